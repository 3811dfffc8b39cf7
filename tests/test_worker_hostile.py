"""The agent survives the worker it serves: page files and control replies a compromised worker
shapes to kill or stall the agent are that capture's named error, within a stated memory bound.

- a page file truncated after the agent opened it: a short read, not SIGBUS (the agent reads the
  worker's files with ``pread``, never through a mapping);
- a FIFO in a page file's place: refused at once, not an ``open()`` that blocks forever;
- an index declaring a 1 GiB page over a sparse file: refused before anything is allocated;
- a 62 MiB JSON reply of small values: refused before parsing (it would take ~15x its size).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from agent import fs
from agent.engines import control, staging


@pytest.fixture
def stage(tmp_path: Path) -> Path:
    d = tmp_path / "stage"
    staging.ensure_dir(d)
    return d


def write_pages(d: Path, name: str, n: int = 4) -> Path:
    w = staging.PageWriter(d, name, dtype="float32", page_shape=(2, 8), layers=("l0",))
    for i in range(n):
        w.write(bytes([i]) * 8, bytes([i]) * 64)
    w.commit()
    return w.index_path


def test_a_page_file_truncated_after_opening_is_a_named_error_not_sigbus(stage: Path) -> None:
    idx = write_pages(stage, "cap-1")
    pf = staging.PageFile(idx, directory=stage, mapped=False)
    try:
        assert bytes(pf.page(bytes([0]) * 8)) == bytes([0]) * 64
        os.truncate(idx.with_suffix(".bin"), 64)  # the worker cuts the file under the agent
        with pytest.raises(staging.PageFileError, match="truncated"):
            pf.page(bytes([3]) * 8)
    finally:
        pf.close()


def test_a_fifo_in_a_page_files_place_is_refused_at_once(stage: Path) -> None:
    idx = stage / "cap-2.json"
    os.mkfifo(idx, 0o600)
    got = at_once(lambda: staging.PageFile(idx, directory=stage, mapped=False), "opening a FIFO blocked the agent")
    assert isinstance(got, fs.UnsafePath)
    assert "not a regular file" in str(got)


def at_once(fn: Callable[[], object], blocked: str) -> object:
    """``fn``'s result or the exception it raised, which must come at once (``blocked``: what it
    means if it does not, within 20 s)."""
    got: list[object] = []

    def run() -> None:
        try:
            got.append(fn())
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), blocked
    return got[0]


@pytest.mark.parametrize("planted", ["fifo", "symlink", "file"])
def test_a_page_writer_never_opens_what_stands_under_its_file_names(stage: Path, planted: str) -> None:
    """Another account plants a FIFO (or a symlink, or a file) under the next restore page file's
    names in the shared staging directory: the writer creates its own files in their place at
    once — never blocking on the FIFO, never writing through the link — and the pages round-trip."""
    outside = stage.parent / f"outside-{planted}"
    outside.write_bytes(b"keep")
    for path in (stage / "rst-1.bin", stage / ".rst-1.json.tmp"):
        if planted == "fifo":
            os.mkfifo(path, 0o600)
        elif planted == "symlink":
            path.symlink_to(outside)
        else:
            path.write_bytes(b"stale")

    def write() -> staging.PageIndex:
        w = staging.PageWriter(stage, "rst-1", dtype="uint8", page_shape=(64,), layers=("l0",))
        w.write(bytes([1]) * 8, bytes([7]) * 64)
        return w.commit()

    got = at_once(write, "a planted FIFO blocked the writer")
    assert isinstance(got, staging.PageIndex), got
    assert outside.read_bytes() == b"keep"
    assert (stage / "rst-1.bin").read_bytes() == bytes([7]) * 64
    assert not (stage / "rst-1.bin").is_symlink()
    pf = staging.PageFile(stage / "rst-1.json", directory=stage, mapped=False)
    try:
        assert bytes(pf.page(bytes([1]) * 8)) == bytes([7]) * 64
    finally:
        pf.close()


def test_a_declared_gigabyte_page_over_a_sparse_file_is_refused_before_allocating(stage: Path) -> None:
    idx = stage / "cap-3.json"
    doc = {
        "schema": staging.SCHEMA,
        "version": staging.VERSION,
        "dtype": "float32",
        "page_shape": [1 << 28],
        "page_bytes": 1 << 30,
        "layers": ["l0"],
        "keys": ["00" * 8],
    }
    fd = os.open(idx, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, json.dumps(doc).encode())
    os.close(fd)
    fd = os.open(idx.with_suffix(".bin"), os.O_WRONLY | os.O_CREAT, 0o600)
    os.ftruncate(fd, 1 << 30)  # sparse: costs the worker nothing
    os.close(fd)
    tracemalloc.start()
    try:
        with pytest.raises(staging.PageFileError, match="bound"):
            staging.PageFile(idx, directory=stage, mapped=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_a_huge_json_reply_of_small_values_is_refused_before_parsing(tmp_path: Path) -> None:
    path = str(tmp_path / "w.sock")
    line = b'{"ok": true, "x": [' + b"1," * (31 << 20) + b"1]}\n"  # 62 MiB
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.makefile("rb").readline()
            conn.sendall(line)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    tracemalloc.start()
    try:
        with pytest.raises(control.ControlError, match="JSON values"):
            control.call(path, "stats")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        srv.close()
    # the line itself, received and copied once; parsed it would have cost ~15x
    assert peak < 3 * len(line), peak
