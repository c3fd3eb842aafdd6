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
5. ``thinking_token_budget``: the row's next token is forced (its logit set to 1e9) where plain
   decoding's thinking-budget state after the row's history forces it (:func:`forced_tokens`);

and, after the temperature (random rows only, as vLLM does), ``min_p`` (:meth:`after_temperature`).
The law of every row is then the law of plain decoding after the same history, so the walk,
which is lossless for any per-row law, keeps plain decoding's output law.

Everything is on the device and sync-free; the host builds small per-request tables (bad words,
stop tokens, biases: what vLLM's own processors build) once per step, only for the features
present. Memory: one ``[rows, V + 1]`` count table per chunk of rows with penalties. The one
exception is the thinking budget: its state machine is vLLM's host code, so a step with such a
request reads its trees on the host (a synchronisation on CUDA, in those steps only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.plugin.state import to_device
from vllm_ddtree.sampling import cached_arange
from vllm_ddtree.tree import DraftTree

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
        self.forced: torch.Tensor | None = None  # [T] int64: the token forced on a row, -1 none

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
        holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
        if isinstance(holder, ForcedRows):  # a step without drafts: computed already
            features.forced = holder.forced
            active = True
        elif holder is not None and holder.has_tracked_requests():
            features.forced = _forced_rows(holder, outputs, tree, cu_num_rows)
            active = active or features.forced is not None
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
        if self.forced is not None:
            force(logits, self.forced[row_ids])
        return logits

    def after_temperature(self, logits: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """``min_p`` (vLLM applies it to the temperature-scaled logits of random sampling)."""
        if self.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True).mul_(
                self.min_p[self.rows.request[row_ids]][:, None])
            logits.masked_fill_(probs < threshold, NEG_INF)
        return logits

    def _apply_bad_words(self, logits, row_ids, request):
        word_request, last, prefix_len, prefix = self.bad_words
        path = self.tree.path_tokens(request, self.rows.node[row_ids])
        history = row_history(path, self.output_tail[request], prefix.shape[1])
        ban_bad_words(logits, history, request, word_request, last, prefix_len, prefix)

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
        row_counts = counts[request]  # [c, V + 1]: the output's tokens, plus the path's
        path = self.tree.path_tokens(request, self.rows.node[row_ids])
        row_counts.scatter_add_(1, torch.where(path >= 0, path, vocab), (path >= 0).long())
        row_counts = row_counts[:, :vocab]
        output_mask = row_counts > 0
        apply_repetition_penalties(logits, prompt_mask[request], output_mask, repetition[request])
        logits -= frequency[request].unsqueeze(dim=1) * row_counts
        logits -= presence[request].unsqueeze(dim=1) * output_mask


def row_history(path: torch.Tensor, output_tail: torch.Tensor, length: int) -> torch.Tensor:
    """``[c, length]``: token j (0 = the latest) of each row's history: its path's tokens
    (``DraftTree.path_tokens``, -1 past the root), then its request's output, newest first
    (``output_tail [c, >= length]``, NO_TOKEN before the output's first token).
    Example: path [9, 5, -1], output tail [4, 3, NO_TOKEN] -> [9, 5, 4] for length 3."""
    depth = (path >= 0).sum(dim=1, keepdim=True)  # [c, 1]
    if path.shape[1] < length:
        path = torch.nn.functional.pad(path, (0, length - path.shape[1]), value=-1)
    column = cached_arange(length, path.device)[None, :]
    from_output = output_tail.gather(1, (column - depth).clamp(min=0).expand(len(path), -1))
    return torch.where(column < depth, path[:, :length], from_output)


def ban_bad_words(logits: torch.Tensor, history: torch.Tensor, request: torch.Tensor,
                  word_request: torch.Tensor, last: torch.Tensor, prefix_len: torch.Tensor,
                  prefix: torch.Tensor) -> None:
    """vLLM's bad words on rows with their own history (:func:`row_history`): a word's last
    token -> -inf in row i where the row's request is the word's (``request [c]``,
    ``word_request [W]``; -1 matches no row) and its history ends with the word's other tokens
    (``prefix [W, K]`` newest first, ``prefix_len [W]`` of them count). ``logits [c, V]``, in
    place; ``history [c, K]``."""
    slots = cached_arange(prefix.shape[1], logits.device)
    same = (history[:, None, :] == prefix[None]) | (slots >= prefix_len[:, None])[None]
    banned = (request[:, None] == word_request) & same.all(dim=-1)  # [c, words]
    logits.scatter_add_(1, last.expand(len(request), -1), torch.where(banned, NEG_INF, 0.0))


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


# ---- thinking budgets ---------------------------------------------------------------------------

PLAIN_STATE = "ddtree_plain"  # our key in vLLM's per-request thinking state: see forced_tokens
FORCED_LOGIT = 1e9  # vLLM's (ThinkingBudgetStateHolder._apply_forcing_to_logits)


def _plain_step(holder, state: dict, output: list[int]) -> tuple[dict, int | None]:
    """One sampler call of plain decoding (no speculation) for a request whose output is
    ``output``: vLLM's ``ThinkingBudgetStateHolder.update_state`` then ``apply_to_logits``, on a
    copy of ``state``. Returns the new state and the token forced on the row that predicts the
    token after ``output`` (None: not forced). Without speculation the forced row is always
    the request's one row (``force_index`` 0)."""
    state = dict(state)  # vLLM replaces the state's values, never mutates them in place
    state.update(output_tok_ids=output, spec_token_ids=[], in_spec_mode=False, force_index=[])
    holder._update_think_state(state)
    if not state.get("in_end", False):
        return state, None
    if state["end_count"] > 0:
        state["bonus_token_forced"] = False
    end_ids = holder.think_end_token_ids
    if state["bonus_token_forced"] or not state["force_index"] or state["end_count"] >= len(end_ids):
        return state, None
    return state, end_ids[state["end_count"]]


def _forced_rows(holder, outputs: list[list[int]], tree: DraftTree,
                 cu_num_rows: torch.Tensor) -> torch.Tensor | None:
    """:func:`forced_tokens` of a verify step's trees, read on the host: the one host read of
    the per-step code, in steps with a thinking budget only (a synchronisation on CUDA)."""
    num_nodes = torch.diff(cu_num_rows.long(), prepend=cu_num_rows.new_zeros(1)) - 1
    return forced_tokens(holder, outputs, tree.token_ids.tolist(), tree.parents.tolist(),
                         num_nodes.tolist(), tree.token_ids.device)


def forced_tokens(holder, outputs: list[list[int]], token_ids: list[list[int]],
                  parents: list[list[int]], num_nodes: list[int],
                  device: torch.device) -> torch.Tensor | None:
    """The token each verify row must emit under ``thinking_token_budget``, or None if none.

    ``holder``: the input batch's ``ThinkingBudgetStateHolder`` (its ``_state`` has an entry per
    batch index of a request with a budget); request r's rows are its root then its nodes
    ``0 .. num_nodes[r] - 1`` (``token_ids`` / ``parents`` of its tree, host lists). Returns
    ``[T]`` int64 on ``device``: the forced token of each flat row, -1 where none.

    The law is plain decoding's: vLLM's own state machine is stepped once per token, as its
    sampler steps it once per decode step, along each row's history (the output, then the
    node's path). Per request, the state after its output is kept in vLLM's entry (moved and
    dropped with it) and advanced by the tokens emitted since; each node's state is its
    parent's advanced by the node's token. (vLLM's holder itself never runs on ddtree's
    rows: in a speculative engine it would count chains of drafts.) After a preemption vLLM
    starts the entry afresh and the state is rebuilt token by token from the prompt. An entry
    is the row's request's only while it holds that request's output list (the one vLLM gave
    it when the request was added): others are stale and dropped.
    """
    starts = [0]
    for m in num_nodes:
        starts.append(starts[-1] + m + 1)
    forced = [-1] * starts[-1]
    for r, entry in list(holder._state.items()):
        if r >= len(num_nodes):
            continue
        output = outputs[r]
        if entry["output_tok_ids"] is not output:
            # a finished request's entry: vLLM 0.32's holder keeps it when condense() moves a
            # request without a budget into the slot (a move whose source has no entry leaves
            # the target's). Its output list is the finished request's, never the row's.
            del holder._state[r]
            continue
        kept = entry.get(PLAIN_STATE)
        if kept is None or kept[0] > len(output):
            kept = (-1, holder._init_state_entry(entry["prompt_tok_ids"],
                                                 entry["thinking_token_budget"]), None)
        length, state, token = kept
        while length < len(output):
            length += 1
            state, token = _plain_step(holder, state, output[:length])
        entry[PLAIN_STATE] = (length, state, token)
        row = starts[r]
        if token is not None:
            forced[row] = token
        states, paths = [], []
        for node in range(num_nodes[r]):
            parent = parents[r][node]
            path = (paths[parent] if parent >= 0 else []) + [token_ids[r][node]]
            node_state, node_token = _plain_step(
                holder, states[parent] if parent >= 0 else state, output + path)
            states.append(node_state)
            paths.append(path)
            if node_token is not None:
                forced[row + 1 + node] = node_token
    if all(token < 0 for token in forced):
        return None
    return to_device(forced, torch.int64, device)


def force(logits: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """vLLM's forcing: ``logits [c, V]`` gets FORCED_LOGIT at each row's ``forced [c]`` token
    (rows with -1 untouched), in place, without a synchronisation."""
    column = forced.clamp(min=0)[:, None]
    kept = logits.gather(1, column)
    logits.scatter_(1, column, torch.where(forced[:, None] >= 0, FORCED_LOGIT, kept))
    return logits


class ForcedRows:
    """The thinking budgets of a step without drafts, in the interface vLLM's ``Sampler``
    calls (``thinking_budget_state_holder``): the rows' forced tokens, already computed by
    :func:`forced_tokens` (one row per request), applied where vLLM applies its own."""

    def __init__(self, forced: torch.Tensor):
        self.forced = forced

    def has_tracked_requests(self) -> bool:
        return True

    def update_state(self, *args, **kwargs) -> None:
        pass

    def apply_to_logits(self, logits: torch.Tensor, predict_bonus_token: bool = False,
                        spec_token_ids=None) -> torch.Tensor:
        return force(logits, self.forced)
