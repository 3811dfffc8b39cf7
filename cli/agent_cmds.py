"""``gpuckpt agent run``, ``agent ready``, ``checkpoint``, ``status``, ``restore`` and ``launch``.

``agent ready``, ``checkpoint`` and ``status`` ask a running agent over its control socket
(``--agent``, default ``$GPUCKPT_AGENT_SOCKET``); ``restore`` works without an
agent, straight against a worker's connector socket; ``launch`` starts a
``vllm serve`` worker with the connector configured and an agent beside it.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

import ckpt
from agent import engines, fs
from agent.daemon import config as config_mod
from agent.daemon import watchdog
from ckpt.logfmt import JsonFormatter, TextFormatter
from cli import exitcodes
from cli._common import console, kv_table, open_repo, repo_url, safe, settings, show
from cli.options import JsonOpt, duration

AGENT_ENV = "GPUCKPT_AGENT_SOCKET"

agent_app = typer.Typer(help="The agent daemon beside a serving worker.", no_args_is_help=True)

AgentOpt = Annotated[
    str | None,
    typer.Option(
        "--agent",
        metavar="SOCKET",
        envvar=AGENT_ENV,
        show_default=False,
        help=f"The agent's control socket (default ${AGENT_ENV}).",
    ),
]


def _client(sock: str | None) -> Any:
    from agent.daemon.client import AgentClient  # late: httpx and asyncio cost ~25 ms of start-up every verb would pay

    if not sock:
        raise ckpt.ConfigError(f"no agent socket: pass --agent SOCKET or set ${AGENT_ENV}")
    return AgentClient(sock)


def _call(client: Any, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    from agent.daemon.client import AgentApiError  # late: as in _client

    try:
        return client.request(method, path, body)
    except ConnectionError as exc:
        raise ckpt.ServiceUnavailable(str(exc)) from None
    except AgentApiError as exc:
        raise ckpt.GpuckptError(str(exc)) from None


def default_runtime_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/run/gpuckpt")
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/gpuckpt-{os.getuid()}"  # noqa: S108 - private 0700 dir
    return Path(base) / "gpuckpt"


# -- agent run ---------------------------------------------------------------------------


@agent_app.command("run")
def agent_run(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", metavar="FILE.toml", help="Agent configuration (GPUCKPT_AGENT__* overrides)."),
    ] = None,
) -> None:
    """Run the agent in the foreground (systemd: Type=notify); logs JSON lines on stdout."""
    from agent.daemon import agent as agent_mod  # late: the daemon (metrics, notice sources, API) only runs here

    cfg = config_mod.load(config)
    _setup_daemon_logging(cfg.log_format)
    raise typer.Exit(agent_mod.Agent(cfg).run())


@agent_app.command("ready")
def agent_ready(agent: AgentOpt = None, json_: JsonOpt = False) -> None:
    """Exit 0 once the agent's restore at start has finished and the worker answers (a readiness probe).

    Otherwise exit 7, naming what is awaited (the agent's start, the restore
    at start, the worker's API); an agent that does not answer is exit 7 too.
    """
    with _client(agent) as c:
        r = _call(c, "GET", "/ready")
    if json_:
        typer.echo(json.dumps(r))
    elif r["ready"]:
        outcome = (r.get("restore") or {}).get("outcome") or "none"
        typer.echo(safe(f"ready (restore at start: {outcome})"))
    if not r["ready"]:
        if not json_:
            typer.echo(safe("not ready: awaiting " + "; ".join(r["awaiting"])), err=True)
        raise typer.Exit(exitcodes.UNAVAILABLE)


def _setup_daemon_logging(fmt: str) -> None:
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(logging.INFO)


# -- checkpoint / status -------------------------------------------------------------------


def checkpoint_cmd(
    agent: AgentOpt = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait for it, showing progress; exit non-zero if it fails.")
    ] = False,
    drain: Annotated[
        bool, typer.Option("--drain", help="Trigger as a planned drain (recorded in the labels).")
    ] = False,
    timeout: Annotated[
        timedelta | None,
        typer.Option(
            "--timeout",
            parser=duration,
            metavar="DURATION",
            show_default=False,
            help="With --wait: stop waiting after this long and exit 1 (the agent goes on with the checkpoint).",
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Ask the agent for a checkpoint now (joins one that has not captured yet)."""
    if timeout is not None and not wait:
        raise typer.BadParameter("--timeout bounds --wait; pass both", param_hint="--timeout")
    with _client(agent) as c:
        t = _call(c, "POST", "/checkpoint", {"trigger": "drain" if drain else "request"})
        if wait:
            end = None if timeout is None else time.monotonic() + timeout.total_seconds()
            t = _wait_ticket(c, t, show=not json_, end=end)
    if t["state"] not in ("done", "failed") and wait:
        raise ckpt.GpuckptError(
            f"checkpoint ticket {t['id']} not done within {timeout.total_seconds() if timeout else 0:g} s "
            f"(state {t['state']}); the agent goes on with it"
        )
    if t["state"] == "failed":  # one line (or, with --json, one JSON error document) from the handler
        raise ckpt.GpuckptError(f"checkpoint failed (ticket {t['id']}): {t['error']}")
    if json_:
        typer.echo(json.dumps(t))
    elif t["state"] == "done":
        typer.echo(safe(f"checkpoint {t['checkpoint']} saved (ticket {t['id']}, triggers {', '.join(t['triggers'])})"))
    else:
        typer.echo(safe(f"checkpoint ticket {t['id']} {t['state']}; `gpuckpt status` shows its progress"))


def _wait_ticket(c: Any, t: dict[str, Any], *, show: bool, end: float | None = None) -> dict[str, Any]:
    """Poll ticket ``t`` until it is done or failed, or (``end``, a monotonic time) until then."""
    from rich.progress import Progress, TextColumn  # late: ~15 ms of start-up, for --wait only

    with Progress(
        TextColumn("{task.description}"), console=console(stderr=True), transient=True, disable=not show
    ) as bar:
        task = bar.add_task("checkpoint: pending")
        while t["state"] not in ("done", "failed"):
            if end is not None and time.monotonic() >= end:
                break
            time.sleep(0.25 if end is None else max(0.0, min(0.25, end - time.monotonic())))
            t = _call(c, "GET", f"/checkpoint/{t['id']}")
            p = t.get("progress") or {}
            desc = f"checkpoint: {p.get('phase', t['state'])}"
            if p.get("total_blocks"):
                desc += (
                    f" {p.get('blocks', 0)}/{p['total_blocks']} blocks, {p.get('uploaded_bytes', 0) / 2**20:.1f} MiB up"
                )
            bar.update(task, description=desc)
    return t


def status_cmd(
    agent: AgentOpt = None,
    json_: JsonOpt = False,
) -> None:
    """What the agent is doing: worker, last checkpoint, running operation, last restore."""
    with _client(agent) as c:
        st = _call(c, "GET", "/status")
    if json_:
        typer.echo(json.dumps(st))
        return
    lc, op, rr, err = st.get("last_checkpoint"), st.get("operation"), st.get("restore"), st.get("last_error")
    rows: list[tuple[str, object]] = [
        ("worker", f"{st['worker_id']} ({'attached' if st['worker']['attached'] else 'not attached'})"),
        ("state", st["state"]),
        ("repository", st["repository"]),
        (
            "last checkpoint",
            f"{lc['id']} at {lc['at']}, {lc['duration_s']} s, pause {lc['pause_ms']} ms" if lc else "none",
        ),
        ("running", f"ticket {op['id']} {op['state']} {op.get('progress') or ''}" if op else "nothing"),
        (
            "last restore",
            f"{rr['outcome']} {rr.get('checkpoint') or ''} {'; '.join(rr.get('reasons') or [])}" if rr else "-",
        ),
        ("last error", f"{err['operation']}: {err['error']} at {err['at']}" if err else "none"),
    ]
    for rid, why in ((rr or {}).get("inexact") or {}).items():
        rows.append((f"  {rid}", "replayed cold because " + "; ".join(why)))
    for rid, why in ((rr or {}).get("left_to_client") or {}).items():
        rows.append((f"  {rid}", f"not resubmitted: {why} (its client's retry computes it)"))
    console().print(kv_table(f"agent {st['worker_id']} (pid {st['pid']})", rows))


# -- restore ------------------------------------------------------------------------------------


def restore_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(metavar="CKPT", help="Checkpoint id, WORKER:latest or latest.")],
    connector: Annotated[
        str, typer.Option("--connector-socket", metavar="SOCKET", help="The new worker's connector control socket.")
    ],
    worker_url: Annotated[
        str | None,
        typer.Option("--worker-url", metavar="URL", help="The worker's API: canary probe and resubmission."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan and the compatibility table; change nothing.")
    ] = False,
    ignore: Annotated[list[str] | None, typer.Option("--ignore", metavar="RULE", help="Disregard this rule.")] = None,
    unchecked: Annotated[
        bool,
        typer.Option("--unchecked", help="Allow a warm restore without the canary probe (no --worker-url)."),
    ] = False,
    repo: Annotated[str | None, typer.Option("--repo", "-r", metavar="URL", show_default=False)] = None,
    key: Annotated[str | None, typer.Option("--key", metavar="SOURCE", show_default=False)] = None,
    engine_name: Annotated[
        str | None,
        typer.Option("--engine", metavar="ENGINE", help="vllm or sglang (default: what the worker says it runs)."),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Restore CKPT into a fresh worker: warm if every pin matches, else cold with ledger replay.

    A warm restore needs the canary probe to match on the worker's API
    (--worker-url); without it the restore is cold unless --unchecked.
    --dry-run exits 5 when a warm restore would be refused.
    """
    from agent import session  # late: the restore's machinery (page files, streams) runs only here

    policy = ckpt.Policy.from_strings(ignore=ignore or [])
    with open_repo(ctx, repo, key) as r:
        m = r.manifest(ref)
        try:
            engine = engines.attach(connector, engine_name)
            decision = session.plan(engine, m, policy)
        except ckpt.EngineError:
            raise
        except OSError as exc:
            raise ckpt.WorkerUnreachable(f"no worker answering on {connector}: {exc}") from None
        if dry_run:
            held = _quarantined(connector, m)
            if json_:
                typer.echo(json.dumps({**decision.to_json(), **held}, default=str))
            else:
                table = Table(title=f"restore plan for {m.id}", title_justify="left")
                for col in ("rule", "verdict", "checkpoint", "here"):
                    table.add_column(col, overflow="fold")
                for x in decision.results:
                    table.add_row(x.rule, str(x.verdict), show(x.recorded), show(x.current))
                console().print(table)
                verdict = "warm: load the checkpoint's blocks" if decision.warm else "cold: replay the ledger"
                typer.echo(safe(f"plan: {verdict}; {decision.requests} requests in flight, {decision.blocks} blocks"))
                for line in decision.reasons:
                    typer.echo(safe(f"  {line}"))
                for rid, causes in decision.inexact.items():
                    typer.echo(safe(f"  {rid}: not an exact continuation: {'; '.join(causes)}"))
                for rid, why in held.get("quarantined", {}).items():
                    typer.echo(safe(f"  {rid}: not resubmitted: {why}"))
                if held.get("quarantine_refused"):
                    typer.echo(safe(f"  {held['quarantine_refused']}"))
            if not decision.warm:
                raise typer.Exit(exitcodes.INCOMPATIBLE)
            return
        client = engine.client(worker_url) if worker_url else None
        try:
            plan = session.restore(
                r,
                m.id,
                engine,
                policy=policy,
                generate=client.generate if client else None,
                require_canary=not unchecked,
            )
            resubmitted = None
            if client is not None and plan.requests:
                try:
                    # with the worker: a carried state it never applied, or failed to, is said too
                    resubmitted = session.resubmit(client, plan.requests, worker=engine)
                except (ckpt.GpuckptError, OSError) as exc:  # the client's refusal (ServeError) or no answer
                    raise ckpt.WorkerUnreachable(f"resubmitting to {worker_url}: {exc}") from None
            # the rest streams in behind the resubmitted requests; this process must not end before it
            plan.wait_offered()
        finally:
            if client is not None:
                client.close()
    result = session.Restored(m.id, plan, resubmitted)
    report = result.to_json()
    outputs = result.outputs()
    if json_:
        typer.echo(json.dumps(report, default=str))
        return
    typer.echo(safe(f"restore of {m.id}: {'warm' if plan.warm else 'cold (ledger replay)'}"))
    for line in plan.reasons:
        typer.echo(safe(f"  {line}"))
    left = plan.left_to_client()
    if outputs:
        for rid, o in outputs.items():
            if rid in left:
                continue
            typer.echo(
                safe(f"  {rid}: {len(o['new_token_ids'])} new tokens, {o['cached_tokens']} prompt tokens from cache")
            )
    elif plan.to_resubmit():
        typer.echo(f"  {len(plan.to_resubmit())} requests to resubmit (pass --worker-url to resubmit them)")
    for rid, whys in result.inexact().items():
        typer.echo(safe(f"  {rid}: not an exact continuation: {'; '.join(whys)}"))
    for rid, why in left.items():
        typer.echo(safe(f"  {rid}: not resubmitted: {why} (its client's retry computes it)"))


# -- launch ----------------------------------------------------------------------------------


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


#: variables only the agent needs: the bucket's credentials (the AWS chain) and the agent's own settings
AGENT_ONLY_PREFIXES = ("AWS_", "GPUCKPT_")


def worker_environment(environ: Mapping[str, str], key_source: str | None) -> dict[str, str]:
    """The environment ``launch`` gives the worker: its own, less the agent's secrets — the
    ``AWS_*`` credentials, every ``GPUCKPT_*`` setting and the variable an ``env:NAME`` key
    source names. A network-facing worker that is compromised then holds neither the key nor
    the bucket (what else it needs — ``HF_TOKEN``, ``CUDA_*``, ``VLLM_*`` — it keeps)."""
    drop = {key_source[len("env:") :]} if key_source and key_source.startswith("env:") else set()
    return {k: v for k, v in environ.items() if not k.startswith(AGENT_ONLY_PREFIXES) and k not in drop}


#: how long a launched worker holds possible retries for its agent's restore at most
RETRY_HOLD_S = 60.0


def _has_checkpoint(ctx: typer.Context, repo: str | None, key: str | None, worker_id: str, base: Any) -> bool:
    """Whether the agent will have something to restore (then the worker's server holds retries)."""
    if base is not None and not base.restore.on_start:
        return False
    try:
        with open_repo(ctx, repo, key) as r:
            r.resolve(f"{worker_id}:latest")
        return True
    except (ckpt.GpuckptError, OSError):
        return False


def _quarantined(connector: str, m: ckpt.Manifest) -> dict[str, Any]:
    """What the crash-loop record beside the worker (``launch``'s runtime directory: the connector
    socket's) makes a restore of ``m`` leave out (:mod:`agent.daemon.quarantine`)."""
    # late, like the restore's machinery: only --dry-run reads the record
    from agent.daemon import quarantine
    from agent.engines import ledgers

    ids = [r.request_id for r in ledgers.format_of(m.ledger).resubmissions(m.ledger)] if m.ledger else []
    path = quarantine.path_for(Path(connector).parent, m.worker_id)
    v = quarantine.verdict(path, worker_id=m.worker_id, checkpoint=m.id, ledger_ids=ids)
    out: dict[str, Any] = {}
    if v.quarantined:
        out["quarantined"] = v.quarantined
    if v.refused:
        out["quarantine_refused"] = v.refused
    return out


def launch_cmd(
    ctx: typer.Context,
    command: Annotated[
        list[str],
        typer.Argument(
            metavar="-- WORKER_COMMAND...",
            help="The worker command: vllm serve MODEL [ARGS]... or python -m sglang.launch_server [ARGS]...",
        ),
    ],
    worker_id: Annotated[str, typer.Option("--worker-id", help="This worker's id in the repository.")] = "worker0",
    config: Annotated[
        Path | None, typer.Option("--config", "-c", metavar="FILE.toml", help="Agent configuration.")
    ] = None,
    runtime_dir: Annotated[
        Path | None,
        typer.Option("--runtime-dir", help="Sockets and staging (default /run/gpuckpt or $XDG_RUNTIME_DIR)."),
    ] = None,
    repo: Annotated[str | None, typer.Option("--repo", "-r", metavar="URL", show_default=False)] = None,
    key: Annotated[str | None, typer.Option("--key", metavar="SOURCE", show_default=False)] = None,
) -> None:
    """Start a vLLM or SGLang worker with gpuckpt's adapter and an agent beside it.

    The agent restores the worker's newest checkpoint at start and takes a final one on stop.
    """
    from agent.daemon import agent as agent_mod  # late: as in agent_run

    if not command:
        raise typer.BadParameter("give the worker command after --, e.g. -- vllm serve MODEL")
    rdir = runtime_dir or default_runtime_dir()
    # sockets and staging go here: /tmp/gpuckpt-$UID (without XDG_RUNTIME_DIR) may have been made by
    # someone else first, and is then refused, named — never adopted
    fs.ensure_socket_dir(rdir)
    connector = rdir / f"{worker_id}-connector.sock"
    try:
        engine = engines.for_command(command)
    except ckpt.ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    base = config_mod.load(config) if config else None
    # a restore follows this start: the worker's server holds possible retries until the agent says
    # what it resubmits (vLLM; see agent.engines.vllm.middleware)
    hold = RETRY_HOLD_S if _has_checkpoint(ctx, repo, key, worker_id, base) else 0.0
    try:
        argv = engine.worker_command(
            command,
            control_socket=str(connector),
            staging_dir=str(rdir / f"{worker_id}-staging"),
            shared_group=base.shared_group if base else None,
            hold_retries_s=hold,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    port = _flag_value(argv, "--port") or str(engine.default_port)
    host = _flag_value(argv, "--host") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host  # noqa: S104 - we connect, not bind
    overrides: dict[str, Any] = {
        "worker_id": worker_id,
        "repository": repo_url(ctx, repo),
        "key": key or settings(ctx).key,
        "engine": engine.name,
        "connector_socket": str(connector),
        "worker_url": f"http://{host}:{port}",
    }
    api_socket = str(base.api.socket) if base else str(rdir / f"{worker_id}.sock")
    cfg = config_mod.load(config, **overrides, api={"socket": api_socket} if base is None else None)
    _setup_daemon_logging("text")
    typer.echo(f"gpuckpt: starting worker: {shlex.join(argv)}", err=True)
    typer.echo(f"gpuckpt: agent socket {cfg.api.socket} (export {AGENT_ENV}={cfg.api.socket})", err=True)
    # the worker gets the environment without what only the agent needs (the key, the bucket's credentials)
    worker = subprocess.Popen(
        argv,
        start_new_session=True,
        env=worker_environment(os.environ, cfg.key),
        preexec_fn=watchdog.die_with(os.getpid()),
    )
    # the second line: whatever kills launch, the worker's group is gone within GRACE_S of it
    guard = watchdog.start(worker.pid)
    agent = agent_mod.Agent(cfg)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    code = 0
    try:
        agent.start()
        while not stop.wait(0.5):
            if worker.poll() is not None:
                typer.echo(f"gpuckpt: the worker exited with {worker.returncode}", err=True)
                code = worker.returncode or 1
                # soon after a restore: what it was running is quarantined for the next restore
                if quarantined := agent.worker_died():
                    typer.echo(f"gpuckpt: quarantined for the next restore: {', '.join(quarantined)}", err=True)
                break
        agent.shutdown(final=cfg.checkpoint.on_stop and worker.poll() is None)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
        if guard is not None:
            guard.terminate()
            guard.wait()
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.add_typer(agent_app, name="agent")
    app.command("checkpoint")(checkpoint_cmd)
    app.command("status")(status_cmd)
    app.command("restore")(restore_cmd)
    app.command("launch", context_settings={"allow_interspersed_args": False})(launch_cmd)
