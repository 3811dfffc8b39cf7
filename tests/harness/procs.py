"""Processes as a test sees them: which of a process group still run."""

from __future__ import annotations

import os


def running_in_group(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that still run: zombies excluded (a killed worker whose
    parent died waits for init to reap it, and ``killpg(pgid, 0)`` still finds it then)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found
