"""`make bench-retries`: what a restart costs the clients, with gpuckpt and with a cold restart.

Eight clients stream completions of ``--tokens`` tokens each (greedy and seeded; one asks for
logprobs, one for a JSON document of a schema) from a ``vllm serve`` worker (CPU build, a
generated Llama with a generated tokenizer, gpuckpt's connector and middleware). At
``--cut`` tokens each, the worker is checkpointed and SIGKILLed: every stream breaks. Then,
measured from the moment the new worker's API answers, with each client retrying its call
(same ``X-Request-Id``, same body) at once:

- **gpuckpt**: the new worker restores the checkpoint and the agent's path resubmits the
  ledger; the retries wait for it (the worker holds possible retries until the agent says what it
  resubmits, as ``gpuckpt launch`` configures it) and are served the whole answer from the
  continuations;
- **cold**: a fresh worker; the retries recompute everything.

It prints each client's time to its complete answer, the ratio of the two restarts (mean and
last client; target ≤ 0.5), and the tokens the engine generated after the restart ÷ the tokens
that were still missing at the cut (the engine's own ``vllm:generation_tokens_total``; target
≤ 1.05; a cold restart's is tokens ÷ (tokens - cut)). The gpuckpt answers are checked against
the cold ones for the greedy requests (the JSON document and the logprobs too).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_common import WORKER_ENV, free_port, make_model, worker_args

from agent import session
from agent.engines import canary
from agent.engines.retries import ATTACH_HEADER
from agent.engines.vllm.serve import kv_transfer_config
from agent.testing import ServeProcess
from ckpt import Repository
from tests.harness.models import write_tokenizer

VOCAB = 2048
#: the generated tokenizer's vocabulary (prompts stay inside it; the model's is larger)
TOKENIZER_VOCAB = 500
#: the JSON request's schema: exactly 150 words (600 tokens or more, as the model spells them: it
#: ends after the cut, and within its budget of 1,500)
SCHEMA = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"type": "string", "enum": ["alpha", "beta", "gamma", "delta"]},
            "minItems": 150,
            "maxItems": 150,
        },
        "kind": {"type": "string", "enum": ["x", "yy"]},
    },
    "required": ["words", "kind"],
    "additionalProperties": False,
}


def stream(url: str, rid: str, body: dict[str, Any], t0: float, out: dict[str, Any], cut: int = 0) -> None:
    """One client call, streamed: its tokens, when it completed (from ``t0``), the attach header."""
    ids: list[int] = []
    lps: list[float] = []
    try:
        with (
            httpx.Client(timeout=900) as h,
            h.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r,
        ):
            out["attach"] = r.headers.get(ATTACH_HEADER)
            if r.status_code != 200:  # said at once: a checkpoint waiting for this request would wait in vain
                r.read()
                print(f"{rid}: HTTP {r.status_code}: {r.text[:300]}", file=sys.stderr, flush=True)
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:]).get("choices") or ():
                        ids += ch.get("token_ids") or []
                        out["text"] = out.get("text", "") + (ch.get("text") or "")
                        lps += (ch.get("logprobs") or {}).get("token_logprobs") or []
                        if ids and "first_s" not in out:
                            out["first_s"] = time.monotonic() - t0
                        if cut and len(ids) >= cut and "cut_s" not in out:
                            out["cut_s"] = time.monotonic() - t0
        out["done_s"] = time.monotonic() - t0
    except httpx.HTTPError as exc:
        out["error"] = str(exc)
    out["logprobs"] = lps
    out["ids"] = ids


def generated(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("no vllm:generation_tokens_total in /metrics")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=".demo")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--cut", type=int, default=500)
    a = ap.parse_args()
    work = Path(a.workdir).resolve()
    run = work / time.strftime("retries-%Y%m%dT%H%M%S")
    run.mkdir(parents=True, mode=0o700)
    path = make_model(work / "models-text", layers=4, hidden=512, heads=8, kv_heads=4, vocab=VOCAB, dtype="float32")
    if not (path / "tokenizer.json").exists():  # its <s>, </s> are the model's bos 1, eos 2
        write_tokenizer(path)
    model = str(path)
    repo = Repository.open(str(run / "repo"), create=True)
    rng = random.Random(7)
    system = [rng.randrange(3, TOKENIZER_VOCAB) for _ in range(200)]
    bodies = {}
    for i in range(a.requests):
        sampling: dict[str, Any] = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": 100 + i}
        if i == 2:
            sampling["logprobs"] = 2
        bodies[f"client{i}"] = {
            "model": model,
            "prompt": system + [rng.randrange(3, TOKENIZER_VOCAB) for _ in range(100 + 20 * i)],
            "max_tokens": a.tokens,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
            **sampling,
        }
        if i == 4:  # greedy, a JSON document of SCHEMA: it ends when the document does
            del bodies[f"client{i}"]["ignore_eos"]
            # (its prompt + budget within the worker's 2,048 positions)
            bodies[f"client{i}"]["max_tokens"] = 1500
            bodies[f"client{i}"]["structured_outputs"] = {"json": SCHEMA}

    def worker(name: str, **extra: Any) -> ServeProcess:
        sock, stage = str(run / f"{name}.sock"), str(run / f"stage-{name}")
        w = ServeProcess(
            model,
            sock,
            port=free_port(),
            log_path=str(run / f"{name}.log"),
            staging_dir=stage,
            args=[
                *(x for x in worker_args(max_model_len=2048) if x != "--skip-tokenizer-init"),
                "--structured-outputs-config",
                json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
            ],
            env=WORKER_ENV,
            kv_config=kv_transfer_config(sock, stage, **extra),
        )
        w.wait_ready()
        return w

    # -- the worker that is preempted at the cut
    with worker("a") as w:
        probe = canary.record(w.client.generate)
        dead: dict[str, dict[str, Any]] = {k: {} for k in bodies}
        threads = [
            threading.Thread(target=stream, args=(w.url, k, b, 0.0, dead[k]), daemon=True) for k, b in bodies.items()
        ]

        def start() -> None:
            for t in threads:
                t.start()

        session.hold(w.control_socket, len(bodies), timeout=300)
        when = {"live": len(bodies), "min_outputs": a.cut}
        # as the agent does: the logprobs the server gave out for the captured outputs go in the ledger
        taken = session.checkpoint_around(
            w.control_socket,
            start,
            repo,
            "w0",
            canary=probe,
            when=when,
            timeout=900,
            complete_ledger=w.client.complete_ledger,
        )
        m = taken.manifest
        w.kill()
    assert m.ledger is not None
    cut_at = {e["client_request_id"]: len(e["output_token_ids"]) for e in m.ledger.data["requests"]}
    print(f"checkpoint {m.id}: {len(cut_at)} requests cut at {a.cut}+ tokens")

    def clients(url: str) -> tuple[dict[str, dict[str, Any]], float]:
        t0 = time.monotonic()
        res: dict[str, dict[str, Any]] = {k: {} for k in bodies}
        ts = [threading.Thread(target=stream, args=(url, k, b, t0, res[k], a.cut)) for k, b in bodies.items()]
        for t in ts:
            t.start()
        return res, t0

    # -- gpuckpt: restore + resubmission (the agent's path) beside the clients' retries
    with worker("b", retry_hold_s=60) as w:
        g0 = generated(w.url)
        res_b, _ = clients(w.url)
        t_plan = time.monotonic()
        stage = str(run / "stage-b")
        plan = session.restore(repo, m.id, w.control_socket, staging_dir=stage, generate=w.client.generate)
        plan_s = time.monotonic() - t_plan
        w.client.submit(plan.requests, stream=False)  # as the agent does
        while any("ids" not in r for r in res_b.values()):
            time.sleep(0.05)
        gen_b = generated(w.url) - g0
        warm = plan.warm
    # -- cold: a fresh worker, the clients recompute
    with worker("c") as w:
        g0 = generated(w.url)
        res_c, _ = clients(w.url)
        while any("ids" not in r for r in res_c.values()):
            time.sleep(0.05)
        gen_c = generated(w.url) - g0

    # what was still missing at the cut: each answer's length (the cold run's, the uninterrupted
    # answer for the greedy ones; the JSON document ends before max_tokens) less what was captured
    missing = sum(len(res_c[k]["ids"]) - cut_at[f"cmpl-{k}-0"] for k in bodies)
    print(f"{missing} tokens missing at the cut")
    print(f"\nrestore plan (manifest, pages, canary) {plan_s:.2f} s")
    print(f"{'client':<10}{'gpuckpt first/done s':>22}{'cold first/done s':>20}  attach     same as cold")
    nan = float("nan")
    for k in bodies:
        b, c = res_b[k], res_c[k]
        greedy = bodies[k].get("temperature") == 0.0
        same = ("yes" if b["ids"] == c["ids"] else "NO") if greedy else "(seeded)"
        print(
            f"{k:<10}{b.get('first_s', nan):>12.2f}{b.get('done_s', nan):>10.2f}"
            f"{c.get('first_s', nan):>10.2f}{c.get('done_s', nan):>10.2f}  {b.get('attach')!s:<10} {same}"
        )
    for k, body in bodies.items():
        b, c = res_b[k], res_c[k]
        if body.get("logprobs") is not None:
            near = len(b["logprobs"]) == len(c["logprobs"]) and all(
                abs(x - y) <= 1e-3 for x, y in zip(b["logprobs"], c["logprobs"], strict=True)
            )
            print(f"{k}: logprobs of {len(b['logprobs'])} of {len(b['ids'])} tokens; same as cold: {near}")
        if "structured_outputs" in body:
            try:
                doc = json.loads(b.get("text", ""))
                valid = len(doc["words"]) == 150 and doc["kind"] in ("x", "yy")
            except (ValueError, KeyError, TypeError):
                valid = False
            print(f"{k}: a JSON document of the schema: {valid}; {len(b['ids'])} tokens")
    mean_b = sum(r["done_s"] for r in res_b.values()) / len(res_b)
    mean_c = sum(r["done_s"] for r in res_c.values()) / len(res_c)
    last_b, last_c = max(r["done_s"] for r in res_b.values()), max(r["done_s"] for r in res_c.values())
    print(f"\nrestore warm: {warm}")
    print(
        f"time to complete answers, gpuckpt ÷ cold: mean {mean_b / mean_c:.2f}, last {last_b / last_c:.2f}"
        "  (target ≤ 0.5)"
    )
    tail_c = sum(r["done_s"] - r["cut_s"] for r in res_c.values()) / len(res_c)
    print(
        f"the cold run's own last {a.tokens - a.cut} tokens took {tail_c:.2f} s on average; gpuckpt's "
        f"answers ÷ that: {mean_b / tail_c:.2f} (the floor: the same tokens decoded at the same context lengths)"
    )
    print(
        f"generated after the restart ÷ missing: gpuckpt {gen_b / missing:.3f} (target ≤ 1.05), "
        f"cold {gen_c / missing:.3f}"
    )


if __name__ == "__main__":
    main()
