"""Derive `llama-3-8b_a100.json` from Vidur's measured profiles (microsoft/vidur, MIT licence, commit 7d47513).

    python skvs_jax/sim/profiles/derive_vidur.py MLP_CSV ATTENTION_ROWS_DIR > skvs_jax/sim/profiles/llama-3-8b_a100.json

MLP_CSV: Vidur's `data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv` (every row is kept: one per
(num_tokens, tensor-parallel degree)). ATTENTION_ROWS_DIR: text files of rows of Vidur's `attention.csv` for that
model (TP1, block size 16), one row per line after a `#` header naming the columns: decode files (`decode*.txt`:
`kv batch attn_decode_median_ms`) and prefill files (`prefill*.txt`: `chunk kv attn_prefill_median_ms
attn_kv_cache_save_median_ms`, -1 where a value was not transcribed). Run once; not imported by the package.
"""

import csv
import json
import pathlib
import sys

import numpy as np

# Vidur's `ExecutionTime._get_block_execution_time`: the per-layer operators of its compute profile it charges.
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def linear_tables(path: str) -> dict:
    rows = list(csv.DictReader(open(path)))
    out = {}
    for tp in sorted({int(r["num_tensor_parallel_workers"]) for r in rows}):
        by_n: dict[int, list] = {}
        for r in rows:
            if int(r["num_tensor_parallel_workers"]) == tp:
                med = {op: float(r[f"time_stats.{op}.median"]) for op in (*LAYER_OPS, "emb")}
                by_n.setdefault(int(r["num_tokens"]), []).append(
                    (sum(med[op] for op in LAYER_OPS), med["mlp_up_proj"], med["emb"]))
        ns = sorted(by_n)
        vals = np.asarray([np.mean(by_n[n], axis=0) for n in ns])  # duplicate rows (2048, 4096, 32768): mean
        out[str(tp)] = {"num_tokens": ns, "layer_ms": [round(x, 5) for x in vals[:, 0]],
                        "up_proj_ms": [round(x, 5) for x in vals[:, 1]], "emb_ms": [round(x, 5) for x in vals[:, 2]]}
    return out


def attention_rows(folder: str) -> dict:
    decode, prefill, save = [], [], []
    for f in sorted(pathlib.Path(folder).glob("*.txt")):
        for line in f.read_text().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            v = line.split()
            if f.name.startswith("decode"):
                decode.append([int(v[0]), int(v[1]), float(v[2])])  # kv, batch, ms
            else:
                prefill.append([int(v[0]), int(v[1]), float(v[2])])  # chunk, kv, ms
                # The KV write of a chunk does not depend on its context; only the kv = 0 rows' save times were
                # transcribed exactly (the others are approximate, or -1), so only they are kept.
                if float(v[3]) >= 0 and int(v[1]) == 0:
                    save.append([int(v[0]), float(v[3])])
    return {"decode_kv_batch_ms": sorted(set(map(tuple, decode))),
            "prefill_chunk_kv_ms": sorted(set(map(tuple, prefill))),
            # Vidur fits the save time on num_tokens alone (its random forest averages the rows of each count).
            "kv_save_tokens_ms": [[n, round(float(np.mean([t for m, t in save if m == n])), 5)]
                                  for n in sorted({m for m, _ in save})]}


if __name__ == "__main__":
    doc = {
        "source": "microsoft/vidur (MIT licence, Copyright (c) Microsoft Corporation), commit 7d47513, "
                  "data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/{mlp.csv, attention.csv}: measured on an "
                  "A100-80GB, bf16, milliseconds per decoder layer (medians)",
        "derivation": "skvs_jax/sim/profiles/derive_vidur.py. linear_per_tp[tp]: every row of mlp.csv at that "
                      "tensor-parallel degree; layer_ms = input_layernorm + attn_pre_proj + attn_rope + "
                      "attn_post_proj + post_attention_layernorm + mlp_up_proj + mlp_act + mlp_down_proj + add "
                      "(Vidur's ExecutionTime block, attention kernels and all-reduce excluded), duplicate rows "
                      "averaged. decode_kv_batch_ms, prefill_chunk_kv_ms, kv_save_tokens_ms: a sample of "
                      "attention.csv rows (TP1, block size 16; 895 decode and 551 prefill rows), kv-save "
                      "from the kv = 0 rows (the exactly transcribed ones), averaged per token count, anchored "
                      "at 1 token by attn_rope's 1-token time (the sample has no KV write below 64 tokens)",
        "model": "meta-llama/Meta-Llama-3-8B (the shapes of meta-llama/Llama-3.1-8B)",
        "device": "NVIDIA A100-SXM4-80GB",
        "linear_per_tp": linear_tables(sys.argv[1]), **attention_rows(sys.argv[2])}
    # The sample has no KV write below 64 tokens (decode rows do not carry it): anchor the table at 1 token with
    # the profile's one-token elementwise kernel of the same layer (attn_rope, TP1), a launch-bound floor.
    rope = [float(r["time_stats.attn_rope.median"]) for r in csv.DictReader(open(sys.argv[1]))
            if r["num_tensor_parallel_workers"] == "1" and r["num_tokens"] == "1"]
    doc["kv_save_tokens_ms"] = [[1, rope[0]]] + doc["kv_save_tokens_ms"]
    json.dump(doc, sys.stdout, separators=(",", ":"))
