"""systemd's notify protocol: readiness, watchdog pings and status lines.

One datagram per message to ``$NOTIFY_SOCKET`` (a path, or ``@name`` in the
abstract namespace). The protocol is a single ``sendto``; the maintained
binding (``systemd-python``) needs libsystemd headers to build, which a GPU
host's Python environment often lacks, so it is written out here.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable


class Notifier:
    """Sends ``READY=1``, ``STATUS=…``, ``WATCHDOG=1``, ``STOPPING=1``; a no-op outside systemd."""

    def __init__(self, address: str | None = None) -> None:
        self.address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines in one datagram; False when not under systemd or on error."""
        if self._sock is None or not self.address:
            return False
        msg = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with self._lock:
                self._sock.sendto(msg, addr)
            return True
        except OSError:
            return False  # systemd went away; nothing to tell

    def ready(self, status: str) -> bool:
        return self.send(ready=1, status=status)

    def status(self, text: str) -> bool:
        return self.send(status=text)

    def stopping(self, status: str) -> bool:
        return self.send(stopping=1, status=status)

    def watchdog_interval(self) -> float | None:
        """Half of ``$WATCHDOG_USEC`` in seconds, if the watchdog is on for this process."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 2e6
        except ValueError:
            return None

    def start_watchdog(self, healthy: Callable[[], bool] | None = None) -> threading.Thread | None:
        """Ping ``WATCHDOG=1`` every half period while ``healthy()`` (if given) is true."""
        interval = self.watchdog_interval()
        if interval is None or not self.enabled:
            return None

        def loop() -> None:
            while not self._stop.wait(interval):
                if healthy is None or healthy():
                    self.send(watchdog=1)

        t = threading.Thread(target=loop, name="gpuckpt-watchdog", daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
