"""Tiny Llama and Medusa heads in Flax NNX, with a Hugging Face checkpoint loader, a CPU trainer and shipped weights.

Dimension names are the project's (`skvs_jax/__init__.py`): B sequences, T tokens in one forward call, Hq / Hkv
heads, D head dim, L layers, V vocabulary; and Dm the model width. Other dimensions are words (`heads` for the
Medusa heads, `paths` and `depth` for a draft tree, `prompt_len`).

Modules (each reads top to bottom):
  llama       LlamaConfig, Llama (dense forward; paged prefill / multi-query on `pallas_kernels`), KVCache
  medusa      MedusaConfig, MedusaHeads (Medusa-1: residual SiLU block + own LM head per head)
  checkpoint  load/save in the HF Llama and the FasterDecoding / vLLM Medusa safetensors layouts, in the
              checkpoint's dtype or a chosen one; `load_shipped`
  generate    greedy decoding (dense reference, paged) and Medusa chain verification
  medusa_tree Medusa tree verification (DraftTree, tree mask, K/V compaction of the accepted path)
  corpus      the shipped training text (CPython stdlib docstrings, PSF licence)
  train       `python -m reference_models.train`: trains the shipped weights in `weights/` (docs/models.md)
"""

from reference_models.checkpoint import load_llama, load_medusa, load_shipped, save_llama, save_medusa
from reference_models.generate import accepted_prefix_len, greedy_generate, greedy_reference, medusa_generate
from reference_models.llama import KVCache, Llama, LlamaConfig, RopeScaling
from reference_models.medusa import MedusaConfig, MedusaHeads
from reference_models.medusa_tree import SMALL_TREE, DraftTree, medusa_tree_generate

__all__ = [
    "KVCache", "Llama", "LlamaConfig", "RopeScaling", "MedusaConfig", "MedusaHeads",
    "load_llama", "load_medusa", "load_shipped", "save_llama", "save_medusa",
    "accepted_prefix_len", "greedy_generate", "greedy_reference", "medusa_generate",
    "DraftTree", "SMALL_TREE", "medusa_tree_generate",
]
