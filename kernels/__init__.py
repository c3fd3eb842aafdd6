"""Triton kernels of vllm-ddtree, each with a plain torch twin (installs as vllm_ddtree.kernels).

- :func:`tree_attention` / :func:`tree_attention_ref`: paged attention of a verify step, causal
  over the context and ancestor-only inside each request's tree.
- :func:`compact_kv` / :func:`compact_kv_ref`: move the accepted path's K/V to the first slots of
  the draft region, in every layer, in one launch.
- ``verify_steps``: the verify step's tree build, walk and finish_verify on CUDA, one launch
  each (their twins: the torch paths in ``vllm_ddtree`` and the fused CPU ops of ``csrc``).

Importing this package never needs a working Triton backend: the @triton.jit bodies live in
``*_kernel.py`` modules that the launchers import on first call.
"""

from .compact_kv import KVCacheTable, compact_kv
from .reference import (
    compact_kv_ref,
    flatten_kv_caches,
    masked_attention_ref,
    request_attention_mask,
    tree_attention_ref,
    unpack_tree_mask,
)
from .tree_attention import tree_attention

__all__ = [
    "tree_attention",
    "tree_attention_ref",
    "masked_attention_ref",
    "request_attention_mask",
    "unpack_tree_mask",
    "compact_kv",
    "compact_kv_ref",
    "flatten_kv_caches",
    "KVCacheTable",
]
