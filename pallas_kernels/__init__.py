"""Pallas kernels for paged attention and speculative block-state updates, each with a pure-jnp reference."""
