"""Freed memory handed back to the system. glibc keeps what a process frees below its mmap threshold (which rises
to 32 MB once a block that large has been freed) in its heap for later allocations, and gives back only the free
top of it. A pass that allocates many tensors of a few MB and frees them in another order than it took them (a
backward pass, a stage's batches) leaves the heap holding free pages between live ones: on the 1.1B shape's local
effects, 1.8 GiB of them after one batch's gradient passes, counted in the process's RSS and in every later
stage's peak. Mapping every such tensor instead (a low mmap threshold) returns them too, at 30 % more time there,
and only in a heap that has not grown yet: glibc serves an allocation from its free chunks before it maps one (a
256 KiB threshold set before the 1.1B shape's loss stage, after its local effects: 5.71 GiB peak, 5.66 without).
"""

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library: macOS, musl)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed() -> bool:
    """Give the free pages of the heap back to the system (glibc's malloc_trim(0): the free top, and every free
    page inside it); whether any was given. Memory still in use is untouched. A no-op without glibc."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
