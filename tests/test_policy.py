"""The budget controller's host-side rules (vllm_ddtree/plugin/policy.py), without an engine:
when "auto" pauses the drafter, and the online correction of the step costs.

Oracles: the documented pause schedule step by step, and the ratios computed by hand.
"""

import pytest
import torch

from vllm_ddtree.budget import CostModel
from vllm_ddtree.plugin import policy
from vllm_ddtree.plugin.options import DDTreeOptions
from vllm_ddtree.plugin.policy import FIRST_PAUSE, PAUSE_AFTER, BudgetController


def controller() -> BudgetController:
    options = DDTreeOptions(budget=16, depth=7, budget_policy="auto")
    return BudgetController(options, torch.device("cpu"))


def run_step(ctl: BudgetController, num_reqs: int, budgets: list[int] | None) -> bool:
    """One proposal step: whether the drafter ran; ``budgets`` is what its trees got."""
    ran = ctl.drafting(num_reqs)
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


def test_a_slow_step_moves_the_scales_little(monkeypatch):
    """Step costs are corrected by running ratios; one outlier (10x) moves them by at most
    SCALE_EMA of a doubling, while a sustained change is followed."""
    ctl = controller()
    ctl.set_cost_model(CostModel((1, 100), (0.010, 0.010), (1,), (0.005,)))
    clock = [0.0]
    monkeypatch.setattr(policy.time, "perf_counter", lambda: clock[0])

    def step(seconds: float, drafted: bool) -> None:
        ctl._drafting_now = drafted  # the drafter decision at the end of the previous step
        ctl.step_started(1, 1, True)
        clock[0] += seconds

    step(0.010, False)
    step(0.100, False)  # 10x the model's 10 ms
    step(0.010, False)
    assert ctl.off_scale == pytest.approx(1.0 + policy.SCALE_EMA * (2.0 - 1.0))
    for _ in range(60):  # drafter steps at 30 ms, predicted 15 ms: on_scale -> 2
        step(0.030, True)
    assert ctl.on_scale == pytest.approx(2.0, rel=0.01)
