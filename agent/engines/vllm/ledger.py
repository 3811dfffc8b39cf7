"""The request ledger: in-flight vLLM requests as JSON, and back to resubmissions.

Schema ``gpuckpt-vllm-ledger`` version 1: ``data`` is
``{"step": int, "block_size": int, "requests": [entry, …]}`` with one entry
per request the scheduler held at the captured step boundary::

    {"request_id": internal id, "client_request_id": id the client gave,
     "prompt_token_ids": [...], "output_token_ids": [...],
     "num_computed_tokens": tokens whose KV the capture holds,
     "max_tokens": original budget, "remaining_max_tokens": int,
     "min_tokens": int, "sampling": {public SamplingParams fields},
     "cache_salt": str|null, "lora": str|null, "priority": int,
     "arrival_time": float,
     "generator_state": base64 of torch.Generator.get_state() — seeded
                        requests only, added by the connector after the copy}

``generator_state`` is the sampler's random state before the captured step's
sample, i.e. after exactly the entry's outputs; a warm restore sets it before
the resubmitted request's first sample. A cold replay does not (the seeded
continuation then differs from the uninterrupted run).
"""

from __future__ import annotations

from typing import Any

from agent.engines.base import Resubmission
from ckpt import Ledger

SCHEMA = "gpuckpt-vllm-ledger"
VERSION = 1

# Public SamplingParams fields that are plain JSON. Anything else (structured
# outputs, logits processors) is refused at capture time rather than dropped.
SAMPLING_FIELDS = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
)


def client_id(internal: str) -> str:
    """The id the client gave: vLLM appends ``-<8 random chars>`` to it."""
    head, sep, tail = internal.rpartition("-")
    return head if sep and len(tail) == 8 else internal


def sampling_to_json(sp: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        v = getattr(sp, name, None)
        if v is None:
            continue
        if isinstance(v, (set, frozenset, tuple)):
            v = sorted(v) if isinstance(v, (set, frozenset)) else list(v)
        if isinstance(v, dict):
            v = {str(k): val for k, val in v.items()}
        out[name] = v
    if getattr(sp, "structured_outputs", None) is not None:
        raise ValueError("structured outputs are not carried by the ledger yet")
    return out


def request_entry(req: Any, kv_tokens: int) -> dict[str, Any]:
    """A live ``vllm.v1.request.Request`` as a ledger entry (called on the scheduler thread)."""
    sp = req.sampling_params
    outputs = list(req.output_token_ids)
    max_tokens = int(req.max_tokens)
    lora = getattr(req, "lora_request", None)
    return {
        "request_id": req.request_id,
        "client_request_id": client_id(req.request_id),
        "prompt_token_ids": list(req.prompt_token_ids or []),
        "output_token_ids": outputs,
        "num_computed_tokens": kv_tokens,
        "max_tokens": max_tokens,
        "remaining_max_tokens": max(0, max_tokens - len(outputs)),
        "min_tokens": int(getattr(sp, "min_tokens", 0) or 0),
        "sampling": sampling_to_json(sp),
        "cache_salt": req.cache_salt,
        "lora": getattr(lora, "lora_name", None),
        "priority": int(req.priority),
        "arrival_time": float(req.arrival_time),
    }


def make_ledger(entries: list[dict[str, Any]], *, step: int, block_size: int) -> Ledger:
    return Ledger.model_validate(
        {"schema": SCHEMA, "version": VERSION, "data": {"step": step, "block_size": block_size, "requests": entries}}
    )


def resubmissions(ledger: Ledger | dict[str, Any]) -> list[Resubmission]:
    """The requests to submit again: prompt + outputs so far, the rest of the budget."""
    d = ledger.model_dump(by_alias=True) if isinstance(ledger, Ledger) else ledger
    if d.get("schema") != SCHEMA or d.get("version") != VERSION:
        raise ValueError(f"not a {SCHEMA} v{VERSION} ledger: {d.get('schema')!r} v{d.get('version')!r}")
    out = []
    for e in d["data"]["requests"]:
        if e["remaining_max_tokens"] <= 0:
            continue
        sampling = dict(e["sampling"])
        sampling["max_tokens"] = e["remaining_max_tokens"]
        sampling["min_tokens"] = max(0, e["min_tokens"] - len(e["output_token_ids"]))
        out.append(
            Resubmission(
                request_id=e["client_request_id"],
                token_ids=list(e["prompt_token_ids"]) + list(e["output_token_ids"]),
                num_prompt_tokens=len(e["prompt_token_ids"]),
                output_token_ids=list(e["output_token_ids"]),
                sampling=sampling,
                priority=e["priority"],
                cache_salt=e["cache_salt"],
            )
        )
    return out
