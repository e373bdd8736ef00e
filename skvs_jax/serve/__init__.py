"""Serving a real model: the engine drives the scheduler and a model through one jitted step.

  engine        `Engine`: requests in, tokens out; the host loop around one jitted step
  engine_step   the jitted step itself, as named phases (schedule, drafts, forward, verify, update)
  model_runner  the protocol the engine reaches models through, and the tiny Llama + Medusa runner
  speculation   draft trees, verification over a tree, the accepted path's KV move
  acceptance    the acceptance rules (greedy, typical, lossless rejection sampling) and a chi-square test
"""
