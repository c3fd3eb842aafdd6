"""The rank guards of vllm_ddtree/plugin/ranks.py on a real two-process gloo group (the CPU
group vLLM gives a tensor-parallel group): ranks that disagree both stop with a clear error
(neither is left waiting), ranks that agree pass, timings reduce to the slowest rank's."""

import multiprocessing
import os
import socket
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


def _rank_main(rank: int, port: int, values: list, out) -> None:
    import torch.distributed as dist

    from vllm_ddtree.plugin import ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ranks._tp_group = lambda: SimpleNamespace(world_size=2, cpu_group=dist.group.WORLD)
    result = {"max": ranks.max_over_ranks([1.0 + rank, 5.0 - rank])}
    for name, value in values:
        try:
            ranks.check_same(name, value)
            result[name] = "same"
        except ranks.DDTreeRankError as error:
            result[name] = str(error)
    out.put((rank, result))
    dist.destroy_process_group()


def test_ranks_that_disagree_stop_with_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = []
    for rank in range(2):
        values = [("the options", {"budget": 32}),
                  ("the plan of a step", ("draft" if rank == 0 else "context", 7))]
        procs.append(ctx.Process(target=_rank_main, args=(rank, port, values, out)))
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank in range(2):
        got = results[rank]
        assert got["max"] == [2.0, 5.0]  # each point: the slowest rank's
        assert got["the options"] == "same"
        error = got["the plan of a step"]
        assert "disagree on the plan of a step" in error
        assert "rank 0: ('draft', 7)" in error and "rank 1: ('context', 7)" in error


def test_one_rank_checks_nothing():
    from vllm_ddtree.plugin import ranks

    assert ranks.tp_world_size() == 1
    ranks.check_same("anything", os.getpid())  # no group: nothing to compare, no error
    assert ranks.max_over_ranks([3.0]) == [3.0]
    assert not ranks.check_every_step()
