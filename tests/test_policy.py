"""The budget controller's host-side rules (vllm_ddtree/plugin/policy.py), without an engine:
when "auto" pauses the drafter, the online correction of the step costs, and the measured
drafting / plain rates.

Oracles: the documented pause schedule step by step, and the ratios computed by hand.
"""

import math

import pytest
import torch

from vllm_ddtree.budget import CostModel
from vllm_ddtree.plugin import policy
from vllm_ddtree.plugin.options import DDTreeOptions
from vllm_ddtree.plugin.policy import (
    EXPLORE_AFTER,
    FIRST_PAUSE,
    MAX_LOSS_PAUSE,
    MAX_PAUSE,
    MIN_MEASURED,
    PAUSE_AFTER,
    REMEASURE_AFTER,
    BudgetController,
    MeasuredRate,
    critical_tokens,
)


def controller() -> BudgetController:
    options = DDTreeOptions(budget=16, depth=7, budget_policy="auto")
    return BudgetController(options, torch.device("cpu"))


def run_step(ctl: BudgetController, num_reqs: int, budgets: list[int] | None) -> bool:
    """One proposal step: whether the drafter ran; ``budgets`` is what its trees got."""
    ran = ctl.drafting(ctl.will_draft(num_reqs))
    if ran:
        ctl.drafts_sent(budgets, budgets)
    else:
        ctl.drafts_sent([], [0] * num_reqs)
    return ran


def test_one_unsure_tree_does_not_pause_the_drafter():
    assert PAUSE_AFTER == 2 and policy.ANSWER_EMA == 0.2
    ctl = controller()
    # no, yes, no, yes: never two "no" in a row, the drafter never pauses
    for budgets in ([0], [5], [0], [5], [0]):
        assert run_step(ctl, 1, budgets)
    # rate of "draft": 0.5 -> .4, .52, .416, .533, .426; the second "no" in a row (.341) with
    # a rate below one half pauses it for FIRST_PAUSE steps
    assert run_step(ctl, 1, [0])
    assert [run_step(ctl, 1, [3]) for _ in range(FIRST_PAUSE)] == [False] * FIRST_PAUSE
    # the probe after a pause: one "no" is enough, and the pause doubles
    assert run_step(ctl, 1, [0])
    assert [run_step(ctl, 1, [3]) for _ in range(2 * FIRST_PAUSE)] == [False] * 2 * FIRST_PAUSE
    # a probe that drafts ends the pause cycle: later single "no"s are tolerated again
    assert run_step(ctl, 1, [4])
    assert run_step(ctl, 1, [0]) and run_step(ctl, 1, [4])


def test_a_drafter_that_pays_is_not_paused_by_a_few_unsure_trees():
    ctl = controller()
    for _ in range(10):
        assert run_step(ctl, 1, [20])  # rate of "draft" -> 0.95
    # four unsure trees in a row: 0.76, 0.61, 0.49 (< 1/2 with a streak of 3: pause)
    assert run_step(ctl, 1, [0]) and run_step(ctl, 1, [0]) and run_step(ctl, 1, [0])
    assert not run_step(ctl, 1, [20])


def test_pauses_are_per_batch_bucket():
    ctl = controller()
    run_step(ctl, 8, [0] * 8)
    run_step(ctl, 8, [0] * 8)  # bucket of 8 requests paused
    assert not run_step(ctl, 8, [1] * 8)
    assert run_step(ctl, 1, [2])  # one request: another regime, drafts
    assert not run_step(ctl, 9, [1] * 9)  # 9 requests share 8's bucket (power of two)


def test_a_slow_step_moves_the_overheads_little():
    """Step costs are corrected by running overheads (observed - predicted seconds); one
    outlier (10x) moves them by at most OVERHEAD_EMA of the prediction, while a sustained change
    is followed; a step faster than the model leaves no negative overhead."""
    ctl = controller()
    ctl.set_cost_model(CostModel((1, 100), (0.010, 0.010), (1,), (0.005,)))
    clock = [0.0]  # the scheduler's step stamps

    def step(seconds: float, drafted: bool) -> None:
        ctl._drafting_now = drafted  # the drafter decision at the end of the previous step
        ctl.step_started(clock[0], 1, 1, True, drafted)
        clock[0] += seconds

    step(0.010, False)
    step(0.100, False)  # 10x the model's 10 ms, clipped to 2x
    step(0.010, False)
    assert ctl.off_overhead == pytest.approx(policy.OVERHEAD_EMA * 0.010)
    for _ in range(60):  # drafter steps at 30 ms, predicted 15 ms: on_overhead -> 15 ms
        step(0.030, True)
    assert ctl.on_overhead == pytest.approx(0.015, rel=0.01)
    for _ in range(200):  # plain steps faster than the model: the overhead goes to 0, not below
        step(0.005, False)
    assert ctl.off_overhead == 0.0


def test_measured_rate_is_a_mean_then_an_exponential_average():
    rate = MeasuredRate()
    rate.add(0.010, 1)
    rate.add(0.030, 3)
    assert (rate.seconds, rate.tokens) == (pytest.approx(0.020), pytest.approx(2.0))
    for _ in range(8):
        rate.add(0.020, 2)
    assert rate.steps == 10 and rate.tokens_per_s() == pytest.approx(100.0)
    rate.add(0.120, 2)  # past 1 / MEASURED_EMA steps: weight 0.1
    assert rate.seconds == pytest.approx(0.020 + policy.MEASURED_EMA * 0.100)


class Engine:
    """Drives a controller like the runner does: per step, step_started (with whether the step
    verifies drafts), the emitted tokens, then the proposal (drafting / drafts_sent), on a fake
    clock. The cost model says drafting always pays (verification free, gains large)."""

    def __init__(self, num_reqs: int = 1, resume_seconds: float = 0.0):
        self.ctl = controller()
        self.ctl.set_cost_model(CostModel((1, 1000), (0.005, 0.005), (1,), (0.001,)))
        self.clock = [0.0]  # the scheduler's step stamps (SchedulerOutput.ddtree_clock)
        self.num_reqs = num_reqs
        self.verifies = False  # the next step verifies drafts
        # what the first step of a drafting run (it verifies nothing, then runs the drafter
        # with the context its pause kept) takes beyond a plain step
        self.resume_seconds = resume_seconds

    def step(self, draft_seconds: float, draft_tokens: int, plain_seconds: float) -> bool:
        """One decode step; a step verifying drafts takes ``draft_seconds`` and emits
        ``draft_tokens`` per request, a plain one ``plain_seconds`` and 1 (and
        ``resume_seconds`` more where it runs the drafter). Returns whether the drafter ran at
        its end."""
        ctl, r = self.ctl, self.num_reqs
        ctl.step_started(self.clock[0], r, r * (1 + 4 * self.verifies), True, self.verifies)
        ctl.tokens_emitted(r * (draft_tokens if self.verifies else 1))
        ran = ctl.drafting(ctl.will_draft(r))
        ctl.drafts_sent([4] * r if ran else [], [4] * r if ran else [0] * r)
        self.clock[0] += (draft_seconds if self.verifies
                          else plain_seconds + self.resume_seconds * ran)
        self.verifies = ran
        return ran


def test_a_drafter_slower_than_plain_decoding_is_paused_whatever_the_model_says():
    """Drafting steps take 16 ms for 2.5 tokens (6.4 ms a token), plain ones 5 ms for 1: the
    model says draft, the measurements say no. The bucket first explores plain decoding
    (EXPLORE_AFTER drafting steps, then a pause of FIRST_PAUSE), then the measured rates pause
    it: after that, the drafter runs only in probes, and the probes lose at most PROBE_LOSS of
    the time (drafting emits 1 - 0.219 of plain decoding's tokens per second)."""
    assert MIN_MEASURED <= FIRST_PAUSE - 2  # a pause measures enough plain steps
    engine = Engine()
    ran = [engine.step(0.016, 2.5, 0.005) for _ in range(2400)]
    first_off = ran.index(False)
    # the first drafting step is a transition (no verify yet), then EXPLORE_AFTER measured
    # ones; a step's measurement lands when the next step starts
    assert first_off == EXPLORE_AFTER + 2
    assert ran[first_off:first_off + FIRST_PAUSE] == [False] * FIRST_PAUSE
    # PAUSE_AFTER "no"s with a falling rate of "draft" answers pause it; then probes: a probe
    # drafts one step that verifies nothing, then until MIN_MEASURED of its own verify steps
    # are measured, and answers "no" at the last of them (its drafts are verified in the
    # pause's first step)
    runs = alternating_runs(ran[first_off + FIRST_PAUSE:])
    assert runs[0][0] and runs[0][1] <= 5
    loss = 1 - (2.5 / 0.016) / (1 / 0.005)
    pauses = [length for value, length in runs[1:-1] if not value]
    probes = [length for value, length in runs[1:-1] if value]
    assert probes == [policy.PROBE_STEPS] * len(probes) and len(probes) >= 4
    # the first pause of the sequence is FIRST_PAUSE (the running rate's "no"); after each
    # probe's "no", the probe loses at most PROBE_LOSS over its cycle (pause, then the probe)
    assert pauses[0] == FIRST_PAUSE
    probe_s = policy.PROBE_STEPS * 0.016
    for pause in pauses[1:]:
        assert probe_s * loss / (pause * 0.005 + probe_s) <= policy.PROBE_LOSS
    # the pause after the first probe is as short as that allows (the doubling one, 16, would
    # lose ~12 %), then the pauses double up to the longest
    assert pauses[1] < 1.1 * policy.PROBE_STEPS * 0.016 / 0.005 * (loss / policy.PROBE_LOSS - 1)
    assert pauses[2:] == [MAX_PAUSE] * (len(pauses) - 2)
    summary = engine.ctl.summary()
    measured = summary["measured_tokens_per_s"]
    # probes answered "no" count with the model's 1 ms drafter added
    assert 2.5 / 0.017 <= measured["1-1 requests, drafting"] <= 2.5 / 0.016
    assert measured["1-1 requests, plain"] == pytest.approx(1 / 0.005, rel=0.01)


def test_a_drafter_that_loses_little_keeps_the_doubling_pauses():
    """Drafting loses 1.9 % (1.05 tokens in 5.35 ms against 1 in 5 ms): a probe after the
    doubling pause of 8 steps loses ~0.8 % (under PROBE_LOSS) already; the pauses double from
    there (8, 16, ...), so a drafter close to break-even is asked again soon."""
    engine = Engine()
    ran = [engine.step(0.00535, 1.05, 0.005) for _ in range(1200)]
    runs = alternating_runs(ran[ran.index(False) + FIRST_PAUSE:])
    pauses = [length for value, length in runs[1:-1] if not value]
    assert pauses[0] <= 2 * FIRST_PAUSE
    assert all(b == min(2 * a, MAX_PAUSE) for a, b in zip(pauses, pauses[1:])), pauses


def test_pause_length_is_the_shortest_that_keeps_the_probes_loss_under_probe_loss():
    """``_pause_length`` after a probe's "no" against the loss share computed from the rates:
    the probes of the pause's cycle lose at most PROBE_LOSS of its time, and one step less
    would lose more (unless the doubling pause or MAX_LOSS_PAUSE bounds it). The loss may ask
    for more than the doubling's MAX_PAUSE (a drafter that loses 75 %: 1776 steps), up to
    MAX_LOSS_PAUSE (one that loses 96 % would need 14250). A first pause (no probe yet) is
    FIRST_PAUSE whatever the rates."""
    pauses = []
    for on_s, on_tokens, off_s in [(0.016, 2.5, 0.005), (0.030, 40, 0.020), (0.012, 1.2, 0.010),
                                   (0.011, 2.0, 0.005), (0.020, 1.0, 0.005), (0.050, 1.0, 0.002)]:
        ctl = controller()
        ctl._measured[(1, True)] = MeasuredRate(on_s, on_tokens, MIN_MEASURED, MIN_MEASURED)
        ctl._measured[(1, False)] = MeasuredRate(off_s, 1.0, MIN_MEASURED, MIN_MEASURED)
        assert ctl._pause_length(1) == FIRST_PAUSE
        ctl._pause[1] = FIRST_PAUSE  # a probe after the first pause answered "no"
        pause = ctl._pause_length(1)
        loss = 1 - (on_tokens / on_s) / (1 / off_s)
        probe_s = policy.PROBE_STEPS * on_s

        def lost(n: int) -> float:
            return probe_s * max(loss, 0.0) / (n * off_s + probe_s)

        assert FIRST_PAUSE <= pause <= MAX_LOSS_PAUSE
        assert lost(pause) <= policy.PROBE_LOSS or pause == MAX_LOSS_PAUSE
        assert (pause == FIRST_PAUSE or pause == MAX_LOSS_PAUSE
                or lost(pause - 1) > policy.PROBE_LOSS)
        pauses.append(pause)
    assert pauses[-2:] == [1776, MAX_LOSS_PAUSE], pauses


def test_a_probe_pays_for_resuming_the_drafter():
    """The first step of a probe takes ``resume`` seconds more than a plain step (the drafter's
    kept context written, its run): the pause after a probe's "no" covers that too. Drafting
    16 ms for 3 tokens against plain 5 ms for 1 (loss 0.0625), resuming 5 ms: 101 steps
    without it, 200 with it (200 * 5 ms = 6 * 16 ms * (0.0625 / 0.01 - 1) + 5 ms * 99, by
    hand, less 0.2 steps), and the cycle then loses at most PROBE_LOSS counted with the
    resume."""
    assert policy.PROBE_LOSS == 0.01  # the numbers below are worked out for it
    ctl = controller()
    ctl._measured[(1, True)] = MeasuredRate(0.016, 3.0, MIN_MEASURED, MIN_MEASURED)
    ctl._measured[(1, False)] = MeasuredRate(0.005, 1.0, MIN_MEASURED, MIN_MEASURED)
    ctl._pause[1] = FIRST_PAUSE  # a probe after the first pause answered "no"
    assert ctl._pause_length(1) == 101
    ctl.resume_s[1] = 0.005
    assert ctl._pause_length(1) == 200
    loss, probe_s = 0.0625, policy.PROBE_STEPS * 0.016

    def lost(n: int) -> float:
        return (probe_s * loss + 0.005) / (n * 0.005 + probe_s + 0.005)

    assert lost(200) <= policy.PROBE_LOSS < lost(199)
    # a drafter that loses nothing while it drafts still pauses long if resuming costs
    ctl._measured[(1, True)] = MeasuredRate(0.010, 2.0, MIN_MEASURED, MIN_MEASURED)
    ctl.resume_s[1] = 0.001
    assert ctl._pause_length(1) == max(FIRST_PAUSE, math.ceil(
        (policy.PROBE_STEPS * 0.010 * (0.0 / policy.PROBE_LOSS - 1) + 0.001 * 49) / 0.005))


def test_resuming_is_measured_from_the_first_step_of_each_drafting_run():
    """Driven like the runner: a drafter slower than plain decoding (16 ms for 2.5 tokens
    against 5 ms for 1) whose drafting runs each begin with a step 20 ms longer than a plain
    one. The controller measures that 20 ms from its step stamps and the pauses after its
    probes grow to cover it: each cycle (pause, probe, resume) loses at most PROBE_LOSS (the
    20 ms alone need 396 steps beside the 401 the rates ask for: longer than the doubling's
    MAX_PAUSE, at which a cycle would lose more)."""
    engine = Engine(resume_seconds=0.020)
    ran = [engine.step(0.016, 2.5, 0.005) for _ in range(4000)]
    assert engine.ctl.resume_s[1] == pytest.approx(0.020)
    runs = alternating_runs(ran[ran.index(False) + FIRST_PAUSE:])
    pauses = [length for value, length in runs[1:-1] if not value]
    loss, probe_s = 0.21875, policy.PROBE_STEPS * 0.016

    def lost(n: int) -> float:  # the share of a cycle's time that its probe loses
        return (probe_s * loss + 0.020) / (n * 0.005 + probe_s + 0.020)

    assert pauses[0] == FIRST_PAUSE and len(pauses) >= 4, pauses
    assert all(MAX_PAUSE < n < MAX_LOSS_PAUSE and lost(n) <= policy.PROBE_LOSS
               for n in pauses[1:]), pauses
    assert lost(MAX_PAUSE) > policy.PROBE_LOSS
    # without the resume cost the same drafter's second pause is the rates' 401 steps or so
    engine = Engine()
    ran = [engine.step(0.016, 2.5, 0.005) for _ in range(1200)]
    runs = alternating_runs(ran[ran.index(False) + FIRST_PAUSE:])
    assert [length for value, length in runs[1:-1] if not value][1] < MAX_PAUSE
    assert engine.ctl.resume_s.get(1, 0.0) == 0.0


def test_a_bad_spell_of_a_drafter_that_pays_in_the_long_run_keeps_the_doubling_pauses():
    """At one request every prompt has its own acceptance. A drafter that pays on the bucket's
    traffic (3 tokens in 10 ms against plain decoding's 1 in 5 ms) meets a stretch it drafts
    badly (1.2 tokens in 16 ms: drafting loses 62.5 % there, a bad prompt). The probes answer
    "no" while it lasts and the pauses double, 8, 16, 32: the loss that lengthens a pause is
    priced by drafting's long-run rate, which still pays at first. Priced by the probe's own
    steps, the second pause was already the loss-based one (6 x 16 ms x (0.625 / PROBE_LOSS - 1)
    / 5 ms ~ 1180 steps, MAX_PAUSE), and the good stretch after it (the next prompts) was plain
    decoded for hundreds of steps. As the bad stretch goes on, the long-run rate follows it and
    the pauses lengthen by the loss; once drafting is good again, the next probe drafts."""
    engine = Engine()
    good = [engine.step(0.010, 3, 0.005) for _ in range(600)]
    assert good[-1]  # drafting (its periodic re-measurements of plain decoding are over)
    bad = [engine.step(0.016, 1.2, 0.005) for _ in range(150)]
    runs = alternating_runs(bad)
    pauses = [length for value, length in runs if not value]
    assert pauses[:3] == [FIRST_PAUSE, 2 * FIRST_PAUSE, 4 * FIRST_PAUSE], runs
    assert [length for value, length in runs[1:-1] if value] == [policy.PROBE_STEPS] * 3
    assert pauses[3] > 8 * FIRST_PAUSE  # the long-run rate now loses: the loss lengthens it
    measured = engine.ctl.summary()["measured_tokens_per_s"]
    assert 1.2 / 0.016 < measured["1-1 requests, drafting, long run"] < 200  # under plain's
    assert measured["1-1 requests, drafting"] == pytest.approx(1.2 / 0.016, rel=0.05)
    after = [engine.step(0.010, 3, 0.005) for _ in range(200)]
    runs = alternating_runs(after)
    assert not runs[0][0] and runs[0][1] < MAX_PAUSE and runs[1] == (True, 200 - runs[0][1])


def alternating_runs(ran: list[bool]) -> list[tuple[bool, int]]:
    """(value, length) of every run of equal values."""
    runs: list[tuple[bool, int]] = []
    for r in ran:
        if runs and runs[-1][0] == r:
            runs[-1] = (r, runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs


def paused_runs(ran: list[bool]) -> list[tuple[int, int]]:
    """(first step, length) of every run of steps in which the drafter did not run."""
    runs, start = [], 0
    for value, length in alternating_runs(ran):
        if not value:
            runs.append((start, length))
        start += length
    return runs


def test_a_drafter_faster_than_plain_decoding_keeps_drafting():
    """Drafting steps: 10 ms for 3 tokens, plain: 5 ms a token (200 tokens/s). The drafter
    runs every step but for the exploration pause and, at intervals, a pause of the same
    length that measures plain decoding again. Drafting's measured average is 10.1 ms (the
    verify step before the exploration pause counts with the model's 1 ms drafter time, at
    weight MEASURED_EMA): 297.0 tokens/s. A re-measurement loses FIRST_PAUSE plain steps x
    5 ms x drafting's gain (1 - 200/297.0 = 0.327), which is REMEASURE_LOSS of the time over
    8 x 5/10.1 x 0.327 / 0.0025 = 517.6 drafting steps: one every 518 (not REMEASURE_AFTER's
    256), counted from the first drafting step after a pause (which drafts without verifying)."""
    assert policy.REMEASURE_LOSS == 0.0025 and policy.MEASURED_EMA == 0.1
    seconds = 0.010 + policy.MEASURED_EMA * 0.001
    gain = 1 - 200 / (3 / seconds)
    interval = math.ceil(FIRST_PAUSE * 0.005 / seconds * gain / policy.REMEASURE_LOSS)
    assert interval == 518 and REMEASURE_AFTER < interval < policy.MAX_REMEASURE
    engine = Engine()
    ran = [engine.step(0.010, 3, 0.005) for _ in range(1200)]
    first = EXPLORE_AFTER + 2
    period = FIRST_PAUSE + 1 + interval
    assert paused_runs(ran) == [(first + k * period, FIRST_PAUSE) for k in range(3)]
    measured = engine.ctl.summary()["measured_tokens_per_s"]
    assert measured["1-1 requests, drafting"] == pytest.approx(300, rel=1e-6)  # 10 ms again
    assert measured["1-1 requests, plain"] == pytest.approx(200, rel=1e-6)


def test_a_drafter_that_barely_pays_re_measures_plain_decoding_every_remeasure_after_steps():
    """Drafting 10 ms for 2.1 tokens (~208 tokens/s) against plain's 200: a re-measurement
    loses little (8 x 5/10.1 x 0.038 / 0.0025 = 61 steps < REMEASURE_AFTER), so the floor
    holds: one every REMEASURE_AFTER steps."""
    engine = Engine()
    ran = [engine.step(0.010, 2.1, 0.005) for _ in range(700)]
    first = EXPLORE_AFTER + 2
    period = FIRST_PAUSE + 1 + REMEASURE_AFTER
    assert paused_runs(ran) == [(first + k * period, FIRST_PAUSE) for k in range(3)]


def test_a_plain_rate_measured_in_a_slow_spell_does_not_keep_the_drafter_on():
    """Plain decoding is first measured while the machine is slow (20 ms a step), so drafting
    (10 ms for 3 tokens) wins. The machine recovers (plain: 2 ms a token, better than
    drafting's 3.3): the next re-measurement starts a fresh plain average, and the measured
    rates pause the drafter."""
    engine = Engine()
    slow = [engine.step(0.010, 3, 0.020) for _ in range(100)]
    assert paused_runs(slow) == [(EXPLORE_AFTER + 2, FIRST_PAUSE)]
    # the stale plain rate (50 tokens/s against drafting's 300) holds until the longest
    # interval, MAX_REMEASURE steps (8 x 20/10 x 0.83 / 0.0025 = 5333 by the formula)
    fast = [engine.step(0.010, 3, 0.002) for _ in range(policy.MAX_REMEASURE + 500)]
    assert sum(fast[:policy.MAX_REMEASURE - 100]) == policy.MAX_REMEASURE - 100
    # re-measured (a pause of FIRST_PAUSE): drafting loses 40 %, so each drafting step
    # answers "no" and the running rate of "draft" answers falls from ~1 to .8, .64, .51,
    # .41: the fourth pauses it (FIRST_PAUSE); after its first probe the drafter pauses as
    # long as its probes' loss asks, longer than the doubling's longest pause
    assert policy.ANSWER_EMA == 0.2
    runs = alternating_runs(fast)
    assert [length for _, length in runs[1:5]] == [
        FIRST_PAUSE, 4, FIRST_PAUSE, policy.PROBE_STEPS], runs
    assert not runs[5][0] and MAX_PAUSE < runs[5][1] <= MAX_LOSS_PAUSE, runs
    measured = engine.ctl.summary()["measured_tokens_per_s"]
    assert measured["1-1 requests, plain"] == pytest.approx(1 / 0.002, rel=0.01)


def test_which_steps_are_measured():
    engine = Engine()
    ctl = engine.ctl
    ctl.step_started(engine.clock[0], 1, 64, False, False)  # a prefill
    ctl.tokens_emitted(1)
    engine.clock[0] += 0.5
    ctl.drafting(ctl.will_draft(1))
    ctl.drafts_sent([4], [4])  # the drafter ran: the next step verifies
    engine.verifies = True
    engine.step(0.010, 3, 0.005)  # verify + draft: the first measured step
    assert ctl._measured == {}  # the prefill step was not measured
    engine.step(0.010, 3, 0.005)
    drafting = ctl._measured[(1, True)]
    assert drafting.steps == 1 and drafting.seconds == pytest.approx(0.010)
    # a verify step after which the drafter pauses (a probe answered "no") counts as drafting,
    # with the model's drafter time (1 ms) added
    ctl.step_started(engine.clock[0], 1, 5, True, True)
    ctl.tokens_emitted(3)
    engine.clock[0] += 0.012
    ctl._drafting_now = False
    ctl.step_started(engine.clock[0], 1, 1, True, False)
    assert drafting.steps == 3 and drafting.seconds == pytest.approx((0.010 + 0.010 + 0.013) / 3)
    # a step that drafts without verifying (the first step of a probe) is not counted
    ctl.tokens_emitted(1)
    engine.clock[0] += 0.005
    ctl._drafting_now = True
    ctl.step_started(engine.clock[0], 1, 5, True, True)
    assert drafting.steps == 3 and (1, False) not in ctl._measured


def test_a_drafter_that_becomes_faster_than_plain_decoding_drafts_again():
    """Paused by its measured rate (pauses up to MAX_PAUSE), a drafter whose steps then get
    faster (3 tokens in 8 ms) drafts again from its next probe on: the probe's own verify
    steps decide, not the running average of the slow ones (with a one-step probe that moved
    the average by MEASURED_EMA, it took ~1500 steps of doubling pauses)."""
    engine = Engine()
    slow = [engine.step(0.016, 2.5, 0.005) for _ in range(1200)]
    value, into = alternating_runs(slow)[-1]  # some steps into a pause of MAX_PAUSE
    assert not value and alternating_runs(slow)[-3] == (False, MAX_PAUSE)
    fast = [engine.step(0.008, 3, 0.005) for _ in range(2200)]
    runs = paused_runs(fast)
    # the pause in progress ends, the probe answers "draft"; from then on only the periodic
    # plain re-measurements pause it (every ~940 steps: 8 x 5/8 x (1 - 200/375) / 0.0025)
    assert runs[0] == (0, MAX_PAUSE - into), runs
    assert len(runs) >= 3 and all(length == FIRST_PAUSE for _, length in runs[1:]), runs


def test_once_measured_the_rates_decide_whether_to_draft_and_the_model_sizes_trees():
    """The model says plain decoding wins (the docstring example of auto_budgets for one
    request: the best tree, one node, 1.9 tokens in 3 ms, against 1 token in 1 ms); the
    measurements say drafting pays (3 tokens in 10 ms against 1 in 5 ms). Without both rates the
    model's answer stands (budget 0); with them the drafter runs and gets the model's best
    tree given that it runs, with the step overhead it has learned (below)."""
    engine = Engine()
    ctl = engine.ctl
    ctl.set_cost_model(CostModel((1, 2), (1e-3, 2e-3), (1,), (1e-3,)))
    scores = torch.tensor([[0.9, 0.5]]).log()
    depths = torch.tensor([[1, 2]])
    assert ctl.budget(1, None)(scores, depths).tolist() == [0]
    ran = [engine.step(0.010, 3, 0.005) for _ in range(EXPLORE_AFTER + 2 + FIRST_PAUSE + 8)]
    assert ran.count(False) == FIRST_PAUSE and all(ran[-8:])
    # the tree given the drafting steps' learned overhead o (10 ms steps against a model of
    # 3 ms): k of (1 + [0, .9, 1.4]) / ([1, 2, 3] + 1 + o) tokens per ms, k = 2 once o > 1 ms
    overhead_ms = ctl.on_overhead * 1e3
    assert 1.0 < overhead_ms < 7.0
    rates = [(1 + g) / (t + 1 + overhead_ms) for g, t in zip([0, 0.9, 1.4], [1, 2, 3])]
    assert ctl.budget(1, None)(scores, depths).tolist() == [rates.index(max(rates))] == [2]
    # another batch bucket has no measurements: the model still decides there
    assert ctl.budget(2, None)(scores.expand(2, 2), depths.expand(2, 2)).tolist() == [0, 0]


def test_a_single_request_where_drafting_pays_verifies_a_full_width_tree_every_16_steps():
    """Every EXPLORE_TREE_EVERY-th proposal step of a single request whose drafting pays by the
    measured rates gets the full-width tree (the int max_budget, as a static budget) instead of
    the budget function, so the calibration sees every score bin; never with more requests,
    with structured outputs, with a hole in a request's context, or where drafting loses."""
    assert policy.EXPLORE_TREE_EVERY == 16
    engine = Engine()
    for _ in range(200):
        engine.step(0.010, 3, 0.005)  # drafting pays: 300 tokens/s against 200
    ctl = engine.ctl
    assert ctl._measured_both(1) and ctl._measured_pays(1)
    ctl.step = 64  # a multiple of EXPLORE_TREE_EVERY
    assert ctl.budget(1, None) == ctl.max_budget == 16
    assert ctl.budget(1, None, structured=[False]) == 16
    assert callable(ctl.budget(1, None, structured=[True]))
    assert callable(ctl.budget(1, None, complete=torch.ones(1, dtype=torch.bool)))
    assert callable(ctl.budget(2, None))  # another batch size (and not measured there)
    ctl.step = 65
    assert callable(ctl.budget(1, None))
    slow = Engine()
    for _ in range(200):
        slow.step(0.016, 2.5, 0.005)  # drafting loses
    slow.ctl.step = 64
    assert not slow.ctl._measured_pays(1) and callable(slow.ctl.budget(1, None))
    # driven like the runner, the full-width steps are one in EXPLORE_TREE_EVERY proposals
    explored = 0
    for _ in range(160):
        explored += isinstance(ctl.budget(1, None), int)
        engine.step(0.010, 3, 0.005)
    assert 160 // policy.EXPLORE_TREE_EVERY - 2 <= explored <= 160 // policy.EXPLORE_TREE_EVERY


def test_long_pauses_go_cold_until_warm_up_steps_before_the_probe():
    """Auto skips even the context pass in a pause, except in its last WARM_UP steps (and in
    the probe); the static and table policies always keep the drafter's context."""
    assert policy.WARM_UP == 32
    ctl = controller()
    pauses = []  # per pause: its steps, True where the drafter keeps its context
    while len(pauses) < 6:
        assert ctl.keeps_context(1)  # the probe (and the first two steps)
        run_step(ctl, 1, [0])
        pause = []
        while not ctl.will_draft(1):
            pause.append(ctl.keeps_context(1))
            run_step(ctl, 1, [0])
        pauses.append(pause)
    assert [len(p) for p in pauses] == [0, 8, 16, 32, 64, 128]
    for pause in pauses:
        cold = max(len(pause) - 32, 0)
        assert pause == [False] * cold + [True] * (len(pause) - cold)
    for policy_ in ("static", [[4, 0]]):
        other = BudgetController(DDTreeOptions(budget=16, depth=7, budget_policy=policy_),
                                 torch.device("cpu"))
        assert other.keeps_context(1) and other.keeps_context(64)


def test_a_verify_step_is_worth_what_it_did_for_the_critical_request():
    """critical_tokens: the batch's size times the tokens of the request with the most tokens
    left before the step (ties share their mean). Worked by hand: a wave of 4 requests with
    64 tokens left each emitting [4, 1, 2, 5] is worth 4 x 3 = 12 tokens (all tied: the
    total); the next step, [1, 3, 2, 1] from 60 / 63 / 62 / 59 left, is worth 4 x 3 = 12
    where the batch emitted 7: the request furthest behind set the wave's end. In a steady
    state the newest request (most left) is critical; one request is worth its own tokens; a
    step of one token each is worth the batch's tokens."""
    def worth(emitted, before):
        return critical_tokens(emitted, [b - e for b, e in zip(before, emitted)])

    assert worth([4, 1, 2, 5], [64] * 4) == 12.0 == sum([4, 1, 2, 5])
    assert worth([1, 3, 2, 1], [60, 63, 62, 59]) == 12.0
    assert worth([1, 3, 2, 1], [63, 63, 62, 59]) == 8.0  # two tied: the mean of 1 and 3, x 4
    assert worth([2, 4, 3], [10, 50, 30]) == 12.0  # steady: the newest, 4 tokens, x 3
    assert worth([3], [17]) == 3.0
    assert worth([1] * 8, [9, 5, 64, 2, 2, 7, 30, 11]) == 8.0
    # a request that finishes in this step is critical only if no other had more left
    assert worth([5, 1], [5, 6]) == 2.0 and worth([5, 1], [5, 4]) == 10.0
