"""Acceptance (tau = mean accepted tokens per target forward, bonus included) on held-out prompts.

Used by ``scripts/train_tiny_pair.py`` (final report) and ``benchmarks/acceptance.py``.
"""

from __future__ import annotations

import torch

from .corpus import read_split
from .drafter import DFlashDrafter
from .engine import generate

__all__ = ["load_pair", "heldout_prompts", "measure_tau", "acceptance_report"]


def load_pair(target_dir: str, drafter_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(target, drafter, tokenizer) from checkpoint directories (no network)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation="sdpa")
    target = target.to(device).eval()
    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return target, drafter, tokenizer


def heldout_prompts(tokenizer, num: int, prompt_len: int = 64) -> list[list[int]]:
    """The first ``prompt_len`` tokens of the first ``num`` held-out files long enough for it.

    Deterministic (sorted held-out files, see corpus.py); skips files shorter than 2 * prompt_len.
    """
    prompts = []
    for text in read_split("eval"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= 2 * prompt_len:
            prompts.append(ids[:prompt_len])
        if len(prompts) == num:
            break
    return prompts


def measure_tau(target, drafter, prompts, method: str, budget: int = 32, temperature: float = 0.0,
                max_new_tokens: int = 64, seed: int = 0, stop_token_ids=None,
                tree_temperature: float = 1.0) -> dict:
    """tau over all rounds of all prompts (rounds pooled), plus the per-prompt mean."""
    gen = torch.Generator(device=target.device).manual_seed(seed)
    lengths, per_prompt = [], []
    for ids in prompts:
        res = generate(target, drafter, ids, method=method, budget=budget, temperature=temperature,
                       max_new_tokens=max_new_tokens, generator=gen, stop_token_ids=stop_token_ids,
                       tree_temperature=tree_temperature)
        lengths += res.acceptance_lengths
        per_prompt.append(res.tau)
    return {
        "method": method,
        "budget": budget,
        "temperature": temperature,
        "tree_temperature": tree_temperature,
        "tau": sum(lengths) / max(len(lengths), 1),
        "rounds": len(lengths),
        "tau_per_prompt": per_prompt,
    }


def acceptance_report(target_dir: str, drafter_dir: str, num_prompts: int = 8, max_new_tokens: int = 64) -> dict:
    """tau at T=0 for the argmax chain and DDTree at B = 8, 32, 64 (the training script's report)."""
    target, drafter, tokenizer = load_pair(target_dir, drafter_dir)
    prompts = heldout_prompts(tokenizer, num_prompts)
    out = {"chain": measure_tau(target, drafter, prompts, "chain", max_new_tokens=max_new_tokens)["tau"]}
    for budget in (8, 32, 64):
        out[f"ddtree_B{budget}"] = measure_tau(
            target, drafter, prompts, "ddtree", budget=budget, max_new_tokens=max_new_tokens
        )["tau"]
    return out
