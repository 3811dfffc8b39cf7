"""Worker and agent as two accounts (issue #11, item 3), end to end with real processes.

The vLLM worker runs as one uid and ``gpuckpt agent run`` as another; they
share a group for the connector socket and the staging directories, as the
systemd units set them up (``systemd/``). The agent holds the repository key
and the repository; the worker can read neither, yet a checkpoint taken with
requests in flight restores warm into a fresh worker (the agent reads the
worker's capture pages, the worker reads the agent's restore pages) and the
requests finish with the tokens an uninterrupted run produces.

Needs root (to become other accounts, with ``setpriv``). Where the Python
interpreter lives below a directory other accounts cannot enter (pyenv under
``/root``), each process runs in a private mount namespace (``unshare -m``)
that shows only the interpreter's directory there.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from agent import session
from agent.engines.base import token_digest
from agent.engines.vllm.serve import kv_transfer_config
from agent.testing import ServeProcess
from ckpt import Repository
from ckpt.keys import KeySource, generate_key
from tests.harness.cli import CLI, cli
from tests.harness.net import free_port
from tests.harness.paths import ROOT, short_dir
from tests.harness.vllm import ARGS, ENV, GREEDY
from tests.harness.waiting import concurrently, quiet, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="becoming two other accounts needs root"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"),
]
WORKER_UID, AGENT_UID, KV_GID = 61001, 61002, 61010  # no passwd entries needed
LONG = {**GREEDY, "max_tokens": 3000}


def reach_python(base: Path) -> str:
    """Shell lines that make the interpreter reachable for other accounts in this mount namespace,
    or "" when it already is."""
    real = Path(os.path.realpath(sys.base_prefix))
    for d in [*reversed(real.parents), real]:
        if not os.stat(d).st_mode & 0o001:
            hold = base / f"py-{uuid.uuid4().hex[:6]}"
            hold.mkdir()
            # a tmpfs over the closed directory, with only the interpreter's tree bound back into it
            return (
                f"mount --bind {real} {hold} && mount -t tmpfs -o mode=755 tmpfs {d} && "
                f"mkdir -p {real} && mount --bind {hold} {real} && "
            )
    return ""


def as_account(uid: int, gid: int, groups: list[int], base: Path) -> list[str]:
    setpriv = [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]
    mounts = reach_python(base)
    if not mounts:
        return setpriv
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", mounts + 'exec "$@"', "sh", *setpriv]


def owned_dir(p: Path, uid: int, gid: int, mode: int) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    os.chown(p, uid, gid)
    os.chmod(p, mode)
    return p


def closed_to_others(*paths: Path) -> Path | None:
    """The first directory on the way to ``paths`` that other accounts cannot enter (no o+x)."""
    for p in paths:
        real = Path(os.path.realpath(p))
        for d in [*reversed(real.parents), real]:
            if not os.stat(d).st_mode & 0o001:
                return d
    return None


@pytest.fixture(scope="module")
def two_accounts(tiny_llama: Path) -> Iterator[dict]:
    # the worker's account runs the test venv's Python and imports this checkout: both must be
    # reachable for it (the base interpreter is made so below, a venv or checkout in a home is not)
    closed = closed_to_others(Path(sys.prefix), ROOT)
    if closed is not None:
        pytest.skip(
            f"the worker's and the agent's accounts cannot enter {closed} (mode "
            f"{os.stat(closed).st_mode & 0o777:04o}), where the test venv or this checkout lives: "
            f"check out where other accounts can enter, or `chmod o+x {closed}`"
        )
    base = short_dir("gpps-")
    os.chmod(base, 0o755)  # noqa: S103 - both accounts must reach what is below it
    out: dict = {"base": base}
    model = base / "model"
    shutil.copytree(tiny_llama, model)
    subprocess.run(["chmod", "-R", "a+rX", str(model)], check=True)
    run = owned_dir(base / "run", WORKER_UID, KV_GID, 0o2770)  # the worker unit's RuntimeDirectory
    whome = owned_dir(base / "whome", WORKER_UID, KV_GID, 0o700)
    ahome = owned_dir(base / "ahome", AGENT_UID, AGENT_UID, 0o700)
    arun = owned_dir(base / "arun", AGENT_UID, AGENT_UID, 0o700)
    secrets = owned_dir(base / "secrets", AGENT_UID, AGENT_UID, 0o700)  # the agent's credentials
    key = secrets / "repo-key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(generate_key() + "\n")
    repo_path = base / "repo"
    Repository.open(str(repo_path), create=True, key=KeySource.parse(f"file:{key}"))  # as root, then handed over
    os.chown(key, AGENT_UID, AGENT_UID)
    subprocess.run(["chown", "-R", f"{AGENT_UID}:{AGENT_UID}", str(repo_path)], check=True)
    os.chmod(repo_path, 0o700)
    stage = Path(f"/dev/shm/gpuckpt-ps-{uuid.uuid4().hex[:8]}")  # made by the worker's connector
    out.update(key=key, repo=repo_path, stage=stage, run=run)

    def worker(name: str, pace: bool) -> ServeProcess:
        sock = str(run / f"{name}.sock")
        extra = {"shared_group": str(KV_GID), **({"step_delay_s": 0.02} if pace else {})}
        env = {**ENV, "HOME": str(whome), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        w = ServeProcess(
            str(model),
            sock,
            port=free_port(),
            log_path=str(base / f"{name}.log"),
            staging_dir=str(stage),
            args=[*ARGS, "--max-model-len", "4096"],
            env=env,
            inherit_env=False,  # nothing of the test's (root's) environment
            kv_config=kv_transfer_config(sock, str(stage), **extra),
            prefix=as_account(WORKER_UID, KV_GID, [], base),
        )
        try:
            w.wait_ready()
        except BaseException:
            w.kill()
            raise
        return w

    def agent(name: str, w: ServeProcess, restore: bool) -> tuple[subprocess.Popen[bytes], Path]:
        api = arun / f"{name}.sock"
        cfg = base / f"{name}.toml"
        cfg.write_text(
            f"""
worker_id = "w0"
repository = "{repo_path}"
key = "file:{key}"
connector_socket = "{w.control_socket}"
staging_dir = "{stage}"
shared_group = "{KV_GID}"
worker_url = "{w.url}"
log_format = "json"
[api]
socket = "{api}"
mode = "0600"
[checkpoint]
interval = "1h"
stop_deadline = "60s"
[restore]
on_start = {"true" if restore else "false"}
wait_for_worker = "2m"
[retention]
keep_last = 10
gc_interval = "1h"
"""
        )
        os.chmod(cfg, 0o644)
        log = base / f"{name}.log"
        env = {"HOME": str(ahome), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen(
            [
                *as_account(AGENT_UID, AGENT_UID, [KV_GID], base),
                *CLI,
                "agent",
                "run",
                "--config",
                str(cfg),
            ],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
        )

        def ready() -> bool:
            if p.poll() is not None:
                raise RuntimeError(f"agent exited {p.returncode}:\n{log.read_text()[-3000:]}")
            if not api.exists():
                return False
            r = cli("status", "--agent", str(api), "--json")
            return r.returncode == 0 and json.loads(r.stdout)["state"] == "ready"

        wait_for(ready, 120, f"agent {name} ready:\n{log}")
        return p, api

    try:
        # -- worker A and its agent: a checkpoint with requests in flight
        a = worker("a", pace=True)
        ag = None
        try:
            ag, api = agent("agent-a", a, restore=False)
            uids = {os.stat(f"/proc/{pid}").st_uid for pid in _group_pids(a.proc.pid)}
            out["worker_ids"] = sorted(uids | {os.stat(f"/proc/{ag.pid}").st_uid})
            prompts = {f"req{i}": [3 + (7 * i + j) % 500 for j in range(120 + 40 * i)] for i in range(2)}
            threads = [
                threading.Thread(
                    target=quiet, args=(lambda k=k: a.client.complete(prompts[k], LONG, request_id=k, stream=False),)
                )
                for k in prompts
            ]

            def start() -> None:
                for t in threads:
                    t.start()

            session.wait_around(a.control_socket, start, live=2, min_outputs=30)
            out["stage_stat"] = os.stat(stage)
            out["socket_stat"] = os.stat(a.control_socket)
            r = cli("checkpoint", "--agent", str(api), "--wait", "--json")
            out["checkpoint"] = r
            out["stage_after"] = sorted(p.name for p in stage.iterdir() if p.name.startswith("capture-"))
            # what the worker's account can reach of the agent's
            probe = as_account(WORKER_UID, KV_GID, [], base)
            out["worker_reads_key"] = subprocess.run([*probe, "cat", str(key)], capture_output=True, text=True)
            out["worker_lists_repo"] = subprocess.run([*probe, "ls", str(repo_path)], capture_output=True, text=True)
            out["worker_environ"] = Path(f"/proc/{a.proc.pid}/environ").read_bytes().split(b"\0")
            out["prompts"] = prompts
        finally:
            if ag is not None and ag.poll() is None:
                ag.send_signal(signal.SIGTERM)
                ag.wait(90)
            a.kill()
        # -- worker B and a fresh agent: restore at start, as the two accounts
        b = worker("b", pace=False)
        ag = None
        try:
            ag, api = agent("agent-b", b, restore=True)

            def restored():  # type: ignore[no-untyped-def]
                st = json.loads(cli("status", "--agent", str(api), "--json").stdout)
                state = (st.get("restore") or {}).get("resubmission", {}).get("state")
                return st if state in ("done", "failed") else None

            wait_for(restored, 180, "the restored requests to finish")
            from agent.daemon.api import AgentClient

            with AgentClient(api) as c:
                out["restore"] = c.request("GET", "/restore")
            # together: the engine decodes them in one step each, as it did the restored continuations
            refs = concurrently(
                {
                    k: partial(b.client.complete, p, LONG, request_id=f"ref-{k}", stream=False)
                    for k, p in prompts.items()
                }
            )
            out["reference"] = {k: c.token_ids for k, c in refs.items()}
        finally:
            if ag is not None and ag.poll() is None:
                ag.send_signal(signal.SIGTERM)
                ag.wait(90)
            b.kill()
        yield out
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if not os.environ.get("GPUCKPT_TEST_KEEP"):  # logs, for a failure
            shutil.rmtree(base, ignore_errors=True)


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    pids.append(int(d.name))
            except ProcessLookupError:
                continue
    return pids


def test_worker_and_agent_run_as_two_accounts(two_accounts: dict) -> None:
    assert two_accounts["worker_ids"] == [WORKER_UID, AGENT_UID]


def test_the_worker_account_cannot_read_the_key_or_the_repository(two_accounts: dict) -> None:
    r = two_accounts["worker_reads_key"]
    assert r.returncode != 0, r.stdout[:20]
    assert "Permission denied" in r.stderr
    r = two_accounts["worker_lists_repo"]
    assert r.returncode != 0
    assert "Permission denied" in r.stderr
    env = two_accounts["worker_environ"]
    assert not [v for v in env if v.startswith((b"GPUCKPT_", b"AWS_"))], "secrets in the worker's environment"


def test_socket_and_staging_are_shared_through_the_group_only(two_accounts: dict) -> None:
    st = two_accounts["stage_stat"]
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (WORKER_UID, KV_GID, 0o2770)
    st = two_accounts["socket_stat"]
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (WORKER_UID, KV_GID, 0o660)


def test_the_agent_checkpoints_the_other_accounts_worker(two_accounts: dict) -> None:
    r = two_accounts["checkpoint"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["state"] == "done"
    assert two_accounts["stage_after"] == [], "the agent deletes the worker's capture pages once read"


def test_the_restore_is_warm_and_token_exact_across_the_accounts(two_accounts: dict) -> None:
    rep = two_accounts["restore"]
    assert rep["outcome"] == "warm", rep
    results = rep["results"]
    for k, ref in two_accounts["reference"].items():
        r = results[f"cmpl-{k}-0"]
        assert (r["output_tokens"], r["output_digest"]) == (len(ref), token_digest(ref)), f"{k} diverged"
        assert r["cached_tokens"] == r["prompt_tokens"] - 1, r
