"""Compiled kernels for building packed batches, used when numba is installed.

``pip install diskreplay[fast]`` installs numba; :func:`diskreplay.collate_packed`
then writes each output column in one compiled pass over the rows, reading
every row straight from where it lies (a segment's memory map, or a batch's
values), instead of joining ~1,000 numpy views per column. Without numba, or
with ``DISKREPLAY_JIT=0`` in the environment, the numpy path runs; both give
the same bytes (tests compare them).

Why: the numpy path's per-row Python work (a view and a piece of a join per
row and column) is gone, and the writes run at the machine's memory bandwidth
(``tools/bench.py sample``).

Rows are passed by address: a column's rows of one read lie in dozens of
segment maps, and handing numba a list of arrays (``numba.typed.List``) costs
more than the copy. The caller computes every row's
start address from arrays it keeps alive during the call, and checks that
each row's range lies inside its array; the kernel trusts both.

The kernels live in :mod:`.compiled` (imported on first use: importing numba costs
~0.3 s), defined at module level with nothing of the process in them, so numba
compiles them once per machine (and numba or diskreplay version) and every later
process loads the machine code from numba's cache, one file per kernel and
signature (``tests/test_kernel_cache.py``).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from typing import Any, Callable, Optional, TypeVar

import numpy as np

__all__ = ["kernels", "kernels_now", "SUPPORTED", "dispatchers", "drop_stale_cache"]

#: source and output dtypes the kernels handle; other dtypes take the numpy path
SUPPORTED = frozenset(np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                                            np.uint16, np.uint32, np.uint64, np.float32, np.float64))

_loaded: Optional[Any] = None
_failed = False
_crc_function: Optional[int] = None
_loading: Optional[threading.Thread] = None
_lock = threading.Lock()  # held while the kernels load
_starting = threading.Lock()  # held while the loading thread is made (never while they load)


def _build() -> Any:
    from . import compiled

    drop_stale_cache()

    class Kernels:
        __slots__ = ()
        stream = staticmethod(compiled.pair)
        layout = staticmethod(compiled.positions_and_mask)
        pages = staticmethod(compiled.check_pages)

    return Kernels()


def dispatchers() -> dict:
    """``{name: numba dispatcher}`` of every compiled kernel (their ``.stats`` say which
    signatures came from numba's cache and which were compiled); empty without the kernels."""
    if kernels() is None:
        return {}
    from . import compiled

    return dict(compiled.DISPATCHERS)


def drop_stale_cache() -> int:
    """Remove the cache files of kernels that older versions built inside a function
    (``_jit._build.locals.*``: those missed the cache in every process and added a file to it
    each time), and those of kernels of :mod:`.compiled` at lines they no longer start at (an
    older diskreplay's: numba names a kernel's files by its line and keeps them), from the
    directories numba would have put them in. The number of files removed. With these gone the
    cache holds one index per kernel and one file per signature it was called with.

    >>> drop_stale_cache() >= 0
    True
    """
    try:
        from numba.core import config
        from numba.core.caching import _CacheLocator
        from numba.misc.appdirs import AppDirs
    except ImportError:
        return 0
    # numba's three places for a module's cache: beside it, NUMBA_CACHE_DIR, the user's cache
    from . import compiled

    current = {f"compiled.{name}-{d.py_func.__code__.co_firstlineno}." for name, d in compiled.DISPATCHERS.items()}

    def stale(name: str) -> bool:
        if name.startswith("_jit._build.locals."):
            return True
        return name.startswith("compiled.") and not any(name.startswith(c) for c in current)

    places = []
    for source in (os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_jit.py"),
                   compiled.__file__):
        sub = _CacheLocator.get_suitable_cache_subpath(source)
        places += [os.path.join(os.path.dirname(source), "__pycache__"),
                   os.path.join(AppDirs(appname="numba", appauthor=False).user_cache_dir, sub)]
        if config.CACHE_DIR:
            places.append(os.path.join(config.CACHE_DIR, sub))
    removed = 0
    for place in places:
        try:
            names = os.listdir(place)
        except OSError:
            continue
        for name in names:
            if stale(name) and name.endswith((".nbi", ".nbc")):
                try:
                    os.unlink(os.path.join(place, name))
                    removed += 1
                except OSError:
                    pass
    return removed


def crc32c_function() -> Optional[int]:
    """The address of the C library's ``crc32c_extend(crc, bytes, length)`` that google_crc32c
    calls (hardware CRC where the CPU has it), or None when google_crc32c runs without it.

    >>> crc32c_function() is None or crc32c_function() > 0
    True
    """
    global _crc_function
    if _crc_function is None:
        _crc_function = 0
        try:
            import ctypes

            import google_crc32c
            from google_crc32c import _crc32c

            if google_crc32c.implementation == "c":
                # the extension module's handle finds the symbol in the library it links
                _crc_function = ctypes.cast(ctypes.CDLL(_crc32c.__file__).crc32c_extend, ctypes.c_void_p).value or 0
        except (ImportError, OSError, AttributeError):
            pass
    return _crc_function or None


def loaded() -> bool:
    """Whether the kernels are built in this process already (numba's start-up is paid)."""
    return _loaded is not None


def _switched_off() -> bool:
    return os.environ.get("DISKREPLAY_JIT", "1").strip().lower() in ("0", "off", "false", "no")


def kernels() -> Optional[Any]:
    """The compiled kernels (``.stream``, ``.layout``, ``.pages``), or None when numba is not
    installed or ``DISKREPLAY_JIT`` is ``0`` (read on every call, so tests can switch paths).
    Waits for numba's start-up (~1 s with the machine code in numba's cache) where
    :func:`kernels_now` does not."""
    global _loaded, _failed
    if _switched_off():
        return None
    if _loaded is None and not _failed:
        with _lock:
            if _loaded is None and not _failed:
                _load()
    return _loaded


def kernels_now() -> Optional[Any]:
    """The compiled kernels if this process has them ready, else None at once (the caller takes
    the numpy path) after starting their load on a thread of their own.

    Why: numba's start-up costs ~1 s in every new process even when the machine code comes
    from its cache (importing numba, then its typing and lowering registries), ~30 times a
    batch: a restarted trainer's first batch would wait for it. The numpy paths give the same
    bytes, so the first batches take them while numba starts beside them.

    >>> k = kernels_now()  # None while numba starts (or without numba), else the kernels
    """
    if _switched_off():
        return None
    if _loaded is None and not _failed and _loading is None:
        if _batch.depth:
            _batch.wanted = True  # started when the batch is done (see deferring)
        else:
            _start_loading()
    return _loaded


class _Batch(threading.local):
    depth = 0
    wanted = False


_batch = _Batch()
F = TypeVar("F", bound=Callable[..., Any])


def deferring(fn: F) -> F:
    """Decorate a read or collate: numba's load that :func:`kernels_now` starts inside it begins
    when the outermost such call on this thread returns, so that the batch that asked for the
    kernels does not share the CPU (and the GIL: numba's start-up is Python) with their load."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _batch.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _batch.depth -= 1
            if not _batch.depth and _batch.wanted:
                _batch.wanted = False
                _start_loading()
    return wrapper  # type: ignore[return-value]


def _start_loading() -> None:
    global _loading
    with _starting:
        if _loading is not None or _loaded is not None or _failed:
            return
        # a daemon: a short job that read one batch must not wait ~1 s at exit for kernels it will
        # not use (a daemon thread is parked, not unwound, when the interpreter finalizes)
        _loading = threading.Thread(target=_load_in_background, name="diskreplay-jit", daemon=True)
        _loading.start()


def _load_in_background() -> None:
    with _lock:
        if _loaded is None and not _failed:
            _load(warm=True)


def _wait_for_loading() -> None:
    """Before a fork: a child must not inherit an import that a thread of ours is half-way
    through (its module locks would stay held in the child forever)."""
    thread = _loading
    if thread is not None and thread is not threading.current_thread():
        thread.join()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_wait_for_loading)


def _load(warm: bool = False) -> None:
    """Build the kernels (``_lock`` held); ``warm``: also load the machine code of the
    signatures that reads and batches use, so that their first call does not wait for it."""
    global _loaded, _failed
    try:
        built = _build()
        if warm:
            _warm(built)
        _loaded = built
    except ImportError:
        _failed = True
    except Exception as exc:  # numba present but unusable here (e.g. no writable cache directory)
        _failed = True
        warnings.warn(f"diskreplay: numba's kernels could not be built ({exc}); packed batches take "
                      "the numpy path (set NUMBA_CACHE_DIR to a writable directory, or DISKREPLAY_JIT=0 "
                      "to silence this)", RuntimeWarning, stacklevel=3)


def _warm(built: Any) -> None:
    """Call every kernel once on empty arrays of the dtypes a store holds (int32 ids, float32
    log-probs) and the outputs built from them: numba loads (or compiles) each signature then."""
    none = np.zeros(0, dtype=np.int64)
    built.pages(0, np.zeros((0, 11), dtype=np.int64), none, np.zeros(1, dtype=np.int64))
    built.layout(none, none.copy(), np.zeros(1, dtype=np.int64), none)
    for out, source in ((np.int64, np.int32), (np.int32, np.int32), (np.float32, np.float32)):
        kind = np.zeros(0, dtype=source)
        built.stream(np.zeros(0, dtype=out), none, kind, none, none, kind, none, none)
