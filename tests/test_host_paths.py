"""Runtime and staging directories nobody else can squat; page files another process names are read
only from where they belong (issue #11, item 1).

The attacks are a local account's: creating ``/tmp/gpuckpt-$UID`` (or a
staging directory) first, serving the connector socket the agent talks to,
and answering a capture with a page file outside staging, behind a symlink,
or hard-linked to a file the agent can read (its key). Tests that need a
second account (a foreign owner) run as root, which CI is; the mode and
symlink cases run as anyone.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent import fs, session
from agent.engines import staging
from agent.engines.types import Staging
from cli.main import app
from tests.fake_connector import FakeConnector

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="a directory owned by another account needs root to make")
OTHER = 54321  # an account that is not us (no passwd entry needed)


def squat(d: Path, *, owner: int | None = None, mode: int = 0o777) -> Path:
    d.mkdir()
    os.chmod(d, mode)
    if owner is not None:
        os.chown(d, owner, owner)
    return d


# -- directories ------------------------------------------------------------------------------


@needs_root
def test_a_runtime_directory_another_account_made_first_is_refused_by_name(short_tmp: Path) -> None:
    d = squat(short_tmp / f"gpuckpt-{os.getuid()}", owner=OTHER)
    for make in (fs.ensure_dir, fs.ensure_socket_dir, staging.ensure_dir):
        with pytest.raises(fs.UnsafePath) as e:
            make(d)
        assert str(d) in str(e.value), e.value
        assert f"uid {OTHER}" in str(e.value), e.value
    # and anything below it: the squatter could swap it
    with pytest.raises(fs.UnsafePath, match="could replace"):
        fs.ensure_dir(d / "gpuckpt")
    assert not (d / "gpuckpt").exists()


def test_a_directory_of_ours_others_can_write_to_is_refused_not_chmodded(short_tmp: Path) -> None:
    d = squat(short_tmp / "stage")
    (d / "planted.json").write_text("{}")
    with pytest.raises(fs.UnsafePath, match=r"mode 0777.*plant"):
        staging.ensure_dir(d)
    assert os.stat(d).st_mode & 0o777 == 0o777  # left as it was: the operator decides
    with pytest.raises(fs.UnsafePath, match="writable by other accounts"):
        fs.ensure_dir(d / "below")


def test_a_symlink_is_never_adopted_as_a_directory(short_tmp: Path) -> None:
    real = short_tmp / "real"
    real.mkdir(mode=0o700)
    (short_tmp / "link").symlink_to(real)
    with pytest.raises(fs.UnsafePath, match="symlink"):
        staging.ensure_dir(short_tmp / "link")


def test_made_directories_are_private_or_the_shared_groups(short_tmp: Path) -> None:
    d = fs.ensure_dir(short_tmp / "a" / "b")
    assert os.stat(d).st_mode & 0o7777 == 0o700
    assert os.stat(short_tmp / "a").st_mode & 0o7777 == 0o700
    if ROOT:
        shared = fs.ensure_dir(short_tmp / "shared", fs.Trust.of(4242))
        st = os.stat(shared)
        assert (st.st_mode & 0o7777, st.st_gid) == (0o2770, 4242)
        # the worker's files in it: the group reads them, nobody else
        w = staging.PageWriter(shared, "p", dtype="uint8", page_shape=(4,), layers=["l"], trust=fs.Trust.of(4242))
        w.write(b"k" * 32, b"abcd")
        w.commit()
        for f in (shared / "p.bin", shared / "p.json"):
            st = os.stat(f)
            assert (st.st_mode & 0o777, st.st_gid) == (0o640, 4242)


@needs_root
def test_launch_refuses_a_squatted_runtime_directory(short_tmp: Path) -> None:
    d = squat(short_tmp / "run", owner=OTHER)
    r = CliRunner().invoke(app, ["--repo", str(short_tmp / "repo"), "launch", "--runtime-dir", str(d), "--", "true"])
    assert r.exit_code != 0
    assert str(d) in r.output, r.output
    assert "refusing" in r.output, r.output


# -- sockets ------------------------------------------------------------------------------------


def test_a_socket_in_a_directory_others_can_write_to_is_not_talked_to(short_tmp: Path) -> None:
    d = squat(short_tmp / "sq")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "conn.sock"))
    try:
        os.chmod(d / "conn.sock", 0o600)
        with pytest.raises(fs.UnsafePath, match="could replace the socket"):
            fs.check_socket(d / "conn.sock")
    finally:
        s.close()
    (short_tmp / "file.sock").write_text("")
    with pytest.raises(fs.UnsafePath, match="not a socket"):
        fs.check_socket(short_tmp / "file.sock")


@needs_root
def test_a_socket_another_account_serves_is_not_talked_to(short_tmp: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(short_tmp / "conn.sock"))
    try:
        os.chown(short_tmp / "conn.sock", OTHER, OTHER)
        with pytest.raises(fs.UnsafePath, match=f"owned by uid {OTHER}"):
            fs.check_socket(short_tmp / "conn.sock")
    finally:
        s.close()


# -- page files a connector names ----------------------------------------------------------------


@pytest.fixture
def rig(short_tmp: Path) -> Iterator[tuple[Path, FakeConnector]]:
    fake = FakeConnector(short_tmp / "conn.sock", short_tmp / "stage", pages=4)
    yield short_tmp, fake
    fake.close()


def _capture(tmp: Path, fake: FakeConnector) -> None:
    cap = session.capture(fake.sock, 30, where=Staging(tmp / "stage"))
    try:
        for _ in cap.pages:
            pass
    finally:
        cap.close()


def _moved(tmp: Path, index: Path, where: Path) -> Path:
    where.mkdir(mode=0o700, exist_ok=True)
    for suffix in (".json", ".bin"):
        shutil.move(index.with_suffix(suffix), where / index.with_suffix(suffix).name)
    return where / index.name


def test_the_staging_directory_as_configured_is_read(rig: tuple[Path, FakeConnector]) -> None:
    tmp, fake = rig
    _capture(tmp, fake)
    assert not list((tmp / "stage").glob("capture-*")), "a read chunk is deleted"


def test_a_page_file_outside_staging_is_refused_and_left_alone(rig: tuple[Path, FakeConnector]) -> None:
    tmp, fake = rig
    planted: list[Path] = []
    fake.name_index = lambda idx: str(planted.append(_moved(tmp, idx, tmp / "elsewhere")) or planted[-1])
    with pytest.raises(fs.UnsafePath, match="not in the staging directory"):
        _capture(tmp, fake)
    assert planted[0].exists(), "a path the reply names is not deleted"
    assert planted[0].with_suffix(".bin").exists()


def test_a_page_file_behind_a_symlink_is_refused(rig: tuple[Path, FakeConnector]) -> None:
    tmp, fake = rig

    def link(idx: Path) -> str:
        real = _moved(tmp, idx, tmp / "elsewhere")
        (tmp / "stage" / "evil.json").symlink_to(real)
        (tmp / "stage" / "evil.bin").symlink_to(real.with_suffix(".bin"))
        return str(tmp / "stage" / "evil.json")

    fake.name_index = link
    with pytest.raises(fs.UnsafePath, match="symlink"):
        _capture(tmp, fake)


def test_page_data_hard_linked_to_another_file_is_refused(rig: tuple[Path, FakeConnector]) -> None:
    tmp, fake = rig
    secret = tmp / "key"
    secret.write_bytes(b"s" * 8192 * 4)
    os.chmod(secret, 0o600)

    def hardlink(idx: Path) -> str:
        data = idx.with_suffix(".bin")
        data.unlink()
        os.link(secret, data)  # the agent's own file, same size as the pages
        return str(idx)

    fake.name_index = hardlink
    with pytest.raises(fs.UnsafePath, match="2 links"):
        _capture(tmp, fake)
    assert secret.read_bytes() == b"s" * 8192 * 4


def test_a_page_file_others_can_read_is_refused(rig: tuple[Path, FakeConnector]) -> None:
    tmp, fake = rig

    def loosen(idx: Path) -> str:
        os.chmod(idx.with_suffix(".bin"), 0o644)
        return str(idx)

    fake.name_index = loosen
    with pytest.raises(fs.UnsafePath, match="mode 0644"):
        _capture(tmp, fake)


@needs_root
def test_a_page_file_another_account_owns_is_refused(rig: tuple[Path, FakeConnector]) -> None:
    tmp, fake = rig

    def chown(idx: Path) -> str:
        os.chown(idx, OTHER, OTHER)
        return str(idx)

    fake.name_index = chown
    with pytest.raises(fs.UnsafePath, match=f"owned by uid {OTHER}"):
        _capture(tmp, fake)


def test_without_a_configured_directory_a_world_writable_one_is_refused(rig: tuple[Path, FakeConnector]) -> None:
    tmp, fake = rig
    d = squat(tmp / "tmpish", mode=0o1777)  # like /tmp
    fake.name_index = lambda idx: str(_moved(tmp, idx, d))
    cap = None
    with pytest.raises(fs.UnsafePath, match=str(d)):
        cap = session.capture(fake.sock, 30)  # no Staging: the named file's own directory is judged
    assert cap is None


# -- what launch gives the worker ------------------------------------------------------------------


def test_launch_gives_the_worker_no_secret_of_the_agent(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cli import agent_cmds

    seen: dict[str, dict[str, str]] = {}

    class Stop(Exception):
        pass

    real = subprocess.Popen

    def popen(argv: list[str], **kw: object) -> object:
        if "env" not in kw:  # launch's probe of the worker's interpreter (which vLLM it has): run it
            return real(argv, **kw)  # type: ignore[call-overload]
        seen["env"] = dict(kw["env"])  # type: ignore[arg-type]
        raise Stop

    secrets = {
        "AWS_ACCESS_KEY_ID": "AKIA-test",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
        "AWS_SESSION_TOKEN": "tok",
        "GPUCKPT_AGENT__KEY": "env:REPO_KEY",
        "REPO_KEY": "ab" * 32,
    }
    for k, v in {**secrets, "HF_TOKEN": "hf-keep", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(agent_cmds.subprocess, "Popen", popen)
    r = CliRunner().invoke(
        app,
        ["--repo", str(short_tmp / "repo"), "launch", "--runtime-dir", str(short_tmp / "run"), "--", "vllm", "serve"],
    )
    assert isinstance(r.exception, Stop), r.output
    env = seen["env"]
    assert not set(secrets) & set(env), sorted(set(secrets) & set(env))
    assert env["HF_TOKEN"] == "hf-keep"  # what the worker needs stays
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_with_staging_unset_a_capture_cannot_name_the_agents_own_restore_pages(rig: tuple[Path, FakeConnector]) -> None:
    """With no staging directory configured the agent reads page files from any directory it accepts;
    never from a restore's staging (its own files: read, then deleted)."""
    tmp, fake = rig
    restore_dir = staging.default_dir(f"{session.RESTORE_TAG}{os.getpid()}-test")
    planted: list[Path] = []
    fake.name_index = lambda idx: str(planted.append(_moved(tmp, idx, restore_dir)) or planted[-1])
    try:
        with pytest.raises(fs.UnsafePath, match="restore's staging"):
            session.capture(fake.sock, 30, where=Staging())  # staging_dir unset
        assert planted[0].exists(), "the restore's page file was deleted"
    finally:
        shutil.rmtree(restore_dir, ignore_errors=True)
