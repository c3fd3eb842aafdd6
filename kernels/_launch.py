"""Small helpers shared by the launchers: can Triton run here, and input checks with messages."""

from __future__ import annotations

import os

import torch


def interpreter_active() -> bool:
    """True when ``TRITON_INTERPRET=1``: @triton.jit kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_launchable(name: str, tensor: torch.Tensor, fallback: str) -> None:
    """Raise early, with the fix, when a kernel cannot run on ``tensor``'s device."""
    if tensor.is_cuda or interpreter_active():
        return
    raise ValueError(
        f"{name} is on {tensor.device}: the Triton kernel needs a CUDA tensor, or "
        f"TRITON_INTERPRET=1 set before triton is imported (slow, for tests). "
        f"On the CPU use {fallback} instead."
    )


def check_shape(name: str, tensor: torch.Tensor, expected: tuple) -> None:
    """``expected`` holds ints, or None for "any size"."""
    shape = tuple(tensor.shape)
    ok = len(shape) == len(expected) and all(e is None or s == e for s, e in zip(shape, expected))
    if not ok:
        want = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{name}.shape={shape}, expected {want}")


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        raise ValueError(f"{name}.dtype={tensor.dtype}, expected one of {allowed}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
