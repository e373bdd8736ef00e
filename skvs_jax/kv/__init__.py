"""The KV layer: where blocks live and what they hold. Knows nothing of models or requests.

  allocator      the block pool and per-sequence block tables: pure jitted transitions over a pytree
  prefix_cache   a hash chain over full, validated blocks in a fixed-size table, with the speculative barrier
  manager        the one facade the scheduler talks to: keeps the allocator and the prefix index consistent
  tiers          host and disk tiers that swapped-out blocks are copied to
"""
