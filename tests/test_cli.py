"""The ``gpuckpt`` command line, against real local repositories.

Most tests go through typer's CliRunner (same process); a few run the
command as a real subprocess, so the console script, ``python -m cli.main``,
exit statuses and stream separation are tested as a user meets them.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import Result

import ckpt
from ckpt.lock import Lock
from ckpt.pins import HostFacts, Pins, WorkerFacts
from cli import exitcodes
from tests.harness.cli import CLI
from tests.harness.cli import invoke as run
from tests.harness.paths import ROOT
from tests.harness.repo import WORKER_FACTS

NS = ckpt.Namespace({"engine": "test", "model": "tiny"})
WORKER = WorkerFacts.model_validate(WORKER_FACTS)
LEDGER = {"schema": "gpuckpt-vllm-ledger", "version": 2, "data": {"requests": [{"id": "a"}, {"id": "b"}]}}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GPUCKPT_REPO", "GPUCKPT_KEY", "COLUMNS"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session")
def here() -> HostFacts:
    return ckpt.host_facts()


def _blocks(seed: int, n: int = 4) -> list[ckpt.Block]:
    return [
        ckpt.Block.from_array(f"{seed}-{i}".encode(), np.arange(512, dtype=np.float16) + seed + i) for i in range(n)
    ]


def _save(repo: ckpt.Repository, host: HostFacts, *, seed: int = 0, worker_id: str = "w0") -> ckpt.Manifest:
    return repo.save(
        _blocks(seed),
        worker_id=worker_id,
        namespace=NS,
        pins=Pins(host=host, worker=WORKER),
        ledger=LEDGER,
        canary={"prompt": [1, 2, 3]},
    )


@pytest.fixture
def repo_dir(tmp_path: Path, here: HostFacts) -> tuple[Path, ckpt.Manifest]:
    path = tmp_path / "repo"
    with ckpt.Repository.open(str(path), create=True) as repo:
        m = _save(repo, here)
    return path, m


def as_json(result: Result) -> Any:
    return json.loads(result.stdout)


def one_error_line(result: Result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpuckpt: error: ")
    assert "Traceback" not in result.output
    return lines[0]


def flip_blob_byte(repo: Path) -> Path:
    """Flip one byte in the middle of the blob area of the repository's only pack."""
    (pack,) = (p for p in (repo / "packs").rglob("*") if p.is_file())
    data = bytearray(pack.read_bytes())
    (trailer_len,) = struct.unpack_from("<Q", data, len(data) - 32)
    start, end = 16, len(data) - 32 - trailer_len
    assert end > start
    data[(start + end) // 2] ^= 0xFF
    os.chmod(pack, 0o600)
    pack.write_bytes(bytes(data))
    return pack


def sub(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCKPT_")}
    full_env.update(env or {})
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=full_env,
        timeout=60,
        check=False,
    )


# -- exit codes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ckpt.RepositoryNotFound("x"), 3),
        (ckpt.CheckpointNotFound("x"), 3),
        (ckpt.ObjectNotFound("x"), 3),
        (ckpt.IntegrityError("x"), 4),
        (ckpt.IncompatibleCheckpoint("x", ["a"]), 5),
        (ckpt.RepositoryLocked("x"), 6),
        (ckpt.StoreUnavailable("x"), 7),
        (ckpt.AccessDenied("x"), 7),
        (ckpt.StorageFull("x"), 8),
        (ckpt.KeyMissing("x"), 9),
        (ckpt.KeyMismatch("x"), 9),
        (ckpt.ConfigError("x"), 9),
        (ckpt.FormatError("x"), 9),
        (ckpt.UnsupportedVersion("config", 9, (1,)), 9),
        (ckpt.ManifestError("x"), 9),
        (ckpt.RepositoryExists("x"), 1),
        (ckpt.ObjectExists("x"), 1),
        (ckpt.InvalidName("x"), 1),
        (ckpt.OperationAborted("x"), 1),
        (ckpt.GpuckptError("x"), 1),
        (KeyboardInterrupt(), 130),
    ],
)
def test_exit_code_for(exc: BaseException, code: int) -> None:
    assert exitcodes.exit_code_for(exc) == code


def test_exit_code_doc_matches_module() -> None:
    text = (ROOT / "docs" / "exit-codes.md").read_text()
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*([A-Z_]+)\s*\|", text, re.M)
    documented = {name: int(code) for code, name in rows}
    assert documented == exitcodes.CODES
    for name, code in exitcodes.CODES.items():  # and the module docstring's table
        assert re.search(rf"^{code}\s+{name}\s", exitcodes.__doc__ or "", re.M), name


# -- commands, through CliRunner --------------------------------------------------------


def test_ls(repo_dir: tuple[Path, ckpt.Manifest], here: HostFacts) -> None:
    path, m = repo_dir
    with ckpt.Repository.open(str(path)) as repo:
        m2 = _save(repo, here, seed=1)
        _save(repo, here, seed=2, worker_id="w1")
    r = run("-r", str(path), "ls", "--json")
    assert r.exit_code == 0, r.output
    doc = as_json(r)
    assert [c["id"] for c in doc["checkpoints"] if c["worker"] == "w0"] == [m.id, m2.id]
    assert all(c["manifest_bytes"] > 0 for c in doc["checkpoints"])

    r = run("ls", "-r", str(path), "--worker", "w0", "--long", "--json")
    rows = as_json(r)["checkpoints"]
    assert [c["id"] for c in rows] == [m.id, m2.id]
    assert rows[0]["blocks"] == 4
    assert rows[0]["raw_bytes"] == 4 * 512 * 2
    assert rows[0]["parent"] is None
    assert rows[1]["parent"] == m.id
    assert rows[1]["new_raw_bytes"] == 4 * 512 * 2

    r = run("-r", str(path), "ls", "--long")
    assert r.exit_code == 0
    assert m.id in r.stdout
    assert m2.id in r.stdout
    assert "w1" in r.stdout


def test_inspect(repo_dir: tuple[Path, ckpt.Manifest]) -> None:
    path, m = repo_dir
    r = run("-r", str(path), "inspect", m.id[:20], "--json")
    assert r.exit_code == 0, r.output
    doc = as_json(r)
    assert doc["id"] == m.id
    assert "blocks" not in doc
    assert doc["ledger"]["schema"] == "gpuckpt-vllm-ledger"
    assert doc["pins"]["worker"]["block_size"] == 16

    doc = as_json(run("-r", str(path), "inspect", "w0:latest", "--json", "--blocks"))
    assert len(doc["blocks"]) == 4
    assert ckpt.Manifest.model_validate(doc) == m

    r = run("-r", str(path), "inspect", "latest", "--blocks")
    assert r.exit_code == 0, r.output
    out = r.stdout
    for text in (
        m.id,
        "gpuckpt-vllm-ledger v2",
        "present",
        "[2,num_blocks,16,4,8]",
        "FLASH_ATTN",
        m.blocks[0].key,
        "zstd",
    ):
        assert text in out, text
    assert re.search(r"ledger requests\s+│\s+2\b", out)


def test_unknown_checkpoint_is_exit_3(repo_dir: tuple[Path, ckpt.Manifest]) -> None:
    path, _ = repo_dir
    r = run("-r", str(path), "inspect", "20990101")
    assert r.exit_code == 3
    assert "no checkpoint '20990101'" in one_error_line(r)
    assert r.stdout == ""

    r = run("-r", str(path), "inspect", "20990101", "--json")
    assert r.exit_code == 3
    assert as_json(r) == {
        "error": {
            "type": "CheckpointNotFound",
            "message": f"no checkpoint '20990101' in {path.as_uri()}",
            "exit_code": 3,
        }
    }
    one_error_line(r)


def test_missing_repository_is_exit_3(tmp_path: Path) -> None:
    r = run("-r", str(tmp_path / "nothing"), "ls")
    assert r.exit_code == 3
    assert "no gpuckpt repository" in one_error_line(r)
    r = run("-r", str(tmp_path), "stats")  # a directory, but no repository in it
    assert r.exit_code == 3
    assert "no gpuckpt repository" in one_error_line(r)


def test_verify_ok(repo_dir: tuple[Path, ckpt.Manifest]) -> None:
    path, m = repo_dir
    r = run("-r", str(path), "verify", "--json")
    assert r.exit_code == 0, r.output
    doc = as_json(r)
    assert doc["ok"] is True
    assert doc["problems"] == []
    assert doc["checked_checkpoints"] == 1
    assert doc["checked_packs"] == 1
    r = run("-r", str(path), "verify", m.id)
    assert r.exit_code == 0
    assert "no problems found" in r.stdout


def test_verify_corrupt_pack_is_exit_4(repo_dir: tuple[Path, ckpt.Manifest]) -> None:
    path, m = repo_dir
    pack = flip_blob_byte(path)
    r = run("-r", str(path), "verify", "--json")
    assert r.exit_code == 4, r.output
    doc = as_json(r)
    assert doc["ok"] is False
    assert doc["problems"]
    assert all(p["obj"].endswith(pack.name) for p in doc["problems"])

    r = run("-r", str(path), "verify", m.id)  # one checkpoint: every block read back
    assert r.exit_code == 4, r.output
    assert pack.name in r.stdout
    assert "problem(s) found" in r.stdout

    r = run("-r", str(path), "verify", "--no-read-data")  # the data is there, just wrong
    assert r.exit_code == 0, r.output


def test_compat_warm(tmp_path: Path, here: HostFacts) -> None:
    path = tmp_path / "repo"
    with ckpt.Repository.open(str(path), create=True) as repo:
        m = _save(repo, here)
    # A fact this host cannot determine is UNKNOWN, which strictly refuses:
    # allow exactly those, so the test holds on any host.
    allow = [f"--allow-unknown={k}" for k, v in here.model_dump().items() if v is None]
    r = run("-r", str(path), "compat", m.id, "--json", *allow)
    assert r.exit_code == 0, r.output
    doc = as_json(r)
    assert doc["warm"] is True
    assert doc["worker_checked"] is False
    rules = {x["rule"]: x for x in doc["results"]}
    assert rules["block_size"]["ignored"] is True  # no --worker-facts: host only
    assert rules["cpu_isa"]["checkpoint"] == here.cpu_isa

    facts = tmp_path / "worker.json"
    facts.write_text(WORKER.model_dump_json())
    r = run("-r", str(path), "compat", m.id, "--worker-facts", str(facts), *allow)
    assert r.exit_code == 0, r.output
    assert "warm restore allowed" in r.stdout

    facts.write_text(WORKER.model_copy(update={"block_size": 32}).model_dump_json())
    r = run("-r", str(path), "compat", m.id, "--worker-facts", str(facts), "--json", *allow)
    assert r.exit_code == 5
    assert as_json(r)["reasons"] == ["block_size: mismatch (checkpoint 16, here 32)"]

    r = run("-r", str(path), "compat", m.id, "--worker-facts", str(facts), "--ignore", "block_size", *allow)
    assert r.exit_code == 0, r.output

    facts.write_text('{"block_size": "sixteen"}')
    r = run("-r", str(path), "compat", m.id, "--worker-facts", str(facts))
    assert r.exit_code == 9
    assert "block_size" in one_error_line(r)

    r = run("-r", str(path), "compat", m.id, "--ignore", "no_such_rule")
    assert r.exit_code == 2
    assert "no_such_rule" in r.stderr


def test_compat_refused_is_exit_5(tmp_path: Path, here: HostFacts) -> None:
    path = tmp_path / "repo"
    elsewhere = here.model_copy(update={"cpu_isa": "other-isa", "torch_version": "0.0.1"})
    with ckpt.Repository.open(str(path), create=True) as repo:
        m = _save(repo, elsewhere)
    r = run("-r", str(path), "compat", m.id, "--json")
    assert r.exit_code == 5, r.output
    doc = as_json(r)
    assert doc["warm"] is False
    assert f"cpu_isa: mismatch (checkpoint other-isa, here {here.cpu_isa})" in doc["reasons"]
    assert any(x.startswith("torch_version: mismatch") for x in doc["reasons"])

    r = run("-r", str(path), "compat", m.id)
    assert r.exit_code == 5
    assert re.search(r"cpu_isa\s+│\s+mismatch\s+│\s+other-isa", r.stdout)
    assert "warm restore refused" in r.stdout
    assert r.stderr == ""  # a refusal is an answer, not an error


def test_gc_forget_rm_stats(repo_dir: tuple[Path, ckpt.Manifest], here: HostFacts) -> None:
    path, m0 = repo_dir
    with ckpt.Repository.open(str(path)) as repo:
        m1 = _save(repo, here, seed=1)
        m2 = _save(repo, here, seed=2)
    stats = as_json(run("-r", str(path), "stats", "--json"))
    assert stats["manifests_count"] == 3
    assert stats["packs_count"] == 3

    r = run("-r", str(path), "forget", "--keep-last", "1", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    doc = as_json(r)
    assert doc["dry_run"] is True
    assert [(c["id"], c["worker"]) for c in doc["removed"]] == [(m0.id, "w0"), (m1.id, "w0")]
    assert len(as_json(run("-r", str(path), "ls", "--json"))["checkpoints"]) == 3

    r = run("-r", str(path), "forget", "--keep-within", "1h", "--json")
    assert r.exit_code == 0
    assert as_json(r)["removed"] == []
    r = run("-r", str(path), "forget", "--keep-last", "2", "--worker", "w0")
    assert r.exit_code == 0
    assert m0.id in r.stdout
    r = run("-r", str(path), "rm", m1.id[:22], "--json")
    assert r.exit_code == 0
    assert as_json(r)["removed"]["id"] == m1.id
    assert [c["id"] for c in as_json(run("-r", str(path), "ls", "--json"))["checkpoints"]] == [m2.id]

    r = run("-r", str(path), "gc", "--grace", "1h", "--json")  # the orphan packs are young
    assert r.exit_code == 0, r.output
    assert as_json(r)["deleted_packs"] == []
    assert as_json(r)["kept_young_packs"] == 2
    # beside saves (the default): condemned now, deleted by a gc twice a save's limit later
    r = run("-r", str(path), "gc", "--grace", "0s", "--json")
    assert r.exit_code == 0, r.output
    assert (len(as_json(r)["condemned_packs"]), as_json(r)["deleted_packs"]) == (2, [])
    assert as_json(run("-r", str(path), "stats", "--json"))["packs_count"] == 3
    r = run("-r", str(path), "gc", "--grace", "0s", "--json")
    assert (as_json(r)["condemned_packs"], as_json(r)["pending_packs"], as_json(r)["deleted_packs"]) == ([], 2, [])
    assert "2 condemned earlier and not yet due" in run("-r", str(path), "gc", "--grace", "0s").stdout
    r = run("-r", str(path), "gc", "--grace", "0s", "--now", "--dry-run", "--json")
    assert len(as_json(r)["deleted_packs"]) == 2
    assert as_json(r)["dry_run"] is True
    r = run("-r", str(path), "gc", "--grace", "0s", "--now", "--json")
    assert len(as_json(r)["deleted_packs"]) == 2
    stats = as_json(run("-r", str(path), "stats", "--json"))
    assert stats["packs_count"] == 1
    assert stats["manifests_count"] == 1
    assert run("-r", str(path), "verify").exit_code == 0

    r = run("-r", str(path), "stats")
    assert r.exit_code == 0
    assert re.search(r"packs\s+│\s+1\s+│", r.stdout)


@pytest.mark.parametrize("bad", ["5x", "1h30", "h", "-1h", ""])
def test_bad_duration_is_usage_error(repo_dir: tuple[Path, ckpt.Manifest], bad: str) -> None:
    path, _ = repo_dir
    r = run("-r", str(path), "gc", "--grace", bad)
    assert r.exit_code == 2
    assert f"invalid duration {bad!r}" in r.stderr


def test_forget_needs_a_policy(repo_dir: tuple[Path, ckpt.Manifest]) -> None:
    r = run("-r", str(repo_dir[0]), "forget")
    assert r.exit_code == 2
    assert "--keep-last" in r.stderr


def test_locked_is_exit_6(repo_dir: tuple[Path, ckpt.Manifest]) -> None:
    path, _ = repo_dir
    with Lock(ckpt.LocalStore(path), exclusive=False, operation="save w9"):
        assert run("-r", str(path), "gc", "--json").exit_code == 0  # runs beside saves
        r = run("-r", str(path), "gc", "--now", "--json")
    assert r.exit_code == 6, r.output
    assert as_json(r)["error"]["type"] == "RepositoryLocked"
    one_error_line(r)


def test_multi_line_error_is_one_line(repo_dir: tuple[Path, ckpt.Manifest], monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise ckpt.IncompatibleCheckpoint("warm restore refused", ["a: mismatch", "b: unknown"])

    monkeypatch.setattr(ckpt.Repository, "manifest", refuse)
    r = run("-r", str(repo_dir[0]), "inspect", "latest")
    assert r.exit_code == 5
    assert one_error_line(r) == "gpuckpt: error: warm restore refused; a: mismatch; b: unknown"


def test_env(here: HostFacts) -> None:
    from agent.engines import versions

    r = run("env", "--json")
    assert r.exit_code == 0, r.output
    doc = as_json(r)
    engines = {e["engine"]: e for e in doc.pop("engines")}
    assert HostFacts.model_validate(doc) == here
    # each engine installed here against the range a worker checks at start
    assert set(engines) == set(versions.SUPPORTED)
    for name, e in engines.items():
        assert e["supported"] == versions.SUPPORTED[name]
        assert e["version"] == versions.installed(name)
    r = run("env")
    assert r.exit_code == 0
    assert "cpu_arch" in r.stdout
    assert str(here.cpu_arch) in r.stdout
    assert versions.SUPPORTED["vllm"] in r.stdout


def test_init_and_key_generate(tmp_path: Path) -> None:
    repo = tmp_path / "plain"
    r = run("-r", str(repo), "init", "--json")
    assert r.exit_code == 0, r.output
    assert as_json(r)["encrypted"] is False
    assert as_json(run("-r", str(repo), "ls", "--json"))["checkpoints"] == []
    r = run("-r", str(repo), "init")
    assert r.exit_code == 1
    assert "already exists" in one_error_line(r)

    r = run("-r", str(tmp_path / "x"), "init", "--encrypt")
    assert r.exit_code == 2
    assert "--encrypt needs a key" in r.stderr

    keyfile = tmp_path / "key"
    r = run("key", "generate", str(keyfile), "--json")
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(keyfile.stat().st_mode) == 0o600
    secret = keyfile.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    key_id = as_json(r)["key_id"]
    assert key_id == ckpt.Keyring(bytes.fromhex(secret)).key_id

    r = run("key", "generate", str(keyfile))
    assert r.exit_code == 9
    assert "refusing to overwrite" in one_error_line(r)
    assert keyfile.read_text().strip() == secret

    enc = tmp_path / "enc"
    r = run("-r", str(enc), "init", "--encrypt", "--key", f"file:{keyfile}", "--json")
    assert r.exit_code == 0, r.output
    assert as_json(r)["encrypted"] is True
    assert as_json(r)["key_id"] == key_id
    assert secret not in r.output


def test_encrypted_repo_key_errors_are_exit_9(tmp_path: Path, here: HostFacts) -> None:
    keyfile, other = tmp_path / "key", tmp_path / "other"
    for f in (keyfile, other):
        assert run("key", "generate", str(f)).exit_code == 0
    path = tmp_path / "repo"
    with ckpt.Repository.open(str(path), key=f"file:{keyfile}", create=True) as repo:
        m = _save(repo, here)

    r = run("-r", str(path), "--key", f"file:{keyfile}", "ls", "--json")
    assert r.exit_code == 0, r.output
    assert as_json(r)["checkpoints"][0]["id"] == m.id

    r = run("-r", str(path), "ls")
    assert r.exit_code == 9
    assert "is encrypted" in one_error_line(r)

    r = run("-r", str(path), "inspect", "latest", "--key", f"file:{other}", "--json")
    assert r.exit_code == 9
    assert as_json(r)["error"]["type"] == "KeyMismatch"
    assert "not this repository's key" in one_error_line(r)

    secrets_ = [keyfile.read_text().strip(), other.read_text().strip()]
    r = run("-r", str(path), "--key", secrets_[1], "ls")  # key material where a source belongs
    assert r.exit_code == 9
    line = one_error_line(r)
    assert "file:/path" in line
    for s in secrets_:
        assert s not in r.output


def test_env_var_defaults(repo_dir: tuple[Path, ckpt.Manifest], monkeypatch: pytest.MonkeyPatch) -> None:
    path, m = repo_dir
    monkeypatch.setenv("GPUCKPT_REPO", str(path))
    assert as_json(run("ls", "--json"))["checkpoints"][0]["id"] == m.id
    monkeypatch.setenv("GPUCKPT_REPO", str(path.parent / "elsewhere"))
    assert run("ls").exit_code == 3
    assert run("ls", "-r", str(path)).exit_code == 0  # the command's own option wins


# -- as a real process ----------------------------------------------------------------------


def test_subprocess_json_and_exit_codes(repo_dir: tuple[Path, ckpt.Manifest]) -> None:
    path, m = repo_dir
    p = sub("ls", "--json", env={"GPUCKPT_REPO": str(path)})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["checkpoints"][0]["id"] == m.id

    p = sub("-r", str(path), "inspect", "nope", "--json")
    assert p.returncode == 3
    assert json.loads(p.stdout)["error"]["exit_code"] == 3
    assert p.stderr == f"gpuckpt: error: no checkpoint 'nope' in {path.as_uri()}\n"

    flip_blob_byte(path)
    p = sub("-r", str(path), "verify")
    assert p.returncode == 4
    assert "problem(s) found" in p.stdout

    p = sub("-r", str(path), "gc", "--grace", "soon")
    assert p.returncode == 2
    assert "invalid duration 'soon'" in p.stderr


def test_subprocess_encrypted_without_key(tmp_path: Path) -> None:
    keyfile = tmp_path / "key"
    assert sub("key", "generate", str(keyfile)).returncode == 0
    p = sub("-r", str(tmp_path / "repo"), "init", "--encrypt", "--key", f"file:{keyfile}")
    assert p.returncode == 0, p.stderr
    p = sub("-r", str(tmp_path / "repo"), "stats", "--json")
    assert p.returncode == 9
    assert json.loads(p.stdout)["error"]["type"] == "KeyMissing"
    assert p.stderr.count("\n") == 1
    assert "is encrypted" in p.stderr
    env = {"GPUCKPT_REPO": str(tmp_path / "repo"), "GPUCKPT_KEY": f"file:{keyfile}"}
    p = sub("stats", env=env)
    assert p.returncode == 0, p.stderr


def test_console_script() -> None:
    script = Path(sys.executable).with_name("gpuckpt")
    if not script.exists():
        pytest.skip("the gpuckpt console script is not installed in this environment")
    p = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=False)
    assert p.returncode == 0
    assert p.stdout == f"gpuckpt {ckpt.__version__}\n"
    p = subprocess.run([str(script), "no-such-command"], capture_output=True, text=True, check=False)
    assert p.returncode == 2
