"""Loading a manifest (resolving deltas) and finding a store's newest commit."""

from __future__ import annotations

import errno
import mmap
import os
import weakref
from typing import Any, Dict, List, Optional, Tuple


from ..errors import CommitConflictError, CorruptStoreError, FormatError, ManifestBaseMissingError
from .names import (DELTA_FORMAT, FLOOR_FILE, FORMAT_FILE, FORWARD_READS, MANIFEST_DIR, MANIFEST_NAME, MAX_DELTA_CHAIN,
                    MAX_JSON_BYTES, MAX_RELISTS, manifest_file)
from .._fileio import crc32c
from ..storage.base import Storage
from .access import StorageLike, as_storage, file_exists, location, read_signed
from .jsondoc import parse_json, signature_in_bytes
from .segment_table import SegmentTable, SegmentTableEntry, cut_entries
from .options import StoreOptions
from .manifest import Delta, Manifest, delta_from_doc
from .floor import read_floor


#: manifests at least this long are mapped rather than read (a segment table's start at about 30 KB)
MAPPED_MANIFEST_BYTES = 16 << 10


def load_manifest(path: str, generation: Optional[int] = None, *, known: Optional[Manifest] = None,
                  options: Optional[StoreOptions] = None, seen: Optional[Dict[int, Manifest]] = None) -> Manifest:
    """Read, verify and parse one manifest file (which must say it is ``generation``, if given).

    A delta (:class:`AppendDelta`) is applied to the manifests before it, read
    from the same directory back to a full one, or to ``known`` (a manifest of
    this store already held) when the chain reaches its generation. ``seen``,
    if given, receives every generation a chain of deltas made on the way.
    """
    folder, name = os.path.split(path)
    doc, verified = read_manifest_doc(folder, name)
    if isinstance(doc, dict) and doc.get("format") == DELTA_FORMAT:
        m = MANIFEST_NAME.match(name)
        if m is None:
            raise CorruptStoreError(f"{path} is an append delta outside a store's manifests directory")
        return _resolve(as_storage(os.path.dirname(folder)), int(m.group(1)), doc, verified, path, known, options,
                        seen)
    m = Manifest.from_dict(doc, path, verified)
    if generation is not None and m.generation != generation:
        raise CorruptStoreError(f"{path} says it is generation {m.generation}")
    return m


def _resolve(root: Storage, generation: int, doc: Any, verified: bool, where: str, known: Optional[Manifest],
             options: Optional[StoreOptions], seen: Optional[Dict[int, Manifest]] = None) -> Manifest:
    """Manifest ``generation`` of ``root`` from its document: a full manifest, or a delta applied
    to the manifest of the generation before (recursively, back to a full one or ``known``)."""
    chain: List[Tuple[str, Delta]] = []
    base = None
    g, g_where = generation, where
    while isinstance(doc, dict) and doc.get("format") == DELTA_FORMAT:
        chain.append((g_where, delta_from_doc(doc, g_where, verified)))
        g -= 1
        if known is not None and known.generation == g:
            base = known
            break
        if g == 0:  # the store's first commits: they follow the empty store
            base = Manifest()
            break
        if len(chain) > MAX_DELTA_CHAIN:
            raise CorruptStoreError(f"{where} is an append delta whose chain of {len(chain)} deltas ends at "
                                    f"generation {g} without a full manifest")
        g_where = location(root, manifest_file(g))
        try:
            doc, verified = read_manifest_doc(root, manifest_file(g))
        except FileNotFoundError:  # collected with the delta meanwhile, or lost: the error says which
            raise ManifestBaseMissingError(
                errno.ENOENT, f"{where} is an append delta, but {g_where}, a manifest it applies to, is missing "
                "(collected after retain_seconds, or lost): open a newer generation, or run `diskreplay verify`",
                g_where) from None
    if base is None:
        base = Manifest.from_dict(doc, g_where, verified)
        if base.generation != g:
            raise CorruptStoreError(f"{g_where} says it is generation {base.generation}")
    if not chain:
        return base
    if options is None:  # the capacities (FORMAT.json is fixed at creation but for late_columns)
        raw, ok = read_signed(root, FORMAT_FILE)
        options = StoreOptions.from_dict(raw, location(root, FORMAT_FILE), ok)
    made = []
    for d_where, delta in reversed(chain):
        try:
            base = delta.apply(base, options)
        except CommitConflictError as exc:  # its writer applied it to exactly this base: forged or damaged
            raise CorruptStoreError(f"{d_where} is a rewrite delta that does not apply to generation "
                                    f"{base.generation}: {exc}") from None
        made.append(base)
    _check_appended(base, where)
    if seen is not None:
        seen.update((m.generation, m) for m in made)
    return base


def _check_appended(m: Manifest, where: str) -> None:
    """What ``Manifest.validate`` could find wrong in ``m``, a valid manifest with append deltas
    applied: a segment id twice. The rest holds by construction (:meth:`AppendDelta.apply` places
    the entries after the base's rows, raises ``next_segment`` past their ids and applies the
    capacities; :func:`rewrite_rows` checks a rewrite's rows), so a reader catching up does not
    check every segment's rows per delta."""
    segs = m.segments
    if isinstance(segs, SegmentTable):
        if segs.ids_unique():
            return
    elif len({s.id for s in segs}) == len(segs):
        return
    raise FormatError(f"a segment id appears twice in {where}")


def read_manifest_doc(root: StorageLike, rel: str) -> Tuple[Any, bool]:
    """A manifest's document and whether its bytes proved their checksum, as :func:`read_signed`
    gives it, but with ``segments`` already a :class:`SegmentTable` when the manifest names an
    intact segment table (its JSON entries are then not parsed). A table that is missing, of
    other bytes or not one leaves the JSON entries to be read, as a reader without tables does."""
    root = as_storage(root)
    where = location(root, rel)
    mapped = _mapped(root, rel)  # a long manifest where it lies: its entries are neither copied nor read
    if mapped is not None and signature_in_bytes(mapped):
        raw: Any = mapped
        verified = True
    else:  # (a damaged map is read again: the read names what is wrong)
        raw = root.read_bytes(rel, MAX_JSON_BYTES)
        verified = signature_in_bytes(raw)
    doc = _with_table(root, raw, where) if verified else None
    if doc is not None:
        return doc, True
    return parse_json(raw if isinstance(raw, bytes) else bytes(raw), where), verified


def _with_table(root: Storage, raw: Any, where: str) -> Optional[Dict[str, Any]]:
    """The document of ``raw`` (checksum proved) with its segment table as ``segments``, the JSON
    entries not parsed; None when it names none or the table is not intact."""
    cut = cut_entries(raw)
    if cut is None:
        return None
    doc = parse_json(cut[0], where)
    table = _segment_table(root, doc, where)
    if table is None:
        return None
    doc["segments"] = table
    return doc


def _mapped(root: Storage, rel: str) -> Optional[mmap.mmap]:
    """A read-only map of the manifest ``rel`` where its storage maps files in place and it is long
    enough to name a segment table (else None: it is read)."""
    return root.map(rel, min_bytes=MAPPED_MANIFEST_BYTES, max_bytes=MAX_JSON_BYTES)


def _segment_table(root: Storage, doc: Any, where: str) -> Optional[SegmentTable]:
    try:
        entry = SegmentTableEntry.from_dict(doc.get("segment_table") if isinstance(doc, dict) else None, where)
        data = root.read_bytes(entry.file, entry.bytes)
        if len(data) != entry.bytes or crc32c(data) != entry.crc32c:
            return None
        table = SegmentTable.from_bytes(data, location(root, entry.file))
    except (OSError, FormatError, CorruptStoreError):
        return None
    return table if len(table) == entry.count else None


def list_generations(root: StorageLike) -> List[int]:
    """Manifest generations present in ``root`` (a directory or a Storage), newest first."""
    try:
        names = as_storage(root).list(MANIFEST_DIR)
    except FileNotFoundError:
        return []
    gens = [int(m.group(1)) for m in map(MANIFEST_NAME.match, names) if m]
    return sorted(gens, reverse=True)


def load_newest_manifest(root: StorageLike, *, known: Optional[Manifest] = None, options: Optional[StoreOptions] = None,
                         seen: Optional[Dict[int, Manifest]] = None,
                         known_is_newest: bool = False) -> Tuple[Manifest, List[str]]:
    """The newest manifest that parses and verifies, and the problems met on the way.

    ``seen`` receives the generations a chain of deltas made on the way (:func:`load_manifest`).
    ``known_is_newest``: ``known`` was the newest generation so recently that it cannot have
    been collected since (see :func:`read_forward`); the generations after it are then read
    in order, without probing for them first.
    An empty store gives ``Manifest()``. Raises ``CorruptStoreError`` naming the
    files when manifests exist but none is intact. A reader whose directory
    listing went stale while a writer committed and cleaned up (every listed
    manifest deleted before it could be opened) lists again rather than
    mistaking the store for an empty one. An object store is probed instead
    (:func:`_newest_by_probing`): its listings are not relied on.

    A store with a collection floor (:func:`read_floor`) is held to it: the answer counts only
    if the floor, read after it was found, is not above it. Otherwise the search went through
    a collected generation (it found a run that a clean-up was removing, or a manifest a stale
    writer created in a collected slot) and starts again from the floor.
    """
    root = as_storage(root)
    start = 0
    for _ in range(MAX_RELISTS):
        m, problems = _newest_unchecked(root, known, options, seen, known_is_newest and not start, start)
        floor = read_floor(root)
        if floor is None or m.generation >= floor:
            return m, problems
        start, known_is_newest = floor, False
    raise CorruptStoreError(f"the collection floor of {location(root, FLOOR_FILE)} kept moving past the "
                            f"newest manifest found ({MAX_RELISTS} searches): is something deleting manifests?")


def _newest_unchecked(root: Storage, known: Optional[Manifest], options: Optional[StoreOptions],
                      seen: Optional[Dict[int, Manifest]], known_is_newest: bool,
                      start: int) -> Tuple[Manifest, List[str]]:
    """:func:`load_newest_manifest` without the floor's check; ``start``: search from that
    generation up (the floor), not from ``known``."""
    if not root.reliable_listing:  # (an object store's listing may miss new objects: it is probed)
        return _newest_by_probing(root, known, options, seen, start)
    if known is not None and known.generation and known_is_newest:
        known, complete = read_forward(root, known, options=options, seen=seen)
        if complete:
            return known, []
    newest: Optional[int] = None
    if start:  # the floor: never collected while it is the floor (gone: it moved on; list)
        if file_exists(root, manifest_file(start)):
            newest = _probe_up(root, start)
    elif known is not None and known.generation:  # probe up from it rather than list (see newer_generation)
        newest = newer_generation(root, known.generation)
        if newest is None:
            return known, []
    if newest is not None:
        try:
            return read_manifest(root, newest, known=known, options=options, seen=seen), []
        except (FileNotFoundError, CorruptStoreError, FormatError):
            pass  # collected or damaged: the listing below finds the newest intact one
    for _ in range(MAX_RELISTS):
        problems: List[str] = []
        vanished = broken = False
        gens = list_generations(root)
        for gen in gens:
            try:
                return read_manifest(root, gen, known=known, options=options), problems
            except ManifestBaseMissingError as exc:
                # a clean-up removes a chain oldest first: its delta goes next, and the listing changes
                problems.append(exc.strerror)
                broken = True
            except FileNotFoundError:
                vanished = True  # deleted by the writer's clean-up between listdir and open
            except (CorruptStoreError, FormatError) as exc:
                problems.append(str(exc))
        if not vanished and not (broken and list_generations(root) != gens):
            break
    else:
        raise CorruptStoreError(f"the manifests of {root.url} kept vanishing while being read "
                                f"({MAX_RELISTS} listings): is something deleting them?")
    if problems:
        raise CorruptStoreError("no intact manifest in " + root.url + ": " + "; ".join(problems))
    return Manifest(), problems


def manifest_docs(root: StorageLike) -> Tuple[Dict[int, Manifest], Dict[int, str]]:
    """Intact manifests by generation, and the manifests that could not be read.

    A damaged manifest (bad JSON, checksum, format) is left out of both: it
    names nothing trustworthy. One that could not be *read* (EIO, EACCES, ...)
    is reported with its error: it may be intact and name files, so clean-up
    must not treat it, or the files it may name, as garbage.
    """
    root = as_storage(root)
    out: Dict[int, Manifest] = {}
    unreadable: Dict[int, str] = {}
    for gen in reversed(list_generations(root)):  # oldest first: a delta applies to the one before
        path = location(root, manifest_file(gen))
        try:
            out[gen] = read_manifest(root, gen, known=out.get(gen - 1))
        except (CorruptStoreError, FormatError, FileNotFoundError):
            continue
        except OSError as exc:
            unreadable[gen] = f"{path}: {exc}"
    return dict(sorted(out.items(), reverse=True)), unreadable


def read_manifest(root: StorageLike, generation: int, *, known: Optional[Manifest] = None,
                  options: Optional[StoreOptions] = None, seen: Optional[Dict[int, Manifest]] = None) -> Manifest:
    """Read, verify and parse manifest ``generation`` of ``root`` (a directory or a Storage);
    a delta is resolved as :func:`load_manifest` says."""
    root = as_storage(root)
    rel = manifest_file(generation)
    doc, verified = read_manifest_doc(root, rel)
    return _resolve(root, generation, doc, verified, location(root, rel), known, options, seen)


def read_forward(root: StorageLike, known: Manifest, *, options: Optional[StoreOptions] = None,
                 seen: Optional[Dict[int, Manifest]] = None, limit: int = FORWARD_READS) -> Tuple[Manifest, bool]:
    """The manifests after ``known`` in a local store, read in order until one is absent:
    ``(newest read, True)``; ``(newest read, False)`` when more than ``limit`` follow or one does
    not read (the caller probes and lists, as :func:`load_newest_manifest` does).

    Only for a ``known`` that was the newest generation less than ``retain_seconds / 2`` ago:
    a manifest is collected only after a newer one has existed for ``retain_seconds``, and
    every generation above ``known`` was created after it was the newest, so none of them,
    and not ``known``, can have been collected, and the first absent generation ends the
    contiguous run of present ones (the margin covers clocks of other hosts, as a commit's
    own files do). So the open of the next generation replaces the ``stat`` of the held one
    and of the next (:func:`newer_generation`): nothing new costs one failed open, each new
    commit the read of its file that catching up needs anyway.

    >>> import shutil, tempfile; root = tempfile.mkdtemp(); m = Manifest(generation=3)
    >>> read_forward(root, m) == (m, True)
    True
    >>> shutil.rmtree(root)
    """
    m = known
    for _ in range(limit):
        g = m.generation + 1
        try:
            m = read_manifest(root, g, known=m, options=options)
        except FileNotFoundError:
            return m, True
        except (OSError, CorruptStoreError, FormatError):
            return m, False
        if seen is not None:  # every one, full manifests too: a writer's clean-up need not read them again
            seen[g] = m
    return m, False


def newer_generation(root: StorageLike, held: int) -> Optional[int]:
    """The newest generation of ``root`` if it is above ``held``, else None, without listing
    ``manifests/`` (a multi-writer store keeps ``retain_seconds`` of them): the generations
    present above a present one are contiguous, so one or two probes tell that nothing is
    newer, and +1, +2, +4, ... then a binary search find the newest. A listing is the fallback
    when ``held`` itself is gone (collected).

    >>> import tempfile; newer_generation(tempfile.mkdtemp(), 0) is None
    True
    """
    root = as_storage(root)
    if held and file_exists(root, manifest_file(held)):
        newest = _probe_up(root, held)
    else:
        gens = list_generations(root)
        newest = _probe_up(root, gens[0]) if gens else 0
    return newest if newest > held else None


#: per storage handle: the newest generation it saw (where the next search starts), and the name
#: its last publish created when that was taken into account
_HINTS: "weakref.WeakKeyDictionary[Any, Tuple[int, str]]" = weakref.WeakKeyDictionary()


def _hint(storage: Storage) -> int:
    """The newest generation ``storage`` saw: found by a search, or created by its own publish."""
    hint, seen = _HINTS.get(storage, (0, ""))
    published = getattr(storage, "published", "")
    if published != seen:
        m = MANIFEST_NAME.match(published.rpartition("/")[2]) if published.startswith(f"{MANIFEST_DIR}/") else None
        hint = max(hint, int(m.group(1)) if m else 0)
        _HINTS[storage] = (hint, published)
    return hint


def _set_hint(storage: Storage, generation: int) -> None:
    _HINTS[storage] = (generation, getattr(storage, "published", ""))


def _newest_by_probing(storage: Storage, known: Optional[Manifest] = None, options: Optional[StoreOptions] = None,
                       seen: Optional[Dict[int, Manifest]] = None, start: int = 0) -> Tuple[Manifest, List[str]]:
    """The newest intact manifest of an object store, found with HEAD requests.

    Commits create generations N, N+1, ... in order and clean-up removes only
    old ones, so the generations present above any present one are
    contiguous: from a hint (the newest this storage saw before, else a
    listing, which may be stale) probe +1, +2, +4, ... until one is missing,
    then binary-search the gap. About 2 log2(commits since the hint) HEADs.
    Without a hint, or when the hint itself was collected, the search starts
    at the collection floor (``start``, else the one read here), which is never
    collected while it is the floor; only a store without a floor (written by
    an older diskreplay) is listed, and an empty listing of such a store is
    checked against generation 1 before it is taken for an empty store.
    """
    problems: List[str] = []
    for _ in range(MAX_RELISTS):
        hint = max(_hint(storage), start)
        newest = _probe_up(storage, hint) if hint else 0
        if newest == hint and (hint == 0 or not file_exists(storage, manifest_file(hint))):
            floor = read_floor(storage)
            low = max(floor or 0, 1)
            if floor is not None and file_exists(storage, manifest_file(low)):
                newest = _probe_up(storage, low)
            elif floor is not None and read_floor(storage) != floor:
                start = 0
                _set_hint(storage, 0)
                continue  # the floor moved past the generation it named: read it again
            else:
                # no floor (an older diskreplay's store), or its generation is lost (damage, or no
                # commit yet): a listing, which may lag, is all there is
                gens = list_generations(storage)
                low = gens[0] if gens else (1 if file_exists(storage, manifest_file(1)) else 0)
                newest = _probe_up(storage, low) if low else 0
        if newest == 0:
            return Manifest(), problems
        problems = []
        vanished = False
        for gen in range(newest, 0, -1):
            try:
                m = read_manifest(storage, gen, known=known, options=options, seen=seen)
            except ManifestBaseMissingError as exc:
                # a generation found by probing keeps its chain for retain_seconds after it is superseded
                problems.append(exc.strerror)
                continue
            except FileNotFoundError:
                vanished = gen == newest  # collected between the probe and the read: probe again
                break
            except (CorruptStoreError, FormatError) as exc:
                problems.append(str(exc))
                continue
            _set_hint(storage, gen)
            return m, problems
        if not vanished:
            break
        _set_hint(storage, 0)
    if problems:
        raise CorruptStoreError("no intact manifest in " + storage.url + ": " + "; ".join(problems))
    raise CorruptStoreError(f"the manifests of {storage.url} kept vanishing while being read: is something "
                            "deleting them?")


def _probe_up(storage: Storage, low: int) -> int:
    """The highest present generation above ``low`` (``low`` itself when none is)."""
    step = 1
    while file_exists(storage, manifest_file(low + step)):
        low += step
        step *= 2
    high = low + step
    while high - low > 1:
        mid = (low + high) // 2
        if file_exists(storage, manifest_file(mid)):
            low = mid
        else:
            high = mid
    return low
