"""The agent daemon against a stand-in connector (tests/fake_connector.py).

The real vLLM worker path is ``tests/vllm/test_agent_e2e.py``; these pin the
agent's own behaviour: configuration errors, triggers and their
coalescing, deadlines, SIGTERM's final checkpoint, the control API under
malformed input, socket permissions, the systemd notify protocol and the
metrics.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import ckpt
from agent.daemon import config as config_mod
from agent.daemon.agent import Agent
from agent.daemon.api import AgentApiError, AgentClient
from agent.daemon.notify import Notifier
from ckpt import ConfigError, Repository, RepositoryLocked
from ckpt.store.base import Buffer, Store
from ckpt.testing import FaultyStore
from tests.fake_connector import FakeConnector
from tests.harness.agent import make_cfg
from tests.harness.paths import ROOT


@pytest.fixture
def rig(short_tmp: Path):
    fake = FakeConnector(short_tmp / "conn.sock", short_tmp / "stage")
    agents: list[Agent] = []

    def start(**over: object) -> Agent:
        a = Agent(make_cfg(short_tmp, **over), notifier=Notifier(address=""))
        a.start()
        agents.append(a)
        return a

    yield short_tmp, fake, start
    for a in agents:
        if a.state != "stopping":
            a.shutdown(final=False)
    fake.close()


# -- configuration -----------------------------------------------------------------------


def test_invalid_config_names_every_bad_field(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text(
        'worker_id = "bad id!"\nrepository = "/r"\nconnector_socket = "/c"\nkey = "hunter2"\n'
        '[api]\nsocket = "/a"\nmode = "0666"\n[checkpoint]\ninterval = "10 minutes"\n'
    )
    with pytest.raises(ConfigError) as e:
        config_mod.load(f)
    msg = str(e.value)
    assert str(f) in msg
    for field in ("worker_id", "key", "api.mode", "checkpoint.interval"):
        assert field in msg, msg
    assert "hunter2" not in msg  # a key pasted in the wrong place is never echoed
    assert "others access" in msg


def test_unknown_fields_and_bad_toml_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text('worker_id = "w"\nrepository = "/r"\nconnector_socket = "/c"\n[api]\nsocket = "/a"\nsokcet = 1\n')
    with pytest.raises(ConfigError, match=r"api.sokcet: Extra inputs are not permitted"):
        config_mod.load(f)
    f.write_text("worker_id = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config_mod.load(f)
    with pytest.raises(ConfigError, match="does not exist"):
        config_mod.load(tmp_path / "missing.toml")


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "agent.toml"
    f.write_text(
        'worker_id = "w"\nrepository = "/r"\nconnector_socket = "/c"\n'
        '[api]\nsocket = "/a"\n[checkpoint]\ninterval = "10m"\n'
    )
    monkeypatch.setenv("GPUCKPT_AGENT__CHECKPOINT__INTERVAL", "30s")
    monkeypatch.setenv("GPUCKPT_AGENT__REPOSITORY", "s3://b/p")
    cfg = config_mod.load(f)
    assert cfg.checkpoint.interval.total_seconds() == 30
    assert cfg.repository == "s3://b/p"
    assert cfg.api.mode == 0o660


# -- checkpoints ------------------------------------------------------------------------------


def test_the_host_is_probed_before_the_agent_serves(rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe holds the interpreter for seconds (torch, CUDA, NVML load): at the first
    checkpoint it stalled the API and the watchdog, so it runs before either starts."""
    from ckpt import fingerprint

    _tmp, _fake, start = rig
    fingerprint.host_facts.cache_clear()
    order: list[str] = []
    real = fingerprint._probe_cpu

    def probe() -> dict:
        order.append("probe")
        return real()

    monkeypatch.setattr(fingerprint, "_probe_cpu", probe)
    from agent.daemon import api

    started = api.ApiServer.start

    def api_start(self) -> None:  # type: ignore[no-untyped-def]
        order.append("api")
        started(self)

    monkeypatch.setattr(api.ApiServer, "start", api_start)
    start()
    assert order[:2] == ["probe", "api"], order
    assert fingerprint.host_facts.cache_info().currsize == 1  # every checkpoint reuses it


def test_request_checkpoint_lands_and_status_reports_it(rig) -> None:
    tmp, _fake, start = rig
    a = start()
    with AgentClient(a.cfg.api.socket) as c:
        t = c.request("POST", "/checkpoint", {})
        for _ in range(200):
            t = c.request("GET", f"/checkpoint/{t['id']}")
            if t["state"] in ("done", "failed"):
                break
            time.sleep(0.05)
        assert t["state"] == "done", t
        st = c.request("GET", "/status")
    assert st["last_checkpoint"]["id"] == t["checkpoint"]
    assert st["worker"]["attached"] is True
    assert [i.id for i in Repository.open(str(tmp / "repo")).list("w0")] == [t["checkpoint"]]


def test_triggers_at_once_coalesce_into_one_checkpoint(rig) -> None:
    tmp, fake, start = rig
    a = start()
    fake.gate = threading.Event()  # the first capture waits: the next triggers queue behind it
    first = a.request_checkpoint("request")
    time.sleep(0.3)
    queued = [a.request_checkpoint(t) for t in ("periodic", "preemption", "request")]
    assert len({q.id for q in queued}) == 1, "triggers while one runs share the next checkpoint"
    assert queued[0].id != first.id
    fake.gate.set()
    assert first.done.wait(20)
    assert queued[0].done.wait(20)
    assert sorted(queued[0].triggers) == ["periodic", "preemption", "request"]
    assert fake.captures == 2
    assert len(Repository.open(str(tmp / "repo")).list("w0")) == 2


def test_a_checkpoint_past_its_deadline_is_abandoned_and_nothing_is_visible(rig) -> None:
    tmp, fake, start = rig
    a = start()
    good = a.request_checkpoint("request")
    assert good.done.wait(20)
    assert good.state == "done"
    fake.capture_delay = 1.5
    t = a.request_checkpoint("request", deadline_s=0.5)
    assert t.done.wait(20)
    assert t.state == "failed"
    assert "timed out" in t.error.lower() or "deadline" in t.error.lower() or "Aborted" in t.error, t.error
    ids = [i.id for i in Repository.open(str(tmp / "repo")).list("w0")]
    assert ids == [good.checkpoint], "the abandoned checkpoint is not visible; the previous one is intact"
    assert a.status()["last_error"]["operation"] == "checkpoint"


def test_a_checkpoint_never_waits_for_the_canary_behind_a_full_batch(rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The canary probe is a request like any other: on a worker whose every sequence slot is taken
    it queues until one frees, and the final checkpoint of a busy worker waited for it (49 of
    50.7 s). It is recorded in the background as soon as the worker answers; a checkpoint that
    finds the probe still queued behind a full batch goes without it at once (its restore is cold,
    and the log says why), and every later checkpoint of the same worker process reuses the
    record without probing again. The logged timings account for the whole duration."""
    _tmp, fake, start = rig
    released = threading.Event()
    probes: list[int] = []

    class Worker:  # the worker's API: the probe waits in its queue until a slot frees
        def generate(self, ids: list[int], n: int) -> list[int]:
            probes.append(n)
            assert released.wait(60)
            return [5] * n

    monkeypatch.setattr(Agent, "_serving_client", lambda self: Worker())
    fake.batch = {"live": 16, "max_num_seqs": 16}
    a = start(worker_url="http://127.0.0.1:9")
    t0 = time.monotonic()
    t = a.request_checkpoint("stop", deadline_s=60)
    assert t.done.wait(60)
    assert t.state == "done", t.error
    assert time.monotonic() - t0 < 20, "the checkpoint waited for the queued probe"
    repo = Repository.open(str(_tmp / "repo"))
    assert repo.manifest(t.checkpoint).canary is None
    timings = a.last_checkpoint["timings"]
    assert set(timings) >= {"canary_s", "wait_s", "capture_s", "write_s", "save_s", "other_s"}
    assert sum(timings.values()) == pytest.approx(a.last_checkpoint["duration_s"], abs=0.01)
    # a slot frees: the background probe completes, and the next checkpoints use its record
    released.set()
    fake.batch = {"live": 3, "max_num_seqs": 16}
    deadline = time.monotonic() + 30
    while a._canary is None:
        assert time.monotonic() < deadline, "the background probe never completed"
        time.sleep(0.05)
    for _ in range(2):
        t = a.request_checkpoint("request")
        assert t.done.wait(60)
        assert t.state == "done", t.error
        assert repo.manifest(t.checkpoint).canary == {
            "kind": "greedy-probe-v1",
            "prompt_token_ids": repo.manifest(t.checkpoint).canary["prompt_token_ids"],
            "new_tokens": 8,
            "expected": [5] * 8,
        }
    assert probes == [8], "probed once per worker process"


def test_a_worker_shaping_page_files_against_its_agent_fails_that_checkpoint_only(rig) -> None:
    """A FIFO in a page file's place, and a page file truncated under the agent: each is that
    checkpoint's named error; the agent keeps serving and the next checkpoint is taken."""
    import os

    _tmp, fake, start = rig
    a = start()

    def fifo(idx: Path) -> str:
        planted = idx.with_name("fifo-" + idx.name)
        os.mkfifo(planted, 0o600)
        return str(planted)

    fake.name_index = fifo
    t = a.request_checkpoint("request")
    assert t.done.wait(30), "a FIFO stalled the checkpoint"
    assert t.state == "failed"
    assert "not a regular file" in t.error, t.error

    def truncated(idx: Path) -> str:
        os.truncate(idx.with_suffix(".bin"), 100)  # after the index: the sizes disagree
        return str(idx)

    fake.name_index = truncated
    t = a.request_checkpoint("request")
    assert t.done.wait(30)
    assert t.state == "failed"
    assert "bytes, index says" in t.error, t.error
    fake.name_index = None
    t = a.request_checkpoint("request")
    assert t.done.wait(30)
    assert t.state == "done", t.error
    assert a.healthy()


def test_worker_failing_a_capture_is_reported_and_the_agent_keeps_going(rig) -> None:
    _tmp, fake, start = rig
    a = start()
    fake.fail_capture = "the worker died mid-capture"
    t = a.request_checkpoint("request")
    assert t.done.wait(20)
    assert t.state == "failed"
    assert "died mid-capture" in t.error
    fake.fail_capture = None
    t2 = a.request_checkpoint("request")
    assert t2.done.wait(20)
    assert t2.state == "done"


def test_periodic_checkpoints_are_incremental_and_retention_keeps_the_newest(rig) -> None:
    tmp, fake, start = rig
    a = start(checkpoint={"interval": "1s"})
    repo = Repository.open(str(tmp / "repo"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and fake.captures < 4:
        fake.generation = fake.captures
        time.sleep(0.2)
    a.shutdown(final=False)
    # The last checkpoint may still be saving: retention runs after each save.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(repo.list("w0")) != 2:
        time.sleep(0.05)
    ids = [i.id for i in repo.list("w0")]
    assert len(ids) == 2, ids  # keep_last = 2
    m = repo.manifest(ids[-1])
    assert m.sizes.new_blocks <= 1 < m.sizes.blocks, m.sizes  # only the changed page was written


def test_sigterm_path_takes_a_final_checkpoint(rig) -> None:
    tmp, _fake, start = rig
    a = start()
    a.shutdown(final=True)
    infos = Repository.open(str(tmp / "repo")).list("w0")
    assert len(infos) == 1
    m = Repository.open(str(tmp / "repo")).manifest(infos[0].id)
    assert m.labels.get("trigger") == "stop"


def test_preemption_notice_file_triggers_one_checkpoint(rig) -> None:
    tmp, fake, start = rig
    notice = tmp / "preempt"
    a = start(checkpoint={"preemption_file": str(notice), "preemption_poll": "1s"})
    time.sleep(0.5)
    assert fake.captures == 0
    notice.write_text("terminate at 12:00")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and a.status()["last_checkpoint"] is None:
        time.sleep(0.1)
    assert a.status()["preempted"]["notice"].startswith("file ")
    time.sleep(1.5)
    assert fake.captures == 1, "one notice, one checkpoint"


@pytest.mark.parametrize("cloud", ["gce", "aws", "azure"])
def test_each_clouds_notice_triggers_exactly_one_preemption_checkpoint(rig, cloud: str) -> None:  # type: ignore[no-untyped-def]
    """A fake metadata service speaking the cloud's protocol: no checkpoint on its "no event"
    answers, one on the notice (however often polled after), Azure's events acknowledged once it
    is done."""
    from tests.harness.metadata import MetadataServer

    _tmp, fake, start = rig
    srv = MetadataServer(cloud)
    try:
        a = start(checkpoint={"preemption": cloud, "preemption_metadata_url": srv.url, "preemption_poll": "1s"})

        def polls() -> int:
            return sum(1 for m, _ in srv.requests if m == "GET")

        def until(pred: Any, what: str) -> None:
            deadline = time.monotonic() + 30
            while not pred():
                assert time.monotonic() < deadline, what
                time.sleep(0.05)

        until(lambda: polls() >= 3, "the agent never polled")
        assert fake.captures == 0, "a checkpoint without a notice"
        srv.preempted = True
        until(lambda: a.status()["last_checkpoint"] is not None, "no preemption checkpoint")
        assert a.status()["preempted"]["provider"] == cloud
        seen = polls()
        until(lambda: polls() >= seen + 3, "the agent stopped polling")
        assert fake.captures == 1, "one notice, one checkpoint"
        if cloud == "azure":
            until(lambda: bool(srv.acks), "the scheduled event was never acknowledged")
            assert srv.acks == [{"StartRequests": [{"EventId": "E-1"}]}]
    finally:
        srv.close()


def test_a_long_gc_does_not_delay_the_preemption_checkpoint(rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc runs off the scheduler thread that polls for preemption notices."""
    tmp, _fake, start = rig
    entered, release = threading.Event(), threading.Event()

    def slow_gc(self: Repository, **kw: object) -> object:
        entered.set()
        release.wait(60)
        raise RepositoryLocked("released by the test")

    monkeypatch.setattr(Repository, "gc", slow_gc)
    notice = tmp / "preempt"
    a = start(
        checkpoint={"preemption_file": str(notice), "preemption_poll": "1s"},
        retention={"keep_last": 2, "gc_interval": "1s"},
    )
    try:
        assert entered.wait(30), "gc never started"
        notice.write_text("terminate at 12:00")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and a.status()["last_checkpoint"] is None:
            time.sleep(0.1)
        assert a.status()["last_checkpoint"] is not None, "the preemption checkpoint waited for gc"
        assert not release.is_set()
    finally:
        release.set()


class HangingStore(FaultyStore):
    """The first pack put blocks until ``release`` is set (a hung bucket)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.entered, self.release = threading.Event(), threading.Event()

    def put(self, name: str, data: Buffer, *, if_absent: bool = False) -> None:
        if name.startswith("packs/") and not self.entered.is_set():
            self.entered.set()
            self.release.wait(120)
        super().put(name, data, if_absent=if_absent)


@pytest.mark.parametrize("running", ["periodic", "request"])
def test_a_preemption_checkpoint_does_not_wait_behind_a_hung_save(rig, running: str) -> None:
    """A save stuck on the store is abandoned when a preemption notice comes (a periodic one at
    once, a requested one after a short grace): the urgent checkpoint captures and commits, the
    stuck one fails naming why, nothing of it shows."""
    tmp, _fake, start = rig
    notice = tmp / "preempt"
    a = start(checkpoint={"preemption_file": str(notice), "preemption_poll": "1s", "deadline": "10m"})
    assert a.repo is not None
    hung = HangingStore(a.repo.store)
    a.repo.store = hung
    try:
        periodic = a.request_checkpoint(running)
        assert hung.entered.wait(60), "the periodic save never reached the store"
        notice.write_text("terminate at 12:00")
        assert periodic.done.wait(60), "the hung save was not abandoned"
        assert periodic.state == "failed"
        assert "cancelled" in (periodic.error or "")

        def preemption_done() -> bool:
            last = a.status()["last_checkpoint"]
            return last is not None and "preemption" in last["triggers"]

        deadline = time.monotonic() + 60
        while not preemption_done() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert preemption_done(), a.status()
        assert not hung.release.is_set(), "the preemption checkpoint waited for the hung store"
        infos = a.repo.list("w0")
        assert [i.id for i in infos] == [a.status()["last_checkpoint"]["id"]]
    finally:
        hung.release.set()


# -- the control API ---------------------------------------------------------------------------


def test_api_socket_is_created_with_the_configured_mode(rig) -> None:
    tmp, _fake, start = rig
    a = start(api={"socket": str(tmp / "agent.sock"), "mode": "0600"})
    assert stat.S_IMODE(os.stat(a.cfg.api.socket).st_mode) == 0o600


def raw(sock: Path, data: bytes) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(sock))
    s.sendall(data)
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
        if b"\r\n\r\n" in out:
            head, _, body = out.partition(b"\r\n\r\n")
            n = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0)
            if len(body) >= n:
                break
    s.close()
    return out


def test_malformed_requests_get_errors_and_the_agent_keeps_answering(rig) -> None:
    _tmp, _fake, start = rig
    a = start()
    sock = a.cfg.api.socket
    assert b" 400 " in raw(sock, b"GARBAGE\r\n\r\n").split(b"\r\n")[0]
    r = raw(sock, b"POST /checkpoint HTTP/1.1\r\nContent-Length: 5\r\n\r\n{nope")
    assert b"400" in r.split(b"\r\n")[0]
    assert b"not JSON" in r
    r = raw(sock, b"POST /checkpoint HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n")
    assert b"413" in r.split(b"\r\n")[0]
    r = raw(sock, b'POST /checkpoint HTTP/1.1\r\nContent-Length: 18\r\n\r\n{"trigger": "now"}')
    assert b"400" in r.split(b"\r\n")[0]
    assert b"trigger must be" in r
    with AgentClient(sock) as c:
        with pytest.raises(AgentApiError, match="404"):
            c.request("GET", "/nope")
        with pytest.raises(AgentApiError, match="404"):
            c.request("GET", "/checkpoint/12345")
        assert c.request("GET", "/health")["ok"] is True


def test_odd_ticket_ids_are_a_400_and_control_characters_reach_the_logs_escaped(rig, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    _tmp, _fake, start = rig
    a = start()
    sock = a.cfg.api.socket
    with caplog.at_level(logging.DEBUG):
        # "\xb2" is "²" in the request line's latin-1: str.isdigit() says yes, int() says no
        r = raw(sock, b"GET /checkpoint/\xb2 HTTP/1.1\r\n\r\n")
        assert b" 400 " in r.split(b"\r\n")[0], r
        r = raw(sock, b"GET /checkpoint/\x1b[2J\x07 HTTP/1.1\r\n\r\n")
        assert r.split(b"\r\n")[0].split(b" ")[1] in (b"400", b"404"), r
    assert not any("\x1b" in rec.getMessage() or "\x07" in rec.getMessage() for rec in caplog.records)
    with AgentClient(sock) as c:
        assert c.request("GET", "/health")["ok"] is True


def test_status_answers_while_a_checkpoint_is_running(rig) -> None:
    _tmp, fake, start = rig
    a = start()
    fake.gate = threading.Event()
    a.request_checkpoint("request")
    time.sleep(0.2)
    with AgentClient(a.cfg.api.socket, timeout=5) as c:
        t0 = time.monotonic()
        st = c.request("GET", "/status")
        assert time.monotonic() - t0 < 2
    assert st["operation"]["state"] == "capturing"
    fake.gate.set()


def test_metrics_count_checkpoints_by_outcome(rig) -> None:
    import socket as s

    with s.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _tmp, fake, start = rig
    a = start(metrics_address=f"127.0.0.1:{port}")
    t = a.request_checkpoint("request")
    assert t.done.wait(20)
    fake.fail_capture = "boom"
    t = a.request_checkpoint("periodic")
    assert t.done.wait(20)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'gpuckpt_checkpoints_total{outcome="ok",trigger="request"} 1.0' in text
    assert 'gpuckpt_checkpoints_total{outcome="failed",trigger="periodic"} 1.0' in text
    assert "gpuckpt_last_checkpoint_age_seconds" in text
    assert "gpuckpt_bytes_written_total" in text


# -- systemd notify ---------------------------------------------------------------------------------


def test_readiness_status_and_watchdog_reach_a_real_notify_socket(rig, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp, _fake, _start = rig
    path = tmp / "notify.sock"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(path))
    rx.settimeout(10)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # ping every 0.2 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    a = Agent(make_cfg(tmp), notifier=Notifier())
    a.start()
    try:
        msgs: list[str] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any("WATCHDOG=1" in m for m in msgs):
            msgs.append(rx.recv(4096).decode())
        ready = [m for m in msgs if "READY=1" in m]
        assert ready, msgs
        assert "STATUS=ready: worker w0" in ready[0]
        assert any("WATCHDOG=1" in m for m in msgs)
        a.shutdown(final=True)
        rest = []
        rx.settimeout(1)
        try:
            while True:
                rest.append(rx.recv(4096).decode())
        except TimeoutError:
            pass
        assert any("STOPPING=1" in m for m in rest), rest
        assert any("checkpointing (stop)" in m for m in rest), rest
    finally:
        rx.close()


def test_cli_checkpoint_and_status_through_the_agent(rig) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    tmp, fake, start = rig
    a = start()
    runner = CliRunner()
    r = runner.invoke(app, ["checkpoint", "--agent", str(a.cfg.api.socket), "--wait", "--json"])
    assert r.exit_code == 0, r.output
    t = json.loads(r.stdout)
    assert t["state"] == "done"
    r = runner.invoke(app, ["status", "--agent", str(a.cfg.api.socket), "--json"])
    assert json.loads(r.stdout)["last_checkpoint"]["id"] == t["checkpoint"]
    fake.fail_capture = "worker gone"
    r = runner.invoke(app, ["checkpoint", "--agent", str(a.cfg.api.socket), "--wait"])
    assert r.exit_code == 1
    assert "checkpoint failed" in r.output
    assert "worker gone" in r.output
    r = runner.invoke(app, ["status", "--agent", str(tmp / "nobody.sock"), "--json"])
    assert r.exit_code == 7, r.output
    assert json.loads(r.stdout)["error"]["type"] == "ServiceUnavailable"


def test_launch_runs_vllm_serve_as_the_api_server_module_of_its_own_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent import engines
    from agent.engines.vllm.engine import _api_server_argv as vllm_serve_argv

    script = tmp_path / "vllm"
    script.write_text("#!/opt/venv/bin/python3.11\nimport sys\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    argv = vllm_serve_argv(["vllm", "serve", "meta/llama", "--port", "9000"])
    assert argv == [
        "/opt/venv/bin/python3.11",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "meta/llama",
        "--port",
        "9000",
    ]
    # Anything else is run as given.
    assert vllm_serve_argv(["python", "-m", "x"]) == ["python", "-m", "x"]
    # a vLLM whose own CLI starts (the CUDA wheels: make test's version venvs): `vllm serve`, the
    # form vLLM 0.34 does not deprecate, is run as given
    for cli in sorted(ROOT.glob(".venv-vllm-*/bin/vllm")):
        assert vllm_serve_argv([str(cli), "serve", "m", "--port", "9"]) == [str(cli), "serve", "m", "--port", "9"]
        assert engines.for_command([str(cli), "serve", "m"]).name == "vllm"
    # and the command says which engine launch configures
    assert engines.for_command(["vllm", "serve", "meta/llama"]).name == "vllm"
    assert engines.for_command(["python", "-m", "sglang.launch_server", "--model-path", "m"]).name == "sglang"
    with pytest.raises(ckpt.ConfigError, match="cannot tell which engine"):
        engines.for_command(["python", "-m", "x"])


def test_launch_refuses_a_command_that_sets_its_own_connector(short_tmp: Path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    r = CliRunner().invoke(
        app,
        [
            "launch",
            "--runtime-dir",
            str(short_tmp),
            "--repo",
            str(short_tmp / "repo"),
            "--",
            "vllm",
            "serve",
            "m",
            "--kv-transfer-config",
            "{}",
        ],
    )
    assert r.exit_code == 2
    assert "already has --kv-transfer-config" in r.output
    # a command of no engine gpuckpt knows is refused, named
    r = CliRunner().invoke(
        app, ["launch", "--runtime-dir", str(short_tmp), "--repo", str(short_tmp / "repo"), "--", "python", "-m", "x"]
    )
    assert r.exit_code == 2
    assert "cannot tell which engine" in r.output


def test_restore_dry_run_prints_the_compatibility_table_and_exits_5_when_refused(rig) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    tmp, fake, start = rig
    a = start()
    t = a.request_checkpoint("request")
    assert t.done.wait(20)
    runner = CliRunner()
    args = ["restore", t.checkpoint, "--repo", str(tmp / "repo"), "--connector-socket", str(tmp / "conn.sock")]
    r = runner.invoke(app, [*args, "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["warm"] is True
    assert plan["blocks"] == 16
    # The new worker runs another block size: refused, naming the rule and both values.
    fake.facts = lambda: {**FakeConnector.facts(fake), "block_size": 32}  # type: ignore[method-assign]
    r = runner.invoke(app, [*args, "--dry-run", "--json"])
    assert r.exit_code == 5, r.output
    plan = json.loads(r.stdout)
    assert plan["warm"] is False
    assert any("block_size" in x and "16" in x and "32" in x for x in plan["reasons"]), plan["reasons"]
    r = runner.invoke(app, [*args, "--dry-run"])
    assert r.exit_code == 5
    assert "cold: replay the ledger" in r.output


class _HoldingClient:
    """A worker's client as the restore sees it: each renewal of the retry hold recorded, the
    worker's answer (the seconds the hold has left) as the test sets it."""

    def __init__(self, answer: float = 30.0, fail_first: bool = False) -> None:
        self.calls: list[float] = []
        self.answer = answer
        self.fail_first = fail_first
        self.cond = threading.Condition()

    def hold_retries(self, seconds: float) -> float:
        with self.cond:
            self.calls.append(seconds)
            self.cond.notify_all()
            if self.fail_first and len(self.calls) == 1:
                raise httpx.ConnectError("the worker's server is restarting")
            return self.answer

    def wait_calls(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.calls) >= n, timeout=60), self.calls


def test_the_restore_keeps_renewing_the_workers_retry_hold_until_it_is_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """However long the restore runs (a large checkpoint from a bucket), the agent keeps the
    worker's server holding possible retries by renewing a short lease; a failed renewal is
    retried; after ``stop`` nothing renews (the agent says what it resubmits next)."""
    from agent.daemon import restore_at_start as ras

    monkeypatch.setattr(ras, "HOLD_RENEW_S", 0.01)
    client = _HoldingClient(fail_first=True)
    hold = ras._RetryHold(client)  # type: ignore[arg-type]
    hold.start()
    client.wait_calls(4)  # a restore several leases long; the first renewal failed and was retried
    hold.stop()
    assert hold._thread is not None
    hold._thread.join(60)
    assert not hold._thread.is_alive(), "nothing renews after stop"
    assert set(client.calls) == {ras.HOLD_LEASE_S}
    # a worker that holds nothing (released, no middleware): one try, then no thread
    quiet = _HoldingClient(answer=0.0)
    idle = ras._RetryHold(quiet)  # type: ignore[arg-type]
    idle.start()
    assert idle._thread is not None
    idle._thread.join(60)
    assert not idle._thread.is_alive()
    assert quiet.calls == [ras.HOLD_LEASE_S]
    # an engine whose client has no hold (SGLang): nothing to renew
    none = ras._RetryHold(object())  # type: ignore[arg-type]
    none.start()
    assert none._thread is None
    none.stop()
