"""Helpers for end-to-end tests through the real vLLM engine (CPU, float32, in-process)."""

import gc
import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PAIR = Path(__file__).resolve().parents[1] / "vllm_ddtree" / "assets" / "tiny_pair"
TARGET = str(PAIR / "target")
DRAFTER = str(PAIR / "drafter")

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "    for i in range(",
    "# Copyright (c) Python Software Foundation\n\"\"\"Utilities for ",
    "x",
]


def ddtree_spec(budget: int, **extra) -> dict:
    """A ddtree speculative config on the tiny pair. The budget policy is pinned to "static"
    unless given (the default, "auto", pauses a drafter that does not pay on this CPU: tests of
    trees need trees in every step)."""
    extra.setdefault("ddtree_budget_policy", "static")
    return {"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": budget, **extra}


# The K/V cache of a test engine unless the test sizes it: ~100k tokens of the tiny pair. A fixed
# size, not vLLM's default share of host RAM (gpu_memory_utilization), so an engine does not
# depend on the machine and starts ~2 s sooner (it allocates 0.25 GiB, not 30 % of the RAM).
KV_CACHE_BYTES = 1 << 28


def make_llm(speculative_config=None, **kwargs):
    from vllm import LLM

    # vLLM's model loader runs a full gc.collect() after loading each model (target and drafter:
    # ~4 passes over the heap an engine start, ~0.6-1 s each in a test process), and the heap
    # is mostly the ~650k objects the imports of vLLM, torch and transformers made. Frozen, the
    # passes skip them; vLLM freezes the heap itself at the end of its start-up and unfreezes it
    # at shutdown (``close``). One pass first: the garbage of an engine closed before (its
    # reference cycles) must be collected, not frozen with the rest (its K/V cache would stay).
    gc.collect()
    gc.freeze()

    args = dict(
        model=TARGET,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.3,  # only where a test sizes the cache in blocks
        max_model_len=512,
        seed=0,
        disable_log_stats=False,
    )
    if "num_gpu_blocks_override" not in kwargs and "gpu_memory_utilization" not in kwargs:
        args["kv_cache_memory_bytes"] = KV_CACHE_BYTES
    args.update(kwargs)
    return LLM(speculative_config=speculative_config, **args)


def close(llm) -> None:
    """Shut an engine down before the next one starts in this process. vLLM's own shutdown of
    an in-process engine core tears down its distributed state and collects garbage
    (``EngineCore.shutdown``: ``gc.unfreeze()``, ``cleanup_dist_env_and_memory()``); doing it
    again here cost ~1 s per engine."""
    llm.llm_engine.engine_core.shutdown()


def spec_metrics(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode") or metric.name == "vllm:num_preemptions":
            out[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return out


def mean_acceptance_length(metrics: dict) -> float:
    drafts = metrics.get("vllm:spec_decode_num_drafts", 0)
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
    return 1.0 + accepted / drafts if drafts else 1.0


def ddtree_state(llm):
    """The TreeState of the in-process engine's model runner."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    return runner.ddtree_state
