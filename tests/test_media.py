"""Media columns (docs/FORMAT.md, "Media"): blobs stored once per content, shared by a group's
samples and across prompts, read zero-copy, freed exactly when their last row is evicted,
checked by verify, exactly once across writers (lost races, an entry evicted under a commit,
SIGKILLed writer processes)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from diskreplay import Media, MediaReader, ReplayStore
from diskreplay import format as fmt
from diskreplay.errors import ArgumentError, BatchError, CorruptStoreError, RowsEvictedError
from diskreplay.storage import LocalStorage
from diskreplay.verify import repair_store, verify_store

from .conftest import package_at
from .torchrun import ROOT, child_env

#: a diskreplay that knows no media
PREVIOUS_VERSION = "66ceeba"


def image(k: int, size: int = 300) -> bytes:
    """The encoded bytes of prompt ``k``'s image (any bytes: the store never decodes them)."""
    return hashlib.sha256(b"img%d" % k).digest() * (size // 32) + bytes([k % 256])


def group(prompts, per=4, first_token=0):
    """``per`` samples of each prompt, sharing its image."""
    keys = [p for p in prompts for _ in range(per)]
    return {"prompt_id": np.array(keys), "completion_ids": [[first_token + i] for i in range(len(keys))],
            "image": Media([image(p) for p in keys], mime="image/png")}


def blob_files(path):
    return sorted(f for f in os.listdir(os.path.join(path, "segments")) if f.startswith("media."))


def test_round_trip_bit_exact_and_stored_once_per_content(tmp_path):
    path = str(tmp_path / "s")
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    with ReplayStore(path) as store:
        store.extend(group([1, 2]))  # two prompts, 4 samples each: 2 blobs
        store.extend({"prompt_id": np.array([3, 3, 1]), "completion_ids": [[1], [2], [3]],
                      "image": Media([arr, arr, image(1)], mime=["image/png", "image/png", "image/png"])})
        assert len(store.manifest.media) == 3 and len(blob_files(path)) == 3  # prompt 1's image reused: once
        refs = store.read(store.row_ids())["image"]
        assert refs.shape == (11, 4) and refs.dtype == np.int64
        reader = MediaReader(store)
        got = [reader.get(r) for r in refs]
        assert [bytes(g) for g in got[:8]] == [image(k) for k in [1] * 4 + [2] * 4]
        assert np.array_equal(got[8], arr) and got[8].dtype == np.float32 and not got[8].flags.writeable
        assert bytes(got[10]) == image(1)
        assert reader.entry(refs[8]).mime == "application/x-array" and reader.entry(refs[8]).shape == (2, 3, 4)
    with ReplayStore(path) as store:  # reopened: the same blobs, same last rows
        m = store.manifest
        assert {e.last_row for e in m.media} == {10, 7, 9}
        calls = []
        out = MediaReader(store).batch(store.read(store.row_ids())["image"],
                                       decode=lambda v, e: calls.append(e.hash) or len(v))
        assert len(calls) == 3 and out[:4] == [len(image(1))] * 4  # decoded once per hash in the batch
    assert verify_store(path)["ok"]


def test_memory_storage_and_many_writers_read_the_same(tmp_path):
    for path in ("memory://media-test", str(tmp_path / "mw")):
        with ReplayStore(path, multi_writer=True) as store:
            store.extend(group([5]), token="w:0")
            with ReplayStore(path, multi_writer=True) as other:
                other.extend(group([5, 6]))
            store.refresh()
            assert len(store.manifest.media) == 2
            reader = MediaReader(store)
            assert [bytes(v) for v in reader.batch(store.read(store.row_ids())["image"])] == \
                [image(5)] * 8 + [image(6)] * 4


def test_eviction_frees_a_blob_exactly_when_its_last_row_goes(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path, capacity=8) as store:
        store.extend(group([1], per=4))          # rows 0-3 name image 1
        store.extend(group([2], per=2))          # rows 4-5
        store.extend(group([1], per=2))          # rows 6-7 name image 1 again: last_row 7
        hashes = {e.mime and e.last_row: e.hash for e in store.manifest.media}
        assert sorted(hashes) == [5, 7]
        store.extend(group([3], per=5))          # head 5: rows 0-4 evicted, image 2's row 5 lives
        assert sorted(e.last_row for e in store.manifest.media) == [5, 7, 12]
        store.extend(group([3], per=1))          # head 6: image 2's last row (5) goes, and its entry
        assert sorted(e.last_row for e in store.manifest.media) == [7, 13]
        assert bytes(MediaReader(store).get(store.read([6])["image"][0])) == image(1)
        for _ in range(fmt.KEEP_MANIFESTS + 1):
            store.extend(group([3], per=1))      # head 8: image 1's row 7 goes
        assert [e.last_row for e in store.manifest.media] == [18]
        assert len(blob_files(path)) == 1         # the freed blobs are collected with their manifests
        with pytest.raises(RowsEvictedError):
            MediaReader(store).entry("0" * 64)
    assert verify_store(path)["ok"]


def test_merges_and_compaction_keep_every_blob(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        for k in range(20):
            store.extend(group([k % 5], per=2, first_token=k))
        before = {e.hash: e.last_row for e in store.manifest.media}
        store.compact()
        assert len(store.manifest.segments) == 1 and {e.hash: e.last_row for e in store.manifest.media} == before
        assert [bytes(v) for v in MediaReader(store).batch(store.read(store.row_ids())["image"])] == \
            [image(k % 5) for k in range(20) for _ in range(2)]
    assert verify_store(path)["ok"]


def test_a_retried_token_writes_nothing(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        rows = store.extend(group([1, 2]), token="t0")
        files = blob_files(path)
        assert store.extend(group([1, 2]), token="t0").tolist() == rows.tolist()
        assert blob_files(path) == files and len(store) == 8 and store.generation == 1
        with pytest.raises(BatchError):  # the same token for other media
            store.extend(group([1, 3]), token="t0")


def test_bad_media_is_refused_before_anything_is_written(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        store.extend(group([1]))
        gen = store.generation
        with pytest.raises(BatchError, match="without a media type"):
            store.extend({"prompt_id": [1], "completion_ids": [[1]], "image": Media([b"x"])})
        with pytest.raises(BatchError, match="nothing is pickled"):
            store.extend({"prompt_id": [1], "completion_ids": [[1]],
                          "image": Media([np.array([{}], dtype=object)], mime="image/png")})
        with pytest.raises(BatchError, match="media column"):  # the rows as hashes, without their bytes
            store.extend({"prompt_id": [1], "completion_ids": [[1]], "image": np.zeros((1, 4), np.int64)})
        with pytest.raises(BatchError, match="first extend"):  # a media column cannot come late
            store.extend({**group([1]), "audio": Media([b"a"] * 4, mime="audio/wav")})
        with pytest.raises(ArgumentError, match="media column"):
            store.update([0], {"image": Media([b"y"], mime="image/png")})
        assert store.generation == gen and len(blob_files(path)) == 1


# ------------------------------------------------------------------ many writers


def _race(monkeypatch, loser, rival_batch, rival):
    """``rival`` commits ``rival_batch`` right before ``loser`` publishes its next manifest."""
    real = LocalStorage.link_new
    left = [1]

    def put(self, src, rel):
        if self is loser._committer.storage and rel.startswith(fmt.MANIFEST_DIR) and left[0]:
            left[0] -= 1
            rival.extend(rival_batch)
        return real(self, src, rel)

    monkeypatch.setattr(LocalStorage, "link_new", put)


def test_two_writers_storing_the_same_content_keep_one_blob(tmp_path, monkeypatch):
    path = str(tmp_path / "mw")
    with ReplayStore(path, multi_writer=True) as a, ReplayStore(path, multi_writer=True) as b:
        a.extend(group([0]))
        _race(monkeypatch, a, group([7], per=2), b)  # neither base names image 7: both write a blob
        a.extend(group([7]), token="a:1")
        monkeypatch.undo()
        a.refresh()
        m = a.manifest
        sevens = [e for e in m.media if bytes(MediaReader(a).get(e.hash)) == image(7)]
        assert len(sevens) == 1 and sevens[0].last_row == m.next_row - 1  # folded onto the rival's blob
        assert len(blob_files(path)) == 3  # the loser's own copy is an unnamed file, collected after retention
        assert [bytes(v) for v in MediaReader(a).batch(a.read(a.row_ids())["image"])] == \
            [image(0)] * 4 + [image(7)] * 6
        assert a.extend(group([7]), token="a:1").tolist() == list(range(6, 10))
    assert verify_store(path)["ok"]


def test_an_append_whose_blob_is_evicted_under_it_writes_the_blob_and_commits(tmp_path, monkeypatch):
    path = str(tmp_path / "mw")
    with ReplayStore(path, multi_writer=True, capacity=6) as a, \
            ReplayStore(path, multi_writer=True, capacity=6) as b:
        a.extend(group([7], per=2))  # rows 0-1 name image 7: its entry's last row is 1
        assert len(a.manifest.media) == 1
        # a plans on that base (names image 7: writes no blob); the rival commits 6 rows first,
        # evicting rows 0-1 and with them image 7's entry: a's append conflicts and is planned again
        _race(monkeypatch, a, group([8], per=6), b)
        rows = a.extend(group([7], per=2), token="a:1")
        monkeypatch.undo()
        a.refresh()
        assert rows.tolist() == [8, 9] and a.head == 4
        assert [bytes(v) for v in MediaReader(a).batch(a.read(rows)["image"])] == [image(7)] * 2
        assert sorted(e.last_row for e in a.manifest.media) == [7, 9]
        assert a.stats()["conflicts"] >= 1
    assert verify_store(path)["ok"]


def test_add_media_rule():
    e = fmt.MediaEntry("a" * 64, 3, 1, 0, 2, "image/png")
    m = fmt.Manifest(generation=1, next_row=3, head=0, next_segment=4,
                     segments=(fmt.SegmentEntry(0, 0, 3, 10, 0),), media=(e,))
    delta = fmt.AppendDelta((fmt.SegmentEntry(5, 0, 2, 10, 0),), 2, media=(fmt.MediaEntry("b" * 64, 6, 1, 0, 0, "a/b"),),
                            media_last=(("a" * 64, 1), ("b" * 64, 0)))
    again = fmt.AppendDelta.from_doc(json.loads(fmt.signed_bytes(delta.body())), "d")
    assert again == delta
    new = again.apply(m, fmt.StoreOptions())
    assert [(x.hash[0], x.id, x.last_row) for x in new.media] == [("a", 3, 4), ("b", 6, 3)] and new.next_segment == 7
    assert fmt.Manifest.from_dict(json.loads(new.file_bytes()), "m") == new
    gone = fmt.AppendDelta((fmt.SegmentEntry(5, 0, 1, 10, 0),), 1, media_last=(("c" * 64, 0),))
    with pytest.raises(Exception, match="evicted by another commit"):
        gone.apply(m, fmt.StoreOptions())


# ------------------------------------------------------------------ damage


def test_a_damaged_blob_is_named_by_verify_never_served_and_repair_drops_it(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        store.extend(group([1, 2]))
        e = next(x for x in store.manifest.media if x.last_row == 7)
    with open(os.path.join(path, e.file), "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xfe")
    report = verify_store(path)
    assert not report["ok"] and e.file in report["problems"][0] and "media blob" in report["problems"][0]
    with ReplayStore(path) as store:
        refs = store.read([0, 4])["image"]
        assert bytes(MediaReader(store).get(refs[0])) == image(1)
        with pytest.raises(CorruptStoreError, match="media.000000000"):
            MediaReader(store).get(refs[1])
    actions = repair_store(path)["actions"]
    assert any("dropping the damaged media blob" in a for a in actions)
    report = verify_store(path)
    assert report["ok"] and any("rows [4, 5, 6, 7] name the media blob" in w for w in report["warnings"])
    with ReplayStore(path) as store:
        assert len(store) == 8 and store.read([4])["completion_ids"][0].tolist() == [4]  # the rows stay
        with pytest.raises(RowsEvictedError, match="repair"):
            MediaReader(store).get(store.read([4])["image"][0])
        store.extend(group([2], per=1))  # the same content again: stored again, the old rows read it
        assert bytes(MediaReader(store).get(store.read([4])["image"][0])) == image(2)
    assert verify_store(path)["warnings"] == []


def test_verify_names_a_row_whose_blob_entry_would_be_freed_before_it(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        store.extend(group([1], per=3))
        m = store.manifest
    forged = m.evolve(generation=m.generation + 1, media=(fmt.evolve(m.media[0], {"last_row": 1}),))
    forged.write(path)
    report = verify_store(path)
    assert not report["ok"] and "row 2 names the media blob" in report["problems"][0]


def test_an_older_diskreplay_refuses_a_store_with_media(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        store.extend(group([1]))
    doc = json.load(open(os.path.join(path, "FORMAT.json")))
    assert doc["version"] == fmt.MEDIA_FORMAT_VERSION and doc["media"] is True and doc["patches"] is False
    previous = package_at(PREVIOUS_VERSION, tmp_path / "previous")
    code = "import sys\nfrom diskreplay import ReplayStore\nReplayStore(sys.argv[1])\n"
    proc = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=previous), cwd=previous)
    assert proc.returncode != 0 and "Unsupported version 7" in proc.stderr, proc.stderr[-800:]
    with ReplayStore(path) as store:  # nothing was collected
        assert bytes(MediaReader(store).get(store.read([0])["image"][0])) == image(1)


# ------------------------------------------------------------------ SIGKILL

_WRITER = r"""
import sys, hashlib, numpy as np
from diskreplay import Media, ReplayStore
path, w, start, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def image(k, size=300):
    return hashlib.sha256(b"img%d" % k).digest() * (size // 32) + bytes([k % 256])
with ReplayStore(path, multi_writer=True) as store:
    for i in range(start, stop):
        prompts = [(w * 7 + i) % 5, (i * 3) % 5]  # contents shared with the other writers
        keys = [p for p in prompts for _ in range(4)]
        rows = store.extend({"prompt_id": np.array(keys), "completion_ids": [[w * 1000 + i]] * 8,
                             "image": Media([image(p) for p in keys], mime="image/png")}, token=f"{w}:{i}")
        print(f"ack {i} {rows[0]}", flush=True)
"""


@pytest.mark.slow
def test_writers_killed_at_random_store_each_blob_once_and_every_acknowledged_row(tmp_path):
    path = str(tmp_path / "mw")
    ReplayStore(path, multi_writer=True).close()
    rng = random.Random(5)
    batches, writers = 24, 3
    acked = {w: {} for w in range(writers)}
    nxt = {w: 0 for w in range(writers)}
    kills = mid_run = 0
    env = child_env()
    while any(nxt[w] < batches for w in range(writers)):
        procs = {w: subprocess.Popen([sys.executable, "-c", _WRITER, path, str(w), str(nxt[w]), str(batches)],
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
                 for w in range(writers) if nxt[w] < batches}
        victim, early = None, {}
        if kills < 4:  # then a last round runs every writer to its end
            # SIGKILL a writer after its k-th acknowledged batch: mid-run, whatever the machine's speed
            victim, k = rng.choice(list(procs)), rng.randint(1, 4)
            early[victim] = [procs[victim].stdout.readline() for _ in range(k)]
            time.sleep(rng.uniform(0, 0.02))  # (somewhere in its next commit)
            procs[victim].send_signal(signal.SIGKILL)
            kills += 1
        for w, p in procs.items():
            out, _ = p.communicate(timeout=120)
            lines = [line for line in early.get(w, []) + out.splitlines() if line.strip()]
            mid_run += w == victim and bool(lines)
            for line in lines:
                _, i, first = line.split()
                acked[w][int(i)] = int(first)
            # a killed writer re-sends its last unacknowledged batch with its token
            nxt[w] = max(acked[w]) + 1 if acked[w] else 0
    assert kills == 4 and mid_run >= 3, (kills, mid_run)
    with ReplayStore(path, multi_writer=True) as store:
        m = store.manifest
        assert len(store) == writers * batches * 8  # every batch exactly once
        assert len(m.media) == 5 and len({e.hash for e in m.media}) == 5  # each content named once
        tokens = store.read(store.row_ids(), ["completion_ids"])["completion_ids"]
        firsts = {}
        for r, t in zip(store.row_ids().tolist(), tokens):
            firsts.setdefault(int(t[0]), r)
        reader = MediaReader(store)
        for w in range(writers):
            for i, first in acked[w].items():
                assert firsts[w * 1000 + i] == first
                prompts = [(w * 7 + i) % 5, (i * 3) % 5]
                got = reader.batch(store.read(np.arange(first, first + 8))["image"])
                assert [bytes(g) for g in got] == [image(p) for p in prompts for _ in range(4)]
    assert verify_store(path)["ok"]


def test_the_docs_example_runs():
    import re

    doc = open(os.path.join(ROOT, "docs", "media.md")).read()
    (code,) = re.findall(r"```python\n(.*?)```", doc, re.S)
    exec(compile(code, "docs/media.md", "exec"), {})


# ------------------------------------------------------------------ exports


def _png(k):
    try:
        from PIL import Image
    except ImportError:  # bytes with a PNG signature: the store never decodes them
        return b"\x89PNG\r\n\x1a\n" + image(k)
    import io

    buf = io.BytesIO()
    Image.new("RGB", (4 + k, 3), (k * 40 % 256, 7, 9)).save(buf, format="PNG")
    return buf.getvalue()


def _media_store(path):
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    with ReplayStore(path) as store:
        store.extend({"prompt_id": np.array([1, 1, 2, 2, 3]), "completion_ids": [[1], [2], [3], [4], [5]],
                      "image": Media([_png(1), _png(1), _png(2), _png(2), arr], mime="image/png")})
        return [bytes(v) if not isinstance(v, np.ndarray) else v
                for v in MediaReader(store).batch(store.read(store.row_ids())["image"])]


@pytest.mark.parametrize("kind", ["parquet", "hf"])
def test_exports_carry_the_bytes_and_import_stores_the_same_blobs(tmp_path, kind):
    from diskreplay.export import export, import_rollouts

    src = str(tmp_path / "s")
    want = _media_store(src)
    out = str(tmp_path / ("out.parquet" if kind == "parquet" else "out"))
    export(src, out, kind)
    if kind == "parquet":
        import pyarrow.parquet as pq

        col = pq.read_table(out)["image"].to_pylist()
        assert [r["bytes"] for r in col[:4]] == want[:4] and col[4]["bytes"] == want[4].tobytes()
    back = str(tmp_path / "back")
    import_rollouts(out, back)
    with ReplayStore(src) as a, ReplayStore(back) as b:
        assert sorted(e.hash for e in a.manifest.media) == sorted(e.hash for e in b.manifest.media)
        ra, rb = a.read(a.row_ids())["image"], b.read(b.row_ids())["image"]
        assert np.array_equal(ra, rb)  # the same content hashes: bit-exact bytes, types, shapes
        got = MediaReader(b).batch(rb)
        assert [bytes(g) for g in got[:4]] == want[:4] and np.array_equal(got[4], want[4])


def test_hf_export_of_images_uses_the_image_feature(tmp_path):
    datasets = pytest.importorskip("datasets")
    from diskreplay.export import export_hf

    src = str(tmp_path / "s")
    with ReplayStore(src) as store:
        store.extend({"prompt_id": np.array([1, 1]), "completion_ids": [[1], [2]],
                      "image": Media([_png(1), _png(1)], mime="image/png")})
    export_hf(src, str(tmp_path / "ds"))
    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    assert isinstance(ds.features["image"], datasets.Image)
    assert ds.with_format("arrow")[:]["image"].to_pylist()[0]["bytes"] == _png(1)
    try:
        import PIL  # noqa: F401  (decoding is HF's, with Pillow)
    except ImportError:
        return
    assert ds[0]["image"].size == (5, 3)


def test_jsonl_exports_media_by_reference(tmp_path):
    from diskreplay.export import export_jsonl, import_rollouts
    from diskreplay.errors import ExportError

    src = str(tmp_path / "s")
    with ReplayStore(src) as store:
        store.extend(group([1], per=2))
        h = store.manifest.media[0].hash
    export_jsonl(src, str(tmp_path / "o.jsonl"))
    rows = [json.loads(line) for line in open(tmp_path / "o.jsonl")]
    assert [r["image"] for r in rows] == [{"hash": h, "mime": "image/png"}] * 2
    with pytest.raises(ExportError, match="column 'image' holds a JSON object"):  # no bytes to store
        import_rollouts(str(tmp_path / "o.jsonl"), str(tmp_path / "back"))


# ------------------------------------------------------------------ crash points

_CRASHING = r"""
import sys, hashlib, numpy as np
from diskreplay import Media, ReplayStore
path, multi = sys.argv[1], sys.argv[2] == "multi"
def image(k, size=300):
    return hashlib.sha256(b"img%d" % k).digest() * (size // 32) + bytes([k % 256])
with ReplayStore(path, multi_writer=multi) as store:
    keys = [1, 1, 9, 9]  # image 1 is stored already, image 9 is new
    store.extend({"prompt_id": np.array(keys), "completion_ids": [[5]] * 4,
                  "image": Media([image(k) for k in keys], mime="image/png")}, token="crash")
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["single", "multi"])
@pytest.mark.parametrize("step", ["segment.written", "segment.written#2", "segment.renamed#2", "segments.synced",
                                  "manifest.written", "manifest.renamed", "manifest.committed"])
def test_sigkill_at_each_step_of_a_media_commit(tmp_path, step, mode):
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=mode == "multi") as store:
        store.extend(group([1], per=2))
    proc = subprocess.run([sys.executable, "-c", _CRASHING, path, mode], capture_output=True, text=True,
                          timeout=120, env={**child_env(), "DISKREPLAY_CRASH_AT": step}, cwd=ROOT)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-2000:]
    with ReplayStore(path, multi_writer=mode == "multi") as store:
        assert len(store) in (2, 6)  # the previous commit or the new one, whole
        reader = MediaReader(store)
        assert [bytes(v) for v in reader.batch(store.read(store.row_ids())["image"])] == \
            [image(1)] * 2 + [image(k) for k in [1, 1, 9, 9]][: len(store) - 2]
        # the producer re-sends its batch with its token: committed exactly once
        store.extend({"prompt_id": np.array([1, 1, 9, 9]), "completion_ids": [[5]] * 4,
                      "image": Media([image(k) for k in [1, 1, 9, 9]], mime="image/png")}, token="crash")
        assert len(store) == 6 and len(store.manifest.media) == 2
        assert [bytes(v) for v in reader.batch(store.read(store.row_ids())["image"])] == \
            [image(1)] * 4 + [image(9)] * 2
    report = verify_store(path)
    assert report["ok"], report["problems"]


# ------------------------------------------------------------------ batches


def _tiny_processor(values):
    """A Qwen2-VL-shaped image processor: each row's image cut into 14x14 patches, flattened
    (``pixel_values`` [sum of patches, 3 * 14 * 14]) and its grid (``image_grid_thw`` [B, 3])."""
    import torch

    pixels, grids = [], []
    for img in values:
        h, w = img.shape[0] // 14, img.shape[1] // 14
        patches = img[:h * 14, :w * 14].reshape(h, 14, w, 14, 3).transpose(0, 2, 4, 1, 3).reshape(h * w, -1)
        pixels.append(torch.from_numpy(patches.astype(np.float32) / 255))
        grids.append([1, h, w])
    return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids)}


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_collator_processes_each_blob_once_into_a_vlm_batch(tmp_path, layout):
    import torch
    from diskreplay import Collator

    rng = np.random.default_rng(0)
    imgs = {k: rng.integers(0, 256, (28, 14 * (k + 1), 3), dtype=np.uint8) for k in range(3)}
    keys = [0, 0, 0, 1, 1, 2]
    with ReplayStore(str(tmp_path / "s")) as store:
        store.extend({"prompt_id": np.array(keys), "completion_ids": [[1, 2], [3], [4], [5, 6], [7], [8]],
                      "image": Media([imgs[k] for k in keys])})
        decoded = []
        collator = Collator(0, layout=layout, media={"image": _tiny_processor},
                            media_decode={"image": lambda v, e: decoded.append(e.hash) or np.array(v)})
        rows = [5, 0, 3, 1]
        batch = collator.read(store, rows)
        assert len(decoded) == 3  # one decode per distinct image of the batch, not per row
        want = _tiny_processor([imgs[keys[r]] for r in rows])
        assert torch.equal(batch["pixel_values"], want["pixel_values"])
        assert batch["image_grid_thw"].tolist() == [[1, 2, 3], [1, 2, 1], [1, 2, 2], [1, 2, 1]]
        assert batch["image"].shape == (4, 4)  # the hashes ride along
        with pytest.raises(ArgumentError, match="media_decode"):
            Collator(0, media_decode={"image": lambda v, e: v})


def test_a_writer_that_read_the_options_before_media_were_marked_keeps_the_flag(tmp_path, monkeypatch):
    """Writer b reads the store's options after a's first append fixed the schema and before it marked
    media in FORMAT.json; b's first update marks patches: FORMAT.json must keep saying media (a
    diskreplay without media would otherwise take the manifests naming blobs for damaged ones)."""
    import diskreplay.store.appending as appending

    path = str(tmp_path / "mw")
    real = appending.mark_media
    opened = []

    def late_mark(committer, options):
        opened.append(ReplayStore(path, multi_writer=True))  # reads SCHEMA.json and a FORMAT.json without media
        return real(committer, options)

    monkeypatch.setattr(appending, "mark_media", late_mark)
    with ReplayStore(path, multi_writer=True) as a:
        a.extend({**group([1], per=2), "rewards": np.zeros(2, np.float32)})
    monkeypatch.undo()
    (b,) = opened
    assert not b.options.media
    b.update([0], {"rewards": [1.0]})
    b.close()
    doc = json.load(open(os.path.join(path, "FORMAT.json")))
    assert doc["version"] == fmt.MEDIA_FORMAT_VERSION and doc["media"] is True and doc["patches"] is True


def test_a_zarr_export_refuses_a_media_column(tmp_path):
    from diskreplay.errors import ExportError
    from diskreplay.export import export

    src = str(tmp_path / "s")
    with ReplayStore(src) as store:
        store.extend(group([1], per=2))
    with pytest.raises(ExportError, match="media column"):
        export(src, str(tmp_path / "o.zarr"))
    assert not os.path.exists(tmp_path / "o.zarr")
    export(src, str(tmp_path / "o.zarr"), columns=["prompt_id", "completion_ids"])


def test_an_export_fails_on_a_damaged_blob_unless_told_to_skip_its_rows(tmp_path):
    from diskreplay.export import export, import_rollouts

    src = str(tmp_path / "s")
    with ReplayStore(src) as store:
        store.extend(group([1, 2], per=3))
        e = next(x for x in store.manifest.media if x.last_row == 5)
    with open(os.path.join(src, e.file), "r+b") as f:
        f.write(b"\x00\x01")
    with pytest.raises(CorruptStoreError, match=e.file.split("/")[1]):
        export(src, str(tmp_path / "o.parquet"))
    res = export(src, str(tmp_path / "o.parquet"), skip_damaged=True)
    assert res["rows"] == 3 and res["skipped_rows"] == 3
    assert res["skipped_damaged"] == [{"file": e.file, "hash": e.hash, "row_ids": [3, 4, 5],
                                       "why": res["skipped_damaged"][0]["why"]}]
    import_rollouts(str(tmp_path / "o.parquet"), str(tmp_path / "back"))
    with ReplayStore(str(tmp_path / "back")) as back:
        assert [bytes(v) for v in MediaReader(back).batch(back.read(back.row_ids())["image"])] == [image(1)] * 3


# ------------------------------------------------------------------ the rule, against a model

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(capacity=st.integers(1, 12),
       appends=st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.booleans(),
                                  st.integers(0, 3)), min_size=1, max_size=25))
def test_media_entries_are_exactly_the_hashes_live_rows_name(capacity, appends):
    """Appends (single rows naming hashes 0-5, as a delta or a full manifest) and evictions against a
    model: after every commit the entries are exactly the hashes some live row names, each with the
    last row naming it; a hash is written as a new blob only when the base does not name it."""
    from diskreplay.store import ops

    options = fmt.StoreOptions(capacity_rows=capacity)
    m = fmt.Manifest()
    named_by = {}  # row -> hash
    for hashes, as_delta, evict in appends:
        base_names = {e.hash for e in m.media}
        last, new = {}, []
        for i, h in enumerate(hashes):
            last["%064x" % h] = i
        for h in last:
            if h not in base_names:
                new.append(fmt.MediaEntry(h, m.next_segment + 1 + len(new), 1, 0, last[h], "image/png"))
        seg = fmt.SegmentEntry(m.next_segment, m.next_row, len(hashes), 10, 0)
        op = ops.Append((seg,), len(hashes), None, (), as_delta, tuple(new), tuple(last.items()))
        for i, h in enumerate(hashes):
            named_by[m.next_row + i] = "%064x" % h
        m = ops.apply(m, op, options)
        if evict:
            m = ops.apply(m, ops.Evict(m.head + evict), options)
        live = {r: h for r, h in named_by.items() if r >= m.head}
        want = {}
        for r, h in live.items():
            want[h] = max(want.get(h, -1), r)
        assert {e.hash: e.last_row for e in m.media} == want
        assert fmt.Manifest.from_dict(json.loads(m.file_bytes()), "m") == m


def test_info_counts_the_blobs(tmp_path):
    from diskreplay.export.info import format_info, store_info

    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        store.extend(group([1, 2], per=4))
    info = store_info(path)
    assert info["media"] == {"blobs": 2, "bytes": 2 * len(image(1))}
    assert "media       2 blobs" in format_info(info)


def test_a_torch_tensor_row_is_stored_as_its_array(tmp_path):
    import torch

    with ReplayStore(str(tmp_path / "s")) as store:
        t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
        store.extend({"prompt_id": [1, 1], "completion_ids": [[1], [2]],
                      "pixels": Media([t, t.float().numpy()])})  # bfloat16 is stored as float32: one blob
        assert len(store.manifest.media) == 1
        got = MediaReader(store).get(store.read([0])["pixels"][0])
        assert got.dtype == np.float32 and got.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_array_rows_keep_their_shape_and_dtype_bit_exact(tmp_path):
    rows = [np.array(5), np.zeros((0, 3), np.float32), np.array([True, False]), np.arange(12).reshape(3, 4)[:, ::2],
            np.array([1.5], dtype=np.float16)]
    with ReplayStore(str(tmp_path / "s")) as store:
        store.extend({"prompt_id": [1] * 5, "completion_ids": [[1]] * 5, "x": Media(rows)})
        got = MediaReader(store).batch(store.read(store.row_ids())["x"])
    for a, b in zip(rows, got):
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def test_an_export_cuts_its_chunks_by_the_media_bytes_its_rows_name(tmp_path):
    import pyarrow.parquet as pq
    from diskreplay.export import export

    src = str(tmp_path / "s")
    with ReplayStore(src) as store:
        store.extend(group(list(range(6)), per=4))  # 24 rows of 32 bytes name 6 images of 301 bytes
    out = str(tmp_path / "o.parquet")
    export(src, out, chunk_bytes=700)  # about two images' bytes a row group
    f = pq.ParquetFile(out)
    assert f.metadata.num_row_groups >= 10 and f.metadata.num_rows == 24
    assert [r["bytes"] for r in f.read()["image"].to_pylist()] == [image(k) for k in range(6) for _ in range(4)]
