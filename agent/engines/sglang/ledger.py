"""The request ledger of an SGLang worker: its requests as plain JSON, and back to resubmissions.

No SGLang import: the agent reads ledgers; the linker
(:mod:`agent.engines.sglang.linker`) writes them on the scheduler thread.

Schema ``gpuckpt-sglang-ledger`` version 1; ``data`` is
``{"page_size": int, "requests": [entry, …]}``, one entry per request the
scheduler held (running batch and waiting queue) at the captured step
boundary::

    {"rid": the request id the client gave (SGLang keeps it as is),
     "prompt_token_ids": [...], "output_token_ids": [...],
     "kv_tokens": tokens of prompt + outputs whose KV the capture holds,
     "sampling": {SAMPLING_FIELDS present}, "priority": int | null,
     "extra_key": str | null, "cache_salt": str | null,
     "return_logprob": bool,
     "inexact_reasons": [why a resubmission cannot continue exactly, …],
     "api": {"endpoint": "chat"|"completions", "body": sha256 of the
             request body, "tenant": sha256 of its Authorization header,
             "n": choices, "request_id": the client's id (X-Request-Id or
             the body's rid), "unattachable": why a retry cannot be served
             from the continuation | null} | absent — what gpuckpt's SGLang
             server (:mod:`.middleware`) recorded of the call, added by the
             agent after the capture (:func:`carry_api`), so that the
             client's retry attaches to the continuation}

and, where the capture held requests whose input the ledger cannot carry
(:func:`uncarried_input`), ``data["left_to_client"]``: ``[{"rid",
"left_to_client": why}, …]`` — no tokens, never resubmitted.

**What continues exactly**: a request resubmitted as prompt + outputs with
``max_new_tokens`` (and ``min_new_tokens``) reduced by the outputs continues
from the exact next token when its next token depends on those tokens and
stateless parameters only: greedy decoding, temperature / top-p / top-k /
min-p (unseeded: a fresh draw, as any other), ``logit_bias``,
``stop_token_ids``, ``ignore_eos``. Recorded as inexact (resubmitted all the
same — its KV is right — but reported as a cold replay):

- seeded sampling that is not greedy: SGLang derives its noise from the seed
  and the batch's state, which a resubmission does not reproduce (not
  reproducible by default at all: ``--enable-deterministic-inference``);
- frequency / presence / repetition penalties: they count the request's
  earlier *outputs*, which the resubmission sends as prompt;
- structured outputs (``json_schema``, ``regex``, ``ebnf``,
  ``structural_tag``): the grammar would start over at the outputs so far;
- stop strings / stop regexes: matched on the output text, which the
  resubmission starts afresh;
- logprobs: those of the earlier outputs are not produced again;
- custom logit processors and custom parameters; beam search; ``n > 1``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from agent.engines.types import Resubmission
from ckpt import Ledger
from ckpt.errors import FormatError

log = logging.getLogger("gpuckpt.sglang")

SCHEMA = "gpuckpt-sglang-ledger"
VERSION = 1

#: The ``SamplingParams`` fields a ledger entry carries (those that are set), all plain JSON.
SAMPLING_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
    "logit_bias",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "n",
    "beam_width",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "stop",
    "stop_regex",
    "custom_params",
)

#: Fields of an entry, each checked by :func:`read`.
_ENTRY_FIELDS = {
    "rid": str,
    "prompt_token_ids": list,
    "output_token_ids": list,
    "kv_tokens": int,
    "sampling": dict,
    "inexact_reasons": list,
}


def inexact_reasons(sampling: dict[str, Any], *, outputs: int, return_logprob: bool = False) -> list[str]:
    """Why a request with these parameters and ``outputs`` outputs so far cannot continue exactly
    after a resubmission of prompt + outputs (empty: it can). See the module docstring."""
    reasons = []
    greedy = float(sampling.get("temperature", 1.0) or 0.0) == 0.0 or int(sampling.get("top_k", -1) or -1) == 1
    if sampling.get("sampling_seed") is not None and not greedy:
        reasons.append("seeded sampling: SGLang does not reproduce a seeded draw after a resubmission")
    if outputs:
        penalties = [f for f in ("frequency_penalty", "presence_penalty") if sampling.get(f)]
        if sampling.get("repetition_penalty") not in (None, 1, 1.0):
            penalties.append("repetition_penalty")
        if penalties:
            reasons.append(f"{', '.join(penalties)} count earlier outputs, which the resubmission sends as prompt")
        grammar = [f for f in ("json_schema", "regex", "ebnf", "structural_tag") if sampling.get(f)]
        if grammar:
            reasons.append(f"structured outputs ({', '.join(grammar)}): the grammar would start over")
        stops = [f for f in ("stop", "stop_regex") if sampling.get(f)]
        if stops:
            reasons.append(f"{', '.join(stops)}: matched on output text the resubmission starts afresh")
    if return_logprob:
        reasons.append("logprobs: those of the earlier outputs are not produced again")
    if sampling.get("custom_params"):
        reasons.append("custom parameters (custom logit processors) are not carried")
    if (sampling.get("beam_width") or 1) > 1:
        reasons.append("beam search is not continued")
    if (sampling.get("n") or 1) > 1:
        reasons.append("n > 1: each choice is resubmitted as a request of its own")
    return reasons


#: the ledger's ``data`` key of the requests whose input it cannot carry (input embeddings, images,
#: audio, video: SGLang's token ids there are placeholders), each ``{"rid", "left_to_client": why}``;
#: apart from ``requests`` so that no reader, an older one included, resubmits one of them
LEFT = "left_to_client"


def uncarried_input(req: Any) -> str | None:
    """Why the ledger cannot carry an SGLang ``Req``'s input (``None``: it can): it holds multimodal
    items (whose tokens are pad values standing for each item), or its prompt came as embeddings
    (SGLang then makes up its token ids; SGLang 0.5.23 refuses such a request unless the radix
    cache is off, "input_embeds is provided while disable_radix_cache is False", so beside
    gpuckpt's linker it does not arise). Resubmitting its ids would run another input."""
    if getattr(req, "input_embeds", None) is not None:
        return "its input embeddings are not carried by the ledger"
    if getattr(req, "multimodal_inputs", None) is not None:
        return "its multimodal inputs (images, audio, video) are not carried by the ledger"
    return None


def make_ledger(entries: list[dict[str, Any]], *, page_size: int) -> Ledger:
    """The ledger of one capture: ``entries`` as the module docstring describes them; an entry
    with ``left_to_client`` (:func:`uncarried_input`) goes under :data:`LEFT`, without its tokens."""
    data: dict[str, Any] = {"page_size": page_size, "requests": [e for e in entries if LEFT not in e]}
    if left := [{"rid": e["rid"], LEFT: e[LEFT]} for e in entries if LEFT in e]:
        data[LEFT] = left
    return Ledger.model_validate({"schema": SCHEMA, "version": VERSION, "data": data})


def left_entries(ledger: Ledger | dict[str, Any]) -> list[dict[str, Any]]:
    """The requests the ledger could not carry, each with why (none in a ledger before them)."""
    read(ledger)  # the schema and version checks
    d = ledger.model_dump(by_alias=True) if isinstance(ledger, Ledger) else ledger
    left = d["data"].get(LEFT) or []
    if not isinstance(left, list) or not all(
        isinstance(e, dict) and isinstance(e.get("rid"), str) and isinstance(e.get(LEFT), str) for e in left
    ):
        raise FormatError(f"{SCHEMA}: data.{LEFT} is not a list of requests, each with why")
    return left


def read(ledger: Ledger | dict[str, Any]) -> list[dict[str, Any]]:
    """The entries of a version-1 SGLang ledger; :class:`ckpt.errors.FormatError` naming what is wrong."""
    d = ledger.model_dump(by_alias=True) if isinstance(ledger, Ledger) else ledger
    if not isinstance(d, dict) or d.get("schema") != SCHEMA or d.get("version") != VERSION:
        got = (d.get("schema"), d.get("version")) if isinstance(d, dict) else (type(d).__name__, None)
        raise FormatError(f"not a version-{VERSION} {SCHEMA} ledger: {got[0]!r} v{got[1]!r}")
    data = d.get("data")
    entries = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise FormatError(f"{SCHEMA}: data.requests is not a list")
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise FormatError(f"{SCHEMA}: request {i} is not an object")
        for name, kind in _ENTRY_FIELDS.items():
            if not isinstance(e.get(name), kind) or (isinstance(e.get(name), bool) and kind is int):
                raise FormatError(f"{SCHEMA}: request {i} ({e.get('rid')!r}): {name} is not a {kind.__name__}")
        for name in ("prompt_token_ids", "output_token_ids"):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in e[name]):
                raise FormatError(f"{SCHEMA}: request {i} ({e['rid']!r}): {name} holds a non-integer")
    return entries


#: the API facts an entry's ``api`` must hold to be matched to a client's retry
_API_FIELDS: dict[str, type | tuple[type, ...]] = {
    "endpoint": str,
    "body": str,
    "tenant": str,
    "n": int,
    "request_id": str,
    "unattachable": (str, type(None)),
}


def valid_api(api: Any) -> dict[str, Any] | None:
    """``api`` as a ledger entry's API facts, or ``None`` where it is not (absent, or not what
    gpuckpt's server records: it is then never matched to anyone's retry)."""
    if not isinstance(api, dict) or any(not isinstance(api.get(k), t) for k, t in _API_FIELDS.items()):
        return None
    return {k: api[k] for k in _API_FIELDS}


def carry_api(ledger: Ledger, fetch: Callable[[list[str]], Mapping[str, Any]]) -> Ledger:
    """``ledger`` with each request's API facts as gpuckpt's SGLang server recorded them (``fetch``:
    rids → ``{rid: facts | None}``); a request the server has none for (it came another way)
    carries none, and its retry is served anew. A server that does not answer: the ledger as it
    was (the checkpoint goes on; no retry of it attaches)."""
    data = ledger.data if isinstance(ledger.data, dict) else None
    entries = [e for e in (data or {}).get("requests") or () if isinstance(e, dict)]
    if not entries:
        return ledger
    try:
        got = dict(fetch([str(e.get("rid")) for e in entries]))
    except Exception as exc:
        log.warning("gpuckpt: the API facts of %d requests were not fetched: %s", len(entries), exc)
        return ledger
    out = []
    for e in (data or {}).get("requests") or ():
        api = valid_api(got.get(str(e.get("rid")))) if isinstance(e, dict) else None
        out.append({**e, "api": api} if api is not None else e)
    return ledger.model_copy(update={"data": {**(data or {}), "requests": out}})


def _remaining(e: dict[str, Any]) -> int | None:
    budget = e["sampling"].get("max_new_tokens")
    return None if budget is None else max(0, int(budget) - len(e["output_token_ids"]))


def resubmissions(ledger: Ledger | dict[str, Any]) -> list[Resubmission]:
    """The requests to submit again: prompt + outputs so far, under the original ``rid``, with
    ``max_new_tokens`` and ``min_new_tokens`` reduced by the outputs; a request with no budget
    left is not resubmitted. ``exact`` / ``reasons`` come from the ledger."""
    out = []
    for e in read(ledger):
        left = _remaining(e)
        if left == 0:
            continue
        sampling = dict(e["sampling"])
        if left is not None:
            sampling["max_new_tokens"] = left
        if sampling.get("min_new_tokens"):
            sampling["min_new_tokens"] = max(0, int(sampling["min_new_tokens"]) - len(e["output_token_ids"]))
        reasons = tuple(str(r) for r in e["inexact_reasons"])
        if e.get("extra_key") is not None:
            sampling["extra_key"] = e["extra_key"]  # /generate takes it beside the sampling params
        out.append(
            Resubmission(
                request_id=e["rid"],
                token_ids=list(e["prompt_token_ids"]) + list(e["output_token_ids"]),
                num_prompt_tokens=len(e["prompt_token_ids"]),
                output_token_ids=list(e["output_token_ids"]),
                sampling=sampling,
                priority=int(e.get("priority") or 0),
                cache_salt=e.get("cache_salt"),
                exact=not reasons,
                reasons=reasons,
                budget={k: e["sampling"].get(k) for k in ("max_new_tokens", "min_new_tokens")},
                api=valid_api(e.get("api")),
            )
        )
    out += [Resubmission.left(e["rid"], str(e[LEFT])) for e in left_entries(ledger)]
    return out


def judged_on(requests: list[Resubmission], layout: Mapping[str, Any]) -> list[Resubmission]:
    """``requests`` as the ledger judged them: nothing of an SGLang worker's layout changes that."""
    return requests


def request_states(ledger: Ledger | dict[str, Any], *, warm: bool) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """What each request needs beyond its tokens (by rid), and why some cannot have it beyond the
    reasons its resubmission already carries.

    An SGLang request carries nothing beyond its tokens and parameters (no
    sampler state is captured), warm or cold: both are empty. (The ledger's
    inexact reasons are on :func:`resubmissions`' requests; repeating them
    here would list them twice.) The ledger is read, so a malformed one fails.
    """
    read(ledger)
    return {}, {}


def key_requests(ledger: Ledger | dict[str, Any]) -> list[dict[str, Any]]:
    """The ``keys`` command's request list: each request's tokens, KV length and namespace, and
    its ``request_id`` (the rid it is resubmitted under)."""
    return [
        {
            "request_id": e["rid"],
            "token_ids": list(e["prompt_token_ids"]) + list(e["output_token_ids"]),
            "kv_tokens": int(e["kv_tokens"]),
            "extra_key": e.get("extra_key"),
            "cache_salt": e.get("cache_salt"),
        }
        for e in read(ledger)
    ]


def count(ledger: Ledger | dict[str, Any]) -> int:
    """Requests the ledger holds, those left to their clients included."""
    return len(read(ledger)) + len(left_entries(ledger))
