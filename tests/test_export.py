"""Exports, imports, preference pairs, best-of-n and store_info against the store's own reads."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diskreplay import ReplayStore
from diskreplay.export import (ExportError, MissingDependencyError, OutputExistsError, best_of_n, export,
                               export_hf, export_jsonl, export_parquet, export_zarr, import_rollouts,
                               load_tokenizer, preference_pairs, store_info)
from diskreplay.export._common import plan_chunks

VOCAB = 300


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------

def fill_store(path, *, string_keys=True, extends=5, batch=16, seed=0, capacity=1000):
    """A store of several segments with every column kind: string or int group
    keys, a log-prob row that is None, a vector reward, a bool flag."""
    rng = np.random.default_rng(seed)
    with ReplayStore(path, capacity=capacity) as s:
        for e in range(extends):
            keys = [f"prompt {e}-{i // 4}" if string_keys else e * 100 + i // 4 for i in range(batch)]
            comp = [rng.integers(2, VOCAB, rng.integers(0, 9)).astype(np.int32) for _ in range(batch)]
            logp = [None if (e == 0 and i == 3) else -rng.random(len(c)).astype(np.float32)
                    for i, c in enumerate(comp)]
            s.extend({"prompt_id": keys,
                      "prompt_ids": [rng.integers(2, VOCAB, rng.integers(1, 6)) for _ in range(batch)],
                      "completion_ids": comp, "old_per_token_logps": logp,
                      "rewards": rng.random(batch).astype(np.float32),
                      "advantages": rng.standard_normal(batch).astype(np.float32),
                      "policy_version": np.full(batch, e, dtype=np.int64),
                      "reward_parts": rng.random((batch, 2)).astype(np.float32),
                      "truncated": rng.random(batch) < 0.5})
    return path


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return fill_store(str(tmp_path_factory.mktemp("store") / "store"))


@pytest.fixture(scope="module")
def int_store_path(tmp_path_factory):
    return fill_store(str(tmp_path_factory.mktemp("store") / "store"), string_keys=False, seed=1)


@pytest.fixture
def store(store_path):
    s = ReplayStore(store_path, readonly=True)
    yield s
    s.close()


def make_tokenizer(directory, with_transformers=True):
    """A WordLevel tokenizer (w0..w299 are ids 2..301) saved as tokenizer.json,
    wrapped as a transformers tokenizer when transformers is installed."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[EOS]": 1, **{f"w{i}": i + 2 for i in range(VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["[EOS]"])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    if with_transformers:
        try:
            import transformers
        except ImportError:
            return directory
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]",
                                             unk_token="[UNK]").save_pretrained(directory)
    return directory


def words(ids):
    return " ".join(f"w{i - 2}" if i >= 2 else ("[EOS]" if i == 1 else "[UNK]") for i in ids)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    pytest.importorskip("tokenizers")
    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


def assert_same_store(a, b):
    """Every live row, column, dtype and group of two stores agrees bit for bit."""
    assert a.schema == b.schema
    assert (a.group_key, a.capacity, len(a)) == (b.group_key, b.capacity, len(b))
    ra, rb = a.read(a.row_ids()), b.read(b.row_ids())
    assert list(ra) == list(rb)
    for name in ra:
        x, y = ra[name], rb[name]
        if hasattr(x, "offsets"):
            assert x.values.dtype == y.values.dtype, name
            assert x.to_list() == y.to_list(), name
            assert np.array_equal(np.diff(x.offsets), np.diff(y.offsets))
            assert x.values.tobytes() == y.values.tobytes(), name
        elif isinstance(x, list):
            assert x == y, name
        else:
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
    assert a.group_keys() == b.group_keys()
    for k in a.group_keys():
        assert np.array_equal(a.group_rows(k) - a.head, b.group_rows(k) - b.head)


def leftovers(directory):
    return [f for f in os.listdir(directory) if f.startswith(".")]


# --------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["parquet", "zarr", "hf"])
def test_round_trip_is_exact(store, tmp_path, fmt):
    if fmt == "zarr":
        pytest.importorskip("zarr")
    if fmt == "hf":
        pytest.importorskip("datasets")
    out = str(tmp_path / f"out.{fmt}")
    res = export(store, out, fmt)
    assert res["rows"] == len(store)
    info = import_rollouts(out, str(tmp_path / "back"))
    assert info["rows"] == len(store) and info["format"] == fmt and info["group_key"] == "prompt_id"
    with ReplayStore(str(tmp_path / "back"), readonly=True) as back:
        assert back.read(np.arange(8))["old_per_token_logps"][3] is None  # the None row survives
        assert_same_store(store, back)
    assert leftovers(tmp_path) == []


def test_round_trip_int_keys_and_small_chunks(int_store_path, tmp_path):
    """Many row groups and import chunks that do not line up with them."""
    with ReplayStore(int_store_path, readonly=True) as s:
        export_parquet(s, str(tmp_path / "o.parquet"), chunk_bytes=1500)
        assert pq.ParquetFile(str(tmp_path / "o.parquet")).num_row_groups > 2
        import_rollouts(str(tmp_path / "o.parquet"), str(tmp_path / "back"), chunk_rows=7)
        with ReplayStore(str(tmp_path / "back"), readonly=True) as back:
            assert_same_store(s, back)


def test_round_trip_after_eviction(tmp_path):
    """Only live rows are exported, and the capacity comes back."""
    path = fill_store(str(tmp_path / "s"), capacity=50)
    with ReplayStore(path, readonly=True) as s:
        assert s.head > 0
        export_parquet(s, str(tmp_path / "a.parquet"))
        import_rollouts(str(tmp_path / "a.parquet"), str(tmp_path / "back"))
        with ReplayStore(str(tmp_path / "back"), readonly=True) as back:
            assert back.capacity == 50
            assert_same_store(s, back)


def test_plan_chunks_covers_live_rows_in_order(store):
    starts = [seg.first_row for seg in store.manifest.segments]
    for size in (1, 2000, 10 ** 9):
        chunks = plan_chunks(store, size)
        pieces = [p for c in chunks for p in c]
        assert pieces[0][0] == store.head and pieces[-1][1] == store.next_row
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        for lo, hi in pieces:  # a piece never crosses a segment boundary
            assert not any(lo < s < hi for s in starts)
    assert len(plan_chunks(store, 10 ** 9)) == 1  # small segments share a chunk
    assert len(plan_chunks(store, 1)) == len(store)  # and large ones are split


# --------------------------------------------------------------------------
# the files, read by the ecosystem's libraries
# --------------------------------------------------------------------------

def test_parquet_readable_by_pyarrow_polars_duckdb(store, tmp_path):
    out = str(tmp_path / "o.parquet")
    export_parquet(store, out)
    data = store.read(store.row_ids())
    t = pq.read_table(out)
    assert t.schema.field("completion_ids").type == pa.large_list(pa.int32())
    assert t.schema.field("old_per_token_logps").type == pa.large_list(pa.float32())
    assert t["completion_ids"].to_pylist() == data["completion_ids"].to_list()
    assert t["old_per_token_logps"][3].as_py() is None
    assert t["prompt_id"].to_pylist() == data["prompt_id"]
    total_tokens = int(np.diff(data["completion_ids"].offsets).sum())

    pl = pytest.importorskip("polars")
    df = pl.read_parquet(out)
    assert df.height == len(store)
    assert df["completion_ids"].list.len().sum() == total_tokens
    assert df["old_per_token_logps"].null_count() == 1
    assert df["rewards"].to_numpy().tobytes() == data["rewards"].tobytes()

    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect()
    n, toks, groups = con.execute(
        f"SELECT count(*), sum(len(completion_ids)), count(DISTINCT prompt_id) FROM read_parquet('{out}')").fetchone()
    assert (n, toks, groups) == (len(store), total_tokens, store.num_groups)


def test_hf_load_from_disk_has_sequence_features(store, tmp_path):
    datasets = pytest.importorskip("datasets")
    out = str(tmp_path / "ds")
    export_hf(store, out)
    ds = datasets.load_from_disk(out)
    assert len(ds) == len(store)
    for name, dtype in (("completion_ids", "int32"), ("prompt_ids", "int32"), ("old_per_token_logps", "float32")):
        feat = ds.features[name]
        assert isinstance(feat, (datasets.Sequence, getattr(datasets, "List", datasets.Sequence))), feat
        assert feat.feature.dtype == dtype
    data = store.read(store.row_ids())
    assert ds["completion_ids"][:] == data["completion_ids"].to_list()
    assert ds[3]["old_per_token_logps"] is None


def test_jsonl_one_rollout_per_line(store, tmp_path):
    out = str(tmp_path / "o.jsonl")
    res = export_jsonl(store, out)
    lines = open(out, encoding="utf-8").read().splitlines()
    assert len(lines) == res["rows"] == len(store)
    data = store.read(store.row_ids())
    for i in (0, 3, len(store) - 1):
        row = json.loads(lines[i])
        assert row["prompt_id"] == data["prompt_id"][i]
        assert row["completion_ids"] == data["completion_ids"][i].tolist()
        assert np.float32(row["rewards"]) == data["rewards"][i]  # float32 survives the decimal text
        assert row["reward_parts"] == data["reward_parts"][i].tolist()
        assert isinstance(row["truncated"], bool)
    assert json.loads(lines[3])["old_per_token_logps"] is None


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "json"])
def test_jsonl_is_exact_with_and_without_orjson(store, tmp_path, monkeypatch, fast):
    import diskreplay.export.writers as writers

    if fast:
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(writers, "_orjson", lambda: None)
    out = str(tmp_path / "o.jsonl")
    export_jsonl(store, out)
    rows = [json.loads(line) for line in open(out, encoding="utf-8")]
    data = store.read(store.row_ids())
    assert len(rows) == len(store)
    for i, row in enumerate(rows):
        for name, col in data.items():
            want = col[i] if col is not None else None
            got = row[name]
            if isinstance(want, np.ndarray):
                assert np.array_equal(np.asarray(got, dtype=want.dtype), want), (i, name)
            elif want is None or isinstance(want, str):
                assert got == want, (i, name)
            else:
                assert np.asarray(got, dtype=col.dtype) == want, (i, name)


def test_zarr_layout(store, tmp_path):
    zarr = pytest.importorskip("zarr")
    out = str(tmp_path / "a.zarr")
    export_zarr(store, out)
    g = zarr.open_group(out, mode="r")
    meta = dict(g.attrs)["diskreplay"]
    assert [c["name"] for c in meta["schema"]] == store.columns and meta["group_key"] == "prompt_id"
    data = store.read(store.row_ids())
    off = g["columns/completion_ids/offsets"][:]
    assert off.dtype == np.int64 and np.array_equal(off, data["completion_ids"].offsets)
    assert g["columns/completion_ids/values"][:].tobytes() == data["completion_ids"].values.tobytes()
    assert not g["columns/old_per_token_logps/validity"][3]
    assert g["columns/reward_parts"].shape == (len(store), 2)
    assert g["columns/prompt_id"][:].tolist() == data["prompt_id"]
    assert any(type(c).__name__ == "ShardingCodec" for c in g["columns/completion_ids/values"].metadata.codecs)
    gi = store.group_index()
    assert g["index/keys"][:].tolist() == list(gi.keys)
    assert np.array_equal(g["index/offsets"][:], gi.offsets)
    assert np.array_equal(g["index/rows"][:], gi.rows - store.head)


# --------------------------------------------------------------------------
# filters, columns, tokenizer
# --------------------------------------------------------------------------

def test_filters_and_columns(store, tmp_path):
    out = str(tmp_path / "o.parquet")
    res = export(store, out, columns=["prompt_id", "completion_ids", "rewards"], policy_versions="1:3",
                 min_reward=0.3, limit=20)
    data = store.read(store.row_ids())
    keep = np.flatnonzero((data["policy_version"] >= 1) & (data["policy_version"] <= 3)
                          & (data["rewards"] >= np.float32(0.3)))[:20]
    t = pq.read_table(out)
    assert t.column_names == ["prompt_id", "completion_ids", "rewards"] == res["columns"]
    assert t.num_rows == len(keep) == 20
    assert t["rewards"].to_numpy().tobytes() == data["rewards"][keep].tobytes()
    assert t["completion_ids"].to_pylist() == [data["completion_ids"][i].tolist() for i in keep]
    # a subset export still imports (with the group key it names)
    import_rollouts(out, str(tmp_path / "back"))
    with ReplayStore(str(tmp_path / "back"), readonly=True) as back:
        assert back.columns == ["prompt_id", "completion_ids", "rewards"] and back.group_key == "prompt_id"


@pytest.mark.parametrize("bad", [dict(columns=["nope"]), dict(policy_versions="3:1"), dict(policy_versions="x"),
                                 dict(min_reward=0.5, reward_key="truncated"), dict(format="csv")])
def test_bad_export_options(store, tmp_path, bad):
    kw = dict(bad)
    fmt = kw.pop("format", "parquet")
    with pytest.raises(ExportError):
        export(store, str(tmp_path / "o"), fmt, **kw)
    assert os.listdir(tmp_path) == []


def test_tokenizer_adds_text(store, tmp_path, tokenizer_dir):
    out = str(tmp_path / "o.jsonl")
    export_jsonl(store, out, tokenizer=tokenizer_dir, limit=5)
    data = store.read(np.arange(5))
    for i, line in enumerate(open(out).read().splitlines()):
        row = json.loads(line)
        # decoded after its prompt: the space between them is the completion's, so prompt + completion
        # tokenizes back to the ids (tests/test_trl_exports.py)
        assert row["completion"] == " " + words(data["completion_ids"][i])
        assert row["prompt"] == words(data["prompt_ids"][i])


def test_tokenizers_only_directory(tmp_path):
    pytest.importorskip("tokenizers")
    d = make_tokenizer(str(tmp_path / "t"), with_transformers=False)
    dec = load_tokenizer(d)
    from diskreplay.ragged import RaggedColumn

    assert dec.decode(RaggedColumn.from_arrays([[2, 3], [4]]), 2) == ["w0 w1", "w2"]


@pytest.mark.parametrize("with_transformers", [True, False])
def test_a_tokenizer_that_does_not_know_the_ids_is_refused(tmp_path, with_transformers):
    """Another model's tokenizer (its vocabulary smaller than the store's ids) decoded every prompt and
    completion to "" and the export said it succeeded."""
    pytest.importorskip("tokenizers")
    if with_transformers:
        pytest.importorskip("transformers")
    tok = make_tokenizer(str(tmp_path / "tok"), with_transformers=with_transformers)
    with ReplayStore(str(tmp_path / "s")) as s:
        s.extend({"prompt_id": [0, 0, 1, 1], "prompt_ids": [[2, 3]] * 4,
                  "completion_ids": [[4], [5], [94274, 6], [7]], "rewards": np.arange(4, dtype=np.float32)})
    with ReplayStore(str(tmp_path / "s"), readonly=True) as s:
        with pytest.raises(ExportError, match="column 'completion_ids' holds token id 94274, but the tokenizer"):
            export_jsonl(s, str(tmp_path / "o.jsonl"), tokenizer=tok)
        with pytest.raises(ExportError, match="94274"):
            preference_pairs(s, str(tmp_path / "p.jsonl"), tokenizer=tok)
        export_jsonl(s, str(tmp_path / "ids.jsonl"))  # without a tokenizer: the ids, as ever
    assert sorted(os.listdir(tmp_path)) == ["ids.jsonl", "s", "tok"]


def test_bad_tokenizer_directory(store, tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{not json")
    for d in (str(tmp_path / "tok"), str(tmp_path / "missing")):
        with pytest.raises(ExportError, match="tokenizer directory"):
            export(store, str(tmp_path / "o.jsonl"), "jsonl", tokenizer=d)
    assert not os.path.exists(tmp_path / "o.jsonl")


# --------------------------------------------------------------------------
# atomic outputs
# --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "hf", "zarr"])
def test_failure_midway_leaves_nothing(store_path, tmp_path, monkeypatch, fmt):
    if fmt in ("hf", "zarr"):
        pytest.importorskip({"hf": "datasets", "zarr": "zarr"}[fmt])
    calls = {"n": 0}
    real = ReplayStore.read

    def failing(self, rows, columns=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk went away")
        return real(self, rows, columns)

    monkeypatch.setattr(ReplayStore, "read", failing)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk went away"):
        export(store_path, str(out), fmt, chunk_bytes=2000)
    assert calls["n"] == 3
    assert os.listdir(tmp_path) == []


def test_existing_output_is_refused_then_overwritten(store, tmp_path):
    out = tmp_path / "o.parquet"
    out.write_text("precious")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        export_parquet(store, str(out))
    assert out.read_text() == "precious"
    export_parquet(store, str(out), overwrite=True)
    assert pq.read_table(str(out)).num_rows == len(store)
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputExistsError):
        import_rollouts(str(out), str(tmp_path / "d"))
    import_rollouts(str(out), str(tmp_path / "d"), overwrite=True)
    assert leftovers(tmp_path) == []


def test_missing_optional_dependency(store, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "zarr", None)
    with pytest.raises(MissingDependencyError, match=r"diskreplay\[zarr\]"):
        export(store, str(tmp_path / "a.zarr"), "zarr")
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------
# imports of other frameworks' dumps
# --------------------------------------------------------------------------

def write_dump(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


def dump_rows(n=10):
    return [{"uid": f"q{i // 3}", "prompt_token_ids": [1, 2, i], "response_tokens": list(range(i % 4 + 1)),
             "logprobs": None if i == 2 else [-0.5] * (i % 4 + 1), "reward": i % 2, "step": i // 5,
             "meta_text": f"row {i}"} for i in range(n)]


def test_import_jsonl_with_mapping(tmp_path):
    src = write_dump(tmp_path / "dump.jsonl", dump_rows())
    res = import_rollouts(src, str(tmp_path / "s"), mapping=[
        "prompt_ids=prompt_token_ids", "completion_ids=response_tokens", "old_per_token_logps=logprobs",
        "rewards=reward", "policy_version=step", "prompt_id=uid"], chunk_rows=4)
    assert res["rows"] == 10 and res["group_key"] == "prompt_id"
    with ReplayStore(str(tmp_path / "s"), readonly=True) as s:
        d = s.read(s.row_ids())
        assert s.columns == ["prompt_id", "prompt_ids", "completion_ids", "old_per_token_logps", "rewards",
                             "policy_version", "meta_text"]
        assert d["completion_ids"][4].tolist() == [0] and d["completion_ids"][4].dtype == np.int32
        assert d["old_per_token_logps"][2] is None and d["old_per_token_logps"][1].tolist() == [-0.5, -0.5]
        assert d["rewards"].dtype == np.float64 and d["rewards"].tolist() == [i % 2 for i in range(10)]
        assert d["policy_version"].tolist() == [i // 5 for i in range(10)]
        assert s.num_groups == 4


def test_import_jsonl_with_aliases_and_columns(tmp_path):
    src = write_dump(tmp_path / "dump.jsonl", dump_rows())
    import_rollouts(src, str(tmp_path / "s"), aliases=True,
                    columns=["prompt_id", "completion_ids", "rewards", "policy_version"])
    with ReplayStore(str(tmp_path / "s"), readonly=True) as s:
        assert s.columns == ["prompt_id", "completion_ids", "rewards", "policy_version"]
        assert s.group_key == "prompt_id" and len(s) == 10


def test_import_bad_mapping(tmp_path):
    src = write_dump(tmp_path / "dump.jsonl", dump_rows())
    for mapping, match in ((["completion_ids=nope"], "'nope' named in the mapping"),
                           (["completion_ids"], "NEW=OLD"),
                           (["meta_text=uid"], "clashes")):
        with pytest.raises(ExportError, match=match):
            import_rollouts(src, str(tmp_path / "s"), mapping=mapping)
    with pytest.raises(ExportError, match="'nope' is not in"):
        import_rollouts(src, str(tmp_path / "s"), columns=["nope"])
    with pytest.raises(ExportError, match="group key"):
        import_rollouts(src, str(tmp_path / "s"), group_key="nope")
    assert sorted(os.listdir(tmp_path)) == ["dump.jsonl"]


def test_import_bad_lines(tmp_path):
    rows = dump_rows(12)
    rows[4] = '{"uid": "q1", "response_tokens": [1, 2'  # truncated line
    rows[6] = "[1, 2, 3]"  # not an object
    rows[7]["logprobs"] = [-0.5] * 9  # does not align with its tokens
    rows[8]["reward"] = "high"  # changes type
    src = write_dump(tmp_path / "dump.jsonl", rows)
    with pytest.raises(ExportError, match=r"dump\.jsonl:5: not valid JSON.*--skip-bad"):
        import_rollouts(src, str(tmp_path / "s"), chunk_rows=2, aliases=True)
    assert sorted(os.listdir(tmp_path)) == ["dump.jsonl"]  # no half-built store
    res = import_rollouts(src, str(tmp_path / "s"), aliases=True, skip_bad=True, chunk_rows=2)
    assert res["skipped"] == 4 and res["rows"] == 8
    assert [b.split(":")[1] for b in res["bad_lines"]] == ["5", "7", "8", "9"]
    with ReplayStore(str(tmp_path / "s"), readonly=True) as s:
        assert s.read(s.row_ids(), ["meta_text"])["meta_text"] == [f"row {i}" for i in (0, 1, 2, 3, 5, 9, 10, 11)]


def test_import_first_rows_without_logprobs(tmp_path):
    """A per-token column absent from the first chunk still becomes a store column."""
    rows = [{"prompt_id": 0, "completion_ids": [1, 2], "logps": None} for _ in range(5)]
    rows += [{"prompt_id": 1, "completion_ids": [3], "logps": [-1.5]}]
    src = write_dump(tmp_path / "d.jsonl", rows)
    import_rollouts(src, str(tmp_path / "s"), chunk_rows=2)
    with ReplayStore(str(tmp_path / "s"), readonly=True) as s:
        d = s.read(s.row_ids())
        assert d["logps"].to_list() == [None] * 5 + [[-1.5]]


def test_import_append_and_format_detection(store_path, tmp_path):
    with ReplayStore(store_path, readonly=True) as s:
        export_parquet(s, str(tmp_path / "o.bin"))
        n = len(s)
    import_rollouts(str(tmp_path / "o.bin"), str(tmp_path / "s"))
    res = import_rollouts(str(tmp_path / "o.bin"), str(tmp_path / "s"), append=True)
    assert res["store_rows"] == 2 * n
    with pytest.raises(ExportError, match="--append needs an existing store"):
        import_rollouts(str(tmp_path / "o.bin"), str(tmp_path / "t"), append=True)
    (tmp_path / "x.dat").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ExportError, match="--format"):
        import_rollouts(str(tmp_path / "x.dat"), str(tmp_path / "u"))


# --------------------------------------------------------------------------
# pairs and best-of-n on hand-made groups
# --------------------------------------------------------------------------

@pytest.fixture
def groups_store(tmp_path):
    path = str(tmp_path / "g")
    with ReplayStore(path) as s:
        s.extend({"prompt_id": ["a", "a", "a", "b", "c", "c", "d", "d"],
                  "prompt_ids": [[2, 3]] * 3 + [[4]] + [[5]] * 2 + [[6]] * 2,
                  "completion_ids": [[10], [11, 12], [13], [14], [15], [16], [17], [18]],
                  "rewards": np.array([0.2, 1.0, 0.0, 1.0, 0.5, 0.5, 0.3, 0.0], dtype=np.float32),
                  "policy_version": [0, 0, 1, 1, 1, 1, 2, 2]})
        s.extend({"prompt_id": ["a"], "prompt_ids": [[2, 3]], "completion_ids": [[19]],
                  "rewards": np.array([1.0], dtype=np.float32), "policy_version": [3]})
    return path


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_preference_pairs(groups_store, tmp_path):
    res = preference_pairs(groups_store, str(tmp_path / "p.jsonl"))
    rows = read_jsonl(tmp_path / "p.jsonl")
    # a: highest 1.0 (row 1, older than row 8), lowest 0.0 (row 2); b: one row; c: a tie; d: margin 0.3
    assert res["pairs"] == 2 and [r["prompt_id"] for r in rows] == ["a", "d"]
    a = rows[0]
    assert (a["prompt_ids"], a["chosen_ids"], a["rejected_ids"]) == ([2, 3], [11, 12], [13])
    assert (a["chosen_row"], a["rejected_row"], a["margin"]) == (1, 2, 1.0)
    preference_pairs(groups_store, str(tmp_path / "q.parquet"), min_margin=0.5, format="parquet")
    assert pq.read_table(str(tmp_path / "q.parquet"))["prompt_id"].to_pylist() == ["a"]
    preference_pairs(groups_store, str(tmp_path / "r.jsonl"), policy_versions="1:")
    assert [(r["prompt_id"], r["chosen_row"], r["rejected_row"]) for r in read_jsonl(tmp_path / "r.jsonl")] == [
        ("a", 8, 2), ("d", 6, 7)]


def test_preference_pairs_text(groups_store, tmp_path, tokenizer_dir):
    preference_pairs(groups_store, str(tmp_path / "p.jsonl"), tokenizer=tokenizer_dir)
    a = read_jsonl(tmp_path / "p.jsonl")[0]
    assert (a["prompt"], a["chosen"], a["rejected"]) == ("w0 w1", " w9 w10", " w11")
    assert "prompt_ids" not in a


def test_best_of_n(groups_store, tmp_path):
    res = best_of_n(groups_store, str(tmp_path / "b.jsonl"), k=2, min_reward=0.25)
    rows = read_jsonl(tmp_path / "b.jsonl")
    # a: rows 1 and 8 tie at 1.0 (older first), row 0 is below 0.25; c: a tie; d: only row 6 passes
    assert [(r["prompt_id"], r["row"], r["rank"]) for r in rows] == [
        ("a", 1, 0), ("a", 8, 1), ("b", 3, 0), ("c", 4, 0), ("c", 5, 1), ("d", 6, 0)]
    assert res["rows"] == 6
    first = rows[0]
    assert first["input_ids"] == [2, 3, 11, 12] and first["completion_mask"] == [0, 0, 1, 1]
    assert first["completion_ids"] == [11, 12] and first["reward"] == 1.0


def test_best_of_n_counts_and_text(groups_store, tmp_path, tokenizer_dir):
    res = best_of_n(groups_store, str(tmp_path / "b.parquet"), k=1, format="parquet", tokenizer=tokenizer_dir)
    t = pq.read_table(str(tmp_path / "b.parquet"))
    assert res["rows"] == 4 and t.column_names[:2] == ["prompt", "completion"]
    assert t["completion"].to_pylist() == [" w9 w10", " w12", " w13", " w15"]
    with pytest.raises(ExportError, match="positive"):
        best_of_n(groups_store, str(tmp_path / "c.jsonl"), k=0)
    with pytest.raises(ExportError, match="reward column"):
        best_of_n(groups_store, str(tmp_path / "c.jsonl"), reward_key="nope")


# --------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------

def test_store_info(store):
    info = store_info(store)
    d = store.read(store.row_ids())
    assert (info["rows"], info["groups"], info["segments"]) == (len(store), store.num_groups, 5)
    assert info["tokens"]["completion"] == int(np.diff(d["completion_ids"].offsets).sum())
    r = d["rewards"].astype(np.float64)
    s = info["stats"]["rewards"]
    assert s["count"] == len(r) and np.isclose(s["mean"], r.mean()) and np.isclose(s["std"], r.std())
    assert (s["min"], s["max"]) == (r.min(), r.max())
    assert info["policy_version"] == {"min": 0, "max": 4}
    assert info["bytes_per_completion_token"] == info["bytes"] / info["tokens"]["completion"]
    assert [c["name"] for c in info["columns"]] == store.columns


def test_import_from_another_store_and_merge(store, tmp_path):
    res = import_rollouts(store.path, str(tmp_path / "copy"))
    assert res["format"] == "store"
    with ReplayStore(str(tmp_path / "copy"), readonly=True) as c:
        assert_same_store(store, c)
    import_rollouts(store.path, str(tmp_path / "copy"), append=True, chunk_rows=7)
    with ReplayStore(str(tmp_path / "copy"), readonly=True) as c:
        assert len(c) == 2 * len(store) and c.num_groups == store.num_groups


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_an_interrupted_import_append_resumes_without_duplicates(store_path, tmp_path, monkeypatch, fmt):
    """Running an interrupted ``import --append`` again appended every row again (256 of 4,096 twice):
    each chunk is committed with a token naming the source and the chunk, and the rerun skips those."""
    import diskreplay.export.importer as importer

    src = str(tmp_path / f"o.{fmt}")
    (export_parquet if fmt == "parquet" else export_jsonl)(store_path, src)
    target = str(tmp_path / "t")
    import_rollouts(src, target)  # a store of the same columns, to append to
    calls = {"n": 0}
    real = importer.check_interrupt

    def interrupt():
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        real()

    monkeypatch.setattr(importer, "check_interrupt", interrupt)
    with pytest.raises(KeyboardInterrupt):
        import_rollouts(src, target, append=True, chunk_rows=5)
    monkeypatch.undo()
    with ReplayStore(store_path, readonly=True) as source:
        total = len(source)
        want = source.read(source.row_ids(), ["rewards"])["rewards"]
    with ReplayStore(target, readonly=True) as t:
        partial = len(t) - total
    assert 0 < partial < total
    res = import_rollouts(src, target, append=True, chunk_rows=5)
    assert res["rows"] == total and res["already_imported"] == partial
    with ReplayStore(target, readonly=True) as t:
        assert len(t) == 2 * total
        np.testing.assert_array_equal(t.read(np.arange(total, 2 * total), ["rewards"])["rewards"], want)
    again = import_rollouts(src, target, append=True, chunk_rows=5)  # everything is in: nothing more
    assert again["already_imported"] == total
    with ReplayStore(target, readonly=True) as t:
        assert len(t) == 2 * total


def test_an_import_of_nothing_is_an_error_and_creates_nothing(tmp_path):
    """An empty source, or one whose every line was bad (--skip-bad), made an empty store without a
    schema (a later append then lost its group key) and said "imported 0 rows", exit 0."""
    empty, bad = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("")
    bad.write_text("not json\n{also not\n")
    with pytest.raises(ExportError, match="nothing to import from .*holds no rows"):
        import_rollouts(str(empty), str(tmp_path / "a"))
    with pytest.raises(ExportError, match="all 2 lines were bad"):
        import_rollouts(str(bad), str(tmp_path / "b"), skip_bad=True)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "empty.jsonl"]


@pytest.mark.parametrize("fmt", ["parquet", "hf"])
def test_an_output_made_meanwhile_is_not_replaced_without_overwrite(store_path, tmp_path, monkeypatch, fmt):
    """Two exports to one path: the later replaced the earlier's output, both said they wrote it (and a
    directory made at the path meanwhile was renamed away and deleted)."""
    import diskreplay.export.outputs as common

    if fmt == "hf":
        pytest.importorskip("datasets")
    out = str(tmp_path / ("o.parquet" if fmt == "parquet" else "o"))
    real = common._fsync_tree

    def another_export_finishes_first(path):
        real(path)
        if os.path.lexists(out):
            return
        if fmt == "parquet":
            with open(out, "w") as fh:
                fh.write("the other export's")
        else:
            os.mkdir(out)
            with open(os.path.join(out, "theirs"), "w") as fh:
                fh.write("the other export's")

    monkeypatch.setattr(common, "_fsync_tree", another_export_finishes_first)
    with pytest.raises(OutputExistsError, match="appeared while"):
        export(store_path, out, format=fmt)
    monkeypatch.undo()
    mine = open(out).read() if fmt == "parquet" else open(os.path.join(out, "theirs")).read()
    assert mine == "the other export's" and sorted(os.listdir(tmp_path)) == [os.path.basename(out)]
    if fmt == "parquet":
        export(store_path, out, format=fmt, overwrite=True)  # asked for: replaced


@pytest.mark.parametrize("bad, says", [({"completion_ids": [4, -5]}, "position 1 holds token id -5"),
                                       ({"completion_ids": [4, 2 ** 40]}, "holds 1099511627776, outside int32"),
                                       ({"old_per_token_logps": [float("nan"), -0.2]}, "position 0 is NaN")])
def test_a_jsonl_line_of_bad_values_is_named_and_skip_bad_skips_it(tmp_path, bad, says):
    """A line that parses but holds values no store takes (a negative or too large token id, NaN
    log-probs) stopped the import even with --skip-bad, and was named "lines 1-3 ... row 2"."""
    good = {"prompt_id": 1, "prompt_ids": [1, 2], "completion_ids": [4, 5], "old_per_token_logps": [-0.1, -0.2],
            "rewards": 1.0}
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in [good, {**good, **bad}, good]) + "\n")
    with pytest.raises(ExportError, match=rf"d\.jsonl:2: column '\w+' {says}.*--skip-bad"):
        import_rollouts(str(src), str(tmp_path / "a"))
    res = import_rollouts(str(src), str(tmp_path / "b"), skip_bad=True)
    assert res["rows"] == 2 and res["skipped"] == 1 and res["bad_lines"][0].startswith(f"{src}:2: ")
    with ReplayStore(str(tmp_path / "b"), readonly=True) as s:
        assert s.read([0, 1], ["completion_ids"])["completion_ids"].to_list() == [[4, 5], [4, 5]]


def test_import_refuses_to_replace_an_open_store(store_path, tmp_path):
    from diskreplay import StoreLockedError

    export_parquet(store_path, str(tmp_path / "o.parquet"))
    with ReplayStore(str(tmp_path / "live")) as live:
        live.extend({"prompt_id": [1], "completion_ids": [[1]]})
        with pytest.raises(StoreLockedError):
            import_rollouts(str(tmp_path / "o.parquet"), str(tmp_path / "live"), overwrite=True)
        assert len(live) == 1


def test_import_jsonl_column_missing_from_first_lines(tmp_path):
    rows = [{"prompt_id": i, "completion_ids": [1, 2]} for i in range(4)]
    rows += [{"prompt_id": 9, "completion_ids": [3], "ref_logps": [-0.25]}]
    src = write_dump(tmp_path / "d.jsonl", rows)
    import_rollouts(src, str(tmp_path / "s"), chunk_rows=2)
    with ReplayStore(str(tmp_path / "s"), readonly=True) as s:
        assert s.read(s.row_ids())["ref_logps"].to_list() == [None] * 4 + [[-0.25]]


# --------------------------------------------------------------------------
# token ids must be integers, in every source (issue 12 item 8)
# --------------------------------------------------------------------------

def _bad_ids_table(kind):
    """Rows 0-3 fine-looking, row 2 of completion_ids of the given bad kind."""
    ids = {"floats": [[1.0, 2.0], [3.0], [4.5, 5.0], [6.0]],
           "strings": [["1", "2"], ["3"], ["4"], ["5"]],
           "scalar strings": ["1 2", "3", "4", "5"],
           "scalar floats": [1.0, 2.0, 3.0, 4.0]}[kind]
    return pa.table({"prompt_id": [0, 0, 1, 1], "completion_ids": ids, "rewards": [1.0, 0.0, 1.0, 0.5]})


@pytest.mark.parametrize("kind, what", [("floats", "double values (1.0)"), ("strings", "string values ('1')"),
                                        ("scalar strings", "a string per row ('1 2')"),
                                        ("scalar floats", "a double per row (1.0)")])
def test_import_parquet_refuses_non_integer_token_ids(tmp_path, kind, what):
    src = tmp_path / "bad.parquet"
    pq.write_table(_bad_ids_table(kind), str(src))
    with pytest.raises(ExportError) as e:
        import_rollouts(str(src), str(tmp_path / "s"))
    msg = str(e.value)
    assert msg.startswith(f"{src}, row 0: column 'completion_ids' holds {what}") and "integers" in msg
    assert sorted(os.listdir(tmp_path)) == ["bad.parquet"]


def test_import_names_the_row_across_files_and_chunks(tmp_path):
    d = tmp_path / "parts"
    d.mkdir()
    good = pa.table({"prompt_id": [0] * 10, "completion_ids": [[1, 2]] * 10})
    pq.write_table(good, str(d / "a.parquet"))
    bad = pa.table({"prompt_id": [1] * 10, "completion_ids": [[]] * 7 + [[3.5]] + [[4.0]] * 2})
    pq.write_table(bad, str(d / "b.parquet"))
    with pytest.raises(ExportError, match=r"b\.parquet, row 7: column 'completion_ids' holds double values \(3\.5\)"):
        import_rollouts(str(d), str(tmp_path / "s"), chunk_rows=4)
    assert not (tmp_path / "s").exists()


def test_import_jsonl_float_or_string_ids_are_bad_lines(tmp_path):
    rows = [{"prompt_id": 0, "completion_ids": [1, 2], "rewards": 1.0},
            {"prompt_id": 0, "completion_ids": [3, 4.5], "rewards": 0.0},
            {"prompt_id": 1, "completion_ids": [5], "rewards": 1.0},
            {"prompt_id": 1, "completion_ids": ["6"], "rewards": 0.0},
            {"prompt_id": 2, "completion_ids": [7.0], "rewards": 1.0}]
    src = write_dump(tmp_path / "d.jsonl", rows)
    with pytest.raises(ExportError, match=r"d\.jsonl:2: column 'completion_ids' holds 4\.5 at position 1; token "
                                          r"ids must be integers \(pass --skip-bad"):
        import_rollouts(src, str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()
    # --skip-bad keeps its documented meaning: bad lines are skipped and counted
    res = import_rollouts(src, str(tmp_path / "s"), skip_bad=True)
    assert (res["rows"], res["skipped"]) == (2, 3)
    assert [line.split(": ")[0].rsplit(":", 1)[1] for line in res["bad_lines"]] == ["2", "4", "5"]
    with ReplayStore(str(tmp_path / "s"), readonly=True) as s:
        assert s.schema["completion_ids"].dtype == "int32"
        assert s.read(s.row_ids())["completion_ids"].to_list() == [[1, 2], [5]]


def test_import_hf_refuses_float_ids(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"prompt_id": [0, 1], "completion_ids": [[1.0, 2.0], [3.25]]})
    ds.save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ExportError, match=r"ds, row 0: column 'completion_ids' holds double values"):
        import_rollouts(str(tmp_path / "ds"), str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()


def test_import_zarr_refuses_float_ids(store, tmp_path):
    zarr = pytest.importorskip("zarr")
    out = str(tmp_path / "a.zarr")
    export_zarr(store, out, columns=["prompt_id", "completion_ids", "rewards"])
    g = zarr.open_group(out, mode="r+")
    values = g["columns/completion_ids/values"][:]
    del g["columns/completion_ids/values"]
    g.create_array("columns/completion_ids/values", data=values.astype(np.float32) + 0.5)
    with pytest.raises(ExportError, match=r"a\.zarr, row \d+: column 'completion_ids' holds float values"):
        import_rollouts(out, str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()


def test_import_keeps_extends_alignment_rule_and_says_where(tmp_path):
    """Per-token floats must align with the completions: extend's check, located in the file."""
    t = pa.table({"prompt_id": list(range(10)), "completion_ids": [[1, 2]] * 10,
                  "old_per_token_logps": [[-0.5, -0.5]] * 6 + [[-0.5]] + [[-0.5, -0.5]] * 3})
    pq.write_table(t, str(tmp_path / "m.parquet"))
    with pytest.raises(ExportError) as e:
        import_rollouts(str(tmp_path / "m.parquet"), str(tmp_path / "s"), chunk_rows=4)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'm.parquet'}, row 6: ") and "'old_per_token_logps'" in msg  # the file's row
    assert "row 2" not in msg and "count the rows of" not in msg
    assert not (tmp_path / "s").exists()


def test_info_on_a_store_whose_ids_are_not_ragged(tmp_path, monkeypatch):
    """A store written before extend checked token ids may hold them as strings; info still works."""
    import diskreplay.ingest as schema

    with monkeypatch.context() as m:  # what an older diskreplay accepted
        m.setattr(schema, "COMPLETION_IDS", "not-a-column")
        with ReplayStore(str(tmp_path / "s")) as s:
            s.extend({"prompt_id": [0, 1], "completion_ids": ["1 2", "3"], "rewards": [1.0, 0.0]})
    info = store_info(str(tmp_path / "s"))
    assert info["rows"] == 2 and info["tokens"] == {} and info["stats"]["rewards"]["count"] == 2


def test_the_error_classes_live_in_errors_and_keep_their_old_homes():
    import diskreplay
    import diskreplay.errors as errors
    import diskreplay.export as export_pkg
    import diskreplay.export._common as common

    for name in ("ExportError", "OutputExistsError", "MissingDependencyError", "EvictionRefusedError",
                 "StoreNotFoundError"):
        cls = getattr(errors, name)
        assert issubclass(cls, errors.DiskReplayError) and cls.__module__ == "diskreplay.errors"
        assert getattr(diskreplay, name) is cls and name in diskreplay.__all__
        assert getattr(export_pkg, name) is cls and name in export_pkg.__all__
    assert common.ExportError is errors.ExportError


def test_no_bare_builtin_errors_are_raised_from_cli_and_export():
    """Every ``raise`` in the CLI and the export package raises one of our classes (or re-raises)."""
    import ast
    import pathlib

    import diskreplay

    root = pathlib.Path(diskreplay.__file__).parent
    ours = {n for n in dir(__import__("diskreplay.errors", fromlist=["x"])) if n.endswith("Error")}
    ours |= {"KeyboardInterrupt", "ArgumentTypeError"}  # Ctrl-C re-raised; argparse's own usage error
    helpers = {"missing_store", "_null_rows_error", "_null_values_error", "_appeared"}  # functions returning one of ours
    bad = []
    for path in [*sorted((root / "cli").glob("*.py")), *sorted((root / "export").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                name = exc.id if isinstance(exc, ast.Name) else getattr(exc, "attr", None)
                if name not in ours and name not in helpers:
                    bad.append(f"{path.name}:{node.lineno} raises {name}")
    assert bad == []


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "json"])
def test_jsonl_writes_null_for_non_finite_floats_and_import_names_it(tmp_path, monkeypatch, fast):
    """JSON has no NaN or Infinity: both encoders write null (the standard library would write
    ``-Infinity``, which strict parsers refuse), and an import of a null inside a row says why."""
    import diskreplay.export.writers as writers

    if fast:
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(writers, "_orjson", lambda: None)
    s = ReplayStore(str(tmp_path / "s"))
    s.extend({"prompt_id": ["q1", "q1"], "completion_ids": [[1, 2], [3]],
              "old_per_token_logps": [[-0.1, -np.inf], [-0.2]], "rewards": np.array([np.nan, 1.0], np.float32)})
    out = str(tmp_path / "o.jsonl")
    res = export_jsonl(s, out)
    assert res["warnings"] and res["warnings"][0].startswith("2 NaN or infinite value(s) were written as null")

    def strict(text):
        raise AssertionError(f"not JSON: {text}")

    rows = [json.loads(line, parse_constant=strict) for line in open(out, encoding="utf-8")]
    assert rows[0]["old_per_token_logps"][1] is None and rows[0]["rewards"] is None
    assert np.float32(rows[0]["old_per_token_logps"][0]) == np.float32(-0.1) and rows[1]["rewards"] == 1.0
    with pytest.raises(ExportError, match=r"o.jsonl:1: column 'old_per_token_logps' position 1 is null.*JSON "
                                          r"has no NaN"):
        import_rollouts(out, str(tmp_path / "back"))
    assert not os.path.exists(os.path.join(tmp_path, "back", "FORMAT.json"))


def test_a_jsonl_export_of_a_vector_column_imports_back(tmp_path):
    """A per-row vector is a list per line, not as long as the completion: the import reads it as the
    vector it was (it refused the file: 'per-token columns must align with their ids')."""
    src = ReplayStore(str(tmp_path / "src"))
    scores = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
    src.extend({"prompt_id": [0, 0, 1], "completion_ids": [[1], [2, 3, 4], [5, 6]],
                "old_per_token_logps": [[-0.1], [-0.2, -0.3, -0.4], [-0.5, -0.6]], "scores": scores})
    src.close()
    export(str(tmp_path / "src"), str(tmp_path / "o.jsonl"))
    import_rollouts(str(tmp_path / "o.jsonl"), str(tmp_path / "dst"))
    with ReplayStore(str(tmp_path / "dst"), readonly=True) as dst:
        assert dst.schema["scores"].kind == "vector" and dst.schema["scores"].width == 2
        assert dst.schema["old_per_token_logps"].kind == "ragged"
        np.testing.assert_array_equal(dst.read([0, 1, 2])["scores"], scores)
    lines = open(tmp_path / "o.jsonl").read().splitlines()
    bad = json.loads(lines[2])
    bad["scores"] = None
    (tmp_path / "bad.jsonl").write_text("\n".join(lines[:2] + [json.dumps(bad)]) + "\n")
    import_rollouts(str(tmp_path / "bad.jsonl"), str(tmp_path / "dst2"))  # null: "not computed"
    with ReplayStore(str(tmp_path / "dst2"), readonly=True) as dst:
        assert np.isnan(dst.read([2])["scores"]).all()
    # a width other lines do not have, on a line past those the import looked at first
    lines_ok = [json.loads(x) for x in lines]
    many = [dict(lines_ok[i % 3], prompt_id=i) for i in range(12)]
    many[11]["scores"] = [1.0, 2.0, 3.0]
    (tmp_path / "wide.jsonl").write_text("\n".join(map(json.dumps, many)) + "\n")
    from diskreplay.export.sources import JsonlSource
    src = JsonlSource(str(tmp_path / "wide.jsonl"))
    src.peek_columns(10)  # the 12th line is past the lines looked at
    with pytest.raises(ExportError, match="wide.jsonl:12: column 'scores' has 3 values; other lines hold a per-row "
                                          "vector of 2"):
        list(src.batches(100, [k for k in many[0]], {}))


def test_jsonl_writes_float32_digits_whether_or_not_a_column_has_null_rows(tmp_path):
    """With orjson, a log-prob column holding a "not computed" row was written with float64 digits."""
    pytest.importorskip("orjson")
    s = ReplayStore(str(tmp_path / "s"))
    s.extend({"prompt_id": [0, 0], "completion_ids": [[1, 2], [3]],
              "old_per_token_logps": [np.float32([-0.7976544499397278, -1.0]), None]})
    out = str(tmp_path / "o.jsonl")
    export_jsonl(s, out)
    lines = open(out).read().splitlines()
    assert '"old_per_token_logps":[-0.79765445,-1.0]' in lines[0] and '"old_per_token_logps":null' in lines[1]


def test_a_jsonl_export_of_a_vector_column_added_late_imports_back(tmp_path):
    """Rows before a late vector column export it as null ("not computed"): the import refused them."""
    src = ReplayStore(str(tmp_path / "src"))
    src.extend({"prompt_id": [0, 0], "completion_ids": [[1], [2, 3]]})
    src.extend({"prompt_id": [1, 1], "completion_ids": [[4, 5, 6], [7]], "feat": np.float32([[1, 2], [3, 4]])})
    src.close()
    export(str(tmp_path / "src"), str(tmp_path / "o.jsonl"))
    import_rollouts(str(tmp_path / "o.jsonl"), str(tmp_path / "dst"))
    with ReplayStore(str(tmp_path / "dst"), readonly=True) as dst:
        got = dst.read([0, 1, 2, 3])["feat"]
        assert dst.schema["feat"].kind == "vector" and np.isnan(got[:2]).all()
        np.testing.assert_array_equal(got[2:], [[1, 2], [3, 4]])


def test_curation_takes_a_vector_reward_as_the_mean_of_its_scored_functions(tmp_path):
    """A row only some reward functions scored ([1.0, NaN]) has reward 1.0, as TRL and the samplers
    take it: pairs, best-of-n and --min-reward dropped it as NaN."""
    path = str(tmp_path / "s")
    with ReplayStore(path) as s:
        s.extend({"prompt_id": [1, 1, 1], "prompt_ids": [[9], [9], [9]], "completion_ids": [[5], [6], [7]],
                  "rewards_per_func": np.array([[1.0, np.nan], [0, 0], [0.2, 0.2]], np.float32)})
    preference_pairs(path, str(tmp_path / "p.jsonl"), reward_key="rewards_per_func")
    pair = json.loads(open(tmp_path / "p.jsonl").readline())
    assert pair["chosen_ids"] == [5] and pair["rejected_ids"] == [6]
    best_of_n(path, str(tmp_path / "b.jsonl"), reward_key="rewards_per_func", k=1)
    assert json.loads(open(tmp_path / "b.jsonl").readline())["input_ids"] == [9, 5]
    res = export(path, str(tmp_path / "e.jsonl"), min_reward=0.5, reward_key="rewards_per_func")
    assert res["rows"] == 1


def test_pairs_and_best_of_n_leave_out_rows_without_a_prompt(tmp_path):
    """prompt_ids added after the store's first commit: its older rows have none, and became pairs and
    SFT examples with a null prompt (TRL's collators fail on it, or train without the prompt)."""
    path = str(tmp_path / "s")
    with ReplayStore(path) as s:
        s.extend({"prompt_id": [1, 1], "completion_ids": [[5], [6]], "rewards": [1.0, 0.0]})
        s.extend({"prompt_id": [2, 2], "prompt_ids": [[9, 9], [9, 9]], "completion_ids": [[7], [8]],
                  "rewards": [1.0, 0.0]})
    best_of_n(path, str(tmp_path / "b.jsonl"))
    rows = [json.loads(x) for x in open(tmp_path / "b.jsonl")]
    assert [r["input_ids"] for r in rows] == [[9, 9, 7]]
    res = preference_pairs(path, str(tmp_path / "p.jsonl"))
    pairs = [json.loads(x) for x in open(tmp_path / "p.jsonl")]
    assert res["pairs"] == 1 and pairs[0]["prompt_ids"] == [9, 9] and pairs[0]["chosen_ids"] == [7]


def test_an_hf_export_without_rows_loads_and_imports(tmp_path):
    """datasets cannot load its own save_to_disk of an empty dataset (no data file listed): an export
    whose filters keep nothing made one, and importing it was a traceback."""
    datasets = pytest.importorskip("datasets")
    path = str(tmp_path / "s")
    with ReplayStore(path) as s:
        s.extend({"prompt_id": [0], "completion_ids": [[1]], "policy_version": [0]})
    res = export(path, str(tmp_path / "out"), format="hf", policy_versions="5:")
    assert res["rows"] == 0
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    assert len(ds) == 0 and "completion_ids" in ds.column_names
    with pytest.raises(ExportError, match="nothing to import"):  # an empty store would have no schema
        import_rollouts(str(tmp_path / "out"), str(tmp_path / "back"))
    assert not os.path.exists(tmp_path / "back")


def test_zarr_archive_nodes_of_awkward_column_names_never_collide(tmp_path):
    """'values' was mapped to columns/col3, which a column named 'col3' also took; 'zarr.json' was
    used as a node name."""
    pytest.importorskip("zarr")
    path = str(tmp_path / "s")
    cols = {"prompt_id": [0, 0], "completion_ids": [[1], [2, 3]], "rewards": np.float32([1, 2]),
            "values": np.float32([3, 4]), "col4": np.float32([5, 6]), "zarr.json": np.float32([7, 8])}
    with ReplayStore(path) as s:
        s.extend(cols)
    export(path, str(tmp_path / "a.zarr"))
    import_rollouts(str(tmp_path / "a.zarr"), str(tmp_path / "back"))
    with ReplayStore(str(tmp_path / "back"), readonly=True) as back:
        got = back.read([0, 1])
        for name in ("rewards", "values", "col4", "zarr.json"):
            np.testing.assert_array_equal(got[name], cols[name])


def test_min_margin_compares_at_the_rewards_precision(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as s:
        s.extend({"prompt_id": [1, 1], "prompt_ids": [[9], [9]], "completion_ids": [[5], [6]],
                  "rewards": np.float32([0.5, 0.1])})
    assert preference_pairs(path, str(tmp_path / "p.jsonl"), min_margin=0.4)["pairs"] == 1
    assert preference_pairs(path, str(tmp_path / "q.jsonl"), min_margin=0.41)["pairs"] == 0


def test_a_new_store_import_that_its_capacity_would_evict_is_refused(tmp_path):
    """The export carries the source's capacity_bytes; the imported store's files are not the source's
    size, so its oldest rows were evicted while import said "imported N rows" (42 rows became 15)."""
    from diskreplay import EvictionRefusedError

    rows = 42
    batch = {"prompt_id": list(range(rows)), "completion_ids": [list(range(i % 7 + 1)) for i in range(rows)]}
    with ReplayStore(str(tmp_path / "s")) as s:
        s.extend(batch)  # one segment
        nbytes = s.manifest.nbytes
    with ReplayStore(str(tmp_path / "sized"), capacity_bytes=nbytes + 64) as s:
        s.extend(batch)
        assert len(s) == rows
        sized = s.path
    out = str(tmp_path / "o.parquet")
    export_parquet(sized, out)
    with pytest.raises(EvictionRefusedError, match="evicted .* of the 42 rows imported .*; nothing was written"):
        import_rollouts(out, str(tmp_path / "restored"), chunk_rows=1)
    assert not os.path.exists(str(tmp_path / "restored"))
    res = import_rollouts(out, str(tmp_path / "restored"), chunk_rows=1, allow_evict=True)
    with ReplayStore(str(tmp_path / "restored"), readonly=True) as r:
        assert 0 < len(r) < rows and res["store_rows"] == len(r)


def test_pairs_and_best_of_n_of_a_store_grouped_by_its_prompt_text(tmp_path, tokenizer_dir):
    """A store grouped by a string column named "prompt" got two "prompt" columns in a --tokenizer pairs /
    best-of-n export: a Parquet file pyarrow cannot read, an HF export that failed, a JSONL whose prompt
    text was the key's. The key is now written as group_prompt."""
    import pyarrow.parquet as pq

    path = str(tmp_path / "txt")
    with ReplayStore(path, group_key="prompt") as s:
        s.extend({"prompt": ["Q: hi", "Q: hi"], "prompt_ids": [[3, 4], [3, 4]], "completion_ids": [[5, 2], [6]],
                  "rewards": np.array([1.0, 0.0], np.float32)})
    preference_pairs(path, str(tmp_path / "p.parquet"), tokenizer=tokenizer_dir)
    table = pq.read_table(str(tmp_path / "p.parquet"))
    assert table.column_names.count("prompt") == 1 and table.column("group_prompt").to_pylist() == ["Q: hi"]
    best_of_n(path, str(tmp_path / "b.parquet"), tokenizer=tokenizer_dir)
    table = pq.read_table(str(tmp_path / "b.parquet"))
    assert table.column_names.count("prompt") == 1 and table.column("group_prompt").to_pylist() == ["Q: hi"]


def test_an_import_says_which_columns_had_no_value_in_any_row(tmp_path):
    """A JSONL export writes NaN as null; a rewards column unscored in every row (TRL's NaN) came back as
    nothing at all, and the import said nothing."""
    path = str(tmp_path / "nan")
    with ReplayStore(path) as s:
        s.extend({"prompt_id": [7, 7], "completion_ids": [[5], [6, 7]],
                  "rewards": np.array([np.nan, np.nan], np.float32), "advantages": np.array([0.0, 0.0], np.float32)})
    out = str(tmp_path / "nan.jsonl")
    export_jsonl(path, out)
    res = import_rollouts(out, str(tmp_path / "back"))
    assert res["empty_columns"] == ["rewards"] and "rewards" not in res["columns"]


def test_jsonl_import_of_a_per_row_vector_added_late(tmp_path):
    """A per-row vector added after the first commit exports null in the older lines: a reward-named one,
    or one whose first value lies past the lines the import peeks at, was taken for a per-token column
    ("has 2 values but 'completion_ids' has 3 tokens")."""
    import json

    path = str(tmp_path / "late.jsonl")
    with open(path, "w") as f:
        for i in range(1200):
            row = {"prompt_id": i, "completion_ids": [1, 2, 3], "judge_rewards": None, "judge": None}
            if i >= 2:
                row["judge_rewards"] = [0.5, float(i)]
            if i >= 1100:
                row["judge"] = [1.0, 2.0]
            f.write(json.dumps(row) + "\n")
    import_rollouts(path, str(tmp_path / "s"))
    with ReplayStore(str(tmp_path / "s"), readonly=True) as s:
        assert s.schema["judge_rewards"].kind == "vector" and s.schema["judge"].kind == "vector"
        got = s.read([0, 5, 1150], ["judge_rewards", "judge"])
        assert np.isnan(got["judge_rewards"][0]).all() and got["judge_rewards"][1].tolist() == [0.5, 5.0]
        assert np.isnan(got["judge"][1]).all() and got["judge"][2].tolist() == [1.0, 2.0]


# --------------------------------------------------------------------------
# rows a resumed run excluded (issue 35)
# --------------------------------------------------------------------------

def resumed_store(path):
    """A store as a TRL run killed after step 3 and resumed from its step-2 checkpoint leaves it:
    steps 0-3, then 2-3 again; rows [16, 32) (the discarded steps 2 and 3) recorded as excluded in
    the "trl.replay" state, exactly as DiskReplayGRPOTrainer records them. Both timelines wrote
    versions 2 and 3, so no --policy-versions separates them. The discarded rows have the highest
    rewards: a pair, a best-of-n pick or a statistic that uses them shows."""
    from diskreplay.integrations.trl.checkpoint import STATE_NAME, ReplayState
    from diskreplay.integrations.trl.planners import Timeline

    with ReplayStore(path) as s:
        for step, version in enumerate([0, 1, 2, 3, 2, 3]):
            discarded = step in (2, 3)
            s.extend({"prompt_id": [0] * 4 + [1] * 4, "prompt_ids": [[9, 8]] * 8,
                      "completion_ids": [[2 + step, 2 + i] for i in range(8)],
                      "rewards": np.float32(np.arange(8) % 4 + (10 if discarded else 0)),
                      "policy_version": [version] * 8})
        state = ReplayState("off", None, np.random.Generator(np.random.PCG64(0)), next_row=48,
                            global_step=4, store_path=s.path, timeline=Timeline(((16, 32),)))
        s.save_state(STATE_NAME, state.to_dict())
    return path


def test_exports_pairs_best_of_n_and_info_leave_out_the_rows_a_resumed_run_excluded(tmp_path):
    """Found with a real TRL resume: export, pairs (one DPO pair used an excluded row), best-of-n and info
    used the rows of the discarded timeline. They honour the store's recorded exclusions by default,
    say how many rows they left out, and use them with include_excluded=True."""
    path = resumed_store(str(tmp_path / "s"))
    kept = [r for r in range(48) if not 16 <= r < 32]

    res = export(path, str(tmp_path / "o.parquet"), columns=["completion_ids", "rewards"])
    assert res["rows"] == 32 and res["excluded_rows"] == 16 and res["excluded_ranges"] == [[16, 32]]
    got = pq.read_table(str(tmp_path / "o.parquet"))["completion_ids"].to_pylist()
    with ReplayStore(path, readonly=True) as s:
        assert got == s.read(kept)["completion_ids"].to_list()
    # the exclusion comes before --limit counts, and counts only rows the filters kept
    res = export(path, str(tmp_path / "l.jsonl"), limit=20, policy_versions="2:3")
    assert res["rows"] == 16 and res["excluded_rows"] == 16
    res = export(path, str(tmp_path / "z.zarr"))
    assert res["rows"] == 32 and res["excluded_rows"] == 16
    res = export(path, str(tmp_path / "all.jsonl"), include_excluded=True)
    assert res["rows"] == 48 and res["excluded_rows"] == 0 and res["excluded_ranges"] == [[16, 32]]

    res = preference_pairs(path, str(tmp_path / "p.jsonl"))
    pairs = [json.loads(line) for line in open(tmp_path / "p.jsonl")]
    assert res["pairs"] == 2 and res["excluded_rows"] == 16
    assert all(not 16 <= p[k] < 32 for p in pairs for k in ("chosen_row", "rejected_row"))
    with_them = preference_pairs(path, str(tmp_path / "p2.jsonl"), include_excluded=True)
    assert with_them["excluded_rows"] == 0
    assert any(16 <= json.loads(line)["chosen_row"] < 32 for line in open(tmp_path / "p2.jsonl"))

    res = best_of_n(path, str(tmp_path / "b.jsonl"), k=2)
    assert res["rows"] == 4 and res["excluded_rows"] == 16
    assert all(not 16 <= json.loads(line)["row"] < 32 for line in open(tmp_path / "b.jsonl"))

    info = store_info(path)
    assert info["rows"] == 48 and info["excluded"] == {"ranges": [[16, 32]], "rows": 16, "included": False}
    assert info["stats"]["rewards"]["count"] == 32 and info["stats"]["rewards"]["max"] == 3.0
    assert info["tokens"]["completion"] == 64
    full = store_info(path, include_excluded=True)
    assert full["stats"]["rewards"]["count"] == 48 and full["excluded"]["included"] is True
    # a store that records none is as before
    plain = fill_store(str(tmp_path / "plain"), extends=1)
    assert store_info(plain)["excluded"] is None
    assert export(plain, str(tmp_path / "plain.jsonl"))["excluded_rows"] == 0


def test_pairs_within_a_window_of_policy_versions(tmp_path):
    """A group is a prompt across the whole run, so a pair could set a completion of policy version 0
    against one of version 3. version_window=W pairs only rows of the same window of W versions (one
    pair per group and window); the default pools every version, as before."""
    path = str(tmp_path / "s")
    with ReplayStore(path) as s:
        for version in range(4):  # prompt 0's best row is always of version 3, its worst of version 0
            s.extend({"prompt_id": [0, 0, 0], "completion_ids": [[2 + version, i] for i in range(3)],
                      "rewards": np.float32([version, version + 0.5, version + 0.25]),
                      "policy_version": [version] * 3})
    pooled = preference_pairs(path, str(tmp_path / "all.jsonl"))
    row = json.loads(open(tmp_path / "all.jsonl").readline())
    assert pooled["pairs"] == 1 and (row["chosen_row"], row["rejected_row"]) == (10, 0)
    assert "chosen_policy_version" not in row

    res = preference_pairs(path, str(tmp_path / "one.jsonl"), version_window=1)
    rows = [json.loads(line) for line in open(tmp_path / "one.jsonl")]
    assert res["pairs"] == 4 and res["version_windows"] == 4
    assert [(r["chosen_row"], r["rejected_row"]) for r in rows] == [(1, 0), (4, 3), (7, 6), (10, 9)]
    assert all(r["chosen_policy_version"] == r["rejected_policy_version"] for r in rows)

    res = preference_pairs(path, str(tmp_path / "two.jsonl"), version_window=2)
    rows = [json.loads(line) for line in open(tmp_path / "two.jsonl")]
    assert [(r["chosen_policy_version"], r["rejected_policy_version"]) for r in rows] == [(1, 0), (3, 2)]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ExportError, match="version_window"):
            preference_pairs(path, str(tmp_path / "bad.jsonl"), version_window=bad)
    with ReplayStore(str(tmp_path / "nov")) as s:
        s.extend({"prompt_id": [0, 0], "completion_ids": [[2], [3]], "rewards": [0.0, 1.0]})
    with pytest.raises(ExportError, match="policy_version"):
        preference_pairs(str(tmp_path / "nov"), str(tmp_path / "nov.jsonl"), version_window=1)
