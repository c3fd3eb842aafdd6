"""What a ddtree target must not have, refused at engine start with one error line each.

A verify step runs the whole tree as one flattened batch of query rows: each row sees the
committed context plus its ancestors (tree attention), at position ``context + depth``, and
afterwards the accepted path's K/V is moved to the chain slots (compaction). Anything whose
state or mask depends on the row order, the row's chain index or on tokens outside that view
is wrong for trees:

* recurrent layers (Mamba, GDN, linear attention): their state would advance along the
  flattened rows, through siblings and cousins, instead of along each root-to-node path;
* attention other than a plain softmax over the context and the ancestors, which is all the
  tree kernels compute: sliding windows, sinks, logit soft-capping, ALiBi, chunked local or
  dual chunk attention, bidirectional multimodal prefixes, cross / encoder attention, and
  MLA (its layers run MLA backends, not the tree backends);
* M-RoPE: the runner feeds ``mrope_positions``, which stay chain positions.

:func:`check_target` reads the configuration (inside ``EngineArgs.create_speculative_config``,
before any weight is read). :func:`check_attention_layers` is the second line of defence once
the model is built: it reads the attributes of the target's attention layers, where a
model's own per-layer choices (e.g. GPT-OSS's alternating windows) are final.
"""

from __future__ import annotations

from vllm_ddtree.plugin.options import DDTreeConfigError

# ``layer_types`` entries with recurrent state, as vLLM counts them (``LayerBlockType`` and
# ``get_num_layers_by_block_type``: a "hybrid" layer runs attention and Mamba side by side)
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "hybrid")
# HF config flags that turn on learned attention sinks in vLLM's model code (GPT-OSS has
# sinks on every layer without a flag); the layer walk sees every sink whatever the flag.
SINK_FLAGS = ("attention_sinks", "swa_attention_sink_enabled", "add_swa_attention_sink_bias",
              "param_sink_number")
SINK_MODEL_TYPES = ("gpt_oss",)
WITHOUT_DDTREE = "serve this model without ddtree"


def check_target(model_config, parallel_config) -> None:
    """Refuse a target ddtree cannot verify trees on (configuration only, no model loaded).

    ``model_config``: the target's ``ModelConfig``; ``parallel_config``: its ``ParallelConfig``.
    Raises :class:`DDTreeConfigError` with one line naming the problem and the fix.
    """
    arch = model_config.architecture
    recurrent = recurrent_layer_kinds(model_config)
    if recurrent:
        raise DDTreeConfigError(
            f"ddtree: the target {arch} has recurrent layers ({recurrent}), which are not "
            f"supported (their state cannot follow the branches of a draft tree); "
            f"{WITHOUT_DDTREE}"
        )
    if model_config.uses_mrope:
        raise DDTreeConfigError(
            f"ddtree: the target {arch} uses M-RoPE (multimodal rotary positions), which is "
            f"not supported yet (tree nodes get depth positions, mrope_positions do not); "
            f"{WITHOUT_DDTREE}"
        )
    features = attention_features(model_config)
    if features:
        only_window = len(features) == 1 and features[0].startswith("sliding-window")
        fix = ("pass --disable-sliding-window (max_model_len is then capped at the window) or "
               + WITHOUT_DDTREE) if only_window else WITHOUT_DDTREE
        raise DDTreeConfigError(
            f"ddtree: the target {arch} uses {', '.join(features)}, which tree attention does "
            f"not support yet; {fix}"
        )


def recurrent_layer_kinds(model_config) -> str | None:
    """How the target declares recurrent layers, or None: ``layer_types`` entries, else vLLM's
    own hybrid / inner-state notion (from its model registry)."""
    layer_types = getattr(model_config.hf_text_config, "layer_types", None) or []
    kinds = sorted({t for t in layer_types if t in RECURRENT_LAYER_TYPES})
    if kinds:
        return f"layer_types {', '.join(kinds)}"
    if model_config.is_hybrid or model_config.has_inner_state:
        return "Mamba / linear attention"
    return None


def attention_features(model_config) -> list[str]:
    """The target's attention features tree attention lacks, as read from its configuration."""
    text = model_config.hf_text_config
    found = []
    window = sliding_window_layers(model_config)
    if window is not None:
        size, count, total = window
        found.append(f"sliding-window attention (window {size} on {count} of {total} layers)")
    if model_config.rswa_window is not None:
        found.append(f"reference sliding-window attention (rswa_window={model_config.rswa_window})")
    flags = [f for f in SINK_FLAGS if getattr(text, f, None)]
    if flags or getattr(text, "model_type", None) in SINK_MODEL_TYPES:
        found.append("attention sinks" + (f" ({', '.join(flags)})" if flags else ""))
    soft_cap = getattr(text, "attn_logit_softcapping", None)
    if soft_cap:
        found.append(f"attention logit soft-capping (attn_logit_softcapping={soft_cap})")
    if model_config.uses_alibi:
        found.append("ALiBi")
    if model_config.attention_chunk_size:
        found.append(f"chunked local attention (attention_chunk_size="
                     f"{model_config.attention_chunk_size})")
    if model_config.is_mm_prefix_lm:
        found.append("a bidirectional multimodal prefix (is_mm_prefix_lm)")
    if model_config.use_mla:
        found.append("multi-head latent attention (MLA)")
    if getattr(text, "dual_chunk_attention_config", None):
        found.append("dual chunk attention (dual_chunk_attention_config)")
    return found


def sliding_window_layers(model_config) -> tuple[int, int, int] | None:
    """``(window, sliding layers, layers)`` or None, decided per layer as vLLM does.

    ``sliding_window`` is the window once the HF config class and vLLM have resolved it: None
    when ``use_sliding_window`` is false (Qwen2/Qwen3 configs carry a value anyway) or with
    ``--disable-sliding-window``. Without ``layer_types`` (or with all of them sliding) vLLM
    applies it to every layer (``CacheConfig.sliding_window``); otherwise the layers marked
    ``"sliding_attention"`` get it (``max_window_layers`` is already folded into
    ``layer_types`` by the HF config class). Example: Qwen3 with ``use_sliding_window: false,
    sliding_window: 4096`` -> None; GPT-OSS (24 layers, alternating, window 128) ->
    ``(128, 12, 24)``.
    """
    size = model_config.get_sliding_window()
    if not size:
        return None
    text = model_config.hf_text_config
    total = getattr(text, "num_hidden_layers", None) or 0
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        return size, total, total
    count = sum(t == "sliding_attention" for t in layer_types)
    return (size, count, len(layer_types)) if count else None


def check_attention_layers(static_forward_context: dict, drafter_layer_names) -> None:
    """Refuse target layers (built, before serving) that tree attention or compaction
    cannot handle.

    ``static_forward_context``: ``compilation_config.static_forward_context`` (layer name ->
    layer); ``drafter_layer_names``: the drafter's layers, skipped. Layers without an
    ``impl`` (MoE runners, LoRA wrappers, ...) are not attention and are skipped. KV-sharing
    layers (``kv_sharing_target_layer_name``) are fine: they read another layer's cache.
    """
    drafter = set(drafter_layer_names or ())
    by_problem: dict[str, list[str]] = {}
    for name, layer in static_forward_context.items():
        if name in drafter:
            continue
        for problem in layer_problems(layer):
            by_problem.setdefault(problem, []).append(name)
    if by_problem:
        described = "; ".join(
            f"{problem} ({len(names)} layer{'s' if len(names) > 1 else ''}, e.g. {names[0]})"
            for problem, names in by_problem.items()
        )
        raise DDTreeConfigError(
            f"ddtree: tree attention does not support yet what the target's layers use: "
            f"{described}; {WITHOUT_DDTREE}"
        )


def layer_problems(layer) -> list[str]:
    """What tree attention or compaction cannot serve in one layer of the static forward
    context (read from vLLM's ``Attention`` / ``MLAAttention`` / ``MambaBase`` attributes)."""
    if hasattr(layer, "mamba_type"):
        return ["a recurrent state (Mamba / linear attention)"]
    impl = getattr(layer, "impl", None)
    if impl is None:
        return []
    found = []
    backend = getattr(layer, "attn_backend", None)
    if backend is not None and not is_tree_backend(backend):
        found.append(f"the attention backend {backend.__name__} (not a ddtree tree backend)")
    if getattr(layer, "kv_lora_rank", None) is not None:
        found.append("multi-head latent attention (MLA)")
    attn_type = getattr(layer, "attn_type", "decoder")
    attn_type = getattr(attn_type, "value", attn_type)  # vLLM's AttentionType is a str Enum
    if attn_type != "decoder":
        found.append(f"{attn_type} attention")
    window = getattr(layer, "sliding_window", None)
    if window is None and getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)):
        window = impl.sliding_window
    if window is not None:
        found.append(f"a sliding window {window}")
    if getattr(layer, "attention_chunk_size", None):
        found.append(f"chunked local attention (chunk {layer.attention_chunk_size})")
    if (getattr(layer, "has_sink", False) or getattr(impl, "sinks", None) is not None
            or getattr(layer, "sink_len", None)):
        found.append("attention sinks")
    if getattr(impl, "logits_soft_cap", None):
        found.append(f"logit soft-capping {impl.logits_soft_cap}")
    if getattr(impl, "alibi_slopes", None) is not None:
        found.append("ALiBi")
    if getattr(layer, "use_mm_prefix", False):
        found.append("a bidirectional multimodal prefix")
    return found


def is_tree_backend(backend: type) -> bool:
    """Whether ``backend`` is, or wraps by subclassing (vLLM's chunked-local, cross and
    encoder-only layers do), one of the plugin's tree backends (``CPU_ATTN`` / ``TRITON_ATTN``
    overrides). Compared by module so the CUDA backend is not imported on the CPU."""
    return any(cls.__module__.startswith("vllm_ddtree.plugin.") for cls in backend.__mro__)
