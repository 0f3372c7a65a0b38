"""The outputs of the dataset tools: files and directories that appear whole or not at all,
Ctrl-C deferred to safe points while they are written, and progress bars."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import signal
import sys
import threading
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, Union

from .._fileio import fsync_dir, sized_progress_bar
from ..errors import DiskReplayError, ExportError, OutputExistsError, OutputIOError
from ..format import FORMAT_FILE, MANIFEST_DIR

PathLike = Union[str, "os.PathLike[str]"]


# ---------------------------------------------------------------------------
# Ctrl-C while an output is written


class _Interrupts:
    """Defers SIGINT to safe points while outputs are being written.

    Python raises ``KeyboardInterrupt`` wherever the main thread happens to
    be. Inside a zarr write that is in the middle of an ``asyncio`` call run
    on zarr's own event-loop thread, which keeps writing into the temporary
    directory after we removed it (a hidden ``.NAME.tmp-...`` came back) and
    prints loop tracebacks. So while an output is written the first Ctrl-C
    only sets a flag; the writer checks it between chunks (``check``), where
    no library call is in flight, and raises ``KeyboardInterrupt`` there;
    the usual clean-up then removes the temporary output. A second Ctrl-C
    raises at once, as Python would. Only the main thread can own a signal
    handler, and a handler the application installed is left alone: then
    nothing is deferred.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.hits = 0
        self.previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.hits += 1
        if self.hits > 1:
            raise KeyboardInterrupt

    def check(self) -> None:
        if self.hits:
            self.hits = 0
            raise KeyboardInterrupt

    @contextmanager
    def deferred(self) -> Iterator[None]:
        if self.depth:
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
            return
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield
            return
        self.hits, self.depth = 0, 1
        signal.signal(signal.SIGINT, self._handler)
        try:
            yield
        finally:
            self.depth = 0
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self.check()  # a Ctrl-C after the last check still stops the program


_INTERRUPTS = _Interrupts()
#: ``with interrupts_deferred():`` Ctrl-C stops at the next :func:`check_interrupt`.
interrupts_deferred = _INTERRUPTS.deferred
#: raises ``KeyboardInterrupt`` when Ctrl-C was pressed inside :func:`interrupts_deferred`
check_interrupt = _INTERRUPTS.check


# ---------------------------------------------------------------------------
# Outputs appear whole or not at all


def temporary_sibling(path: str, tag: str) -> str:
    parent, base = os.path.split(path)
    return os.path.join(parent, f".{base}.{tag}-{os.getpid()}-{secrets.token_hex(4)}")


def remove_path(path: str) -> None:
    """Remove a file or directory tree if it exists; never raises for a missing path."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_tree(path: str) -> None:
    if os.path.isfile(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    for root, _dirs, files in os.walk(path):
        for f in files:
            _fsync_tree(os.path.join(root, f))
        fsync_dir(root)


def check_output(out: PathLike, overwrite: bool, replaceable: Any = None) -> str:
    """Absolute ``out``; raises if it exists (without ``overwrite``) or its directory does not.

    With ``overwrite``, an existing ``out`` is replaced only if
    ``replaceable(out)`` says it may be (default: a file, or an empty
    directory), so a typo never deletes a directory full of someone's work.
    """
    if str(os.fspath(out)).startswith(("s3://", "gs://", "az://")):
        raise ExportError(f"{out}: this output is written to a local path; write it here and copy it to the bucket")
    out = os.path.abspath(os.fspath(out))
    parent = os.path.dirname(out)
    above = parent
    while not os.path.lexists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ExportError(f"{above} is a file, so the output {out} cannot go {'in' if above == parent else 'under'} "
                          "it; choose a directory")
    if not os.path.isdir(parent):
        raise ExportError(f"the directory of the output {out} does not exist; create {parent} first")
    inside = parent
    while True:
        if os.path.isfile(os.path.join(inside, FORMAT_FILE)) and os.path.isdir(os.path.join(inside, MANIFEST_DIR)):
            raise ExportError(f"the output {out} would be inside the store at {inside}, whose directory holds the "
                              "store's own files only (verify reports anything else); write it elsewhere")
        up = os.path.dirname(inside)
        if up == inside:
            break
        inside = up
    if os.path.lexists(out):
        ok = replaceable(out) if replaceable is not None else (
            not os.path.isdir(out) or os.path.islink(out) or not os.listdir(out))
        if ok and not overwrite:
            raise OutputExistsError(f"{out} already exists; pass --overwrite (overwrite=True) to replace it")
        if not ok:  # (never suggest --overwrite for what it will not replace)
            if os.path.isdir(out) and not os.path.islink(out):
                what = "a directory with other contents" if os.listdir(out) else "a directory, and this output is a file"
            else:
                what = "a file, and this output is a directory"
            raise OutputExistsError(f"{out} exists and is not an output of this kind (it is {what}); "
                                    "refusing to replace it even with --overwrite: remove it yourself or "
                                    "choose another name")
    return out


def _appeared(out: str) -> OutputExistsError:
    return OutputExistsError(f"{out} appeared while this output was being written (another export to the same "
                             "path?); it was left as it is and nothing was written (pass --overwrite "
                             "(overwrite=True) to replace it)")


def _publish_new_file(tmp: str, out: str) -> None:
    """Give ``tmp`` the name ``out`` only if nothing has it (another export to the same path may have
    made it meanwhile): a hard link fails on an existing name, where a rename would replace it."""
    try:
        os.link(tmp, out)
    except FileExistsError:
        raise _appeared(out) from None
    except OSError as exc:  # a filesystem without hard links: the rename, after one more look
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(out):
            raise _appeared(out) from None
        os.rename(tmp, out)
        return
    os.unlink(tmp)


#: what to do when writing an output failed with this errno (the failures of the device written to,
#: not of the store read: those are the store's own errors)
_OUTPUT_FIXES = {
    errno.ENOSPC: "free space on its filesystem (or write it elsewhere) and run it again",
    errno.EDQUOT: "free space within your disk quota (or write it elsewhere) and run it again",
    errno.EFBIG: "the filesystem's largest file is smaller: write it elsewhere, or in parts (--policy-versions, "
                 "--limit)",
    errno.EROFS: "the filesystem is read-only: write it elsewhere",
    errno.EIO: "the device failed: check it (dmesg) or write it elsewhere",
}


def _output_message(exc: OSError, what: str, out: str) -> str:
    """``exc`` (a library's bare ``[Errno 28] Error writing bytes to file``) as one line naming
    the output and its format."""
    return (f"cannot write the {what} {out}: {os.strerror(exc.errno)} (errno {exc.errno}); nothing was left "
            f"behind: {_OUTPUT_FIXES[exc.errno]}")


@contextmanager
def atomic_output(out: PathLike, *, overwrite: bool, directory: bool, replaceable: Any = None,
                  what: Optional[str] = None) -> Iterator[str]:
    """Yield a temporary path beside ``out``; on success move it to ``out``.

    The temporary name starts with a dot in the same directory, so the final
    rename is atomic and an interrupted export leaves nothing under ``out``
    (an existing ``out`` is replaced only once the new one is complete). On
    any error the temporary output is deleted and the error re-raised. Ctrl-C
    is deferred to :func:`check_interrupt` points meanwhile (see
    :class:`_Interrupts`), and checked once more before the rename. With
    ``what`` (e.g. ``"parquet export"``), a full disk, a quota, a read-only
    filesystem or a device error while writing raises :class:`OutputIOError`
    naming ``what`` and ``out``.

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); out = os.path.join(d, "a.txt")
    >>> with atomic_output(out, overwrite=False, directory=False) as tmp:
    ...     _ = open(tmp, "w").write("hi")
    >>> os.listdir(d), open(out).read()
    (['a.txt'], 'hi')
    """
    out = check_output(out, overwrite, replaceable)
    with interrupts_deferred():
        tmp = temporary_sibling(out, "tmp")
        try:
            if directory:
                os.mkdir(tmp)
            yield tmp
            check_interrupt()
            _fsync_tree(tmp)
            if os.path.lexists(out):
                if not overwrite:
                    raise _appeared(out)
                if not directory and not os.path.isdir(out):
                    os.replace(tmp, out)
                else:
                    old = temporary_sibling(out, "old")
                    os.rename(out, old)
                    os.rename(tmp, out)
                    remove_path(old)
            elif directory:
                os.rename(tmp, out)
            else:
                _publish_new_file(tmp, out)
            fsync_dir(os.path.dirname(out))
        except OSError as exc:
            remove_path(tmp)
            if what is None or isinstance(exc, DiskReplayError) or exc.errno not in _OUTPUT_FIXES:
                raise
            raise OutputIOError(_output_message(exc, what, out), errno=exc.errno) from exc
        except BaseException:
            remove_path(tmp)
            raise


def replaceable_file(path: str) -> bool:
    """``overwrite`` of a file output may replace a file (or a link), never a directory."""
    return not os.path.isdir(path) or os.path.islink(path)


def replaceable_dir(*markers: str) -> Any:
    """``overwrite`` of a directory output may replace a link, an empty directory, or a
    directory holding one of ``markers`` (an earlier output of the same kind); never a
    file (a mistyped name, or a source and an output swapped, would lose it)."""
    def ok(path: str) -> bool:
        if os.path.islink(path):
            return True
        if not os.path.isdir(path):
            return False
        names = os.listdir(path)
        return not names or any(m in names for m in markers)
    return ok


#: Output names: what each extension says the file is. A compressed suffix
#: names no format we write (the bytes would not be what the name promises).
EXTENSION_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
                     ".json": "jsonl", ".zarr": "zarr"}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip")


def output_format(out: PathLike, format: Optional[str] = None, *, formats: Sequence[str] = ("parquet", "jsonl",
                  "hf", "zarr"), force: bool = False) -> str:
    """The format to write ``out`` in: ``format``, or the one its name says.

    Rules: ``.parquet`` / ``.pq`` are Parquet; ``.jsonl`` / ``.ndjson`` /
    ``.json`` JSONL; ``.zarr`` a Zarr archive; a name without an extension
    (or an existing directory) a Hugging Face dataset directory (``hf``).
    Any other extension needs an explicit ``format``. An explicit ``format``
    that disagrees with a known extension (``-f parquet out.jsonl``), or any
    format for a compressed name (``.gz`` ...: nothing is written compressed),
    is refused unless ``force``.

    >>> output_format("rollouts.jsonl"), output_format("ds"), output_format("a.zarr", "zarr")
    ('jsonl', 'hf', 'zarr')
    >>> output_format("rollouts.jsonl", "parquet")
    Traceback (most recent call last):
    ...
    diskreplay.errors.ExportError: rollouts.jsonl ends in .jsonl, which names jsonl, but the format asked is parquet; rename the output or pass --force (force=True) to write parquet into it anyway
    """
    path = os.fspath(out)
    name = os.path.basename(os.path.normpath(path))
    ext = os.path.splitext(name)[1].lower()
    choices = ", ".join(formats)
    if format is not None:
        if format not in formats:
            raise ExportError(f"format must be one of {choices}, got {format!r}")
        implied = EXTENSION_FORMATS.get(ext)
        if not force and (ext in _COMPRESSED or (implied is not None and implied != format)):
            says = "a compressed file, which diskreplay does not write" if implied is None else f"{implied}"
            raise ExportError(f"{name} ends in {ext}, which names {says}, but the format asked is {format}; "
                              f"rename the output or pass --force (force=True) to write {format} into it anyway")
        return format
    if ext in EXTENSION_FORMATS:
        fmt = EXTENSION_FORMATS[ext]
    elif not ext or os.path.isdir(path):
        fmt = "hf"
    else:
        hint = (f"; diskreplay writes uncompressed files: export to {name[:-len(ext)]} and compress that"
                if ext in _COMPRESSED else "")
        raise ExportError(f"cannot tell the output format from the name {name}: name it .parquet/.pq, "
                          f".jsonl/.ndjson/.json, .zarr or without an extension (a Hugging Face dataset "
                          f"directory), or pass --format ({choices}){hint}")
    if fmt not in formats:
        raise ExportError(f"{name} names a {fmt} output, but this command writes {choices}; "
                          "choose another name or pass --format")
    return fmt


# ---------------------------------------------------------------------------
# Progress


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_warned_tqdm = False


def progress_bar(total: Optional[int], desc: str, enabled: bool, unit: str = "rows") -> Any:
    """A tqdm bar on stderr, or a do-nothing bar when disabled or tqdm is missing."""
    global _warned_tqdm
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        if not _warned_tqdm:
            _warned_tqdm = True
            warnings.warn("progress bars need tqdm: pip install 'diskreplay[progress]'", RuntimeWarning,
                          stacklevel=3)
        return _NoBar()
    return sized_progress_bar(tqdm, sys.stderr, total=total, desc=desc, unit=unit, unit_scale=True, leave=False)
