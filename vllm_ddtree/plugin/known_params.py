"""Every ``SamplingParams`` field of the vLLM versions this plugin supports, and how ddtree
serves it; the fallback for a field it does not know.

A request may set only fields this table names (vLLM 0.32.0 and 0.33.0 have the same 42;
``tests/test_vllm_versions.py`` holds the table against both wheels' sources). A later vLLM of a supported
series (a patch release) may add a field that changes what a request's tokens are, which the
tree sampler would not apply. A request that sets such a field (a value other than the
field's default) is served with no drafts (budget 0): while it is scheduled, the scheduler
schedules no drafts for any request (``patches._wrap_schedule``), so every row of those steps
goes through vLLM's own sampler, exactly as in plain decoding, whatever the field does; the
log names the field once. Drafting resumes when the request finishes.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.ddtree")

# field -> how ddtree serves it (README "Request features" and docs/serving.md say the same)
KNOWN: dict[str, str] = {
    # the row's law, the same for every row of a request (plugin/sampler.py)
    "temperature": "per row",
    "top_p": "per row",
    "top_k": "per row",
    "min_p": "per row, after the temperature (features.py)",
    "seed": "per row, noise keyed by position (sampler.sample_seeded)",
    "logit_bias": "per row (features.py)",
    "allowed_token_ids": "per row (features.py)",
    # the row's law depends on the path (features.py, grammar.py)
    "presence_penalty": "counts the path's tokens",
    "frequency_penalty": "counts the path's tokens",
    "repetition_penalty": "counts the path's tokens",
    "min_tokens": "masks stop tokens by the node's depth",
    "bad_words": "bans by the path's suffix",
    "_bad_words_token_ids": "bans by the path's suffix",
    "thinking_token_budget": "counts the path's tokens",
    "structured_outputs": "grammar state per node (grammar.py)",
    # what is returned for the emitted tokens (sampler.py)
    "logprobs": "of the emitted rows",
    "logprob_token_ids": "of the emitted rows",
    "flat_logprobs": "output format",
    # the prompt (prefill: no drafts)
    "prompt_logprobs": "prefill",
    "prompt_logprob_token_ids": "prefill (vLLM: V2 runner only, refused on V1)",
    "prompt_logprob_start": "prefill",
    "skip_reading_prefix_cache": "prefix cache",
    "routed_experts_prompt_start": "prompt-side capture of a MoE's routed experts",
    # the scheduler and the output processor, on the emitted tokens (a chain, as vLLM's)
    "n": "parallel samples: separate requests",
    "stop": "output processor",
    "stop_token_ids": "scheduler, per emitted token",
    "_all_stop_token_ids": "scheduler, per emitted token",
    "_eos_token_id": "scheduler, per emitted token",
    "ignore_eos": "scheduler, per emitted token",
    "max_tokens": "scheduler; drafts cut to what can still be emitted (state.clip_drafts)",
    "repetition_detection": "scheduler, per emitted token",
    "include_stop_str_in_output": "output processor",
    "detokenize": "output processor",
    "skip_special_tokens": "output processor",
    "spaces_between_special_tokens": "output processor",
    "output_kind": "output processor",
    "stream_interval": "output processor",
    "output_text_buffer_length": "output processor",
    "skip_clone": "front end",
    # vLLM refuses these with a DFlash-style drafter, at start or per request
    "watermarking": "vLLM: autoregressive drafters only (refused at engine start)",
    "_watermarking_skipped": "vLLM's bookkeeping of the above",
    "trace_decode_token_ids": "vLLM: needs --enable-trace-replay, a V2-runner feature",
    "extra_args": "custom logits processors are refused under speculative decoding; "
                  "vLLM's own keys (KV transfer) do not touch sampling",
}

# fields that change the target's law beyond the row's temperature, top-k, top-p and min-p:
# a request that sets one says less about the drafter than a plain one (reshapes_target)
RESHAPING = ("logit_bias", "allowed_token_ids", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "min_tokens", "bad_words", "_bad_words_token_ids",
             "thinking_token_budget", "structured_outputs")

_defaults: dict[str, object] = {}
_logged: set[str] = set()


def _default(params, name: str):
    if not _defaults:
        fresh = type(params)()
        _defaults.update({field: getattr(fresh, field) for field in fresh.__struct_fields__})
    return _defaults.get(name)


def _is_default(value, default) -> bool:
    try:
        return bool(value == default)
    except Exception:  # an array, or a type whose == is not a truth value: treat it as set
        return value is default


def unknown_fields(params) -> list[str]:
    """The fields ``params`` sets (not at their default) that :data:`KNOWN` does not name."""
    if params is None:
        return []
    return [name for name in getattr(params, "__struct_fields__", ())
            if name not in KNOWN and not _is_default(getattr(params, name),
                                                      _default(params, name))]


def reshapes_target(params) -> bool:
    """Whether ``params`` sets a :data:`RESHAPING` field: penalties, banned or allowed tokens, a
    grammar... turn the target away from what the drafter predicts, each in its own way, so
    the trees' calibration (``vllm_ddtree/calibration.py``) leaves such a request out: it
    does not learn from its steps (they would reshape every other request's trees) and its
    trees are DDTree's (what the plain requests taught need not hold for it). An empty value
    sets nothing: vLLM's OpenAI server sends ``bad_words=[]`` with every request."""
    if params is None:
        return False
    for name in RESHAPING:
        value = getattr(params, name, None)
        empty = value is None or (isinstance(value, (list, tuple, dict, set)) and not value)
        if not empty and not _is_default(value, _default(params, name)):
            return True
    return False


def reshaping(requests: dict, req_ids) -> list[bool]:
    """:func:`reshapes_target` of each of ``req_ids`` (V1's runner requests), remembered on the
    request."""
    flags = []
    for req_id in req_ids:
        request = requests[req_id]
        flag = request.__dict__.get("_ddtree_reshapes")
        if flag is None:
            flag = request._ddtree_reshapes = reshapes_target(request.sampling_params)
        flags.append(flag)
    return flags


def untreeable(request) -> bool:
    """Whether a scheduler request must be served with no drafts (see the module docstring);
    remembered on the request, logged once per field."""
    verdict = request.__dict__.get("_ddtree_untreeable")
    if verdict is None:
        fields = unknown_fields(getattr(request, "sampling_params", None))
        verdict = request._ddtree_untreeable = bool(fields)
        new = [name for name in fields if name not in _logged]
        if new:
            _logged.update(new)
            logger.warning(
                "ddtree: request %s sets the sampling parameter(s) %s, which this version of "
                "vllm-ddtree does not know; while such a request runs, every request decodes "
                "without drafts (vLLM's own sampler, exact). Upgrade vllm-ddtree for a version "
                "that serves them with trees.", request.request_id, ", ".join(new))
    return verdict
