"""Request features on tree rows: vLLM's per-request logits processing, applied to every verify
row with the row's own history.

vLLM's sampler processes one row per request whose history is the request's output tokens
(its chain rejection sampler: draft row i has the output plus drafts 0..i-1). In a tree verify
step, request r owns rows ``[root, node_0 .. node_{m-1}]``; the row of node n predicts the token
after the path root -> n, so its history is the request's output tokens plus the path's tokens
(the root row's: the output alone), and its output position is ``len(output) + depth(n)``.
:class:`TreeFeatures` applies, to any subset of those rows, exactly what vLLM's ``Sampler``
applies to a row with that history, in vLLM's order:

1. ``allowed_token_ids``: every other token -> -inf (the same for every row);
2. ``bad_words``: the last token of a bad word -> -inf where the row's history ends with the
   word's other tokens (the path's suffix, then the output's);
3. the built-in logits processors, in vLLM's list order: ``min_tokens`` masks the stop tokens
   while ``len(output) + depth < min_tokens`` (vLLM's rule for structured-output requests:
   unless that leaves the row at -inf), ``logit_bias`` adds its biases;
4. presence / frequency / repetition penalties, counting the output's tokens plus the path's;

and, after the temperature (random rows only, as vLLM does), ``min_p`` (:meth:`after_temperature`).
The law of every row is then the law of plain decoding after the same history, so the walk,
which is lossless for any per-row law, keeps plain decoding's output law.

Everything is on the device and sync-free; the host builds small per-request tables (bad words,
stop tokens, biases: what vLLM's own processors build) once per step, only for the features
present. Memory: one ``[rows, V + 1]`` count table per chunk of rows with penalties.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.plugin.state import to_device
from vllm_ddtree.sampling import cached_arange
from vllm_ddtree.tree import DraftTree, unpack_mask

NEG_INF = float("-inf")
NO_TOKEN = -2  # a history slot before the output's first token: matches no bad word token


@dataclass(frozen=True)
class TreeRows:
    """Where each flat verify row sits: ``request [T]``, ``node [T]`` (-1 for the root row) and
    ``depth [T]`` (0 for the root row), int64 on the device."""

    request: torch.Tensor
    node: torch.Tensor
    depth: torch.Tensor

    @classmethod
    def of(cls, tree: DraftTree, cu_num_rows: torch.Tensor, num_rows: int) -> TreeRows:
        """The rows of a verify step: request r owns rows ``[cu[r - 1], cu[r])`` (vLLM's
        ``cu_num_sampled_tokens``), its root then its nodes in tree order."""
        row = cached_arange(num_rows, tree.token_ids.device)
        ends = cu_num_rows.long()
        request = torch.searchsorted(ends, row, right=True)
        index = row - (ends - torch.diff(ends, prepend=ends.new_zeros(1)))[request]  # 0: root
        depths = torch.nn.functional.pad(tree.depths, (1, 0))  # [R, B + 1]: the root's 0 first
        depth = depths.view(-1)[request * depths.shape[1] + index]
        return cls(request, index - 1, depth)


class TreeFeatures:
    """The request features of one verify step, ready to apply to chunks of its rows.

    Built by :meth:`build` from vLLM's ``SamplingMetadata`` (None when no request of the step
    uses any feature); ``tree`` is the walked tree (its node n is row n + 1 of its request).
    """

    def __init__(self, tree: DraftTree, rows: TreeRows | None, device: torch.device):
        self.tree = tree
        self.rows = rows
        self.device = device
        self.allowed_mask: torch.Tensor | None = None  # [R, V] bool, True = not allowed
        # bad words: per word (request, last token, reversed prefix [K - 1], prefix length)
        self.bad_words: tuple[torch.Tensor, ...] | None = None
        self.output_tail: torch.Tensor | None = None  # [R, K - 1]: output[-1], output[-2], ..
        self.processors: list[tuple[str, tuple[torch.Tensor, ...]]] = []  # in vLLM's order
        self.penalties: tuple[torch.Tensor, ...] | None = None
        self.min_p: torch.Tensor | None = None  # [R] float32

    # ---- building ---------------------------------------------------------------------------

    @classmethod
    def build(cls, sampling_metadata, tree: DraftTree, cu_num_rows: torch.Tensor,
              logits_shape: tuple[int, int]) -> TreeFeatures | None:
        """``cu_num_rows``: vLLM's ``cu_num_sampled_tokens``; ``logits_shape``: ``(T, V)``."""
        device = tree.token_ids.device
        num_reqs = tree.token_ids.shape[0]
        num_rows, vocab = logits_shape
        features = cls(tree, None, device)
        active = False
        if sampling_metadata.allowed_token_ids_mask is not None:
            features.allowed_mask = sampling_metadata.allowed_token_ids_mask[:num_reqs]
            active = True
        outputs = sampling_metadata.output_token_ids
        if sampling_metadata.bad_words_token_ids:
            features._set_bad_words(sampling_metadata.bad_words_token_ids, outputs, num_reqs)
            active = True
        for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
            entry = _processor_entry(processor, num_reqs, device)
            if entry is not None:
                features.processors.append(entry)
                active = True
        if not sampling_metadata.no_penalties:
            features._set_penalties(sampling_metadata, outputs, num_reqs, vocab)
            active = True
        for processor in sampling_metadata.logitsprocs.argmax_invariant:
            min_p = _min_p(processor, num_reqs, device)
            if min_p is not None:
                features.min_p = min_p
                active = True
        if not active:
            return None
        features.rows = TreeRows.of(tree, cu_num_rows, num_rows)
        return features

    @classmethod
    def without_trees(cls, sampling_metadata, logits: torch.Tensor) -> TreeFeatures | None:
        """The features of a step without drafts: one row per request (``logits [R, V]``)."""
        num_reqs, device = logits.shape[0], logits.device
        none = torch.zeros(num_reqs, 0, dtype=torch.int64, device=device)
        tree = DraftTree(token_ids=none, parents=none, depths=none, scores=none.float(),
                         num_nodes=torch.zeros(num_reqs, dtype=torch.int64, device=device),
                         ancestor_mask=torch.ones(num_reqs, 1, 1, dtype=torch.int32,
                                                  device=device), max_depth=0)
        return cls.build(sampling_metadata, tree, cached_arange(num_reqs + 1, device)[1:],
                         tuple(logits.shape))

    def _set_bad_words(self, bad_words: dict[int, list[list[int]]], outputs, num_reqs: int):
        words = [(r, word) for r, ws in sorted(bad_words.items()) if r < num_reqs for word in ws]
        longest = max(len(word) for _, word in words)
        width = max(longest - 1, 1)
        prefixes = [list(reversed(word[:-1])) + [NO_TOKEN] * (width - len(word) + 1)
                    for _, word in words]
        table = to_device([[r, word[-1], len(word) - 1, *prefix]
                           for (r, word), prefix in zip(words, prefixes)], torch.int64, self.device)
        self.bad_words = (table[:, 0], table[:, 1], table[:, 2], table[:, 3:])
        tails = [[NO_TOKEN] * width for _ in range(num_reqs)]
        for r in {r for r, _ in words}:
            tail = list(reversed(outputs[r][-width:]))
            tails[r][: len(tail)] = tail
        self.output_tail = to_device(tails, torch.int64, self.device)

    def _set_penalties(self, sampling_metadata, outputs, num_reqs: int, vocab: int):
        from vllm.model_executor.layers.utils import get_token_bin_counts_and_mask

        _, prompt_mask = get_token_bin_counts_and_mask(
            sampling_metadata.prompt_token_ids[:num_reqs], vocab, num_reqs)
        longest = max((len(out) for out in outputs[:num_reqs]), default=0)
        padded = np.full((num_reqs, max(longest, 1)), vocab, dtype=np.int64)
        for r, out in enumerate(outputs[:num_reqs]):
            padded[r, : len(out)] = out
        padded[padded == -1] = vocab  # async placeholders, as vLLM does
        padded = to_device(padded, torch.int64, self.device)
        counts = torch.zeros(num_reqs, vocab + 1, dtype=torch.int64, device=self.device)
        counts.scatter_add_(1, padded, torch.ones_like(padded))
        self.penalties = (prompt_mask, counts,
                          sampling_metadata.presence_penalties[:num_reqs],
                          sampling_metadata.frequency_penalties[:num_reqs],
                          sampling_metadata.repetition_penalties[:num_reqs])

    # ---- applying ---------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """Process ``logits [c, V]`` float32 (in place) of the flat rows ``row_ids [c]``:
        everything vLLM applies before the temperature. Returns ``logits``."""
        request = self.rows.request[row_ids]
        if self.allowed_mask is not None:
            logits.masked_fill_(self.allowed_mask[request], NEG_INF)
        if self.bad_words is not None:
            self._apply_bad_words(logits, row_ids, request)
        for kind, table in self.processors:
            if kind == "min_tokens":
                self._apply_min_tokens(logits, row_ids, request, *table)
            else:  # logit_bias
                word_request, token, bias = table
                logits.scatter_add_(1, token.expand(len(request), -1),
                                    torch.where(request[:, None] == word_request, bias, 0.0))
        if self.penalties is not None:
            self._apply_penalties(logits, row_ids, request)
        return logits

    def after_temperature(self, logits: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """``min_p`` (vLLM applies it to the temperature-scaled logits of random sampling)."""
        if self.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True).mul_(
                self.min_p[self.rows.request[row_ids]][:, None])
            logits.masked_fill_(probs < threshold, NEG_INF)
        return logits

    def _history(self, row_ids: torch.Tensor, request: torch.Tensor, length: int) -> torch.Tensor:
        """``[c, length]``: token j (0 = the latest) of each row's history, NO_TOKEN before the
        output's first token. The path's tokens come first (parent hops), then the output's."""
        depth = self.rows.depth[row_ids]
        node = self.rows.node[row_ids]
        # a padding column: the root row's walk up reads it, and trees of width 0 have one
        tokens = torch.nn.functional.pad(self.tree.token_ids, (0, 1), value=NO_TOKEN)
        parents = torch.nn.functional.pad(self.tree.parents, (0, 1), value=-1)
        base = request * tokens.shape[1]
        node = torch.where(node >= 0, node, tokens.shape[1] - 1)
        columns = []
        for j in range(length):
            index = base + node
            back = (j - depth).clamp(min=0, max=self.output_tail.shape[1] - 1)
            columns.append(torch.where(j < depth, tokens.view(-1)[index],
                                       self.output_tail[request, back]))
            if j + 1 < length:
                node = torch.where(j + 1 < depth, parents.view(-1)[index], node)
        return torch.stack(columns, dim=1)

    def _apply_bad_words(self, logits, row_ids, request):
        word_request, last, prefix_len, prefix = self.bad_words
        history = self._history(row_ids, request, prefix.shape[1])  # [c, K - 1]
        slots = cached_arange(prefix.shape[1], self.device)
        same = (history[:, None, :] == prefix[None]) | (slots >= prefix_len[:, None])[None]
        banned = (request[:, None] == word_request) & same.all(dim=-1)  # [c, words]
        logits.scatter_add_(1, last.expand(len(request), -1),
                            torch.where(banned, NEG_INF, 0.0))

    def _apply_min_tokens(self, logits, row_ids, request, stop_request, stop_token, remaining,
                          restore):
        depth = self.rows.depth[row_ids]
        masked = (request[:, None] == stop_request) & (depth[:, None] < remaining)  # [c, S]
        if bool(restore.numel()):  # structured-output requests keep a row that would be all -inf
            values = logits.gather(1, stop_token.expand(len(request), -1))
            finite = torch.isfinite(values)
            left = torch.isfinite(logits).sum(dim=-1) - (masked & finite).sum(dim=-1)
            keep = restore & (left == 0)[:, None]
            masked &= ~keep
        logits.scatter_add_(1, stop_token.expand(len(request), -1),
                            torch.where(masked, NEG_INF, 0.0))

    def _apply_penalties(self, logits, row_ids, request):
        from vllm._custom_ops import apply_repetition_penalties

        prompt_mask, counts, presence, frequency, repetition = self.penalties
        vocab = logits.shape[1]
        row_counts = counts[request]  # [c, V + 1]: the output's tokens
        width = self.tree.token_ids.shape[1]
        if width:  # plus the path's: the nodes on the row's ancestor row, the root excluded
            path = unpack_mask(self.tree.ancestor_mask[request, (self.rows.node[row_ids] + 1)],
                               width + 1)[:, 1:]
            tokens = self.tree.token_ids[request]
            row_counts.scatter_add_(1, torch.where(tokens >= 0, tokens, vocab),
                                    (path & (tokens >= 0)).long())
        row_counts = row_counts[:, :vocab]
        output_mask = row_counts > 0
        apply_repetition_penalties(logits, prompt_mask[request], output_mask, repetition[request])
        logits -= frequency[request].unsqueeze(dim=1) * row_counts
        logits -= presence[request].unsqueeze(dim=1) * output_mask


def _processor_entry(processor, num_reqs: int, device: torch.device):
    """vLLM's built-in non-argmax-invariant processors as per-request tables, or None when the
    processor has nothing to do in this step."""
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    if isinstance(processor, MinTokensLogitsProcessor):
        entries = [(r, tok, min_tok - len(out), structured)
                   for r, (min_tok, out, stops, structured) in sorted(processor.min_toks.items())
                   if r < num_reqs and len(out) < min_tok for tok in sorted(stops)]
        if not entries:
            return None
        table = to_device([e[:3] for e in entries], torch.int64, device)
        restore = to_device([e[3] for e in entries] if any(e[3] for e in entries) else [],
                            torch.bool, device)
        return "min_tokens", (table[:, 0], table[:, 1], table[:, 2], restore)
    if isinstance(processor, LogitBiasLogitsProcessor):
        entries = [(r, tok, bias) for r, biases in sorted(processor.biases.items())
                   if r < num_reqs for tok, bias in biases.items()]
        if not entries:
            return None
        index = to_device([e[:2] for e in entries], torch.int64, device)
        bias = to_device([e[2] for e in entries], torch.float32, device)
        return "logit_bias", (index[:, 0], index[:, 1], bias)
    raise RuntimeError(f"ddtree: unknown logits processor {type(processor).__name__} "
                       "(vLLM refuses custom logits processors with speculative decoding)")


def _min_p(processor, num_reqs: int, device: torch.device) -> torch.Tensor | None:
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    if not isinstance(processor, MinPLogitsProcessor):
        raise RuntimeError(f"ddtree: unknown logits processor {type(processor).__name__}")
    if not processor.min_p_count:
        return None
    return to_device(processor.min_p_cpu[:num_reqs].copy(), torch.float32, device)
