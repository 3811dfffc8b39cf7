"""Paced captures: register a capture (or a wait) with the worker *before* the traffic it is about
exists, so that a condition the traffic meets only for a moment cannot pass unseen, however busy
the host — for tests, demos and benchmarks."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from agent.engines.control import ControlError
from agent.engines.types import Checkpointed
from agent.session.checkpoint import CheckpointOptions, checkpoint
from agent.session.worker import WorkerLike, channel_of, wait_until
from ckpt import Repository

__all__ = ["checkpoint_around", "wait_around"]

_T = TypeVar("_T")


def _around(worker: WorkerLike, pending: str, call: Callable[[], _T], start: Callable[[], None], timeout: float) -> _T:
    """Run ``call`` (a blocking control call that registers a waiter) in a thread; once the
    worker counts it under ``pending``, run ``start``; return what ``call`` returned."""
    channel = channel_of(worker)
    out: list[_T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, name="gpuckpt-around", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    # the worker counts pending waiters: a condition, polled (no event crosses the socket)
    while t.is_alive() and int(channel.stats().get(pending, 0)) < 1:
        if time.monotonic() > deadline:
            raise ControlError(f"the connector did not register the waiter within {timeout:.0f} s")
        time.sleep(0.02)
    if errors:
        raise errors[0]
    start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


def checkpoint_around(
    worker: WorkerLike,
    start: Callable[[], None],
    repo: Repository,
    worker_id: str,
    options: CheckpointOptions | None = None,
    /,
    **fields: Any,
) -> Checkpointed:
    """Checkpoint traffic the caller makes: register a capture at condition ``when`` (a field of
    ``options`` or ``fields``, required), *then* call ``start()`` (which sends the requests), and
    return the checkpoint.

    The capture is pending in the worker before any of the traffic exists, so
    a condition the traffic meets only for a moment (every request live with
    k outputs) cannot pass before the capture is asked for, however busy the
    host. Pair it with :func:`agent.session.hold` so that the requests start
    at one step boundary.
    """
    opts = dataclasses.replace(options or CheckpointOptions(), **fields)
    if opts.when is None:
        raise TypeError("checkpoint_around needs the condition `when` to capture at")
    return _around(worker, "captures_pending", lambda: checkpoint(worker, repo, worker_id, opts), start, opts.timeout)


def wait_around(
    worker: WorkerLike, start: Callable[[], None], *, live: int, min_outputs: int = 0, timeout: float = 120.0
) -> dict[str, Any]:
    """:func:`agent.session.wait_until`, registered before ``start()`` sends the traffic (see
    :func:`checkpoint_around`)."""
    return _around(
        worker,
        "waits_pending",
        lambda: wait_until(worker, live=live, min_outputs=min_outputs, timeout=timeout),
        start,
        timeout,
    )
