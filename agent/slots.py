"""A bounded set of served connections, shared by the agent's API and the connector's control socket.

Any account that can connect to either socket could otherwise start threads
without limit. At most ``limit`` connections are served at once, each by
its own thread. When all are taken, a new connection takes the place of one
that is *waiting for a request* — one that has sent nothing of it first,
then the one that made progress least recently — which is shut down and
whose thread is joined before the new one starts (threads are bounded, not
only slots); a connection whose request is being handled is never dropped.
When every connection is handling a request, :meth:`Slots.admit` says no and
the server refuses the newcomer in its own protocol.

The bound is on threads, not only on connections: a connection's thread
gives its slot back (:meth:`Slots.release`) a moment before it ends, and on
a busy host that moment can last (the thread waits for the GIL to unwind).
So a released thread still counts until :meth:`Slots.admit` has joined it;
a thread that does not end within the join timeout keeps its place, and the
newcomer is refused rather than started beside it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class Conn:
    """One served connection; the fields are guarded by its :class:`Slots`' lock."""

    __slots__ = ("evicted", "got", "reading", "since", "sock", "thread")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reading = True  # waiting for (the rest of) a request: may give way to a new connection
        self.got = 0  # bytes of the current request received
        self.since = time.monotonic()  # its last progress
        self.evicted = False
        self.thread: threading.Thread | None = None  # the accept loop's to set and join


class Slots:
    """At most ``limit`` connections at once (see the module docstring)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        self.conns: set[Conn] = set()
        self.leaving: list[threading.Thread] = []  # released, maybe not yet ended: still counted

    def _taken(self) -> int:
        return len(self.conns) + len(self.leaving)

    def _reap(self, timeout: float) -> None:
        """Join the threads that gave their slot back; those still running keep it."""
        with self.lock:
            leaving, self.leaving = self.leaving, []
        deadline = time.monotonic() + timeout
        alive = []
        for t in leaving:
            if t is threading.current_thread():
                continue
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                alive.append(t)
        if alive:
            with self.lock:
                self.leaving.extend(alive)

    def admit(self, conn: Conn, *, join_timeout: float = 5.0) -> bool:
        """Take ``conn`` in, making room by dropping a waiting connection if need be; False when
        every connection is handling a request."""
        self._reap(join_timeout)
        victim = None
        with self.lock:
            if self._taken() >= self.limit:
                waiting = [c for c in self.conns if c.reading and not c.evicted]
                if waiting:
                    victim = min(waiting, key=lambda c: (c.got > 0, c.since))
                    victim.evicted = True
                    with contextlib.suppress(OSError):
                        victim.sock.shutdown(socket.SHUT_RD)  # its blocked recv returns at once
        if victim is not None:
            if victim.thread is not None:
                victim.thread.join(timeout=join_timeout)
            self._reap(join_timeout)
        with self.lock:
            if self._taken() >= self.limit:
                return False
            self.conns.add(conn)
            return True

    def release(self, conn: Conn) -> None:
        """``conn`` is done; called by its own thread, which is counted until it is joined."""
        with self.lock:
            self.conns.discard(conn)
            if conn.thread is not None and conn.thread.ident is not None:  # started
                self.leaving.append(conn.thread)

    def progress(self, conn: Conn, got: int) -> None:
        """``conn`` has received ``got`` bytes of its current request."""
        with self.lock:
            conn.got = got
            conn.since = time.monotonic()

    def buffered(self) -> int:
        """Bytes of unfinished requests held across the connections waiting for theirs."""
        with self.lock:
            return sum(c.got for c in self.conns if c.reading)
