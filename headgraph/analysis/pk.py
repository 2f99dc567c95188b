"""All-pairs Projection Kernel between two sets of head subspaces, tiled to a memory budget.

PK(S, S') = ||U^T U'||_F^2 = tr(P P') for orthonormal bases U (d x k), U' (d x k') and projectors P = U U^T.
Two exact formulations, chosen per call by a cost model (both are tested equal):

- "gram": stack the bases and take the block Gram matrix G = B_src^T B_tgt; PK(a, b) is the sum of squares of
  its k x k' block (a, b). 2 k k' d FLOPs per pair.
- "projector": vectorise each projector over its upper block triangle (off-diagonal blocks weighted by
  sqrt 2), so PK(a, b) = <v_a, v_b>. About d^2 + d k FLOPs per pair (vs 2 k k' d: fewer whenever
  d < 2 k k', ~10x fewer on GPT-2 small) plus about d^2 k to build each projector once, which is slow
  small-GEMM work and must be redone per tile when the projectors do not fit the memory budget.

No Python loop runs over head pairs: the loops run over tiles of heads, sized so that the working memory
(tile copies, Gram or projector blocks, excluding the input bases and the output matrix) stays within
`max_memory` bytes. Same code on CUDA and CPU; the dtype is the bases' dtype.
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch

from headgraph.analysis.options import DEFAULT_MAX_MEMORY

FORMULATIONS = ("gram", "projector")
# Building projector blocks is many small batched GEMMs (b x k x b, b = k) plus copies; on this project's
# 2-core CPU they ran at about a fifth of a large GEMM's FLOP/s, so the cost model weighs their FLOPs by 5.
PROJECTOR_BUILD_EFFICIENCY = 0.2


@dataclass(frozen=True)
class PKPlan:
    """How one all-pairs PK computation runs: formulation, tile sizes, estimated FLOPs and working bytes."""

    formulation: str
    src_tile: int
    tgt_tile: int
    cache_targets: bool
    build_chunk: int
    flops: float
    cost: float
    working_bytes: int


def pair_mask(src_layers: torch.Tensor, tgt_layers: torch.Tensor, full_matrix: bool,
              same_type: bool) -> torch.Tensor:
    """Which (source, target) pairs to compute: earlier -> strictly later layer, or every pair but a head
    with itself when `full_matrix` (a head's subspace against itself is always PK = rank)."""
    src = src_layers[:, None]
    tgt = tgt_layers[None, :]
    if not full_matrix:
        return src < tgt
    mask = torch.ones(len(src_layers), len(tgt_layers), dtype=torch.bool)
    if same_type:
        mask.fill_diagonal_(False)
    return mask


def touched_fraction(mask: torch.Tensor, src_tile: int) -> float:
    """Fraction of the full matrix the tiled loop computes: each source tile covers the span of columns
    any of its rows needs."""
    rows_any = torch.stack([mask[i:i + src_tile].any(dim=0) for i in range(0, mask.shape[0], src_tile)])
    has_any = rows_any.any(dim=1)
    first = rows_any.int().argmax(dim=1)
    last = mask.shape[1] - rows_any.flip(1).int().argmax(dim=1)
    tile_rows = torch.tensor([min(src_tile, mask.shape[0] - i) for i in range(0, mask.shape[0], src_tile)])
    return float((tile_rows * (last - first) * has_any).sum()) / max(1, mask.numel())


def _max_src_tile(n_src: int, parts: int) -> int:
    """Source tiles are at most 1/parts of the sources, so that earlier -> later masks skip empty blocks
    (the Gram GEMM keeps its efficiency with thin tiles; the projector GEMM, memory-bound, needs fat ones)."""
    return max(1, math.ceil(n_src / parts))


def _gram_working_bytes(src_tile: int, tgt_tile: int, d: int, k_src: int, k_tgt: int, itemsize: int) -> int:
    return itemsize * (src_tile * k_src * tgt_tile * k_tgt + src_tile * d * k_src + tgt_tile * d * k_tgt)


def _projector_length(d: int, k: int) -> int:
    b, n_blocks = projector_layout(d, k)
    return n_blocks * b * b


def _projector_bytes(n_heads: int, d: int, k: int, itemsize: int) -> int:
    """A block of vectorised projectors."""
    return itemsize * n_heads * _projector_length(d, k)


def _build_bytes(chunk: int, d: int, k: int, itemsize: int) -> int:
    """Row-block copies of `chunk` heads' bases made while building their projector blocks."""
    b, n_blocks = projector_layout(d, k)
    return 2 * itemsize * chunk * n_blocks * b * k


def _build_chunk(d: int, k: int, itemsize: int, budget: int) -> int:
    """Heads whose projector blocks are built at once."""
    return max(1, min(8, budget // max(1, _build_bytes(1, d, k, itemsize))))


def _largest_tile(n: int, fits: Callable[[int], bool]) -> int:
    """Largest tile size <= n (halving from n) for which `fits` holds; 1 if none does."""
    size = max(1, n)
    while size > 1 and not fits(size):
        size = (size + 1) // 2
    return size


def _plan_gram(mask: torch.Tensor, d: int, k_src: int, k_tgt: int, itemsize: int, budget: int) -> PKPlan:
    n_src, n_tgt = mask.shape
    stacked_targets = itemsize * n_tgt * d * k_tgt
    cache_targets = stacked_targets + _gram_working_bytes(1, 1, d, k_src, k_tgt, itemsize) <= budget // 2
    free = budget - stacked_targets if cache_targets else budget
    tgt_tile = _largest_tile(n_tgt, lambda t: _gram_working_bytes(1, t, d, k_src, k_tgt, itemsize) <= free)
    src_tile = _largest_tile(_max_src_tile(n_src, 16),
                             lambda s: _gram_working_bytes(s, tgt_tile, d, k_src, k_tgt, itemsize) <= free)
    flops = 2.0 * k_src * k_tgt * d * n_src * n_tgt * touched_fraction(mask, src_tile)
    working = _gram_working_bytes(src_tile, tgt_tile, d, k_src, k_tgt, itemsize) + stacked_targets * cache_targets
    return PKPlan("gram", src_tile, tgt_tile, cache_targets, 0, flops, flops, working)


def _plan_projector(mask: torch.Tensor, d: int, k_src: int, k_tgt: int, itemsize: int, budget: int) -> PKPlan:
    n_src, n_tgt = mask.shape
    k = max(k_src, k_tgt)
    build_chunk = _build_chunk(d, k, itemsize, budget // 4)
    build = _build_bytes(build_chunk, d, k, itemsize)
    all_targets = _projector_bytes(n_tgt, d, k, itemsize)
    cache_targets = all_targets + _projector_bytes(1, d, k, itemsize) + build <= budget
    if cache_targets:
        tgt_tile = n_tgt
        free = budget - all_targets - build
    else:
        tgt_tile = _largest_tile(n_tgt, lambda t: 2 * _projector_bytes(t, d, k, itemsize) + build <= budget)
        free = budget - _projector_bytes(tgt_tile, d, k, itemsize) - build
    src_tile = _largest_tile(_max_src_tile(n_src, 4),
                             lambda s: _projector_bytes(s, d, k, itemsize) + itemsize * s * tgt_tile <= free)
    n_src_tiles = math.ceil(n_src / src_tile)
    target_builds = n_tgt if cache_targets else n_tgt * n_src_tiles
    length = _projector_length(d, k)
    build_flops = 2.0 * length * k * (n_src + target_builds)
    gemm_flops = 2.0 * length * n_src * n_tgt * touched_fraction(mask, src_tile)
    cost = gemm_flops + build_flops / PROJECTOR_BUILD_EFFICIENCY
    working = (_projector_bytes(src_tile, d, k, itemsize) + _projector_bytes(tgt_tile, d, k, itemsize) + build
               + itemsize * src_tile * tgt_tile)
    return PKPlan("projector", src_tile, tgt_tile, cache_targets, build_chunk, gemm_flops + build_flops, cost,
                  working)


def plan_pk(mask: torch.Tensor, d: int, k_src: int, k_tgt: int, itemsize: int,
            max_memory: int = DEFAULT_MAX_MEMORY, formulation: str = "auto") -> PKPlan:
    """Tile sizes for both formulations under `max_memory`; "auto" returns the one of lower cost (FLOPs,
    projector building weighted by 1 / PROJECTOR_BUILD_EFFICIENCY) among those whose working set fits.
    Raises ValueError when even one-head tiles do not fit."""
    if formulation not in ("auto", *FORMULATIONS):
        raise ValueError(f"formulation must be 'auto', 'gram' or 'projector', got {formulation!r}")
    plans = [
        _plan_gram(mask, d, k_src, k_tgt, itemsize, max_memory),
        _plan_projector(mask, d, k_src, k_tgt, itemsize, max_memory),
    ]
    allowed = [p for p in plans if formulation in ("auto", p.formulation)]
    fitting = [p for p in allowed if p.working_bytes <= max_memory]
    if not fitting:
        smallest = min(p.working_bytes for p in allowed)
        raise ValueError(f"max_memory {max_memory} bytes is too small for d_model={d}: "
                         f"the smallest tiles need {smallest} bytes")
    return min(fitting, key=lambda plan: plan.cost)


def projector_layout(d: int, k: int) -> tuple[int, int]:
    """Block size b (= the head width, at most d) and number of upper-triangle blocks T of the vectorised
    projector: the d x d projector is cut into ceil(d / b)^2 blocks of b x b; the T = nb (nb + 1) / 2 blocks
    on or above the diagonal are kept, so the vector has T b^2 ~ d^2 / 2 + d b / 2 entries."""
    b = max(1, min(k, d))
    nb = math.ceil(d / b)
    return b, nb * (nb + 1) // 2


def vectorised_projectors(bases: torch.Tensor, chunk: int, width: int | None = None) -> torch.Tensor:
    """[n, d, k] bases -> [n, T b^2]: the blocks of P = U U^T on and above the block diagonal, off-diagonal
    blocks times sqrt 2, so that the dot product of two rows is tr(P P'). Each block U_i U_j^T is built
    directly from row blocks of U (half the FLOPs of forming P, no gather). Vectors of two sets are
    comparable when built with the same layout `width` (default k)."""
    n, d, k = bases.shape
    b, n_blocks = projector_layout(d, width or k)
    nb = math.ceil(d / b)
    block_i, block_j = torch.triu_indices(nb, nb, device=bases.device)
    weight = torch.full(block_i.shape, math.sqrt(2.0), dtype=bases.dtype, device=bases.device)
    weight = weight.masked_fill(block_i == block_j, 1.0).view(1, -1, 1, 1)
    out = torch.empty(n, n_blocks * b * b, dtype=bases.dtype, device=bases.device)
    for start in range(0, n, chunk):
        block = torch.nn.functional.pad(bases[start:start + chunk], (0, 0, 0, nb * b - d))
        rows = block.reshape(block.shape[0], nb, b, k)
        target = out[start:start + chunk].view(block.shape[0], n_blocks, b, b)
        left = rows[:, block_i].mul_(weight)
        torch.matmul(left, rows[:, block_j].transpose(-1, -2), out=target)
    return out


def stacked_bases(bases: torch.Tensor) -> torch.Tensor:
    """[n, d, k] bases side by side as one d x (n k) matrix (head-major columns)."""
    n, d, k = bases.shape
    return bases.permute(1, 0, 2).reshape(d, n * k)


def _gram_tile(src: torch.Tensor, right: torch.Tensor, k_tgt: int) -> torch.Tensor:
    """PK for every pair of a source tile [s, d, k] and stacked target bases d x (t k') via one GEMM."""
    s, d, k = src.shape
    left = src.transpose(1, 2).reshape(s * k, d)
    gram = left @ right
    return gram.square_().reshape(s, k, -1, k_tgt).sum(dim=(1, 3))


def _column_span(mask_rows: torch.Tensor) -> tuple[int, int] | None:
    """First and one-past-last needed column of a block of mask rows (None if it needs none)."""
    cols = torch.nonzero(mask_rows.any(dim=0), as_tuple=False)
    if cols.numel() == 0:
        return None
    return int(cols[0]), int(cols[-1]) + 1


def pk_matrix(src: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor, plan: PKPlan,
              advance: Callable[[int], None] | None = None) -> torch.Tensor:
    """PK between every source [Ns, d, k] and target [Nt, d, k'] basis where `mask` [Ns, Nt] is True
    (NaN elsewhere). Heads must be ordered by layer so each source tile needs one contiguous column span.
    `advance(n)` is called after each source tile with the number of source heads done.

    PK is the sum of the squared cosines of the principal angles: k for equal subspaces, 0 for orthogonal ones,
    k k'/d on average for random ones (headgraph.analysis.reference). A high PK says the subspaces overlap, not
    that the model sends information from one head to the other.

    Two subspaces: the line at 60 degrees to span{e0} in R^2 has PK cos^2(60) = 0.25 with it.

    >>> import math, torch
    >>> line = torch.tensor([[[1.0], [0.0]]], dtype=torch.float64)
    >>> tilted = torch.tensor([[[math.cos(math.pi / 3)], [math.sin(math.pi / 3)]]], dtype=torch.float64)
    >>> one = torch.ones(1, 1, dtype=torch.bool)
    >>> round(pk_matrix(line, tilted, one, plan_pk(one, 2, 1, 1, 8)).item(), 12)
    0.25

    All pairs: two 2-d heads span{e0, e1}, span{e2, e3} of R^4 against span{e1, e2} (one shared axis each)
    and span{e0, e1}; the second source's pair is masked out.

    >>> e = torch.eye(4, dtype=torch.float64)
    >>> src, tgt = torch.stack([e[:, :2], e[:, 2:]]), torch.stack([e[:, 1:3], e[:, :2]])
    >>> mask = torch.tensor([[True, True], [True, False]])
    >>> pk_matrix(src, tgt, mask, plan_pk(mask, 4, 2, 2, 8))
    tensor([[1., 2.],
            [1., nan]], dtype=torch.float64)
    """
    n_src, n_tgt = src.shape[0], tgt.shape[0]
    out = torch.full((n_src, n_tgt), float("nan"), dtype=src.dtype, device=src.device)
    k_tgt = tgt.shape[2]
    width = max(src.shape[2], k_tgt)

    def projectors(bases: torch.Tensor) -> torch.Tensor:
        return vectorised_projectors(bases, plan.build_chunk, width)

    cached = None
    if plan.cache_targets:
        cached = projectors(tgt) if plan.formulation == "projector" else stacked_bases(tgt)
    for i0 in range(0, n_src, plan.src_tile):
        i1 = min(i0 + plan.src_tile, n_src)
        span = _column_span(mask[i0:i1])
        if span is not None:
            src_vec = projectors(src[i0:i1]) if plan.formulation == "projector" else None
            for j0 in range(span[0], span[1], plan.tgt_tile):
                j1 = min(j0 + plan.tgt_tile, span[1])
                if plan.formulation == "gram":
                    right = cached[:, j0 * k_tgt:j1 * k_tgt] if cached is not None else stacked_bases(tgt[j0:j1])
                    out[i0:i1, j0:j1] = _gram_tile(src[i0:i1], right, k_tgt)
                else:
                    tgt_vec = cached[j0:j1] if cached is not None else projectors(tgt[j0:j1])
                    out[i0:i1, j0:j1] = src_vec @ tgt_vec.T
        if advance is not None:
            advance(i1 - i0)
    return torch.where(mask.to(out.device), out, torch.full_like(out, float("nan")))
