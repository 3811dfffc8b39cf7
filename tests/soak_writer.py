"""A writer for the soak test: saves checkpoints into a local repository until killed.

``python soak_writer.py ROOT WORKER SEED MAX_SAVE_S``. Blocks share a "system prompt"
with the other writers (deduplication across workers), and a fault kit
fails one store put in twenty (a flaky bucket): such a save fails cleanly
and the writer goes on.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt import Block, GpuckptError, Namespace, Pins, Repository, WorkerFacts
from ckpt.pins import HostFacts
from ckpt.store.local import LocalStore
from ckpt.testing import Fault, FaultyStore


def main() -> None:
    root, worker, seed, max_save = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    rng = random.Random(seed)
    shared = [Block(f"system-{i}".encode(), random.Random(i).randbytes(8192), "uint8", (8192,)) for i in range(4)]
    n = 0
    while True:
        faults = [Fault("put", nth=rng.randint(1, 40), match=lambda name: not name.startswith("locks/"))]
        repo = Repository.open(FaultyStore(LocalStore(root), faults))
        repo.max_save_seconds = max_save  # the soak's gc deletes condemned packs after twice this
        own = [Block(f"{worker}-{n}-{i}".encode(), rng.randbytes(8192), "uint8", (8192,)) for i in range(6)]
        try:
            repo.save(
                shared + own,
                worker_id=worker,
                namespace=Namespace({"engine": "soak"}),
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
