"""The tree-budget policy of one model runner: how many nodes each request drafts, per step.

``ddtree_budget_policy`` (see ``options.py``):

- ``"static"``: every request gets B = ``num_speculative_tokens`` nodes.
- a table of ``[max_running_requests, budget]`` rows: every request of a step with R requests
  gets the budget of the first row whose bound covers R; a budget of 0 pauses the drafter.
- ``"auto"``: per-request budgets from :func:`vllm_ddtree.budget.auto_budgets`, on the device,
  inside the tree build: calibrated node gains against the step cost model the engine measured
  at start-up (:mod:`vllm_ddtree.plugin.costs`), corrected online by the step times it sees.

What the drafter does when a step gives no request any node: it still stores the context
K/V of the step's new tokens in its cache (DFlash's context pass, a few small GEMMs), but skips
its query pass, the lm_head and the tree build, and the scheduler gets no drafts, so the next
step is a plain decoding step. This stays correct because verification never depends on the
drafter (no drafts: vLLM's own sampler), and the drafter's cache stays complete, so when
drafting resumes its context is exactly the committed text. In auto's long pauses, until
``WARM_UP`` steps before the probe, the drafter goes cold: it skips even the context pass
(:meth:`BudgetController.keeps_context`) for the new tokens of running requests (prompt rows
keep theirs: the prefix cache shares prompts, ``DDTreeProposer.skip_context``). Those requests
then lack context and draft nothing (``TreeState.plan_step``, ``TreeState.context_complete``);
still correct, as verification never depends on what the drafter proposes.

"auto" pauses the drafter when even its best tree does not beat plain decoding (by the model
until this regime has both kinds of step measured, then by the measured rates below) in
``PAUSE_AFTER`` consecutive steps while drafting has mostly not paid lately in this regime (a
running rate of "draft" answers below one half: a few unsure trees, as at the start of a
generation, do not switch off a drafter that pays), and probes again after a pause that doubles
each time the probe's answer stays the same (8 steps, then 16, ... up to 512), per batch-size
bucket (R's power of two): a new regime of traffic gets its own answer. Once the measured rates
decide (below), a probe drafts until ``MIN_MEASURED`` of its own verify steps are measured and
answers with their rate alone (``_probing``); when a probe answers "no", the next pause is at
least as long as keeps the measured loss of the probes under ``PROBE_LOSS`` of the time
(``_pause_length``), what resuming the drafter costs included (``resume_s``, below), up to
``MAX_LOSS_PAUSE`` steps: past the doubling's ``MAX_PAUSE`` where drafting loses much (half the
throughput at 8 requests on the CPU asks for ~1400 steps; capped at 512 its probes lost ~2.6 %
of the time). That loss is priced by drafting's long-run rate in the bucket (every measured
drafting step, weight ``LONG_RUN_EMA``, never restarted), not by the probe's own steps: the
probe answered for the requests it met, the next probe meets the bucket's traffic. At one
request a bad prompt answers "no" and the pauses double while it lasts, but a drafter that
pays in the long run is not paused across the next prompts (pricing by the probe's steps
paused one for 512 steps, eight prompts of 64 tokens, after one bad prompt on the tiny pair).
A drafter that loses 11 % of the throughput while it drafts (auto's trees at 32 requests on
the CPU) pauses for ~290 steps after its first probe; one that loses 2 % and costs nothing
to resume still doubles from 8. ``PROBE_LOSS`` is 1 %: where drafting never pays, auto's floor
(a step that drafts nothing still carries vLLM's speculative bookkeeping: 0.96-0.97 of plain
decoding's throughput on the CPU, docs/measurements.md) less the probes is where auto runs.
The first pause of a sequence stays ``FIRST_PAUSE``: at one request the running rate follows
each prompt's acceptance, and one bad prompt must not pause a drafter that pays for long.
Where decisions are made: every rank of a tensor-parallel group runs its own controller, and
the controllers stay identical by construction (``ranks.py``): they read time only from the
scheduler's clock stamp of each step (``SchedulerOutput.ddtree_clock``, broadcast to every
rank with the step), a start-up cost model reduced over the ranks, the step's emitted tokens and
device results that are identical on every rank. No rank reads its own clock for a decision.

Exploration trees: the calibration learns only from verified nodes, and the budget function
leaves out nodes whose calibrated gain is low, so a score bin the drafter underrates would
never be verified and stay underrated. Every ``EXPLORE_TREE_EVERY``-th proposal step of a
single request whose drafting pays by the measured rates drafts the full-width tree instead
(:meth:`BudgetController._explores`); at one request that costs what static B costs, and the
calibration it feeds serves every batch size. Head to head at one request on the tiny pair
(docs/measurements.md), auto went from 0.955 to 0.972 of static B = 16 with at most 16 nodes,
and from 0.951 to 0.962 with at most 24.

Near-ties go to the larger tree: the budget function takes the largest tree (the longest
prefix of the nodes ranked by gain) whose modelled rate is within ``TREE_TIE`` (1 %) of the
best tree's, not the best tree itself, over nodes that have a gain (a request without drafter
context, or past its structured-output limit, still gets none). The nodes the model is least
sure of are the trees' tails (the calibration's cells with the least evidence), and they are
the ones it cuts:
replaying recorded full-width trees of one request (``benchmarks/tree_replay.py``, two sets of
prompts, nodes priced at 1, 1.5 and 2 times the recorded cost model), the nodes auto's best
trees cut were accepted 1.3-1.7x as often as it predicted, and those trees made 0.9-2.7 % less
than the best fixed width. Taking the largest tree within 1 % gained 0.4-2.3 % over them and
left auto within 0 to 1.2 % of the best fixed width in every case; by the model's own
reckoning it costs at most ``TREE_TIE`` of a step.

Online correction: the wall time between consecutive decode steps is compared with the cost
model's prediction for what the step did (drafter on, or paused); the running differences
(``on_overhead``, ``off_overhead``, seconds, >= 0) are added to the two sides of the comparison,
so the step's work that the start-up measurement of forwards cannot see (vLLM's scheduling and
input preparation, the plugin's stages: half of a step on the CPU) is learned. It is added,
not multiplied: it does not grow with the nodes of a tree, so a model scaled by it would price
each node as if it cost the whole step's overhead too, and size the trees too small (a scale,
multiplying every tree's time alike, also left the trees exactly as the model sized them). One
observation is clipped to [1/2, 2] x the corrected prediction and weighs ``OVERHEAD_EMA`` (a page
fault or another process's burst must not switch the drafter off).

Measured rates: the model sizes the trees, but whether drafting pays at all is also checked
against what the engine actually got. Per batch bucket, decode steps that verified drafts
("drafting" steps) and steps that neither verified nor drafted ("plain" steps) each keep
running averages (weight ``MEASURED_EMA``) of their wall time and of the tokens they emitted
(vLLM's own host copy of the sampled tokens: no extra synchronisation), a verify step's
tokens counted along the batch's critical request (:func:`critical_tokens`: the batch's size
times the tokens of the request with the most left; trees move requests unevenly, and a batch
that nothing refills is done when that request is, so per-step totals overrated drafting at 8
and 32 requests in waves on the CPU, docs/measurements.md). A step that verifies
drafts but does not draft again (a probe answered "no") counts as drafting, with the model's
drafter time added, so every probe refreshes the drafting rate and a drafter that became
faster than plain decoding is found again. Once both kinds have ``MIN_MEASURED`` steps, the
measured rates alone decide whether to draft: a drafting step answers "no" whenever drafting's
measured tokens per second fall below plain decoding's, and "yes" otherwise, whatever the model
said (its trees are then the best given that the drafter runs, not compared with plain
decoding): a cost the model cannot see (the CPU's tree attention, an unlucky drafter on this
traffic) cannot keep a losing drafter on, and a cost it overrates cannot keep a paying one off.
A bucket that has drafted ``EXPLORE_AFTER`` measured steps with no plain ones pauses once for
``FIRST_PAUSE`` steps to measure them, and while drafting keeps paying it re-measures plain
decoding the same way every ``REMEASURE_AFTER`` steps, or less often where that would cost
more than ``REMEASURE_LOSS`` of the time (``_remeasure_interval``), starting its plain average
afresh: a plain rate measured while the machine was slow (another tenant's burst) must not keep
a drafter on that no longer pays. Steps that draft without verifying (the first of a probe) and
steps with a prefill are not counted in the rates.

Resuming costs: the first step of a drafting run verifies nothing, yet it runs the drafter,
and after a pause that first writes the context the pause kept (``DDTreeProposer.flush_context``:
up to ``WARM_UP`` steps of every request's rows). Its time beyond what plain decoding takes for
its tokens is kept per bucket (``resume_s``, a running average with weight ``RESUME_EMA``) and
charged to every probe in ``_pause_length``: at 32 requests on the CPU such a step took ~31 ms
against 12.7 ms for a plain one, a cost comparable to the probe's loss by the rates, which
pauses that left it out did not cover.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from vllm_ddtree.budget import Calibration, CostModel, TablePolicy, budget_function
from vllm_ddtree.plugin.options import DDTreeOptions

logger = logging.getLogger("vllm.ddtree")  # under vLLM's logger: its handlers and format

FIRST_PAUSE, MAX_PAUSE = 8, 512  # steps: auto's pause after a "do not draft" answer, doubling
MAX_LOSS_PAUSE = 2048  # steps: the longest pause that the probes' measured loss may ask for
PAUSE_AFTER = 2  # consecutive "do not draft" answers before the first pause of a bucket
ANSWER_EMA = 0.2  # weight of each answer in a bucket's running rate of "draft" answers
OVERHEAD_EMA = 0.1  # weight of each new step-time observation in the online correction
MEASURED_EMA = 0.1  # weight of each step in a bucket's measured drafting / plain rates
LONG_RUN_EMA = 0.02  # weight of each drafting step in a bucket's long-run drafting rate
MIN_MEASURED = 4  # steps of each kind before the measured rates can say "no"
PROBE_STEPS = MIN_MEASURED + 2  # steps the drafter runs in a probe (one verifies nothing)
PROBE_LOSS = 0.01  # the most of the time that probes of a measured-losing drafter may lose
EXPLORE_AFTER = 16  # measured drafting steps after which a bucket with no plain ones pauses
REMEASURE_AFTER = 256  # steps after which a drafting bucket measures plain decoding again ...
REMEASURE_LOSS = 0.0025  # ... or later, while that costs more than this share of the time
MAX_REMEASURE = 1024  # the longest interval between two re-measurements of plain decoding
RESUME_EMA = 0.5  # weight of each drafting run's first step in a bucket's resume cost
WARM_UP = 32  # steps before a probe from which a paused drafter keeps its context again
EXPLORE_TREE_EVERY = 16  # proposal steps between two full-width trees where drafting pays
TREE_TIE = 0.01  # the largest tree within this share of the best tree's modelled rate
LOG_INTERVAL_S = 10.0  # the periodic log line (vLLM's stats interval)


def critical_tokens(emitted: list[int], left: list[int]) -> float:
    """The tokens a verify step is worth to the measured rates: the batch's size times the
    tokens of its critical request, the one that had the most tokens left before the step
    (``left[r] + emitted[r]``, ``left``: what each request may still emit after it; requests
    tied for the most share the mean of their tokens).

    Trees move requests unevenly. Where nothing replaces the requests that finish (a batch
    submitted together), the batch is done when its critical request is, and the steps after
    the others have finished run a few requests at a step's cost; all the tokens a step
    emitted would overrate it. In a server's steady state the critical request is the newest,
    whose acceptance is like any other's; at one request it is the request itself. Example:
    a wave in step, both requests with 10 tokens left, emitting 4 and 2: worth 2 x 3 = 6
    tokens; a step later with 6 and 8 left, emitting 1 and 3: the second is critical, 2 x 3.
    """
    before = [n + e for n, e in zip(left, emitted)]
    most = max(before, default=0)
    tied = [e for b, e in zip(before, emitted) if b == most]
    return len(emitted) * sum(tied) / max(len(tied), 1)


def has_structured_outputs(request) -> bool:
    """Whether a request on the worker (vLLM's ``CachedRequestState``) samples under a grammar:
    it sends at most :attr:`BudgetController.structured_limit` nodes (``TreeState.clip_drafts``),
    and auto prices each of them with the scheduler's grammar time."""
    params = getattr(request, "sampling_params", None)
    return getattr(params, "structured_outputs", None) is not None


@dataclass
class MeasuredRate:
    """Running averages of one kind of step's wall time and emitted tokens (a plain mean over
    the first ``1 / ema`` steps, then exponential)."""

    seconds: float = 0.0
    tokens: float = 0.0
    steps: int = 0
    fresh: int = 0  # steps since the average last started afresh (:meth:`restart`)
    ema: float = MEASURED_EMA  # the weight of each step once past the plain mean

    def add(self, seconds: float, tokens: int) -> None:
        self.steps += 1
        self.fresh += 1
        weight = max(1.0 / self.fresh, self.ema)
        self.seconds += weight * (seconds - self.seconds)
        self.tokens += weight * (tokens - self.tokens)

    def restart(self) -> None:
        """Start the average afresh: the next step replaces it, then a plain mean again (the
        count of steps measured so far stays)."""
        self.fresh = 0

    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclass
class PolicyStats:
    """Counters since the last log line (host)."""

    steps: int = 0  # proposal steps
    drafted: int = 0  # ... in which the drafter ran its query pass
    cold: int = 0  # ... in which it skipped even its context pass
    requests: int = 0  # request-steps (one per request per proposal step)
    nodes: int = 0  # nodes sent to the scheduler
    budgets: dict[int, int] = field(default_factory=dict)  # nodes per request -> count


class BudgetController:
    def __init__(self, options: DDTreeOptions, device: torch.device):
        policy = options.budget_policy
        self.name = policy if isinstance(policy, str) else "table"
        self.max_budget = options.budget
        self.depth = options.depth
        self.device = device
        self.table = None if isinstance(policy, str) else TablePolicy([list(r) for r in policy])
        self.cost: CostModel | None = None  # auto: measured at start-up (set_cost_model)
        self.calibration = Calibration(options.depth, device) if self.name == "auto" else None
        self.step = 0
        self._pause_until: dict[int, int] = {}  # batch bucket -> first step to draft again
        self._pause: dict[int, int] = {}  # batch bucket -> the pause length that would follow
        self._no_streak: dict[int, int] = {}  # batch bucket -> consecutive "do not draft"
        self._draft_rate: dict[int, float] = {}  # batch bucket -> running rate of "draft"
        self.on_overhead = self.off_overhead = 0.0  # seconds, see the module doc
        # (start, R, tokens, verified drafts) of the step in flight
        self._last: tuple[float, int, int, bool] | None = None
        self._emitted: int | None = None  # tokens the step in flight emitted (sample_tokens)
        self._measured: dict[tuple[int, bool], MeasuredRate] = {}  # (bucket, drafting) -> rate
        self._long_run: dict[int, MeasuredRate] = {}  # bucket -> drafting's, never restarted
        self._remeasure_at: dict[int, int] = {}  # batch bucket -> step to re-measure plain
        self._probe_started: dict[int, int] = {}  # batch bucket -> the pause its probe ended
        self.resume_s: dict[int, float] = {}  # batch bucket -> seconds resuming the drafter costs
        self._drafting_now = True
        # the scheduler's mean grammar seconds per structured-output node (grammar.GrammarTime,
        # with each step's schedule): auto counts it in the step time of the trees it sizes
        self.grammar_node_s = 0.0
        self._greedy_masks: dict[int, torch.Tensor] = {}  # all_greedy
        self.stats = PolicyStats()
        self._totals = PolicyStats()
        self._logged_at = time.monotonic()

    def decision_state(self) -> tuple:
        """Everything the policy's next decisions depend on, host side (compared across the
        tensor-parallel ranks each step under ``VLLM_DDTREE_CHECK_RANKS=1``, ``ranks.py``)."""
        return (self.step, self._drafting_now, self.on_overhead, self.off_overhead,
                self.grammar_node_s,
                sorted(self._pause_until.items()), sorted(self._pause.items()),
                sorted(self._no_streak.items()), sorted(self._draft_rate.items()),
                sorted(self._remeasure_at.items()), sorted(self._probe_started.items()),
                sorted(self.resume_s.items()),
                sorted((k, (r.seconds, r.tokens, r.steps, r.fresh))
                       for k, r in self._measured.items()),
                sorted((k, (r.seconds, r.tokens, r.steps)) for k, r in self._long_run.items()))

    # --- before the drafter runs ---------------------------------------------------------

    @property
    def structured_limit(self) -> int:
        """The most nodes a structured-output request sends, L: the scheduler's grammar work is
        host work per node (benchmarks/structured_cost.py: whole trees cost more than they
        accept), so it gets the best tree of L nodes, the grammar cost of a chain of L drafts,
        and by DDTree's optimality at least the chain's expected acceptance."""
        return self.depth

    def set_cost_model(self, cost: CostModel) -> None:
        cost.upload(self.device)
        self.cost = cost
        logger.info("ddtree auto budgets: step cost model %s", cost.to_dict())

    @staticmethod
    def _bucket(num_reqs: int) -> int:
        return max(num_reqs, 1).bit_length()

    def all_greedy(self, num_reqs: int) -> torch.Tensor:
        """``[num_reqs]`` bool, all False (no request samples): one tensor per batch size,
        made once (auto and the trees' calibration read it when every request is greedy; read
        only)."""
        mask = self._greedy_masks.get(num_reqs)
        if mask is None:
            mask = self._greedy_masks[num_reqs] = torch.zeros(num_reqs, dtype=torch.bool,
                                                              device=self.device)
        return mask

    def will_draft(self, num_reqs: int) -> bool:
        """Whether the drafter runs its query pass at the end of this step (no side effect:
        the runner asks before the step's forward)."""
        if self.name == "static":
            return True
        if self.table is not None:
            return self.table.budget(num_reqs) > 0
        return self.step >= self._pause_until.get(self._bucket(num_reqs), 0)

    def keeps_context(self, num_reqs: int) -> bool:
        """Whether a drafter that does not draft this step still runs its context pass: always,
        except in auto's long pauses, until ``WARM_UP`` steps before the bucket's next probe
        (so that the requests that arrive from then on can draft in it)."""
        if self.name != "auto":
            return True
        return self.step + WARM_UP >= self._pause_until.get(self._bucket(num_reqs), 0)

    def drafting(self, run: bool) -> bool:
        """Record whether the drafter runs its query pass at the end of this step (the step's
        plan, ``TreeState.plan_step``: :meth:`will_draft` and enough requests with a drafter
        context); the next step's timing is attributed to it. Returns ``run``."""
        self._drafting_now = run
        return run

    def went_cold(self) -> None:
        self.stats.cold += 1

    def budget(self, num_reqs: int, sampled: torch.Tensor | None,
               complete: torch.Tensor | None = None, structured: list[bool] | None = None):
        """What ``build_tree`` gets as its budget this step: an int, or (auto) a function of
        the ranked candidates. ``sampled``: ``[R]`` bool, requests with T > 0 (None: all
        greedy); ``complete``: ``[R]`` bool, requests whose drafter context is complete (None:
        all), the others get no nodes (only auto pauses go cold); ``structured``: per request,
        whether it has structured outputs (auto: it sends at most L nodes, each costing the
        scheduler's grammar time :attr:`grammar_node_s` besides its verify row)."""
        if self.name == "static":
            return self.max_budget
        if self.table is not None:
            return self.table.budget(num_reqs)
        if self.cost is None:
            raise RuntimeError("ddtree auto budgets: no step cost model (measured at start-up)")
        bucket = self._bucket(num_reqs)
        if self._explores(num_reqs, bucket, complete, structured):
            return self.max_budget  # a full-width tree: every score bin gets calibrated
        if sampled is None:
            sampled = self.all_greedy(num_reqs)
        # measured rates of both kinds here decide whether to draft; the model sizes the trees
        versus_plain = not self._measured_both(bucket)
        node_cost = limit = None
        if structured is not None and any(structured):
            from vllm_ddtree.plugin.state import to_device  # state.py imports this module

            node_cost = to_device([self.grammar_node_s * s for s in structured], torch.float64,
                                  self.device)
            limits = (self.structured_limit, self.max_budget)
            limit = to_device([limits[0] if s else limits[1] for s in structured], torch.int64,
                              self.device)
        return budget_function(self.cost, self.calibration, sampled, complete,
                               on_overhead=self.on_overhead, off_overhead=self.off_overhead,
                               versus_plain=versus_plain, node_cost=node_cost, limit=limit,
                               tie=TREE_TIE)

    def _explores(self, num_reqs: int, bucket: int, complete: torch.Tensor | None,
                  structured: list[bool] | None) -> bool:
        """Whether this step's tree is the full-width one (``max_budget`` nodes) instead of
        the budget function's: every ``EXPLORE_TREE_EVERY``-th proposal step of a single request
        whose drafting pays by the measured rates (and that has its whole drafter context and
        no structured outputs). The calibration learns only from verified nodes, and the budget
        function leaves out nodes whose calibrated gain is low, so a score bin the drafter
        underrates would never be verified and stay underrated (the tiny pair's paths of
        probability e^-5 to e^-4 at depths 3-6 are accepted 1.6-6.7x as often as the drafter
        says; capped at 16 nodes, auto never verified one). At one request a full-width tree
        costs what static B costs there, about what auto's own does; the calibration it feeds
        serves every batch size. ``bucket``: ``num_reqs``' batch bucket."""
        return (num_reqs == 1 and self.step % EXPLORE_TREE_EVERY == 0 and complete is None
                and not any(structured or ()) and self._measured_both(bucket)
                and self._measured_pays(bucket))

    # --- after the drafts reached the host (take_draft_token_ids) --------------------------

    def drafts_sent(self, budgeted: list[int], num_nodes: list[int]) -> bool:
        """This step's outcome on the host: ``budgeted``, the nodes the policy gave each drafted
        request; ``num_nodes``, what each request sends to the scheduler (after the cut near
        ``max_tokens``). Returns whether the periodic log line was written now."""
        stats = self.stats
        stats.steps += 1
        stats.drafted += int(self._drafting_now)
        stats.requests += len(num_nodes)
        if any(num_nodes):
            stats.nodes += sum(num_nodes)
            for n in num_nodes:
                stats.budgets[n] = stats.budgets.get(n, 0) + 1
        elif num_nodes:  # no request sends nodes (a paused drafter's step)
            stats.budgets[0] = stats.budgets.get(0, 0) + len(num_nodes)
        if self.name == "auto" and self._drafting_now:
            bucket = self._bucket(len(num_nodes))
            if self._probing(bucket):
                self.step += 1
                return self._maybe_log()
            paid = (not budgeted or any(budgeted)) and self._measured_pays(bucket)
            rate = self._draft_rate.get(bucket, 0.5)
            rate = self._draft_rate[bucket] = rate + ANSWER_EMA * (float(paid) - rate)
            if not paid:  # the best tree did not pay
                streak = self._no_streak[bucket] = self._no_streak.get(bucket, 0) + 1
                # a probe after a pause, or a streak where drafting has mostly not paid
                if bucket in self._pause or (streak >= PAUSE_AFTER and rate < 0.5):
                    pause = self._pause_length(bucket)
                    self._pause_until[bucket] = self.step + 1 + pause
                    self._pause[bucket] = min(2 * pause, MAX_PAUSE)
                    self._no_streak[bucket] = 0
            else:
                self._pause.pop(bucket, None)
                self._no_streak[bucket] = 0
                self._explore_plain(bucket)
        self.step += 1
        return self._maybe_log()

    def _pause_length(self, bucket: int) -> int:
        """The next pause of a bucket: the doubling one, or, when a probe answered "no" (the
        bucket is in a sequence of pauses) and both rates are measured, at least the pause
        after which a probe's loss is ``PROBE_LOSS`` of the time. A probe of
        ``PROBE_STEPS`` drafting steps (``t_on`` each) loses the share ``loss`` of their time
        (drafting's measured tokens per second are ``1 - loss`` of plain decoding's), and its
        first step takes ``resume`` seconds more than a plain one (:attr:`resume_s`); over a
        pause of ``n`` plain steps (``t_off`` each) and the probe that ends it, that is
        ``PROBE_LOSS`` when ``n * t_off = PROBE_STEPS * t_on * (loss / PROBE_LOSS - 1)
        + resume * (1 / PROBE_LOSS - 1)``, at most ``MAX_LOSS_PAUSE``. Example: steps of 16 ms
        for 3 tokens against 5 ms for 1 (loss 0.0625): 101 steps; with resuming at 5 ms more:
        200."""
        pause = min(self._pause.get(bucket, FIRST_PAUSE), MAX_PAUSE)
        if bucket in self._pause and self._measured_both(bucket):
            # the loss by drafting's long-run rate: the probe's own steps answered for the
            # requests it met; the next probe meets the bucket's traffic, which the long run
            # describes (at one request a bad prompt said "no"; the next prompt is another)
            on = self._long_run.get(bucket) or self._measured[(bucket, True)]
            off = self._measured[(bucket, False)]
            loss = 1.0 - on.tokens_per_s() / max(off.tokens_per_s(), 1e-12)
            lost = (PROBE_STEPS * on.seconds * (loss / PROBE_LOSS - 1.0)
                    + self.resume_s.get(bucket, 0.0) * (1.0 / PROBE_LOSS - 1.0))
            if lost > 0.0:
                pause = max(pause, min(math.ceil(lost / max(off.seconds, 1e-12)),
                                       MAX_LOSS_PAUSE))
        return pause

    def _probing(self, bucket: int) -> bool:
        """Whether this drafting step of a probe after a pause defers its answer: once both
        kinds are measured, a probe drafts until its own ``MIN_MEASURED`` verify steps are
        measured (the drafting average starts afresh at the probe's first step), so that its
        answer is about the drafter now. A probe of one step would move the running average by
        ``MEASURED_EMA`` only: a drafter that became faster would stay paused for ~1500
        steps of doubling pauses (a new prompt at one request, a drafter that warmed up)."""
        drafting = self._measured.get((bucket, True))
        if bucket not in self._pause or not self._measured_both(bucket):
            return False
        if self._probe_started.get(bucket) != self._pause_until[bucket]:
            self._probe_started[bucket] = self._pause_until[bucket]  # this probe's first step
            drafting.restart()
        return drafting.fresh < MIN_MEASURED

    def _measured_both(self, bucket: int) -> bool:
        """Whether this bucket has measured ``MIN_MEASURED`` drafting and plain steps."""
        on, off = self._measured.get((bucket, True)), self._measured.get((bucket, False))
        return on is not None and off is not None and min(on.steps, off.steps) >= MIN_MEASURED

    def _measured_pays(self, bucket: int) -> bool:
        """False when this bucket's measured drafting steps emit fewer tokens per second than
        its plain steps (both kinds measured); True without evidence."""
        if not self._measured_both(bucket):
            return True
        on, off = self._measured[(bucket, True)], self._measured[(bucket, False)]
        return on.tokens_per_s() >= off.tokens_per_s()

    def _explore_plain(self, bucket: int) -> None:
        """Pause for ``FIRST_PAUSE`` steps to measure plain decoding: once when drafting has
        been measured ``EXPLORE_AFTER`` times here and plain decoding too rarely to compare,
        then again (a fresh plain average) :meth:`_remeasure_interval` steps after each pause
        measured it."""
        on, off = self._measured.get((bucket, True)), self._measured.get((bucket, False))
        if on is None or on.steps < EXPLORE_AFTER or self._pause_until.get(bucket, 0) > self.step:
            return
        if off is not None and off.steps >= MIN_MEASURED:
            if bucket not in self._remeasure_at:  # plain was measured while paused
                self._remeasure_at[bucket] = self.step + self._remeasure_interval(bucket)
            if self.step < self._remeasure_at[bucket]:
                return
            self._measured[(bucket, False)] = MeasuredRate()
        # the next re-measurement is set once this pause has measured plain decoding (above)
        self._remeasure_at.pop(bucket, None)
        self._pause_until[bucket] = self.step + 1 + FIRST_PAUSE

    def _remeasure_interval(self, bucket: int) -> int:
        """Drafting steps between two re-measurements of plain decoding in a bucket where
        drafting pays: ``REMEASURE_AFTER``, or longer while a re-measurement would cost more
        than ``REMEASURE_LOSS`` of the time (up to ``MAX_REMEASURE``). Its ``FIRST_PAUSE``
        plain steps (``t_off`` each) lose the share ``gain = 1 - r_off / r_on`` of their time
        against drafting; over ``n`` drafting steps (``t_on`` each) that is
        ``REMEASURE_LOSS`` when ``n = FIRST_PAUSE * t_off / t_on * gain / REMEASURE_LOSS``.
        Example: one request, drafting steps of 14 ms for 3.3 tokens (236 tokens/s) against
        plain ones of 8 ms for 1 (125 tokens/s): gain 0.47, 859 steps. The drafting rate keeps
        updating in between, so a drafter that stops paying is still paused at once; only a
        plain rate measured in a slow spell waits this long to be replaced."""
        on, off = self._measured[(bucket, True)], self._measured[(bucket, False)]
        gain = 1.0 - off.tokens_per_s() / max(on.tokens_per_s(), 1e-12)
        steps = FIRST_PAUSE * off.seconds / max(on.seconds, 1e-12) * gain / REMEASURE_LOSS
        return min(max(REMEASURE_AFTER, math.ceil(steps)), MAX_REMEASURE)

    # --- verification and step timing ------------------------------------------------------

    def observe_verify(self, tree, accepted_nodes: torch.Tensor, matched: torch.Tensor,
                       sampled: torch.Tensor | None) -> None:
        """Fold a verify step's outcome (the walk's accepted nodes) into the calibration (auto;
        device ops only)."""
        if self.calibration is None:
            return
        if sampled is None:
            sampled = self.all_greedy(matched.shape[0])
        self.calibration.observe(tree.scores, tree.depths, accepted_nodes, matched, sampled)

    def tokens_emitted(self, num_tokens: float) -> None:
        """What the step in flight emitted, in tokens for the whole batch: all requests'
        tokens, or for a step that verified drafts :func:`critical_tokens` (from vLLM's host
        copy of the sampled tokens)."""
        self._emitted = num_tokens

    def step_started(self, now: float, num_reqs: int, num_tokens: int, decode_only: bool,
                     verified: bool, grammar_s: float = 0.0) -> None:
        """Called at the start of every step (``verified``: whether it verifies drafts) with
        ``now``, the scheduler's clock stamp of the step (``SchedulerOutput.ddtree_clock``: the
        same number on every tensor-parallel rank, see ``ranks.py``; never this rank's own
        clock): the time since the previous step's stamp is that step's cost (its verify
        forward over its tokens, then the drafter if it ran at its end: ``_drafting_now`` still
        holds that decision); compare it with the model (auto), and fold it into the measured
        rates. ``grammar_s``: the scheduler's grammar seconds since its previous schedule
        (known exactly, so added to the model's prediction, not learned by the scales)."""
        if self.cost is None:
            return
        if now is None:
            raise RuntimeError(
                "ddtree auto budgets: this step has no scheduler clock stamp "
                "(SchedulerOutput.ddtree_clock); the vllm-ddtree plugin must be installed where "
                "vLLM's engine core (its scheduler) runs")
        last, self._last = self._last, (now, num_reqs, num_tokens, verified)
        emitted, self._emitted = self._emitted, None
        if last is None or not decode_only:
            if not decode_only:
                self._last = None  # a prefill step's time says nothing about decode costs
            return
        start, reqs, tokens, last_verified = last
        if emitted is not None and not last_verified and self._drafting_now:
            self._observe_resume(self._bucket(reqs), now - start, emitted)
        if emitted is not None and (last_verified or not self._drafting_now):
            seconds = now - start
            if last_verified and not self._drafting_now:  # a probe answered "no": its verify
                seconds += self.cost.draft_time(reqs)  # counts, with the drafter it skipped
            key = (self._bucket(reqs), last_verified)
            rate = self._measured.get(key) or self._measured.setdefault(key, MeasuredRate())
            rate.add(seconds, emitted)
            if last_verified:
                long_run = self._long_run.get(key[0]) or self._long_run.setdefault(
                    key[0], MeasuredRate(ema=LONG_RUN_EMA))
                long_run.add(seconds, emitted)
        predicted = self.cost.verify_time_host(tokens) + grammar_s
        if self._drafting_now:
            predicted += self.cost.draft_time(reqs)
            self.on_overhead = _updated_overhead(self.on_overhead, now - start, predicted)
        else:
            self.off_overhead = _updated_overhead(self.off_overhead, now - start, predicted)

    def _observe_resume(self, bucket: int, seconds: float, emitted: int) -> None:
        """A decode step that verified nothing and ran the drafter at its end (a drafting run's
        first): its ``seconds`` beyond the time plain decoding's measured rate needs for its
        ``emitted`` tokens fold into :attr:`resume_s` (nothing before plain decoding is
        measured here)."""
        off = self._measured.get((bucket, False))
        if off is None or off.steps < MIN_MEASURED:
            return
        extra = max(seconds - emitted / max(off.tokens_per_s(), 1e-12), 0.0)
        old = self.resume_s.get(bucket)
        self.resume_s[bucket] = extra if old is None else old + RESUME_EMA * (extra - old)

    # --- observability ----------------------------------------------------------------------

    def summary(self, stats: PolicyStats | None = None) -> dict:
        """Mean nodes per request per step, how often the drafter ran, calibration, overheads."""
        stats = stats or self._merged()
        out = {
            "policy": self.name,
            "steps": stats.steps,
            "mean_nodes_per_request_step": stats.nodes / max(stats.requests, 1),
            "drafter_on_fraction": stats.drafted / max(stats.steps, 1),
            "drafter_cold_fraction": stats.cold / max(stats.steps, 1),
            "budget_histogram": dict(sorted(stats.budgets.items())),
        }
        if self.calibration is not None:
            factors = self.calibration.factors()  # a sync: only for logs and benchmarks
            # [depth][score bin] (budget.score_bins: bin b holds paths of probability
            # e^-(b+1) to e^-b, the last bin everything below)
            out["calibration_greedy"] = [[round(float(c), 2) for c in row] for row in factors[0]]
            out["calibration_sampled"] = [[round(float(c), 2) for c in row] for row in factors[1]]
            out["on_overhead_ms"] = round(self.on_overhead * 1e3, 3)
            out["off_overhead_ms"] = round(self.off_overhead * 1e3, 3)
            out["resume_ms"] = {f"{1 << (bucket - 1)}-{(1 << bucket) - 1} requests":
                                round(seconds * 1e3, 3)
                                for bucket, seconds in sorted(self.resume_s.items())}
            out["measured_tokens_per_s"] = {
                f"{1 << (bucket - 1)}-{(1 << bucket) - 1} requests, "
                f"{'drafting' if drafting else 'plain'}": round(rate.tokens_per_s(), 1)
                for (bucket, drafting), rate in sorted(self._measured.items())}
            # what prices the pauses after a probe's "no" (_pause_length)
            out["measured_tokens_per_s"].update({
                f"{1 << (bucket - 1)}-{(1 << bucket) - 1} requests, drafting, long run":
                round(rate.tokens_per_s(), 1) for bucket, rate in sorted(self._long_run.items())})
        return out

    def _merged(self) -> PolicyStats:
        a, b = self._totals, self.stats
        merged = PolicyStats(a.steps + b.steps, a.drafted + b.drafted, a.cold + b.cold,
                             a.requests + b.requests, a.nodes + b.nodes, dict(a.budgets))
        for n, count in b.budgets.items():
            merged.budgets[n] = merged.budgets.get(n, 0) + count
        return merged

    def _maybe_log(self) -> bool:
        now = time.monotonic()  # when to log only: no decision reads this rank's clock
        if now - self._logged_at < LOG_INTERVAL_S:
            return False
        self._logged_at = now
        s = self.summary(self.stats)
        extra = ""
        if self.calibration is not None:
            extra = (f", calibration per depth and score bin {s['calibration_greedy']} (greedy) "
                     f"{s['calibration_sampled']} (sampled), step overhead beyond the model "
                     f"{s['on_overhead_ms']} ms drafting, {s['off_overhead_ms']} ms not, "
                     f"measured tokens/s {s['measured_tokens_per_s']}, resuming the drafter "
                     f"costs (ms beyond a plain step) {s['resume_ms']}")
        logger.info("ddtree %s budgets: %.1f nodes per request per step over %d steps, drafter "
                    "on in %.0f%% of them, cold in %.0f%%%s", s["policy"],
                    s["mean_nodes_per_request_step"], s["steps"], 100 * s["drafter_on_fraction"],
                    100 * s["drafter_cold_fraction"], extra)
        self._totals = self._merged()
        self.stats = PolicyStats()
        return True


def _updated_overhead(overhead: float, seconds: float, predicted: float) -> float:
    """The running observed - predicted step time after one more step of ``seconds``: an
    exponential average (weight ``OVERHEAD_EMA``) of the difference, the step's time clipped to
    [1/2, 2] x ``predicted + overhead``, and never below 0 (a model measured on a busy machine
    is left as it is). Example: overhead 0, predicted 10 ms, a 100 ms outlier -> 1 ms (unclipped
    it would be 9 ms); steps of 30 ms at a prediction of 15 ms -> 15 ms."""
    expected = predicted + overhead
    seconds = min(max(seconds, expected / 2), 2 * expected)
    return max(overhead + OVERHEAD_EMA * (seconds - expected), 0.0)
