"""ddtree inside vLLM 0.32 (CPU) at temperature > 0: the generated tokens follow the target's law.

The first generated token is sampled by the target at prefill (no speculation); tokens 2 and 3
come out of verification (the tree walk, or HSD for ``ddtree_mode="hsd_chain"``). The law tests
therefore compare the JOINT law of generated tokens (t1, t2, t3) with the exact law of the
target, computed independently: the committed target loaded with transformers in float32,
P(t1, t2, t3 | prompt) = p(t1) p(t2 | t1) p(t3 | t1, t2), each factor processed as vLLM's sampler
does it (temperature, then top-k, then top-p: :func:`vllm_ddtree.sampling.processed_logits`,
checked against vLLM's own ``apply_top_k_top_p`` below).

Statistic: Pearson chi-square goodness of fit, cells with expected count < 5 pooled into one
bin (at temperature 1 the law has 4096^3 cells: every triple that is not enumerated has
probability < 5 / N and sits in that bin, whose exact mass is 1 - the enumerated mass).
Each law group asserts p > 1e-4: a correct engine fails a group with probability 1e-4 nominally
(the chi-square approximation makes it a few 1e-4: 1 and 2 p-values < 1e-4 in 4000 simulated
draws from the exact law at N = 1800 and 600); the file has 4 groups, about 1e-3 in all. The
calibration/power test shows the statistic is uniform under the exact law and rejects
plausible wrong laws (temperature off by 10 %, top-p or temperature ignored) at the same N.

The engine itself is seeded (``make_llm(seed=0)``), so a run repeats its draws on a given
machine; the requests of a law batch carry no seed (except the seeded group), so their draws
are independent of each other.

Seeded requests: the same ``seed`` gives the same tokens whatever else the engine runs, in
"tree" and "hsd_chain" mode.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chi2
from vllm_utils import PROMPTS, TARGET, close, ddtree_spec, ddtree_state, make_llm, spec_metrics

from vllm_ddtree.budget import CostModel
from vllm_ddtree.sampling import SamplingBatch, processed_logits

PROMPT = "    def __init__(self"
P_MIN = 1e-4  # bound on each law group's p-value (its nominal false-alarm rate)
SETTINGS = {  # name -> vLLM SamplingParams keywords (top_k 0 / top_p 1: off)
    "t1": dict(temperature=1.0, top_k=0, top_p=1.0),
    "t07_k20_p09": dict(temperature=0.7, top_k=20, top_p=0.9),
    # request features whose law depends on each token's history (penalties: a tree node's
    # path) or that vLLM refuses under speculative decoding (logit_bias, min_p)
    "t1_features": dict(temperature=1.0, top_k=0, top_p=1.0, presence_penalty=-2.0,
                        frequency_penalty=-1.5, repetition_penalty=1.3, min_p=0.02,
                        logit_bias={12: 1.0, 289: -0.7}),
}
FEATURES = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p")
N_PER_SETTING = 1800  # requests per setting in the engine law tests
N_SEEDED = 600  # + requests of the top-k/top-p setting with distinct seeds, in the same batch
SEED0 = 1000


# ---------------------------------------------------------------------------------------------
# the exact target law


class TargetLaw:
    """Exact law of the next tokens of the committed target after ``prompt_ids`` (float64).

    ``probs(prefixes, setting)`` runs the target (transformers, float32) on ``prompt + prefix``
    for every prefix and returns the processed next-token law ``[n, V]``.
    """

    def __init__(self, prompt_ids: list[int]):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
        self.prompt_ids = list(prompt_ids)
        self._logits: dict[tuple, torch.Tensor] = {}

    def logits(self, prefixes: list[tuple]) -> torch.Tensor:
        missing = [p for p in dict.fromkeys(prefixes) if p not in self._logits]
        by_len: dict[int, list[tuple]] = {}
        for p in missing:
            by_len.setdefault(len(p), []).append(p)
        for group in by_len.values():
            for i in range(0, len(group), 512):
                chunk = group[i:i + 512]
                ids = torch.tensor([self.prompt_ids + list(p) for p in chunk])
                with torch.no_grad():
                    out = self.model(input_ids=ids).logits[:, -1].float()
                self._logits.update(zip(chunk, out))
        return torch.stack([self._logits[p] for p in prefixes])

    @staticmethod
    def sampling(setting: dict, n: int) -> SamplingBatch:
        return SamplingBatch(temperature=torch.full((n,), float(setting["temperature"])),
                             top_k=torch.full((n,), int(setting["top_k"]), dtype=torch.int64),
                             top_p=torch.full((n,), float(setting["top_p"])))

    def probs(self, prefixes: list[tuple], setting: dict) -> torch.Tensor:
        logits = self.features(self.logits(prefixes).double(), prefixes, setting)
        logits = processed_logits(logits[:, None], self.sampling(setting, len(prefixes)))[:, 0]
        if setting.get("min_p"):  # after the temperature, as vLLM (top-k / top-p are off here)
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < probs.amax(-1, keepdim=True) * setting["min_p"],
                                        float("-inf"))
        return logits.softmax(-1)

    def features(self, logits: torch.Tensor, prefixes: list[tuple], setting: dict):
        """``logit_bias``, then the penalties with each prefix as the output so far (vLLM's own
        ``apply_all_penalties``, the prompt counting for the repetition penalty)."""
        from vllm.v1.sample.ops.penalties import apply_all_penalties

        for token, bias in (setting.get("logit_bias") or {}).items():
            logits[:, token] += bias
        n = len(prefixes)
        penalty = lambda key, default: torch.full((n,), float(setting.get(key, default)),  # noqa: E731
                                                  dtype=torch.float64)
        if any(k in setting for k in FEATURES[:3]):
            logits = apply_all_penalties(
                logits, torch.tensor([self.prompt_ids] * n), penalty("presence_penalty", 0),
                penalty("frequency_penalty", 0), penalty("repetition_penalty", 1),
                [list(p) for p in prefixes])
        return logits

    def min_p_margin(self, prefixes: list[tuple], setting: dict) -> float:
        """Smallest |log p - log(min_p max p)| over ``prefixes`` and tokens: how far the min_p
        decisions are from flipping (inf without min_p)."""
        if not setting.get("min_p"):
            return math.inf
        logits = self.features(self.logits(prefixes).double(), prefixes, setting)
        logp = (logits / setting["temperature"]).log_softmax(-1)
        edge = logp.amax(-1, keepdim=True) + math.log(setting["min_p"])
        return float((logp - edge).abs().min())

    def joint(self, setting: dict, min_prob: float = 0.0) -> dict[tuple, float]:
        """P(t1, t2, t3) of every triple whose probability is >= ``min_prob`` and > 0 (with
        ``min_prob = 0`` the whole support: finite with top-k)."""
        p1 = self.probs([()], setting)[0]
        firsts = [(t,) for t in torch.nonzero((p1 >= min_prob) & (p1 > 0)).flatten().tolist()]
        p2 = self.probs(firsts, setting) * p1[[t for (t,) in firsts]][:, None]
        pairs, w2 = [], []
        for i, (a,) in enumerate(firsts):
            for b in torch.nonzero((p2[i] >= min_prob) & (p2[i] > 0)).flatten().tolist():
                pairs.append((a, b))
                w2.append(float(p2[i, b]))
        p3 = self.probs(pairs, setting) * torch.tensor(w2, dtype=torch.float64)[:, None]
        law = {}
        for i, pair in enumerate(pairs):
            for c in torch.nonzero((p3[i] >= min_prob) & (p3[i] > 0)).flatten().tolist():
                law[pair + (c,)] = float(p3[i, c])
        return law

    def law_of(self, triples: list[tuple], setting: dict) -> dict[tuple, float]:
        """P(t1, t2, t3) of the given triples."""
        prefixes = sorted({t[:k] for t in triples for k in range(3)}, key=len)
        rows = {p: i for i, p in enumerate(prefixes)}
        probs = self.probs(prefixes, setting)
        return {t: math.prod(float(probs[rows[t[:k]], t[k]]) for k in range(3)) for t in triples}

    def boundary_margin(self, prefixes: list[tuple], setting: dict) -> float:
        """Smallest distance of the top-k / top-p decisions from flipping, over ``prefixes``:
        the gap between the k-th and (k+1)-th logit / T, and |cumulative probability - (1 - p)|
        of the ascending top-p scan. vLLM computes the logits with other kernels (differences
        ~1e-6); a margin well above that makes the processed support the same in both."""
        logits = self.logits(prefixes).double() / setting["temperature"]
        k, p = int(setting["top_k"]), float(setting["top_p"])
        margin = math.inf
        ordered = logits.sort(dim=-1, descending=True).values
        if 0 < k < logits.shape[1]:
            margin = min(margin, float((ordered[:, k - 1] - ordered[:, k]).min()))
            ordered = ordered[:, :k]
        if p < 1.0:
            cum = ordered.flip(-1).softmax(-1).cumsum(-1)[:, :-1]  # ascending scan
            margin = min(margin, float((cum - (1 - p)).abs().min()))
        return margin


# ---------------------------------------------------------------------------------------------
# the statistic


def pooled_chi_square(counts: dict[tuple, int], law: dict[tuple, float], total: int):
    """Pearson chi-square of ``counts`` (triple -> count, ``total`` draws) against ``law``.

    ``law`` lists the probability of at least every triple with expected count >= 5; its
    missing mass 1 - sum(law) belongs to triples it does not list. Cells with expected count
    < 5 (listed or not) are pooled into one bin. Returns ``(statistic, dof, p_value)``.
    """
    big = {t: p * total for t, p in law.items() if p * total >= 5}
    stat = sum((counts.get(t, 0) - e) ** 2 / e for t, e in big.items())
    pooled_obs = total - sum(counts.get(t, 0) for t in big)
    pooled_exp = total - sum(big.values())
    cells = len(big)
    if pooled_exp > 1e-9 * total:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    elif pooled_obs > 0:
        return math.inf, max(cells - 1, 1), 0.0  # draws where the law has no mass
    dof = max(cells - 1, 1)
    return stat, dof, float(chi2.sf(stat, dof))


# ---------------------------------------------------------------------------------------------
# no engine: the oracle's processing is vLLM's, and the statistic is calibrated and has power


def test_processed_logits_matches_vllm_sampler():
    """:func:`processed_logits` = vLLM's sampler (temperature, then top-k, then top-p) on the
    same per-row tensors vLLM hands the plugin (top_k = vocab and top_p = 1 where unused),
    ties at the k-th logit included; top-k only and top-p only take other vLLM code paths."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    gen = torch.Generator().manual_seed(0)
    vocab = 64
    logits = (torch.randn(8, vocab, generator=gen) * 3).round(decimals=1)  # many ties
    temperature = torch.tensor([1.0, 0.7, 0.3, 1.3, 0.0, 1.0, 0.9, 2.0])
    top_k = torch.tensor([vocab, 20, 1, 5, vocab, 63, 7, vocab], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 1.0, 0.05, 0.99, 0.3])
    for k, p in [(top_k, top_p), (top_k, None), (None, top_p)]:
        expected = apply_top_k_top_p(
            Sampler.apply_temperature(logits.clone(), temperature, all_random=False), k, p)
        ours = processed_logits(logits[:, None], SamplingBatch(temperature, k, p))[:, 0]
        assert torch.equal(torch.isinf(ours), torch.isinf(expected))
        finite = ~torch.isinf(expected)
        torch.testing.assert_close(ours[finite], expected[finite])


def _multinomial_counts(law_on_cells: dict[tuple, float], total: int, gen) -> dict[tuple, int]:
    """``total`` draws from the listed cells and one cell 'rest' holding the missing mass."""
    cells = list(law_on_cells)
    probs = torch.tensor([law_on_cells[c] for c in cells] + [0.0], dtype=torch.float64)
    probs[-1] = max(1.0 - float(probs.sum()), 0.0)
    draws = torch.bincount(torch.multinomial(probs, total, replacement=True, generator=gen),
                           minlength=len(probs)).tolist()
    return {c: n for c, n in zip(cells + [("rest",)], draws) if n}


# Wrong laws the statistic must reject at the engine test's N: a temperature off by 10 %,
# top-p ignored, the temperature ignored.
WRONG_LAWS = {
    "t1": [dict(temperature=0.9)],
    "t07_k20_p09": [dict(top_p=1.0), dict(temperature=1.0)],
    # the penalties ignored (a node's path and the output alike); logit_bias and min_p ignored
    "t1_features": [dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0),
                    dict(logit_bias=None, min_p=0.0)],
}


def law_min_prob(setting: dict, total: int) -> float:
    """Enumeration threshold: the whole support with top-k; else every triple that can reach
    an expected count of 5 (1 / N is safely below 5 / N)."""
    return 0.0 if setting["top_k"] else 1.0 / total


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def target_law(prompt_ids) -> TargetLaw:
    return TargetLaw(prompt_ids)


@pytest.fixture(scope="module")
def exact_laws(target_law) -> dict[str, dict[tuple, float]]:
    return {name: target_law.joint(s, law_min_prob(s, N_PER_SETTING))
            for name, s in SETTINGS.items()}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_statistic_is_calibrated_and_rejects_wrong_laws(name, target_law, exact_laws):
    """The statistic of the engine test, on synthetic counts at the same N: draws from the exact
    law give p-values that look uniform (2-9 % below 0.05 in 300 draws) and draws from each
    wrong law in WRONG_LAWS are rejected (p < P_MIN) in at least 45 of 50 draws, so the engine
    test can fail. The prompt keeps the top-k/top-p decisions far from flipping: margin > 2e-5,
    where vLLM's log-probabilities differ from transformers' by < 3e-6 (measured on this
    prompt)."""
    setting, law = SETTINGS[name], exact_laws[name]
    gen = torch.Generator().manual_seed(1)
    if setting["top_k"]:
        assert abs(sum(law.values()) - 1) < 1e-9, "the enumeration missed part of the support"
        prefixes = sorted({t[:k] for t in law for k in range(3)}, key=len)
        assert target_law.boundary_margin(prefixes, setting) > 2e-5
    if setting.get("min_p"):
        prefixes = sorted({t[:k] for t in law for k in range(3)}, key=len)
        assert target_law.min_p_margin(prefixes, setting) > 2e-5
    for total in [N_PER_SETTING] + ([N_SEEDED] if setting["top_k"] else []):
        big = [t for t, p in law.items() if p * total >= 5]
        assert len(big) >= 10, "too few cells for a meaningful test"
        pvalues = [pooled_chi_square(_multinomial_counts(law, total, gen), law, total)[2]
                   for _ in range(300)]
        assert 0.02 <= sum(p < 0.05 for p in pvalues) / len(pvalues) <= 0.09, total
        for change in WRONG_LAWS[name]:
            wrong = target_law.law_of(big, dict(setting, **change))
            pvalues = [pooled_chi_square(_multinomial_counts(wrong, total, gen), law, total)[2]
                       for _ in range(50)]
            assert sum(p < P_MIN for p in pvalues) >= 45, (total, change, sorted(pvalues)[-5:])


# ---------------------------------------------------------------------------------------------
# the real engine


class Engines:
    """At most one vLLM engine alive in this process: ``get(kind)`` closes the other one."""

    SPECS = {"tree": lambda: ddtree_spec(16),
             "hsd_chain": lambda: ddtree_spec(4, ddtree_mode="hsd_chain"),
             "auto": lambda: ddtree_spec(16, ddtree_budget_policy="auto")}
    # "auto" with a synthetic step cost (10 ms + 10 us per verified token, drafter 0.5 ms) and
    # no online correction: a node pays when its calibrated path probability beats ~0.2 at a
    # batch of 256, so budgets vary per request and step, zeros included, whatever this
    # machine's load
    AUTO_COST = CostModel((1, 1001), (0.01001, 0.02001), (1,), (0.0005,))

    def __init__(self):
        self.kind, self.llm = None, None

    def get(self, kind: str):
        if kind != self.kind:
            self.close()
            # per-request acceptance histograms: the mean acceptance length of each setting
            # no chunked prefill: vLLM 0.32's CPU runner crashes on a seeded request whose
            # prompt is split into chunks (CPU generators have no offset to rewind), with or
            # without speculative decoding
            self.llm = make_llm(self.SPECS[kind](), per_request_spec_decode_metrics="summary",
                                enable_chunked_prefill=False)
            self.kind = kind
            if kind == "auto":
                budgets = ddtree_state(self.llm).budgets
                budgets.set_cost_model(self.AUTO_COST)
                budgets.step_started = lambda *args: None
        return self.llm

    def close(self):
        if self.llm is not None:
            close(self.llm)
        self.kind, self.llm = None, None


@pytest.fixture(scope="module")
def engines():
    e = Engines()
    yield e
    e.close()


def sampling_params(setting: dict, **extra):
    from vllm import SamplingParams

    return SamplingParams(**setting, **extra)


def run_law_batch(llm, prompt_ids, names: list[str]) -> tuple[dict, dict]:
    """One ``generate`` call: request i uses setting ``names[i]``, 3 tokens. A name
    ``"<setting>/seeded"`` gives the request its own seed (SEED0 + i: distinct seeds, so the
    draws stay independent); plain names have no seed. Returns ``(counts, histogram)``: per
    name the (t1, t2, t3) counts and the summed per-request acceptance histogram (index =
    draft tokens accepted in a verify step)."""
    from vllm.inputs import TokensPrompt

    params = []
    for i, name in enumerate(names):
        setting, _, seeded = name.partition("/")
        seed = {"seed": SEED0 + i} if seeded else {}
        params.append(sampling_params(SETTINGS[setting], max_tokens=3, ignore_eos=True, **seed))
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)] * len(names), params,
                           use_tqdm=False)
    counts = {n: {} for n in names}
    histogram = {n: None for n in names}
    for name, out in zip(names, outputs):
        triple = tuple(out.outputs[0].token_ids)
        assert len(triple) == 3
        counts[name][triple] = counts[name].get(triple, 0) + 1
        hist = out.outputs[0].spec_decode_metrics.histogram
        histogram[name] = list(hist) if histogram[name] is None else [
            a + b for a, b in zip(histogram[name], hist)]
    return counts, histogram


def check_law(name, counts, histogram, law, total):
    """Support, acceptance (the drafts must be both wrong and right often) and chi-square."""
    if SETTINGS[name.partition("/")[0]]["top_k"]:  # ``law`` is the whole (finite) support
        unknown = [t for t in counts if t not in law]
        assert not unknown, f"{name}: outside the target's top-k/top-p support: {unknown[:5]}"
    steps = sum(histogram)
    accepted = sum(j * c for j, c in enumerate(histogram))
    mean_len = 1 + accepted / steps
    assert histogram[0] > 0.05 * steps and steps - histogram[0] > 0.05 * steps, (name, histogram)
    stat, dof, p = pooled_chi_square(counts, law, total)
    print(f"\n{name}: N={total} chi2={stat:.1f} dof={dof} p={p:.4f} "
          f"mean acceptance length={mean_len:.3f} histogram={histogram[:4]}")
    assert p > P_MIN, (name, stat, dof, p)
    return p, mean_len


def test_joint_law_tree_mixed_batch(engines, prompt_ids, exact_laws):
    """ddtree B=16: N requests per setting, both settings interleaved in ONE batch (per-row
    temperature / top-k / top-p), 3 tokens each, no seed; plus N_SEEDED requests of the top-k /
    top-p setting with distinct seeds spread over the same batch (seeded rows take their own
    sampling path in the plugin). The joint (t1, t2, t3) counts of each group fit the exact
    target law (p > 1e-4: a correct engine fails with probability 1e-4 per group), the
    top-k/top-p groups never leave the support, and verification really ran: accepted draft
    tokens > 0 in vLLM's metrics, and in each group at least 5 % of verify steps accept nothing
    and at least 5 % accept a draft."""
    llm = engines.get("tree")
    before = spec_metrics(llm).get("vllm:spec_decode_num_accepted_tokens", 0)
    names = [n for _ in range(N_PER_SETTING) for n in SETTINGS]
    every = len(names) // N_SEEDED
    for k in range(N_SEEDED):
        names.insert(k * (every + 1), "t07_k20_p09/seeded")
    counts, histogram = run_law_batch(llm, prompt_ids, names)
    assert spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens"] > before
    for name, total in [*((n, N_PER_SETTING) for n in SETTINGS),
                        ("t07_k20_p09/seeded", N_SEEDED)]:
        check_law(name, counts[name], histogram[name], exact_laws[name.partition("/")[0]], total)


# ---------------------------------------------------------------------------------------------
# seeded requests are reproducible whatever else runs


SEEDED_PROMPTS = [PROMPT, "import os\nimport sys\n\n\ndef main("]


def run_schedule(llm, tag: str, schedule: list[tuple]) -> list[list[int]]:
    """Add request i = ``(arrival_step, prompt, params)`` before engine step ``arrival_step``;
    step until all finish. Returns the generated token ids in schedule order."""
    engine = llm.llm_engine
    pending = sorted(range(len(schedule)), key=lambda i: schedule[i][0])
    done: dict[int, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and schedule[pending[0]][0] <= step:
            i = pending.pop(0)
            engine.add_request(f"{tag}-{i}", schedule[i][1], schedule[i][2])
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
        step += 1
        assert step < 5000
    return [done[i] for i in range(len(schedule))]


def seeded_outputs_in_three_contexts(llm, tag: str):
    """The seeded requests X (two prompts, seeds 11 and 12) run (1) in one batch with other
    traffic, all arriving together; (2) arriving at steps 2 and 5 while other requests are
    already decoding (their prefill shares a step with verification), more traffic arriving in
    between; (3) each alone. Returns the three lists of X's outputs and a control output (the
    first prompt with seed 13)."""
    seeded = [sampling_params(dict(temperature=0.8, top_k=50, top_p=0.95), seed=seed,
                              max_tokens=24, ignore_eos=True) for seed in (11, 12)]
    xs = list(zip(SEEDED_PROMPTS, seeded))
    t1 = sampling_params(SETTINGS["t1"], max_tokens=30, ignore_eos=True)
    t07 = sampling_params(SETTINGS["t07_k20_p09"], max_tokens=9, ignore_eos=True)
    greedy = sampling_params(dict(temperature=0.0), max_tokens=20, ignore_eos=True)
    other_seed = sampling_params(dict(temperature=1.0), seed=99, max_tokens=14, ignore_eos=True)
    control = sampling_params(dict(temperature=0.8, top_k=50, top_p=0.95), seed=13,
                              max_tokens=24, ignore_eos=True)
    traffic = [(PROMPTS[2], t1), (PROMPTS[3], greedy), (PROMPTS[4], t07), (PROMPTS[5], other_seed)]
    together = run_schedule(llm, f"{tag}-together",
                            [(0, p, sp) for p, sp in xs + traffic + [(PROMPT, control)]])
    staggered = run_schedule(llm, f"{tag}-staggered", [
        (0, *traffic[0]), (0, *traffic[1]), (2, *xs[0]), (4, *traffic[2]), (4, *traffic[3]),
        (5, *xs[1]), (7, PROMPTS[0], t1)])
    alone = [run_schedule(llm, f"{tag}-alone{i}", [(0, *x)])[0] for i, x in enumerate(xs)]
    return together[:2], [staggered[2], staggered[5]], alone, together[-1]


@pytest.mark.parametrize("mode", ["tree", "hsd_chain"])
def test_seeded_requests_reproducible(engines, mode):
    """Two requests with the same ``seed`` give the same tokens whatever else runs: in one batch
    with other traffic, arriving while other requests verify trees, and alone (ddtree on,
    budget 16 for "tree", 4 for "hsd_chain"). A different seed gives a different output (the
    requests are really random). Before commit ec582cc this failed: in "tree" mode a seeded
    request whose prefill shared a step with other requests' verification drew its first token
    with the walk's noise, [widest tree + 1, V] exponentials from its generator, instead of
    vLLM's sampler (one draw), so its later tokens depended on the batch; in "hsd_chain" mode
    HSD drew from the default generator, so even requests arriving together diverged."""
    llm = engines.get(mode)
    together, staggered, alone, control = seeded_outputs_in_three_contexts(llm, mode)
    assert together == alone, "same seed, other requests in the batch"
    assert staggered == alone, "same seed, arriving while other requests verify"
    assert control != together[0]


def test_joint_law_hsd_chain(engines, prompt_ids, exact_laws):
    """ddtree_mode "hsd_chain" (B=4 tokens sampled from the drafter, verified by HSD): N
    requests at temperature 1, 3 tokens each; the joint (t1, t2, t3) law fits the exact target
    law (p > 1e-4) and HSD accepted drafts in at least 5 % of the verify steps (and rejected
    every draft in at least 5 %)."""
    llm = engines.get("hsd_chain")
    before = spec_metrics(llm).get("vllm:spec_decode_num_accepted_tokens", 0)
    counts, histogram = run_law_batch(llm, prompt_ids, ["t1"] * N_PER_SETTING)
    assert spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens"] > before
    check_law("t1", counts["t1"], histogram["t1"], exact_laws["t1"], N_PER_SETTING)
    # request features: their batches verify the sampled chains with the walk (lossless for
    # any drafts; HSD would read the target law from the raw logits)
    name = "t1_features"
    counts, histogram = run_law_batch(llm, prompt_ids, [name] * N_PER_SETTING)
    check_law(name, counts[name], histogram[name], exact_laws[name], N_PER_SETTING)


def test_joint_law_tree_auto_budgets(engines, prompt_ids, exact_laws):
    """ddtree with ``ddtree_budget_policy: "auto"`` (maximum B=16): both settings interleaved
    in one batch, each request's tree sized per step by the policy (see Engines.AUTO_COST), so
    one step verifies trees of different sizes next to requests without drafts. The joint
    (t1, t2, t3) law of each setting fits the exact target law (p > 1e-4) and verification ran."""
    llm = engines.get("auto")
    before = spec_metrics(llm).get("vllm:spec_decode_num_accepted_tokens", 0)
    settings = ("t1", "t07_k20_p09")  # (request features: the tree and hsd_chain tests)
    counts, histogram = run_law_batch(llm, prompt_ids,
                                      [n for _ in range(N_PER_SETTING) for n in settings])
    assert spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens"] > before
    sizes = ddtree_state(llm).budgets.summary()["budget_histogram"]
    # mixed budgets: requests without drafts next to trees of several sizes
    assert sizes.get(0, 0) > 0 and len([n for n in sizes if n > 0]) >= 2, sizes
    for name in settings:
        check_law(name, counts[name], histogram[name], exact_laws[name], N_PER_SETTING)
