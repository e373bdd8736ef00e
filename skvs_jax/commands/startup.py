"""What the `skvs` commands set up before they run: a persistent XLA compilation cache (on by default) and the
folder their results go to (`output_dir`, made and checked before any work, so a bad --out never costs a run).

Nearly all of a command's start-up is XLA compiling the engine step (one program per query width; docs/serving.md
has the figures). jax can keep compiled programs on disk and load them in later processes; the commands turn that
on in one documented place, chosen in this order:

  1. `--compile-cache DIR` or `--compile-cache off` (the flag of `skvs generate`, `skvs bench`, `skvs simulate`);
  2. the environment variable SKVS_COMPILE_CACHE (a directory, or "off");
  3. jax's own JAX_COMPILATION_CACHE_DIR, if set (left to jax as configured);
  4. DEFAULT_DIR: $XDG_CACHE_HOME/skvs_jax/xla, i.e. ~/.cache/skvs_jax/xla.

Every program is stored, however quickly it compiled (jax's default keeps only those over 1 s; the engine's
small programs add up). What the cache cannot save is tracing and lowering the Python program, which runs in
every process. The test suite points the commands at its own per-run cache (tests/conftest.py), never at home.
"""

from __future__ import annotations

import argparse
import os
import pathlib

ENV = "SKVS_COMPILE_CACHE"
OFF = "off"


def default_dir(environ=os.environ) -> pathlib.Path:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "skvs_jax" / "xla"


DEFAULT_DIR = default_dir()


def add_arguments(parser: argparse.ArgumentParser, *, warmup: bool | None = None) -> None:
    """--compile-cache; and --warmup (default `warmup`) when the command serves a model (None: no flag)."""
    parser.add_argument("--compile-cache", metavar="DIR|off", default=None,
                        help=f"persistent XLA compilation cache (default: ${ENV}, else jax's "
                             f"JAX_COMPILATION_CACHE_DIR, else {DEFAULT_DIR}); 'off' disables it")
    if warmup is not None:
        parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=warmup,
                            help="compile every query width before serving (Engine.warmup); without it only the "
                                 "widths the run uses are compiled, when first used"
                                 + (" (default: on, so no compilation lands in the timed runs)" if warmup else ""))


def resolve(flag: str | None, environ=os.environ) -> str | None:
    """The cache directory the rules above choose (None: off, or left to jax's own setting). Raises ValueError for
    an empty setting."""
    for source, value in (("--compile-cache", flag), (ENV, environ.get(ENV))):
        if value is None:
            continue
        if not value.strip():
            raise ValueError(f"{source} must be a directory or '{OFF}', got an empty string")
        return None if value.strip().lower() == OFF else str(pathlib.Path(value).expanduser().absolute())
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return environ["JAX_COMPILATION_CACHE_DIR"]
    return str(default_dir(environ))


def configure(flag: str | None, environ=os.environ) -> str | None:
    """Point jax's persistent compilation cache where `resolve` says (before anything compiles); returns the
    directory in use, or None when off. Idempotent: a directory already configured is kept as is."""
    import jax

    directory = resolve(flag, environ)
    if directory is None:
        if (flag or environ.get(ENV) or "").strip().lower() == OFF:
            jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    if jax.config.jax_compilation_cache_dir != directory:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", directory)
        compilation_cache.reset_cache()  # a cache opened earlier in this process would keep its old directory
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


def output_dir(path: str, command: str) -> pathlib.Path:
    """`--out PATH` made (with its parents) and checked writable now, before the command's work: a folder that
    cannot be made ends in `SystemExit("skvs <command>: --out PATH: ...")` instead of a traceback after the run,
    with its results lost."""
    out = pathlib.Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SystemExit(f"skvs {command}: --out {path}: cannot create the folder ({err.strerror or err})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise SystemExit(f"skvs {command}: --out {path}: the folder is not writable")
    return out
