"""Run this project's Triton kernels in Triton's interpreter when there is no GPU."""

import contextlib
import os


@contextlib.contextmanager
def interpreter_on_cpu(device: str):
    """Set TRITON_INTERPRET=1 for the duration on the CPU (no-op with CUDA).

    Use it in a module-scoped autouse fixture: the launchers import their @triton.jit modules
    on first call, which then happens with the variable set, so the kernels are interpreted;
    other test files keep their environment (vLLM must not see TRITON_INTERPRET=1).
    """
    if device == "cuda":
        yield
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def compile_key(kernel, args, kwargs) -> tuple:
    """What decides whether a launch of ``kernel`` reuses a compiled binary or compiles anew,
    following Triton's specialisation rules: the value of every ``tl.constexpr`` argument, the
    dtype and 16-byte alignment of every tensor (unless listed in
    ``do_not_specialize_on_alignment``), and for every other integer (unless listed in
    ``do_not_specialize``) whether it equals 1 and whether it is divisible by 16; plus the
    launch options. Works on JIT and interpreted kernels alike (no GPU needed).
    """
    import inspect

    import torch
    import triton.language as tl

    fn = kernel.fn
    def listed(name):
        return set(getattr(kernel, name, None) or getattr(kernel, "kwargs", {}).get(name) or ())

    skip, skip_alignment = listed("do_not_specialize"), listed("do_not_specialize_on_alignment")
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip((p.name for p in params), args))
    bound.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
    key = []
    for p in params:
        value = bound[p.name]
        if p.annotation is tl.constexpr or p.annotation == "tl.constexpr":
            key.append((p.name, repr(value)))
        elif isinstance(value, torch.Tensor):
            aligned = None if p.name in skip_alignment else value.data_ptr() % 16 == 0
            key.append((p.name, value.dtype, aligned))
        elif isinstance(value, bool) or not isinstance(value, int):
            key.append((p.name, type(value).__name__))
        elif p.name in skip:
            key.append((p.name, "int"))
        else:
            key.append((p.name, value == 1, value % 16 == 0, -2**31 <= value < 2**31))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in bound))
    return tuple(key) + options


class LaunchRecorder:
    """Stands in for a kernel module's @triton.jit function: records the compile key of each
    launch (:func:`compile_key`), then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.keys: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.append(compile_key(self.kernel, args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch
