"""The maintenance verbs: checks (``verify``, ``compat``), reclaiming space (``gc``,
``unlock``) and removing checkpoints (``forget``, ``rm``), and ``stats``.

Commands::

    gpuckpt verify [CKPT] [--no-read-data]         check stored data (exit 4 on problems)
    gpuckpt compat CKPT [--worker-facts F.json]    may CKPT be restored warm here? (exit 5 if not)
    gpuckpt gc [--grace 1h] [--dry-run] [--now]    delete unreferenced data
    gpuckpt unlock [--remove-all]                  list locks, remove the stale ones
    gpuckpt forget [--keep-last N] [--keep-within 7d] [--worker W] [--dry-run]
    gpuckpt rm CKPT                                remove one checkpoint
    gpuckpt stats                                  object counts and bytes

:func:`register` adds them to the root app (see :mod:`cli.app`).
"""

import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.table import Table

import ckpt
from ckpt.compat import Policy, Verdict, decide, rule_json
from ckpt.lock import list_locks, remove_stale_locks
from cli import exitcodes
from cli._common import console, created, emit_json, one_line, open_repo, progress, safe, show, size
from cli.options import JsonOpt, KeyOpt, RepoOpt, duration

# -- checks: verify and compat ------------------------------------------------------------


def verify_cmd(
    ctx: typer.Context,
    ref: Annotated[
        str | None,
        typer.Argument(metavar="[CKPT]", help="One checkpoint; default the whole repository.", show_default=False),
    ] = None,
    no_read_data: Annotated[
        bool,
        typer.Option("--no-read-data", help="Only check that referenced data exists; read none."),
    ] = False,
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Check stored data against its checksums. Exit 4 if any problem is found."""
    show_bar = not json_ and sys.stderr.isatty()
    with open_repo(ctx, repo, key) as r, progress(show_bar, "verifying") as on_progress:
        report = r.verify(ref, read_data=not no_read_data, progress=on_progress)
    if json_:
        emit_json({"ok": report.ok, **asdict(report)})
    else:
        what = (
            f"{report.checked_checkpoints} checkpoint(s), {report.checked_packs} pack(s), "
            f"{report.checked_blobs} blob(s)"
        )
        if report.ok:
            typer.echo(f"checked {what}: no problems found")
        else:
            table = Table(title=f"{len(report.problems)} problem(s)", title_justify="left")
            table.add_column("object", no_wrap=True)
            table.add_column("blob")
            table.add_column("problem", overflow="fold")
            for p in report.problems:
                table.add_row(safe(p.obj), safe(p.blob or "-"), safe(p.message))
            console().print(table)
            typer.echo(f"checked {what}: {len(report.problems)} problem(s) found")
    if not report.ok:
        raise typer.Exit(exitcodes.INTEGRITY)


def _read_worker_facts(path: Path) -> ckpt.WorkerFacts:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ckpt.ConfigError(f"cannot read worker facts {path}: {exc.strerror}") from None
    try:
        return ckpt.WorkerFacts.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise ckpt.ConfigError(
            f"worker facts {path}: not a JSON object of WorkerFacts fields (first problem at {loc}: {first['msg']})"
        ) from None


def compat_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(metavar="CKPT", help="The checkpoint to check.")],
    worker_facts: Annotated[
        Path | None,
        typer.Option(
            "--worker-facts",
            metavar="FILE.json",
            show_default=False,
            help="The restoring worker's facts (a JSON object of WorkerFacts fields). "
            "Without it only the host is checked: the worker rules are ignored.",
        ),
    ] = None,
    ignore: Annotated[
        list[str] | None,
        typer.Option("--ignore", metavar="RULE", help="Disregard this rule (repeatable, or a,b).", show_default=False),
    ] = None,
    allow_unknown: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-unknown",
            metavar="RULE",
            show_default=False,
            help="Accept an unknown verdict for this rule; a mismatch still refuses.",
        ),
    ] = None,
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """May CKPT be restored warm on this host? Exit 5 if not."""
    ignored = list(ignore or [])
    if worker_facts is None:
        ignored += list(ckpt.WorkerFacts.model_fields)
    try:
        policy = Policy.from_strings(ignore=ignored, allow_unknown=allow_unknown or [])
    except ckpt.ConfigError as exc:
        raise typer.BadParameter(str(exc), ctx=ctx, param_hint="'--ignore' / '--allow-unknown'") from None
    worker = _read_worker_facts(worker_facts) if worker_facts is not None else None
    with open_repo(ctx, repo, key) as r:
        m = r.manifest(ref)
    current = ckpt.Pins(host=ckpt.host_facts(), worker=worker or m.pins.worker)
    decision = decide(m.pins, current, policy)
    if json_:
        emit_json(
            {
                "checkpoint": m.id,
                "warm": decision.warm,
                "worker_checked": worker is not None,
                "reasons": decision.reasons,
                "results": [rule_json(res, policy) for res in decision.results],
            }
        )
    else:
        table = Table(title=safe(f"compatibility of {m.id}"), title_justify="left")
        for col in ("rule", "verdict", "checkpoint", "here"):
            table.add_column(col, overflow="fold")
        for res in decision.results:
            verdict = str(res.verdict)
            if res.rule in policy.ignore:
                verdict += " (ignored)"
            elif res.verdict is Verdict.UNKNOWN and res.rule in policy.allow_unknown:
                verdict += " (allowed)"
            table.add_row(safe(res.rule), verdict, show(res.recorded), show(res.current))
        console().print(table)
        if worker is None:
            typer.echo("worker facts not given (--worker-facts): only the host was checked")
        if decision.warm:
            typer.echo("decision: warm restore allowed")
        else:
            typer.echo("decision: warm restore refused (cold start with ledger replay):")
            for reason in decision.reasons:
                typer.echo(f"  {safe(reason)}")
    if not decision.warm:
        raise typer.Exit(exitcodes.INCOMPATIBLE)


# -- space and removal: gc, unlock, forget, rm, stats --------------------------------------------


def gc_cmd(
    ctx: typer.Context,
    grace: Annotated[
        timedelta,
        typer.Option(
            "--grace",
            parser=duration,
            metavar="DURATION",
            show_default="1h",
            help="Keep unreferenced packs younger than this (a save may still be using them).",
        ),
    ] = timedelta(hours=1),
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report; delete nothing.")] = False,
    repack_below: Annotated[
        float,
        typer.Option(
            "--repack-below",
            min=0.0,
            max=1.0,
            metavar="FRACTION",
            help="Repack packs whose live blobs fill less than this fraction of them (0: never).",
        ),
    ] = 0.5,
    now: Annotated[
        bool,
        typer.Option(
            "--now",
            help="Wait for running saves, keep new ones out, and delete at once "
            "(default: run beside saves; what is condemned now is deleted by a gc an hour or more later).",
        ),
    ] = False,
    lock_wait: Annotated[
        timedelta,
        typer.Option(
            "--lock-wait",
            parser=duration,
            metavar="DURATION",
            show_default="0s",
            help="With --now: wait this long for running saves.",
        ),
    ] = timedelta(0),
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Delete data no checkpoint references, repacking sparse packs.

    By default gc never holds up a save: it condemns what is garbage now and
    deletes what an earlier gc condemned long enough ago (twice the longest a
    save may run), unless a checkpoint committed since needs it."""
    with open_repo(ctx, repo, key) as r:
        report = r.gc(
            grace=grace, dry_run=dry_run, repack_below=repack_below, now=now, lock_wait=lock_wait.total_seconds()
        )
    if json_:
        emit_json(asdict(report))
        return
    verb = "would delete" if dry_run else "deleted"
    typer.echo(
        f"{verb} {len(report.deleted_packs)} pack(s) ({size(report.deleted_bytes)}); "
        f"{'would repack' if dry_run else 'repacked'} {len(report.repacked_packs)} sparse pack(s); "
        f"{size(report.reclaimed_bytes)} reclaimed in all; "
        f"{report.live_blobs} live blob(s); kept {report.kept_young_packs} young unreferenced "
        f"pack(s); {'would rewrite' if dry_run else 'rewrote'} {report.rewritten_indexes} index "
        f"document(s); removed {report.removed_locks} stale lock(s), "
        f"{report.removed_debris} temporary file(s)"
    )
    if not report.exclusive:
        typer.echo(
            f"{'would condemn' if dry_run else 'condemned'} {len(report.condemned_packs)} pack(s) "
            f"(deleted by a later gc); {report.pending_packs} condemned earlier and not yet due; "
            f"{len(report.rescued_packs)} rescued (a checkpoint committed since needs them)"
        )
    for line in report.unreadable:
        typer.echo(f"  skipped (unreadable, left in place): {safe(one_line(line))}")


def unlock_cmd(
    ctx: typer.Context,
    remove_all: Annotated[
        bool,
        typer.Option("--remove-all", help="Remove every lock, live ones too (only when no gpuckpt runs on it)."),
    ] = False,
    stale_after: Annotated[
        timedelta,
        typer.Option(
            "--stale-after",
            parser=duration,
            metavar="DURATION",
            show_default="30m",
            help="A lock not refreshed for this long (by the store's clock) is stale.",
        ),
    ] = timedelta(minutes=30),
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """List the repository's locks and remove the stale ones (a dead holder on this host is stale at once)."""
    with open_repo(ctx, repo, key) as r:
        removed = remove_stale_locks(r.store, stale_after.total_seconds(), everything=remove_all)
        left = list_locks(r.store)

    def row(lk: Any) -> dict[str, Any]:
        return {
            "name": lk.name,
            "exclusive": lk.exclusive,
            "operation": lk.operation,
            "hostname": lk.hostname,
            "pid": lk.pid,
            "problem": lk.problem,
        }

    if json_:
        emit_json({"removed": [row(x) for x in removed], "live": [row(x) for x in left]})
        return
    for x in removed:
        typer.echo(f"removed {safe(x.describe())}")
    for x in left:
        typer.echo(f"kept (live) {safe(x.describe())}")
    if not removed and not left:
        typer.echo("no locks")


def forget_cmd(
    ctx: typer.Context,
    keep_last: Annotated[
        int | None,
        typer.Option(
            "--keep-last", min=1, metavar="N", show_default=False, help="Keep each worker's N newest checkpoints."
        ),
    ] = None,
    keep_within: Annotated[
        timedelta | None,
        typer.Option(
            "--keep-within",
            parser=duration,
            metavar="DURATION",
            show_default=False,
            help="Keep checkpoints younger than this, e.g. 7d.",
        ),
    ] = None,
    worker: Annotated[str | None, typer.Option("--worker", "-w", help="Only this worker's checkpoints.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report; remove nothing.")] = False,
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Remove checkpoints by retention policy (each worker's newest is always kept).

    Removes manifests only; the next ``gc`` reclaims their data.
    """
    if keep_last is None and keep_within is None:
        raise typer.BadParameter(
            "give --keep-last N and/or --keep-within DURATION",
            ctx=ctx,
            param_hint="'--keep-last' / '--keep-within'",
        )
    with open_repo(ctx, repo, key) as r:
        removed = r.forget(keep_last=keep_last, keep_within=keep_within, worker_id=worker, dry_run=dry_run)
    removed = sorted(removed, key=lambda c: (c.id, c.worker_id))
    if json_:
        emit_json(
            {
                "dry_run": dry_run,
                "removed": [{"id": c.id, "worker": c.worker_id, "created": c.created.isoformat()} for c in removed],
            }
        )
        return
    if removed:
        table = Table(title="would remove" if dry_run else "removed", title_justify="left")
        for col in ("id", "worker", "created"):
            table.add_column(col, no_wrap=True)
        for c in removed:
            table.add_row(safe(c.id), safe(c.worker_id), created(c))
        console().print(table)
    verb = "would remove" if dry_run else "removed"
    tail = "" if dry_run or not removed else "; run 'gpuckpt gc' to reclaim their data"
    typer.echo(f"{verb} {len(removed)} checkpoint(s){tail}")


def rm_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(metavar="CKPT", help="The checkpoint to remove.")],
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Remove one checkpoint (its data goes at the next gc)."""
    with open_repo(ctx, repo, key) as r:
        info = r.delete(ref)
    if json_:
        emit_json({"removed": {"id": info.id, "worker": info.worker_id, "created": info.created.isoformat()}})
        return
    typer.echo(safe(f"removed checkpoint {info.id} of worker {info.worker_id}; run 'gpuckpt gc' to reclaim its data"))


def stats_cmd(
    ctx: typer.Context,
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Object counts and bytes by kind."""
    with open_repo(ctx, repo, key) as r:
        stats = r.stats()
        url = r.url
    if json_:
        emit_json({"repository": url, **stats})
        return
    table = Table(title=safe(f"objects in {url}"), title_justify="left")
    table.add_column("kind")
    table.add_column("objects", justify="right")
    table.add_column("bytes", justify="right")
    kinds = [k.removesuffix("_count") for k in stats if k.endswith("_count")]
    for kind in kinds:
        table.add_row(kind, str(stats[f"{kind}_count"]), size(stats.get(f"{kind}_bytes", 0)))
    console().print(table)


def register(app: typer.Typer) -> None:
    """Add this module's verbs to the root app, in the order ``gpuckpt --help`` lists them."""
    app.command("verify")(verify_cmd)
    app.command("compat")(compat_cmd)
    app.command("gc")(gc_cmd)
    app.command("unlock")(unlock_cmd)
    app.command("forget")(forget_cmd)
    app.command("rm")(rm_cmd)
    app.command("stats")(stats_cmd)
