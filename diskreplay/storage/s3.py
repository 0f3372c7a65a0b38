"""A store's files as objects under ``s3://bucket/prefix``, through obstore.

Why obstore: the lowest per-request cost of the clients measured
(``python tools/s3_clients.py``; numbers in docs/BENCHMARKS.md); it offers
create-if-absent (``mode="create"``, sent as ``If-None-Match: *``) with a
distinct exception for "already exists", which pyarrow.fs does not offer at
all and s3fs reports as a plain ``OSError(EINVAL)``; it fetches many ranges
of one object concurrently (``get_ranges``); and it retries transient errors
(5xx, dropped connections, timeouts) with exponential backoff and jitter
under a time bound, in Rust, without an event loop of its own.

One module: the whole Storage and Publisher contract over S3's conditional
requests (its page cache is :mod:`.cache`).

Guarantees kept on object storage:

- Every object is written by one PUT, so it is visible whole or not at all; an
  interrupted upload leaves nothing (objects over ``multipart_threshold``,
  4 GiB by default, use a multipart upload, which is also invisible until
  completed).
- Nothing relies on rename (S3 has none) or on listing being consistent:
  ``list`` is for maintenance; commits are decided by conditional PUTs.
- ``put_if_absent`` is a conditional PUT. A conditional PUT that succeeded
  but whose response was lost is retried by the client and then reports
  "already exists": so when the object exists, its bytes are compared with
  ours and equal bytes count as our success (a manifest names its writer, so
  equal bytes mean the same commit).
"""

from __future__ import annotations

import datetime
import errno
import os
import random
import re
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .._fileio import crash_point, run_concurrently
from ..errors import (CommitConflictError, ConditionalWriteError, CorruptStoreError, MissingDependencyError,
                      ObjectStoreError)
from .cache import ObjectCache, fetch_into
from .base import DEFAULT_CACHE_BYTES, Buffer, Publisher, check_range, check_rel

_UPDATE_TRIES = 64  # lost races of a read-modify-write of the floor before it gives up (see update_small)
_PROBED: set = set()  # endpoints whose conditional writes passed the probe in this process
_OWN_OPTIONS = ("allow_http", "retry_timeout", "max_retries", "connect_timeout", "timeout",
                "multipart_threshold")
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                     "InvalidToken", "AuthorizationHeaderMalformed"}
_NOT_SUPPORTED_CODES = {"NotImplemented", "InvalidArgument", "InvalidRequest"}
_CONDITIONAL_FIX = ("every commit to a store in an object store is a conditional PUT: use a server with atomic "
                    "conditional writes (AWS S3, recent MinIO, seaweedfs 4.48+, Ceph RGW 18+, Cloudflare R2), "
                    "or keep the store on a local or shared filesystem")


def _obstore():
    try:
        import obstore
        import obstore.exceptions
        import obstore.store
    except ImportError as exc:
        raise MissingDependencyError(f"s3:// stores need the 'obstore' package, which is not installed "
                                     f"({exc}); install it with: pip install 'diskreplay[s3]'") from None
    return obstore


def _s3_code(exc: BaseException) -> Optional[str]:
    """The S3 error code (``<Code>NoSuchBucket</Code>``) the server sent, if any.

    obstore keeps the response body in its message but has no field for the
    code; this is protocol parsing of the server's XML, not matching on text
    of our own.
    """
    m = re.search(r"<Code>([A-Za-z]+)</Code>", str(exc))
    return m.group(1) if m else None


def _http_status(exc: BaseException) -> Optional[int]:
    m = re.search(r"status code: (\d{3})", str(exc))
    return int(m.group(1)) if m else None


def _conflicting_write(exc: BaseException) -> bool:
    """A conditional write answered 409 (``ConditionalRequestConflict``): it raced another
    conditional write of the same key and was not applied; unlike 412 it says nothing about
    whether the key exists, so it is retried."""
    return _http_status(exc) == 409 or _s3_code(exc) == "ConditionalRequestConflict"


def _short(exc: BaseException) -> str:
    text = str(exc).split("Debug source", 1)[0]
    text = re.sub(r"<\?xml.*", "", text, flags=re.S)
    return " ".join(text.split())[:240]


def _address(endpoint: str) -> Optional[Tuple[str, int]]:
    """``(host, port)`` of an ``http(s)://`` endpoint (None for the default AWS one).

    >>> _address("http://127.0.0.1:8333"), _address("https://s3.example.com/"), _address("the default AWS endpoint")
    (('127.0.0.1', 8333), ('s3.example.com', 443), None)
    """
    import urllib.parse

    parts = urllib.parse.urlsplit(str(endpoint))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port
    except ValueError:
        return None  # (the client reports a bad port)
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _proxied(endpoint: str, host: str) -> bool:
    """Whether the client reaches ``endpoint`` through a proxy (``HTTP(S)_PROXY``, as it reads them):
    then a refused direct connection says nothing."""
    import urllib.request

    return bool(urllib.request.getproxies().get(endpoint.split(":", 1)[0])) and not urllib.request.proxy_bypass(host)


def _flag(value: Any) -> bool:
    """A boolean option given as a bool or as text (``--storage-option allow_http=false``)."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")


def parse_s3_url(url: str) -> Tuple[str, str]:
    """Split ``s3://bucket/prefix`` into ``(bucket, prefix)`` (prefix without slashes at its ends).

    >>> parse_s3_url("s3://runs/grpo/store")
    ('runs', 'grpo/store')
    >>> parse_s3_url("s3://runs")
    ('runs', '')
    """
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ObjectStoreError(f"{url!r} is not an s3:// URL; expected s3://BUCKET or s3://BUCKET/PREFIX")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise ObjectStoreError(f"{url} names no bucket; expected s3://BUCKET or s3://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    if prefix:
        check_rel(prefix)
    return bucket, prefix


class S3Storage(Publisher):
    """The storage interface over ``s3://bucket/prefix`` in any S3-compatible store.

    ``storage_options`` are obstore's S3 settings (``endpoint``,
    ``access_key_id``, ``secret_access_key``, ``region``, ``session_token``,
    ...); anything not given comes from the usual ``AWS_*`` environment
    variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``). Also accepted:
    ``retry_timeout`` (seconds a request is retried for, default 30; an endpoint that refuses
    connections before it ever took one is refused at once),
    ``max_retries`` (default 100), ``connect_timeout`` / ``timeout`` (seconds),
    ``allow_http`` (default: true when the endpoint is ``http://``) and
    ``multipart_threshold`` (bytes, default 4 GiB).

    Immutable objects (segments, group sidecars) are read through a bounded
    local cache (``cache_dir``, ``cache_bytes``): :meth:`local_path` gives a
    whole local copy, :meth:`fetch_ranges` fills just the byte ranges a
    batch needs into a sparse local file, both memory-mappable.

    >>> try:
    ...     S3Storage("gs://bucket/x")
    ... except ObjectStoreError as exc:
    ...     print(exc)
    'gs://bucket/x' is not an s3:// URL; expected s3://BUCKET or s3://BUCKET/PREFIX
    """

    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]] = None, *,
                 cache_dir: Optional[str] = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 coalesce_bytes: int = 8 << 10, align: int = 8192) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self._init_args = (url, dict(storage_options or {}), cache_dir, cache_bytes, coalesce_bytes, align)
        ob = _obstore()
        self._ob = ob
        self._exc = ob.exceptions
        opts = dict(storage_options or {})
        own = {k: opts.pop(k) for k in _OWN_OPTIONS if k in opts}
        if "endpoint_url" in opts:  # boto3's and s3fs's name for it
            opts["endpoint"] = opts.pop("endpoint_url")
        self.endpoint = (opts.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL")
                         or os.environ.get("AWS_ENDPOINT") or "the default AWS endpoint")
        def integer(value: Any) -> int:  # "1e6" from the command line too
            try:
                return int(value)
            except (TypeError, ValueError):
                f = float(value)
                if not f.is_integer():
                    raise
                return int(f)

        def number(key: str, default: Any, kind: Callable[[Any], Any]) -> Any:
            value = own.get(key, default)
            try:
                out = kind(value)
            except (TypeError, ValueError):
                out = None
            if out is None or out < 0:
                raise ObjectStoreError(f"{self.url}: storage option {key}={value!r} is not a non-negative "
                                       f"{'integer' if kind is integer else 'number'}")
            return out

        self.retry_timeout = number("retry_timeout", 30.0, float)
        self.multipart_threshold = number("multipart_threshold", 4 << 30, integer)
        client_options: Dict[str, Any] = {
            "allow_http": _flag(own.get("allow_http", str(self.endpoint).startswith("http://")))}
        if not client_options["allow_http"] and str(self.endpoint).startswith("http://"):
            raise ObjectStoreError(f"{self.url}: the endpoint {self.endpoint} is plain HTTP but allow_http is "
                                   "false; use an https:// endpoint, or allow_http=true for a server without TLS")
        for key in ("connect_timeout", "timeout"):
            if key in own:
                client_options[key] = datetime.timedelta(seconds=number(key, None, float))
        retry_config = {
            # retry_timeout is the bound that matters (backoff jitter makes 10
            # retries last anywhere from 1 to 20 s); a seaweedfs restart takes ~4 s.
            "max_retries": number("max_retries", 100, integer),
            "retry_timeout": datetime.timedelta(seconds=self.retry_timeout),
            "backoff": {"init_backoff": datetime.timedelta(milliseconds=50),
                        "max_backoff": datetime.timedelta(seconds=2), "base": 2},
        }
        try:
            self._store = ob.store.S3Store(self.bucket, prefix=self.prefix or None,
                                           client_options=client_options, retry_config=retry_config,
                                           **opts)
        except (self._exc.BaseError, TypeError, ValueError) as exc:
            raise ObjectStoreError(f"{self.url}: storage_options are not usable ({_short(exc)}); "
                                   f"accepted: obstore's S3 settings (endpoint, access_key_id, "
                                   f"secret_access_key, region, ...) and {', '.join(_OWN_OPTIONS)}") from None
        self.coalesce_bytes = int(coalesce_bytes)
        #: the ETags of the objects this writer uploaded for the commit in progress (see delete_own)
        self._own_etags: Dict[str, str] = {}
        #: whether the last publish got as far as its manifest's PUT (see Committer._publish)
        self.link_attempted = False
        self._page_cache = ObjectCache(cache_dir, cache_bytes, self.url, align=align)
        self._clock: Optional[Tuple[float, float]] = None  # (server's Date - time.time(), when measured)
        address = _address(self.endpoint)
        #: the endpoint's (host, port) until a connection to it opened (see _contact)
        self._uncontacted = None if address is None or _proxied(str(self.endpoint), address[0]) else address

    def _contact(self) -> None:
        """Before the first request: refuse at once an endpoint that refuses connections. The client
        retries a refused connection like a dropped one, for ``retry_timeout`` (30 s): right for a
        server restarting under a running writer, but before the endpoint ever took a connection it is
        a wrong endpoint or a server not running. A connection that times out, a name not resolved
        now, are left to the client's retries."""
        address = self._uncontacted
        if address is None:
            return
        try:
            socket.create_connection(address, timeout=min(2.0, self.retry_timeout or 2.0)).close()
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH):
                why = ("connection refused: nothing listens at" if exc.errno == errno.ECONNREFUSED
                       else f"{exc.strerror.lower()}:")
                raise ObjectStoreError(
                    f"{self.url}: cannot reach the object store at {self.endpoint} ({why} {address[0]}:{address[1]}); "
                    "check that the server is running and that AWS_ENDPOINT_URL (or storage_options['endpoint']) "
                    "names it") from None
        self._uncontacted = None

    # -- errors ---------------------------------------------------------------

    def _url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def _error(self, exc: BaseException, op: str, rel: str) -> BaseException:
        """One clear exception for a failed request (naming the URL and the fix)."""
        url = self._url_of(rel)
        code = _s3_code(exc)
        if code == "NoSuchBucket":
            return ObjectStoreError(f"{url}: the bucket {self.bucket!r} does not exist at {self.endpoint}; "
                                    "create it first, or fix the bucket name in the URL")
        if isinstance(exc, FileNotFoundError):
            return FileNotFoundError(errno.ENOENT, "no such object in the store", url)
        if code in _CREDENTIAL_CODES or isinstance(exc, (self._exc.PermissionDeniedError,
                                                          self._exc.UnauthenticatedError)):
            return ObjectStoreError(
                f"{url}: the server at {self.endpoint} refused the credentials for {op} "
                f"({code or type(exc).__name__}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                "storage_options access_key_id / secret_access_key) to a key allowed to use this bucket")
        if "169.254.169.254" in str(exc):
            # no key given: the client asked the cloud instance metadata service for one
            return ObjectStoreError(
                f"{url}: no credentials for {self.endpoint} ({op}): none was given, and this machine has no "
                "cloud instance role to take one from; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                "storage_options access_key_id / secret_access_key)")
        if code is None and _http_status(exc) is None:
            return ObjectStoreError(
                f"{url}: cannot reach the object store at {self.endpoint} for {op} ({_short(exc)}) "
                f"after retrying for up to {self.retry_timeout:g} s; check that the server is running "
                "and that AWS_ENDPOINT_URL (or storage_options['endpoint']) names it")
        return ObjectStoreError(f"{url}: {op} failed ({_short(exc)})")

    def _call(self, op: str, rel: str, fn, *args, **kwargs):
        """One request (idempotent: a read, a list, a plain PUT or a DELETE), retried within
        ``retry_timeout`` on a transport error or a 5xx. The client retries most of those
        itself, but not a request sent on a pooled connection the server closed meanwhile (a
        server restart answers it in microseconds with "error sending request")."""
        self._contact()
        deadline = time.monotonic() + self.retry_timeout
        delay = 0.05
        while True:
            try:
                return fn(self._store, *args, **kwargs)
            except FileNotFoundError as exc:
                raise self._error(exc, op, rel) from None
            except (self._exc.BaseError, OSError) as exc:
                status = _http_status(exc)
                transient = (status is None and _s3_code(exc) is None) or (status is not None and status >= 500)
                if not transient or time.monotonic() + delay > deadline:
                    raise self._error(exc, op, rel) from None
                time.sleep(random.uniform(0, delay))
                delay = min(delay * 2, 2.0)

    # -- the storage interface ----------------------------------------------

    #: what a bucket can do (see :class:`~diskreplay.storage.base.Storage`): every request is a
    #: network round trip, so files are fetched into a local page cache before they are mapped; there
    #: is no lock, and listings are not relied on for commits
    can_map = False
    exclusive_lock = False
    reliable_listing = False
    cached = True

    def read_bytes(self, rel: str, limit: Optional[int] = None) -> bytes:
        rel = check_rel(rel)
        data = bytes(self._call("GET", rel, self._ob.get, rel).bytes())
        if limit is not None and len(data) > limit:
            raise CorruptStoreError(f"{self._url_of(rel)} is {len(data)} bytes; at most {limit} are expected here")
        return data

    def exists(self, rel: str) -> bool:
        """Whether the object ``rel`` exists (one HEAD request)."""
        try:
            self.size(rel)
            return True
        except FileNotFoundError:
            return False

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        rel = check_rel(rel)
        start, end = check_range(rel, start, end)
        if start == end:
            return b""
        self._contact()
        try:
            return bytes(self._ob.get_range(self._store, rel, start=start, end=end))
        except (self._exc.BaseError, FileNotFoundError, OSError) as exc:
            if _http_status(exc) == 416:  # start at or past the end: like pread, no bytes
                return b""
            raise self._error(exc, "GET", rel) from None

    def size(self, rel: str) -> int:
        rel = check_rel(rel)
        return int(self._call("HEAD", rel, self._ob.head, rel)["size"])

    def age(self, rel: str) -> float:
        """Seconds since ``rel`` was written, by the server's clock against ours
        (clean-up keeps files younger than ``retain_seconds``: keep clocks within
        a small fraction of it)."""
        rel = check_rel(rel)
        modified = self._call("HEAD", rel, self._ob.head, rel)["last_modified"]
        return self._server_now() - modified.timestamp()

    def _server_now(self) -> float:
        """The server's clock now, as this host's ``time.time()`` plus the offset of the server's
        ``Date`` (measured once a minute, by a signed HEAD): ages judged by the server's clock
        alone, so a host whose clock is ahead does not take young objects for old ones. ``Date``
        is in whole seconds: a skew below 2 s is not corrected, a larger one to within a second."""
        import email.utils
        import urllib.error
        import urllib.request

        now, mono = time.time(), time.monotonic()
        if self._clock is None or mono - self._clock[1] > 60:
            offset = 0.0
            try:
                url = self._ob.sign(self._store, "HEAD", "FLOOR.json", datetime.timedelta(minutes=5))
                try:
                    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10) as r:
                        date = r.headers.get("Date")
                except urllib.error.HTTPError as exc:
                    date = exc.headers.get("Date")
                if date:
                    offset = email.utils.parsedate_to_datetime(date).timestamp() - time.time()
                    # within the Date's resolution (whole seconds) the clocks agree: no correction
                    offset = offset if abs(offset) >= 2 else 0.0
            except (OSError, ValueError, TypeError, self._exc.BaseError):
                pass  # no Date: this host's clock, as before
            self._clock = (offset, mono)
        return now + self._clock[0]

    def list(self, reldir: str) -> List[str]:
        reldir = check_rel(reldir, allow_root=True)
        out = self._call("LIST", reldir, self._ob.list_with_delimiter, reldir or None)
        names = [o["path"].rsplit("/", 1)[-1] for o in out["objects"]]
        # "" is a folder marker (seaweedfs lists "dir/" after its last object goes).
        return sorted(n for n in names if n and not n.startswith("."))

    def list_ages(self, reldir: str) -> Dict[str, float]:
        """Like :meth:`list`, with each object's age in seconds (from the listing's Last-Modified,
        by the server's clock against ours)."""
        reldir = check_rel(reldir, allow_root=True)
        out = self._call("LIST", reldir, self._ob.list_with_delimiter, reldir or None)
        now = self._server_now()
        ages = {}
        for o in out["objects"]:
            name = o["path"].rsplit("/", 1)[-1]
            if name and not name.startswith("."):
                ages[name] = now - o["last_modified"].timestamp()
        return ages

    def list_kinds(self, reldir: str) -> Dict[str, str]:
        """Like :meth:`list`, with each name's kind: objects are ``file``, prefixes ``dir``."""
        reldir = check_rel(reldir, allow_root=True)
        out = self._call("LIST", reldir, self._ob.list_with_delimiter, reldir or None)
        kinds = {n: "dir" for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in out["common_prefixes"])
                 if n and not n.startswith(".")}
        for o in out["objects"]:
            name = o["path"].rsplit("/", 1)[-1]
            if name and not name.startswith("."):
                kinds[name] = "file"
        return kinds

    def stat(self, rel: str) -> Optional[Tuple[str, int]]:
        """``("file", size)`` for an object, ``("dir", 0)`` for a prefix something lies under (the
        store's root always), ``None`` otherwise: an object store has no links."""
        if rel in ("", "."):
            return "dir", 0
        try:
            return "file", self.size(rel)
        except FileNotFoundError:
            pass
        out = self._call("LIST", rel, self._ob.list_with_delimiter, rel)
        return ("dir", 0) if out["objects"] or out["common_prefixes"] else None

    def some_names(self, limit: int = 1000) -> List[str]:
        """Paths of up to about ``limit`` objects anywhere under the store's prefix (one listing
        page, no delimiter: objects in any "folder"), relative to it."""
        def first_page(store: Any) -> List[str]:  # the requests run while iterating: inside the retries
            out: List[str] = []
            for chunk in self._ob.list(store, None, chunk_size=limit):
                out += [o["path"] for o in chunk]
                if len(out) >= limit:
                    break
            return out

        return sorted(self._call("LIST", "", first_page))  # (the client's store has the prefix: paths are relative)

    def _put(self, op: str, rel: str, data: Buffer, **kwargs) -> Optional[str]:
        view = memoryview(data).cast("B")
        result = self._call(op, rel, self._ob.put, rel, view,
                            use_multipart=len(view) > self.multipart_threshold, **kwargs)
        return result.get("e_tag") if isinstance(result, Mapping) else None

    def write_new(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> None:
        """Create ``rel``, which must not exist: a conditional PUT, so that a second
        writer (there is no lock) can never overwrite a file another commit names."""
        rel = check_rel(rel)
        if not self.put_if_absent(rel, data):
            raise CommitConflictError(
                f"{self._url_of(rel)} already exists: another writer wrote it (an object store has no lock; "
                "give a single-writer store one writer, or create it with multi_writer=True); nothing was "
                "overwritten")

    def _create(self, rel: str, view: memoryview) -> bool:
        """One conditional PUT: True if it created ``rel``, False if the server
        said the name exists (412 Precondition Failed).

        The client does not retry a conditional PUT that failed after it was
        sent (it is not idempotent to the client), so a connection dropped
        mid-request (a server restart) is retried here, within
        ``retry_timeout``; a retry that finds the name taken answers False,
        and :meth:`put_if_absent` then compares the bytes (our own first
        attempt may have landed).
        """
        self._contact()
        deadline = time.monotonic() + self.retry_timeout
        delay = 0.05
        while True:
            try:
                # One PUT: the condition is checked with the object (a multipart
                # upload checks it only at completion); conditional objects are
                # segments, manifests and probes, below S3's 5 GiB single-PUT limit.
                result = self._ob.put(self._store, rel, view, mode="create", use_multipart=False)
                if isinstance(result, Mapping) and result.get("e_tag"):
                    self._own_etags[rel] = result["e_tag"]
                return True
            except (self._exc.AlreadyExistsError, self._exc.PreconditionError) as exc:
                if not _conflicting_write(exc):
                    return False
                # 409 ConditionalRequestConflict: another conditional write of this name was in progress;
                # nothing was decided (obstore reports it as "already exists"): ask again
                if time.monotonic() + delay > deadline:
                    raise self._error(exc, "conditional PUT", rel) from None
                time.sleep(random.uniform(0, delay))
                delay = min(delay * 2, 2.0)
                continue
            except (self._exc.BaseError, OSError) as exc:
                if _s3_code(exc) in _NOT_SUPPORTED_CODES or _http_status(exc) == 501:
                    raise ConditionalWriteError(
                        f"{self._url_of(rel)}: the server at {self.endpoint} rejects conditional writes "
                        f"(If-None-Match: *): {_short(exc)}; {_CONDITIONAL_FIX}") from None
                status = _http_status(exc)
                transient = (status is None and _s3_code(exc) is None) or (status is not None and status >= 500)
                if not transient or time.monotonic() + delay > deadline:
                    raise self._error(exc, "conditional PUT", rel) from None
                time.sleep(random.uniform(0, delay))
                delay = min(delay * 2, 2.0)

    def put_if_absent(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> bool:
        rel = check_rel(rel)
        view = memoryview(data).cast("B")
        if self._create(rel, view):
            return True
        # A PUT that succeeded but lost its response is retried by the client
        # and then refused: equal bytes are our own commit.
        try:
            return self.read_bytes(rel) == view
        except FileNotFoundError:
            return False

    def link_candidates(self, rel_of: Callable[[int], str], data: Buffer, first: int, *,
                        tries: int = 1 << 16, step: Optional[str] = None) -> Tuple[int, str]:
        """Create ``rel_of(i)`` for the first ``i >= first`` no one has, by conditional
        PUTs; returns ``(i, name)`` (how a writer reserves a segment id)."""
        view = memoryview(data).cast("B")
        for i in range(first, first + tries):
            rel = check_rel(rel_of(i))
            if self._create(rel, view):
                return i, rel
        raise ObjectStoreError(f"{self._url_of(rel_of(first))}: no free name after {tries} tries")

    def reserve(self, rel_of: Callable[[int], str], first: int, *, tries: int = 1 << 16, ahead: int = 1,
                max_age: float = 0.0) -> Tuple[int, str]:
        """Take the first free name ``rel_of(i)``, ``i >= first``, with a conditional PUT of an
        empty object; :meth:`write_files` fills it. No other writer can get that name (one PUT
        per name: ``ahead`` is not used)."""
        empty = memoryview(b"")
        for i in range(first, first + tries):
            rel = check_rel(rel_of(i))
            if self._create(rel, empty):
                return i, rel
        raise ObjectStoreError(f"{self._url_of(rel_of(first))}: no free name after {tries} tries")

    def name_durable(self, rel: str) -> bool:
        """True: a PUT makes an object and its name durable at once (there are no directories)."""
        return True

    def write_files(self, files: Sequence[Tuple[str, Buffer, Optional[str]]], dirs: Sequence[str] = ()) -> None:
        """Upload ``(rel, data, step)`` files, concurrently, one PUT each. Their names are this
        writer's alone (reserved by :meth:`reserve`, or named after an id it reserved), so
        the PUT only ever replaces this writer's own placeholder; a PUT is atomic, so no
        reader sees a torn file. ``dirs`` need nothing (an object store has no directories)."""
        def put(rel: str, data: Buffer, step: Optional[str]) -> Callable[[], None]:
            def run() -> None:
                etag = self._put("PUT", check_rel(rel), data)
                if etag:
                    self._own_etags[rel] = etag
                if step:
                    crash_point(f"{step}.written")
                    crash_point(f"{step}.renamed")
            return run

        calls = [put(rel, data, step) for rel, data, step in files]
        if len(calls) == 1:
            calls[0]()
        elif calls:
            run_concurrently(calls)

    def settle_publish(self, rel: str, data: Buffer) -> Optional[bool]:
        """After a :meth:`publish` whose PUT raised (the server may still apply it): the same conditional
        PUT again decides it. Created now, or found holding ``data``: True (the manifest is ours, for
        good); anything else, or an error: None (not known). Never False: a PUT the client gave up on
        cannot be withdrawn."""
        try:
            if self.put_if_absent(rel, data):
                return True
            return True if self.read_bytes(rel) == bytes(data) else None
        except (OSError, self._exc.BaseError):
            return None

    def replace(self, rel: str, data: Buffer, *, step: Optional[str] = None, sync: bool = True) -> None:
        """Replace ``rel`` with one PUT (a manifest's publish is a conditional one: see
        :meth:`Publisher.publish`)."""
        self._put("PUT", check_rel(rel), data)

    def update_small(self, rel: str, update: Callable[[Optional[bytes]], Optional[bytes]]) -> Optional[bytes]:
        """Read-modify-write the small object ``rel`` (the collection floor) with no concurrent
        update lost: ``update(current bytes or None)`` gives the new bytes (None: keep them), PUT
        only if the object is still the one read (``If-Match`` its ETag; ``If-None-Match: *``
        where there was none), else read again. Returns the bytes the object holds now; after
        ``_UPDATE_TRIES`` lost races, or on a server that refuses ``If-Match``, the current bytes
        unchanged (the caller then does less)."""
        rel = check_rel(rel)
        delay = 0.01
        current: Optional[bytes] = None
        for _ in range(_UPDATE_TRIES):
            try:
                got = self._call("GET", rel, self._ob.get, rel)
                current, etag = bytes(got.bytes()), got.meta.get("e_tag")
            except FileNotFoundError:
                current, etag = None, None
            new = update(current)
            if new is None:
                return current
            mode: Any = "create" if etag is None else {"e_tag": etag}
            try:
                self._ob.put(self._store, rel, memoryview(new).cast("B"), mode=mode, use_multipart=False)
                return bytes(new)
            except (self._exc.AlreadyExistsError, self._exc.PreconditionError):
                pass  # another update came first (or a 409 race): read it and decide again
            except (self._exc.BaseError, OSError) as exc:
                if _s3_code(exc) in _NOT_SUPPORTED_CODES or _http_status(exc) == 501:
                    return current  # no If-Match here: nothing is raised, nothing deleted below it
                status = _http_status(exc)
                if not ((status is None and _s3_code(exc) is None) or (status is not None and status >= 500)):
                    raise self._error(exc, "conditional PUT", rel) from None
            time.sleep(random.uniform(0, delay))
            delay = min(delay * 2, 0.5)
        return current

    #: an object store has no locks: a stopped writer's objects are judged by their age alone
    holds_leases = False

    def release_leases(self) -> None:
        """Nothing is leased here (see :attr:`holds_leases`); the ETags of this commit's uploads go."""
        self._own_etags.clear()

    def delete_own(self, rel: str) -> bool:
        """Remove ``rel``, an object this writer uploaded for a commit that did not happen, only while
        it is still that object (``If-Match`` the ETag its upload got): if another writer's clean-up
        took it and another commit made the name again, that commit's object stays."""
        etag = self._own_etags.pop(check_rel(rel), None)
        return self.delete(rel) if etag is None else self._delete_if(rel, etag)

    def hold(self, rels: Sequence[str]) -> Dict[str, Optional[str]]:
        """Of ``rels`` (objects a clean-up would remove), those that exist, each with its ETag now:
        :meth:`remove_held` removes it only while it is still that object (there are no locks)."""
        out: Dict[str, Optional[str]] = {}
        for rel in rels:
            try:
                out[rel] = self._call("HEAD", check_rel(rel), self._ob.head, rel).get("e_tag")
            except FileNotFoundError:
                continue
        return out

    def hold_run(self, rels: Sequence[str]) -> Tuple[Dict[str, Optional[str]], bool]:
        """All of ``rels``, unheld: there are no leases, so a writer whose commit the floor passed
        before it read it cannot tell it from a stale one (docs/FORMAT.md, "The collection floor")."""
        return dict.fromkeys(rels), True

    def remove_held(self, rel: str, handle: Optional[str]) -> bool:
        """Remove ``rel`` if it is still the object :meth:`hold` saw (``If-Match`` its ETag)."""
        return self.delete(rel) if handle is None else self._delete_if(rel, handle)

    def unhold(self, held: Mapping[str, Optional[str]]) -> None:
        """Nothing is held on an object store."""

    def _delete_if(self, rel: str, etag: str) -> bool:
        """A DELETE with ``If-Match: etag``: True if it removed that object, False if the name now
        holds another one (412) or none. obstore has no conditional DELETE, so the request is sent
        to a URL it signed (the condition header is not part of a presigned signature)."""
        import urllib.error
        import urllib.request

        rel = check_rel(rel)
        self._contact()
        deadline = time.monotonic() + self.retry_timeout
        delay = 0.05
        while True:
            try:
                url = self._ob.sign(self._store, "DELETE", rel, datetime.timedelta(minutes=5))
                request = urllib.request.Request(url, method="DELETE", headers={"If-Match": etag})
                with urllib.request.urlopen(request, timeout=max(5.0, self.retry_timeout)):
                    pass
                self._page_cache.forget(rel)
                return True
            except urllib.error.HTTPError as exc:
                if exc.code in (404, 412):
                    return False
                if exc.code < 500 or time.monotonic() + delay > deadline:
                    raise ObjectStoreError(f"{self._url_of(rel)}: conditional DELETE failed (HTTP {exc.code} "
                                           f"{exc.reason})") from None
            except (OSError, self._exc.BaseError) as exc:
                if time.monotonic() + delay > deadline:
                    raise self._error(exc, "conditional DELETE", rel) from None
            time.sleep(random.uniform(0, delay))
            delay = min(delay * 2, 2.0)

    def delete(self, rel: str) -> bool:
        """Remove ``rel``; True (S3 answers a DELETE of an absent key the same way)."""
        rel = check_rel(rel)
        try:
            self._call("DELETE", rel, self._ob.delete, rel)
        except FileNotFoundError:
            pass
        self._page_cache.forget(rel)
        return True

    def sync_dir(self, reldir: str) -> None:
        """Nothing to do: an object store makes each PUT and DELETE durable before answering."""
        check_rel(reldir, allow_root=True)

    def ensure_dir(self, reldir: str) -> None:
        """Nothing to do: an object store has no directories."""
        check_rel(reldir, allow_root=True)

    def probe_create_if_absent(self, reldir: str) -> None:
        """Raise :class:`ConditionalWriteError` (naming the URL) unless conditional PUTs work here.

        The full probe runs once per endpoint in a process (conditional writes
        are the server's; the probe costs seconds on seaweedfs, whose losing
        PUTs wait for a lock); later stores there only check bucket,
        credentials and endpoint.
        """
        key = self.endpoint
        if key in _PROBED:
            self.check()
            return
        self.probe_conditional_put()
        _PROBED.add(key)

    # -- object-store extras ------------------------------------------------

    def fetch_ranges(self, rel: str, ranges: Optional[Sequence[Tuple[int, int]]], *,
                     size: Optional[int] = None, evict: bool = True, tag: Optional[str] = None) -> str:
        """Make byte ranges ``[(start, end), ...]`` of the immutable object ``rel``
        present in its local cache file and return that file's path.

        The file has the object's full size; only the requested ranges (widened
        to ``align`` bytes, the store's checksum page) are guaranteed filled.
        Missing ranges closer than ``coalesce_bytes`` are fetched as one range
        GET; the GETs of one call run concurrently. ``ranges=None`` fetches the
        whole object. The returned path stays the same while the object is
        cached, so a mapping of it sees ranges filled later. ``evict=False``
        leaves the bound to the next :meth:`trim_cache` (a store reading a batch
        must not lose pages it already checked while fetching more). ``tag``
        (e.g. the manifest's size and checksum of the object) keeps copies of
        different contents under one name apart: a name can be written again
        after a repair rolled a store back, and a shared cache must not serve
        the old bytes for it.
        """
        return fetch_into(self, self._page_cache, rel, ranges, size=size, evict=evict, tag=tag,
                          coalesce=self.coalesce_bytes)

    def read_ranges(self, rel: str, ranges: Sequence[Tuple[int, int]]) -> List[bytes]:
        """The byte ranges of ``rel``, fetched concurrently (one request each, none merged here)."""
        starts = [s for s, _ in ranges]
        ends = [e for _, e in ranges]
        return self._call("GET", rel, self._ob.get_ranges, rel, starts=starts, ends=ends, coalesce=0)

    def check(self) -> None:
        """Raise :class:`ObjectStoreError` now, naming the fix, unless the bucket
        exists, the credentials are accepted and the endpoint answers.

        One GET of a name that does not exist: "no such key" is the healthy answer.
        (Some servers create a bucket on the first PUT, so a PUT cannot tell.)
        """
        rel = f".probe-{secrets.token_hex(8)}"
        try:
            self._call("GET", rel, self._ob.get, rel)
        except FileNotFoundError:
            return

    def probe_conditional_put(self, racers: int = 4, body_bytes: int = 256 << 10) -> None:
        """Raise :class:`ConditionalWriteError` unless the server honours
        ``If-None-Match: *``, sequentially and under concurrency.

        1. A conditional PUT of a fresh name must succeed; a second must be
           refused, and the first bytes must survive (servers that ignore the
           header fail here).
        2. ``racers`` threads create one more fresh name at once: exactly one
           may succeed, and its bytes must be what is stored. Servers that
           check the condition before uploading and write after it (a
           check-then-act race; seaweedfs had it, its issue #8800) pass step 1
           and fail here, where they would let two commits of one generation
           both succeed.

        Also checks bucket, credentials and endpoint (:meth:`check`). Leaves
        nothing behind. Costs ``racers + 2`` PUTs; on seaweedfs 4.48 its
        losing PUTs wait for a server lock, about 1 s each.
        """
        self.check()
        token = secrets.token_hex(8)
        rel = f".probe-conditional-{token}"
        race = f".probe-race-{token}"
        try:
            if not self._create(rel, memoryview(b"first")):
                raise ConditionalWriteError(f"{self._url_of(rel)}: the server at {self.endpoint} refused to "
                                            f"create a fresh name conditionally; {_CONDITIONAL_FIX}")
            if self._create(rel, memoryview(b"second")) or self.read_bytes(rel) != b"first":
                raise ConditionalWriteError(
                    f"{self._url_of(rel)}: the server at {self.endpoint} ignores If-None-Match: * (a second "
                    "create-if-absent PUT replaced the object), so concurrent commits could overwrite "
                    f"each other; {_CONDITIONAL_FIX}")
            # Bodies of some size keep each upload in flight long enough for
            # a check-then-write server to let several through.
            bodies = [bytes([i]) * body_bytes for i in range(racers)]
            start = threading.Barrier(racers)

            def create(body: bytes) -> bool:
                start.wait()
                return self._create(race, memoryview(body))

            with ThreadPoolExecutor(racers) as pool:
                won = list(pool.map(create, bodies))
            stored = self.read_bytes(race)
            winners = [i for i, w in enumerate(won) if w]
            if len(winners) != 1 or stored != bodies[winners[0]]:
                raise ConditionalWriteError(
                    f"{self._url_of(race)}: the server at {self.endpoint} let {len(winners)} of {racers} "
                    "concurrent create-if-absent PUTs of one name succeed (If-None-Match: * is checked "
                    "before the write, not atomically with it), so concurrent commits could overwrite "
                    f"each other; {_CONDITIONAL_FIX}")
        finally:
            for name in (rel, race):
                try:
                    self._call("DELETE", name, self._ob.delete, name)
                except (ObjectStoreError, FileNotFoundError):
                    pass

    def close(self) -> None:
        """Remove this process's partly fetched cache files (complete ones stay for reuse)."""
        self._page_cache.close()

    def __reduce__(self):
        # Travels to Ray actors / worker processes as its settings; the
        # client and cache are rebuilt there.
        url, opts, cache_dir, cache_bytes, coalesce, align = self._init_args
        return (_rebuild, (url, opts, cache_dir, cache_bytes, coalesce, align))

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r}, endpoint={self.endpoint!r})"


def _rebuild(url, opts, cache_dir, cache_bytes, coalesce, align) -> S3Storage:
    return S3Storage(url, opts, cache_dir=cache_dir, cache_bytes=cache_bytes, coalesce_bytes=coalesce,
                     align=align)
