"""The committed tiny pair: size, formats, tokenizer, and the drafter's link to the target."""

import json
import os

import torch

PAIR = os.path.join(os.path.dirname(__file__), "..", "vllm_ddtree", "assets", "tiny_pair")


def test_pair_is_small_and_in_the_expected_formats():
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(PAIR) for f in fs)
    assert total <= 10 * 2**20, f"tiny pair is {total / 2**20:.1f} MiB, budget 10 MiB"
    tcfg = json.load(open(f"{PAIR}/target/config.json"))
    dcfg = json.load(open(f"{PAIR}/drafter/config.json"))
    assert tcfg["architectures"] == ["Qwen3ForCausalLM"] and tcfg["head_dim"] in (32, 64, 80, 96, 112, 128)
    assert dcfg["architectures"] == ["DFlashDraftModel"] and dcfg["model_type"] == "qwen3"
    assert dcfg["num_target_layers"] == tcfg["num_hidden_layers"]
    assert dcfg["hidden_size"] == tcfg["hidden_size"] and dcfg["vocab_size"] == tcfg["vocab_size"]
    assert max(dcfg["dflash_config"]["target_layer_ids"]) < tcfg["num_hidden_layers"] - 1  # vLLM aux layers
    assert dcfg["block_size"] in (8, 16)


def test_tokenizer_loads_offline_with_chat_template_and_mask_token():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(f"{PAIR}/target")
    dcfg = json.load(open(f"{PAIR}/drafter/config.json"))
    assert tok.convert_tokens_to_ids("<|mask|>") == dcfg["dflash_config"]["mask_token_id"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template([{"role": "user", "content": "def f(x):"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\ndef f(x):<|im_end|>\n<|im_start|>assistant\n"
    code = "def f(x):\n    return x  # é ✓\n"
    assert tok.decode(tok(code)["input_ids"]) == code  # byte-level: lossless round trip


def test_target_predicts_held_out_code_better_than_uniform():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_ddtree.hf.corpus import read_split

    tok = AutoTokenizer.from_pretrained(f"{PAIR}/target")
    model = AutoModelForCausalLM.from_pretrained(f"{PAIR}/target", dtype=torch.float32).eval()
    ids = torch.tensor([tok(read_split("eval")[3])["input_ids"][:256]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 0.75 * torch.log(torch.tensor(float(len(tok)))).item(), loss  # uniform: log 4096 = 8.3


def test_ddtree_b64_beats_the_chain_by_1_3x_at_t0():
    """The pair's reason to exist: at T=0 on held-out prompts DDTree (B=64) accepts >= 1.3x the
    chain's tokens per step (benchmarks/acceptance.py measures 1.55x on 8 prompts)."""
    from vllm_ddtree.hf.evaluate import heldout_prompts, load_pair, measure_tau

    target, drafter, tok = load_pair(f"{PAIR}/target", f"{PAIR}/drafter")
    prompts = heldout_prompts(tok, 4)
    chain = measure_tau(target, drafter, prompts, "chain", max_new_tokens=48)["tau"]
    tree = measure_tau(target, drafter, prompts, "ddtree", budget=64, max_new_tokens=48)["tau"]
    assert tree >= 1.3 * chain, (tree, chain)
