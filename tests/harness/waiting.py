"""Waiting for conditions, never for a clock, and for several calls at once."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
K = TypeVar("K")


def wait_for(pred: Callable[[], T], timeout: float, what: str, *, interval: float = 0.25) -> T:
    """Call ``pred`` until it returns something true and return that; ``TimeoutError`` naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(what)


def quiet(fn: Callable[[], object]) -> None:
    """Run ``fn``, dropping an exception: a client whose worker is killed under it."""
    try:
        fn()
    except Exception:
        return


def concurrently(calls: Mapping[K, Callable[[], T]]) -> dict[K, T]:
    """Every call at once, each in a thread; their results by key (the first exception raised).

    For requests a worker can batch: an engine decodes several sequences in one step for about
    the time of one, so uninterrupted reference runs cost one long request, not their sum.
    """
    with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        futures = {k: pool.submit(fn) for k, fn in calls.items()}
        return {k: f.result() for k, f in futures.items()}
