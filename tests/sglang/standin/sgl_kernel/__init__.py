"""Test-only pure-torch stand-in for the three ``sgl_kernel`` CPU ops SGLang 0.5.23 needs here.

It exists only because no CPU wheel of sgl-kernel exists for this CPU (the PyPI
``sglang-kernel`` wheels need ``libcuda``; the CPU ones need AVX-512/AMX). A GPU
host uses the real ``sgl-kernel``. The tests put this directory on the SGLang
server's ``PYTHONPATH``; nothing in gpuckpt imports it.

Provided: ``copy_all_layer_kv_cache_cpu``, ``assign_req_to_token_pool_cpu`` and
``torch.ops.sgl_kernel.murmur_hash32_cpu``. Any other attribute fails loudly,
naming the op, when it is called.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__version__ = "0.0.0+gpuckpt-test-standin"


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer (data pointer ``data_ptrs[i]``, ``strides[i]`` bytes per slot): copy slot
    ``src_loc[j]`` to slot ``tgt_loc[j]``."""
    src = [int(s) for s in src_loc.tolist()]
    tgt = [int(t) for t in tgt_loc.tolist()]
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(int(ptr) + s * int(stride), int(stride)) for s in src]  # read all first
        for t, row in zip(tgt, rows, strict=True):
            ctypes.memmove(int(ptr) + t * int(stride), row, int(stride))


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]]`` = the next ``end[i] - start[i]`` of
    ``out_cache_loc``, request after request (the Triton kernel's contract)."""
    pos = 0
    for row, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = int(e) - int(s)
        req_to_token[int(row), int(s) : int(e)] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


_M32 = 0xFFFFFFFF


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = (k * 0xCC9E2D51) & _M32
    k = _rotl(k, 15)
    k = (k * 0x1B873593) & _M32
    h = h ^ k
    h = _rotl(h, 13)
    return (h * 5 + 0xE6546B64) & _M32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 of (seed low, seed high, position, column) per row and column, as the Triton kernel."""
    s = seed.to(torch.int64)
    lo = (s & _M32).unsqueeze(1)
    hi = ((s >> 32) & _M32).unsqueeze(1)
    pos = (positions.to(torch.int64) & _M32).unsqueeze(1)
    col = (col_indices.to(torch.int64) & _M32).unsqueeze(0)
    h = torch.zeros((s.shape[0], col.shape[1]), dtype=torch.int64)
    h = _mix(h, lo.expand_as(h))
    h = _mix(h, hi.expand_as(h))
    h = _mix(h, pos.expand_as(h))
    h = _mix(h, col.expand_as(h))
    h = _fmix(h ^ 16)
    return h.to(torch.uint32)


_lib = torch.library.Library("sgl_kernel", "DEF")  # type: ignore[no-untyped-call]
_lib.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")  # type: ignore[no-untyped-call]
_lib.impl("murmur_hash32_cpu", _murmur_hash32, "CPU")  # type: ignore[no-untyped-call]


def __getattr__(name: str) -> Any:
    """Any other op: a function that fails loudly, naming the op, when called (SGLang imports some
    CPU ops at module level that a text model on this path never calls)."""
    if name.startswith("__"):  # the import machinery's probes
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name}: not provided by gpuckpt's test stand-in (only copy_all_layer_kv_cache_cpu, "
            "assign_req_to_token_pool_cpu and murmur_hash32_cpu are); a GPU host uses the real sgl-kernel"
        )

    missing.__name__ = name
    return missing
