"""The compiled kernels themselves (imported by :func:`diskreplay._jit.kernels` only: importing
this module imports numba, ~0.3 s).

>>> DISPATCHERS["check_pages"] is check_pages
True

Every kernel is a module-level function with ``cache=True`` and nothing of the process in it:
addresses (rows, the C library's CRC function) come in as int arguments. numba keys its on-disk
cache by the function's code and its closure; a kernel built inside a function closes over
objects that carry a fresh id in every process (an ``@intrinsic``'s, a dispatcher's), so each
process missed the cache, compiled again and added a file to it. Defined here, a process after
the first loads the machine code from the cache, and the cache holds one file per kernel and
signature.

Every loop writes through a view of its row (``dst = out[a:b]; dst[j] = ...``): indexing
``out[a + j]`` makes numba check for a negative index on every element, which keeps LLVM from
vectorising the loop.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["pair", "positions_and_mask", "check_pages", "DISPATCHERS"]


@intrinsic
def as_pointer(typingctx, address):
    """The int64 ``address`` as a ``void *`` (for ``numba.carray``)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))
    return types.voidptr(types.int64), codegen


@intrinsic
def crc32c_call(typingctx, function, crc, address, length):
    """``crc32c_extend(crc, address, length)`` of the C library at the address ``function``: an
    indirect call through an argument, so no address of this process is compiled in."""
    def codegen(context, builder, signature, args):
        bytes_ptr = ir.IntType(8).as_pointer()
        kind = ir.FunctionType(ir.IntType(32), [ir.IntType(32), bytes_ptr, ir.IntType(64)])
        target = builder.inttoptr(args[0], kind.as_pointer())
        return builder.call(target, [args[1], builder.inttoptr(args[2], bytes_ptr), args[3]])
    return types.uint32(types.int64, types.uint32, types.int64, types.int64), codegen


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


@njit(nogil=True, cache=True)
def check_pages(function, segments, rows, bounds):
    """The page checks of one read, every segment in one pass: ``segments[k]`` describes
    segment k (see ``Segment.page_check_table``), its rows are ``rows[bounds[k]:bounds[k + 1]]``.
    Each row not checked before has the pages of its values checked, each page once; a row is
    marked once all of its pages passed. ``(k, page)`` of the first page that fails, else
    ``(-1, -1)``. ``function``: the address of the C library's ``crc32c_extend``."""
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


#: every dispatcher of this module (tests read their cache statistics)
DISPATCHERS = {"fill": fill, "copy": copy, "pair": pair, "positions_and_mask": positions_and_mask,
               "check_pages": check_pages}
