"""Python sources of a vLLM release that is not installed, read from its wheel on PyPI.

A wheel is a zip archive and PyPI serves byte ranges, so reading one module costs a few HTTP
range requests (the archive's directory, then that member), not the 330 MB download. Files
are checked against the wheel's own ``RECORD`` (sha256 per file), and the ``RECORD`` against
the digest pinned here, then cached under ``$VLLM_DDTREE_CACHE`` (default
``~/.cache/vllm-ddtree``): a second run needs no network.

    sources = WheelSources("0.33.0")
    text = sources.read("vllm/v1/core/sched/scheduler.py")
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import urllib.request
import zipfile
from pathlib import Path

# The CUDA wheel of each release (x86_64: the Python sources are the same on every platform),
# and the sha256 of its RECORD, which holds the sha256 of every other file.
WHEELS = {
    "0.32.0": (
        "https://files.pythonhosted.org/packages/a5/0d/"
        "0b15fda9a56ac485ebb607e466f0e3386c8c115bafeced6514298bd325b5/"
        "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "7de1ca9fab186868f4794671b450d274a40739fd887f7e5a52bc5ca76aab0f85",
    ),
    "0.33.0": (
        "https://files.pythonhosted.org/packages/8b/a8/"
        "92e278093df40fde4c4bfd6572704bb8f398d6a2280d8c82cb5efaf12047/"
        "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "a860951d44545b1b68c2d1484b9a03bbde52f6eae34850a6c22741c60ac386c4",
    ),
}


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file through HTTP range requests."""

    def __init__(self, url: str, block: int = 1 << 18):
        self.url, self.block, self.pos = url, block, 0
        request = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(request, timeout=60) as response:
            self.size = int(response.headers["Content-Length"])
        self._blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.size}[whence] + offset
        return self.pos

    def _fetch(self, start: int, end: int) -> bytes:
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end - 1}"})
        with urllib.request.urlopen(request, timeout=120) as response:
            if response.status != 206:
                raise OSError(f"{self.url}: the server ignored the byte range (HTTP {response.status})")
            return response.read()

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        first, last = self.pos // self.block, (end - 1) // self.block
        missing = [i for i in range(first, last + 1) if i not in self._blocks]
        if missing:  # one request for the whole missing run
            lo, hi = missing[0] * self.block, min(self.size, (missing[-1] + 1) * self.block)
            data = self._fetch(lo, hi)
            for i in range(missing[0], missing[-1] + 1):
                self._blocks[i] = data[(i - missing[0]) * self.block:][: self.block]
        data = b"".join(self._blocks[i] for i in range(first, last + 1))
        out = data[self.pos - first * self.block:][: end - self.pos]
        self.pos = end
        return out


def _sha256_b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


class WheelSources:
    """Files of the vLLM ``version`` wheel, fetched once and cached, checked against RECORD."""

    def __init__(self, version: str):
        if version not in WHEELS:
            raise KeyError(f"no wheel known for vLLM {version}; known: {sorted(WHEELS)}")
        self.version = version
        self.url, self.record_sha256 = WHEELS[version]
        root = Path(os.environ.get("VLLM_DDTREE_CACHE", Path.home() / ".cache" / "vllm-ddtree"))
        self.cache = root / f"vllm-{version}"
        self._zip: zipfile.ZipFile | None = None
        self._record: dict[str, str] | None = None

    def _archive(self) -> zipfile.ZipFile:
        if self._zip is None:
            self._zip = zipfile.ZipFile(_RangeFile(self.url))
        return self._zip

    def _cached(self, name: str) -> bytes:
        path = self.cache / name
        if path.exists():
            return path.read_bytes()
        data = self._archive().read(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".part")
        tmp.write_bytes(data)
        tmp.replace(path)
        return data

    def record(self) -> dict[str, str]:
        """``{path: sha256 (urlsafe base64)}`` from the wheel's RECORD, itself checked."""
        if self._record is None:
            name = f"vllm-{self.version}.dist-info/RECORD"
            data = self._cached(name)
            digest = hashlib.sha256(data).hexdigest()
            if digest != self.record_sha256:
                (self.cache / name).unlink()
                raise ValueError(f"{name}: sha256 {digest}, expected {self.record_sha256}")
            rows = csv.reader(io.StringIO(data.decode()))
            self._record = {row[0]: row[1].removeprefix("sha256=") for row in rows if row[1]}
        return self._record

    def read(self, name: str) -> str:
        """The text of ``name`` (a path inside the wheel, e.g. ``vllm/config/vllm.py``)."""
        expected = self.record().get(name)
        if expected is None:
            raise FileNotFoundError(f"vLLM {self.version} has no {name}")
        data = self._cached(name)
        if _sha256_b64(data) != expected:
            (self.cache / name).unlink()
            raise ValueError(f"{name} of vLLM {self.version} does not match its RECORD")
        return data.decode()
