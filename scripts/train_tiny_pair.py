#!/usr/bin/env python
"""Train the tiny target + DFlash drafter pair committed under vllm_ddtree/assets/tiny_pair/.

Everything runs on the CPU from data every machine has (the interpreter's stdlib sources, see
``vllm_ddtree/hf/corpus.py``), step-based with a fixed seed:

1. tokenizer: byte-level BPE (``tokenizers``), vocab 4096, specials <|endoftext|>, <|im_start|>,
   <|im_end|>, <|mask|> (DFlash's mask_token_id), a simple chat template.
2. target: Qwen3ForCausalLM (hidden 192, 4 layers, 6 heads of head_dim 32, 2 KV heads, tied
   embeddings), next-token cross-entropy on 256-token windows. A quarter of the files are wrapped
   as a chat (user = the opening lines, assistant = the rest) so chat prompts stay in domain.
3. drafter: DFlash (1 layer, block_size 8, target_layer_ids [1, 2]) trained against the FROZEN
   target: for anchors a in a window, the block [x_a, mask x 7] at positions a..a+7 attends to the
   target features of positions < a; its position k output is trained (cross-entropy) onto
   the target's next-token ARGMAX at position a + k - 1 (``--drafter-loss hard``, the default: it makes
   q calibrated for greedy verification, which DDTree's tree relies on; ``soft`` distils the whole
   distribution and gave an under-confident drafter whose B=64 tree lost to the chain at T=0),
   weighted exp(-(k - 1) / 4).
   All anchors of a window run in one pass with a block-diagonal mask (DFlash's training recipe).

Usage::

    .venv/bin/python scripts/train_tiny_pair.py                       # the committed pair
    .venv/bin/python scripts/train_tiny_pair.py --target-steps 50 --drafter-steps 50 --out /tmp/pair
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from vllm_ddtree.hf.corpus import CHAT_TEMPLATE, SPECIAL_TOKENS, read_split  # noqa: E402
from vllm_ddtree.hf.drafter import DFlashDrafter, DrafterConfig, init_weights  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "vllm_ddtree", "assets", "tiny_pair")
SEQ_LEN = 256


def progress(prefix: str, step: int, total: int, t0: float, extra: str) -> None:
    width = 30
    done = int(width * step / total)
    rate = (time.time() - t0) / max(step, 1)
    eta = rate * (total - step)
    sys.stdout.write(f"\r{prefix} [{'#' * done}{'.' * (width - done)}] {step}/{total} {extra} eta {eta:5.0f}s ")
    sys.stdout.flush()
    if step == total:
        sys.stdout.write("\n")


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------
def chatify(text: str, num_lines: int = 6) -> str:
    """User = the first ``num_lines`` non-empty lines, assistant = the rest of the file."""
    lines = text.splitlines()
    kept, i = [], 0
    while i < len(lines) and len(kept) < num_lines:
        if lines[i].strip():
            kept.append(lines[i])
        i += 1
    rest = "\n".join(lines[i:])
    return (
        f"<|im_start|>user\n{chr(10).join(kept)}<|im_end|>\n<|im_start|>assistant\n{rest}<|im_end|>\n"
    )


def build_tokenizer(out_dir: str, vocab_size: int, train_texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|mask|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def encode_corpus(tokenizer, texts: list[str], chat_every: int) -> torch.Tensor:
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for i, text in enumerate(texts):
        body = chatify(text) if chat_every and i % chat_every == 0 else text
        ids.extend(tokenizer(body, add_special_tokens=False)["input_ids"])
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def windows(data: torch.Tensor, batch: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - SEQ_LEN - 1, (batch,), generator=gen)
    return torch.stack([data[s : s + SEQ_LEN] for s in starts.tolist()])


def eval_windows(data: torch.Tensor, num: int) -> torch.Tensor:
    """Deterministic, evenly spaced held-out windows."""
    stride = max((data.numel() - SEQ_LEN - 1) // num, 1)
    return torch.stack([data[i * stride : i * stride + SEQ_LEN] for i in range(num)])


# --------------------------------------------------------------------------------------------
# target
# --------------------------------------------------------------------------------------------
def target_config(tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        architectures=["Qwen3ForCausalLM"],
        torch_dtype="bfloat16",
    )


def lr_at(step: int, total: int, peak: float, warmup: int = 30) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1))) * 0.9 + peak * 0.1 * (
        1 - (step - warmup) / max(total - warmup, 1)
    )


def train_target(cfg, train_ids, eval_ids, steps: int, batch: int, seed: int):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.time()
    loss_avg = None
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, 3e-3)
        x = windows(train_ids, batch, gen)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        progress("target ", step + 1, steps, t0, f"loss {loss_avg:.3f}")
    model.eval()
    with torch.no_grad():
        x = eval_windows(eval_ids, 32)
        logits = model(input_ids=x).logits
        eval_loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item()
    return model, eval_loss, time.time() - t0


# --------------------------------------------------------------------------------------------
# drafter
# --------------------------------------------------------------------------------------------
def drafter_batch(target, drafter, x: torch.Tensor, num_anchors: int, gen: torch.Generator, loss_kind: str = "hard"):
    """One training pass: all anchors of every window in one block-diagonal forward.

    Returns (loss, top-1 agreement with the target at block position 1).
    """
    L = drafter.block_size - 1
    b, T = x.shape
    with torch.no_grad():
        out = target(input_ids=x, output_hidden_states=True)
        feats = drafter.context_features(out.hidden_states)  # [b, T, 2h]
        teacher = F.log_softmax(out.logits.float(), dim=-1)  # [b, T, V]: predicts x[:, t + 1]
    # anchors a in [1, T - L - 1]: the block needs a context and L teacher rows a .. a + L - 1
    anchors = torch.stack(
        [torch.randperm(T - L - 2, generator=gen)[:num_anchors] + 1 for _ in range(b)]
    ).sort(dim=1).values  # [b, A]
    A, S = num_anchors, drafter.block_size
    offs = torch.arange(S)
    block_pos = anchors[:, :, None] + offs  # [b, A, S]
    block_tok = torch.full((b, A, S), drafter.mask_token_id, dtype=torch.long)
    block_tok[:, :, 0] = x.gather(1, anchors)
    embed = target.get_input_embeddings()
    noise = embed(block_tok.view(b, A * S))  # [b, A*S, h]
    positions = torch.cat([torch.arange(T).expand(b, T), block_pos.view(b, A * S)], dim=1)
    # mask: query (j, s) sees context t < a_j and its own block
    ctx_vis = torch.arange(T)[None, None, :] < anchors[:, :, None]  # [b, A, T]
    ctx_vis = ctx_vis[:, :, None, :].expand(b, A, S, T).reshape(b, A * S, T)
    blk = torch.arange(A).repeat_interleave(S)
    blk_vis = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    mask = torch.cat([ctx_vis, blk_vis], dim=2)[:, None]  # [b, 1, A*S, T + A*S]
    hidden = drafter(feats, noise, positions, attention_mask=mask)
    hidden = hidden.view(b, A, S, -1)[:, :, 1:]  # [b, A, L, h]
    logits = target.lm_head(hidden).float()  # shared head (frozen)
    rows = (anchors[:, :, None] + torch.arange(L)).view(b, A * L)  # teacher row a + k - 1
    p_log = teacher.gather(1, rows[:, :, None].expand(-1, -1, teacher.shape[-1])).view(b, A, L, -1)
    q_log = F.log_softmax(logits, dim=-1)
    if loss_kind == "hard":  # cross-entropy on the target's argmax (what T=0 verification accepts)
        ce = -q_log.gather(-1, p_log.argmax(-1, keepdim=True)).squeeze(-1)  # [b, A, L]
    else:  # soft: cross-entropy against the target's whole next-token distribution
        ce = -(p_log.exp() * q_log).sum(-1)  # [b, A, L]
    weight = torch.exp(-torch.arange(L, dtype=torch.float32) / 4.0)
    loss = (ce * weight).sum(-1).mean() / weight.sum()
    agree = (q_log.argmax(-1) == p_log.argmax(-1)).float().mean(dim=(0, 1))  # [L]
    return loss, agree


def train_drafter(target, dcfg, train_ids, eval_ids, steps, batch, anchors, seed, loss_kind):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dcfg)
    init_weights(drafter, 0.02, torch.Generator().manual_seed(seed))
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    t0 = time.time()
    loss_avg = None
    drafter.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, 2e-3)
        x = windows(train_ids, batch, gen)
        loss, agree = drafter_batch(target, drafter, x, anchors, gen, loss_kind)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        progress("drafter", step + 1, steps, t0, f"loss {loss_avg:.3f} top1@1 {agree[0]:.2f}")
    drafter.eval()
    with torch.no_grad():
        loss, agree = drafter_batch(target, drafter, eval_windows(eval_ids, 16), anchors,
                                    torch.Generator().manual_seed(0), loss_kind)
    return drafter, loss.item(), agree.tolist(), time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--target-steps", type=int, default=240)
    ap.add_argument("--target-batch", type=int, default=16)
    ap.add_argument("--drafter-steps", type=int, default=300)
    ap.add_argument("--drafter-loss", choices=["hard", "soft"], default="hard",
                    help="hard: CE on the target's argmax (calibrated for T=0 trees); soft: CE on its distribution")
    ap.add_argument("--drafter-only", action="store_true",
                    help="reuse the tokenizer and target already in --out, train only the drafter")
    ap.add_argument("--drafter-batch", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=16, help="blocks per 256-token window")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-eval", action="store_true", help="skip the acceptance (tau) report")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    t_start = time.time()
    tgt_dir, drf_dir = os.path.join(args.out, "target"), os.path.join(args.out, "drafter")
    os.makedirs(tgt_dir, exist_ok=True)

    train_texts, eval_texts = read_split("train"), read_split("eval")
    if args.drafter_only:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tgt_dir)
    else:
        tokenizer = build_tokenizer(tgt_dir, args.vocab_size, train_texts[::4])
    train_ids = encode_corpus(tokenizer, train_texts, chat_every=4)
    eval_ids = encode_corpus(tokenizer, eval_texts, chat_every=4)
    print(f"tokenizer: vocab {len(tokenizer)}, train {train_ids.numel()} tokens, eval {eval_ids.numel()} "
          f"tokens ({time.time() - t_start:.0f}s)")

    cfg = target_config(tokenizer)
    if args.drafter_only:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(tgt_dir, dtype=torch.float32, attn_implementation="sdpa")
        previous = json.load(open(os.path.join(args.out, "train_report.json")))
        target_eval_loss, t_target = previous["target_heldout_loss"], previous["train_seconds"]["target"]
    else:
        target, target_eval_loss, t_target = train_target(
            cfg, train_ids, eval_ids, args.target_steps, args.target_batch, args.seed
        )
        target.save_pretrained(tgt_dir, safe_serialization=True)
        # store bf16 weights (the committed pair must stay small); loaders upcast with dtype=float32
        from safetensors.torch import load_file, save_file

        path = os.path.join(tgt_dir, "model.safetensors")
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(path).items()}, path,
                  metadata={"format": "pt"})
    print(f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M params, held-out loss "
          f"{target_eval_loss:.3f} ({t_target:.0f}s)")

    target = target.to(torch.bfloat16).float()  # train the drafter against the weights we ship
    L = args.block_size - 1
    dcfg = DrafterConfig(
        hidden_size=cfg.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        num_target_layers=cfg.num_hidden_layers,
        block_size=args.block_size,
        mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"),
        target_layer_ids=[1, 2],
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=10000.0,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    drafter, drafter_eval_loss, agree, t_drafter = train_drafter(
        target, dcfg, train_ids, eval_ids, args.drafter_steps, args.drafter_batch, args.anchors, args.seed,
        args.drafter_loss,
    )
    drafter.save_pretrained(drf_dir, dtype=torch.bfloat16)
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params, held-out CE "
          f"{drafter_eval_loss:.3f}, top-1 agreement by depth {[round(a, 2) for a in agree]} ({t_drafter:.0f}s)")

    report = {
        "seed": args.seed,
        "args": vars(args) | {"out": None},
        "target_heldout_loss": target_eval_loss,
        "drafter_heldout_ce": drafter_eval_loss,
        "drafter_top1_agreement_by_depth": agree,
        "train_seconds": {"target": t_target, "drafter": t_drafter},
    }
    if not args.skip_eval:
        from vllm_ddtree.hf.evaluate import acceptance_report

        report["acceptance"] = acceptance_report(tgt_dir, drf_dir, num_prompts=8, max_new_tokens=64)
        print("acceptance (held-out prompts, T=0):", json.dumps(report["acceptance"]))
    report["total_seconds"] = time.time() - t_start
    with open(os.path.join(args.out, "train_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(f"done in {report['total_seconds']:.0f}s -> {args.out}")


if __name__ == "__main__":
    main()
