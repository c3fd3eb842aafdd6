"""K/V compaction after a verify step: the accepted path moves to the chain slots.

vLLM's scheduler assumes chains: after a step that verified ``m`` drafts and accepted ``k``,
the request's tokens are the first ``1 + k`` query slots. A tree puts accepted node ``q_j`` at
query slot ``q_j + 1``, so its K/V is copied to slot ``j`` in every target layer before the
next forward (on the same stream). Drafter layers need no compaction: DFlash rewrites their
context K/V from the gathered hidden states every step (see ``proposer.py``).

:class:`KVCompactor` is built once per runner when the KV caches exist
(``initialize_kv_cache``): it groups the target's layer caches by KV-cache group, head size and
CPU kernel ISA, drops duplicates (KV-sharing layers alias another layer's cache: moving it twice
would be harmless but wasted work), and uploads one pointer table per group on CUDA, or
builds each cache's slot layout on the CPU. A step then costs a few ops on the pairs, one
gather of each group's slot mapping and one ``compact_kv`` launch per group on CUDA, and one
fused op per slot layout on the CPU (``copy_slots_``; its torch twin runs one gather and one
scatter per layer cache, vLLM allocating one tensor per layer), with no host synchronisation
and no host-to-device copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_ddtree.kernels import KVCacheTable, compact_kv
from vllm_ddtree.kernels.native import cpu_ops


@dataclass
class CacheGroup:
    """Target layer caches of one KV-cache group that share shape and layout."""

    group_id: int  # vLLM's KV-cache group: its block table gives the slots
    head_dim: int
    isa: str | None  # vLLM's CPU attention kernel ISA (CPU only): the slot layout
    caches: list[torch.Tensor]  # one per distinct layer cache, [nb, nkv, bs, 2 * head_dim]
    table: object | None = None  # CUDA: the group's KVCacheTable (pointer table), built once
    layouts: list | None = None  # CPU: one CPUKVLayout per cache, built once
    # CPU, fused kernel: (flat caches, offsets, slot stride) per distinct slot layout
    native: list | None = None


def kv_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CUDA layer cache, logical ``[nb, nkv, bs, 2 * D]`` in any physical stride order
    -> (K, V) views ``[nb, bs, nkv, D]``, the layout the Triton kernels take."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
    return key_cache, value_cache


def _storage_key(cache: torch.Tensor) -> tuple:
    return (cache.untyped_storage().data_ptr(), cache.storage_offset(), tuple(cache.shape),
            cache.stride())


def target_cache_groups(kv_cache_groups, forward_context, drafter_layers) -> list[CacheGroup]:
    """The target's layer caches, grouped by (KV-cache group, head size, ISA), each distinct
    cache once.

    A group whose layers differ in shape (vLLM's ``UniformTypeKVCacheSpecs``, e.g. a drafter
    with other KV heads than the target in the target's group) is split by head size, so each
    entry holds caches of one shape and layout. Example: layers a, b, c of group 0 where c
    shares a's cache (``kv_sharing_target_layer_name``) -> one group with the caches of a, b.
    """
    groups: dict[tuple[int, int, str | None], CacheGroup] = {}
    seen: set[tuple] = set()
    for gid, group in enumerate(kv_cache_groups):
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
        for name in group.layer_names:
            if name in drafter_layers:
                continue
            layer = forward_context[name]
            cache = layer.kv_cache
            if not isinstance(cache, torch.Tensor) or cache.numel() == 0:
                continue
            key = _storage_key(cache)
            if key in seen:
                continue
            seen.add(key)
            head_dim = per_layer.get(name, group.kv_cache_spec).head_size
            isa = getattr(layer, "isa", None)
            entry = groups.setdefault((gid, head_dim, isa), CacheGroup(gid, head_dim, isa, []))
            entry.caches.append(cache)
    return list(groups.values())


class KVCompactor:
    """Moves accepted K/V to chain slots in every target layer (see the module doc)."""

    def __init__(self, kv_cache_groups, forward_context: dict, drafter_layers, depth: int,
                 slot_mapping: Callable[[int, int], torch.Tensor],
                 use_triton: bool | None = None):
        """``kv_cache_groups``: vLLM's KV-cache groups; ``forward_context``: layer name ->
        layer (``compilation_config.static_forward_context``); ``drafter_layers``: the
        drafter's layer names (never moved); ``depth``: L, the pairs per request in every
        verify step; ``slot_mapping(group_id, num_tokens)``: the K/V slot of each of the
        step's rows in that group (the runner's buffer: V1 and V2 keep it in different
        places). ``use_triton``: compact with the Triton kernel (vLLM's CUDA cache layout);
        None decides by the caches' device (tests force it on the CPU under
        TRITON_INTERPRET=1)."""
        self.depth = depth
        self.slot_mapping = slot_mapping
        self.groups = target_cache_groups(kv_cache_groups, forward_context,
                                          set(drafter_layers or ()))
        for group in self.groups:
            if use_triton if use_triton is not None else group.caches[0].is_cuda:
                group.table = KVCacheTable.from_caches(
                    [kv_views(cache, group.head_dim) for cache in group.caches]
                )
            else:
                from vllm_ddtree.plugin.cpu_attention import cpu_kv_layout  # vLLM's CPU ops

                group.layouts = [cpu_kv_layout(cache, group.isa) for cache in group.caches]
                shared: dict[int, tuple] = {}  # caches of one slot layout: one native call
                for layout in group.layouts:
                    entry = shared.setdefault(id(layout.offsets), (
                        [], layout.offsets.contiguous(), layout.slot_stride))
                    entry[0].append(layout.flat)
                group.native = list(shared.values())

    @classmethod
    def of_v1_runner(cls, runner, use_triton: bool | None = None) -> KVCompactor:
        """The compactor of vLLM's V1 runner: its slots are in the input batch's block tables."""
        return cls(runner.kv_cache_config.kv_cache_groups,
                   runner.compilation_config.static_forward_context,
                   getattr(runner.drafter, "_draft_attn_layer_names", ()),
                   runner.ddtree_state.depth,
                   lambda gid, n: runner.input_batch.block_table[gid].slot_mapping.gpu[:n],
                   use_triton)

    def compact(self, src_rows: torch.Tensor, dst_rows: torch.Tensor, num_tokens: int,
                num_requests: int, slot_mappings: dict[int, torch.Tensor] | None = None) -> None:
        """Copy query row ``src_rows[n]``'s K/V to query row ``dst_rows[n]``'s slot (a ``-1``
        on either side: skip) in every target layer. Rows index this step's flat batch of
        ``num_tokens``; the pairs are ``num_requests`` equal groups, one per request (as
        :meth:`~vllm_ddtree.plugin.state.TreeState.finish_verify` returns them), moved in
        parallel on CUDA.

        Example: rows 44 -> 42 with group 0's slot mapping [.., 42: 1030, .., 44: 1032, ..]
        copies slot 1032 to slot 1030 in each layer of group 0. A skipped pair becomes slots
        (-1, -1) for ``compact_kv`` on CUDA; the fused CPU kernel skips it (its torch twin,
        :func:`~vllm_ddtree.plugin.cpu_attention.copy_cpu_slots`, copies the null block's slot
        onto itself).

        ``slot_mappings``: each KV-cache group's slot of every row, in place of this step's
        (a pipeline stage's moves of the previous step, ``stages.py``).
        """
        skip = None
        for group in self.groups:
            # query row -> K/V slot of this group (each group has its own block table); a -1
            # row reads the last row's slot, replaced just below
            slot_mapping = (self.slot_mapping(group.group_id, num_tokens)
                            if slot_mappings is None else slot_mappings[group.group_id])
            if group.table is None and (ops := cpu_ops(slot_mapping.device)) is not None:
                # the fused CPU kernel: every cache of a slot layout in one op
                for flats, offsets, slot_stride in group.native:
                    ops.copy_slots_(flats, offsets, slot_stride, slot_mapping, src_rows, dst_rows)
                continue
            if skip is None:
                skip = torch.minimum(src_rows, dst_rows) < 0  # [n]
            if group.table is not None:
                # a tensor per side, not two views of one: the kernel's compile key holds
                # each pointer's 16-byte alignment
                compact_kv(group.table, slot_mapping[src_rows].masked_fill_(skip, -1),
                           slot_mapping[dst_rows].masked_fill_(skip, -1),
                           group_size=src_rows.shape[0] // num_requests)
            else:
                from vllm_ddtree.plugin.cpu_attention import NULL_SLOT, copy_cpu_slots

                slots = slot_mapping[torch.stack((src_rows, dst_rows))]  # [2, n]
                copy_cpu_slots(group.layouts, slots.masked_fill_(skip, NULL_SLOT))

    def warm_up(self) -> None:
        """Compile the compaction kernel of every group now (engine start), not mid-serving.

        All pairs are -1, so nothing moves. The kernel's compile key depends on the pairs per
        request (the drafting depth L, fixed per engine), not on the number of requests (see
        ``compact_kv``), so this one launch per group covers every step.
        """
        depth = self.depth  # pairs per request in every verify step
        for group in self.groups:
            if group.table is None:
                continue
            skip = torch.full((depth,), -1, dtype=torch.int64, device=group.table.device)
            compact_kv(group.table, skip, skip, group_size=depth)
