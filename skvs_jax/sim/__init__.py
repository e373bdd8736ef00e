"""The trace simulator: the real scheduler driven by a cost model of the GPU instead of a model forward.

* `cost_model`: the time of one engine step of a large model (Llama-3.1-8B, Llama-3-70B, or the shipped tiny
  model) on a device (A100, H100, H200, or a CPU device fitted from the real engine's step times), as jittable
  `jnp` arithmetic: measured kernel times where a profile exists, a roofline elsewhere (`COST_MODES`).
* `specs`: the models and devices it prices (`MODELS`, `DEVICES`), each number with its source.
* `kernel_profiles`: the measured profiles (Vidur's A100 kernels for Llama-3-8B) and the fits made of them.
* `simulate`: the engine's step (`scheduler.add_unchecked` / `schedule_unchecked` / `update_unchecked`, the same
  code) in a `while_loop`, the model replaced by the cost model, a token table and an acceptance table (a chain
  acceptance model, or replayed from the model itself for a greedy run). `start` / `advance` / `finish` are the
  same loop in pieces.
* `acceptance_model`: chain acceptance presets (Medusa's published numbers; the tiny model's measured heads).
* `sweep`: many simulations of one policy in one compiled call (knobs, KV budget, arrival rate, trace as data),
  vmapped or mapped per device, and split over a `dp` mesh axis.
* `calibrate`: fits the `cpu-measured` device and checks fidelity against the engine.
* `fidelity`: the simulator against the engine at a real model's shape (oracle drafter, refit device, out of sample).
* `scenarios`: the named workloads `skvs claims` runs through the simulator (the article's settings, KV-starved
  sweeps, pressure), each a function of its parameters.

The command `skvs simulate` lives with the other commands, in `skvs_jax.commands.simulate`.
"""

from skvs_jax.sim.cost_model import CostModel, StepSample, fit_cpu_device
from skvs_jax.sim.specs import DEVICES, MODELS, DeviceSpec, ModelSpec

# `skvs_jax.sim.simulate` stays a module (its function of the same name is `simulate.simulate`).
__all__ = ["DEVICES", "MODELS", "CostModel", "DeviceSpec", "ModelSpec", "StepSample", "fit_cpu_device"]
