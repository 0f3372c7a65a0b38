"""The one commit path: operations applied to a base manifest, published, and cleaned up after.

Single-writer stores (the default) publish a manifest with a rename under the
writer's exclusive lock. Multi-writer stores publish with an atomic
create-if-absent (``Storage.put_if_absent``: ``link()`` on POSIX): a writer
that loses the race re-reads the newest manifest, applies its operation to it
again (:func:`ops.apply`: appends commute, a rewrite of segments another commit
changed is a conflict) and retries after a bounded exponential backoff with
jitter. docs/FORMAT.md ("Commit protocol", "Many writers") is the
specification; this module is its executable form.
"""

from __future__ import annotations

import errno
import json
import os
import random
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from .. import format as fmt
from .._fileio import TMP_PREFIX, boot_clock, crash_point
from ..errors import (CommitConflictError, CommitNotDurableError, CommitTimeoutError, CorruptStoreError,
                      StoreIOError)
from . import ops
from ..storage import Storage
from .tokens import TokenIndex, compact_tokens

MAX_ATTEMPTS = 10_000  # commits a writer retries after losing the race, before giving up
BACKOFF_FIRST = 0.0005  # seconds; doubled per lost race, capped, with full jitter
BACKOFF_CAP = 0.05
QUIET_COMMITS = 8  # commits without a lost race after which a writer folds its data into the manifest's wait
SHARED_GC_EVERY = 64  # commits of one writer between its clean-up sweeps of a multi-writer store (at least)
# ... and at least a sweep's directory entries over this many: a store that retains an hour of a fast
# writer's commits holds ~10^5-10^6 files, and a sweep lists them all; spread over its writer's commits
# this bounds what the sweeps cost each commit (~16 entries listed and looked up per commit, whatever
# the store's size; at 64 the sweeps were 4 % of a small commit's CPU). A file then waits at most a
# few seconds of commits past retain_seconds
SWEEP_ENTRIES_PER_COMMIT = 16
SEEN_MANIFESTS = 4096  # manifests a writer keeps between its sweeps, so that a sweep need not read them again
# the deepest base an append delta may follow: a lost race does not turn an append into a full manifest
# written again and again (the slower commit, it loses to deltas), while checkpoints still come within
# 2 * CHECKPOINT_EVERY (a reader applies at most this many deltas)
MAX_DELTA_DEPTH = 2 * fmt.CHECKPOINT_EVERY - 1
UNREADABLE_RETRIES = 3  # lost races to a manifest that does not read before the commit gives up
#: files a sweep of a store without manifests could not judge yet (see Committer._pending_set_aside)
PENDING_FILE = f"{fmt.QUARANTINE_DIR}/{fmt.QUARANTINE_PENDING}"
# sidecars before segments: a segment file's existence reserves its id (and so its sidecar's
# name) against other writers, so it goes last (see Committer._remove)
DATA_SWEEP_DIRS = (fmt.GROUPS_DIR, fmt.SEGMENT_DIR, fmt.STATE_DIR, fmt.TOKENS_DIR)


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
class CommitResult:
    manifest: fmt.Manifest
    #: set when the token was already committed: nothing was written, these are its rows
    duplicate: Optional[fmt.TokenRecord] = None
    files: List[str] = field(default_factory=list)


class Committer:
    """Publishes operations on a store's manifests; holds the newest manifest this writer knows."""

    def __init__(self, storage: Storage, options: fmt.StoreOptions, manifest: fmt.Manifest) -> None:
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
        self._validated_at = 0.0  # boot_clock() when the base was last found to be the newest commit
        # one writer: the manifests kept (ascending generations), how many of them name each file, and
        # those that are deltas (a store converted from many writers); see collect
        self.retained: Dict[int, fmt.Manifest] = {}
        self._refs: Counter = Counter()
        self._chained: Set[int] = set()
        self._superseded_at: Dict[int, float] = {}
        self._unsynced = False
        self._since_sweep = 0
        self._sweep_every = SHARED_GC_EVERY  # commits between sweeps, grown with the entries a sweep lists
        # the shared sweep: the newest generation it read (with its manifest and files), the files each
        # later-kept generation stopped naming, and each one's delta depth (see _named_by)
        self._swept: Optional[Tuple[int, fmt.Manifest, frozenset]] = None
        self._released: Dict[int, frozenset] = {}
        self._ripe: Dict[str, float] = {}  # young unnamed files: when (time.time()) each is old enough to go
        self._depth: Dict[int, int] = {}
        # the manifests of the generations this writer made or read since its last sweep (its own
        # commits, other writers' deltas it applied): the sweep reads only the ones it missed
        self._seen: Dict[int, fmt.Manifest] = {}
        #: files the next publish writes and fsyncs together with the manifest (and directories
        #: it fsyncs): an append's segments and sidecars, a rebase's rewritten sidecars
        self.pending: List[Tuple[str, object, Optional[str]]] = []
        self.pending_dirs: List[str] = []
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
        self._since_conflict = QUIET_COMMITS  # this writer's commits since its last lost race
        #: (generation, boot_clock()) at which that generation was the newest (no later one existed)
        self._newest_at: Tuple[int, float] = (0, 0.0)

    # ------------------------------------------------------------------ reading the base

    def newest(self) -> fmt.Manifest:
        """The newest commit on storage (never older than the one held)."""
        # probes up from the one held; nothing newer: the one held (a generation is created once)
        seen = self._seen if self.multi_writer else None
        t = boot_clock()
        m, _ = fmt.load_newest_manifest(self.storage, known=self.manifest, options=self.options, seen=seen,
                                        known_is_newest=self._held_is_newest())
        if m.generation > self.manifest.generation:
            self.manifest = m
            self._saw(m)
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

    def _saw(self, m: fmt.Manifest) -> None:
        if self.multi_writer:
            self._seen[m.generation] = m
            while len(self._seen) > SEEN_MANIFESTS:
                del self._seen[next(iter(self._seen))]

    def uncontended(self) -> bool:
        """No lost race in this writer's last ``QUIET_COMMITS`` commits: its next append may make its
        data durable in the same wait as its manifest's file (one wait less). Under contention the
        data goes first, so that the race window is the manifest step alone."""
        return self._since_conflict >= QUIET_COMMITS

    def find_token(self, token: str) -> Optional[fmt.TokenRecord]:
        return self.tokens.find(self.manifest, token)

    # ------------------------------------------------------------------ committing

    def commit(self, plan: Callable[[fmt.Manifest], ops.Operation], written: List[str], *,
               token: Optional[str] = None, install: Callable[[fmt.Manifest], None],
               rows: Callable[[fmt.Manifest], object] = lambda m: None,
               started: Optional[float] = None) -> CommitResult:
        """Apply ``plan(base)`` to the newest manifest and publish it; returns the new manifest.

        ``written`` are this commit's files (removed when it does not happen),
        first written at ``boot_clock()`` ``started``.
        ``install`` makes the new manifest the caller's state; it is called as
        soon as the commit is visible, even if making it durable then fails
        (:class:`CommitNotDurableError`, whose ``rows`` is ``rows(new)``): a
        writer must never reuse a visible commit's generation, ids or rows.
        """
        self.require_known_state()
        self._in_doubt = None  # many writers: the base read below finds that commit if it landed
        t0 = time.perf_counter()
        # the commit began when its first data file was written (``started``), if it wrote any
        before = max(0.0, boot_clock() - started) if started is not None else 0.0
        lost_at: Optional[float] = None  # when the first attempt's link failed, once one lost
        publish_t = t0
        delay = BACKOFF_FIRST
        unreadable = 0
        delta: Optional[Tuple[fmt.Delta, bytes]] = None  # made once: a lost race links the same file again
        base = self.manifest
        try:
            if self.multi_writer and self.options.append_deltas:
                delta = self._stage_delta(plan)
            # many writers: plan on the newest commit now, after the data (and an append's delta) is
            # written and durable, so that the race window is the manifest step alone (a delta's: a link)
            base = self.newest() if self.multi_writer else self.manifest
            if self._unsynced:  # an earlier commit is visible but its durability is still owed
                self.storage.sync_dir(fmt.MANIFEST_DIR)
                self._unsynced = False
            for attempt in range(MAX_ATTEMPTS):
                if token is not None:
                    dup = self.tokens.find(base, token)
                    if dup is not None:
                        self._remove(written)
                        self.manifest = base
                        return CommitResult(base, duplicate=dup)
                self._check_age(started)
                op = plan(base)
                logs: List[str] = []
                # a full manifest (a checkpoint) once the base is this writer's depth past one; after a lost
                # race, the delta made before it as long as the chain stays short enough (the checkpoint is
                # left to the next commit: a full manifest's longer race window would lose again)
                if 0 <= base.depth < self._lost_checkpoint_at:  # another writer's checkpoint landed
                    self._checkpoint_deferred, self._lost_checkpoint_at = 0, -1
                checkpoint = False
                if delta is not None and (base.depth < max(self._checkpoint_at, self._checkpoint_deferred)
                                          or (attempt and base.depth < MAX_DELTA_DEPTH)):
                    # (a rewrite delta raises ops.Conflict once the base no longer holds its segments)
                    new, data = delta[0].apply(base, self.options), delta[1]
                    publish_t = time.perf_counter()
                else:
                    checkpoint = delta is not None
                    new = ops.apply(base, op, self.options).evolve(depth=0)
                    new, logs = compact_tokens(new, self.tokens, self._write_token_log)
                    written += logs
                    publish_t = time.perf_counter()
                    if self.multi_writer:
                        new = self._count(base, new, attempt, t0 - before, lost_at, publish_t)
                    data = fmt.signed_bytes(new.body())
                if self._publish(new, data, install, rows, token is not None):
                    if new.depth:
                        self._owe(attempt, t0 - before, lost_at, publish_t)
                    else:
                        self._unreported = {}
                    if checkpoint:
                        self._checkpoint_deferred, self._lost_checkpoint_at = 0, -1
                    break
                if checkpoint:
                    # a full manifest's write and fsync come after the base is read: a window in which the
                    # others' deltas (a link each) win. Trying again at the next commit, and the one after,
                    # would lose again as all the writers past their depth do: wait a few deltas deeper,
                    # so that one of them (or this one, at most MAX_DELTA_DEPTH) writes it
                    self._lost_checkpoint_at = base.depth
                    self._checkpoint_deferred = min(MAX_DELTA_DEPTH, base.depth + 1
                                                    + random.randrange(fmt.CHECKPOINT_EVERY // 2))
                # another writer took this generation: rebase on the newest and retry. The data
                # files are written and durable already; only the manifest step (and, for an
                # append, its sidecars' row ids) is redone.
                if lost_at is None:
                    lost_at = self._linked_t
                self.stats.conflicts += 1
                for rel in logs:
                    written.remove(rel)
                    self.storage.delete(rel)
                if attempt:  # the first retry goes at once: the winner's manifest is there to read
                    time.sleep(random.uniform(0, delay))
                    delay = min(delay * 2, BACKOFF_CAP)
                base = self.newest()
                if base.generation < new.generation:
                    # the generation we lost exists but does not read as a manifest: no commit can
                    # ever follow it (a transient read error gets a few more tries)
                    unreadable += 1
                    if unreadable >= UNREADABLE_RETRIES:
                        raise CorruptStoreError(
                            f"{self.storage.url}/{new.file} exists but cannot be read as a manifest, so no "
                            f"commit can follow generation {base.generation}; run `diskreplay verify "
                            f"{self.storage.url}` and `diskreplay repair` (nothing of this commit is visible)")
            else:
                raise ops.Conflict(f"gave up committing to {self.storage.url} after {MAX_ATTEMPTS} "
                                   "lost races")
        except CommitNotDurableError:
            self.stats.not_durable += 1
            raise
        except BaseException:
            if self.manifest.generation == base.generation and self._in_doubt is None:
                self._remove(written)  # not committed: its files are garbage
            raise
        finally:
            self.storage.discard_staged()
            self.discard_pending()  # a duplicate token or an error: never written
            self.storage.release_leases()  # published, or removed (or in doubt: then clean-up decides)
            # what the lost races cost: from the first failed link to the last link (the back-off,
            # re-reading the newest commit, re-planning on it, rewriting the sidecars and manifest)
            if lost_at is not None:
                self.stats.retry_seconds += self._linked_t - lost_at
            self.stats.manifest_seconds += time.perf_counter() - t0
            self.stats.commit_seconds += time.perf_counter() - t0 + before
        self.stats.commits += 1
        self.stats.rebases += attempt > 0
        self._since_conflict = 0 if attempt else self._since_conflict + 1
        return CommitResult(new, files=written)

    def discard_pending(self) -> None:
        """Forget the files the next publish was to write (written now, or never)."""
        self.pending, self.pending_dirs = [], []

    def _stage_delta(self, plan: Callable[[fmt.Manifest], ops.Operation]) -> Optional[Tuple[fmt.Delta, bytes]]:
        """An append's (or, format v5, a rewrite's) delta, written and made durable with its data
        before the race (it does not depend on the base): ``(delta, its bytes)``, or None for
        another operation. It is published as it is unless the base turns out ``_checkpoint_at``
        deltas deep (then the commit writes a full manifest)."""
        op = plan(self.manifest)
        # (a merge as a full manifest raced with a longer write and lost to the small commits around
        # it: 1.6 lost races per merge with 4 writers; its delta races for a link)
        if not (isinstance(op, ops.Append) and op.relocatable
                or isinstance(op, ops.Rewrite) and self.options.inline_groups):
            return None
        d = op.delta({"commits": 1, **self._unreported})
        data = fmt.signed_bytes(d.body())
        files, dirs = self.pending, self.pending_dirs
        self.pending, self.pending_dirs = [], []
        self.storage.stage(fmt.MANIFEST_DIR, data, files, dirs, step="manifest")
        return d, data

    @staticmethod
    def _stats(conflicts: int, t0: float, lost_at: Optional[float], publish_t: float) -> Dict[str, int]:
        return {"commits": 1, "conflicts": conflicts, "commit_ms": int(round((publish_t - t0) * 1e3)),
                "retry_ms": 0 if lost_at is None else int(round((publish_t - lost_at) * 1e3))}

    def _count(self, base: fmt.Manifest, new: fmt.Manifest, conflicts: int, t0: float, lost_at: Optional[float],
               publish_t: float) -> fmt.Manifest:
        """``new`` with this commit (and this writer's earlier deltas' owed counters) added to the store's
        ``commit_stats`` (summed over all writers: each commit adds its own to its base's, so a lost
        race's retry counts it again on the newer base)."""
        stats = dict(base.commit_stats)
        for key, value in list(self._stats(conflicts, t0, lost_at, publish_t).items()) + list(
                self._unreported.items()):
            stats[key] = stats.get(key, 0) + value
        return new.evolve(commit_stats=stats)

    def _owe(self, conflicts: int, t0: float, lost_at: Optional[float], publish_t: float) -> None:
        """After a delta's publish: its own lost races and times ride in this writer's next commit
        (its ``commits`` count was in the delta)."""
        own = self._stats(conflicts, t0, lost_at, publish_t)
        own.pop("commits")
        self._unreported = {k: v for k, v in own.items() if v}

    def _check_age(self, started: Optional[float]) -> None:
        """Many writers: another writer's clean-up takes unnamed files older than
        ``retain_seconds``, so a commit must not name files that old."""
        # (files leased by this writer are never taken, however long it is stopped: no bound needed)
        if self.multi_writer and started is not None and not self.storage.holds_leases \
                and boot_clock() - started > self.retain_seconds / 2:
            raise CommitTimeoutError(errno.ETIMEDOUT, f"a commit to {self.storage.url} took more than half of "
                               f"retain_seconds ({self.retain_seconds} s); its files may be collected by other "
                               "writers, so it is abandoned (nothing was committed; retry it)")

    def _publish(self, new: fmt.Manifest, data: bytes, install, rows, tokened: bool = False) -> bool:
        rel = new.file
        files, dirs = self.pending, self.pending_dirs
        self.pending, self.pending_dirs = [], []  # written and durable after this, whatever the outcome
        t = boot_clock()
        try:
            linked = self.storage.publish(rel, data, files, dirs, exclusive=self.multi_writer, step="manifest")
            self._linked_t = time.perf_counter()
            if not linked:
                return False
        except BaseException as exc:
            visible = self._visible(rel, data)
            if visible is None or (visible is False and self.storage.link_attempted and isinstance(exc, OSError)):
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
                                       + ("" if self.multi_writer else ", after reopening the store"),
                                       exc.filename) from exc
                raise
            if not visible:
                raise
            # the create/rename landed and only something after it failed: committed
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
        base was the newest commit then. A floor above it means the base was stale and the link
        filled a collected slot (the writer was idle or stopped for longer than retain_seconds):
        the file is removed and the commit rebased like a lost race, its token looked up again
        on the newest commit. Only a commit whose base is older than ``retain_seconds / 2`` can
        also have been a real commit since collected (a clock that jumped, a writer stopped
        right after its link): without a token that is not known (:class:`StoreIOError`, its
        files kept); with one, the rebase finds its token if it was."""
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
        if not tokened and boot_clock() - self._validated_at >= self.retain_seconds / 2:
            self._in_doubt = (f"whether generation {new.generation} of {self.storage.url} was committed is not "
                              f"known: this writer was stopped for longer than half of retain_seconds around its "
                              f"commit, and the collection floor ({floor}) has passed it since")
            raise StoreIOError(errno.ETIMEDOUT, f"{self._in_doubt}; commit with a token to find out (a retry "
                               "without one may append the rows twice)", self.storage.url)
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
        if not self.multi_writer and self.retain_seconds is not None:  # only _young asks (kept while retained)
            self._superseded_at[self.manifest.generation] = time.time()
        self.manifest = new
        self._saw(new)
        install(new)
        crash_point("manifest.committed")

    def require_known_state(self) -> None:
        """Refuse to write after a single-writer commit whose outcome is not known (see :meth:`_publish`):
        one writer plans on the manifest it holds, and if that commit landed, the next would write its
        segment ids again and replace its generation (a rename). Many writers read the base anyway."""
        if self._in_doubt is not None and not self.multi_writer:
            raise StoreIOError(errno.EIO, f"{self._in_doubt}; close and reopen the store to go on from what "
                               "storage holds", self.storage.url)

    def _visible(self, rel: str, data: bytes) -> Optional[bool]:
        """Whether the manifest ``rel`` holds ``data`` (None: it cannot be read, so not known)."""
        try:
            return self.storage.read_bytes(rel) == data
        except FileNotFoundError:
            return False
        except OSError:
            return None

    def _remove(self, written: Sequence[str]) -> None:
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
        if self.multi_writer:
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
        """Delete what no retained manifest names (see docs/FORMAT.md, step 7 and "Many writers")."""
        if self.multi_writer:
            self._since_sweep += 1
            if full or self._since_sweep >= self._sweep_every:
                self._since_sweep = 0
                self.sweep_shared()
            return
        if full:
            self._sweep_exclusive()
            return
        # O(files of the manifests added and dropped) a commit, however many are retained: a store
        # retaining an hour of commits holds thousands (rebuilding their file set took ~300 ms a commit)
        current = self.manifest.generation
        if current not in self.retained:
            self._keep(current, self.manifest)
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
                               if g != self.manifest.generation}
        return set(self._refs)

    def _young(self, generation: int) -> bool:
        """Superseded less than ``retain_seconds`` ago (a pinned snapshot may still read it)."""
        if self.retain_seconds is None:
            return False
        at = self._superseded_at.get(generation)
        return at is not None and time.time() - at < self.retain_seconds

    def _sweep_exclusive(self) -> None:
        """The single writer's open: everything no retained manifest names is garbage (it holds the lock)."""
        current = self.manifest.generation
        docs, unreadable = fmt.manifest_docs(self.storage)
        referenced = self.retain_at_open(self._kept_with_chains(docs, current))
        if unreadable:
            warnings.warn(f"{self.storage.url}: cannot read manifest(s) {'; '.join(unreadable.values())}; "
                          "they and every data file are kept (run `diskreplay verify`)", RuntimeWarning, stacklevel=4)
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

    def _kept_with_chains(self, docs: Mapping[int, fmt.Manifest], current: int) -> Dict[int, fmt.Manifest]:
        kept = {g: docs[g] for g in self.kept_at_open(docs, current)}
        kept[current] = self.manifest
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
        hi = fmt.load_newest_manifest(self.storage, known=self.manifest, options=self.options,
                                      seen=self._seen)[0].generation
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
            newest = fmt.load_newest_manifest(self.storage, known=self.manifest, options=self.options,
                                              seen=self._seen)[0].generation
            return self._named_by(set(range(cut, max(newest, cut) + 1)))

        self._collect_unnamed([fmt.manifest_file(g) for g in drop], files, young, retain,
                              not hi and not floor and not self.manifest.generation, referenced, unreadable,
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
                m = self._seen.get(g) or fmt.read_manifest(
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
        self._seen = {g: m for g, m in self._seen.items() if g > hi}
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
                          "backup to get their rows back)", RuntimeWarning, stacklevel=5)
        return rest

    def _set_aside(self, rel: str) -> str:
        """Move ``rel`` to a free name under ``quarantine/`` (a rename where the storage has one)."""
        local = self.storage.local_path if self.storage.can_map else None
        data = None if local is not None else self.storage.read_bytes(rel)  # an object store copies
        for n in range(1 << 16):
            dest = f"{fmt.QUARANTINE_DIR}/{rel}" + (f".{n}" if n else "")
            if local is not None:
                target = local(dest)
                if os.path.lexists(target):
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.rename(local(rel), target)
                self.storage.sync_dir(os.path.dirname(dest))
                self.storage.sync_dir(os.path.dirname(rel))
                return dest
            if self.storage.put_if_absent(dest, data):
                self.storage.delete(rel)
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
        if self.floored and manifests:
            # the floor first: a writer whose link fills a collected slot must find it above that slot
            floor = fmt.raise_floor(self.storage, max(map(_generation_of, manifests)) + 1)
            manifests = sorted((rel for rel in manifests if _generation_of(rel) < floor), key=_generation_of)
        for rel in manifests:  # (oldest first)
            crash_point("gc.manifest")
            self.storage.delete(rel)
        if manifests:
            self.storage.sync_dir(fmt.MANIFEST_DIR)
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


def _file_keys(m: fmt.Manifest, before: Optional[Tuple[int, fmt.Manifest, frozenset]] = None) -> frozenset:
    """The files ``m`` names, a segment (and its sidecar) by its id: a sweep compares the files of
    thousands of generations, and two names per segment cost 10x the ids (:func:`_file_names`).
    ``before``: the generation before, its manifest and its keys; what ``m`` holds as the same
    objects (a delta's manifest keeps its base's states, token logs and index) is not named again."""
    prev = before[1] if before is not None else None
    if prev is not None and m.states is prev.states and m.token_logs is prev.token_logs \
            and m.group_index is prev.group_index:
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
