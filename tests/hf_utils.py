"""Tiny random target + drafter pairs for the transformers-engine tests (no downloads)."""

from __future__ import annotations

import torch

from vllm_ddtree.hf.drafter import DFlashDrafter, DrafterConfig, init_weights


def tiny_target(vocab: int = 64, hidden: int = 64, layers: int = 3, std: float = 0.2, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    init_weights(model, std, torch.Generator().manual_seed(seed))
    return model.float().eval()


def tiny_drafter(target, block_size: int = 4, layers: int = 1, std: float = 0.2, seed: int = 1,
                 target_layer_ids=(0, 1)):
    t = target.config
    cfg = DrafterConfig(
        hidden_size=t.hidden_size, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, intermediate_size=2 * t.hidden_size, vocab_size=t.vocab_size,
        num_target_layers=t.num_hidden_layers, block_size=block_size, mask_token_id=t.vocab_size - 1,
        target_layer_ids=list(target_layer_ids), rope_theta=10000.0, max_position_embeddings=512,
    )
    drafter = DFlashDrafter(cfg)
    init_weights(drafter, std, torch.Generator().manual_seed(seed))
    return drafter.float().eval()


def one_thread():
    """Tiny models run fastest on one thread (and do not fight other processes for the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
