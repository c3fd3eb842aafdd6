"""Each request slot's tree, from the step that drafts it to the step that verifies it.

V2 indexes a request's state by a slot (``RequestState.req_id_to_index``) and keeps its drafts
in ``RequestState.draft_tokens[slot]``. :class:`SlotTrees` keeps the rest of the tree in
buffers indexed by the same slot, in the proposal store's layout (``state.ProposalStore``):
``nodes [S + 2, 3, B]`` (token, parent, depth), ``scores [S + 2, B]`` and the packed ancestor
rows ``mask [S + 2, B + 1, W]``. Row ``S`` is the empty tree (B padding nodes) and row
``S + 1`` takes the writes of a batch's padding rows (CUDA-graph padding, dummy runs), so
every read and write is one gather or ``index_copy_`` of fixed shape, with no host data.

A request enters its slot with the empty tree (:meth:`SlotTrees.reset`): until the drafter
writes its first tree, whatever drafts the step verifies for it (placeholders, or zeros) are
padding nodes, never accepted. A request whose features read a row's history as a chain of
drafts (see :func:`needs_chain_history`) drafts a chain instead of a tree: the drafter's first
choice at each depth (what vLLM's ``dflash`` drafts), so every row's history is the chain
before it, as vLLM's sampler and scheduler read it. In ``hsd_chain`` mode every slot drafts a
sampled chain, and keeps the law it was drawn from (``law_probs``, ``law_ids``) for HSD.
"""

from __future__ import annotations

import torch

from vllm_ddtree.calibration import CELLS, TOP_RANKS, DraftTops
from vllm_ddtree.plugin.state import _verify_constants
from vllm_ddtree.tree import PADDING_TOKEN_ID, DraftTree


def needs_chain_history(sampling_params) -> list[str]:
    """The features of a request that vLLM's V2 sampler computes from a row's chain of drafts
    (the rows before it in the request's block): the thinking budget, and structured outputs
    (the scheduler validates drafts as a chain and fills one bitmask row per draft position).
    Tree rows have a path, not a chain, so such a request drafts a chain on V2 (a chain is a
    tree whose paths are the chains vLLM reads). Penalties and bad words are not among them:
    they read each row's path (``verifier.TreePenalties``, ``verifier.TreeBadWords``). Empty:
    the request drafts trees."""
    if sampling_params is None:
        return []
    found = []
    if getattr(sampling_params, "thinking_token_budget", None) is not None:
        found.append("thinking_token_budget")
    if sampling_params.structured_outputs is not None:
        found.append("structured outputs")
    return found


class SlotTrees:
    """The trees of every request slot (see the module doc)."""

    def __init__(self, num_slots: int, budget: int, depth: int, device: torch.device,
                 calibrated: bool = True, law_width: int = 0):
        self.budget, self.depth, self.device = budget, depth, device
        self.calibrated = calibrated  # trees carry their drafter tops (the calibration's)
        self.empty_slot, self.padding_slot = num_slots, num_slots + 1
        rows = num_slots + 2
        node, parents, depths, chain_mask, pad_mask, within = _verify_constants(budget, depth,
                                                                                device)
        self.pad_mask = pad_mask  # [B + 1, W] the ancestor rows of a tree of padding nodes
        # a chain of min(B, L) nodes (node k at depth k + 1), padding beyond: its parents and
        # depths [B], scores [B] (0: chains carry no probabilities) and ancestor rows [B + 1, W]
        self.chain_parents = torch.where(within, parents, -1)
        self.chain_depths = torch.where(within, depths, 0)
        self.chain_scores = torch.where(within, 0.0, float("-inf"))
        rows_within = torch.nn.functional.pad(within, (1, 0), value=True)
        self.chain_mask = torch.where(rows_within[:, None], chain_mask, pad_mask)
        self.nodes = torch.empty(rows, 3, budget, dtype=torch.int64, device=device)
        self.nodes[:, 0], self.nodes[:, 1], self.nodes[:, 2] = PADDING_TOKEN_ID, -1, 0
        self.scores = torch.full((rows, budget), float("-inf"), device=device)
        self.mask = pad_mask.expand(rows, -1, -1).clone()
        # [S + 2] bool: the slot's request drafts chains (needs_chain_history)
        self.chained = torch.zeros(rows, dtype=torch.bool, device=device)
        # [S + 2] bool: the slot's request samples (T > 0): its trees' calibration row
        self.sampled = torch.zeros(rows, dtype=torch.bool, device=device)
        # [S + 2] bool: the slot's request reshapes the target's law (penalties, a grammar...):
        # the calibration does not learn from it (known_params.reshapes_target)
        self.reshaped = torch.zeros(rows, dtype=torch.bool, device=device)
        # the drafter's top tokens of each slot's tree (DraftTops), for the calibration
        self.top_ids = torch.full((rows, depth, TOP_RANKS), -1, dtype=torch.int64,
                                  device=device)
        self.top_probs = torch.zeros(rows, depth, CELLS, device=device)
        # hsd_chain (law_width K > 0): the sparse law each slot's chain was drawn from,
        # probabilities and token ids [S + 2, B, K] (sampling.top_k_draft_law)
        self.law_probs = torch.zeros(rows, budget, law_width, device=device)
        self.law_ids = torch.zeros(rows, budget, law_width, dtype=torch.int64, device=device)

    def reset(self, slot: int, chained: bool, sampled: bool, reshaped: bool = False) -> None:
        """A request enters ``slot``: the empty tree until the drafter writes one."""
        for buf in (self.nodes, self.scores, self.mask, self.top_ids, self.top_probs):
            buf[slot] = buf[self.empty_slot]
        self.chained[slot] = chained
        self.sampled[slot] = sampled
        self.reshaped[slot] = reshaped

    def targets(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows that a batch's ``slots`` (-1: a padding row) write to."""
        return torch.where(slots < 0, self.padding_slot, slots)

    def store(self, slots: torch.Tensor, tree: DraftTree | None, chain: torch.Tensor,
              law: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Keep ``tree`` (row r for slot ``slots[r]``; -1: a padding row) until it is verified,
        or for a slot that drafts chains the chain ``chain [R, >= min(B, L)]`` (the drafter's
        argmax at each depth). ``tree`` None: every slot drafts ``chain``, sampled from ``law``
        (``hsd_chain``: probabilities and ids ``[R, B, K]``, kept for the verify step).

        Returns the node tokens ``[R, B]`` the runner stores as the slots' drafts, with 0 for
        padding nodes (they become input ids; the tree marks them padding). Device ops only.
        """
        target = self.targets(slots)
        width = min(self.budget, self.depth)
        chain = torch.nn.functional.pad(chain[:, :width], (0, self.budget - width),
                                        value=PADDING_TOKEN_ID)  # [R, B]
        num_rows = chain.shape[0]
        nodes = torch.stack([chain, self.chain_parents.expand(num_rows, -1),
                             self.chain_depths.expand(num_rows, -1)], dim=1)
        scores = self.chain_scores.expand(num_rows, -1)
        mask = self.chain_mask.expand(num_rows, -1, -1)
        if tree is not None:
            chained = self.chained[target]  # [R]
            nodes = torch.where(chained[:, None, None], nodes, torch.stack(
                [tree.token_ids, tree.parents, tree.depths], dim=1))  # [R, 3, B]
            scores = torch.where(chained[:, None], scores, tree.scores)
            mask = torch.where(chained[:, None, None], mask, tree.ancestor_mask)
            if tree.tops is not None:
                self.top_ids.index_copy_(0, target, tree.tops.token_ids)
                self.top_probs.index_copy_(0, target, tree.tops.probs)
        if law is not None:
            self.law_probs.index_copy_(0, target, law[0])
            self.law_ids.index_copy_(0, target, law[1])
        self.nodes.index_copy_(0, target, nodes)
        self.scores.index_copy_(0, target, scores)
        self.mask.index_copy_(0, target, mask)
        return torch.where(nodes[:, 2] > 0, nodes[:, 0], 0)

    def law(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sparse laws ``[R, B, K]`` (probabilities, ids) the chains of ``slots`` were
        drawn from (``hsd_chain``)."""
        return self.law_probs[slots], self.law_ids[slots]

    def batch(self, slots: torch.Tensor, num_draft: torch.Tensor, width: int) -> DraftTree:
        """The verify trees of a step: request r verifies the first ``num_draft[r]`` nodes of
        slot ``slots[r]``'s tree (any prefix of a best-first tree is a subtree: the scheduler
        may cut a request's drafts near ``max_model_len``), padded to ``width`` nodes.

        ``slots [R]``, ``num_draft [R]`` on the device; ``width`` (host) >= every count.
        Example: a slot with nodes (token, parent) [(5, -1), (7, -1), (9, 0)] and 2 drafts ->
        tokens [5, 7, -1], parents [-1, -1, -1]: node 2 is padding.
        """
        node = torch.arange(width, device=self.device)
        real = (node[None, :] < num_draft[:, None]) & (self.nodes[slots, 2, :width] > 0)
        nodes = self.nodes[slots, :, :width]
        words = (width + 1 + 31) // 32
        rows_real = torch.cat([torch.ones_like(real[:, :1]), real], dim=1)  # [R, width + 1]
        mask = torch.where(rows_real[:, :, None], self.mask[slots, : width + 1, :words],
                           self.pad_mask[: width + 1, :words])
        return DraftTree(
            token_ids=torch.where(real, nodes[:, 0], PADDING_TOKEN_ID),
            parents=torch.where(real, nodes[:, 1], -1),
            depths=torch.where(real, nodes[:, 2], 0),
            scores=torch.where(real, self.scores[slots, :width], float("-inf")),
            num_nodes=real.sum(dim=1),
            ancestor_mask=mask,
            max_depth=min(self.depth, width),
            tops=(DraftTops(self.top_ids[slots], self.top_probs[slots]) if self.calibrated
                  else None),
        )
