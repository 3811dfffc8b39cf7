"""The worker conformance suite: every adapter of the control protocol runs every test here.

A subject's test class subclasses :class:`WorkerTests` and provides one
fixture, ``subject``: a :class:`Subject` — a running worker side (the vLLM
scheduler half built on CPU, the SGLang linker, the fake) with its channel,
its own capture staging directory, a directory it trusts for offered page
files, and its page format. The suite speaks to it only through the
protocol (:class:`agent.engines.channel.WorkerChannel`, or raw lines for the
messages the channel would never send), and checks what really landed on
disk beside it, as ``tests/store_suite.py`` does for stores. Hostile cases
included: unknown commands, keys and versions, a later offer part of an
ended generation, a page file outside the staging rules, an unknown capture
sequence.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from agent.engines import control, staging
from agent.engines.channel import WorkerChannel
from agent.engines.control import ControlError
from agent.engines.protocol import PROTOCOL_VERSION, KeyRequest


@dataclass
class Subject:
    """A running worker side under test."""

    channel: WorkerChannel
    #: where it writes its capture page files (``sweep`` judges this directory)
    staging_dir: Path
    #: a directory it trusts for offered page files (private to this account)
    offer_dir: Path
    page_shape: tuple[int, ...]
    dtype: str
    layers: list[str]
    #: what ``describe`` reports as the engine
    engine: str
    close: Callable[[], None] = field(default=lambda: None)


def wait_for(cond: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def page_file(directory: Path, name: str, subject: Subject, n: int, seed: int = 0) -> tuple[Path, list[bytes]]:
    """A committed page file of ``n`` pages in the subject's format; its index path and keys."""
    w = staging.PageWriter(directory, name, dtype=subject.dtype, page_shape=subject.page_shape, layers=subject.layers)
    size = torch.empty((), dtype=getattr(torch, subject.dtype)).element_size()
    for d in subject.page_shape:
        size *= d
    keys = []
    for i in range(n):
        k = (seed * 1000 + i).to_bytes(8, "little").ljust(32, b"\x01")
        w.write(k, bytes([(seed + i) % 251]) * size)
        keys.append(k)
    w.commit()
    return w.index_path, keys


class WorkerTests:
    """Subclass and provide ``subject``."""

    @pytest.fixture
    def subject(self) -> Subject:
        raise NotImplementedError

    # -- the protocol itself

    def test_ping_answers_with_the_workers_pid(self, subject: Subject) -> None:
        assert subject.channel.ping().pid > 0

    def test_describe_names_the_engine(self, subject: Subject) -> None:
        d = subject.channel.describe()
        assert d.facts["engine"] == subject.engine
        assert d.namespace["engine"] == subject.engine
        assert isinstance(d.layout, dict)

    @pytest.mark.parametrize(
        ("request_", "why"),
        [
            ({"cmd": "frobnicate"}, "unknown command 'frobnicate'"),
            ({"cmd": "ping", "v": None}, "protocol version None"),
            ({"cmd": "ping", "v": PROTOCOL_VERSION + 1}, f"protocol version {PROTOCOL_VERSION + 1}"),
            ({"cmd": "stats", "bogus": 1}, r"unknown keys \['bogus'\]"),
            ({"cmd": "next", "seq": "one"}, "seq must be an integer"),
            ({"cmd": "durable", "add": ["not hex"]}, "hex"),
            ({"cmd": "capture", "when": {"live": 1, "soon": True}}, "a condition is"),
            ({"cmd": "keys", "requests": [{"token_ids": [1], "extra": 1}]}, "a request is"),
        ],
    )
    def test_what_is_not_the_protocol_is_refused_by_name(
        self, subject: Subject, request_: dict[str, object], why: str
    ) -> None:
        body = dict(request_)
        cmd = str(body.pop("cmd"))
        body.setdefault("v", PROTOCOL_VERSION)
        with pytest.raises(ControlError, match=why):
            control.call(subject.channel.socket, cmd, **body)
        assert subject.channel.ping().pid > 0, "the worker answers on after a refused request"

    def test_stats_hold_the_common_counters(self, subject: Subject) -> None:
        s = subject.channel.stats()
        for k in (
            "offered",
            "offer_files",
            "files_to_delete",
            "durable",
            "captures_pending",
            "waits_pending",
            "last_stream",
            "hook_failures",
            "restored_tokens",
            "step",
        ):
            assert k in s, k

    def test_wait_returns_at_a_step_boundary(self, subject: Subject) -> None:
        step = subject.channel.stats()["step"]
        r = subject.channel.wait(timeout=30)
        assert r.get("step", 0) >= step

    def test_a_condition_never_met_times_out_naming_it(self, subject: Subject) -> None:
        with pytest.raises(ControlError, match="timed out"):
            subject.channel.wait(when={"live": 1000}, timeout=0.5)
        assert subject.channel.stats()["waits_pending"] == 0, "the timed-out wait is forgotten"

    # -- capture streams

    def test_a_capture_streams_until_done_and_its_files_are_the_agents(self, subject: Subject) -> None:
        cap = subject.channel.capture(timeout=30)
        assert cap.seq >= 1
        assert cap.ledger is not None
        files = [Path(str(s["index"])) for s in cap.get("shards") or [] if s.get("index")]
        files = files or [Path(str(cap.get("index")))]
        for f in files:
            assert f.parent.resolve() == subject.staging_dir.resolve()
            assert staging.PageFile(f, mapped=False).index.keys is not None
        done, acks = cap.get("last", False), [int(cap.get("chunk", 0))]
        while not done:
            r = subject.channel.next(seq=cap.seq, ack=acks, timeout=30)
            done, acks = r.done, [int(p["chunk"]) for p in r.parts]
        for f in files:
            staging.unlink_pair(f)  # the agent consumed it
        r = subject.channel.next(seq=cap.seq, ack=acks, timeout=5)
        assert r.done
        assert subject.channel.stats()["last_stream"]["seq"] == cap.seq

    def test_a_pre_copy_records_no_ledger(self, subject: Subject) -> None:
        cap = subject.channel.capture(prefix_only=True, timeout=30)
        assert cap.ledger is None
        assert subject.channel.cancel(cap.seq).cancelled

    def test_next_of_an_unknown_sequence_is_an_error_and_cancel_cancels_nothing(self, subject: Subject) -> None:
        with pytest.raises(ControlError, match="capture 999"):
            subject.channel.next(seq=999, timeout=1)
        assert subject.channel.cancel(999).cancelled is False

    def test_a_cancelled_capture_deletes_what_it_staged(self, subject: Subject) -> None:
        cap = subject.channel.capture(timeout=30)
        assert subject.channel.cancel(cap.seq).cancelled
        wait_for(lambda: not list(subject.staging_dir.glob(f"capture-*-{cap.seq}*")), "the cancelled capture's files")
        with pytest.raises(ControlError, match=f"capture {cap.seq}"):
            subject.channel.next(seq=cap.seq, timeout=1)

    def test_sweep_deletes_capture_files_no_stream_owns(self, subject: Subject) -> None:
        d = subject.staging_dir
        d.mkdir(parents=True, exist_ok=True)
        (d / "capture-1-99-c0-r0.json").write_text("{}")
        (d / "capture-1-99-c0-r0.bin").write_bytes(b"x")
        (d / "capture-1-98.bin").write_bytes(b"x")  # data whose index was never written
        (d / "unrelated.txt").write_text("kept")
        removed = subject.channel.sweep().removed
        assert {"capture-1-99-c0-r0.json", "capture-1-98.bin"} <= set(removed)
        assert not (d / "capture-1-99-c0-r0.bin").exists()
        assert (d / "unrelated.txt").exists()

    # -- the offer

    def test_an_offer_takes_its_pages_and_withdraw_deletes_its_file(self, subject: Subject) -> None:
        index, _ = page_file(subject.offer_dir, "offer-a", subject, 3)
        r = subject.channel.offer(index=str(index), ttl=60)
        assert r.offered == 3
        assert r.generation is not None
        s = subject.channel.stats()
        assert s["offered"] == 3
        assert str(index) in s["offer_files"]
        assert subject.channel.withdraw().files == 1
        wait_for(lambda: not index.exists() and not index.with_suffix(".bin").exists(), "the withdrawn file's deletion")
        assert subject.channel.stats()["offered"] == 0

    def test_a_later_part_of_an_ended_offer_is_refused_and_its_file_deleted(self, subject: Subject) -> None:
        first, _ = page_file(subject.offer_dir, "part-1", subject, 2)
        gen = subject.channel.offer(index=str(first), ttl=60).generation
        subject.channel.withdraw()
        later, _ = page_file(subject.offer_dir, "part-2", subject, 2, seed=1)
        with pytest.raises(ControlError, match=f"generation {gen} has ended"):
            subject.channel.offer(index=str(later), generation=gen)
        assert not later.exists(), "a refused part is deleted (the worker owned it from the offer)"
        assert subject.channel.stats()["offered"] == 0

    def test_an_offer_expires_after_its_ttl(self, subject: Subject) -> None:
        index, _ = page_file(subject.offer_dir, "short", subject, 1)
        subject.channel.offer(index=str(index), ttl=0.2)
        wait_for(lambda: not index.exists(), "the expired offer's file deletion")
        assert subject.channel.stats()["offered"] == 0

    def test_a_page_file_outside_the_staging_rules_is_refused_and_left_alone(self, subject: Subject) -> None:
        loose = subject.offer_dir.parent / "loose"
        loose.mkdir(mode=0o700)
        index, _ = page_file(loose, "planted", subject, 1)
        os.chmod(loose, 0o777)  # noqa: S103  (another account could have planted it)
        with pytest.raises(ControlError, match=r"mode|refusing"):
            subject.channel.offer(index=str(index))
        link = subject.offer_dir / "link.json"
        link.symlink_to(index)
        with pytest.raises(ControlError, match=r"symlink|refusing"):
            subject.channel.offer(index=str(link))
        assert index.exists(), "a refused file is not the worker's to delete"
        assert subject.channel.stats()["offered"] == 0

    def test_request_states_alone_are_an_offer(self, subject: Subject) -> None:
        r = subject.channel.offer(requests={"req-1": {"prior_outputs": [1, 2]}}, ttl=60)
        assert r.offered == 0
        subject.channel.withdraw()

    # -- durable keys and page keys

    def test_durable_keys_are_counted_added_and_removed(self, subject: Subject) -> None:
        base = subject.channel.durable().durable
        assert subject.channel.durable(add=["aa" * 32, "bb" * 32]).durable == base + 2
        assert subject.channel.durable(remove=["aa" * 32]).durable == base + 1
        subject.channel.durable(remove=["bb" * 32])

    def test_keys_answers_one_list_of_hex_keys_per_request(self, subject: Subject) -> None:
        reqs = [KeyRequest(tuple(range(1, 41)), 40), KeyRequest((5, 6, 7), 3), KeyRequest((), 0)]
        got = subject.channel.keys(reqs).keys
        assert len(got) == 3
        for keys in got:
            for k in keys:
                bytes.fromhex(k)
        assert got[2] == (), "no tokens, no pages"
