"""The smaller attacks on the repository and the agent (issue 22, item 6), each as written."""

from __future__ import annotations

import json
import os
import zlib
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from agent.engines import control
from ckpt import Block, HostFacts, Keyring, Namespace, OperationAborted, Pins, WorkerFacts, document
from ckpt import save as save_mod
from ckpt.config import DEFAULT_PACK_SIZE
from ckpt.repository import Repository

NS = Namespace({"model": "hardening"})
PINS = Pins(host=HostFacts(), worker=WorkerFacts())
KiB = 1 << 10


def blocks(tag: str, n: int) -> list[Block]:
    return [
        Block(
            f"{tag}{i}".encode(),
            np.random.default_rng(zlib.crc32(f"{tag}{i}".encode())).bytes(16 * KiB),
            "uint8",
            (16 * KiB,),
        )
        for i in range(n)
    ]


def test_a_config_whose_mac_was_removed_cannot_set_the_pack_size(tmp_path: Path) -> None:
    key = Keyring(os.urandom(32))
    root = tmp_path / "repo"
    Repository.open(str(root), key=key, create=True)
    env = json.loads((root / "config").read_bytes())
    body = env["body"]
    del body["encryption"]["mac"]  # a writer without the key
    body["pack_size"] = 64 * KiB  # every save would write thousands of packs
    (root / "config").write_bytes(document.seal("gpuckpt-repository", env["version"], "config", body, None))
    repo = Repository.open(str(root), key=key)
    assert repo.config.pack_size == DEFAULT_PACK_SIZE
    m = repo.save(blocks("a", 64), worker_id="w0", namespace=NS, pins=PINS)  # 1 MiB
    assert m.sizes.packs_written == 1


def test_a_manifest_larger_than_readers_accept_is_never_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = Repository.open(str(tmp_path / "repo"), create=True)
    monkeypatch.setattr(save_mod, "MANIFEST_MAX_BYTES", 4096)  # ~800k blocks at the real bound
    with pytest.raises(OperationAborted, match="more than readers accept"):
        repo.save(blocks("a", 40), worker_id="w0", namespace=NS, pins=PINS)
    assert repo.list() == []


def test_one_planted_object_with_a_bad_name_stops_neither_latest_nor_retention_nor_gc(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    repo = Repository.open(str(root), create=True)
    for i in range(2):
        repo.save(blocks(f"c{i}", 4), worker_id="w0", namespace=NS, pins=PINS)
    bad = root / "manifests" / "bad name"
    bad.mkdir()
    (bad / "20261202T000000000Z-deadbeef").write_text("planted")
    # listed for what it is (ls shows it, escaped), never read: latest, retention and gc go on
    assert sorted(c.worker_id for c in repo.list()) == ["bad name", "w0", "w0"]
    assert repo.latest()[0].worker_id == "w0"
    assert len(repo.forget(keep_last=1)) == 1
    repo.gc(grace=timedelta(0))
    assert (bad / "20261202T000000000Z-deadbeef").exists(), "not ours: left alone"


def test_the_control_channel_never_follows_a_symlink_at_the_socket_path(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.sock"
    link = tmp_path / "w.sock"
    link.symlink_to(target)
    with pytest.raises(control.ControlError, match="symlink"):
        control.call(str(link), "ping")


def test_the_agent_api_adopts_no_socket_directory_others_could_write(tmp_path: Path) -> None:
    from agent import fs
    from agent.daemon.api import ApiServer

    d = tmp_path / "run"
    d.mkdir()
    os.chmod(d, 0o777)  # noqa: S103 - the squatted directory under test
    with pytest.raises(fs.UnsafePath, match="other accounts could replace the socket"):
        ApiServer(None, d / "w.sock").start()
    assert not (d / "w.sock").exists()
