"""``verify_store``: the read-only, thorough check of a store.

Where opening a store reads manifests and footers only, ``verify_store`` reads
every byte the newest intact commit references and checks it against the
manifest's sizes and CRC-32C checksums, parses every Arrow file, compares each
segment's schema with ``FORMAT.json``, rebuilds each group sidecar from its
segment's group-key column and compares, and checks that row ids are
contiguous. Every problem names its file.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import pyarrow as pa

from .. import format as fmt
from ..format import media as fmt_media
from .._fileio import TMP_PREFIX, crc32c
from ..errors import CorruptStoreError, FormatError
from ..segment import META_BUFFERS_KEY, ArrowFile, Segment, buffer_ranges, field_buffers
from ..format.sidecars import group_sidecar, inline_group, segment_local_rows
from ..format.states import decode_state
from .files import ROOT_NAMES, StoreFiles, progress_bar, where_in

QUARANTINE_DIR = fmt.QUARANTINE_DIR


# times verify starts again on a newer commit when a live writer collected files under it
CATCH_UPS = 20


#: a delta found without the manifest it applies to is looked for again after this long: a clean-up
#: removes a chain oldest first, so one in progress takes the delta next (lost otherwise: damage)
MISSING_BASE_RECHECK_SECONDS = 0.5


def verify_store(path: Any, progress: bool = False, *, storage_options: Optional[Dict[str, Any]] = None
                 ) -> Dict[str, Any]:
    """Check every file of the store at ``path`` without changing anything.

    Returns ``{"ok", "generation", "rows", "problems", "warnings",
    "checked_files", "checked_bytes"}``. ``ok`` is False exactly when there are
    problems: damaged, missing, hostile or inconsistent files, each named in
    its message. Unreferenced and temporary files are warnings (a crashed
    writer leaves them; the next writer removes them), unless they may be a
    live writer's commit in flight: younger than this check (of a commit after
    the manifest it checks) or, in a multi-writer store, than ``retain_seconds``. ``path`` may be
    ``s3://bucket/prefix`` (with ``storage_options``, or the ``AWS_*`` variables).

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(d) as store:
    ...     _ = store.extend({"prompt_id": [1, 1, 2], "completion_ids": [[1], [2, 3], []]})
    >>> report = verify_store(d)
    >>> report["ok"], report["rows"], report["problems"]
    (True, 3, [])
    >>> with open(os.path.join(d, "segments", "000000000000.arrow"), "r+b") as f:
    ...     _ = f.seek(-20, 2); _ = f.write(b"?")
    >>> report = verify_store(d)
    >>> report["ok"], "segments/000000000000.arrow" in report["problems"][0]
    (False, True)
    """
    files = StoreFiles.open(path, storage_options)
    try:
        for _ in range(CATCH_UPS):
            r = _verify_once(files, progress)
            # A live writer may have committed and collected files of the commit being
            # checked (legitimately): those are not damage. Check the newer commit instead.
            if r.generation == 0 or not r.problems or _newest_generation(files) <= r.generation:
                break
        return r.result()
    finally:
        files.close()


def _newest_generation(files: "StoreFiles") -> int:
    gens = fmt.list_generations(files.root)
    return gens[0] if gens else 0


def _verify_once(files: "StoreFiles", progress: bool) -> "Report":
    r = Report(files)
    started = time.time()
    if not files.is_store_dir():
        r.problem(f"{files.url} is not a directory")
        return r
    options = _check_format_file(r)
    # files a live writer may still commit (or, with many writers, one its clean-up keeps) are not
    # left-overs: younger than this check (it cannot see the commits made after its manifest), or
    # with many writers younger than retain_seconds (commits in flight, orphans not yet due)
    kept = 0.0
    if options is not None and options.multi_writer:
        kept = float(options.retain_seconds or fmt.DEFAULT_RETAIN_SECONDS)
    try:
        floor = fmt.read_floor(r.root)
    except (CorruptStoreError, FormatError) as exc:
        r.problem(f"{exc} (the collection floor: writers cannot commit until it is mended; `diskreplay "
                  "repair` writes it again)")
        floor = None
    manifests, damaged = scan_manifests(r, floor=floor)
    newest = manifests[0] if manifests else None
    if floor is not None and floor > (newest.generation if newest is not None else 0):
        r.problem(f"{where_in(r.root, fmt.FLOOR_FILE)}: the collection floor {floor} is above the newest manifest "
                  f"({newest.generation if newest is not None else 'none'}): the manifests at and above it are "
                  "lost (restore them from a backup)")
    for gen, message in damaged:
        r.problem(message)
    if newest is None and damaged:
        r.problem(f"{where_in(r.root, fmt.MANIFEST_DIR)}: no intact manifest; the store cannot open")
    if newest is not None:
        r.generation, r.rows = newest.generation, newest.num_rows
        _check_rows(r, newest, options)
        _check_segment_table(r, newest)
        options = with_late_columns(r, options, newest)
        files = _sized_files(newest)
        bar = progress_bar(progress, sum(b for _, b in files), "verify")
        try:
            for seg in newest.segments:
                _check_segment(r, seg, options, bar)
            for st in newest.states.values():
                _check_state(r, st, bar)
            for p in newest.patches:
                _check_patch(r, p, options, bar)
            for e in newest.media:
                _check_media(r, e, bar)
            _check_media_rows(r, newest, options)
            for log in newest.token_logs:
                problem = _check_checksum(r, log.file, log.bytes, log.crc32c, bar)
                if problem:
                    r.problem(problem)
            gi = newest.group_index
            if gi is not None:
                problem = _check_checksum(r, gi.file, gi.bytes, gi.crc32c, bar)
                if problem:  # derived data: readers warn and use the sidecars instead
                    r.warn(f"{problem} (the persisted group index; readers rebuild it from the group sidecars)")
        finally:
            if bar is not None:
                bar.close()
        # Older manifests are what a damaged newest one falls back to, and
        # what a reader that loaded them still opens: their files must exist.
        checked = set(newest.files())
        for m in manifests[1:]:
            for rel, size in _sized_files(m):
                if rel in checked or size == 0:
                    continue
                checked.add(rel)
                problem = check_size(r.files, rel, size)
                if problem and r.files.exists(m.file):
                    r.warn(f"{problem} (referenced by the older {m.file})")
    _scan_unreferenced(r, manifests, lambda rel: r.files.age(rel) < max(kept, time.time() - started
                                                                         + SNAPSHOT_MARGIN_SECONDS),
                       no_manifest=not manifests and not damaged)
    return r


#: a file written this long before verify began may belong to a commit made after its manifest was read
SNAPSHOT_MARGIN_SECONDS = 1.0


@dataclass
class Report:
    files: "StoreFiles"
    problems: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    generation: int = 0
    rows: int = 0
    checked_files: int = 0
    checked_bytes: int = 0

    @property
    def root(self) -> Any:
        return self.files.root

    def problem(self, message: str) -> None:
        self.problems.append(message)

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def result(self) -> Dict[str, Any]:
        return {"ok": not self.problems, "generation": self.generation, "rows": self.rows,
                "problems": self.problems, "warnings": self.warnings,
                "checked_files": self.checked_files, "checked_bytes": self.checked_bytes}


def _check_format_file(r: Report) -> Optional[fmt.StoreOptions]:
    path = where_in(r.files, fmt.FORMAT_FILE)
    try:
        size = r.files.format_file()
    except CorruptStoreError as exc:
        r.problem(str(exc))
        return None
    if size is None:
        r.problem(f"{path} is missing; this is not a diskreplay store")
        return None
    r.checked_files += 1
    r.checked_bytes += size
    try:
        return fmt.StoreOptions.read(r.root)
    except (CorruptStoreError, FormatError) as exc:
        r.problem(str(exc) if path in str(exc) else f"{path}: {exc}")
    except Exception as exc:  # verify reports; it never lets a damaged file crash it
        r.problem(f"{path} cannot be read ({type(exc).__name__}: {exc})")
    return None


def _load_manifest(files: StoreFiles, gen: int) -> fmt.Manifest:
    path = files.where(fmt.manifest_file(gen))
    try:
        return files.manifest(gen)
    except (CorruptStoreError, FormatError, FileNotFoundError):
        raise
    except Exception as exc:
        raise CorruptStoreError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None


def scan_manifests(r: Optional[Report], files: Optional[StoreFiles] = None, floor: Optional[int] = None
                    ) -> Tuple[List[fmt.Manifest], List[Tuple[int, str]]]:
    """Intact manifests newest first, and ``(generation, message)`` of damaged ones; those below the
    collection ``floor`` are collected ones a clean-up has not removed yet (or that a stale writer
    created in a collected slot), and are left out."""
    files = r.files if r is not None else files
    root = files
    intact, damaged, suspects = [], [], []
    for gen in fmt.list_generations(files.root):
        if floor is not None and gen < floor:
            continue
        try:
            m = _load_manifest(files, gen)
        except fmt.ManifestBaseMissingError as exc:
            suspects.append((gen, exc.strerror))  # lost, or a clean-up in progress removes the delta next
            continue
        except FileNotFoundError:
            continue
        except (CorruptStoreError, FormatError) as exc:
            msg = str(exc)
            path = where_in(root, fmt.manifest_file(gen))
            damaged.append((gen, msg if path in msg else f"{path}: {msg}"))
            continue
        if r is not None:
            r.checked_files += 1
        intact.append(m)
    if suspects:
        time.sleep(MISSING_BASE_RECHECK_SECONDS)
        still = set(fmt.list_generations(files.root))
        damaged += [(gen, msg) for gen, msg in suspects if gen in still]
        damaged.sort(key=lambda d: -d[0])
    return intact, damaged


def _check_rows(r: Report, m: fmt.Manifest, options: Optional[fmt.StoreOptions]) -> None:
    where = where_in(r.files, m.file)
    prev_end = None
    holes = dict(m.holes)  # (repair's: a gap no segment holds, recorded as one)
    for s in m.segments:
        if prev_end is not None and s.first_row != prev_end and holes.pop(prev_end, None) != s.first_row:
            r.problem(f"{where}: segment {s.id} starts at row {s.first_row}, expected {prev_end}")
        if s.id >= m.next_segment:
            r.problem(f"{where}: segment id {s.id} is not below next_segment {m.next_segment}")
        prev_end = s.end_row
    if m.segments:
        if not m.segments[0].first_row <= m.head < m.segments[0].end_row:
            r.problem(f"{where}: head {m.head} is not in the first segment "
                      f"[{m.segments[0].first_row}, {m.segments[0].end_row})")
        end = m.segments[-1].end_row
        if end != m.next_row and holes.pop(end, None) != m.next_row:
            r.problem(f"{where}: next_row {m.next_row} but the segments end at {end}")
    elif m.head != m.next_row:
        r.problem(f"{where}: live rows [{m.head}, {m.next_row}) but no segments")
    for a, b in holes.items():
        r.problem(f"{where}: the hole [{a}, {b}) is not a gap between its segments")
    if options is not None:
        if options.capacity_rows is not None and m.num_rows > options.capacity_rows:
            r.problem(f"{where}: {m.num_rows} live rows exceed capacity {options.capacity_rows} "
                      f"of {fmt.FORMAT_FILE}")
        if m.segments and options.schema is None:
            holder = fmt.schema_file(options, not r.files.storage.exclusive_lock)
            r.problem(f"{where} has rows but {where_in(r.files, holder)} "
                      f"{'is missing' if holder == fmt.SCHEMA_FILE else 'records no schema'} (it holds the "
                      "store's schema, fixed by its first append; restore it from a backup or a copy)")


def _check_segment_table(r: Report, m: fmt.Manifest) -> None:
    """A manifest's segment table holds exactly its JSON entries: a missing or damaged one is read
    past (readers take the entries; the next commit writes a new table), one of other entries is
    what readers would read."""
    t = m.segment_table
    if t is None:
        return
    where = where_in(r.files, t.file)
    raw = r.files.storage.read_bytes(m.file, fmt.MAX_JSON_BYTES)
    entries = fmt.Manifest.from_dict(fmt.parse_json(raw, where_in(r.files, m.file)), where_in(r.files, m.file),
                                     verified=True).segments
    try:
        data = r.files.storage.read_bytes(t.file, t.bytes)
        problem = (None if len(data) == t.bytes and crc32c(data) == t.crc32c
                   else f"has {len(data)} bytes, crc32c {crc32c(data):#010x}; the manifest records {t.bytes} bytes, "
                        f"{t.crc32c:#010x}")
        table = fmt.SegmentTable.from_bytes(data, where) if problem is None else None
    except (OSError, FormatError, CorruptStoreError) as exc:
        problem, table = f"cannot be read ({exc})", None
    if problem is not None:
        r.warn(f"{where} {problem}: readers read the segment entries of {where_in(r.files, m.file)} instead "
               "(nothing is lost; the next commit writes a new table)")
    elif table != entries:
        r.problem(f"{where} does not hold the segment entries of {where_in(r.files, m.file)}, yet readers take "
                  "their entries from it: remove that file (readers then read the entries; the next commit "
                  "writes a new table)")


def with_late_columns(r: "Report", options: Optional[fmt.StoreOptions],
                       m: fmt.Manifest) -> Optional[fmt.StoreOptions]:
    """``options`` whose schema is the store's at commit ``m`` (plus its late columns): segments
    older than a late column lack it, newer ones hold it with the recorded type."""
    if options is None or not m.late_columns:
        return options
    try:
        return replace(options, schema=fmt.store_schema(options.schema, m.late_columns, where_in(r.root, m.file)))
    except (CorruptStoreError, FormatError) as exc:
        r.problem(str(exc))
        return options


def _sized_files(m: fmt.Manifest) -> List[Tuple[str, int]]:
    out = []
    for s in m.segments:
        out.append((s.file, s.bytes))
        out.append((s.groups_file, s.groups_bytes))
    out += [(st.file, st.bytes) for st in m.states.values()]
    out += [(t.file, t.bytes) for t in m.token_logs]
    out += [(p.file, p.bytes) for p in m.patches]
    out += [(e.file, e.bytes) for e in m.media]
    if m.group_index is not None:
        out.append((m.group_index.file, m.group_index.bytes))
    return out


def check_size(files: StoreFiles, rel: str, size: int) -> Optional[str]:
    return files.size_problem(rel, size)


def _check_checksum(r: Report, rel: str, size: int, crc: int, bar: Any) -> Optional[str]:
    """Size and CRC-32C of one file; the problem, or None."""
    problem = check_size(r.files, rel, size)
    if problem:
        return problem
    path = where_in(r.files, rel)
    got = r.files.crc(rel, size)
    r.checked_files += 1
    r.checked_bytes += size
    if bar is not None:
        bar.update(size)
    if got != crc:
        return f"{path} fails its checksum (crc32c {got:#010x}, the manifest records {crc:#010x}); the file is damaged"
    return None


def _check_segment(r: Report, s: fmt.SegmentEntry, options: Optional[fmt.StoreOptions], bar: Any) -> None:
    problem = _check_checksum(r, s.file, s.bytes, s.crc32c, bar)
    if problem:
        r.problem(problem)
        seg = None
    else:
        seg = _open_segment(r, s, options)
    if options is None:
        return  # FORMAT.json is the problem reported: nothing says whether the store has a group key
    group_key = options.group_key
    if group_key is None:
        if s.groups_bytes or s.group is not None:
            r.problem(f"{where_in(r.files, fmt.MANIFEST_DIR)}: segment {s.id} records a group "
                      f"{'sidecar' if s.group is None else 'key'} but {fmt.FORMAT_FILE} has no group key")
        return
    if s.group is not None:
        if seg is not None:
            problem = compare_inline_group(r.files, s, seg, group_key)
            if problem:
                r.problem(problem)
        return
    problem = _check_checksum(r, s.groups_file, s.groups_bytes, s.groups_crc32c, bar)
    if problem:
        r.problem(problem)
        return
    if seg is not None:
        problem = compare_sidecar(r.files, s, seg, group_key)
        if problem:
            r.problem(problem)


def _open_segment(r: Report, s: fmt.SegmentEntry, options: Optional[fmt.StoreOptions]) -> Optional[Segment]:
    path = where_in(r.files, s.file)
    try:
        seg = Segment(r.files.local(s.file, s.bytes), s.bytes, options.schema if options is not None else None,
                      s.num_rows)
        # full validation: offsets inside their buffers, monotone, etc.
        seg.batch.validate(full=True)
        return seg
    except CorruptStoreError as exc:
        r.problem(str(exc))
    except Exception as exc:
        r.problem(f"{path} is not a valid segment ({type(exc).__name__}: {exc})")
    return None


def compare_inline_group(files: StoreFiles, s: fmt.SegmentEntry, seg: Segment, group_key: str) -> Optional[str]:
    """A segment whose manifest entry names its one group (no sidecar): every row has that key."""
    try:
        ok = inline_group(seg.column(group_key)) == s.group
    except CorruptStoreError as exc:
        return str(exc)
    except Exception as exc:
        return f"{where_in(files, s.file)} cannot be checked ({type(exc).__name__}: {exc})"
    if not ok:
        return (f"{where_in(files, s.file)}: the manifest records that all its rows are group {s.group}, but its "
                f"{group_key!r} column holds other keys")
    return None


def compare_sidecar(files: StoreFiles, s: fmt.SegmentEntry, seg: Segment, group_key: str) -> Optional[str]:
    path = where_in(files, s.groups_file)
    root = files
    try:
        side = ArrowFile(files.local(s.groups_file, s.groups_bytes), s.groups_bytes).batch
        keys = seg.column(group_key)
        want = group_sidecar(keys, None if segment_local_rows(side) else s.first_row)
    except CorruptStoreError as exc:
        return str(exc)
    except Exception as exc:
        return f"{path} cannot be checked ({type(exc).__name__}: {exc})"
    if not side.schema.equals(want.schema) or not side.equals(want):
        return (f"{path} does not match the {group_key!r} column of {where_in(root, s.file)} "
                "(keys, counts or row ids differ)")
    raw = (side.schema.metadata or {}).get(META_BUFFERS_KEY)
    if raw is not None:  # (sidecars written before the key existed have none)
        recorded = buffer_ranges(raw, 0, s.bytes)
        if recorded is None or recorded.tolist() != field_buffers(seg.batch, seg.base_address).tolist():
            return (f"{path} records buffer ranges (diskreplay.buffers) that are not those of "
                    f"{where_in(root, s.file)}; reads are right but ask the disk for the wrong pages; "
                    "run `diskreplay repair`")
    return None


def _check_state(r: Report, st: fmt.StateEntry, bar: Any) -> None:
    problem = _check_checksum(r, st.file, st.bytes, st.crc32c, bar)
    if problem:
        r.problem(problem)
        return
    path = where_in(r.files, st.file)
    try:
        with open(r.files.local(st.file, st.bytes), "rb") as f:
            decode_state(f.read(), path)
    except CorruptStoreError as exc:
        r.problem(str(exc))
    except Exception as exc:
        r.problem(f"{path} is not a readable state file ({type(exc).__name__}: {exc})")


def _check_patch(r: Report, p: fmt.PatchEntry, options: Optional[fmt.StoreOptions], bar: Any) -> None:
    """A patch file as a segment is checked: size, CRC-32C, then what it holds (docs/FORMAT.md, "Patches")."""
    problem = _check_checksum(r, p.file, p.bytes, p.crc32c, bar)
    if problem:
        r.problem(f"{problem} (a patch: values of {list(p.columns)} for {p.num_rows} rows in "
                  f"[{p.first_row}, {p.end_row}))")
        return
    try:
        with open(r.files.local(p.file, p.bytes), "rb") as f:
            data = pa.py_buffer(f.read())
        fmt.parse_patch(data, p, where_in(r.files, p.file), check=False,
                        schema=options.schema if options is not None else None)
    except CorruptStoreError as exc:
        r.problem(str(exc))


def _check_media(r: Report, e: fmt.MediaEntry, bar: Any) -> None:
    """A media blob: size, CRC-32C, then its content hash (docs/FORMAT.md, "Media")."""
    what = f" (the media blob {e.hash[:16]}... ({e.mime}), named by rows up to {e.last_row})"
    problem = _check_checksum(r, e.file, e.bytes, e.crc32c, bar)
    if problem:
        r.problem(problem + what)
        return
    try:
        with open(r.files.local(e.file, e.bytes), "rb") as f:
            fmt_media.check_blob(f.read(), e, where_in(r.files, e.file), content=True)
    except CorruptStoreError as exc:
        r.problem(str(exc) + what)


def _check_media_rows(r: Report, m: fmt.Manifest, options: Optional[fmt.StoreOptions]) -> None:
    """Every live row's media hash is named by an entry whose ``last_row`` is at or after the row
    (else eviction could free a blob a live row names: a problem). A hash no entry names is a
    warning: ``repair`` dropped its damaged blob, and an append of the same content mends it."""
    names = [c.name for c in options.schema.columns.values() if c.media] if options and options.schema else []
    if not names:
        return
    last = {e.hash: e.last_row for e in m.media}
    unnamed: Dict[str, List[int]] = {}
    for s in m.segments:
        try:
            with open(r.files.local(s.file, s.bytes), "rb") as f:
                record = pa.ipc.open_file(pa.py_buffer(f.read())).get_batch(0)
        except Exception:
            continue  # (the segment's own check reports it)
        skip = max(0, m.head - s.first_row)
        for name in names:
            if name not in record.schema.names:
                continue
            for i, w in enumerate(fmt_media.hash_rows(record.column(name).slice(skip))):
                row, h = s.first_row + skip + i, fmt_media.hex_of(w)
                if h not in last:
                    unnamed.setdefault(h, []).append(row)
                elif last[h] < row:
                    r.problem(f"{where_in(r.files, m.file)}: row {row} names the media blob {h[:16]}... whose entry "
                              f"says its last row is {last[h]}: eviction would free it while the row lives")
    for h, rows in unnamed.items():
        r.warn(f"rows {rows[:8]}{' ...' if len(rows) > 8 else ''} name the media blob {h[:16]}..., which "
               f"{where_in(r.files, m.file)} does not name (repair dropped it as damaged): their media cannot be "
               "read until an append of the same content stores it again")


def referenced_files(manifests: Iterable[fmt.Manifest]) -> Set[str]:
    out: Set[str] = set()
    for m in manifests:
        out.add(m.file)
        out.update(rel for rel, size in _sized_files(m) if size or not rel.startswith(fmt.GROUPS_DIR))
    return out


def _scan_unreferenced(r: Report, manifests: List[fmt.Manifest], in_flight: Callable[[str], bool], *,
                       no_manifest: bool = False) -> None:
    referenced = referenced_files(manifests)
    files = r.files
    orphans = []
    for rel, is_dir in files.entries():
        path = where_in(files, rel)
        name = os.path.basename(rel)
        if "/" not in rel:
            if name in fmt.DATA_DIRS:
                if files.is_link(rel) or not is_dir:
                    r.problem(f"{path} is not a directory (a symlink is not allowed)")
            elif name == QUARANTINE_DIR:
                n = files.quarantined()
                if is_dir and n:
                    r.warn(f"{path} holds {n} quarantined file(s), set aside by a repair or by a writer that found "
                           "no manifest (nothing there is read; look at them, then remove them)")
            elif name.startswith(TMP_PREFIX):
                if not in_flight(rel):
                    r.warn(f"{path} is a temporary file left by an interrupted write")
            elif name not in ROOT_NAMES:
                r.warn(f"{path} is not part of a diskreplay store")
            continue
        if rel in referenced or not is_dir and not files.is_link(rel) and in_flight(rel):
            continue
        if name.startswith(TMP_PREFIX):
            r.warn(f"{path} is a temporary file left by an interrupted write")
        elif files.is_link(rel):
            r.warn(f"{path} is an unreferenced symlink")
        elif rel.startswith(fmt.MANIFEST_DIR + "/"):
            if not fmt.MANIFEST_NAME.match(name):
                r.warn(f"{path} is not a manifest name")
        elif no_manifest and not is_dir and files.size(rel):
            orphans.append(rel)
        else:
            r.warn(f"{path} is not referenced by any intact manifest")
    if orphans:
        r.problem(orphans_message(files, orphans))


def orphans_message(files: "StoreFiles", orphans: List[str]) -> str:
    orphans = sorted(orphans, key=lambda rel: (not rel.startswith(fmt.SEGMENT_DIR + "/"), rel))
    return (f"{where_in(files, fmt.MANIFEST_DIR)}: no manifest at all, yet {len(orphans)} data file(s) "
            f"({', '.join(orphans[:3])}{', ...' if len(orphans) > 3 else ''}): the store's manifests were "
            "deleted or lost (its rows are in these files), or its first commit crashed; a writer that "
            f"opens the store moves them to {fmt.QUARANTINE_DIR}/ (nothing is deleted); restore the "
            "manifests from a backup to get the rows back")
