"""Blocks: the unit a checkpoint stores.

A block is one KV page copied whole (bytes + dtype + shape), identified by a
*content key* the caller supplies (for vLLM: the prefix-hash chain value)
inside a :class:`Namespace` (model, KV layout, engine). The pair names the
bytes: a block already in the repository under the same namespace and key is
never stored again. Raw block ids (slot numbers) are never keys.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch

Buffer = bytes | bytearray | memoryview

#: dtype name → bytes per element. Names are torch's, without "torch.".
DTYPES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}

_NS_KEY = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def check_dtype(dtype: str) -> int:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"unsupported dtype {dtype!r} (known: {', '.join(DTYPES)})") from None


@dataclass(frozen=True)
class Namespace:
    """The space a content key is unique in: blocks dedup only within one.

    ``fields`` are short lowercase names to strings, e.g.
    ``{"engine": "vllm", "model": "sha256:…", "layout": "…"}``. The namespace id
    is a digest of their canonical JSON, so field order does not matter.
    """

    fields: Mapping[str, str]
    id: str = field(init=False)

    def __post_init__(self) -> None:
        if not self.fields:
            raise ConfigError("a namespace needs at least one field")
        for k, v in self.fields.items():
            if not isinstance(k, str) or not _NS_KEY.match(k):
                raise ConfigError(f"namespace field name {k!r} must match {_NS_KEY.pattern}")
            if not isinstance(v, str):
                raise ConfigError(f"namespace field {k!r} must be a string, not {type(v).__name__}")
        canon = json.dumps(dict(self.fields), sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "fields", dict(self.fields))
        object.__setattr__(self, "id", hashlib.sha256(canon.encode()).hexdigest()[:32])


@dataclass(frozen=True)
class Block:
    """A block to save. ``data`` is any contiguous buffer of ``prod(shape) * itemsize`` bytes.

    The save pipeline reads ``data`` from worker threads; the caller must not
    modify it until ``release`` is called (if given: the pipeline calls it
    exactly once, as soon as it no longer needs the bytes) or the save returns.
    """

    key: bytes
    data: Buffer
    dtype: str
    shape: tuple[int, ...]
    release: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or not 1 <= len(self.key) <= 256:
            raise ConfigError("a block key must be 1 to 256 bytes")
        itemsize = check_dtype(self.dtype)
        n = 1
        for d in self.shape:
            if not isinstance(d, int) or d < 0:
                raise ConfigError(f"block shape {self.shape!r} must be non-negative ints")
            n *= d
        nbytes = memoryview(self.data).nbytes
        if nbytes != n * itemsize:
            raise ConfigError(f"block {self.key.hex()}: {nbytes} bytes do not fit shape {self.shape} of {self.dtype}")

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes

    @classmethod
    def from_tensor(cls, key: bytes, tensor: torch.Tensor) -> Block:
        """A block from a CPU tensor (a CUDA tensor must be copied to host first;
        see :class:`ckpt.hostbuffers.HostBuffers`)."""
        import torch

        if tensor.device.type != "cpu":
            raise ConfigError("Block.from_tensor takes a host tensor; copy device memory to host first")
        t = tensor.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        flat = t.reshape(-1).view(torch.uint8)
        return cls(key, flat.numpy().data, dtype, tuple(t.shape))

    @classmethod
    def from_array(cls, key: bytes, array: np.ndarray[Any, Any], dtype: str | None = None) -> Block:
        import numpy as np  # late: numpy is needed only by array blocks (typed under TYPE_CHECKING above)

        a = np.ascontiguousarray(array)
        return cls(key, a.reshape(-1).view(np.uint8).data, dtype or str(a.dtype), tuple(a.shape))


@dataclass(frozen=True)
class Existing:
    """A block the caller believes the repository already holds (same namespace and key): it is
    referenced, not read or rewritten — an incremental capture does not copy such blocks at all.

    A save given one the repository does not hold (or holds only in a pack a gc has condemned, or
    with another size) raises :class:`~ckpt.errors.BlocksMissing` naming every such key, before
    anything becomes visible: it is never left dangling.
    """

    key: bytes
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or not 1 <= len(self.key) <= 256:
            raise ConfigError("a block key must be 1 to 256 bytes")
        check_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        n = check_dtype(self.dtype)
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class LoadedBlock:
    """A block read back and verified. ``data`` is owned by the caller."""

    key: bytes
    data: bytearray | bytes
    dtype: str
    shape: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        """A CPU tensor viewing ``data`` (no copy), with the stored dtype and shape."""
        import torch

        dt = getattr(torch, self.dtype)
        if len(self.data) == 0:
            return torch.empty(self.shape, dtype=dt)
        return torch.frombuffer(self.data, dtype=torch.uint8).view(dt).reshape(self.shape)
