"""Test-only start-up fix for vLLM's CUDA wheels (0.33, 0.34) imported on this CPU machine
(Python imports it at start-up from the ``PYTHONPATH`` the version runs of ``make test`` set).

Those runs use vLLM's Python classes only — configs, the scheduler, the block pool, the connector
base, the API server's request path — never a model. A CUDA wheel finds no GPU here, so the runs
set ``VLLM_TARGET_DEVICE=cpu``; vLLM's CPU platform then refuses an x86 host without triton-cpu
(``check_and_update_config``), which only running a model needs. Nothing here runs one: the
check is answered as a CPU build with triton-cpu would answer it.
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

try:
    import vllm.triton_utils as _triton_utils
except Exception:  # noqa: S110 - not a version venv, or vLLM fails on its own terms later
    pass
else:
    _triton_utils.HAS_TRITON = True
