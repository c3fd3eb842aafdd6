"""DDTree / DFlash-chain / plain decoding on Hugging Face transformers (batch size 1).

One round (``start`` = number of committed tokens whose K/V sit in the target cache; the root is
the bonus token of the previous round, at position ``start``, not yet in the cache)::

    draft   drafter(new context features, embed([root, mask x L]))  -> draft_logits [1, L, V]
    tree    build_tree(draft_logits, budget)  (or a chain: argmax / sampled tokens along depth)
    verify  target([root, nodes], positions = start + depth, 4-D mask: full context, ancestors
            inside the tree)  -> logits [1, B + 1, V]; verify_tree / hsd_verify / tokenwise_verify
    commit  K/V of the accepted rows [0, node + 1, ...] gathered to start, start + 1, ...;
            cache cropped; drafter context = target hidden states of those rows

Example (commit): start = 40, accepted rows [0, 3, 7] -> K/V at cache slots [40, 43, 47] move
to [40, 41, 42], the cache is cropped to 43 and the bonus token becomes the next root at 43.

Methods: ``"ar"`` (target only), ``"chain"`` (argmax drafts verified by the walk on a chain),
``"ddtree"`` (optimal tree of ``budget`` nodes, the walk), ``"chain_hsd"`` / ``"chain_tokenwise"``
(drafts SAMPLED from the processed draft distribution, verified by capped HSD / token-wise).
Every method is lossless: greedy outputs equal plain greedy decoding, sampled outputs follow the
target's law.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vllm_ddtree.sampling import (
    SamplingBatch,
    hsd_verify,
    sample_from_probs,
    sample_tokens,
    target_probs_from_logits,
    tokenwise_verify,
)
from vllm_ddtree.tree import DraftTree, build_tree, pack_mask
from vllm_ddtree.walk import verify_tree

from .drafter import DFlashDrafter, DrafterCache

__all__ = ["METHODS", "GenerationResult", "generate", "chain_tree"]

METHODS = ("ar", "chain", "ddtree", "chain_hsd", "chain_tokenwise")
STAGES = ("draft", "tree", "verify", "commit")


@dataclass
class GenerationResult:
    """``output_ids``: generated tokens only (prompt excluded), stop token included."""

    output_ids: list[int]
    num_accepted: list[int]  # per round: draft tokens accepted (bonus excluded)
    stage_times: dict[str, list[float]] = field(default_factory=dict)  # seconds per round
    prefill_time: float = 0.0

    @property
    def acceptance_lengths(self) -> list[int]:
        """Tokens committed per round = accepted + 1 (the bonus): dflash's ``acceptance_lengths``."""
        return [n + 1 for n in self.num_accepted]

    @property
    def tau(self) -> float:
        """Mean accepted tokens per target forward, bonus included."""
        lengths = self.acceptance_lengths
        return sum(lengths) / max(len(lengths), 1)


def chain_tree(token_ids: torch.Tensor) -> DraftTree:
    """A one-path DraftTree: node k has parent k - 1 and depth k + 1.

    Example: token_ids [[5, 9, 2]] -> parents [[-1, 0, 1]], depths [[1, 2, 3]], mask rows
    root: {0}, node 0: {0, 1}, node 1: {0, 1, 2}, node 2: {0, 1, 2, 3} (causal).
    """
    batch, n = token_ids.shape
    device = token_ids.device
    idx = torch.arange(n, device=device)
    causal = torch.ones(n + 1, n + 1, dtype=torch.bool, device=device).tril()
    return DraftTree(
        token_ids=token_ids.long(),
        parents=(idx - 1).expand(batch, n).contiguous(),
        depths=(idx + 1).expand(batch, n).contiguous(),
        scores=torch.zeros(batch, n, dtype=torch.float32, device=device),
        num_nodes=torch.full((batch,), n, dtype=torch.int64, device=device),
        ancestor_mask=pack_mask(causal).expand(batch, -1, -1).contiguous(),
        max_depth=n,
    )


class _Timer:
    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.cuda = enabled, device.type == "cuda"
        self.times: dict[str, list[float]] = {s: [] for s in STAGES} if enabled else {}
        self._t = 0.0

    def start(self) -> None:
        if self.enabled:
            if self.cuda:
                torch.cuda.synchronize()
            self._t = time.perf_counter()

    def stop(self, stage: str) -> None:
        if self.enabled:
            if self.cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.times[stage].append(now - self._t)
            self._t = now


def _sampling(temperature: float, top_p: float, top_k: int, device, generator) -> SamplingBatch | None:
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"{temperature=} must be >= 0, {top_p=} in (0, 1], {top_k=} >= 0")
    if temperature == 0:
        return None
    return SamplingBatch(
        temperature=torch.tensor([float(temperature)], device=device),
        top_k=torch.tensor([int(top_k)], device=device),
        top_p=torch.tensor([float(top_p)], device=device),
        generators={0: generator} if generator is not None else None,
    )


def _tree_attention_mask(tree: DraftTree, context_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, B + 1, context_len + B + 1]`` float mask: 0 = visible, finfo.min = hidden."""
    visible = tree.dense_mask()[:, None]  # [1, 1, B + 1, B + 1]
    ctx = torch.ones(*visible.shape[:-1], context_len, dtype=torch.bool, device=visible.device)
    visible = torch.cat([ctx, visible], dim=-1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)


def _compact_cache(cache, start: int, rows: torch.Tensor) -> None:
    """Gather the K/V of verify rows ``rows`` (row r at slot start + r) to start, start + 1, ...;
    crop the cache to ``start + len(rows)``."""
    src = start + rows
    for layer in cache.layers:
        n = src.numel()
        layer.keys[:, :, start : start + n] = layer.keys.index_select(2, src)
        layer.values[:, :, start : start + n] = layer.values.index_select(2, src)
    remove = cache.get_seq_length() - (start + rows.numel())
    if remove > 0:
        cache.crop(-remove)


def _embed(target, ids: torch.Tensor) -> torch.Tensor:
    return target.get_input_embeddings()(ids)


def _lm_head(target):
    head = getattr(target, "lm_head", None)
    return head if head is not None else target.get_output_embeddings()


@torch.inference_mode()
def generate(
    target,
    drafter: DFlashDrafter | None,
    input_ids: torch.Tensor | list[int],
    method: str = "ddtree",
    budget: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 64,
    stop_token_ids: list[int] | None = None,
    timing: bool = False,
    generator: torch.Generator | None = None,
    tree_temperature: float = 1.0,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (``[1, n]`` or a list).

    ``budget`` (B) is the tree size for ``"ddtree"``; the chain methods draft L = block_size - 1
    tokens; ``tree_temperature`` scales the drafter's logits before the tree is built
    (``build_tree``'s ``temperature``). ``timing=True`` records the draft / tree / verify /
    commit seconds of every round (synchronising CUDA around each stage).
    """
    from transformers import DynamicCache

    if method not in METHODS:
        raise ValueError(f"{method=}, expected one of {METHODS}")
    if method != "ar" and drafter is None:
        raise ValueError(f"{method=} needs a drafter (pass method='ar' for plain decoding)")
    if method == "ddtree" and budget < 1:
        raise ValueError(f"{budget=}, expected >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"{max_new_tokens=}, expected >= 1")
    device = target.device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids.shape={tuple(ids.shape)}, expected [1, n] with n >= 1 (batch size 1)")
    sampling = _sampling(temperature, top_p, top_k, device, generator)
    if method in ("chain_hsd", "chain_tokenwise") and sampling is None:
        method = "chain"  # with a point-mass q both verifiers reduce to the walk on the argmax chain
    stop = set(stop_token_ids or [])
    dtype = next(target.parameters()).dtype
    timer = _Timer(timing, device)
    L = drafter.block_size - 1 if drafter is not None else 0
    cache = DynamicCache(config=target.config)
    dcache = DrafterCache(drafter.config.num_hidden_layers) if drafter is not None else None

    # -- prefill ------------------------------------------------------------------------------
    t0 = time.perf_counter()
    n = ids.shape[1]
    out = target(
        input_ids=ids,
        position_ids=torch.arange(n, device=device)[None],
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=drafter is not None,
        logits_to_keep=1,
    )
    root = sample_tokens(out.logits[:, -1:], sampling)[:, 0]  # [1]
    new_ctx = drafter.context_features(out.hidden_states) if drafter is not None else None  # [1, n, F]
    prefill_time = time.perf_counter() - t0
    generated = [int(root)]
    num_accepted: list[int] = []
    start = n

    while len(generated) < max_new_tokens and generated[-1] not in stop:
        timer.start()
        # -- draft ----------------------------------------------------------------------------
        if method != "ar":
            block = torch.full((1, L + 1), drafter.mask_token_id, dtype=torch.long, device=device)
            block[:, 0] = root
            ctx_pos = torch.arange(start - new_ctx.shape[1], start + L + 1, device=device)[None]
            hidden = drafter(new_ctx, _embed(target, block), ctx_pos, cache=dcache)[:, 1:]
            draft_logits = _lm_head(target)(hidden).float()  # [1, L, V]
            timer.stop("draft")
        # -- tree -----------------------------------------------------------------------------
        draft_probs = None
        if method == "ar":
            tree = chain_tree(torch.empty(1, 0, dtype=torch.long, device=device))
        elif method == "ddtree":
            tree = build_tree(draft_logits, budget, temperature=tree_temperature)
        elif method == "chain":
            tree = chain_tree(draft_logits.argmax(-1))
        else:
            draft_probs = target_probs_from_logits(draft_logits, sampling)  # processed q [1, L, V]
            tree = chain_tree(sample_from_probs(draft_probs, generator=generator))
        timer.stop("tree")
        # -- verify ---------------------------------------------------------------------------
        query = tree.query_token_ids(root)  # [1, B + 1]
        positions = start + tree.position_offsets()
        out = target(
            input_ids=query,
            position_ids=positions,
            attention_mask=_tree_attention_mask(tree, start, dtype),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=drafter is not None,
        )
        logits = out.logits.float()  # [1, B + 1, V]
        if draft_probs is None:
            verdict = verify_tree(tree, logits, sampling)
            n_acc, tokens, rows = verdict.num_accepted, verdict.output_tokens, verdict.accepted_rows
        else:
            p = target_probs_from_logits(logits, sampling)
            verify = hsd_verify if method == "chain_hsd" else tokenwise_verify
            n_acc, tokens = verify(tree.token_ids, draft_probs, p, generator=generator)
            rows = torch.arange(L + 1, device=device)[None]
        timer.stop("verify")
        # -- commit ---------------------------------------------------------------------------
        k = int(n_acc[0])
        keep = rows[0, : k + 1]
        _compact_cache(cache, start, keep)
        if drafter is not None:
            new_ctx = drafter.context_features(out.hidden_states).index_select(1, keep)
        new_tokens = tokens[0, : k + 1].tolist()
        root = tokens[:, k]
        start += k + 1
        num_accepted.append(k)
        for t in new_tokens:
            generated.append(t)
            if t in stop or len(generated) >= max_new_tokens:
                break
        timer.stop("commit")

    return GenerationResult(
        output_ids=generated[:max_new_tokens],
        num_accepted=num_accepted,
        stage_times=timer.times,
        prefill_time=prefill_time,
    )
