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

The first call in a process costs ~1-2 s (numba's start-up; the machine code
itself is cached on disk by numba after the first compile).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import numpy as np

__all__ = ["kernels", "SUPPORTED"]

#: source and output dtypes the kernels handle; other dtypes take the numpy path
SUPPORTED = frozenset(np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                                            np.uint16, np.uint32, np.uint64, np.float32, np.float64))

_loaded: Optional[Any] = None
_failed = False
_crc_function: Optional[int] = None


def _build() -> Any:
    import numba
    from numba import njit, types
    from numba.extending import intrinsic

    @intrinsic
    def as_pointer(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.voidptr))
        return types.voidptr(types.int64), codegen

    # Every loop writes through a view of its row (``dst = out[a:b]; dst[j] = ...``): indexing
    # ``out[a + j]`` makes numba check for a negative index on every element, which keeps LLVM from
    # vectorising the loop.

    @njit(nogil=True, cache=True)
    def fill(dst, value):
        for j in range(dst.shape[0]):
            dst[j] = value

    @njit(nogil=True, cache=True)
    def copy(dst, address, kind):
        src = numba.carray(as_pointer(address), dst.shape[0], kind.dtype)
        for j in range(dst.shape[0]):
            dst[j] = src[j]

    @njit(nogil=True, cache=True)
    def pair(out, starts, first_kind, first_at, first_len, second_kind, second_at, second_len):
        """Row i of the stream, from ``starts[i]``: ``first_len[i]`` values read at address
        ``first_at[i]`` (zeros where it is 0), then ``second_len[i]`` values at ``second_at[i]``.
        ``*_kind``: an empty array of the source's dtype (the values are cast to ``out``'s)."""
        for i in range(first_len.shape[0]):
            middle = starts[i] + first_len[i]
            dst = out[starts[i]:middle]
            if first_at[i] == 0:
                fill(dst, 0)
            else:
                copy(dst, first_at[i], first_kind)
            dst = out[middle:middle + second_len[i]]
            if second_at[i] == 0:
                fill(dst, 0)
            else:
                copy(dst, second_at[i], second_kind)

    @njit(nogil=True, cache=True)
    def positions_and_mask(positions, mask, starts, prompt_len):
        """``positions``: 0, 1, ... over each row; ``mask``: 0 over its prompt, 1 over its completion."""
        for i in range(prompt_len.shape[0]):
            at, end = starts[i], starts[i + 1]
            row = positions[at:end]
            for j in range(row.shape[0]):
                row[j] = j
            fill(mask[at:at + prompt_len[i]], 0)
            fill(mask[at + prompt_len[i]:end], 1)

    @intrinsic
    def crc32c_call(typingctx, function, crc, address, length):
        """``crc32c_extend(crc, address, length)`` of the C library at the address ``function``."""
        def codegen(context, builder, signature, args):
            from llvmlite import ir

            bytes_ptr = ir.IntType(8).as_pointer()
            kind = ir.FunctionType(ir.IntType(32), [ir.IntType(32), bytes_ptr, ir.IntType(64)])
            target = builder.inttoptr(args[0], kind.as_pointer())
            return builder.call(target, [args[1], builder.inttoptr(args[2], bytes_ptr), args[3]])
        return types.uint32(types.int64, types.uint32, types.int64, types.int64), codegen

    @njit(nogil=True, cache=True)
    def check_pages(function, segments, rows, bounds):
        """The page checks of one read, every segment in one pass: ``segments[k]`` describes
        segment k (see ``Segment.page_check_table``), its rows are ``rows[bounds[k]:bounds[k + 1]]``.
        Each row not checked before has the pages of its values checked, each page once; a row is
        marked once all of its pages passed. ``(k, page)`` of the first page that fails, else
        ``(-1, -1)``."""
        for k in range(segments.shape[0]):
            d = segments[k]
            n_rows, n_cols, n_pages, page_bytes, size, base = d[3], d[4], d[5], d[6], d[7], d[8]
            checked = numba.carray(as_pointer(d[0]), n_rows, np.uint8)
            first = numba.carray(as_pointer(d[1]), n_cols * n_rows, np.int64)
            count = numba.carray(as_pointer(d[2]), n_cols * n_rows, np.int64)
            verified = numba.carray(as_pointer(d[9]), n_pages, np.uint8)
            crcs = numba.carray(as_pointer(d[10]), n_pages, np.uint32)
            for i in range(bounds[k], bounds[k + 1]):
                r = rows[i]
                if checked[r]:
                    continue
                for c in range(n_cols):
                    at = c * n_rows + r
                    for page in range(first[at], first[at] + count[at]):
                        if verified[page]:
                            continue
                        start = page * page_bytes
                        if crc32c_call(function, np.uint32(0), base + start, min(page_bytes, size - start)) \
                                != crcs[page]:
                            return k, page
                        verified[page] = 1
                checked[r] = 1
        return -1, -1

    class Kernels:
        __slots__ = ()
        stream = staticmethod(pair)
        layout = staticmethod(positions_and_mask)
        pages = staticmethod(check_pages)

    return Kernels()


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


def kernels() -> Optional[Any]:
    """The compiled kernels (``.stream``, ``.layout``), or None when numba is not installed or
    ``DISKREPLAY_JIT`` is ``0`` (read on every call, so tests can switch paths)."""
    global _loaded, _failed
    if os.environ.get("DISKREPLAY_JIT", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    if _loaded is None and not _failed:
        try:
            _loaded = _build()
        except ImportError:
            _failed = True
        except Exception as exc:  # numba present but unusable here (e.g. no writable cache directory)
            _failed = True
            warnings.warn(f"diskreplay: numba's kernels could not be built ({exc}); packed batches take "
                          "the numpy path (set NUMBA_CACHE_DIR to a writable directory, or DISKREPLAY_JIT=0 "
                          "to silence this)", RuntimeWarning, stacklevel=3)
    return _loaded
