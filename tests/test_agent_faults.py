"""The agent under faults, with real processes: the bucket goes away mid-checkpoint
(a SeaweedFS server of its own, stopped), and the agent is SIGKILLed mid-upload.

Either way: no crash loop, no visible partial checkpoint, the previous
checkpoint still loads, and status says what happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agent.daemon.agent import Agent
from agent.daemon.api import AgentClient
from agent.daemon.notify import Notifier
from ckpt import Repository
from tests.fake_connector import FakeConnector
from tests.harness.agent import make_cfg
from tests.harness.cli import CLI
from tests.harness.seaweed import SeaweedServer


def load_all(repo: Repository, ref: str) -> int:
    m = repo.manifest(ref)
    n = sum(1 for _ in repo.load(m))
    assert n == len(m.blocks)
    return n


def test_bucket_going_away_mid_checkpoint(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = SeaweedServer(short_tmp / "sw")
    srv.start()
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", srv.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", srv.secret_key)
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        url = f"s3://{srv.make_bucket('agent-faults')}/repo?endpoint={srv.endpoint}"
        fake = FakeConnector(short_tmp / "conn.sock", short_tmp / "stage")
        a = Agent(make_cfg(short_tmp, repository=url), notifier=Notifier(address=""))
        a.start()
        try:
            good = a.request_checkpoint("request")
            assert good.done.wait(30)
            assert good.state == "done", good.error
            fake.generation = 1
            fake.gate = threading.Event()  # the next capture waits: the bucket goes away meanwhile
            t = a.request_checkpoint("request", deadline_s=40)
            time.sleep(0.3)
            srv.stop()
            fake.gate.set()
            assert t.done.wait(60)
            assert t.state == "failed"
            st = a.status()
            assert st["last_error"]["operation"] == "checkpoint"
            assert st["last_error"]["error"] == t.error
            assert a.healthy(), "the agent keeps running: no crash loop"
            with AgentClient(a.cfg.api.socket) as c:
                assert c.request("GET", "/health")["ok"] is True
            srv.start()  # the bucket is back
            fake.gate = None
            again = a.request_checkpoint("request")
            assert again.done.wait(60)
            assert again.state == "done", again.error
        finally:
            a.shutdown(final=False)
            fake.close()
        repo = Repository.open(url)
        ids = [i.id for i in repo.list("w0")]
        assert ids == [good.checkpoint, again.checkpoint], "nothing of the failed checkpoint is visible"
        assert load_all(repo, good.checkpoint) == 16
        assert load_all(repo, again.checkpoint) == 16
        assert "Store" in t.error or "nreachable" in t.error or "onnect" in t.error, t.error
    finally:
        srv.close()


def test_agent_sigkilled_mid_upload(short_tmp: Path) -> None:
    fake = FakeConnector(short_tmp / "conn.sock", short_tmp / "stage", pages=6000, random_pages=True)
    cfg = short_tmp / "agent.toml"
    api = short_tmp / "agent.sock"
    cfg.write_text(
        f'worker_id = "w0"\nrepository = "{short_tmp / "repo"}"\nconnector_socket = "{short_tmp / "conn.sock"}"\n'
        f'[api]\nsocket = "{api}"\n[restore]\non_start = false\n'
    )

    def start() -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            [*CLI, "agent", "run", "--config", str(cfg)],
            stdout=(short_tmp / "agent.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if api.exists():
                try:
                    with AgentClient(api, timeout=5) as c:
                        if c.request("GET", "/health")["state"] == "ready":
                            return p
                except ConnectionError:
                    pass
            time.sleep(0.1)
        p.kill()
        raise TimeoutError((short_tmp / "agent.log").read_text()[-2000:])

    try:
        p = start()
        with AgentClient(api) as c:
            first = c.request("POST", "/checkpoint", {})
            while first["state"] not in ("done", "failed"):
                time.sleep(0.1)
                first = c.request("GET", f"/checkpoint/{first['id']}")
            assert first["state"] == "done", first
            t = c.request("POST", "/checkpoint", {})
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                t = c.request("GET", f"/checkpoint/{t['id']}")
                if t["state"] == "saving" and t["progress"].get("blocks", 0) > 100:
                    break
                assert t["state"] != "done", "the save finished before it could be killed"
                time.sleep(0.005)
        os.kill(p.pid, signal.SIGKILL)  # mid-upload
        p.wait()
        left = sorted(x.name for x in (short_tmp / "stage").glob("capture-*"))
        assert left, "the killed agent's capture page file should still be there"
        repo = Repository.open(str(short_tmp / "repo"))
        assert [i.id for i in repo.list("w0")] == [first["checkpoint"]], "no partial checkpoint is visible"
        assert load_all(repo, first["checkpoint"]) == 6000
        # A restarted agent (systemd's Restart=on-failure) takes the stale socket over and works.
        p = start()
        # the restarted agent had the connector delete what the killed one left staged (users' KV)
        assert fake.swept >= 1
        assert not set(left) & {x.name for x in (short_tmp / "stage").glob("capture-*")}
        with AgentClient(api) as c:
            st = c.request("GET", "/status")
            assert st["state"] == "ready"
            t = c.request("POST", "/checkpoint", {})
            while t["state"] not in ("done", "failed"):
                time.sleep(0.1)
                t = c.request("GET", f"/checkpoint/{t['id']}")
            assert t["state"] == "done", t
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        ids = [i.id for i in repo.list("w0")]
        assert ids[0] == first["checkpoint"]
        assert len(ids) == 3  # the first, the one after the restart, the final one on SIGTERM
        logs = [json.loads(x) for x in (short_tmp / "agent.log").read_text().splitlines() if x.startswith("{")]
        assert any(r.get("message") == "final checkpoint saved" for r in logs)
    finally:
        fake.close()
