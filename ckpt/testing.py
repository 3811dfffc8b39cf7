"""A testing kit: a fault-injecting store wrapper and helpers.

Shipped with the library (not only the tests) so users can reproduce faults
against their own stores, in the manner of kopia's testing kit.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ckpt.errors import StoreUnavailable
from ckpt.store.base import Buffer, ObjectInfo, Store


class SimulatedCrash(BaseException):
    """Raised by :class:`FaultyStore` to model a process killed mid-call.

    A BaseException, so ordinary ``except Exception`` clean-up code does not
    run, just as it would not in a killed process.
    """


@dataclass
class Fault:
    """Fail the ``nth`` call (1-based) of ``method`` whose name passes ``match``.

    ``error`` is raised *instead of* the call, or, with ``after=True``, after
    the call has taken effect (the answer was lost). ``times`` repeats the
    fault on that many consecutive matching calls.
    """

    method: str
    nth: int = 1
    error: Callable[[], BaseException] = lambda: StoreUnavailable("injected: 503 Slow Down")
    after: bool = False
    match: Callable[[str], bool] = lambda _name: True
    times: int = 1
    seen: int = field(default=0, init=False)


class FaultyStore(Store):
    """Wraps a store and injects :class:`Fault` s. Counts every call by method."""

    def __init__(self, inner: Store, faults: list[Fault] | None = None) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self.faults = list(faults or [])
        self.calls: dict[str, int] = {}
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._armed = threading.local()  # after=True faults due when this thread's call returns

    @property
    def url(self) -> str:
        return self.inner.url

    def _check(self, method: str, name: str, when_after: bool) -> None:
        with self._lock:
            if when_after:
                armed: list[Fault] = getattr(self._armed, "faults", [])
                self._armed.faults = []
                if armed:
                    raise armed[0].error()
                return
            self.calls[method] = self.calls.get(method, 0) + 1
            self.log.append((method, name))
            # Count the call for every matching fault, before and after ones alike
            # (an after=True fault must see the calls too, or it never fires).
            armed = []
            for f in self.faults:
                if f.method != method or not f.match(name):
                    continue
                f.seen += 1
                if f.nth <= f.seen < f.nth + f.times:
                    if not f.after:
                        raise f.error()
                    armed.append(f)
            self._armed.faults = armed

    def _run(self, method: str, name: str, fn: Callable[[], object]) -> object:
        self._check(method, name, False)
        out = fn()
        self._check(method, name, True)
        return out

    def put(self, name: str, data: Buffer, *, if_absent: bool = False) -> None:
        self._run("put", name, lambda: self.inner.put(name, data, if_absent=if_absent))

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        out = self._run("get", name, lambda: self.inner.get(name, offset, length))
        assert isinstance(out, bytes)
        return out

    def stat(self, name: str) -> ObjectInfo:
        out = self._run("stat", name, lambda: self.inner.stat(name))
        assert isinstance(out, ObjectInfo)
        return out

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        out = self._run("list", prefix, lambda: list(self.inner.list(prefix)))
        assert isinstance(out, list)
        return iter(out)

    def delete(self, name: str) -> None:
        self._run("delete", name, lambda: self.inner.delete(name))

    def cleanup(self, older_than: float) -> int:
        return self.inner.cleanup(older_than)

    def close(self) -> None:
        self.inner.close()


class KilledStore(FaultyStore):
    """A FaultyStore whose process dies at the first SimulatedCrash: every later
    call raises SimulatedCrash too, so no clean-up (discarding packs, releasing
    the lock) reaches the store, exactly as after a SIGKILL."""

    dead = False

    def _check(self, method: str, name: str, when_after: bool) -> None:
        if self.dead:
            raise SimulatedCrash(f"process is dead: {method} {name}")
        try:
            super()._check(method, name, when_after)
        except SimulatedCrash:
            self.dead = True
            raise


class VirtualClock:
    """A store's clock for tests: stamps objects when they are written and
    moves only when told (``advance``) or by ``tick`` per store call.

    Shared by every :class:`ClockedStore` over one inner store, so several
    ``Repository`` objects (a gc's, a save's) see one timeline; tests can
    also hand :meth:`now` to code that reads a host clock.
    """

    def __init__(self, start: float | None = None, tick: float = 1.0) -> None:
        # from the host's time: checkpoint ids carry the writer's clock, and ids far
        # from the store's clock are taken for future-dated
        self._now = time.time() if start is None else start
        self.tick = tick
        self.stamps: dict[str, float] = {}
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds

    def step(self) -> float:
        with self._lock:
            self._now += self.tick
            return self._now


class ClockedStore(FaultyStore):
    """A :class:`FaultyStore` whose modification times come from a :class:`VirtualClock`,
    and which calls ``hook(n, method, name)`` before its ``n``-th call (1-based) — the place to
    run a competing operation at every step of this one."""

    def __init__(
        self,
        inner: Store,
        clock: VirtualClock,
        faults: list[Fault] | None = None,
        hook: Callable[[int, str, str], None] | None = None,
    ) -> None:
        super().__init__(inner, faults)
        self.clock = clock
        self.hook = hook
        self.count = 0

    def _run(self, method: str, name: str, fn: Callable[[], object]) -> object:
        with self._lock:
            self.count += 1
            n = self.count
        if self.hook is not None:
            self.hook(n, method, name)
        t = self.clock.step()
        if method == "put":
            # stamped when the write begins, as S3's LastModified is
            self.clock.stamps[name] = t
        return super()._run(method, name, fn)

    def _stamped(self, o: ObjectInfo) -> ObjectInfo:
        return dataclasses.replace(o, mtime=self.clock.stamps.get(o.name, 0.0))

    def stat(self, name: str) -> ObjectInfo:
        return self._stamped(super().stat(name))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return iter([self._stamped(o) for o in super().list(prefix)])
