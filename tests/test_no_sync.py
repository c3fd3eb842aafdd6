"""build_tree / verify_tree / hsd_verify never synchronise with the host.

A TorchDispatchMode rejects the aten ops that force a device->host round trip (scalar reads,
data-dependent shapes, copies to the CPU from another device); on CUDA,
``torch.cuda.set_sync_debug_mode("error")`` is armed as well.
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_ddtree.sampling import SamplingBatch, hsd_verify
from vllm_ddtree.tree import build_tree
from vllm_ddtree.walk import verify_tree

SYNCING_OPS = {
    "aten::_local_scalar_dense",  # .item(), float(t), int(t), bool(t)
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::unique_dim",
    "aten::_unique2",
    "aten::repeat_interleave.Tensor",  # without output_size its shape depends on data
}


class HostSyncError(RuntimeError):
    pass


class NoHostSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name + (f".{func._overloadname}" if func._overloadname != "default" else "")
        if func._schema.name in SYNCING_OPS or name in SYNCING_OPS:
            raise HostSyncError(f"host synchronisation through {name}")
        if func._schema.name in ("aten::index", "aten::index_put", "aten::index_put_"):
            if any(t is not None and t.dtype == torch.bool for t in args[1]):
                raise HostSyncError(f"boolean-mask indexing (data-dependent shape) through {name}")
        if func._schema.name in ("aten::_to_copy", "aten::copy_"):
            src = args[1] if func._schema.name == "aten::copy_" else args[0]
            dst_device = kwargs.get("device") if func._schema.name == "aten::_to_copy" else args[0].device
            if src.device.type != "cpu" and dst_device is not None and torch.device(dst_device).type == "cpu":
                raise HostSyncError(f"device->host copy through {name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync():
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with NoHostSync():
            yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")


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
