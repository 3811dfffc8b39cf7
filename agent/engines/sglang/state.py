"""What the linker reads of SGLang's requests: page keys, the live requests, ledger entries.

Keys are SGLang's own chained page hashes (``get_storage_hash_str``, seeded
by ``extra_key`` / ``cache_salt`` as the radix cache seeds them), so a
restored server's own lookups match them; a partial last page is keyed by
:func:`tail_key`. Everything here reads request objects on the scheduler
thread (``on_keys`` computes keys from the agent's token ids on a control
thread: no engine state).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str, storage_namespace_seed

from agent.engines.sglang import ledger as ledger_mod

__all__ = ["kv_tokens", "ledger_entry", "live_requests", "met", "page_keys", "sampling", "tail_key", "tokens"]


def tail_key(parent: str | None, tokens: list[int], extra_key: str | None, cache_salt: str | None) -> bytes:
    """Content key of a partial last page: sha256 of a tag, the previous full page's storage hash
    (hex; ``None`` for a first page, which takes the request's namespace seed instead) and the
    tail's token ids (int64, little-endian)."""
    h = hashlib.sha256(b"gpuckpt-sglang-tail\x00")
    prior = parent if parent is not None else storage_namespace_seed(extra_key, cache_salt)
    h.update((prior or "").encode() + b"\x00")
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


def page_keys(tokens: list[int], n: int, page_size: int, extra_key: str | None, cache_salt: str | None) -> list[str]:
    """The storage hashes (hex) of the full pages of ``tokens[:n]``, as SGLang's radix cache keys them."""
    full = min(n, len(tokens)) // page_size * page_size
    if full <= 0:
        return []
    key = RadixKey(array("q", tokens[:full]), extra_key=extra_key, cache_salt=cache_salt)
    out = get_storage_hash_str(key, None, page_size=page_size)
    return [out] if isinstance(out, str) else list(out)


def _plain(v: Any) -> Any:
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def sampling(sp: Any) -> dict[str, Any]:
    """A request's ``SamplingParams`` as the ledger's JSON (stop strings from their normalized fields)."""
    out: dict[str, Any] = {}
    for name in ledger_mod.SAMPLING_FIELDS:
        v = getattr(sp, name, None)
        if name == "stop":
            v = v or getattr(sp, "stop_strs", None)
        elif name == "stop_regex":
            v = v or getattr(sp, "stop_regex_strs", None)
        if v is not None and v != [] and v != "":
            out[name] = _plain(v)
    return out


def live_requests(scheduler: Any) -> list[Any]:
    """The requests ``scheduler`` holds now, unfinished, once each (scheduler thread)."""
    if scheduler is None:
        return []
    groups: list[Any] = []
    for name in ("running_batch", "last_batch"):
        b = getattr(scheduler, name, None)
        if b is not None:
            groups.append(getattr(b, "reqs", None) or [])
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        groups.append([chunked])
    groups.append(list(getattr(scheduler, "waiting_queue", None) or []))
    out: dict[int, Any] = {}
    for g in groups:
        for r in g:
            if not r.finished() and id(r) not in out:
                out[id(r)] = r
    return list(out.values())


def tokens(req: Any) -> list[int]:
    return [int(t) for t in req.origin_input_ids] + [int(t) for t in req.output_ids]


def kv_tokens(req: Any) -> int:
    """Tokens of prompt + outputs whose KV the request's slots hold (the last sampled token's is
    computed by the next step)."""
    kv = getattr(req, "kv", None)
    if kv is None or getattr(kv, "req_pool_idx", None) is None:
        return 0
    return max(0, min(int(kv.kv_committed_len), len(req.origin_input_ids) + len(req.output_ids) - 1))


def met(when: dict[str, int] | None, live: list[Any]) -> bool:
    """Whether a capture's or wait's condition holds for ``live``."""
    if not when:
        return True
    k = when.get("min_outputs", 0)
    return sum(1 for r in live if len(r.output_ids) >= k) >= when.get("live", 0)


def ledger_entry(req: Any, kv: int) -> dict[str, Any]:
    """``req``'s entry in the capture's ledger (``kv``: :func:`kv_tokens`)."""
    if why := ledger_mod.uncarried_input(req):
        return {"rid": str(req.rid), ledger_mod.LEFT: why}
    sp = sampling(req.sampling_params)
    return {
        "rid": str(req.rid),
        "prompt_token_ids": [int(t) for t in req.origin_input_ids],
        "output_token_ids": [int(t) for t in req.output_ids],
        "kv_tokens": kv,
        "sampling": sp,
        "priority": getattr(req, "priority", None),
        "extra_key": getattr(req, "extra_key", None),
        "cache_salt": getattr(req, "cache_salt", None),
        "return_logprob": bool(getattr(req, "return_logprob", False)),
        "inexact_reasons": ledger_mod.inexact_reasons(
            sp,
            outputs=len(req.output_ids),
            return_logprob=bool(getattr(req, "return_logprob", False)),
        ),
    }
