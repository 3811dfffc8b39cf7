"""The environment fingerprint: probe this host's facts, digest a model's files.

:func:`host_facts` fills a :class:`~ckpt.pins.HostFacts` from NVML, the CUDA
driver (cuda-python), torch and ``/proc/cpuinfo``. Its contract:

- It never raises. Each probe runs in isolation; a probe that fails leaves
  its facts ``None`` (unknown) and the others still report.
- ``None`` and :data:`~ckpt.pins.ABSENT` are told apart with care. A GPU fact
  is ABSENT only when the host demonstrably has no NVIDIA GPU: NVML's library
  is missing or its driver is not loaded, *and* there is no ``/dev/nvidia<N>``
  device node, *and* torch sees no CUDA device. Any other failure is unknown,
  because a host whose driver is merely broken must not look like a CPU host.
- The result is cached per process (``host_facts.cache_clear()`` resets it).

The probes are module-level functions (``_probe_nvml``, ``_probe_cuda_driver``,
``_probe_cuda_runtime``, ``_probe_torch``, ``_probe_cpu``) each returning a
dict of field name to value, so tests can monkeypatch them to simulate hosts.

:func:`model_digest` and :func:`tokenizer_digest` identify a model directory
by content. Hashing a multi-GB weight directory takes a while, so per-file
hashes are cached in a JSON file keyed by the file's absolute path and stat
identity; an unchanged file is not read again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from ckpt.errors import ConfigError
from ckpt.pins import ABSENT, FactValue, HostFacts

__all__ = [
    "cpu_isa_from_flags",
    "host_facts",
    "model_digest",
    "tokenizer_digest",
]

log = logging.getLogger(__name__)

Probe = Callable[[], dict[str, FactValue]]

# ---------------------------------------------------------------------------
# Host facts
# ---------------------------------------------------------------------------

_GPU_FIELDS_ABSENT: Final[dict[str, FactValue]] = {
    "gpu_product": ABSENT,
    "gpu_compute_capability": ABSENT,
    "gpu_count": 0,
    "driver_version": ABSENT,
    "cuda_driver_version": ABSENT,
}


def _text(value: object) -> str:
    # Older nvidia-ml-py returns bytes for strings, newer returns str.
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").strip()
    return str(value).strip()


def _cuda_version_string(version: int) -> str:
    """``12040`` (CUDA's integer encoding) -> ``"12.4"``."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _join_distinct(values: Iterable[str]) -> str:
    # A uniform host gives one value; a mixed host gives a list that can never
    # equal a uniform host's value.
    return ",".join(sorted(set(values)))


def _gpu_device_nodes() -> bool:
    """True if any ``/dev/nvidia<N>`` node exists (a GPU is, or was meant to be, here)."""
    dev = Path("/dev")
    try:
        return any(p.name[len("nvidia") :].isdigit() for p in dev.glob("nvidia[0-9]*"))
    except OSError:
        # Cannot list /dev: we cannot prove there is no GPU.
        return True


def _gpu_absent() -> bool:
    """True only when this host demonstrably has no NVIDIA GPU.

    Called after NVML or the CUDA driver library could not be loaded. Only
    reached when there is no device node, so asking torch (which may
    initialise CUDA) costs nothing on a host that has a GPU.
    """
    if _gpu_device_nodes():
        return False
    try:  # late: torch is optional here (an agent image may have none) and slow to import
        import torch

        return not torch.cuda.is_available()
    except Exception:  # torch missing or broken: absence not proven
        log.debug("torch.cuda.is_available() failed", exc_info=True)
        return False


def _field(out: dict[str, FactValue], name: str, read: Callable[[], FactValue]) -> None:
    # One NVML call failing (NotSupported on an old GPU, say) must only make
    # its own fact unknown.
    try:
        out[name] = read()
    except Exception:
        log.debug("NVML: reading %s failed", name, exc_info=True)


def _probe_nvml() -> dict[str, FactValue]:
    """GPU product, compute capability, count and driver version from NVML."""
    try:  # late: NVML's bindings are optional (no GPU host needs them)
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded):
        return dict(_GPU_FIELDS_ABSENT) if _gpu_absent() else {}
    try:
        out: dict[str, FactValue] = {}
        _field(out, "driver_version", lambda: _text(pynvml.nvmlSystemGetDriverVersion()))
        # The CUDA version the driver supports, without initialising CUDA in
        # this process; the cuda-python probe is preferred when it runs.
        _field(
            out,
            "cuda_driver_version",
            lambda: _cuda_version_string(int(pynvml.nvmlSystemGetCudaDriverVersion())),
        )
        _field(out, "gpu_count", lambda: int(pynvml.nvmlDeviceGetCount()))
        count = out.get("gpu_count")
        if not isinstance(count, int):
            return out
        if count == 0:
            out["gpu_product"] = ABSENT
            out["gpu_compute_capability"] = ABSENT
            return out
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception:
            log.debug("NVML: device handles unavailable", exc_info=True)
            return out

        def names() -> str:
            return _join_distinct(_text(pynvml.nvmlDeviceGetName(h)) for h in handles)

        def capabilities() -> str:
            caps = (pynvml.nvmlDeviceGetCudaComputeCapability(h) for h in handles)
            return _join_distinct(f"{int(major)}.{int(minor)}" for major, minor in caps)

        _field(out, "gpu_product", names)
        _field(out, "gpu_compute_capability", capabilities)
        return out
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _driver_library_missing(exc: BaseException) -> bool:
    try:  # late: cuda-python's pathfinder exists only in its newer releases
        from cuda.pathfinder import DynamicLibNotFoundError
    except ImportError:  # older cuda-python: a plain error naming the library
        return "libcuda" in str(exc) or "not found" in str(exc).lower()
    return isinstance(exc, DynamicLibNotFoundError)


def _probe_cuda_driver() -> dict[str, FactValue]:
    """The CUDA version the installed driver supports (``cuDriverGetVersion``).

    ``cuDriverGetVersion`` needs no ``cuInit``, so this neither creates
    driver threads nor initialises CUDA in the agent process.
    """
    try:  # late: cuda-python is optional, and loads the driver library when imported
        from cuda.bindings import driver
    except ImportError:
        return {}
    try:
        err, version = driver.cuDriverGetVersion()
    except Exception as exc:
        if _driver_library_missing(exc) and _gpu_absent():
            return {"cuda_driver_version": ABSENT}
        raise
    if err != driver.CUresult.CUDA_SUCCESS:
        return {}
    return {"cuda_driver_version": _cuda_version_string(int(version))}


def _probe_cuda_runtime() -> dict[str, FactValue]:
    """The CUDA runtime the engine's kernels use.

    ``torch.version.cuda`` is preferred: the KV cache is written by the
    engine's torch, and cuda-python may bundle a different runtime. A CPU
    build of torch has none (ABSENT). Without torch, cuda-python's
    ``cudaRuntimeGetVersion`` is the best remaining answer.
    """
    try:  # late: the engine's torch, when there is one (slow to import, optional here)
        import torch
    except ImportError:
        from cuda.bindings import runtime  # late: cuda-python, the fallback

        err, version = runtime.cudaRuntimeGetVersion()
        if err != runtime.cudaError_t.cudaSuccess:
            return {}
        return {"cuda_runtime_version": _cuda_version_string(int(version))}
    cuda = torch.version.cuda
    if cuda:
        return {"cuda_runtime_version": str(cuda)}
    return {"cuda_runtime_version": ABSENT}


def _probe_torch() -> dict[str, FactValue]:
    import torch  # late: probed only when asked (slow to import)

    return {"torch_version": str(torch.__version__)}


def _read_cpu_flags(path: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The CPU feature flags every core has (x86 ``flags``, arm64 ``Features``).

    The intersection over cores, so a hybrid CPU reports only what any core
    can run. ``None`` if the file is unreadable or lists no flags.
    """
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    common: set[str] | None = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags = set(value.split())
            common = flags if common is None else common & flags
    return common


_X86_V4: Final = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
_X86_AMX: Final = frozenset({"amx_tile", "amx_bf16"})
_X86_V3: Final = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c"})
_X86_V2: Final = frozenset({"sse4_1", "sse4_2", "ssse3", "popcnt"})


def cpu_isa_from_flags(flags: set[str] | frozenset[str], arch: str) -> str:
    """The instruction-set level of a CPU, from its ``/proc/cpuinfo`` flags.

    x86_64 (also ``amd64``): ``"avx512+amx"`` (AVX-512 level plus AMX tiles
    with bf16), ``"avx512"`` (x86-64-v4: F, BW, CD, DQ, VL), ``"avx2"``
    (x86-64-v3's vector set: AVX, AVX2, FMA, BMI1/2, F16C), ``"sse4.2"``
    (x86-64-v2), else ``"x86-64"``.

    aarch64 (also ``arm64``): ``"sve2"``, ``"sve"``, ``"neon"`` (``asimd``),
    else ``"aarch64"``.

    Any other architecture: the architecture name, lower-cased. The CPU
    backend's page format depends on the vector width, hence levels rather
    than the raw flag list (which differs between CPU steppings and VMs
    without affecting it).
    """
    machine = arch.lower()
    if machine in ("x86_64", "amd64"):
        if flags >= _X86_V4:
            return "avx512+amx" if flags >= _X86_AMX else "avx512"
        if flags >= _X86_V3:
            return "avx2"
        if flags >= _X86_V2:
            return "sse4.2"
        return "x86-64"
    if machine in ("aarch64", "arm64"):
        if "sve2" in flags:
            return "sve2"
        if "sve" in flags:
            return "sve"
        if "asimd" in flags:
            return "neon"
        return "aarch64"
    return machine


def _probe_cpu() -> dict[str, FactValue]:
    arch = platform.machine()
    out: dict[str, FactValue] = {"cpu_arch": arch or None}
    flags = _read_cpu_flags()
    if arch and flags is not None:
        out["cpu_isa"] = cpu_isa_from_flags(flags, arch)
    return out


def _run_probe(name: str, probe: Probe) -> dict[str, FactValue]:
    try:
        result: object = probe()
    except Exception:
        log.warning("host fingerprint: probe %s failed; its facts are unknown", name, exc_info=True)
        return {}
    if not isinstance(result, dict):
        log.warning("host fingerprint: probe %s returned %r, not a dict", name, type(result))
        return {}
    return {str(k): v for k, v in result.items()}


@functools.cache
def host_facts(*, use_cuda: bool = True) -> HostFacts:
    """Probe this host. Never raises; facts that cannot be determined are ``None``.

    ``use_cuda=False`` skips the cuda-python driver probe (and so never loads
    ``libcuda`` in this process); the CUDA driver version then comes from
    NVML alone. Cached per process and per ``use_cuda``; call
    ``host_facts.cache_clear()`` to probe again.
    """
    # Probes are looked up at call time, so monkeypatched ones take effect.
    # Earlier probes take precedence: the first non-None value of a fact wins.
    probes: list[tuple[str, Probe]] = []
    if use_cuda:
        probes.append(("cuda_driver", _probe_cuda_driver))
    probes += [
        ("nvml", _probe_nvml),
        ("cuda_runtime", _probe_cuda_runtime),
        ("torch", _probe_torch),
        ("cpu", _probe_cpu),
    ]
    facts: dict[str, FactValue] = {}
    for name, probe in probes:
        for key, value in _run_probe(name, probe).items():
            if value is None or facts.get(key) is not None:
                continue
            # Validate field by field so one malformed value cannot void the rest.
            try:
                HostFacts.model_validate({key: value})
            except ValidationError:
                log.warning("host fingerprint: probe %s gave invalid %s=%r", name, key, value)
                continue
            facts[key] = value
    return HostFacts.model_validate(facts)


# ---------------------------------------------------------------------------
# Model and tokenizer digests
# ---------------------------------------------------------------------------

CHUNK_SIZE: Final = 8 * 1024 * 1024

_TOKENIZER_PATTERNS: Final = (
    "tokenizer*.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
)
_WEIGHT_PATTERNS: Final = ("*.safetensors", "*.bin", "*.pt", "*.gguf")
_CONFIG_PATTERNS: Final = ("*.json",)

_CACHE_VERSION: Final = 1
_CACHE_FILE_NAME: Final = "digests.json"

# A file modified within this window before it was hashed is not cached: a
# second write in the same timestamp tick, keeping the size, would leave its
# stat identity unchanged (git's "racily clean" problem).
_RACY_WINDOW_NS = 2_000_000_000


def _is_tokenizer_file(name: str) -> bool:
    return any(fnmatchcase(name, p) for p in _TOKENIZER_PATTERNS)


def _is_model_file(name: str) -> bool:
    if _is_tokenizer_file(name):
        return False
    return any(fnmatchcase(name, p) for p in (*_CONFIG_PATTERNS, *_WEIGHT_PATTERNS))


def _sha256_file(path: Path) -> str:
    """The hex sha256 of a file's content, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_SIZE)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _default_cache_path() -> Path:
    env = os.environ.get("GPUCKPT_CACHE_DIR")
    if env:
        return Path(env) / _CACHE_FILE_NAME
    import platformdirs  # late: only without GPUCKPT_CACHE_DIR

    return Path(platformdirs.user_cache_dir("gpuckpt")) / _CACHE_FILE_NAME


def _stat_key(st: os.stat_result) -> dict[str, int]:
    # ctime as well as mtime: a write that restores the old mtime (cp -p,
    # touch -d) still moves ctime, which no user can set.
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }


class _DigestCache:
    """Per-file sha256 cache in a JSON file, keyed by absolute path and stat identity.

    Best effort by design: an unreadable, corrupt or untrusted cache file is
    treated as empty and a failed write is logged, never raised: the cache
    only saves time, it never decides a digest. Entries are trusted only
    from a file this user owns that nobody else can write, since a forged
    entry would make modified weights look unchanged.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = self._load()
        self.dirty = False
        self.hits = 0
        self.misses = 0

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid != os.getuid() or st.st_mode & 0o022:
                    log.warning("ignoring digest cache %s: not private to this user", self.path)
                    return {}
                doc = json.loads(f.read())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            log.warning("ignoring unreadable digest cache %s", self.path, exc_info=True)
            return {}
        if not isinstance(doc, dict) or doc.get("version") != _CACHE_VERSION:
            return {}
        entries = doc.get("entries")
        if not isinstance(entries, dict):
            return {}
        return {k: v for k, v in entries.items() if isinstance(v, dict)}

    def lookup(self, key: str, st: os.stat_result) -> str | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        sha = entry.get("sha256")
        if not isinstance(sha, str) or len(sha) != 64:
            return None
        if any(entry.get(k) != v for k, v in _stat_key(st).items()):
            return None
        return sha

    def store(self, key: str, st: os.stat_result, sha: str) -> None:
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < _RACY_WINDOW_NS:
            return
        self.entries[key] = {**_stat_key(st), "sha256": sha}
        self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # Another agent on this host may have added entries since we
            # loaded: merge, ours winning. Lost updates only cost a re-hash.
            merged = {**self._load(), **self.entries}
            # Forget files that are gone, so the cache does not grow forever.
            merged = {k: v for k, v in merged.items() if os.path.exists(k)}
            data = json.dumps({"version": _CACHE_VERSION, "entries": merged}, sort_keys=True).encode()
            # mkstemp creates the file 0600; rename makes the swap atomic.
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self.dirty = False
        except OSError:
            log.warning("could not write digest cache %s", self.path, exc_info=True)


def _select_files(root: Path, select: Callable[[str], bool]) -> list[tuple[str, Path]]:
    """(relative POSIX name, path) of the selected regular files under ``root``, sorted.

    Hidden files and directories (``.git``, ``.cache/huggingface``) are tool
    metadata, not model content, and are skipped. Symlinked files (the
    Hugging Face cache's snapshots) are followed; symlinked directories are
    not, so a link loop cannot hang the walk.
    """
    found: list[tuple[str, Path]] = []

    def unreadable(exc: OSError) -> None:
        # os.walk would skip it silently, and the digest would quietly cover less.
        raise ConfigError(f"cannot list model directory {exc.filename}: {exc.strerror}") from exc

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for filename in filenames:
            if filename.startswith(".") or not select(filename):
                continue
            path = Path(dirpath) / filename
            found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    return found


def _file_sha256(path: Path, cache: _DigestCache) -> tuple[int, str]:
    """(size, hex sha256) of one file, from the cache when its stat identity is unchanged."""
    try:
        real = path.resolve(strict=True)
        key = str(real)
        before = real.stat()
        if not stat.S_ISREG(before.st_mode):
            raise ConfigError(f"model file {path} is not a regular file")
        cached = cache.lookup(key, before)
        if cached is not None:
            cache.hits += 1
            return before.st_size, cached
        cache.misses += 1
        for _attempt in range(2):
            sha = _sha256_file(real)
            after = real.stat()
            if _stat_key(after) == _stat_key(before):
                cache.store(key, after, sha)
                return after.st_size, sha
            before = after  # written to while we read it: once more
    except OSError as exc:
        raise ConfigError(f"cannot read model file {path}: {exc}") from exc
    raise ConfigError(f"model file {path} keeps changing while it is hashed")


def _digest(
    kind: str,
    path: str | os.PathLike[str],
    select: Callable[[str], bool],
    cache_path: Path | None,
) -> str | None:
    root = Path(path)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise ConfigError(f"model directory {root} {what}")
    files = _select_files(root, select)
    if not files:
        return None
    cache = _DigestCache(cache_path if cache_path is not None else _default_cache_path())
    try:
        entries = []
        for name, file in files:
            size, sha = _file_sha256(file, cache)
            entries.append([name, size, sha])
    finally:
        cache.save()
    # A canonical, unambiguous encoding (JSON: names may hold any character),
    # prefixed by the kind so a model and a tokenizer digest never collide.
    canonical = json.dumps(entries, ensure_ascii=False, separators=(",", ":"))
    outer = hashlib.sha256(f"gpuckpt {kind} digest v1\n{canonical}".encode())
    return "sha256:" + outer.hexdigest()


def model_digest(path: str | os.PathLike[str], *, cache_path: Path | None = None) -> str:
    """Identify a model by the content of its config and weight files.

    ``"sha256:<hex>"`` over the sorted (relative name, size, sha256) of every
    ``*.json`` (other than tokenizer files) and every ``*.safetensors``,
    ``*.bin``, ``*.pt`` and ``*.gguf`` under ``path``. Per-file hashes are
    cached in ``cache_path`` (default ``$GPUCKPT_CACHE_DIR/digests.json``, else
    the user cache directory), so unchanged files are not read again.

    Raises :class:`~ckpt.errors.ConfigError` when ``path`` is not a directory,
    holds none of those files, or a file cannot be read.
    """
    digest = _digest("model", path, _is_model_file, cache_path)
    if digest is None:
        raise ConfigError(f"model directory {path} holds no config or weight files")
    return digest


def tokenizer_digest(path: str | os.PathLike[str], *, cache_path: Path | None = None) -> str:
    """Identify a tokenizer by the content of its files.

    Like :func:`model_digest`, over ``tokenizer*.json``, ``tokenizer.model``,
    ``special_tokens_map.json``, ``added_tokens.json``, ``vocab.*``,
    ``merges.txt`` and ``*.tiktoken``. A directory with none of them gives
    :data:`~ckpt.pins.ABSENT` (the model carries no tokenizer files, e.g. a
    GGUF with an embedded vocabulary). Raises
    :class:`~ckpt.errors.ConfigError` when ``path`` is not a directory or a
    file cannot be read.
    """
    digest = _digest("tokenizer", path, _is_tokenizer_file, cache_path)
    return ABSENT if digest is None else digest
