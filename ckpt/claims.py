"""Claims (FORMAT.md §13): how a replacement worker adopts exactly one orphaned checkpoint.

A worker of a *pool* (a Deployment's pods: new names on every replacement) restores at start a
checkpoint its pool left behind: a *final* one (taken at stop, drain or preemption) that is its
worker's newest, so that worker is gone. Several new workers start at once, so each checkpoint
is taken by a **claim**: a small document created with a conditional create, which exactly one
of any number of racing claimants wins (S3 ``If-None-Match: *``, ``link(2)`` locally).

Objects, under a prefix of their own that gc, verify and the readers of checkpoints never list::

    claims/<worker id>/<checkpoint id>/<generation>   a claim: 8 digits, 00000001 upward
    claims/<worker id>/<checkpoint id>/done           the outcome; the checkpoint is never adopted again
    claims/<worker id>/<checkpoint id>/clock-<32 hex> a claimant's probe of the store's clock (deleted at once)

The contract:

* **One holder.** Generation *n + 1* can only be created (conditionally) once generation *n*
  was released, or its lease ran out: its object was not rewritten for ``lease_s`` by the
  **store's** clock (its modification time against a probe object's, both stamped by the
  store), so the claimants' clocks never enter. The holder rewrites its generation every
  ``lease_s / 4`` (:meth:`Claim.renew`), and counts itself lost, on its own monotonic clock,
  once ``lease_s / 2`` passed without a renewal that landed — before any other claimant can
  see the lease as run out (the store stamps a rewrite no earlier than it was sent; clock
  *rates* differ by far less than the margin), so two live holders need a renewal that took
  longer than half the lease to land.
* **Nothing restored twice.** ``done`` is created once (conditionally) by the holder when the
  restore finished, warm or cold; a checkpoint with ``done`` is never claimed again. A holder
  that finds a later generation on the store has lost its claim and writes nothing more.
* **No bouncing.** A checkpoint claimed :data:`MAX_ATTEMPTS` times without a ``done`` (each
  claimant died or released it) is given up: the next claimant writes ``done`` with the outcome
  ``abandoned`` instead of claiming it.
* **Refused by name.** A claim object that does not read (malformed, planted, an unknown
  version) makes its checkpoint unclaimable, with an error naming the object; nothing is
  deleted or overwritten. Names under ``claims/`` that do not fit the tree are ignored.

This module knows nothing of agents or engines: the agent's restore at start
(``agent/daemon/restore_at_start.py``) composes :func:`candidates`, :func:`try_claim` and
:class:`Claim`.
"""

from __future__ import annotations

import logging
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from ckpt.document import open_envelope, seal
from ckpt.errors import (
    CheckpointNotFound,
    FormatError,
    GpuckptError,
    IntegrityError,
    ObjectExists,
    ObjectNotFound,
    OperationAborted,
)
from ckpt.keys import Keyring
from ckpt.manifest import (
    MAX_CLOCK_SKEW,
    CheckpointInfo,
    Manifest,
    by_store_time,
    check_worker_id,
    is_worker_id,
    list_checkpoints,
    read_manifest,
)
from ckpt.store.base import Store

__all__ = [
    "DEFAULT_LEASE_S",
    "FINAL_TRIGGERS",
    "MAX_ATTEMPTS",
    "POOL_LABEL",
    "PREFIX",
    "TRIGGER_LABEL",
    "Candidate",
    "Claim",
    "ClaimLost",
    "ClaimState",
    "Done",
    "Refusal",
    "candidates",
    "done_names",
    "is_final",
    "read_state",
    "store_now",
    "try_claim",
]

log = logging.getLogger("gpuckpt.claims")

PREFIX = "claims/"
KIND = "gpuckpt-claim"
DONE_KIND = "gpuckpt-claim-done"
VERSION = 1
SUPPORTED = (1,)
#: the labels an agent writes into a checkpoint's manifest: what started it, and its worker's pool
TRIGGER_LABEL = "trigger"
POOL_LABEL = "pool"
#: a checkpoint taken because its worker was going away: the worker's last words
FINAL_TRIGGERS = frozenset({"stop", "drain", "preemption"})
DEFAULT_LEASE_S = 300.0
MAX_ATTEMPTS = 3
#: the store stamps modification times to the second (S3 ``Last-Modified``): never judge closer
STAMP_SLACK_S = 2.0
MAX_CLAIM_BYTES = 64 << 10
_GENERATION = re.compile(r"^[0-9]{8}$")
_WORKER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HOSTNAME = socket.gethostname()

Outcome = Literal["warm", "cold", "failed", "abandoned"]


class ClaimLost(OperationAborted):
    """This worker no longer holds its claim: a later generation exists (its lease ran out
    while it could not renew), or a renewal could not land within half the lease."""


# -- names ---------------------------------------------------------------------------------------


def prefix_of(worker_id: str, checkpoint_id: str) -> str:
    return f"{PREFIX}{check_worker_id(worker_id)}/{checkpoint_id}/"


def generation_name(worker_id: str, checkpoint_id: str, generation: int) -> str:
    return f"{prefix_of(worker_id, checkpoint_id)}{generation:08d}"


def done_name(worker_id: str, checkpoint_id: str) -> str:
    return prefix_of(worker_id, checkpoint_id) + "done"


# -- documents -----------------------------------------------------------------------------------

_CLAIM_FIELDS = {"claimant", "worker_id", "checkpoint", "generation", "state", "lease_s", "pool", "hostname", "at"}
_DONE_FIELDS = {"claimant", "worker_id", "checkpoint", "generation", "outcome", "reason", "at"}


@dataclass(frozen=True)
class ClaimDoc:
    """One generation's document (plain: it holds nothing its name does not already say, but
    the claimant and its host). ``state``: ``active`` or ``released``; ``at``: the claimant's
    clock at the write, informational (the lease is judged by the store's clock)."""

    claimant: str
    worker_id: str
    checkpoint: str
    generation: int
    state: Literal["active", "released"]
    lease_s: float
    pool: str | None
    hostname: str
    at: float
    mtime: float = 0.0  # the store's clock at the last write (not stored in the body)

    def body(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in sorted(_CLAIM_FIELDS)}


@dataclass(frozen=True)
class Done:
    """``done``: who finished the restore of this checkpoint, how, and why."""

    claimant: str
    worker_id: str
    checkpoint: str
    generation: int
    outcome: str
    reason: str
    at: float

    def body(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in sorted(_DONE_FIELDS)}


def _check_body(name: str, body: dict[str, Any], fields: set[str]) -> None:
    if set(body) != fields:
        raise FormatError(f"{name}: not a claim gpuckpt writes: fields {sorted(body)}, expected {sorted(fields)}")


def _decode_claim(name: str, data: bytes, mtime: float, worker_id: str, checkpoint_id: str) -> ClaimDoc:
    if len(data) > MAX_CLAIM_BYTES:
        raise FormatError(f"{name}: {len(data)} bytes, more than a claim's {MAX_CLAIM_BYTES}")
    _v, body = open_envelope(data, kind=KIND, supported=SUPPORTED, name=name, keyring=None)
    _check_body(name, body, _CLAIM_FIELDS)
    gen = int(name.rsplit("/", 1)[1])
    ok = (
        isinstance(body["claimant"], str)
        and _WORKER.match(body["claimant"]) is not None
        and body["worker_id"] == worker_id
        and body["checkpoint"] == checkpoint_id
        and type(body["generation"]) is int
        and body["generation"] == gen
        and body["state"] in ("active", "released")
        and isinstance(body["lease_s"], (int, float))
        and not isinstance(body["lease_s"], bool)
        and 0 < body["lease_s"] <= 86400
        and (body["pool"] is None or isinstance(body["pool"], str))
        and isinstance(body["hostname"], str)
        and isinstance(body["at"], (int, float))
    )
    if not ok:
        raise FormatError(f"{name}: a claim whose fields do not fit its name or its schema")
    return ClaimDoc(**body, mtime=mtime)


def _decode_done(name: str, data: bytes, worker_id: str, checkpoint_id: str) -> Done:
    if len(data) > MAX_CLAIM_BYTES:
        raise FormatError(f"{name}: {len(data)} bytes, more than a claim's {MAX_CLAIM_BYTES}")
    _v, body = open_envelope(data, kind=DONE_KIND, supported=SUPPORTED, name=name, keyring=None)
    _check_body(name, body, _DONE_FIELDS)
    ok = (
        isinstance(body["claimant"], str)
        and body["worker_id"] == worker_id
        and body["checkpoint"] == checkpoint_id
        and type(body["generation"]) is int
        and isinstance(body["outcome"], str)
        and isinstance(body["reason"], str)
        and isinstance(body["at"], (int, float))
    )
    if not ok:
        raise FormatError(f"{name}: a done record whose fields do not fit its name or its schema")
    return Done(**body)


# -- the state of one checkpoint's claims --------------------------------------------------------


@dataclass(frozen=True)
class ClaimState:
    """What the store says of one checkpoint's claims: its ``done`` record, its latest
    generation (with the store's time of its last write) and how many generations there are."""

    worker_id: str
    checkpoint: str
    done: Done | None = None
    latest: ClaimDoc | None = None
    generations: int = 0


def read_state(store: Store, worker_id: str, checkpoint_id: str) -> ClaimState:
    """The claims of checkpoint ``worker_id/checkpoint_id``. Raises :class:`FormatError` (or
    :class:`~ckpt.errors.UnsupportedVersion`, :class:`~ckpt.errors.IntegrityError`) naming a
    claim object that does not read: the checkpoint is then not to be claimed."""
    pre = prefix_of(worker_id, checkpoint_id)
    gens: dict[int, float] = {}
    has_done = False
    for o in store.list(pre):
        leaf = o.name[len(pre) :]
        if _GENERATION.match(leaf):
            gens[int(leaf)] = o.mtime
        elif leaf == "done":
            has_done = True
        # anything else (a clock probe, a name that does not fit) is not a claim: left alone
    done = None
    if has_done:
        name = done_name(worker_id, checkpoint_id)
        try:
            done = _decode_done(name, store.get(name), worker_id, checkpoint_id)
        except ObjectNotFound:
            done = None
    latest = None
    if gens:
        n = max(gens)
        name = generation_name(worker_id, checkpoint_id, n)
        try:
            st = store.stat(name)
            latest = _decode_claim(name, store.get(name), st.mtime, worker_id, checkpoint_id)
        except ObjectNotFound:  # deleted under us (gc of a checkpoint that is gone)
            latest = None
    return ClaimState(worker_id, checkpoint_id, done, latest, max(gens) if gens else 0)


def store_now(store: Store, worker_id: str, checkpoint_id: str) -> float:
    """The store's clock now: the modification time it stamps on a probe object beside the
    claims (deleted again; one a crash leaves is not a claim, and goes with the claims)."""
    name = f"{prefix_of(worker_id, checkpoint_id)}clock-{secrets.token_hex(16)}"
    store.put(name, b"")
    try:
        return store.stat(name).mtime
    finally:
        store.delete(name)


def expired(doc: ClaimDoc, now: float) -> bool:
    """Whether ``doc``'s lease ran out by the store's clock ``now`` (its mtime is the store's)."""
    return now - doc.mtime > doc.lease_s + STAMP_SLACK_S


# -- claiming ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """Why a checkpoint was not claimed (for the restore report and logs)."""

    worker_id: str
    checkpoint: str
    reason: str

    def __str__(self) -> str:
        return f"{self.worker_id}/{self.checkpoint}: {self.reason}"


def _put_done(store: Store, done: Done) -> bool:
    """Create ``done`` (conditionally); False if one exists already (it stands)."""
    name = done_name(done.worker_id, done.checkpoint)
    try:
        store.put(name, seal(DONE_KIND, VERSION, name, done.body(), None), if_absent=True)
    except ObjectExists:
        return False
    return True


def try_claim(
    store: Store,
    worker_id: str,
    checkpoint_id: str,
    claimant: str,
    *,
    pool: str | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    clock: Callable[[], float] | None = None,
    max_attempts: int = MAX_ATTEMPTS,
) -> Claim | Refusal:
    """Claim checkpoint ``worker_id/checkpoint_id`` for ``claimant``: the held :class:`Claim`,
    or why not (adopted already, held by a live claimant, a race lost, a claim that does not
    read, given up after ``max_attempts``). ``clock`` is the store's time now (default: a probe
    object's modification time; tests inject one). Never raises for a claim object that does
    not read — that is a refusal naming it; store errors propagate."""
    check_worker_id(claimant)

    def refuse(reason: str) -> Refusal:
        return Refusal(worker_id, checkpoint_id, reason)

    try:
        state = read_state(store, worker_id, checkpoint_id)
    except (FormatError, IntegrityError) as exc:
        log.warning("a claim object does not read: the checkpoint is left alone", extra={"error": str(exc)})
        return refuse(f"refused: {exc}")
    if state.done is not None:
        d = state.done
        return refuse(f"done: {d.outcome} by {d.claimant} ({d.reason})")
    nxt = 1
    if state.latest is not None:
        doc = state.latest
        if doc.state == "active":
            now = clock() if clock is not None else store_now(store, worker_id, checkpoint_id)
            if not expired(doc, now):
                left = doc.lease_s - (now - doc.mtime)
                return refuse(f"held by {doc.claimant} (generation {doc.generation}, lease {left:.0f}s left)")
            log.warning(
                "taking over a claim whose lease ran out",
                extra={"claim": generation_name(worker_id, checkpoint_id, doc.generation), "holder": doc.claimant},
            )
        nxt = state.generations + 1
    elif state.generations:
        nxt = state.generations + 1  # the latest vanished under us: never reuse its number
    if nxt > max_attempts:
        reason = f"given up after {max_attempts} claims that did not finish"
        done = Done(claimant, worker_id, checkpoint_id, nxt - 1, "abandoned", reason, time.time())
        _put_done(store, done)
        log.warning("giving up a checkpoint", extra={"checkpoint": f"{worker_id}/{checkpoint_id}", "reason": reason})
        return refuse(f"abandoned: {reason}")
    claim = Claim(store, worker_id, checkpoint_id, nxt, claimant, pool=pool, lease_s=lease_s)
    try:
        store.put(claim.name, claim._encode("active"), if_absent=True)
    except ObjectExists:
        return refuse(f"another claimant won generation {nxt}")
    claim._landed(time.monotonic())
    return claim


class Claim:
    """A claim this worker holds: generation ``generation`` of checkpoint
    ``worker_id/checkpoint_id``. Keep it with :meth:`renew` (or :meth:`keep`, a thread renewing
    every ``lease_s / 4``); end it with :meth:`finish` (``done``: the checkpoint is never adopted
    again) or :meth:`release` (another claimant may take it at once). Thread-safe."""

    def __init__(
        self,
        store: Store,
        worker_id: str,
        checkpoint_id: str,
        generation: int,
        claimant: str,
        *,
        pool: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.worker_id = worker_id
        self.checkpoint = checkpoint_id
        self.generation = generation
        self.claimant = claimant
        self.pool = pool
        self.lease_s = float(lease_s)
        self.name = generation_name(worker_id, checkpoint_id, generation)
        self.state: Literal["held", "lost", "released", "done"] = "held"
        self.lost_reason: str | None = None
        self._monotonic = monotonic
        self._last_ok = monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Claim({self.name!r}, {self.claimant!r}, {self.state})"

    def _encode(self, state: Literal["active", "released"]) -> bytes:
        doc = ClaimDoc(
            self.claimant,
            self.worker_id,
            self.checkpoint,
            self.generation,
            state,
            self.lease_s,
            self.pool,
            _HOSTNAME,
            time.time(),
        )
        return seal(KIND, VERSION, self.name, doc.body(), None)

    def _landed(self, sent_at: float) -> None:
        self._last_ok = sent_at

    def _superseded(self) -> str | None:
        """Why this claim is no longer ours, from the store: a later generation, or a ``done``
        someone else wrote (a claimant that gave the checkpoint up)."""
        pre = prefix_of(self.worker_id, self.checkpoint)
        for o in self.store.list(pre):
            leaf = o.name[len(pre) :]
            if _GENERATION.match(leaf) and int(leaf) > self.generation:
                return f"generation {int(leaf)} exists: the lease ran out and another claimant took over"
            if leaf == "done":
                return "the checkpoint was marked done by another claimant"
        return None

    def _lose(self, why: str) -> ClaimLost:
        self.state, self.lost_reason = "lost", why
        log.error("claim lost", extra={"claim": self.name, "reason": why})
        return ClaimLost(f"claim {self.name} lost: {why}")

    def renew(self) -> None:
        """Rewrite the claim (the store stamps the new time), then look for a later generation.
        Raises :class:`ClaimLost` when the claim is no longer ours — found so on the store, or a
        renewal that could not land within half the lease (by this host's monotonic clock)."""
        with self._lock:
            if self.state != "held":
                raise ClaimLost(f"claim {self.name} is {self.state}")
            sent = self._monotonic()
            if sent - self._last_ok > self.lease_s / 2:
                raise self._lose(f"no renewal landed for {sent - self._last_ok:.0f}s (half the lease)")
            self.store.put(self.name, self._encode("active"))
            why = self._superseded()
            if why is not None:
                raise self._lose(why)
            self._last_ok = sent

    def keep(self, interval: float | None = None) -> None:
        """Renew on a thread every ``interval`` (default ``lease_s / 4``) until finished, released
        or lost; a failed renewal is retried at the next tick, and counts toward the lapse."""
        every = interval if interval is not None else self.lease_s / 4

        def run() -> None:
            while not self._stop.wait(every):
                try:
                    self.renew()
                except ClaimLost:
                    return
                except GpuckptError as exc:
                    log.warning("claim renewal failed", extra={"claim": self.name, "error": str(exc)})

        self._thread = threading.Thread(target=run, name="gpuckpt-claim-lease", daemon=True)
        self._thread.start()

    def _halt(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def finish(self, outcome: str, reason: str) -> Done:
        """The restore finished (``outcome``: warm, cold, …, ``reason`` why): write ``done``, so
        that the checkpoint is never adopted again. Raises :class:`ClaimLost` if the claim is no
        longer ours (then another claimant restores it, and we write nothing)."""
        self._halt()
        with self._lock:
            if self.state != "held":
                raise ClaimLost(f"claim {self.name} is {self.state}: {self.lost_reason or ''}")
            why = self._superseded()
            if why is not None:
                raise self._lose(why)
            done = Done(self.claimant, self.worker_id, self.checkpoint, self.generation, outcome, reason, time.time())
            _put_done(self.store, done)
            self.state = "done"
        log.info("claim done", extra={"claim": self.name, "outcome": outcome, "reason": reason})
        return done

    def release(self, reason: str) -> None:
        """Give the claim up before restoring anything: another claimant may take the checkpoint
        at once (a later generation). Nothing if the claim is no longer ours."""
        self._halt()
        with self._lock:
            if self.state != "held":
                return
            if self._superseded() is None:
                self.store.put(self.name, self._encode("released"))
            self.state = "released"
        log.info("claim released", extra={"claim": self.name, "reason": reason})


# -- finding a pool's orphaned final checkpoints -------------------------------------------------


def is_final(m: Manifest) -> bool:
    """Whether ``m`` was taken because its worker was going away (stop, drain, preemption)."""
    triggers = set(m.labels.get(TRIGGER_LABEL, "").split(","))
    return bool(triggers & FINAL_TRIGGERS)


@dataclass(frozen=True)
class Candidate:
    """A checkpoint a worker of ``pool`` may adopt: its listing and its manifest."""

    info: CheckpointInfo
    manifest: Manifest = field(repr=False)


def done_names(store: Store) -> set[tuple[str, str]]:
    """(worker id, checkpoint id) of every checkpoint with a ``done`` record, from names alone."""
    out = set()
    for o in store.list(PREFIX):
        parts = o.name[len(PREFIX) :].split("/")
        if len(parts) == 3 and parts[2] == "done" and is_worker_id(parts[0]):
            out.add((parts[0], parts[1]))
    return out


def candidates(
    store: Store,
    keyring: Keyring | None,
    *,
    pool: str,
    trust_domain: str | None,
    exclude: Iterable[str] = (),
    skew: timedelta = MAX_CLOCK_SKEW,
) -> tuple[list[Candidate], list[Refusal]]:
    """The orphaned final checkpoints of ``pool``, newest first (by the store's clock), and why
    the other newest checkpoints were passed over: each worker's newest checkpoint (a worker
    that checkpointed after its final one is alive again) that is final, not ``done``, labelled
    with ``pool`` and, with ``trust_domain``, of that domain (a checkpoint of another domain
    would be a cold replay of requests from workers this one does not trust). Workers in
    ``exclude`` (the claimant itself) are left out. Reads one manifest per worker whose newest
    checkpoint is not done; one that does not read is passed over, logged."""
    newest: dict[str, CheckpointInfo] = {}
    for c in by_store_time(store, None, skew):
        newest[c.worker_id] = c  # oldest first: the last one stands
    skip = set(exclude)
    done = done_names(store)
    todo = [c for w, c in newest.items() if w not in skip and (w, c.id) not in done]
    refused: list[Refusal] = []
    if not todo:
        return [], refused

    def read(c: CheckpointInfo) -> Manifest | str:
        try:
            return read_manifest(store, keyring, c)
        except (FormatError, IntegrityError, CheckpointNotFound) as exc:
            return f"manifest does not read: {exc}"

    with ThreadPoolExecutor(min(8, len(todo))) as ex:
        got = list(ex.map(read, todo))
    out = []
    for c, m in zip(todo, got, strict=True):
        if isinstance(m, str):
            refused.append(Refusal(c.worker_id, c.id, m))
        elif m.labels.get(POOL_LABEL) != pool:
            continue  # another pool's, or a pool-less worker's: not ours to consider
        elif not is_final(m):
            refused.append(Refusal(c.worker_id, c.id, f"not final (trigger {m.labels.get(TRIGGER_LABEL)!r})"))
        elif trust_domain is not None and m.namespace.get("trust_domain") not in (trust_domain, None):
            theirs = m.namespace.get("trust_domain")
            refused.append(Refusal(c.worker_id, c.id, f"trust domain {theirs!r} is not this worker's"))
        else:
            out.append(Candidate(c, m))
    out.sort(key=lambda x: (x.info.stored, x.info.id), reverse=True)
    return out, refused


def protected(store: Store) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """For retention: (checkpoints held by a claim — its latest generation active, lease run
    out or not, or a claim that does not read: being restored, or about to be, never
    forgotten; checkpoints with ``done`` — adopted). A released claim protects nothing."""
    claimed: set[tuple[str, str]] = set()
    done: set[tuple[str, str]] = set()
    for o in store.list(PREFIX):
        parts = o.name[len(PREFIX) :].split("/")
        if len(parts) != 3 or not is_worker_id(parts[0]):
            continue  # not a claim gpuckpt writes: left alone
        if parts[2] == "done":
            done.add((parts[0], parts[1]))
        elif _GENERATION.match(parts[2]):
            claimed.add((parts[0], parts[1]))
    held = set()
    for w, cid in claimed - done:
        try:
            latest = read_state(store, w, cid).latest
        except (FormatError, IntegrityError):
            latest = None  # cannot tell: keep it
        if latest is None or latest.state == "active":
            held.add((w, cid))
    return held, done


def sweep(store: Store, *, older_than: float, dry_run: bool = False) -> list[str]:
    """Delete the claim objects of checkpoints whose manifests are gone (forgotten), last
    written before ``older_than`` (the store's epoch seconds), and clock probes a crash left;
    returns their names. A checkpoint that exists keeps every claim object."""
    found = list(store.list(PREFIX))
    if not found:
        return []
    alive = {(c.worker_id, c.id) for c in list_checkpoints(store)}
    gone = []
    for o in found:
        parts = o.name[len(PREFIX) :].split("/")
        if len(parts) != 3 or o.mtime >= older_than or not is_worker_id(parts[0]):
            continue
        ours = parts[2] == "done" or _GENERATION.match(parts[2]) or parts[2].startswith("clock-")
        if ours and ((parts[0], parts[1]) not in alive or parts[2].startswith("clock-")):
            gone.append(o.name)
    if not dry_run:
        for name in gone:
            store.delete(name)
    return gone
