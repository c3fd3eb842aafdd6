"""The ready configs (configs/*.json), their README, and the Docker packaging (no engine start).

1. Every ``configs/*.json`` is a JSON object with only the keys the plugin accepts, passes the
   plugin's own option parsing (``split_speculative_config``) with a budget in 1..MAX_BUDGET,
   and is named in configs/README.md.
2. Qwen configs name a z-lab DFlash drafter, and every serve command in configs/README.md pairs
   a config with the target its drafter was trained for.
3. The tiny-pair config: its drafter path (relative to the repository root) is a DFlash drafter
   whose ``block_size`` passes ``resolve_depth`` and which matches the committed target; the
   file's exact text goes through vLLM's CLI parser and ``create_engine_config`` (config only,
   no weights read, no engine started).
4. docker/Dockerfile: ``FROM vllm/vllm-openai:v0.32.*``, installs with ``--no-deps`` and nothing
   else, every COPY source exists, the COPYs put everything pyproject.toml needs where pip
   installs from, the CUDA opt-in variable is the plugin's, the entry point is the image's;
   .dockerignore keeps .venv/.git/caches out without excluding a copied path.
"""

import ast
import fnmatch
import json
import posixpath
import re
import shlex
from pathlib import Path

import pytest

from vllm_ddtree.plugin.options import (
    MAX_BUDGET,
    OPTION_KEYS,
    resolve_depth,
    split_speculative_config,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
CONFIG_README = CONFIGS / "README.md"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
TINY = "tiny-pair-ddtree.json"
EXPECTED = {  # file -> (target, drafter): the configs this project promises
    "qwen3-4b-ddtree.json": ("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"),
    "qwen3-8b-ddtree.json": ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"),
    "qwen3-coder-30b-a3b-ddtree.json": ("Qwen/Qwen3-Coder-30B-A3B-Instruct",
                                        "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
    TINY: ("vllm_ddtree/assets/tiny_pair/target", "vllm_ddtree/assets/tiny_pair/drafter"),
}
ALLOWED_KEYS = {"method", "model", "num_speculative_tokens", *OPTION_KEYS}
CONFIG_FILES = sorted(p.name for p in CONFIGS.glob("*.json"))


def load(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def drafter_family(drafter: str) -> str:
    """``z-lab/Qwen3-8B-DFlash-b16`` -> ``Qwen3-8B``: the target name its drafter was trained for."""
    name = drafter.split("/", 1)[1]
    return name[: name.index("-DFlash")]


# ---------------------------------------------------------------------------- 1. every config


def test_expected_configs_present():
    assert set(EXPECTED) <= set(CONFIG_FILES), f"missing: {set(EXPECTED) - set(CONFIG_FILES)}"


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_config_parses_and_passes_plugin_validation(name):
    spec = load(name)
    assert isinstance(spec, dict)
    assert spec.get("method") == "ddtree"
    assert set(spec) <= ALLOWED_KEYS, f"{name}: keys the plugin does not take: {set(spec) - ALLOWED_KEYS}"
    dflash, options = split_speculative_config(spec)
    assert dflash["method"] == "dflash" and dflash["model"] == spec["model"]
    assert 1 <= options.budget <= MAX_BUDGET
    assert options.budget == spec["num_speculative_tokens"]


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_config_named_in_readme(name):
    assert name in CONFIG_README.read_text(), f"configs/README.md does not mention {name}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_pairs_promised_drafter(name):
    spec = load(name)
    assert spec["model"] == EXPECTED[name][1]
    if name != TINY:
        assert spec["num_speculative_tokens"] == 256  # the paper's sweet spot, lower end


# ----------------------------------------------------------------------------- 2. Qwen configs


@pytest.mark.parametrize("name", [n for n in CONFIG_FILES if n != TINY])
def test_qwen_config_names_zlab_dflash_drafter(name):
    drafter = load(name)["model"]
    assert re.fullmatch(r"z-lab/Qwen3-[\w.-]+-DFlash(-b\d+)?", drafter), drafter


def readme_serve_commands() -> list[tuple[str, str]]:
    """(target, config file) of every command in configs/README.md that reads a config."""
    text = CONFIG_README.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        m = re.search(r'"\$\(cat configs/([\w.-]+\.json)\)"', line)
        if not m:
            continue
        words = shlex.split(line.replace(m.group(0), "SPEC"), comments=True)
        if "--model" in words:
            target = words[words.index("--model") + 1]
        else:
            target = words[words.index("serve") + 1]
        found.append((target, m.group(1)))
    return found


def test_readme_serve_commands_pair_the_right_target():
    commands = readme_serve_commands()
    assert {name for _, name in commands} == set(CONFIG_FILES), "a config without a serve command"
    for target, name in commands:
        assert (CONFIGS / name).exists(), name
        drafter = load(name)["model"]
        if name == TINY:
            assert target == EXPECTED[TINY][0]
        else:
            assert target.split("/", 1)[1].startswith(drafter_family(drafter)), (target, drafter)
    # both platforms are covered for every Qwen config
    text = CONFIG_README.read_text()
    for name in EXPECTED:
        if name != TINY:
            assert f'VLLM_DDTREE_EXPERIMENTAL_CUDA=1 vllm serve {EXPECTED[name][0]} ' \
                   f'--speculative-config "$(cat configs/{name})"' in text
            assert f'python -m vllm.entrypoints.openai.api_server --model {EXPECTED[name][0]} ' \
                   f'--speculative-config "$(cat configs/{name})"' in text


# --------------------------------------------------------------------------------- 3. tiny pair


def test_tiny_pair_drafter_resolves():
    spec = load(TINY)
    drafter = ROOT / spec["model"]
    assert not Path(spec["model"]).is_absolute(), "keep the tiny pair's path relative to the repo root"
    cfg = json.loads((drafter / "config.json").read_text())
    assert "DFlashDraftModel" in cfg["architectures"] and cfg.get("dflash_config")
    assert (drafter / "model.safetensors").exists()
    _, options = split_speculative_config(spec)
    resolved = resolve_depth(options, cfg["block_size"])
    assert resolved.depth == cfg["block_size"] - 1
    target = json.loads((ROOT / EXPECTED[TINY][0] / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["hidden_size"]) == (target["vocab_size"], target["hidden_size"])


def test_tiny_pair_config_through_vllm_cli(monkeypatch):
    """The file's exact text as ``--speculative-config``, the way configs/README.md serves it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)  # the drafter path is relative to the repository root
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", EXPECTED[TINY][0], "--dtype", "float32",
                              "--max-model-len", "512",
                              "--speculative-config", (CONFIGS / TINY).read_text()])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative_config.method == "dflash"
    assert config.additional_config["ddtree"]["budget"] == load(TINY)["num_speculative_tokens"]
    assert config.additional_config["ddtree"]["depth"] == 7
    assert config.additional_config["ddtree"]["calibrate_trees"] is True


# ------------------------------------------------------------------------------------ 4. Docker


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [l for l in DOCKERFILE.read_text().splitlines() if not l.lstrip().startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY / ADD from the build context."""
    out = []
    for word, rest in dockerfile_instructions():
        if word not in ("COPY", "ADD"):
            continue
        parts = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        if any(p.startswith("--from") for p in parts):
            continue  # from another stage or image, not the context
        parts = [p for p in parts if not p.startswith("--")]
        out.append((parts[:-1], parts[-1]))
    return out


def test_dockerfile_base_image():
    froms = [rest for word, rest in dockerfile_instructions() if word == "FROM"]
    assert len(froms) == 1 and re.fullmatch(r"vllm/vllm-openai:v0\.32\.\d+", froms[0].split()[0]), froms


def pip_installs() -> list[tuple[str, list[str]]]:
    """(directory it runs in, arguments) of every pip install in a RUN."""
    out = []
    for word, rest in dockerfile_instructions():
        if word != "RUN":
            continue
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands, words = [], []
        for token in lexer:
            if token in ("&&", ";", "||"):
                commands.append(words)
                words = []
            else:
                words.append(token)
        cwd = None
        for words in [*commands, words]:
            if words[:1] == ["cd"]:
                cwd = words[1]
            if "pip" in words and "install" in words:
                out.append((cwd, words[words.index("install") + 1:]))
    return out


def test_dockerfile_installs_only_the_plugin_without_deps():
    installs = pip_installs()
    assert len(installs) == 1, installs
    _, args = installs[0]
    assert "--no-deps" in args
    targets = [a for a in args if not a.startswith("-")]
    assert targets == ["."], f"installs {targets}: only the plugin, never vllm or torch"


def test_dockerfile_copy_sources_exist_and_cover_pyproject():
    landed = {}  # destination path in the image -> source in the repository
    for sources, dest in copies():
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            if len(sources) == 1 and (ROOT / src).is_dir():
                landed[dest.rstrip("/")] = src.rstrip("/")
            elif dest.endswith("/") or len(sources) > 1:
                landed[posixpath.join(dest, posixpath.basename(src.rstrip("/")))] = src.rstrip("/")
            else:
                landed[dest] = src
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    (cwd, args), = pip_installs()
    assert cwd, "pip install . must run in the directory the sources were copied to"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tool = project["tool"]["setuptools"]
    package_dir = tool.get("package-dir", {})
    needed = {"pyproject.toml", project["project"]["readme"]}
    for package in tool["packages"]:
        needed.add(package_dir.get(package, package.replace(".", "/")).split("/")[0])
    for path in needed:
        assert landed.get(posixpath.join(cwd, path)) == path, \
            f"{path} (needed by pyproject.toml) is not copied to {cwd}/{path}"


def test_pyproject_lists_every_package():
    """A non-editable install (a wheel: the Docker image, the offline bundles) holds only the
    packages pyproject.toml lists: every folder with an __init__.py must be one of them
    (vllm_ddtree.plugin.v2 was once missing, and the wheel had no Model Runner V2 support)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {package: Path(tool.get("package-dir", {}).get(package, package.replace(".", "/")))
               for package in tool["packages"]}
    on_disk = {init.parent.relative_to(ROOT) for top in {f.parts[0] for f in folders.values()}
               for init in (ROOT / top).rglob("__init__.py")}
    assert on_disk == set(folders.values()), \
        f"packages with an __init__.py that pyproject.toml does not list: {sorted(map(str, on_disk - set(folders.values())))}"


def test_dockerfile_opt_in_env_and_entrypoint():
    tree = ast.parse((ROOT / "vllm_ddtree" / "plugin" / "patches.py").read_text())
    opt_in = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(t, "id", None) == "CUDA_OPT_IN" for t in node.targets))
    instructions = dockerfile_instructions()
    assert ("ENV", f"{opt_in}=1") in instructions
    assert not [w for w, _ in instructions if w in ("ENTRYPOINT", "CMD")], "keep the image's entry point"


def test_dockerignore():
    patterns = [l.strip() for l in DOCKERIGNORE.read_text().splitlines()
                if l.strip() and not l.startswith("#")]
    normalised = {p.strip("/") for p in patterns}
    for required in (".venv", ".git", "benchmarks/results"):
        assert required in normalised, f".dockerignore must exclude {required}"
    assert any("__pycache__" in p for p in patterns) and ".pytest_cache" in normalised
    for sources, _ in copies():
        for src in sources:
            for pattern in normalised:
                assert not fnmatch.fnmatch(src.strip("/"), pattern), f"{pattern} excludes COPY {src}"


def test_docker_readme_commands():
    text = (ROOT / "docker" / "README.md").read_text()
    assert "docker build -f docker/Dockerfile -t vllm-ddtree ." in text
    assert "--gpus all" in text and "-p 8000:8000" in text and "/root/.cache/huggingface" in text
    assert '--speculative-config "$(cat configs/qwen3-8b-ddtree.json)"' in text
    assert "VLLM_DDTREE_EXPERIMENTAL_CUDA=1" in text
