"""The ``gpuckpt`` command: thin wrappers that parse options, call :mod:`ckpt` and print.

Commands::

    gpuckpt init [--encrypt --key file:/path]      create a repository
    gpuckpt key generate PATH                      write a new random key (mode 0600)
    gpuckpt env                                    this host's facts
    gpuckpt ls [--worker W] [--long]               checkpoints
    gpuckpt inspect CKPT [--blocks]                a manifest
    gpuckpt verify [CKPT] [--no-read-data]         check stored data (exit 4 on problems)
    gpuckpt compat CKPT [--worker-facts F.json]    may CKPT be restored warm here? (exit 5 if not)
    gpuckpt gc [--grace 1h] [--dry-run] [--now]    delete unreferenced data
    gpuckpt forget [--keep-last N] [--keep-within 7d] [--worker W] [--dry-run]
    gpuckpt rm CKPT                                remove one checkpoint
    gpuckpt stats                                  object counts and bytes

``--repo/-r`` and ``--key`` are accepted before the command (global) and after
it; the command's own value wins, then the global one, then ``$GPUCKPT_REPO``
/ ``$GPUCKPT_KEY``, then :func:`ckpt.default_repo_url`. Most commands take
``--json``: then stdout holds exactly one JSON document and nothing else.

Errors: every :class:`ckpt.GpuckptError` is caught in one place,
:meth:`_Group.invoke`, printed as one ``gpuckpt: error: <message>`` line on
stderr (and, with ``--json``, as ``{"error": {...}}`` on stdout) and turned into
an exit code by :func:`cli.exitcodes.exit_code_for`. No traceback, no key
material. Usage errors are typer's own (exit 2).
"""

import json
import logging
import os
import sys
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final, NoReturn, TextIO

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from typer import _click
from typer.core import TyperGroup

import ckpt
from agent.daemon.config import parse_duration
from ckpt.compat import Policy, Verdict, decide, rule_json
from ckpt.logfmt import JsonFormatter, TextFormatter
from ckpt.manifest import Manifest
from cli import exitcodes
from cli.options import _JSON_META, JsonOpt

_KEY_ENV: Final = "GPUCKPT_KEY"
_REPO_ENV: Final = "GPUCKPT_REPO"


# -- the one error handler -----------------------------------------------------------


def _one_line(message: str) -> str:
    # Some messages (IncompatibleCheckpoint) list reasons on further lines.
    return "; ".join(part.strip() for part in message.splitlines() if part.strip())


def _fail(ctx: _click.Context, exc: ckpt.GpuckptError) -> NoReturn:
    code = exitcodes.exit_code_for(exc)
    message = _one_line(str(exc)) or type(exc).__name__
    if ctx.meta.get(_JSON_META):
        _emit_json({"error": {"type": type(exc).__name__, "message": message, "exit_code": code}})
    typer.echo(f"gpuckpt: error: {_safe(message)}", err=True)
    raise typer.Exit(code)


class _Group(TyperGroup):
    """The root command group: the one place ckpt errors become messages and exit codes."""

    def invoke(self, ctx: _click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ckpt.GpuckptError as exc:
            _fail(ctx, exc)


app = typer.Typer(
    cls=_Group,
    name="gpuckpt",
    help="Checkpoint LLM serving workers' KV cache to object storage: inspect and maintain repositories.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # locals may hold key bytes
)
key_app = typer.Typer(help="Repository encryption keys.", no_args_is_help=True)
app.add_typer(key_app, name="key")


# -- shared options ------------------------------------------------------------------------


@dataclass
class _Settings:
    repo: str | None
    key: str | None


RepoOpt = Annotated[
    str | None,
    typer.Option(
        "--repo",
        "-r",
        metavar="URL",
        show_default=False,
        help=f"Repository: a path, file:///path or s3://bucket/prefix (overrides the global --repo and ${_REPO_ENV}).",
    ),
]
KeyOpt = Annotated[
    str | None,
    typer.Option(
        "--key",
        metavar="SOURCE",
        show_default=False,
        help=f"Key source, file:/path or env:NAME (overrides the global --key and ${_KEY_ENV}).",
    ),
]


def _duration(value: str | timedelta) -> timedelta:
    """Parse ``30s``, ``10m``, ``1h``, ``7d``, ``2w``, ``1h30m`` (or ``0``): the agent configuration's syntax."""
    if isinstance(value, timedelta):  # a default, already parsed
        return value
    try:
        return parse_duration(value)
    except ValueError:
        raise typer.BadParameter(
            f"invalid duration {value!r}: use a number and a unit (s, m, h, d, w), e.g. 30s, 10m, 1h, 7d, 1h30m"
        ) from None


def _settings(ctx: typer.Context) -> _Settings:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, _Settings) else _Settings(None, None)


def _repo_url(ctx: typer.Context, repo: str | None) -> str:
    return repo or _settings(ctx).repo or ckpt.default_repo_url()


def _key_source(ctx: typer.Context, key: str | None) -> ckpt.KeySource | None:
    spec = key or _settings(ctx).key
    if not spec:
        return None
    if not spec.startswith(("file:", "env:")):
        # Not echoed: a key pasted where its source belongs must not reach a terminal or log.
        raise ckpt.ConfigError(
            f"the key source (--key or ${_KEY_ENV}) must be 'file:/path' or 'env:NAME'; "
            "the value given is neither (not shown, in case it is key material)"
        )
    return ckpt.KeySource.parse(spec)


@contextmanager
def _open_repo(ctx: typer.Context, repo: str | None, key: str | None) -> Iterator[ckpt.Repository]:
    url = _repo_url(ctx, repo)
    source = _key_source(ctx, key)
    try:
        r = ckpt.Repository.open(url, key=source)
    except ckpt.ObjectNotFound as exc:  # a local path that does not exist
        raise ckpt.RepositoryNotFound(f"no gpuckpt repository at {url} ({exc})") from None
    with r:
        yield r


# -- output helpers ------------------------------------------------------------------


def _console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # Piped output keeps whole ids on one line rather than wrapping at 80 columns.
    width = None if stream.isatty() else 200
    return Console(stderr=stderr, markup=False, highlight=False, width=width)


def _emit_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _size(n: int | None) -> str:
    if n is None:
        return ""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# Characters shown escaped in human output: controls (C0, DEL, C1), format
# characters (bidi overrides and isolates, zero-width ones), surrogates, and
# line and paragraph separators.
_UNSAFE_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _safe(text: object) -> str:
    """``text`` made safe for a terminal: every control or format character is shown
    escaped (``\\x1b``, ``\\u202e``), so a string from the repository (a label, a pin, a
    worker id, an error message quoting stored text) cannot move the cursor, clear the
    screen or reorder what is shown. Every human-readable line and table cell that may
    hold such a string passes through here; ``--json`` output does not (``json.dumps``
    escapes control characters itself)."""
    s = str(text)
    if s.isprintable():  # the usual case: nothing to escape
        return s
    return "".join(_escape(ch) if unicodedata.category(ch) in _UNSAFE_CATEGORIES else ch for ch in s)


def _escape(ch: str) -> str:
    n = ord(ch)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _show(value: object) -> str:
    return "unknown" if value is None else _safe(value)


def _kv_table(title: str, rows: Sequence[tuple[str, object]]) -> Table:
    table = Table(title=_safe(title), title_justify="left", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for k, v in rows:
        table.add_row(_safe(k), _show(v))
    return table


def _created(info: ckpt.CheckpointInfo | Manifest) -> str:
    return info.created.strftime("%Y-%m-%d %H:%M:%S UTC")


def _codec_line(pipeline: Sequence[Any]) -> str:
    parts = []
    for spec in pipeline:
        conf = ", ".join(f"{k}={v}" for k, v in spec.configuration.items())
        parts.append(f"{spec.name}({conf})" if conf else spec.name)
    return " -> ".join(parts) or "(none)"


def _ledger_requests(m: Manifest) -> int | None:
    """Requests in the checkpoint's ledger; None where this gpuckpt cannot read it (another
    engine's, a newer version): the repository commands work on any checkpoint."""
    from agent.engines import ledgers

    try:
        return ledgers.request_count(m.ledger) if m.ledger is not None else None
    except ckpt.FormatError:
        return None


@contextmanager
def _progress(enabled: bool, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr, or nothing (``None``) when disabled."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=_console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


# -- the root callback ---------------------------------------------------------------


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever ``sys.stderr`` is at the time (never stdout: --json owns it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


_log_handler: _StderrHandler | None = None


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


def _setup_logging(level: LogLevel, log_format: LogFormat = LogFormat.TEXT) -> None:
    global _log_handler
    root = logging.getLogger()
    if _log_handler is None:
        _log_handler = _StderrHandler()
        root.addHandler(_log_handler)
    _log_handler.setFormatter(JsonFormatter() if log_format == LogFormat.JSON else TextFormatter())
    root.setLevel(getattr(logging, level.value.upper()))


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"gpuckpt {ckpt.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    repo: Annotated[
        str | None,
        typer.Option(
            "--repo",
            "-r",
            metavar="URL",
            envvar=_REPO_ENV,
            show_default=False,
            help="Repository: a path, file:///path or s3://bucket/prefix (default: a per-user data directory).",
        ),
    ] = None,
    key: Annotated[
        str | None,
        typer.Option(
            "--key",
            metavar="SOURCE",
            envvar=_KEY_ENV,
            show_default=False,
            help="Where the repository key is: file:/path (mode 0600) or env:NAME. Needed for encrypted repositories.",
        ),
    ] = None,
    log_level: Annotated[
        LogLevel, typer.Option("--log-level", case_sensitive=False, help="Log level (stderr).")
    ] = LogLevel.WARNING,
    log_format: Annotated[
        LogFormat,
        typer.Option("--log-format", case_sensitive=False, help="Log lines as text or one JSON object each (stderr)."),
    ] = LogFormat.TEXT,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    """Inspect and maintain gpuckpt checkpoint repositories."""
    _setup_logging(log_level, log_format)
    ctx.obj = _Settings(repo=repo, key=key)


# -- init and keys --------------------------------------------------------------------------


@app.command("init")
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
    url = _repo_url(ctx, repo)
    source = _key_source(ctx, key)
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
            _emit_json({"repository": r.url, "id": r.config.id, "encrypted": r.encrypted, "key_id": key_id})
            return
        how = f"encrypted, key id {key_id}" if key_id else "not encrypted"
        typer.echo(_safe(f"created repository {r.config.id} at {r.url} ({how})"))


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
        _emit_json({"path": str(path), "key_id": key_id})
        return
    typer.echo(
        f"wrote a new key to {path} (key id {key_id}); keep a copy safe: without it the repository cannot be read"
    )


# -- env ------------------------------------------------------------------------------------


@app.command("env")
def env_cmd(json_: JsonOpt = False) -> None:
    """This host's facts, as a checkpoint taken here would pin them."""
    facts = ckpt.host_facts()
    if json_:
        _emit_json(facts.model_dump(mode="json"))
        return
    table = Table(title="host facts", title_justify="left")
    table.add_column("fact")
    table.add_column("value")
    for name, value in facts.model_dump().items():
        table.add_row(name, _show(value))
    _console().print(table)


# -- ls and inspect ---------------------------------------------------------------------------


def _read_manifests(r: ckpt.Repository, infos: list[ckpt.CheckpointInfo]) -> list[Manifest]:
    if not infos:
        return []
    with ThreadPoolExecutor(min(8, len(infos))) as ex:
        return list(ex.map(r.manifest, infos))


@app.command("ls")
def ls_cmd(
    ctx: typer.Context,
    worker: Annotated[str | None, typer.Option("--worker", "-w", help="Only this worker's checkpoints.")] = None,
    long: Annotated[bool, typer.Option("--long", "-l", help="Read each manifest: blocks, sizes, parent.")] = False,
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """List checkpoints, oldest first."""
    with _open_repo(ctx, repo, key) as r:
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
        _emit_json({"repository": url, "checkpoints": rows})
        return
    table = Table(title=_safe(f"{len(rows)} checkpoint(s) in {url}"), title_justify="left")
    for col in ("id", "worker", "created", "manifest"):
        table.add_column(col, justify="right" if col == "manifest" else "left", no_wrap=True)
    if long:
        for col in ("blocks", "raw", "stored", "new", "parent"):
            table.add_column(col, justify="left" if col == "parent" else "right", no_wrap=True)
    for info, row in zip(infos, rows, strict=True):
        cells = [info.id, info.worker_id, _created(info), _size(info.size)]
        if long:
            cells += [
                str(row["blocks"]),
                _size(row["raw_bytes"]),
                _size(row["stored_bytes"]),
                _size(row["new_stored_bytes"]),
                row["parent"] or "-",
            ]
        table.add_row(*map(_safe, cells))
    _console().print(table)


@app.command("inspect")
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
    with _open_repo(ctx, repo, key) as r:
        m = r.manifest(ref)
    if json_:
        doc = m.model_dump(mode="json", by_alias=True)
        if not blocks:
            del doc["blocks"]
        _emit_json(doc)
        return
    out = _console()
    requests = _ledger_requests(m)
    summary: list[tuple[str, object]] = [
        ("id", m.id),
        ("worker", m.worker_id),
        ("created", _created(m)),
        ("parent", m.parent or "-"),
        ("namespace", ", ".join(f"{k}={v}" for k, v in m.namespace.items())),
        ("labels", ", ".join(f"{k}={v}" for k, v in m.labels.items()) or "-"),
        ("layout", json.dumps(m.layout, sort_keys=True) if m.layout else "-"),
        ("encryption", f"{m.encryption.alg} {m.encryption.key_id}" if m.encryption else "none"),
        ("ledger", f"{m.ledger.schema_} v{m.ledger.version}" if m.ledger else "-"),
        ("ledger requests", requests if requests is not None else "-"),
        ("canary", "present" if m.canary is not None else "absent"),
    ]
    out.print(_kv_table("checkpoint", summary))
    s = m.sizes
    out.print(
        _kv_table(
            "sizes",
            [
                ("blocks", s.blocks),
                ("raw", _size(s.raw_bytes)),
                ("stored", _size(s.stored_bytes)),
                ("new blocks", s.new_blocks),
                ("new raw", _size(s.new_raw_bytes)),
                ("new stored", _size(s.new_stored_bytes)),
                ("packs written", s.packs_written),
            ],
        )
    )
    if m.timings:
        out.print(_kv_table("timings", [(k, f"{v:.3f} s") for k, v in m.timings.items()]))
    out.print(_kv_table("codecs", [(str(i), _codec_line(p)) for i, p in enumerate(m.codecs)]))
    out.print(_kv_table("host pins", list(m.pins.host.model_dump().items())))
    out.print(_kv_table("worker pins", list(m.pins.worker.model_dump().items())))
    if blocks:
        table = Table(title=f"{len(m.blocks)} block(s)", title_justify="left")
        for col in ("key", "blob", "pack", "offset", "length", "raw", "dtype", "shape", "codec"):
            table.add_column(col, no_wrap=col in ("key", "blob", "pack"))
        for b in m.blocks:
            table.add_row(
                *map(
                    _safe,
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


# -- verify and compat --------------------------------------------------------------------------


@app.command("verify")
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
    with _open_repo(ctx, repo, key) as r, _progress(show_bar, "verifying") as progress:
        report = r.verify(ref, read_data=not no_read_data, progress=progress)
    if json_:
        _emit_json({"ok": report.ok, **asdict(report)})
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
                table.add_row(_safe(p.obj), _safe(p.blob or "-"), _safe(p.message))
            _console().print(table)
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


@app.command("compat")
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
    with _open_repo(ctx, repo, key) as r:
        m = r.manifest(ref)
    current = ckpt.Pins(host=ckpt.host_facts(), worker=worker or m.pins.worker)
    decision = decide(m.pins, current, policy)
    if json_:
        _emit_json(
            {
                "checkpoint": m.id,
                "warm": decision.warm,
                "worker_checked": worker is not None,
                "reasons": decision.reasons,
                "results": [rule_json(res, policy) for res in decision.results],
            }
        )
    else:
        table = Table(title=_safe(f"compatibility of {m.id}"), title_justify="left")
        for col in ("rule", "verdict", "checkpoint", "here"):
            table.add_column(col, overflow="fold")
        for res in decision.results:
            verdict = str(res.verdict)
            if res.rule in policy.ignore:
                verdict += " (ignored)"
            elif res.verdict is Verdict.UNKNOWN and res.rule in policy.allow_unknown:
                verdict += " (allowed)"
            table.add_row(_safe(res.rule), verdict, _show(res.recorded), _show(res.current))
        _console().print(table)
        if worker is None:
            typer.echo("worker facts not given (--worker-facts): only the host was checked")
        if decision.warm:
            typer.echo("decision: warm restore allowed")
        else:
            typer.echo("decision: warm restore refused (cold start with ledger replay):")
            for reason in decision.reasons:
                typer.echo(f"  {_safe(reason)}")
    if not decision.warm:
        raise typer.Exit(exitcodes.INCOMPATIBLE)


# -- maintenance --------------------------------------------------------------------------------


@app.command("gc")
def gc_cmd(
    ctx: typer.Context,
    grace: Annotated[
        timedelta,
        typer.Option(
            "--grace",
            parser=_duration,
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
            parser=_duration,
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
    with _open_repo(ctx, repo, key) as r:
        report = r.gc(
            grace=grace, dry_run=dry_run, repack_below=repack_below, now=now, lock_wait=lock_wait.total_seconds()
        )
    if json_:
        _emit_json(asdict(report))
        return
    verb = "would delete" if dry_run else "deleted"
    typer.echo(
        f"{verb} {len(report.deleted_packs)} pack(s) ({_size(report.deleted_bytes)}); "
        f"{'would repack' if dry_run else 'repacked'} {len(report.repacked_packs)} sparse pack(s); "
        f"{_size(report.reclaimed_bytes)} reclaimed in all; "
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
        typer.echo(f"  skipped (unreadable, left in place): {_safe(_one_line(line))}")


@app.command("unlock")
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
            parser=_duration,
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
    from ckpt.lock import list_locks, remove_stale_locks

    with _open_repo(ctx, repo, key) as r:
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
        _emit_json({"removed": [row(x) for x in removed], "live": [row(x) for x in left]})
        return
    for x in removed:
        typer.echo(f"removed {_safe(x.describe())}")
    for x in left:
        typer.echo(f"kept (live) {_safe(x.describe())}")
    if not removed and not left:
        typer.echo("no locks")


@app.command("forget")
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
            parser=_duration,
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
    with _open_repo(ctx, repo, key) as r:
        removed = r.forget(keep_last=keep_last, keep_within=keep_within, worker_id=worker, dry_run=dry_run)
    removed = sorted(removed, key=lambda c: (c.id, c.worker_id))
    if json_:
        _emit_json(
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
            table.add_row(_safe(c.id), _safe(c.worker_id), _created(c))
        _console().print(table)
    verb = "would remove" if dry_run else "removed"
    tail = "" if dry_run or not removed else "; run 'gpuckpt gc' to reclaim their data"
    typer.echo(f"{verb} {len(removed)} checkpoint(s){tail}")


@app.command("rm")
def rm_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(metavar="CKPT", help="The checkpoint to remove.")],
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Remove one checkpoint (its data goes at the next gc)."""
    with _open_repo(ctx, repo, key) as r:
        info = r.delete(ref)
    if json_:
        _emit_json({"removed": {"id": info.id, "worker": info.worker_id, "created": info.created.isoformat()}})
        return
    typer.echo(_safe(f"removed checkpoint {info.id} of worker {info.worker_id}; run 'gpuckpt gc' to reclaim its data"))


@app.command("stats")
def stats_cmd(
    ctx: typer.Context,
    repo: RepoOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Object counts and bytes by kind."""
    with _open_repo(ctx, repo, key) as r:
        stats = r.stats()
        url = r.url
    if json_:
        _emit_json({"repository": url, **stats})
        return
    table = Table(title=_safe(f"objects in {url}"), title_justify="left")
    table.add_column("kind")
    table.add_column("objects", justify="right")
    table.add_column("bytes", justify="right")
    kinds = [k.removesuffix("_count") for k in stats if k.endswith("_count")]
    for kind in kinds:
        table.add_row(kind, str(stats[f"{kind}_count"]), _size(stats.get(f"{kind}_bytes", 0)))
    _console().print(table)


from cli import agent_cmds  # noqa: E402 - registers on the app defined above

agent_cmds.register(app)


def main() -> None:
    """The ``gpuckpt`` console script."""
    app(prog_name="gpuckpt")


if __name__ == "__main__":
    main()
