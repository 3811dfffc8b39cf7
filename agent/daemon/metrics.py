"""The agent's Prometheus metrics (``/metrics`` on ``metrics_address``, off by default).

One registry per agent (not the process-global one), so tests and embedders
can run several. Names follow Prometheus conventions: ``_total`` counters,
``_seconds`` and ``_bytes`` units.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from agent.engines.types import CheckpointStats
from ckpt.manifest import Sizes

_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, worker_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.checkpoints = Counter(
            "gpuckpt_checkpoints_total", "Checkpoints by trigger and outcome", ["trigger", "outcome"], registry=r
        )
        self.restores = Counter(
            "gpuckpt_restores_total",
            "Restores by outcome (warm, cold, failed) and reason",
            ["outcome", "reason"],
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "gpuckpt_checkpoint_duration_seconds", "Checkpoint wall time", buckets=_DURATION_BUCKETS, registry=r
        )
        self.restore_seconds = Histogram(
            "gpuckpt_restore_duration_seconds",
            "Restore planning and staging time",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.pause_seconds = Histogram(
            "gpuckpt_worker_pause_seconds",
            "Engine time spent copying pages for a capture",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.precopy_bytes = Counter(
            "gpuckpt_precopy_bytes_total", "Raw KV bytes stored ahead of checkpoints by pre-copies", registry=r
        )
        self.staging_peak = Gauge(
            "gpuckpt_capture_staging_peak_bytes", "Peak host staging of the last capture", registry=r
        )
        self.bytes_written = Counter("gpuckpt_bytes_written_total", "Bytes uploaded (after compression)", registry=r)
        self.bytes_deduplicated = Counter(
            "gpuckpt_bytes_deduplicated_total", "Raw KV bytes not uploaded because the repository had them", registry=r
        )
        self.compression_ratio = Gauge(
            "gpuckpt_compression_ratio", "Raw ÷ stored bytes of the last checkpoint", registry=r
        )
        self.last_good = Gauge(
            "gpuckpt_last_checkpoint_timestamp_seconds", "Unix time of the last good checkpoint", registry=r
        )
        self.last_good_age = Gauge(
            "gpuckpt_last_checkpoint_age_seconds", "Seconds since the last good checkpoint", registry=r
        )
        self.info = Gauge("gpuckpt_agent_info", "The agent's worker id", ["worker_id"], registry=r)
        self.info.labels(worker_id=worker_id).set(1)
        self._last_good: float | None = None
        self.last_good_age.set_function(self._age)

    def _age(self) -> float:
        return float("nan") if self._last_good is None else time.time() - self._last_good

    def checkpoint_done(self, trigger: str, *, seconds: float, stats: CheckpointStats, sizes: Sizes) -> None:
        """A checkpoint of ``trigger`` saved in ``seconds`` (its capture's pause and staging in ``stats``)."""
        self.checkpoints.labels(trigger=trigger, outcome="ok").inc()
        self.checkpoint_seconds.observe(seconds)
        self.pause_seconds.observe(stats.get("copy_s", 0.0))
        if stats.get("staged_peak_bytes") is not None:
            self.staging_peak.set(float(stats["staged_peak_bytes"]))
        self.bytes_written.inc(sizes.new_stored_bytes)
        self.bytes_deduplicated.inc(max(0, sizes.raw_bytes - sizes.new_raw_bytes))
        if sizes.stored_bytes:
            self.compression_ratio.set(sizes.raw_bytes / sizes.stored_bytes)
        self._last_good = time.time()
        self.last_good.set(self._last_good)

    def serve(self, address: str) -> Any:
        host, _, port = address.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
        return server
