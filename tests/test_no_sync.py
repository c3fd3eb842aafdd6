"""build_tree / verify_tree / hsd_verify never synchronise with the host.

A TorchDispatchMode rejects the aten ops that force a device->host round trip (scalar reads,
data-dependent shapes, copies to the CPU from another device); on CUDA,
``torch.cuda.set_sync_debug_mode("error")`` is armed as well.
"""

import pytest
import torch
from sync_checker import HostSyncError, no_host_sync

from vllm_ddtree.budget import Calibration, CostModel, auto_budgets, budget_function, node_gains
from vllm_ddtree.sampling import SamplingBatch, hsd_verify
from vllm_ddtree.tree import build_tree
from vllm_ddtree.walk import verify_tree

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_checker_catches_syncs():
    x = torch.arange(5.0)
    with pytest.raises(HostSyncError, match="_local_scalar_dense"):
        with no_host_sync():
            x.sum().item()
    with pytest.raises(HostSyncError, match="nonzero"):
        with no_host_sync():
            x.nonzero()
    with pytest.raises(HostSyncError):
        with no_host_sync():
            x[x > 2]  # boolean masking: data-dependent shape
    with pytest.raises(HostSyncError):
        with no_host_sync():
            if x.sum() > 3:  # Python bool of a tensor
                pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device->host copies need CUDA")
def test_checker_allows_only_non_blocking_copies_into_pinned_memory():
    x = torch.arange(5, device="cuda")
    pinned = torch.empty(5, dtype=x.dtype, pin_memory=True)
    with no_host_sync():
        pinned.copy_(x, non_blocking=True)  # queued on the stream: no wait
    torch.cuda.synchronize()
    assert pinned.tolist() == [0, 1, 2, 3, 4]
    for blocking in (lambda: x.cpu(), lambda: pinned.copy_(x),
                     lambda: torch.empty(5, dtype=x.dtype).copy_(x, non_blocking=True)):
        with pytest.raises(HostSyncError, match="device->host copy"):
            with no_host_sync():
                blocking()


@pytest.mark.parametrize("device", DEVICES)
def test_build_and_verify_have_no_host_sync(device):
    batch, depth, vocab, budget = 4, 15, 1000, 64
    logits = torch.randn(batch, depth, vocab, device=device)
    target = torch.randn(batch, budget + 1, vocab, device=device)
    budgets = torch.tensor([64, 10, 1, 33], device=device)
    sampling = SamplingBatch(
        temperature=torch.tensor([0.0, 1.0, 0.7, 1.2], device=device),
        top_k=torch.tensor([0, 20, 5, 0], device=device),
        top_p=torch.tensor([1.0, 0.9, 1.0, 0.5], device=device),
        generators={2: torch.Generator(device=device).manual_seed(0)},
    )
    with no_host_sync():  # cold: the first call for a shape builds its tables on the device
        tree = build_tree(logits, budget)
        tree_b = build_tree(logits, budgets, max_budget=budget)
        verify_tree(tree, target)  # greedy
        verify_tree(tree_b, target, sampling)


@pytest.mark.parametrize("device", DEVICES)
def test_hsd_has_no_host_sync(device):
    g, vocab = 8, 100
    ids = torch.randint(0, vocab, (16, g), device=device)
    q = torch.rand(16, g, vocab, device=device).softmax(-1)
    p = torch.rand(16, g + 1, vocab, device=device).softmax(-1)
    with no_host_sync():
        hsd_verify(ids, q, p)


@pytest.mark.parametrize("device", DEVICES)
def test_auto_budgets_have_no_host_sync_and_match_the_cpu(device):
    """auto's step on the device (off the CPU its torch path): the calibration's update, the
    budget function (node costs, limits, incomplete contexts, the tie) and the tree it cuts,
    with no host sync; the budgets equal the CPU's for the same gains."""
    batch, depth, vocab, width = 4, 15, 1000, 64
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, depth, vocab, generator=gen) * 4).to(device)
    cost = CostModel((1, 8, 64, 512), (2e-3, 2.1e-3, 2.6e-3, 9e-3), (1, 8), (1e-3, 1.4e-3))
    cost.upload(torch.device(device))
    calibration = Calibration(depth, torch.device(device))
    sampled = torch.tensor([False, True, False, True], device=device)
    complete = torch.tensor([True, True, False, True], device=device)
    node_cost = torch.tensor([0.0, 2e-6, 0.0, 1e-5], dtype=torch.float64, device=device)
    limit = torch.tensor([64, 64, 64, 5], device=device)
    tree = build_tree(logits, width)
    accepted = torch.full((batch, depth + 1), -1, device=device)
    accepted[:, :3] = torch.tensor([0, 1, 3], device=device)
    with no_host_sync():
        calibration.observe(tree.scores, tree.depths, accepted, complete, sampled)
        fn = budget_function(cost, calibration, sampled, complete, on_overhead=1e-4,
                             off_overhead=5e-5, node_cost=node_cost, limit=limit, tie=0.01)
        cut = build_tree(logits, fn, max_budget=width)
    budgets = (cut.depths > 0).sum(1)
    assert budgets[2] == 0 and budgets[3] <= 5 and budgets.sum() > 0

    gains = node_gains(tree.scores, tree.depths, calibration.factors(), sampled)
    gains = gains * complete[:, None]
    for tie in (0.0, 0.01):
        here = auto_budgets(gains, cost, on_overhead=1e-4, off_overhead=5e-5, tie=tie)
        cpu = auto_budgets(gains.cpu(), cost, on_overhead=1e-4, off_overhead=5e-5, tie=tie)
        assert here.cpu().tolist() == cpu.tolist()
