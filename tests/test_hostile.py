"""Hostile stores: a store is data from somewhere else, and opening it must be safe.

Manifests here are forged with valid checksums (an attacker computes CRC-32C
as easily as we do), so the store's structural checks, not its checksums, are
what is under test. Every case must end in a clear diskreplay error
(``FormatError`` / ``CorruptStoreError``) or in a fallback to an older intact
manifest, never in an unrelated exception from deep inside pyarrow, numpy or
json, and never in a read or write of a file outside the store.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diskreplay import CorruptStoreError, DiskReplayError, FormatError, ReplayStore
from diskreplay import format as fmt
from diskreplay._fileio import crc32c
from diskreplay.schema import Schema
from diskreplay.segment import encode_ipc
from diskreplay.format.states import STATE_META
from diskreplay.verify import repair_store, verify_store

from .test_durability import check_live_rows, expected_rows

CLEAR = (FormatError, CorruptStoreError)


@pytest.fixture
def store_path(tmp_path):
    """A store with generations 1 (rows 0-5) and 2 (rows 0-11) and a saved state (generation 3)."""
    path = str(tmp_path / "store")
    with ReplayStore(path) as store:
        store.extend(expected_rows(np.arange(0, 6)))
        store.extend(expected_rows(np.arange(6, 12)))
        store.save_state("sampler", {"k": 1, "w": np.arange(3, dtype=np.float32)})
    return path


def manifest_doc(path, gen):
    with open(os.path.join(path, fmt.manifest_file(gen))) as f:
        return json.load(f)


def sign(doc):
    """Recompute a manifest's checksum, as a forger would."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    doc["checksum"] = crc32c(fmt.canonical_json(body))
    return doc


def write_manifest(path, gen, doc=None, raw=None):
    full = os.path.join(path, fmt.manifest_file(gen))
    with open(full, "wb") as f:
        f.write(raw if raw is not None else json.dumps(doc).encode())
    return full


def open_hostile(path, **kw):
    """Open read-only; the store (possibly fallen back) or the clear error raised."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            return ReplayStore(path, readonly=True, **kw)
        except CLEAR as exc:
            return exc


def assert_safe_outcome(path, hostile_gen, hostile_file):
    """Clear error naming the file, or a fallback below the hostile generation that serves true rows."""
    res = open_hostile(path)
    if isinstance(res, Exception):
        assert hostile_file in str(res), res
    else:
        assert res.generation < hostile_gen
        check_live_rows(res)
        res.close()
    report = verify_store(path)
    assert not report["ok"] and any(hostile_file in p for p in report["problems"]), report


# --------------------------------------------------------------------------- paths that escape


@pytest.mark.parametrize("key,value", [
    ("file", "../../outside.arrow"), ("file", "/etc/passwd"), ("file", "segments/../../outside.arrow"),
    ("groups_file", "../outside.arrow"), ("groups_file", "/tmp/x.arrow"),
])
def test_manifest_segment_paths_cannot_escape(store_path, key, value):
    doc = manifest_doc(store_path, 3)
    doc["generation"] = 4
    doc["segments"][0][key] = value
    write_manifest(store_path, 4, sign(doc))
    assert_safe_outcome(store_path, 4, fmt.manifest_file(4))


@pytest.mark.parametrize("value", ["../../etc/passwd", "/etc/passwd", "state/../../x.arrow"])
def test_manifest_state_paths_cannot_escape(store_path, value):
    doc = manifest_doc(store_path, 3)
    doc["generation"] = 4
    doc["states"]["sampler"]["file"] = value
    write_manifest(store_path, 4, sign(doc))
    assert_safe_outcome(store_path, 4, fmt.manifest_file(4))


@pytest.mark.parametrize("name", ["../../evil", "/abs", ".hidden", ""])
def test_manifest_state_name_cannot_escape(store_path, name):
    doc = manifest_doc(store_path, 3)
    doc["generation"] = 4
    doc["states"] = {name: doc["states"]["sampler"]}
    write_manifest(store_path, 4, sign(doc))
    assert_safe_outcome(store_path, 4, fmt.manifest_file(4))


def test_symlinked_segment_file_is_refused(store_path, tmp_path):
    outside = tmp_path / "outside.arrow"
    seg = os.path.join(store_path, fmt.segment_file(0))
    shutil.copy(seg, outside)
    os.remove(seg)
    os.symlink(outside, seg)
    store = open_hostile(store_path)
    with pytest.raises(CorruptStoreError, match=fmt.segment_file(0).split("/")[1]):
        store.read([0])
    report = verify_store(store_path)
    assert not report["ok"] and any(fmt.segment_file(0) in p for p in report["problems"])


def _link_dir_outside(store_path, tmp_path, d):
    """Move ``STORE/d`` outside the store, plant a victim file beside it, symlink it back."""
    outside = tmp_path / f"outside-{d}"
    shutil.move(os.path.join(store_path, d), outside)
    (outside / "victim.txt").write_text("precious")
    os.symlink(outside, os.path.join(store_path, d))
    return outside


@pytest.mark.parametrize("d", [fmt.SEGMENT_DIR, fmt.MANIFEST_DIR])
def test_symlinked_data_dir_is_not_read(store_path, tmp_path, d):
    _link_dir_outside(store_path, tmp_path, d)
    res = open_hostile(store_path)
    if not isinstance(res, Exception):
        try:
            res.read(res.row_ids())
        except CLEAR as exc:
            res = exc
    assert isinstance(res, CLEAR), "rows were served from a directory outside the store"
    assert not verify_store(store_path)["ok"]


@pytest.mark.parametrize("d", [fmt.SEGMENT_DIR, fmt.GROUPS_DIR, fmt.STATE_DIR])
def test_writer_never_deletes_outside_the_store(store_path, tmp_path, d):
    outside = _link_dir_outside(store_path, tmp_path, d)
    try:
        ReplayStore(store_path).close()
    except CLEAR:
        pass
    assert (outside / "victim.txt").exists(), "opening the store as writer deleted a file outside it"


def test_lock_symlink_is_not_followed(store_path, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock = os.path.join(store_path, fmt.LOCK_FILE)
    os.remove(lock)
    os.symlink(victim, lock)
    try:
        ReplayStore(store_path).close()
    except CLEAR:
        pass
    assert victim.read_text() == "precious\n", "opening the store as writer overwrote a file outside it"


@pytest.mark.parametrize("which", ["manifest", "FORMAT", "state"])
def test_symlinked_json_or_state_is_not_read(store_path, tmp_path, which):
    rel = {"manifest": fmt.manifest_file(3), "FORMAT": fmt.FORMAT_FILE,
           "state": manifest_doc(store_path, 3)["states"]["sampler"]["file"]}[which]
    full = os.path.join(store_path, rel)
    outside = tmp_path / "outside-copy"
    shutil.move(full, outside)
    os.symlink(outside, full)
    res = open_hostile(store_path)
    if not isinstance(res, Exception):
        try:
            state = res.load_state("sampler")
        except CLEAR as exc:
            res = exc
        else:
            # reading it through the link is the failure; falling back to generation 2 is fine
            assert res.generation < 3 and state is None, f"{rel} was read through a symlink"
    report = verify_store(store_path)
    assert not report["ok"]


# --------------------------------------------------------------------------- absurd values, wrong types

MUTATIONS = {
    "generation-str": lambda d: d.__setitem__("generation", "4"),
    "generation-float": lambda d: d.__setitem__("generation", 4.0),
    "generation-bool": lambda d: d.__setitem__("generation", True),
    "generation-huge": lambda d: d.__setitem__("generation", 10 ** 40),
    "head-negative": lambda d: d.__setitem__("head", -1),
    "head-past-end": lambda d: d.__setitem__("head", d["next_row"] + 1),
    "next-row-null": lambda d: d.__setitem__("next_row", None),
    "segments-dict": lambda d: d.__setitem__("segments", {"0": d["segments"][0]}),
    "segments-null": lambda d: d.__setitem__("segments", None),
    "states-list": lambda d: d.__setitem__("states", []),
    "entry-list": lambda d: d["segments"].__setitem__(0, [1, 2, 3]),
    "entry-missing-crc": lambda d: d["segments"][0].pop("crc32c"),
    "crc-str": lambda d: d["segments"][0].__setitem__("crc32c", "deadbeef"),
    "crc-too-big": lambda d: d["segments"][0].__setitem__("crc32c", 1 << 40),
    "bytes-zero": lambda d: d["segments"][0].__setitem__("bytes", 0),
    "num-rows-zero": lambda d: d["segments"][0].__setitem__("num_rows", 0),
    "num-rows-float": lambda d: d["segments"][0].__setitem__("num_rows", 6.0),
    "gap-between-segments": lambda d: d["segments"][1].__setitem__("first_row", 7),
    "duplicate-segment-id": lambda d: d["segments"][1].__setitem__("id", 0),
    "segment-id-negative": lambda d: d["segments"][0].__setitem__("id", -1),
    "next-segment-small": lambda d: d.__setitem__("next_segment", 1),
    "state-generation-str": lambda d: d["states"]["sampler"].__setitem__("generation", "3"),
    "format-wrong": lambda d: d.__setitem__("format", "parquet"),
    "version-2": lambda d: d.__setitem__("version", 2),
    "nan": lambda d: d.__setitem__("head", float("nan")),
    "infinity": lambda d: d.__setitem__("next_row", float("inf")),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_forged_manifest_values(store_path, mutation):
    doc = manifest_doc(store_path, 3)
    doc["generation"] = 4
    MUTATIONS[mutation](doc)
    write_manifest(store_path, 4, sign(doc))
    assert_safe_outcome(store_path, 4, fmt.manifest_file(4))


@pytest.mark.parametrize("raw", [
    b"[" * 100000 + b"]" * 100000,  # deeper than the parser's recursion limit
    b'{"format": "diskreplay.manifest", "version": 1, "x": ' + b"[" * 900 + b"]" * 900 + b"}",
    b"\xff\xfe not utf-8",
    b"",
    b"null",
    b'"a string"',
    b'{"format": "diskreplay.manifest", "version": 1, "generation": 1e999}',
    b'{"format": "diskreplay.manifest", "version": 1, "generation": NaN}',
])
def test_garbage_manifest_text(store_path, raw):
    write_manifest(store_path, 4, raw=raw)
    assert_safe_outcome(store_path, 4, fmt.manifest_file(4))


def test_huge_integer_literal_in_manifest(store_path):
    write_manifest(store_path, 4, raw=b'{"format": "diskreplay.manifest", "version": 1, "generation": '
                   + b"9" * 5000 + b"}")
    assert_safe_outcome(store_path, 4, fmt.manifest_file(4))


def test_absurd_segment_bytes(store_path):
    doc = manifest_doc(store_path, 3)
    doc["generation"] = 4
    doc["segments"][0]["bytes"] = 1 << 62
    write_manifest(store_path, 4, sign(doc))
    store = open_hostile(store_path)
    assert store.generation == 4  # nothing at open says the sizes are wrong: opening reads no segment
    with pytest.raises(CorruptStoreError, match=fmt.segment_file(0).split("/")[1]):
        store.read([0])


def _absurd_counts(store_path):
    doc = manifest_doc(store_path, 3)
    doc["generation"] = 4
    huge = 1 << 40
    doc["segments"][0]["num_rows"] = huge
    doc["segments"][1]["first_row"] = huge
    doc["next_row"] = huge + doc["segments"][1]["num_rows"]
    write_manifest(store_path, 4, sign(doc))
    return open_hostile(store_path)


def test_absurd_row_counts_fall_back(store_path):
    """A forged row count is refused when the manifest is parsed: the store opens the previous commit."""
    expected = open_hostile(store_path).read([3])
    store = _absurd_counts(store_path)
    if isinstance(store, Exception):
        return
    assert store.generation == 3 and any("num_rows" in p for p in store.recovered_from)
    got = store.read([3])
    np.testing.assert_array_equal(got["completion_ids"].values, expected["completion_ids"].values)
    assert len(store.group_index().rows) == len(store)


# --------------------------------------------------------------------------- Arrow files that disagree


def _forge_segment(store_path, seg_index, data, rel_key="file"):
    """Put ``data`` in place of a referenced file and sign a manifest that records it."""
    doc = manifest_doc(store_path, 3)
    entry = doc["segments"][seg_index]
    rel = entry[rel_key]
    with open(os.path.join(store_path, rel), "wb") as f:
        f.write(bytes(data))
    size_key, crc_key = ("bytes", "crc32c") if rel_key == "file" else ("groups_bytes", "groups_crc32c")
    entry[size_key], entry[crc_key] = len(bytes(data)), crc32c(bytes(data))
    doc["generation"] = 4
    write_manifest(store_path, 4, sign(doc))
    return rel


def _segment_batch(store_path, i):
    return pa.ipc.open_file(os.path.join(store_path, fmt.segment_file(i))).get_batch(0)


@pytest.mark.parametrize("case", ["int64-tokens", "renamed-column", "missing-column", "extra-column",
                                  "two-batches", "not-arrow"])
def test_segment_schema_disagrees_with_format_json(store_path, case):
    b = _segment_batch(store_path, 1)
    cols = {n: b.column(n) for n in b.schema.names}
    if case == "int64-tokens":
        cols["completion_ids"] = cols["completion_ids"].cast(pa.large_list(pa.int64()))
    elif case == "renamed-column":
        cols["completion_idz"] = cols.pop("completion_ids")
    elif case == "missing-column":
        cols.pop("rewards")
    elif case == "extra-column":
        cols["extra"] = pa.array(np.zeros(len(b), dtype=np.int64))
    if case == "two-batches":
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, b.schema) as w:
            w.write_batch(b)
            w.write_batch(b)
        data = sink.getvalue()
    elif case == "not-arrow":
        data = os.urandom(4096)
    else:
        data = encode_ipc(pa.RecordBatch.from_pydict(cols))
    rel = _forge_segment(store_path, 1, data)
    store = open_hostile(store_path)
    with pytest.raises(CorruptStoreError, match=rel.split("/")[1]):
        store.read(store.row_ids())
    store.read([0])  # the other segment is fine
    report = verify_store(store_path)
    assert not report["ok"] and any(rel in p for p in report["problems"]), report


def test_format_json_schema_disagrees_with_segments(store_path):
    path = os.path.join(store_path, fmt.FORMAT_FILE)
    with open(path) as f:
        doc = json.load(f)
    for col in doc["schema"]:
        if col["name"] == "rewards":
            col["dtype"] = "float64"
    with open(path, "w") as f:
        json.dump(sign(doc), f)  # a forged FORMAT.json with a valid checksum
    store = open_hostile(store_path)
    with pytest.raises(CorruptStoreError, match="000000000000.arrow"):
        store.read([0])
    assert not verify_store(store_path)["ok"]


@pytest.mark.parametrize("case", ["missing-rows", "rows-as-strings", "negative-counts"])
def test_forged_group_sidecar(store_path, case):
    keys = pa.array([0, 1], type=pa.int64())
    if case == "missing-rows":
        rb = pa.RecordBatch.from_pydict({"key": keys, "count": pa.array([3, 3])})
    elif case == "rows-as-strings":
        rb = pa.RecordBatch.from_pydict({"key": keys, "count": pa.array([3, 3]),
                                         "rows": pa.array([["a"] * 3, ["b"] * 3], type=pa.large_list(pa.string()))})
    else:
        rb = pa.RecordBatch.from_pydict({"key": keys, "count": pa.array([-1, 7]),
                                         "rows": pa.array([[0, 1, 2], [3, 4, 5]], type=pa.large_list(pa.int64()))})
    _forge_segment(store_path, 0, encode_ipc(rb), rel_key="groups_file")
    store = open_hostile(store_path)
    with pytest.raises(CorruptStoreError):
        store.group_index()


def _forge_state(store_path, doc, arrays=()):
    cols = [pa.LargeListArray.from_arrays(pa.array([0, a.size], type=pa.int64()), pa.array(a)) for a in arrays]
    schema = pa.schema([pa.field(f"a{i}", c.type) for i, c in enumerate(cols)],
                       metadata={STATE_META: json.dumps(doc).encode()})
    rb = pa.RecordBatch.from_arrays(cols, schema=schema) if cols else pa.RecordBatch.from_pylist([], schema=schema)
    data = encode_ipc(rb).to_pybytes()
    mdoc = manifest_doc(store_path, 3)
    entry = mdoc["states"]["sampler"]
    with open(os.path.join(store_path, entry["file"]), "wb") as f:
        f.write(data)
    entry["bytes"], entry["crc32c"] = len(data), crc32c(data)
    mdoc["generation"] = 4
    write_manifest(store_path, 4, sign(mdoc))
    return open_hostile(store_path)


ARR = np.arange(3, dtype=np.int64)


@pytest.mark.parametrize("doc", [
    {"x": {"__array__": 5, "dtype": "<i8", "shape": [3]}},
    {"x": {"__array__": True, "dtype": "<i8", "shape": [3]}},
    {"x": {"__array__": 0, "dtype": 5, "shape": [3]}},
    {"x": {"__array__": 0, "dtype": "<i8", "shape": [10 ** 12]}},
    {"x": {"__array__": 0, "dtype": "<i8", "shape": "abc"}},
])
def test_forged_state_file(store_path, doc):
    store = _forge_state(store_path, doc, [ARR])
    with pytest.raises(CorruptStoreError):
        store.load_state("sampler")


@pytest.mark.parametrize("doc", [
    {"__dict__": 5},
    {"x": {"__array__": 0}},
    {"x": {"__array__": 0, "dtype": "O", "shape": [3]}},
])
def test_forged_state_structure(store_path, doc):
    store = _forge_state(store_path, doc, [ARR])
    try:
        state = store.load_state("sampler")
    except CorruptStoreError:
        return
    arrays = [v for v in state.values() if isinstance(v, np.ndarray)]
    assert all(a.dtype.kind in "biuf" for a in arrays), "a state array of a non-numeric dtype was built"


# --------------------------------------------------------------------------- fuzzing the parsers

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _only_clear_errors(fn, *args):
    try:
        return fn(*args)
    except CLEAR:
        return None


def _valid_manifest():
    seg = fmt.SegmentEntry(id=0, first_row=0, num_rows=4, bytes=100, crc32c=7, groups_bytes=50, groups_crc32c=9)
    seg2 = fmt.SegmentEntry(id=1, first_row=4, num_rows=4, bytes=100, crc32c=8, groups_bytes=50, groups_crc32c=9)
    st_ = fmt.StateEntry("sampler", 2, 30, 5)
    return fmt.Manifest(generation=2, head=1, next_row=8, next_segment=2, segments=(seg, seg2),
                        states={"sampler": st_}).to_dict()


def _paths(doc, prefix=()):
    """Every (path to a value) inside a JSON document."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


@FUZZ
@given(doc=JSON)
def test_fuzz_manifest_arbitrary(doc):
    m = _only_clear_errors(fmt.Manifest.from_dict, doc, "fuzz")
    assert m is None or isinstance(m, fmt.Manifest)


@FUZZ
@given(data=st.data())
def test_fuzz_manifest_mutated(data):
    """A valid manifest with one value replaced, re-signed: only valid objects or clear errors."""
    doc = _valid_manifest()
    # ("states",) itself is left alone: a new state *name* is test_manifest_state_name_cannot_escape's
    paths = [p for p in _paths(doc) if p and p != ("checksum",) and p != ("states",)]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(JSON)
    target = doc
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    m = _only_clear_errors(fmt.Manifest.from_dict, sign(doc), "fuzz")
    if m is not None:
        m.validate("fuzz")
        assert fmt.Manifest.from_dict(m.to_dict(), "again") == m  # what parses, round-trips


@FUZZ
@given(doc=JSON, use_valid=st.booleans(), key=st.sampled_from(
    ["format", "version", "group_key", "capacity_rows", "capacity_bytes", "schema"]), value=JSON)
def test_fuzz_store_options(doc, use_valid, key, value):
    if use_valid:
        doc = fmt.StoreOptions(group_key="prompt_id", capacity_rows=10).to_dict()
        doc[key] = value
    opts = _only_clear_errors(fmt.StoreOptions.from_dict, doc)
    assert opts is None or isinstance(opts, fmt.StoreOptions)


COLUMN = st.fixed_dictionaries({}, optional={
    "name": JSON | st.sampled_from(["prompt_id", "completion_ids", ""]),
    "kind": JSON | st.sampled_from(["ragged", "scalar", "vector"]),
    "dtype": JSON | st.sampled_from(["int32", "float32", "int64", "string", "bool", "object"]),
    "align": JSON | st.sampled_from(["prompt", "completion"]),
    "width": JSON | st.integers(-2, 1 << 21),
})


@FUZZ
@given(items=JSON | st.lists(COLUMN | JSON, max_size=4))
def test_fuzz_schema(items):
    schema = _only_clear_errors(Schema.from_list, items)
    if schema is not None:
        schema.arrow_schema()  # what parses, describes real Arrow types
        assert Schema.from_list(schema.to_list()) == schema


@FUZZ
@given(raw=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()))
def test_fuzz_read_json(tmp_path, raw):
    p = tmp_path / "fuzz.json"
    p.write_bytes(raw)
    _only_clear_errors(fmt.read_json, str(p))


def test_opening_never_imports_pickle_or_evaluates(store_path, monkeypatch):
    """Opening and reading a store touches no pickle, eval or torch.load."""
    import builtins
    import pickle

    def forbidden(*a, **k):
        raise AssertionError("code execution path used while opening a store")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    store = ReplayStore(store_path, readonly=True)
    check_live_rows(store)
    assert store.load_state("sampler")["k"] == 1
    assert verify_store(store_path)["ok"]
    assert isinstance(DiskReplayError("x"), Exception)


@pytest.mark.parametrize("multi_writer", [False, True])
def test_a_store_whose_manifests_were_deleted_keeps_its_rows_for_a_person(tmp_path, multi_writer):
    # a newcomer's session: `rm manifests/*`, then verify said ok and the next writer deleted every segment
    from diskreplay.verify import repair_store

    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=multi_writer) as store:
        for i in range(5):
            store.extend({"prompt_id": [i, i], "completion_ids": [[1, 2], [3]]})
    segments = sorted(os.listdir(os.path.join(path, "segments")))
    data = {n: open(os.path.join(path, "segments", n), "rb").read() for n in segments}
    for name in os.listdir(os.path.join(path, "manifests")):
        os.remove(os.path.join(path, "manifests", name))
    for d in ("segments", "groups", "state", "tokens"):  # written two hours ago: no commit in flight
        for name in os.listdir(os.path.join(path, d)) if os.path.isdir(os.path.join(path, d)) else ():
            os.utime(os.path.join(path, d, name), (time.time() - 7200,) * 2)
    report = verify_store(path)
    assert not report["ok"] and any("no manifest at all" in p and "segments/" in p for p in report["problems"])
    with pytest.raises(CorruptStoreError, match="no manifest at all"):
        repair_store(path, force=True)
    assert sorted(os.listdir(os.path.join(path, "segments"))) == segments  # repair changed nothing
    with pytest.warns(RuntimeWarning, match="moved to quarantine/ .*not deleted"):
        store = ReplayStore(path, multi_writer=multi_writer)
    with store:
        store.extend({"prompt_id": [9], "completion_ids": [[4]]})  # cannot overwrite a set-aside file
        assert len(store) == 1
    kept = os.path.join(path, "quarantine", "segments")
    for name, raw in data.items():
        if raw:  # an empty reserved name holds no rows
            assert open(os.path.join(kept, name), "rb").read() == raw
    assert verify_store(path)["ok"]


def test_verify_of_a_damaged_format_json_reports_it_once(store_path):
    # it also reported each segment's sidecar "but FORMAT.json has no group key": follow-ons of the one problem
    with open(os.path.join(store_path, "FORMAT.json"), "w") as f:
        f.write("{bad")
    report = verify_store(store_path)
    assert len(report["problems"]) == 1 and "FORMAT.json is not valid JSON" in report["problems"][0]


def test_recent_files_of_a_many_writer_store_whose_manifests_were_deleted_are_kept_too(tmp_path):
    """Files younger than retain_seconds may be a first commit in flight, so the open keeps them; once
    the store had manifests again they looked like any orphan and a later sweep deleted them."""
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, retain_seconds=60) as store:
        store.extend({"prompt_id": [0, 0], "completion_ids": [[1, 2], [3]]})
        store.extend({"prompt_id": [1], "completion_ids": [[4]]})
    segments = sorted(os.listdir(os.path.join(path, "segments")))
    data = {n: open(os.path.join(path, "segments", n), "rb").read() for n in segments}
    shutil.rmtree(os.path.join(path, "manifests"))
    os.mkdir(os.path.join(path, "manifests"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # young: nothing is moved (nor deleted) yet
        store = ReplayStore(path, multi_writer=True, retain_seconds=60)
    store.extend({"prompt_id": [9], "completion_ids": [[5]]})  # the store has a manifest again
    for name in segments:  # ... and the old files are past retention now
        os.utime(os.path.join(path, "segments", name), (time.time() - 120,) * 2)
    store._committer.gc._ripe = {}  # when it meant to look at them again: now, as the clock moved 2 minutes
    with pytest.warns(RuntimeWarning, match="no manifest ever named"):
        store._committer.collect(full=True)
    store.close()
    for name, raw in data.items():
        if raw:
            assert open(os.path.join(path, "quarantine", "segments", name), "rb").read() == raw
    assert not os.path.exists(os.path.join(path, "quarantine", "pending.json"))
    assert verify_store(path)["ok"]


def _four_rows(key):
    return {"prompt_id": [key] * 4, "completion_ids": [list(range(i, i + 3)) for i in range(4)]}


def test_repair_keeps_the_manifests_a_kept_delta_applies_to(tmp_path):
    """An evicted segment's file went missing (only older manifests named it); repair quarantined those
    manifests although the newest one is an append delta on them: no open worked any more."""
    d = str(tmp_path / "s")
    with ReplayStore(d, capacity=8, multi_writer=True) as s:
        for i in range(3):
            s.extend(_four_rows(i))  # the third evicts segment 0, which generations 1 and 2 still name
    os.remove(os.path.join(d, "segments", "000000000000.arrow"))
    repair_store(d, force=True)
    with ReplayStore(d, readonly=True) as r:
        assert r.read(np.arange(4, 12))["prompt_id"].tolist() == [1] * 4 + [2] * 4
    assert verify_store(d)["ok"]


def test_repair_of_a_damaged_state_alone_keeps_head(tmp_path):
    """Only a saved state was damaged; repair set head to the first segment's first row, which made
    evicted rows live again (beyond the capacity) and reported them as "dropped"."""
    d = str(tmp_path / "s")
    with ReplayStore(d, capacity=10) as s:
        s.extend(_four_rows(0))
        s.save_state("sampler", {"x": 1})
        for i in range(1, 4):
            s.extend(_four_rows(i))
        head = s.head
    (state,) = os.listdir(os.path.join(d, "state"))
    with open(os.path.join(d, "state", state), "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 1]))
    actions = repair_store(d)["actions"]
    assert not any("dropping rows" in a for a in actions) and any("saved state 'sampler'" in a for a in actions)
    with ReplayStore(d, readonly=True) as r:
        assert (r.head, len(r)) == (head, 10)
    assert verify_store(d)["ok"]


def test_a_store_that_lost_format_json_is_not_created_anew(tmp_path):
    """A writer's open of a store whose FORMAT.json was deleted created a new one with default options
    (capacity None) and accepted another schema, after which every old segment was unreadable."""
    d = str(tmp_path / "s")
    with ReplayStore(d, capacity=30) as s:
        for i in range(3):
            s.extend(_four_rows(i))
    os.remove(os.path.join(d, "FORMAT.json"))
    before = sorted(os.listdir(d))
    with pytest.raises(CorruptStoreError, match=r"manifests/.*but no FORMAT.json: it was lost"):
        ReplayStore(d)
    assert sorted(os.listdir(d)) == before


@pytest.mark.parametrize("readonly", [True, False])
def test_a_multi_writer_store_that_lost_schema_json_says_so(tmp_path, readonly):
    """Without SCHEMA.json a reader's read returned {} for rows it counted, verify blamed FORMAT.json,
    and a writer fixed a new schema, after which every committed segment was unreadable."""
    d = str(tmp_path / "s")
    with ReplayStore(d, multi_writer=True) as s:
        for i in range(3):
            s.extend(_four_rows(i))
    os.remove(os.path.join(d, "SCHEMA.json"))
    with pytest.raises(CorruptStoreError, match="schema is gone.*SCHEMA.json is missing"):
        ReplayStore(d, readonly=readonly)
    assert not os.path.exists(os.path.join(d, "SCHEMA.json"))
    assert any("SCHEMA.json is missing" in p for p in verify_store(d)["problems"])


@pytest.mark.parametrize("readonly", [True, False])
def test_a_missing_group_index_file_is_rebuilt_from_the_sidecars(tmp_path, readonly):
    """verify said readers rebuild a missing persisted group index from the sidecars; they raised an
    uncaught FileNotFoundError (a damaged one was handled)."""
    from diskreplay import PromptGroupSampler

    d = str(tmp_path / "s")
    with ReplayStore(d) as s:
        for i in range(40):
            s.extend({"prompt_id": [i, i], "completion_ids": [[i], [i, i]]})
        index = s.manifest.group_index.file
        want = s.group_index()
        want = {int(k): want.group(i).tolist() for i, k in enumerate(want.keys)}
    os.remove(os.path.join(d, index))
    with ReplayStore(d, readonly=readonly) as r:
        with pytest.warns(RuntimeWarning, match="is missing; the group index is rebuilt from the group sidecars"):
            got = r.group_index()
        assert {int(k): got.group(i).tolist() for i, k in enumerate(got.keys)} == want
        assert len(PromptGroupSampler(num_groups=2, seed=0).sample(r, 4)) == 4


def test_a_delta_whose_base_manifest_is_gone_is_named(tmp_path):
    """verify said ok (0 rows) and every open failed after 1000 listings blaming "something deleting
    them" when the full manifest an append delta applies to was deleted."""
    d = str(tmp_path / "s")
    with ReplayStore(d, multi_writer=True) as s:
        for i in range(3):
            s.extend(_four_rows(i))
    os.remove(os.path.join(d, "manifests", "000000000001.json"))
    report = verify_store(d)
    assert not report["ok"]
    assert any("000000000003.json is an append delta, but" in p and "000000000001.json, a manifest it applies to, "
               "is missing" in p for p in report["problems"])
    with pytest.raises(CorruptStoreError, match="000000000003.json is an append delta, but .*000000000001.json"):
        ReplayStore(d, readonly=True)


@pytest.mark.parametrize("multi_writer", [False, True])
def test_repair_drops_a_damaged_token_log(tmp_path, multi_writer):
    """verify named a damaged sealed token log, repair did nothing, and every extend with a token raised
    CorruptStoreError from then on."""
    d = str(tmp_path / "s")
    with ReplayStore(d, multi_writer=multi_writer) as s:
        i = 0
        while not s.manifest.token_logs:  # (many writers seal at a checkpoint, 8 to 15 commits apart)
            s.extend({"prompt_id": [i], "completion_ids": [[i]]}, token=f"t{i}")
            i += 1
        log = s.manifest.token_logs[0]
    with open(os.path.join(d, log.file), "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 4]))
    assert any(log.file in p for p in verify_store(d)["problems"])
    actions = repair_store(d, force=True)["actions"]
    assert any(f"dropping the damaged token log {log.file}: its {log.count} exactly-once tokens" in a for a in actions)
    assert verify_store(d)["ok"]
    with ReplayStore(d) as s:
        rows = s.extend({"prompt_id": [99], "completion_ids": [[9]]}, token="brand-new")
        assert s.extend({"prompt_id": [99], "completion_ids": [[9]]}, token="brand-new").tolist() == rows.tolist()


def test_a_reader_open_across_a_repair_roll_back_reads_the_new_rows(tmp_path):
    """repair rolled back to generation 2 and the next commits reused generation 3 and segment id 2:
    a reader that had read segment 2 before kept serving its old rows for the new row ids. (Repair
    now keeps the lost segment's row ids as a hole: they are never served again.)"""
    d = str(tmp_path / "s")
    with ReplayStore(d) as w:
        for i in range(3):
            w.extend(_four_rows(i))  # segment 2 holds rows 8..11
    with ReplayStore(d, readonly=True) as reader:
        assert reader.read([8, 9])["prompt_id"].tolist() == [2, 2]
        os.remove(os.path.join(d, "segments", "000000000002.arrow"))
        repair_store(d)
        with ReplayStore(d) as w:
            for i in range(3):
                w.extend(_four_rows(70 + i))
        reader.refresh()
        from diskreplay import RowsEvictedError
        with pytest.raises(RowsEvictedError, match="repair dropped rows"):
            reader.read([8, 9])
        assert reader.read([12, 13])["prompt_id"].tolist() == [70, 70]


def test_an_error_opening_a_segment_keeps_its_errno_and_names_no_symlink(tmp_path, monkeypatch):
    """EIO, EMFILE or EACCES opening a segment became a CorruptStoreError with errno None, saying "a
    symlink is not allowed": callers could not tell a transient error from damage."""
    import errno as errno_module

    from diskreplay import StoreIOError

    d = str(tmp_path / "s")
    with ReplayStore(d) as s:
        s.extend(_four_rows(1))
    seg = os.path.join(d, "segments", "000000000000.arrow")
    real = os.open

    def failing(path, flags, *a, **k):
        if os.fspath(path) == seg:
            raise OSError(errno_module.EMFILE, "Too many open files")
        return real(path, flags, *a, **k)

    with ReplayStore(d, readonly=True) as r:
        monkeypatch.setattr(os, "open", failing)
        with pytest.raises(StoreIOError, match="Too many open files") as info:
            r.read([0])
        assert info.value.errno == errno_module.EMFILE and info.value.filename == seg
        assert "symlink" not in str(info.value)
        monkeypatch.setattr(os, "open", real)
        assert r.read([0])["prompt_id"].tolist() == [1]  # transient: the next read works
