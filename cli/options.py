"""Options shared by every command module."""

from typing import Annotated, Final

import typer

_JSON_META: Final = "gpuckpt.json"


def _json_callback(ctx: typer.Context, value: bool) -> bool:
    # Recorded in ctx.meta (shared by every context of one invocation) so the
    # error handler knows to answer in JSON as well.
    if value:
        ctx.meta[_JSON_META] = True
    return value


JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON document on stdout instead of tables.",
        callback=_json_callback,
    ),
]
