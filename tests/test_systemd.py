"""The units in systemd/ pass ``systemd-analyze verify`` and keep their contract."""

from __future__ import annotations

import configparser
import json
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
    for src in ("gpuckpt-agent@.service", "vllm-worker@.service", "sglang-worker@.service"):
        text = (SYSTEMD / src).read_text()
        text = text.replace("/usr/bin/gpuckpt", str(gpuckpt)).replace("/usr/bin/vllm", str(vllm))
        text = text.replace("/usr/bin/sglang", str(vllm))
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
    assert "sglang-worker@%i.service" in u["Unit"]["After"]
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
    extra = re.search(r"--kv-transfer-config '([^']+)'", worker)
    assert extra is not None
    conn = json.loads(extra.group(1).replace("%i", cfg.worker_id))["kv_connector_extra_config"]
    assert str(cfg.connector_socket) == conn["control_socket"]
    assert str(cfg.staging_dir) == conn["staging_dir"]
    assert cfg.shared_group == conn["shared_group"]
    assert cfg.api.mode == 0o660


def test_the_sglang_unit_loads_the_linker_the_agent_configuration_names() -> None:
    cfg = config_mod.load(SYSTEMD / "agent.example.toml", engine="sglang")
    worker = (SYSTEMD / "sglang-worker@.service").read_text()
    extra = re.search(r"--unified-cache-external-linker-config '([^']+)'", worker)
    assert extra is not None
    linker = json.loads(extra.group(1).replace("%i", cfg.worker_id))
    assert linker["linker_module_path"] == "agent.engines.sglang.linker"
    conn = linker["linker_extra_config"]
    assert str(cfg.connector_socket) == conn["control_socket"]
    assert str(cfg.staging_dir) == conn["staging_dir"]
    assert cfg.shared_group == conn["shared_group"]
    # the same two accounts and hardening as the vLLM worker: only the command differs
    s, v = unit("sglang-worker@.service")["Service"], unit("vllm-worker@.service")["Service"]
    assert {k: x for k, x in s.items() if k != "ExecStart"} == {k: x for k, x in v.items() if k != "ExecStart"}


def test_worker_and_agent_are_two_accounts_and_only_the_agent_gets_the_secrets() -> None:
    agent, worker = unit("gpuckpt-agent@.service")["Service"], unit("vllm-worker@.service")["Service"]
    assert agent["User"] != worker["User"]
    shared = worker["Group"]
    assert shared in agent["SupplementaryGroups"].split()
    # the key and the bucket's credentials: systemd credentials of the agent's unit, by path
    creds = (SYSTEMD / "gpuckpt-agent@.service").read_text()
    assert "LoadCredential=repo-key:" in creds
    assert "GPUCKPT_AGENT__KEY=file:%d/repo-key" in creds
    assert "AWS_SHARED_CREDENTIALS_FILE=%d/" in creds
    assert "EnvironmentFile" not in agent, "secrets in an environment file end up in /proc/<pid>/environ"
    wtext = (SYSTEMD / "vllm-worker@.service").read_text()
    assert "LoadCredential" not in wtext
    assert "--host 127.0.0.1" in wtext, "the example worker serves loopback only"
    for s in (agent, worker):
        assert s["ProtectProc"] == "invisible"
    for text in (creds, wtext):
        assert "\nSystemCallFilter=@system-service\n" in text
    sysusers = (SYSTEMD / "gpuckpt.sysusers").read_text().split("\n")
    assert f"m {agent['User']} {shared}" in sysusers
    assert f"m {worker['User']} {shared}" in sysusers


#: `systemd-analyze security` exposure levels the units keep (0 safest, 10 most exposed), as in docs/agent.md
MAX_EXPOSURE = {"gpuckpt-agent@.service": 2.0, "vllm-worker@.service": 2.5, "sglang-worker@.service": 2.5}


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (.ci/run installs it)")
def test_units_are_rated_well_by_systemd_analyze_security(tmp_path: Path) -> None:
    for src, limit in MAX_EXPOSURE.items():
        dst = tmp_path / src.replace("@.", "@gpu0.")
        dst.write_text((SYSTEMD / src).read_text())
        r = subprocess.run(
            [ANALYZE, "security", "--offline=yes", "--no-pager", dst.name], capture_output=True, text=True, cwd=tmp_path
        )
        m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout + r.stderr)
        assert m is not None, r.stdout[-2000:] + r.stderr[-2000:]
        assert float(m.group(1)) <= limit, f"{src}: exposure {m.group(1)} > {limit}"
