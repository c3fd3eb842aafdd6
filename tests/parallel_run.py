"""One engine on the tiny pair, in its own process, for tests/test_vllm_parallel.py.

``python tests/parallel_run.py --out FILE [--tp 2] [--pp 2] [--spec JSON] [--max-tokens N]
[--num-blocks N] [--short] [--v2]``
starts an engine (tensor parallel over ``--tp`` CPU ranks, pipeline parallel over ``--pp``
stages, one core per rank; ``--v2``: on vLLM's Model Runner V2, tests/v2_harness.py, with
async scheduling where ``V2_ASYNC=1``), runs every job of
:func:`jobs` and writes a JSON file: the output token ids per job, the preemptions, and per rank
the rows ddtree verified as chains because their drafts were not a proposal, the K/V slots it
moved and its drafter's embedding sum. ``--num-blocks N``: a K/V cache of N blocks of 32 tokens
(few blocks: requests preempt). It prints a line after each job, so the test's watchdog can
tell a hang (no line for a while) from a slow machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

if "--v2" in sys.argv:  # before vLLM is imported, here and in every spawned rank
    import v2_harness  # noqa: F401  (this folder is the script's sys.path[0])

from vllm_utils import PROMPTS as _TINY_PROMPTS

PROMPTS = [*_TINY_PROMPTS, "def parse_args(argv):\n    parser = argparse.ArgumentParser(",
           "    return self."]
SEEDED = dict(temperature=0.8, top_p=0.9, top_k=50)
STRUCTURED_REGEX = r"[a-z ]{40,80}\."
# the law jobs: LAW_REQUESTS requests of one prompt (no seed: independent draws), 3 tokens
# each, at one of tests/test_vllm_sampling.py's settings, which computes their joint law exactly
LAW_PROMPT, LAW_REQUESTS = "    def __init__(self", 600
LAW_JOBS = {"law": "t1", "law_features": "t1_features"}
FEATURES = [dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.2, logprobs=2),
            dict(bad_words=["self", " in"], ignore_eos=True),
            dict(min_tokens=48, stop_token_ids=[202, 286], logprobs=3),
            dict(allowed_token_ids=list(range(150, 420)), ignore_eos=True, logprobs=1),
            dict(logit_bias={202: -50.0, 286: 3.0}, ignore_eos=True)]


def jobs(max_tokens: int, short: bool = False, names: list[str] | None = None):
    """(name, prompts, per-prompt sampling kwargs) in run order. ``greedy``: every prompt at
    T = 0 (twice, the second time in reverse order); ``mixed``: even prompts greedy, odd ones
    seeded at T = 0.8, all in one batch; ``features`` (short runs): every prompt at T = 0 with
    one of ``FEATURES`` (penalties, bad words, min_tokens, allowed ids, logit_bias, with
    logprobs on three of them); ``structured`` (short runs): four prompts at T = 0 under a
    regular expression; ``alone`` and ``pairs``: the seeded prompts again, each alone, then in
    other company (the same seeds must give the same text); ``staggered`` (only where named):
    every prompt at T = 0, one request added every third engine step, so requests join running
    ones; ``penalties`` (only where named): every prompt with presence, frequency and
    repetition penalties and logprobs, even ones greedy, odd ones seeded; ``biased`` (only
    where named): every prompt at T = 0 with a small ``logit_bias`` on token 5; ``bad_words``
    (only where named): bad words of 2 and 3 tokens that plain outputs hold, even prompts
    greedy, odd ones seeded; ``law`` and ``law_features`` (only where named):
    :data:`LAW_REQUESTS` requests of :data:`LAW_PROMPT`, 3 tokens each, at the setting of
    :data:`LAW_JOBS` (T = 1, then with penalties, ``min_p`` and ``logit_bias``). ``short``:
    without the reversed greedy pass and the runs alone (a second policy on the same layout),
    with the features and structured jobs. ``names``: only these jobs (``alone`` for the runs
    alone), in the order above."""
    common = dict(max_tokens=max_tokens, ignore_eos=True)

    def greedy(i):
        return dict(common, temperature=0.0)

    def seeded(i):
        return dict(common, **SEEDED, seed=1000 + i)

    def mixed(i):
        return greedy(i) if i % 2 == 0 else seeded(i)

    def features(i):  # request features on tree rows (features.py), greedy, 64 tokens
        return dict(FEATURES[i % len(FEATURES)], max_tokens=64, temperature=0.0)

    def penalties(i):  # penalties counting each row's path: even prompts greedy, odd seeded
        return dict(mixed(i), **FEATURES[0])

    def bad_words(i):  # words of 2 and 3 tokens that the outputs hold: banned by the history
        return dict(mixed(i), bad_words=["self.", "get_name"])

    def biased(i):  # a feature that reshapes the target's law (known_params.reshapes_target)
        return dict(greedy(i), logit_bias={5: -1.0})

    def law_job(name):
        from test_vllm_sampling import SETTINGS

        return lambda i: dict(SETTINGS[LAW_JOBS[name]], max_tokens=3, ignore_eos=True)

    def structured(i):  # a grammar along the trees (grammar.py), greedy
        from vllm.sampling_params import StructuredOutputsParams

        return dict(max_tokens=48, temperature=0.0,
                    structured_outputs=StructuredOutputsParams(regex=STRUCTURED_REGEX))

    if names is None:
        names = (["greedy", "features", "structured", "mixed", "pairs"] if short else
                 ["greedy", "greedy_reversed", "mixed", "alone", "pairs"])
    everyone = list(range(len(PROMPTS)))
    odd = everyone[1::2]
    listed = [("greedy", everyone, greedy), ("features", everyone, features),
              ("structured", everyone[:4], structured),
              ("greedy_reversed", everyone[::-1], greedy), ("mixed", everyone, mixed),
              *((f"alone_{i}", [i], seeded) for i in odd),
              ("pairs", [odd[1], 0, odd[0], 2, odd[3], odd[2]], mixed),
              ("staggered", everyone, greedy), ("penalties", everyone, penalties),
              ("biased", everyone, biased), ("bad_words", everyone, bad_words),
              *((name, list(range(LAW_REQUESTS)), law_job(name)) for name in LAW_JOBS)]
    for job in listed:
        if job[0] in names or (job[0].startswith("alone_") and "alone" in names):
            yield job


# the V2 tree step's code, from the verify trees to the drafter's next trees (--check-host-sync)
V2_STEP_FILES = tuple(f"vllm_ddtree/{name}" for name in (
    "plugin/v2/trees.py", "plugin/v2/model_state.py", "plugin/v2/verifier.py",
    "plugin/v2/speculator.py", "plugin/state.py", "plugin/compaction.py", "tree.py", "walk.py",
    "sampling.py"))


def cache_sizes(num_blocks: int) -> dict:
    """Engine arguments for a K/V cache of ``num_blocks`` blocks of 32 tokens (0: the test
    default); a few blocks make requests preempt and resume."""
    if not num_blocks:
        return {}
    return dict(num_gpu_blocks_override=num_blocks, block_size=32, max_model_len=256)


def _tree_step(worker):
    """The V2 runner's tree state (vllm_ddtree/plugin/v2), or None."""
    return getattr(getattr(worker.model_runner, "model_state", None), "ddtree", None)


def _unmatched_rows(worker) -> int:
    if _tree_step(worker) is not None:
        return 0  # V2 verifies each request slot's own tree: nothing to match
    state = getattr(worker.model_runner, "ddtree_state", None)
    return -1 if state is None else state.num_unmatched_rows


def _drafter_embedding_sum(worker) -> float | None:
    """The sum of the drafter's input embedding rows of the vocabulary (float64), where the
    rank has a drafter model: on the last pipeline stage it must be the target's."""
    runner = worker.model_runner
    model = getattr(getattr(runner, "drafter", getattr(runner, "speculator", None)), "model",
                    None)
    if model is None:
        return None
    vocab = worker.model_runner.model_config.get_vocab_size()
    return float(model.model.embed_tokens.weight[:vocab].double().sum())


def _moved_slots(worker) -> int:
    """K/V positions this rank moved after verify steps: by its own walk (the last pipeline
    stage, or every rank without pipeline parallelism) or by the accepted paths the scheduler
    relayed (a stage before the last, stages.py)."""
    step = _tree_step(worker)
    if step is not None:
        return step.num_compacted_slots
    state = getattr(worker.model_runner, "ddtree_state", None)
    if state is None:
        return -1
    return state.stage.moved_slots if state.stage is not None else state.num_compacted_slots


def run_jobs(llm, max_tokens: int, short: bool = False, log=lambda line: None,
             names: list[str] | None = None, guard=None) -> dict:
    """The jobs of :func:`jobs` on ``llm``: the output token ids per job, the logprobs of the
    requests that ask for them (rounded to 1e-4), and (ddtree) per rank the rows verified as
    chains because their drafts were not a proposal. ``guard``: a context manager the jobs
    run in (not the statistics read after them)."""
    from vllm import SamplingParams

    result: dict = {"outputs": {}, "logprobs": {}}
    with guard or contextlib.nullcontext():
        _run(llm, jobs(max_tokens, short, names), result, log)

    if llm.llm_engine.vllm_config.speculative_config is not None:
        result["unmatched_rows_per_rank"] = llm.collective_rpc(_unmatched_rows)
        result["moved_slots_per_rank"] = llm.collective_rpc(_moved_slots)
        result["drafter_embedding_sum_per_rank"] = llm.collective_rpc(_drafter_embedding_sum)
    metrics = llm.get_metrics()
    result["preemptions"] = sum(m.value for m in metrics if m.name == "vllm:num_preemptions")
    drafts = sum(m.value for m in metrics if m.name == "vllm:spec_decode_num_drafts")
    accepted = sum(m.value for m in metrics
                   if m.name == "vllm:spec_decode_num_accepted_tokens")
    result["mean_acceptance_length"] = 1 + accepted / drafts if drafts else 1.0
    draft_tokens = sum(m.value for m in metrics if m.name == "vllm:spec_decode_num_draft_tokens")
    result["num_drafts"] = drafts  # request-steps that verified drafts
    result["draft_tokens_per_draft"] = draft_tokens / drafts if drafts else 0.0
    config = llm.llm_engine.vllm_config
    result["model_runner"] = "v2" if config.use_v2_model_runner else "v1"
    result["async_scheduling"] = bool(config.scheduler_config.async_scheduling)
    return result


def _run(llm, job_list, result: dict, log) -> None:
    from vllm import SamplingParams

    result["job_acceptance_length"] = {}
    for name, indices, params in job_list:
        before = _draft_counts(llm)
        prompts = [LAW_PROMPT if name in LAW_JOBS else PROMPTS[i] for i in indices]
        sampling = [SamplingParams(**params(i)) for i in indices]
        if name == "staggered":
            outs, rounds = _staggered(llm, prompts, sampling)
            result["rounds"] = {str(i): r for i, r in zip(indices, rounds)}
            result["prompt_ids"] = {str(i): list(o.prompt_token_ids)
                                    for i, o in zip(indices, outs)}
        else:
            outs = llm.generate(prompts, sampling, use_tqdm=False)
        drafts, accepted = (a - b for a, b in zip(_draft_counts(llm), before))
        result["job_acceptance_length"][name] = 1 + accepted / drafts if drafts else 1.0
        result["outputs"][name] = {str(i): list(o.outputs[0].token_ids)
                                   for i, o in zip(indices, outs)}
        result["logprobs"][name] = {
            str(i): [{str(t): round(lp.logprob, 4) for t, lp in row.items()}
                     for row in o.outputs[0].logprobs]
            for i, o in zip(indices, outs) if o.outputs[0].logprobs}
        log(f"job {name} done")


def _draft_counts(llm) -> tuple[float, float]:
    """vLLM's running counts of request-steps with drafts and of accepted drafts."""
    metrics = llm.get_metrics()
    return tuple(sum(m.value for m in metrics if m.name == name) for name in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"))


def _staggered(llm, prompts: list[str], sampling: list) -> tuple[list, list[list[int]]]:
    """The requests added one every third engine step (the first at once), run to the end;
    their outputs and the tokens each got per step that gave it any (its verify rounds)."""
    engine = llm.llm_engine
    pending = list(enumerate(zip(prompts, sampling)))
    done, steps = {}, 0
    rounds: list[list[int]] = [[] for _ in prompts]
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:
            i, (prompt, params) = pending.pop(0)
            engine.add_request(f"staggered_{i}", prompt, params)
        for out in engine.step():
            i = int(out.request_id.split("_")[1])
            new = len(out.outputs[0].token_ids) - sum(rounds[i])
            if new:
                rounds[i].append(new)
            if out.finished:
                done[i] = out
        steps += 1
        assert steps < 5000, "the staggered job does not finish"
    return [done[i] for i in range(len(prompts))], rounds


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
    parser.add_argument("--v2", action="store_true",
                        help="Model Runner V2 (tests/v2_harness.py, imported at the top)")
    parser.add_argument("--jobs", default=None, help="comma-separated job names (jobs())")
    parser.add_argument("--max-batched-tokens", type=int, default=0,
                        help="max_num_batched_tokens (0: vLLM's default); small: chunked prefill")
    parser.add_argument("--model", default=None, help="the target (default: the tiny pair's)")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--check-host-sync", action="store_true",
                        help="run the jobs under tests/sync_checker.py's NoHostSync, judging "
                             "the V2 tree step's code (V2_STEP_FILES); one process, one thread")
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
    extra = dict(cache_sizes(args.num_blocks))
    if args.max_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_batched_tokens
    if args.model:
        extra["model"] = args.model
    llm = make_llm(spec, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                   max_num_seqs=args.max_num_seqs, **extra)
    print("engine ready", flush=True)
    names = args.jobs.split(",") if args.jobs else None
    checker = None
    try:
        guard = None
        if args.check_host_sync:
            from sync_checker import NoHostSync, no_host_sync

            checker = NoHostSync(
                scope=V2_STEP_FILES,
                allowed_reads={("plugin/v2/verifier.py", "_host_seq_lens"):
                               "seq_lens_cpu_upper_bound: a host tensor vLLM made"},
                allowed_uploads=(("vllm_ddtree/plugin/state.py", "to_device"),))
            guard = no_host_sync(checker)
            # the engine steps its runner in another thread: the dispatch mode (thread-local)
            # must be entered there too
            runner = (llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
                      .worker.model_runner)
            for method in ("execute_model", "sample_tokens"):
                def checked(*a, _method=getattr(runner, method), **k):
                    with checker:
                        return _method(*a, **k)

                setattr(runner, method, checked)
        result = run_jobs(llm, args.max_tokens, args.short, lambda line: print(line, flush=True),
                          names, guard)
        if checker is not None:
            result["host_sync_checked_ops"] = checker.num_checked
    finally:
        close(llm)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
