"""The ddtree options of ``--speculative-config``, parsed and validated (no vLLM imports).

User-facing keys (everything else passes through to vLLM's ``SpeculativeConfig``)::

    {"method": "ddtree",                 # this plugin
     "model": "<DFlash drafter>",        # directory or hub id in z-lab's format
     "num_speculative_tokens": 64,       # B: tree budget = draft nodes per request, 1..1024
     "ddtree_depth": 15,                 # optional: L, default drafter block_size - 1
     "ddtree_mode": "tree",              # optional: "tree" (default) or "hsd_chain"
     "ddtree_budget_policy": "auto",     # optional: "auto", "static" or [[max_reqs, B], ...]
     "ddtree_calibrate_trees": true}     # optional: trees by observed acceptance (tree mode)

``ddtree_budget_policy`` sizes each request's tree per step (``num_speculative_tokens`` is the
maximum): ``"auto"`` (the default in tree mode) chooses per-request budgets that maximise
expected tokens per second from the drafter's calibrated node probabilities and the step costs
the engine measures at start-up (see ``vllm_ddtree/budget.py``), and pauses the drafter where
drafting does not pay; ``"static"`` gives every request B nodes in every step (the default,
and the only policy, of ``"hsd_chain"``); a list of ``[max_running_requests, budget]`` rows
gives every request the budget of the first row whose bound covers the step's number of
requests (the last row beyond its bound); on Model Runner V2 that is vLLM's own dynamic
speculation length (:func:`dynamic_sd_schedule`).

``"hsd_chain"`` drafts a chain of ``num_speculative_tokens`` (<= L) tokens SAMPLED from the
drafter's distributions at each request's temperature and verifies it with the lossless HSD
sampler (:func:`vllm_ddtree.sampling.hsd_verify`); greedy requests get argmax chains.

``ddtree_calibrate_trees`` (tree mode, default true) builds each tree by the acceptance the
engine observes (``vllm_ddtree/calibration.py``): per depth and rank of a token in the
drafter's list, how often the target's token had that rank against how often the drafter
said so, for greedy and sampled requests apart. A drafter right more often than it says gets
deeper trees, one that is wrong more often gets wider ones; until the engine has evidence the
trees are DDTree's. ``false`` builds DDTree's trees from the drafter's stated probabilities
(reproducing the paper's trees, or a reference engine's round for round). Sampled chains
(``"hsd_chain"``) build no tree: they ignore it.

Inside vLLM the method stays ``"dflash"`` (its DFlash drafter, model and KV plumbing are
reused) and these options travel in ``additional_config["ddtree"]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

MAX_BUDGET = 1024  # the Triton kernels and the mask packing are tested up to 1024 nodes
OPTION_KEYS = ("ddtree_depth", "ddtree_mode", "ddtree_budget_policy",
               "ddtree_calibrate_trees")
# options that no longer exist, with what replaced them (refused with that message)
REMOVED_KEYS = {
    "ddtree_tree_temperature": (
        "trees are built by the acceptance the engine observes (ddtree_calibrate_trees, on by "
        "default), which learns what a hand-set temperature guessed at; remove the option"),
}
POLICIES = ("auto", "static")
DEFAULT_POLICY = "auto"  # tree mode; sampled chains (hsd_chain) draft a fixed length: "static"
MODES = ("tree", "hsd_chain")
ADDITIONAL_CONFIG_KEY = "ddtree"


class DDTreeConfigError(ValueError):
    """A ddtree configuration that cannot run; the message names the fix."""


@dataclass(frozen=True)
class DDTreeOptions:
    budget: int  # B: draft nodes per request
    depth: int | None = None  # L; None = drafter block_size - 1 (filled in at engine start)
    mode: str = "tree"  # "tree" | "hsd_chain"
    budget_policy: str | tuple[tuple[int, int], ...] = DEFAULT_POLICY  # see the module doc
    calibrate_trees: bool = True  # trees by observed acceptance (tree mode), see above
    runner: str = "v1"  # vLLM's model runner the engine uses: "v1" or "v2" (choose_runner)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DDTreeOptions:
        data = dict(data)
        policy = data.get("budget_policy", DEFAULT_POLICY)
        if not isinstance(policy, str):  # a table: JSON turns its rows into lists
            data["budget_policy"] = tuple(tuple(row) for row in policy)
        return cls(**data)


def ddtree_options(vllm_config) -> DDTreeOptions | None:
    """The ddtree options of an engine's ``VllmConfig`` (None: the engine does not run ddtree)."""
    data = (getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY)
    return None if data is None else DDTreeOptions.from_dict(data)


V1_ONLY = "runs on vLLM's V1 model runner only so far"


def v1_only(policy, data_parallel_size: int = 1) -> str | None:
    """What of a ddtree configuration ddtree serves on vLLM's V1 model runner only (None: it
    runs on either). ``policy``: the budget policy the user gave (None: the default). A table
    runs on V2 as vLLM's dynamic speculation length (:func:`dynamic_sd_schedule`), which vLLM
    turns off under data parallelism (its ranks could pick different lengths)."""
    if policy == "auto":
        return "ddtree_budget_policy 'auto'"
    if policy is not None and not isinstance(policy, str) and data_parallel_size > 1:
        return "a ddtree_budget_policy table with data parallelism"
    return None


def dynamic_sd_schedule(table) -> list[list[int]]:
    """A budget table as vLLM's ``num_speculative_tokens_per_batch_size``: inclusive ranges of
    the step's number of requests, each with its number of drafts (vLLM carries the last one
    past the last range, as the table does). Model Runner V2's scheduler then schedules that
    many drafts per request; a tree's first n nodes are the best n-node tree.

    Example: ``((4, 64), (16, 16), (256, 0))`` -> ``[[1, 4, 64], [5, 16, 16], [17, 256, 0]]``.
    """
    ranges, start = [], 1
    for bound, budget in table:
        ranges.append([start, bound, budget])
        start = bound + 1
    return ranges


def choose_runner(policy, use_v2_env: bool | None, has_triton: bool,
                  data_parallel_size: int = 1) -> str:
    """The model runner a ddtree engine will use: "v1" or "v2".

    vLLM's own rule (``VllmConfig.use_v2_model_runner``): ``VLLM_USE_V2_MODEL_RUNNER`` when set
    (``use_v2_env``), else V2 where Triton is usable. ddtree on V2 serves both modes with the
    static policy or a table, a table not under data parallelism (:func:`v1_only`); an engine
    that asks for more runs V1 (the plugin tells vLLM so: ``patches._wrap_v2_unsupported``),
    and one that forces V2 with it is refused. ``policy``: the budget policy the user gave
    (None: the default).

    Example: (None, None, True) -> "v2"; ("auto", None, True) -> "v1".
    """
    if use_v2_env is False or (use_v2_env is None and not has_triton):
        return "v1"
    reason = v1_only(policy, data_parallel_size)
    if reason is None:
        return "v2"
    if use_v2_env:
        raise DDTreeConfigError(
            f"ddtree: {reason} {V1_ONLY}, and VLLM_USE_V2_MODEL_RUNNER=1 asks for Model Runner "
            "V2; unset VLLM_USE_V2_MODEL_RUNNER (or set it to 0), or leave that option out")
    return "v1"


def split_speculative_config(spec: dict, pipeline_parallel_size: int = 1,
                             use_v2_env: bool | None = False, has_triton: bool = False,
                             data_parallel_size: int = 1) -> tuple[dict, DDTreeOptions]:
    """Split a user's ``method: "ddtree"`` config into vLLM's dflash config and our options.

    The runner (:func:`choose_runner`; the defaults here mean V1) sets the default budget
    policy: "auto" on V1, "static" on V2 ("auto" runs on V1 only so far). On V2 a table
    becomes vLLM's ``num_speculative_tokens_per_batch_size`` (:func:`dynamic_sd_schedule`),
    which a ddtree config does not take directly (one way to give it). Under pipeline
    parallelism the budget policy defaults to "static" and "auto" is refused: auto's cost
    model times whole forwards of the target on one worker, which a pipeline stage cannot run
    alone.

    Example: ``{"method": "ddtree", "model": "d", "num_speculative_tokens": 64,
    "ddtree_depth": 7}`` -> ``({"method": "dflash", "model": "d",
    "num_speculative_tokens": 64}, DDTreeOptions(budget=64, depth=7))``.
    """
    spec = dict(spec)
    for key, why in REMOVED_KEYS.items():
        if key in spec:
            raise DDTreeConfigError(f"ddtree: {key} was removed: {why}")
    unknown = sorted(k for k in spec if k.startswith("ddtree") and k not in OPTION_KEYS)
    if unknown:
        raise DDTreeConfigError(
            f"ddtree: unknown option(s) {unknown} in --speculative-config; "
            f"the ddtree options are {list(OPTION_KEYS)}"
        )
    if "num_speculative_tokens_per_batch_size" in spec:
        raise DDTreeConfigError(
            "ddtree: num_speculative_tokens_per_batch_size is vLLM's dynamic speculation "
            "length for chains; for trees give ddtree_budget_policy a table of "
            "[max_running_requests, budget] rows (e.g. [[4, 64], [16, 16], [256, 0]])")
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
    given = spec.pop("ddtree_budget_policy", None)
    if given is not None:
        given = _budget_policy(given, budget)
    runner = choose_runner(given, use_v2_env, has_triton, data_parallel_size)
    default = ("static" if mode == "hsd_chain" or pipeline_parallel_size > 1 or runner == "v2"
               else DEFAULT_POLICY)
    policy = default if given is None else given
    if policy == "auto" and pipeline_parallel_size > 1:
        raise DDTreeConfigError(
            f"ddtree: ddtree_budget_policy 'auto' is not supported with "
            f"--pipeline-parallel-size {pipeline_parallel_size} (its cost model times whole "
            "forwards of the target on one worker); use 'static' (the default there) or a "
            "table of [max_running_requests, budget] rows")
    if mode == "hsd_chain" and policy != "static":
        raise DDTreeConfigError(
            f"ddtree: ddtree_budget_policy={_show(policy)} needs ddtree_mode 'tree'; sampled "
            "chains (hsd_chain) draft a fixed length: use ddtree_budget_policy 'static'"
        )
    calibrate = spec.pop("ddtree_calibrate_trees", None)
    if calibrate is not None and not isinstance(calibrate, bool):
        raise DDTreeConfigError(
            f"ddtree: ddtree_calibrate_trees={calibrate!r} must be true or false (or leave it "
            "out: true)")
    spec["method"] = "dflash"
    if runner == "v2" and not isinstance(policy, str):
        spec["num_speculative_tokens_per_batch_size"] = dynamic_sd_schedule(policy)
    return spec, DDTreeOptions(budget=budget, depth=depth, mode=mode, budget_policy=policy,
                               calibrate_trees=mode == "tree" and calibrate is not False,
                               runner=runner)


def _show(policy) -> str:
    return repr(policy) if isinstance(policy, str) else repr([list(row) for row in policy])


def _budget_policy(policy, budget: int) -> str | tuple[tuple[int, int], ...]:
    """Validate ``ddtree_budget_policy``; a table becomes a tuple of ``(bound, budget)`` rows.

    Example: ``[[8, 64], [32, 16]]`` with B = 64 -> ``((8, 64), (32, 16))``.
    """
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise DDTreeConfigError(
                f"ddtree: ddtree_budget_policy={policy!r} must be one of {list(POLICIES)} or a "
                "list of [max_running_requests, budget] rows"
            )
        return policy
    how = ("ddtree: ddtree_budget_policy as a table is a non-empty list of [max_running_requests, "
           f"budget] rows with increasing bounds >= 1 and budgets in [0, num_speculative_tokens="
           f"{budget}]")
    if not isinstance(policy, (list, tuple)) or not policy:
        raise DDTreeConfigError(f"{how}; got {policy!r}")
    rows = []
    for row in policy:
        if (not isinstance(row, (list, tuple)) or len(row) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in row)):
            raise DDTreeConfigError(f"{how}; row {row!r} is not [int, int]")
        bound, size = row
        if bound < 1 or not 0 <= size <= budget or (rows and bound <= rows[-1][0]):
            raise DDTreeConfigError(f"{how}; row {list(row)} breaks that")
        rows.append((bound, size))
    return tuple(rows)


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
    return dataclasses.replace(options, depth=depth)
