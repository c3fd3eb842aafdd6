"""A DFlash block-diffusion drafter in plain torch, loading z-lab's checkpoint format.

One forward pass turns the target's hidden states of the committed context plus a block
``[bonus, mask x L]`` into L per-position draft distributions q_1..q_L (DFlash, arXiv 2602.06036).

Checkpoint format (the same directory loads here, in ``dflash.model.DFlashDraftModel`` and in
vLLM's ``qwen3_dflash.py``): ``config.json`` with ``architectures ["DFlashDraftModel"]``,
``model_type "qwen3"``, ``block_size``, ``num_target_layers``,
``dflash_config {mask_token_id, target_layer_ids}``, and ``model.safetensors`` with the weights
below (no embedding, no lm_head: the drafter uses the target's)::

    fc.weight                                 [hidden, len(target_layer_ids) * target_hidden]
    hidden_norm.weight, norm.weight           [hidden]
    layers.{i}.input_layernorm.weight         [hidden]
    layers.{i}.post_attention_layernorm.weight
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight
    layers.{i}.mlp.{gate,up,down}_proj.weight

Math of one layer (block of Q query tokens, C context tokens)::

    q = RoPE(q_norm(W_q x_block))                                  # [b, heads, Q, d]
    k = RoPE(k_norm(W_k [ctx ; x_block])), v = W_v [ctx ; x_block]   # [b, kv_heads, C + Q, d]
    x_block += W_o SDPA(q, k, v)   (non-causal: every block token sees all context and the block)
    x_block += MLP(post_norm(x_block))

``ctx = hidden_norm(fc(cat(target hidden states of target_layer_ids)))`` enters every layer as
K/V only; it is cached across rounds (:class:`DrafterCache`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["DrafterConfig", "DFlashDrafter", "DrafterCache", "default_target_layer_ids"]


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """dflash's fallback: evenly from layer 1 to ``num_target_layers - 3`` (middle for one layer).

    Example: 36 target layers, 5 draft layers -> [1, 9, 17, 25, 33].
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 3 - 1
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    """The fields of a DFlash ``config.json`` this module reads (Qwen3 layer shapes)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    target_hidden_size: int | None = None  # None: same as hidden_size
    extra: dict = field(default_factory=dict)  # other keys of config.json, written back unchanged

    @classmethod
    def from_dict(cls, raw: dict) -> "DrafterConfig":
        dflash = raw.get("dflash_config") or {}
        rope = raw.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default" or raw.get("rope_scaling"):
            raise ValueError(f"rope_type={rope_type!r}: only plain RoPE drafters are supported")
        for key, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                             ("final_logit_softcapping", None)):
            value = dflash.get(key, raw.get(key, neutral))
            if value not in (neutral, 0, 0.0) or (neutral == 1.0 and value != 1.0):
                raise ValueError(f"{key}={value!r}: not supported by this drafter (expected {neutral!r})")
        layer_types = raw.get("layer_types")
        if layer_types and set(layer_types) != {"full_attention"}:
            raise ValueError(f"{layer_types=}: sliding-window drafters are not supported")
        num_layers = raw["num_hidden_layers"]
        num_target = raw["num_target_layers"]
        heads = raw["num_attention_heads"]
        known = {
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "num_target_layers", "block_size",
            "rms_norm_eps", "rope_theta", "max_position_embeddings", "target_hidden_size",
        }
        return cls(
            hidden_size=raw["hidden_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            num_target_layers=num_target,
            block_size=int(dflash.get("block_size", raw.get("block_size", 16))),
            mask_token_id=int(dflash.get("mask_token_id", raw.get("mask_token_id"))),
            target_layer_ids=list(
                dflash.get("target_layer_ids")
                or raw.get("target_layer_ids")
                or default_target_layer_ids(num_target, num_layers)
            ),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
            max_position_embeddings=raw.get("max_position_embeddings", 40960),
            target_hidden_size=raw.get("target_hidden_size"),
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_dict(self) -> dict:
        """z-lab's layout: Qwen3 keys + ``block_size`` + ``dflash_config``."""
        raw = dict(self.extra)
        raw.update(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            num_target_layers=self.num_target_layers,
            block_size=self.block_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            dflash_config={
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": self.target_layer_ids,
            },
        )
        if self.target_hidden_size is not None:
            raw["target_hidden_size"] = self.target_hidden_size
        return raw


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: computed in float32, scaled, cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """``positions [b, n]`` -> ``(cos, sin)`` each ``[b, 1, n, head_dim]`` (NeoX halves)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [b, n, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``ctx [b, C, hidden]`` -> K, V ``[b, kv_heads, C, d]`` (K normed and rotated)."""
        b, n, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(b, n, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(ctx).view(b, n, -1, self.head_dim).transpose(1, 2)
        return k * cos + _rotate_half(k) * sin, v

    def forward(self, x, k_ctx, v_ctx, cos, sin, mask):
        # x: [b, Q, hidden]; k_ctx, v_ctx: [b, kv_heads, C, d]; cos, sin: [b, 1, Q, d] (block)
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, -1, self.head_dim)).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k_blk, v_blk = self.context_kv(x, cos, sin)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, i, bias=False)
        self.mlp.up_proj = nn.Linear(h, i, bias=False)
        self.mlp.down_proj = nn.Linear(i, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, x, k_ctx, v_ctx, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), k_ctx, v_ctx, cos, sin, mask)
        y = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(y)) * self.mlp.up_proj(y))


class DrafterCache:
    """Per-layer context K/V of the drafter, ``[batch, kv_heads, C, head_dim]`` each.

    Only committed context enters the cache (:meth:`DFlashDrafter.append_context`); the block's
    own K/V are recomputed every round, as in dflash (which crops its cache back to ``start``).
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)


class DFlashDrafter(nn.Module):
    """The DFlash draft model. ``embed`` and ``lm_head`` are the target's (passed in per call)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        target_hidden = cfg.target_hidden_size or cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * target_hidden, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # -- properties used by the engine ------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def context_features(self, hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
        """HF ``output_hidden_states`` (embeddings first) -> ``[b, n, len(ids) * hidden]``.

        Layer id i is the OUTPUT of target layer i, i.e. ``hidden_states[i + 1]``.
        """
        need = max(self.target_layer_ids) + 2
        if len(hidden_states) < need:
            raise ValueError(
                f"{len(hidden_states)=} hidden states, target_layer_ids={self.target_layer_ids} "
                f"needs at least {need}: does the drafter belong to this target?"
            )
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    # -- forward ----------------------------------------------------------------------------
    def forward(
        self,
        target_hidden: torch.Tensor,  # [b, C, len(ids) * target_hidden] new context features
        noise_embedding: torch.Tensor,  # [b, Q, hidden] target embedding of [bonus, mask x L]
        position_ids: torch.Tensor,  # [b, C + Q]: the new context's positions, then the block's
        attention_mask: torch.Tensor | None = None,  # [b or 1, 1, Q, cached + C + Q] bool or float
        cache: DrafterCache | None = None,
    ) -> torch.Tensor:
        """Returns the normed block hidden states ``[b, Q, hidden]`` (dflash's ``forward``).

        With a cache, the new context K/V are appended to it first and the block attends to the
        whole cache; the block's own K/V are never stored.
        """
        b, num_ctx, _ = target_hidden.shape
        num_q = noise_embedding.shape[1]
        if position_ids.shape != (b, num_ctx + num_q):
            raise ValueError(f"position_ids.shape={tuple(position_ids.shape)}, expected ({b}, {num_ctx + num_q})")
        cfg = self.config
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, noise_embedding.dtype)
        cos_c, sin_c, cos_q, sin_q = cos[:, :, :num_ctx], sin[:, :, :num_ctx], cos[:, :, num_ctx:], sin[:, :, num_ctx:]
        x = noise_embedding
        for i, layer in enumerate(self.layers):
            k_ctx, v_ctx = layer.self_attn.context_kv(ctx, cos_c, sin_c)
            if cache is not None:
                cache.append(i, k_ctx, v_ctx)
                k_ctx, v_ctx = cache.keys[i], cache.values[i]
            x = layer(x, k_ctx, v_ctx, cos_q, sin_q, attention_mask)
        return self.norm(x)

    # -- loading / saving -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, device="cpu") -> "DFlashDrafter":
        from safetensors.torch import load_file

        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        if "DFlashDraftModel" not in (raw.get("architectures") or []):
            raise ValueError(f"{path}/config.json architectures={raw.get('architectures')}, expected ['DFlashDraftModel']")
        model = cls(DrafterConfig.from_dict(raw))
        state = load_file(os.path.join(path, "model.safetensors"))
        state = {k.removeprefix("model."): v for k, v in state.items() if "rotary_emb" not in k}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: missing weights {missing}, unexpected weights {unexpected}")
        return model.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.config.to_dict(), f, indent=2)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def init_weights(model: nn.Module, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    """Normal(0, std) linear weights, unit norms (Qwen3's ``_init_weights``)."""
    for name, p in model.named_parameters():
        with torch.no_grad():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)
