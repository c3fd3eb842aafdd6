"""The training corpus every machine has: the interpreter's standard library sources.

Files are the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``
excluded), sorted by relative path; every ``EVAL_EVERY``-th file (index % EVAL_EVERY == 0) is held
out whole for evaluation, so the split is deterministic and no held-out line is ever trained on.

Example: files [a.py, b.py, ..., z.py] with EVAL_EVERY = 10 -> eval [a.py, k.py, u.py], train the rest.

A chat-formatted prompt (:func:`chat_prompts`) wraps the opening lines of a held-out file as the
user message, so demo / benchmark prompts are in the target's domain.
"""

from __future__ import annotations

import os
import sysconfig

__all__ = ["stdlib_files", "read_split", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "EVAL_EVERY"]

EVAL_EVERY = 10
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted relative paths of the stdlib ``*.py`` files (no site-packages)."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in filenames:
            if name.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def read_split(split: str, max_bytes: int | None = None, root: str | None = None) -> list[str]:
    """Texts of the ``"train"`` or ``"eval"`` files, in sorted order, up to ``max_bytes`` in total."""
    if split not in ("train", "eval"):
        raise ValueError(f"{split=}, expected 'train' or 'eval'")
    root = root or sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    for i, rel in enumerate(stdlib_files(root)):
        if (i % EVAL_EVERY == 0) != (split == "eval"):
            continue
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        if not text.strip():
            continue
        texts.append(text)
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    return texts


def chat_prompts(tokenizer, num: int, num_lines: int = 6, max_chars: int = 400) -> list[list[int]]:
    """``num`` chat-formatted prompts (token ids) from the opening lines of held-out files."""
    prompts = []
    for text in read_split("eval"):
        lines = [ln for ln in text.splitlines() if ln.strip()][:num_lines]
        content = "\n".join(lines)[:max_chars]
        if len(content) < 40:
            continue
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        prompts.append(list(ids))
        if len(prompts) == num:
            break
    return prompts
