"""Exactly-once tokens: which ``extend`` tokens a commit knows, kept small in every manifest.

The newest ``INLINE_TOKENS`` records ride in the manifest itself; older ones
are sealed into immutable ``tokens/<id>.json`` logs that the manifest lists
(with their size and checksum), and once there are more than ``MAX_TOKEN_LOGS``
logs those of the smallest size tier are merged (:func:`_merge_tier`). A record
is kept while any of its rows is live or it is among the newest
``RETAIN_TOKEN_COMMITS`` commits. Looking a token
up reads the inline records and then the logs, newest first; a log is
immutable, so a writer parses each one once.

Measured manifest growth (``tests/test_commit.py::test_token_manifest_growth``):
with tokens on every commit the manifest holds at most ``INLINE_TOKENS``
records (about 55 bytes each) plus one ~150-byte entry per log.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .. import format as fmt
from ..errors import ArgumentError, CorruptStoreError
from .._fileio import crc32c
from ..storage import Storage

INLINE_TOKENS = 32  # parsed on every catch-up with another writer's commit: keep manifests small
MAX_TOKEN_LOGS = 32
# logs merged together are of one size tier (records per log within a factor of TOKEN_LOG_TIER), at
# least TOKEN_LOG_FANIN of them: a record is rewritten about log_16(records / INLINE_TOKENS) times.
# (merging every log into one would rewrite, and make every writer parse again, every record kept)
TOKEN_LOG_TIER = 16
TOKEN_LOG_FANIN = 8
RETAIN_TOKEN_COMMITS = 100_000


def check_token(token: object) -> Optional[str]:
    if token is None:
        return None
    if not isinstance(token, str) or not token:
        raise ArgumentError(f"token must be a non-empty str (unique per logical batch, e.g. f'{{worker}}:{{step}}'), "
                        f"got {token!r}")
    if len(token) > fmt.MAX_TOKEN_CHARS:
        raise ArgumentError(f"token must be at most {fmt.MAX_TOKEN_CHARS} characters, got {len(token)}")
    return token


class TokenIndex:
    """Token lookup over a manifest's inline records and its token logs (parsed once each).

    A lookup of a new token (every exactly-once append makes one) misses every log, so the
    logs' records are also held in one dict, newest log last (it wins), kept for the manifests'
    ``token_logs`` as long as they only grow at the end (a log sealed): one probe, not one per log.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        # by the whole entry: an id freed by clean-up may be reused for another log
        self._logs: Dict[fmt.TokenLog, Dict[str, fmt.TokenRecord]] = {}
        self._merged_for: Tuple[fmt.TokenLog, ...] = ()
        self._merged: Dict[str, fmt.TokenRecord] = {}

    def _log(self, entry: fmt.TokenLog) -> Dict[str, fmt.TokenRecord]:
        hit = self._logs.get(entry)
        if hit is None:
            raw = self.storage.read_bytes(entry.file, entry.bytes)
            if len(raw) != entry.bytes or crc32c(raw) != entry.crc32c:
                raise CorruptStoreError(f"{self.storage.local_path(entry.file)} fails its checksum; the token "
                                        "log is damaged")
            hit = self._logs[entry] = {r.token: r for r in fmt.parse_token_log(raw, entry.file)}
        return hit

    def _records_of(self, logs: Tuple[fmt.TokenLog, ...]) -> Optional[Dict[str, fmt.TokenRecord]]:
        """Every record of ``logs``, a token in two of them as the newest one has it (None for
        the logs of a manifest older than the ones held: they are looked up one by one)."""
        held = self._merged_for
        if logs is held or logs == held:
            return self._merged
        if len(logs) < len(held) and held[:len(logs)] == logs:
            return None  # an older manifest's (some of the records held are newer than it)
        if logs[:len(held)] == held:  # logs sealed since: add theirs
            merged, new = self._merged, logs[len(held):]
        else:  # logs dropped or merged into one: start again
            merged, new = {}, logs
            self._logs = {e: self._logs[e] for e in logs if e in self._logs}  # the others are gone
        try:
            for entry in new:
                merged.update(self._log(entry))
        except BaseException:  # a log that does not read: what is held is no one manifest's any more
            self._merged_for, self._merged = (), {}
            raise
        self._merged_for, self._merged = logs, merged
        return merged

    def find(self, manifest: fmt.Manifest, token: str) -> Optional[fmt.TokenRecord]:
        """``token``'s record in ``manifest``, or None. A record whose rows intersect a hole is not
        found: repair dropped those rows with a damaged segment, so the batch, sent again, is appended
        again (a sealed log keeps such records; repair forgets the inline ones)."""
        r = self._find(manifest, token)
        if r is not None and any(a < r.end_row and r.first_row < b for a, b in manifest.holes):
            return None
        return r

    def _find(self, manifest: fmt.Manifest, token: str) -> Optional[fmt.TokenRecord]:
        for r in reversed(manifest.tokens):
            if r.token == token:
                return r
        if not manifest.token_logs:
            return None
        merged = self._records_of(manifest.token_logs)
        if merged is not None:
            return merged.get(token)
        for entry in reversed(manifest.token_logs):
            r = self._log(entry).get(token)
            if r is not None:
                return r
        return None

    def records(self, entry: fmt.TokenLog) -> List[fmt.TokenRecord]:
        return list(self._log(entry).values())


def _kept(r: fmt.TokenRecord, manifest: fmt.Manifest) -> bool:
    return r.end_row > manifest.head or r.generation > manifest.generation - RETAIN_TOKEN_COMMITS


def compact_tokens(manifest: fmt.Manifest, index: TokenIndex, write_log) -> Tuple[fmt.Manifest, List[str]]:
    """Seal inline records into a log when there are too many, drop logs nobody needs, merge logs.

    ``write_log(data, first_id) -> id`` writes an immutable log under a fresh id
    (``first_id`` for one writer: four ids per generation, so the sealed and the
    merged log of one commit differ). Returns the new manifest and the files written.
    """
    written: List[str] = []
    tokens, logs = manifest.tokens, manifest.token_logs
    if len(tokens) <= INLINE_TOKENS and len(logs) <= MAX_TOKEN_LOGS \
            and not (logs and not _log_kept(logs[0], manifest)):
        return manifest, written
    logs = tuple(e for e in logs if _log_kept(e, manifest))
    if len(tokens) > INLINE_TOKENS:
        sealed = [r for r in tokens if _kept(r, manifest)]
        if sealed:
            logs = logs + (_write(sealed, 4 * manifest.generation, write_log, written),)
        tokens = ()
    if len(logs) > MAX_TOKEN_LOGS:
        chosen = _merge_tier(logs)
        merged = [r for i in chosen for r in index.records(logs[i]) if _kept(r, manifest)]
        into = (_write(merged, 4 * manifest.generation + 1, write_log, written),) if merged else ()
        # the merged log takes the place of the oldest it replaces (logs stay about in age order)
        first, picked = chosen[0], set(chosen)
        logs = logs[:first] + into + tuple(e for i, e in enumerate(logs) if i > first and i not in picked)
    return manifest.evolve(tokens=tokens, token_logs=logs), written


def _tier(count: int) -> int:
    """A log's size tier: 0 below ``TOKEN_LOG_TIER`` sealings' worth of records, then one per factor."""
    tier, size = 0, INLINE_TOKENS * TOKEN_LOG_TIER
    while count >= size:
        tier, size = tier + 1, size * TOKEN_LOG_TIER
    return tier


def _merge_tier(logs: Sequence[fmt.TokenLog]) -> List[int]:
    """Indices of the logs to merge: those of the smallest tier that holds ``TOKEN_LOG_FANIN`` (with
    more than ``MAX_TOKEN_LOGS`` logs over a few tiers one does), else all of them.

    >>> e = lambda n: fmt.TokenLog(0, 1, 0, n, 1, 1)
    >>> _merge_tier([e(9000)] + [e(600)] * 3 + [e(33)] * 29)[:3], len(_merge_tier([e(33)] * 33))
    ([4, 5, 6], 33)
    """
    tiers: Dict[int, List[int]] = {}
    for i, e in enumerate(logs):
        tiers.setdefault(_tier(e.count), []).append(i)
    for tier in sorted(tiers):
        if len(tiers[tier]) >= TOKEN_LOG_FANIN:
            return tiers[tier]
    return list(range(len(logs)))


def _log_kept(e: fmt.TokenLog, manifest: fmt.Manifest) -> bool:
    return e.end_row > manifest.head or e.last_generation > manifest.generation - RETAIN_TOKEN_COMMITS


def _write(records: List[fmt.TokenRecord], first_id: int, write_log, written: List[str]) -> fmt.TokenLog:
    records.sort(key=lambda r: r.generation)
    data = fmt.token_log_bytes(records)
    log_id = write_log(data, first_id)
    written.append(fmt.token_log_file(log_id))
    return fmt.TokenLog(log_id, len(data), crc32c(data), len(records), max(r.generation for r in records),
                        max(r.end_row for r in records))
