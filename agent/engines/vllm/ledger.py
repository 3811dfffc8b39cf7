"""The request ledger: in-flight vLLM requests as JSON, and back to resubmissions.

Schema ``gpuckpt-vllm-ledger`` version 3 (versions 1 and 2 are still read): ``data``
is ``{"step": int, "block_size": int, "requests": [entry, …]}`` with one
entry per request the scheduler held at the captured step boundary::

    {"request_id": internal id, "client_request_id": id the client gave,
     "prompt_token_ids": [...], "output_token_ids": [...],
     "num_computed_tokens": tokens whose KV the capture holds,
     "max_tokens": original budget, "remaining_max_tokens": int,
     "min_tokens": int, "sampling": {public SamplingParams fields},
     "structured_outputs": {regex|json|choice|grammar|json_object|
                            structural_tag, options…, "backend": name,
                            "settings": the worker's structured-output
                            settings the grammar was compiled under
                            (grammar_settings), from version 3 on} | null,
     "exact": bool, "inexact_reasons": [why this request cannot continue
                                        exactly after a restore, …],
     "cache_salt": str|null, "lora": str|null, "priority": int,
     "arrival_time": float,
     "generator_state": base64 of torch.Generator.get_state() — seeded
                        requests on the V1 model runner only, added by the
                        connector after the copy,
     "api": {"endpoint": "chat"|"completions", "body": sha256 of the
             request body, "tenant": sha256 of its Authorization header,
             "n": choices, "unattachable": why a retry cannot be served
             from the continuation | null} | absent — version 3: the
             API-level facts gpuckpt's middleware (:mod:`.middleware`)
             recorded, so a client's retry can be matched to this entry,
     "logprobs": [[[token id, logprob (null: -inf), rank, text], …] per
                  output token] | absent — a request that asked for
                  logprobs: those of its outputs, as the API server gave them
                  (added by the agent after the capture, :func:`carry_logprobs`;
                  without them its retry is served anew)}

and, where the capture held requests whose input the ledger cannot carry
(prompt embeddings, images, audio, video: :func:`uncarried_input`),
``data["left_to_client"]``: ``[{"request_id", "client_request_id",
"left_to_client": why, "api"}, …]`` — no tokens, never resubmitted; kept apart
from ``requests`` so that no reader, an older one included, resubmits them.

**What continues exactly** (``exact: true``): a request resubmitted as
prompt + outputs continues from the exact next token when everything that
decides its next token is carried:

- greedy and seeded sampling (the V1 runner's ``torch.Generator`` state is
  ``generator_state``, set before the first restored sample; Model Runner V2
  derives its noise from seed and position, which prompt + outputs keep);
- stateless parameters: temperature, top-p/k, min-p, ``logit_bias``,
  ``allowed_token_ids``, stop token ids, ``ignore_eos``, ``logprobs``;
- counters: ``max_tokens`` and ``min_tokens`` are reduced by the outputs so far;
- frequency / presence penalties and ``bad_words``, which look at *outputs*
  only: the connector hands the worker the earlier outputs
  (:data:`PRIOR_OUTPUTS_NEEDED`) and puts them in front of the restored
  request's outputs in the sampler's view (V1 runner, synchronous scheduling);
  the repetition penalty covers prompt and outputs alike and needs nothing;
- structured outputs: the grammar is compiled anew — under the same settings as the original's
  (``settings``: the server's backend and whitespace options, which shape every grammar it
  compiles; a worker with others, or a ledger without them, leaves the request to its client,
  :func:`judged_on`) — and advanced by the earlier outputs before the first restored token is
  constrained. A grammar that rejects them voids the continuation (the connector stops it and no
  client is served it: the retry is computed anew);
- parallel sampling (``n > 1``): each choice is an engine request of its own
  with its own seed (the parent's + its index) and generator, carried as any
  seeded request.

A request's state is applied only to the request that continues it: the
same ledger id (or the resubmission's id, :func:`resubmitted_id`) *and* a
prompt equal to the entry's prompt + outputs (:func:`token_digest`). A state
that no such request claimed is reported by the restore, and the request
said to be a cold replay.

Anything else is recorded with ``exact: false`` and the reasons; a restore
resubmits such a request all the same (its KV is correct) and reports it as
"replayed cold because …" — never as an exact continuation.

``generator_state`` is the sampler's random state before the captured step's
sample, i.e. after exactly the entry's outputs; a warm restore sets it before
the resubmitted request's first sample. A cold replay does not (the seeded
continuation then differs from the uninterrupted run).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.engines.continuations import valid_positions
from agent.engines.types import Resubmission, token_digest
from ckpt import Ledger
from ckpt.errors import FormatError

log = logging.getLogger("gpuckpt.vllm")

SCHEMA = "gpuckpt-vllm-ledger"
VERSION = 3
READABLE = (1, 2, 3)

# Public SamplingParams fields that are plain JSON (structured outputs are
# carried apart, see STRUCTURED_FIELDS).
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


#: Sampling fields that look at the request's earlier *outputs*: prompt +
#: outputs resubmitted would count those outputs as prompt. The connector
#: corrects this on the V1 model runner (see the module docstring).
PRIOR_OUTPUTS_NEEDED = ("frequency_penalty", "presence_penalty", "bad_words")

#: Structured-output fields carried to the resubmission (one constraint + options).
STRUCTURED_FIELDS = (
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "structural_tag",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)

#: Grammar backends whose matcher the scheduler half can advance by the earlier
#: outputs (vLLM's ``StructuredOutputGrammar.accept_tokens``).
GRAMMAR_BACKENDS = ("xgrammar", "guidance", "outlines", "lm-format-enforcer")

#: the key under which gpuckpt's middleware hands a request's API-level facts to the engine
#: (the body's ``vllm_xargs``, which become ``SamplingParams.extra_args``)
API_XARG = "gpuckpt_api"

#: the key of a finished engine request's ``kv_transfer_params`` by which the connector tells the
#: API server that the request's continuation is void — a carried state it needed could not be
#: applied (why, as the value) — so that no client is ever served it
VOID_PARAM = "gpuckpt_void"


def resubmitted_id(cid: str) -> str:
    """The client id under which ``vllm serve`` runs the agent's resubmission of ``cid`` when no
    gpuckpt middleware renames it: ``/v1/completions`` with ``X-Request-Id`` from
    :func:`agent.engines.vllm.serve.header_request_id`."""
    m = re.match(r"^cmpl-(?P<base>.+)-0$", cid)
    return cid if m else f"cmpl-{cid}-0"


def wants_logprobs(entry: Mapping[str, Any]) -> bool:
    """The request asked for logprobs, and its client's retry could be served from its
    continuation (it came through gpuckpt's middleware, nothing else rules the retry out)."""
    api = entry.get("api")
    return (
        (entry.get("sampling") or {}).get("logprobs") is not None
        and isinstance(api, dict)
        and not api.get("unattachable")
        and bool(entry.get("output_token_ids"))
    )


#: why a logprobs request's retry is served anew when its checkpoint lacks its earlier logprobs
NO_LOGPROBS = "the logprobs of its tokens before the checkpoint are not carried"


def carry_logprobs(ledger: Ledger, fetch: Callable[[list[dict[str, Any]]], Mapping[str, Any]]) -> Ledger:
    """``ledger`` with the logprobs of each logprobs request's captured outputs, as ``fetch`` (the
    worker's API server, which streamed them: ``[{"id", "n", "outputs"}, …]`` → ``{id: positions
    | None}``) gives them. An entry that gets none, or not exactly one position per output,
    carries none: its ``api`` says why its retry is served anew (:data:`NO_LOGPROBS`), and the
    agent leaves it to its client instead of computing a continuation nobody can collect."""
    data = ledger.data if isinstance(ledger.data, dict) else None
    wanted = [e for e in (data or {}).get("requests") or () if isinstance(e, dict) and wants_logprobs(e)]
    if not wanted:
        return ledger
    ask = [
        {"id": e["client_request_id"], "n": int(e["api"].get("n") or 1), "outputs": len(e["output_token_ids"])}
        for e in wanted
    ]
    why = NO_LOGPROBS
    try:
        got = dict(fetch(ask))
    except Exception as exc:  # the checkpoint goes on without them; each retry is served anew
        log.warning("gpuckpt: the logprobs of %d requests were not fetched: %s", len(ask), exc)
        got, why = {}, f"{NO_LOGPROBS} (the API server did not give them: {str(exc)[:120]})"
    entries = []
    for e in data["requests"] if data else ():
        if isinstance(e, dict) and wants_logprobs(e):
            lps = valid_positions(got.get(e["client_request_id"]), len(e["output_token_ids"]))
            e = {**e, "logprobs": lps} if lps is not None else {**e, "api": {**e["api"], "unattachable": why}}
        entries.append(e)
    return ledger.model_copy(update={"data": {**(data or {}), "requests": entries}})


def api_facts(sp: Any) -> dict[str, Any] | None:
    """The API-level facts the middleware recorded for a request (``None``: it came another way)."""
    raw = (getattr(sp, "extra_args", None) or {}).get(API_XARG)
    if not isinstance(raw, str):
        return None
    try:
        facts = json.loads(raw)
    except ValueError:
        return None
    return facts if isinstance(facts, dict) else None


@dataclass(frozen=True)
class RunnerFacts:
    """What the worker's model runner does with a request's state (from the engine config)."""

    model_runner: str = "v1"  # "v1": a torch.Generator per seeded request; "v2": stateless sampling
    async_scheduling: bool = False
    speculative: str | None = None
    """The speculative decoding method (``ngram``, ``eagle3``, ``mtp``, …), ``None`` without it."""
    grammar: Mapping[str, Any] | None = None
    """The worker's structured-output settings (:func:`grammar_settings`)."""


def grammar_settings(vllm_config: Any) -> dict[str, Any]:
    """What of a worker's configuration shapes every grammar it compiles, beside the request's own
    constraint: the server's ``--structured-outputs-config`` (vLLM's backends read whitespace and
    additional-properties options from it, not from the request; a reasoning parser decides
    where the grammar starts)."""
    so = getattr(vllm_config, "structured_outputs_config", None)
    return {
        "backend": str(getattr(so, "backend", "auto") or "auto"),
        "disable_any_whitespace": bool(getattr(so, "disable_any_whitespace", False)),
        "disable_additional_properties": bool(getattr(so, "disable_additional_properties", False)),
        "reasoning_parser": str(getattr(so, "reasoning_parser", "") or ""),
        "enable_in_reasoning": bool(getattr(so, "enable_in_reasoning", False)),
    }


def grammar_mismatch(recorded: Mapping[str, Any] | None, backend: Any, worker: Mapping[str, Any] | None) -> str | None:
    """Why a grammar compiled under ``recorded`` settings (with ``backend``, the one the engine
    chose for the request) is not what ``worker`` would compile for its continuation (``None``:
    it is the same)."""
    if not recorded:
        return "its grammar's settings are not in the ledger (written by an older gpuckpt)"
    if not worker:
        return "the restoring worker does not say its structured-output settings"
    if worker.get("backend") not in ("auto", backend):
        return f"its grammar backend {backend!r} is not the restoring worker's ({worker.get('backend')!r})"
    differ = sorted(k for k in recorded if k != "backend" and recorded.get(k) != worker.get(k))
    if differ:
        shown = ", ".join(f"{k} {recorded.get(k)!r} here {worker.get(k)!r}" for k in differ)
        return f"its grammar was compiled under other structured-output settings ({shown})"
    return None


def _plain(v: Any) -> Any:
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, dict):
        return {str(k): val for k, val in v.items()}
    return v


def sampling_to_json(sp: Any) -> dict[str, Any]:
    """The public, JSON-able sampling fields of a ``SamplingParams`` (structured outputs apart)."""
    return {name: _plain(v) for name in SAMPLING_FIELDS if (v := getattr(sp, name, None)) is not None}


def structured_to_json(sp: Any, settings: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """A request's structured-output constraint as JSON, with the backend the engine chose and the
    worker's ``settings`` it was compiled under (:func:`grammar_settings`)."""
    so = getattr(sp, "structured_outputs", None)
    if so is None:
        return None
    out = {name: _plain(v) for name in STRUCTURED_FIELDS if (v := getattr(so, name, None)) not in (None, False)}
    if isinstance(out.get("json"), dict):
        # the schema as the text the engine compiles (vLLM's structured_output_key): a manifest is
        # canonical JSON, keys sorted, and a schema's property order is the order its grammar
        # generates — a sorted schema is another grammar, which rejects the earlier outputs
        out["json"] = json.dumps(so.json)
    out["backend"] = getattr(so, "_backend", None)
    if settings is not None:
        out["settings"] = dict(settings)
    return out


def inexact_reasons(entry: dict[str, Any], runner: RunnerFacts) -> list[str]:
    """Why ``entry`` cannot continue from the exact next token after a restore (empty: it can)."""
    reasons = []
    sampling = entry["sampling"]
    if entry["output_token_ids"]:
        if prior := priors_reason(sampling, runner):
            reasons.append(prior)
        so = entry.get("structured_outputs")
        if so is not None and so.get("backend") not in GRAMMAR_BACKENDS:
            reasons.append(f"structured outputs: grammar backend {so.get('backend')!r} cannot be advanced")
    if sampling.get("seed") is not None and runner.model_runner == "v1" and runner.async_scheduling:
        # the generator is read a sample ahead of the outputs the ledger knows
        reasons.append("seeded sampling on model runner v1 with async scheduling: the sampler state runs ahead")
    if runner.speculative and speculation_changes(runner.speculative, sampling):
        reasons.append(speculative_reason(runner.speculative))
    return reasons


def priors_reason(sampling: Mapping[str, Any], runner: RunnerFacts) -> str | None:
    """Why a request of ``sampling`` that has outputs cannot be given them back in the sampler's
    view on ``runner`` (``None``: it can, or needs none) — a fact of the restoring worker's runner,
    which the ledger's writer judged by its own."""
    needs_prior = [f for f in PRIOR_OUTPUTS_NEEDED if sampling.get(f)]
    if not needs_prior or (runner.model_runner == "v1" and not runner.async_scheduling):
        return None
    return (
        f"{', '.join(needs_prior)} count earlier outputs, which the restored request cannot be given on "
        f"model runner {runner.model_runner}{' with async scheduling' if runner.async_scheduling else ''}"
    )


# vLLM's rejection_sample_method="synthetic", a benchmark mode: drafts are accepted by a coin
# calibrated to an acceptance rate, not by the target model, greedy requests included
SYNTHETIC = " with synthetic acceptance"


def speculative_method(vllm_config: Any) -> str | None:
    """The worker's speculative decoding method, ``None`` without speculative decoding; the method
    ends with ``SYNTHETIC`` where drafts are accepted synthetically."""
    sc = getattr(vllm_config, "speculative_config", None)
    if sc is None:
        return None
    method = str(getattr(sc, "method", None) or "speculative")
    if getattr(sc, "rejection_sample_method", "standard") == "synthetic":
        method += SYNTHETIC
    return method


def judged_on(requests: list[Resubmission], layout: Mapping[str, Any]) -> list[Resubmission]:
    """``requests`` as the restoring worker (its ``describe`` layout) lets them continue, where the
    ledger's writer judged them by its own runner. Where the worker runs speculative decoding
    (``layout["speculative"]``), a seeded sampled request is not exact — on either model runner
    (V1's generator, V2's noise by seed and position: the rejection sampler's draws depend on the
    drafts) — nor, under synthetic acceptance, any request. Where its runner cannot put a
    request's earlier outputs back in the sampler's view (V2, or async scheduling:
    ``model_runner``, ``async_scheduling``), a request with penalties or bad words that counts
    them is not exact either. A structured request whose grammar the worker would compile under
    other settings than the original's (``layout["structured_outputs"]``; or a ledger that does
    not say them) is left to its client: its continuation would run under another grammar, and
    its retry is computed anew."""
    worker = RunnerFacts(
        str(layout.get("model_runner") or "v1"), bool(layout.get("async_scheduling")), layout.get("speculative")
    )

    def on_worker(r: Resubmission) -> Resubmission:
        if r.left_to_client is not None:
            return r
        needs = r.needs or {}
        if "grammar" in needs and (
            off := grammar_mismatch(needs["grammar"], needs.get("backend"), layout.get("structured_outputs"))
        ):
            return Resubmission.left(r.request_id, off, r.api)
        why = []
        # (a cause the ledger's writer already named, in the same words, is not named twice)
        if r.output_token_ids and (prior := priors_reason(r.sampling, worker)) and prior not in r.reasons:
            why.append(prior)
        if (
            worker.speculative
            and speculation_changes(worker.speculative, r.sampling)
            and not any(_SPECULATIVE_CAUSE in x for x in r.reasons)
        ):
            why.append(speculative_reason(worker.speculative))
        if not why:
            return r
        return dataclasses.replace(r, exact=False, reasons=(*r.reasons, *(f"on this worker: {w}" for w in why)))

    return [on_worker(r) for r in requests]


def seeded_sampling(sampling: Mapping[str, Any]) -> bool:
    """Whether a request samples with a seed (greedy ignores its seed)."""
    return sampling.get("seed") is not None and float(sampling.get("temperature", 1.0) or 0.0) > 0.0


def speculation_changes(method: str, sampling: Mapping[str, Any]) -> bool:
    """Whether speculative decoding by ``method`` (``speculative_method``'s word) keeps a request
    of ``sampling`` from continuing exactly: a seeded sampled one always; under synthetic
    acceptance every one, greedy too (what is accepted depends on the drafts, not the model)."""
    return method.endswith(SYNTHETIC) or seeded_sampling(sampling)


_SPECULATIVE_CAUSE = "with speculative decoding ("


def speculative_reason(method: str) -> str:
    """Why a request does not continue exactly under speculative decoding by ``method``."""
    if method.endswith(SYNTHETIC):
        return (
            f"sampling with speculative decoding ({method.removesuffix(SYNTHETIC)}, synthetic acceptance, "
            "a benchmark mode): drafts are accepted by chance, not by the model, and a restored "
            "request's drafts differ, so its continuation is another one"
        )
    # Rejection sampling draws random numbers per draft token, and which tokens are drafted when
    # depends on the batch and on where the request (re)started: a restored request's first step
    # has no drafts. Its continuation is a sample of the same distribution, not the same sample.
    return (
        f"seeded sampling with speculative decoding ({method}): the sampler draws per draft token, "
        "and a restored request's drafts differ, so its continuation is another sample"
    )


def uncarried_input(req: Any) -> str | None:
    """Why the ledger cannot carry ``req``'s input, or ``None``: it can (token ids alone).

    A prompt given as embeddings (in whole or mixed with token ids) or a multimodal request
    (images, audio, video: the token ids there are placeholders, the same for every item) would
    be resubmitted without what its tokens stand for, so its continuation would come from
    another input. Such a request is not resubmitted: it is left to its client, whose retry
    sends the whole input again (:data:`LEFT`)."""
    if getattr(req, "prompt_embeds", None) is not None or req.prompt_token_ids is None:
        return "its prompt embeddings are not carried by the ledger"
    features = getattr(req, "mm_features", None) or ()
    if features:
        kinds = sorted({str(getattr(f, "modality", "multimodal")) for f in features})
        return f"its {'/'.join(kinds)} inputs are not carried by the ledger"
    return None


def request_entry(req: Any, kv_tokens: int, runner: RunnerFacts = RunnerFacts()) -> dict[str, Any]:
    """A live ``vllm.v1.request.Request`` as a ledger entry (called on the scheduler thread; never raises
    for a request it cannot carry exactly: that is recorded in ``exact`` / ``inexact_reasons``)."""
    sp = req.sampling_params
    outputs = list(req.output_token_ids)
    max_tokens = int(req.max_tokens)
    lora = getattr(req, "lora_request", None)
    entry: dict[str, Any] = {
        "request_id": req.request_id,
        "client_request_id": client_id(req.request_id),
        "prompt_token_ids": list(req.prompt_token_ids or []),
        "output_token_ids": outputs,
        "num_computed_tokens": kv_tokens,
        "max_tokens": max_tokens,
        "remaining_max_tokens": max(0, max_tokens - len(outputs)),
        "min_tokens": int(getattr(sp, "min_tokens", 0) or 0),
        "sampling": sampling_to_json(sp),
        "structured_outputs": structured_to_json(sp, runner.grammar),
        "cache_salt": req.cache_salt,
        "lora": getattr(lora, "lora_name", None),
        "priority": int(req.priority),
        "arrival_time": float(req.arrival_time),
    }
    api = api_facts(sp)
    if api is not None:
        entry["api"] = api
    if why := uncarried_input(req):
        entry[LEFT] = why  # not resubmitted: make_ledger files it apart, without its tokens
        entry["inexact_reasons"] = [why]
    else:
        entry["inexact_reasons"] = inexact_reasons(entry, runner)
    entry["exact"] = not entry["inexact_reasons"]
    return entry


#: the ledger's ``data`` key of the requests it cannot carry (:func:`uncarried_input`), each
#: ``{"request_id", "client_request_id", "left_to_client": why, "api"?}``; apart from
#: ``requests`` so that a reader older than it never resubmits one of them without its input
LEFT = "left_to_client"


def make_ledger(entries: list[dict[str, Any]], *, step: int, block_size: int) -> Ledger:
    """The ledger of a capture's entries (:func:`request_entry`)."""
    carried = [e for e in entries if LEFT not in e]
    data: dict[str, Any] = {"step": step, "block_size": block_size, "requests": carried}
    if left := [e for e in entries if LEFT in e]:
        keep = ("request_id", "client_request_id", LEFT, "api")
        data[LEFT] = [{k: e[k] for k in keep if k in e} for e in left]
    return Ledger.model_validate({"schema": SCHEMA, "version": VERSION, "data": data})


def _split(ledger: Ledger | dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The carried entries and those left to their clients, or :class:`ckpt.FormatError`."""
    d = ledger.model_dump(by_alias=True) if isinstance(ledger, Ledger) else ledger
    if d.get("schema") != SCHEMA or d.get("version") not in READABLE:
        raise FormatError(f"not a {SCHEMA} ledger of version {READABLE}: {d.get('schema')!r} v{d.get('version')!r}")
    data = d.get("data", {})
    entries = data.get("requests")
    if not isinstance(entries, list):
        raise FormatError(f"{SCHEMA}: data.requests is not a list")
    left = data.get(LEFT) or []
    if not isinstance(left, list) or not all(
        isinstance(e, dict) and isinstance(e.get("client_request_id"), str) and isinstance(e.get(LEFT), str)
        for e in left
    ):
        raise FormatError(f"{SCHEMA}: data.{LEFT} is not a list of requests, each with why")
    # a ledger written before LEFT kept a prompt given as embeddings among the requests, with no
    # prompt tokens: it is left to its client too, never resubmitted as its outputs alone (an
    # image request of such a ledger cannot be told apart: its placeholders are tokens there)
    old = [e for e in entries if isinstance(e, dict) and e.get("prompt_token_ids") == []]
    if old:
        why = "its prompt embeddings are not carried by the ledger"
        keep = ("request_id", "client_request_id", "api")
        left = [*left, *({**{k: e[k] for k in keep if k in e}, LEFT: why} for e in old)]
        entries = [e for e in entries if not (isinstance(e, dict) and e.get("prompt_token_ids") == [])]
    return entries, left


def left_entries(ledger: Ledger | dict[str, Any]) -> list[dict[str, Any]]:
    """The requests the ledger could not carry, each with why (:data:`LEFT`)."""
    return _split(ledger)[1]


def read(ledger: Ledger | dict[str, Any]) -> list[dict[str, Any]]:
    """The carried entries of a ledger this code can read (:data:`READABLE`), or
    :class:`ckpt.FormatError`."""
    return _split(ledger)[0]


def resubmissions(ledger: Ledger | dict[str, Any]) -> list[Resubmission]:
    """The requests to submit again: prompt + outputs so far, the rest of the budget.

    Each carries ``exact`` and ``reasons`` from the ledger: a request that
    cannot continue exactly is still resubmitted (it finishes), and its
    reasons say why it is a cold replay rather than a continuation.
    """
    out = []
    for e in read(ledger):
        if e["remaining_max_tokens"] <= 0:
            continue
        sampling = dict(e["sampling"])
        sampling["max_tokens"] = e["remaining_max_tokens"]
        sampling["min_tokens"] = max(0, e["min_tokens"] - len(e["output_token_ids"]))
        # Prompt logprobs were delivered with the first tokens; over prompt +
        # outputs they would be a different thing (and defeat the cache).
        sampling.pop("prompt_logprobs", None)
        so = e.get("structured_outputs")
        needs = None
        if so:
            sampling["structured_outputs"] = {k: v for k, v in so.items() if k not in ("backend", "settings")}
            if e["output_token_ids"]:  # a grammar that starts afresh needs nothing of the worker
                needs = {"grammar": so.get("settings"), "backend": so.get("backend")}
        reasons = list(e.get("inexact_reasons") or [])
        if "exact" not in e:  # a version-1 ledger did not judge its requests
            reasons = inexact_reasons({**e, "structured_outputs": None}, RunnerFacts())
        api = e.get("api")
        lps = None
        if wants_logprobs(e):
            lps = valid_positions(e.get("logprobs"), len(e["output_token_ids"]))
            if lps is None:  # not carried (the server did not give them), or not one per output
                why = NO_LOGPROBS if e.get("logprobs") is None else f"{NO_LOGPROBS} (its entry's are malformed)"
                api = {**(api or {}), "unattachable": why}
        out.append(
            Resubmission(
                request_id=e["client_request_id"],
                token_ids=list(e["prompt_token_ids"]) + list(e["output_token_ids"]),
                num_prompt_tokens=len(e["prompt_token_ids"]),
                output_token_ids=list(e["output_token_ids"]),
                sampling=sampling,
                priority=e["priority"],
                cache_salt=e["cache_salt"],
                exact=not reasons,
                reasons=tuple(reasons),
                api=api,
                needs=needs,
                logprobs=lps,
                budget={"max_tokens": e["max_tokens"], "min_tokens": e["min_tokens"]},
            )
        )
    for e in left_entries(ledger):
        api = e.get("api")
        out.append(Resubmission.left(str(e["client_request_id"]), str(e[LEFT]), api if isinstance(api, dict) else None))
    return out


def request_states(
    ledger: Ledger | dict[str, Any], *, warm: bool
) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """What each ledger entry needs beyond its tokens, by client id, and why some cannot have it.

    Earlier outputs (for penalties / bad words and to advance a grammar)
    apply warm or cold: they are the request's semantics, not the cache's.
    The seeded sampler state applies on a warm restore only.
    """
    states: dict[str, dict[str, Any]] = {}
    problems: dict[str, list[str]] = {}
    for e in read(ledger):
        cid = e["client_request_id"]
        st: dict[str, Any] = {}
        outs = list(e["output_token_ids"])
        if outs and any(e["sampling"].get(f) for f in PRIOR_OUTPUTS_NEEDED):
            st["prior_outputs"] = outs
        if outs and e.get("structured_outputs"):
            st["grammar_outputs"] = outs
        g = e.get("generator_state")
        if g:
            if not warm:
                problems.setdefault(cid, []).append(
                    "seeded sampling: the sampler state is carried on a warm restore only"
                )
            else:
                try:
                    if not base64.b64decode(str(g), validate=True):
                        raise ValueError("empty")
                    st["generator_state"] = g
                except (ValueError, binascii.Error) as exc:
                    problems.setdefault(cid, []).append(f"seeded sampling: the generator state is corrupt ({exc})")
        if st:
            # matched on identity and tokens: the resubmission (under this id, or the id vllm serve
            # gives it) whose prompt is this entry's prompt + outputs — never a retry under the id alone
            st["ids"] = sorted({cid, resubmitted_id(cid)})
            st["match"] = token_digest(list(e["prompt_token_ids"]) + outs)
            states[cid] = st
    return states, problems


def key_requests(ledger: Ledger | dict[str, Any]) -> list[dict[str, Any]]:
    """The ``keys`` command's requests (token ids, tokens of KV, cache salt), each with its client
    ``request_id``: which pages each resubmitted request reads, hashed by the new worker's block
    hasher."""
    reqs = []
    for e in read(ledger):
        if e.get("lora"):
            continue  # its block hashes name the adapter's path, which the ledger does not carry
        toks = list(e["prompt_token_ids"]) + list(e["output_token_ids"])
        reqs.append(
            {
                "request_id": e["client_request_id"],
                "token_ids": toks,
                "kv_tokens": int(e["num_computed_tokens"]),
                "cache_salt": e["cache_salt"],
            }
        )
    return reqs


def count(ledger: Ledger | dict[str, Any]) -> int:
    """Requests the ledger holds, those left to their clients included."""
    return len(read(ledger)) + len(left_entries(ledger))
