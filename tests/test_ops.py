"""Commits as values, tested without a store: ``store.ops.apply``, its conflict table and the
manifest transforms under it, over random sequences of operations (docs/FORMAT.md, "Many writers",
"Operations and conflicts").

Each property is stated against a plain model (a list of live row ids and a dict of states),
never against another ``ReplayStore``: what an operation does to a manifest is a pure function.
"""

from __future__ import annotations

import json
from typing import List

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from diskreplay import format as fmt
from diskreplay.errors import CommitConflictError
from diskreplay.store import ops


def _options(capacity_rows=None) -> fmt.StoreOptions:
    return fmt.StoreOptions(group_key=None, capacity_rows=capacity_rows, multi_writer=True)


def _append(base: fmt.Manifest, sizes: List[int], token: str = None) -> ops.Append:
    """An append of segments of ``sizes`` rows prepared on ``base`` (ids from its ``next_segment``)."""
    entries, row = [], base.next_row
    for i, n in enumerate(sizes):
        entries.append(fmt.SegmentEntry(base.next_segment + i, row, n, 100 * n, 7))
        row += n
    record = None if token is None else fmt.TokenRecord(token, -1, sum(sizes), 1, -1)
    return ops.Append(tuple(entries), sum(sizes), record)


def _live(m: fmt.Manifest) -> List[int]:
    """Row ids the manifest's segments hold at or above its head."""
    out: List[int] = []
    for s in m.segments:
        out += [r for r in range(s.first_row, s.end_row) if r >= m.head]
    return out


def _merge(m: fmt.Manifest, at: int) -> ops.Rewrite:
    """Merge segments ``at`` and ``at + 1`` of ``m`` into one new segment with the same rows."""
    a, b = m.segments[at], m.segments[at + 1]
    merged = fmt.SegmentEntry(m.next_segment, a.first_row, a.num_rows + b.num_rows, a.bytes + b.bytes, 9)
    return ops.Rewrite((a, b), (merged,))


step = st.one_of(
    st.tuples(st.just("append"), st.lists(st.integers(1, 5), min_size=1, max_size=3)),
    st.tuples(st.just("evict"), st.integers(0, 40)),
    st.tuples(st.just("state"), st.sampled_from(["sampler", "stream.trainer"])),
    st.tuples(st.just("merge"), st.integers(0, 10)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(step, max_size=30), st.one_of(st.none(), st.integers(1, 20)))
def test_apply_against_model(steps, capacity):
    """Every operation makes generation + 1; live rows are exactly ``[head, next_row)``, in order, FIFO
    under a row capacity; a merge keeps the rows; the newest saved state of a name wins; manifests
    survive their own JSON."""
    options = _options(capacity)
    m, next_row, head, states, gen = fmt.Manifest(), 0, 0, {}, 0
    for kind, arg in steps:
        if kind == "append":
            m2 = ops.apply(m, _append(m, arg), options)
            next_row += sum(arg)
            if capacity is not None:
                head = max(head, next_row - capacity)
        elif kind == "evict":
            m2 = ops.apply(m, ops.Evict(arg), options)
            head = min(max(head, arg), next_row)
        elif kind == "state":
            entry = fmt.StateEntry(arg, m.generation + 1, 10, 3)
            m2 = ops.apply(m, ops.SaveState(entry), options)
            states[arg] = entry
        else:
            if len(m.segments) < 2:
                continue
            m2 = ops.apply(m, _merge(m, arg % (len(m.segments) - 1)), options)
        gen += 1
        assert m2.generation == gen == m.generation + 1
        assert (m2.head, m2.next_row) == (head, next_row)
        assert _live(m2) == list(range(head, next_row))
        assert dict(m2.states) == states
        ids = [s.id for s in m2.segments]
        assert len(set(ids)) == len(ids) and all(i < m2.next_segment for i in ids)
        assert fmt.Manifest.from_dict(m2.to_dict(), "test") == m2
        m = m2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_append_is_prepared_for_its_base(mine, theirs):
    """An append prepared on a base does not apply to a newer one (its row ids are the base's):
    the committer rebases it; a relocatable one (segment-local rows) applies to any base, at that
    base's end, with its token recorded there."""
    options = _options()
    base = fmt.Manifest()
    newer = ops.apply(base, _append(base, theirs), options)
    op = _append(base, mine, token="w:1")
    with pytest.raises(CommitConflictError):
        ops.apply(newer, op, options)
    reloc = ops.Append(op.entries, op.num_rows, op.token, relocatable=True)
    m = ops.apply(newer, reloc, options)
    assert m.next_row == sum(theirs) + sum(mine)
    assert _live(m) == list(range(m.next_row))
    (record,) = m.tokens
    assert (record.token, record.first_row, record.num_rows, record.generation) == ("w:1", sum(theirs), sum(mine), 2)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=3, max_size=6), st.integers(0, 10), st.integers(0, 10))
def test_rewrite_conflicts_exactly_when_its_segments_are_gone(sizes, first, second):
    """Two writers merge at once (the conflict table's ``Rewrite`` row): the second applies on top of
    the first exactly when the segments it replaces are still in the base; else ``Conflict``.
    Eviction past a replaced segment conflicts the same way."""
    options = _options()
    m = ops.apply(fmt.Manifest(), _append(fmt.Manifest(), sizes), options)
    a = _merge(m, first % (len(m.segments) - 1))
    b = _merge(m, second % (len(m.segments) - 1))
    after_a = ops.apply(m, a, options)
    overlap = set(a.ids) & set(b.ids)
    if overlap:
        with pytest.raises(ops.Conflict):
            ops.apply(after_a, b, options)
    else:
        both = ops.apply(after_a, b, options)
        assert _live(both) == list(range(m.next_row))
    evicted = ops.apply(m, ops.Evict(m.segments[1].end_row), options)
    with pytest.raises(ops.Conflict):
        ops.apply(evicted, _merge(m, 0), options)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["append", "evict", "state"]), min_size=2, max_size=8), st.randoms())
def test_commuting_operations_rebase_to_the_same_rows(kinds, rnd):
    """Appends, evictions and saved states never conflict: applied in any order (each append
    rebased, i.e. prepared again on the base it lands on) they give the same live rows, head and
    states, whatever the interleaving; only the row ids of each append depend on its turn."""
    options = _options(capacity_rows=12)

    def run(order):
        m = fmt.Manifest()
        for k in order:
            if k == "append":
                m = ops.apply(m, _append(m, [3]), options)
            elif k == "evict":
                m = ops.apply(m, ops.Evict(m.next_row - 2), options)
            else:
                m = ops.apply(m, ops.SaveState(fmt.StateEntry("s", m.generation + 1, 1, 1)), options)
        return m

    shuffled = list(kinds)
    rnd.shuffle(shuffled)
    one, two = run(kinds), run(shuffled)
    assert one.generation == two.generation == len(kinds)
    assert one.next_row == two.next_row
    assert set(one.states) == set(two.states)
    if "evict" not in kinds:
        assert one.head == two.head  # only capacity moved it: FIFO depends on the count alone


def test_roll_back_conflicts_unless_planned_on_its_base():
    options = _options()
    m1 = ops.apply(fmt.Manifest(), _append(fmt.Manifest(), [2]), options)
    m2 = ops.apply(m1, _append(m1, [3]), options)
    back = ops.RollBack(m1, base=m2.generation)
    assert _live(ops.apply(m2, back, options)) == [0, 1]
    m3 = ops.apply(m2, ops.Evict(0), options)
    with pytest.raises(ops.Conflict):
        ops.apply(m3, back, options)


# --------------------------------------------------------------------------
# the conflict table, pair by pair
# --------------------------------------------------------------------------

KINDS = ("append", "rewrite", "save", "evict", "rollback", "index")


@st.composite
def planned(draw, base: fmt.Manifest, older: fmt.Manifest, kind: str, k: int) -> ops.Operation:
    """An operation of ``kind`` planned on ``base`` (``older``: an earlier commit a roll back
    returns to; ``k``: which of the concurrent writers, so that their segment ids differ)."""
    first_id = base.next_segment + 100 * k
    if kind == "append":
        sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
        entries, row = [], 0
        for i, n in enumerate(sizes):  # segment-local rows: applies at whatever row the base ends
            entries.append(fmt.SegmentEntry(first_id + i, row, n, 100 * n, 7))
            row += n
        token = fmt.TokenRecord(f"w{k}:{draw(st.integers(0, 9))}", 0, row, 1, 1)
        return ops.Append(tuple(entries), row, token, relocatable=True)
    if kind == "rewrite":
        at = draw(st.integers(0, len(base.segments) - 2))
        a, b = base.segments[at], base.segments[at + 1]
        return ops.Rewrite((a, b), (fmt.SegmentEntry(first_id, a.first_row, a.num_rows + b.num_rows,
                                                     a.bytes + b.bytes, 9),))
    if kind == "save":
        name = draw(st.sampled_from(["sampler", "stream.trainer"]))
        conditional = draw(st.booleans())
        return ops.SaveState(fmt.StateEntry(name, base.generation + 1 + k, 10, k), base.states.get(name), conditional)
    if kind == "evict":
        return ops.Evict(draw(st.integers(base.head, base.next_row)))
    if kind == "rollback":
        return ops.RollBack(older, base.generation)
    end = draw(st.integers(base.head, base.next_row))
    return ops.IndexGroups(fmt.GroupIndexEntry(base.generation + 1, base.head, end, 64, k, (8, 16, k)))


def _documented_conflict(op: ops.Operation, planned_on: fmt.Manifest, base: fmt.Manifest) -> bool:
    """Whether the conflict table (ops.py's docstring, docs/FORMAT.md "Operations and conflicts") says
    ``op``, planned on ``planned_on``, conflicts with ``base``, the commit that won the race."""
    if isinstance(op, ops.Rewrite):  # a replaced segment is gone (merged by another, or evicted)
        return not set(op.ids) <= {s.id for s in base.segments}
    if isinstance(op, ops.SaveState):  # a compare-and-set: its entry changed meanwhile
        return op.conditional and base.states.get(op.entry.name) != op.replaces
    if isinstance(op, ops.RollBack):
        return base.generation != planned_on.generation
    if isinstance(op, ops.IndexGroups):  # of rows the base still has (a roll back may have taken them)
        return op.entry.end_row > base.next_row
    return False  # Append (rows numbered when applied), Evict (the head only moves forward)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(KINDS), st.sampled_from(KINDS), st.lists(st.integers(1, 4), min_size=3, max_size=6),
       st.one_of(st.none(), st.integers(4, 30)), st.data())
def test_every_pair_of_operations_rebases_or_conflicts_as_the_table_says(first, second, sizes, capacity, data):
    """Two writers plan an operation each on one base; the first commits. Rebasing the second on its
    commit either raises ``Conflict`` exactly where the conflict table says, or gives what the
    second operation documents, applied on top of the first's result."""
    options = _options(capacity)
    older = ops.apply(fmt.Manifest(), _append(fmt.Manifest(), sizes[:1]), options)
    base = ops.apply(older, _append(older, sizes[1:]), options)
    base = ops.apply(base, ops.SaveState(fmt.StateEntry("sampler", base.generation + 1, 10, 3)), options)
    assume(len(base.segments) >= 2)
    one = data.draw(planned(base, older, first, 1))
    two = data.draw(planned(base, older, second, 2))
    won = ops.apply(base, one, options)
    assert won.generation == base.generation + 1
    if _documented_conflict(two, base, won):
        with pytest.raises(ops.Conflict):
            ops.apply(won, two, options)
        return
    m = ops.apply(won, two, options)
    assert m.generation == won.generation + 1
    assert fmt.Manifest.from_dict(m.to_dict(), "test") == m  # a valid manifest
    live = _live(won)
    if isinstance(two, ops.Append):
        new = list(range(won.next_row, won.next_row + two.num_rows))
        want = [r for r in live + new if capacity is None or r >= won.next_row + two.num_rows - capacity]
        assert _live(m) == want and m.next_row == won.next_row + two.num_rows
        assert m.tokens[-1].first_row == won.next_row and m.tokens[-1].generation == m.generation
    elif isinstance(two, ops.Rewrite):
        assert _live(m) == live and (m.head, m.next_row) == (won.head, won.next_row)
        assert not set(two.ids) & {s.id for s in m.segments}
    elif isinstance(two, ops.SaveState):
        assert m.states == {**won.states, two.entry.name: two.entry}  # the later commit's state wins
        assert _live(m) == live
    elif isinstance(two, ops.Evict):
        assert m.head == min(max(won.head, two.head), won.next_row)
        assert _live(m) == [r for r in live if r >= m.head]
    elif isinstance(two, ops.IndexGroups):
        assert m.group_index == two.entry and _live(m) == live
    else:
        raise AssertionError(f"{two} was documented to conflict")


def _table_rows(text: str, mark: str) -> set:
    """The operation names that start the rows of a table in ``text``."""
    import re

    return set(re.findall(rf"^{re.escape(mark)}(\w+)", text, re.M))


def test_the_conflict_tables_name_every_operation():
    """ops.py's conflict table, docs/FORMAT.md's ("Operations and conflicts") and ``ops.Operation``
    name the same operations."""
    import typing
    from pathlib import Path

    names = {t.__name__ for t in typing.get_args(ops.Operation)}
    assert _table_rows(ops.__doc__, "``") == names
    docs = (Path(__file__).parent.parent / "docs" / "FORMAT.md").read_text()
    section = docs[docs.index("**Operations and conflicts.**"):]
    section = section[:section.index("\n\n", section.index("| operation"))]
    assert _table_rows(section, "| `") == names


# --------------------------------------------------------------------------
# the manifest transforms under ops.apply (format/manifest.py, format/segment_table.py)
# --------------------------------------------------------------------------

def _with_holes(m: fmt.Manifest, dropped) -> fmt.Manifest:
    """``m`` after a repair dropped the segments at positions ``dropped`` (never the first): their
    rows become holes, the ranges between the segments kept and after the last."""
    kept = tuple(s for i, s in enumerate(m.segments) if i not in dropped)
    holes: List[tuple] = []
    for i, s in enumerate(m.segments):
        if i in dropped:
            if holes and holes[-1][1] == s.first_row:
                holes[-1] = (holes[-1][0], s.end_row)
            else:
                holes.append((s.first_row, s.end_row))
    return m.evolve(generation=m.generation + 1, segments=kept, holes=tuple(holes))


def _model_rows(m: fmt.Manifest) -> List[int]:
    """The live rows a manifest promises: ``[head, next_row)`` less its holes."""
    return [r for r in range(m.head, m.next_row) if not any(a <= r < b for a, b in m.holes)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=3, max_size=7), st.sets(st.integers(1, 6), max_size=3),
       st.lists(st.tuples(st.sampled_from(["append", "evict", "merge", "state"]), st.integers(0, 40)), max_size=12),
       st.one_of(st.none(), st.integers(6, 30)))
def test_holes_stay_exactly_the_gaps_through_every_operation(sizes, dropped, steps, capacity):
    """After a repair left holes, appends, evictions (by count and by capacity), merges and saves keep
    the live rows exactly ``[head, next_row)`` less the holes, the holes exactly the gaps (the
    manifest validates), ``head`` never inside one; a merge across a hole conflicts."""
    options = _options(capacity)
    m = ops.apply(fmt.Manifest(), _append(fmt.Manifest(), sizes), options)
    m = _with_holes(m, {i for i in dropped if i < len(m.segments)})
    for kind, arg in steps:
        if kind == "append":
            op = _append(m, [1 + arg % 4])
        elif kind == "evict":
            op = ops.Evict(arg)
        elif kind == "state":
            op = ops.SaveState(fmt.StateEntry("s", m.generation + 1, 1, 1))
        else:
            if len(m.segments) < 2:
                continue
            at = arg % (len(m.segments) - 1)
            op = _merge(m, at)
            if m.segments[at].end_row != m.segments[at + 1].first_row:
                with pytest.raises(ops.Conflict, match="hole"):
                    ops.apply(m, op, options)
                continue
        before = _model_rows(m)
        m2 = ops.apply(m, op, options)
        assert _live(m2) == _model_rows(m2)
        assert set(_model_rows(m2)) <= set(before) | set(range(m.next_row, m2.next_row))
        assert not any(a <= m2.head < b for a, b in m2.holes) and all(a > m2.head for a, _ in m2.holes)
        assert fmt.Manifest.from_dict(json.loads(m2.file_bytes()), "test") == m2
        m = m2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 900)), min_size=1, max_size=10), st.integers(0, 30),
       st.one_of(st.none(), st.integers(1, 40)), st.one_of(st.none(), st.integers(1, 5000)))
def test_eviction_keeps_the_newest_rows_within_the_capacities(segs, head, capacity_rows, capacity_bytes):
    """``format.evict``: the head only moves forward; at most ``capacity_rows`` row ids stay; the
    segments kept fit ``capacity_bytes`` unless only the newest is left, and are the fewest dropped
    to get there (FIFO); a segment table gives what its entries give."""
    entries, row = [], 0
    for i, (n, nbytes) in enumerate(segs):
        entries.append(fmt.SegmentEntry(i, row, n, nbytes, 0, groups_bytes=nbytes // 10))
        row += n
    head = min(head, entries[0].end_row - 1)
    options = fmt.StoreOptions(group_key=None, capacity_rows=capacity_rows, capacity_bytes=capacity_bytes)
    new_head, kept, holes = fmt.evict(head, row, tuple(entries), options)
    assert new_head >= head and holes == ()
    if capacity_rows is not None:
        assert new_head >= row - capacity_rows
    assert list(kept) == [s for s in entries if s.end_row > new_head]
    size = [s.bytes + s.groups_bytes for s in entries]
    if capacity_bytes is not None and len(kept) > 1:
        assert sum(size[len(entries) - len(kept):]) <= capacity_bytes
    by_rows = max(head, row - capacity_rows) if capacity_rows is not None else head
    dropped_by_bytes = [s for s in entries if s.end_row > by_rows and s not in kept]
    if dropped_by_bytes:  # the last one it dropped was needed
        assert sum(size[len(entries) - len(kept) - 1:]) > capacity_bytes
    table = fmt.evict(head, row, fmt.SegmentTable.of(entries), options)
    assert table[0] == new_head and list(table[1]) == list(kept)


segment_entries = st.lists(st.tuples(st.integers(1, 1000), st.integers(1 << 10, 1 << 40), st.integers(0, 2 ** 32 - 1),
                                     st.one_of(st.none(), st.integers(-(1 << 62), 1 << 62))),
                           min_size=1, max_size=20)


@settings(max_examples=60, deadline=None)
@given(segment_entries, st.integers(0, 10 ** 6))
def test_segment_table_round_trip(rows, first_row):
    """A long manifest's entries as one Arrow table (``table_bytes``) read back as the same entries
    (inline groups and sidecar sizes included), and the manifest naming it validates the same."""
    entries, row = [], first_row
    for i, (n, nbytes, crc, group) in enumerate(rows):
        groups = (0, 0) if group is not None else (nbytes // 7 + 1, crc ^ 1)
        entries.append(fmt.SegmentEntry(3 * i, row, n, nbytes, crc, *groups, group=group))
        row += n
    table = fmt.SegmentTable.from_bytes(fmt.table_bytes(fmt.SegmentTable.of(entries)), "t")
    assert list(table) == entries and table == tuple(entries)
    for name in ("id", "first_row", "num_rows", "bytes", "crc32c"):
        assert table.column(name).tolist() == [getattr(e, name) for e in entries]
    m = fmt.Manifest(generation=2, head=first_row, next_row=row, next_segment=3 * len(entries), segments=tuple(entries))
    doc = m.to_dict()
    assert fmt.Manifest.from_dict(dict(doc, segments=table), "t", verified=True) == m
    assert m.file_bytes() == fmt.signed_bytes(m.body())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.lists(st.integers(1, 5), min_size=2, max_size=5),
       st.dictionaries(st.sampled_from(fmt.COMMIT_STATS), st.integers(0, 10 ** 6)),
       st.dictionaries(st.sampled_from(fmt.COMMIT_STATS), st.integers(0, 10 ** 6)), st.integers(0, 3))
def test_deltas_are_their_operations(mine, before, stats, base_stats, depth):
    """An append delta and a rewrite delta survive their signed JSON and make, on any base, the
    manifest their operation makes (``append_rows``, ``rewrite_rows``), one more delta deep, their
    commit counters added to the base's; a rewrite delta whose segments are gone conflicts."""
    options = _options()
    base = ops.apply(fmt.Manifest(), _append(fmt.Manifest(), before), options)
    base = base.evolve(commit_stats=base_stats, depth=depth)
    op = _append(fmt.Manifest(), mine)
    op = ops.Append(op.entries, op.num_rows, fmt.TokenRecord("w:1", 0, op.num_rows, 5, 1), relocatable=True)
    delta = op.delta(stats)
    assert fmt.delta_from_doc(json.loads(fmt.signed_bytes(delta.body())), "d") == delta
    m = delta.apply(base, options)
    moved = [e.moved(base.next_row) for e in op.entries]
    want = fmt.append_rows(base, moved, op.num_rows, op.token, (), options)
    assert m.evolve(commit_stats={}) == want.evolve(commit_stats={}) and m.generation == want.generation
    assert m.depth == depth + 1
    assert dict(m.commit_stats) == {k: base_stats.get(k, 0) + stats.get(k, 0) for k in {*base_stats, *stats}}

    merge = _merge(base, 0)
    rewrite = merge.delta(stats)
    assert fmt.delta_from_doc(json.loads(fmt.signed_bytes(rewrite.body())), "d") == rewrite
    r = rewrite.apply(base, options)
    assert r.evolve(commit_stats={}) == ops.apply(base, merge, options).evolve(commit_stats={})
    assert r.depth == depth + 1 and _live(r) == _live(base)
    with pytest.raises(ops.Conflict):
        rewrite.apply(r, options)  # its segments are merged already
    assert fmt.with_chains({r.generation: r}) == set(range(r.generation - r.depth, r.generation + 1))


@given(st.integers(0, 60), st.lists(st.integers(1, 5), max_size=12))
def test_past_holes_moves_the_head_out_of_any_hole(head, widths):
    """``past_holes``: a head inside a hole moves to its end; the holes kept all start above it."""
    holes, at = [], 1
    for i, w in enumerate(widths):
        if i % 2:
            holes.append((at, at + w))
        at += w
    new, kept = fmt.past_holes(head, tuple(holes))
    assert new >= head and not any(a <= new < b for a, b in holes)
    assert kept == tuple(h for h in holes if h[0] > new)
    assert new == head or any(b == new and a <= head for a, b in holes)
