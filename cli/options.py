"""Options shared by every command module: ``--repo``, ``--key``, ``--json`` and the duration syntax.

A command that works on a repository takes ``repo: RepoOpt = None, key: KeyOpt = None`` and
opens it with :func:`cli._common.open_repo`; one that prints takes ``json_: JsonOpt = False``.
"""

from datetime import timedelta
from typing import Annotated, Final

import typer

from agent.daemon.config import parse_duration

KEY_ENV: Final = "GPUCKPT_KEY"
REPO_ENV: Final = "GPUCKPT_REPO"
JSON_META: Final = "gpuckpt.json"
"""The key in ``ctx.meta`` that says this invocation answers in JSON (errors included)."""


def _json_callback(ctx: typer.Context, value: bool) -> bool:
    # Recorded in ctx.meta (shared by every context of one invocation) so the
    # error handler knows to answer in JSON as well.
    if value:
        ctx.meta[JSON_META] = True
    return value


JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON document on stdout instead of tables.",
        callback=_json_callback,
    ),
]
RepoOpt = Annotated[
    str | None,
    typer.Option(
        "--repo",
        "-r",
        metavar="URL",
        show_default=False,
        help=f"Repository: a path, file:///path or s3://bucket/prefix (overrides the global --repo and ${REPO_ENV}).",
    ),
]
KeyOpt = Annotated[
    str | None,
    typer.Option(
        "--key",
        metavar="SOURCE",
        show_default=False,
        help=f"Key source, file:/path or env:NAME (overrides the global --key and ${KEY_ENV}).",
    ),
]


def duration(value: str | timedelta) -> timedelta:
    """Parse ``30s``, ``10m``, ``1h``, ``7d``, ``2w``, ``1h30m`` (or ``0``): the agent configuration's syntax.

    The ``parser=`` of every duration option."""
    if isinstance(value, timedelta):  # a default, already parsed
        return value
    try:
        return parse_duration(value)
    except ValueError:
        raise typer.BadParameter(
            f"invalid duration {value!r}: use a number and a unit (s, m, h, d, w), e.g. 30s, 10m, 1h, 7d, 1h30m"
        ) from None
