"""Arrow IPC files of a store: row segments, their page checksums and memory maps.

A segment is one uncompressed Arrow IPC *file* holding one record batch of
unpadded rows. It is read through a memory map: opening parses the footer
only, and every column comes back as numpy views of the mapped pages, so a
read touches just the bytes it returns.

One module: a segment's map, its pages' checksums and the record of pages already checked
change together (every read path goes through all three).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa

from . import _jit
from ._fileio import crc32c, first_bad_page, read_exactly
from ._ranges import coalesce
from .errors import CorruptStoreError, StoreIOError
from .ragged import data_address, numpy_view
from .schema import Schema

_PAGE = mmap.PAGESIZE
# byte ranges closer than this are hinted with one madvise (see ArrowFile.advise)
_ADVISE_GAP = 64 << 10


def _libc_mincore():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int
    return fn


_mincore = _libc_mincore()
# Page checksums of a segment live in its group sidecar's schema metadata.
PAGE_BYTES = 8192
# ... for segments of at least this many bytes. A smaller one (a commit of a few rows) is checked whole
# against its manifest CRC-32C when first opened, as a segment without a sidecar is: reading all of it
# costs no more than paging it, and a small commit does not pay for page checksums and buffer ranges.
PAGED_SEGMENT_BYTES = 64 << 10
# reads of at least this many rows start the compiled page checks (check_rows_of_parts)
COMPILED_CHECK_ROWS = 64
_META_PAGE_BYTES = b"diskreplay.page_bytes"
META_PAGE_CRCS = b"diskreplay.page_crc32c"  # little-endian uint32, one per page of the segment file
_META_BODY = b"diskreplay.body"  # "start end": byte range of the record batch's body (its buffers)
# little-endian int64 "start end" per field of the segment, in field order: the bytes of the field's
# buffers a read needs whatever its rows (all of them but a ragged column's values)
META_BUFFERS_KEY = b"diskreplay.buffers"
_IPC_OPTIONS = pa.ipc.IpcWriteOptions()  # the defaults (uncompressed), built once
# Arrow type id -> numpy dtype of the fixed-width numbers a segment's columns are viewed as (Segment._view)
_DTYPES = {t.id: np.dtype(t.to_pandas_dtype()) for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(),
                                                         pa.uint16(), pa.uint32(), pa.uint64(), pa.float16(),
                                                         pa.float32(), pa.float64())}
_OFFSETS = np.dtype(np.int64)  # a large_list's offsets


class PageChecksums:
    """CRC-32C of every ``page_bytes`` page of a segment file, and where its data buffers lie.

    A reader checks the pages outside ``body`` (Arrow's schema, batch header
    and footer) before parsing the file, and each data page the first time it
    reads from it, so nothing damaged is parsed or served while a sample of a
    few rows still reads only the pages those rows live in.
    """

    __slots__ = ("crcs", "page_bytes", "body", "verified", "buffers", "_crcs_u32")

    def __init__(self, crcs: np.ndarray, page_bytes: int, body: Tuple[int, int],
                 buffers: Optional[np.ndarray] = None) -> None:
        self.crcs, self.page_bytes, self.body = crcs, page_bytes, body
        # pages that passed, kept here so a segment unmapped and mapped again is not re-checked
        self.verified = np.zeros(len(crcs), dtype=bool)
        # [fields, 2] byte ranges of each field's buffers but a ragged column's values (see
        # field_buffers), or None (written before they were recorded): a cold read asks for them
        # together with the header and footer pages, before parsing the file
        self.buffers = buffers
        self._crcs_u32: Optional[np.ndarray] = None

    def crcs_u32(self) -> np.ndarray:
        """The checksums as one contiguous uint32 array (made once)."""
        if self._crcs_u32 is None:
            self._crcs_u32 = np.ascontiguousarray(self.crcs, dtype=np.uint32)
        return self._crcs_u32

    @classmethod
    def of(cls, data: pa.Buffer, page_bytes: int = PAGE_BYTES) -> "PageChecksums":
        # numpy slices: a pyarrow Buffer.slice per page cost more than the page's CRC
        b = np.frombuffer(data, dtype=np.uint8)
        crcs = np.array([crc32c(b[i:i + page_bytes]) for i in range(0, len(b), page_bytes)], dtype=np.uint32)
        return cls(crcs, page_bytes, *_record_batch_layout(data))

    def buffer_pages(self, fields: np.ndarray) -> Optional[np.ndarray]:
        """``[k, 2]`` ``[start, end)`` of the whole checksum pages holding the recorded buffers of the
        segment's ``fields`` (positions; those past the recorded ones and empty ranges skipped), or
        None when no buffers are recorded. Whole pages: checking a buffer reads the pages around it.

        >>> pc = PageChecksums(np.zeros(4, np.uint32), 512, (0, 2048), np.array([[100, 600], [700, 700]]))
        >>> pc.buffer_pages(np.array([0, 1, 5])).tolist()
        [[0, 1024]]
        """
        if self.buffers is None:
            return None
        p = self.page_bytes
        b = self.buffers[fields[fields < len(self.buffers)]]
        b = b[b[:, 1] > b[:, 0]]
        return np.stack([b[:, 0] // p * p, -(-b[:, 1] // p) * p], axis=1)

    def metadata(self) -> Dict[bytes, bytes]:
        meta = {_META_PAGE_BYTES: str(self.page_bytes).encode(),
                META_PAGE_CRCS: self.crcs.astype("<u4").tobytes(),
                _META_BODY: f"{self.body[0]} {self.body[1]}".encode()}
        if self.buffers is not None:
            meta[META_BUFFERS_KEY] = self.buffers.astype("<i8").tobytes()
        return meta

    @classmethod
    def from_metadata(cls, meta: Optional[Dict[bytes, bytes]], path: str) -> Optional["PageChecksums"]:
        if not meta or META_PAGE_CRCS not in meta:
            return None
        try:
            page_bytes = int(meta[_META_PAGE_BYTES])
            start, end = (int(x) for x in meta[_META_BODY].split())
            crcs = np.frombuffer(meta[META_PAGE_CRCS], dtype="<u4")
        except (KeyError, ValueError) as exc:
            raise CorruptStoreError(f"{path}: bad page checksums ({exc})") from None
        if page_bytes < 512 or not 0 <= start <= end:
            raise CorruptStoreError(f"{path}: bad page checksums")
        return cls(crcs, page_bytes, (start, end), buffer_ranges(meta.get(META_BUFFERS_KEY), start, end))


def pages_of(starts: np.ndarray, ends: np.ndarray, page_bytes: int) -> np.ndarray:
    """The page numbers holding the byte ranges ``[starts[i], ends[i])`` (empty ranges skipped; a
    page may repeat).

    >>> pages_of(np.array([0, 8190, 50]), np.array([10, 8200, 50]), 8192).tolist()
    [0, 0, 1]
    """
    keep = ends > starts
    first, last = starts[keep] // page_bytes, (ends[keep] - 1) // page_bytes
    counts = last - first + 1
    ends_at = np.cumsum(counts)
    return np.repeat(first - (ends_at - counts), counts) + np.arange(int(ends_at[-1]) if len(counts) else 0)


def has_page_checksums(nbytes: int) -> bool:
    """Whether a segment file of ``nbytes`` is checked page by page (else whole, when first opened).

    >>> has_page_checksums(20_000), has_page_checksums(4 << 20)
    (False, True)
    """
    return nbytes >= PAGED_SEGMENT_BYTES


def buffer_ranges(raw: Optional[bytes], body_start: int, body_end: int) -> Optional[np.ndarray]:
    """The ``[fields, 2]`` ranges of ``diskreplay.buffers`` (``raw``), or None when absent or not
    well formed (each range inside the body): a reader then finds the buffers by parsing the file,
    as before they were recorded. They only say which pages to ask for early; what is read is
    checked against the page checksums either way.

    >>> buffer_ranges(np.array([8, 16, 16, 16], dtype="<i8").tobytes(), 0, 64).tolist()
    [[8, 16], [16, 16]]
    >>> buffer_ranges(b"short", 0, 64) is None, buffer_ranges(np.array([8, 99], dtype="<i8").tobytes(), 0, 64)
    (True, None)
    """
    if not raw or len(raw) % 16:
        return None
    r = np.frombuffer(raw, dtype="<i8").reshape(-1, 2).astype(np.int64)
    # (count_nonzero: np.any goes through a Python wrapper; this runs for every segment a store opens)
    if np.count_nonzero(r[:, 0] > r[:, 1]) or \
            np.count_nonzero((r[:, 1] > r[:, 0]) & ((r[:, 0] < body_start) | (r[:, 1] > body_end))):
        return None
    return r


def field_buffers(batch: pa.RecordBatch, base_address: int) -> np.ndarray:
    """``[fields, 2]`` int64 ``[start, end)``, relative to ``base_address``, of each field's buffers
    that a read needs whatever its rows: a ragged (``large_list``) column's validity and offsets,
    every buffer of any other column (``[0, 0)`` for a field without such bytes). Arrow writes a
    field's buffers one after another, so one range per field covers them with nothing between
    but padding. (Every segment a writer writes pays this: plain loops, a type id compared.)

    >>> rb = pa.record_batch({"ids": pa.array([[1, 2], [3]], type=pa.large_list(pa.int32())),
    ...                       "reward": pa.array([0.5, 1.0])})
    >>> data = encode_ipc(rb)
    >>> r = field_buffers(pa.ipc.open_file(data).get_batch(0), data.address)
    >>> (r[:, 1] - r[:, 0]).tolist()  # the offsets (3 int64), the rewards (2 float64)
    [24, 16]
    """
    out = []
    for col in batch.columns:
        bufs = col.buffers()
        if col.type.id == _LARGE_LIST:
            bufs = bufs[:2]
        lo = hi = -1
        for b in bufs:
            if b is not None and b.size:
                a = b.address - base_address
                lo = a if lo < 0 or a < lo else lo
                hi = max(hi, a + b.size)
        out.append((lo, hi) if lo >= 0 else (0, 0))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


_LARGE_LIST = pa.large_list(pa.int8()).id


def _record_batch_layout(data: pa.Buffer) -> Tuple[Tuple[int, int], np.ndarray]:
    """``(body, field_buffers)`` of an IPC file of one batch: the body from the messages'
    framing, the buffers from the batch message alone (cheaper than opening the file, which
    reads the footer and builds a reader; reading the flatbuffer's buffer table in Python
    cost more than this)."""
    try:
        reader = pa.BufferReader(data)
        reader.seek(8)  # the file's magic, padded
        schema = pa.ipc.read_schema(pa.ipc.read_message(reader))
        message = pa.ipc.read_message(reader)
        if message.type == "record batch":
            end = reader.tell()
            batch = pa.ipc.read_record_batch(message, schema)
            return (end - message.body.size, end), field_buffers(batch, data.address)
    except (pa.ArrowInvalid, OSError):
        pass
    batch = pa.ipc.open_file(data).get_batch(0)  # a file with dictionaries (never written by a store)
    return batch_body(batch, data), field_buffers(batch, data.address)

def batch_body(batch: pa.RecordBatch, base: pa.Buffer) -> Tuple[int, int]:
    """Byte range of ``base`` from the first of ``batch``'s buffers to the end of the last."""
    spans = [(b.address - base.address, b.address - base.address + b.size)
             for col in batch.columns for b in col.buffers() if b is not None and b.size]
    return (min(a for a, _ in spans), max(e for _, e in spans)) if spans else (0, 0)


def frame_crc(data: pa.Buffer, body: Tuple[int, int]) -> int:
    """CRC-32C of the bytes of ``data`` outside ``body = (start, end)``."""
    return crc32c(data.slice(body[1]), crc32c(data.slice(0, body[0])))


_SMALL_IPC = 4 << 20  # below this, one pass into a growing buffer is cheaper than sizing it first


def encode_ipc(batch: pa.RecordBatch) -> pa.Buffer:
    """One record batch as the bytes of an uncompressed Arrow IPC file.

    A dry run into a byte-counting sink sizes the buffer exactly, so the real
    pass writes every byte once (a growing stream would reallocate and copy).
    A small batch (a commit of a few rows, a group sidecar) is written in one
    pass instead: the second writer cost more than the copies it saves.
    """
    def write(sink) -> None:
        with pa.ipc.RecordBatchFileWriter(sink, batch.schema, options=_IPC_OPTIONS) as writer:
            writer.write_batch(batch)

    if batch.get_total_buffer_size() < _SMALL_IPC:
        sink = pa.BufferOutputStream()
        write(sink)
        return sink.getvalue()
    mock = pa.MockOutputStream()
    write(mock)
    buf = pa.allocate_buffer(mock.size())
    write(pa.FixedSizeBufferWriter(buf))
    return buf


class ArrowFile:
    """A memory-mapped Arrow IPC file holding one record batch.

    ``path`` is opened with ``O_NOFOLLOW`` (a symlink planted in a store is
    refused) and its size checked against the manifest before parsing, so a
    truncated or swapped file gives ``CorruptStoreError`` naming it.
    """

    def __init__(self, path: str, expected_bytes: Optional[int] = None,
                 expected_crc: Optional[int] = None, pages: Optional[PageChecksums] = None, *,
                 whole: bool = False, frame: Optional[Tuple[int, int, int]] = None, copy: bool = False) -> None:
        """``copy``: read the file into memory with one ``read`` instead of mapping it (a small file
        read once and whole, as a merge reads its inputs: mapping it, advising and faulting in its
        pages cost more than copying it)."""
        self.path = path
        self.pages = pages
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink: nothing outside the store is read
                raise CorruptStoreError(f"cannot open {path}: it is a symlink, which a store never holds") from None
            # EIO, EMFILE, EACCES: not damage (a retry may work); the errno stays
            raise StoreIOError(exc.errno, f"cannot open the file ({exc.strerror or exc})", path) from None
        try:
            size = os.fstat(fd).st_size
            if expected_bytes is not None and size != expected_bytes:
                raise CorruptStoreError(f"{path} has {size} bytes but the manifest records {expected_bytes}; "
                                        "the file is truncated or was replaced")
            if size == 0:
                raise CorruptStoreError(f"{path} is empty")
            if copy:
                self._mmap: Optional[mmap.mmap] = None
                self._base = pa.py_buffer(read_exactly(fd, size, path))
                self.advised_all = True
            else:
                self._mmap = mmap.mmap(fd, size, prot=mmap.PROT_READ)
                # Rows are read at random: without this, each page fault reads ahead
                # (up to MBs on some VMs) and cold batches pay for bytes they never use.
                # Readers that need many pages ask for them explicitly (advise, advise_all).
                # ``whole``: a file read from end to end is read ahead as a whole
                try:
                    self._mmap.madvise(mmap.MADV_WILLNEED if whole else mmap.MADV_RANDOM)
                except (AttributeError, OSError):
                    pass
                self.advised_all = whole
                self._base = pa.py_buffer(self._mmap)
        finally:
            os.close(fd)
        self.size = size
        # Checksums are checked before Arrow parses a byte: a damaged file must
        # neither be served nor reach the parser (some flips crash it). With page
        # checksums only the non-data pages are checked here, data pages on first read.
        if pages is not None:
            n_pages = -(-size // pages.page_bytes)
            if len(pages.crcs) != n_pages or pages.body[1] > size:
                raise CorruptStoreError(f"{path}: its page checksums describe {len(pages.crcs)} pages, the file "
                                        f"has {n_pages}")
            self._verified = pages.verified
            p = pages.page_bytes
            head = np.arange(0, -(-pages.body[0] // p))
            tail = np.arange(pages.body[1] // p, n_pages)
            self._verify_pages(np.concatenate([head, tail]))
        elif frame is not None:
            # ``(body_start, body_end, crc32c)``: only the bytes outside the body are checked here; the
            # caller checks the body's buffers against checksums those bytes carry
            if frame[1] > size or frame_crc(self._base, frame[:2]) != frame[2]:
                raise CorruptStoreError(f"{path} fails its checksum (crc32c) outside its data; the file is "
                                        "damaged and is not served; run `diskreplay verify`")
        elif expected_crc is not None and crc32c(self._base) != expected_crc:
            raise CorruptStoreError(f"{path} fails its checksum (crc32c); the file is damaged and is not "
                                    "served; run `diskreplay verify` / `diskreplay repair`")
        try:
            reader = pa.ipc.open_file(self._base)
            if reader.num_record_batches != 1:
                raise CorruptStoreError(f"{path} holds {reader.num_record_batches} record batches; expected 1")
            self.batch = reader.get_batch(0)
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            if isinstance(exc, CorruptStoreError):
                raise
            raise CorruptStoreError(f"{path} is not a readable Arrow IPC file ({exc})") from None

    def _verify_pages(self, pages: np.ndarray) -> None:
        """Check the CRC of each given page not checked before (raises naming the file)."""
        todo = pages[~self._verified[pages]]
        if not len(todo):
            return
        # each page once, in file order (a read's pages per segment are few: Python's set beats
        # numpy's sort and compare there, and np.unique would import numpy.ma, ~80 ms once)
        ids = sorted(set(todo.tolist()))
        bad = first_bad_page(self._base, ids, self.pages.crcs[ids].tolist(), self.pages.page_bytes)
        if bad is not None:
            self.page_failed(bad)
        self._verified[ids] = True

    def page_failed(self, page: int) -> None:
        """Raise the error of a page whose checksum does not match."""
        p = self.pages.page_bytes
        raise CorruptStoreError(f"{self.path} fails its checksum at bytes [{page * p}, {(page + 1) * p}); the "
                                "file is damaged and is not served; run `diskreplay verify` / "
                                "`diskreplay repair`")

    @property
    def base_address(self) -> int:
        """The address of the file's first byte in memory (buffer addresses minus it are file offsets)."""
        return self._base.address

    def verify_whole(self, crc: int) -> None:
        """Check the whole file against its manifest CRC-32C (before its data is copied elsewhere)."""
        if crc32c(self._base) != crc:
            raise CorruptStoreError(f"{self.path} fails its checksum (crc32c); the file is damaged and is not "
                                    "copied; run `diskreplay verify` / `diskreplay repair`")
        if self.pages is not None:
            self._verified[:] = True

    def verify_span(self, start: int, end: int) -> None:
        """Check the pages holding bytes ``[start, end)`` of the file (no-op without page checksums)."""
        if self.pages is not None and end > start:
            p = self.pages.page_bytes
            first, stop = start // p, (end - 1) // p + 1
            # (a span checked already, as a read's fixed buffers are when their segment opens: one test)
            if np.count_nonzero(self._verified[first:stop]) < stop - first:
                self._verify_pages(np.arange(first, stop))

    def verify_ranges(self, ranges: np.ndarray) -> None:
        """Check the pages holding the ``[k, 2]`` byte ranges ``[start, end)`` of the file, all in
        one pass (no-op without page checksums)."""
        if self.pages is not None and len(ranges):
            self._verify_pages(pages_of(ranges[:, 0], ranges[:, 1], self.pages.page_bytes))

    def verify_buffers(self, arr: pa.Array) -> None:
        """Check every page holding a buffer of ``arr`` (``buffers()`` includes its children's)."""
        if self.pages is None:
            return
        base = self._base.address
        for b in arr.buffers():
            if b is not None and b.size:
                self.verify_span(b.address - base, b.address - base + b.size)

    def advise_all(self) -> None:
        """Ask the kernel to read the whole file ahead (for scans: export, compact)."""
        if not self.advised_all:
            self.advised_all = True
            try:
                self._mmap.madvise(mmap.MADV_WILLNEED)
            except OSError:
                pass

    def in_page_cache(self) -> bool:
        """Whether every page of the file is in the page cache (``mincore``: one call, a byte per
        page); False where that cannot be told (no map, not Linux, a file the caller may neither
        write nor owns, whose unmapped pages ``mincore`` reports as absent).

        >>> import tempfile
        >>> p = tempfile.mktemp(); _ = open(p, "wb").write(encode_ipc(pa.record_batch({"x": [1]})).to_pybytes())
        >>> isinstance(Segment(p).in_page_cache(), bool)
        True
        >>> os.remove(p)
        """
        if self._mmap is None or _mincore is None or not self.size:
            return False
        pages = np.empty(-(-self.size // _PAGE), dtype=np.uint8)
        if _mincore(self._base.address, self.size, pages.ctypes.data) != 0:
            return False
        return bool(np.count_nonzero(pages & 1) == len(pages))

    def span_in_page_cache(self, start: int, end: int) -> bool:
        """Whether every page of the mapped addresses ``[start, end)`` is in the page cache (one
        ``mincore``); False where that cannot be told (see :meth:`in_page_cache`)."""
        if self._mmap is None or _mincore is None:
            return False
        if end <= start:
            return True
        base = self._base.address
        first = base + (start - base) // _PAGE * _PAGE
        pages = np.empty(-(-(end - first) // _PAGE), dtype=np.uint8)
        if _mincore(first, end - first, pages.ctypes.data) != 0:
            return False
        return bool(np.count_nonzero(pages & 1) == len(pages))

    def advise(self, ranges: Any) -> None:
        """Ask the kernel to read the given ``(address, length)`` byte ranges ahead (WILLNEED).

        Ranges closer than ``_ADVISE_GAP`` are merged into one call: a batch's
        rows of one group lie side by side, and one ``madvise`` per row and
        column costs about as much as the read itself on a warm cache, while
        reading a few pages more costs next to nothing.
        """
        if self._mmap is None:  # a copy in memory: nothing to read ahead
            return
        r = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        r = r[r[:, 1] > 0]
        if not len(r):
            return
        # whole checksum pages: checking a row's values reads the checksum pages around them
        align = max(_PAGE, self.pages.page_bytes) if self.pages is not None else _PAGE
        lo = (r[:, 0] - self._base.address) // align * align
        hi = np.minimum(-(-(r[:, 0] - self._base.address + r[:, 1]) // align) * align, self.size)
        starts, ends = coalesce(lo, hi, _ADVISE_GAP)
        for a, b in zip(starts.tolist(), ends.tolist()):
            if b <= a:
                continue
            try:
                self._mmap.madvise(mmap.MADV_WILLNEED, a, b - a)
            except (OSError, ValueError):
                return


def prefetch_files(paths_and_ranges: List[Tuple[str, List[Tuple[int, int]]]]) -> None:
    """Ask the kernel to read byte ranges of files that are about to be opened
    (``posix_fadvise(WILLNEED)``: asynchronous), so that opening many cold
    files waits for their reads together instead of one after another.

    ``(path, [(offset, length), ...])`` pairs; a length of 0 means "to the
    end". Missing files are skipped (opening them reports it)."""
    for path, ranges in paths_and_ranges:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            for offset, length in ranges:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)


class Segment(ArrowFile):
    """One committed row segment, with numpy views of its columns.

    >>> import tempfile
    >>> rb = pa.record_batch({"x": pa.array([1, 2], type=pa.int64())})
    >>> p = tempfile.mktemp(); open(p, "wb").write(encode_ipc(rb).to_pybytes()) > 0
    True
    >>> Segment(p).scalar("x").tolist()
    [1, 2]
    """

    def __init__(self, path: str, expected_bytes: Optional[int] = None,
                 schema: Optional[Union[Schema, pa.Schema]] = None, num_rows: Optional[int] = None,
                 expected_crc: Optional[int] = None, pages: Optional[PageChecksums] = None, *,
                 copy: bool = False) -> None:
        super().__init__(path, expected_bytes, expected_crc, pages, copy=copy)
        if num_rows is not None and self.batch.num_rows != num_rows:
            raise CorruptStoreError(f"{path} holds {self.batch.num_rows} rows; the manifest records {num_rows}")
        if schema is not None:
            why = schema.segment_problem(self.batch.schema)
            if why is not None:
                raise CorruptStoreError(f"{path} disagrees with the store's schema (FORMAT.json and the manifest's "
                                        f"late columns): {why}")
        self.schema = schema
        self._cache: Dict[str, Any] = {}
        self._offset_keys: Dict[str, str] = {}
        self._states: Dict[str, tuple] = {}  # ragged column -> ragged_state
        self._rows_checked_for: Dict[tuple, np.ndarray] = {}  # ragged columns read together -> rows checked
        self._row_pages: Dict[tuple, Tuple[np.ndarray, np.ndarray]] = {}  # the same -> _page_spans (compiled)
        self._check_tables: Dict[tuple, np.ndarray] = {}  # the same -> page_check_table
        self._names = frozenset(self.batch.schema.names)  # (has: asked per column of every read)
        self._bytes: Optional[np.ndarray] = None  # the whole mapped file as uint8 (see _view)
        self._addresses: Dict[str, int] = {}  # ragged column -> where its values start (see ragged)

    @property
    def num_rows(self) -> int:
        return self.batch.num_rows

    def column(self, name: str) -> pa.Array:
        return self.batch.column(name)

    def has(self, name: str) -> bool:
        """Whether the segment holds column ``name`` (a late column is absent from older segments).

        >>> import tempfile
        >>> p = tempfile.mktemp(); _ = open(p, "wb").write(encode_ipc(pa.record_batch({"x": [1]})).to_pybytes())
        >>> Segment(p).has("x"), Segment(p).has("sampling_per_token_logps")
        (True, False)
        >>> os.remove(p)
        """
        return name in self._names

    def _absent_ragged(self, name: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A late ragged column this segment predates: every row null ("not computed")."""
        dtype = np.dtype(self.schema[name].dtype) if self.schema is not None and name in self.schema else np.float32
        n = self.num_rows
        return np.zeros(0, dtype=dtype), np.zeros(n + 1, dtype=np.int64), np.zeros(n, dtype=bool)

    def ragged(self, name: str) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """``(values, offsets, validity)`` numpy views of a ragged column (all rows null if it
        is a late column this segment does not hold)."""
        hit = self._cache.get(name)
        if hit is None and not self.has(name):
            hit = self._cache[name] = self._absent_ragged(name)
        if hit is None:
            arr = self.batch.column(name)
            bufs = arr.buffers()
            if self.pages is not None:
                base = self._base.address
                # validity and offsets (written one after the other: one check); values page by page
                # in check_rows_of
                spans = [(b.address - base, b.address - base + b.size) for b in bufs[:2] if b is not None and b.size]
                if spans:
                    self.verify_span(min(a for a, _ in spans), max(e for _, e in spans))
            child = arr.values
            offsets = self._view(bufs[1], _OFFSETS, arr.offset, len(arr) + 1)
            values = self._view(bufs[-1], _DTYPES.get(child.type.id), child.offset, len(child))
            if offsets is None or values is None:  # a layout the views below do not cover
                offsets, values = numpy_view(arr.offsets), numpy_view(child)
            else:  # (where the values start, for ragged_state: data_address costs ~7 us)
                self._addresses[name] = bufs[-1].address + child.offset * values.itemsize
            validity = None if arr.null_count == 0 else numpy_view(arr.is_valid())
            self._check_offsets(name, offsets, len(values))
            hit = self._cache[name] = (values, offsets, validity)
        return hit

    def _view(self, buf: Optional[pa.Buffer], dtype: Optional[np.dtype], offset: int,
              count: int) -> Optional[np.ndarray]:
        """``count`` elements of ``dtype`` from element ``offset`` of ``buf`` (a buffer of this file's
        batch), as a numpy view of the mapped file; None where that does not apply (no dtype or
        buffer, or a range outside the file). One view of the whole file is made once: a view of
        each buffer (``np.frombuffer`` through Arrow's buffer protocol, ``numpy_view``) cost ~10 us,
        ~300 times in a reopened store's first batch."""
        if dtype is None or buf is None:
            return None
        whole = self._bytes
        if whole is None:
            whole = self._bytes = np.frombuffer(self._base, dtype=np.uint8)
        start = buf.address - self._base.address + offset * dtype.itemsize
        end = start + count * dtype.itemsize
        if start < 0 or end > buf.address - self._base.address + buf.size or end > len(whole):
            return None
        return whole[start:end].view(dtype)

    def ragged_state(self, name: str) -> tuple:
        """``(values, offsets, validity, offsets_key, address)`` of ragged column ``name``: what a
        read needs of each segment it touches, in one call (:meth:`ragged`, :meth:`offsets_key`, and
        where the values start in this process's memory, the map staying put while the segment is
        open: compiled kernels read rows by address)."""
        state = self._states.get(name)
        if state is None:
            values, offsets, validity = self.ragged(name)
            address = self._addresses.get(name) if values.size else 0
            state = self._states[name] = (values, offsets, validity, self.offsets_key(name),
                                          data_address(values) if address is None else address)
        return state

    def rows_in_page_cache(self, names: Sequence[str], local_rows: np.ndarray) -> bool:
        """Whether the values of ``local_rows`` in the ragged columns ``names`` lie in pages all in
        the page cache: one ``mincore`` per run of those values (a batch's rows of one segment are a
        few groups, each side by side). Asking about the whole file (:meth:`in_page_cache`) cost
        ~0.3 ms a segment, ~40 times in a reopened store's first batch."""
        lo, hi = [], []
        for name in names:
            if self.has(name) and len(local_rows):
                values, offsets, _, _, address = self.ragged_state(name)
                if values.size:
                    lo.append(address + offsets[local_rows] * values.itemsize)
                    hi.append(address + offsets[local_rows + 1] * values.itemsize)
        if not lo:
            return True
        starts, ends = coalesce(np.concatenate(lo), np.concatenate(hi), _PAGE)
        return all(self.span_in_page_cache(a, b) for a, b in zip(starts.tolist(), ends.tolist()))

    def check_rows(self, name: str, local_rows: np.ndarray) -> None:
        """Check the pages holding the values of ``local_rows`` of a ragged column (once per row)."""
        self.check_rows_of((name,), local_rows)

    def check_rows_of(self, names: tuple, local_rows: np.ndarray) -> None:
        """Check the pages holding the values of ``local_rows`` in the ragged columns ``names`` (a
        read's), each row once: warm, one test for all of them; cold, the pages of every column
        found from a per-row table (built once per segment and column set) and checked in one pass.
        :func:`check_rows_of_parts` does the same for all the segments of a read at once."""
        if self.pages is None or not names:
            return
        checked = self._rows_checked(names)
        seen = checked[local_rows]
        # (count_nonzero: a third of ndarray.all's cost, which goes through a Python wrapper)
        if np.count_nonzero(seen) == len(seen):
            return
        todo = local_rows[~seen]
        # the pages of these rows only (a per-row table of the whole segment is the compiled check's)
        base, lo, hi = self._base.address, [], []
        for name in names:
            values, offsets, _, _, address = self.ragged_state(name)
            if values.size:
                start, item = address - base, values.itemsize
                lo.append(start + offsets[todo] * item)
                hi.append(start + offsets[todo + 1] * item)
        if lo:
            self._verify_pages(pages_of(np.concatenate(lo), np.concatenate(hi), self.pages.page_bytes))
        checked[todo] = True

    def _rows_checked(self, names: tuple) -> np.ndarray:
        """The record of rows whose values in ``names`` were checked."""
        checked = self._rows_checked_for.get(names)
        if checked is None:
            for name in names:
                self.ragged_state(name)  # (first: it checks the offsets, and may raise)
            checked = self._rows_checked_for[names] = np.zeros(self.num_rows, dtype=bool)
        return checked

    def page_check_table(self, names: tuple) -> Optional[np.ndarray]:
        """What the compiled page check reads of this segment for the ragged columns ``names``:
        int64 addresses and sizes of its row record, page table, page record and checksums and of
        its mapped bytes (the arrays stay referenced by this segment), or None for a segment
        without page checksums or with its own page fetching (an object store's)."""
        table = self._check_tables.get(names)
        if table is None:
            if self.pages is None or type(self)._verify_pages is not ArrowFile._verify_pages:
                return None
            checked = self._rows_checked(names)
            first, count = self._row_pages[names] = self._page_spans(names)
            p = self.pages
            table = self._check_tables[names] = np.array(
                [checked.ctypes.data, first.ctypes.data, count.ctypes.data, self.num_rows, len(names),
                 len(p.crcs), p.page_bytes, self.size, self._base.address, p.verified.ctypes.data,
                 p.crcs_u32().ctypes.data], dtype=np.int64)
        return table

    def _page_spans(self, names: tuple) -> Tuple[np.ndarray, np.ndarray]:
        """``(first page, page count)``, each ``[len(names), rows]``, of every row's values in the
        ragged columns ``names`` (count 0: no values)."""
        p = self.pages.page_bytes
        first = np.zeros((len(names), self.num_rows), dtype=np.int64)
        count = np.zeros((len(names), self.num_rows), dtype=np.int64)
        for k, name in enumerate(names):
            values, offsets, _, _, address = self.ragged_state(name)
            if not values.size:
                continue
            start = address - self._base.address
            lo = start + offsets[:-1] * values.itemsize
            hi = start + offsets[1:] * values.itemsize
            first[k] = lo // p
            count[k] = np.where(hi > lo, (hi - 1) // p - first[k] + 1, 0)
        return first, count

    def offsets_key(self, name: str) -> str:
        """The first ragged column (in asking order) whose offsets equal ``name``'s.

        Columns aligned with the same ids share it, so a read can compute its
        gather indices once for all of them.
        """
        key = self._offset_keys.get(name)
        if key is None:
            offsets = self.ragged(name)[1]
            # (the last offsets first: columns aligned with other ids almost always differ there)
            key = next((canon for canon in set(self._offset_keys.values())
                        if len(other := self.ragged(canon)[1]) == len(offsets)
                        and (not len(offsets) or other[-1] == offsets[-1]) and np.array_equal(other, offsets)), name)
            self._offset_keys[name] = key
        return key

    def _check_offsets(self, name: str, offsets: np.ndarray, n_values: int) -> None:
        # (count_nonzero of a comparison: no temporary of np.diff, once per segment and column)
        if len(offsets) and (offsets[0] < 0 or offsets[-1] > n_values or np.count_nonzero(offsets[1:] < offsets[:-1])):
            raise CorruptStoreError(f"{self.path}: column {name!r} has invalid offsets")

    def scalar(self, name: str, spec: Any = None) -> Any:
        """A per-row column as a numpy array (``[n, width]`` for vectors) or list of str.

        A late (float) column reads NaN in rows without a value, and in every row
        of a segment older than the column (``spec``, its schema entry, then
        gives the shape; default: the schema the segment was opened with).
        """
        hit = self._cache.get(name)
        if hit is None and not self.has(name):
            spec = spec if spec is not None else self.schema[name]
            shape = (self.num_rows,) + ((spec.width,) if spec.width else ())
            hit = self._cache[name] = np.full(shape, np.nan, dtype=np.dtype(spec.dtype))
        if hit is None:
            arr = self.batch.column(name)
            self.verify_buffers(arr)
            t = arr.type
            if pa.types.is_large_string(t) or pa.types.is_string(t):
                hit = arr
            elif pa.types.is_fixed_size_list(t):
                flat = numpy_view(arr.values)
                hit = flat.reshape(len(arr), t.list_size)
            else:
                hit = self._view(arr.buffers()[1], _DTYPES.get(t.id), arr.offset, len(arr))
                if hit is None:
                    hit = numpy_view(arr)
            if arr.null_count and not isinstance(hit, pa.Array):
                # only late float columns hold nulls (rows of a batch that left them out): NaN there
                hit = hit.astype(np.float64 if hit.dtype == np.float64 else np.float32)
                hit[~numpy_view(arr.is_valid())] = np.nan
            self._cache[name] = hit
        return hit

    def column_ranges(self, names: List[str], ragged: List[bool]) -> np.ndarray:
        """``[k, 2]`` ``(address, length)`` of the buffers reading ``names`` touches whatever the rows:
        every buffer of a per-row column, the validity and offsets of a ragged one (not its values)."""
        out = []
        for name, is_ragged in zip(names, ragged):
            arr = self.batch.column(name)
            bufs = arr.buffers()[:2] if is_ragged else arr.buffers()
            out += [(b.address, b.size) for b in bufs if b is not None and b.size]
        return np.array(out, dtype=np.int64).reshape(-1, 2)

    def value_ranges(self, name: str, local_rows: np.ndarray) -> np.ndarray:
        """``[k, 2]`` int64 ``(address, length)`` byte ranges that reading ``local_rows`` of a ragged
        column touches: one per row, then the column's offsets buffer."""
        values, offsets, _, _, addr = self.ragged_state(name)
        local_rows = np.asarray(local_rows, dtype=np.int64)
        if values.size == 0 or len(local_rows) == 0:
            return np.zeros((0, 2), dtype=np.int64)
        arr = self.batch.column(name)
        item = values.itemsize
        starts = offsets[local_rows].astype(np.int64)
        out = np.empty((len(local_rows) + 1, 2), dtype=np.int64)
        out[:-1, 0] = addr + starts * item
        out[:-1, 1] = (offsets[local_rows + 1] - starts) * item
        out[-1] = (arr.offsets.buffers()[1].address, 8 * (len(arr) + 1))
        return out


def check_rows_of_parts(parts: Sequence[Tuple["Segment", np.ndarray]], names: tuple) -> None:
    """Check the pages holding the values of each ``(segment, local rows)`` of a read in the
    ragged columns ``names``, as :meth:`Segment.check_rows_of` does: with the compiled kernels,
    every segment in one call (each page's CRC-32C by the C library, no Python per page or per
    segment), else segment by segment. Raises ``CorruptStoreError`` naming the file and bytes
    of the first page that fails.

    >>> check_rows_of_parts([], ("ids",))
    """
    if not names or not parts:
        return
    # a small read does not start numba (about a second, once a process): opening a store and
    # reading a few rows stays as fast as before; a batch starts it on a thread of its own and
    # takes the numpy path until it is ready (a restarted trainer's first batch does not wait)
    if not _jit.loaded() and sum(len(local_rows) for _, local_rows in parts) < COMPILED_CHECK_ROWS:
        kernels, function = None, None
    else:
        kernels = _jit.kernels_now()
        function = _jit.crc32c_function() if kernels is not None else None
    compiled, tables = [], []
    for seg, local_rows in parts:
        if seg.pages is None:
            continue  # checked whole when opened: its rows need no page checks
        table = seg.page_check_table(names) if kernels is not None and function else None
        if table is None:  # no kernels, or a segment that fetches its own pages (an object store's)
            seg.check_rows_of(names, local_rows)
        else:
            compiled.append((seg, local_rows))
            tables.append(table)
    if not compiled:
        return
    rows = np.concatenate([local_rows for _, local_rows in compiled]) if len(compiled) > 1 else compiled[0][1]
    bounds = np.zeros(len(compiled) + 1, dtype=np.int64)
    np.cumsum([len(local_rows) for _, local_rows in compiled], out=bounds[1:])
    bad, page = kernels.pages(function, np.stack(tables), np.ascontiguousarray(rows, dtype=np.int64), bounds)
    if bad >= 0:
        compiled[bad][0].page_failed(int(page))
