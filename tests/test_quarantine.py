"""The crash-loop record (:mod:`agent.daemon.quarantine`): what a restore leaves out, and every way a
record that is not the agent's own is refused by name (the restore then goes on as if there were
none). The end-to-end behaviour, through ``gpuckpt launch`` and a request that kills the engine, is
``tests/vllm/test_crash_loop.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agent.daemon import quarantine as q

AT = "2026-12-07T00:00:00Z"


def test_a_recorded_request_is_left_out_of_every_restore_that_holds_it(tmp_path: Path) -> None:
    p = q.path_for(tmp_path, "w1")
    assert q.verdict(p, worker_id="w1", checkpoint="c1", ledger_ids=["a", "b"]) == q.Verdict()
    q.record(p, worker_id="w1", checkpoint="c1", requests=["a"], why="3 s after the restore of c1", at=AT)
    assert p.stat().st_mode & 0o777 == 0o600
    v = q.verdict(p, worker_id="w1", checkpoint="c1", ledger_ids=["a", "b"])
    assert list(v.quarantined) == ["a"]
    assert "the worker died running it (once; 3 s after the restore of c1)" in v.quarantined["a"]
    assert v.refused is None
    # a later checkpoint that captured it again (a retry served anew): left out there too
    assert list(q.verdict(p, worker_id="w1", checkpoint="c2", ledger_ids=["a"]).quarantined) == ["a"]
    # twice: counted, and kept with every checkpoint it died in
    q.record(p, worker_id="w1", checkpoint="c2", requests=["a"], why="2 s after the restore of c2", at=AT)
    body = json.loads(p.read_text())["body"]
    assert body["requests"]["a"]["count"] == 2
    assert body["requests"]["a"]["checkpoints"] == ["c1", "c2"]
    assert "2 times" in q.verdict(p, worker_id="w1", checkpoint="c2", ledger_ids=["a"]).quarantined["a"]


def _planted(p: Path, mutate: str) -> None:
    q.record(p, worker_id="w1", checkpoint="c1", requests=["a"], why="x", at=AT)
    if mutate == "corrupt":
        doc = json.loads(p.read_text())
        doc["body"]["requests"]["b"] = doc["body"]["requests"]["a"]  # the checksum no longer matches
        p.write_text(json.dumps(doc))
    elif mutate == "not json":
        p.write_bytes(b"\x00garbage")
    elif mutate == "other account":
        os.chown(p, 65534, 65534)
    elif mutate == "world-writable":
        os.chmod(p, 0o666)  # noqa: S103 - the planted case under test
    elif mutate == "symlink":
        real = p.with_name("elsewhere.json")
        p.rename(real)
        p.symlink_to(real)
    elif mutate == "unknown request":
        doc = json.loads(p.read_text())
        body = doc["body"]
        body["requests"]["zzz"] = body["requests"].pop("a")
        doc["checksum"] = q._checksum(body)
        p.write_text(json.dumps(doc))
    elif mutate == "other worker":
        doc = json.loads(p.read_text())
        doc["body"]["worker_id"] = "w9"
        doc["checksum"] = q._checksum(doc["body"])
        p.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("mutate", "named"),
    [
        ("corrupt", "checksum does not match"),
        ("not json", "refused"),
        ("other account", "owned by"),
        ("world-writable", "mode"),
        ("symlink", "symlink"),
        ("unknown request", "'zzz', not in checkpoint c1"),
        ("other worker", "worker 'w9'"),
    ],
)
def test_a_record_that_is_not_the_agent_s_own_is_refused_by_name(tmp_path: Path, mutate: str, named: str) -> None:
    if mutate == "other account" and os.geteuid() != 0:
        pytest.skip("giving a file to another account needs root")
    p = q.path_for(tmp_path, "w1")
    _planted(p, mutate)
    v = q.verdict(p, worker_id="w1", checkpoint="c1", ledger_ids=["a"])
    assert v.quarantined == {}, "the restore goes on as if there were none"
    assert v.refused is not None
    assert str(p) in v.refused
    assert named in v.refused, v.refused
    # the agent's next record replaces what it could not read (a symlink is replaced, never followed)
    if mutate not in ("other account", "unknown request"):
        q.record(p, worker_id="w1", checkpoint="c1", requests=["a"], why="y", at=AT)
        assert list(q.verdict(p, worker_id="w1", checkpoint="c1", ledger_ids=["a"]).quarantined) == ["a"]


def test_only_a_worker_that_died_soon_after_its_restore_quarantines_what_it_was_running(tmp_path: Path) -> None:
    """The agent records on the worker's death only: what the resubmission had not finished, and
    only within the window after it started. Nothing when nothing was running (an agent that
    itself crashed never calls this: nothing is recorded)."""
    import time
    from types import SimpleNamespace

    from agent.daemon.restore_at_start import RestoreAtStart

    r = RestoreAtStart.__new__(RestoreAtStart)
    import threading

    r._lock, r._death = threading.Lock(), threading.Lock()
    r.cfg = SimpleNamespace(worker_id="w1")  # type: ignore[assignment]
    r._quarantine = q.path_for(tmp_path, "w1")
    r._resubmitted_at, r._checkpoint, r._pending, r._died = None, None, set(), None
    assert r.worker_died() == [], "no restore resubmitted anything"
    r._resubmitted_at, r._checkpoint, r._pending, r._died = time.monotonic(), "c1", {"a", "b"}, None
    r._finished("b")
    assert r.worker_died() == ["a"]
    assert r.worker_died() == ["a"], "one death, one record: a second witness is told the first's"
    assert json.loads(r._quarantine.read_text())["body"]["requests"]["a"]["count"] == 1
    assert list(q.verdict(r._quarantine, worker_id="w1", checkpoint="c1", ledger_ids=["a", "b"]).quarantined) == ["a"]
    r._quarantine.unlink()
    r._resubmitted_at, r._died = time.monotonic() - q.WINDOW_S - 1, None
    assert r.worker_died() == [], "long after the restore: not taken for its crash"
    assert not r._quarantine.exists()


def test_a_resubmission_that_fails_because_the_worker_died_quarantines_without_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's pod has no ``launch`` to see the worker die: the agent's own resubmission does
    (its requests fail, and the worker no longer answers on its control socket). One that fails
    while the worker still answers (a refused request) quarantines nothing."""
    import threading
    import time
    from types import SimpleNamespace

    from agent.daemon import restore_at_start
    from agent.daemon.restore_at_start import RestoreAtStart, RestoreReport

    monkeypatch.setattr(restore_at_start, "WORKER_GONE_WAIT_S", 0.3)

    def restorer(alive: bool) -> RestoreAtStart:
        r = RestoreAtStart.__new__(RestoreAtStart)
        r._lock, r._death, r._died = threading.Lock(), threading.Lock(), None
        r._report = RestoreReport(started_at=AT)
        r._parts = 2  # this and the planning thread's own
        r.cfg = SimpleNamespace(worker_id="w1")  # type: ignore[assignment]
        r._quarantine = q.path_for(tmp_path, "w1")
        r._resubmitted_at, r._checkpoint, r._pending = time.monotonic(), "c1", {"a", "b"}

        def ping() -> None:
            if not alive:
                raise ConnectionRefusedError("no worker")

        r.engine = SimpleNamespace(channel=SimpleNamespace(ping=ping))  # type: ignore[assignment]
        return r

    class Client:
        def submit(self, requests: Any, **kw: Any) -> Any:
            kw["on_done"]("b")
            raise OSError("the engine died")

        def close(self) -> None:
            pass

    alive = restorer(True)
    alive._resubmit(Client(), [])  # type: ignore[arg-type]
    assert alive.report is not None
    assert alive.report.resubmission["state"] == "failed"  # type: ignore[index]
    assert not alive._quarantine.exists()
    dead = restorer(False)
    dead._resubmit(Client(), [])  # type: ignore[arg-type]
    assert list(q.verdict(dead._quarantine, worker_id="w1", checkpoint="c1", ledger_ids=["a", "b"]).quarantined) == [
        "a"
    ]
    assert dead.worker_died() == ["a"], "one death, one record: launch seeing it too is told the same"
    assert json.loads(dead._quarantine.read_text())["body"]["requests"]["a"]["count"] == 1
