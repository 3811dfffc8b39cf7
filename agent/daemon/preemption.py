"""Preemption notices, each cloud's as it documents them.

A :class:`NoticeSource` is polled by the agent's scheduler; :meth:`NoticeSource.poll` returns a
:class:`Notice` or ``None``. A malformed, unreachable or refusing metadata service is never a
notice (it is logged once per kind of trouble): a notice starts the final checkpoint and stops
everything else, so only the provider's own "this instance is going away" counts.

=========  ==========================================================================================
provider   protocol
=========  ==========================================================================================
``gce``    ``GET computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google`` (403
           without it): the body ``TRUE`` is the notice, ``FALSE`` is none. For GPU VMs, which
           terminate on host maintenance, ``instance/maintenance-event`` answering
           ``TERMINATE_ON_HOST_MAINTENANCE`` is one too. Notice: 30 s (15 s for GKE pods).
``aws``    IMDSv2: ``PUT latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` (kept
           until it nearly expires), then ``GET latest/meta-data/spot/instance-action`` with
           ``X-aws-ec2-metadata-token``: 404 until a notice, then JSON ``{"action", "time"}``.
           ``events/recommendations/rebalance`` (JSON ``{"noticeTime"}``) is an *early* signal:
           a checkpoint, not a preemption. Notice: 2 min.
``azure``  Scheduled Events: ``GET metadata/scheduledevents?api-version=2020-07-01`` with
           ``Metadata: true``: JSON ``{"DocumentIncarnation", "Events": [...]}``; an event of type
           ``Preempt``, ``Terminate``, ``Reboot`` or ``Redeploy`` is the notice. Once the
           checkpoint is done it is acknowledged (``POST`` of ``{"StartRequests": [{"EventId"}]}``),
           so the platform need not wait out the notice. Notice: at least 30 s.
``url``    any URL answering 200 (a notice) or anything else (none), as before.
``file``   a file that appears.
=========  ==========================================================================================
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("gpuckpt.preemption")

#: the metadata services' addresses (tests and proxies set another ``metadata_url``)
DEFAULT_METADATA = {
    "gce": "http://metadata.google.internal",
    "aws": "http://169.254.169.254",
    "azure": "http://169.254.169.254",
}
#: the interval each provider recommends polling at, or that fits its notice window
RECOMMENDED_POLL_S = {"gce": 1.0, "aws": 5.0, "azure": 1.0, "url": 5.0, "file": 1.0}
GCE_TERMINATING = ("TERMINATE_ON_HOST_MAINTENANCE",)
AZURE_GOING = ("Preempt", "Terminate", "Reboot", "Redeploy")
AWS_TOKEN_TTL_S = 21600
TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Notice:
    """A notice: ``final`` (the instance is going away: a preemption) or an early signal (a
    checkpoint now, nothing more); ``detail`` says what the provider said."""

    provider: str
    detail: str
    final: bool = True
    #: what acknowledges it once the checkpoint is done (Azure's event ids)
    ack: tuple[str, ...] = ()


@dataclass
class NoticeSource:
    """One provider's notices. ``poll`` never raises."""

    provider: str
    metadata_url: str | None = None
    url: str | None = None
    file: Path | None = None
    timeout: float = TIMEOUT_S
    _token: str | None = None
    _token_until: float = 0.0
    _warned: set[str] = field(default_factory=set)

    @property
    def base(self) -> str:
        return (self.metadata_url or DEFAULT_METADATA.get(self.provider, "")).rstrip("/")

    def poll(self) -> Notice | None:
        try:
            return getattr(self, f"_poll_{self.provider}")()  # type: ignore[no-any-return]
        except (OSError, ValueError, KeyError, TypeError) as exc:  # unreachable, malformed: never a notice
            self._warn(type(exc).__name__, f"{self.provider} metadata: {exc}")
            return None

    def acknowledge(self, notice: Notice) -> None:
        """Tell the provider the instance is ready to go (Azure: start the events now)."""
        if self.provider != "azure" or not notice.ack:
            return
        body = json.dumps({"StartRequests": [{"EventId": e} for e in notice.ack]}).encode()
        try:
            self._request("POST", self._azure_url(), {"Metadata": "true", "Content-Type": "application/json"}, body)
            log.info("acknowledged the scheduled events", extra={"events": list(notice.ack)})
        except OSError as exc:
            log.warning("could not acknowledge the scheduled events", extra={"error": str(exc)})

    # -- providers --

    def _poll_file(self) -> Notice | None:
        if self.file is not None and self.file.exists():
            return Notice("file", f"file {self.file}")
        return None

    def _poll_url(self) -> Notice | None:
        assert self.url is not None
        status, body = self._request("GET", self.url, {})
        return Notice("url", f"url {self.url}: {body[:200]}") if status == 200 else None

    def _poll_gce(self) -> Notice | None:
        h = {"Metadata-Flavor": "Google"}
        status, body = self._request("GET", f"{self.base}/computeMetadata/v1/instance/preempted", h)
        if status == 200 and body.strip() == "TRUE":
            return Notice("gce", "instance/preempted: TRUE")
        if status != 200 or body.strip() not in ("TRUE", "FALSE"):
            self._warn(f"gce-{status}", f"gce metadata answered {status}: {body[:80]!r} (not a notice)")
        status, body = self._request("GET", f"{self.base}/computeMetadata/v1/instance/maintenance-event", h)
        if status == 200 and body.strip() in GCE_TERMINATING:
            return Notice("gce", f"instance/maintenance-event: {body.strip()}")
        return None

    def _poll_aws(self) -> Notice | None:
        token = self._aws_token()
        h = {"X-aws-ec2-metadata-token": token}
        status, body = self._request("GET", f"{self.base}/latest/meta-data/spot/instance-action", h)
        if status == 401:
            self._token = None  # expired or revoked: a new one next time
        if status == 200:
            doc = json.loads(body)
            if not isinstance(doc, dict) or "action" not in doc:
                raise ValueError(f"spot/instance-action is not a notice: {body[:80]!r}")
            return Notice("aws", f"spot/instance-action: {doc['action']} at {doc.get('time')}")
        status, body = self._request("GET", f"{self.base}/latest/meta-data/events/recommendations/rebalance", h)
        if status == 200:
            doc = json.loads(body)
            if isinstance(doc, dict) and "noticeTime" in doc:
                return Notice("aws", f"rebalance recommendation at {doc['noticeTime']}", final=False)
        return None

    def _aws_token(self) -> str:
        if self._token is None or time.monotonic() > self._token_until:
            h = {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}
            status, body = self._request("PUT", f"{self.base}/latest/api/token", h, b"")
            if status != 200 or not body.strip():
                raise ValueError(f"IMDSv2 token request answered {status}")
            self._token, self._token_until = body.strip(), time.monotonic() + AWS_TOKEN_TTL_S - 60
        return self._token

    def _azure_url(self) -> str:
        return f"{self.base}/metadata/scheduledevents?api-version=2020-07-01"

    def _poll_azure(self) -> Notice | None:
        status, body = self._request("GET", self._azure_url(), {"Metadata": "true"})
        if status != 200:
            raise ValueError(f"scheduled events answered {status}")
        doc = json.loads(body)
        events: list[dict[str, Any]] = doc["Events"]
        going = [e for e in events if isinstance(e, dict) and e.get("EventType") in AZURE_GOING]
        if not going:
            return None
        kinds = ", ".join(f"{e.get('EventType')} {e.get('EventId')} not before {e.get('NotBefore')}" for e in going)
        return Notice("azure", f"scheduled events: {kinds}", ack=tuple(str(e["EventId"]) for e in going))

    # -- plumbing --

    def _request(self, method: str, url: str, headers: dict[str, str], data: bytes | None = None) -> tuple[int, str]:
        req = urllib.request.Request(url, data=data, headers=headers, method=method)  # noqa: S310 - configured
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:  # noqa: S310 - configured URL
                return int(r.status), r.read(64 << 10).decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read(4096).decode(errors="replace")

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)


def source(
    provider: str | None, *, metadata_url: str | None, url: str | None, file: Path | None
) -> NoticeSource | None:
    """The configured source (``provider`` unset: the ``url`` or ``file`` setting, as before)."""
    if provider is None:
        provider = "url" if url else "file" if file else None
    if provider is None:
        return None
    return NoticeSource(provider, metadata_url=metadata_url, url=url, file=file)
