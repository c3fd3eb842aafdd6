"""What a cold step keeps of its prompt rows for the drafter's next context pass (no engine).

``shareable_rows`` picks the prompt rows the prefix cache can share (whole blocks); the
oracle is the rule written per row.

``DDTreeProposer._keep_prompt_rows`` takes slices where the prompt rows are one block and
index_select elsewhere; the oracle is the rule written out row by row: the kept hidden state
of prompt row i is the concatenation of every auxiliary layer's row (``gather[i]`` after a
tree verify step), with the runner's position and slot of row i, in row order.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ddtree.plugin.proposer import DDTreeProposer, shareable_rows

NUM_TOKENS, HIDDEN, NUM_AUX = 10, 3, 2


def kept(rows, gather=None):
    """Run ``_keep_prompt_rows`` on buffers larger than the step (as the runner's are); returns
    what it kept and the step's inputs."""
    aux = [torch.randn(NUM_TOKENS + 4, HIDDEN) for _ in range(NUM_AUX)]
    positions = torch.arange(100, 100 + NUM_TOKENS + 4)
    slot_buffer = torch.randperm(64)[: NUM_TOKENS + 4]
    out = []
    fake = SimpleNamespace(_runner=SimpleNamespace(positions=positions),
                           device=torch.device("cpu"),
                           _keep_context=lambda *tensors: out.append(tensors))
    DDTreeProposer._keep_prompt_rows(fake, np.array(rows, dtype=np.int64), aux,
                                     slot_buffer[:NUM_TOKENS], gather, NUM_TOKENS)
    return out, aux, positions, slot_buffer


@pytest.mark.parametrize("rows, gather", [
    (list(range(NUM_TOKENS)), None),  # a wave's prompts: every row
    ([6, 7, 8, 9], None),  # a new prompt after the running requests' decode rows
    ([2, 3, 4], None),  # a block in the middle
    ([0, 1, 5, 6, 7], None),  # two prompts around decode rows
    ([6, 7, 8, 9], list(reversed(range(NUM_TOKENS)))),  # after a tree verify step
])
def test_prompt_rows_are_kept_as_the_rule_says(rows, gather):
    gather_index = None if gather is None else torch.tensor(gather)
    out, aux, positions, slot_buffer = kept(rows, gather_index)
    assert len(out) == 1
    hidden, kept_positions, kept_slots = out[0]
    source = rows if gather is None else [gather[i] for i in rows]
    expected = torch.stack([torch.cat([h[s] for h in aux]) for s in source])
    assert torch.equal(hidden, expected)
    assert kept_positions.tolist() == [positions[i].item() for i in rows]
    assert kept_slots.tolist() == [slot_buffer[i].item() for i in rows]
    # the kept tensors are their own: the runner reuses its buffers in the next step
    before = (hidden.clone(), kept_positions.clone(), kept_slots.clone())
    for buffer in (*aux, positions, slot_buffer):
        buffer.zero_()
    assert all(torch.equal(a, b) for a, b in zip(before, (hidden, kept_positions, kept_slots)))


def test_a_step_without_prompt_rows_keeps_nothing():
    out, *_ = kept([])
    assert out == []


def test_shareable_rows_are_those_of_full_blocks():
    """``shareable_rows`` against the rule written per row: a prompt row at position p is kept
    iff its whole block (positions p // bs * bs to p // bs * bs + bs - 1) lies within its
    request's known tokens; decode rows never. Random steps of prompts, chunks and decode rows."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        block = int(rng.choice([1, 4, 16, 128]))
        num_reqs = int(rng.integers(1, 6))
        counts, prompt, computed, known = [], [], [], []
        for _ in range(num_reqs):
            is_prompt = bool(rng.integers(0, 2))
            first = int(rng.integers(0, 300))
            n = int(rng.integers(2, 200)) if is_prompt else int(rng.integers(1, 4))
            counts.append(n)
            prompt.append(is_prompt)
            computed.append(first)
            known.append(first + n + int(rng.integers(0, 300)) * int(rng.integers(0, 2)))
        expected = [is_prompt and (p // block + 1) * block <= total
                    for n, is_prompt, first, total in zip(counts, prompt, computed, known)
                    for p in range(first, first + n)]
        shared = shareable_rows(counts, prompt, computed, known, block)
        assert shared.tolist() == expected


def test_a_prompt_within_one_block_shares_nothing():
    # the tiny pair's benchmark prompts: 64 tokens, blocks of 128 on the CPU
    assert not shareable_rows([64, 1], [True, False], [0, 70], [64, 71], 128).any()
    assert shareable_rows([64], [True], [0], [64], 16).all()
