#!/usr/bin/env python
"""A target + DFlash drafter pair whose drafter is right at every depth, for overhead runs,
or (``--confidence p``) right at every depth but saying so with probability ~p.

With the drafter always right, trees cannot accept more than the chain (both accept L + 1
tokens per step, up to ``max_tokens``), so a throughput run of ddtree against vLLM's ``dflash``
on this pair measures what a step costs each of them, nothing else (issue 23).

Made from the committed tiny pair, same shapes (so the same forward cost):

- target: the residual stream is the token embedding alone (every layer's ``o_proj`` and
  ``down_proj`` zero: the layers still run, their outputs add nothing), with a large constant
  in dimension 0 of every embedding; the final norm keeps dimension 0 only and an untied
  ``lm_head`` scores only token ``--token`` (its row is ``100 e_0``), so the target's greedy
  choice is ``--token`` after every prefix, by a margin of ~1400 logits.
- drafter: the same construction (zero ``o_proj`` / ``down_proj``, final norm on dimension 0);
  it shares the target's embedding and ``lm_head``, so every depth puts all its mass on
  ``--token``: the tree's best path is the chain of that token, the rest of the tree has
  probability ~e^-1400 (it is still drafted and verified, at full cost).
- ``--confidence p`` (an underconfident drafter, issue 54): the ``lm_head`` row of token
  ``--token + 1`` is ``SECOND_SCALE e_0`` and every other row ``-REST_SCALE e_0``, so the target
  still takes ``--token`` by a margin of ~140 logits; the drafter's final norm scales dimension
  0 down until its two first tokens are ``log(p / (1 - p))`` logits apart: it puts ~p on
  ``--token`` and ~1 - p on the next token (the rest ~e^-40) at every depth, and is always
  right. DDTree's tree from those probabilities (p^depth) spends its nodes on siblings; the
  chain of first choices is accepted L deep.

Usage::

    .venv/bin/python benchmarks/oracle_pair.py --out /tmp/oracle_pair
    .venv/bin/python benchmarks/oracle_pair.py --out /tmp/unsure_pair --confidence 0.52
    .venv/bin/python benchmarks/budget_policy.py --target /tmp/oracle_pair/target \\
        --drafter /tmp/oracle_pair/drafter --only plain dflash ddtree_B16 ddtree_B64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(REPO, "vllm_ddtree", "assets", "tiny_pair")
EMBED_SHIFT = 1000.0  # dimension 0 of every embedding: dominates the residual stream
# the normed dimension 0 is ~sqrt(hidden) = 13.9, so the chosen token's logit is ~1400, every
# other token's 0
LOGIT_SCALE = 100.0
SECOND_SCALE = 90.0  # --confidence: the second token's row (the target's margin: ~140 logits)
REST_SCALE = 5000.0  # --confidence: every other row, negated (the drafter's rest: ~e^-40)


def _silence_layers(weights: dict, prefix: str) -> None:
    """Zero every layer's output projections: attention and MLP run but add nothing."""
    for name, tensor in weights.items():
        if name.startswith(prefix) and name.endswith(("self_attn.o_proj.weight",
                                                      "mlp.down_proj.weight")):
            tensor.zero_()


def _dimension_zero_norm(weights: dict, name: str) -> None:
    weights[name].zero_()
    weights[name][0] = 1.0


def _normed_dimension_zero(embedding: torch.Tensor, eps: float) -> float:
    """Dimension 0 of RMSNorm(``embedding``) with unit weight (vLLM's and transformers' norm)."""
    x = embedding.double()
    return float(x[0] / torch.sqrt(x.pow(2).mean() + eps))


def make_pair(out: str, token: int, confidence: float | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    target_out, drafter_out = os.path.join(out, "target"), os.path.join(out, "drafter")
    shutil.copytree(os.path.join(PAIR, "target"), target_out, dirs_exist_ok=True)
    shutil.copytree(os.path.join(PAIR, "drafter"), drafter_out, dirs_exist_ok=True)

    target = load_file(os.path.join(target_out, "model.safetensors"))
    embed = target["model.embed_tokens.weight"]
    if not 0 <= token < embed.shape[0]:
        raise SystemExit(f"--token {token} is outside the vocabulary (0..{embed.shape[0] - 1})")
    embed[:, 0] = EMBED_SHIFT
    _silence_layers(target, "model.layers.")
    _dimension_zero_norm(target, "model.norm.weight")
    lm_head = torch.zeros_like(embed)
    if confidence is not None:
        lm_head[:, 0] = -REST_SCALE
        lm_head[(token + 1) % embed.shape[0], 0] = SECOND_SCALE
    lm_head[token, 0] = LOGIT_SCALE
    target["lm_head.weight"] = lm_head
    save_file(target, os.path.join(target_out, "model.safetensors"))
    config_path = os.path.join(target_out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tie_word_embeddings"] = False
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)

    drafter = load_file(os.path.join(drafter_out, "model.safetensors"))
    _silence_layers(drafter, "layers.")
    _dimension_zero_norm(drafter, "norm.weight")
    stated = ""
    if confidence is not None:
        # the drafter's residual stream at a mask query is the mask token's embedding: its
        # first two logits are (LOGIT_SCALE - SECOND_SCALE) * n0 * w0 apart
        with open(os.path.join(drafter_out, "config.json")) as f:
            dconfig = json.load(f)
        mask_id = dconfig.get("dflash_config", dconfig).get("mask_token_id", dconfig.get(
            "mask_token_id"))
        n0 = _normed_dimension_zero(embed[mask_id], dconfig.get("rms_norm_eps", 1e-6))
        gap = math.log(confidence / (1.0 - confidence))
        drafter["norm.weight"][0] = gap / ((LOGIT_SCALE - SECOND_SCALE) * n0)
        stated = f"; the drafter says so with probability ~{confidence:g}"
    save_file(drafter, os.path.join(drafter_out, "model.safetensors"))
    print(f"wrote {target_out} and {drafter_out}: greedy output is token {token} at every "
          f"step{stated}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for target/ and drafter/")
    parser.add_argument("--token", type=int, default=100, help="the token every step emits")
    parser.add_argument("--confidence", type=float, default=None,
                        help="the drafter's probability of its (always right) first choice, in "
                             "(0.5, 1); default: certain")
    args = parser.parse_args()
    if args.confidence is not None and not 0.5 < args.confidence < 1.0:
        raise SystemExit(f"--confidence {args.confidence} must be in (0.5, 1)")
    make_pair(args.out, args.token, args.confidence)


if __name__ == "__main__":
    main()
