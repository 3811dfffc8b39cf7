"""Requests with state beyond their tokens, and a connector whose every hook fails.

One checkpointing worker (a model with a generated tokenizer; greedy,
penalised and structured-output requests in flight), one restoring worker,
and one worker whose connector fails in every hook.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.harness.scripts.vllm_worker import REGEX, SCHEMA
from tests.harness.vllm import run_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tiny_llama_text: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-requests")
    base = {"model": str(tiny_llama_text), "repo": str(tmp / "repo"), "tokenizer": True}
    a = run_worker(
        {**base, "mode": "mixed", "socket": str(tmp / "a.sock"), "staging": str(tmp / "stage-a")},
        tmp,
        kill_after_result=True,
    )
    b = run_worker(
        {
            **base,
            "mode": "restore",
            "socket": str(tmp / "b.sock"),
            "staging": str(tmp / "stage-b"),
            "checkpoint": a["checkpoint"],
        },
        tmp,
    )
    return {"a": a, "b": b}


def test_the_ledger_judges_every_request_exact(runs: dict) -> None:
    ledger = runs["a"]["ledger"]
    assert set(ledger) == {"greedy0", "penalised0", "penalised1", "regex0", "json0"}
    for rid, e in ledger.items():
        assert e["outputs"] >= 30, rid  # checkpointed mid-decode
        assert e["exact"], (rid, e["inexact_reasons"])
    assert ledger["regex0"]["structured_outputs"]["regex"] == REGEX
    assert ledger["regex0"]["structured_outputs"]["backend"] == "xgrammar"
    assert json.loads(ledger["json0"]["structured_outputs"]["json"]) == SCHEMA  # the text vLLM compiled


def test_checkpointing_leaves_the_worker_serving(runs: dict) -> None:
    assert runs["a"]["after"] == 16


def test_penalties_and_structured_outputs_continue_exactly(runs: dict) -> None:
    a, b = runs["a"], runs["b"]
    assert b["warm"], b["reasons"]
    for rid, ref in a["reference"].items():
        got = b["restored"][rid]["full"]
        first = next((i for i, (x, y) in enumerate(zip(got, ref, strict=False)) if x != y), min(len(got), len(ref)))
        assert got == ref, f"{rid}: first difference at token {first} (prompt {a['prompt_lens'][rid]})"
        assert b["restored"][rid]["num_cached_tokens"] == b["restored"][rid]["prompt_len"] - 1, rid
    applied = b["connector"]["states_applied"]
    assert "prior_outputs" in applied["penalised0"]
    assert "prior_outputs" in applied["penalised1"]
    assert applied["regex0"] == ["grammar"]
    assert applied["json0"] == ["grammar"]


def test_structured_outputs_are_valid_for_their_schema(runs: dict, tiny_llama_text: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_text)
    a, b = runs["a"], runs["b"]
    for rid in ("regex0", "json0"):
        out = b["restored"][rid]["full"][a["prompt_lens"][rid] :]
        text = tok.decode(out, skip_special_tokens=True)
        if rid == "regex0":
            assert re.fullmatch(REGEX, text), text
        else:
            value = json.loads(text)
            assert isinstance(value, list)
            assert len(value) == SCHEMA["minItems"]
            assert set(value) <= set(SCHEMA["items"]["enum"])


def test_a_failing_connector_never_takes_the_engine_down(tiny_llama: Path, tmp_path: Path) -> None:
    hooks = [
        "register_kv_caches",
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "build_connector_worker_meta",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "has_pending_push_work",
        "on_new_request",
    ]
    r = run_worker(
        {
            "model": str(tiny_llama),
            "repo": str(tmp_path / "repo"),
            "mode": "faults",
            "socket": str(tmp_path / "f.sock"),
            "staging": str(tmp_path / "stage"),
            "inject_faults": hooks,
        },
        tmp_path,
    )
    assert r["completed"] == {"f0": 60, "f1": 60, "f2": 60}
    assert r["capture_error"] is not None
    assert "ControlError" in r["capture_error"]
    assert "build_connector_meta" in r["capture_error"]  # the error names the failing hook
    # The scheduler half counts its failures (the worker half's are in the worker's log).
    failed = r["stats"]["hook_failures"]
    for h in ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"):
        assert failed.get(h, 0) >= 1, (h, failed)
