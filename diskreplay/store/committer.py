"""The one commit path: operations applied to a base manifest, published, and cleaned up after.

Single-writer stores (the default) publish a manifest with a rename under the
writer's exclusive lock. Multi-writer stores publish with an atomic
create-if-absent (``Publisher.put_if_absent``: ``link()`` on POSIX): a writer
that loses the race re-reads the newest manifest, applies its operation to it
again (:func:`ops.apply`: appends commute, a rewrite of segments another commit
changed is a conflict) and retries after a bounded exponential backoff with
jitter. docs/FORMAT.md ("Commit protocol", "Many writers") is the
specification; this module is its executable form.
"""

from __future__ import annotations

import errno
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .. import format as fmt
from .._fileio import boot_clock, crash_point, crc32c
from ..errors import (CommitConflictError, CommitNotDurableError, CommitTimeoutError, CorruptStoreError,
                      StoreIOError)
from . import ops
from ..storage import Publisher
from .collector import Collector
from .commits import Commit, CommitResult, reserved_twice
from .tokens import TokenIndex, compact_tokens

MAX_ATTEMPTS = 10_000  # commits a writer retries after losing the race, before giving up
BACKOFF_FIRST = 0.0005  # seconds; doubled per lost race, capped, with full jitter
BACKOFF_CAP = 0.05
QUIET_COMMITS = 8  # commits without a lost race after which a writer folds its data into the manifest's wait
# the deepest base an append delta may follow: a lost race does not turn an append into a full manifest
# written again and again (the slower commit, it loses to deltas), while checkpoints still come within
# 2 * CHECKPOINT_EVERY (a reader applies at most this many deltas)
MAX_DELTA_DEPTH = 2 * fmt.CHECKPOINT_EVERY - 1
UNREADABLE_RETRIES = 3  # lost races to a manifest that does not read before the commit gives up


@dataclass
class CommitStats:
    """Counters of one writer's commits (``ReplayStore.stats()``)."""

    commits: int = 0
    conflicts: int = 0  # lost races for a generation (each one is a retry)
    rebases: int = 0  # commits that had to be re-planned on a newer base after losing a race
    dropped_rewrites: int = 0  # merges given up because another commit changed their segments
    collected_slots: int = 0  # links of a stale writer into a collected generation (retried as lost races)
    commit_seconds: float = 0.0  # from a commit's first data write to its manifest's publishing
    manifest_seconds: float = 0.0  # of commit_seconds: the manifest step (re-planned after a lost race)
    retry_seconds: float = 0.0  # of both: lost publishes, back-off, re-reading and re-planning
    not_durable: int = 0

    def as_dict(self) -> Dict[str, float]:
        return dict(self.__dict__)


@dataclass
class _Race:
    """One commit's attempts: when its manifest step began (``t0``, ``perf_counter``), the data
    writes before it (``before`` seconds), its lost races and back-off."""

    t0: float
    before: float
    attempt: int = 0
    lost_at: Optional[float] = None  # when the first attempt's link failed, once one lost
    publish_t: float = 0.0  # when the last attempt's manifest was ready to publish
    delay: float = BACKOFF_FIRST
    unreadable: int = 0

    def stats(self) -> Dict[str, int]:
        """This commit's contribution to a store's ``commit_stats``."""
        start = self.t0 - self.before
        return {"commits": 1, "conflicts": self.attempt, "commit_ms": int(round((self.publish_t - start) * 1e3)),
                "retry_ms": 0 if self.lost_at is None else int(round((self.publish_t - self.lost_at) * 1e3))}


class Committer:
    """Publishes operations on a store's manifests; holds the newest manifest this writer knows."""

    def __init__(self, storage: Publisher, options: fmt.StoreOptions, manifest: fmt.Manifest) -> None:
        self.storage = storage
        self.options = options
        self.manifest = manifest
        self.multi_writer = options.multi_writer
        self.retain_seconds = options.retain_seconds if options.retain_seconds is not None else (
            fmt.DEFAULT_RETAIN_SECONDS if options.multi_writer else None)
        self.tokens = TokenIndex(storage)
        self.stats = CommitStats()
        #: manifests are created only if absent (many writers; any store on object storage, which has
        #: no lock): a clean-up raises the collection floor before it deletes one, and a commit counts
        #: only if the floor, read after its link, is not above it (docs/FORMAT.md, "The collection floor")
        self.floored = options.multi_writer or not storage.exclusive_lock
        #: what this writer deletes once no retained commit names it
        self.gc = Collector(storage, options, lambda: self.manifest, retain_seconds=self.retain_seconds,
                            floored=self.floored)
        self._unsynced = False  # the newest commit is visible but manifests/ was not fsynced (see sync)
        self._validated_at = 0.0  # boot_clock() when the base was last found to be the newest commit
        self._linked_t = 0.0  # when the newest publish attempt's link (or rename) returned
        #: counters of this writer's commits published as deltas, not yet in the store's commit_stats
        #: (a delta's file is fixed before its race, so it carries the ones of the commits before it)
        self._unreported: Dict[str, int] = {}
        # each writer writes a full manifest at its own depth in [CHECKPOINT_EVERY, 2 CHECKPOINT_EVERY):
        # at one depth for all, every writer would race to write the same checkpoint and all but one
        # would lose a full manifest's work
        self._checkpoint_at = fmt.CHECKPOINT_EVERY + random.randrange(fmt.CHECKPOINT_EVERY)
        # after its checkpoint lost a race at depth ``_lost_checkpoint_at``, not before this depth
        self._checkpoint_deferred, self._lost_checkpoint_at = 0, -1
        self._in_doubt: Optional[str] = None  # a commit whose outcome is not known (see _publish)
        #: one writer's publish in doubt: (its manifest, bytes, install), settled again before its next commit
        self._doubt: Optional[Tuple[fmt.Manifest, bytes, Callable[[fmt.Manifest], None]]] = None
        self._since_conflict = QUIET_COMMITS  # this writer's commits since its last lost race
        #: (generation, boot_clock()) at which that generation was the newest (no later one existed)
        self._newest_at: Tuple[int, float] = (0, 0.0)

    # ------------------------------------------------------------------ reading the base

    def newest(self) -> fmt.Manifest:
        """The newest commit on storage (never older than the one held)."""
        # probes up from the one held; nothing newer: the one held (a generation is created once)
        seen = self.gc.seen if self.multi_writer else None
        t = boot_clock()
        m, _ = fmt.load_newest_manifest(self.storage, known=self.manifest, options=self.options, seen=seen,
                                        known_is_newest=self._held_is_newest())
        if m.generation > self.manifest.generation:
            self.manifest = m
            self.gc.saw(m)
        self._newest_at = (self.manifest.generation, t)
        self._validated_at = t
        return self.manifest

    def _held_is_newest(self) -> bool:
        """The manifest held, or one older, was the newest less than ``retain_seconds / 2`` ago:
        nothing newer than it can have been collected since (see ``fmt.read_forward``)."""
        gen, at = self._newest_at
        return (self.multi_writer and self.manifest.generation >= gen > 0
                and boot_clock() - at < self.retain_seconds / 2)

    def ensure_floor(self) -> None:
        """A writer's open of a store held to a collection floor: create it where there is none yet
        (a new store: 0; one an older diskreplay wrote, or a store converted to many writers: the
        lowest generation of the run that ends at the newest, which is true of any store), or
        raise it to that where it is lower (a store converted from many writers and back)."""
        if self.floored:
            fmt.raise_floor(self.storage, fmt.lowest_present(self.storage, self.manifest.generation))

    def uncontended(self) -> bool:
        """No lost race in this writer's last ``QUIET_COMMITS`` commits: its next append may make its
        data durable in the same wait as its manifest's file (one wait less). Under contention the
        data goes first, so that the race window is the manifest step alone."""
        return self._since_conflict >= QUIET_COMMITS

    def find_token(self, token: str) -> Optional[fmt.TokenRecord]:
        return self.tokens.find(self.manifest, token)

    # ------------------------------------------------------------------ committing

    def commit(self, commit: Commit, install: Callable[[fmt.Manifest], None]) -> CommitResult:
        """Publish ``commit`` on the newest manifest, rebased on it (:meth:`Commit.on`) as often as
        another writer commits first; returns the new manifest and the commit as published.

        ``commit.files`` are removed when it does not happen. ``install`` makes the new manifest
        the caller's state; it is called as soon as the commit is visible, even if making it
        durable then fails (:class:`CommitNotDurableError`, whose ``rows`` are
        ``commit.rows(new)``): a writer must never reuse a visible commit's generation, ids or rows.
        """
        self.require_known_state()
        self._in_doubt = None  # many writers: the base read below finds that commit if it landed
        # set once an attempt's link landed and was not proved to fill a collected slot: its files may
        # be named by a real commit (collected since, its later generations inheriting them), so this
        # commit never removes them; if they are in fact unnamed, clean-up collects them as orphans
        self._maybe_named = False
        token, started = commit.token, commit.started
        # the commit began when its first data file was written (``started``), if it wrote any
        race = _Race(time.perf_counter(), max(0.0, boot_clock() - started) if started is not None else 0.0)
        delta: Optional[Tuple[fmt.Delta, bytes]] = None  # made once: a lost race links the same file again
        base = self.manifest
        try:
            if self.multi_writer and self.options.append_deltas:
                commit, delta = self._stage_delta(commit)
            # many writers: plan on the newest commit now, after the data (and an append's delta) is
            # written and durable, so that the race window is the manifest step alone (a delta's: a link)
            base = self.newest() if self.multi_writer else self.manifest
            if self._unsynced:  # an earlier commit is visible but its durability is still owed
                self.storage.sync_dir(fmt.MANIFEST_DIR)
                self._unsynced = False
            for race.attempt in range(MAX_ATTEMPTS):
                if token is not None:
                    dup = self.tokens.find(base, token)
                    if dup is not None:
                        if not self._maybe_named:
                            self.remove_files(commit.removable(self.manifest))
                        self.manifest = base
                        return CommitResult(base, duplicate=dup)
                self._check_age(started)
                commit = self._on(commit, base)
                new, data, commit, logs, checkpoint = self._next_manifest(base, commit, delta, race)
                published, commit = commit, commit.published()  # written, whatever the outcome
                if self._publish(new, data, published, install, token is not None):
                    self._won(new, checkpoint, race)
                    break
                base = self._lost(base, new, checkpoint, logs, race)
                commit = commit.without(logs)
            else:
                raise ops.Conflict(f"gave up committing to {self.storage.url} after {MAX_ATTEMPTS} "
                                   "lost races")
        except CommitNotDurableError:
            self.stats.not_durable += 1
            raise
        except BaseException:
            if self.manifest.generation == base.generation and self._in_doubt is None and not self._maybe_named:
                self.remove_files(commit.removable(self.manifest))  # not committed: its files are garbage
            raise
        finally:
            self.storage.discard_staged()
            self.storage.release_leases()  # published, or removed (or in doubt: then clean-up decides)
            self._count_time(race)
        self.stats.commits += 1
        self.stats.rebases += race.attempt > 0
        self._since_conflict = 0 if race.attempt else self._since_conflict + 1
        return CommitResult(new, commit)

    def _on(self, commit: Commit, base: fmt.Manifest) -> Commit:
        """``commit`` rebased on ``base``, refused where ``base`` names one of its segment ids already
        (their files are kept: :meth:`Commit.removable`)."""
        taken = commit.taken(base)
        if taken:
            raise reserved_twice(self.storage.url, taken[0])
        return commit.on(base)

    def _next_manifest(self, base: fmt.Manifest, commit: Commit, delta: Optional[Tuple[fmt.Delta, bytes]],
                       race: "_Race") -> Tuple[fmt.Manifest, bytes, Commit, List[str], bool]:
        """The manifest this attempt publishes on ``base``: ``(manifest, its bytes, the commit with the
        files this attempt adds, the token logs (and segment table) it wrote before the publish,
        whether it is a checkpoint made instead of the staged delta)``.

        A full manifest (a checkpoint) once the base is this writer's depth past one; after a lost
        race, the delta made before it as long as the chain stays short enough (the checkpoint is
        left to the next commit: a full manifest's longer race window would lose again)."""
        if 0 <= base.depth < self._lost_checkpoint_at:  # another writer's checkpoint landed
            self._checkpoint_deferred, self._lost_checkpoint_at = 0, -1
        if delta is not None and (base.depth < max(self._checkpoint_at, self._checkpoint_deferred)
                                  or (race.attempt and base.depth < MAX_DELTA_DEPTH)):
            # (a rewrite delta raises ops.Conflict once the base no longer holds its segments)
            race.publish_t = time.perf_counter()
            return delta[0].apply(base, self.options), delta[1], commit, [], False
        new = ops.apply(base, commit.op, self.options).evolve(depth=0)
        new, logs = compact_tokens(new, self.tokens, self._write_token_log)
        commit = commit.adding(logs)
        race.publish_t = time.perf_counter()
        if self.multi_writer:
            new = self._count(base, new, race)
        if len(new.segments) >= fmt.SEGMENT_TABLE_MIN:
            try:
                new, table, with_manifest = self._with_segment_table(new)
            except BaseException:
                if not self._maybe_named:
                    self.remove_files(logs)  # not committed (the loop removes the commit's other files)
                raise
            commit = commit.adding([table.file], *with_manifest)
            logs = logs + [table.file]  # (a lost race removes it with the token logs)
        return new, new.file_bytes(), commit, logs, delta is not None

    def _with_segment_table(self, new: fmt.Manifest) -> Tuple[fmt.Manifest, fmt.SegmentTableEntry,
                                                                Tuple[Tuple[Any, ...], Tuple[str, ...]]]:
        """``new`` naming a segment table of its segments (docs/FORMAT.md, "Segment tables"), the
        table's entry, and ``(writes, dirs)`` the publish makes durable with the manifest: the
        table one writer writes there; many writers (and object storage) write it before, under
        the first free id from its generation on, created only if absent (never another writer's
        table)."""
        table = fmt.SegmentTable.of(new.segments)
        data = fmt.table_bytes(table)
        if self.multi_writer or not self.storage.exclusive_lock:
            self.storage.ensure_dir(fmt.GROUPS_DIR)
            table_id, _ = self.storage.link_candidates(fmt.segment_table_file, data, new.generation)
            self.storage.sync_dir(fmt.GROUPS_DIR)
            with_manifest: Tuple[Tuple[Any, ...], Tuple[str, ...]] = ((), ())
        else:  # one writer, one commit per generation: a fresh name, written and made durable with the manifest
            table_id = new.generation
            with_manifest = (((fmt.segment_table_file(table_id), data, "groups"),), (fmt.GROUPS_DIR,))
        entry = fmt.SegmentTableEntry(table_id, len(data), crc32c(data), len(table))
        return new.evolve(segments=table, segment_table=entry), entry, with_manifest

    def _won(self, new: fmt.Manifest, checkpoint: bool, race: "_Race") -> None:
        """After a publish: a delta's own counters ride in this writer's next commit."""
        if new.depth:
            own = race.stats()
            own.pop("commits")  # counted in the delta
            self._unreported = {k: v for k, v in own.items() if v}
        else:
            self._unreported = {}
        if checkpoint:
            self._checkpoint_deferred, self._lost_checkpoint_at = 0, -1

    def _lost(self, base: fmt.Manifest, new: fmt.Manifest, checkpoint: bool, logs: List[str],
              race: "_Race") -> fmt.Manifest:
        """Another writer took ``new``'s generation: drop what this attempt wrote, back off, and
        return the newest manifest to rebase on. The data files are written and durable already;
        only the manifest step (and, for an append, its sidecars' row ids) is redone."""
        if checkpoint:
            # a full manifest's write and fsync come after the base is read: a window in which the
            # others' deltas (a link each) win. Trying again at the next commit, and the one after,
            # would lose again as all the writers past their depth do: wait a few deltas deeper,
            # so that one of them (or this one, at most MAX_DELTA_DEPTH) writes it
            self._lost_checkpoint_at = base.depth
            self._checkpoint_deferred = min(MAX_DELTA_DEPTH, base.depth + 1
                                            + random.randrange(fmt.CHECKPOINT_EVERY // 2))
        if race.lost_at is None:
            race.lost_at = self._linked_t
        self.stats.conflicts += 1
        for rel in logs:
            self.storage.delete(rel)
        if race.attempt:  # the first retry goes at once: the winner's manifest is there to read
            time.sleep(random.uniform(0, race.delay))
            race.delay = min(race.delay * 2, BACKOFF_CAP)
        newest = self.newest()
        if newest.generation < new.generation:
            # the generation we lost exists but does not read as a manifest: no commit can
            # ever follow it (a transient read error gets a few more tries)
            race.unreadable += 1
            if race.unreadable >= UNREADABLE_RETRIES:
                raise CorruptStoreError(
                    f"{self.storage.url}/{new.file} exists but cannot be read as a manifest, so no "
                    f"commit can follow generation {newest.generation}; run `diskreplay verify "
                    f"{self.storage.url}` and `diskreplay repair` (nothing of this commit is visible)")
        return newest

    def _count_time(self, race: "_Race") -> None:
        """What the commit took; of it, the lost races: from the first failed link to the last link
        (the back-off, re-reading the newest commit, re-planning on it, rewriting the sidecars and
        manifest)."""
        if race.lost_at is not None:
            self.stats.retry_seconds += self._linked_t - race.lost_at
        spent = time.perf_counter() - race.t0
        self.stats.manifest_seconds += spent
        self.stats.commit_seconds += spent + race.before

    def _stage_delta(self, commit: Commit) -> Tuple[Commit, Optional[Tuple[fmt.Delta, bytes]]]:
        """An append's (or, format v5, a rewrite's) delta, written and made durable with its data
        before the race (it does not depend on the base): ``(the commit, its writes written, (delta,
        its bytes))``, or no delta for another operation. It is published as it is unless the base
        turns out ``_checkpoint_at`` deltas deep (then the commit writes a full manifest)."""
        commit = self._on(commit, self.manifest)
        op = commit.op
        # (a merge as a full manifest raced with a longer write and lost to the small commits around
        # it: 1.6 lost races per merge with 4 writers; its delta races for a link)
        if not (isinstance(op, ops.Append) and op.relocatable
                or isinstance(op, ops.Rewrite) and self.options.inline_groups and not op.folded):
            return commit, None
        d = op.delta({"commits": 1, **self._unreported})
        data = fmt.signed_bytes(d.body())
        staged, commit = commit, commit.published()
        self.storage.stage(fmt.MANIFEST_DIR, data, staged.writes, staged.dirs, step="manifest")
        return commit, (d, data)

    def _count(self, base: fmt.Manifest, new: fmt.Manifest, race: "_Race") -> fmt.Manifest:
        """``new`` with this commit (and this writer's earlier deltas' owed counters) added to the store's
        ``commit_stats`` (summed over all writers: each commit adds its own to its base's, so a lost
        race's retry counts it again on the newer base)."""
        stats = dict(base.commit_stats)
        for key, value in list(race.stats().items()) + list(self._unreported.items()):
            stats[key] = stats.get(key, 0) + value
        return new.evolve(commit_stats=stats)

    def _check_age(self, started: Optional[float]) -> None:
        """Many writers: another writer's clean-up takes unnamed files older than
        ``retain_seconds``, so a commit must not name files that old."""
        # (files leased by this writer are never taken, however long it is stopped: no bound needed)
        if self.multi_writer and started is not None and not self.storage.holds_leases \
                and boot_clock() - started > self.retain_seconds / 2:
            raise CommitTimeoutError(errno.ETIMEDOUT, f"a commit to {self.storage.url} took more than half of "
                               f"retain_seconds ({self.retain_seconds} s); its files may be collected by other "
                               "writers, so it is abandoned (nothing was committed; retry it)")

    def _publish(self, new: fmt.Manifest, data: bytes, commit: Commit, install, tokened: bool = False) -> bool:
        """Publish ``new`` (bytes ``data``) with ``commit``'s writes; False: another writer took its
        generation (or it filled a collected slot)."""
        rel = new.file
        files, dirs, rows = commit.writes, commit.dirs, commit.rows
        t = boot_clock()
        try:
            linked = self.storage.publish(rel, data, files, dirs, exclusive=self.multi_writer, step="manifest")
            self._linked_t = time.perf_counter()
            if not linked:
                return False
        except BaseException as exc:
            self._linked_t = time.perf_counter()
            visible = self._visible(rel, data)
            doubtful = visible is None or (visible is False and self.storage.link_attempted and isinstance(exc, OSError))
            if doubtful and not self.multi_writer and isinstance(exc, OSError):
                # one writer (holding the lock, or alone on an object store): what storage holds settles it
                # where it can (the temporary name removed, so a late rename cannot land; a PUT repeated)
                settled = self.storage.settle_publish(rel, data)
                if settled is False:
                    raise StoreIOError(exc.errno, f"publishing generation {new.generation} of {self.storage.url} "
                                       f"failed ({exc.strerror or exc}); nothing of it was committed (its files are "
                                       "removed), so retrying the extend is safe", exc.filename) from exc
                if settled:
                    visible, doubtful = True, False
                else:
                    self._doubt = (new, data, install)
            if doubtful:
                # the link (or rename, or PUT) failed and reading its name back failed too, or found nothing:
                # a request the client gave up on may still be carried out (an NFS link retransmitted, a PUT
                # a server applies after the client's timeout). Whether the commit landed is not known, so its
                # files stay (if it landed, it names them; if not, clean-up collects them as any commit's
                # that never happened)
                self._in_doubt = (f"whether generation {new.generation} of {self.storage.url} was committed is "
                                  f"not known: publishing it failed ({exc}) and reading it back "
                                  + ("failed too" if visible is None else "found nothing yet"))
                if isinstance(exc, OSError):
                    raise StoreIOError(exc.errno, f"{self._in_doubt}; retry with the same token to find out (a "
                                       "retry without one may append the rows twice)"
                                       + ("" if self.multi_writer else "; this store's next extend first "
                                          "settles it from what storage holds, or says how to go on"),
                                       exc.filename) from exc
                raise
            if not visible:
                raise
            # the create/rename landed and only something after it failed; a create counts only as a
            # clean one does: the floor, read after it (its lease held until then), is not above it
            if self.floored and not self._above_floor(new, data, tokened):
                return False  # linked into a collected slot: not a commit
            self._installed(new, install)
            self._unsynced = True
            if isinstance(exc, OSError):
                raise self._not_durable(exc, f"generation {new.generation} of {self.storage.url}", rows(new)) from exc
            raise
        if self.floored and not self._above_floor(new, data, tokened):
            return False  # linked into a collected slot: not a commit (see _above_floor)
        self._newest_at = (new.generation, t)  # its link found no later generation
        self._installed(new, install)
        try:
            self.storage.sync_dir(fmt.MANIFEST_DIR)
        except OSError as exc:
            raise self._not_durable(exc, f"generation {new.generation} of {self.storage.url}", rows(new)) from exc
        return True

    def _above_floor(self, new: fmt.Manifest, data: bytes, tokened: bool) -> bool:
        """Whether the generation just linked counts: the collection floor, read after the link,
        is not above it. Every generation below the floor was (or may have been) collected, and
        a clean-up raises the floor before it deletes a manifest: so a floor at or below this one
        proves that no manifest of this generation ever existed before the link, hence that the
        base was the newest commit then. A floor above it means, where the manifest was leased
        from before its link until now (a local store with ``flock``: no clean-up raises the
        floor past a leased manifest), that the base was stale and the link filled a collected
        slot: the file is removed and the commit rebased like a lost race. Without that lease (an
        object store, a filesystem without ``flock``) a real commit may also have been collected
        before this read (its writer stopped right after the link, a collector's clock ahead):
        with a token the rebase's lookup tells, and the files are kept either way; without one
        it is not known (:class:`StoreIOError`, its files kept)."""
        try:
            floor = fmt.read_floor(self.storage)
        except OSError as exc:
            self._in_doubt = (f"whether generation {new.generation} of {self.storage.url} was committed is not "
                              f"known: reading the collection floor after its link failed ({exc})")
            raise StoreIOError(exc.errno, f"{self._in_doubt}; retry with the same token to find out (a retry "
                               "without one may append the rows twice)", exc.filename) from exc
        if floor is None or floor <= new.generation:
            return True
        crash_point("manifest.collected-slot")
        proved = self.multi_writer and self.storage.holds_leases
        if not proved:
            self._maybe_named = True
        if not tokened and (not proved if self.multi_writer
                            else boot_clock() - self._validated_at >= self.retain_seconds / 2):
            self._in_doubt = (f"whether generation {new.generation} of {self.storage.url} was committed is not "
                              f"known: the collection floor ({floor}) passed it before this writer read the floor "
                              "after its link, and without locks (an object store, a filesystem without flock) a "
                              "stale link and a commit collected since look the same")
            raise StoreIOError(errno.ETIMEDOUT, f"{self._in_doubt}; read the store to see whether its rows are "
                               "there, and commit with a token (extend(batch, token=...)) so that a retry tells "
                               "(a retry without one may append the rows twice)", self.storage.url)
        try:
            if self.storage.read_bytes(new.file) == data:  # ours, in a slot nobody else can fill now
                self.storage.delete(new.file)
        except OSError:
            pass  # below the floor it is ignored by every reader, and the next clean-up removes it
        self.stats.collected_slots += 1
        if not self.multi_writer:
            raise CommitConflictError(
                f"generation {new.generation} of {self.storage.url} was committed and collected by another writer "
                "while this single-writer store was open (an object store has no lock, so a second writer is "
                "found at its commit); nothing of this commit is visible: close the store and reopen it, and "
                "give each store one writer, or create it with multi_writer=True for many")
        return False

    def _not_durable(self, exc: OSError, what: str, rows: Any, again: str = "") -> CommitNotDurableError:
        """The error for a commit that is visible but whose durability failed (owed from now on)."""
        self._unsynced = True
        return CommitNotDurableError(
            exc.errno, f"{what} is committed and visible, but making it durable failed{again} "
            f"({exc.strerror or exc}); do not append these rows again: the next commit or close() retries, and "
            "a retry with the token returns them once durable", rows=rows)

    def _installed(self, new: fmt.Manifest, install) -> None:
        self.gc.superseded(self.manifest.generation)
        self.manifest = new
        self.gc.saw(new)
        install(new)
        crash_point("manifest.committed")

    def require_known_state(self) -> None:
        """Before a single writer's commit after one whose outcome was not known (see :meth:`_publish`):
        settle it now from what storage holds (it landed: it is this writer's newest commit; it never
        will: nothing to do), or refuse. One writer plans on the manifest it holds, and if that commit
        landed, the next would write its segment ids again and replace its generation (a rename).
        Many writers read the base anyway."""
        if self._in_doubt is None or self.multi_writer:
            return
        if self._doubt is not None:
            new, data, install = self._doubt
            settled = self.storage.settle_publish(new.file, data)
            if settled is not None:
                self._in_doubt = self._doubt = None
                if settled:
                    self._installed(new, install)
                    self._unsynced = True  # its rename raised: durability is owed (the next commit syncs)
                return
        raise StoreIOError(errno.EIO, f"{self._in_doubt}, and reading storage again could not settle it; close "
                           "and reopen the store to go on from what storage holds (with the TRL integration, "
                           "restart the trainer: it reopens the store), then retry the batch with its token",
                           self.storage.url)

    def _visible(self, rel: str, data: bytes) -> Optional[bool]:
        """Whether the manifest ``rel`` holds ``data`` (None: it cannot be read, so not known)."""
        try:
            return self.storage.read_bytes(rel) == data
        except FileNotFoundError:
            return False
        except OSError:
            return None

    def remove_files(self, written: Sequence[str]) -> None:
        """Delete a commit's files that no manifest names, newest first: a segment's sidecar
        (named after the segment's id) goes before the segment file whose creation reserved the
        id. The other order frees the id while its sidecar is still there, and a writer that
        reserves it at that moment has its new sidecar deleted by this one."""
        for rel in reversed(written):
            try:
                self.storage.delete_own(rel)  # only while it is still this writer's file
            except OSError:
                pass

    def _write_token_log(self, data: bytes, first_id: int) -> int:
        self.storage.ensure_dir(fmt.TOKENS_DIR)
        # many writers, or one without a lock (object storage): the first free id, created only if
        # absent, never another writer's (or a crashed one's) log
        if self.multi_writer or not self.storage.exclusive_lock:
            log_id, _ = self.storage.link_candidates(fmt.token_log_file, data, first_id)
        else:
            log_id = first_id  # one writer, one commit per generation: a fresh name
            self.storage.write_new(fmt.token_log_file(log_id), data)
        self.storage.sync_dir(fmt.TOKENS_DIR)
        return log_id

    def durable_replay(self, rows: Any) -> None:
        """Before an ``extend`` whose token is committed returns that commit's ``rows``: make it durable
        (a return means durable). Its own attempt may have raised ``CommitNotDurableError``, in this
        process or in one that died since, so ``manifests/`` is synced again (a retry is rare: one
        ``fsync``); failing, it raises ``CommitNotDurableError`` again."""
        try:
            self.storage.sync_dir(fmt.MANIFEST_DIR)
        except OSError as exc:
            raise self._not_durable(exc, f"the token's commit in {self.storage.url}", rows, again=" again") from exc
        self._unsynced = False

    def sync(self) -> None:
        """Make the newest commit durable if an earlier attempt failed (``close()`` calls it)."""
        if self._unsynced:
            self.storage.sync_dir(fmt.MANIFEST_DIR)
            self._unsynced = False

    def close(self) -> None:
        """:meth:`sync`, then close what the storage keeps open for this writer (directories)."""
        try:
            self.sync()
        finally:
            close = getattr(self.storage, "close", None)
            if close is not None and not self.storage.cached:  # a cached store's storage is the store's own
                close()

    # ------------------------------------------------------------------ garbage collection

    def collect(self, full: bool = False) -> None:
        """Delete what no retained manifest names (:meth:`Collector.collect`); ``full``: a sweep of the
        whole store (an open's)."""
        self.gc.collect(full)

    @property
    def retained(self) -> Dict[int, fmt.Manifest]:
        """The manifests a single writer keeps (ascending generations)."""
        return self.gc.retained


def backoff_delays(n: int, first: float = BACKOFF_FIRST, cap: float = BACKOFF_CAP) -> List[Tuple[float, float]]:
    """The ``(low, high)`` sleep before each of the first ``n`` retries: none before the first
    (the winner's manifest is there to rebase on), then full jitter, doubling, capped.

    >>> backoff_delays(4, 0.001, 0.002)
    [(0, 0), (0, 0.001), (0, 0.002), (0, 0.002)]
    """
    out, d = [(0, 0)][:n], first
    for _ in range(n - 1):
        out.append((0, d))
        d = min(d * 2, cap)
    return out
