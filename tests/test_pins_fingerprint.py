"""Pins models, the host fingerprint and the model/tokenizer digests."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import stat
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from pydantic import ValidationError

from ckpt import fingerprint
from ckpt.errors import ConfigError
from ckpt.fingerprint import cpu_isa_from_flags, host_facts, model_digest, tokenizer_digest
from ckpt.pins import ABSENT, HostFacts, Pins, WorkerFacts
from tests.harness.strategies import INT_FIELDS, pins_strategy


@pytest.fixture(autouse=True)
def _fresh_host_facts() -> Iterator[None]:
    host_facts.cache_clear()
    yield
    host_facts.cache_clear()


# --- Pins -----------------------------------------------------------------


@given(pins_strategy())
def test_pins_json_round_trip_is_exact(pins: Pins) -> None:
    doc = pins.model_dump(mode="json")
    assert Pins.model_validate(doc) == pins
    # Through actual JSON text too, as a manifest stores it.
    assert Pins.model_validate(json.loads(json.dumps(doc))) == pins
    assert Pins.model_validate_json(pins.model_dump_json()) == pins


def test_int_fields_are_exactly_the_non_string_facts() -> None:
    for model in (HostFacts, WorkerFacts):
        for name in model.model_fields:
            takes_str = True
            try:
                model.model_validate({name: "x"})
            except ValidationError:
                takes_str = False
            assert takes_str == (name not in INT_FIELDS), name


def test_worker_facts_default_to_unknown() -> None:
    assert all(v is None for v in WorkerFacts().model_dump().values())
    assert all(v is None for v in HostFacts().model_dump().values())


@pytest.mark.parametrize(
    "doc",
    [
        {"gpu_count": "8"},  # strict: no coercion from str
        {"gpu_count": True},  # strict: a bool is not a count
        {"gpu_count": -1},
        {"gpu_count": 1.0},
        {"gpu_product": 5},
        {"gpu_vendor": "nvidia"},  # extra keys are forbidden
    ],
)
def test_host_facts_reject_invalid(doc: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        HostFacts.model_validate(doc)


@pytest.mark.parametrize("doc", [{"block_size": 0}, {"rank": -1}, {"tensor_parallel_size": 0}])
def test_worker_facts_reject_invalid(doc: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        WorkerFacts.model_validate(doc)


def test_pins_are_frozen() -> None:
    pins = Pins(host=HostFacts(), worker=WorkerFacts())
    with pytest.raises(ValidationError):
        pins.host.gpu_count = 3


# --- cpu_isa_from_flags -----------------------------------------------------

_V2 = {"sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt"}
_V3 = _V2 | {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.parametrize(
    ("flags", "arch", "expected"),
    [
        (_V4 | {"amx_tile", "amx_bf16", "amx_int8"}, "x86_64", "avx512+amx"),
        (_V4 | {"amx_tile"}, "x86_64", "avx512"),  # tiles without bf16 do not count
        (_V4, "x86_64", "avx512"),
        (_V3 | {"avx512f"}, "x86_64", "avx2"),  # avx512f alone is not the v4 level
        (_V3, "x86_64", "avx2"),
        (_V3, "AMD64", "avx2"),
        (_V2 | {"avx", "avx2"}, "x86_64", "sse4.2"),  # avx2 without fma/bmi2
        (_V2, "x86_64", "sse4.2"),
        ({"sse", "sse2"}, "x86_64", "x86-64"),
        (set(), "x86_64", "x86-64"),
        ({"fp", "asimd", "sve", "sve2"}, "aarch64", "sve2"),
        ({"fp", "asimd", "sve"}, "aarch64", "sve"),
        ({"fp", "asimd"}, "arm64", "neon"),
        ({"fp"}, "aarch64", "aarch64"),
        ({"vsx"}, "ppc64le", "ppc64le"),
    ],
)
def test_cpu_isa_from_flags(flags: set[str], arch: str, expected: str) -> None:
    assert cpu_isa_from_flags(flags, arch) == expected


def test_read_cpu_flags_takes_the_intersection_over_cores(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: sse avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: sse avx2\n\n")
    assert fingerprint._read_cpu_flags(cpuinfo) == {"sse", "avx2"}
    assert fingerprint._read_cpu_flags(tmp_path / "missing") is None
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert fingerprint._read_cpu_flags(arm) == {"fp", "asimd", "sve"}


# --- host_facts on this host ------------------------------------------------


def _host_has_gpu() -> bool:
    import torch

    return any(Path("/dev").glob("nvidia[0-9]*")) or torch.cuda.is_available()


def _proc_cpuinfo_flags() -> set[str]:
    # Read independently of the code under test.
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    raise AssertionError("no flags line in /proc/cpuinfo")


def test_host_facts_on_this_host() -> None:
    import torch

    facts = host_facts()
    assert facts.torch_version == torch.__version__
    assert facts.cpu_arch == platform.machine()
    if Path("/proc/cpuinfo").exists():
        assert facts.cpu_isa == cpu_isa_from_flags(_proc_cpuinfo_flags(), platform.machine())
    if _host_has_gpu():
        assert isinstance(facts.gpu_count, int)
        assert facts.gpu_count >= 1
        assert facts.gpu_product not in (None, ABSENT)
    else:
        assert facts.gpu_product == ABSENT
        assert facts.gpu_compute_capability == ABSENT
        assert facts.gpu_count == 0
        assert facts.driver_version == ABSENT
        assert facts.cuda_driver_version == ABSENT
        if torch.version.cuda is None:
            assert facts.cuda_runtime_version == ABSENT


def test_host_facts_is_cached_until_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def probe() -> dict[str, object]:
        calls.append(1)
        return {"torch_version": f"2.4.{len(calls)}"}

    monkeypatch.setattr(fingerprint, "_probe_torch", probe)
    first = host_facts()
    assert host_facts() is first
    assert len(calls) == 1
    host_facts.cache_clear()
    assert host_facts().torch_version == "2.4.2"


# --- host_facts with simulated probes -----------------------------------------

H100 = {
    "gpu_product": "NVIDIA H100 80GB HBM3",
    "gpu_compute_capability": "9.0",
    "gpu_count": 8,
    "driver_version": "550.54.15",
    "cuda_driver_version": "12.4",
}


@pytest.fixture
def h100_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprint, "_probe_nvml", lambda: dict(H100))
    monkeypatch.setattr(fingerprint, "_probe_cuda_driver", lambda: {"cuda_driver_version": "12.4"})
    monkeypatch.setattr(fingerprint, "_probe_cuda_runtime", lambda: {"cuda_runtime_version": "12.1"})
    monkeypatch.setattr(fingerprint, "_probe_torch", lambda: {"torch_version": "2.4.0+cu121"})
    monkeypatch.setattr(fingerprint, "_probe_cpu", lambda: {"cpu_arch": "x86_64", "cpu_isa": "avx512+amx"})


@pytest.mark.usefixtures("h100_host")
def test_simulated_h100_host() -> None:
    assert host_facts() == HostFacts(
        gpu_product="NVIDIA H100 80GB HBM3",
        gpu_compute_capability="9.0",
        gpu_count=8,
        driver_version="550.54.15",
        cuda_driver_version="12.4",
        cuda_runtime_version="12.1",
        cpu_isa="avx512+amx",
        cpu_arch="x86_64",
        torch_version="2.4.0+cu121",
    )


@pytest.mark.usefixtures("h100_host")
def test_a_failing_probe_leaves_only_its_facts_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> dict[str, object]:
        raise RuntimeError("NVML: Unknown Error")

    monkeypatch.setattr(fingerprint, "_probe_nvml", broken)
    facts = host_facts()
    assert facts.gpu_product is None
    assert facts.gpu_compute_capability is None
    assert facts.gpu_count is None
    assert facts.driver_version is None
    # The other probes still report.
    assert facts.cuda_driver_version == "12.4"
    assert facts.cuda_runtime_version == "12.1"
    assert facts.torch_version == "2.4.0+cu121"
    assert facts.cpu_isa == "avx512+amx"


@pytest.mark.usefixtures("h100_host")
def test_every_probe_failing_gives_all_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> dict[str, object]:
        raise OSError("boom")

    for name in ("_probe_nvml", "_probe_cuda_driver", "_probe_cuda_runtime", "_probe_torch"):
        monkeypatch.setattr(fingerprint, name, broken)
    monkeypatch.setattr(fingerprint, "_probe_cpu", lambda: "not a dict")
    assert host_facts() == HostFacts()


@pytest.mark.usefixtures("h100_host")
def test_an_invalid_probe_value_is_dropped_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprint, "_probe_nvml", lambda: {**H100, "gpu_count": "eight", "bogus": 1})
    facts = host_facts()
    assert facts.gpu_count is None
    assert facts.gpu_product == "NVIDIA H100 80GB HBM3"


@pytest.mark.usefixtures("h100_host")
def test_cuda_driver_probe_wins_over_nvml_and_use_cuda_false_skips_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fingerprint, "_probe_nvml", lambda: {**H100, "cuda_driver_version": "12.2"})
    assert host_facts().cuda_driver_version == "12.4"

    def must_not_run() -> dict[str, object]:
        raise AssertionError("cuda-python probed with use_cuda=False")

    monkeypatch.setattr(fingerprint, "_probe_cuda_driver", must_not_run)
    assert host_facts(use_cuda=False).cuda_driver_version == "12.2"


# --- _probe_nvml against a fake pynvml ----------------------------------------


class _NVMLError(Exception):
    pass


class _LibraryNotFound(_NVMLError):
    pass


class _DriverNotLoaded(_NVMLError):
    pass


class _NotSupported(_NVMLError):
    pass


def _fake_pynvml(
    *,
    init_error: type[Exception] | None = None,
    names: list[str | bytes] | None = None,
    caps: list[tuple[int, int]] | None = None,
    caps_error: bool = False,
) -> types.SimpleNamespace:
    names = names if names is not None else []
    caps = caps if caps is not None else [(9, 0)] * len(names)
    fake = types.SimpleNamespace(shutdowns=0, inits=0)

    def init() -> None:
        fake.inits += 1
        if init_error is not None:
            raise init_error()

    def shutdown() -> None:
        fake.shutdowns += 1

    def cap(i: int) -> tuple[int, int]:
        if caps_error:
            raise _NotSupported()
        return caps[i]

    fake.NVMLError = _NVMLError
    fake.NVMLError_LibraryNotFound = _LibraryNotFound
    fake.NVMLError_DriverNotLoaded = _DriverNotLoaded
    fake.nvmlInit = init
    fake.nvmlShutdown = shutdown
    fake.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    fake.nvmlSystemGetCudaDriverVersion = lambda: 12040
    fake.nvmlDeviceGetCount = lambda: len(names)
    fake.nvmlDeviceGetHandleByIndex = lambda i: i
    fake.nvmlDeviceGetName = lambda i: names[i]
    fake.nvmlDeviceGetCudaComputeCapability = cap
    return fake


@pytest.fixture
def use_fake_pynvml(monkeypatch: pytest.MonkeyPatch) -> Callable[..., types.SimpleNamespace]:
    def install(**kwargs: Any) -> types.SimpleNamespace:
        fake = _fake_pynvml(**kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return install


def test_nvml_probe_reads_an_h100_host(use_fake_pynvml: Callable[..., Any]) -> None:
    fake = use_fake_pynvml(names=["NVIDIA H100 80GB HBM3"] * 8)
    assert fingerprint._probe_nvml() == H100
    assert fake.shutdowns == 1


def test_nvml_probe_mixed_gpus_give_a_sorted_list(use_fake_pynvml: Callable[..., Any]) -> None:
    use_fake_pynvml(
        names=["NVIDIA L4", b"NVIDIA A100-SXM4-80GB", "NVIDIA L4"],
        caps=[(8, 9), (8, 0), (8, 9)],
    )
    out = fingerprint._probe_nvml()
    assert out["gpu_product"] == "NVIDIA A100-SXM4-80GB,NVIDIA L4"
    assert out["gpu_compute_capability"] == "8.0,8.9"
    assert out["gpu_count"] == 3


def test_nvml_probe_one_failing_call_is_unknown_alone(
    use_fake_pynvml: Callable[..., Any],
) -> None:
    fake = use_fake_pynvml(names=["Tesla V100"], caps_error=True)
    out = fingerprint._probe_nvml()
    assert "gpu_compute_capability" not in out
    assert out["gpu_product"] == "Tesla V100"
    assert out["driver_version"] == "550.54.15"
    assert fake.shutdowns == 1


@pytest.mark.parametrize("error", [_LibraryNotFound, _DriverNotLoaded])
def test_nvml_missing_on_a_gpu_less_host_is_absent(
    use_fake_pynvml: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    use_fake_pynvml(init_error=error)
    monkeypatch.setattr(fingerprint, "_gpu_absent", lambda: True)
    assert fingerprint._probe_nvml() == {
        "gpu_product": ABSENT,
        "gpu_compute_capability": ABSENT,
        "gpu_count": 0,
        "driver_version": ABSENT,
        "cuda_driver_version": ABSENT,
    }


def test_nvml_missing_with_a_gpu_device_node_is_unknown(
    use_fake_pynvml: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A broken driver on a GPU host must not look like a CPU host.
    use_fake_pynvml(init_error=_DriverNotLoaded)
    monkeypatch.setattr(fingerprint, "_gpu_device_nodes", lambda: True)
    assert fingerprint._probe_nvml() == {}


def test_other_nvml_init_errors_are_unknown(
    use_fake_pynvml: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    use_fake_pynvml(init_error=_NVMLError)
    monkeypatch.setattr(fingerprint, "_gpu_absent", lambda: True)
    monkeypatch.setattr(fingerprint, "_probe_cuda_driver", dict)
    facts = host_facts()
    assert facts.gpu_product is None
    assert facts.gpu_count is None


def test_nvml_with_zero_gpus(use_fake_pynvml: Callable[..., Any]) -> None:
    use_fake_pynvml(names=[])
    out = fingerprint._probe_nvml()
    assert out["gpu_count"] == 0
    assert out["gpu_product"] == ABSENT
    assert out["driver_version"] == "550.54.15"


# --- _probe_cuda_driver ------------------------------------------------------


def test_cuda_driver_probe_formats_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda.bindings import driver

    monkeypatch.setattr(driver, "cuDriverGetVersion", lambda: (driver.CUresult.CUDA_SUCCESS, 12040))
    assert fingerprint._probe_cuda_driver() == {"cuda_driver_version": "12.4"}
    monkeypatch.setattr(driver, "cuDriverGetVersion", lambda: (driver.CUresult.CUDA_ERROR_UNKNOWN, 0))
    assert fingerprint._probe_cuda_driver() == {}


def test_cuda_driver_library_missing_depends_on_gpu_evidence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cuda.bindings import driver
    from cuda.pathfinder import DynamicLibNotFoundError

    def missing() -> tuple[object, int]:
        raise DynamicLibNotFoundError("libcuda.so.1 not found")

    monkeypatch.setattr(driver, "cuDriverGetVersion", missing)
    monkeypatch.setattr(fingerprint, "_gpu_absent", lambda: True)
    assert fingerprint._probe_cuda_driver() == {"cuda_driver_version": ABSENT}
    monkeypatch.setattr(fingerprint, "_gpu_absent", lambda: False)
    with pytest.raises(DynamicLibNotFoundError):
        fingerprint._probe_cuda_driver()  # host_facts turns this into unknown


@pytest.mark.parametrize(("version", "text"), [(12040, "12.4"), (11080, "11.8"), (13000, "13.0")])
def test_cuda_version_string(version: int, text: str) -> None:
    assert fingerprint._cuda_version_string(version) == text


# --- model and tokenizer digests --------------------------------------------

WEIGHTS = "model-00001-of-00002.safetensors"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 4096}')
    (d / "generation_config.json").write_text("{}")
    (d / "model.safetensors.index.json").write_text("{}")
    (d / WEIGHTS).write_bytes(os.urandom(64 * 1024))
    (d / "model-00002-of-00002.safetensors").write_bytes(os.urandom(1024))
    (d / "tokenizer.json").write_text('{"vocab": {}}')
    (d / "tokenizer_config.json").write_text("{}")
    (d / "special_tokens_map.json").write_text("{}")
    (d / "README.md").write_text("hello")
    (d / ".cache" / "huggingface").mkdir(parents=True)
    (d / ".cache" / "huggingface" / "x.json").write_text("{}")
    # Files made "now" are racily clean and never cached; date them back.
    old = time.time() - 3600
    for p in d.rglob("*"):
        os.utime(p, (old, old))
    return d


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "digests.json"


@pytest.fixture
def hash_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the name of every file whose content is actually read."""
    calls: list[str] = []
    real = fingerprint._sha256_file

    def counting(path: Path) -> str:
        calls.append(path.name)
        return real(path)

    monkeypatch.setattr(fingerprint, "_sha256_file", counting)
    # ctime cannot be dated back; accept files changed moments ago into the cache.
    monkeypatch.setattr(fingerprint, "_RACY_WINDOW_NS", 0)
    return calls


def test_model_digest_format_and_stability(model_dir: Path, cache: Path, tmp_path: Path) -> None:
    first = model_digest(model_dir, cache_path=cache)
    assert first.startswith("sha256:")
    assert len(first) == len("sha256:") + 64
    assert model_digest(model_dir, cache_path=cache) == first
    # A fresh cache computes the same digest.
    assert model_digest(model_dir, cache_path=tmp_path / "other.json") == first
    # Model and tokenizer digests never coincide.
    assert tokenizer_digest(model_dir, cache_path=cache) != first


def test_model_digest_covers_exactly_config_and_weights(model_dir: Path, cache: Path, hash_calls: list[str]) -> None:
    model_digest(model_dir, cache_path=cache)
    assert sorted(hash_calls) == sorted(
        [
            "config.json",
            "generation_config.json",
            "model.safetensors.index.json",
            WEIGHTS,
            "model-00002-of-00002.safetensors",
        ]
    )
    hash_calls.clear()
    tokenizer_digest(model_dir, cache_path=cache)
    assert sorted(hash_calls) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_the_digest_is_sha256_over_names_sizes_and_hashes(model_dir: Path, cache: Path) -> None:
    names = ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    entries = [
        [
            n,
            (model_dir / n).stat().st_size,
            hashlib.sha256((model_dir / n).read_bytes()).hexdigest(),
        ]
        for n in names
    ]
    canonical = json.dumps(entries, ensure_ascii=False, separators=(",", ":"))
    expected = hashlib.sha256(f"gpuckpt tokenizer digest v1\n{canonical}".encode()).hexdigest()
    assert tokenizer_digest(model_dir, cache_path=cache) == f"sha256:{expected}"


def test_unrelated_files_do_not_change_the_model_digest(model_dir: Path, cache: Path) -> None:
    model = model_digest(model_dir, cache_path=cache)
    tok = tokenizer_digest(model_dir, cache_path=cache)
    (model_dir / "README.md").write_text("changed")
    (model_dir / ".cache" / "huggingface" / "x.json").write_text('{"changed": 1}')
    (model_dir / "tokenizer.json").write_text('{"vocab": {"a": 1}}')
    assert model_digest(model_dir, cache_path=cache) == model
    assert tokenizer_digest(model_dir, cache_path=cache) != tok


def test_a_copy_elsewhere_has_the_same_digest(model_dir: Path, cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere" / "model"
    other.mkdir(parents=True)
    for p in model_dir.iterdir():
        if p.is_file():
            (other / p.name).write_bytes(p.read_bytes())
    assert model_digest(other, cache_path=cache) == model_digest(model_dir, cache_path=cache)


def test_symlinked_files_are_followed(model_dir: Path, cache: Path, tmp_path: Path) -> None:
    # The Hugging Face cache layout: snapshot names are links to blobs.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for p in model_dir.iterdir():
        if p.is_file():
            blob = blobs / hashlib.sha256(p.name.encode()).hexdigest()
            blob.write_bytes(p.read_bytes())
            (snapshot / p.name).symlink_to(blob)
    assert model_digest(snapshot, cache_path=cache) == model_digest(model_dir, cache_path=cache)


def test_renaming_a_weight_file_changes_the_digest(model_dir: Path, cache: Path) -> None:
    before = model_digest(model_dir, cache_path=cache)
    (model_dir / WEIGHTS).rename(model_dir / "model-00001-of-00003.safetensors")
    assert model_digest(model_dir, cache_path=cache) != before


def _flip_first_byte(path: Path) -> None:
    with path.open("r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))


def test_a_changed_weight_byte_is_seen_even_with_the_old_mtime(
    model_dir: Path, cache: Path, hash_calls: list[str]
) -> None:
    weights = model_dir / WEIGHTS
    before = model_digest(model_dir, cache_path=cache)
    st = weights.stat()
    time.sleep(0.05)  # so the write below lands in a later ctime tick
    _flip_first_byte(weights)
    # Same size, and the mtime put back as it was: only ctime tells.
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size
    assert weights.stat().st_mtime_ns == st.st_mtime_ns
    hash_calls.clear()
    changed = model_digest(model_dir, cache_path=cache)
    assert changed != before
    assert hash_calls == [WEIGHTS]
    # Then with the mtime bumped as an ordinary write leaves it.
    _flip_first_byte(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    hash_calls.clear()
    assert model_digest(model_dir, cache_path=cache) == before  # the content is back
    assert hash_calls == [WEIGHTS]


def test_unchanged_files_are_not_read_again(model_dir: Path, cache: Path, hash_calls: list[str]) -> None:
    model_digest(model_dir, cache_path=cache)
    assert len(hash_calls) == 5
    hash_calls.clear()
    model_digest(model_dir, cache_path=cache)
    assert hash_calls == []
    # Entries are per file, so another directory sharing nothing is hashed,
    # and this one still is not.
    tokenizer_digest(model_dir, cache_path=cache)
    assert len(hash_calls) == 3
    hash_calls.clear()
    tokenizer_digest(model_dir, cache_path=cache)
    model_digest(model_dir, cache_path=cache)
    assert hash_calls == []


def test_racily_clean_files_are_not_cached(model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With the default window, files changed just now (ctime: the fixture's
    # utime) are hashed on every call until they settle.
    calls: list[str] = []
    real = fingerprint._sha256_file

    def counting(path: Path) -> str:
        calls.append(path.name)
        return real(path)

    monkeypatch.setattr(fingerprint, "_sha256_file", counting)
    model_digest(model_dir, cache_path=cache)
    model_digest(model_dir, cache_path=cache)
    assert len(calls) == 10


def test_cache_file_is_private_and_valid_json(model_dir: Path, cache: Path, hash_calls: list[str]) -> None:
    model_digest(model_dir, cache_path=cache)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600
    doc = json.loads(cache.read_text())
    assert doc["version"] == 1
    entry = doc["entries"][str((model_dir / WEIGHTS).resolve())]
    assert entry["sha256"] == hashlib.sha256((model_dir / WEIGHTS).read_bytes()).hexdigest()
    assert entry["size"] == 64 * 1024
    # No temporary files left behind.
    assert [p.name for p in cache.parent.iterdir()] == ["digests.json"]


def test_cache_dir_from_environment(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hash_calls: list[str]
) -> None:
    monkeypatch.setenv("GPUCKPT_CACHE_DIR", str(tmp_path / "envcache"))
    model_digest(model_dir)
    assert (tmp_path / "envcache" / "digests.json").exists()
    hash_calls.clear()
    model_digest(model_dir)
    assert hash_calls == []


def test_corrupt_cache_is_ignored_and_rewritten(model_dir: Path, cache: Path, hash_calls: list[str]) -> None:
    digest = model_digest(model_dir, cache_path=cache)
    cache.write_text("{not json")
    os.chmod(cache, 0o600)
    hash_calls.clear()
    assert model_digest(model_dir, cache_path=cache) == digest
    assert len(hash_calls) == 5
    assert json.loads(cache.read_text())["version"] == 1


def test_forged_cache_entries_in_a_shared_file_are_not_trusted(
    model_dir: Path, cache: Path, hash_calls: list[str]
) -> None:
    digest = model_digest(model_dir, cache_path=cache)
    # Someone else could have written a group-writable cache: a forged sha
    # would make changed weights look unchanged.
    doc = json.loads(cache.read_text())
    for entry in doc["entries"].values():
        entry["sha256"] = "0" * 64
    cache.write_text(json.dumps(doc))
    os.chmod(cache, 0o664)
    hash_calls.clear()
    assert model_digest(model_dir, cache_path=cache) == digest
    assert len(hash_calls) == 5


def test_entries_of_deleted_files_are_pruned(model_dir: Path, cache: Path, hash_calls: list[str]) -> None:
    model_digest(model_dir, cache_path=cache)
    gone = str((model_dir / WEIGHTS).resolve())
    (model_dir / WEIGHTS).unlink()
    # Pruned when the cache is next written, i.e. when some file was hashed.
    (model_dir / "config.json").write_text('{"hidden_size": 8192}')
    model_digest(model_dir, cache_path=cache)
    assert gone not in json.loads(cache.read_text())["entries"]


def test_an_unwritable_cache_does_not_fail_the_digest(model_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the cache directory should be
    assert model_digest(model_dir, cache_path=blocker / "digests.json").startswith("sha256:")


def test_large_files_are_hashed_in_chunks(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    data = os.urandom(fingerprint.CHUNK_SIZE * 2 + 12345)
    big.write_bytes(data)
    assert fingerprint._sha256_file(big) == hashlib.sha256(data).hexdigest()


def test_missing_directory_raises_config_error(tmp_path: Path, cache: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match="no-such-model"):
        model_digest(missing, cache_path=cache)
    with pytest.raises(ConfigError, match="no-such-model"):
        tokenizer_digest(missing, cache_path=cache)


def test_a_file_instead_of_a_directory_raises_config_error(tmp_path: Path, cache: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="not a directory"):
        model_digest(f, cache_path=cache)


def test_a_directory_without_model_files(tmp_path: Path, cache: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    (d / "README.md").write_text("nothing here")
    with pytest.raises(ConfigError, match="no config or weight files"):
        model_digest(d, cache_path=cache)
    assert tokenizer_digest(d, cache_path=cache) == ABSENT


def test_an_unreadable_model_file_raises_config_error(model_dir: Path, cache: Path) -> None:
    (model_dir / "dangling.safetensors").symlink_to(model_dir / "nowhere")
    with pytest.raises(ConfigError, match=r"dangling\.safetensors"):
        model_digest(model_dir, cache_path=cache)


@pytest.mark.parametrize(
    ("name", "model", "tokenizer"),
    [
        ("config.json", True, False),
        ("model.safetensors", True, False),
        ("pytorch_model-00001-of-00002.bin", True, False),
        ("consolidated.pt", True, False),
        ("model-q4.gguf", True, False),
        ("tokenizer.json", False, True),
        ("tokenizer_config.json", False, True),
        ("tokenizer.model", False, True),
        ("special_tokens_map.json", False, True),
        ("added_tokens.json", False, True),
        ("vocab.json", False, True),
        ("vocab.txt", False, True),
        ("merges.txt", False, True),
        ("cl100k_base.tiktoken", False, True),
        ("README.md", False, False),
        ("LICENSE", False, False),
    ],
)
def test_file_selection(name: str, model: bool, tokenizer: bool) -> None:
    assert fingerprint._is_model_file(name) == model
    assert fingerprint._is_tokenizer_file(name) == tokenizer


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_an_unreadable_subdirectory_raises_config_error(model_dir: Path, cache: Path) -> None:
    sub = model_dir / "original"
    sub.mkdir()
    (sub / "params.json").write_text("{}")
    sub.chmod(0)
    try:
        with pytest.raises(ConfigError, match="original"):
            model_digest(model_dir, cache_path=cache)
    finally:
        sub.chmod(0o700)


def test_the_walk_error_handler_raises_config_error(
    model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_walk = os.walk

    def failing_walk(top: Any, onerror: Any = None, **kw: Any) -> Any:
        onerror(PermissionError(13, "Permission denied", str(Path(top) / "original")))
        return real_walk(top, onerror=onerror, **kw)

    monkeypatch.setattr(os, "walk", failing_walk)
    with pytest.raises(ConfigError, match="original"):
        model_digest(model_dir, cache_path=cache)


def test_subdirectories_are_included(model_dir: Path, cache: Path) -> None:
    before = model_digest(model_dir, cache_path=cache)
    sub = model_dir / "original"
    sub.mkdir()
    (sub / "params.json").write_text("{}")
    assert model_digest(model_dir, cache_path=cache) != before
