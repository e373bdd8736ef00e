"""Swap a sequence's KV blocks between the device cache and a host tier (NumPy) or a disk tier (numpy.memmap).

This is host-side orchestration around two jitted device programs, kept deliberately simple:

  swap_out: device gather of the sequence's blocks  ->  one device-to-host copy  ->  bytes into tier slots
  swap_in:  bytes out of tier slots  ->  one host-to-device copy  ->  device scatter into the new blocks

`kv_pages` is a tuple of device arrays sharing the leading block axis N: the K and V pages [N, L, S, Hkv, D] of any
real dtype (float32, bfloat16, int8, float8_e4m3fn, ...; not bool or complex) and, for quantised pages, their scales
[N, L, S, Hkv]; any trailing shape works. A tier stores each block of each array as raw bytes (uint8 [capacity,
bytes per block]), so the round trip is bit-identical whatever the dtype (NaN payloads included). Capacity is in
blocks; the tier's free slots are a host-side bitmap. A tier that cannot hold a request returns a handle with
ok=False and moves nothing: failure is data, the scheduler decides (recompute instead, or try the next tier).

`SwapSpace` is what the engine swaps into: a host tier backed by a bounded disk tier, spilling the least recently
swapped-out sequences' blocks to disk when the host is full, and reading them back on swap-in.

Tiers are mutable host objects (they own host memory or a file) and are never traced. Jitted gathers and
scatters are compiled per power-of-two bucket of the block count (padding gathers the null block and scatters
out of range, where it is dropped), so the number of compilations grows with log2 of the largest swap.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import tempfile
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax.config import NULL_BLOCK

HOST, DISK = "host", "disk"


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """Capacities in blocks (0 disables a tier) and the directory that holds the disk tier's files."""

    host_blocks: int
    disk_blocks: int = 0
    disk_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("host_blocks", "disk_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.disk_blocks and self.disk_dir is None:
            raise ValueError("disk_dir must name a directory when disk_blocks > 0")


@dataclasses.dataclass(frozen=True, eq=False)
class SwapHandle:
    """Where a swapped-out sequence lives. slots: int64[X] tier slots of its blocks, in the given block order
    (empty when ok is False); serial identifies the swap, so a handle can be swapped in only once."""

    tier: Tier
    slots: np.ndarray
    ok: bool
    serial: int

    @property
    def num_blocks(self) -> int:
        return int(self.slots.shape[0])


def _layout(kv_pages) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """((per-block shape, dtype), ...) of a kv_pages tuple; raises naming kv_pages if it is malformed."""
    if not isinstance(kv_pages, tuple) or not kv_pages:
        raise TypeError(f"kv_pages must be a non-empty tuple of arrays, got {type(kv_pages).__name__}")
    for i, x in enumerate(kv_pages):
        if not hasattr(x, "shape") or not hasattr(x, "dtype") or len(x.shape) < 1:
            raise TypeError(f"kv_pages[{i}] must be an array with a leading block axis, got {type(x).__name__}")
    n = kv_pages[0].shape[0]
    for i, x in enumerate(kv_pages):
        if x.shape[0] != n:
            raise ValueError(f"kv_pages[{i}] has {x.shape[0]} blocks, kv_pages[0] has {n}")
        real = jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)  # ml_dtypes too
        if not real or np.dtype(x.dtype).itemsize not in _UINT:  # blocks are moved as unsigned-integer bits
            raise TypeError(f"kv_pages[{i}] must have a real numeric dtype, got {x.dtype}")
    return tuple((tuple(x.shape[1:]), np.dtype(x.dtype)) for x in kv_pages)


class Tier:
    """A fixed number of block slots for one kv_pages layout, in host memory or in memory-mapped files."""

    _serials = itertools.count(1)

    def __init__(self, kv_pages, capacity: int, kind: str = HOST, directory: str | None = None):
        self.layout = _layout(kv_pages)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative int, got {capacity!r}")
        if kind not in (HOST, DISK):
            raise ValueError(f"kind must be {HOST!r} or {DISK!r}, got {kind!r}")
        self.kind, self.capacity, self.paths = kind, capacity, []
        self.owner = np.zeros((capacity,), np.int64)  # serial of the swap holding each slot, 0 = free
        self.live: set[int] = set()  # serials of swaps not yet swapped in or released (empty ones included)
        self.storage = []
        for i, (shape, dtype) in enumerate(self.layout):
            row = (max(1, capacity), int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
            if kind == HOST:
                self.storage.append(np.zeros(row, np.uint8))
            else:
                if directory is None or not os.path.isdir(directory):
                    raise ValueError(f"directory must be an existing directory, got {directory!r}")
                fd, path = tempfile.mkstemp(suffix=f"_{i}.bin", prefix="kv_tier_", dir=directory)  # unique name
                os.close(fd)
                self.paths.append(path)
                self.storage.append(np.memmap(path, np.uint8, mode="w+", shape=row))

    @property
    def free_blocks(self) -> int:
        return int(np.sum(self.owner == 0))

    def close(self) -> None:
        """Drop the storage; a disk tier deletes its files. Live handles become invalid."""
        self.storage = []
        self.owner[:] = -1
        self.live.clear()
        for path in self.paths:
            if os.path.exists(path):
                os.remove(path)


def make_tiers(kv_pages, cfg: TierConfig) -> tuple[Tier, Tier | None]:
    """The host tier and (when cfg.disk_blocks > 0) the disk tier for this kv_pages layout."""
    host = Tier(kv_pages, cfg.host_blocks, HOST)
    disk = Tier(kv_pages, cfg.disk_blocks, DISK, cfg.disk_dir) if cfg.disk_blocks else None
    return host, disk


# ------------------------------------------------------------------------------------- device programs


def _bucket(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _bits(x: jax.Array) -> jax.Array:
    """The same bits as an unsigned integer array. Blocks are moved as bits because XLA:CPU scatters bfloat16
    through float32, which quiets NaN payloads; an integer move is exact on every backend."""
    return jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])


@jax.jit
def _gather(kv_pages: tuple, ids: jax.Array) -> tuple:
    """ids: int32[X'] -> tuple of [X', ...] blocks, as unsigned-integer bits."""
    return tuple(_bits(pages)[ids] for pages in kv_pages)


@jax.jit
def _scatter(kv_pages: tuple, ids: jax.Array, blocks: tuple) -> tuple:
    """Write blocks[i] ([X', ...] bits) to block ids[i]; ids >= N are dropped (padding)."""
    return tuple(
        jax.lax.bitcast_convert_type(_bits(pages).at[ids].set(new, mode="drop"), pages.dtype)
        for pages, new in zip(kv_pages, blocks)
    )


def _check_ids(name: str, ids, n: int) -> np.ndarray:
    if not hasattr(ids, "shape") or not hasattr(ids, "dtype") or len(ids.shape) != 1:
        raise ValueError(f"{name} must be a 1-D integer array, got {getattr(ids, 'shape', type(ids).__name__)}")
    if np.dtype(ids.dtype).kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")
    ids = np.asarray(ids, np.int64)  # host orchestration: block ids are concrete
    if ids.size and (ids.min() < 1 or ids.max() >= n):
        raise ValueError(f"{name} must lie in [1, {n - 1}] (block 0 is the null block), got {ids.tolist()}")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"{name} must be distinct blocks, got {ids.tolist()}")
    return ids


# ---------------------------------------------------------------------------------------------- swaps


def swap_out(kv_pages: tuple, block_ids, tier: Tier) -> SwapHandle:
    """Copy blocks block_ids (int[X], a sequence's blocks in table order) from the device into `tier`.

    Returns a handle; handle.ok is False (and nothing is copied) when the tier has fewer than X free slots.
    The device blocks are left as they are: the caller frees them in the allocator afterwards.
    """
    if not isinstance(tier, Tier) or not tier.storage:
        raise TypeError(f"tier must be an open Tier, got {type(tier).__name__}")
    if _layout(kv_pages) != tier.layout:
        raise ValueError(f"kv_pages layout {_layout(kv_pages)} does not match the tier's {tier.layout}")
    ids = _check_ids("block_ids", block_ids, kv_pages[0].shape[0])
    free = np.flatnonzero(tier.owner == 0)
    serial = next(Tier._serials)
    if free.size < ids.size:
        return SwapHandle(tier=tier, slots=np.zeros((0,), np.int64), ok=False, serial=serial)
    slots = free[: ids.size]
    if ids.size:
        padded = np.full((_bucket(ids.size),), NULL_BLOCK, np.int32)
        padded[: ids.size] = ids
        blocks = jax.device_get(_gather(kv_pages, jnp.asarray(padded)))
        for store, data in zip(tier.storage, blocks):  # a handful of arrays (K, V, scales), not blocks
            store[slots] = np.ascontiguousarray(data[: ids.size]).view(np.uint8).reshape(ids.size, -1)
    tier.owner[slots] = serial
    tier.live.add(serial)
    return SwapHandle(tier=tier, slots=slots, ok=True, serial=serial)


def _check_handle(handle) -> None:
    if not isinstance(handle, SwapHandle):
        raise TypeError(f"handle must be a SwapHandle, got {type(handle).__name__}")
    if not handle.ok:
        raise ValueError("handle is a failed swap (ok=False): there is nothing to swap in")
    if not handle.tier.storage:
        raise ValueError("handle's tier was closed")
    if handle.serial not in handle.tier.live:  # a swap of zero blocks owns no slot, so the set, not `owner`, says
        raise ValueError("handle was already swapped in or released")


def swap_in(kv_pages: tuple, handle: SwapHandle, dst_block_ids) -> tuple:
    """Copy a swapped-out sequence into device blocks dst_block_ids (int[X], usually freshly allocated), and
    free its tier slots. Returns the new kv_pages; the blocks are bit-identical to those swapped out."""
    _check_handle(handle)
    tier = handle.tier
    if _layout(kv_pages) != tier.layout:
        raise ValueError(f"kv_pages layout {_layout(kv_pages)} does not match the tier's {tier.layout}")
    dst = _check_ids("dst_block_ids", dst_block_ids, kv_pages[0].shape[0])
    if dst.size != handle.num_blocks:
        raise ValueError(f"dst_block_ids has {dst.size} blocks, the handle holds {handle.num_blocks}")
    x = dst.size
    if x:
        size = _bucket(x)
        padded = np.full((size,), kv_pages[0].shape[0], np.int32)  # out of range: dropped by the scatter
        padded[:x] = dst
        blocks = []
        for store, (shape, dtype) in zip(tier.storage, tier.layout):
            data = np.zeros((size, store.shape[1]), np.uint8)
            data[:x] = store[handle.slots]
            blocks.append(jnp.asarray(data.view(_UINT[dtype.itemsize]).reshape((size,) + shape)))
        kv_pages = _scatter(kv_pages, jnp.asarray(padded), tuple(blocks))
    tier.owner[handle.slots] = 0
    tier.live.discard(handle.serial)
    return kv_pages


def release(handle: SwapHandle) -> None:
    """Free a swapped-out sequence's tier slots without swapping it in (it finished or was aborted)."""
    _check_handle(handle)
    handle.tier.owner[handle.slots] = 0
    handle.tier.live.discard(handle.serial)


# ------------------------------------------------------------------------------- host tier backed by a disk tier


@dataclasses.dataclass(eq=False)
class TieredHandle:
    """Where a sequence swapped into a `SwapSpace` lives: parts[i] = (index of its first block in the sequence's
    block order, the `SwapHandle` of that run of blocks), in block order; a spill can leave a sequence split over
    the host and the disk tier. ok is False (and parts empty) when the swap was refused."""

    parts: list[tuple[int, SwapHandle]]
    num_blocks: int
    ok: bool


class SwapSpace:
    """A host tier of `host_blocks` backed by a disk tier of `disk_blocks` (0: none): what the engine swaps into.

    `swap_out` puts a sequence in the host tier. When the host lacks room, blocks of the least recently swapped-out
    sequences move to the disk tier first (their last blocks first, so a sequence may end up split over both
    tiers), as many as the disk takes; whatever still does not fit the host (a sequence larger than the host's free
    room after the spill) goes to disk directly. A swap is refused (ok False, nothing moved) only when the two
    tiers together have fewer free slots than it needs, so a scheduler that counts host + disk blocks is never
    refused. `swap_in` reads each part back from its tier. Every move is of raw bytes: bit-identical.

    disk_dir: the directory of the disk tier's files (None: a fresh temporary directory, removed by `close`).
    Counters: spilled_blocks (moved host -> disk), disk_in_blocks (swapped in from disk), disk_out_blocks
    (swapped out straight to disk).
    """

    def __init__(self, kv_pages, host_blocks: int, disk_blocks: int = 0, disk_dir: str | None = None):
        for name, value in (("host_blocks", host_blocks), ("disk_blocks", disk_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if disk_dir is not None and not os.path.isdir(disk_dir):
            raise ValueError(f"disk_dir must be an existing directory, got {disk_dir!r}")
        self._tmp = tempfile.mkdtemp(prefix="skvs_kv_disk_") if disk_blocks and disk_dir is None else None
        self.host = Tier(kv_pages, host_blocks, HOST)
        self.disk = Tier(kv_pages, disk_blocks, DISK, disk_dir or self._tmp) if disk_blocks else None
        self._order: dict[int, TieredHandle] = {}  # id -> handle of every live swap, least recently swapped first
        self.spilled_blocks = self.disk_in_blocks = self.disk_out_blocks = 0
        # An engine that is dropped without `close` must not leave its disk files (or its temporary directory).
        self._cleanup = weakref.finalize(self, _remove, list(self.disk.paths) if self.disk else [], self._tmp)

    @property
    def capacity(self) -> int:
        return self.host.capacity + (self.disk.capacity if self.disk else 0)

    @property
    def free_blocks(self) -> int:
        return self.host.free_blocks + (self.disk.free_blocks if self.disk else 0)

    def _move_tail(self, handle: SwapHandle, count: int, dst: Tier) -> tuple[SwapHandle | None, SwapHandle]:
        """Move the last `count` blocks of `handle` into `dst` (which has room). Returns (the blocks left behind,
        or None when all moved; the moved ones)."""
        src = handle.tier
        keep, moved = handle.slots[: handle.num_blocks - count], handle.slots[handle.num_blocks - count:]
        slots = np.flatnonzero(dst.owner == 0)[:count]
        for s_store, d_store in zip(src.storage, dst.storage):
            d_store[slots] = s_store[moved]
        serial = next(Tier._serials)
        dst.owner[slots] = serial
        dst.live.add(serial)
        src.owner[moved] = 0
        if not keep.size:
            src.live.discard(handle.serial)
        left = SwapHandle(tier=src, slots=keep, ok=True, serial=handle.serial) if keep.size else None
        return left, SwapHandle(tier=dst, slots=slots, ok=True, serial=serial)

    def _spill(self, need: int) -> None:
        """Move up to `need` host blocks to disk, least recently swapped sequences first, their tails first."""
        for entry in list(self._order.values()):
            if need <= 0 or not self.disk.free_blocks:
                return
            parts = []
            for start, part in entry.parts:
                count = min(need, part.num_blocks, self.disk.free_blocks) if part.tier is self.host else 0
                if not count:
                    parts.append((start, part))
                    continue
                left, moved = self._move_tail(part, count, self.disk)
                parts += ([(start, left)] if left else []) + [(start + part.num_blocks - count, moved)]
                need -= count
                self.spilled_blocks += count
            entry.parts = parts

    def swap_out(self, kv_pages: tuple, block_ids) -> TieredHandle:
        """Copy a sequence's blocks block_ids (int[X], in table order) out of the device (see the class)."""
        ids = _check_ids("block_ids", block_ids, kv_pages[0].shape[0])
        x = int(ids.size)
        if self.free_blocks < x:
            return TieredHandle(parts=[], num_blocks=0, ok=False)
        if self.host.free_blocks < x and self.disk is not None:
            self._spill(x - self.host.free_blocks)
        on_host = min(x, self.host.free_blocks)
        parts = [(0, swap_out(kv_pages, ids[:on_host], self.host))]
        if on_host < x:
            parts.append((on_host, swap_out(kv_pages, ids[on_host:], self.disk)))
            self.disk_out_blocks += x - on_host
        handle = TieredHandle(parts=parts, num_blocks=x, ok=True)
        self._order[id(handle)] = handle
        return handle

    def _take(self, handle: TieredHandle) -> None:
        if not isinstance(handle, TieredHandle):
            raise TypeError(f"handle must be a TieredHandle, got {type(handle).__name__}")
        if not handle.ok:
            raise ValueError("handle is a failed swap (ok=False): there is nothing to swap in")
        if self._order.pop(id(handle), None) is None:
            raise ValueError("handle was already swapped in or released")

    def swap_in(self, kv_pages: tuple, handle: TieredHandle, dst_block_ids) -> tuple:
        """Copy a swapped-out sequence into device blocks dst_block_ids (int[X]) from wherever its parts are, and
        free its slots. Returns the new kv_pages."""
        dst = _check_ids("dst_block_ids", dst_block_ids, kv_pages[0].shape[0])
        if dst.size != handle.num_blocks:
            raise ValueError(f"dst_block_ids has {dst.size} blocks, the handle holds {handle.num_blocks}")
        self._take(handle)
        for start, part in handle.parts:
            kv_pages = swap_in(kv_pages, part, dst[start: start + part.num_blocks])
            if part.tier is self.disk:
                self.disk_in_blocks += part.num_blocks
        return kv_pages

    def release(self, handle: TieredHandle) -> None:
        """Free a swapped-out sequence's slots without swapping it in (it was aborted)."""
        self._take(handle)
        for _, part in handle.parts:
            release(part)

    def close(self) -> None:
        """Drop both tiers (the disk tier's files, and the temporary directory if this object made it)."""
        self.host.close()
        if self.disk is not None:
            self.disk.close()
        self._cleanup()
        self._order.clear()


def _remove(paths: list[str], directory: str | None) -> None:
    for path in paths:
        if os.path.exists(path):
            os.remove(path)
    if directory is not None and os.path.isdir(directory):
        os.rmdir(directory)
