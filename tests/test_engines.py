"""The engine interface: one way for the daemon, its API and the CLI to reach a worker.

Against the stand-in connector (tests/fake_connector.py); the real engines are
covered in tests/vllm and tests/sglang.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ckpt
from agent import engines, session
from agent.daemon.agent import Agent
from agent.daemon.notify import Notifier
from agent.engines import control, ledgers
from agent.engines.base import Resubmission
from agent.engines.types import Staging
from tests.fake_connector import FakeConnector
from tests.harness.agent import make_cfg

ROOT = Path(__file__).resolve().parents[1]


# That vllm and sglang are imported only in their engine's package is an import-linter contract
# (pyproject.toml, run by `make lint`), no longer a test here.


def test_engines_are_chosen_by_name_and_unknown_ones_are_refused(tmp_path: Path) -> None:
    assert type(engines.get("vllm", tmp_path / "s")).__name__ == "VllmEngine"
    assert type(engines.get("sglang", tmp_path / "s")).__name__ == "SglangEngine"
    with pytest.raises(ckpt.ConfigError, match="unknown engine 'tgi'; one of sglang, vllm"):
        engines.get("tgi", tmp_path / "s")


def test_the_agent_configuration_names_the_engine(tmp_path: Path) -> None:
    assert make_cfg(tmp_path).engine == "vllm"
    assert make_cfg(tmp_path, engine="sglang").engine == "sglang"
    with pytest.raises(ckpt.ConfigError, match="engine"):
        make_cfg(tmp_path, engine="tgi")


def test_launch_configures_each_engines_adapter_with_its_own_flags() -> None:
    v = engines.for_command(["vllm", "serve", "m", "--port", "9000"])
    argv = v.worker_command(
        ["vllm", "serve", "m", "--port", "9000"], control_socket="/run/c.sock", staging_dir="/run/st", shared_group="g"
    )
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"] == {
        "control_socket": "/run/c.sock",
        "staging_dir": "/run/st",
        "shared_group": "g",
    }
    s = engines.for_command(["python3", "-m", "sglang.launch_server", "--model-path", "m"])
    argv = s.worker_command(
        ["python3", "-m", "sglang.launch_server", "--model-path", "m"],
        control_socket="/run/c.sock",
        staging_dir=None,
        shared_group=None,
        hold_retries_s=30.0,
    )
    # SGLang's own server through gpuckpt's launcher (its middleware: retries attach), same arguments
    assert argv[:5] == ["python3", "-m", "agent.engines.sglang.server", "--model-path", "m"]
    assert "--enable-unified-cache-external-linker" in argv
    assert argv[argv.index("--unified-cache-external-linker-backend") + 1] == "dynamic"
    linker = json.loads(argv[argv.index("--unified-cache-external-linker-config") + 1])
    assert linker["linker_module_path"] == "agent.engines.sglang.linker"
    assert linker["linker_extra_config"]["control_socket"] == "/run/c.sock"
    assert linker["linker_extra_config"]["retry_hold_s"] == 30.0
    with pytest.raises(ValueError, match="already configures an external cache linker"):
        s.worker_command(argv, control_socket="/x", staging_dir=None, shared_group=None)


def test_a_worker_of_another_engine_is_refused_by_name(short_tmp: Path) -> None:
    fake = FakeConnector(short_tmp / "conn.sock", short_tmp / "stage")  # says it runs vllm
    try:
        e = engines.get("sglang", fake.sock)
        with pytest.raises(ckpt.EngineMismatch, match="runs vllm, not sglang"):
            session.describe(e)
        with pytest.raises(ckpt.EngineMismatch):
            session.checkpoint(e, ckpt.Repository.init(f"file://{short_tmp / 'repo'}"), "w0")
        assert fake.captures == 0  # refused before anything was captured
        assert engines.attach(fake.sock).name == "vllm"  # or taken as what it says it is
    finally:
        fake.close()


def test_engine_errors_are_typed_with_their_exit_codes(short_tmp: Path) -> None:
    from cli import exitcodes

    with pytest.raises(ckpt.WorkerUnreachable, match="no worker adapter answering on") as e:
        control.call(short_tmp / "nobody.sock", "ping")
    assert isinstance(e.value, OSError)  # what callers written for a missing socket catch
    assert exitcodes.exit_code_for(e.value) == exitcodes.UNAVAILABLE
    assert exitcodes.exit_code_for(ckpt.EngineRefused("no step boundary")) == exitcodes.UNAVAILABLE
    assert exitcodes.exit_code_for(ckpt.EngineMismatch("another engine")) == exitcodes.CONFIG
    assert issubclass(control.ControlError, ckpt.EngineError)


def test_the_checkpoint_returns_its_stats_and_the_restore_decision_serializes_one_way(short_tmp: Path) -> None:
    fake = FakeConnector(short_tmp / "conn.sock", short_tmp / "stage")
    try:
        repo = ckpt.Repository.init(f"file://{short_tmp / 'repo'}")
        e = engines.get("vllm", fake.sock, Staging(fake.stage))
        done = session.checkpoint(e, repo, "w0")
        assert done.manifest.sizes.blocks == fake.pages
        assert done.stats["pages"] == fake.pages
        assert "save_s" in done.stats
        d = session.plan(e, done.manifest)
        assert d.warm, d.reasons
        assert d.reasons == []
        assert d.blocks == fake.pages
        j = d.to_json()
        assert set(j) == {"checkpoint", "warm", "reasons", "requests", "blocks", "inexact", "results"}
        assert j["inexact"] == {}  # the fake's ledger holds no request
        assert {"rule", "verdict", "checkpoint", "here", "detail", "ignored", "refuses"} <= set(j["results"][0])
        # the agent's API answers the same document
        from agent.daemon.api import restore_plan

        a = Agent(make_cfg(short_tmp, connector_socket=str(fake.sock)), notifier=Notifier(address=""))
        a.repo = repo
        assert restore_plan(a, "latest") == j
    finally:
        fake.close()


def test_ledgers_are_read_by_their_engines_package() -> None:
    vllm_ledger = {"schema": "gpuckpt-vllm-ledger", "version": 2, "data": {"requests": []}}
    assert ledgers.format_of(vllm_ledger).SCHEMA == "gpuckpt-vllm-ledger"
    with pytest.raises(ckpt.FormatError, match="ledger schema 'tgi-ledger' is not one this gpuckpt reads"):
        ledgers.format_of({"schema": "tgi-ledger", "version": 1, "data": {}})
    s = ledgers.format_of({"schema": "gpuckpt-sglang-ledger", "version": 1, "data": {"requests": []}})
    assert s.SCHEMA == "gpuckpt-sglang-ledger"
    assert all(
        isinstance(r, Resubmission)
        for r in s.resubmissions(
            {"schema": "gpuckpt-sglang-ledger", "version": 1, "data": {"page_size": 16, "requests": []}}
        )
    )
