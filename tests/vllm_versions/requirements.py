"""Print the requirements of the installed ``vllm`` wheel that run on a CPU host.

vLLM's CUDA wheels (0.33, 0.34) pin a CUDA torch and GPU kernel packages (several GB, unusable
without a GPU). The version venvs of ``make test`` install the wheel ``--no-deps``, then what this
prints: its own requirements, read from its metadata, less torch (the CPU build on this disk is
installed first) and the packages that exist only for a GPU. What is installed stays the wheel's
own choice of versions, so each venv is that release as far as a CPU host can hold it.
"""

from __future__ import annotations

import re
from importlib.metadata import requires

# torch and its companions come from the CPU build; the rest are GPU kernels, codecs and loaders
# no class gpuckpt's version-independent tests import ever touches.
GPU_ONLY = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer-python|apache-tvm-ffi|tilelang"
    r"|nvidia-.*|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels"
    r"|opencv-python-headless|numba)$"
)


def main() -> None:
    for req in requires("vllm") or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")
        if not GPU_ONLY.match(name):
            print(req)


if __name__ == "__main__":
    main()
