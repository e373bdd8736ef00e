"""Tiny Llama and Medusa heads in Flax NNX (built in a later issue)."""
