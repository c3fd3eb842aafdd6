"""The ddtree options of ``--speculative-config``, parsed and validated (no vLLM imports).

User-facing keys (everything else passes through to vLLM's ``SpeculativeConfig``)::

    {"method": "ddtree",                 # this plugin
     "model": "<DFlash drafter>",        # directory or hub id in z-lab's format
     "num_speculative_tokens": 64,       # B: tree budget = draft nodes per request, 1..1024
     "ddtree_depth": 15,                 # optional: L, default drafter block_size - 1
     "ddtree_mode": "tree"}              # optional: "tree" (default) or "hsd_chain"

``"hsd_chain"`` drafts a chain of ``num_speculative_tokens`` (<= L) tokens SAMPLED from the
drafter's distributions at each request's temperature and verifies it with the lossless HSD
sampler (:func:`vllm_ddtree.sampling.hsd_verify`); greedy requests get argmax chains.

Inside vLLM the method stays ``"dflash"`` (its DFlash drafter, model and KV plumbing are
reused) and these options travel in ``additional_config["ddtree"]``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MAX_BUDGET = 1024  # the Triton kernels and the mask packing are tested up to 1024 nodes
OPTION_KEYS = ("ddtree_depth", "ddtree_mode")
MODES = ("tree", "hsd_chain")
ADDITIONAL_CONFIG_KEY = "ddtree"


class DDTreeConfigError(ValueError):
    """A ddtree configuration that cannot run; the message names the fix."""


@dataclass(frozen=True)
class DDTreeOptions:
    budget: int  # B: draft nodes per request
    depth: int | None = None  # L; None = drafter block_size - 1 (filled in at engine start)
    mode: str = "tree"  # "tree" | "hsd_chain"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DDTreeOptions:
        return cls(**data)


def ddtree_options(vllm_config) -> DDTreeOptions | None:
    """The ddtree options of an engine's ``VllmConfig`` (None: the engine does not run ddtree)."""
    data = (getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY)
    return None if data is None else DDTreeOptions.from_dict(data)


def split_speculative_config(spec: dict) -> tuple[dict, DDTreeOptions]:
    """Split a user's ``method: "ddtree"`` config into vLLM's dflash config and our options.

    Example: ``{"method": "ddtree", "model": "d", "num_speculative_tokens": 64,
    "ddtree_depth": 7}`` -> ``({"method": "dflash", "model": "d",
    "num_speculative_tokens": 64}, DDTreeOptions(budget=64, depth=7))``.
    """
    spec = dict(spec)
    unknown = sorted(k for k in spec if k.startswith("ddtree") and k not in OPTION_KEYS)
    if unknown:
        raise DDTreeConfigError(
            f"ddtree: unknown option(s) {unknown} in --speculative-config; "
            f"the ddtree options are {list(OPTION_KEYS)}"
        )
    if not spec.get("model"):
        raise DDTreeConfigError(
            'ddtree: --speculative-config needs "model": the DFlash drafter '
            '(e.g. "z-lab/Qwen3-8B-DFlash-b16" or a local directory)'
        )
    budget = spec.get("num_speculative_tokens")
    if budget is None:
        raise DDTreeConfigError(
            'ddtree: --speculative-config needs "num_speculative_tokens": the tree budget B '
            f"(draft nodes per request, 1..{MAX_BUDGET}; 32-256 is a good start)"
        )
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise DDTreeConfigError(
            f"ddtree: num_speculative_tokens={budget!r} is the tree budget and must be an "
            f"integer in [1, {MAX_BUDGET}]"
        )
    depth = spec.pop("ddtree_depth", None)
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise DDTreeConfigError(
            f"ddtree: ddtree_depth={depth!r} must be a positive integer no larger than the "
            "drafter's block_size - 1 (or leave it out)"
        )
    mode = spec.pop("ddtree_mode", "tree")
    if mode not in MODES:
        raise DDTreeConfigError(f"ddtree: ddtree_mode={mode!r} must be one of {list(MODES)}")
    spec["method"] = "dflash"
    return spec, DDTreeOptions(budget=budget, depth=depth, mode=mode)


def resolve_depth(options: DDTreeOptions, drafter_block_size: int | None) -> DDTreeOptions:
    """Fill in L from the drafter's block size and check an explicit override against it."""
    if not drafter_block_size or drafter_block_size < 2:
        raise DDTreeConfigError(
            f"ddtree: the drafter has block_size={drafter_block_size!r}; a DFlash drafter "
            "declares block_size >= 2 in its config.json"
        )
    max_depth = drafter_block_size - 1
    if options.depth is not None and options.depth > max_depth:
        raise DDTreeConfigError(
            f"ddtree: ddtree_depth={options.depth} exceeds the drafter's block_size - 1 = "
            f"{max_depth}; lower it or leave it out"
        )
    depth = max_depth if options.depth is None else options.depth
    if options.mode == "hsd_chain" and options.budget > depth:
        raise DDTreeConfigError(
            f"ddtree: ddtree_mode 'hsd_chain' drafts one token per depth, so "
            f"num_speculative_tokens={options.budget} must be <= the depth {depth}"
        )
    return DDTreeOptions(budget=options.budget, depth=depth, mode=options.mode)
