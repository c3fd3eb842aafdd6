"""Per-runner ddtree state shared by the proposer, the attention builder and the sampler.

One :class:`TreeState` belongs to one model runner (no module-global context). A step goes:

1. ``propose`` (step t) records each request's tree: :meth:`TreeState.record_proposal`; when
   the drafts go to the scheduler, a request near ``max_tokens`` or ``max_model_len`` keeps
   only the nodes it can still use (:meth:`TreeState.clip_drafts`).
2. ``_prepare_inputs`` (step t+1) matches the scheduled drafts of each row with the tree
   proposed for that request and builds the verify batch: :meth:`TreeState.begin_verify`.
   Rows whose drafts are not that tree (placeholders after preemption, zeros when the input
   did not fit the drafter, dummy runs) are verified as chains, which is also a valid tree.
3. attention reads the structure (:attr:`VerifyBatch.tree`), the sampler walks it and records
   the verdict; the runner compacts the accepted path's K/V and the proposer gathers the
   accepted rows' hidden states (:meth:`TreeState.finish_verify`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from vllm_ddtree.calibration import DraftTops, TreeCalibration
from vllm_ddtree.kernels.native import cpu_ops
from vllm_ddtree.kernels.verify_steps import finish_verify_triton, triton_stages
from vllm_ddtree.plugin.options import DDTreeOptions
from vllm_ddtree.plugin.policy import BudgetController, has_structured_outputs
from vllm_ddtree.sampling import cached_arange
from vllm_ddtree.tree import PADDING_TOKEN_ID, DraftTree, _ancestor_mask, pack_mask
from vllm_ddtree.walk import TreeVerdict


logger = logging.getLogger("vllm.ddtree")
_UNMATCHED_COUNTER = None


def _unmatched_counter():
    """The process's ``vllm:ddtree_unmatched_draft_rows`` Prometheus counter (created once:
    several engines in one process share it). It is in the registry of the process that runs
    the model runner: ``LLM.get_metrics()`` of an in-process engine, or vLLM's /metrics when
    its Prometheus runs in multiprocess mode; the warning line reaches the log everywhere."""
    global _UNMATCHED_COUNTER
    if _UNMATCHED_COUNTER is None:
        from prometheus_client import Counter

        _UNMATCHED_COUNTER = Counter(
            "vllm:ddtree_unmatched_draft_rows",
            "Scheduled requests whose drafts were not their ddtree proposal (verified as chains)")
    return _UNMATCHED_COUNTER


@dataclass
class VerifyBatch:
    """The trees verified in one target step, one row per scheduled request."""

    tree: DraftTree  # [R, B] nodes: the scheduled drafts; node k >= num_draft[r] is padding
    num_draft: list[int]  # m_r, host
    query_start: list[int]  # first query row of each request in the flat batch, host
    num_tokens: int  # T, scheduled tokens in the step
    matched: torch.Tensor  # [R] bool: the drafts are the tree proposed for this request
    # hsd_chain: the drafter law the chains were sampled from, as the proposer recorded it
    # (a tuple of tensors with one row per request), rows gathered into this batch's order;
    # rows where ``matched`` is False are meaningless
    draft_law: tuple[torch.Tensor, ...] | None = None
    # every request with drafts got exactly its whole proposal: no row is unmatched (host)
    exact: bool = False
    starts: torch.Tensor | None = None  # [R] query_start on the device
    # [num_tokens] each row's position shift (depth - query position for node rows, else 0)
    position_shift: torch.Tensor | None = None


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host data (a list or a CPU tensor) on ``device`` without a host synchronisation.

    On CUDA the data is staged in pinned memory and copied asynchronously: a plain
    ``torch.tensor(data, device="cuda")`` copies from pageable memory and waits for the stream.
    """
    host = torch.as_tensor(data, dtype=dtype)
    # (a torch.device is read, not rebuilt: torch.device() took ~5 us inside an engine step)
    if (device.type if isinstance(device, torch.device) else torch.device(device).type) != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _read_host_count(host: torch.Tensor, event: torch.cuda.Event | None) -> int:
    """The value of a count copied to the host by an earlier report (``event``: its CUDA copy,
    recorded a log period ago: done, so waiting on it does not stall the stream)."""
    if event is not None:
        event.synchronize()
    return int(host)


@lru_cache(maxsize=16)
def _verify_constants(width: int, depth: int, device: torch.device):
    """Per-(width, depth) tables for :meth:`TreeState.begin_verify`, built once with device ops:
    node index ``[B]``, chain parents ``[B]`` (node k hangs off k - 1) and depths ``[B]``
    (k + 1), the packed ancestor rows of a chain ``[B + 1, W]`` (row i holds 0..i) and of a
    padding node ``[B + 1, W]`` (the root and itself), and whether a chain node is within the
    drafting depth L ``[B]``."""
    rows = torch.arange(width + 1, device=device)
    node = rows[:width]
    chain_mask = pack_mask(rows[None, :] <= rows[:, None])
    pad_mask = pack_mask((rows[None, :] == rows[:, None]) | (rows[None, :] == 0))
    return node, node - 1, node + 1, chain_mask, pad_mask, node < depth


def chain_parents(num_rows: int, width: int, device: torch.device) -> torch.Tensor:
    """``[num_rows, width]`` parents of a chain: node k hangs off node k - 1 (node 0 off the root)."""
    return (torch.arange(width, device=device) - 1).expand(num_rows, width)


def best_path(parents: list[int], max_depth: int) -> list[int]:
    """The nodes of a tree's most probable root-to-leaf path, at most ``max_depth`` of them.

    Nodes are best-first (a higher prefix probability first, parents before children), so the
    first child of a node in index order is its most probable one. Example: parents
    [-1, -1, 0, 1, 2, 0] -> [0, 2, 4] (with max_depth 2: [0, 2]).
    """
    path, current = [], -1
    for node, parent in enumerate(parents):
        if len(path) >= max_depth:
            break
        if parent == current:
            path.append(node)
            current = node
    return path


def tokens_left(request, max_model_len: int) -> int:
    """How many more tokens a runner request (vLLM's ``CachedRequestState``) may emit: its
    ``max_tokens`` less its outputs, and at most up to ``max_model_len``."""
    left = max_model_len - request.num_tokens
    max_tokens = getattr(request.sampling_params, "max_tokens", None)
    if max_tokens is not None:
        left = min(left, max_tokens - len(request.output_token_ids))
    return left


def renumbered_parents(parents: list[int], kept: list[int]) -> list[int]:
    """The parents of the kept nodes (a subtree: a kept node's ancestors are kept), as indices
    into ``kept``. Example: parents [-1, 0, -1, 2] keeping [0, 2, 3] -> [-1, -1, 1]."""
    new = {old: i for i, old in enumerate(kept)}
    return [new[parents[old]] if parents[old] >= 0 else -1 for old in kept]


def accepted_moves(accepted_rows: torch.Tensor, starts: torch.Tensor, num_tokens: int,
                   moved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K/V moves of a verify step and the drafter's hidden-state gather index.

    Accepted node q_j at depth j sits at query row ``start + q_j + 1`` and must move to
    ``start + j`` (its chain slot). ``accepted_rows [R, L + 1]``: the walk's rows of each
    request (0 for the root, node + 1, -1 past the path); ``starts [R]``: each request's root
    row in the step's ``num_tokens`` flat rows (device). Returns ``(src, dst)`` flat rows
    ``[R * L]``, -1 where nothing moves, and the gather index ``[num_tokens]`` (dst row reads
    src row, the identity elsewhere); the moved slots are added to ``moved`` (a 0-dim int64
    counter). Example: a request whose rows start at 40 with accepted nodes [0, 3, 7] -> src
    rows [-1, 44, 48], dst rows [-1, 42, 43] (node 0 is already in place). One op on the CPU
    (the fused kernel), one launch on CUDA (Triton), else the torch path below; no host
    synchronisation."""
    ops = cpu_ops(accepted_rows.device)
    if ops is not None:
        return tuple(ops.finish_verify(accepted_rows, starts, num_tokens, moved))
    if triton_stages(accepted_rows.device):
        return finish_verify_triton(accepted_rows, starts, num_tokens, moved)
    device = accepted_rows.device
    rows = accepted_rows[:, 1:]  # [R, L] query rows within the request, -1 pad
    identity = cached_arange(num_tokens + 1, device)  # row T: a sentinel
    depth = cached_arange(rows.shape[1] + 1, device)[1:]  # the chain slots 1..L
    accepted = rows >= 0
    # pairs that are not accepted become (T, T): a move of the sentinel row onto itself
    src = torch.where(accepted, starts[:, None] + rows, num_tokens).flatten()
    dst = torch.where(accepted, starts[:, None] + depth, num_tokens).flatten()
    gather_index = identity.clone().scatter_(0, dst, src)[:num_tokens]
    moves = src != dst
    src = torch.where(moves, src, -1)
    moved += (src >= 0).sum()
    return src, torch.where(moves, dst, -1), gather_index


class ProposalStore:
    """Each request's latest proposal, kept on the device until it is verified or replaced.

    A request that is not scheduled in the step after its proposal (the token budget ran out)
    is verified later with the drafts the scheduler kept for it; its tree must still be here
    then, whatever was proposed for other requests in between. Proposals live in persistent
    ``[capacity, ...]`` buffers, one slot per request; recording and reading a batch is one
    ``index_copy_`` / gather per buffer (host slot numbers reach the device through
    :func:`to_device`). Example: "a" and "b" proposed at step t, only "b" scheduled at t + 1
    (and proposed again), "a" at t + 2: slot("a") still holds the step-t tree.
    """

    def __init__(self, capacity: int, device: torch.device, empty: dict | None = None):
        """``empty``: the value of the empty row (:attr:`empty_slot`) per buffer name (a
        scalar or a tensor of one row's shape); other buffers' empty rows hold zeros."""
        self.device = device
        self.capacity = max(int(capacity), 1)
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))
        self._buffers: dict[str, torch.Tensor] = {}  # name -> [capacity + 1, ...]
        self._empty = dict(empty or {})
        # the drafts the scheduler was sent for each request's proposal (host lists)
        self.sent: dict[str, list[int]] = {}

    @property
    def empty_slot(self) -> int:
        """A row that belongs to no request and holds the ``empty`` values (a tree of no
        nodes): the source row of requests that verify nothing."""
        return self.capacity

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slot_of

    def slots(self, req_ids: list[str]) -> list[int]:
        """Slot of each request, -1 for a request without a proposal (host)."""
        return [self._slot_of.get(req_id, -1) for req_id in req_ids]

    def _new_buffer(self, name: str, like: torch.Tensor, capacity: int) -> torch.Tensor:
        buf = like.new_zeros((capacity + 1, *like.shape[1:]))
        if name in self._empty:
            buf[capacity] = self._empty[name]
        return buf

    def _grow(self, needed: int) -> None:
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        for name, buf in self._buffers.items():
            grown = self._new_buffer(name, buf, capacity)
            grown[: self.capacity] = buf[: self.capacity]
            self._buffers[name] = grown
        self._free = list(range(capacity - 1, self.capacity - 1, -1)) + self._free
        self.capacity = capacity

    def assign(self, req_ids: list[str]) -> list[int]:
        """The slots that ``req_ids``' new proposals go to (host), allocated where needed."""
        new = [req_id for req_id in dict.fromkeys(req_ids) if req_id not in self._slot_of]
        if len(new) > len(self._free):
            self._grow(len(self._slot_of) + len(new))
        for req_id in new:
            self._slot_of[req_id] = self._free.pop()
        for req_id in req_ids:  # a new proposal: its drafts are not sent yet
            self.sent.pop(req_id, None)
        return self.slots(req_ids)

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Buffer ``name`` for rows shaped like ``like[0]`` (made, or remade, if it has other
        rows)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape[1:] != like.shape[1:] or buf.dtype != like.dtype:
            buf = self._buffers[name] = self._new_buffer(name, like, self.capacity)
        return buf

    def put(self, req_ids: list[str], rows: dict[str, torch.Tensor]) -> None:
        """Store row r of every tensor in ``rows`` (``[len(req_ids), ...]``) for ``req_ids[r]``,
        replacing what that request held. Buffers absent from ``rows`` keep stale rows."""
        index = to_device(self.assign(req_ids), torch.int64, self.device)
        for name, values in rows.items():
            self.buffer(name, values).index_copy_(0, index, values)

    def tree_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ``nodes``, ``scores`` and ``mask`` buffers (the fused CPU kernels' operands)."""
        return self._buffers["nodes"], self._buffers["scores"], self._buffers["mask"]

    def rows(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """Rows ``slots`` (device, each a request's slot or :attr:`empty_slot`) of ``name``."""
        return self._buffers[name][slots]

    def get(self, name: str, slots: torch.Tensor) -> torch.Tensor | None:
        """Rows ``slots`` (device, -1 allowed: row 0, meaningless) of buffer ``name``."""
        buf = self._buffers.get(name)
        return None if buf is None else buf[slots.clamp(min=0)]

    def get_all(self, names: tuple[str, ...], slots: torch.Tensor
                ) -> list[torch.Tensor] | None:
        """:meth:`get` of several buffers with one clamp (None when one of them is missing)."""
        bufs = [self._buffers.get(name) for name in names]
        if any(buf is None for buf in bufs):
            return None
        safe = slots.clamp(min=0)
        return [buf[safe] for buf in bufs]

    def set_rows(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        self._buffers[name].index_copy_(0, slots, values)

    def drop(self, req_ids) -> None:
        if not self._slot_of and not self.sent:  # nothing held (a paused drafter's steps)
            return
        for req_id in req_ids:
            self.sent.pop(req_id, None)
            slot = self._slot_of.pop(req_id, None)
            if slot is not None:
                self._free.append(slot)

    def clear(self) -> None:
        self.drop(list(self._slot_of))

    def keep_only(self, live_req_ids) -> None:
        """Forget the proposals of requests that no longer exist (finished, aborted)."""
        self.drop([req_id for req_id in self._slot_of if req_id not in live_req_ids])


class TreeState:
    def __init__(self, options: DDTreeOptions, device: torch.device, max_num_reqs: int = 8):
        if options.depth is None:
            raise ValueError("ddtree: the drafting depth must be resolved before the runner starts")
        self.options = options
        self.device = device
        cpu_ops(device)  # the fused CPU kernels load (or build) at engine start, not mid-step
        pad_mask = _verify_constants(options.budget, options.depth, device)[4]
        # a padding node's (token, parent, depth): the "nodes" rows of the store's empty row
        self._padding_node = torch.tensor([[PADDING_TOKEN_ID], [-1], [0]], device=device)
        self._nodes_like: dict[int, torch.Tensor] = {}  # width -> [1, 3, width] (record_proposal)
        self.proposals = ProposalStore(max_num_reqs, device, empty={
            "nodes": self._padding_node, "scores": float("-inf"), "mask": pad_mask,
            "top_ids": -1})
        self.budgets = BudgetController(options, device)
        # trees by observed acceptance (vllm_ddtree/calibration.py), whatever the budget policy
        self.calibration = (TreeCalibration(options.depth, device) if options.calibrate_trees
                            else None)
        # The latest proposal's node parents and depths on the host, {req_id: row} ->
        # [R, 2, B] int16, for clip_drafts (copied with vLLM's own draft copy, read after vLLM
        # waits for it).
        self._latest_rows: dict[str, int] = {}
        self._latest_nodes: torch.Tensor | None = None
        self._latest_law_names: tuple[str, ...] = ()
        self.verify: VerifyBatch | None = None
        self.chain_positions: torch.Tensor | None = None  # [T] positions before the depth shift
        # [rows] position of the token each sampled row predicts, in steps with seeded requests
        self.sample_positions: torch.Tensor | None = None
        self.verdict: TreeVerdict | None = None
        self.gather_index: torch.Tensor | None = None  # [T] hidden-state rows for the drafter
        self._compacted = torch.zeros((), dtype=torch.int64, device=device)  # slots moved
        # scheduled rows with drafts that were not their request's recorded proposal (device;
        # read with the policy's periodic log line, so serving never waits for it)
        self._unmatched = torch.zeros((), dtype=torch.int64, device=device)
        self._unmatched_reported = 0
        # the host copy of the count that the previous report started, and its CUDA event
        self._unmatched_copy: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self.check_ranks = False  # compare each step's plan across TP ranks (ranks.py)
        # Pipeline parallelism (stages.py): the last stage sends every tree's parents with its
        # drafts; a stage before the last moves its K/V along the accepted paths (StageMoves).
        self.send_all_trees = False
        self.stage = None
        self.last_num_draft: list[int] = []  # m_r of the latest verify step, host
        # What the drafter does at the end of the step in flight (plan_step): "draft",
        # "context" (its context pass only) or "cold" (nothing).
        self.plan = "context"
        # A step that verifies nothing and plans no drafts runs without speculation from its
        # input preparation to the end of its sampling: the runner's speculative config is
        # held here meanwhile (patches._wrap_prepare_inputs, _wrap_sample_tokens).
        self.held_spec_config = None
        # Drafter context validity, for auto's cold pauses (steps that skip even the context
        # pass): per K/V slot of the drafter's group, False when the last step that wrote the
        # slot's position skipped the context pass. Allocated with the caches; read only once
        # a step went cold (``ever_cold``). ``cold_reqs``: requests scheduled in a cold step.
        self.context_valid: torch.Tensor | None = None
        self.ever_cold = False
        self.cold_reqs: set[str] = set()

    @property
    def num_compacted_slots(self) -> int:
        """K/V slots moved by compaction so far (tests, diagnostics; reading it syncs)."""
        return int(self._compacted)

    @property
    def num_unmatched_rows(self) -> int:
        """Scheduled requests with drafts that were verified as chains because their drafts
        were not their request's recorded proposal (tests, diagnostics; reading syncs). Zero in
        normal serving: see :meth:`report_unmatched`."""
        return int(self._unmatched)

    def report_unmatched(self) -> None:
        """With the policy's periodic log line: the unmatched rows since the last report, as a
        warning and in the ``vllm:ddtree_unmatched_draft_rows`` counter.

        An unmatched row is a scheduled request whose drafts are not the tree this runner
        proposed for it. The plugin sends the scheduler only recorded proposals, keeps each
        request's proposal until the request is scheduled again, and drops it whenever the
        scheduler cannot hold those drafts any more, so none arises in serving; if one did (a
        scheduler change in a new vLLM, a bug), its drafts are verified as a chain, which is
        still lossless (the walk is exact for any drafts that do not depend on the target's
        samples), but the trees' acceptance is lost: hence the warning.

        The count is reported one log period late, without waiting for the device: each report
        starts an asynchronous copy of the device count to the host and reads the copy that
        the previous report started (on CUDA, its event completed long before)."""
        started, self._unmatched_copy = self._unmatched_copy, self._copy_unmatched()
        if started is None:
            return
        total = _read_host_count(*started)
        new, self._unmatched_reported = total - self._unmatched_reported, total
        if new > 0:
            _unmatched_counter().inc(new)
            logger.warning("ddtree: %d scheduled requests had drafts that were not their "
                           "proposal and were verified as chains (%d since start); please "
                           "report this with your vLLM version", new, total)

    def _copy_unmatched(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if self.device.type != "cuda":
            return self._unmatched.clone(), None
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        host.copy_(self._unmatched, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def count_unmatched(self, verify: VerifyBatch) -> None:
        if not verify.exact:  # an exact step has none
            self._unmatched += ((verify.tree.num_nodes > 0) & ~verify.matched).sum()

    @property
    def budget(self) -> int:
        return self.options.budget

    @property
    def depth(self) -> int:
        return self.options.depth

    def tree_calibration(self, sampled: torch.Tensor | None, num_reqs: int,
                         reshaped: list[bool] | None = None) -> torch.Tensor | None:
        """``build_tree``'s calibration for a proposal of ``num_reqs`` requests (``sampled``:
        ``[R]`` bool, T > 0; None: all greedy), or None (DDTree's trees). ``reshaped``: per
        request, whether its features reshape the target's law
        (``known_params.reshapes_target``): its tree is DDTree's (factors 1)."""
        if self.calibration is None:
            return None
        if sampled is None:
            sampled = self.budgets.all_greedy(num_reqs)
        factors = self.calibration.log_factors(sampled)
        if reshaped is not None and any(reshaped):
            factors.masked_fill_(to_device(reshaped, torch.bool, self.device)[:, None, None],
                                 0.0)
        return factors

    def observe_calibration(self, sampled: torch.Tensor | None, reshaped: list[bool]) -> None:
        """Fold the verify step's outcome (:meth:`finish_verify`) into the tree calibration:
        the requests whose trees were their recorded proposals, except those whose features
        reshape the target's law (``reshaped``, per request of the step, host:
        ``known_params.reshapes_target``). Device ops, and one small upload where a request
        is left out."""
        verify, verdict = self.verify, self.verdict
        if self.calibration is None or verify is None or verify.tree.tops is None:
            return
        counted = verify.matched & (verify.tree.num_nodes > 0)
        if any(reshaped):
            counted &= ~to_device(reshaped, torch.bool, self.device)
        if sampled is None:
            sampled = self.budgets.all_greedy(counted.shape[0])
        self.calibration.observe(verify.tree.tops, verdict.output_tokens, verdict.num_accepted,
                                 counted, sampled)

    def record_proposal(self, req_ids: list[str], tree: DraftTree,
                        draft_law: tuple[torch.Tensor, ...] | None = None) -> None:
        """Keep the trees drafted for ``req_ids`` (row r of ``tree`` is ``req_ids[r]``), and for
        sampled chains the drafter law they were drawn from (tensors with one row per request),
        until each request is verified or proposed for again; with them the drafter's top
        tokens (:attr:`DraftTree.tops`) the calibration learns from."""
        law = {f"law{i}": t for i, t in enumerate(draft_law or ())}
        tops = {} if tree.tops is None else {"top_ids": tree.tops.token_ids,
                                             "top_probs": tree.tops.probs}
        self._latest_law_names = tuple(law)
        self._latest_rows = {req_id: row for row, req_id in enumerate(req_ids)}
        ops = cpu_ops(self.device)
        if ops is not None and not law:  # the fused CPU kernel: one op
            store = self.proposals
            slots = to_device(store.assign(req_ids), torch.int64, self.device)
            nodes_like = self._nodes_like.get(tree.max_budget)  # the buffer's row shape only
            if nodes_like is None:
                nodes_like = self._nodes_like[tree.max_budget] = self._padding_node.new_empty(
                    1, 3, tree.max_budget)
            store.buffer("nodes", nodes_like)
            store.buffer("scores", tree.scores)
            store.buffer("mask", tree.ancestor_mask)
            self._latest_nodes = ops.store_trees_(
                *store.tree_buffers(), slots, tree.token_ids, tree.parents, tree.depths,
                tree.scores, tree.ancestor_mask)
            for name, values in tops.items():
                store.buffer(name, values).index_copy_(0, slots, values)
            return
        nodes = torch.stack([tree.token_ids, tree.parents, tree.depths], dim=1)  # [R, 3, B]
        self.proposals.put(req_ids, {"nodes": nodes, "scores": tree.scores,
                                     "mask": tree.ancestor_mask, **law, **tops})
        # Queued before vLLM's own copy of the draft ids, whose event vLLM waits on before it
        # reads them: read in clip_drafts after that wait, so this adds no synchronisation.
        self._latest_nodes = nodes[:, 1:].to(torch.int16).to("cpu", non_blocking=True)

    def plan_step(self, req_ids: list[str], without_drafts: bool = False) -> str:
        """What the drafter does at the end of this step (decided before its forward, kept in
        :attr:`plan`): ``"draft"`` when the policy drafts, the scheduler allows drafts
        (``without_drafts``: a request it holds sets a sampling parameter the plugin does not
        know, ``known_params.py``) and at least half of the requests
        have a complete drafter context (requests scheduled in a cold step have lost theirs);
        else ``"context"`` when the policy keeps the drafter's cache (its context pass only)
        and some request can still use it; else ``"cold"``: nothing, the step's positions lose
        their drafter context. A new request can use it: it is written from its first step."""
        budgets, num_reqs = self.budgets, len(req_ids)
        usable = num_reqs
        if self.cold_reqs:
            usable = num_reqs - len(self.cold_reqs.intersection(req_ids))
        if (usable and not without_drafts and budgets.will_draft(num_reqs)
                and 2 * usable >= num_reqs):
            self.plan = "draft"
        elif usable and budgets.keeps_context(num_reqs):
            self.plan = "context"
        else:
            self.plan = "cold"
        return self.plan

    def allocate_context_validity(self, num_slots: int) -> None:
        self.context_valid = torch.ones(num_slots, dtype=torch.bool, device=self.device)

    def context_written(self, slots: torch.Tensor) -> None:
        """The drafter's context pass writes ``slots`` (device): their context is valid."""
        if self.ever_cold:  # before the first cold step every slot is valid
            self.context_valid.index_fill_(0, slots, True)

    def went_cold(self, req_ids: list[str], slots: torch.Tensor) -> None:
        """A cold step: the positions it wrote (``slots``) have no drafter context, and its
        requests can no longer draft (their context has a hole)."""
        if self.context_valid is None:
            raise RuntimeError("ddtree: a cold step before the K/V caches exist")
        self.ever_cold = True
        self.cold_reqs.update(req_ids)
        self.context_valid.index_fill_(0, slots, False)

    def forget_finished(self, live_req_ids) -> None:
        """Forget the proposals and cold marks of requests that no longer exist."""
        self.proposals.keep_only(live_req_ids)
        if self.cold_reqs:
            self.cold_reqs.intersection_update(live_req_ids)

    def context_complete(self, block_table: torch.Tensor, num_computed: list[int],
                         block_size: int) -> torch.Tensor | None:
        """``[R]`` bool (device): whether each request's drafter context is complete, every
        position before this step (``num_computed[r]`` of them, prefix-cache hits included)
        last written by a context pass; None when no step ever went cold (all complete).

        ``block_table``: ``[>= R, max_blocks]`` the drafter group's block table. Example:
        block_size 4, a request with 6 computed positions in blocks [3, 1]: slots
        12 13 14 15 4 5 must all be valid.
        """
        if not self.ever_cold:
            return None
        ops = cpu_ops(self.device)
        if ops is not None:  # one op instead of ~10 (auto's every step once a step went cold)
            return ops.context_complete(self.context_valid, block_table, num_computed,
                                        block_size)
        num_reqs, device = len(num_computed), self.device
        longest = max(num_computed, default=0)
        pos = torch.arange(longest, device=device)
        inside = pos[None, :] < to_device(num_computed, torch.int64, device)[:, None]
        blocks = block_table[:num_reqs, : (longest + block_size - 1) // block_size].long()
        slots = blocks.gather(1, (pos // block_size).expand(num_reqs, -1)) * block_size \
            + pos % block_size
        return (self.context_valid[torch.where(inside, slots, 0)] | ~inside).all(dim=1)

    def no_drafts(self, req_ids: list[str]) -> None:
        """:meth:`clip_drafts` for a step whose drafter did not run its query pass (paused by
        the policy): the step's requests send no drafts, so their older proposals may never be
        matched again (the scheduler cleared their drafts when it scheduled them). Requests
        that were not scheduled in this step keep theirs: the scheduler still holds their
        drafts and verifies them when it schedules them."""
        self._latest_nodes, self._latest_rows = None, {}
        self.proposals.drop(req_ids)
        if self.budgets.drafts_sent([], [0] * len(req_ids)):
            self.report_unmatched()

    def clip_drafts(self, req_ids: list[str], drafts: list[list[int]], requests: dict,
                    max_model_len: int) -> dict[str, list[int]]:
        """Keep (in place) only the drafts each request can use: its real nodes (its budget;
        nodes of probability zero are padding too), and near its end only those it can still
        accept. Reports the result to the budget policy. Returns the parents of the drafts
        sent for each structured-output request (the scheduler checks their grammar along
        the tree: ``patches._wrap_update_draft_token_ids``).

        After this step request r holds ``n`` tokens, ``out`` of them outputs; its next verify
        step emits ``accepted + 1`` tokens, and only ``max_tokens - out`` more are allowed
        (``max_model_len - n`` by length), so nodes deeper than ``u = min(max_tokens - out - 1,
        max_model_len - n - 1)`` can never be used. When ``u < L`` the request keeps its nodes
        of depth <= u, in order (a subtree: ancestors are shallower), and the recorded proposal
        is re-indexed to match, so the verify step sees exactly these nodes. Example: L = 7,
        max_tokens 10 and 8 outputs so far: u = 1, only the depth-1 nodes stay; with 9 outputs
        u = 0 and the request is scheduled without drafts.

        Requests whose drafts were not recorded by the latest proposal (the drafter did not
        run its query pass: paused by the policy, or vLLM sent zeros because the input did not
        fit the drafter) send no drafts and lose any older proposal, so that it can never be
        matched against drafts it did not produce.
        """
        nodes, self._latest_nodes = self._latest_nodes, None  # a proposal is clipped once
        rows, self._latest_rows = self._latest_rows, {}
        self.proposals.drop([req_id for req_id in req_ids if req_id not in rows])
        kept: dict[str, list[int]] = {}
        trees: dict[str, list[int]] = {}  # structured-output requests: the drafts' parents
        budgeted = []  # real nodes per request, before the cut near the end
        for req_id, ids in zip(req_ids, drafts):
            row = rows.get(req_id)
            if row is None or nodes is None:
                ids.clear()
                continue
            node_depths = nodes[row, 1, : len(ids)].tolist()
            real = sum(1 for d in node_depths if d > 0)  # real nodes come first
            del ids[real:]
            budgeted.append(real)
            request = requests.get(req_id)
            useful = self._usable_depth(request, max_model_len)
            keep = None
            if useful < self.depth:
                keep = [i for i, d in enumerate(node_depths) if 0 < d <= useful]
                ids[:] = [ids[i] for i in keep]
                kept[req_id] = keep
            structured = has_structured_outputs(request)
            if structured:
                # the tree's first nodes (a subtree), at most the policy's structured_limit
                limit = self.budgets.structured_limit
                if len(ids) > limit:  # the proposal keeps them alone (then padding)
                    keep = (keep or list(range(len(ids))))[:limit]
                    kept[req_id] = keep
                    del ids[limit:]
            if structured or self.send_all_trees:
                parents = nodes[row, 0, :real].tolist()
                if keep is not None:
                    parents = renumbered_parents(parents, keep)
                trees[req_id] = parents[: len(ids)]
            self.proposals.sent[req_id] = list(ids)  # a copy: the scheduler owns the list
        if self.budgets.drafts_sent(budgeted, [len(ids) for ids in drafts]):
            self.report_unmatched()
        if kept:
            # vLLM calls take_draft_token_ids outside inference mode; the buffers are
            # inference tensors (written during the step), so update them inside it
            with torch.inference_mode():
                self._reindex_proposals(kept)
        return trees

    def keep_scheduled(self, kept: dict[str, list[int]]) -> None:
        """The scheduler kept, of each structured-output request's sent drafts, the nodes
        ``kept[r]`` (in order: a subtree, the grammar-valid nodes of the tree): the proposal
        keeps them as its first nodes and they become the drafts it was sent, so that the
        verify step matches the scheduled drafts against them."""
        cut = {}
        for req_id, nodes in kept.items():
            sent = self.proposals.sent.get(req_id)
            if sent is None or nodes == list(range(len(nodes))):
                continue  # a prefix (or nothing to match): matched as it is
            self.proposals.sent[req_id] = [sent[i] for i in nodes]
            cut[req_id] = nodes
        if cut:
            self._reindex_proposals(cut)

    def _usable_depth(self, request, max_model_len: int) -> int:
        """The deepest node a request can still accept in its next verify step (see
        :meth:`clip_drafts`); L for a request the runner does not know."""
        if request is None:
            return self.depth
        return tokens_left(request, max_model_len) - 1

    def _reindex_proposals(self, kept: dict[str, list[int]]) -> None:
        """Request r's proposal keeps nodes ``kept[r]`` (in order) as its first nodes, the rest
        padding. Example: nodes [a, b, ab, c] keeping [0, 2] -> [a, ab, pad, pad], parents
        [-1, 0, -1, -1]."""
        req_ids = list(kept)
        num, width, store = len(req_ids), self.budget, self.proposals
        ops = cpu_ops(self.device)
        if ops is not None:  # the fused CPU kernel: one op
            plan = np.full((num, 1 + width), -1, dtype=np.int64)  # slot, then new -> old node
            plan[:, 0] = store.slots(req_ids)
            for i, req_id in enumerate(req_ids):
                plan[i, 1 : 1 + len(kept[req_id])] = kept[req_id]
            ops.reindex_trees_(*store.tree_buffers(), to_device(plan, torch.int64, self.device))
            return
        # host, one upload: the slots, then per request new -> old node, old -> new node (-1:
        # dropped) and whether the new node is real
        host = np.zeros((3, num, width), dtype=np.int64)
        host[1] = -1
        for i, req_id in enumerate(req_ids):
            keep = kept[req_id]
            host[0, i, : len(keep)] = keep
            host[1, i, keep] = np.arange(len(keep))
            host[2, i, : len(keep)] = 1
        uploaded = to_device(np.concatenate([store.slots(req_ids), host.ravel()]), torch.int64,
                             self.device)
        slots, (index, inverse, valid) = uploaded[:num], uploaded[num:].view(3, num, width)
        valid = valid.bool()
        # the kept nodes' (token, parent, depth), first; a kept node keeps its depth (its
        # ancestors are kept too) and its parent is renumbered; the rest padding
        kept_nodes = store.rows("nodes", slots).gather(2, index[:, None, :].expand(-1, 3, -1))
        old_parents = kept_nodes[:, 1]
        new_parents = torch.where(old_parents >= 0, inverse.gather(1, old_parents.clamp(min=0)),
                                  -1)
        kept_nodes = torch.stack([kept_nodes[:, 0], new_parents, kept_nodes[:, 2]], dim=1)
        store.set_rows("nodes", slots, torch.where(valid[:, None], kept_nodes, self._padding_node))
        # pointer jumping over L levels rebuilds their ancestor rows (a structured request's
        # best path keeps up to L nodes; padding nodes hang off the root)
        store.set_rows("mask", slots, _ancestor_mask(torch.where(valid, new_parents, -1),
                                                     self.depth))
        store.set_rows("scores", slots, torch.where(valid, store.rows("scores", slots).gather(
            1, index), float("-inf")))
        # hsd_chain draft laws need no re-indexing: a chain keeps a prefix of its nodes

    def begin_verify(
        self,
        req_ids: list[str],
        num_draft: list[int],
        draft_token_ids: torch.Tensor,  # [sum(num_draft)] the scheduled drafts, -1 = placeholder
        query_start: list[int],
        num_tokens: int,
        scheduled: list[list[int]] | None = None,
        token_rows: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> VerifyBatch:
        """Build the verify trees of a step from the scheduled drafts and the proposals.

        Example: B = 3, request "a" was proposed tokens [5, 7, 9] with parents [-1, -1, 0]
        and the scheduler kept 2 of them: the verify tree is tokens [5, 7, -1], parents
        [-1, -1, -1] (node 2 is padding). Request "b" has placeholder drafts [-1, -1] and no
        proposal: it is verified as the chain with parents [-1, 0, -1].
        A matched request keeps its proposal's scores; chains get score 0 per node.

        ``scheduled``: each request's scheduled drafts as the scheduler's host lists, where the
        caller has them. When every request with drafts got exactly the drafts it was sent
        (:meth:`clip_drafts` keeps them), each tree is its stored proposal as it is: one gather
        per field and nothing to match on the device (:attr:`VerifyBatch.exact`). Otherwise
        (a cut proposal, placeholders, no ``scheduled``) the drafts are matched on the device.
        ``token_rows``: the request index and query position of each of the step's
        ``num_tokens`` rows (host arrays, vLLM's ``req_indices`` / ``query_pos``); when given,
        :attr:`VerifyBatch.position_shift` holds each row's position shift: query row i of a
        request with drafts moves from ``ctx + i`` to ``ctx + depth(i)``.
        """
        num_rows, width, depth = len(req_ids), self.budget, self.depth
        device, store = self.device, self.proposals
        node, chain, chain_depths, chain_mask, pad_mask, within_depth = _verify_constants(
            width, depth, device)
        slots = store.slots(req_ids)
        exact = scheduled is not None and all(
            m == 0 or (slot >= 0 and store.sent.get(req_id) == drafts)
            for req_id, m, slot, drafts in zip(req_ids, num_draft, slots, scheduled))
        # one upload: per request its draft count, first draft in the flat list, proposal
        # slot (-1: none) and first query row; for an exact step the row each tree is read
        # from (requests without drafts read the store's empty row) and whether the request
        # has a proposal; with token_rows, each token's row in the position-shift table
        counts = np.asarray(num_draft, dtype=np.int64)
        host = [counts, np.cumsum(counts) - counts, np.asarray(slots, dtype=np.int64),
                np.asarray(query_start, dtype=np.int64)]
        if exact:
            host += [np.where(counts > 0, host[2], store.empty_slot), host[2] >= 0]
        if token_rows is not None:
            row_req, row_pos = token_rows
            node_row = row_pos <= counts[row_req]  # the root (0) and the node rows 1..m
            host.append(row_req * (width + 1) + np.where(node_row, row_pos, 0))
        uploaded = to_device(np.concatenate(host), torch.int64, device)
        per_request = uploaded[: (len(host) - (token_rows is not None)) * num_rows]
        counts, draft_starts, slots, starts, *exact_rows = per_request.view(-1, num_rows)
        draft_law = position_shift = offsets = None
        ops = cpu_ops(device)
        if exact:  # each tree is the stored row: the proposal's, or the empty row
            slots, matched = exact_rows[0], exact_rows[1].bool()
        if exact and ops is not None and not self._latest_law_names:
            # the fused CPU kernel: the trees and the position shifts in one op
            token_index = uploaded[per_request.numel():]
            *fields, shift = ops.gather_trees(*store.tree_buffers(), slots, token_index)
            tree = DraftTree(*fields[:3], scores=fields[3], num_nodes=counts,
                             ancestor_mask=fields[4], max_depth=depth)
            if token_rows is not None:
                position_shift = shift
        elif exact:
            tree = DraftTree(
                *store.rows("nodes", slots).unbind(1), scores=store.rows("scores", slots),
                num_nodes=counts, ancestor_mask=store.rows("mask", slots), max_depth=depth)
            if self._latest_law_names:
                draft_law = tuple(store.rows(name, slots) for name in self._latest_law_names)
            offsets = tree.depths - chain_depths  # every scheduled node is real
        else:
            tree, matched, draft_law = self._match_drafts(
                counts, draft_starts, slots, draft_token_ids, node, chain, chain_depths, chain_mask,
                pad_mask, within_depth)
            offsets = torch.where(tree.depths > 0, tree.depths - chain_depths, 0)
        if token_rows is not None and offsets is not None:  # [R, B + 1], root column 0
            table = torch.nn.functional.pad(offsets, (1, 0)).view(-1)
            position_shift = table[uploaded[per_request.numel():]]
        tops = (None if self.calibration is None
                else store.get_all(("top_ids", "top_probs"), slots))
        if tops is not None:  # what the calibration learns from (rows of matched trees)
            tree = dataclasses.replace(tree, tops=DraftTops(*tops))
        self.last_num_draft = list(num_draft)
        self.verify = VerifyBatch(tree=tree, num_draft=list(num_draft),
                                  query_start=list(query_start), num_tokens=num_tokens,
                                  matched=matched, draft_law=draft_law, exact=exact,
                                  starts=starts, position_shift=position_shift)
        self.verdict = None
        self.gather_index = None
        return self.verify

    def _match_drafts(self, counts, draft_starts, slots, draft_token_ids, node, chain, chain_depths,
                      chain_mask, pad_mask, within_depth):
        """:meth:`begin_verify` on the device: each request's scheduled drafts are compared
        with its proposal; a matched request's tree is its proposal cut to its drafts (any
        prefix of it is a subtree: its depths and ancestor rows hold), the others are verified
        as chains (scores 0), cut at the drafting depth L. Returns (tree, matched, law)."""
        num_rows, width = counts.shape[0], self.budget
        device = self.device
        in_draft = node[None, :] < counts[:, None]  # [R, B]
        # scheduled drafts, padded to [R, B] with -1
        flat_drafts = draft_token_ids.to(device=device, dtype=torch.int64).flatten()
        flat_index = (draft_starts[:, None] + node[None, :]).clamp(
            max=max(flat_drafts.numel() - 1, 0))
        if flat_drafts.numel() == 0:
            flat_drafts = torch.full((1,), -1, dtype=torch.int64, device=device)
        scheduled = torch.where(in_draft, flat_drafts[flat_index], -1)
        p_nodes = self.proposals.get("nodes", slots)
        draft_law = None
        chains = chain.expand(num_rows, width)
        if p_nodes is None or p_nodes.shape[2] != width:
            matched = torch.zeros(num_rows, 1, dtype=torch.bool, device=device)
            tokens, parents, scores = scheduled, chains, torch.zeros(num_rows, width, device=device)
            depths, mask = chain_depths.expand(num_rows, width), chain_mask
        else:
            p_tokens, p_parents, p_depths = p_nodes.unbind(1)
            # the proposal's tokens as the scheduler saw them (zero-probability padding -> 0)
            same = (torch.where(in_draft, p_tokens.clamp(min=0), -1) == scheduled).all(
                dim=1, keepdim=True)
            matched = (slots[:, None] >= 0) & same  # [R, 1]
            parents = torch.where(matched, p_parents, chains)
            tokens = torch.where(matched, p_tokens, scheduled)
            scores = self.proposals.get("scores", slots).masked_fill(~matched, 0.0)
            depths = torch.where(matched, p_depths, chain_depths)
            mask = torch.where(matched[:, :, None], self.proposals.get("mask", slots), chain_mask)
            if self._latest_law_names:
                draft_law = tuple(self.proposals.get(name, slots) for name in self._latest_law_names)
        # A chain is cut at the drafting depth L (no verified node is deeper than L, so the
        # walk's rounds are bounded by L, not B); the nodes past it are padding.
        real = in_draft & (matched | within_depth)
        rows_real = torch.cat([torch.ones_like(real[:, :1]), real], dim=1)
        tree = DraftTree(
            token_ids=torch.where(real, tokens, -1),
            parents=torch.where(real, parents, -1),
            depths=torch.where(real, depths, 0),
            scores=scores.masked_fill(~real, float("-inf")),
            num_nodes=real.sum(dim=1),
            ancestor_mask=torch.where(rows_real[:, :, None], mask, pad_mask),
            max_depth=self.depth,
        )
        return tree, matched.squeeze(1), draft_law

    def end_step_without_verify(self) -> None:
        self.last_num_draft = []
        self.verify = None
        self.verdict = None
        self.gather_index = None

    def finish_verify(self, verdict: TreeVerdict) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the walk's verdict; return the (src, dst) flat query rows of the K/V moves
        (:func:`accepted_moves`) and keep the drafter's hidden-state gather index."""
        assert self.verify is not None
        self.verdict = verdict
        src, dst, self.gather_index = accepted_moves(
            verdict.accepted_rows, self.verify.starts, self.verify.num_tokens, self._compacted)
        return src, dst

    def take_gather_index(self, num_tokens: int) -> torch.Tensor | None:
        index, self.gather_index = self.gather_index, None
        if index is None or index.numel() != num_tokens:
            return None
        return index
