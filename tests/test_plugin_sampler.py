"""TreeRejectionSampler (the walk in vLLM's sampler slot) on hand-made batches, no engine.

Oracle: plain decoding's rule at temperature 0 (accept while the draft equals the target's
argmax, then the argmax as the bonus), written out here per request.
"""

import torch
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

import vllm_ddtree.plugin.sampler as sampler_module
from vllm_ddtree.plugin.options import DDTreeOptions
from vllm_ddtree.plugin.sampler import TreeRejectionSampler
from vllm_ddtree.plugin.state import TreeState


class Greedy:
    all_greedy = True
    temperature = None


def greedy_chain_output(drafts: list[int], logits: torch.Tensor) -> list[int]:
    out = []
    for i, token in enumerate(drafts):
        best = int(logits[i].argmax())
        out.append(best)
        if best != token:
            return out
    out.append(int(logits[len(drafts)].argmax()))
    return out


def test_warmup_batch_pads_to_the_widest_tree_not_the_budget(monkeypatch):
    """vLLM's warm-up: max_num_seqs requests with one draft each, budget 1024.

    The walk must see [R, 2, V] logits; padding to the budget ([256, 1025, V]) is what made
    budget 1024 run out of memory at engine start.
    """
    seen = []
    walk = sampler_module.verify_tree
    monkeypatch.setattr(sampler_module, "verify_tree",
                        lambda tree, logits, sampling: seen.append(logits.shape) or walk(
                            tree, logits, sampling))
    state = TreeState(DDTreeOptions(budget=1024, depth=15), torch.device("cpu"))
    num_reqs, vocab = 256, 64
    drafts = [[int(t)] for t in torch.randint(0, vocab, (num_reqs,))]
    metadata = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    logits = torch.randn(2 * num_reqs, vocab)
    out = TreeRejectionSampler(state)(metadata, None, logits, Greedy()).sampled_token_ids
    assert seen == [torch.Size([num_reqs, 2, vocab])]
    assert out.shape == (num_reqs, 2)
    for r in range(num_reqs):
        expected = greedy_chain_output(drafts[r], logits[2 * r: 2 * r + 2])
        assert out[r].tolist() == expected + [-1] * (2 - len(expected))
