"""The two exact kernels of the Projection Kernel engine, for one group of heads at a time.

PK(a, b) = ||U_a^T U_b||_F^2 = tr(P_a P_b) for orthonormal bases U (d x k) and projectors P = U U^T.

- "gram": a group's bases stacked as one (g k) x d matrix; a tile is one GEMM G = A B^T whose k x k' block
  (a, b) has PK(a, b) as its sum of squares. 2 d k k' FLOPs per pair.
- "projector": a group's projectors vectorised over their upper block triangle (block size b), so that a
  tile is PK = V_A V_B^T: 2 L FLOPs per pair with L = b^2 nb (nb + 1) / 2 ~ d^2 / 2 + d b / 2 entries
  (nb = ceil(d / b)), whatever the head width, plus 2 L k FLOPs to build each head's vector once.
  The vector is stored as nb segments (the nb diagonal blocks together, then the part of each block row
  right of the diagonal, off-diagonal entries times sqrt 2) so that each segment is written by one
  batched GEMM of the whole group with no copy; a tile sums one GEMM per segment.

Both hold for any d x k matrices, not only orthonormal ones (||A^T B||_F^2 = <A A^T, B B^T>), which the
Composition Score uses. Nothing here loops over heads or pairs; same code on CUDA and CPU.
"""

import math

import torch

FORMULATIONS = ("gram", "projector")
MIN_BLOCK = 64  # projector block size: at least this (fewer, larger GEMMs), at most d
GRAM_TILE_BYTES = 8 * 2**20  # a gram tile's Gram block stays this small: 8 MiB blocks ran 30 % faster than 128 MiB


def projector_block(d: int, width: int) -> int:
    """Block size b of the projector layout for head width `width` in R^d: max(width, 64), at most d."""
    return max(1, min(d, max(width, MIN_BLOCK)))


def projector_length(d: int, block: int) -> int:
    """Entries L of one vectorised projector: nb (nb + 1) / 2 blocks of b x b, nb = ceil(d / b) (d padded)."""
    nb = math.ceil(d / block)
    return block * block * nb * (nb + 1) // 2


def vector_elements(formulation: str, d: int, k: int, block: int) -> int:
    """Elements one head occupies once built: its stacked basis (gram) or its vectorised projector."""
    return d * k if formulation == "gram" else projector_length(d, block)


def build_flops(formulation: str, d: int, k: int, block: int) -> float:
    """FLOPs to build one head's vector (a copy for gram)."""
    return 0.0 if formulation == "gram" else 2.0 * k * projector_length(d, block)


def tile_flops(formulation: str, d: int, k_left: int, k_right: int, block: int) -> float:
    """FLOPs per (source, target) pair of a tile."""
    return 2.0 * d * k_left * k_right if formulation == "gram" else 2.0 * projector_length(d, block)


def build_temporary_bytes(formulation: str, heads: int, d: int, k: int, block: int, itemsize: int) -> int:
    """Bytes of the temporaries made while building a group of `heads` heads (the padded bases, their scaled
    transpose and the diagonal blocks' right operand for the projector)."""
    if formulation == "gram":
        return 0
    padded = math.ceil(d / block) * block
    return 3 * itemsize * heads * padded * k


def build(formulation: str, bases: torch.Tensor, block: int) -> list[torch.Tensor]:
    """A group's vectors, as a list of [g, m] matrices whose concatenation along dim 1 is each head's vector:
    one (g k) x d stacked basis for gram (so g rows become g k), the nb projector segments otherwise."""
    g, d, k = bases.shape
    if formulation == "gram":
        return [bases.transpose(1, 2).reshape(g * k, d)]
    nb = math.ceil(d / block)
    padded = torch.nn.functional.pad(bases, (0, 0, 0, nb * block - d)) if nb * block != d else bases.contiguous()
    scaled_t = (padded.transpose(1, 2) * math.sqrt(2.0)).contiguous()  # [g, k, nb b]
    sizes = [nb * block * block] + [block * (nb - 1 - i) * block for i in range(nb - 1)]
    buffer = torch.empty(g * sum(sizes), dtype=bases.dtype, device=bases.device)
    segments, offset = [], 0
    for size in sizes:
        segments.append(buffer[offset:offset + g * size].view(g, size))
        offset += g * size
    rows = padded.view(g * nb, block, k)
    diagonal_right = padded.view(g, nb, block, k).permute(0, 1, 3, 2).reshape(g * nb, k, block)
    torch.bmm(rows, diagonal_right, out=segments[0].view(g * nb, block, block))
    for i in range(nb - 1):
        left = padded[:, i * block:(i + 1) * block]
        torch.bmm(left, scaled_t[:, :, (i + 1) * block:], out=segments[i + 1].view(g, block, (nb - 1 - i) * block))
    return segments


def tile(formulation: str, left: list[torch.Tensor], right: list[torch.Tensor], rows: slice, cols: slice,
         k_left: int, k_right: int) -> torch.Tensor:
    """PK [s, t] of heads `rows` of the left group against heads `cols` of the right group (built vectors)."""
    if formulation == "gram":
        a = left[0][rows.start * k_left:rows.stop * k_left]
        b = right[0][cols.start * k_right:cols.stop * k_right]
        gram = (a @ b.T).square_()
        return gram.view(rows.stop - rows.start, k_left, cols.stop - cols.start, k_right).sum(dim=(1, 3))
    out = left[0][rows] @ right[0][cols].T
    for a, b in zip(left[1:], right[1:]):
        out.addmm_(a[rows], b[cols].T)
    return out


def tile_bytes(formulation: str, s: int, t: int, k_left: int, k_right: int, itemsize: int) -> int:
    """Working bytes of one tile: its output, and its Gram block (gram)."""
    return itemsize * s * t * (1 + (k_left * k_right if formulation == "gram" else 0))
