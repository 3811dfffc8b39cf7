"""A wrapper that retries transient store failures with capped, jittered backoff."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from ckpt.errors import ObjectExists, StoreUnavailable
from ckpt.store.base import Buffer, ObjectInfo, Store, retry_budget_left

T = TypeVar("T")
log = logging.getLogger("gpuckpt.store")


class RetryStore(Store):
    """Retries calls that raise :class:`StoreUnavailable`; other errors pass through.

    A conditional create that raced with its own earlier attempt (the first
    attempt reached the server, its answer was lost) would report
    ObjectExists on the retry; callers that need to tell the two apart compare
    the stored bytes, which the repository does for manifests.
    """

    def __init__(
        self,
        inner: Store,
        *,
        attempts: int = 5,
        base_delay: float = 0.05,
        max_delay: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._sleep = sleep

    @property
    def url(self) -> str:
        return self.inner.url

    def _call(self, what: str, name: str, fn: Callable[[], T]) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except StoreUnavailable as exc:
                if attempt == self.attempts:
                    raise
                delay = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
                delay *= 0.5 + random.random()
                if not retry_budget_left(delay):
                    # the operation's deadline passes before the retry would start
                    log.warning(
                        "store call failed; no retry: the operation's deadline passes first",
                        extra={"op": what, "object": name, "attempt": attempt, "error": str(exc)},
                    )
                    raise
                log.warning(
                    "store call failed, retrying",
                    extra={"op": what, "object": name, "attempt": attempt, "error": str(exc)},
                )
                self._sleep(delay)
        raise AssertionError("unreachable")

    def put(self, name: str, data: Buffer, *, if_absent: bool = False) -> None:
        first = [True]

        def do() -> None:
            try:
                self.inner.put(name, data, if_absent=if_absent)
            except ObjectExists:
                # On a retry, the earlier attempt may have landed: if the bytes
                # are ours, the create succeeded.
                if not first[0] and bytes(self.inner.get(name)) == bytes(data):
                    return
                raise
            finally:
                first[0] = False

        self._call("put", name, do)

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        return self._call("get", name, lambda: self.inner.get(name, offset, length))

    def stat(self, name: str) -> ObjectInfo:
        return self._call("stat", name, lambda: self.inner.stat(name))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Listing is materialised so that a retry restarts it cleanly.
        return iter(self._call("list", prefix, lambda: list(self.inner.list(prefix))))

    def delete(self, name: str) -> None:
        self._call("delete", name, lambda: self.inner.delete(name))

    def cleanup(self, older_than: float) -> int:
        return self.inner.cleanup(older_than)

    def close(self) -> None:
        self.inner.close()
