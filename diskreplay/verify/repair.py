"""``repair_store``: bring a damaged store back to its newest intact commit.

It holds the writer lock (a local store's) and never deletes: damaged,
unreferenced and temporary files move into ``STORE/quarantine/``, where a
person can inspect them.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import pyarrow as pa

from .. import format as fmt
from .._fileio import TMP_PREFIX, WriterLock, crc32c
from .._ranges import merge_ranges
from ..errors import CorruptStoreError, FormatError, ReadOnlyError, StoreLockedError, StoreNotFoundError
from ..segment import PageChecksums, Segment, encode_ipc, has_page_checksums
from ..format.sidecars import group_sidecar
from ..store import ops
from ..store.committer import Commit, Committer
from .check import (Report, check_size, compare_inline_group, compare_sidecar, orphans_message, referenced_files,
                    scan_manifests, with_late_columns)
from .files import ROOT_NAMES, StoreFiles, progress_bar, where_in


def repair_store(path: Any, dry_run: bool = False, progress: bool = False, force: bool = False, *,
                 storage_options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Roll the store at ``path`` back to its newest intact commit and tidy it.

    Holds the writer lock (raises ``StoreLockedError`` while a writer has the
    store open). The newest intact manifest is kept: damaged manifests,
    damaged files and files no retained manifest references move into
    ``quarantine/`` (nothing is deleted). Every row that still reads and
    checksums stays: the rows of a segment that is missing or fails its size
    or CRC-32C are dropped, recorded as a hole in the row ids (``store.holes``;
    at the front, the head moves past them) in a new commit, and the actions
    say which rows of which file. A damaged saved state is replaced by an
    older intact one of its name, else dropped. Damaged or missing group
    sidecars are rebuilt from their segment's group-key column, in a new
    commit. When no manifest is intact at all, it raises
    ``CorruptStoreError`` and changes nothing. ``dry_run=True`` reports the same actions without changing anything (and
    without taking the lock). Returns ``{"actions", "generation", "rows"}``.

    A store with a live writer is refused (``StoreLockedError``), dry run or
    not: a single-writer store while a process holds its lock; a multi-writer
    store (which has no lock) while any manifest or temporary file is younger
    than ``LIVE_SECONDS``, unless ``force=True`` (you have stopped every writer).
    A store in an object store (``s3://...``, ``storage_options``) has no lock
    and is treated like a multi-writer store; its quarantine is a copy and a delete.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(d) as store:
    ...     _ = store.extend({"prompt_id": [1, 2], "completion_ids": [[1], [2, 3]]})
    >>> os.remove(os.path.join(d, "groups", "000000000000.arrow"))
    >>> repair_store(d)["actions"]
    ['rebuilt groups/000000000000.arrow from the group-key column of segments/000000000000.arrow']
    >>> from diskreplay.verify import verify_store; verify_store(d)["ok"]
    True
    """
    files = StoreFiles.open(path, storage_options)
    try:
        return _repair(files, dry_run, progress, force)
    finally:
        files.close()


def _repair(files: "StoreFiles", dry_run: bool, progress: bool, force: bool) -> Dict[str, Any]:
    root = files.url
    if not files.exists(fmt.FORMAT_FILE):
        raise StoreNotFoundError(f"no diskreplay store at {root} (no {fmt.FORMAT_FILE})")
    try:
        multi = fmt.StoreOptions.read(files.root).multi_writer
    except (CorruptStoreError, FormatError):
        multi = False  # run() reports the damaged FORMAT.json
    # a local store's writers hold LOCK (one exclusively; many shared): any of them still open, idle or
    # not, is certain, and holding LOCK exclusively keeps new ones out while repair runs
    unlocked = not files.storage.exclusive_lock  # no LOCK to hold: an object store
    lock = None if unlocked else _repair_lock(
        files, f"{root} is a multi-writer store that writers have open (they hold LOCK); repair refuses a store "
               "with live writers: stop them all and run repair again" if multi else
               f"{root} is open for writing by another process (it holds LOCK); repair refuses a store with a "
               "live writer: close it (stop the run) and repair again", dry_run)
    if multi or unlocked:  # without a lock a live writer is told by its recent commits
        age = files.youngest_activity()
        if age < LIVE_SECONDS and not force:
            if lock is not None:
                lock.release()
            kind = "a multi-writer store" if multi else "a store on object storage (which has no lock)"
            raise StoreLockedError(f"{root} is {kind} that was written {age:.0f} s ago; repair "
                                   f"refuses a store with live writers: stop them all and run repair again, or pass "
                                   f"--force (force=True) if none is running")
    if dry_run and lock is not None:
        lock.release()
        lock = None
    keep_young = 0.0
    if (multi or unlocked) and not force:
        try:
            keep_young = float(fmt.StoreOptions.read(files.root).retain_seconds or fmt.DEFAULT_RETAIN_SECONDS)
        except (CorruptStoreError, FormatError):
            keep_young = float(fmt.DEFAULT_RETAIN_SECONDS)
    try:
        return _Repair(files, dry_run, progress, keep_young).run()
    finally:
        if lock is not None:
            lock.release()


def _repair_lock(files: "StoreFiles", refusal: str, dry_run: bool = False) -> Optional[WriterLock]:
    """LOCK of the local store ``files``, held exclusively; ``StoreLockedError(refusal)`` while a writer holds it.

    A dry run only tests it (None), through a read-only descriptor: it needs no write access to the store.
    """
    lock = files.storage.lock(fmt.LOCK_FILE)
    if dry_run:
        try:
            lock.probe()
        except StoreLockedError:
            raise StoreLockedError(refusal) from None
        return None
    try:
        lock.acquire()
    except StoreLockedError:
        raise StoreLockedError(refusal) from None
    except PermissionError as exc:
        raise ReadOnlyError(f"repair needs write access to {files.url} (it takes {fmt.LOCK_FILE} and moves files "
                            f"into {fmt.QUARANTINE_DIR}/): {exc.strerror}; --dry-run (dry_run=True) reports "
                            "what it would do without it") from None
    return lock


LIVE_SECONDS = 60


class _Repair:
    def __init__(self, files: StoreFiles, dry_run: bool, progress: bool, keep_young: float = 0.0) -> None:
        self.files, self.dry_run, self.progress = files, dry_run, progress
        #: unreferenced files younger than this stay (many writers, object storage: a writer on another
        #: host, which no lock shows, may have a commit in flight that names them; as clean-up keeps them)
        self.keep_young = keep_young
        self.root = files
        self.actions: List[str] = []
        self._moved: Set[str] = set()
        self._crc_cache: Dict[Tuple[str, int, int], bool] = {}

    # a file is "good" when its size and checksum match what a manifest records
    def _good(self, rel: str, size: int, crc: int, bar: Any = None) -> bool:
        key = (rel, size, crc)
        hit = self._crc_cache.get(key)
        if hit is None:
            hit = check_size(self.files, rel, size) is None and self.files.crc(rel, size) == crc
            if bar is not None:
                bar.update(size)
            self._crc_cache[key] = hit
        return hit

    def _bad_segments(self, m: fmt.Manifest, bar: Any = None) -> List[fmt.SegmentEntry]:
        return [s for s in m.segments if not self._good(s.file, s.bytes, s.crc32c, bar)]

    def _bad_states(self, m: fmt.Manifest, bar: Any = None) -> List[fmt.StateEntry]:
        return [st for st in m.states.values() if not self._good(st.file, st.bytes, st.crc32c, bar)]

    def run(self) -> Dict[str, Any]:
        try:
            options = self.options = fmt.StoreOptions.read(self.files.root)
        except (CorruptStoreError, FormatError) as exc:
            raise CorruptStoreError(f"repair cannot rebuild {fmt.FORMAT_FILE}, which holds the schema: {exc}") \
                from None
        self.files.check_dirs(lambda d, why: self._quarantine(d, why) or not self.dry_run)
        intact, damaged = scan_manifests(None, self.files)
        if damaged and not intact:
            # Nothing says which files hold committed rows: quarantining them all
            # would empty the store, so leave it for a person to look at.
            raise CorruptStoreError(f"no intact manifest in {where_in(self.root, fmt.MANIFEST_DIR)}; repair will not "
                                    "guess which files hold committed rows: " + "; ".join(m for _, m in damaged))
        if not intact:
            orphans = [rel for rel, is_dir in self.files.entries()
                       if not is_dir and fmt.is_data_file(rel) and self.files.size(rel)]
            if orphans:
                raise CorruptStoreError(orphans_message(self.files, orphans) + "; repair changes nothing here")
        for gen, message in damaged:
            self._quarantine(fmt.manifest_file(gen), f"it is damaged: {message}")

        total = sum(s.bytes for m in intact[:1] for s in m.segments)
        bar = progress_bar(self.progress, total, "repair")
        try:
            chosen, kept = self._choose(intact, bar)
        finally:
            if bar is not None:
                bar.close()
        if chosen is None:
            self.actions.append("no intact manifest: the store is empty")
            generation, rows = 0, 0
        else:
            chosen = self._rebuild_sidecars(chosen, with_late_columns(Report(self.root), options, chosen))
            chosen = self._drop_damaged_token_logs(chosen)
            chosen = self._drop_damaged_patches(chosen)
            chosen = self._drop_damaged_media(chosen)
            chosen = self._past_rolled_back(chosen, intact, damaged)
            generation, rows = chosen.generation, chosen.num_rows
            kept = [chosen] + [m for m in kept if m.generation < chosen.generation]
        self._quarantine_unreferenced(kept)
        self._floor_past_moved_manifests(generation)
        if not self.dry_run:
            self.files.sync()
        return {"actions": self.actions, "generation": generation, "rows": rows}

    def _floor_past_moved_manifests(self, newest: int) -> None:
        """Raise a floored store's collection floor above every manifest moved to quarantine (never
        above the newest): discovery probes upwards from the floor and stops at the first missing
        generation, so a hole left at or above the floor would hide every commit past it."""
        moved = [int(name[:-5]) for rel in self._moved
                 for d, _, name in [rel.partition("/")]
                 if d == fmt.MANIFEST_DIR and name.endswith(".json") and name[:-5].isdigit()]
        if not moved or fmt.read_floor(self.files.root) is None:
            return
        floor = min(max(moved) + 1, newest)
        if not self.dry_run and floor > fmt.raise_floor(self.files.storage, floor):
            self.actions.append(f"could not raise {fmt.FLOOR_FILE} to generation {floor}: run repair again")
        else:
            self.actions.append(f"raised the collection floor ({fmt.FLOOR_FILE}) to generation {floor}, past the "
                                "manifests moved to quarantine")

    def _choose(self, intact: List[fmt.Manifest], bar: Any) -> Tuple[Optional[fmt.Manifest], List[fmt.Manifest]]:
        """Pick the commit to keep: the newest intact manifest. When files it names are damaged, its
        rows are kept but for those of the damaged segments (recorded as holes), in a new commit."""
        if not intact:
            return None, []
        newest = intact[0]
        bad_segments, bad_states = self._bad_segments(newest, bar), self._bad_states(newest, bar)
        if bad_segments or bad_states:
            chosen = self._without_damage(newest, bad_segments, bad_states, intact)
            self._commit(chosen)
            # every manifest before the repair goes: one names a damaged file, and a diskreplay that does
            # not know holes (which refuses the new one) would open an older one as the newest commit
            for m in intact:
                self._quarantine(m.file, f"repair replaced it by generation {chosen.generation}, without "
                                         f"the damaged {', '.join(s.file for s in bad_segments + bad_states)}")
            return chosen, [chosen]
        # older manifests stay only while their files are intact (a reader may hold one), and always
        # when a kept delta applies to them (a delta's manifest is its base's plus what it adds:
        # without the base it cannot be read, whatever its base's own files are)
        kept = [newest]
        for m in intact[1:]:
            bad = [s.file for s in m.segments if check_size(self.files, s.file, s.bytes)]
            if bad and m.generation not in fmt.with_chains({k.generation: k for k in kept}):
                self._quarantine(m.file, f"it references damaged or missing {', '.join(bad)}")
            else:
                kept.append(m)
        return newest, kept

    def _without_damage(self, m: fmt.Manifest, bad_segments: List[fmt.SegmentEntry],
                        bad_states: List[fmt.StateEntry], intact: List[fmt.Manifest]) -> fmt.Manifest:
        """``m`` without its damaged files, as the next generation: each damaged segment's live rows
        become a hole (at the front: the head moves past them), and nothing names a row of a hole (a
        persisted group index covering one, exactly-once tokens of its rows); a damaged saved state
        is replaced by the newest intact one of its name an older manifest names, else dropped."""
        holes = list(m.holes)
        for s in bad_segments:
            lo = max(s.first_row, m.head)
            self.actions.append(f"dropping rows [{lo}, {s.end_row}) ({s.end_row - lo} rows) of the damaged "
                                f"{s.file}; the rows before and after it stay")
            holes.append((lo, s.end_row))
        head, holes = fmt.past_holes(m.head, merge_ranges(holes))
        gone = {s.id for s in bad_segments}
        segments = tuple(s for s in m.segments if s.id not in gone and s.end_row > head)
        if not segments:
            head, holes = m.next_row, ()
        if holes:
            self.actions.append(f"recorded the rows no segment holds any more as holes: "
                                f"{', '.join(f'[{a}, {b})' for a, b in holes)}")
        states = dict(m.states)
        for st in bad_states:
            older = [o.states[st.name] for o in intact[1:] if st.name in o.states
                     and o.states[st.name].file != st.file and self._good_state(o.states[st.name])]
            if older:
                states[st.name] = older[0]
                self.actions.append(f"replacing the damaged saved state {st.name!r} ({st.file}) by the older "
                                    f"{older[0].file}")
            else:
                del states[st.name]
                self.actions.append(f"dropping the damaged saved state {st.name!r} ({st.file})")
        lost = merge_ranges(list(holes) + [(m.head, head)])  # (rows evicted before keep their tokens)
        changes: Dict[str, Any] = {}
        if m.group_index is not None and any(a < m.group_index.end_row for a, _ in holes):
            changes["group_index"] = None  # readers build the index from the sidecars instead
        tokens = tuple(t for t in m.tokens if not any(a < t.end_row and t.first_row < b for a, b in lost))
        if len(tokens) != len(m.tokens):
            self.actions.append(f"forgetting {len(m.tokens) - len(tokens)} exactly-once token(s) of dropped rows "
                                "(a batch re-sent with one of them is appended again)")
            changes["tokens"] = tokens
        return m.evolve(generation=m.generation + 1, head=head, segments=segments, holes=tuple(holes),
                        states=states, **changes)

    def _good_state(self, st: fmt.StateEntry) -> bool:
        return check_size(self.files, st.file, st.bytes) is None and self._good(st.file, st.bytes, st.crc32c)

    def _rebuild_sidecars(self, m: fmt.Manifest, options: fmt.StoreOptions) -> fmt.Manifest:
        if options.group_key is None:
            return m
        entries, changed = [], False
        for s in m.segments:
            ok = s.group is not None or self._good(s.groups_file, s.groups_bytes, s.groups_crc32c)
            seg = None
            if ok:
                try:
                    seg = Segment(self.files.local(s.file, s.bytes), s.bytes, options.schema, s.num_rows)
                    compare = compare_sidecar if s.group is None else compare_inline_group
                    ok = compare(self.files, s, seg, options.group_key) is None
                except CorruptStoreError:
                    ok = True  # the segment itself is unreadable; nothing to rebuild from
            if ok:
                entries.append(s)
                continue
            try:
                if seg is None:
                    seg = Segment(self.files.local(s.file, s.bytes), s.bytes, options.schema, s.num_rows)
                with open(self.files.local(s.file, s.bytes), "rb") as fh:  # as a writer makes them
                    pages = PageChecksums.of(pa.py_buffer(fh.read())) if has_page_checksums(s.bytes) else None
                data = encode_ipc(group_sidecar(seg.column(options.group_key), s.first_row, pages))
            except (CorruptStoreError, KeyError) as exc:
                self.actions.append(f"cannot rebuild {s.groups_file}: {exc}")
                entries.append(s)
                continue
            if self.files.exists(s.groups_file):
                self._quarantine(s.groups_file, "it is damaged")
            self.actions.append(f"rebuilt {s.groups_file} from the group-key column of {s.file}")
            if not self.dry_run:
                self.files.write(s.groups_file, data)
            new = fmt.SegmentEntry(s.id, s.first_row, s.num_rows, s.bytes, s.crc32c, data.size, crc32c(data))
            changed |= new != s
            entries.append(new)
        if not changed:
            return m
        new_m = m.evolve(generation=m.generation + 1, segments=tuple(entries))
        self._commit(new_m)
        return new_m

    def _past_rolled_back(self, m: fmt.Manifest, intact: Sequence[fmt.Manifest],
                          damaged: Sequence[Tuple[int, str]]) -> fmt.Manifest:
        """After a roll-back, ``m``'s contents committed as a generation above every one moved to
        quarantine, with segment ids past every one they (or the segment files) used: a reader that
        held a newer generation, or cached its segments by id, must not meet those generations and
        ids again naming other rows (the next commit reused both)."""
        newest = max([g.generation for g in intact] + [g for g, _ in damaged])
        if m.generation >= newest:
            return m
        ids = [g.next_segment for g in intact]
        for rel, is_dir in self.files.entries():
            d, _, name = rel.partition("/")
            if not is_dir and d in (fmt.SEGMENT_DIR, fmt.GROUPS_DIR) and name[:12].isdigit():
                ids.append(int(name[:12]) + 1)
        new_m = m.evolve(generation=newest + 1, next_segment=max([m.next_segment] + ids))
        self._commit(new_m)
        return new_m

    def _drop_damaged_token_logs(self, m: fmt.Manifest) -> fmt.Manifest:
        """``m`` without its damaged sealed token logs, committed (a tokened ``extend`` reads them and
        raised ``CorruptStoreError`` every time): their tokens are forgotten, as old ones are."""
        bad = [t for t in m.token_logs if not self._good(t.file, t.bytes, t.crc32c)]
        if not bad:
            return m
        for t in bad:
            self.actions.append(f"dropping the damaged token log {t.file}: its {t.count} exactly-once tokens are "
                                "forgotten (a batch re-sent with one of them is appended again)")
        new_m = m.evolve(generation=m.generation + 1, token_logs=tuple(t for t in m.token_logs if t not in bad))
        self._commit(new_m)
        return new_m

    def _drop_damaged_patches(self, m: fmt.Manifest) -> fmt.Manifest:
        """``m`` without its damaged patches, committed: the rows they held values for read their
        older values again (a segment's, an older patch's); nothing else is lost."""
        return self._drop_damaged(m, "patches", lambda p: (
            f"dropping the damaged patch {p.file}: its values of {', '.join(p.columns)} for {p.num_rows} rows in "
            f"[{p.first_row}, {p.end_row})" + (f" (version {p.version!r})" if p.version else "") + " are lost, those "
            "rows read their older values; an update that wrote it is found committed by its token: send it again "
            "under a new token"))

    def _drop_damaged_media(self, m: fmt.Manifest) -> fmt.Manifest:
        """``m`` without its damaged or missing media blobs, committed: the rows naming one keep their
        other columns, and reads of their media raise an error naming the blob; a later append of the
        same content stores it again, and they read it (docs/FORMAT.md, "Media")."""
        return self._drop_damaged(m, "media", lambda e: (
            f"dropping the damaged media blob {e.file} ({e.mime}, {e.hash[:16]}...): the rows naming it (up to row "
            f"{e.last_row}) keep their other columns, and reads of its bytes raise an error until an append of the "
            "same content stores it again"))

    def _drop_damaged(self, m: fmt.Manifest, field: str, action: Callable[[Any], str]) -> fmt.Manifest:
        """``m`` without the entries of its list ``field`` whose file is damaged or missing, committed
        (``m`` itself where none is), with ``action(entry)`` said for each one dropped."""
        entries = getattr(m, field)
        bad = [e for e in entries if not self._good(e.file, e.bytes, e.crc32c)]
        if not bad:
            return m
        self.actions.extend(action(e) for e in bad)
        new_m = m.evolve(generation=m.generation + 1, **{field: tuple(e for e in entries if e not in bad)})
        self._commit(new_m)
        return new_m

    def _commit(self, m: fmt.Manifest) -> None:
        """Commit ``m``'s contents as generation ``m.generation`` through the store's one commit path."""
        self.actions.append(f"wrote manifest generation {m.generation} ({m.file})")
        if self.dry_run:
            return
        base, _ = fmt.load_newest_manifest(self.files.root)
        if base.generation > m.generation - 1:
            raise CorruptStoreError(f"{self.files.url} changed while repair ran (generation {base.generation}); "
                                    "stop every writer and repair again")
        # newer manifests went to quarantine: the commit keeps the generation numbers going up
        base = base.evolve(generation=m.generation - 1)
        Committer(self.files.storage, self.options, base).commit(Commit(ops.RollBack(m, base.generation)),
                                                                 install=lambda new: None)

    def _quarantine_unreferenced(self, kept: List[fmt.Manifest]) -> None:
        referenced = referenced_files(kept)
        young = 0
        for rel, is_dir in self.files.entries():
            if rel in self._moved or "/" not in rel and (rel in ROOT_NAMES or is_dir):
                continue
            name = os.path.basename(rel)
            if "/" not in rel and not name.startswith(TMP_PREFIX):
                continue  # stray files beside the store are the user's, not ours
            if rel in referenced:
                continue
            if self.keep_young and self.files.age(rel) < self.keep_young:
                young += 1
                continue
            why = "it is a temporary file of an interrupted write" if name.startswith(TMP_PREFIX) \
                else "no retained manifest references it"
            self._quarantine(rel, why)
        if young:
            self.actions.append(f"kept {young} unreferenced file(s) younger than {self.keep_young:.0f} s: a commit "
                                "in flight may name them (clean-up removes them once they are older and unnamed; "
                                "--force if every writer is stopped)")

    def _quarantine(self, rel: str, why: str) -> None:
        if rel in self._moved:
            return
        self._moved.add(rel)
        dest = self.files.free_name(f"{fmt.QUARANTINE_DIR}/{rel}")
        self.actions.append(f"moved {rel} to {dest} ({why})")
        if self.dry_run:
            return
        self.files.move(rel, dest)
