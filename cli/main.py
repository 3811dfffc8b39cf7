"""The ``gpuckpt`` console script (``[project.scripts]``) and ``python -m cli.main``.

The app itself is built in :mod:`cli.app`; ``from cli.main import app`` keeps working.
"""

from cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    """The ``gpuckpt`` console script."""
    app(prog_name="gpuckpt")


if __name__ == "__main__":
    main()
