"""Train the shipped tiny byte-level Llama and its Medusa heads on CPU: `python -m reference_models.train`.

1. Base model: next-byte cross-entropy on random windows of the training split of the corpus
   (`reference_models.corpus`: CPython standard-library docstrings, PSF licence), AdamW with warmup + cosine decay.
2. Medusa heads, by self-distillation: the frozen base model continues random training-text prompts greedily
   (paged decoding); head i is trained on those sequences to match the base model's own distribution for
   position t + 2 + i (soft cross-entropy to its logits), at every position whose target lies in the greedy
   continuation. Heads start as identity blocks with the base LM head, as in Medusa.
3. Evaluation on held-out text (never trained on): bits per byte, per-head top-1 agreement with greedy
   continuations, and Medusa chain acceptance (tokens per verification step) with `medusa_generate`.

Writes the weights in the HF / Medusa layouts (`checkpoint.py`) plus `training_log.json` (loss curves and the
evaluation) to --out (default `reference_models/weights`). Vocabulary: 256 bytes, ids = byte values.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reference_models import checkpoint, corpus
from reference_models.checkpoint import WEIGHTS_DIR
from reference_models.generate import greedy_generate, medusa_generate
from reference_models.llama import Llama, LlamaConfig
from reference_models.medusa import MedusaConfig, MedusaHeads
from reference_models.medusa_tree import SMALL_TREE, medusa_tree_generate

MODEL_CONFIG = LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=2,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=1024,
)


# ----------------------------------------------------------------------------------------------- optimiser


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdamState:
    step: jax.Array  # [] int32
    mu: nnx.State  # first moments, shaped like the parameters
    nu: nnx.State  # second moments


def adam_init(params: nnx.State) -> AdamState:
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731  (two calls: mu and nu need own buffers)
    return AdamState(jnp.zeros((), jnp.int32), zeros(), zeros())


def learning_rate(step: jax.Array, peak: float, warmup: int, total: int) -> jax.Array:
    s = step.astype(jnp.float32)
    warm = s / warmup
    cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.clip((s - warmup) / max(total - warmup, 1), 0.0, 1.0)))
    return jnp.float32(peak) * jnp.where(s < warmup, warm, 0.1 + 0.9 * cosine)


def adamw_update(params, grads, opt: AdamState, lr: jax.Array, weight_decay: float = 0.01, clip: float = 1.0):
    """AdamW (b1 0.9, b2 0.95) with global-norm gradient clipping. Returns (params, opt, grad_norm)."""
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(jnp.float32(1.0), jnp.float32(clip) / (norm + 1e-6))
    grads = jax.tree.map(lambda g: g * scale, grads)
    step = opt.step + 1
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, opt.mu, grads)
    nu = jax.tree.map(lambda v, g: 0.95 * v + 0.05 * g * g, opt.nu, grads)
    c1 = 1.0 - jnp.float32(0.9) ** step.astype(jnp.float32)
    c2 = 1.0 - jnp.float32(0.95) ** step.astype(jnp.float32)
    decay = lambda p: weight_decay * p if p.ndim == 2 else jnp.zeros_like(p)  # noqa: E731  (no decay on norms)
    params = jax.tree.map(
        lambda p, m, v: p - lr * (m / c1 / (jnp.sqrt(v / c2) + 1e-8) + decay(p)), params, mu, nu)
    return params, AdamState(step, mu, nu), norm


# ---------------------------------------------------------------------------------------------- base model


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits [..., V], targets [...] -> mean negative log-likelihood (nats)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6), donate_argnums=(1, 2))
def base_train_step(graphdef, params, opt, batch, peak_lr, warmup, total):
    """batch [B, T+1] bytes -> one AdamW step on next-byte cross-entropy."""

    def loss_fn(p):
        logits, _ = nnx.merge(graphdef, p).forward_dense(batch[:, :-1])
        return cross_entropy(logits, batch[:, 1:])

    loss, grads = jax.value_and_grad(loss_fn)(params)
    params, opt, norm = adamw_update(params, grads, opt, learning_rate(opt.step, peak_lr, warmup, total))
    return params, opt, loss, norm


@functools.partial(jax.jit, static_argnums=0)
def eval_loss(graphdef, params, batch):
    logits, _ = nnx.merge(graphdef, params).forward_dense(batch[:, :-1])
    return cross_entropy(logits, batch[:, 1:])


def windows(data: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> jax.Array:
    """[batch, length] random contiguous windows of a byte array, int32."""
    starts = rng.integers(0, len(data) - length, batch)
    return jnp.asarray(np.stack([data[s:s + length] for s in starts]).astype(np.int32))


def heldout_bits_per_byte(model: Llama, heldout: np.ndarray, length: int = 257) -> float:
    graphdef, params = nnx.split(model)
    n = (len(heldout) - 1) // (length - 1)
    starts = np.arange(n) * (length - 1)
    batch = np.stack([heldout[s:s + length] for s in starts]).astype(np.int32)
    losses = [float(eval_loss(graphdef, params, jnp.asarray(batch[i:i + 32]))) * len(batch[i:i + 32])
              for i in range(0, n, 32)]
    return sum(losses) / n / math.log(2.0)


# --------------------------------------------------------------------------------------------- Medusa heads


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8), donate_argnums=(1, 2))
def medusa_train_step(graphdef, params, opt, hidden, teacher, prompt_len, peak_lr, warmup, total):
    """hidden [B, T, Dm], teacher [B, T, V] base logits on greedy sequences -> one step on all heads.

    Head i at position t is matched to softmax(teacher[t + 1 + i]) (the base model's distribution for token
    t + 2 + i), for t + 2 + i >= prompt_len + 1 (the target lies in the greedy continuation).
    """

    def loss_fn(p):
        heads = nnx.merge(graphdef, p)
        logits = heads(hidden)  # [heads, B, T, V]
        t_len = hidden.shape[1]
        total_loss = jnp.float32(0.0)
        for i in range(logits.shape[0]):
            span = t_len - 1 - i  # positions t = 0 .. span-1 have a teacher at t + 1 + i
            target = jax.nn.softmax(teacher[:, 1 + i:], axis=-1)  # [B, span, V]
            logp = jax.nn.log_softmax(logits[i, :, :span], axis=-1)
            ce = -jnp.sum(target * logp, axis=-1)  # [B, span]
            t = jnp.arange(span, dtype=jnp.int32)[None, :]
            keep = (t + 2 + i >= prompt_len + 1).astype(jnp.float32)
            mean_ce = jnp.sum(ce * keep) / (jnp.sum(keep) * ce.shape[0])
            total_loss = total_loss + mean_ce * jnp.float32(0.8**i)  # later heads weigh less
        return total_loss

    loss, grads = jax.value_and_grad(loss_fn)(params)
    params, opt, _ = adamw_update(params, grads, opt, learning_rate(opt.step, peak_lr, warmup, total), 0.0)
    return params, opt, loss


@functools.partial(jax.jit, static_argnums=0)
def base_outputs(graphdef, params, tokens):
    logits, hidden = nnx.merge(graphdef, params).forward_dense(tokens)
    return hidden, logits


def head_top1_agreement(model: Llama, heads: MedusaHeads, sequences: np.ndarray, prompt_len: int) -> list[float]:
    """Per head i: P(argmax head_i(h_t) == greedy token t + 2 + i) over positions whose target was generated."""
    graphdef, params = nnx.split(model)
    hidden, _ = base_outputs(graphdef, params, jnp.asarray(sequences))
    preds = np.asarray(jnp.argmax(heads(hidden), axis=-1))  # [heads, B, T]
    rates = []
    for i in range(heads.config.num_heads):
        t = np.arange(prompt_len - 1 - i, sequences.shape[1] - 2 - i)  # targets t + 2 + i >= prompt_len + 1
        rates.append(float(np.mean(preds[i][:, t] == sequences[:, t + 2 + i])))
    return rates


def head_agreement_on_text(model: Llama, heads: MedusaHeads, text: np.ndarray) -> list[float]:
    """Per head i, on real text [B, T] (teacher forcing): P(argmax head_i(h_t) == the base model's own argmax
    for position t + 2 + i given the true text up to t + 1 + i). Harder than greedy continuations, which a
    small model makes repetitive."""
    graphdef, params = nnx.split(model)
    hidden, logits = base_outputs(graphdef, params, jnp.asarray(text))
    base = np.asarray(jnp.argmax(logits, axis=-1))  # [B, T]: base prediction for position t + 1
    preds = np.asarray(jnp.argmax(heads(hidden), axis=-1))  # [heads, B, T]
    t_len = text.shape[1]
    return [float(np.mean(preds[i][:, : t_len - 1 - i] == base[:, 1 + i:])) for i in range(heads.config.num_heads)]


# ------------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=WEIGHTS_DIR)
    ap.add_argument("--steps", type=int, default=480, help="base-model AdamW steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--medusa-heads", type=int, default=4)
    ap.add_argument("--medusa-steps", type=int, default=400)
    ap.add_argument("--distill-prompts", type=int, default=512, help="greedy sequences for self-distillation")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-only", action="store_true", help="evaluate the weights in --out, train nothing")
    args = ap.parse_args(argv)
    if args.eval_only:
        _, heldout = corpus.train_heldout_split()
        model = checkpoint.load_llama(args.out / "tiny_llama")
        heads = checkpoint.load_medusa(args.out / "tiny_llama_medusa")
        result = {"heldout_bits_per_byte": heldout_bits_per_byte(model, heldout),
                  **evaluate(model, heads, heldout, np.random.default_rng(1234), args.prompt_len, args.gen_len)}
        print(json.dumps(result, indent=1))
        return
    t0 = time.time()
    rng = np.random.default_rng(args.seed)
    train, heldout = corpus.train_heldout_split()
    log: dict = {"command": "python -m reference_models.train " + " ".join(argv or []), "args": {
        k: str(v) for k, v in vars(args).items()}, "base_loss": [], "medusa_loss": []}

    model = Llama(MODEL_CONFIG, rngs=nnx.Rngs(args.seed), std=0.02)
    print(f"base model: {MODEL_CONFIG.num_params} parameters; {len(train)} train / {len(heldout)} held-out bytes")
    graphdef, params = nnx.split(model)
    opt = adam_init(params)
    warmup = max(1, args.steps // 20)
    for step in range(args.steps):
        batch = windows(train, rng, args.batch, args.seq_len + 1)
        params, opt, loss, norm = base_train_step(graphdef, params, opt, batch, args.lr, warmup, args.steps)
        if step % 50 == 0 or step == args.steps - 1:
            loss = float(loss)
            log["base_loss"].append([step, loss, round(time.time() - t0, 1)])
            print(f"base step {step:5d}  loss {loss:.4f} nats/byte  |g| {float(norm):.2f}  {time.time() - t0:6.1f}s")
    model = nnx.merge(graphdef, params)
    log["base_seconds"] = round(time.time() - t0, 1)
    log["heldout_bits_per_byte"] = heldout_bits_per_byte(model, heldout)
    print(f"held-out: {log['heldout_bits_per_byte']:.3f} bits/byte")

    # Self-distillation data: greedy continuations of training-text prompts.
    t1 = time.time()
    prompts = np.asarray(windows(train, rng, args.distill_prompts, args.prompt_len))
    sequences = np.concatenate([greedy_generate(model, prompts[i:i + 128], args.gen_len)
                                for i in range(0, len(prompts), 128)])
    hidden, teacher = [], []
    for i in range(0, len(sequences), 64):
        h, lg = base_outputs(graphdef, params, jnp.asarray(sequences[i:i + 64]))
        hidden.append(h)
        teacher.append(lg)
    hidden, teacher = jnp.concatenate(hidden), jnp.concatenate(teacher)
    print(f"distillation data: {sequences.shape} in {time.time() - t1:.1f}s")

    mcfg = MedusaConfig(MODEL_CONFIG.hidden_size, MODEL_CONFIG.vocab_size, args.medusa_heads, 1)
    heads = MedusaHeads(mcfg, model.lm_head_weight())
    hgraph, hparams = nnx.split(heads)
    hopt = adam_init(hparams)
    mwarm = max(1, args.medusa_steps // 20)
    for step in range(args.medusa_steps):
        idx = rng.integers(0, len(sequences), 32)
        hparams, hopt, loss = medusa_train_step(hgraph, hparams, hopt, hidden[idx], teacher[idx], args.prompt_len,
                                                1e-3, mwarm, args.medusa_steps)
        if step % 50 == 0 or step == args.medusa_steps - 1:
            log["medusa_loss"].append([step, float(loss), round(time.time() - t0, 1)])
            print(f"medusa step {step:4d}  loss {float(loss):.4f}  {time.time() - t0:6.1f}s")
    heads = nnx.merge(hgraph, hparams)
    log["train_seconds"] = round(time.time() - t0, 1)

    log["eval"] = evaluate(model, heads, heldout, np.random.default_rng(1234), args.prompt_len, args.gen_len)
    log["total_seconds"] = round(time.time() - t0, 1)
    print(json.dumps(log["eval"], indent=1))
    checkpoint.save_llama(model, args.out / "tiny_llama")
    checkpoint.save_medusa(heads, args.out / "tiny_llama_medusa", base_model="tiny_llama")
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved to {args.out} after {time.time() - t0:.0f}s")


def evaluate(model: Llama, heads: MedusaHeads, heldout: np.ndarray, rng: np.random.Generator,
             prompt_len: int = 32, gen_len: int = 96, num_prompts: int = 64) -> dict:
    """Held-out acceptance: per-head top-1 agreement and chain acceptance of `medusa_generate`."""
    prompts = np.asarray(windows(heldout, rng, num_prompts, prompt_len))
    greedy = greedy_generate(model, prompts, gen_len)
    agreement = head_top1_agreement(model, heads, greedy, prompt_len)
    tokens, stats = medusa_generate(model, heads, prompts, gen_len)
    acc = stats.accepted[stats.running]
    k = heads.config.num_heads
    text = np.asarray(windows(heldout, rng, num_prompts, prompt_len + gen_len))
    tree_result = {}
    if heads.config.num_heads >= int(SMALL_TREE.depth.max()):
        tree_tokens, tree_stats = medusa_tree_generate(model, heads, prompts, gen_len, SMALL_TREE)
        tree_result = {"tree_mean_tokens_per_step": float(np.mean(tree_stats.accepted[tree_stats.running]) + 1.0),
                       "tree_equals_greedy": bool((tree_tokens == greedy).all())}
    return {
        "prompts": num_prompts, "prompt_len": prompt_len, "gen_len": gen_len,
        "head_top1_agreement": agreement,
        "head_agreement_on_heldout_text": head_agreement_on_text(model, heads, text),
        "chain_accept_at_least": [float(np.mean(acc >= i)) for i in range(1, k + 1)],
        "mean_tokens_per_step": float(np.mean(acc) + 1.0),
        "medusa_equals_greedy": bool((tokens == greedy).all()),
        **tree_result,
    }


if __name__ == "__main__":
    main()
