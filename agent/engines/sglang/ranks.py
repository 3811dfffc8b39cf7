"""Tensor parallelism in the SGLang linker: every TP rank's scheduler acts at the same step.

An SGLang server with ``--tp-size N`` runs one scheduler process per rank,
each with its own KV pools holding its own heads of every page (rank ``r``
of ``tp`` holds heads ``[r·H//tp, r·H//tp + max(1, H//tp))`` of the
model's ``H``: the rule :func:`agent.engines.shards.local_heads` states for
vLLM, which SGLang's ``QKVParallelLinear`` follows too), and its own radix
tree. The ranks stay in step because every rank's scheduler sees the same
requests in the same loop iteration and makes the same decisions: rank 0
pulls the iteration's requests and ``broadcast_pyobj`` hands the same list
to every rank (``Scheduler.ingest_requests`` →
``SchedulerRequestReceiver.recv_requests``,
``srt/managers/scheduler_components/request_receiver.py``). So the trees
hold the same nodes, and a capture's plan — which pages, which nodes
locked, which pages a chunk takes — is the same on every rank, provided
every rank acts at the same step with the same inputs. That is what this
module arranges. A rank's decisions must never differ from rank 0's: a
lock reference taken or released on one rank only changes what that rank's
tree may evict, and ranks whose trees differ schedule differently and hang
in their next collective.

**Who talks to whom.** Rank 0's linker (the *leader*) serves the agent's
control socket, as a single-rank server's does. The other ranks serve
nothing the agent reaches; they write their own page files into the same
staging directory and report them to the leader over a Unix socket the
leader serves beside its control socket (:func:`.notes.rank_socket`; JSON lines,
:mod:`agent.engines.control`). A chunk is complete — handed to the agent,
or answering the capture call for chunk 0 — when every rank's file of it is
written: the reply lists one page file per rank (``shards``: rank, file,
``kv_heads``), as a vLLM worker's does, and the agent joins them into
stored pages holding every head (:mod:`agent.session.capture`).

**Step notes.** Everything the leader decides that changes what a rank
does at a step boundary rides SGLang's own per-iteration broadcast: the
linker wraps the scheduler's request receiver (:class:`.notes.Relay`, installed at
the first step boundary). On rank 0, before the iteration's requests are
broadcast, the relay adds a *step note* — a string ``gpuckpt-step:`` +
JSON — to the requests (as SGLang adds its own timeout aborts,
``local_reqs``); on every rank, after the broadcast, it takes the notes out
before SGLang dispatches the requests, and the linker applies them at the
step boundary of the same iteration (``num_completed_offloads``, called on
every rank at the same point of the loop). Nothing races the step: a rank
learns a decision in the iteration it is to act on it. A note's operations:

- ``capture``: a capture call to plan (its ``when``, ``full``, staging
  bounds) and the change to the durable keys since the last one; every
  rank registers it and judges ``when`` itself, on the same live requests,
  so every rank reaches the consistent point at the same boundary and
  plans the same pages and locks;
- ``drop``: a registered capture call gave up before its consistent point;
- ``pump``: issue the stream's next chunk at this boundary (the leader
  decides: the staging ring's room depends on the agent's acknowledgements,
  which only the leader sees);
- ``end``: the leader ended the stream (done, cancelled, abandoned, a
  rank's failure); ``release``: release the locks of ended streams — the
  leader keeps an ended stream's locks until it has announced the end, so
  that every rank releases them at the same boundary;
- ``offer`` / ``withdraw``: a restore's page file (every rank reads its own
  heads out of the same stored pages) and its end. These are applied as the
  note arrives (they touch no tree); the leader's ``offer`` answers the
  agent only once its note is out, so no resubmitted request can reach the
  ranks before the pages it may hit.

Restore needs no more: SGLang's linker wrapper already reduces every rank's
``lookup`` to the prefixes all ranks can load, and a failed load to every
rank's verdict (``UnifiedCacheLinkerWrapper.match`` / ``finish_loads``); a
rank's ``load`` answers from what its own ``lookup`` saw, so all agree.

An iteration whose receive SGLang skips (``--scheduler-recv-interval``)
broadcasts nothing: rank 0 sends its note again with the next one.

Limits: no pipeline or data parallelism (refused by name at start: each
stage holds other layers, and the replicas are not one group in step). A
copy that fails on one rank only ends the stream on every rank, but that
rank's locks may be released a few steps before the others'.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from agent import fs
from agent.engines import control, staging
from agent.engines.protocol import Offer
from agent.engines.service import Reply, Waiter
from agent.engines.sglang import state
from agent.engines.sglang.capture import Capturer
from agent.engines.sglang.notes import Relay, encode_note, rank_socket
from agent.engines.sglang.stream import Pin, Stream

__all__ = ["TensorParallel"]

log = logging.getLogger("gpuckpt.sglang")

#: How long the leader's ``offer`` waits for its note to go out to the other ranks.
OFFER_SEND_S = 60.0
#: Reports a rank may send for a capture the leader has not reached yet (bounded memory).
MAX_EARLY = 256


class TensorParallel(Capturer):
    """The linker's tensor-parallel side (state set by :meth:`_init_ranks`, from the linker's
    ``__init__``). With ``tp == 1`` none of it runs: the linker acts on its own at each boundary."""

    _files: dict[str, staging.PageFile]

    def _init_ranks(self, control_socket: str | None) -> None:
        self._control_socket = control_socket
        self._relay: Relay | None = None
        self._inbox: list[dict[str, Any]] = []  # received operations, applied at the boundary
        self._by_id: dict[int, Waiter] = {}  # registered capture calls not yet due (every rank)
        self._synced_durable: set[bytes] = set()  # durable keys as of the last capture note
        self._tag = str(os.getpid())  # names the capture streams; rank 0's pid on every rank
        # the leader's side
        self._outbox_captures: list[Waiter] = []  # capture calls not yet announced
        self._outbox: list[dict[str, Any]] = []  # drop / offer / withdraw operations to announce
        self._carry: list[dict[str, Any]] = []  # a note that did not go out, sent again
        self._registered: dict[int, Waiter] = {}  # announced capture calls, not yet registered
        self._abandoned: set[int] = set()
        self._op_id = 0
        self._mirror: dict[int, Stream] = {}  # streams the other ranks hold open (not announced ended)
        self._opened = 0  # the last stream opened here (a later one's reports are early)
        self._unpin_sent: list[Pin] = []  # locks whose release went out with this iteration's note
        self._offers_made = 0
        self._offers_sent = 0
        self._early: dict[int, list[tuple[int, dict[str, Any]]]] = {}  # seq → rank reports before its stream
        self._rank_server: control.ControlServer | None = None
        self._hits: dict[str, dict[bytes, str]] = {}  # rid → the offered keys its last lookup saw
        self._told = False  # ending a stream because rank 0 said so (not to be told back)
        self._sending: list[dict[str, Any]] = []  # the operations of the note on its way out

    @property
    def _ranked(self) -> bool:
        """Whether the ranks act on rank 0's notes (a tensor-parallel server whose KV is carried;
        a refused one answers captures with its refusal, on rank 0 alone)."""
        return self._tp > 1 and self._disabled is None

    @property
    def _leads(self) -> bool:
        return self._rank == 0

    def _serve_ranks(self) -> None:
        """The leader's socket for the other ranks' chunk reports (beside the agent's)."""
        if self._control_socket and self._ranked and self._leads:
            path = Path(rank_socket(self._control_socket))
            fs.ensure_socket_dir(path.parent, self.trust)
            self._rank_server = control.ControlServer(path, self._on_rank_message)

    def _close_ranks(self) -> None:
        if self._rank_server is not None:
            self._rank_server.close()
            self._rank_server = None

    # ------------------------------------------------------------------ the relay

    def _install_relay(self) -> None:
        """Wrap the scheduler's request receiver (first boundary: it exists from then on)."""
        sched = self._scheduler
        inner = getattr(sched, "request_receiver", None)
        if inner is None or not hasattr(inner, "recv_requests"):
            raise RuntimeError("the SGLang scheduler has no request receiver to carry gpuckpt's step notes")
        if isinstance(inner, Relay):
            self._relay = inner
            return
        self._relay = Relay(
            inner, leader=self._leads, outgoing=self._note_out, sent=self._note_sent, incoming=self._note_in
        )
        sched.request_receiver = self._relay

    def _note_out(self) -> str | None:
        """Rank 0, the scheduler thread, before this iteration's broadcast: the note for every rank.
        Idle (nothing to announce, no stream), it reads five fields and returns."""
        if not (self._mirror or self._outbox_captures or self._outbox or self._carry or self._unpin_sent):
            return None
        with self.lock:
            ops = self._carry
            self._carry = []
            now = time.monotonic()
            st = self.stream
            if st is not None and st.seq in self._mirror and st.idle(now):
                self.end_stream(st, "no word from the agent")
            if self._outbox_captures and not any(op["op"] == "capture" for op in self._inbox + ops):
                # the durable keys' change rides along; computed against what every rank holds,
                # so only once the last capture note is applied (a paused scheduler holds them)
                durable = self.offers.durable
                add = durable - self._synced_durable
                remove = self._synced_durable - durable
                for w in self._outbox_captures:
                    self._op_id += 1
                    self._registered[self._op_id] = w
                    ops.append(
                        {
                            "op": "capture",
                            "id": self._op_id,
                            "when": w.when,
                            "full": w.full,
                            "prefix_only": w.prefix_only,
                            "max_staging": w.max_staging,
                            "copy_per_step": w.copy_per_step,
                            "tag": self._tag,
                            "durable_add": [k.hex() for k in add],
                            "durable_remove": [k.hex() for k in remove],
                        }
                    )
                    add, remove = set(), set()
                self._outbox_captures = []
            ops += self._outbox
            self._outbox = []
            for seq, ended in list(self._mirror.items()):
                if ended is not self.stream:
                    ops.append({"op": "end", "seq": seq, "why": ended.error})
                    self._unpin_sent.extend(ended.take_pins())
                    del self._mirror[seq]
            if self._unpin_sent:
                ops.append({"op": "release"})
            st = self.stream
            if st is not None and st.seq in self._mirror and st.can_issue():
                ops.append({"op": "pump", "seq": st.seq})
            self._sending = ops
        return encode_note(ops) if ops else None

    def _note_sent(self, note: str, out: bool) -> None:
        """Whether rank 0's note went out; one that did not is sent again (less its pump)."""
        with self.lock:
            ops, self._sending = self._sending, []
            if out:
                self._offers_sent += sum(1 for op in ops if op["op"] == "offer")
                self.cond.notify_all()
            else:
                self._carry = [op for op in ops if op["op"] != "pump"] + self._carry

    def _note_in(self, ops: list[dict[str, Any]]) -> None:
        """Every rank, the scheduler thread, after the broadcast: offers now, the rest at the boundary."""
        for op in ops:
            if op["op"] in ("offer", "withdraw"):
                if not self._leads:
                    self._apply_offer(op)
            else:
                self._inbox.append(op)

    # ------------------------------------------------------------------ the step boundary

    def _ranked_boundary(self) -> None:
        """The step boundary of a tensor-parallel server (every rank, the scheduler thread): the
        notes received this iteration, in order, then the capture calls whose ``when`` holds."""
        if self._relay is None:
            try:
                self._install_relay()
            except Exception as exc:  # the same on every rank: every rank stops here
                with self.lock:
                    self._disabled = f"tensor parallel: {exc}"
                    self.capture_calls += self._outbox_captures  # answered with the refusal
                    self._outbox_captures = []
                log.error("gpuckpt: %s; captures will be refused", self._disabled)
                return
        ops, self._inbox = self._inbox, []
        for op in ops:
            kind = op["op"]
            if kind == "end":
                self._apply_end(int(op["seq"]), op.get("why"))
            elif kind == "release":
                with self.lock:
                    pins = self._unpin_sent if self._leads else self._unpin
                    if self._leads:
                        self._unpin_sent = []
                    else:
                        self._unpin = []
                self._unlock(pins)
            elif kind == "capture":
                self._apply_capture(op)
            elif kind == "drop":
                with self.lock:
                    w = self._by_id.pop(int(op["id"]), None)
                    if w is not None and w in self.capture_calls:
                        self.capture_calls.remove(w)
                    self._abandoned.discard(int(op["id"]))
            elif kind == "pump":
                seq = int(op["seq"])
                st = self._mirror.get(seq) if self._leads else self.stream
                if st is not None and st.seq == seq:
                    self._pump_now(st)
        if not (self.capture_calls or self.wait_calls):
            return
        live = state.live_requests(self._scheduler)
        with self.lock:
            due = [w for w in self.wait_calls + self.capture_calls if state.met(w.when, live)]
            self.wait_calls = [w for w in self.wait_calls if w not in due]
            self.capture_calls = [w for w in self.capture_calls if w not in due]
            ids = {id(w): i for i, w in self._by_id.items()}
            due_ids = [ids[id(w)] for w in due if id(w) in ids]
            for i in due_ids:
                self._by_id.pop(i, None)
            abandoned = bool(due_ids) and all(i in self._abandoned for i in due_ids)
            self._abandoned.difference_update(due_ids)
        for w in due:
            if w.kind == "wait":
                w.reply = {"ok": True, **self._progress(live)}
                w.event.set()
        captures = [w for w in due if w.kind == "capture"]
        if not captures:
            return
        before = self._seq
        try:
            self._capture(captures, live)
        except Exception as exc:
            log.exception("gpuckpt: capture failed")
            self.failures["capture"] = self.failures.get("capture", 0) + 1
            self.answer(captures, {"ok": False, "error": f"capture failed: {type(exc).__name__}: {exc}"})
        with self.lock:
            st = self.stream
            if abandoned and self._leads and st is not None and st.seq > before:
                # every call that asked for it gave up: nobody will read it
                self.end_stream(st, "the capture call timed out")

    def _progress(self, live: list[Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _stream_opened(self, st: Stream) -> None:
        """The leader tracks the stream until its end is announced, and takes the reports of ranks
        that reached its chunks first."""
        if not (self._ranked and self._leads):
            return
        self._mirror[st.seq] = st
        self._opened = st.seq
        for k, rec in self._early.pop(st.seq, []):
            self._take_report(st, k, rec)
        for seq in [s for s in self._early if s < st.seq]:  # of captures this rank never opened
            for _, rec in self._early.pop(seq):
                if rec.get("index"):
                    staging.unlink_pair(rec["index"])

    def _release_all_pins(self) -> None:
        """Release every lock of every ended stream now (the cache flushed, or shutdown: every rank
        does so at the same step), announced or not."""
        with self.lock:
            pins, self._unpin, self._unpin_sent = self._unpin + self._unpin_sent, [], []
            for ended in self._mirror.values():
                if ended is not self.stream:
                    pins += ended.take_pins()
        self._unlock(pins)

    def _keeps_pins(self, st: Stream) -> bool:
        """The leader's ended stream keeps its locks until the next note announces its end."""
        return self._ranked and self._leads and st.seq in self._mirror

    def _apply_capture(self, op: dict[str, Any]) -> None:
        i = int(op["id"])
        self._synced_durable.update(bytes.fromhex(k) for k in op.get("durable_add") or [])
        self._synced_durable.difference_update(bytes.fromhex(k) for k in op.get("durable_remove") or [])
        self._tag = str(op.get("tag") or self._tag)
        with self.lock:
            w = self._registered.pop(i, None) if self._leads else None
            if w is None:
                w = Waiter(
                    "capture",
                    op.get("when"),
                    bool(op.get("full")),
                    bool(op.get("prefix_only")),
                    op.get("max_staging"),
                    op.get("copy_per_step"),
                )
            self._by_id[i] = w
            self.capture_calls.append(w)

    def _apply_end(self, seq: int, why: str | None) -> None:
        if self._leads:
            return  # ended (and announced) already
        with self.lock:
            st = self.stream
            if st is not None and st.seq == seq:
                self._told = True
                try:
                    self.end_stream(st, why)
                finally:
                    self._told = False

    def end_stream(self, st: Stream, error: str | None) -> None:
        """A rank other than 0 whose stream fails on its own (a copy off its pools) tells rank 0,
        which ends it on every rank (lock held: told from a thread)."""
        tell = self._ranked and not self._leads and error is not None and not st.ended and not self._told
        super().end_stream(st, error)
        if tell:
            msg = {"seq": st.seq, "chunk": -1, "rec": {"rank": self._rank, "error": error}}
            threading.Thread(target=self._report_to_leader, args=(msg,), daemon=True).start()

    # ------------------------------------------------------------------ what the leader changes

    def _skip_keys(self) -> set[bytes]:
        return self._synced_durable if self._ranked else self.offers.durable

    def _stream_tag(self) -> str:
        return self._tag

    def _queue(self, w: Waiter) -> list[Waiter]:
        """The leader's capture calls wait for their note before any rank registers them."""
        if w.kind == "capture" and self._ranked:
            return self._outbox_captures
        return super()._queue(w)

    def forget_waiter(self, w: Waiter) -> None:
        """A capture call gave up (lock held). Announced but not due yet: every rank drops it at the
        same boundary (until then it may still come due: its stream then ends at once)."""
        if self._ranked:
            for i, x in list(self._registered.items()) + list(self._by_id.items()):
                if x is w:
                    self._abandoned.add(i)
                    self._outbox.append({"op": "drop", "id": i})
                    return
        super().forget_waiter(w)

    # ------------------------------------------------------------------ the other ranks' reports

    def _chunk_written(self, st: Stream, k: int, rec: dict[str, Any]) -> None:
        """A rank other than 0 reports its page file to the leader (see :func:`.notes.rank_socket`)."""
        if self._leads or not self._ranked:
            super()._chunk_written(st, k, rec)
            return
        with self.lock:
            st.reports.setdefault(k, {})[self._rank] = rec  # its own files, deleted if the stream fails
            ended = self.stream is not st or st.error is not None
        if ended and rec.get("index"):
            staging.unlink_pair(rec["index"])
            return
        self._report_to_leader({"seq": st.seq, "chunk": k, "rec": rec})

    def _report_to_leader(self, msg: dict[str, Any]) -> None:
        if not self._control_socket:
            return
        try:
            reply = control.call(rank_socket(self._control_socket), "chunk", io_timeout=30.0, **msg)
        except Exception as exc:
            log.error("gpuckpt: rank %d could not report to rank 0: %s", self._rank, exc)
            return
        if not reply.get("ok"):
            log.warning("gpuckpt: rank 0 did not take rank %d's report: %s", self._rank, reply.get("error"))

    def _on_rank_message(self, req: dict[str, Any]) -> Reply:
        """The leader's handler of the other ranks' messages (a control thread)."""
        if req.get("cmd") != "chunk":
            return {"ok": False, "error": f"unknown rank message {req.get('cmd')!r}"}
        seq, k, rec = int(req["seq"]), int(req["chunk"]), dict(req["rec"])
        rank = int(rec.get("rank", -1))
        if not 0 < rank < self._tp:
            return {"ok": False, "error": f"a report of rank {rank} in a {self._tp}-way server"}
        index = rec.get("index")
        # the leader deletes it later: only files where its own would be
        if index is not None and Path(str(index)).resolve().parent != Path(self.staging_dir).resolve():
            return {"ok": False, "error": f"{index} is not in the staging directory"}
        with self.lock:
            st = self._mirror.get(seq)
            if st is None and seq > self._opened:  # this rank reached the consistent point first
                early = self._early.setdefault(seq, [])
                if len(early) < MAX_EARLY:
                    early.append((k, rec))
                    return {"ok": True}
            if st is None:
                if index:
                    staging.unlink_pair(str(index))
                return {"ok": True, "ended": True}
            self._take_report(st, k, rec)
        return {"ok": True}

    # ------------------------------------------------------------------ restore: offers on every rank

    def on_offer(self, msg: Offer) -> Reply:
        """The leader answers once its note has taken the offer to every rank."""
        reply = super().on_offer(msg)
        if not (self._ranked and reply.get("ok") and msg.index):
            return reply
        deadline = time.monotonic() + OFFER_SEND_S
        with self.lock:
            self._offers_made += 1
            n = self._offers_made
            self._outbox.append({"op": "offer", "index": msg.index})
            while self._offers_sent < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {
                        "ok": False,
                        "error": f"the offer did not reach the other ranks within {OFFER_SEND_S:g} s "
                        "(is the scheduler stepping?)",
                    }
                self.cond.wait(min(left, 1.0))
        return reply

    def offer_ended(self) -> None:
        """The offer ended on the leader (lock held): the other ranks end theirs with the next note."""
        if self._ranked and self._leads:
            self._outbox.append({"op": "withdraw"})

    def _apply_offer(self, op: dict[str, Any]) -> None:
        """A rank other than 0 takes (or ends) the offer rank 0 announced; its files stay rank 0's
        to delete. A file it cannot read is not offered here, so no rank loads from it."""
        if op["op"] == "withdraw":
            with self.lock:
                self.offers.end()
                files, self._files = self._files, {}
            for pf in files.values():
                pf.close()
            return
        path = str(op["index"])
        try:
            pf = staging.PageFile(path, trust=self.trust)
        except Exception as exc:
            log.error("gpuckpt: rank %d cannot read the offered page file %s: %s", self._rank, path, exc)
            return
        try:
            self.check_page_file(pf)
        except Exception as exc:
            pf.close()
            log.error("gpuckpt: rank %d refuses the offered page file %s: %s", self._rank, path, exc)
            return
        with self.lock:
            old = self._files.pop(path, None)
            if old is not None:
                old.close()
            self._files[path] = pf
            self.offers.add(path, list(pf.index.keys))

    def _remember_hit(self, rid: str, keys: list[str], offer: dict[bytes, str]) -> None:
        """What ``rid``'s lookup found (``keys``: the hit pages'): its load plans from that alone,
        so every rank's load answers as every rank's lookup did (SGLang's wrapper takes the
        shortest hit of all ranks and expects the same load verdict from each)."""
        if len(self._hits) > 4096:
            self._hits.clear()
        self._hits[rid] = {bytes.fromhex(k): offer[bytes.fromhex(k)] for k in keys}
