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
