"""A crash loop is broken, not repeated: the requests a worker was running when it died soon after a
restore, recorded so that the next restore of that checkpoint resubmits none of them.

vLLM has requests that kill its engine (a model's NaN under one penalty, a seeded chunked prefill
on the CPU build). Once such a request is in a checkpoint's ledger, each restore resubmits it and
the engine dies again. So when ``gpuckpt launch`` sees its worker die within :data:`WINDOW_S` of a
restore's resubmission, with resubmitted requests still running, the agent records those requests
(:func:`record`) in a file beside the worker, in the runtime directory that ``launch`` and the
relaunched agent share; the next restore of that checkpoint leaves them to their clients
(``X-Gpuckpt-Attach: new: quarantined …``: a client's retry runs it anew — one crash per client
attempt, never one per restore), restores everything else warm, and reports them. A quarantined
request is never resubmitted again, from any checkpoint of the worker that holds it (a client's
retry served anew and captured by a later checkpoint included).

Only a live agent that saw its worker die writes the record: an agent that crashed (or was
killed) itself never quarantines anything. The record is the agent's own: a file that is not
(another account's, a symlink, group- or world-writable), that does not parse or whose checksum
does not match, or that names requests the checkpoint does not hold, is refused by name and the
restore goes on as if there were none.

Format ``gpuckpt-quarantine`` version 1 (JSON)::

    {"format": "gpuckpt-quarantine", "version": 1, "checksum": sha256 of the canonical body,
     "body": {"worker_id": str,
              "requests": {client request id: {"count": times quarantined,
                                               "checkpoints": [checkpoint ids],
                                               "why": str, "at": ISO time}}}}
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent import fs

log = logging.getLogger("gpuckpt.agent")

FORMAT = "gpuckpt-quarantine"
VERSION = 1
#: a worker that dies this soon after its restore's resubmission started is taken for crashed by
#: what it resubmitted
WINDOW_S = 300.0
#: how many deaths the report names as such ("2 times")
NEVER_AFTER = 2
#: the record's size bound (a ledger of thousands of requests fits many times over)
MAX_BYTES = 4 << 20


@dataclass(frozen=True)
class Verdict:
    """What a restore of ``checkpoint`` leaves out: each quarantined request and why; ``refused``:
    why the record was not used (``None``: it was, or there was none)."""

    quarantined: dict[str, str] = field(default_factory=dict)
    refused: str | None = None


def path_for(runtime_dir: str | os.PathLike[str], worker_id: str) -> Path:
    """Where a worker's record lives: beside its sockets, in the runtime directory ``launch`` uses."""
    return Path(runtime_dir) / f"{worker_id}.quarantine.json"


def _checksum(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _load(path: Path) -> dict[str, Any] | None:
    """The record's body (``None``: there is none); :class:`ValueError` or :class:`fs.UnsafePath`
    naming why it cannot be used."""
    try:
        fd = fs.open_checked(path, directory=path.parent, trust=fs.Trust.of())
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ValueError(f"over {MAX_BYTES} bytes")
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(f"not a version-{VERSION} {FORMAT} record")
    body = doc.get("body")
    if not isinstance(body, dict) or doc.get("checksum") != _checksum(body):
        raise ValueError("its checksum does not match its body (corrupt)")
    reqs = body.get("requests")
    if not isinstance(reqs, dict):
        raise ValueError("its requests are not an object")
    for rid, e in reqs.items():
        if not (
            isinstance(e, dict)
            and isinstance(e.get("count"), int)
            and e["count"] >= 1
            and isinstance(e.get("checkpoints"), list)
            and all(isinstance(c, str) for c in e["checkpoints"])
            and isinstance(e.get("why"), str)
        ):
            raise ValueError(f"its entry for {rid!r} is malformed")
    return body


def verdict(path: Path, *, worker_id: str, checkpoint: str, ledger_ids: Iterable[str]) -> Verdict:
    """Which requests of ``checkpoint`` (its ledger's ``ledger_ids``) a restore leaves out: every
    quarantined one it holds — from this checkpoint or a later one of this worker that captured
    it again (a request is its client's id): never resubmitted by any restore. A record that
    cannot be used is refused, named, and nothing is left out."""
    try:
        body = _load(path)
    except (OSError, ValueError, fs.UnsafePath) as exc:
        why = f"the quarantine record {path} is refused: {exc}"
        log.error(why)
        return Verdict(refused=why)
    if body is None:
        return Verdict()
    if body.get("worker_id") != worker_id:
        why = f"the quarantine record {path} is refused: it is worker {body.get('worker_id')!r}'s, not {worker_id!r}'s"
        log.error(why)
        return Verdict(refused=why)
    ids = set(ledger_ids)
    out: dict[str, str] = {}
    for rid, e in body["requests"].items():
        mine = checkpoint in e["checkpoints"]
        if mine and rid not in ids:
            why = f"the quarantine record {path} is refused: it names {rid!r}, not in checkpoint {checkpoint}"
            log.error(why)
            return Verdict(refused=why)
        if rid in ids:
            times = f"{e['count']} times" if e["count"] >= NEVER_AFTER else "once"
            out[rid] = f"quarantined: the worker died running it ({times}; {e['why']})"[:200]
    return Verdict(quarantined=out)


def record(path: Path, *, worker_id: str, checkpoint: str, requests: Iterable[str], why: str, at: str) -> None:
    """Add ``requests`` (running when the worker died after restoring ``checkpoint``) to the record,
    durably (written whole, then renamed over the old one; the agent's account only). A record
    that cannot be used is replaced."""
    try:
        body = _load(path) or {"worker_id": worker_id, "requests": {}}
    except (OSError, ValueError, fs.UnsafePath) as exc:
        log.warning("replacing a quarantine record that cannot be used", extra={"path": str(path), "error": str(exc)})
        body = {"worker_id": worker_id, "requests": {}}
    body["worker_id"] = worker_id
    reqs = body["requests"]
    for rid in requests:
        e = reqs.get(rid) or {"count": 0, "checkpoints": [], "why": why, "at": at}
        e["count"] += 1
        e["checkpoints"] = [*[c for c in e["checkpoints"] if c != checkpoint], checkpoint][-8:]
        e["why"], e["at"] = why, at
        reqs[rid] = e
    doc = {"format": FORMAT, "version": VERSION, "checksum": _checksum(body), "body": body}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(doc, separators=(",", ":")).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
