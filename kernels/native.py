"""The fused CPU kernels (``csrc/ddtree_cpu.cpp``): one op per verify-step stage on the CPU.

The torch path of each stage runs tens of small ops (tree build ~45, walk ~14, finish verify
~12, compaction 4 per layer), each a fixed cost of a few microseconds on the CPU; the fused op
does the same work in one call. The ops are built with ``torch.utils.cpp_extension`` the
first time a process needs them (~40 s with g++; cached in torch's extensions folder, so
later processes load them in milliseconds; ``scripts/setup_venv.sh`` builds them once) and
registered as ``torch.ops.ddtree.*``.

:func:`cpu_ops` returns the op namespace for CPU tensors, or None when the torch path must
run: on other devices (CUDA runs the torch path or the Triton kernels), when
``VLLM_DDTREE_NATIVE=0`` (tests and benchmarks compare both paths), or when the build
failed (no C++ compiler: a warning says so once, and the torch path serves: same outputs,
more ops per step).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

__all__ = ["cpu_ops", "enabled"]

logger = logging.getLogger("vllm.ddtree")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "ddtree_cpu.cpp")
_lock = threading.Lock()
_state: dict = {}  # "ops": the namespace once loaded, "error": the build failure


_OFF = frozenset(("0", "false", "False"))  # the values of VLLM_DDTREE_NATIVE that disable
# os.environ's own store, read without its mapping layer: ``os.environ.get`` of an unset
# variable raises and catches a KeyError, ~5 us inside an engine step, and a verify step asks
# ~9 times (tests switch the variable between calls, so it is read every time, not cached)
_ENV = getattr(os.environ, "_data", None)
_KEY = os.environ.encodekey("VLLM_DDTREE_NATIVE") if _ENV is not None else None
_OFF_STORED = frozenset(os.environ.encodevalue(v) for v in _OFF) if _ENV is not None else _OFF


def enabled() -> bool:
    """False when ``VLLM_DDTREE_NATIVE=0``: every stage takes its torch path (on the CPU, and on
    CUDA instead of the Triton stages of ``verify_steps``)."""
    if _ENV is None:  # not CPython's os._Environ
        return os.environ.get("VLLM_DDTREE_NATIVE", "1") not in _OFF
    return _ENV.get(_KEY) not in _OFF_STORED


def _load():
    with _lock:
        if "ops" in _state or "error" in _state:
            return _state.get("ops")
        try:
            from torch.utils.cpp_extension import load

            logger.info("ddtree: loading the fused CPU kernels (the first build takes ~40 s)")
            # -fopenmp: ATen's parallel_for is an OpenMP pragma compiled into the op (without
            # it the op ran on one thread); no -lgomp: the calls bind to the OpenMP runtime
            # torch itself loads, so the process keeps one thread pool. A compiler without
            # OpenMP (Apple's clang) builds them single-threaded rather than not at all.
            try:
                load(name="vllm_ddtree_cpu", sources=[SOURCE], extra_cflags=["-O3", "-fopenmp"],
                     is_python_module=False, verbose=False)
            except Exception as exc:
                logger.warning("ddtree: building the fused CPU kernels with OpenMP failed (%s); "
                               "building them without (each op on one thread)", exc)
                load(name="vllm_ddtree_cpu", sources=[SOURCE], extra_cflags=["-O3"],
                     is_python_module=False, verbose=False)
            _state["ops"] = torch.ops.ddtree
        except Exception as exc:  # no compiler, no headers: the torch path serves
            _state["error"] = exc
            logger.warning("ddtree: the fused CPU kernels could not be built (%s); the torch "
                           "path runs instead (same outputs, more ops per step). Install a "
                           "C++ compiler (g++) to get them.", exc)
        return _state.get("ops")


def cpu_ops(device: torch.device | str):
    """``torch.ops.ddtree`` for tensors on ``device`` when it is the CPU and the fused kernels
    are enabled and built (building them on first use); else None.

    Called by several stages of every verify step, so a ``torch.device`` is read, not rebuilt:
    inside an engine step a call took ~12 us, half of it ``torch.device(device)``.
    """
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind != "cpu" or not enabled():
        return None
    ops = _state.get("ops")
    return ops if ops is not None else _load()
