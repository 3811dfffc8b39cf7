"""Staging lifetime: what a killed agent staged (users' KV in /dev/shm) is swept by the next one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from agent import session
from agent.engines import staging


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_dead_agents_restore_staging_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    dead = staging.default_dir(f"{session.RESTORE_TAG}{dead_pid()}")
    live = staging.default_dir(f"{session.RESTORE_TAG}{os.getpid()}")
    for d in (dead, live):
        staging.ensure_dir(d)
        w = staging.PageWriter(d, "restore-x", dtype="float32", page_shape=(1, 2), layers=["l0"])
        w.write(b"k" * 32, b"\0" * 8)
        w.commit()
    # something that is not ours to judge: a symlink with a dead pid's name
    link = staging.default_dir(f"{session.RESTORE_TAG}{dead_pid()}")
    link.symlink_to(tmp_path)
    (tmp_path / "keep").write_text("not staging")
    try:
        removed = session.sweep_restore_dirs()
        assert str(dead) in removed
        assert not dead.exists()
        assert live.exists(), "a running agent's staging is never swept"
        assert link.is_symlink()
        assert (tmp_path / "keep").exists()
    finally:
        staging.unlink_pair(live / "restore-x.json")
        with contextlib.suppress(OSError):  # this process's restores may have staging there too
            live.rmdir()
        link.unlink()
