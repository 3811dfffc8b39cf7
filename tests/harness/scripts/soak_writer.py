"""A writer for the soak test: saves checkpoints into a local repository until killed.

``python soak_writer.py ROOT WORKER SEED MAX_SAVE_S [DOMAIN [hostile]]``. Blocks share a
"system prompt" with the other writers (deduplication across workers), and a fault kit
fails one store put in twenty (a flaky bucket): such a save fails cleanly
and the writer goes on. With ``DOMAIN`` the writer saves in that trust domain, into an
encrypted repository (the key in ``GPUCKPT_SOAK_KEY``, hex); ``hostile`` writes bytes of its
choosing under the system prompt's keys.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout

from ckpt import Block, GpuckptError, Keyring, Namespace, Pins, Repository, WorkerFacts
from ckpt.pins import HostFacts
from ckpt.store.local import LocalStore
from ckpt.testing import Fault, FaultyStore


def system_bytes(i: int, hostile: bool = False) -> bytes:
    """The shared prompt's page ``i``: its true bytes, or a hostile writer's chosen ones."""
    return random.Random(i + (1000 if hostile else 0)).randbytes(8192)


def main() -> None:
    root, worker, seed, max_save = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    domain = sys.argv[5] if len(sys.argv) > 5 else None
    hostile = len(sys.argv) > 6 and sys.argv[6] == "hostile"
    key = Keyring(bytes.fromhex(os.environ["GPUCKPT_SOAK_KEY"])) if domain else None
    ns = Namespace({"engine": "soak", **({"trust_domain": domain} if domain else {})})
    rng = random.Random(seed)
    shared = [Block(f"system-{i}".encode(), system_bytes(i, hostile), "uint8", (8192,)) for i in range(4)]
    n = 0
    while True:
        faults = [Fault("put", nth=rng.randint(1, 40), match=lambda name: not name.startswith("locks/"))]
        repo = Repository.open(FaultyStore(LocalStore(root), faults), key=key)
        repo.max_save_seconds = max_save  # the soak's gc deletes condemned packs after twice this
        own = [Block(f"{worker}-{n}-{i}".encode(), rng.randbytes(8192), "uint8", (8192,)) for i in range(6)]
        try:
            repo.save(
                shared + own,
                worker_id=worker,
                namespace=ns,
                pins=Pins(host=HostFacts(), worker=WorkerFacts()),
                lock_wait=5,
            )
            print("saved", flush=True)
        except GpuckptError as exc:
            print("failed", type(exc).__name__, flush=True)
        n += 1
        time.sleep(rng.uniform(0, 0.2))  # leaves gc a window


if __name__ == "__main__":
    main()
