"""Commits as values: what an operation does to the manifest it is based on, and when it conflicts.

Every new manifest of a store is ``apply(base, op, options)`` for one of the
operations below; the committer (``committer.py``) picks the base, and when
another writer committed first it applies the same operation to the newer
manifest (rebases) or gives up where the rules below say the operation
conflicts. The rules, also in docs/FORMAT.md ("Many writers"):

=============  ==========================================================
operation      conflicts with a concurrent commit when
=============  ==========================================================
``Append``     never (row ids are assigned when it is applied); a late column
               it adds that the base has with another type is a
               ``SchemaError`` (the same type: it is already there); a media
               hash its rows name that the base no longer names (evicted since
               it was planned) and that it did not write itself: then the
               appender plans it again, writing the blob (a hash the base names
               takes the base's blob: a blob the append wrote for it is left
               unnamed, docs/FORMAT.md "Media")
``Rewrite``    a replaced segment is no longer in the base (another rewrite
               merged it, or eviction dropped it), or a patch it folds is no
               longer in the base; stored as a rewrite delta in a format v5
               store when it folds no patch
``SaveState``  never (the state of that name from the later commit wins), unless
               ``conditional``: then when the base's state of that name is not
               ``replaces`` (a compare-and-set: a rollout stream's fence)
``Patch``      never (it lands after every commit it raced with: its values are the newest);
               a new column it adds that the base has with another type is a
               ``SchemaError``, as for an append
``Evict``      never (the head only moves forward)
``RollBack``   always, unless the base is the one it was planned on
``IndexGroups``  the base ends before the rows the persisted group index covers (a roll back took them)
=============  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

from .. import format as fmt
from ..errors import ArgumentError, CommitConflictError
from ..schema import ColumnSpec

#: an operation cannot be applied to the newest manifest (see the table above)
Conflict = CommitConflictError


@dataclass(frozen=True)
class Append:
    """New segments holding ``num_rows`` rows, to become the rows ``[base.next_row, ...)``.

    ``entries`` carry the row ids of the base they were prepared for (a group
    sidecar records global row ids); ``first_row`` says which. A ``relocatable``
    append's sidecars hold segment-local rows: it applies to any base as it
    is, and can be committed as an :class:`~diskreplay.format.AppendDelta`.
    """

    entries: Tuple[fmt.SegmentEntry, ...]
    num_rows: int
    token: Optional[fmt.TokenRecord] = None
    #: late columns its segments hold that the schema it was validated against lacked
    columns: Tuple[ColumnSpec, ...] = ()
    relocatable: bool = False
    #: media blobs it wrote (hashes its base did not name), and for every hash its rows name the
    #: last such row, counted from its first row (:func:`~diskreplay.format.manifest.add_media`)
    media: Tuple[fmt.MediaEntry, ...] = ()
    media_last: Tuple[Tuple[str, int], ...] = ()

    def delta(self, commit_stats: Optional[dict] = None) -> fmt.AppendDelta:
        """This append as a delta (rows numbered from 0)."""
        first = self.entries[0].first_row
        return fmt.AppendDelta(tuple(e.moved(-first) for e in self.entries),
                               self.num_rows, self.token, self.columns, commit_stats or {}, self.media,
                               self.media_last)


@dataclass(frozen=True)
class Rewrite:
    """The rows of the consecutive segments ``replaced`` now live in ``entries`` (merge, compact, repair)."""

    replaced: Tuple[fmt.SegmentEntry, ...]
    entries: Tuple[fmt.SegmentEntry, ...]
    #: ids of the patches whose values the new segments hold (dropped from the manifest): every
    #: patch of the planned-on base that holds any of the rows, each holding only such rows
    folded: Tuple[int, ...] = ()

    @property
    def ids(self) -> Tuple[int, ...]:
        return tuple(s.id for s in self.replaced)

    def delta(self, commit_stats: Optional[dict] = None) -> fmt.RewriteDelta:
        """This rewrite as a delta (format v5 stores)."""
        return fmt.RewriteDelta(self.ids, self.entries, commit_stats or {})


@dataclass(frozen=True)
class SaveState:
    """Save the state file ``entry``; ``conditional``: only over the entry ``replaces`` (None: none)."""

    entry: fmt.StateEntry
    replaces: Optional[fmt.StateEntry] = None
    conditional: bool = False


@dataclass(frozen=True)
class Patch:
    """Values for committed rows: the patch file ``entry`` names, the new columns it adds
    (``columns``: the schema it was validated against lacked them) and its exactly-once ``token``
    (its ``first_row``/``num_rows`` span the patched rows)."""

    entry: fmt.PatchEntry
    token: Optional[fmt.TokenRecord] = None
    columns: Tuple[ColumnSpec, ...] = ()


@dataclass(frozen=True)
class Evict:
    """Drop every row below ``head``."""

    head: int


@dataclass(frozen=True)
class RollBack:
    """Make ``target``'s rows, segments and states the newest commit again (repair); ``base``
    is the generation it was planned on."""

    target: fmt.Manifest
    base: int


@dataclass(frozen=True)
class IndexGroups:
    """Name ``entry``, a persisted group index of rows ``[entry.first_row, entry.end_row)``, in the manifest."""

    entry: fmt.GroupIndexEntry


Operation = Union[Append, Rewrite, Patch, SaveState, Evict, RollBack, IndexGroups]


def apply(base: fmt.Manifest, op: Operation, options: fmt.StoreOptions) -> fmt.Manifest:
    """The manifest that commits ``op`` on top of ``base`` (generation ``base.generation + 1``).

    >>> m = apply(fmt.Manifest(), Evict(0), fmt.StoreOptions())
    >>> m.generation, m.num_rows
    (1, 0)
    """
    generation = base.generation + 1
    if isinstance(op, Append):
        if op.relocatable:
            return op.delta().apply(base, options)  # the committer says whether it is stored as one
        if op.entries and op.entries[0].first_row != base.next_row:
            raise Conflict(f"append prepared for row {op.entries[0].first_row}, the base ends at {base.next_row}")
        return fmt.append_rows(base, op.entries, op.num_rows, op.token, op.columns, options, op.media,
                               op.media_last)
    if isinstance(op, Rewrite):
        if not op.folded:
            return fmt.rewrite_rows(base, op.ids, op.entries, options)  # (ids are never reused)
        have = {p.id for p in base.patches if not p.folded}
        gone = [i for i in op.folded if i not in have]
        if gone:
            raise Conflict(f"patch {gone[0]} was folded or evicted by another commit")
        folded = set(op.folded)  # (a named patch stays readable by its version)
        return fmt.rewrite_rows(base, op.ids, op.entries, options, patches=tuple(
            fmt.evolve(p, {"folded": True}) if p.id in folded else p
            for p in base.patches if p.id not in folded or p.version is not None))
    if isinstance(op, Patch):
        tokens, late = base.tokens, base.late_columns
        if op.token is not None:
            tokens = tokens + (fmt.evolve(op.token, {"generation": generation}),)
        if op.columns:
            late = fmt.add_late_columns(late, op.columns, base.next_row, generation)
        return base.evolve(generation=generation, patches=base.patches + (op.entry,), tokens=tokens,
                           late_columns=late, next_segment=max(base.next_segment, op.entry.id + 1))
    if isinstance(op, SaveState):
        if op.conditional and base.states.get(op.entry.name) != op.replaces:
            raise Conflict(f"the state {op.entry.name!r} changed since this save was planned")
        return base.evolve(generation=generation, states={**base.states, op.entry.name: op.entry})
    if isinstance(op, Evict):
        head, holes = fmt.past_holes(min(max(base.head, op.head), base.next_row), base.holes)
        return base.evolve(generation=generation, head=head, holes=holes,
                           segments=tuple(s for s in base.segments if s.end_row > head),
                           patches=fmt.live_patches(base.patches, head), media=fmt.live_media(base.media, head))
    if isinstance(op, RollBack):
        if base.generation != op.base:
            raise Conflict(f"a roll back planned on generation {op.base} cannot follow generation {base.generation}")
        return op.target.evolve(generation=generation,
                                next_segment=max(base.next_segment, op.target.next_segment))
    if isinstance(op, IndexGroups):
        if op.entry.end_row > base.next_row:
            raise Conflict(f"a group index of rows up to {op.entry.end_row} for a store ending at {base.next_row}")
        return base.evolve(generation=generation, group_index=op.entry)
    raise ArgumentError(f"not an operation: {op!r}")
