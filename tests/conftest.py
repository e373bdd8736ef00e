"""Strict test configuration shared by every test module.

Hypothesis profiles: "ci" (default; deterministic and modest) and "heavy" (many more examples). Choose with
the environment variable SKVS_HYPOTHESIS_PROFILE, e.g. `SKVS_HYPOTHESIS_PROFILE=heavy pytest`.
"""

import os

import jax
from hypothesis import HealthCheck, settings

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
