"""The shipped tiny byte-level Llama + Medusa heads load, generate correctly, and accept as documented."""

import json

import numpy as np
import pytest

from reference_models import corpus, train
from reference_models.generate import greedy_generate, greedy_reference, medusa_generate
from reference_models.medusa_tree import SMALL_TREE, medusa_tree_generate

WEIGHTS = train.WEIGHTS_DIR


@pytest.fixture(scope="module")
def heldout_prompts():
    _, heldout = corpus.train_heldout_split()
    return np.asarray(train.windows(heldout, np.random.default_rng(99), 16, 32))


def test_shipped_weights_load_and_fit_the_budget(shipped):
    model, heads = shipped
    assert model.config == train.MODEL_CONFIG
    assert heads.config.hidden_size == model.config.hidden_size and heads.config.vocab_size == 256
    size = sum(p.stat().st_size for p in WEIGHTS.rglob("*") if p.is_file())
    assert size <= 10 * 2**20, f"shipped weights take {size} bytes"


def test_shipped_model_learned_the_corpus(shipped):
    """Held-out bits per byte far below the 8 of a uniform byte model (see docs/models.md for the figure)."""
    model, _ = shipped
    _, heldout = corpus.train_heldout_split()
    assert train.heldout_bits_per_byte(model, heldout[:8192]) < 3.0


def test_medusa_chain_and_tree_on_shipped_weights_equal_greedy(shipped, heldout_prompts):
    model, heads = shipped
    prompts = heldout_prompts[:4]
    reference = greedy_reference(model, prompts, 48)
    tokens, stats = medusa_generate(model, heads, prompts, 48)
    np.testing.assert_array_equal(tokens, reference)
    assert stats.steps < 48 / 1.5  # the heads do speed decoding up
    tree_tokens, tree_stats = medusa_tree_generate(model, heads, prompts, 48, SMALL_TREE)
    np.testing.assert_array_equal(tree_tokens, reference)
    assert tree_stats.steps <= stats.steps


def test_shipped_head_1_acceptance_on_heldout_text(shipped, heldout_prompts):
    """Head 1 (predicting t + 2) agrees with the base model's greedy continuation >= 50% of the time on held-out
    prompts, and the training log records the full evaluation."""
    model, heads = shipped
    greedy = greedy_generate(model, heldout_prompts, 64)
    agreement = train.head_top1_agreement(model, heads, greedy, prompt_len=32)
    assert agreement[0] >= 0.5, agreement
    log = json.loads((WEIGHTS / "training_log.json").read_text())
    assert log["eval"]["head_top1_agreement"][0] >= 0.5 and log["eval"]["medusa_equals_greedy"]
