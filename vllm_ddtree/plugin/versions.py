"""What the plugin relies on in each vLLM version it supports, in one place.

The plugin wraps, subclasses and imports vLLM internals (``patches.py``, the attention
backends, the proposer, the sampler). :data:`REQUIREMENTS` lists every one of them with the
versions it applies to: the symbol, the parameters the plugin passes or receives by name, and
the source facts a patch relies on (how often a function reads an attribute, a statement it
must contain). :func:`check_live` holds them against the installed vLLM at install time;
``tests/test_vllm_versions.py`` holds them against the sources of every supported release
read from its wheel, so a drift is caught on a machine that has only one version installed.

Where the versions differ (each entry names its version):

* ``SpeculativeConfig.max_num_new_slots_for_drafting``: 0.32 charges a ``dflash`` request
  ``num_speculative_tokens`` (= B for ddtree) scheduler slots for its drafter pass; ddtree
  patches it to L (the drafter's mask queries). 0.33 charges 0 (the drafter runs its own
  query pass, and caps the running requests by ``max_num_batched_tokens //
  num_lookahead_tokens``, which ddtree sets to L + 1): left alone.
* ``is_quantized_kv_cache`` lives in ``vllm.v1.kv_cache_interface`` in both (0.33 removed the
  copy in ``vllm.utils.torch_utils``).
* ``Worker.compile_or_warm_up_model``: in 0.33 a thin wrapper over
  ``_compile_or_warm_up_model``; the plugin wraps the outer method, which both versions call.
* ``apply_top_k_top_p`` gained ``has_topp_only_rows=True`` in 0.33 (the plugin passes the
  first three arguments; the default is the general case).
* ``StructuredOutputManager.grammar_bitmask``: 0.32 lays each request's rows (its drafts, then
  the bonus row) one after the other; 0.33 gives each a fixed block of
  ``num_speculative_tokens + 1`` rows. The tree rows of ``grammar.py`` follow either.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass

SUPPORTED = ((0, 32), (0, 33))
ALL = SUPPORTED


def version_name(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}.x"


def supported_names() -> str:
    return " and ".join(version_name(v) for v in SUPPORTED)


@dataclass(frozen=True)
class Requirement:
    """A vLLM symbol the plugin uses, and what it relies on in it.

    ``module`` and ``qualname`` name the symbol where it is defined (``Class.method`` for a
    method, a property or an attribute; a plain name for a module-level object).
    ``params``: parameter names the function must accept. ``reads``: ``(text, count)`` pairs,
    ``text`` occurs exactly ``count`` times in the function's source. ``contains``: statements
    the source must contain (compared with runs of whitespace collapsed).
    """

    module: str
    qualname: str
    params: tuple[str, ...] = ()
    reads: tuple[tuple[str, int], ...] = ()
    contains: tuple[str, ...] = ()
    versions: tuple[tuple[int, int], ...] = ALL
    why: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
_TRITON_ATTN = "vllm.v1.attention.backends.triton_attn"
_RUNNER = "vllm.v1.worker.gpu_model_runner"

REQUIREMENTS: tuple[Requirement, ...] = (
    # patches.py: configuration
    Requirement("vllm.engine.arg_utils", "EngineArgs.create_speculative_config",
                ("target_model_config", "target_parallel_config")),
    Requirement("vllm.config.vllm", "VllmConfig._get_v2_model_runner_unsupported_features"),
    Requirement("vllm.config.vllm", "VllmConfig._validate_v1_model_runner"),
    Requirement("vllm.config.vllm", "VllmConfig._validate_v2_model_runner"),
    Requirement("vllm.config.vllm", "VllmConfig.__post_init__",
                contains=("if self.use_v2_model_runner: "
                          "self._disable_cudagraphs_for_v2_stock_torch_compile() "
                          "self._validate_v2_model_runner() else: "
                          "self._validate_v1_model_runner()",),
                why="the runner an engine uses is checked against the one its ddtree "
                    "configuration was made for"),
    Requirement("vllm.config.vllm", "VllmConfig.use_v2_model_runner",
                contains=("use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER",
                          "if not HAS_TRITON",
                          "unsupported = self._get_v2_model_runner_unsupported_features()"),
                why="options.choose_runner predicts it with the same rule"),
    Requirement("vllm.config.vllm", "VllmConfig.num_lookahead_tokens"),
    Requirement("vllm.config.speculative", "SpeculativeConfig.max_num_new_slots_for_drafting",
                versions=((0, 32),), why="patched to L for ddtree (dflash charges B)"),
    Requirement("vllm.config.speculative", "SpeculativeConfig.max_num_new_slots_for_drafting",
                contains=("if self.use_dflash() or self.use_dspark(): return 0",),
                versions=((0, 33),), why="left alone: dflash's drafter pass is charged 0"),
    Requirement("vllm.sampling_params", "SamplingParams._validate_spec_decode",
                ("speculative_config",)),
    Requirement("vllm.v1.kv_cache_interface", "is_quantized_kv_cache", ("kv_cache_dtype",)),
    # patches.py: the scheduler
    Requirement("vllm.v1.core.sched.scheduler", "Scheduler.__init__", ("vllm_config",),
                contains=("self.max_num_running_reqs =", "self.num_spec_tokens =")),
    Requirement("vllm.v1.core.sched.scheduler", "Scheduler.schedule",
                reads=(("self.dynamic_sd_lookup", 3),),
                why="a lookup of B at every batch size turns placeholder drafts off"),
    # patches.py and grammar.py: structured outputs with trees
    Requirement("vllm.v1.core.sched.scheduler", "Scheduler.update_draft_token_ids",
                ("draft_token_ids",),
                contains=("request.spec_token_ids = self.structured_output_manager."
                          "validate_tokens( request, spec_token_ids )",)),
    Requirement("vllm.v1.outputs", "DraftTokenIds",
                contains=("req_ids: list[str]", "draft_token_ids: list[list[int]]")),
    Requirement("vllm.v1.structured_output", "StructuredOutputManager.validate_tokens",
                ("request", "spec_tokens")),
    Requirement("vllm.v1.structured_output", "StructuredOutputManager._get_constraint_bounds",
                ("request", "spec_tokens")),
    Requirement("vllm.v1.structured_output", "StructuredOutputManager.grammar_bitmask",
                ("requests", "structured_output_request_ids", "scheduled_spec_decode_tokens"),
                contains=("apply_bitmask = not seen_padding and i >= constraint_start",
                          "if token == -1: seen_padding = True", "cumulative_index += 1",
                          "return bitmask_tensor.numpy()"),
                versions=((0, 32),),
                why="placeholder drafts give a request its root row and unconstrained rows, "
                    "one per draft then the bonus row, in request order"),
    Requirement("vllm.v1.structured_output", "StructuredOutputManager.grammar_bitmask",
                ("requests", "structured_output_request_ids", "scheduled_spec_decode_tokens"),
                contains=("apply_bitmask = not seen_padding and i >= constraint_start",
                          "if token == -1: seen_padding = True",
                          "mask_stride = max_num_spec_tokens + (0 if is_diffusion else 1)",
                          "cumulative_index = grammar_idx * mask_stride",
                          "return bitmask_tensor.numpy()"),
                versions=((0, 33),),
                why="as 0.32, each request in a fixed block of num_speculative_tokens + 1 rows"),
    Requirement("vllm.v1.structured_output.backend_types", "StructuredOutputGrammar.accept_tokens",
                ("request_id", "tokens")),
    Requirement("vllm.v1.structured_output.backend_types",
                "StructuredOutputGrammar.validate_tokens", ("tokens",)),
    Requirement("vllm.v1.structured_output.backend_types", "StructuredOutputGrammar.rollback",
                ("num_tokens",)),
    Requirement("vllm.v1.structured_output.backend_types", "StructuredOutputGrammar.fill_bitmask",
                ("bitmask", "batch_index")),
    Requirement("vllm.v1.structured_output.backend_types",
                "StructuredOutputGrammar.is_terminated"),
    # patches.py: the model runner and the workers
    Requirement(_RUNNER, "GPUModelRunner.__init__", ("vllm_config", "device"),
                contains=("logitsprocs=build_logitsprocs(",),
                why="the input batch's processors, replaced by the built-in ones for ddtree"),
    Requirement("vllm.v1.sample.logits_processor", "build_logitsprocs",
                contains=("if vllm_config.speculative_config: if custom_logitsprocs: raise "
                          "ValueError(STR_SPEC_DEC_REJECTS_LOGITSPROCS)",),
                why="custom logits processors are refused under speculative decoding"),
    Requirement("vllm.v1.sample.logits_processor", "BUILTIN_LOGITS_PROCESSORS"),
    Requirement("vllm.v1.sample.logits_processor", "LogitsProcessors"),
    Requirement("vllm.utils.torch_utils", "PIN_MEMORY"),
    Requirement(_RUNNER, "GPUModelRunner.initialize_kv_cache", ("kv_cache_config",)),
    Requirement(_RUNNER, "GPUModelRunner._prepare_inputs",
                ("scheduler_output", "num_scheduled_tokens"),
                reads=(("self.speculative_config", 1),),
                contains=("use_spec_decode = self.speculative_config is not None",
                          "self.req_indices.np[:total_num_scheduled_tokens] = req_indices",
                          "cu_num_tokens = self._get_cumsum_and_arange( num_scheduled_tokens, "
                          "self.query_pos.np )"),
                why="the host req_indices / query_pos of the step's rows (depth positions)"),
    Requirement(_RUNNER, "GPUModelRunner._sample", ("logits", "spec_decode_metadata")),
    Requirement(_RUNNER, "GPUModelRunner.sample_tokens", ("grammar_output",),
                reads=(("self.speculative_config", 1),),
                contains=("spec_config = self.speculative_config",
                          "if spec_config is not None: self.finalize_kv_connector()",
                          "self._draft_token_ids = None"),
                why="a paused drafter's step runs without speculation from _prepare_inputs to "
                    "here: its speculative config is read once, for the drafter hand-off and "
                    "the deferred K/V-connector finalisation"),
    Requirement(_RUNNER, "GPUModelRunner.execute_model",
                reads=(("self.speculative_config", 4),),
                contains=("defer_kv_connector_finalize = self.speculative_config is not None",
                          "use_spec_decode = self.speculative_config is not None"),
                why="without speculation a step finalises the K/V connector after its forward; "
                    "use_spec_decode matters to linear-attention layers only"),
    Requirement(_RUNNER, "GPUModelRunner._preprocess",
                reads=(("self.speculative_config", 1),),
                contains=("if self.speculative_config is not None: "
                          "self.input_ids.gpu[:num_input_tokens].clamp_(min=0)",),
                why="placeholder drafts (-1), which a step without drafts has none of"),
    Requirement(_RUNNER, "GPUModelRunner._build_attention_metadata",
                reads=(("self.speculative_config", 3),),
                contains=("if self.speculative_config and spec_decode_common_attn_metadata is "
                          "None:",),
                why="the drafter's metadata, which a paused drafter's step does not use"),
    Requirement(_RUNNER, "GPUModelRunner._update_states_after_model_execute",
                reads=(("self.speculative_config", 1),),
                contains=("if not self.speculative_config or not self.model_config.is_hybrid: "
                          "return",),
                why="hybrid (linear-attention) models only"),
    Requirement(_RUNNER, "GPUModelRunner._input_fits_in_drafter", ("common_attn_metadata",)),
    Requirement(_RUNNER, "GPUModelRunner.take_draft_token_ids"),
    Requirement(_RUNNER, "GPUModelRunner.propose_draft_token_ids",
                ("scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                 "sample_hidden_states", "aux_hidden_states")),
    Requirement("vllm.v1.worker.gpu_worker", "Worker.compile_or_warm_up_model"),
    Requirement("vllm.v1.worker.cpu_worker", "CPUWorker.compile_or_warm_up_model"),
    # the proposer (a DFlashProposer subclass)
    Requirement("vllm.v1.spec_decode.dflash", "DFlashProposer.__init__",
                ("vllm_config", "device", "runner")),
    Requirement("vllm.v1.spec_decode.dflash", "DFlashProposer.set_inputs_first_pass"),
    Requirement("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.propose",
                ("num_speculative_tokens",)),
    Requirement("vllm.v1.spec_decode.llm_base_proposer",
                "SpecDecodeBaseProposer._sample_draft_tokens",
                ("hidden_states", "sampling_metadata")),
    # the sampler
    Requirement("vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_top_p",
                ("logits", "k", "p")),
    Requirement("vllm.v1.sample.ops.topk_topp_sampler", "TopKTopPSampler.forward_native",
                ("logits", "generators", "k", "p")),
    Requirement("vllm.v1.outputs", "SamplerOutput"),
    Requirement("vllm.v1.outputs", "LogprobsTensors"),
    Requirement("vllm.v1.sample.sampler", "Sampler.gather_logprobs",
                ("logprobs", "num_logprobs", "token_ids")),
    Requirement("vllm.v1.sample.sampler", "Sampler.gather_specific_token_logprobs",
                ("logprobs", "logprob_token_ids", "sampled")),
    # features.py: what vLLM's sampler applies per row, read from its processors' state
    Requirement("vllm.v1.sample.metadata", "SamplingMetadata",
                contains=("allowed_token_ids_mask: torch.Tensor | None",
                          "bad_words_token_ids: dict[int, list[list[int]]]",
                          "output_token_ids: list[list[int]]",
                          "logprob_token_ids: dict[int, list[int]] | None = None")),
    Requirement("vllm.v1.sample.logits_processor.builtin", "MinTokensLogitsProcessor.__init__",
                contains=("self.min_toks: dict[int, tuple[int, Sequence[int], set[int], "
                          "bool]] = {}",)),
    Requirement("vllm.v1.sample.logits_processor.builtin", "LogitBiasLogitsProcessor.__init__",
                contains=("self.biases: dict[int, dict[int, float]] = {}",)),
    Requirement("vllm.v1.sample.logits_processor.builtin", "MinPLogitsProcessor.__init__",
                contains=("self.min_p_count: int = 0",
                          "self.min_p_cpu = self.min_p_cpu_tensor.numpy()")),
    Requirement("vllm.v1.sample.logits_processor.builtin", "MinPLogitsProcessor.apply",
                contains=("adjusted_min_p = max_probabilities.mul_(self.min_p)",
                          "invalid_token_mask = probability_values < adjusted_min_p")),
    Requirement("vllm.v1.sample.sampler", "Sampler.apply_logits_processors",
                contains=("logits.masked_fill_(sampling_metadata.allowed_token_ids_mask, "
                          "float(\"-inf\"))",
                          "apply_bad_words(logits, bad_words_token_ids, output_token_ids)",
                          "for processor in sampling_metadata.logitsprocs.non_argmax_invariant: "
                          "logits = processor.apply(logits)",
                          "logits = self.apply_penalties(logits, sampling_metadata, "
                          "output_token_ids)"),
                why="features.py applies the same steps in the same order"),
    Requirement("vllm.model_executor.layers.utils", "apply_penalties",
                contains=("apply_repetition_penalties(logits, prompt_mask, output_mask, "
                          "repetition_penalties)",
                          "logits -= frequency_penalties.unsqueeze(dim=1) * output_bin_counts",
                          "logits -= presence_penalties.unsqueeze(dim=1) * output_mask")),
    Requirement("vllm.model_executor.layers.utils", "get_token_bin_counts_and_mask"),
    Requirement("vllm._custom_ops", "apply_repetition_penalties",
                ("logits", "prompt_mask", "output_mask", "repetition_penalties")),
    # the attention backends (subclasses)
    Requirement("vllm.v1.attention.backends.registry", "register_backend"),
    Requirement("vllm.v1.attention.backends.registry", "AttentionBackendEnum"),
    Requirement(_CPU_ATTN, "CPUAttentionBackend",
                contains=("forward_includes_kv_cache_update: bool = False",),
                why="K/V is written by a separate update before forward: a step whose rows "
                    "are all tree rows skips the stock kernel"),
    Requirement(_CPU_ATTN, "CPUAttentionMetadata"),
    Requirement(_CPU_ATTN, "CPUAttentionMetadataBuilder.build",
                ("common_prefix_len", "common_attn_metadata", "fast_build")),
    Requirement(_CPU_ATTN, "CPUAttentionBackendImpl.forward",
                ("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")),
    Requirement(_TRITON_ATTN, "TritonAttentionBackend"),
    Requirement(_TRITON_ATTN, "TritonAttentionMetadata"),
    Requirement(_TRITON_ATTN, "TritonAttentionMetadataBuilder.build",
                ("common_prefix_len", "common_attn_metadata", "fast_build")),
    Requirement(_TRITON_ATTN, "TritonAttentionImpl.forward",
                ("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
                 "output_scale", "output_block_scale")),
    Requirement("vllm.v1.attention.backend", "AttentionCGSupport"),
    # pipeline parallelism (stages.py)
    Requirement("vllm.config.vllm", "VllmConfig.max_concurrent_batches",
                contains=("pp_size = self.parallel_config.pipeline_parallel_size",),
                why="patched to 1 for ddtree under pipeline parallelism"),
    Requirement("vllm.v1.engine.core", "EngineCore.__init__",
                contains=("self.batch_queue_size = vllm_config.max_concurrent_batches",
                          "if self.batch_queue_size > 1:"),
                why="one batch in flight: the engine core steps without its batch queue"),
    Requirement("vllm.v1.core.sched.scheduler", "Scheduler.__init__",
                contains=("self.use_pp = self.parallel_config.pipeline_parallel_size > 1",)),
    Requirement("vllm.v1.core.sched.output", "CachedRequestData",
                contains=("resumed_req_ids: set[str]", "num_computed_tokens: list[int]")),
    Requirement(_RUNNER, "GPUModelRunner._setup_eagle3_aux_hidden_state_outputs",
                contains=("self.model.set_aux_hidden_state_layers(aux_layers)",),
                why="every stage knows the drafter's target layers"),
    Requirement(_RUNNER, "GPUModelRunner._get_eagle3_aux_layers_from_config"),
    Requirement("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils",
                "reserve_aux_intermediate_tensor_slots", ("model",)),
    Requirement("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils",
                "verify_supports_aux_hidden_states_over_pp", ("model", "method")),
    Requirement("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils",
                "aux_hidden_state_relay_keys", ("model",)),
    Requirement(_RUNNER, "GPUModelRunner._model_forward",
                ("input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
                why="a middle stage's output gets the earlier stages' drafter hidden states"),
    Requirement(_RUNNER, "GPUModelRunner.execute_model",
                contains=("model_output = self._model_forward( input_ids=input_ids, "
                          "positions=positions, intermediate_tensors=intermediate_tensors,",),
                why="the forward's intermediate tensors are passed by keyword"),
    Requirement(_RUNNER, "GPUModelRunner.sync_and_gather_intermediate_tensors",
                contains=("assert self.intermediate_tensors is not None",),
                why="a later stage's receive buffers, which vLLM's CPU worker never makes"),
    Requirement(_RUNNER, "GPUModelRunner.execute_model",
                contains=("deferred_state_corrections_fn = self._update_states(scheduler_output)",
                          "self._prepare_inputs(scheduler_output, num_scheduled_tokens_np)"),
                why="a stage's K/V moves read the block tables the step's update wrote"),
    Requirement(_RUNNER, "GPUModelRunner._update_states", ("scheduler_output",),
                contains=("num_new_tokens = ( num_computed_tokens + len(new_token_ids) - "
                          "req_state.num_tokens )",
                          "req_state.output_token_ids.extend( new_token_ids[-num_new_tokens:] )"),
                why="a stage before the last keeps its token history from the scheduler's "
                    "tokens; the plugin completes it with the accepted drafts first"),
    Requirement("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.load_model",
                ("target_model",)),
    Requirement("vllm.v1.spec_decode.llm_base_proposer",
                "SpecDecodeBaseProposer._maybe_share_embeddings",
                contains=("if get_pp_group().world_size == 1:",),
                why="under pipeline parallelism vLLM does not share the target's embedding with "
                    "the drafter: the last stage loads it (proposer.load_target_embedding)"),
    Requirement("vllm.model_executor.model_loader.weight_utils", "download_weights_from_hf",
                ("model_name_or_path", "cache_dir", "allow_patterns", "revision")),
    Requirement("vllm.model_executor.model_loader.weight_utils", "default_weight_loader",
                ("param", "loaded_weight")),
    Requirement("vllm.v1.worker.block_table", "BlockTable.__init__",
                contains=("self.block_size = block_size",)),
)


# Model Runner V2 (vllm_ddtree/plugin/v2)
_V2 = "vllm.v1.worker.gpu"
_V2_RUNNER = f"{_V2}.model_runner"
_V2_DFLASH = f"{_V2}.spec_decode.dflash.speculator"
_V2_MODEL_STATE = f"{_V2}.model_states.interface"
_V2_PP = f"{_V2}.pp_utils"

REQUIREMENTS += (
    # patches._install_v2: the two functions V2 builds a speculator and a model state with
    Requirement(f"{_V2}.spec_decode", "init_speculator", ("vllm_config", "device", "req_states"),
                why="patched: ddtree engines get DDTreeSpeculator"),
    Requirement(_V2_RUNNER, "GPUModelRunner.__init__", ("vllm_config", "device"),
                contains=("self.speculator = init_speculator( self.vllm_config, self.device, "
                          "self.req_states )",),
                why="the runner's own name of init_speculator, patched too"),
    Requirement(f"{_V2}.model_states", "resolve_model_state_cls", ("vllm_config", "model"),
                why="patched: the target's model state gets the tree mixin in front"),
    Requirement(f"{_V2}.model_states", "init_model_state",
                contains=("cls = resolve_model_state_cls(vllm_config, model)",)),
    # the model state's hooks (model_state.py) and where the runner calls them
    Requirement(_V2_MODEL_STATE, "ModelState.add_request", ("req_index", "new_req_data")),
    Requirement(_V2_MODEL_STATE, "ModelState.initialize_kv_cache",
                ("kv_cache_config", "block_tables")),
    Requirement(_V2_MODEL_STATE, "ModelState.preprocess_state",
                ("input_batch", "block_tables", "kv_cache_config", "num_computed_tokens")),
    Requirement(_V2_MODEL_STATE, "ModelState.prepare_attn",
                ("input_batch", "cudagraph_mode", "block_tables", "slot_mappings",
                 "attn_groups", "kv_cache_config", "for_capture")),
    Requirement(_V2_MODEL_STATE, "ModelState.prepare_inputs", ("input_batch", "req_states")),
    Requirement(_V2_MODEL_STATE, "ModelState.prepare_dummy_inputs", ("num_reqs", "num_tokens")),
    Requirement(_V2_MODEL_STATE, "ModelState.custom_sampler", ("sampler",)),
    Requirement(_V2_RUNNER, "GPUModelRunner.execute_model",
                contains=("self.model_state.preprocess_state( input_batch, block_tables, "
                          "self.kv_cache_config, self.req_states.num_computed_tokens.gpu, )",
                          "attn_metadata = self.model_state.prepare_attn( input_batch,",
                          "**self.model_state.prepare_inputs(input_batch, self.req_states),"),
                why="the verify trees are built before the attention metadata, the depth "
                    "positions override the runner's"),
    Requirement(_V2_RUNNER, "GPUModelRunner.load_model",
                contains=("custom = self.model_state.custom_sampler(self.sampler)",
                          "self.sampler, self.rejection_sampler = custom")),
    Requirement(_V2_RUNNER, "GPUModelRunner.initialize_kv_cache",
                contains=("self.speculator.set_attn( self.model_state,",
                          "self.model_state.initialize_kv_cache(self.kv_cache_config, "
                          "self.block_tables)"),
                why="the speculator meets the model state's TreeStep in set_attn"),
    Requirement(_V2_RUNNER, "GPUModelRunner.sample",
                contains=("sampler_output = self.rejection_sampler( logits, input_batch,",
                          "self.speculator.draft_logits, invalid_drafts, )"),
                why="the verifier's call; steps without drafts use vLLM's sampler"),
    # v2/pipeline.py: the stages before the last get the trees with vLLM's broadcast of the
    # drafts, and move their own K/V at consume time (patches._wrap_v2_load_model)
    Requirement(_V2_RUNNER, "GPUModelRunner.load_model",
                contains=("self.model_state = init_model_state(",),
                why="wrapped: the runner's pp_handler gets the model state's TreeStep"),
    Requirement(_V2_PP, "PendingRecv",
                contains=("sampled_tokens: torch.Tensor", "num_sampled: torch.Tensor",
                          "idx_mapping: torch.Tensor", "idx_mapping_np: np.ndarray",
                          "need_sampled_mask: np.ndarray", "gen_at_receive_np: np.ndarray",
                          "draft_tokens: torch.Tensor | None = None")),
    Requirement(_V2_PP, "PPHandler.__init__",
                contains=("self.last_rank = get_pp_group().last_rank",
                          "self.main_stream = torch.cuda.current_stream(device)",
                          "self.broadcast_stream = torch.cuda.Stream(device)",
                          "self.req_idx_gen_np = np.zeros(max_num_reqs, dtype=np.int32)",
                          "self.broadcast_group = get_pp_group().make_sibling_device_group(")),
    Requirement(_V2_PP, "PPHandler.get_prev_sampled_outputs", ("draft_tokens_to_update",),
                contains=("slot = self.queue.popleft()",
                          "freed = self.req_idx_gen_np[slot.idx_mapping_np] != "
                          "slot.gen_at_receive_np",
                          "exclude_mask = freed | ~slot.need_sampled_mask"),
                versions=((0, 32),)),
    Requirement(_V2_PP, "PPHandler.get_prev_sampled_outputs",
                contains=("slot = self.queue.popleft()",
                          "freed = self.req_idx_gen_np[slot.idx_mapping_np] != "
                          "slot.gen_at_receive_np",
                          "exclude_mask = freed | ~slot.need_sampled_mask"),
                versions=((0, 33),)),
    Requirement(_V2_PP, "PPHandler.receive", ("input_batch",),
                contains=("self.queue[-1] = PendingRecv(",), versions=((0, 32),)),
    Requirement(_V2_PP, "PPHandler.receive", ("input_batch", "recv_drafts"),
                contains=("self.queue[-1] = PendingRecv(",), versions=((0, 33),)),
    Requirement(_V2_PP, "PPHandler.broadcast_drafts", ("draft_tokens", "input_batch"),
                contains=("if compute_need_sampled_mask(input_batch) is None: return",),
                versions=((0, 32),)),
    Requirement(_V2_PP, "PPHandler.broadcast_drafts", ("draft_tokens",),
                contains=("if self.sampled_tokens_broadcast:",), versions=((0, 33),)),
    Requirement(_V2_PP, "compute_need_sampled_mask", ("input_batch",)),
    Requirement("vllm.v1.core.sched.scheduler", "Scheduler.__init__",
                contains=("self.use_v2_model_runner = vllm_config.use_v2_model_runner",),
                why="V1's pipeline stages get trees through the scheduler, V2's do not"),
    # a budget table is vLLM's dynamic speculation length (options.dynamic_sd_schedule)
    Requirement("vllm.v1.core.sched.scheduler", "Scheduler.__init__",
                contains=("self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup( "
                          "speculative_config.num_speculative_tokens_per_batch_size,",)),
    Requirement(_V2_RUNNER, "GPUModelRunner.sample_tokens",
                contains=("num_spec_tokens = self.execute_model_state."
                          "num_spec_tokens_to_schedule",
                          "draft_tokens[:, num_spec_tokens:] = -1"),
                why="the step's table budget cuts the drafted trees to their first nodes"),
    Requirement(f"{_V2}.input_batch", "InputBatch",
                contains=("num_draft_tokens_per_req: np.ndarray | None",
                          "cu_num_logits: torch.Tensor", "cu_num_logits_np: np.ndarray",
                          "logits_indices: torch.Tensor",
                          "query_start_loc_np: np.ndarray", "num_tokens_after_padding: int",
                          "seq_lens_cpu_upper_bound: torch.Tensor")),
    Requirement(f"{_V2}.input_batch", "get_num_sampled_and_rejected",
                ("num_sampled", "seq_lens", "cu_num_logits", "idx_mapping", "prefill_len")),
    Requirement(f"{_V2}.block_table", "BlockTables.__init__",
                contains=("self.slot_mappings = torch.zeros(",),
                why="each row's K/V slot per group (compaction), persistent"),
    # the speculator (a DFlashSpeculator subclass)
    Requirement(_V2_DFLASH, "DFlashSpeculator.__init__", ("vllm_config", "device"),
                contains=("self.num_query_per_req = 1 + self.num_speculative_steps",)),
    Requirement(f"{_V2}.spec_decode.speculator", "DraftModelSpeculator.__init__",
                contains=("self.num_speculative_steps = "
                          "self.speculative_config.num_speculative_tokens",),
                why="built with num_speculative_tokens = L: the drafter's query block"),
    Requirement(f"{_V2}.spec_decode.speculator", "DraftModelSpeculator.load_model",
                contains=("self.draft_attn_layer_names = set(all_attn_layers) - "
                          "target_attn_layer_names",)),
    Requirement(_V2_DFLASH, "DFlashSpeculator.set_attn",
                ("model_state", "kv_cache_config", "block_tables")),
    Requirement(_V2_DFLASH, "DFlashSpeculator._run_model",
                ("num_tokens", "attn_metadata", "slot_mappings", "num_tokens_across_dp",
                 "cudagraph_runtime_mode")),
    Requirement(_V2_DFLASH, "DFlashSpeculator._generate_draft",
                ("num_reqs", "num_tokens_padded", "attn_metadata", "slot_mappings",
                 "num_tokens_across_dp", "cudagraph_runtime_mode"),
                contains=("sample_hidden_states = last_hidden_states[self.sample_indices"
                          "[:num_sample]]",
                          "self.sample_pos[:num_sample] - 1,",
                          "self.sample_idx_mapping[:num_sample],"),
                why="overridden: the sample rows' logits build the tree"),
    Requirement(_V2_DFLASH, "DFlashSpeculator._num_graph_context_tokens", ("num_reqs",)),
    Requirement(_V2_DFLASH, "DFlashSpeculator.propose",
                ("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states",
                 "aux_hidden_states", "num_rejected"),
                contains=("hidden_states = self.model.combine_hidden_states( "
                          "torch.cat(aux_hidden_states, dim=-1) )",
                          "self.hidden_states[:num_target_tokens].copy_(hidden_states"
                          "[:num_target_tokens])"),
                versions=((0, 32),),
                why="DFlash reads the first num_target_tokens rows of each auxiliary hidden "
                    "state, which DDTreeSpeculator.propose hands it gathered"),
    Requirement(_V2_DFLASH, "DFlashSpeculator.propose",
                ("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states",
                 "aux_hidden_states", "num_rejected"),
                contains=("if num_speculative_tokens == 0:",),
                versions=((0, 33),),
                why="as 0.32 (_store_hidden_states); a step whose batch verifies no draft next "
                    "stores the context only"),
    Requirement(_V2_DFLASH, "DFlashSpeculator._store_hidden_states",
                contains=("[h[:start] for h in aux_hidden_states]",
                          "torch.cat([h[start:num_tokens] for h in aux_hidden_states], dim=-1)"),
                versions=((0, 33),), why="0.33 reads the auxiliary hidden states here"),
    # the verifier
    Requirement(f"{_V2}.sample.sampler", "Sampler.sample",
                ("logits", "expanded_idx_mapping", "idx_mapping", "idx_mapping_np", "pos",
                 "input_ids", "expanded_local_pos", "seq_lens_upper_bound_np",
                 "return_logprobs")),
    Requirement(f"{_V2}.sample.sampler", "Sampler.get_logprobs_dims", ("idx_mapping_np",)),
    Requirement(f"{_V2}.sample.sampler", "Sampler.__init__",
                contains=("self.needs_logits_processing = np.zeros(max_num_reqs, dtype=bool)",
                          "self.logprob_token_ids_state = LogprobTokenIdsState(",
                          "self.logits_processors: list[LogitsProcessor] = [ logit_bias_state, "
                          "self.penalties_state, bad_words_state, *custom_logits_processors, ]")),
    # verifier.TreePenalties: vLLM's kernel on each tree row with its path's counts
    Requirement(f"{_V2}.sample.penalties", "PenaltiesState.__init__",
                contains=("self.repetition_penalty = UvaBackedTensor(max_num_reqs, "
                          "dtype=torch.float32)",
                          "self.frequency_penalty = UvaBackedTensor(max_num_reqs, "
                          "dtype=torch.float32)",
                          "self.presence_penalty = UvaBackedTensor(max_num_reqs, "
                          "dtype=torch.float32)",
                          "self.use_penalty = np.zeros(max_num_reqs, dtype=bool)",
                          "self.prompt_bin_mask = torch.zeros(",
                          "self.output_bin_counts = torch.zeros(")),
    Requirement(f"{_V2}.sample.penalties", "PenaltiesState.apply", ("logits", "ctx")),
    Requirement(f"{_V2}.sample.penalties", "apply_penalties",
                ("logits", "expanded_idx_mapping", "token_ids", "expanded_local_pos",
                 "repetition_penalty", "frequency_penalty", "presence_penalty",
                 "prompt_bin_mask", "output_bin_counts")),
    # verifier: structured-output rows past what the scheduler checked are marked invalid
    Requirement(f"{_V2}.structured_outputs", "grammar_invalid_drafts",
                ("input_batch", "grammar_req_ids", "num_acceptable_drafts"),
                contains=("return local_pos > row_limit",),
                why="a chain node whose own row is marked is never accepted"),
    # verifier.TreeBadWords: the words by slot, each row's history from the request's output
    Requirement(f"{_V2}.sample.bad_words", "BadWordsState.__init__",
                contains=("self.bad_word_token_ids = StagedWriteTensor(",
                          "self.bad_word_offsets = StagedWriteTensor(",
                          "self.num_bad_words = UvaBackedTensor(max_num_reqs, "
                          "dtype=torch.int32)")),
    Requirement(f"{_V2}.sample.bad_words", "BadWordsState.apply", ("logits", "ctx"),
                contains=("self.req_states.all_token_ids.gpu, self.req_states.prompt_len.gpu, "
                          "self.req_states.total_len.gpu,",)),
    Requirement(f"{_V2}.sample.bad_words", "BadWordsState.add_request",
                ("req_idx", "sampling_params"),
                contains=("bad_words_token_ids = sampling_params.bad_words_token_ids",)),
    Requirement(f"{_V2}.sample.states", "SamplingStates.__init__",
                contains=("self.temperature = UvaBackedTensor(max_num_reqs, "
                          "dtype=torch.float32)",
                          "self.seeds = UvaBackedTensor(max_num_reqs, dtype=torch.int64)")),
    # hsd_chain: the verifier samples by vLLM's unfused path, whose logits hold each row's
    # law (HSD reads it); the noise is keyed by each request's seed (every request has one)
    Requirement(f"{_V2}.sample.sampler", "Sampler.apply_sampling_params",
                ("logits", "expanded_idx_mapping", "idx_mapping", "idx_mapping_np", "pos",
                 "input_ids", "expanded_local_pos", "seq_lens_upper_bound_np",
                 "skip_top_k_top_p"),
                contains=("return self.sampling_states.apply_top_k_top_p( logits, "
                          "expanded_idx_mapping, idx_mapping_np )",)),
    Requirement(f"{_V2}.sample.sampler", "Sampler._sample_random",
                contains=("sampled = gumbel_sample( processed_logits, "
                          "expanded_idx_mapping, self.sampling_states.temperature.gpu, "
                          "self.sampling_states.seeds.gpu, pos, apply_temperature=False, "
                          "is_drafting=False, use_fp64=self.use_fp64_gumbel, )",),
                why="the verifier's hsd_chain path is this one, unfused"),
    Requirement(f"{_V2}.sample.gumbel", "gumbel_sample",
                ("logits", "expanded_idx_mapping", "temperature", "seed", "pos",
                 "apply_temperature", "is_drafting")),
    Requirement(f"{_V2}.spec_decode.speculator", "DraftModelSpeculator.__init__",
                contains=("self.seeds = torch.zeros(self.max_num_reqs, dtype=torch.int64, "
                          "device=device)",),
                why="hsd_chain draws a request's chain with its temperature and seed"),
    Requirement(f"{_V2}.sample.logprob", "compute_topk_scores",
                ("logits", "num_logprobs", "sampled_token_ids", "cu_num_logits",
                 "logprob_token_ids_state", "expanded_idx_mapping", "max_per_req_token_ids",
                 "logits_mode")),
    Requirement(f"{_V2}.metrics.logits", "get_num_nans"),
    Requirement(f"{_V2}.sample.output", "SamplerOutput",
                contains=("sampled_token_ids: torch.Tensor", "num_sampled: torch.Tensor",
                          "num_rejected: torch.Tensor")),
)


def requirements_for(version: tuple[int, int]) -> list[Requirement]:
    return [r for r in REQUIREMENTS if tuple(version) in r.versions]


def grammar_rows_in_fixed_blocks(version: tuple[int, int]) -> bool:
    """Whether vLLM's structured-output bitmask gives each request a fixed block of
    ``num_speculative_tokens + 1`` rows (0.33) rather than its drafts + 1 rows in turn (0.32)."""
    return tuple(version) >= (0, 33)


def patches_draft_slots(version: tuple[int, int]) -> bool:
    """Whether ddtree patches ``max_num_new_slots_for_drafting`` on this version."""
    return tuple(version) < (0, 33)


def _collapse(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def check_source(req: Requirement, source: str | None, params: list[str] | None) -> list[str]:
    """What is wrong with ``req`` given the symbol's source (None: unknown) and parameter
    names (None: not a function); shared by the live check and the wheel test."""
    problems = []
    if req.params:
        if params is None:
            problems.append("is not a function")
        else:
            missing = [p for p in req.params if p not in params]
            if missing:
                problems.append(f"lacks parameters {missing}")
    if req.reads or req.contains:
        if source is None:
            problems.append("has no readable source (install vLLM with its Python sources)")
        else:
            for text, count in req.reads:
                found = source.count(text)
                if found != count:
                    problems.append(f"reads {text} {found} times, not {count}")
            flat = _collapse(source)
            for statement in req.contains:
                if _collapse(statement) not in flat:
                    problems.append(f"no longer contains `{statement}`")
    return problems


def _live_symbol(req: Requirement):
    module = importlib.import_module(req.module)
    owner, *rest = req.qualname.split(".")
    obj = getattr(module, owner, None)
    for part in rest:
        if obj is None:
            break
        obj = inspect.getattr_static(obj, part, None)
    return obj


def check_live(version: tuple[int, int]) -> None:
    """Every requirement of ``version`` against the installed vLLM; ImportError naming each
    broken one."""
    problems = []
    for req in requirements_for(version):
        obj = _live_symbol(req)
        if obj is None:
            problems.append(f"{req.name}: missing")
            continue
        func = obj.fget if isinstance(obj, property) else obj
        func = getattr(func, "__func__", func)  # staticmethod / classmethod
        func = inspect.unwrap(func)  # vLLM's own code under any functools.wraps wrapper
        params = None
        if inspect.isfunction(func):
            params = list(inspect.signature(func).parameters)
        source = None
        if req.reads or req.contains:
            try:
                source = inspect.getsource(func)
            except (OSError, TypeError):
                source = None
        problems += [f"{req.name}: {p}" for p in check_source(req, source, params)]
    if problems:
        raise ImportError(
            "vllm-ddtree: the installed vLLM differs from the vLLM "
            f"{version_name(version)} this plugin knows: " + "; ".join(problems)
        )
