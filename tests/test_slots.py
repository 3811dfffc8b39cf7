""":class:`agent.slots.Slots` bounds threads, not only connections.

A connection's thread gives its slot back a moment before it ends; on a busy
host that moment lasts (CI once counted 39 threads against the API's bound of
32 + 3 during an idle flood, its request timeouts expiring mid-flood). These
tests hold a released thread alive on an event, so nothing here races a clock.
"""

from __future__ import annotations

import socket
import threading

from agent.slots import Conn, Slots


def _conn() -> tuple[Conn, socket.socket]:
    a, b = socket.socketpair()
    return Conn(a), b


def _serve(slots: Slots, conn: Conn, linger: threading.Event) -> None:
    """A connection's thread that gives its slot back, then lingers until ``linger`` is set."""

    def run() -> None:
        slots.release(conn)
        linger.wait()

    conn.thread = threading.Thread(target=run, daemon=True)
    conn.thread.start()


def test_a_released_thread_counts_until_it_has_ended() -> None:
    slots = Slots(1)
    first, peer1 = _conn()
    assert slots.admit(first)
    linger = threading.Event()
    _serve(slots, first, linger)
    second, peer2 = _conn()
    try:
        # The first thread has released its slot but not ended: the newcomer is not started beside it.
        assert slots.admit(second, join_timeout=0.05) is False
        assert first.thread is not None
        assert first.thread.is_alive()
        linger.set()
        assert slots.admit(second) is True  # joined, then admitted
        assert not first.thread.is_alive()
        assert slots.conns == {second}
        assert slots.leaving == []
    finally:
        linger.set()
        for s in (first.sock, second.sock, peer1, peer2):
            s.close()


def test_a_thread_that_never_started_is_not_counted() -> None:
    slots = Slots(1)
    conn, peer = _conn()
    assert slots.admit(conn)
    conn.thread = threading.Thread(target=lambda: None)  # its start failed: released by the accept loop
    slots.release(conn)
    other, peer2 = _conn()
    try:
        assert slots.admit(other) is True
    finally:
        for s in (conn.sock, other.sock, peer, peer2):
            s.close()


def test_a_waiting_connection_gives_way_and_its_thread_is_joined_first() -> None:
    slots = Slots(1)
    idle, peer = _conn()
    assert slots.admit(idle)

    def run() -> None:  # waits for a request, as a served connection does, and leaves on EOF
        idle.sock.recv(1)
        slots.release(idle)

    idle.thread = threading.Thread(target=run, daemon=True)
    idle.thread.start()
    newcomer, peer2 = _conn()
    try:
        assert slots.admit(newcomer) is True
        assert idle.evicted
        assert not idle.thread.is_alive()
        assert slots.conns == {newcomer}
        assert slots.leaving == []
    finally:
        for s in (idle.sock, newcomer.sock, peer, peer2):
            s.close()
