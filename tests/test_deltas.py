"""Append deltas (format v4): multi-writer appends stored as what they add, resolved by readers."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diskreplay import CorruptStoreError, FormatError, ReplayStore
from diskreplay import format as fmt
from diskreplay.storage import LocalStorage
from diskreplay.store import MergePolicy
from diskreplay.testing.workload import batch_for, check_rows, token_for
from diskreplay.verify import verify_store

from .conftest import format_md_table, race_before_publish


def _kinds(path):
    """``{generation: "delta" | "full"}`` of the manifests on disk."""
    out = {}
    for gen in fmt.list_generations(path):
        doc = json.load(open(os.path.join(path, fmt.manifest_file(gen))))
        out[gen] = "delta" if doc["format"] == fmt.DELTA_FORMAT else "full"
    return out


def _same(a: fmt.Manifest, b: fmt.Manifest) -> None:
    assert a == b and a.depth == b.depth, (a, b)


def _clean(path):
    report = verify_store(path)
    assert report["ok"] and not report["warnings"], report


def _appended(path, commits):
    """A new multi-writer store with ``commits`` appends (each one a delta); its generation."""
    with ReplayStore(path, multi_writer=True) as store:
        for step in range(commits):
            store.extend(batch_for(0, step))
        return store.generation


def _resign(path, gen, change):
    """Rewrite manifest ``gen`` with ``change(doc)`` applied and a valid checksum: forged, not damaged."""
    f = os.path.join(path, fmt.manifest_file(gen))
    doc = json.load(open(f))
    change(doc)
    open(f, "wb").write(fmt.signed_bytes({k: v for k, v in doc.items() if k != "checksum"}))


def _grouped(store):
    return {k: store.group_rows(k).tolist() for k in store.group_keys()}


def test_appends_are_deltas_with_a_full_manifest_every_checkpoint(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, capacity=200) as store:
        assert store.options.append_deltas
        for step in range(2 * fmt.CHECKPOINT_EVERY + 3):
            store.extend(batch_for(0, step), token=token_for(0, step))
        held = store.manifest
        kinds = _kinds(path)
        # the merges of small segments are rewrites: full manifests whatever the depth
        assert "delta" in kinds.values() and "full" in kinds.values()
        # a reader resolves every generation to exactly what the writer committed
        with ReplayStore(path, readonly=True) as ro:
            _same(ro.manifest, held)
            assert not check_rows(ro, ro.row_ids())
            assert _grouped(ro) == _grouped(store)
        depths = {g: fmt.read_manifest(path, g).depth for g in kinds}
    assert max(depths.values()) < 2 * fmt.CHECKPOINT_EVERY
    assert all((depths[g] == 0) == (kinds[g] == "full") for g in kinds), (depths, kinds)
    _clean(path)


def test_a_checkpoint_that_loses_its_race_links_its_delta_while_the_chain_is_short(tmp_path, monkeypatch):
    """An append whose base is deep enough for this writer to checkpoint (write a full manifest)
    and that loses the race publishes, on its retry, the delta it staged with its data: a full
    manifest, the slower commit, would only race again. At ``MAX_DELTA_DEPTH`` it checkpoints."""
    from diskreplay.store import committer as cm

    path = str(tmp_path / "s")
    no_merge = MergePolicy(max_bytes=1)  # every commit an append
    a = ReplayStore(path, multi_writer=True, merge_policy=no_merge)
    b = ReplayStore(path, multi_writer=True, merge_policy=no_merge)
    a._committer._checkpoint_at = fmt.CHECKPOINT_EVERY
    b._committer._checkpoint_at = cm.MAX_DELTA_DEPTH
    step = 0
    for target, depth_after in ((fmt.CHECKPOINT_EVERY, fmt.CHECKPOINT_EVERY + 2), (cm.MAX_DELTA_DEPTH - 1, 0)):
        while b.manifest.depth < target:
            b.extend(batch_for(1, step), token=token_for(1, step))
            step += 1
        a._catch_up()  # a's base: `target` deltas past a full manifest, its checkpoint due
        race_before_publish(monkeypatch, a, b)  # b's delta takes the generation a's checkpoint wanted
        rows = a.extend(batch_for(0, step), token=token_for(0, step))
        monkeypatch.undo()
        assert a.manifest.depth == depth_after, (target, a.manifest.depth)
        assert _kinds(path)[a.generation] == ("delta" if depth_after else "full")
        assert a.read(rows)["tag"] == batch_for(0, step)["tag"]
    assert a.stats()["conflicts"] == 2
    with ReplayStore(path, readonly=True) as ro:
        _same(ro.manifest, a.manifest)
        assert not check_rows(ro, ro.row_ids())
    a.close()
    b.close()
    _clean(path)


def test_a_delta_holds_only_what_it_adds_and_segment_local_sidecar_rows(tmp_path):
    path = str(tmp_path / "s")
    two_groups = batch_for(0, 1, rows=4)
    two_groups["prompt_id"][2:] += 1  # (a segment of one group has no sidecar file: see below)
    with ReplayStore(path, multi_writer=True) as store:
        store.extend(batch_for(0, 0))
        rows = store.extend(two_groups, token="t1")
        gen = store.generation
    raw = open(os.path.join(path, fmt.manifest_file(gen)), "rb").read()
    doc = json.loads(raw)
    assert doc["format"] == fmt.DELTA_FORMAT and doc["num_rows"] == len(rows)
    assert [s["first_row"] for s in doc["segments"]] == [0]  # numbered from the append's first row
    assert doc["token"][0] == "t1" and "head" not in doc and "generation" not in doc
    m = fmt.read_manifest(path, gen)
    assert m.segments[-1].first_row == rows[0] and m.tokens[-1].first_row == rows[0]
    assert m.tokens[-1].generation == gen
    # the sidecar does not depend on where the segment landed
    from diskreplay.segment import ArrowFile
    from diskreplay.format.sidecars import segment_local_rows
    e = m.segments[-1]
    side = ArrowFile(os.path.join(path, e.groups_file), e.groups_bytes).batch
    assert segment_local_rows(side)
    assert sorted(np.concatenate(side.column("rows").to_numpy(zero_copy_only=False)).tolist()) == \
        list(range(len(rows)))


def test_a_lost_race_links_the_same_file_again(tmp_path, monkeypatch):
    """The retry after a lost race writes nothing: it links the delta it wrote at the next generation."""
    path = str(tmp_path / "s")
    a = ReplayStore(path, multi_writer=True)
    b = ReplayStore(path)
    a.extend(batch_for(0, 0))
    b.extend(batch_for(1, 0))
    mine = b._committer.storage
    # _write_files: the one place a directory's commit writes its files (stage and publish call it)
    real_link, real_write = LocalStorage.link_new, LocalStorage._write_files
    links, writes, raced = [], [], []

    def link_new(self, src, rel):
        if self is mine and rel.startswith(fmt.MANIFEST_DIR):
            # the delta's file: unnamed (O_TMPFILE) where the filesystem has it, else a temporary name
            with open(f"/proc/self/fd/{src.fd}" if not src.named else self.local_path(src.rel), "rb") as f:
                data = f.read()
            links.append((src, rel, data))
            if not raced:
                raced.append(a.extend(batch_for(0, 1)))  # a's commit takes the generation b is after
        return real_link(self, src, rel)

    def write_files(self, files, dirs=(), **kw):
        if self is mine:
            writes.append([rel for rel, _, _ in files])
        return real_write(self, files, dirs, **kw)

    monkeypatch.setattr(LocalStorage, "link_new", link_new)
    monkeypatch.setattr(LocalStorage, "_write_files", write_files)
    rows = b.extend(batch_for(1, 1), token=token_for(1, 1))
    monkeypatch.undo()
    assert raced and rows[0] == raced[0][-1] + 1
    assert len(links) == 2 and links[0][0] == links[1][0] and links[0][2] == links[1][2]  # one file, twice
    lost = int(os.path.basename(links[0][1])[:-5])
    assert links[1][1] == fmt.manifest_file(lost + 1)
    assert len(writes) == 1, writes  # b's data and delta were written once, before the race
    assert not [n for n in os.listdir(os.path.join(path, fmt.MANIFEST_DIR)) if n.startswith(".")]
    stats = b.stats()
    assert stats["conflicts"] == 1 and stats["rebases"] == 1
    a.close()
    b.close()
    with ReplayStore(path) as w:
        assert not check_rows(w, w.row_ids())
        assert w.committed_rows(token_for(1, 1)).tolist() == rows.tolist()
    assert verify_store(path)["ok"]


def test_clean_up_keeps_the_manifests_a_kept_delta_applies_to(tmp_path):
    path = str(tmp_path / "s")
    no_merges = MergePolicy(fanin=1 << 20)
    with ReplayStore(path, multi_writer=True, retain_seconds=1, capacity=60, merge_policy=no_merges) as store:
        store._committer._checkpoint_at = fmt.CHECKPOINT_EVERY  # (each writer draws its own)
        for step in range(3 * (fmt.CHECKPOINT_EVERY + 1) - 2):  # the newest is the 7th delta after a full one
            store.extend(batch_for(0, step, rows=3))
        assert store.manifest.depth == fmt.CHECKPOINT_EVERY - 1 > fmt.KEEP_MANIFESTS
        old = fmt.list_generations(path)
        past = os.path.getmtime(os.path.join(path, fmt.manifest_file(old[0]))) - 10
        for name in os.listdir(os.path.join(path, fmt.MANIFEST_DIR)):  # every superseded one is past retention
            os.utime(os.path.join(path, fmt.MANIFEST_DIR, name), (past, past))
        for d in (fmt.SEGMENT_DIR, fmt.GROUPS_DIR):
            for name in os.listdir(os.path.join(path, d)):
                os.utime(os.path.join(path, d, name), (past, past))
        store._committer.collect(full=True)
        kept = fmt.list_generations(path)
        assert len(kept) < len(old)
        for gen in kept:  # each one still resolves, and its files are there
            m = fmt.read_manifest(path, gen)
            assert all(os.path.exists(os.path.join(path, f)) for f in m.files())
        newest = fmt.read_manifest(path, kept[0])
        assert sorted(kept) == list(range(kept[0] - newest.depth, kept[0] + 1))  # the chain, and only it
    _clean(path)


def test_a_pinned_generation_that_is_a_delta_opens(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True) as store:
        store.extend(batch_for(0, 0))
        store.extend(batch_for(0, 1))
        gen, want = store.generation, store.row_ids()
        with store.snapshot() as snap:
            store.extend(batch_for(0, 2))
            assert snap.generation == gen and snap.row_ids().tolist() == want.tolist()
        assert _kinds(path)[gen] == "delta"
        with ReplayStore(path, readonly=True, generation=gen) as ro:
            assert ro.row_ids().tolist() == want.tolist() and not check_rows(ro, want)


def test_a_damaged_delta_falls_back_to_the_commit_before(tmp_path):
    path = str(tmp_path / "s")
    gen = _appended(path, 3)
    before = fmt.read_manifest(path, gen - 1)
    f = os.path.join(path, fmt.manifest_file(gen))
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0x20
    open(f, "wb").write(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ReplayStore(path, readonly=True) as ro:
            assert ro.generation == gen - 1 and ro.manifest == before
    assert any(fmt.manifest_file(gen) in str(w.message) for w in caught)
    assert not verify_store(path)["ok"]


def test_a_delta_chain_without_its_base_is_an_error_naming_the_file(tmp_path):
    path = str(tmp_path / "s")
    gen = _appended(path, 3)
    os.remove(os.path.join(path, fmt.manifest_file(gen - 1)))
    with pytest.raises(FileNotFoundError):
        fmt.read_manifest(path, gen)
    # not from the append's first row: refused before use
    _resign(path, gen, lambda doc: doc["segments"][0].update(first_row=1))
    with pytest.raises(FormatError, match="expected 0"):
        fmt.AppendDelta.from_doc(json.load(open(os.path.join(path, fmt.manifest_file(gen)))), "x")


def test_format_v4_flags_must_agree():
    body = fmt.StoreOptions(multi_writer=True, append_deltas=True).body()
    assert body["version"] == fmt.APPEND_DELTAS_VERSION and body["append_deltas"] is True
    assert fmt.StoreOptions.from_dict(json.loads(fmt.signed_bytes(body))).append_deltas
    for bad in ({"multi_writer": False}, {"append_deltas": False}, {"version": fmt.MULTI_WRITER_VERSION}):
        doc = {**body, **bad}
        with pytest.raises(FormatError):
            fmt.StoreOptions.from_dict(json.loads(fmt.signed_bytes(doc)))


def test_a_v2_store_keeps_committing_full_manifests(tmp_path):
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True).close()
    dataclasses.replace(fmt.StoreOptions.read(path), append_deltas=False, inline_groups=False).write(path)
    with ReplayStore(path) as a, ReplayStore(path) as b:
        for step in range(4):
            a.extend(batch_for(0, step), token=token_for(0, step))
            b.extend(batch_for(1, step), token=token_for(1, step))
        assert set(_kinds(path).values()) == {"full"}
        assert not check_rows(a, a.row_ids())
    assert verify_store(path)["ok"]


def test_converting_a_single_writer_store_turns_deltas_on_and_reads_its_old_sidecars(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        store.extend(batch_for(0, 0))
        store.compact(multi_writer=True)
        assert store.options.append_deltas
        store.extend(batch_for(0, 1))
        store.extend(batch_for(0, 2))
        grouped = _grouped(store)
    assert "delta" in _kinds(path).values()
    with ReplayStore(path, readonly=True) as ro:
        assert _grouped(ro) == grouped and not check_rows(ro, ro.row_ids())
    # and back: a single writer commits full manifests and keeps reading the deltas it has
    with ReplayStore(path) as store:
        store.compact(multi_writer=False)
        store.extend(batch_for(0, 3))
        assert not store.options.append_deltas
    with ReplayStore(path, readonly=True) as ro:
        assert not check_rows(ro, ro.row_ids())
    assert verify_store(path)["ok"]


def test_corrupt_chain_is_refused_with_the_file_named(tmp_path):
    path = str(tmp_path / "s")
    gen = _appended(path, 2)
    # a delta that says it adds a segment id the base already has
    taken = fmt.read_manifest(path, gen - 1).segments[0].id
    _resign(path, gen, lambda doc: doc["segments"][0].update(id=taken))
    with pytest.raises((CorruptStoreError, FormatError), match=fmt.manifest_file(gen)):
        fmt.read_manifest(path, gen)
    # so is it for a writer catching up from the commit before, which it holds
    with pytest.raises((CorruptStoreError, FormatError), match=fmt.manifest_file(gen)):
        fmt.read_manifest(path, gen, known=fmt.read_manifest(path, gen - 1))


def test_the_plain_pyarrow_recipe_of_format_md_resolves_deltas(tmp_path):
    """docs/FORMAT.md's reader, verbatim, on a multi-writer store of deltas and full manifests."""
    path = str(tmp_path / "STORE")
    with ReplayStore(path, multi_writer=True) as a, ReplayStore(path) as b:
        for step in range(2 * fmt.CHECKPOINT_EVERY + 1):  # a full manifest by then, whatever the draws
            (a if step % 2 else b).extend(batch_for(step % 2, step))
    with ReplayStore(path, readonly=True) as ro:
        want = ro.read(ro.row_ids(), ["tag"])["tag"]
    assert set(_kinds(path).values()) == {"delta", "full"}
    assert format_md_table(path).column("tag").to_pylist() == list(want)


def _age_everything(path, seconds=100):
    past = os.path.getmtime(os.path.join(path, fmt.FORMAT_FILE)) - seconds
    for d in (fmt.MANIFEST_DIR, fmt.SEGMENT_DIR, fmt.GROUPS_DIR):
        for name in os.listdir(os.path.join(path, d)):
            os.utime(os.path.join(path, d, name), (past, past))


def test_repeated_sweeps_keep_exactly_what_kept_commits_name(tmp_path):
    """The shared sweep holds one manifest and per-commit differences, not every retained manifest,
    and across sweeps still keeps every file a kept commit names and removes the rest."""
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, retain_seconds=30, capacity=40) as store, \
            ReplayStore(path) as other:
        committer = store._committer
        for round_ in range(3):
            for step in range(25):
                (store if step % 3 else other).extend(batch_for(step % 3 == 0, 100 * round_ + step, rows=3))
            _age_everything(path)
            store.extend(batch_for(0, 100 * round_ + 99, rows=3))  # a fresh newest commit
            committer.collect(full=True)
            kept = fmt.list_generations(path)
            named = set()
            for gen in kept:
                named |= set(fmt.read_manifest(path, gen).files())
            on_disk = {f"{d}/{n}" for d in (fmt.SEGMENT_DIR, fmt.GROUPS_DIR)
                       for n in os.listdir(os.path.join(path, d)) if not n.startswith("index-")}
            assert named <= on_disk | {f for f in named if "index-" in f}, sorted(named - on_disk)
            assert on_disk <= named, sorted(on_disk - named)  # old and unnamed: collected
            assert committer.gc._swept[0] == kept[0] and set(committer.gc._released) <= set(kept)
    _clean(path)


def test_a_sweep_names_each_generation_s_files_from_the_one_before(tmp_path):
    """The sweep takes what a generation shares with the one before (the same segments, states,
    token logs, index objects) without naming it again: the same keys as naming it whole, through
    appends with tokens (sealed into token logs), merges, saved states and evictions."""
    from diskreplay.store.collector import _file_keys

    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, capacity=200) as store, ReplayStore(path) as other:
        for step in range(90):
            w = store if step % 3 else other
            w.extend(batch_for(step % 3 == 0, step, rows=3), token=f"t{step}")
            if step % 17 == 5:
                w.save_state("sampler", {"step": np.array([step])})
    gens = sorted(fmt.list_generations(path))
    held, checked = None, 0
    for g in gens:
        m = fmt.read_manifest(path, g, known=held[1] if held is not None and held[0] == g - 1 else None)
        keys = _file_keys(m, held)
        assert keys == _file_keys(m), g
        checked += held is not None and m.token_logs is held[1].token_logs
        held = (g, m, keys)
    assert len(gens) > 90 and checked > 50 and held[1].token_logs and held[1].states
    _clean(path)


# the last commit before append deltas: it knows multi-writer stores (v2) but not v4
BEFORE_DELTAS = "ab056d4"


def test_an_older_diskreplay_refuses_a_delta_store_and_its_v2_stores_still_work(tmp_path):
    from .test_late_columns import _previous_version, _run_previous, open_with_previous
    import tests.test_late_columns as late

    old = late.PREVIOUS_VERSION
    late.PREVIOUS_VERSION = BEFORE_DELTAS
    try:
        previous = _previous_version(tmp_path)
    finally:
        late.PREVIOUS_VERSION = old
    v4, v2 = str(tmp_path / "v4"), str(tmp_path / "v2")
    with ReplayStore(v4, multi_writer=True) as store:
        store.extend(batch_for(0, 0))
        store.extend(batch_for(0, 1))
    before = {n: open(os.path.join(v4, fmt.MANIFEST_DIR, n), "rb").read()
              for n in os.listdir(os.path.join(v4, fmt.MANIFEST_DIR))}
    for mode in ("readonly=True", ""):
        proc = open_with_previous(previous, v4, mode)
        # refused either way: FORMAT.json's version, or (a reader reads the manifest first) the delta
        # (a store created now is version 5: inline groups, below)
        assert "Unsupported version 5" in proc.stdout or (
            mode and "Unsupported format 'diskreplay.delta'" in proc.stdout), (mode, proc.stdout, proc.stderr)
    assert {n: open(os.path.join(v4, fmt.MANIFEST_DIR, n), "rb").read()
            for n in os.listdir(os.path.join(v4, fmt.MANIFEST_DIR))} == before  # nothing collected
    # a multi-writer store the older diskreplay made: this one appends with full manifests, and the
    # older one still reads what it wrote
    proc = _run_previous(previous, """
        with ReplayStore(sys.argv[1], multi_writer=True) as s:
            s.extend({"prompt_id": np.array([1, 1, 2]), "completion_ids": [np.arange(3, dtype=np.int32)] * 3})
        """, v2)
    assert proc.returncode == 0, proc.stderr
    with ReplayStore(v2) as store:
        assert not store.options.append_deltas
        store.extend({"prompt_id": np.array([3]), "completion_ids": [np.arange(2, dtype=np.int32)]})
    assert set(_kinds(v2).values()) == {"full"}
    proc = _run_previous(previous, """
        with ReplayStore(sys.argv[1], readonly=True) as s:
            print("rows", len(s), s.read([3])["completion_ids"][0].tolist())
        """, v2)
    assert "rows 4 [0, 1]" in proc.stdout, (proc.stdout, proc.stderr)


# ---------------------------------------------------------------------------
# inline groups (format v5): a small segment of one group has no sidecar file


def _files(path, d):
    return sorted(os.listdir(os.path.join(path, d)))


def test_a_small_one_group_segment_names_its_group_and_has_no_sidecar(tmp_path):
    path = str(tmp_path / "s")
    two = batch_for(0, 2, rows=4)  # groups 1 and 2
    two["prompt_id"][2:] += 1
    with ReplayStore(path, multi_writer=True) as store:
        one = store.extend(batch_for(0, 0, rows=5), token="one")
        store.extend(two)
        gen = store.generation
        e_one, e_two = store.manifest.segments
        assert e_one.group == 0 and e_one.groups_bytes == 0 and e_two.group is None and e_two.groups_bytes
        assert _files(path, fmt.GROUPS_DIR) == [os.path.basename(e_two.groups_file)]
        assert store.group_rows(0).tolist() == one.tolist()
        assert json.load(open(os.path.join(path, fmt.FORMAT_FILE)))["version"] == fmt.INLINE_GROUPS_VERSION
    doc = json.load(open(os.path.join(path, fmt.manifest_file(gen - 1))))
    assert doc["segments"][0]["group"] == 0 and "groups_file" not in doc["segments"][0]
    assert verify_store(path)["ok"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=40))
def test_the_group_index_is_the_same_with_inline_groups_and_sidecars(tmp_path_factory, commits):
    """Commits of random groups (many of one group: inline) to a v5 store and to a v4 store (every
    segment with a sidecar), merged as they go: the same group index, read fresh or followed."""
    root = tmp_path_factory.mktemp("inline")
    v5, v4 = str(root / "v5"), str(root / "v4")
    ReplayStore(v4, multi_writer=True).close()
    dataclasses.replace(fmt.StoreOptions.read(v4), inline_groups=False).write(v4)
    policy = MergePolicy(fanin=4, ratio=3)
    with ReplayStore(v5, multi_writer=True, merge_policy=policy) as a, ReplayStore(v4, merge_policy=policy) as b:
        for i, keys in enumerate(commits):
            batch = batch_for(0, i, rows=len(keys))
            batch["prompt_id"] = np.asarray(keys, dtype=np.int64)
            assert a.extend(batch).tolist() == b.extend(batch).tolist()
        for key in range(4):
            assert a.group_rows(key).tolist() == b.group_rows(key).tolist()
        every = [k for c in commits for k in c]
        for s in a.manifest.segments:  # (small segments all: inline exactly when of one group)
            held = set(every[s.first_row:s.end_row])
            assert s.group == (held.pop() if len(held) == 1 else None) and bool(s.groups_bytes) == (s.group is None)
        assert all(s.group is None for s in b.manifest.segments)
    for path in (v5, v4):
        with ReplayStore(path, readonly=True) as ro:
            for key in range(4):
                assert ro.group_rows(key).tolist() == [r for r, k in enumerate(every) if k == key]
        assert verify_store(path)["ok"]


def test_verify_and_repair_catch_an_inline_group_the_segment_does_not_hold(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, merge_policy=MergePolicy(fanin=1 << 20)) as store:
        for step in range(3):
            store.extend(batch_for(0, 2 * step, rows=3))
        gen = store.generation
    _resign(path, gen, lambda doc: doc["segments"][0].update(group=77))
    report = verify_store(path)
    assert not report["ok"] and any("group 77" in p for p in report["problems"]), report["problems"]
    from diskreplay.verify import repair_store

    repair_store(path, force=True)  # (no writer runs: it was just closed)
    assert verify_store(path)["ok"]
    with ReplayStore(path, readonly=True) as ro:
        assert ro.manifest.segments[-1].group is None and ro.manifest.segments[-1].groups_bytes
        assert ro.group_rows(2).tolist() == [6, 7, 8] and len(ro.group_rows(77)) == 0


def test_a_malformed_inline_group_is_refused_naming_the_field():
    good = fmt.SegmentEntry(1, 0, 2, 100, 5, group=3).to_dict()
    for bad in ({"group": "3"}, {"group": 1 << 63}, {"group": 3, "groups_bytes": 10},
                {"group": 3, "groups_file": "groups/000000000001.arrow"}):
        with pytest.raises(FormatError, match="group"):
            fmt.SegmentEntry.from_dict({**good, **bad}, "m.json")


# the last commit before inline groups: it knows append deltas (v4) but not v5
BEFORE_INLINE_GROUPS = "2da331b"


def test_an_older_diskreplay_refuses_inline_groups_and_its_v4_stores_keep_sidecars(tmp_path):
    from .test_late_columns import _run_previous, open_with_previous
    from .conftest import package_at

    previous = package_at(BEFORE_INLINE_GROUPS, tmp_path / "previous")
    v5, v4 = str(tmp_path / "v5"), str(tmp_path / "v4")
    with ReplayStore(v5, multi_writer=True) as store:
        store.extend(batch_for(0, 0))
    for mode in ("readonly=True", ""):
        proc = open_with_previous(previous, v5, mode)
        assert "Unsupported version 5" in proc.stdout, (mode, proc.stdout, proc.stderr)
    proc = _run_previous(previous, """
        with ReplayStore(sys.argv[1], multi_writer=True) as s:
            s.extend({"prompt_id": np.array([1, 1]), "completion_ids": [np.arange(3, dtype=np.int32)] * 2})
        """, v4)
    assert proc.returncode == 0, proc.stderr
    with ReplayStore(v4) as store:
        assert store.options.append_deltas and not store.options.inline_groups
        store.extend({"prompt_id": np.array([3]), "completion_ids": [np.arange(2, dtype=np.int32)]})
        assert all(s.group is None and s.groups_bytes for s in store.manifest.segments)
    proc = _run_previous(previous, """
        with ReplayStore(sys.argv[1], readonly=True) as s:
            print("rows", len(s), s.group_rows(3).tolist())
        """, v4)
    assert "rows 3 [2]" in proc.stdout, (proc.stdout, proc.stderr)


# ---------------------------------------------------------------------------
# rewrite deltas (format v5): a merge is published as the ids it replaces


def _rewrites(path):
    out = []
    for gen in fmt.list_generations(path):
        doc = json.load(open(os.path.join(path, fmt.manifest_file(gen))))
        if "replaced" in doc:
            out.append(gen)
    return out


def test_merges_are_rewrite_deltas_that_every_reader_resolves(tmp_path):
    """Two writers' small commits with merges (and a capacity evicting under them): the merges are
    rewrite deltas, and every generation on disk resolves to what the writers held."""
    path = str(tmp_path / "s")
    held = {}
    with ReplayStore(path, multi_writer=True, capacity=100, merge_policy=MergePolicy(fanin=4, ratio=3)) as a, \
            ReplayStore(path, merge_policy=MergePolicy(fanin=4, ratio=3)) as b:
        for step in range(40):
            w = a if step % 3 else b
            w.extend(batch_for(int(w is b), step, rows=3), token=token_for(int(w is b), step))
            held[w.generation] = w.manifest
        gens = _rewrites(path)
        assert gens and a.stats()["dropped_rewrites"] + b.stats()["dropped_rewrites"] < len(gens)
        doc = json.load(open(os.path.join(path, fmt.manifest_file(gens[-1]))))
        assert doc["version"] == fmt.REWRITE_DELTA_VERSION and "head" not in doc and len(doc["replaced"]) == 4
        for gen in fmt.list_generations(path):  # resolved from the chain on disk, with no known base
            m = fmt.read_manifest(path, gen)
            if gen in held:
                _same(m, held[gen])
        assert not check_rows(a, a.row_ids()) and len(a) == 100
    assert verify_store(path)["ok"]


def test_a_v4_store_still_merges_with_full_manifests(tmp_path):
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True).close()
    dataclasses.replace(fmt.StoreOptions.read(path), inline_groups=False).write(path)
    with ReplayStore(path, merge_policy=MergePolicy(fanin=4, ratio=3)) as store:
        for step in range(10):
            store.extend(batch_for(0, step, rows=3))
        assert len(store.manifest.segments) < 10
    assert not _rewrites(path) and "full" in _kinds(path).values()


def test_a_rewrite_delta_that_does_not_apply_is_an_error_naming_it(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, merge_policy=MergePolicy(fanin=4, ratio=3)) as store:
        for step in range(4):
            store.extend(batch_for(0, step, rows=3))
        gen = store.generation
    assert _rewrites(path) == [gen]
    for change, why in ((lambda doc: doc["replaced"].reverse(), "changed in another commit"),
                        (lambda doc: doc["replaced"].append(999), "changed in another commit"),
                        (lambda doc: doc["segments"][0].update(num_rows=11), "does not hold the rows")):
        original = open(os.path.join(path, fmt.manifest_file(gen)), "rb").read()
        _resign(path, gen, change)
        with pytest.raises(CorruptStoreError, match=why) as info:
            fmt.read_manifest(path, gen)
        assert fmt.manifest_file(gen) in str(info.value)
        open(os.path.join(path, fmt.manifest_file(gen)), "wb").write(original)
    assert fmt.read_manifest(path, gen).segments[0].num_rows == 12


def test_an_append_delta_reader_refuses_a_rewrite_delta_by_its_version(tmp_path):
    d = fmt.RewriteDelta((1, 2), (fmt.SegmentEntry(3, 0, 6, 99, 0),))
    doc = json.loads(fmt.signed_bytes(d.body()))
    with pytest.raises(FormatError, match="Unsupported version 2"):
        fmt.AppendDelta.from_doc(doc, "x")
    for bad in ({"replaced": []}, {"replaced": [1, 1]}, {"replaced": ["1"]}, {"replaced": [[1]]}, {"segments": []}):
        with pytest.raises(FormatError, match="replaced/segments"):
            fmt.RewriteDelta.from_doc(json.loads(fmt.signed_bytes({**d.body(), **bad})), "x")


def test_a_store_converted_to_one_writer_keeps_reading_its_inline_groups(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True) as store:
        for step in range(3):
            store.extend(batch_for(0, 2 * step, rows=3))
    with ReplayStore(path) as store:
        store.compact(target_bytes=1, multi_writer=False)  # (one segment per input: inline groups stay)
        store.extend(batch_for(0, 6, rows=2))
        assert [s.group for s in store.manifest.segments] == [0, 1, 2, 3]
    doc = json.load(open(os.path.join(path, fmt.FORMAT_FILE)))
    assert doc["version"] == fmt.INLINE_GROUPS_VERSION and doc["multi_writer"] is False
    with ReplayStore(path, readonly=True) as ro:
        assert not ro.options.multi_writer and ro.group_rows(3).tolist() == [9, 10]
    assert verify_store(path)["ok"]
