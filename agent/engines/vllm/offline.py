"""An offline ``vllm.LLM`` as a worker (tests, demos, benchmarks): what ``vllm serve``'s API does
for a restored ledger, done through the engine object."""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams

from agent.engines.types import Resubmission


def submit(llm: Any, requests: list[Resubmission]) -> None:
    """Add resubmissions to an offline ``vllm.LLM`` under their original request ids."""
    for r in requests:
        if r.left_to_client is not None:  # its input is not in the ledger: never run on another one
            continue
        prompt = TokensPrompt(prompt_token_ids=list(r.token_ids))
        if r.cache_salt is not None:
            prompt["cache_salt"] = r.cache_salt
        sampling = dict(r.sampling)
        if sampling.get("logit_bias"):  # JSON keys are strings; the offline API takes token ids
            sampling["logit_bias"] = {int(k): float(v) for k, v in sampling["logit_bias"].items()}
        if sampling.get("structured_outputs") is not None:
            sampling["structured_outputs"] = StructuredOutputsParams(**sampling["structured_outputs"])
        llm.llm_engine.add_request(r.request_id, prompt, SamplingParams(**sampling), priority=r.priority)
