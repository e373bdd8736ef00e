"""The persistent XLA compilation cache, configured in one place for the `skvs` commands and `skvs_jax.LLM`.

Nearly all of an engine's start-up is XLA compiling its step (one program per query width; docs/serving.md has the
figures). jax can keep compiled programs on disk and load them in later processes; the directory is chosen in
this order:

  1. an explicit setting (`--compile-cache DIR|off` of the commands; `LLM(compile_cache=DIR|False)`);
  2. the environment variable SKVS_COMPILE_CACHE (a directory, or "off");
  3. jax's own JAX_COMPILATION_CACHE_DIR, if set (left to jax as configured);
  4. DEFAULT_DIR: $XDG_CACHE_HOME/skvs_jax/xla, i.e. ~/.cache/skvs_jax/xla.

Every program is stored, however quickly it compiled (jax's default keeps only those over 1 s; the engine's
small programs add up). What the cache cannot save is tracing and lowering the Python program, which runs in
every process. Importing skvs_jax configures nothing; `LLM` never replaces a directory already set in jax's
config (`use_default`).
"""

from __future__ import annotations

import os
import pathlib

ENV = "SKVS_COMPILE_CACHE"
OFF = "off"


def default_dir(environ=os.environ) -> pathlib.Path:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "skvs_jax" / "xla"


DEFAULT_DIR = default_dir()


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



def use_default(environ=os.environ) -> str | None:
    """What `skvs_jax.LLM` does by default: keep a cache directory the user already set in jax's config, else
    `configure(None)` (SKVS_COMPILE_CACHE, JAX_COMPILATION_CACHE_DIR, DEFAULT_DIR). Returns the directory in use."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    return configure(None, environ)
