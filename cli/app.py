"""The ``gpuckpt`` app: the root command group, its global options, and the verb groups.

Commands, one group per module (restic's ``cmd_<verb>.go``, a group at a time)::

    cli/repo_cmds.py    init, key generate, env, ls, inspect
    cli/maint_cmds.py   verify, compat, gc, unlock, forget, rm, stats
    cli/agent_cmds.py   agent run, checkpoint, status, restore, launch

A new verb goes in the ``*_cmds.py`` of its group, with a line in that module's
``register``; shared options are in :mod:`cli.options`, shared helpers (opening the
repository, JSON, tables, terminal-safe text) in :mod:`cli._common`.

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

import logging
import sys
from enum import StrEnum
from typing import Annotated, Any, NoReturn, TextIO

import typer
from typer import _click
from typer.core import TyperGroup

import ckpt
from ckpt.logfmt import JsonFormatter, TextFormatter
from cli import agent_cmds, exitcodes, maint_cmds, repo_cmds
from cli._common import Settings, emit_json, one_line, safe
from cli.options import JSON_META, KEY_ENV, REPO_ENV

# -- the one error handler -----------------------------------------------------------


def _fail(ctx: _click.Context, exc: ckpt.GpuckptError) -> NoReturn:
    code = exitcodes.exit_code_for(exc)
    message = one_line(str(exc)) or type(exc).__name__
    if ctx.meta.get(JSON_META):
        emit_json({"error": {"type": type(exc).__name__, "message": message, "exit_code": code}})
    typer.echo(f"gpuckpt: error: {safe(message)}", err=True)
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


# -- the root callback: global options and logging ---------------------------------------------


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
            envvar=REPO_ENV,
            show_default=False,
            help="Repository: a path, file:///path or s3://bucket/prefix (default: a per-user data directory).",
        ),
    ] = None,
    key: Annotated[
        str | None,
        typer.Option(
            "--key",
            metavar="SOURCE",
            envvar=KEY_ENV,
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
    ctx.obj = Settings(repo=repo, key=key)


# -- the verb groups, in the order --help lists them -------------------------------------------

repo_cmds.register(app)
maint_cmds.register(app)
agent_cmds.register(app)
