"""A hand-made target + DFlash drafter pair, built at test time (random weights, no training).

Unlike the committed tiny pair, the shapes are free: the drafter may use other attention heads,
KV heads and head_dim than the target (vLLM then keeps target and drafter layers in one KV-cache
group with per-layer specs), another block size and other target layers. To give the random
drafter real acceptance, the target's output embedding favours a few tokens: target and drafter
share it, so both pick among the same few tokens and trees hit the target's argmax often, at
ranks other than 1.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from vllm_ddtree.hf.drafter import DFlashDrafter, DrafterConfig, init_weights

TINY_TARGET = Path(__file__).resolve().parents[1] / "vllm_ddtree" / "assets" / "tiny_pair" / "target"
VOCAB = 4096  # the tiny pair's tokenizer


def make_pair(out: Path, *, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, tie=False,
              draft_layers=2, draft_heads=8, draft_kv_heads=1, draft_head_dim=32, block_size=16,
              target_layer_ids=(0, 2), favored=6, seed=0, std=0.3) -> tuple[str, str]:
    """Write ``out/target`` (Qwen3, float32, the tiny pair's tokenizer) and ``out/drafter``
    (DFlash, z-lab format); returns their paths."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=2048, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=2, pad_token_id=0,
    )
    gen = torch.Generator().manual_seed(seed)
    target = Qwen3ForCausalLM(config)
    init_weights(target, std, gen)
    with torch.no_grad():
        scale = torch.full((VOCAB, 1), 0.05)
        scale[torch.randperm(VOCAB, generator=gen)[:favored]] = 1.0
        head = target.model.embed_tokens if tie else target.lm_head
        head.weight.mul_(scale * (1.0 if tie else 3.0))
    target.save_pretrained(out / "target")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_TARGET / name, out / "target" / name)
    drafter = DFlashDrafter(DrafterConfig(
        hidden_size=hidden, num_hidden_layers=draft_layers, num_attention_heads=draft_heads,
        num_key_value_heads=draft_kv_heads, head_dim=draft_head_dim, intermediate_size=3 * hidden,
        vocab_size=VOCAB, num_target_layers=layers, block_size=block_size, mask_token_id=3,
        target_layer_ids=list(target_layer_ids), rope_theta=10000.0, max_position_embeddings=2048,
    ))
    init_weights(drafter, std, torch.Generator().manual_seed(seed + 1))
    drafter.save_pretrained(str(out / "drafter"), dtype=torch.float32)
    return str(out / "target"), str(out / "drafter")


def make_unsure_pair(out: Path, confidence: float = 0.52, token: int = 100) -> tuple[str, str]:
    """``benchmarks/oracle_pair.py --confidence``'s pair in ``out``: a target whose greedy output
    is ``token`` after every prefix (the oracle: plain decoding's text, known without running
    it) and a drafter always right at every depth that says so with probability
    ~``confidence``. Returns (target, drafter) paths."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "oracle_pair.py"
    spec = importlib.util.spec_from_file_location("oracle_pair", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_pair(str(out), token, confidence)
    return str(Path(out) / "target"), str(Path(out) / "drafter")
