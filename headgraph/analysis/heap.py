"""Freed memory handed back to the system. glibc keeps what a process frees below its mmap threshold (which rises
to 32 MB once a block that large has been freed) in its heap for later allocations, and gives back only the free
top of it. A pass that allocates many tensors of a few MB and frees them in another order than it took them (a
backward pass, a stage's batches) leaves the heap holding free pages between live ones: on the 1.1B shape's local
effects, 1.8 GiB of them after one batch's gradient passes, counted in the process's RSS and in every later
stage's peak. Mapping every such tensor instead (a low mmap threshold) returns them too, at 30 % more time there,
and only in a heap that has not grown yet: glibc serves an allocation from its free chunks before it maps one (a
256 KiB threshold set before the 1.1B shape's loss stage, after its local effects: 5.71 GiB peak, 5.66 without).

Fresh memory asked for huge pages (`huge_pages_for`): a tensor larger than that threshold is a new mapping, and its
first write faults it in a 4 KiB page at a time.

A matrix held in bf16 and multiplied in float32 is upcast a chunk of rows at a time into one buffer
(`float32_rows`), never whole: no float32 copy of it is made, and each chunk is read from cache by its product.
"""

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_MADV_HUGEPAGE = 14  # Linux
_PAGE = 4096
MAPPED_BYTES = 32 * 2**20  # glibc's largest mmap threshold: a larger allocation is always a mapping of its own
ROW_CHUNK_BYTES = 8 * 2**20  # float32 rows of a stored matrix upcast at once (`row_buffer`)...
ROW_CHUNK_ROWS = 1024  # ...but at least this many: a narrower product runs below the GEMM's rate


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


@functools.cache
def _madvise():
    """The C library's madvise on Linux, or None."""
    name = ctypes.util.find_library("c") if sys.platform == "linux" else None
    advise = getattr(ctypes.CDLL(name), "madvise", None) if name else None
    if advise is not None:
        advise.argtypes, advise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return advise


def huge_pages_for(tensor: "torch.Tensor") -> "torch.Tensor":
    """`tensor` (a CPU tensor not yet written) with its memory advised for transparent huge pages (madvise
    MADV_HUGEPAGE over the whole pages it spans), so that its first write faults it in 2 MiB at a time: a float32
    copy of a 46 MB weight matrix into a new mapping took 15.8 ms, 4.6 ms so advised, 2.4 ms into memory written
    before. Only where the kernel's THP setting is `madvise` or `always` does it change anything; the memory and
    the values are the same either way. A no-op off Linux."""
    advise = _madvise()
    if advise is not None and tensor.device.type == "cpu":
        storage = tensor.untyped_storage()
        first = -(-storage.data_ptr() // _PAGE) * _PAGE
        end = (storage.data_ptr() + storage.nbytes()) // _PAGE * _PAGE
        if end > first:
            advise(first, end - first, _MADV_HUGEPAGE)
    return tensor


def mapped(tensor: "torch.Tensor") -> "torch.Tensor":
    """`tensor` (not yet written) in huge pages (`huge_pages_for`) where it is a CPU mapping of its own (over
    MAPPED_BYTES); smaller, it comes from glibc's heap and is left as it is (advice there would split the heap's
    mapping, and most of it is written before)."""
    return huge_pages_for(tensor) if tensor.untyped_storage().nbytes() > MAPPED_BYTES else tensor


def empty_mapped(like: "torch.Tensor", *size: int) -> "torch.Tensor":
    """like.new_empty(size), `mapped`."""
    return mapped(like.new_empty(size))


def row_buffer(weight: "torch.Tensor") -> "torch.Tensor":
    """A float32 buffer [rows, weight's columns] of about ROW_CHUNK_BYTES, at least ROW_CHUNK_ROWS rows and at most
    the weight's, on the weight's device, for `float32_rows`. The floor of rows is for the wide matrices, whose 8
    MiB are few rows: a chunk's product is as wide as its rows, and TinyLlama's down projection (5632 columns)
    times 6191 rows ran at 382 GFLOP/s by chunks of 372 rows, 437 by 1024 (Llama-3-8B's, 14336 columns: 304 by
    146 rows, 430 by 1024; the square GEMM's peak 468), its backward pass about as fast either way."""
    import torch

    rows = min(len(weight), max(ROW_CHUNK_ROWS, ROW_CHUNK_BYTES // (4 * weight.shape[1])))
    return torch.empty(rows, weight.shape[1], device=weight.device)


def float32_rows(weight: "torch.Tensor", buffer: "torch.Tensor | None" = None
                 ) -> "Iterator[tuple[slice, torch.Tensor]]":
    """(rows, weight[rows] in float32) over the first dimension of a matrix: the whole of a float32 one; else
    len(buffer) rows at a time upcast into `buffer` (`row_buffer(weight)` if None), each chunk valid until the next
    is drawn. Products by chunks of 8 MiB ran 13-35 % faster than the same products after a float32 copy of the
    whole matrix into new memory (TinyLlama's and Llama-3-8B's MLP matrices times 80 or 164 rows, forward and
    backward), and at most 26 % slower than on float32 weights held whole."""
    import torch

    if weight.dtype == torch.float32:
        yield slice(0, len(weight)), weight
        return
    buffer = row_buffer(weight) if buffer is None else buffer
    for start in range(0, len(weight), len(buffer)):
        part = weight[start:start + len(buffer)]
        yield slice(start, start + len(part)), buffer[:len(part)].copy_(part)


def rows_product(x: "torch.Tensor", weight: "torch.Tensor", bias: "torch.Tensor | None", out: "torch.Tensor",
                 buffer: "torch.Tensor | None" = None) -> "torch.Tensor":
    """x Wᵀ + b [n, W's rows] into `out`, in float32, W by `float32_rows` (bias: float32, or None)."""
    import torch

    for rows, part in float32_rows(weight, buffer):
        if bias is None:
            torch.mm(x, part.T, out=out[:, rows])
        else:
            torch.addmm(bias[rows], x, part.T, out=out[:, rows])
    return out


def rows_gradient(grad: "torch.Tensor", weight: "torch.Tensor", buffer: "torch.Tensor | None" = None
                  ) -> "torch.Tensor":
    """grad W [n, W's columns]: the gradient of x of `rows_product` given its output's, in float32, summed over
    W's rows chunk after chunk (`float32_rows`)."""
    out = None
    for rows, part in float32_rows(weight, buffer):
        out = grad[:, rows] @ part if out is None else out.addmm_(grad[:, rows], part)
    return out
