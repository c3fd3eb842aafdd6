"""Targets trees cannot serve yet are refused at engine start (``vllm_ddtree/plugin/support.py``).

1. Configuration (``check_target``, inside ``EngineArgs.create_speculative_config``): one
   hand-made config.json per refusal, without weights (the check fires before any weight is
   read), through ``EngineArgs.create_engine_config``; the look-alikes that must still start
   (Qwen3's ``use_sliding_window: false`` with a ``sliding_window`` value, Llama, the named fix
   ``--disable-sliding-window``). Hand-made targets share the tiny drafter's vocab and hidden
   size, so without the check under test the pair would pass every other check.
2. Built layers (``check_attention_layers``): fake layers carrying the attribute names of
   vLLM's ``Attention`` / ``MLAAttention`` / ``MambaBase`` layers and impls, then the real
   layers of two tiny engines (the committed pair with ddtree; a random Gemma2 without it).
"""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm_utils import TARGET, close, ddtree_spec, make_llm

from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backend import AttentionType
from vllm_ddtree.plugin.cpu_attention import DDTreeCPUBackend
from vllm_ddtree.plugin.options import DDTreeConfigError
from vllm_ddtree.plugin.support import check_attention_layers, check_target

# what the tiny drafter needs of a target: vocab 4096, hidden 192, >= 3 layers
SHAPE = dict(vocab_size=4096, hidden_size=192, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2, head_dim=32, intermediate_size=512,
             max_position_embeddings=2048, eos_token_id=2, pad_token_id=0)


def qwen3(**edits) -> dict:
    return dict(SHAPE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", **edits)


def target_dir(tmp_path: Path, config: dict) -> str:
    """A target directory: config.json (no weights) and the tiny pair's tokenizer."""
    path = tmp_path / "target"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(TARGET) / name, path / name)
    return str(path)


def engine_config(model: str, **kwargs):
    args = dict(model=model, dtype="float32", max_model_len=512,
                speculative_config=ddtree_spec(8))
    args.update(kwargs)
    return EngineArgs(**args).create_engine_config()


def assert_refused(model: str, *words, absent=(), **kwargs) -> str:
    with pytest.raises(DDTreeConfigError) as info:
        engine_config(model, **kwargs)
    message = str(info.value)
    assert message.startswith("ddtree: "), message
    assert "\n" not in message, "one error line"
    for word in words:
        assert word in message, (word, message)
    for word in absent:
        assert word not in message, (word, message)
    return message


# 1. configuration ----------------------------------------------------------------------------

# name -> (target config.json, words the error must contain)
REFUSED = {
    "hybrid_gdn": (
        dict(SHAPE, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
             shared_expert_intermediate_size=64, linear_num_value_heads=4,
             linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
             full_attention_interval=2),
        ("Qwen3NextForCausalLM", "recurrent layers", "layer_types linear_attention",
         "without ddtree"),
    ),
    "mamba": (
        dict(architectures=["MambaForCausalLM"], model_type="mamba", vocab_size=4096,
             hidden_size=192, num_hidden_layers=4, state_size=8, expand=2, conv_kernel=4,
             eos_token_id=2, pad_token_id=0),
        ("MambaForCausalLM", "recurrent layers", "layer_types linear_attention"),
    ),
    # the text config of Qwen3-VL carries this rope section (vLLM's ``uses_mrope``)
    "mrope": (
        qwen3(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                               "mrope_section": [8, 4, 4], "mrope_interleaved": True}),
        ("M-RoPE", "not supported yet", "without ddtree"),
    ),
    # no layer_types: vLLM puts the window on every layer (CacheConfig.sliding_window)
    "sliding_window_model_level": (
        dict(SHAPE, architectures=["MistralForCausalLM"], model_type="mistral",
             sliding_window=64),
        ("sliding-window attention (window 64 on 4 of 4 layers)", "--disable-sliding-window"),
    ),
    # max_window_layers=2: HF's layer_types mark layers 2 and 3 sliding
    "sliding_window_per_layer": (
        qwen3(use_sliding_window=True, sliding_window=64, max_window_layers=2),
        ("sliding-window attention (window 64 on 2 of 4 layers)", "--disable-sliding-window"),
    ),
    "reference_sliding_window": (
        qwen3(rswa_window=128),
        ("reference sliding-window attention (rswa_window=128)",),
    ),
    # alternating windows, and a learned sink on every layer without a config flag
    "gpt_oss_window_and_sinks": (
        dict(SHAPE, architectures=["GptOssForCausalLM"], model_type="gpt_oss",
             num_local_experts=4, num_experts_per_tok=2, sliding_window=64),
        ("GptOssForCausalLM", "sliding-window attention (window 64 on 2 of 4 layers)",
         "attention sinks", "without ddtree"),
    ),
    "attention_sinks": (
        dict(SHAPE, architectures=["GraniteForCausalLM"], model_type="granite",
             attention_sinks=True),
        ("GraniteForCausalLM", "attention sinks (attention_sinks)"),
    ),
    "soft_capping": (
        dict(SHAPE, architectures=["Gemma2ForCausalLM"], model_type="gemma2",
             sliding_window=None, attn_logit_softcapping=50.0),
        ("soft-capping (attn_logit_softcapping=50.0)",),
    ),
    "alibi": (
        dict(architectures=["FalconForCausalLM"], model_type="falcon", vocab_size=4096,
             hidden_size=192, num_hidden_layers=4, num_attention_heads=6, alibi=True,
             new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
             eos_token_id=2),
        ("FalconForCausalLM", "ALiBi"),
    ),
    "chunked_local_attention": (
        dict(SHAPE, architectures=["Llama4ForCausalLM"], model_type="llama4_text",
             attention_chunk_size=64, num_local_experts=2, num_experts_per_tok=1,
             intermediate_size_mlp=512, interleave_moe_layer_step=1, no_rope_layers=[1, 1, 1, 0]),
        ("Llama4ForCausalLM", "chunked local attention (attention_chunk_size=64)"),
    ),
    "dual_chunk_attention": (
        qwen3(dual_chunk_attention_config={"chunk_size": 256, "local_size": 64,
                                           "original_max_position_embeddings": 2048}),
        ("dual chunk attention",),
    ),
    "mla": (
        dict(SHAPE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
             kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
             first_k_dense_replace=4, n_group=1, topk_group=1),
        ("DeepseekV3ForCausalLM", "multi-head latent attention (MLA)"),
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_target_is_refused_at_engine_start(tmp_path, case):
    config, words = REFUSED[case]
    only_window = case.startswith("sliding_window_")
    message = assert_refused(target_dir(tmp_path, config), *words,
                             absent=() if only_window else ("--disable-sliding-window",))
    assert "does not support" in message or "not supported" in message, message


def test_hybrid_without_layer_types_is_refused(tmp_path):
    """Without ``layer_types`` (remote-code configs) vLLM's model registry is the signal."""
    config, _ = REFUSED["hybrid_gdn"]
    assert_refused(target_dir(tmp_path, config), "Qwen3NextForCausalLM", "recurrent layers",
                   "(Mamba / linear attention)", hf_overrides={"layer_types": None})


def test_pipeline_parallelism_defaults_to_the_static_policy_one_batch_at_a_time():
    """Under pipeline parallelism the budget policy defaults to "static", "auto" is refused at
    engine start (its cost model times whole forwards of the target on one worker), and the
    engine core runs one batch at a time (vLLM's batch queue would hand the scheduler a
    batch's drafts before its sampled tokens); without ddtree vLLM keeps its batch queue.
    The stages' serving: test_vllm_parallel.py and test_pipeline_stages.py."""
    spec = {key: value for key, value in ddtree_spec(8).items() if key != "ddtree_budget_policy"}
    config = engine_config(TARGET, speculative_config=spec, pipeline_parallel_size=2)
    assert config.additional_config["ddtree"]["budget_policy"] == "static"
    assert config.max_concurrent_batches == 1
    assert_refused(TARGET, "'auto'", "--pipeline-parallel-size 2", "'static'",
                   speculative_config=dict(spec, ddtree_budget_policy="auto"),
                   pipeline_parallel_size=2)
    assert engine_config(TARGET, speculative_config=None,
                         pipeline_parallel_size=2).max_concurrent_batches == 2


def test_bidirectional_multimodal_prefix_is_refused():
    """Multimodal targets cannot be configured here (vLLM inspects them with torchvision, which
    this CPU venv lacks): the tiny target's real configuration, with vLLM's own flag set."""
    config = engine_config(TARGET, speculative_config=None)
    check_target(config.model_config, config.parallel_config)  # the tiny target passes
    config.model_config.__dict__["is_mm_prefix_lm"] = True  # a cached_property of ModelConfig
    with pytest.raises(DDTreeConfigError, match=r"bidirectional multimodal prefix"):
        check_target(config.model_config, config.parallel_config)


@pytest.mark.parametrize("config, kwargs", [
    # Qwen3 checkpoints carry a window with use_sliding_window false: full attention
    (qwen3(use_sliding_window=False, sliding_window=4096, max_window_layers=28), {}),
    # a window, but max_window_layers >= num_hidden_layers: every layer is full attention
    (qwen3(use_sliding_window=True, sliding_window=64, max_window_layers=28), {}),
    (dict(SHAPE, architectures=["LlamaForCausalLM"], model_type="llama"), {}),
    # the fix the sliding-window error names: vLLM drops the window, caps max_model_len
    (dict(SHAPE, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=256),
     dict(disable_sliding_window=True, max_model_len=256)),
], ids=["qwen3_window_off", "qwen3_window_layers_past_the_end", "llama", "disable_sliding_window"])
def test_supported_targets_start(tmp_path, config, kwargs):
    """The tiny pair's own start is covered by test_vllm_config.py."""
    config = engine_config(target_dir(tmp_path, config), **kwargs)
    assert config.additional_config["ddtree"]["budget"] == 8
    assert config.cache_config.sliding_window is None  # vLLM agrees: no model-level window


# 2. built layers: fakes with vLLM's attribute names -------------------------------------------

# ``Attention`` and a ``CPU_ATTN`` impl with nothing trees lack (CPU_ATTN keeps "no window" as
# -1 and "no soft cap" as 0; TRITON_ATTN as (-1, -1) and 0)
PLAIN_LAYER = dict(sliding_window=None, attn_type=AttentionType.DECODER, has_sink=False,
                   use_mm_prefix=False, kv_sharing_target_layer_name=None,
                   attn_backend=DDTreeCPUBackend)
PLAIN_IMPL = dict(sliding_window=-1, logits_soft_cap=0, alibi_slopes=None, sinks=None)


def attention(impl=None, **layer):
    return SimpleNamespace(**{**PLAIN_LAYER, **layer},
                           impl=SimpleNamespace(**{**PLAIN_IMPL, **(impl or {})}))


class FlashMLABackend:  # stands for any backend that is not a ddtree tree backend
    pass


class ChunkedLocalTreeBackend(DDTreeCPUBackend):  # vLLM wraps a layer's backend by subclassing
    pass


# name -> (fake layer, words the error must contain)
REFUSED_LAYERS = {
    "sliding_window": (attention(sliding_window=128, impl=dict(sliding_window=128)),
                       "a sliding window 128"),
    "sliding_window_in_impl_only": (attention(impl=dict(sliding_window=(127, 0))),
                                    "a sliding window (127, 0)"),
    "sinks": (attention(has_sink=True, impl=dict(sinks=torch.zeros(6))), "attention sinks"),
    "static_sink_tokens": (attention(sink_len=4), "attention sinks"),
    "soft_capping": (attention(impl=dict(logits_soft_cap=30.0)), "logit soft-capping 30.0"),
    "alibi": (attention(impl=dict(alibi_slopes=torch.ones(6))), "ALiBi"),
    "chunked_local": (attention(attention_chunk_size=64, attn_backend=ChunkedLocalTreeBackend),
                      "chunked local attention (chunk 64)"),
    "cross_attention": (attention(attn_type=AttentionType.ENCODER_DECODER),
                        "encoder_decoder attention"),
    "encoder_only": (attention(attn_type=AttentionType.ENCODER_ONLY), "encoder_only attention"),
    "multimodal_prefix": (attention(use_mm_prefix=True), "bidirectional multimodal prefix"),
    "other_backend": (attention(attn_backend=FlashMLABackend),
                      "attention backend FlashMLABackend (not a ddtree tree backend)"),
    "mla": (attention(kv_lora_rank=512), "multi-head latent attention (MLA)"),
    "mamba": (SimpleNamespace(mamba_type="gdn_attention", kv_cache=()),
              "a recurrent state (Mamba / linear attention)"),
}


@pytest.mark.parametrize("case", list(REFUSED_LAYERS))
def test_layer_is_refused(case):
    layer, words = REFUSED_LAYERS[case]
    context = {"model.layers.0.self_attn.attn": attention(), "model.layers.1.attn": layer}
    with pytest.raises(DDTreeConfigError) as info:
        check_attention_layers(context, drafter_layer_names=())
    message = str(info.value)
    assert message.startswith("ddtree: tree attention does not support"), message
    assert f"{words} (1 layer, e.g. model.layers.1.attn)" in message, message
    assert message.count("(1 layer") == 1, f"one problem, no other: {message}"
    assert "without ddtree" in message and "\n" not in message


def test_layers_trees_can_serve_pass():
    context = {
        "cpu": attention(),
        "triton": attention(impl=dict(sliding_window=(-1, -1))),  # TRITON_ATTN's "no window"
        "shares_kv": attention(kv_sharing_target_layer_name="cpu"),  # compaction dedupes caches
        "moe": SimpleNamespace(quant_method=None),  # not attention: no impl
        "drafter": attention(sliding_window=64, impl=dict(sliding_window=64)),
    }
    check_attention_layers(context, drafter_layer_names={"drafter"})
    with pytest.raises(DDTreeConfigError, match=r"a sliding window 64 \(1 layer, e.g. drafter\)"):
        check_attention_layers(context, drafter_layer_names=())


def test_layer_problems_are_counted_in_one_line():
    context = {
        "a": attention(sliding_window=64),
        "b": attention(sliding_window=64, impl=dict(logits_soft_cap=50.0)),
        "c": attention(),
    }
    with pytest.raises(DDTreeConfigError) as info:
        check_attention_layers(context, drafter_layer_names=())
    assert ("a sliding window 64 (2 layers, e.g. a); logit soft-capping 50.0 (1 layer, e.g. b)"
            in str(info.value)), str(info.value)


# 2. built layers: real engines ---------------------------------------------------------------


def model_runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def test_real_layers_of_the_tiny_ddtree_engine_pass():
    llm = make_llm(ddtree_spec(8))
    try:
        runner = model_runner(llm)
        context = runner.compilation_config.static_forward_context
        drafter_layers = runner.drafter._draft_attn_layer_names
        target_layers = [name for name in context if name not in drafter_layers]
        assert len(target_layers) == 4 and drafter_layers <= set(context)
        check_attention_layers(context, drafter_layers)
    finally:
        close(llm)


def test_real_layers_with_windows_and_soft_capping_are_refused(tmp_path):
    """A random Gemma2 (windows on layers 0 and 2, soft-capping on all four) served without
    ddtree: the walk reads what vLLM's Gemma2 decided per layer."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=4096, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=32, sliding_window=256, attn_logit_softcapping=50.0,
                          max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0)
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(TARGET) / name, tmp_path / "gemma2" / name)
    llm = make_llm(None, model=str(tmp_path / "gemma2"), max_model_len=256)
    try:
        context = model_runner(llm).compilation_config.static_forward_context
        with pytest.raises(DDTreeConfigError) as info:
            check_attention_layers(context, drafter_layer_names=())
    finally:
        close(llm)
    message = str(info.value)
    assert "a sliding window 256 (2 layers, e.g. model.layers.0.self_attn.attn)" in message
    assert "logit soft-capping 50.0 (4 layers" in message
