"""The public surface is what ``ckpt.__all__`` lists, and all of it resolves."""

from __future__ import annotations

import ckpt
import ckpt.errors


def test_all_names_resolve_and_are_public() -> None:
    assert len(ckpt.__all__) == len(set(ckpt.__all__))
    for name in ckpt.__all__:
        assert hasattr(ckpt, name), name
        assert not name.startswith("_") or name == "__version__"


def test_every_error_is_exported_and_derives_from_the_base() -> None:
    errors = {
        n
        for n, v in vars(ckpt.errors).items()
        if isinstance(v, type) and issubclass(v, Exception) and v.__module__ == "ckpt.errors"
    }
    assert errors <= set(ckpt.__all__), errors - set(ckpt.__all__)
    for n in errors:
        assert issubclass(getattr(ckpt, n), ckpt.GpuckptError)


def test_the_main_entry_points_are_there() -> None:
    for name in ("Repository", "Block", "Namespace", "Pins", "decide", "host_facts", "SaveOptions", "KeySource"):
        assert name in ckpt.__all__
