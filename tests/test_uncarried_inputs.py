"""Requests whose input a ledger cannot carry — a prompt given as embeddings, images, audio, video —
are never resubmitted on another input: each engine's ledger files them apart (no tokens) and the
restore leaves them to their clients, whose retries send the whole input again. Their partial
blocks are never keyed by the placeholder ids standing where the embeddings or images were.
Against vLLM's own ``Request`` and multimodal classes; the engine path is
``tests/test_vllm_scheduler_half.py`` and ``tests/vllm/test_retries.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from vllm import SamplingParams
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request

from agent.engines.sglang import ledger as sglang_ledger
from agent.engines.sglang.serve import SglangClient
from agent.engines.types import Resubmission
from agent.engines.vllm import ledger as vllm_ledger
from agent.engines.vllm.meta import tail_identified
from agent.engines.vllm.serve import ServeClient
from ckpt.errors import FormatError

# vLLM's Python classes only: run against every supported vLLM release (make test)
pytestmark = pytest.mark.vllm_classes


def image(offset: int, length: int, ident: str = "img-1") -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset=offset, length=length)
    )


def request(prompt: list[int] | None = None, **kw: Any) -> Request:
    return Request("chatcmpl-r-0123abcd", prompt, SamplingParams(max_tokens=50, temperature=0.0), None, **kw)


def test_vllm_names_what_it_cannot_carry_and_files_it_apart_without_tokens() -> None:
    assert vllm_ledger.uncarried_input(request(list(range(40)))) is None
    pic = request(list(range(40)), mm_features=[image(4, 16)])
    assert vllm_ledger.uncarried_input(pic) == "its image inputs are not carried by the ledger"
    embeds = request(None, prompt_embeds=torch.zeros(40, 8))
    assert vllm_ledger.uncarried_input(embeds) == "its prompt embeddings are not carried by the ledger"
    mixed = request([5] * 40, prompt_embeds=torch.zeros(40, 8), prompt_is_token_ids=[True] * 20 + [False] * 20)
    assert vllm_ledger.uncarried_input(mixed) == "its prompt embeddings are not carried by the ledger"
    plain = vllm_ledger.request_entry(request(list(range(40))), 32)
    left = vllm_ledger.request_entry(pic, 32)
    assert left["left_to_client"] == "its image inputs are not carried by the ledger"
    assert not left["exact"]
    led = vllm_ledger.make_ledger([plain, left], step=3, block_size=32)
    data = json.loads(json.dumps(led.model_dump(by_alias=True)))["data"]
    # a reader of "requests" alone, an older gpuckpt's, never sees it
    assert [e["client_request_id"] for e in data["requests"]] == ["chatcmpl-r"]
    assert data["left_to_client"] == [
        {
            "request_id": "chatcmpl-r-0123abcd",
            "client_request_id": "chatcmpl-r",
            "left_to_client": "its image inputs are not carried by the ledger",
        }
    ]
    carried, gone = vllm_ledger.resubmissions(led)
    assert carried.left_to_client is None
    assert carried.token_ids == list(range(40))
    assert gone.left_to_client == "its image inputs are not carried by the ledger"
    assert (gone.token_ids, gone.exact) == ([], False)
    assert vllm_ledger.count(led) == 2, "the checkpoint's requests, the one left to its client included"
    # a ledger before this field reads as before
    assert [
        r.request_id for r in vllm_ledger.resubmissions(vllm_ledger.make_ledger([plain], step=1, block_size=32))
    ] == ["chatcmpl-r"]


def test_a_tail_key_is_never_made_of_placeholder_ids() -> None:
    pic = request(list(range(100)), mm_features=[image(40, 20)])
    assert tail_identified(pic, 0, 30)  # text before the image
    assert not tail_identified(pic, 32, 50)  # the image's placeholders
    assert not tail_identified(pic, 59, 64)  # its last placeholder
    assert tail_identified(pic, 60, 90)  # text after it: the parent's hash holds the image's identity
    embeds = request(None, prompt_embeds=torch.zeros(40, 8))
    assert not tail_identified(embeds, 32, 40)
    assert tail_identified(request(list(range(40))), 32, 40)


def test_sglang_files_embeddings_and_multimodal_requests_apart() -> None:
    def req(**kw: Any) -> SimpleNamespace:
        base = dict(
            rid="r1",
            origin_input_ids=[1, 2, 3],
            output_ids=[4],
            sampling_params=SimpleNamespace(temperature=0.0, max_new_tokens=10),
            input_embeds=None,
            multimodal_inputs=None,
        )
        return SimpleNamespace(**{**base, **kw})

    assert sglang_ledger.uncarried_input(req()) is None
    assert sglang_ledger.uncarried_input(req(input_embeds=[[0.0] * 4] * 3)) == (
        "its input embeddings are not carried by the ledger"
    )
    assert "multimodal" in (sglang_ledger.uncarried_input(req(multimodal_inputs=object())) or "")
    # as the linker's capture writes them (agent.engines.sglang.state.ledger_entry)
    plain = {
        "rid": "r1",
        "prompt_token_ids": [1, 2, 3],
        "output_token_ids": [4],
        "kv_tokens": 3,
        "sampling": {"temperature": 0.0, "max_new_tokens": 10},
        "inexact_reasons": [],
    }
    e = {"rid": "e", sglang_ledger.LEFT: "its input embeddings are not carried by the ledger"}
    led = sglang_ledger.make_ledger([plain, e], page_size=16)
    doc = led.model_dump(by_alias=True)
    assert [x["rid"] for x in doc["data"]["requests"]] == ["r1"]
    subs = sglang_ledger.resubmissions(led)
    assert [(s.request_id, s.left_to_client) for s in subs] == [("r1", None), ("e", e[sglang_ledger.LEFT])]
    with pytest.raises(FormatError, match="left_to_client is not a list"):
        sglang_ledger.left_entries({**doc, "data": {"page_size": 16, "requests": [], "left_to_client": 3}})


LEFT = Resubmission(
    request_id="cmpl-e-0",
    token_ids=[],
    num_prompt_tokens=0,
    output_token_ids=[],
    sampling={},
    exact=False,
    left_to_client="its prompt embeddings are not carried by the ledger",
)


def test_no_client_resubmits_a_request_left_to_its_client() -> None:
    sent: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        sent.append(req.url.path)
        return httpx.Response(500)

    with ServeClient("http://w", transport=httpx.MockTransport(handler)) as c:
        out = c.submit([LEFT])
    assert out["cmpl-e-0"].left_to_client == LEFT.left_to_client
    with SglangClient("http://w", transport=httpx.MockTransport(handler)) as s:
        out = s.submit([LEFT])
    assert out["cmpl-e-0"].left_to_client == LEFT.left_to_client
    assert sent == [], "nothing reached a worker"


def test_a_ledger_from_before_left_to_client_never_resubmits_a_prompt_given_as_embeddings() -> None:
    """An older gpuckpt kept such a request among the requests, without prompt tokens (and
    resubmitted it as its outputs alone): read now, it is left to its client."""
    from agent.engines.types import RestorePlan

    old = vllm_ledger.request_entry(request(list(range(40))), 32)
    gone = {**old, "client_request_id": "cmpl-e-0", "prompt_token_ids": [], "exact": False}
    gone["inexact_reasons"] = ["prompt embeddings are not carried by the ledger"]
    doc = {"schema": vllm_ledger.SCHEMA, "version": 3, "data": {"step": 1, "block_size": 32, "requests": [old, gone]}}
    assert [e["client_request_id"] for e in vllm_ledger.read(doc)] == ["chatcmpl-r"]
    subs = vllm_ledger.resubmissions(doc)
    assert [(s.request_id, s.left_to_client) for s in subs] == [
        ("chatcmpl-r", None),
        ("cmpl-e-0", "its prompt embeddings are not carried by the ledger"),
    ]
    assert vllm_ledger.request_states(doc, warm=True) == ({}, {})
    assert vllm_ledger.count(doc) == 2
    plan = RestorePlan(True, [], subs)
    assert plan.inexact() == {}, "a request left to its client is not replayed cold"
    assert plan.left_to_client() == {"cmpl-e-0": "its prompt embeddings are not carried by the ledger"}
    assert [r.request_id for r in plan.to_resubmit()] == ["chatcmpl-r"]
    # a left entry must say why
    bad = {**doc, "data": {**doc["data"], "left_to_client": [{"client_request_id": "x"}]}}
    with pytest.raises(FormatError, match="each with why"):
        vllm_ledger.left_entries(bad)
