"""Checkers for code that must never wait for the GPU: host synchronisation and pageable copies.

:class:`NoHostSync` is a ``TorchDispatchMode`` that raises :class:`HostSyncError` on the aten
ops that force a device->host round trip (scalar reads, data-dependent shapes, copies to the
CPU from another device, except non-blocking copies into pinned memory). With ``scope`` it
only judges ops whose nearest Python caller outside torch lives in one of the ``scope`` files,
so that vLLM's own (by design) syncs around the plugin are not counted, and it adds the two
rules that matter on a CPU-only machine, where every tensor is a host tensor and a sync cannot
be observed directly:

- no value reads (``.tolist()``, ``.numpy()``, ``.item()``, ``int()``/``bool()`` of a tensor)
  in scoped code: on a GPU each one is a synchronisation (``allowed_reads``: functions that
  read host copies vLLM made for them, each with the reason);
- host data becomes a tensor only through ``allowed_uploads`` (the plugin's ``to_device``,
  which stages through pinned memory and copies asynchronously on CUDA): ``torch.tensor``,
  ``torch.as_tensor`` or ``torch.from_numpy`` anywhere else in scoped code would be a
  pageable host-to-device copy on a GPU, which waits for the stream.

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is armed as well (unscoped checks only:
vLLM's own step synchronises by design).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = {
    "aten::_local_scalar_dense",  # .item(), float(t), int(t), bool(t)
    "aten::item",  # the same under torch.inference_mode (vLLM's steps), not decomposed
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::unique_dim",
    "aten::_unique2",
    "aten::repeat_interleave.Tensor",  # without output_size its shape depends on data
}
TORCH_DIR = str(Path(torch.__file__).parent)
THIS_FILE = str(Path(__file__).resolve())


class HostSyncError(RuntimeError):
    pass


def _caller() -> tuple[str, str, int]:
    """(file, function, line) of the nearest frame outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(TORCH_DIR) and path != THIS_FILE and "<" not in path:
            return path, frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return "", "", 0


def _async_into_pinned(schema: str, args, kwargs) -> bool:
    """A non-blocking ``copy_`` into pinned host memory: queued on the stream, no wait (the
    host reads it later, after an event)."""
    if schema != "aten::copy_":
        return False
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return bool(non_blocking) and args[0].is_pinned()


class NoHostSync(TorchDispatchMode):
    def __init__(self, scope: tuple[str, ...] | None = None,
                 allowed_reads: dict[tuple[str, str], str] | None = None,
                 allowed_uploads: tuple[tuple[str, str], ...] = ()):
        """``scope``: file paths (suffixes) whose code is judged (None: every caller);
        ``allowed_reads`` / ``allowed_uploads``: ``(file suffix, function name)`` exceptions."""
        super().__init__()
        self.scope = scope
        self.allowed_reads = allowed_reads or {}
        self.allowed_uploads = allowed_uploads
        self.num_checked = 0  # aten ops called from scoped code (proves the checker saw it)

    def _judged(self, where) -> bool:
        return self.scope is None or where[0].endswith(self.scope)

    def _allowed(self, where, allowed) -> bool:
        return any(where[0].endswith(f) and where[1] == fn for f, fn in allowed)

    def _fail(self, what: str, where) -> None:
        raise HostSyncError(f"{what} at {where[0]}:{where[2]} in {where[1]}()")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = _caller()
        if self._judged(where):
            self.num_checked += 1
            self._check_op(func, args, kwargs, where)
        return func(*args, **kwargs)

    def _check_op(self, func, args, kwargs, where) -> None:
        schema = func._schema.name
        name = schema + (f".{func._overloadname}" if func._overloadname != "default" else "")
        if schema in SYNCING_OPS or name in SYNCING_OPS:
            if not (schema in ("aten::_local_scalar_dense", "aten::item")
                    and self._allowed(where, self.allowed_reads)):
                self._fail(f"host synchronisation through {name}", where)
        if schema in ("aten::index", "aten::index_put", "aten::index_put_"):
            if any(t is not None and t.dtype == torch.bool for t in args[1]):
                self._fail(f"boolean-mask indexing (data-dependent shape) through {name}", where)
        if schema in ("aten::_to_copy", "aten::copy_"):
            src = args[1] if schema == "aten::copy_" else args[0]
            dst_device = kwargs.get("device") if schema == "aten::_to_copy" else args[0].device
            if (src.device.type != "cpu" and dst_device is not None
                    and torch.device(dst_device).type == "cpu"
                    and not _async_into_pinned(schema, args, kwargs)):
                self._fail(f"device->host copy through {name}", where)

    @contextlib.contextmanager
    def python_hooks(self):
        """Value reads and host-data constructors, which do not all reach the dispatcher."""
        if self.scope is None:
            yield
            return
        saved = {}

        def guard(owner, attr, rule):
            original = getattr(owner, attr)
            saved[(owner, attr)] = original

            def hooked(*args, **kwargs):
                where = _caller()
                if self._judged(where):
                    rule(where, attr)
                return original(*args, **kwargs)

            setattr(owner, attr, hooked)

        def read(where, attr):
            if not self._allowed(where, self.allowed_reads):
                self._fail(f"tensor value read .{attr}() (a sync on a GPU)", where)

        def upload(where, attr):
            if not self._allowed(where, self.allowed_uploads):
                self._fail(f"torch.{attr}(host data) outside the pinned upload path (a "
                           "pageable host-to-device copy on a GPU)", where)

        for attr in ("tolist", "numpy", "item"):
            guard(torch.Tensor, attr, read)
        for attr in ("tensor", "as_tensor", "from_numpy"):
            guard(torch, attr, upload)
        try:
            yield
        finally:
            for (owner, attr), original in saved.items():
                setattr(owner, attr, original)


@contextlib.contextmanager
def no_host_sync(checker: NoHostSync | None = None):
    checker = checker or NoHostSync()
    cuda = torch.cuda.is_available() and checker.scope is None
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with checker.python_hooks(), checker:
            yield checker
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
