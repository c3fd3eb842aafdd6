"""One engine on the tiny pair, in its own process, for tests/test_vllm_parallel.py.

``python tests/parallel_run.py --out FILE [--tp 2] [--pp 2] [--spec JSON] [--max-tokens N]
[--num-blocks N] [--short]``
starts an engine (tensor parallel over ``--tp`` CPU ranks, pipeline parallel over ``--pp``
stages, one core per rank), runs every job of
:func:`jobs` and writes a JSON file: the output token ids per job, the preemptions, and per rank
the rows ddtree verified as chains because their drafts were not a proposal, the K/V slots it
moved and its drafter's embedding sum. ``--num-blocks N``: a K/V cache of N blocks of 32 tokens
(few blocks: requests preempt). It prints a line after each job, so the test's watchdog can
tell a hang (no line for a while) from a slow machine.
"""

from __future__ import annotations

import argparse
import json
import os

from vllm_utils import PROMPTS as _TINY_PROMPTS  # this folder is the script's sys.path[0]

PROMPTS = [*_TINY_PROMPTS, "def parse_args(argv):\n    parser = argparse.ArgumentParser(",
           "    return self."]
SEEDED = dict(temperature=0.8, top_p=0.9, top_k=50)
STRUCTURED_REGEX = r"[a-z ]{40,80}\."
FEATURES = [dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.2, logprobs=2),
            dict(bad_words=["self", " in"], ignore_eos=True),
            dict(min_tokens=48, stop_token_ids=[202, 286]),
            dict(allowed_token_ids=list(range(150, 420)), ignore_eos=True),
            dict(logit_bias={202: -50.0, 286: 3.0}, ignore_eos=True)]


def jobs(max_tokens: int, short: bool = False):
    """(name, prompts, per-prompt sampling kwargs) in run order. ``greedy``: every prompt at
    T = 0 (twice, the second time in reverse order); ``mixed``: even prompts greedy, odd ones
    seeded at T = 0.8, all in one batch; ``features`` (short runs): every prompt at T = 0 with
    one of ``FEATURES`` (penalties, bad words, min_tokens, allowed ids, logit_bias);
    ``structured`` (short runs): four prompts at T = 0 under a regular expression; ``alone``
    and ``pairs``: the seeded prompts again, each alone, then in other company (the same seeds
    must give the same text). ``short``: without the reversed greedy pass and the runs alone
    (a second policy on the same layout)."""
    common = dict(max_tokens=max_tokens, ignore_eos=True)

    def greedy(i):
        return dict(common, temperature=0.0)

    def seeded(i):
        return dict(common, **SEEDED, seed=1000 + i)

    def mixed(i):
        return greedy(i) if i % 2 == 0 else seeded(i)

    def features(i):  # request features on tree rows (features.py), greedy, 64 tokens
        return dict(FEATURES[i % len(FEATURES)], max_tokens=64, temperature=0.0)

    def structured(i):  # a grammar along the trees (grammar.py), greedy
        from vllm.sampling_params import StructuredOutputsParams

        return dict(max_tokens=48, temperature=0.0,
                    structured_outputs=StructuredOutputsParams(regex=STRUCTURED_REGEX))

    everyone = list(range(len(PROMPTS)))
    odd = everyone[1::2]
    yield "greedy", everyone, greedy
    if short:
        yield "features", everyone, features
        yield "structured", everyone[:4], structured
    if not short:
        yield "greedy_reversed", everyone[::-1], greedy
    yield "mixed", everyone, mixed
    for i in [] if short else odd:
        yield f"alone_{i}", [i], seeded
    yield "pairs", [odd[1], 0, odd[0], 2, odd[3], odd[2]], mixed


def cache_sizes(num_blocks: int) -> dict:
    """Engine arguments for a K/V cache of ``num_blocks`` blocks of 32 tokens (0: the test
    default); a few blocks make requests preempt and resume."""
    if not num_blocks:
        return {}
    return dict(num_gpu_blocks_override=num_blocks, block_size=32, max_model_len=256)


def _unmatched_rows(worker) -> int:
    state = getattr(worker.model_runner, "ddtree_state", None)
    return -1 if state is None else state.num_unmatched_rows


def _drafter_embedding_sum(worker) -> float | None:
    """The sum of the drafter's input embedding rows of the vocabulary (float64), where the
    rank has a drafter model: on the last pipeline stage it must be the target's."""
    model = getattr(getattr(worker.model_runner, "drafter", None), "model", None)
    if model is None:
        return None
    vocab = worker.model_runner.model_config.get_vocab_size()
    return float(model.model.embed_tokens.weight[:vocab].double().sum())


def _moved_slots(worker) -> int:
    """K/V positions this rank moved after verify steps: by its own walk (the last pipeline
    stage, or every rank without pipeline parallelism) or by the accepted paths the scheduler
    relayed (a stage before the last, stages.py)."""
    state = getattr(worker.model_runner, "ddtree_state", None)
    if state is None:
        return -1
    return state.stage.moved_slots if state.stage is not None else state.num_compacted_slots


def run_jobs(llm, max_tokens: int, short: bool = False, log=lambda line: None) -> dict:
    """Every job of :func:`jobs` on ``llm``: the output token ids per job, and (ddtree) per
    rank the rows verified as chains because their drafts were not a proposal."""
    from vllm import SamplingParams

    result: dict = {"outputs": {}}
    for name, indices, params in jobs(max_tokens, short):
        outs = llm.generate([PROMPTS[i] for i in indices],
                            [SamplingParams(**params(i)) for i in indices], use_tqdm=False)
        result["outputs"][name] = {str(i): list(o.outputs[0].token_ids)
                                   for i, o in zip(indices, outs)}
        log(f"job {name} done")
    if llm.llm_engine.vllm_config.speculative_config is not None:
        result["unmatched_rows_per_rank"] = llm.collective_rpc(_unmatched_rows)
        result["moved_slots_per_rank"] = llm.collective_rpc(_moved_slots)
        result["drafter_embedding_sum_per_rank"] = llm.collective_rpc(_drafter_embedding_sum)
    result["preemptions"] = sum(m.value for m in llm.get_metrics()
                                if m.name == "vllm:num_preemptions")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--num-blocks", type=int, default=0,
                        help="K/V blocks of 32 tokens (0: the test default); few preempt")
    parser.add_argument("--spec", default=None, help="speculative config as JSON (none: plain)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--short", action="store_true", help="the short job list (jobs())")
    args = parser.parse_args()
    # one core per rank, a bounded K/V space (vLLM's CPU backend), collective_rpc with a function
    # one core per rank, round robin where there are more ranks than cores
    ranks, cores = args.tp * args.pp, os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                          "|".join(str(rank % cores) for rank in range(ranks)))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm_utils import close, make_llm

    spec = json.loads(args.spec) if args.spec else None
    llm = make_llm(spec, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                   max_num_seqs=8, **cache_sizes(args.num_blocks))
    print("engine ready", flush=True)
    try:
        result = run_jobs(llm, args.max_tokens, args.short, lambda line: print(line, flush=True))
    finally:
        close(llm)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
