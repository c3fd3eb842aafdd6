#!/usr/bin/env python
"""End-to-end timing of the transformers engine on a Qwen3-8B-shaped pair (random weights, bf16).

Nothing is downloaded: the target (hidden 4096, 36 layers, 32/8 heads of 128, vocab 151936) and the
drafter (z-lab/Qwen3-8B-DFlash-b16 shapes: 5 layers, block 16, target layers [1, 9, 17, 25, 33])
are built from local configs with random weights. Random weights accept ~nothing, so what this
measures is the COST of a round, not tau:

1. time per round and per stage (draft / tree / verify / commit) for plain decoding, the DFlash
   chain and DDTree at B in {16, 64, 256, 1024};
2. verify-forward time against the number of query tokens (1 .. 1024) over a fixed context, to
   see where verification stops being memory-bound (time flat in n) and turns compute-bound.

Usage (one call on a lent GPU, < 10 min; needs torch + transformers)::

    python benchmarks/e2e_gpu.py                   # H100/H200, writes benchmarks/results/e2e_gpu.json
    python benchmarks/e2e_gpu.py --smoke           # tiny shapes on the CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

try:
    import torch
    import transformers  # noqa: F401  (the engine's target model and KV cache)
except ImportError as exc:  # pragma: no cover - only on machines without transformers
    sys.exit(f"benchmarks/e2e_gpu.py needs torch and transformers ({exc}); "
             "install transformers (pure Python) next to torch")

FULL = dict(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, inter=12288,
            d_layers=5, block=16, target_layer_ids=[1, 9, 17, 25, 33])
SMOKE = dict(vocab=512, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, inter=256,
             d_layers=1, block=8, target_layer_ids=[1, 2])


def build_pair(shape: dict, device: str, dtype: torch.dtype, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from vllm_ddtree.hf.drafter import DFlashDrafter, DrafterConfig

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = Qwen3ForCausalLM(cfg).eval()
            dcfg = DrafterConfig(
                hidden_size=shape["hidden"], num_hidden_layers=shape["d_layers"],
                num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                head_dim=shape["head_dim"], intermediate_size=shape["inter"], vocab_size=shape["vocab"],
                num_target_layers=shape["layers"], block_size=shape["block"], mask_token_id=shape["vocab"] - 1,
                target_layer_ids=shape["target_layer_ids"], rope_theta=1_000_000.0,
            )
            drafter = DFlashDrafter(dcfg).eval()
            for p in drafter.parameters():  # nn.Linear's default init, but keep norms at 1
                if p.dim() == 1:
                    p.data.fill_(1.0)
    finally:
        torch.set_default_dtype(default)
    return target, drafter


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_methods(target, drafter, device, prompt_len, max_new_tokens, budgets, repeats):
    from vllm_ddtree.hf.engine import generate

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size - 1, (1, prompt_len), generator=g).to(device)
    generate(target, drafter, prompt, method="ddtree", budget=budgets[0], max_new_tokens=4)  # warm-up
    rows = []
    for method, budget in [("ar", 0), ("chain", drafter.block_size - 1)] + [("ddtree", b) for b in budgets]:
        per_round, stages, tokens = [], {}, 0
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            res = generate(target, drafter if method != "ar" else None, prompt, method=method,
                           budget=max(budget, 1), max_new_tokens=max_new_tokens, timing=True)
            sync(device)
            elapsed = time.perf_counter() - t0 - res.prefill_time
            per_round.append(elapsed / max(len(res.num_accepted), 1))
            tokens = len(res.output_ids)
            for k, v in res.stage_times.items():
                if v:
                    stages.setdefault(k, []).append(statistics.mean(v))
        row = {"method": method, "budget": budget, "ms_per_round": 1e3 * statistics.median(per_round),
               "stage_ms": {k: 1e3 * statistics.median(v) for k, v in stages.items()},
               "tau": res.tau, "tokens": tokens}
        rows.append(row)
        stage = " ".join(f"{k} {v:.2f}" for k, v in row["stage_ms"].items())
        print(f"{method:7s} B={budget:5d} {row['ms_per_round']:8.2f} ms/round  [{stage}] tau {row['tau']:.2f}",
              flush=True)
    return rows


@torch.inference_mode()
def time_verify(target, device, context_len, sizes, repeats):
    """Target forward over n query tokens on top of a context_len-token cache (4-D float mask)."""
    from transformers import DynamicCache

    V = target.config.vocab_size
    dtype = next(target.parameters()).dtype
    cache = DynamicCache(config=target.config)
    ctx = torch.randint(0, V, (1, context_len), device=device)
    target(input_ids=ctx, past_key_values=cache, use_cache=True, logits_to_keep=1)
    rows = []
    for n in sizes:
        ids = torch.randint(0, V, (1, n), device=device)
        pos = context_len + torch.arange(n, device=device)[None] // 4  # tree-like: shared depths
        mask = torch.zeros(1, 1, n, context_len + n, dtype=dtype, device=device)
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        mask[..., context_len:] = mask[..., context_len:].masked_fill(~causal, torch.finfo(dtype).min)
        times = []
        for i in range(repeats + 1):
            sync(device)
            t0 = time.perf_counter()
            target(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True)
            sync(device)
            if i:  # first call warms up
                times.append(time.perf_counter() - t0)
            cache.crop(-n)
        ms = 1e3 * statistics.median(times)
        rows.append({"tokens": n, "ms": ms, "ms_per_token": ms / n})
        print(f"verify n={n:5d} {ms:8.2f} ms  ({ms / n:.3f} ms/token)", flush=True)
    base = rows[0]["ms"]
    knee = next((r["tokens"] for r in rows if r["ms"] > 1.5 * base), None)
    return rows, knee


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, float32, seconds")
    ap.add_argument("--budgets", type=int, nargs="+", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        shape, device, dtype = SMOKE, "cpu", torch.float32
        budgets, new, plen, reps, sizes, ctx = [4, 16], 8, 16, 1, [1, 4, 16, 64], 64
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke on a CPU")
        shape, device, dtype = FULL, "cuda", torch.bfloat16
        budgets, new, plen, reps, ctx = [16, 64, 256, 1024], 64, 512, 2, 1024
        sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    budgets = args.budgets or budgets
    new = args.max_new_tokens or new
    plen = args.prompt_len or plen
    reps = args.repeats or reps
    t0 = time.time()
    target, drafter = build_pair(shape, device, dtype)
    print(f"built pair in {time.time() - t0:.0f}s on {device}", flush=True)
    methods = time_methods(target, drafter, device, plen, new, budgets, reps)
    verify, knee = time_verify(target, device, ctx, sizes, max(reps, 3))
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype),
        "shape": shape, "smoke": args.smoke, "prompt_len": plen, "max_new_tokens": new,
        "methods": methods, "verify_context_len": ctx, "verify": verify,
        "verify_knee_tokens": knee,  # first n whose verify time exceeds 1.5x the 1-token time
        "seconds": time.time() - t0,
    }
    out = args.out or os.path.join(REPO, "benchmarks", "results", "e2e_gpu_smoke.json" if args.smoke else "e2e_gpu.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"verify time exceeds 1.5x the 1-token time from n = {knee}; wrote {out}")


if __name__ == "__main__":
    main()
