"""Peak extra memory of a verify step's target sampling, as a multiple of the logits' size.

Setting (issue #10): R = 4 requests with B = 256 drafts each, T = R (B + 1) = 1028 flat rows,
V = 151936 (Qwen3's vocabulary), float32 logits ``[T, V]`` (596 MiB) as vLLM's sampler
receives them. Sampling settings: all greedy; T 0.6 / top-k 20 / top-p 0.95 (Qwen3's
defaults) for every request; and a mix (request 0 greedy, request 1 seeded, requests 2-3 at
T 0.6 / top-k 20 / top-p 0.95). ``hsd_chain`` rows: R = 64 chains of B = 15 (T = 1024) at
T 1.0 / top-k 20 / top-p 0.95, the drafter law held between the proposal and the verify step
reported beside.

Paths:

- ``old``: the plugin sampler before issue #10 (commit d38f397): the verify rows padded to
  ``[R, w + 1, V]`` (a copy), then ``verify_tree`` (``processed_logits``: a full-vocabulary
  sort with float and int64 copies) or, with seeded requests, ``sample_tokens`` plus vLLM's op
  per seeded request; hsd: ``target_probs_from_logits`` and the dense ``hsd_verify``. Rebuilt
  here from the functions that remain in :mod:`vllm_ddtree.sampling`.
- ``new``: ``TreeRejectionSampler.forward`` (vLLM's ``TopKTopPSampler`` on chunks of rows, the
  walk; hsd: ``hsd_verify_rows``). Without vLLM (the GPU box): the same core
  (``sample_rows`` / ``hsd_verify_rows`` + ``walk``) with :func:`native_topk_topp`, a copy of
  vLLM 0.32's native op (FlashInfer, which vLLM uses on CUDA, needs less).
- ``vllm_sampler``: vLLM's own ``Sampler`` on the same ``[T, V]`` logits as T independent rows
  (vLLM without speculation for T requests); it divides the logits in place, so it gets a
  clone made before the measurement.
- ``vllm_rejection``: vLLM's ``RejectionSampler`` on R chains of B drafts. Its four Triton
  kernels cannot run on a CPU: they are replaced by stand-ins that allocate nothing (the
  kernels only write preallocated outputs), and ``MAX_SPEC_LEN`` (128) is raised to B, so
  every allocation it makes in Python is counted; its output tokens are meaningless.

Measurement: on CUDA, ``torch.cuda.max_memory_allocated()`` minus the allocated bytes at the
start (peak stats reset first). On the CPU, PyTorch's profiler with ``profile_memory=True``
records every allocation and free of the CPU allocator (``[memory]`` events with signed byte
counts, op-internal temporaries included); the peak of their running sum is the extra memory
(inputs are allocated before, outputs counted until the end). Each path runs once unmeasured
first (lazy initialisation). Numbers are multiples of the logits' bytes (``[T, V]`` float32).
Cross-check on the CPU (tree mode, T 0.6 / top-k 20 / top-p 0.95): the peak RSS of a fresh
process (``MALLOC_MMAP_THRESHOLD_=65536``, VmHWM reset through ``/proc/self/clear_refs``) gave
the same multiples (old 7.25x, new 0.59x).

Usage: ``python benchmarks/sampler_memory.py [--out benchmarks/results/sampler_memory_cpu.json]``
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_ddtree.sampling import (  # noqa: E402
    GeneratorNoise,
    RowSampling,
    SamplingBatch,
    hsd_verify,
    hsd_verify_rows,
    pack_sparse_law,
    processed_logits,
    processed_probs_of_rows,
    sample_rows,
    sample_tokens,
    target_probs_from_logits,
    top_k_draft_law,
    verify_rows,
)
from vllm_ddtree.tree import DraftTree, _ancestor_mask, build_tree  # noqa: E402
from vllm_ddtree.walk import verify_tree, walk  # noqa: E402

try:
    import vllm  # noqa: F401

    HAS_VLLM = True
except ImportError:
    HAS_VLLM = False

VOCAB = 151936


# ---------------------------------------------------------------------------------------------
# measurement


def peak_extra_bytes(fn) -> int:
    """Peak bytes allocated by ``fn()`` beyond what was live when it started."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        del result
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and "CPU" in str(e.device_type())]
    running = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak


# ---------------------------------------------------------------------------------------------
# vLLM 0.32's native top-k/top-p op, copied (Apache-2.0) for machines without vLLM


def native_topk_topp(logits, generators, k, p):
    """``TopKTopPSampler.forward_native`` of vLLM 0.32 (``apply_top_k_top_p_pytorch`` then
    ``random_sample``), in place on ``logits`` like the original."""
    logits = native_mask(logits, k, p)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for i, generator in generators.items():
        q[i].exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1).view(-1), None


def native_mask(logits, k, p):
    """vLLM 0.32's ``apply_top_k_top_p_pytorch`` (the masking half of :func:`native_topk_topp`)."""
    if k is None and p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        top_k_mask = logits_sort.gather(1, (logits_sort.size(1) - k.long()).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < top_k_mask, -float("inf"))
    if p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
        top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
        top_p_mask[:, -1] = False
        logits_sort.masked_fill_(top_p_mask, -float("inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


# ---------------------------------------------------------------------------------------------
# inputs


def make_setting(name: str, num_reqs: int, vocab: int, device):
    """vLLM's sampling metadata for one setting (sampling only: no other request feature)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    temperature = top_k = top_p = None
    generators = {}
    if name != "greedy":
        temperature = torch.full((num_reqs,), 0.6 if name != "hsd" else 1.0, device=device)
        top_k = torch.full((num_reqs,), 20, dtype=torch.int32, device=device)
        top_p = torch.full((num_reqs,), 0.95, device=device)
    if name == "mixed":
        temperature[0] = 0.0
        top_k[0], top_p[0] = vocab, 1.0
        generators = {1: torch.Generator(device=device).manual_seed(7)}
    return SamplingMetadata(
        temperature=temperature, all_greedy=name == "greedy",
        all_random=name not in ("greedy", "mixed"), top_p=top_p, top_k=top_k,
        generators=generators, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(num_reqs, device=device),
        presence_penalties=torch.zeros(num_reqs, device=device),
        repetition_penalties=torch.ones(num_reqs, device=device),
        output_token_ids=[[] for _ in range(num_reqs)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def spec_metadata(num_draft: list[int], drafts: torch.Tensor, device):
    cu_draft = torch.tensor(num_draft, device=device).cumsum(0).to(torch.int32)
    cu_sampled = (torch.tensor(num_draft, device=device) + 1).cumsum(0).to(torch.int32)
    starts = cu_sampled - torch.tensor(num_draft, device=device, dtype=torch.int32) - 1
    target = torch.cat([starts[r] + torch.arange(m, device=device, dtype=torch.int32)
                        for r, m in enumerate(num_draft)])
    return SimpleNamespace(num_draft_tokens=num_draft, max_spec_len=max(num_draft),
                           draft_token_ids=drafts.flatten().to(torch.int32),
                           cu_num_draft_tokens=cu_draft, cu_num_sampled_tokens=cu_sampled,
                           target_logits_indices=target, bonus_logits_indices=cu_sampled - 1,
                           logits_indices=torch.arange(int(cu_sampled[-1]), device=device))


def batch_of(setting) -> SamplingBatch | None:
    if setting.all_greedy:
        return None
    return SamplingBatch(setting.temperature, setting.top_k, setting.top_p,
                         setting.generators or None)


# ---------------------------------------------------------------------------------------------
# the paths


def old_tree_path(logits, tree, num_draft, setting):
    """The plugin sampler of commit d38f397, tree mode."""
    width = max(num_draft)
    rows, start = [], 0
    for m in num_draft:
        rows.append(list(range(start, start + m + 1)) + [-1] * (width - m))
        start += m + 1
    rows = torch.tensor(rows, device=logits.device)
    padded = logits[rows.clamp(min=0)]  # [R, width + 1, V]
    sampling = batch_of(setting)
    if sampling is None or not sampling.generators:
        return verify_tree(tree, padded, sampling).output_tokens
    import dataclasses

    sampled = sample_tokens(padded, dataclasses.replace(sampling, generators=None))
    for r, generator in sampling.generators.items():
        row = SamplingBatch(temperature=sampling.temperature[r:r + 1],
                            top_k=sampling.top_k[r:r + 1], top_p=sampling.top_p[r:r + 1])
        row_logits = processed_logits(padded[r:r + 1, :num_draft[r] + 1], row)[0].float()
        tokens, _ = native_topk_topp(row_logits, {i: generator for i in range(num_draft[r] + 1)},
                                     None, None)
        sampled[r, :num_draft[r] + 1] = tokens
    return walk(tree, sampled).output_tokens


def new_tree_path(logits, tree, metadata, setting, sampler):
    """TreeRejectionSampler.forward (vLLM) or its core with vLLM's native op copied."""
    num_draft = metadata.num_draft_tokens
    if sampler is not None:
        return sampler(metadata, None, logits, setting).sampled_token_ids
    sampling = batch_of(setting)
    rows = None if sampling is None else RowSampling.expand(
        sampling, metadata.cu_num_sampled_tokens, num_draft, logits.shape[1])
    sampled = sample_rows(logits, rows, native_topk_topp, all_random=setting.all_random)
    rows_index = verify_rows(metadata.cu_num_sampled_tokens, max(num_draft))
    return walk(tree, sampled[rows_index]).output_tokens


def vllm_sampler_path(logits_clone, setting, num_rows):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    def rows(x):
        return None if x is None else x.repeat_interleave(num_rows // x.shape[0])

    generators = {}
    per_req = num_rows // len(setting.temperature) if setting.temperature is not None else 0
    for r, gen in setting.generators.items():
        generators.update({r * per_req + i: gen for i in range(per_req)})
    device = logits_clone.device
    metadata = SamplingMetadata(
        temperature=rows(setting.temperature), all_greedy=setting.all_greedy,
        all_random=setting.all_random, top_p=rows(setting.top_p), top_k=rows(setting.top_k),
        generators=generators, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(num_rows, device=device),
        presence_penalties=torch.zeros(num_rows, device=device),
        repetition_penalties=torch.ones(num_rows, device=device),
        output_token_ids=[[] for _ in range(num_rows)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    sampler = Sampler()
    return lambda: sampler(logits_clone, metadata).sampled_token_ids


def vllm_rejection_path(logits, num_draft, tree, setting):
    """vLLM's RejectionSampler with its Triton kernels replaced by allocation-free stand-ins."""
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    def expand(out, x, cu, replace_from, replace_to):
        index = torch.arange(out.shape[0], device=out.device, dtype=cu.dtype)
        request = torch.searchsorted(cu, index, right=True)
        out.copy_(torch.where(x == replace_from, replace_to, x)[request])

    def nothing(*args, **kwargs):
        return None

    rs.MAX_SPEC_LEN = max(rs.MAX_SPEC_LEN, max(num_draft))
    rs._expand = expand
    rs._rejection_greedy_sample = rs._rejection_random_sample = rs._sample_recovered_tokens = nothing
    num_reqs = len(num_draft)
    device = logits.device
    metadata = SamplingMetadata(
        temperature=setting.temperature, all_greedy=setting.all_greedy, all_random=setting.all_random,
        top_p=setting.top_p, top_k=setting.top_k, generators=setting.generators,
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(num_reqs, device=device),
        presence_penalties=torch.zeros(num_reqs, device=device),
        repetition_penalties=torch.ones(num_reqs, device=device),
        output_token_ids=[[] for _ in range(num_reqs)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    spec = spec_metadata(num_draft, tree.token_ids.clamp(min=0), device)
    sampler = rs.RejectionSampler.__new__(rs.RejectionSampler)
    torch.nn.Module.__init__(sampler)
    sampler.sampler, sampler.use_fp64_gumbel = Sampler(), False
    sampler.is_processed_logprobs_mode = sampler.is_logits_logprobs_mode = False
    sampler.synthetic_conditional_rates, sampler.synthetic_mode = None, False
    return lambda: sampler(spec, None, logits, metadata).sampled_token_ids


def old_hsd_path(logits, tree, dense_law, num_draft, setting):
    """Commit d38f397's hsd_chain verify: padded rows, the walk, dense target law, dense HSD."""
    width = max(num_draft)
    rows = torch.arange(len(num_draft), device=logits.device)[:, None] * (width + 1)
    padded = logits[rows + torch.arange(width + 1, device=logits.device)]  # [R, B + 1, V]
    sampling = batch_of(setting)
    walked = verify_tree(tree, padded, sampling).output_tokens
    target_probs = target_probs_from_logits(padded, sampling)
    return walked, hsd_verify(tree.token_ids, dense_law, target_probs)[1]


def new_hsd_path(logits, tree, law, metadata, setting, sampler):
    """TreeRejectionSampler.forward in hsd_chain mode, or its core without vLLM."""
    if sampler is not None:
        return sampler(metadata, None, logits, setting).sampled_token_ids
    num_draft = metadata.num_draft_tokens
    cu = metadata.cu_num_sampled_tokens
    rows = RowSampling.expand(batch_of(setting), cu, num_draft, logits.shape[1])
    rows_index = verify_rows(cu, max(num_draft))
    walked = walk(tree, sample_rows(logits, rows, native_topk_topp)[rows_index])
    return walked, hsd_verify_rows(
        lambda index: processed_probs_of_rows(logits, index, rows, native_mask), logits.shape[1],
        rows_index, tree.token_ids, law[0], law[1], GeneratorNoise())[1]


def plugin_sampler(mode, budget, tree, num_draft, device, law=None):
    """A TreeRejectionSampler whose state holds ``tree`` as the verify batch (None without vLLM)."""
    if not HAS_VLLM:
        return None
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C, whose CPU sampling op vLLM uses)

    from vllm_ddtree.plugin.options import DDTreeOptions
    from vllm_ddtree.plugin.sampler import TreeRejectionSampler
    from vllm_ddtree.plugin.state import TreeState

    state = TreeState(DDTreeOptions(budget=budget, depth=max(budget, 15), mode=mode), device)
    req_ids = [f"r{i}" for i in range(len(num_draft))]
    state.record_proposal(req_ids, tree, law)
    starts = [r * (budget + 1) for r in range(len(num_draft))]
    state.begin_verify(req_ids, num_draft, tree.token_ids.clamp(min=0).flatten(), starts,
                       sum(num_draft) + len(num_draft))
    return TreeRejectionSampler(state)


# ---------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--num-reqs", type=int, default=4)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    num_reqs, budget, vocab = args.num_reqs, args.budget, args.vocab
    num_draft = [budget] * num_reqs
    num_rows = sum(num_draft) + num_reqs
    logits = torch.randn(num_rows, vocab, device=device) * 3  # [T, V] float32
    base = logits.numel() * logits.element_size()
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else
               f"cpu ({platform.machine()})", "torch": torch.__version__, "vllm": HAS_VLLM,
               "method": "torch.cuda.max_memory_allocated" if device.type == "cuda" else
               "torch.profiler CPU allocator events (peak of the running sum)",
               "tree": {}, "hsd_chain": {}, "notes": []}
    if not HAS_VLLM:
        results["notes"].append("vLLM not importable: the vLLM sampler paths are skipped and "
                                "the new path runs its core with a copy of vLLM's native op")
        print(results["notes"][-1])

    def measure(name, fn, size=base):
        fn()  # warm-up
        value = peak_extra_bytes(fn) / size
        print(f"  {name:16s} {value:6.2f}x")
        return round(value, 3)

    # tree mode: R trees of B nodes
    tree = build_tree(torch.randn(num_reqs, 15, vocab, device=device), budget)
    metadata = spec_metadata(num_draft, tree.token_ids.clamp(min=0), device)
    sampler = plugin_sampler("tree", budget, tree, num_draft, device)
    results["tree_setting"] = dict(num_reqs=num_reqs, budget=budget, vocab=vocab, rows=num_rows,
                                   logits_bytes=base)
    print(f"tree: {device}, R={num_reqs} B={budget} V={vocab} T={num_rows}, "
          f"logits {base / 2**20:.0f} MiB")
    for name, kind in (("greedy", "greedy"), ("t0.6_k20_p0.95", "sampled"), ("mixed_seeded", "mixed")):
        setting = make_setting(kind, num_reqs, vocab, device)
        print(name)
        row = {"old": measure("old", lambda: old_tree_path(logits, tree, num_draft, setting)),
               "new": measure("new", lambda: new_tree_path(logits, tree, metadata, setting, sampler))}
        if HAS_VLLM:
            clone = logits.clone()
            row["vllm_sampler"] = measure("vllm_sampler", vllm_sampler_path(clone, setting, num_rows))
            del clone
            row["vllm_rejection"] = measure("vllm_rejection",
                                            vllm_rejection_path(logits, num_draft, tree, setting))
        results["tree"][name] = row
    del sampler

    # hsd_chain: as many rows, as chains of B = 15 sampled from the drafter's top-K law
    hsd_budget = 15
    hsd_reqs = num_rows // (hsd_budget + 1)
    hsd_draft = [hsd_budget] * hsd_reqs
    hsd_logits = logits[: hsd_reqs * (hsd_budget + 1)]
    hsd_base = hsd_logits.numel() * hsd_logits.element_size()
    setting = make_setting("hsd", hsd_reqs, vocab, device)
    drafter = torch.randn(hsd_reqs, hsd_budget, vocab, device=device) * 3
    probs, ids = top_k_draft_law(drafter, setting.temperature)
    dense_law = torch.softmax(drafter / setting.temperature[:, None, None], dim=-1)
    del drafter
    parents = (torch.arange(hsd_budget, device=device) - 1).expand(hsd_reqs, hsd_budget)
    chain = DraftTree(token_ids=ids[..., 0], parents=parents,
                      depths=torch.arange(1, hsd_budget + 1, device=device).expand(hsd_reqs, -1),
                      scores=torch.zeros(hsd_reqs, hsd_budget, device=device),
                      num_nodes=torch.full((hsd_reqs,), hsd_budget, device=device),
                      ancestor_mask=_ancestor_mask(parents, hsd_budget), max_depth=hsd_budget)
    packed = pack_sparse_law(probs, ids, vocab)
    hsd_metadata = spec_metadata(hsd_draft, chain.token_ids, device)
    sampler = plugin_sampler("hsd_chain", hsd_budget, chain, hsd_draft, device, (packed,))
    print(f"hsd_chain: R={hsd_reqs} B={hsd_budget} T={hsd_reqs * (hsd_budget + 1)}, "
          f"logits {hsd_base / 2**20:.0f} MiB, T 1.0 / top-k 20 / top-p 0.95")
    results["hsd_chain"] = {
        "setting": dict(num_reqs=hsd_reqs, budget=hsd_budget, rows=hsd_reqs * (hsd_budget + 1),
                        logits_bytes=hsd_base, temperature=1.0, top_k=20, top_p=0.95),
        "old": measure("old", lambda: old_hsd_path(hsd_logits, chain, dense_law, hsd_draft, setting),
                       hsd_base),
        "new": measure("new", lambda: new_hsd_path(hsd_logits, chain, (probs, ids), hsd_metadata,
                                                   setting, sampler), hsd_base),
        "draft_law_old": round(dense_law.numel() * 4 / hsd_base, 4),
        "draft_law_new": round(packed.numel() * 4 / hsd_base, 4),
    }
    print(f"  draft law kept from proposal to verify: {results['hsd_chain']['draft_law_old']:.3f}x "
          f"dense [R, B, V] -> {results['hsd_chain']['draft_law_new']:.4f}x packed [R, B, 2K]")
    results["command"] = " ".join(["python", *sys.argv])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
