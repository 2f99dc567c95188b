"""The two exact kernels of the Projection Kernel engine.

PK(a, b) = ||U_a^T U_b||_F^2 = tr(P_a P_b) for orthonormal bases U (d x k) and projectors P = U U^T.

- "gram": a group's bases stacked as one (g k) x d matrix; a tile is one GEMM G = A B^T whose k x k' block
  (a, b) has PK(a, b) as its sum of squares. 2 d k k' FLOPs per pair.
- "projector": tr(P_a P_b) summed over the upper block triangle of P (block size b): each block row's diagonal
  block once, the blocks right of it twice, L = sum_i rows_i (d - i b) ~ d^2 / 2 + d b / 2 entries whatever the
  head width. The entries are cut into chunks (`projector_chunks`) that a pass builds for every head of every
  set at once (`build_chunk`: one batched GEMM per piece, 2 k FLOPs per entry) and contracts at once (one
  GEMM per tile and chunk, 2 FLOPs per entry and pair), so that each head's projector is built exactly once
  however small the memory budget: a smaller budget only means narrower chunks.

Both hold for any d x k matrices, not only orthonormal ones (||A^T B||_F^2 = <A A^T, B B^T>), which the
Composition Score uses. Nothing here loops over heads or pairs; same code on CUDA and CPU.
"""

from dataclasses import dataclass
from typing import get_args

import torch

from headgraph.analysis.options import Kernel

FORMULATIONS: tuple[Kernel, ...] = get_args(Kernel)
MIN_BLOCK = 64  # projector block size: at least this (fewer, larger GEMMs), at most d
GRAM_TILE_BYTES = 8 * 2**20  # a gram tile's Gram block stays this small: 8 MiB blocks ran 30 % faster than 128 MiB


def projector_block(d: int, width: int) -> int:
    """Block size b of the projector layout for head width `width` in R^d: max(width, 64), at most d."""
    return max(1, min(d, max(width, MIN_BLOCK)))


@dataclass(frozen=True)
class Piece:
    """Rows r0:r1, columns c0:c1 of every head's projector, counted `weight` times (1 on the diagonal blocks, 2
    right of them)."""

    r0: int
    r1: int
    c0: int
    c1: int
    weight: float

    @property
    def entries(self) -> int:
        return (self.r1 - self.r0) * (self.c1 - self.c0)


def projector_pieces(d: int, block: int, max_entries: int | None = None) -> list[Piece]:
    """The upper block triangle of a d x d projector as pieces of at most `max_entries` entries (whole blocks
    when None): the diagonal blocks, then each block row's part right of its diagonal block, split by columns
    where needed (the weight-1 pieces first, so that chunks hold many pieces)."""
    rows = [(r0, min(r0 + block, d)) for r0 in range(0, d, block)]
    spans = [(r0, r1, r0, r1, 1.0) for r0, r1 in rows] + [(r0, r1, r1, d, 2.0) for r0, r1 in rows if r1 < d]
    pieces = []
    for r0, r1, c_start, c_stop, weight in spans:
        width = c_stop - c_start if max_entries is None else max(1, max_entries // (r1 - r0))
        pieces += [Piece(r0, r1, c0, min(c0 + width, c_stop), weight) for c0 in range(c_start, c_stop, width)]
    return pieces


def projector_chunks(d: int, block: int, max_entries: int) -> list[tuple[Piece, ...]]:
    """Consecutive pieces grouped into chunks of at most `max_entries` entries (a piece is never wider than one
    chunk)."""
    chunks, current = [], []
    for piece in projector_pieces(d, block, max_entries):
        if current and sum(p.entries for p in current) + piece.entries > max_entries:
            chunks.append(tuple(current))
            current = []
        current.append(piece)
    return chunks + ([tuple(current)] if current else [])


def projector_length(d: int, block: int) -> int:
    """Entries L of one head's projector that the pass contracts: the upper block triangle, blocks of `block`."""
    return sum(p.entries for p in projector_pieces(d, block))


def vector_elements(formulation: str, d: int, k: int, block: int) -> int:
    """Elements one head occupies once built: its stacked basis (gram) or its projector's entries (projector)."""
    return d * k if formulation == "gram" else projector_length(d, block)


def build_flops(formulation: str, d: int, k: int, block: int) -> float:
    """FLOPs to build one head's vector (a copy for gram)."""
    return 0.0 if formulation == "gram" else 2.0 * k * projector_length(d, block)


def tile_flops(formulation: str, d: int, k_left: int, k_right: int, block: int) -> float:
    """FLOPs per (source, target) pair of a tile."""
    return 2.0 * d * k_left * k_right if formulation == "gram" else 2.0 * projector_length(d, block)


def build(bases: torch.Tensor) -> list[torch.Tensor]:
    """A group's stacked bases for the gram tile: one (g k) x d matrix."""
    g, d, k = bases.shape
    return [bases.transpose(1, 2).reshape(g * k, d)]


def build_chunk(bases: torch.Tensor, chunk: tuple[Piece, ...], buffer: torch.Tensor | None = None
                ) -> list[torch.Tensor]:
    """One chunk of every head's projector, one [n_heads, entries] matrix per piece (weights not applied: the
    tile applies them), written by one batched GEMM each into `buffer` (at least n_heads * the chunk's entries
    elements, reused across chunks so that no chunk faults in fresh memory) or a new one. A piece's entries are
    in the order of its transpose, columns c0:c1 by rows r0:r1 (P is symmetric and every head's are in the same
    order, so a tile's sums are the same): that GEMM's output is the tall one, 6-17 % faster on the CPU (200
    heads of d 2048, k 64, pieces 64 x 64 to 64 x 1984)."""
    n = bases.shape[0]
    size = n * sum(p.entries for p in chunk)
    buffer = torch.empty(size, dtype=bases.dtype, device=bases.device) if buffer is None else buffer
    out, offset = [], 0
    for p in chunk:
        piece = buffer[offset:offset + n * p.entries].view(n, p.c1 - p.c0, p.r1 - p.r0)
        torch.bmm(bases[:, p.c0:p.c1], bases[:, p.r0:p.r1].transpose(1, 2), out=piece)
        out.append(piece.view(n, p.entries))
        offset += n * p.entries
    return out


def tile(left: list[torch.Tensor], right: list[torch.Tensor], rows: slice, cols: slice, k_left: int,
         k_right: int) -> torch.Tensor:
    """Gram PK [s, t] of heads `rows` of the left group against heads `cols` of the right group (stacked bases)."""
    a = left[0][rows.start * k_left:rows.stop * k_left]
    b = right[0][cols.start * k_right:cols.stop * k_right]
    gram = (a @ b.T).square_()
    return gram.view(rows.stop - rows.start, k_left, cols.stop - cols.start, k_right).sum(dim=(1, 3))


def tile_bytes(formulation: str, s: int, t: int, k_left: int, k_right: int, itemsize: int) -> int:
    """Working bytes of one tile: its output, and its Gram block (gram)."""
    return itemsize * s * t * (1 + (k_left * k_right if formulation == "gram" else 0))
