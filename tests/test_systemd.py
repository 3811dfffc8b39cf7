"""The units in systemd/ pass ``systemd-analyze verify`` and keep their contract."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.daemon import config as config_mod

SYSTEMD = Path(__file__).resolve().parents[1] / "systemd"
ANALYZE = shutil.which("systemd-analyze")


def unit(name: str) -> configparser.ConfigParser:
    p = configparser.ConfigParser(strict=False, interpolation=None)
    p.optionxform = str  # type: ignore[assignment,method-assign]
    p.read(SYSTEMD / name)
    return p


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (.ci/run installs it)")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart's binary exists: point it at this checkout's
    # gpuckpt and at a stand-in vllm, under an instance name.
    gpuckpt = Path(sys.executable).with_name("gpuckpt")
    vllm = tmp_path / "vllm"
    vllm.write_text("#!/bin/sh\nexit 0\n")
    vllm.chmod(0o755)
    names = []
    for src in ("gpuckpt-agent@.service", "vllm-worker@.service"):
        text = (SYSTEMD / src).read_text()
        text = text.replace("/usr/bin/gpuckpt", str(gpuckpt)).replace("/usr/bin/vllm", str(vllm))
        dst = tmp_path / src.replace("@.", "@gpu0.")
        dst.write_text(text)
        names.append(str(dst))
    r = subprocess.run([ANALYZE, "verify", "--man=no", *names], capture_output=True, text=True, cwd=tmp_path)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == 0, problems
    assert not problems, problems


def test_agent_unit_stops_before_its_worker_and_outlasts_the_final_checkpoint() -> None:
    u = unit("gpuckpt-agent@.service")
    assert "vllm-worker@%i.service" in u["Unit"]["After"]  # started after → stopped before
    s = u["Service"]
    assert s["Type"] == "notify"
    assert int(s["WatchdogSec"]) > 0
    assert s["Restart"] == "on-failure"
    example = config_mod.load(SYSTEMD / "agent.example.toml")
    assert int(s["TimeoutStopSec"]) > example.checkpoint.stop_deadline.total_seconds() + 30
    for key, want in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "User": "gpuckpt",
        "RuntimeDirectory": "gpuckpt",
    }.items():
        assert s[key] == want, key
    assert s["CapabilityBoundingSet"] == ""


def test_example_config_validates_and_names_the_worker_units_socket() -> None:
    cfg = config_mod.load(SYSTEMD / "agent.example.toml")
    worker = (SYSTEMD / "vllm-worker@.service").read_text()
    sock = re.search(r'"control_socket": "([^"]+)"', worker)
    assert sock is not None
    assert str(cfg.connector_socket) == sock.group(1).replace("%i", cfg.worker_id)
    assert cfg.api.mode == 0o660
