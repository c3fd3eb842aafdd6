"""scripts/offline_bundle.py: the offline (air-gapped) bundle, on the CPU, with no network.

Tiny wheels are written here as valid wheel zips; the only stand-ins are the resolver's report and
the download (``pack`` takes them as arguments); pip runs for real with ``--no-index``.

1. Targets: manylinux tag families; the FREEZE file format.
2. The plan, on hand-written resolution reports: markers of the *target* followed (extras too),
   FREEZE exact matches left out, other versions carried, exclusions with what only they need,
   FREEZE pins (version-range rule) and the two-pass resolution with its fallback.
3. Parts: the split layout of the docstring example exactly; the round trip pack -> copy part
   folders one by one -> unpack -> import in a subprocess (a wheel chunked over 3+ parts, a .pth
   path entry); a corrupted, a truncated and a missing part named in the error; mixed packs and
   the wrong interpreter refused.
4. ``pack`` end to end with the network steps replaced; the real pip resolver and downloader on a
   local wheel folder (``--no-index``) with a marker that only the target satisfies.
"""

import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Before pip (offline_bundle imports pip's vendored packaging): importing pip first switches this
# process to the stdlib's distutils (setuptools' _distutils_hack), and a later `import setuptools`
# (vLLM's configs, through torch.utils.cpp_extension) then fails its assertion.
import setuptools  # noqa: E402, F401

from wheel_utils import make_wheel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "scripts" / "offline_bundle.py")
ob = importlib.util.module_from_spec(_spec)
sys.modules["offline_bundle"] = ob  # dataclasses look their module up
_spec.loader.exec_module(ob)

HOST_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
PLATFORM = "manylinux_2_28_x86_64"
ENV_312 = ob.Target("3.12", (PLATFORM,)).marker_environment
KIB = 1024


def item(name: str, version: str, requires=(), path: Path | None = None) -> dict:
    """One ``install`` entry of pip's report; sha256 of ``path`` when given."""
    filename = path.name if path else f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    sha = hashlib.sha256(path.read_bytes()).hexdigest() if path else hashlib.sha256(filename.encode()).hexdigest()
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)},
            "download_info": {"url": f"https://files.example/packages/{filename}",
                              "archive_info": {"hashes": {"sha256": sha}}},
            "is_direct": False, "requested": False}


def report(*items, environment=ENV_312) -> dict:
    return {"version": "1", "pip_version": "26.3", "install": list(items), "environment": environment}


# ------------------------------------------------------------------------------------------------
# 1. Targets
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tag, expected_len, first, last, present, absent", [
    # 24 glibc minors (28..5) + manylinux2014/2010/1
    ("manylinux_2_28_x86_64", 27, "manylinux_2_28_x86_64", "manylinux1_x86_64",
     ["manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64"],
     ["manylinux_2_29_x86_64", "linux_x86_64"]),
    ("manylinux2014_aarch64", 16, "manylinux_2_17_aarch64", "manylinux1_aarch64",
     ["manylinux2014_aarch64", "manylinux_2_12_aarch64"], ["manylinux_2_18_aarch64", "manylinux_2_17_x86_64"]),
    ("linux_x86_64", 1, "linux_x86_64", "linux_x86_64", [], ["manylinux1_x86_64"]),
])
def test_platform_family(tag, expected_len, first, last, present, absent):
    family = ob.platform_family(tag)
    assert (len(family), family[0], family[-1]) == (expected_len, first, last)
    assert len(set(family)) == len(family)
    assert all(t in family for t in present) and not any(t in family for t in absent)


def test_target_marker_environment_and_pip_args():
    target = ob.Target("3.12.3", ("manylinux_2_39_x86_64",))
    env = target.marker_environment
    assert (env["python_version"], env["python_full_version"], env["platform_machine"]) == ("3.12", "3.12.3", "x86_64")
    args = target.pip_args()
    assert args[:5] == ["--only-binary=:all:", "--implementation", "cp", "--python-version", "3.12"]
    assert args[5:7] == ["--platform", "manylinux_2_39_x86_64"] and args.count("--platform") == 35 + 3


def test_read_freeze(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# comment\nFoo_Bar==1.0\ntorch==2.11.0+cu130\n-e git+https://x/y#egg=z\n"
                      "baz @ file:///tmp/baz.whl\nqux===2.0.dev1\n\nPyYAML==6.0.3  # inline\n")
    assert ob.read_freeze(freeze) == {"foo-bar": "1.0", "torch": "2.11.0+cu130", "qux": "2.0.dev1",
                                      "pyyaml": "6.0.3"}


# ------------------------------------------------------------------------------------------------
# 2. The plan
# ------------------------------------------------------------------------------------------------

MARKER_REPORT = report(
    item("app", "1.0", ["lib[x]", 'six; python_version > "3.11"', 'old; python_version < "3"']),
    item("lib", "2.0", ['dep; extra == "x"', 'other; extra == "y"']),
    item("dep", "0.1"), item("six", "1.17.0"))


def test_walk_closure_follows_target_markers_and_extras():
    items = ob.report_wheels(MARKER_REPORT)
    extras_of, requirements_on = ob.walk_closure(items, [ob.Requirement("app")], ENV_312)
    assert extras_of == {"app": set(), "lib": {"x"}, "dep": set(), "six": set()}
    assert [(by, str(req)) for by, req in requirements_on["lib"]] == [("app", "lib[x]")]
    env_311 = ob.Target("3.11", (PLATFORM,)).marker_environment
    extras_of, _ = ob.walk_closure(items, [ob.Requirement("app")], env_311, skip=frozenset({"six"}))
    assert "six" not in extras_of
    # a report holding a package the target's markers do not need was made for another environment
    with pytest.raises(ob.BundleError, match=r"\['six'\]"):
        ob.plan_bundle(MARKER_REPORT, ["app"], {}, {}, env_311)


def test_walk_closure_missing_requirement_is_an_error():
    with pytest.raises(ob.BundleError, match="lib requires dep"):
        ob.walk_closure(ob.report_wheels(report(item("app", "1", ["lib"]), item("lib", "1", ["dep"]))),
                        [ob.Requirement("app")], ENV_312)


VLLM_LIKE = report(
    item("vllm", "0.32.0", ["flashinfer-python==0.7.0.post1", "numpy", "torch==2.13.0",
                            "transformers<5.20.0,>=5.16.1"]),
    item("flashinfer-python", "0.7.0.post1", ["nvidia-cudnn-frontend>=1.29.0", "numpy", "torch"]),
    item("nvidia-cudnn-frontend", "1.32.0"), item("numpy", "2.5.2"),
    item("torch", "2.13.0", ["triton==3.7.1"]), item("triton", "3.7.1"), item("transformers", "5.17.0", ["numpy>=1.17"]))
BOX = {"numpy": "2.5.2", "torch": "2.11.0+cu130", "triton": "3.6.0", "transformers": "5.17.0", "jax": "0.11.2"}


def test_plan_bundle_freeze_exact_matches_left_out_and_exclusions():
    groups = {"fi": ob.OptionalGroup(("flashinfer-python",), "FlashInfer off")}
    plan = ob.plan_bundle(VLLM_LIKE, ["vllm==0.32.0"], BOX, groups, ENV_312)
    assert [(w.name, w.version) for w in plan.bring] == [("torch", "2.13.0"), ("triton", "3.7.1"), ("vllm", "0.32.0")]
    assert plan.bring[0].filename == "torch-2.13.0-py3-none-any.whl"
    assert plan.left_out == {
        "numpy": {"version": "2.5.2", "required_as": ["transformers: numpy>=1.17", "vllm: numpy"]},
        "transformers": {"version": "5.17.0", "required_as": ["vllm: transformers<5.20.0,>=5.16.1"]}}
    assert plan.excluded == {"fi": {"packages": ["flashinfer-python"], "off": "FlashInfer off",
                                    "also_dropped": ["nvidia-cudnn-frontend"]}}
    assert plan.dropped == ["flashinfer-python", "nvidia-cudnn-frontend"] and plan.warnings == []
    # without the exclusion both come along; FREEZE's different flashinfer would be warned about
    plan = ob.plan_bundle(VLLM_LIKE, ["vllm==0.32.0"], BOX, {}, ENV_312)
    assert {w.name for w in plan.bring} == {"torch", "triton", "vllm", "flashinfer-python", "nvidia-cudnn-frontend"}
    plan = ob.plan_bundle(VLLM_LIKE, ["vllm==0.32.0"], {**BOX, "flashinfer-python": "0.6.0"}, groups, ENV_312)
    assert len(plan.warnings) == 1 and "flashinfer-python==0.6.0" in plan.warnings[0]


def test_plan_bundle_warns_when_a_carried_package_needs_an_excluded_one():
    resolved = report(item("vllm", "0.32.0", ["flashinfer-python", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl"]),
                      item("flashinfer-python", "0.7.0.post1", ["nvidia-cudnn-frontend", "nvidia-cutlass-dsl"]),
                      item("nvidia-cudnn-frontend", "1.32.0", ["nvidia-cutlass-dsl[cu13]"]),
                      item("nvidia-cutlass-dsl", "4.8.0", ['nvidia-cutlass-dsl-libs-cu13; extra == "cu13"']),
                      item("nvidia-cutlass-dsl-libs-cu13", "4.8.0"))
    plan = ob.plan_bundle(resolved, ["vllm"], {}, {"cute": ob.OptionalGroup(("nvidia-cutlass-dsl",), "x")}, ENV_312)
    assert plan.dropped == ["nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13"]  # the extra's package goes too
    assert plan.warnings == ["--exclude cute: nvidia-cutlass-dsl is required by carried flashinfer-python, "
                             "nvidia-cudnn-frontend; their code that imports it fails when reached"]


def test_freeze_pins_version_range_rule():
    free = report(
        item("vllm", "0.32.0", ["numpy", "numba==0.65.0", "transformers<5.20.0,>=5.16.1", "torch"]),
        item("numba", "0.65.0", ["numpy<2.5,>=1.22"]), item("numpy", "2.3.5"), item("transformers", "5.19.0"),
        item("torch", "2.13.0"))
    pins = ob.freeze_pins(free, [ob.Requirement("vllm==0.32.0")],
                          {"numpy": "2.5.2", "transformers": "5.17.0", "torch": "2.11.0+cu130", "jax": "0.11.2"},
                          ENV_312)
    # numpy 2.5.2: numba's <2.5 refuses it; torch: a local build no index serves; jax: not needed
    assert pins == {"transformers": "5.17.0"}


def test_resolve_against_freeze_pins_then_falls_back():
    def fake_resolve(requirements, target, constraints):
        calls.append(dict(constraints))
        if fail_pinned and constraints:
            raise ob.BundleError("ResolutionImpossible")
        version = constraints.get("transformers", "5.19.0")
        return report(item("vllm", "0.32.0", ["transformers<5.20.0,>=5.16.1"]), item("transformers", version))

    target = ob.Target("3.12", (PLATFORM,))
    calls, fail_pinned = [], False
    final, pins, note = ob.resolve_against_freeze(["vllm==0.32.0"], target, {"transformers": "5.17.0"},
                                                  fake_resolve, log=lambda _: None)
    assert calls == [{}, {"transformers": "5.17.0"}] and pins == {"transformers": "5.17.0"}
    assert final["install"][1]["metadata"]["version"] == "5.17.0" and note == "resolved with FREEZE pins"
    calls, fail_pinned = [], True
    final, pins, note = ob.resolve_against_freeze(["vllm==0.32.0"], target, {"transformers": "5.17.0"},
                                                  fake_resolve, log=lambda _: None)
    assert final["install"][1]["metadata"]["version"] == "5.19.0" and pins == {} and "failed" in note


# ------------------------------------------------------------------------------------------------
# 3. Parts
# ------------------------------------------------------------------------------------------------


def test_split_into_parts_docstring_example(tmp_path):
    paths = []
    for name, size in [("a.whl", 4), ("b.whl", 15), ("c.whl", 3)]:
        paths.append(tmp_path / name)
        paths[-1].write_bytes(bytes(range(size)))
    parts, wheels = ob.split_into_parts(paths, tmp_path / "out", part_bytes=10)
    assert [p["size"] for p in parts] == [10, 10, 2]
    assert [w["segments"] for w in wheels] == [[[0, 0, 4]], [[0, 4, 6], [1, 0, 9]], [[1, 9, 1], [2, 0, 2]]]
    stream = b"".join(p.read_bytes() for p in paths)
    for i, part in enumerate(parts):
        data = (tmp_path / "out" / part["folder"] / part["name"]).read_bytes()
        assert data == stream[10 * i:10 * (i + 1)] and hashlib.sha256(data).hexdigest() == part["sha256"]


def tiny_wheels(directory: Path) -> list[Path]:
    """tinya, tinyb (needs tinya) and tinyc: 200 KiB of incompressible bytes and a .pth file that
    puts its ``tinyc_lib`` folder (with module tinyc_hidden) on sys.path."""
    directory.mkdir(parents=True, exist_ok=True)
    blob = random.Random(0).randbytes(200 * KIB)
    return [
        make_wheel(directory, "tinya", "1.0", {"tinya/__init__.py": "VALUE = 'a'\n"}),
        make_wheel(directory, "tinyb", "2.0", {"tinyb/__init__.py": "import tinya\nVALUE = tinya.VALUE + 'b'\n"},
                   requires=["tinya==1.0"]),
        make_wheel(directory, "tinyc", "3.0", {"tinyc/__init__.py": "", "tinyc/blob.bin": blob,
                                              "tinyc.pth": "tinyc_lib\n",
                                              "tinyc_lib/tinyc_hidden.py": "VALUE = 'hidden'\n"}),
    ]


def host_manifest(**extra) -> dict:
    return {"target": ob.Target(HOST_PYTHON, (PLATFORM,)).to_json(), "check": "import tinya", **extra}


@pytest.fixture
def bundle(tmp_path):
    """A bundle of the tiny wheels in 64 KiB parts: (pack folder, manifest, wheel paths)."""
    wheels = tiny_wheels(tmp_path / "wheels")
    manifest = ob.write_bundle(wheels, tmp_path / "pack", 64 * KIB, host_manifest())
    return tmp_path / "pack", manifest, wheels


def copy_part_folders_flat(pack: Path, box: Path) -> None:
    """What a caller does per device call: copy one part folder's files into one folder on the box."""
    box.mkdir()
    for folder in sorted(pack.glob("part-*")):
        for path in folder.iterdir():
            shutil.copy(path, box / path.name)


def run_python(code: str, pythonpath: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": pythonpath},
                          capture_output=True, text=True, cwd="/")


def test_round_trip_pack_copy_unpack_import(bundle, tmp_path):
    pack, manifest, wheels = bundle
    total = sum(p.stat().st_size for p in wheels)
    assert len(manifest["parts"]) == math.ceil(total / (64 * KIB)) >= 4
    assert [p["folder"] for p in manifest["parts"]] == [f"part-{i:03d}" for i in range(1, len(manifest["parts"]) + 1)]
    for part in manifest["parts"]:
        assert (pack / part["folder"] / part["name"]).stat().st_size == part["size"] <= 64 * KIB
        assert json.loads((pack / part["folder"] / "manifest.json").read_text()) == manifest
    tinyc = next(w for w in manifest["wheels"] if w["file"].startswith("tinyc"))
    assert len(tinyc["segments"]) >= 3  # chunked across parts
    assert [w["sha256"] for w in manifest["wheels"]] == [hashlib.sha256(p.read_bytes()).hexdigest() for p in wheels]

    box, prefix = tmp_path / "box", tmp_path / "site"
    copy_part_folders_flat(pack, box)
    lines = ob.unpack(box, prefix, log=lambda _: None)
    assert lines[0].startswith("export PYTHONPATH=") and lines[0].endswith("${PYTHONPATH:+:$PYTHONPATH}")
    pythonpath = lines[0][len("export PYTHONPATH="):-len("${PYTHONPATH:+:$PYTHONPATH}")]
    assert pythonpath == f"{prefix.resolve()}:{prefix.resolve() / 'tinyc_lib'}"
    code = "import tinya, tinyb, tinyc_hidden; print(tinyb.VALUE, tinyc_hidden.VALUE, tinya.__file__)"
    proc = run_python(code, pythonpath)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["ab", "hidden"] and proc.stdout.split()[2].startswith(str(prefix.resolve()))
    # PYTHONPATH reads no .pth file: the prefix alone would not find tinyc_hidden
    assert run_python("import tinyc_hidden", str(prefix)).returncode != 0
    # unpack straight from the pack folder (part-NNN/ layout) works too, and again over an install
    assert ob.unpack(pack, prefix, log=lambda _: None) == lines


def test_corrupted_part_is_named(bundle, tmp_path):
    pack, manifest, _ = bundle
    part = pack / "part-002" / "part-002.bin"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ob.BundleError, match=r"part-002\.bin has the wrong sha256.*Re-copy") as error:
        ob.unpack(pack, tmp_path / "site", log=lambda _: None)
    assert "part-001" not in str(error.value) and "part-003" not in str(error.value)
    assert not (tmp_path / "site").exists()


def test_truncated_part_is_named(bundle, tmp_path):
    pack, manifest, _ = bundle
    part = pack / "part-003" / "part-003.bin"
    part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(ob.BundleError, match=rf"part-003\.bin is {manifest['parts'][2]['size'] - 1} bytes"):
        ob.unpack(pack, tmp_path / "site", log=lambda _: None)


def test_missing_part_is_named(bundle, tmp_path):
    pack, manifest, _ = bundle
    shutil.rmtree(pack / "part-003")
    with pytest.raises(ob.BundleError, match=rf"1 of {len(manifest['parts'])} parts missing .*: part-003\.bin;"):
        ob.unpack(pack, tmp_path / "site", log=lambda _: None)
    assert not (tmp_path / "site").exists()


def test_no_manifest_mixed_packs_and_wrong_python_refused(bundle, tmp_path):
    pack, manifest, wheels = bundle
    with pytest.raises(ob.BundleError, match="no manifest.json"):
        ob.unpack(tmp_path / "wheels", tmp_path / "site", log=lambda _: None)
    other = ob.write_bundle(wheels[:1], tmp_path / "other", 64 * KIB, host_manifest())
    box = tmp_path / "box"
    copy_part_folders_flat(pack, box)
    (box / "part-001").mkdir()  # a part folder of another pack copied in beside the flat files
    shutil.copy(tmp_path / "other" / "part-001" / "manifest.json", box / "part-001" / "manifest.json")
    assert other != manifest
    with pytest.raises(ob.BundleError, match="different packs"):
        ob.unpack(box, tmp_path / "site", log=lambda _: None)
    old = ob.write_bundle(wheels[:1], tmp_path / "old", 64 * KIB, {**host_manifest(), "target": {"python": "2.7"}})
    assert old["target"]["python"] == "2.7"
    with pytest.raises(ob.BundleError, match=r"for CPython 2\.7, this is"):
        ob.unpack(tmp_path / "old", tmp_path / "site", log=lambda _: None)
    with pytest.raises(ob.BundleError, match="already holds a bundle"):
        ob.write_bundle(wheels, pack, 64 * KIB, host_manifest())


# ------------------------------------------------------------------------------------------------
# 4. pack end to end; the real pip on local wheels
# ------------------------------------------------------------------------------------------------


def test_pack_end_to_end_with_network_steps_replaced(tmp_path, monkeypatch):
    wheels = {p.name.split("-")[0]: p for p in tiny_wheels(tmp_path / "index")}
    heavy = make_wheel(tmp_path / "index", "tinyheavy", "1.0", {"tinyheavy/__init__.py": ""})
    app = make_wheel(tmp_path / "index", "tinyapp", "1.0", {"tinyapp/__init__.py": ""},
                     requires=["tinyb>=2", "tinyc>=3", "tinyheavy"])
    project = make_wheel(tmp_path / "project", "vllm-ddtree", "0.1.0", {"vllm_ddtree/__init__.py": ""},
                         requires=["tinya", 'pytest; extra == "test"'])
    resolved = report(item("tinyapp", "1.0", ["tinyb>=2", "tinyc>=3", "tinyheavy"], app),
                      item("tinya", "1.0", [], wheels["tinya"]), item("tinyb", "2.0", ["tinya==1.0"], wheels["tinyb"]),
                      item("tinyc", "3.0", [], wheels["tinyc"]), item("tinyheavy", "1.0", [], heavy),
                      environment=ob.Target(HOST_PYTHON, (PLATFORM,)).marker_environment)
    downloaded = []

    def fake_download(bring, target, dest):
        downloaded.extend(w.name for w in bring)
        for wheel in bring:
            shutil.copy(tmp_path / "index" / wheel.filename, dest / wheel.filename)
        return [dest / w.filename for w in bring]

    freeze = tmp_path / "freeze.txt"
    freeze.write_text("tinya==1.0\ntinyc==2.9\n")
    monkeypatch.setitem(ob.OPTIONAL_GROUPS, "heavy", ob.OptionalGroup(("tinyheavy",), "heavy things off"))
    options = ob.parse_args(["pack", "--python", HOST_PYTHON, "--platform", PLATFORM, "--have", str(freeze),
                             "--part-mib", "1", "--out", str(tmp_path / "out"), "--require", "tinyapp==1.0",
                             "--exclude", "heavy"])
    manifest = ob.pack(options, resolve=lambda *a: resolved, download=fake_download,
                       build_project=lambda path, dest: project, log=lambda _: None)
    assert downloaded == ["tinyapp", "tinyb", "tinyc"]  # tinya: FREEZE has 1.0; tinyc 2.9 != 3.0
    assert [w["file"] for w in manifest["wheels"]] == [
        "tinyapp-1.0-py3-none-any.whl", "tinyb-2.0-py3-none-any.whl", "tinyc-3.0-py3-none-any.whl",
        "vllm_ddtree-0.1.0-py3-none-any.whl"]
    assert manifest["freeze"]["pins"] == {"tinya": "1.0"}  # tinyc 2.9: tinyapp needs >=3
    assert manifest["freeze"]["left_out"] == {"tinya": {"version": "1.0", "required_as": ["tinyb: tinya==1.0"]}}
    assert manifest["excluded"]["heavy"] == {"packages": ["tinyheavy"], "off": "heavy things off", "also_dropped": []}
    assert manifest["requirements"] == ["tinyapp==1.0"] and manifest["pip_version"] == "26.3"
    assert manifest["target"]["platform_tags"][:2] == [PLATFORM, "manylinux_2_27_x86_64"]
    assert len(manifest["parts"]) == 1 and not list((tmp_path / "out").glob(".download-*"))
    # a project requirement that neither the bundle nor FREEZE holds stops the pack
    missing = make_wheel(tmp_path / "project2", "vllm-ddtree", "0.1.0", {}, requires=["torch"])
    options.out = tmp_path / "out2"
    with pytest.raises(ob.BundleError, match=r"needs \['torch'\]"):
        ob.pack(options, resolve=lambda *a: resolved, download=fake_download,
                build_project=lambda path, dest: missing, log=lambda _: None)


def test_real_pip_resolves_with_target_markers_and_downloads_offline(tmp_path):
    # the target is one minor newer than this interpreter: only its marker environment needs tinynew
    target_python = f"3.{sys.version_info.minor + 1}"
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index, "tinyapp", "1.0", {"tinyapp/__init__.py": ""},
               requires=[f'tinynew; python_version == "{target_python}"', f'tinyold; python_version == "{HOST_PYTHON}"'])
    make_wheel(index, "tinynew", "1.0", {"tinynew/__init__.py": ""})
    make_wheel(index, "tinyold", "1.0", {"tinyold/__init__.py": ""})
    make_wheel(index, "tinynew", "2.0", {"tinynew/__init__.py": ""})
    target = ob.Target(target_python, (PLATFORM,))
    offline = ("--no-index", "--find-links", str(index))
    resolved = ob.resolve_with_pip(["tinyapp"], target, {"tinynew": "1.0"}, index_args=offline)
    assert sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in resolved["install"]) == [
        ("tinyapp", "1.0"), ("tinynew", "1.0")]  # the constraint held tinynew at 1.0
    plan = ob.plan_bundle(resolved, ["tinyapp"], {}, {}, target.marker_environment)
    paths = ob.download_with_pip(plan.bring, target, tmp_path, index_args=offline)
    assert [p.name for p in paths] == ["tinyapp-1.0-py3-none-any.whl", "tinynew-1.0-py3-none-any.whl"]
    assert all(ob.sha256_of(p) == w.sha256 for p, w in zip(paths, plan.bring))
    with pytest.raises(ob.BundleError, match="could not resolve"):
        ob.resolve_with_pip(["tinymissing"], target, {}, index_args=offline)


# ------------------------------------------------------------------------------------------------
# The optional groups offered
# ------------------------------------------------------------------------------------------------

# What `import vllm` and the engine import unconditionally (vLLM 0.32.0's Requires-Dist, read
# against its source): never offered for exclusion.
STARTUP_IMPORTS = {"vllm", "torch", "triton", "numpy", "transformers", "tokenizers", "huggingface-hub",
                   "safetensors", "pydantic", "fastapi", "uvicorn", "openai", "xgrammar", "llguidance",
                   "mistral-common", "openai-harmony", "oss-harmony", "apache-tvm-ffi", "torchvision",
                   "torchaudio", "compressed-tensors", "msgspec", "pyzmq", "cloudpickle", "cbor2", "einops",
                   "blake3", "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-nccl-cu13", "nvidia-cudnn-cu13"}


def test_optional_groups_table_and_help(capsys):
    assert ob.OPTIONAL_GROUPS, "no optional group offered"
    seen = set()
    for name, group in ob.OPTIONAL_GROUPS.items():
        assert group.packages and len(group.off) > 20, name
        assert all(ob.canonicalize_name(p) == p for p in group.packages), name
        assert not (set(group.packages) & seen) and not (set(group.packages) & STARTUP_IMPORTS), name
        seen |= set(group.packages)
    with pytest.raises(SystemExit):
        ob.parse_args(["pack", "--help"])
    text = capsys.readouterr().out
    for name, group in ob.OPTIONAL_GROUPS.items():
        assert f"  {name}: {', '.join(group.packages)}" in text and group.off.split()[0] in text


def test_pack_carries_either_supported_vllm():
    base = ["pack", "--python", "3.12", "--platform", "manylinux_2_39_x86_64", "--out", "/tmp/x"]
    assert ob.parse_args(base).require == [f"vllm=={ob.DEFAULT_VLLM}"]
    assert ob.parse_args([*base, "--vllm", "0.33.0"]).require == ["vllm==0.33.0"]
    assert ob.parse_args([*base, "--require", "tinyapp==1.0"]).require == ["tinyapp==1.0"]
    with pytest.raises(SystemExit):
        ob.parse_args([*base, "--vllm", "0.31.0"])


@pytest.mark.parametrize("version", ob.VLLM_VERSIONS)
def test_optional_groups_are_requirements_of_every_carried_vllm(version):
    """Each group's packages are what that vLLM release requires (its wheel's METADATA)."""
    from vllm_wheel import WheelSources

    metadata = WheelSources(version).read(f"vllm-{version}.dist-info/METADATA")
    required = {ob.canonicalize_name(ob.Requirement(line.split(":", 1)[1]).name)
                for line in metadata.splitlines() if line.startswith("Requires-Dist:")}
    for name, group in ob.OPTIONAL_GROUPS.items():
        assert group.packages[0] in required, (version, name)
