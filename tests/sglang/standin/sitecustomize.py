"""Test-only start-up fix for SGLang 0.5.23 on this CPU machine (imported by Python at start-up
from the SGLang server's ``PYTHONPATH``, which the tests set).

It exists only because no CPU wheel of sgl-kernel exists for this CPU, so this SGLang install
runs a CPU torch, and PyPI's torchvision wheel links CUDA torch: its C++ ops do not load and its
``_meta_registrations`` then fails on import (``operator torchvision::nms does not exist``).
SGLang imports ``torchvision.transforms`` at start-up (``srt/multimodal/internvl_utils.py``), so
the two op schemas it registers fakes for are defined here first; calling either op fails loudly
(no kernel). A GPU host uses a torchvision built for its torch and needs none of this.
"""

import torch

_lib = torch.library.Library("torchvision", "DEF")  # type: ignore[no-untyped-call]
_lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")  # type: ignore[no-untyped-call]
_lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")  # type: ignore[no-untyped-call]
