"""A valid wheel file written from a dict of files, for tests of the offline bundles."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def make_wheel(directory: Path, name: str, version: str, files: dict, requires=(), tag: str = "py3-none-any") -> Path:
    """A valid wheel ``name-version-TAG.whl`` holding ``files`` (path -> str|bytes), with its
    METADATA (``requires`` as Requires-Dist), WHEEL and RECORD (sha256 of every file)."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    purelib = "true" if tag == "py3-none-any" else "false"
    entries = {**files, f"{info}/METADATA": metadata,
               f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: {purelib}\nTag: {tag}\n"}
    record = []
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for member, content in entries.items():
            data = content.encode() if isinstance(content, str) else content
            archive.writestr(member, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{member},sha256={digest},{len(data)}")
        archive.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return path
