"""A vLLM worker for the tests, run as its own process: ``python vllm_worker.py JSON``
(:func:`tests.harness.vllm.run_worker` runs it).

Modes:

``checkpoint``
    Finish a first turn of two conversations, capture the now idle engine
    (nothing running: the prefix cache and the finished turns' tails), start
    the in-flight requests (three greedy, one seeded at temperature 1),
    checkpoint mid-decode through the control socket, then let the same
    engine finish them (the uninterrupted reference), send each
    conversation's next turn (what the engine's own cache gives it) and
    write the result.
``capacity``
    Start the engine (``connector: false``: without gpuckpt) and report the KV
    blocks vLLM allocated and whether its hybrid KV cache manager is on (every
    mode reports these, as ``kv``).
``restore``
    Start a fresh engine with the connector, restore the checkpoint (warm or
    cold; the canary probe runs through :func:`make_generate`), resubmit the
    ledger's requests, finish them, then send each conversation's next turn;
    write outputs, cached-token counts and the connector's stats. With
    ``canary_fault``, restore the same checkpoint once more through a
    ``generate`` that returns wrong tokens (a worker that disagrees with the
    checkpoint): the restore must fail closed and replay cold.

The checkpoint mode passes the same kind of ``generate`` to
``agent.session.checkpoint``, which records the canary just before the capture.
"""

from __future__ import annotations

import json
import os
import sys
import time

COMPACT_JSON = {"backend": "xgrammar", "disable_any_whitespace": True}


def make_llm(a: dict):
    from vllm import LLM

    t0 = time.monotonic()
    llm = LLM(
        model=a["model"],
        skip_tokenizer_init=not a.get("tokenizer"),
        tensor_parallel_size=a.get("tp", 1),
        enforce_eager=True,
        dtype=a.get("dtype", "float32"),
        block_size=a.get("block_size", 32),
        max_model_len=1024,
        max_num_seqs=8,
        gpu_memory_utilization=a.get("gpu_memory_utilization", 0.3),
        seed=0,
        enable_prefix_caching=True,
        **({"mamba_cache_mode": a["mamba_cache_mode"]} if a.get("mamba_cache_mode") else {}),
        **({"speculative_config": a["speculative_config"]} if a.get("speculative_config") else {}),
        kv_transfer_config=kv_config(a) if a.get("connector", True) else None,
        # a random model fills JSON with whitespace: keep the schema's output bounded
        **({"structured_outputs_config": COMPACT_JSON} if a.get("tokenizer") else {}),
    )
    return llm, time.monotonic() - t0


def kv_config(a: dict) -> dict:
    cfg = {
        "kv_connector": "GpuckptConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "control_socket": a["socket"],
            "staging_dir": a["staging"],
            "inject_faults": a.get("inject_faults", []),
        },
    }
    if not a.get("by_name"):
        # Without it, vLLM resolves the name through gpuckpt's installed
        # vllm.general_plugins entry point (agent/engines/vllm/plugin.py).
        cfg["kv_connector_module_path"] = "agent.engines.vllm.connector"
    return cfg


def drain(llm, outs: dict, until=None) -> None:
    """Step the client until ``until(outs)`` or nothing is unfinished."""
    eng = llm.llm_engine
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = {
                "tokens": list(o.outputs[0].token_ids),
                "finished": o.finished,
                "num_cached_tokens": o.num_cached_tokens,
                "prompt_len": len(o.prompt_token_ids or []),
            }
        if until is not None and until(outs):
            return


def make_generate(llm, outs: dict, *, fault: bool = False):
    """``generate(prompt_ids, n)`` for the canary: one greedy request on this engine,
    stepped with whatever else is running (their outputs keep landing in ``outs``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    calls = [0]

    def generate(prompt_ids: list[int], n: int) -> list[int]:
        rid = f"gpuckpt-canary-{calls[0]}"
        calls[0] += 1
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt_ids)), sp)
        drain(llm, outs, until=lambda o: bool(o.get(rid, {}).get("finished")))
        toks = outs.pop(rid)["tokens"]
        return [(t + 1) % 500 for t in toks] if fault else toks

    return generate


def checkpoint_in_flight(a: dict, llm, repo, outs: dict, requests: dict, min_outputs: int):
    """Start ``requests`` (id → (prompt ids, params)) together and checkpoint them mid-decode.

    Race-free on a busy host: the EngineCore runs ahead of this client, so
    nothing here waits on the outputs it sees. The canary is recorded first
    (nothing may run between the condition and the capture), the connector
    holds the requests until all have arrived, and the capture is taken at the
    first step boundary where every one has ``min_outputs`` outputs, as the
    engine's scheduler judges it.
    """
    from vllm.inputs import TokensPrompt

    from agent import session
    from agent.engines import canary

    probe = canary.record(make_generate(llm, outs))
    session.hold(a["socket"], len(requests), timeout=300)

    def start() -> None:
        for rid, (toks, sp) in requests.items():
            llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=toks), sp)

    when = {"live": len(requests), "min_outputs": min_outputs}
    return session.checkpoint_around(a["socket"], start, repo, "w0", canary=probe, when=when, timeout=300).manifest


WORDS = "(alpha|beta|gamma|delta)"
REGEX = f"{WORDS}(,{WORDS}){{59}}"
SCHEMA = {
    "type": "array",
    "items": {"type": "string", "enum": ["alpha", "beta", "gamma", "delta"]},
    "minItems": 40,
    "maxItems": 40,
}


def mixed(a: dict, llm, repo, res: dict) -> None:
    """Requests with state beyond their tokens in flight beside greedy ones, checkpointed mid-decode;
    then the same engine finishes them (the reference) and keeps serving."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    eng = llm.llm_engine
    rng = random.Random(11)
    greedy = {"temperature": 0.0, "max_tokens": 240, "ignore_eos": True}
    params = {
        "greedy0": SamplingParams(**greedy),
        "penalised0": SamplingParams(**greedy, frequency_penalty=0.8, presence_penalty=0.5),
        "penalised1": SamplingParams(
            **greedy, repetition_penalty=1.3, bad_words=["alpha", "fox"], logit_bias={7: -4.0}, min_tokens=200
        ),
        "regex0": SamplingParams(
            temperature=0.0, max_tokens=400, structured_outputs=StructuredOutputsParams(regex=REGEX)
        ),
        "json0": SamplingParams(
            temperature=0.0,
            max_tokens=400,
            structured_outputs=StructuredOutputsParams(json=SCHEMA),
        ),
    }
    system = [rng.randrange(3, 500) for _ in range(40)]
    prompts = {rid: system + [rng.randrange(3, 500) for _ in range(30 + 11 * i)] for i, rid in enumerate(params)}
    outs: dict = {}
    m = checkpoint_in_flight(a, llm, repo, outs, {rid: (prompts[rid], sp) for rid, sp in params.items()}, 30)
    res["checkpoint"] = m.id
    res["ledger"] = {
        e["client_request_id"]: {
            "outputs": len(e["output_token_ids"]),
            "exact": e["exact"],
            "inexact_reasons": e["inexact_reasons"],
            "structured_outputs": e["structured_outputs"],
        }
        for e in m.ledger.data["requests"]
    }
    drain(llm, outs)
    res["reference"] = {rid: prompts[rid] + outs[rid]["tokens"] for rid in prompts}
    res["prompt_lens"] = {rid: len(p) for rid, p in prompts.items()}
    # the first worker keeps serving after the checkpoint
    outs = {}
    after = SamplingParams(**{**greedy, "max_tokens": 16})
    eng.add_request("after0", TokensPrompt(prompt_token_ids=[*system, 9, 8, 7]), after)
    drain(llm, outs)
    res["after"] = len(outs["after0"]["tokens"])


def faults(a: dict, llm, res: dict) -> None:
    """Every connector hook fails: the engine must still complete every request, and a capture
    must come back as a named error."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from agent import session

    eng = llm.llm_engine
    rng = random.Random(5)
    prompts = {f"f{i}": [rng.randrange(3, 500) for _ in range(70 + 9 * i)] for i in range(3)}
    for rid, toks in prompts.items():
        sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        eng.add_request(rid, TokensPrompt(prompt_token_ids=toks), sp)
    outs: dict = {}
    drain(llm, outs, until=lambda o: len(o) == 3 and min(len(v["tokens"]) for v in o.values()) >= 10)
    try:
        session.capture(a["socket"], timeout=5)
        res["capture_error"] = None
    except Exception as exc:
        res["capture_error"] = f"{type(exc).__name__}: {exc}"
    drain(llm, outs)
    res["completed"] = {rid: len(v["tokens"]) for rid, v in outs.items() if v["finished"]}
    res["stats"] = session.stats(a["socket"])


def main() -> None:
    a = json.loads(sys.argv[1])
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from agent import session
    from agent.engines.vllm import offline
    from ckpt import Repository

    t_start = time.monotonic()
    llm, start_s = make_llm(a)
    eng = llm.llm_engine
    res: dict = {"engine_start_s": start_s, "kv": kv_facts(llm)}
    if a["mode"] == "capacity":  # the KV capacity the engine reports, nothing else
        return finish(a, res)
    repo = Repository.open(a["repo"], create=True)
    sp = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    if a["mode"] == "mixed":
        mixed(a, llm, repo, res)
    elif a["mode"] == "faults":
        faults(a, llm, res)
    elif a["mode"] == "checkpoint":
        import random

        rng = random.Random(7)
        # shared by every request: stored once (longer for a model whose blocks are longer)
        system = [rng.randrange(3, 512) for _ in range(a.get("system_len", 64))]
        convs = {f"conv{i}": system + [rng.randrange(3, 512) for _ in range(40 + 17 * i)] for i in range(2)}
        outs: dict = {}
        for rid, toks in convs.items():
            eng.add_request(rid, TokensPrompt(prompt_token_ids=toks), sp(40))
        drain(llm, outs)
        res["turn1"] = {rid: convs[rid] + outs[rid]["tokens"] for rid in convs}
        t0 = time.monotonic()
        cap = session.capture(a["socket"], timeout=20)  # no request running: must still complete
        res["idle_capture"] = {
            **cap.stats,
            "ledger_requests": len(cap.ledger.data["requests"]),
            "call_s": time.monotonic() - t0,
        }
        cap.close()
        prompts = {f"req{i}": system + [rng.randrange(3, 512) for _ in range(100 + 37 * i)] for i in range(3)}
        for rid, toks in prompts.items():
            eng.add_request(rid, TokensPrompt(prompt_token_ids=toks), sp(a.get("max_tokens", 240)))
        if a.get("seeded", True):  # (off for a model whose seeded sampling vLLM's CPU build cannot run)
            prompts["seeded0"] = system + [rng.randrange(3, 512) for _ in range(120)]
            seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=240, ignore_eos=True)
            eng.add_request("seeded0", TokensPrompt(prompt_token_ids=prompts["seeded0"]), seeded)
        outs = {}
        n = len(prompts)
        drain(llm, outs, until=lambda o: len(o) == n and min(len(v["tokens"]) for v in o.values()) >= 40)
        taken = session.checkpoint(a["socket"], repo, "w0", generate=make_generate(llm, outs))
        m, st = taken.manifest, taken.stats
        res["canary"] = m.canary
        res["kv_groups"] = m.pins.worker.kv_groups
        res["checkpoint"] = m.id
        res["checkpoint_stats"] = st
        res["sizes"] = m.sizes.model_dump()
        res["ledger_outputs"] = {e["client_request_id"]: len(e["output_token_ids"]) for e in m.ledger.data["requests"]}
        # how the stored pages' head slots map to the ranks that wrote them
        res["page_heads"] = m.layout.get("page_heads")
        res["shards"] = [s["kv_heads"] for s in m.layout.get("shards") or ()]
        res["namespace_kv"] = m.namespace.get("kv")
        res["ledger_inexact"] = {e["client_request_id"]: e["inexact_reasons"] for e in m.ledger.data["requests"]}
        res["ledger_generators"] = [
            e["client_request_id"] for e in m.ledger.data["requests"] if e.get("generator_state")
        ]
        drain(llm, outs)
        res["reference"] = {rid: prompts[rid] + outs[rid]["tokens"] for rid in prompts}
        # each conversation's next turn on the uninterrupted engine: what its own cache gives
        outs = {}
        for rid, hist in res["turn1"].items():
            eng.add_request(rid + "-t2", TokensPrompt(prompt_token_ids=[*hist, 5, 6, 7, 8]), sp(4))
        drain(llm, outs)
        res["turn2"] = {rid: {"num_cached_tokens": v["num_cached_tokens"]} for rid, v in outs.items()}
    else:
        t0 = time.monotonic()
        gen_outs: dict = {}
        plan = session.restore(
            repo, a["checkpoint"], a["socket"], staging_dir=a["staging"], generate=make_generate(llm, gen_outs)
        )
        res["warm"], res["reasons"], res["restore_stats"] = plan.warm, plan.reasons, plan.stats
        res["inexact"] = plan.inexact()  # each request the restore does not promise exact, and why
        offline.submit(llm, plan.requests)
        outs = {}
        first: dict = {}

        def note_first(o):
            for rid, _v in o.items():
                first.setdefault(rid, time.monotonic() - t0)
            return False

        drain(llm, outs, until=note_first)
        res["resume_s"] = first
        res["restore_total_s"] = time.monotonic() - t0
        # the rest of the prefix cache streams in behind the resubmitted requests
        assert plan.wait_offered(300), "the rest of the restore did not arrive"
        res["restore_stats"] = {**plan.stats, **plan.totals()}
        res["restored"] = {
            r.request_id: {
                "full": r.token_ids + outs[r.request_id]["tokens"],
                "prompt_len": len(r.token_ids),
                "num_cached_tokens": outs[r.request_id]["num_cached_tokens"],
            }
            for r in plan.requests
        }
        res["connector_after_restore"] = session.stats(a["socket"])
        outs = {}
        for rid, hist in a.get("turn1", {}).items():
            eng.add_request(rid + "-t2", TokensPrompt(prompt_token_ids=[*hist, 5, 6, 7, 8]), sp(4))
        drain(llm, outs)
        res["turn2"] = {
            rid: {"prompt_len": v["prompt_len"], "num_cached_tokens": v["num_cached_tokens"]} for rid, v in outs.items()
        }
        res["connector"] = session.stats(a["socket"])
        res["extra_restores"] = {}
        for ref in a.get("extra_restores", []):
            plan = session.restore(repo, ref, a["socket"], staging_dir=a["staging"], generate=make_generate(llm, {}))
            res["extra_restores"][ref] = {"warm": plan.warm, "reasons": plan.reasons}
            session.withdraw(a["socket"])
        if a.get("canary_fault"):
            import dataclasses

            plan = session.restore(
                repo,
                a["checkpoint"],
                a["socket"],
                staging_dir=a["staging"],
                generate=make_generate(llm, {}, fault=True),
            )
            plan.wait_offered(300)
            f: dict = {"warm": plan.warm, "reasons": plan.reasons, "restore_stats": {**plan.stats, **plan.totals()}}
            f["connector_after_restore"] = session.stats(a["socket"])
            # new ids: the first pass's requests (same client ids) are finished, but keep them apart
            again = [dataclasses.replace(r, request_id=r.request_id + "-again") for r in plan.requests]
            offline.submit(llm, again)
            outs = {}
            drain(llm, outs)
            f["restored"] = {r.request_id: r.token_ids + outs[r.request_id + "-again"]["tokens"] for r in plan.requests}
            res["canary_fault"] = f
    res["total_s"] = time.monotonic() - t_start
    finish(a, res)


def kv_facts(llm) -> dict:
    """What vLLM allocated: blocks, and whether its hybrid KV cache manager is on."""
    cfg = llm.llm_engine.vllm_config
    return {
        "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
        "hybrid_manager_off": bool(cfg.scheduler_config.disable_hybrid_kv_cache_manager),
    }


def finish(a: dict, res: dict) -> None:
    """Write the result file; wait to be killed if asked; exit without an engine shutdown."""
    tmp = a["result"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, a["result"])
    if a.get("wait_for_kill"):
        time.sleep(3600)  # the test kills this process group, as a crash would
    os._exit(0)  # do not wait for a graceful engine shutdown


if __name__ == "__main__":
    main()
