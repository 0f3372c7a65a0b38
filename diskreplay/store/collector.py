"""Garbage collection: what a writer deletes once no retained commit names it.

One writer (holding the store's lock) keeps its retained manifests and a
count of the files they name, so a commit drops what the manifests it
superseded stopped naming. Many writers (or a store on object storage) sweep
in turn, deciding by generation numbers down from the newest commit and by
file ages, raising the collection floor before any manifest goes. The rules
are docs/FORMAT.md's "Garbage collection", "Many writers" and "The collection
floor".
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections import Counter
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from .. import format as fmt
from .._fileio import TMP_PREFIX, boot_clock, crash_point
from ..errors import CorruptStoreError
from ..storage import Publisher

SHARED_GC_EVERY = 64  # commits of one writer between its clean-up sweeps of a multi-writer store (at least)
# ... and at least a sweep's directory entries over this many: a sweep lists every retained file, so
# spreading its cost over its writer's commits bounds what sweeping costs each commit whatever the
# store's size; a file then waits at most a few seconds of commits past retain_seconds
SWEEP_ENTRIES_PER_COMMIT = 16
SEEN_MANIFESTS = 4096  # manifests a writer keeps between its sweeps, so that a sweep need not read them again
#: files a sweep of a store without manifests could not judge yet (see Collector._pending_set_aside)
PENDING_FILE = f"{fmt.QUARANTINE_DIR}/{fmt.QUARANTINE_PENDING}"
# sidecars before segments: a segment file's existence reserves its id (and so its sidecar's
# name) against other writers, so it goes last
DATA_SWEEP_DIRS = (fmt.GROUPS_DIR, fmt.SEGMENT_DIR, fmt.STATE_DIR, fmt.TOKENS_DIR)


class Collector:
    """One writer's garbage collection (see the module docstring).

    ``known`` returns the newest manifest the writer knows (its committer's);
    ``floored``: manifests are created only if absent and a clean-up raises the
    collection floor before deleting one.
    """

    def __init__(self, storage: Publisher, options: fmt.StoreOptions, known: Callable[[], fmt.Manifest], *,
                 retain_seconds: Optional[float], floored: bool) -> None:
        self.storage = storage
        self.options = options
        self.known = known
        self.multi_writer = options.multi_writer
        self.retain_seconds = retain_seconds
        self.floored = floored
        # one writer: the manifests kept (ascending generations), how many of them name each file, and
        # those that are deltas (a store converted from many writers); see collect
        self.retained: Dict[int, fmt.Manifest] = {}
        self._refs: Counter = Counter()
        self._chained: Set[int] = set()
        self._superseded_at: Dict[int, float] = {}
        self._since_sweep = 0
        self._sweep_every = SHARED_GC_EVERY  # commits between sweeps, grown with the entries a sweep lists
        # the shared sweep: the newest generation it read (with its manifest and files), the files each
        # later-kept generation stopped naming, and each one's delta depth (see _named_by)
        self._swept: Optional[Tuple[int, fmt.Manifest, frozenset]] = None
        self._released: Dict[int, frozenset] = {}
        self._ripe: Dict[str, float] = {}  # young unnamed files: when (time.time()) each is old enough to go
        self._depth: Dict[int, int] = {}
        #: the manifests of the generations this writer made or read since its last sweep (its own
        #: commits, other writers' deltas it applied): the sweep reads only the ones it missed
        self.seen: Dict[int, fmt.Manifest] = {}

    def saw(self, m: fmt.Manifest) -> None:
        """Remember ``m`` (a commit this writer made or read) for the next shared sweep."""
        if self.multi_writer:
            self.seen[m.generation] = m
            while len(self.seen) > SEEN_MANIFESTS:
                del self.seen[next(iter(self.seen))]

    def superseded(self, generation: int) -> None:
        """``generation`` stops being the newest now (a single writer keeps it ``retain_seconds`` more)."""
        if not self.multi_writer and self.retain_seconds is not None:  # only _young asks
            self._superseded_at[generation] = time.time()


    def collect(self, full: bool = False) -> None:
        """Delete what no retained manifest names (see docs/FORMAT.md, step 7 and "Many writers")."""
        if self.multi_writer:
            self._since_sweep += 1
            if full or self._since_sweep >= self._sweep_every:
                self._since_sweep = 0
                self.sweep_shared()
            return
        if full:
            if self.storage.exclusive_lock:
                self._sweep_exclusive()
            else:
                self._sweep_without_lock()
            return
        # O(files of the manifests added and dropped) a commit, however many are retained: a store
        # retaining an hour of commits holds thousands, whose file set is not rebuilt per commit
        current = self.known().generation
        if current not in self.retained:
            self._keep(current, self.known())
        dropped = []
        last = len(self.retained) - fmt.KEEP_MANIFESTS
        for i, g in enumerate(self.retained):  # oldest first; superseded in order, so young from one on
            if i >= last or self._young(g):
                break
            dropped.append(g)
        if dropped and self._chained:
            # a store converted from many writers may hold deltas: they keep the manifests they apply to
            needed = fmt.with_chains({g: self.retained[g] for g in self._chained if g not in dropped})
            dropped = [g for g in dropped if g not in needed]
        if not dropped:
            return
        old = [self.retained.pop(g) for g in dropped]
        freed = []
        for m in old:
            self._superseded_at.pop(m.generation, None)
            self._chained.discard(m.generation)
            for f in m.files():
                self._refs[f] -= 1
                if not self._refs[f]:
                    del self._refs[f]
                    freed.append(f)
        self.delete([m.file for m in old], sorted(freed))

    def _keep(self, generation: int, manifest: fmt.Manifest) -> None:
        self.retained[generation] = manifest
        self._refs.update(manifest.files())
        if manifest.depth:
            self._chained.add(generation)

    def retain_at_open(self, retained: Mapping[int, fmt.Manifest]) -> Set[str]:
        """Take the manifests an open keeps (ascending), and return the files they name. Those kept
        for ``retain_seconds`` count as superseded now: when they were is not known here, and keeping
        them ``retain_seconds`` more is safe (the first commit used to drop them at once)."""
        now = time.time()
        self.retained, self._refs, self._chained = {}, Counter(), set()
        for g in sorted(retained):
            self._keep(g, retained[g])
        self._superseded_at = {g: self._superseded_at.get(g, now) for g in self.retained
                               if g != self.known().generation}
        return set(self._refs)

    def _young(self, generation: int) -> bool:
        """Superseded less than ``retain_seconds`` ago (a pinned snapshot may still read it)."""
        if self.retain_seconds is None:
            return False
        at = self._superseded_at.get(generation)
        return at is not None and time.time() - at < self.retain_seconds

    def _sweep_exclusive(self) -> None:
        """The single writer's open: everything no retained manifest names is garbage (it holds the lock)."""
        current = self.known().generation
        docs, unreadable = fmt.manifest_docs(self.storage)
        referenced = self.retain_at_open(self._kept_with_chains(docs, current))
        if unreadable:
            warnings.warn(f"{self.storage.url}: cannot read manifest(s) {'; '.join(unreadable.values())}; "
                          "they and every data file are kept (run `diskreplay verify`)", RuntimeWarning, stacklevel=5)
        generations = fmt.list_generations(self.storage)
        manifests = [fmt.manifest_file(g) for g in generations if g not in self.retained and g not in unreadable]
        files = []
        for d in DATA_SWEEP_DIRS + (fmt.MANIFEST_DIR, ""):
            for name in self.storage.list(d):
                rel = f"{d}/{name}" if d else name
                # we hold the writer lock: a temp file or an unreferenced data file is garbage
                if name.startswith(TMP_PREFIX) or (
                        not unreadable and d not in ("", fmt.MANIFEST_DIR) and rel not in referenced):
                    files.append(rel)
        if not generations and not current:
            files = self._set_aside_unnamed(files)
        self.delete(manifests, files)

    def _sweep_without_lock(self) -> None:
        """The open of a single writer that holds no lock (object storage): never a manifest newer than
        the one it holds (another writer's: this one's next commit then fails), and no file younger
        than the grace period (it may be that writer's commit in flight)."""
        current = self.known().generation
        docs, unreadable = fmt.manifest_docs(self.storage)
        referenced = self.retain_at_open(self._kept_with_chains(docs, current))
        manifests = [fmt.manifest_file(g) for g in fmt.list_generations(self.storage)
                     if g < current and g not in self.retained and g not in unreadable]
        grace = self.options.retain_seconds or fmt.DEFAULT_RETAIN_SECONDS
        files, young = [], []
        for d in DATA_SWEEP_DIRS:
            for name in self.storage.list(d):
                rel = f"{d}/{name}"
                garbage = name.startswith(TMP_PREFIX) or (not unreadable and rel not in referenced)
                if not garbage:
                    continue
                if self._age(rel) >= grace:
                    files.append(rel)
                else:
                    young.append(rel)
        self._collect_unnamed(manifests, files, young, grace, not docs and not unreadable and not current,
                              referenced, bool(unreadable))

    def _kept_with_chains(self, docs: Mapping[int, fmt.Manifest], current: int) -> Dict[int, fmt.Manifest]:
        kept = {g: docs[g] for g in self.kept_at_open(docs, current)}
        kept[current] = self.known()
        kept.update((g, docs[g]) for g in fmt.with_chains(kept) if g in docs)
        return kept

    def kept_at_open(self, docs: Mapping[int, fmt.Manifest], current: int) -> List[int]:
        """The generations up to ``current`` that a single writer's open keeps: the newest
        ``KEEP_MANIFESTS``, and with ``retain_seconds`` every one superseded less than that ago (its
        successor has existed for less: a pinned snapshot may read it). Generations are created in
        order, so the newer of two has existed for less time: those are a run of the newest, found
        by bisection (``stat``s, or HEAD requests, of O(log n) manifests, not of every one)."""
        gens = sorted(g for g in docs if g <= current)
        keep = gens[-fmt.KEEP_MANIFESTS:]
        if self.retain_seconds is None or not gens:
            return keep
        later = sorted(docs)  # a generation's successor may be above ``current`` (another writer's)
        succ = {g: later[i + 1] for i, g in enumerate(later[:-1])}
        lo, hi = 0, len(gens)  # gens[i:] were superseded lately (or never) iff gens[i]'s successor is young
        while lo < hi:
            mid = (lo + hi) // 2
            nxt = succ.get(gens[mid])
            if nxt is None or self._age(fmt.manifest_file(nxt)) < self.retain_seconds:
                hi = mid
            else:
                lo = mid + 1
        return sorted(set(keep) | set(gens[lo:]))

    def _age(self, rel: str) -> float:
        try:
            return self.storage.age(rel)
        except FileNotFoundError:
            return float("inf")

    def sweep_shared(self) -> None:
        """Clean-up of a multi-writer store, safe while other writers commit and readers read.

        A manifest goes once a newer one has existed for ``retain_seconds`` (and
        never one of the newest ``KEEP_MANIFESTS``); a data or temporary file
        goes once no remaining manifest names it and it is older than
        ``retain_seconds`` (younger unnamed files may be another writer's commit
        in flight). Manifests that cannot be read stop the data sweep.

        Two rules keep a sweep's decisions from going stale: a file's age is
        checked again right before it is removed (another writer's sweep may
        have removed it meanwhile, and a commit reserved its id again: that
        file is young), and a sweep that took more than ``retain_seconds / 2``
        removes no data file (a generation committed after its listing may
        name one; commits have the same bound, see :meth:`_check_age`).
        """
        started = boot_clock()
        retain = self.retain_seconds
        # what is kept is decided by generation numbers from the newest commit down, never by a listing
        # (an object store's may lag, or be empty): generations at or above the floor are all present
        hi = fmt.load_newest_manifest(self.storage, known=self.known(), options=self.options,
                                      seen=self.seen)[0].generation
        floor = fmt.read_floor(self.storage) or 0
        # a manifest goes once its successor has existed for ``retain`` (never one of the newest
        # KEEP_MANIFESTS); successors are created in order, so those that go are a run of the oldest,
        # found by bisection (stats of O(log n) manifests: a store may retain 10^5 generations)
        lo, cut = max(floor, 1), max(floor, 1, hi - fmt.KEEP_MANIFESTS + 1)
        while lo < cut:
            mid = (lo + cut) // 2
            if self._age(fmt.manifest_file(mid + 1)) >= retain:
                lo = mid + 1
            else:
                cut = mid
        keep = set(range(cut, hi + 1))
        referenced, unreadable = self._named_by(keep)  # keep grows by the chain its oldest delta needs
        gens = fmt.list_generations(self.storage)
        # below the floor (raised first, by delete): collected generations, and manifests stale writers
        # linked into collected slots (whatever their age)
        below = min(keep) if keep else floor
        drop = [] if unreadable else sorted(g for g in gens if g < max(below, floor))
        files = []
        entries = len(gens)
        # unnamed files too young to go, and when they will be old enough: each sweep would stat them
        # all again (a merge leaves its inputs unnamed; retain_seconds of merges are thousands of files)
        now, young, ripe = time.time(), {}, self._ripe
        for d in DATA_SWEEP_DIRS + (fmt.MANIFEST_DIR, ""):
            names = self.storage.list(d)
            entries += len(names)
            for name in names:
                rel = f"{d}/{name}" if d else name
                garbage = name.startswith(TMP_PREFIX) or (
                    not unreadable and d not in ("", fmt.MANIFEST_DIR) and rel not in referenced)
                if not garbage:
                    continue
                at = ripe.get(rel)
                if at is not None and now < at:
                    young[rel] = at
                    continue
                age = self._age(rel)
                if age >= retain:
                    files.append(rel)
                else:
                    young[rel] = now + retain - age
        self._ripe = young
        if boot_clock() - started > retain / 2:
            files = []  # stale: the next sweep decides again
        def named_now() -> Tuple[set, bool]:
            newest = fmt.load_newest_manifest(self.storage, known=self.known(), options=self.options,
                                              seen=self.seen)[0].generation
            return self._named_by(set(range(cut, max(newest, cut) + 1)))

        self._collect_unnamed([fmt.manifest_file(g) for g in drop], files, young, retain,
                              not hi and not floor and not self.known().generation, referenced, unreadable,
                              named_now if hi else None)
        self._sweep_every = max(SHARED_GC_EVERY, entries // SWEEP_ENTRIES_PER_COMMIT)

    def _named_by(self, keep: set) -> Tuple[set, bool]:
        """Every file some generation in ``keep`` names, and whether a manifest could not be read;
        ``keep`` (the newest generations, contiguous) grows by the chain its oldest delta needs.

        A long-lived multi-writer store retains ``retain_seconds`` of commits (thousands), so their
        manifests are not held: a file, once a commit stops naming it, is never named again (ids
        only grow), so the files of generations ``lo..hi`` are those of ``hi`` plus those each
        later generation released (named by the one before it, not by it). Only those differences
        are kept between sweeps, each generation read once (a delta from the one before it).
        """
        if not keep:
            return set(), False
        lo, hi = min(keep), max(keep)
        held = self._swept  # (generation, its manifest, its files) the differences are known up to
        depth = self._depth.get(lo)
        if depth is None:
            try:
                depth = fmt.read_manifest(self.storage, lo, options=self.options).depth
            except (OSError, fmt.FormatError, fmt.CorruptStoreError):
                depth = 0  # met again below
        lo -= depth
        keep |= set(range(lo, hi + 1))
        if held is None or held[0] < lo:  # start afresh at lo: nothing before it matters
            held, self._released, self._depth = None, {}, {}
        unreadable = False
        for g in range(lo if held is None else held[0] + 1, hi + 1):
            try:
                m = self.seen.get(g) or fmt.read_manifest(
                    self.storage, g, options=self.options, known=held[1] if held is not None and held[0] == g - 1
                    else None)
            except FileNotFoundError:
                continue  # another writer's sweep took it: it was past retention
            except (fmt.FormatError, fmt.CorruptStoreError):
                continue  # names nothing trustworthy
            except OSError:
                unreadable = True
                continue
            files = _file_keys(m, held)
            if held is not None:
                self._released[g] = held[2] - files
            self._depth[g] = m.depth
            held = (g, m, files)
        self._swept = held
        self.seen = {g: m for g, m in self.seen.items() if g > hi}
        for table in (self._released, self._depth):
            for g in [g for g in table if g < lo]:
                del table[g]
        keys = set(held[2]) if held is not None else set()
        for g, released in self._released.items():
            if g > lo:  # named by g - 1, which is kept
                keys |= released
        return _file_names(keys), unreadable

    def _collect_unnamed(self, manifests: List[str], files: List[str], young: Iterable[str], retain: float,
                         no_manifest: bool, referenced: set, unreadable: bool,
                         named_now: Optional[Callable[[], Tuple[set, bool]]] = None) -> None:
        """Remove the sweep's ``manifests`` and unnamed ``files`` (each old for ``retain`` seconds, checked
        again right before its removal), except that a store without any manifest, and the files its
        sweeps could not judge then (``young``, see :meth:`_pending_set_aside`), move theirs to
        ``quarantine/``."""
        still_old = lambda rel: self._age(rel) >= retain  # noqa: E731 - checked right before each removal
        pending = self._pending_set_aside(no_manifest, young, referenced, unreadable)
        if no_manifest:
            files = self._set_aside_unnamed(files, still_old)
        elif pending:
            kept = [rel for rel in files if rel in pending]
            if kept:
                files = [rel for rel in files if rel not in pending] + self._set_aside_unnamed(kept, still_old, True)
                self._write_pending({rel for rel in pending if self._age(rel) != float("inf")}, pending)
        self.delete(manifests, files, still_old, named_now)

    def _pending_set_aside(self, no_manifest: bool, young: Iterable[str], referenced: set,
                           unreadable: bool) -> set:
        """The files a sweep of a store without any manifest found too young to judge (they may be
        a first commit in flight, or the rows of a store whose manifests were lost), kept in
        ``quarantine/pending.json`` so that whichever writer's sweep finds them old and still unnamed
        moves them to ``quarantine/`` instead of deleting them (by then the store has manifests, and
        they would look like any orphan). Returns that set; entries named or gone since are dropped."""
        try:
            doc = json.loads(self.storage.read_bytes(PENDING_FILE))
            pending = set(doc.get("files", [])) if isinstance(doc, dict) else set()
        except FileNotFoundError:
            pending = set()
        except (OSError, ValueError):
            return set()  # unreadable: nothing is set aside by it (nor deleted from it) this time
        before = set(pending)
        if no_manifest:
            pending |= {rel for rel in young if fmt.is_data_file(rel)}
        elif not unreadable:
            pending = {rel for rel in pending if rel not in referenced and self._age(rel) != float("inf")}
        self._write_pending(pending, before)
        return pending

    def _write_pending(self, pending: set, before: set) -> None:
        if pending == before:
            return
        if pending:
            self.storage.ensure_dir(fmt.QUARANTINE_DIR)
            self.storage.replace(PENDING_FILE, json.dumps({"files": sorted(pending)}).encode())
        else:
            self.storage.delete(PENDING_FILE)

    def _set_aside_unnamed(self, files: List[str], still: Callable[[str], bool] = lambda rel: True,
                           pending: bool = False) -> List[str]:
        """A store without any manifest: move its unnamed data files to ``quarantine/``, and return
        the rest of ``files`` (temporary files, empty reserved names) to delete.

        No manifest names them, yet without a manifest nothing tells a first commit that crashed
        from a store whose manifests were deleted or lost (its rows are in these files): they are
        kept for a person to look at, never deleted, and the next commit cannot overwrite them.
        """
        rest, moved = [], []
        for rel in files:
            if not fmt.is_data_file(rel):
                rest.append(rel)
                continue
            try:
                if not self.storage.size(rel):
                    rest.append(rel)  # a name reserved ahead and never written: no data
                    continue
                if still(rel):
                    moved.append(self._set_aside(rel))
            except FileNotFoundError:
                continue
        if moved:
            moved.sort(key=lambda rel: (not rel.startswith(f"{fmt.QUARANTINE_DIR}/{fmt.SEGMENT_DIR}/"), rel))
            found = ("held data files no manifest ever named while it had none" if pending else
                     "has no manifest, yet held")
            warnings.warn(f"{self.storage.url} {found}: {len(moved)} file(s); its manifests "
                          "were deleted or lost, or its first commit crashed; they were moved to "
                          f"{fmt.QUARANTINE_DIR}/ (e.g. {moved[0]}), not deleted (restore the manifests from a "
                          "backup to get their rows back)", RuntimeWarning, stacklevel=6)
        return rest

    def _set_aside(self, rel: str) -> str:
        """Move ``rel`` to a free name under ``quarantine/`` (a rename where the storage has one)."""
        for n in range(1 << 16):
            dest = f"{fmt.QUARANTINE_DIR}/{rel}" + (f".{n}" if n else "")
            if self.storage.move(rel, dest, if_absent=True):
                self.storage.sync_dir(os.path.dirname(dest))
                self.storage.sync_dir(os.path.dirname(rel))
                return dest
        raise CorruptStoreError(f"{self.storage.url}/{fmt.QUARANTINE_DIR}/ has no free name left for {rel}; "
                                "look at what it holds and empty it")

    def delete(self, manifests: Sequence[str], files: Sequence[str],
               still: Callable[[str], bool] = lambda rel: True,
               named_now: Optional[Callable[[], Tuple[set, bool]]] = None) -> None:
        """Unlink ``manifests``, make that durable, then unlink ``files`` and make that durable.

        The order is what keeps a power cut safe: an unlink becomes durable at
        its directory's next fsync (or earlier, at the filesystem's whim), so
        the manifests' removal must be durable before the first data file they
        name is unlinked; otherwise a power cut could bring back a manifest
        naming files that are gone.
        """
        held_manifests: Mapping[str, object] = {}
        if self.floored and manifests:
            manifests = sorted(manifests, key=_generation_of)
            # a generation at or above the floor whose writer has not read the floor after its link (it
            # leases its manifest until then) stops the run: raised past it, the floor would make a
            # real commit look like a link into a collected slot to its own writer, whatever the clocks
            floor = fmt.read_floor(self.storage) or 0
            below = [rel for rel in manifests if _generation_of(rel) < floor]
            held_manifests, whole = self.storage.hold_run([rel for rel in manifests if _generation_of(rel) >= floor])
            manifests = below + list(held_manifests)
            if not whole:
                # none of the run goes (the leased one may be a delta applying to the ones before it), nor
                # any file only they name: the next sweep decides again
                self.storage.unhold(held_manifests)
                held_manifests, manifests, files = {}, below, []
        try:
            if self.floored and manifests:
                # the floor first: a writer whose link fills a collected slot must find it above that slot
                floor = fmt.raise_floor(self.storage, max(map(_generation_of, manifests)) + 1)
                if any(_generation_of(rel) >= floor for rel in manifests):
                    # not raised this time (another clean-up holds the floor's lock, stopped perhaps): the
                    # manifests left may name any of the files
                    manifests, files = [rel for rel in manifests if _generation_of(rel) < floor], []
            for rel in manifests:  # (oldest first)
                crash_point("gc.manifest")
                self.storage.delete(rel)
            if manifests:
                self.storage.sync_dir(fmt.MANIFEST_DIR)
        finally:
            self.storage.unhold(held_manifests)
        dirs = set()
        # each file held while it is removed (no live writer leases it, and the name keeps leading to
        # it), then checked again: a commit published since the sweep listed it may name it now
        held = (self.storage.hold(files) if self.multi_writer else dict.fromkeys(files)) if files else {}
        try:
            named: set = set()
            if held and named_now is not None:
                named, unreadable = named_now()
                if unreadable:
                    return
            for rel, handle in held.items():
                crash_point("gc.file")
                if rel not in named and still(rel) and self.storage.remove_held(rel, handle):
                    dirs.add(os.path.dirname(rel))
        finally:
            self.storage.unhold(held)
        for d in sorted(dirs):
            self.storage.sync_dir(d)


def _generation_of(rel: str) -> int:
    """The generation of a manifest's file name (``manifests/000000000007.json``)."""
    return int(rel.rsplit("/", 1)[-1].split(".", 1)[0])


#: the manifest's fields naming files besides its segments (``Manifest.files_besides_segments``)
_FILE_LISTS = ("states", "token_logs", "patches", "media", "group_index", "segment_table")


def _file_keys(m: fmt.Manifest, before: Optional[Tuple[int, fmt.Manifest, frozenset]] = None) -> frozenset:
    """The files ``m`` names, a segment (and its sidecar) by its id: a sweep compares the files of
    thousands of generations, and two names per segment cost 10x the ids (:func:`_file_names`).
    ``before``: the generation before, its manifest and its keys; what ``m`` holds as the same
    objects (a delta's manifest keeps its base's states, token logs and index) is not named again."""
    prev = before[1] if before is not None else None
    # (an append delta may name blobs: any file list a delta changes is read whole)
    if prev is not None and all(getattr(m, f) is getattr(prev, f) for f in _FILE_LISTS):
        if m.segments is prev.segments:
            return before[2]
        # only segments changed (an append, a merge): the other keys are the strings of the keys before
        keys = {k for k in before[2] if type(k) is not int}
    else:
        keys = set(m.files_besides_segments())
    keys.update([s.id for s in m.segments])
    return frozenset(keys)


def _file_names(keys: set) -> set:
    out = set()
    for k in keys:
        if type(k) is int:
            out.add(fmt.segment_file(k))
            out.add(fmt.groups_file(k))
        else:
            out.add(k)
    return out
