"""Helpers every command module shares: the settings of one invocation, opening the
repository, and output (JSON, tables, sizes, a progress bar, terminal-safe text).

Human-readable output: every line and table cell that may hold a string from the
repository, a worker or an error message passes through :func:`safe`. ``--json`` output
goes through :func:`emit_json` and nothing else writes to stdout then.
"""

import json
import sys
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

import typer
from rich.console import Console
from rich.table import Table

import ckpt
from ckpt.manifest import Manifest
from cli.options import KEY_ENV

# -- the invocation's settings and the repository -------------------------------------------


@dataclass
class Settings:
    """The global ``--repo`` and ``--key`` (or their variables), kept in the root context's ``obj``."""

    repo: str | None
    key: str | None


def settings(ctx: typer.Context) -> Settings:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Settings) else Settings(None, None)


def repo_url(ctx: typer.Context, repo: str | None) -> str:
    """The command's ``--repo``, else the global one (or ``$GPUCKPT_REPO``), else the default."""
    return repo or settings(ctx).repo or ckpt.default_repo_url()


def key_source(ctx: typer.Context, key: str | None) -> ckpt.KeySource | None:
    spec = key or settings(ctx).key
    if not spec:
        return None
    if not spec.startswith(("file:", "env:")):
        # Not echoed: a key pasted where its source belongs must not reach a terminal or log.
        raise ckpt.ConfigError(
            f"the key source (--key or ${KEY_ENV}) must be 'file:/path' or 'env:NAME'; "
            "the value given is neither (not shown, in case it is key material)"
        )
    return ckpt.KeySource.parse(spec)


@contextmanager
def open_repo(ctx: typer.Context, repo: str | None, key: str | None) -> Iterator[ckpt.Repository]:
    url = repo_url(ctx, repo)
    source = key_source(ctx, key)
    try:
        r = ckpt.Repository.open(url, key=source)
    except ckpt.ObjectNotFound as exc:  # a local path that does not exist
        raise ckpt.RepositoryNotFound(f"no gpuckpt repository at {url} ({exc})") from None
    with r:
        yield r


# -- output -----------------------------------------------------------------------------------


def console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # Piped output keeps whole ids on one line rather than wrapping at 80 columns.
    width = None if stream.isatty() else 200
    return Console(stderr=stderr, markup=False, highlight=False, width=width)


def emit_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def one_line(message: str) -> str:
    # Some messages (IncompatibleCheckpoint) list reasons on further lines.
    return "; ".join(part.strip() for part in message.splitlines() if part.strip())


def size(n: int | None) -> str:
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


def safe(text: object) -> str:
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


def show(value: object) -> str:
    return "unknown" if value is None else safe(value)


def kv_table(title: str, rows: Sequence[tuple[str, object]]) -> Table:
    table = Table(title=safe(title), title_justify="left", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for k, v in rows:
        table.add_row(safe(k), show(v))
    return table


def created(info: ckpt.CheckpointInfo | Manifest) -> str:
    return info.created.strftime("%Y-%m-%d %H:%M:%S UTC")


@contextmanager
def progress(enabled: bool, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr, or nothing (``None``) when disabled."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn  # late: ~15 ms of start-up

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
