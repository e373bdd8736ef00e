"""Strict test configuration shared by every test module.

Hypothesis profiles: "ci" (default; deterministic and modest) and "heavy" (many more examples). Choose with
the environment variable SKVS_HYPOTHESIS_PROFILE, e.g. `SKVS_HYPOTHESIS_PROFILE=heavy pytest`.
"""

import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# The suite compiles a few hundred programs and runs each briefly, so compilation dominates its time: with XLA:CPU's
# backend optimisations off it runs ~25-40% faster (measured: tests/test_engine.py's policy tests 108 s -> 83 s,
# the simulator tests' CPU time 100 s -> 62 s). XLA:CPU's MLIR fusion emitters are slow to compile the scheduler's
# many small scatters and gathers: off, its `schedule` compiles in 4.4 s instead of 8.1 s and an engine run
# (three widths) in 58 s instead of 69 s (jaxlib 0.10.2, 2026-12-03); a newer jaxlib may not know that flag, so it
# is kept only if a jax started with it runs (one subprocess, once per run: the workers inherit the result).
# Semantics are unchanged; every comparison in the suite is between programs compiled the same way, or with a
# tolerance. Benchmarks and the CLI keep XLA's defaults. Set SKVS_TEST_XLA_DEFAULTS=1 to test with the defaults.
# Must happen before jax starts its backend.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_IF_KNOWN = ("--xla_cpu_use_fusion_emitters=false",)


def _fast_compile_flags() -> str:
    if "SKVS_TEST_XLA_FLAGS" in os.environ:  # set by the pytest process that started this one
        return os.environ["SKVS_TEST_XLA_FLAGS"]
    flags = list(_FAST_COMPILE)
    for flag in _IF_KNOWN:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                               env=dict(os.environ, XLA_FLAGS=" ".join((*flags, flag)), JAX_PLATFORMS="cpu"),
                               capture_output=True, timeout=300)
        if probe.returncode == 0:
            flags.append(flag)
    os.environ["SKVS_TEST_XLA_FLAGS"] = " ".join(flags)
    return os.environ["SKVS_TEST_XLA_FLAGS"]


if os.environ.get("SKVS_TEST_XLA_DEFAULTS"):
    os.environ["SKVS_TEST_XLA_FLAGS"] = ""  # what the suite's own subprocesses add to XLA_FLAGS: nothing
else:
    _flags = _fast_compile_flags()
    if _flags not in os.environ.get("XLA_FLAGS", ""):  # an xdist worker inherits its controller's XLA_FLAGS
        os.environ["XLA_FLAGS"] = " ".join(filter(None, (os.environ.get("XLA_FLAGS"), _flags)))

# A compilation cache on disk, one per test process (jax writes entries in place, so two processes must not share
# one; the subprocesses a test starts inherit it and write while their parent waits). Tests recompile what they
# share after `_drop_compile_caches` below, and a jit that lowers to a program compiled earlier in the run (another
# wrapper, another engine) reads it instead of compiling. Measured once each, `pytest -n 2` here: 16 min 55 s ->
# 14 min 53 s; the tests that recompile gain most (sampled drafts 53 s -> 9 s, the engine replay fixture 61 s ->
# 25 s). It lives for the run, so every run starts empty, as CI does. SKVS_TEST_XLA_CACHE=0 turns it off; a
# directory keeps it there between runs (a subdirectory per xdist worker).
_CACHE = os.environ.get("SKVS_TEST_XLA_CACHE")
if _CACHE != "0":
    if _CACHE:
        _CACHE = os.path.join(os.path.abspath(_CACHE), os.environ.get("PYTEST_XDIST_WORKER", "main"))
    else:
        _CACHE = tempfile.mkdtemp(prefix="skvs-test-xla-")
        atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# The `skvs` commands the CLI tests run in this process use the same cache (or none): never ~/.cache/skvs_jax/xla,
# their default (skvs_jax/commands/startup.py).
os.environ["SKVS_COMPILE_CACHE"] = "off" if _CACHE == "0" else _CACHE

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=30,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "heavy",
    deadline=None,
    max_examples=1000,
    stateful_step_count=100,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("SKVS_HYPOTHESIS_PROFILE", "ci"))


# Every compiled XLA:CPU executable holds memory mappings until its cache entry dies (a small scheduler program
# ~100; an engine step program ~2,000: one skvs engine's four widths, warmed up, add ~8,500), and Linux caps a
# process at vm.max_map_count (65,530 by default): past it, LLVM's next mmap fails and the compiler segfaults.
# The suite compiles a few hundred programs, so drop the caches whenever the count gets high. Costs a recompile
# of what later tests share; only triggers when needed.
_MAPS = "/proc/self/maps"
_MAX_MAPS = 45_000  # leaves ~20,000 (two engines) for the next test
# Tests marked `many_programs` compile more than that (`skvs bench --ablation` with real engines, a slow test:
# four engines, ~35,000): they start from an empty cache. A worker that came to that test with a high count
# crashed in the compiler.
_MAX_MAPS_BEFORE_MANY = 10_000


def _maps() -> int:
    if not os.path.exists(_MAPS):
        return 0
    with open(_MAPS) as f:
        return sum(1 for _ in f)


def _drop_compile_caches() -> None:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _bounded_compile_cache(request):
    if request.node.get_closest_marker("many_programs") and _maps() > _MAX_MAPS_BEFORE_MANY:
        _drop_compile_caches()
    yield
    if _maps() > _MAX_MAPS:
        _drop_compile_caches()


# The heaviest test files first (worker-seconds measured in CI, 2026-11-30: ~330, ~310, ~280, ~190, ~125), so
# that with `--dist loadfile --no-loadscope-reorder` the two workers finish together. xdist's own reorder sorts
# files by their number of tests, which put test_distributed (6 tests, one of ~125 s) last, alone on one worker.
_HEAVIEST_FIRST = ("test_engine.py", "test_engine_dispatch_features.py", "test_scheduler.py", "test_speculation.py",
                   "test_engine_dispatch.py", "test_cli.py", "test_distributed.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


@pytest.fixture(scope="session")
def shipped():
    """The shipped tiny Llama and its Medusa heads (read-only: tests split them, never mutate them)."""
    from reference_models import checkpoint, train

    return (checkpoint.load_llama(train.WEIGHTS_DIR / "tiny_llama"),
            checkpoint.load_medusa(train.WEIGHTS_DIR / "tiny_llama_medusa"))


@pytest.fixture(scope="module")
def one_step(request, shipped, tmp_path_factory):
    """The one-step engine's (steps_per_dispatch=1) run of a feature, served once per module: get(name) calls the
    test module's `_serve(shipped, name, trace, 1, tmp_path)` with its `trace` fixture (tests/test_engine_dispatch*)."""
    runs = {}

    def get(name):
        if name not in runs:
            trace = request.getfixturevalue("trace")
            runs[name] = request.module._serve(shipped, name, trace, 1, tmp_path_factory.mktemp(name))
        return runs[name]

    return get
