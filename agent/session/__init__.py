"""Engine-neutral work on one worker: what the daemon and the CLI (and tests, demos, benchmarks)
do to a worker, one owner per operation.

=====================  ==========================================================================
module                 operation
=====================  ==========================================================================
:mod:`.worker`         the worker a session works on (an Engine, a channel or a socket path) and
                       the control calls that are an operation of their own: ``describe``,
                       ``stats``, ``withdraw``, ``sweep``, ``hold``, ``wait_until``
:mod:`.capture`        a capture stream: pages and ledger at one step boundary, in chunks
:mod:`.checkpoint`     capture and save (``checkpoint``, its :class:`CheckpointOptions`), and
                       the pre-copy between checkpoints (``precopy``)
:mod:`.paced`          a capture or a wait registered before the traffic it is about
:mod:`.plan`           whether a checkpoint restores warm into a worker (:class:`Decision`)
:mod:`.restore`        a restore's first part, and the plan (``restore``, :class:`RestoreOptions`)
:mod:`.restore_rest`   a restore's page files and the rest of a streaming restore
:mod:`.resubmit`       the requests back into the worker, and what came of each
=====================  ==========================================================================

Every function takes the worker first (see :mod:`.worker`) and talks to it
only through its :class:`~agent.engines.channel.WorkerChannel`. The verbs
below (``session.checkpoint``, ``session.restore``, …) are the modules'
functions of the same names; a module itself is reached with
``importlib.import_module("agent.session.<name>")``.
"""

from __future__ import annotations

from agent.session.capture import capture
from agent.session.checkpoint import CheckpointOptions, checkpoint, precopy
from agent.session.paced import checkpoint_around, wait_around
from agent.session.plan import Decision, plan, restore_decision
from agent.session.restore import DEFAULT_OFFER_TTL, Release, RestoreOptions, restore
from agent.session.restore_rest import RESTORE_TAG, sweep_restore_dirs
from agent.session.resubmit import Continuation, Restored, Resubmitted, resubmit, unapplied_states
from agent.session.worker import Worker, WorkerLike, describe, hold, reach, stats, sweep, wait_until, withdraw

__all__ = [
    "DEFAULT_OFFER_TTL",
    "RESTORE_TAG",
    "CheckpointOptions",
    "Continuation",
    "Decision",
    "Release",
    "RestoreOptions",
    "Restored",
    "Resubmitted",
    "Worker",
    "WorkerLike",
    "capture",
    "checkpoint",
    "checkpoint_around",
    "describe",
    "hold",
    "plan",
    "precopy",
    "reach",
    "restore",
    "restore_decision",
    "resubmit",
    "stats",
    "sweep",
    "sweep_restore_dirs",
    "unapplied_states",
    "wait_around",
    "wait_until",
    "withdraw",
]
