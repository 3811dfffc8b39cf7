"""Key files and variables (FORMAT.md §10): one unambiguous format, a file only its owner can use.

Every refusal is a ConfigError naming the source and the cause, and never the
content (key material, or a passphrase someone mistook for a key).
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from ckpt import ConfigError, Keyring, KeySource

RAW = bytes(range(200, 232))  # 32 bytes, not text
HEX = RAW.hex()
B64 = base64.b64encode(RAW).decode()


def key_file(tmp_path: Path, content: bytes, mode: int = 0o600, name: str = "key") -> Path:
    p = tmp_path / name
    p.write_bytes(content)
    os.chmod(p, mode)
    return p


def load(path: Path) -> Keyring:
    return KeySource.parse(f"file:{path}").load()


def refused(path: Path) -> str:
    with pytest.raises(ConfigError) as ei:
        load(path)
    msg = str(ei.value)
    assert str(path) in msg
    return msg


@pytest.mark.parametrize(
    "content",
    [
        HEX.encode(),
        HEX.encode() + b"\n",
        HEX.upper().encode() + b"\r\n",
        B64.encode(),
        B64.encode() + b"\n",
        RAW,
    ],
    ids=["hex", "hex-newline", "hex-crlf", "base64", "base64-newline", "binary"],
)
def test_each_key_form_gives_the_same_key(tmp_path: Path, content: bytes) -> None:
    assert load(key_file(tmp_path, content)).key_id == Keyring(RAW).key_id


def test_read_only_for_the_owner_is_accepted(tmp_path: Path) -> None:
    assert load(key_file(tmp_path, HEX.encode(), 0o400)).key_id == Keyring(RAW).key_id


@pytest.mark.parametrize(
    ("content", "cause"),
    [
        # 31 characters and a newline: 32 bytes, once taken for a binary key.
        (b"correct horse battery staple 31\n", "32 bytes of text, which is ambiguous"),
        (b"x" * 32, "32 bytes of text, which is ambiguous"),
        # 32 characters and a newline: text, but not a key.
        (b"correct horse battery staple 32!\n", "32 characters of text that are neither 64 hex digits nor base64"),
        (HEX.encode()[:-1] + b"g\n", "64 characters of text that are neither"),
        (HEX.encode() + b"\n\n", "whitespace or lines besides the key"),
        (b" " + HEX.encode(), "whitespace or lines besides the key"),
        (RAW + b"\n", "33 bytes that are not text"),
        (RAW[:31], "31 bytes that are not text"),
        (b"", "0 characters of text"),
    ],
    ids=[
        "31+newline",
        "32-text",
        "32+newline",
        "bad-hex",
        "two-newlines",
        "leading-space",
        "33-binary",
        "31-binary",
        "empty",
    ],
)
def test_what_is_not_a_key_is_refused_with_the_cause(tmp_path: Path, content: bytes, cause: str) -> None:
    msg = refused(key_file(tmp_path, content))
    assert cause in msg
    text = content.strip()
    if len(text) >= 8:
        assert text.decode(errors="replace") not in msg  # never the content


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o610, 0o601])
def test_a_key_file_open_to_group_or_others_is_refused(tmp_path: Path, mode: int) -> None:
    msg = refused(key_file(tmp_path, HEX.encode(), mode))
    assert f"open to group or others (mode {mode:04o})" in msg


def test_a_symlinked_key_file_is_refused(tmp_path: Path) -> None:
    target = key_file(tmp_path, HEX.encode())
    link = tmp_path / "link"
    link.symlink_to(target)
    assert "is a symbolic link" in refused(link)
    assert load(target).key_id == Keyring(RAW).key_id


def test_a_key_file_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = key_file(tmp_path, HEX.encode())
    if os.geteuid() == 0:
        os.chown(p, 4242, -1)  # root may give it away; a non-root test pretends to be someone else
    else:
        monkeypatch.setattr(os, "geteuid", lambda: os.stat(p).st_uid + 1)
    msg = refused(p)
    assert f"owned by uid {os.stat(p).st_uid}, not by this user" in msg


def test_a_key_file_owned_by_root_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = key_file(tmp_path, HEX.encode())
    if os.stat(p).st_uid != 0:
        pytest.skip("needs root to make a root-owned file")
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    assert load(p).key_id == Keyring(RAW).key_id


def test_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    # O_NONBLOCK: a FIFO with no writer must not hang the open.
    assert "not a regular file" in refused(fifo)
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    assert "not a regular file" in refused(d)


def test_a_missing_or_huge_key_file_is_refused(tmp_path: Path) -> None:
    assert "No such file" in refused(tmp_path / "absent")
    assert "too large to be a key" in refused(key_file(tmp_path, b"0" * 5000))


def test_a_variable_holds_the_text_forms_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in (HEX, HEX + "\n", B64):
        monkeypatch.setenv("GPUCKPT_TEST_KEY", value)
        assert KeySource.parse("env:GPUCKPT_TEST_KEY").load().key_id == Keyring(RAW).key_id
    monkeypatch.setenv("GPUCKPT_TEST_KEY", "a 32-character passphrase here!!")
    with pytest.raises(ConfigError, match="env:GPUCKPT_TEST_KEY holds 32 bytes of text, which is ambiguous"):
        KeySource.parse("env:GPUCKPT_TEST_KEY").load()
    monkeypatch.setenv("GPUCKPT_TEST_KEY", "é" * 16)  # 32 bytes of UTF-8, not text
    with pytest.raises(ConfigError, match="env:GPUCKPT_TEST_KEY holds 32 binary bytes"):
        KeySource.parse("env:GPUCKPT_TEST_KEY").load()
    monkeypatch.delenv("GPUCKPT_TEST_KEY")
    with pytest.raises(ConfigError, match="the variable is not set"):
        KeySource.parse("env:GPUCKPT_TEST_KEY").load()
