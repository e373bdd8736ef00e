"""What the `skvs` commands set up before they run: the persistent XLA compilation cache (on by default; the rules
are `skvs_jax.compile_cache`'s) and the folder their results go to (`output_dir`, made and checked before any
work, so a bad --out never costs a run). The test suite points the commands at its own per-run cache
(tests/conftest.py), never at home.
"""

from __future__ import annotations

import argparse
import os
import pathlib

from skvs_jax.compile_cache import DEFAULT_DIR, ENV, OFF, configure, default_dir, resolve

__all__ = ["DEFAULT_DIR", "ENV", "OFF", "add_arguments", "configure", "default_dir", "output_dir", "resolve"]


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
