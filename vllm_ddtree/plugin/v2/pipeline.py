"""Pipeline parallelism on Model Runner V2: every stage verifies the same trees and moves its
own layers' K/V along the accepted paths.

V2 runs the drafter and the sampler on the last stage only. vLLM's ``PPHandler`` broadcasts
each step's sampled tokens (``num_sampled`` with them) and drafts from the last stage; a stage
before it receives them on a side stream and consumes them ``pp_size`` steps later
(``get_prev_sampled_outputs``), before the request's next forward (V2 schedules a request's
decodes ``pp_size`` steps apart). :class:`TreePPHandler` wraps that handler:

- **The trees.** With the drafts, the last stage broadcasts each request's tree structure (its
  slot's nodes and packed ancestor rows, :class:`~vllm_ddtree.plugin.v2.trees.SlotTrees`); a
  stage stores them in its own slots when it consumes the drafts, so its next verify step
  attends over the same trees at the same depth positions as the last stage.
- **The accepted paths.** Nothing more is sent: at consume time a stage walks the tree it
  verified (kept at ``receive``) with the broadcast output tokens, the first ``num_sampled -
  1`` of them as the accepted nodes' tokens (siblings carry distinct tokens, so that path is
  unique: the last stage's, whether its walk or HSD picked it), and moves its own layers' K/V
  along it (``state.accepted_moves``, ``compaction.KVCompactor``) with the slot mappings of
  the verify step, also kept at ``receive``. Requests freed since are left alone: their blocks
  may belong to another request by then.

Example: a stage verified a request's tree with tokens [5, 7, 9] and parents [-1, -1, 1], its
root at position c; the last stage's output is [7, 9, 4] with ``num_sampled`` 3: nodes 1 and 2
were accepted, so node 1's K/V moves from position c + 2 to c + 1 and node 2's from c + 3 to
c + 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.utils.torch_utils import async_tensor_h2d
from vllm.v1.worker.gpu.pp_utils import compute_need_sampled_mask

from vllm_ddtree.plugin.state import VerifyBatch, accepted_moves
from vllm_ddtree.walk import walk

NO_TOKEN = -2  # matches no node's token (padding nodes hold -1)


@dataclass
class _Received:
    """What a stage keeps of one step until it consumes that step's broadcast."""

    event: torch.cuda.Event | None  # the trees' broadcast is done (None: no drafts came)
    nodes: torch.Tensor | None  # [R, 3, B] int64 the drafted trees (token, parent, depth)
    mask: torch.Tensor | None  # [R, B + 1, W] int32 their packed ancestor rows
    verify: VerifyBatch | None  # the trees this stage verified in that step
    slot_mappings: torch.Tensor | None  # [groups, num_tokens] that step's K/V slots


class TreePPHandler:
    """vLLM's V2 ``PPHandler`` (``handler``) with the trees and the stages' K/V moves (see the
    module doc); ``step``: the runner's :class:`~vllm_ddtree.plugin.v2.model_state.TreeStep`.
    Everything else is the handler's."""

    def __init__(self, handler, step):
        self.handler, self.step = handler, step

    def __getattr__(self, name: str):
        return getattr(self.handler, name)

    def _broadcast(self, tensors: tuple[torch.Tensor, ...]) -> None:
        handler = self.handler
        for tensor in tensors:
            torch.distributed.broadcast(tensor, src=handler.last_rank,
                                        group=handler.broadcast_group)

    def broadcast_drafts(self, draft_tokens: torch.Tensor, *args, **kwargs) -> None:
        """The last stage: vLLM's drafts, then, where they were sent, the trees of the step's
        batch. (0.32 passes the batch and sends when a request needs the step's outputs;
        0.33 sends when it sent the step's sampled tokens.)"""
        handler = self.handler
        handler.broadcast_drafts(draft_tokens, *args, **kwargs)
        batch = self.step.input_batch
        sent = getattr(handler, "sampled_tokens_broadcast", None)  # 0.33
        if sent is None:
            sent = compute_need_sampled_mask(batch) is not None
        if not sent:
            return
        trees = self.step.trees
        with torch.cuda.stream(handler.broadcast_stream):
            handler.broadcast_stream.wait_stream(handler.main_stream)
            slots = batch.idx_mapping
            slots.record_stream(handler.broadcast_stream)
            self._broadcast((trees.nodes[slots].contiguous(), trees.mask[slots].contiguous()))

    def receive(self, input_batch, *args, **kwargs) -> bool:
        """A stage before the last: vLLM's receive, then the trees where drafts came (after
        them, as they were sent), and what the step's verify needs to move this stage's K/V
        later."""
        handler = self.handler
        all_decode_next = handler.receive(input_batch, *args, **kwargs)
        pending = handler.queue[-1]
        if pending is None:  # nothing was broadcast for this step
            return all_decode_next
        nodes = mask = event = None
        if pending.draft_tokens is not None:
            trees, num_reqs = self.step.trees, input_batch.num_reqs
            with torch.cuda.stream(handler.broadcast_stream):
                nodes = torch.empty((num_reqs, *trees.nodes.shape[1:]),
                                    dtype=trees.nodes.dtype, device=trees.device)
                mask = torch.empty((num_reqs, *trees.mask.shape[1:]), dtype=trees.mask.dtype,
                                   device=trees.device)
                self._broadcast((nodes, mask))
                event = handler.broadcast_stream.record_event()
                nodes.record_stream(handler.main_stream)
                mask.record_stream(handler.main_stream)
        verify = self.step.verify_of(input_batch)
        slot_mappings = (None if verify is None
                         else self.step.slot_mappings[:, : verify.num_tokens].clone())
        pending.ddtree = _Received(event, nodes, mask, verify, slot_mappings)
        return all_decode_next

    def get_prev_sampled_outputs(self, *args, **kwargs):
        """A stage before the last, ``pp_size`` steps later: vLLM's update, then the trees
        drafted in that step into this stage's slots, and that step's verify's K/V moves."""
        handler = self.handler
        pending = handler.queue[0] if handler.queue else None
        outputs = handler.get_prev_sampled_outputs(*args, **kwargs)
        received = getattr(pending, "ddtree", None)
        if received is None:
            return outputs
        freed = handler.req_idx_gen_np[pending.idx_mapping_np] != pending.gen_at_receive_np
        keep_np = pending.need_sampled_mask & ~freed
        if not keep_np.any():
            return outputs
        keep = async_tensor_h2d(keep_np, dtype=torch.bool, device=self.step.device)
        if received.nodes is not None:
            handler.main_stream.wait_event(received.event)
            trees = self.step.trees
            target = torch.where(keep, pending.idx_mapping, trees.padding_slot)
            trees.nodes.index_copy_(0, target, received.nodes)
            trees.mask.index_copy_(0, target, received.mask)
        if received.verify is not None:
            self._move_kv(received, pending.sampled_tokens, pending.num_sampled, keep)
        return outputs

    def _move_kv(self, received: _Received, output: torch.Tensor, num_sampled: torch.Tensor,
                 keep: torch.Tensor) -> None:
        """Walk the kept requests' verified trees along their output tokens (the first
        ``num_sampled - 1``) and move this stage's K/V as the last stage did."""
        verify = received.verify
        tree = verify.tree
        num_accepted = torch.where(keep, num_sampled.long() - 1, 0)
        depth = torch.nn.functional.pad(tree.depths, (1, 0))  # [R, W + 1] each row's depth
        tokens = output.gather(1, depth.clamp(max=output.shape[1] - 1))
        sampled = torch.where(depth < num_accepted[:, None], tokens, NO_TOKEN)
        accepted_rows = walk(tree, sampled).accepted_rows
        src, dst, _ = accepted_moves(accepted_rows, verify.starts, verify.num_tokens,
                                     self.step.moved)
        slot_mappings = dict(enumerate(received.slot_mappings))
        self.step.compactor.compact(src, dst, verify.num_tokens, tree.token_ids.shape[0],
                                    slot_mappings)
