"""Captures and restores at a scale past their staging bound, with ``vllm serve`` workers.

Worker A holds a prefix cache of twelve conversations and two requests
decoding. A checkpoint with a staging bound of a few pages streams the
cached blocks in chunks after its consistent point: more than five chunks,
the staging directory (sampled from outside while it runs) never above the
bound, no block lost, every conversation's blocks in the checkpoint, and the
checkpoint loads whole.

Worker B restores it streaming: the in-flight requests' pages (keys the
new engine computes from their tokens) are offered first and the requests
resubmitted at once; they continue token-exact with every prompt token but
one cached. The rest of the prefix cache arrives behind them: a returning
conversation then finds its history warm.

Worker C restores with the in-flight requests' pages moved to the back of
the stream (they arrive late): the requests recompute what was not there in
time and still continue token-exact. Worker D restores releasing each
request as its own pages arrive, with those pages held back until the
requests are in the worker: it holds them, and they resume from their
restored pages. Worker E restores with a returning conversation's pages at
the back of the rest, in small parts, the rest held back until that
conversation is in the worker: it waits for its pages, asks for them, and
they come next. No restore page file outlives a withdraw.
"""

from __future__ import annotations

import importlib
import random
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from agent import session
from agent.engines import canary
from agent.engines.channel import WorkerChannel
from agent.testing import ServeProcess
from ckpt import Repository
from tests.harness.vllm import GREEDY, serve_worker

pytestmark = pytest.mark.slow
restore_mod = importlib.import_module("agent.session.restore")  # its privates are patched below
restore_rest = importlib.import_module("agent.session.restore_rest")
TURN = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}


def page_bytes(layout: dict) -> int:
    item = {"float32": 4, "bfloat16": 2, "float16": 2}[layout["dtype"]]
    return len(layout["layers"]) * 2 * layout["block_size"] * layout["num_kv_heads"] * layout["head_size"] * item


def staged_bytes(d: Path) -> int:
    total = 0
    for p in d.glob("capture-*.bin"):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            continue
    return total


@pytest.fixture(scope="module")
def streamed(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, module_cleanup: ExitStack) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-stream")
    repo = Repository.open(str(tmp / "repo"), create=True)
    rng = random.Random(23)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    convs = {f"c{i}": toks(200 + 16 * i) for i in range(12)}
    live = {f"live{i}": toks(150 + 40 * i) for i in range(2)}
    out: dict = {"convs": convs, "live": live}
    early: dict[str, ServeProcess] = {}
    # the restoring worker after each (and on the other CPU): started while that one works
    following = {"b": ("c", 0), "c": ("d", 1), "d": ("e", 0)}

    def start_early(name: str, cpu: int) -> None:
        """A restoring worker, started before its turn: an engine start costs ~20 s here, and the
        worker is still fresh when its turn comes."""
        early[name] = module_cleanup.enter_context(serve_worker(tiny_llama, tmp, name, cpu=cpu))

    def worker(name: str) -> ServeProcess:
        if name in following:
            start_early(*following[name])
        return early.pop(name)

    with serve_worker(tiny_llama, tmp, "a") as a:
        a.wait_ready()
        start_early("b", 1)
        probe = canary.record(a.client.generate)
        turn1 = {k: a.client.complete(p, TURN, stream=False).token_ids for k, p in convs.items()}
        layout = session.describe(a.control_socket).layout
        page = page_bytes(layout)
        out["block_size"] = layout["block_size"]
        bound = 18 * page  # chunks of 3 pages: the cache is ~100 pages
        out["bound"], out["page"] = bound, page
        results: dict = {}
        threads = [
            threading.Thread(
                target=lambda k=k: results.__setitem__(
                    k, a.client.complete(live[k], GREEDY, request_id=k, stream=False)
                )
            )
            for k in live
        ]
        session.hold(a.control_socket, len(live), timeout=300)
        peak = [0]
        done = threading.Event()

        def sample() -> None:  # the staging directory as an outsider sees it
            d = tmp / "stage-a"
            while not done.is_set():
                peak[0] = max(peak[0], staged_bytes(d))
                time.sleep(0.01)  # not too often: this thread must not starve the save it watches

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        def start() -> None:
            for t in threads:
                t.start()

        taken = session.checkpoint_around(
            a.control_socket,
            start,
            repo,
            "w0",
            canary=probe,
            when={"live": len(live), "min_outputs": 40},
            timeout=240,
            max_staging=bound,
        )
        m, out["stats"] = taken.manifest, taken.stats
        done.set()
        sampler.join()
        out["sampled_peak"] = peak[0]
        out["checkpoint"] = m
        errors: list = []
        out["loaded"] = sum(1 for _ in repo.load(m.id, errors=errors))
        out["load_errors"] = errors
        reqs = [{"token_ids": convs[k] + turn1[k], "kv_tokens": len(convs[k]) + len(turn1[k]) - 1} for k in convs]
        out["conv_keys"] = WorkerChannel(a.control_socket).keys(reqs).keys
        for t in threads:
            t.join(300)
        out["reference"] = {f"cmpl-{k}-0": results[k].token_ids for k in live}  # by the server's request ids
        out["turn1_c3"] = turn1["c3"]
        nxt = convs["c3"] + turn1["c3"] + toks(8)
        out["next_prompt"] = nxt
        out["next_reference"] = a.client.complete(nxt, TURN, stream=False).token_ids
        out["stage_a_left"] = sorted(p.name for p in (tmp / "stage-a").glob("capture-*"))
        a.kill()

    def restore_into(name: str, late: bool = False, each: bool = False) -> dict:
        res: dict = {}
        with worker(name) as w, pytest.MonkeyPatch.context() as mp:
            w.wait_ready()
            stage = tmp / f"restore-{name}"
            gate = threading.Event()
            if late:
                # the in-flight requests' pages at the back of the stream, after the whole prefix cache
                mp.setattr(restore_mod, "_first_keys", lambda channel, m: ([], _canary_keys(channel, m)))
            if each:
                # every part after the first waits until the resubmitted requests are in the worker
                offer = restore_rest._offer_file

                def gated(*a, **kw):  # type: ignore[no-untyped-def]
                    assert gate.wait(300)
                    return offer(*a, **kw)

                mp.setattr(restore_rest, "_offer_file", gated)
            plan = session.restore(
                repo,
                m.id,
                w.control_socket,
                staging_dir=str(stage),
                generate=w.client.generate,
                release="each" if each else None,  # a CPU worker's default: together
            )
            res["plan"] = plan
            res["returned_before_pages"] = plan.rest is not None and not plan.rest.inflight_done.is_set()
            got: dict = {}
            submit = threading.Thread(target=lambda: got.update(w.client.submit(plan.requests)))
            submit.start()
            if each:
                session.wait_until(w.control_socket, live=len(plan.requests), timeout=120)
                res["awaiting"] = session.stats(w.control_socket)["awaiting"]
                gate.set()
            submit.join(300)
            res["resumed"] = got
            assert plan.wait_offered(120), "the rest of the restore did not arrive"
            res["first_blocks"] = plan.stats["first_blocks"] + (plan.rest.stats["inflight_blocks"] if plan.rest else 0)
            res["offered_total"] = plan.offered_total
            res["rest"] = dict(plan.rest.stats) if plan.rest is not None else {}
            res["next"] = w.client.complete(out["next_prompt"], TURN, stream=False)
            session.withdraw(w.control_socket)
            end = time.monotonic() + 60
            while list(stage.glob("restore-*")) and time.monotonic() < end:
                time.sleep(0.05)
            res["stage_left"] = sorted(p.name for p in stage.glob("restore-*"))
            if each:
                # again, with the requests' pages never coming (until the requests are done): held
                # requests go on without them after the offer's await_s, and still continue exactly
                gate.clear()
                mp.setattr(restore_mod, "AWAIT_S", 2.0)
                plan = session.restore(
                    repo, m.id, w.control_socket, staging_dir=str(stage), generate=w.client.generate, release="each"
                )
                got = {}
                submit = threading.Thread(target=lambda: got.update(w.client.submit(plan.requests)))
                submit.start()
                submit.join(240)
                res["stalled_done"] = not submit.is_alive()
                res["stalled_awaiting"] = session.stats(w.control_socket)["awaiting"]
                gate.set()
                submit.join(60)
                res["stalled"] = (plan, got)
                assert plan.wait_offered(120)
                session.withdraw(w.control_socket)
        return res

    def _canary_keys(channel, m) -> list[bytes]:  # type: ignore[no-untyped-def]
        toks_ = list(m.canary["prompt_token_ids"]) + list(m.canary["expected"])
        got = channel.keys([{"token_ids": toks_, "kv_tokens": len(toks_) - 1}]).keys[0]
        have = {b.key for b in m.blocks}
        return [bytes.fromhex(k) for k in got if k in have]

    def restore_on_demand(name: str) -> dict:
        """The returning conversation's pages last in the rest, small parts, and the rest held back
        until that conversation is in the worker: it asks for its pages, which come next."""
        res: dict = {}
        nxt = out["next_prompt"]
        mine = [bytes.fromhex(k) for k in out["conv_keys"][3]]
        with worker(name) as w, pytest.MonkeyPatch.context() as mp:
            w.wait_ready()
            mp.setattr(restore_rest, "RESTORE_CHUNK_BYTES", 4 * out["page"])
            mp.setattr(restore_rest, "WANT_S", 120.0)  # what the test checks is the order, not a race with the wait
            rest_cls = restore_rest.RestoreRest

            class Last(rest_cls):  # type: ignore[misc, valid-type]
                def __init__(self, repo, m, sock, waiting, keys, *a, **kw):  # type: ignore[no-untyped-def]
                    keys = [k for k in keys if k not in mine] + [k for k in keys if k in mine]
                    super().__init__(repo, m, sock, waiting, keys, *a, **kw)

            mp.setattr(restore_rest, "RestoreRest", Last)
            gate, parts = threading.Event(), []
            offer = restore_rest._offer_file

            def gated(sock, w_, generation, ready=None, **kw):  # type: ignore[no-untyped-def]
                if w_ is not None and not ready:  # a part of the prefix cache
                    assert gate.wait(300)
                    parts.append(set(w_.keys))
                return offer(sock, w_, generation, ready, **kw)

            mp.setattr(restore_rest, "_offer_file", gated)
            plan = session.restore(repo, m.id, w.control_socket, generate=w.client.generate)
            end = time.monotonic() + 120
            while not session.stats(w.control_socket)["coming"] and time.monotonic() < end:
                time.sleep(0.05)  # the worker knows what the rest brings (sent behind the in-flight pages)
            got: dict = {}
            turn = threading.Thread(target=lambda: got.update(next=w.client.complete(nxt, TURN, stream=False)))
            turn.start()
            end = time.monotonic() + 120
            while session.stats(w.control_socket)["asked"] < 1 and time.monotonic() < end:
                time.sleep(0.05)
            res["asked"] = session.stats(w.control_socket)["asked"]
            gate.set()
            turn.join(300)
            assert plan.wait_offered(120)
            # the full pages it reads (its history's last page is a tail: not asked for, it recomputes)
            full = (len(out["convs"]["c3"]) + len(out["turn1_c3"]) - 1) // out["block_size"]
            res["plan"], res["next"], res["parts"], res["mine"] = plan, got.get("next"), parts, set(mine[:full])
            res["rest"] = dict(plan.rest.stats) if plan.rest is not None else {}
            res["coming_after"] = session.stats(w.control_socket)["coming"]
            session.withdraw(w.control_socket)
        return res

    out["b"] = restore_into("b")
    out["c"] = restore_into("c", late=True)
    out["d"] = restore_into("d", each=True)
    out["e"] = restore_on_demand("e")
    return out


def test_a_capture_past_its_staging_bound_streams_within_it(streamed: dict) -> None:
    st, bound = streamed["stats"], streamed["bound"]
    assert st["chunks"] > 5, st
    assert st["lost_pages"] == 0, st
    assert 0 < st["staged_peak_bytes"] <= bound, st
    assert 0 < streamed["sampled_peak"] <= bound, (streamed["sampled_peak"], bound)
    # the consistent point copied the live requests' partial pages and one chunk, not the cache
    assert st["pages"] > 10 * st["chunk_pages"], st


def test_the_streamed_checkpoint_is_whole(streamed: dict) -> None:
    m = streamed["checkpoint"]
    assert streamed["loaded"] == len(m.blocks)
    assert not streamed["load_errors"]
    have = {b.key for b in m.blocks}
    for keys in streamed["conv_keys"]:
        full = keys[:-1] if len(keys) > 1 else keys  # the last may be a tail key of a turn still decoding
        assert set(full) <= have, "a conversation's cached blocks are missing from the checkpoint"
    assert streamed["stage_a_left"] == [], "capture page files left behind"


def test_a_streaming_restore_resumes_in_flight_requests_first_token_exact(streamed: dict) -> None:
    b, m = streamed["b"], streamed["checkpoint"]
    assert b["plan"].warm, b["plan"].reasons
    assert b["plan"].stats["release"] == "together", "a CPU worker's requests run once all their pages are in"
    assert not b["returned_before_pages"]
    assert 0 < b["first_blocks"] < len(m.blocks) // 2, (b["first_blocks"], len(m.blocks))
    for r in b["plan"].requests:
        got = b["resumed"][r.request_id]
        assert list(r.output_token_ids) + list(got.token_ids) == streamed["reference"][r.request_id]
        assert got.cached_tokens >= len(r.token_ids) - 32, (r.request_id, got.cached_tokens, len(r.token_ids))
    assert b["offered_total"] == len(m.blocks), b["rest"]
    # the rest arrived: a returning conversation's history is warm, and its turn the same
    assert b["next"].token_ids == streamed["next_reference"]
    assert b["next"].cached_tokens >= len(streamed["next_prompt"]) - 40, b["next"].cached_tokens
    assert b["stage_left"] == []


def test_released_each_a_request_waits_in_the_worker_for_its_own_pages(streamed: dict) -> None:
    """``release="each"``: the plan comes back after the probe, before the requests' pages; the
    worker holds each resubmitted request until its pages are offered (here: not before every
    request has arrived), so they resume from restored pages, token-exact, not from a recompute."""
    d, m = streamed["d"], streamed["checkpoint"]
    assert d["plan"].warm, d["plan"].reasons
    assert d["plan"].stats["release"] == "each"
    assert d["returned_before_pages"], "the plan waited for the in-flight pages"
    assert d["awaiting"] == len(d["plan"].requests), d["awaiting"]
    assert 0 < d["first_blocks"] < len(m.blocks) // 2
    for r in d["plan"].requests:
        got = d["resumed"][r.request_id]
        assert list(r.output_token_ids) + list(got.token_ids) == streamed["reference"][r.request_id]
        assert got.cached_tokens >= len(r.token_ids) - 32, (r.request_id, got.cached_tokens, len(r.token_ids))
    assert d["offered_total"] == len(m.blocks), d["rest"]
    assert d["stage_left"] == []


def test_held_requests_go_on_without_pages_that_never_come(streamed: dict) -> None:
    d = streamed["d"]
    assert d["stalled_done"], "requests were held past the offer's await_s"
    assert d["stalled_awaiting"] == 0
    plan, got = d["stalled"]
    assert plan.warm
    for r in plan.requests:
        assert list(r.output_token_ids) + list(got[r.request_id].token_ids) == streamed["reference"][r.request_id]


def test_late_blocks_are_recomputed_and_continuations_stay_exact(streamed: dict) -> None:
    c = streamed["c"]
    assert c["plan"].warm
    assert c["first_blocks"] < streamed["b"]["first_blocks"], "the in-flight pages were not moved back"
    for r in c["plan"].requests:
        got = c["resumed"][r.request_id]
        assert list(r.output_token_ids) + list(got.token_ids) == streamed["reference"][r.request_id]
    assert c["next"].token_ids == streamed["next_reference"]
    assert c["stage_left"] == []


def test_a_returning_conversation_asks_for_its_pages_and_they_come_next(streamed: dict) -> None:
    """Its pages are the last of the rest and the rest is held back until it is in the worker: it
    waits for them rather than recompute them, asks for them, and the next parts bring them, ahead
    of the rest; its turn is the uninterrupted one."""
    e = streamed["e"]
    assert e["plan"].warm, e["plan"].reasons
    assert e["asked"] >= 1, "the returning conversation did not wait for its coming pages"
    assert e["next"] is not None
    assert e["next"].token_ids == streamed["next_reference"]
    assert e["next"].cached_tokens >= len(streamed["next_prompt"]) - 40, e["next"].cached_tokens
    assert e["rest"]["wanted_blocks"] > 0, e["rest"]
    parts, mine = e["parts"], e["mine"]
    assert len(parts) > 5, len(parts)
    last_mine = max(i for i, p in enumerate(parts) if p & mine)
    assert last_mine < len(parts) // 2, (last_mine, len(parts), "its pages did not come ahead of the rest")
    assert e["rest"]["blocks"] + e["plan"].stats["first_blocks"] == e["plan"].offered_total
    assert e["coming_after"] == 0, "the worker still expects pages after the rest ended"
