"""Strings from a repository reach the operator's terminal escaped (``cli.main._safe``).

Labels, pins, parents, worker ids (a planted manifest directory) and error
messages quoting stored text (a lock's hostname) carry C0 and C1 controls
and a bidi override; the human output shows them as ``\\x1b``, ``\\u202e``
and so on, and holds no raw control or format character; ``--json`` output
gives the exact strings back.
"""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pytest

import ckpt
from ckpt import lock as lock_mod
from ckpt.pins import Pins, WorkerFacts
from cli._common import safe as _safe
from tests.harness.cli import invoke as run
from tests.harness.repo import WORKER_FACTS

# Clear screen, set the window title (OSC … BEL), C1 CSI, a right-to-left override,
# NUL, DEL, a line separator.
EVIL = "\x1b[2J\x1b]0;t\x07\x9b1m\u202e\x00\x7f\u2028"
SHOWN = r"\x1b[2J\x1b]0;t\x07\x9b1m\u202e\x00\x7f\u2028"


def raw_controls(text: str) -> list[str]:
    """Control and format characters in ``text``, other than the newlines that end lines."""
    return [
        f"U+{ord(ch):04X}" for ch in text if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp")
    ]


@pytest.fixture
def evil_repo(tmp_path: Path) -> tuple[Path, ckpt.Manifest]:
    path = tmp_path / "repo"
    with ckpt.Repository.open(str(path), create=True) as repo:
        m = repo.save(
            [ckpt.Block.from_array(b"k0", np.arange(64, dtype=np.float16))],
            worker_id="w0",
            namespace=ckpt.Namespace({"engine": "test"}),
            pins=Pins(host=ckpt.host_facts(), worker=WorkerFacts.model_validate(WORKER_FACTS | {"model": "m" + EVIL})),
            labels={"note": EVIL},
            parent="p" + EVIL,
        )
    return path, m


def test_safe_escapes_controls_and_keeps_text() -> None:
    for code in [*range(0x20), 0x7F, *range(0x80, 0xA0)]:
        assert _safe(chr(code)) == f"\\x{code:02x}"
    for code in [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x2028, 0x2029, 0xFEFF]:
        assert _safe(chr(code)) == f"\\u{code:04x}"
    assert _safe("\U000e0001") == "\\U000e0001"  # a tag character
    assert _safe(EVIL) == SHOWN
    for text in ("w0", "model=Llama-3 8B", "é, 日本語, ☃, 🙂", "a\\x1b stays as typed", ""):
        assert _safe(text) == text


def test_inspect_shows_labels_and_pins_escaped(evil_repo: tuple[Path, ckpt.Manifest]) -> None:
    path, _ = evil_repo
    r = run("-r", str(path), "inspect", "latest")
    assert r.exit_code == 0, r.output
    assert raw_controls(r.stdout) == []
    assert f"note={SHOWN}" in r.stdout  # the label
    assert f"m{SHOWN}" in r.stdout  # the model pin
    assert f"p{SHOWN}" in r.stdout  # the parent

    doc = json.loads(run("-r", str(path), "inspect", "latest", "--json").stdout)
    assert doc["labels"] == {"note": EVIL}  # --json is exact
    assert doc["pins"]["worker"]["model"] == "m" + EVIL
    assert doc["parent"] == "p" + EVIL


def test_ls_shows_a_parent_and_a_planted_worker_id_escaped(evil_repo: tuple[Path, ckpt.Manifest]) -> None:
    path, m = evil_repo
    r = run("-r", str(path), "ls", "--long")
    assert r.exit_code == 0, r.output
    assert raw_controls(r.stdout) == []
    assert f"p{SHOWN}" in r.stdout
    # Listing takes worker ids from object names (without reading the manifests).
    planted = path / "manifests" / ("w" + EVIL.replace("\x00", "")) / m.id  # a file name cannot hold NUL
    planted.parent.mkdir()
    shutil.copy(path / "manifests" / "w0" / m.id, planted)
    r = run("-r", str(path), "ls")
    assert r.exit_code == 0, r.output
    assert raw_controls(r.stdout) == []
    assert "w" + SHOWN.replace(r"\x00", "") in r.stdout
    workers = {c["worker"] for c in json.loads(run("-r", str(path), "ls", "--json").stdout)["checkpoints"]}
    assert workers == {"w0", planted.parent.name}


def test_compat_reasons_quote_pins_escaped(evil_repo: tuple[Path, ckpt.Manifest], tmp_path: Path) -> None:
    path, _ = evil_repo
    facts = tmp_path / "worker.json"
    facts.write_text(json.dumps(WORKER_FACTS))  # model "tiny": a mismatch with the recorded one
    r = run("-r", str(path), "compat", "latest", "--worker-facts", str(facts))
    assert r.exit_code == 5, r.output
    assert raw_controls(r.stdout) == []
    assert f"m{SHOWN}" in r.stdout


def test_error_messages_quoting_stored_text_are_escaped(
    evil_repo: tuple[Path, ckpt.Manifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = evil_repo
    evil = EVIL.removesuffix("\u2028")  # a message is made one line first: a line separator becomes "; "
    monkeypatch.setattr(lock_mod.socket, "gethostname", lambda: "h" + evil)
    with lock_mod.Lock(ckpt.LocalStore(path), exclusive=False, operation="save"):
        monkeypatch.undo()
        r = run("-r", str(path), "gc", "--now")  # refused, naming the holder's host
        listed = run("-r", str(path), "unlock")
        as_json = run("-r", str(path), "gc", "--now", "--json")
    assert r.exit_code == 6, r.output
    assert raw_controls(r.stderr) == []
    shown = SHOWN.removesuffix(r"\u2028")
    assert f"on h{shown} pid" in r.stderr
    assert raw_controls(listed.stdout) == []
    assert f"on h{shown} pid" in listed.stdout
    assert f"on h{evil} pid" in json.loads(as_json.stdout)["error"]["message"]
