"""A request that kills vLLM's engine, for tests only: a logits processor (``--logits-processors
tests.harness.poison:Poison``) that raises once a request whose prompt holds :data:`MARKER` reaches
``POISON_AT`` tokens of prompt and output (the environment's; default 160). The same absolute
position whether the request runs whole or is resubmitted as prompt + earlier outputs — as a
request that crashes the engine does (vLLM #33338 and the like)."""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

#: eight of this token in a prompt poison its request
MARKER = [11] * 8


def poisoned(prompt: list[int] | None) -> bool:
    if not prompt:
        return False
    k = len(MARKER)
    return any(prompt[i : i + k] == MARKER for i in range(len(prompt) - k + 1))


class Poison(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.at = int(os.environ.get("POISON_AT", "160"))
        self.live: dict[int, tuple[int, list[int]]] = {}  # batch index → (prompt length, outputs)

    def is_argmax_invariant(self) -> bool:
        return False  # applied to greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.live.pop(i, None)
        for i, _params, prompt, outputs in batch_update.added:
            if poisoned(prompt):
                self.live[i] = (len(prompt or ()), outputs)
            else:
                self.live.pop(i, None)
        for a, b, direction in batch_update.moved:
            x, y = self.live.pop(a, None), self.live.pop(b, None)
            if x is not None:
                self.live[b] = x
            if y is not None and str(direction).endswith("SWAP"):
                self.live[a] = y

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for prompt_len, outputs in self.live.values():
            if prompt_len + len(outputs) >= self.at:
                raise RuntimeError(f"test poison: a request reached {self.at} tokens")
        return logits
