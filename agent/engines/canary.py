"""The restore canary: a fixed probe whose greedy continuation is recorded at
checkpoint time and checked on the new worker after a warm restore.

The probe is a short token-id prompt from a fixed seed (no tokenizer needed;
ids in ``[LOW, HIGH)``, valid for any vocabulary of at least ``HIGH`` ids) and
shares no prefix with client requests in practice. The checkpointing engine
runs it just before the capture, so its KV is in the prefix cache and travels
with the checkpoint; on restore the probe reads those restored blocks, and a
continuation that differs means the new worker does not compute what the old
one did (wrong cache, wrong weights, a numerics change): the restore then
fails closed. The engine is reached only through ``generate(prompt_ids, n)``
(greedy, ``n`` new tokens, EOS ignored), so this is engine-neutral.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

#: ``generate(prompt_ids, n) -> n token ids`` (greedy, ignore EOS) on the worker.
Generate = Callable[[list[int], int], list[int]]

KIND = "greedy-probe-v1"
SEED = 0x6770636B  # "gpck"
LENGTH = 40
NEW_TOKENS = 8
LOW, HIGH = 3, 500


def probe(length: int = LENGTH, seed: int = SEED) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(LOW, HIGH) for _ in range(length)]


def record(generate: Generate, n: int = NEW_TOKENS) -> dict[str, Any]:
    """Run the probe on the checkpointing worker; the manifest's ``canary`` field."""
    p = probe()
    out = [int(t) for t in generate(list(p), n)]
    if len(out) != n:
        raise ValueError(f"canary: generate returned {len(out)} tokens, wanted {n}")
    return {"kind": KIND, "prompt_token_ids": p, "new_tokens": n, "expected": out}


def check(canary: dict[str, Any], generate: Generate) -> tuple[bool, list[int], str | None]:
    """Run the recorded probe on the new worker; ``(match, got, reason if not)``."""
    if canary.get("kind") != KIND:
        return False, [], f"canary: unknown kind {canary.get('kind')!r}"
    expected = [int(t) for t in canary["expected"]]
    got = [int(t) for t in generate(list(canary["prompt_token_ids"]), int(canary["new_tokens"]))]
    if got == expected:
        return True, got, None
    return False, got, f"canary: probe continuation mismatch: expected {expected}, got {got}"
