"""Host and disk tiers: a sequence swapped out and back is bit-identical, for every KV dtype; full tiers fail
as data; handles are used once; bad input raises naming the argument."""

import tempfile

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as hs

from skvs_jax.kv import tiers

N, S, HKV, D = 12, 4, 2, 8
# One fixed page geometry per dtype, so the gathers and scatters compile once per (dtype, size bucket).
DTYPES = {"float32": np.uint32, "bfloat16": np.uint16, "int8": np.uint8}


def random_pages(dtype: str, seed: int) -> tuple:
    """K and V pages with random *bits* (NaNs with payloads included); int8 pages come with f32 scales."""
    rng = np.random.default_rng(seed)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "int8": np.int8}[dtype]
    bits = DTYPES[dtype]

    def draw(shape, dt, raw):
        return jnp.asarray(rng.integers(0, np.iinfo(raw).max, shape, dtype=raw, endpoint=True).view(dt))

    pages = tuple(draw((N, S, HKV, D), np_dtype, bits) for _ in range(2))
    if dtype == "int8":
        pages += tuple(draw((N, S, HKV), np.float32, np.uint32) for _ in range(2))
    return pages


def as_bytes(pages, ids) -> list[bytes]:
    return [np.asarray(p)[np.asarray(ids)].tobytes() for p in pages]


@given(
    dtype=hs.sampled_from(sorted(DTYPES)),
    kind=hs.sampled_from([tiers.HOST, tiers.DISK]),
    seed=hs.integers(0, 2**32 - 1),
    data=hs.data(),
)
def test_swap_out_and_in_is_bit_identical(dtype, kind, seed, data):
    pages = random_pages(dtype, seed)
    src = data.draw(hs.lists(hs.integers(1, N - 1), min_size=1, max_size=6, unique=True))
    dst = data.draw(hs.lists(hs.integers(1, N - 1), min_size=len(src), max_size=len(src), unique=True))
    with tempfile.TemporaryDirectory() as directory:
        tier = tiers.Tier(pages, 8, kind, directory)
        other = tiers.swap_out(pages, np.asarray([1], np.int32), tier)  # someone else's blocks in the tier
        handle = tiers.swap_out(pages, np.asarray(src, np.int32), tier)
        assert handle.ok and handle.num_blocks == len(src) and tier.free_blocks == 8 - 1 - len(src)
        # The device blocks are reused for other content meanwhile.
        poisoned = tuple(p.at[np.asarray(src)].set(jnp.zeros((), p.dtype)) for p in pages)
        back = tiers.swap_in(poisoned, handle, np.asarray(dst, np.int32))
        assert as_bytes(back, dst) == as_bytes(pages, src), "swapped-in blocks must be bit-identical"
        rest = [i for i in range(N) if i not in dst]
        assert as_bytes(back, rest) == as_bytes(poisoned, rest), "other blocks must be untouched"
        assert tier.free_blocks == 7
        again = tiers.swap_in(back, other, np.asarray([2], np.int32))
        assert as_bytes(again, [2]) == as_bytes(pages, [1]) and tier.free_blocks == 8
        tier.close()


def test_fp8_pages_with_scales_round_trip():
    rng = np.random.default_rng(0)
    pages = tuple(jnp.asarray(rng.integers(0, 256, (N, S, HKV, D), np.uint8).view(ml_dtypes.float8_e4m3fn))
                  for _ in range(2))
    pages += tuple(jnp.asarray(rng.standard_normal((N, S, HKV), np.float32)) for _ in range(2))
    host, _ = tiers.make_tiers(pages, tiers.TierConfig(host_blocks=4))
    handle = tiers.swap_out(pages, np.asarray([3, 5, 7], np.int32), host)
    back = tiers.swap_in(pages, handle, np.asarray([9, 10, 11], np.int32))
    assert as_bytes(back, [9, 10, 11]) == as_bytes(pages, [3, 5, 7])


def test_a_full_tier_fails_as_data_and_handles_are_used_once():
    pages = random_pages("float32", 1)
    with tempfile.TemporaryDirectory() as directory:
        host, disk = tiers.make_tiers(pages, tiers.TierConfig(host_blocks=3, disk_blocks=5, disk_dir=directory))
        full = tiers.swap_out(pages, np.asarray([1, 2, 3, 4], np.int32), host)
        assert not full.ok and full.num_blocks == 0 and host.free_blocks == 3
        with pytest.raises(ValueError, match="failed swap"):
            tiers.swap_in(pages, full, np.asarray([1, 2, 3, 4], np.int32))
        handle = tiers.swap_out(pages, np.asarray([1, 2, 3, 4], np.int32), disk)  # the next tier has room
        assert handle.ok and disk.free_blocks == 1
        pages2 = tiers.swap_in(pages, handle, np.asarray([5, 6, 7, 8], np.int32))
        assert as_bytes(pages2, [5, 6, 7, 8]) == as_bytes(pages, [1, 2, 3, 4])
        with pytest.raises(ValueError, match="already swapped in"):
            tiers.swap_in(pages, handle, np.asarray([5, 6, 7, 8], np.int32))
        kept = tiers.swap_out(pages, np.asarray([1, 2, 3], np.int32), host)
        assert host.free_blocks == 0
        tiers.release(kept)
        assert host.free_blocks == 3
        with pytest.raises(ValueError, match="already swapped in or released"):
            tiers.release(kept)
        empty = tiers.swap_out(pages, np.zeros((0,), np.int32), host)  # owns no slot, and is still used once
        assert empty.ok and empty.num_blocks == 0
        tiers.swap_in(pages, empty, np.zeros((0,), np.int32))
        with pytest.raises(ValueError, match="already swapped in or released"):
            tiers.swap_in(pages, empty, np.zeros((0,), np.int32))
        with pytest.raises(ValueError, match="already swapped in or released"):
            tiers.release(empty)
        live = tiers.swap_out(pages, np.asarray([1], np.int32), disk)
        disk.close()
        with pytest.raises(ValueError, match="tier was closed"):
            tiers.swap_in(pages, live, np.asarray([1], np.int32))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda p, t: tiers.swap_out(list(p), np.asarray([1], np.int32), t), TypeError, "kv_pages"),
        (lambda p, t: tiers.swap_out((p[0], p[1][:3]), np.asarray([1], np.int32), t), ValueError, "kv_pages"),
        (lambda p, t: tiers.swap_out((p[0],), np.asarray([1], np.int32), t), ValueError, "kv_pages"),
        (lambda p, t: tiers.swap_out(p, np.asarray([0], np.int32), t), ValueError, "block_ids"),
        (lambda p, t: tiers.swap_out(p, np.asarray([N], np.int32), t), ValueError, "block_ids"),
        (lambda p, t: tiers.swap_out(p, np.asarray([1.0]), t), TypeError, "block_ids"),
        (lambda p, t: tiers.swap_out(p, np.asarray([[1]], np.int32), t), ValueError, "block_ids"),
        (lambda p, t: tiers.swap_out(p, np.asarray([2, 2], np.int32), t), ValueError, "block_ids must be distinct"),
        (lambda p, t: tiers.swap_out(p, np.asarray([1], np.int32), None), TypeError, "tier"),
        (lambda p, t: tiers.swap_in(p, None, np.asarray([1], np.int32)), TypeError, "handle"),
        (lambda p, t: tiers.swap_in(p, tiers.swap_out(p, np.asarray([1], np.int32), t), np.asarray([1, 2], np.int32)),
         ValueError, "dst_block_ids"),
        (lambda p, t: tiers.swap_in(p, tiers.swap_out(p, np.asarray([1, 2], np.int32), t),
                                    np.asarray([3, 3], np.int32)), ValueError, "dst_block_ids must be distinct"),
        (lambda p, t: tiers.Tier(p, -1), ValueError, "capacity"),
        (lambda p, t: tiers.Tier(p, 2, tiers.DISK, "/nonexistent/dir"), ValueError, "directory"),
        (lambda p, t: tiers.TierConfig(host_blocks=1, disk_blocks=2), ValueError, "disk_dir"),
        (lambda p, t: tiers.TierConfig(host_blocks=1.5), TypeError, "host_blocks"),
        (lambda p, t: tiers.Tier((p[0], jnp.zeros(p[1].shape[:1], bool)), 2), TypeError,
         "kv_pages\\[1\\] must have a real"),
        (lambda p, t: tiers.Tier((p[0].astype(jnp.complex64),), 2), TypeError, "kv_pages\\[0\\] must have a real"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(call, error, match):
    pages = random_pages("float32", 2)
    with pytest.raises(error, match=match):
        call(pages, tiers.Tier(pages, 4))


# ------------------------------------------------------------------- SwapSpace: a host tier spilling to disk


@given(ops=hs.lists(hs.tuples(hs.sampled_from(["out", "in", "release"]), hs.integers(1, 6), hs.integers(0, 9)),
                    min_size=1, max_size=12),
       host=hs.integers(0, 5), disk=hs.integers(0, 8))
def test_a_swap_space_spills_least_recently_swapped_first_and_every_swap_comes_back_bit_identical(ops, host, disk):
    """Against a model: a swap is refused exactly when host + disk lack room; it goes to the host after the least
    recently swapped sequences' blocks moved to disk; a swapped-in sequence is bit-identical; slots add up."""
    pages = random_pages("bfloat16", 3)
    space = tiers.SwapSpace(pages, host, disk)
    live = []  # (handle, source block ids), least recently swapped first
    for kind, size, pick in ops:
        if kind == "out":
            ids = np.arange(1, 1 + size, dtype=np.int32)
            before_host = [sum(p.num_blocks for _, p in h.parts if p.tier is space.host) for h, _ in live]
            handle = space.swap_out(pages, ids)
            used = sum(h.num_blocks for h, _ in live)
            assert handle.ok == (used + size <= host + disk)
            if not handle.ok:
                assert handle.parts == [] and space.free_blocks == host + disk - used
                continue
            after_host = [sum(p.num_blocks for _, p in h.parts if p.tier is space.host) for h, _ in live]
            moved = [b - a for b, a in zip(before_host, after_host)]
            # Least recently swapped first: a sequence lost host blocks only if every older one has none left.
            for i, m in enumerate(moved):
                if m:
                    assert all(a == 0 for a in after_host[:i])
            on_host = sum(p.num_blocks for _, p in handle.parts if p.tier is space.host)
            assert on_host == min(size, host - sum(after_host))
            assert [s for s, _ in handle.parts] == sorted(s for s, _ in handle.parts)
            live.append((handle, ids))
        elif live:
            handle, ids = live.pop(pick % len(live))
            if kind == "in":
                dst = np.arange(N - handle.num_blocks, N, dtype=np.int32)
                poisoned = tuple(p.at[dst].set(jnp.zeros((), p.dtype)) for p in pages)
                back = space.swap_in(poisoned, handle, dst)
                assert as_bytes(back, dst) == as_bytes(pages, ids)
            else:
                space.release(handle)
            with pytest.raises(ValueError, match="already swapped in or released"):
                space.release(handle)
        assert space.free_blocks == host + disk - sum(h.num_blocks for h, _ in live)
        assert space.host.free_blocks + (space.disk.free_blocks if space.disk else 0) == space.free_blocks
    space.close()


def test_a_swap_space_without_a_directory_uses_a_temporary_one_and_removes_it():
    import os

    pages = random_pages("float32", 4)
    space = tiers.SwapSpace(pages, 2, 4)
    directory = os.path.dirname(space.disk.paths[0])
    first = space.swap_out(pages, np.asarray([1, 2], np.int32))
    second = space.swap_out(pages, np.asarray([3, 4, 5], np.int32))  # the host holds 2: `first` spills to disk
    assert space.spilled_blocks == 2 and [p.tier for _, p in first.parts] == [space.disk]
    assert [(s, p.tier.kind, p.num_blocks) for s, p in second.parts] == [(0, tiers.HOST, 2), (2, tiers.DISK, 1)]
    assert not space.swap_out(pages, np.asarray([6, 7], np.int32)).ok  # 1 slot left of 6
    back = space.swap_in(pages, first, np.asarray([8, 9], np.int32))
    assert as_bytes(back, [8, 9]) == as_bytes(pages, [1, 2]) and space.disk_in_blocks == 2
    with pytest.raises(ValueError, match="dst_block_ids has"):
        space.swap_in(pages, second, np.asarray([8], np.int32))
    with pytest.raises(ValueError, match="disk_blocks"):
        tiers.SwapSpace(pages, 1, -1)
    with pytest.raises(ValueError, match="disk_dir"):
        tiers.SwapSpace(pages, 1, 1, "/nonexistent/dir")
    space.close()
    assert not os.path.exists(directory)
