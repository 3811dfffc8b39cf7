"""The repository verbs: ``init``, ``key generate``, ``env``, ``ls`` and ``inspect``.

Commands::

    gpuckpt init [--encrypt --key file:/path]      create a repository
    gpuckpt key generate PATH                      write a new random key (mode 0600)
    gpuckpt env                                    this host's facts
    gpuckpt ls [--worker W] [--long]               checkpoints
    gpuckpt inspect CKPT [--blocks]                a manifest

:func:`register` adds them to the root app (see :mod:`cli.app`).
"""

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

import ckpt
from agent.engines import ledgers
from ckpt.manifest import Manifest
from cli._common import console, created, emit_json, key_source, kv_table, open_repo, repo_url, safe, show, size
from cli.options import JsonOpt, KeyOpt, RepoOpt

key_app = typer.Typer(help="Repository encryption keys.", no_args_is_help=True)


# -- init and keys --------------------------------------------------------------------------


def init_cmd(
    ctx: typer.Context,
    encrypt: Annotated[
        bool | None,
        typer.Option(
            "--encrypt/--no-encrypt",
            show_default=False,
            help="Encrypt everything in the repository with --key [default: encrypt when a key is given].",
        ),
    ] = None,
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Create a repository."""
    url = repo_url(ctx, repo)
    source = key_source(ctx, key)
    if encrypt is None:
        encrypt = source is not None
    if encrypt and source is None:
        raise typer.BadParameter(
            "--encrypt needs a key: --key file:/path or env:NAME (make one with 'gpuckpt key generate PATH')",
            ctx=ctx,
            param_hint="'--encrypt'",
        )
    with ckpt.Repository.init(url, key=source if encrypt else None) as r:
        key_id = r.keyring.key_id if r.keyring is not None else None
        if json_:
            emit_json({"repository": r.url, "id": r.config.id, "encrypted": r.encrypted, "key_id": key_id})
            return
        how = f"encrypted, key id {key_id}" if key_id else "not encrypted"
        typer.echo(safe(f"created repository {r.config.id} at {r.url} ({how})"))


@key_app.command("generate")
def key_generate(
    path: Annotated[Path, typer.Argument(help="File to create (refuses to overwrite).")],
    json_: JsonOpt = False,
) -> None:
    """Write a new random 32-byte key (hex) to PATH with mode 0600."""
    text = ckpt.generate_key()
    try:
        # O_EXCL: never overwrite a key (that would orphan its repository),
        # and never follow a symlink planted at PATH.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ckpt.ConfigError(f"{path} already exists; refusing to overwrite a key") from None
    except OSError as exc:
        raise ckpt.ConfigError(f"cannot create key file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # whatever the umask
        f.write(text + "\n")
        f.flush()
        os.fsync(fd)
    key_id = ckpt.Keyring(bytes.fromhex(text)).key_id
    if json_:
        emit_json({"path": str(path), "key_id": key_id})
        return
    typer.echo(
        f"wrote a new key to {path} (key id {key_id}); keep a copy safe: without it the repository cannot be read"
    )


# -- env ------------------------------------------------------------------------------------


def env_cmd(json_: JsonOpt = False) -> None:
    """This host's facts, as a checkpoint taken here would pin them, and the engines installed here
    against the versions gpuckpt supports (a worker outside them runs with gpuckpt disabled)."""
    from agent.engines import versions

    facts = ckpt.host_facts()
    engines = [versions.support(e).as_json() for e in versions.SUPPORTED]
    if json_:
        emit_json({**facts.model_dump(mode="json"), "engines": engines})
        return
    table = Table(title="host facts", title_justify="left")
    table.add_column("fact")
    table.add_column("value")
    for name, value in facts.model_dump().items():
        table.add_row(name, show(value))
    console().print(table)
    et = Table(title="engines", title_justify="left")
    for col in ("engine", "installed", "supported", ""):
        et.add_column(col)
    for e in engines:
        verdict = "-" if e["version"] is None else ("ok" if e["ok"] else "outside the range: gpuckpt disabled")
        et.add_row(e["engine"], e["version"] or "not installed", e["supported"], verdict)
    console().print(et)


# -- ls and inspect ---------------------------------------------------------------------------


def _read_manifests(r: ckpt.Repository, infos: list[ckpt.CheckpointInfo]) -> list[Manifest]:
    if not infos:
        return []
    with ThreadPoolExecutor(min(8, len(infos))) as ex:
        return list(ex.map(r.manifest, infos))


def ls_cmd(
    ctx: typer.Context,
    worker: Annotated[str | None, typer.Option("--worker", "-w", help="Only this worker's checkpoints.")] = None,
    long: Annotated[bool, typer.Option("--long", "-l", help="Read each manifest: blocks, sizes, parent.")] = False,
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """List checkpoints, oldest first."""
    with open_repo(ctx, repo, key) as r:
        infos = r.list(worker)
        manifests = _read_manifests(r, infos) if long else []
        url = r.url
    rows: list[dict[str, Any]] = []
    for i, info in enumerate(infos):
        row: dict[str, Any] = {
            "id": info.id,
            "worker": info.worker_id,
            "created": info.created.isoformat(),
            "manifest_bytes": info.size,
        }
        if long:
            m = manifests[i]
            row |= {
                "parent": m.parent,
                "blocks": m.sizes.blocks,
                "raw_bytes": m.sizes.raw_bytes,
                "stored_bytes": m.sizes.stored_bytes,
                "new_raw_bytes": m.sizes.new_raw_bytes,
                "new_stored_bytes": m.sizes.new_stored_bytes,
            }
        rows.append(row)
    if json_:
        emit_json({"repository": url, "checkpoints": rows})
        return
    table = Table(title=safe(f"{len(rows)} checkpoint(s) in {url}"), title_justify="left")
    for col in ("id", "worker", "created", "manifest"):
        table.add_column(col, justify="right" if col == "manifest" else "left", no_wrap=True)
    if long:
        for col in ("blocks", "raw", "stored", "new", "parent"):
            table.add_column(col, justify="left" if col == "parent" else "right", no_wrap=True)
    for info, row in zip(infos, rows, strict=True):
        cells = [info.id, info.worker_id, created(info), size(info.size)]
        if long:
            cells += [
                str(row["blocks"]),
                size(row["raw_bytes"]),
                size(row["stored_bytes"]),
                size(row["new_stored_bytes"]),
                row["parent"] or "-",
            ]
        table.add_row(*map(safe, cells))
    console().print(table)


def _codec_line(pipeline: Sequence[Any]) -> str:
    parts = []
    for spec in pipeline:
        conf = ", ".join(f"{k}={v}" for k, v in spec.configuration.items())
        parts.append(f"{spec.name}({conf})" if conf else spec.name)
    return " -> ".join(parts) or "(none)"


def _ledger_requests(m: Manifest) -> int | None:
    """Requests in the checkpoint's ledger; None where this gpuckpt cannot read it (another
    engine's, a newer version): the repository commands work on any checkpoint."""
    try:
        return ledgers.request_count(m.ledger) if m.ledger is not None else None
    except ckpt.FormatError:
        return None


def inspect_cmd(
    ctx: typer.Context,
    ref: Annotated[
        str, typer.Argument(metavar="CKPT", help="Checkpoint id, unique id prefix, latest, WORKER:latest or WORKER/ID.")
    ],
    blocks: Annotated[bool, typer.Option("--blocks", help="Also list every block.")] = False,
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Show a checkpoint's manifest."""
    with open_repo(ctx, repo, key) as r:
        m = r.manifest(ref)
    if json_:
        doc = m.model_dump(mode="json", by_alias=True)
        if not blocks:
            del doc["blocks"]
        emit_json(doc)
        return
    out = console()
    requests = _ledger_requests(m)
    summary: list[tuple[str, object]] = [
        ("id", m.id),
        ("worker", m.worker_id),
        ("created", created(m)),
        ("parent", m.parent or "-"),
        ("namespace", ", ".join(f"{k}={v}" for k, v in m.namespace.items())),
        ("labels", ", ".join(f"{k}={v}" for k, v in m.labels.items()) or "-"),
        ("layout", json.dumps(m.layout, sort_keys=True) if m.layout else "-"),
        ("encryption", f"{m.encryption.alg} {m.encryption.key_id}" if m.encryption else "none"),
        ("ledger", f"{m.ledger.schema_} v{m.ledger.version}" if m.ledger else "-"),
        ("ledger requests", requests if requests is not None else "-"),
        ("canary", "present" if m.canary is not None else "absent"),
    ]
    out.print(kv_table("checkpoint", summary))
    s = m.sizes
    out.print(
        kv_table(
            "sizes",
            [
                ("blocks", s.blocks),
                ("raw", size(s.raw_bytes)),
                ("stored", size(s.stored_bytes)),
                ("new blocks", s.new_blocks),
                ("new raw", size(s.new_raw_bytes)),
                ("new stored", size(s.new_stored_bytes)),
                ("packs written", s.packs_written),
            ],
        )
    )
    if m.timings:
        out.print(kv_table("timings", [(k, f"{v:.3f} s") for k, v in m.timings.items()]))
    out.print(kv_table("codecs", [(str(i), _codec_line(p)) for i, p in enumerate(m.codecs)]))
    out.print(kv_table("host pins", list(m.pins.host.model_dump().items())))
    out.print(kv_table("worker pins", list(m.pins.worker.model_dump().items())))
    if blocks:
        table = Table(title=f"{len(m.blocks)} block(s)", title_justify="left")
        for col in ("key", "blob", "pack", "offset", "length", "raw", "dtype", "shape", "codec"):
            table.add_column(col, no_wrap=col in ("key", "blob", "pack"))
        for b in m.blocks:
            table.add_row(
                *map(
                    safe,
                    (
                        b.key,
                        b.blob[:16],
                        b.pack,
                        str(b.offset),
                        str(b.length),
                        str(b.raw_length),
                        b.dtype,
                        "x".join(map(str, b.shape)),
                        str(b.codec),
                    ),
                )
            )
        out.print(table)


def register(app: typer.Typer) -> None:
    """Add this module's verbs to the root app, in the order ``gpuckpt --help`` lists them."""
    app.command("init")(init_cmd)
    app.add_typer(key_app, name="key")
    app.command("env")(env_cmd)
    app.command("ls")(ls_cmd)
    app.command("inspect")(inspect_cmd)
