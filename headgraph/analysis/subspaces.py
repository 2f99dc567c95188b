"""Orthonormal bases of attention-head weight subspaces (thin SVD, numerical rank kept).

Subspaces live in the residual stream (d_model). For weight type Q, K or V the subspace of a head is the
column space of its `W_Q[l, h]`, `W_K[l, h]` or `W_V[l, h]` (d_model x d_head): what the head reads. For O it
is the column space of `W_O[l, h].T`: what the head writes. K and V of grouped-query models keep their native
KV heads (axis 1 of `W_K` / `W_V` has n_kv_heads entries), so no expanded copy is ever counted twice.

Every head's basis has width d_head; columns past its numerical rank are zero, so a rank-deficient head
contributes exactly its own rank to every Projection Kernel without special casing.

On the CPU the per-head decompositions (d_head x d_head eigh, or a d_model x d_head SVD) run on one thread.
Threaded LAPACK gains nothing on matrices this small, and on a shared machine it loses badly: each of the
many synchronisation points of one small decomposition waits for a thread that another process has taken
off its core. On a busy 2-core box, in one process, GPT-2 small's 576 bases took 2.9-8.3 s with torch's
default two threads and 0.35-0.46 s with one (50 eigh calls of 64 x 64: 0.11-0.89 s vs 0.03 s). The other
half of such stalls, OpenMP's spinning idle threads, is set off for every `headgraph` process (headgraph.cli).
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from headgraph.heads import WEIGHT_TYPES


@dataclass(frozen=True)
class SubspaceBases:
    """Bases of one weight type for all heads: `bases[l, h]` is d_model x d_head, orthonormal up to its rank."""

    weight_type: str
    bases: torch.Tensor
    ranks: torch.Tensor
    singular_values: torch.Tensor

    @property
    def n_layers(self) -> int:
        return self.bases.shape[0]

    @property
    def n_heads(self) -> int:
        return self.bases.shape[1]

    @property
    def d_model(self) -> int:
        return self.bases.shape[2]

    @property
    def width(self) -> int:
        return self.bases.shape[3]

    def flat(self) -> torch.Tensor:
        """Bases as [n_layers * n_heads, d_model, d_head], heads ordered by layer then index."""
        return self.bases.reshape(-1, self.d_model, self.width)

    def flat_layers(self) -> torch.Tensor:
        """Layer of each head of `flat()`."""
        return torch.arange(self.n_layers).repeat_interleave(self.n_heads)


def head_matrices(weights: torch.Tensor, weight_type: str) -> torch.Tensor:
    """The d_model x d_head matrix whose column space is each head's subspace, [n_layers, n_heads, d, k]."""
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight type must be one of {WEIGHT_TYPES}, got {weight_type!r}")
    if weights.ndim != 4:
        raise ValueError(f"W_{weight_type} must be [n_layers, n_heads, ., .], got shape {tuple(weights.shape)}")
    return weights.transpose(-2, -1) if weight_type == "O" else weights


def rank_tolerance(shape: tuple[int, int], dtype: torch.dtype) -> float:
    """Relative singular-value threshold max(shape) * eps of the compute dtype (as numpy.linalg.matrix_rank)."""
    return max(shape) * torch.finfo(dtype).eps


def _above_rank_threshold(singular_values: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Which singular values [..., k] (descending) count towards the rank: above tolerance * sigma_max."""
    return singular_values > singular_values[..., :1] * tolerance


@contextmanager
def small_lapack(device: torch.device):
    """Run the enclosed per-head decompositions on one CPU thread (restored afterwards); no-op off the CPU."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _svd(work: torch.Tensor, tolerance: float) -> tuple[torch.Tensor, torch.Tensor]:
    with small_lapack(work.device):
        left, singular_values, _ = torch.linalg.svd(work, full_matrices=False)
    return left * _above_rank_threshold(singular_values, tolerance).unsqueeze(-2), singular_values


def _svd_by_gram(work: torch.Tensor, tolerance: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Thin SVD through the float64 eigendecomposition of W^T W: sigma = sqrt(lambda), U = W V / sigma, the
    columns past the rank threshold zeroed by the same k x k transform that divides by sigma (no pass over U
    after its product: 200 heads of 2048 x 64 in 0.31 against 0.44 s with the division and mask as passes).
    In float64 the singular values are accurate to ~1e-7 sigma_max, well inside a float32 rank threshold,
    and far cheaper than a batched SVD of tall matrices (one GEMM and a k x k eigh per head)."""
    wide = work.to(torch.float64)
    gram = wide.transpose(-2, -1) @ wide
    with small_lapack(work.device):
        eigenvalues, right = torch.linalg.eigh(gram)
    singular_values = eigenvalues.flip(-1).clamp(min=0).sqrt()
    kept = _above_rank_threshold(singular_values, tolerance)
    inverse = torch.where(kept, 1.0 / torch.where(kept, singular_values, 1.0), 0.0)
    return wide @ (right.flip(-1) * inverse.unsqueeze(-2)), singular_values


def orthonormal_bases(matrices: torch.Tensor, weight_type: str, dtype: torch.dtype,
                      tolerance_scale: float = 1.0) -> SubspaceBases:
    """Thin SVD of [n_layers, n_heads, d, k] matrices; columns beyond the numerical rank (threshold
    tolerance_scale * max(d, k) * eps(dtype) * sigma_max) are zeroed. float32 runs the SVD through a float64 Gram
    eigendecomposition; float64 through LAPACK's SVD (the Gram route cannot resolve float64's threshold)."""
    decompose = _svd if dtype == torch.float64 else _svd_by_gram
    tolerance = tolerance_scale * rank_tolerance(tuple(matrices.shape[-2:]), dtype)
    bases = torch.empty(matrices.shape, dtype=dtype, device=matrices.device)
    singular_values = torch.empty(*matrices.shape[:-2], min(matrices.shape[-2:]), dtype=dtype, device=matrices.device)
    for layer in range(matrices.shape[0]):  # one layer at a time bounds the float64 temporaries
        bases[layer], singular_values[layer] = decompose(matrices[layer].to(dtype=dtype), tolerance)
    ranks = _above_rank_threshold(singular_values, tolerance).sum(dim=-1)
    return SubspaceBases(weight_type=weight_type, bases=bases, ranks=ranks, singular_values=singular_values)


def rank_deficient_heads(subspaces: dict[str, SubspaceBases]) -> list[dict]:
    """One record per (type, head) whose numerical rank is below d_head."""
    records = []
    for weight_type, sub in subspaces.items():
        deficient = torch.nonzero(sub.ranks < sub.width, as_tuple=False).cpu().tolist()
        for layer, head in deficient:
            records.append({"type": weight_type, "layer": layer, "head": head,
                            "rank": int(sub.ranks[layer, head]), "d_head": sub.width})
    return records


ROW_BLOCKS = 8  # blocks of rows of a triangular product (`add_lower_gram`, significance.root_product)


def row_blocks(d: int) -> list[tuple[int, int]]:
    """(start, end) of ROW_BLOCKS blocks of d rows, the last one shorter where d is not a multiple."""
    block = -(-d // ROW_BLOCKS)
    return [(start, min(start + block, d)) for start in range(0, d, block)]


def add_lower_gram(gram: torch.Tensor, stacked: torch.Tensor) -> None:
    """gram += stacked stacked^T [d, d] on and below its diagonal blocks only, one product per block of rows
    (`row_blocks`) over the rows up to it, (ROW_BLOCKS + 1) / (2 ROW_BLOCKS) of the whole product's FLOPs; what
    lies above them is left as it was, for `lower_to_symmetric` after the last sum."""
    for start, end in row_blocks(gram.shape[0]):
        gram[start:end, :end].addmm_(stacked[start:end], stacked[:end].T)


def lower_to_symmetric(gram: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix of `gram`'s lower triangle."""
    return gram.tril() + gram.tril(-1).T


@dataclass(frozen=True)
class HeadStatistics:
    """What the PK stages keep of a model's weights, built one layer at a time (`head_statistics`): each type's
    bases, each type's second moment Sigma_T = mean over heads of M M^T / d_head (the model-matched null's,
    headgraph.analysis.significance), and the Composition Scores' k x k factors per query head (`composition`:
    "O" for the source's W_OV, and per mode "Q", "K", "V" for the target's circuit; headgraph.analysis.composition).
    A factor C of head matrix F = U C (U the head's basis) stands for F with its components outside the head's
    numerical rank dropped, a change of the order of the rank threshold."""

    subspaces: dict[str, SubspaceBases]
    moments: dict[str, torch.Tensor]
    composition: dict[str, torch.Tensor]


def head_statistics(layers, n_layers: int, dtype: torch.dtype, device: torch.device, tolerance_scale: float = 1.0,
                    composition_modes: tuple[str, ...] = ()) -> HeadStatistics:
    """HeadStatistics of `layers`, an iterable of one dict per layer {"W_Q": [H, d, k], "W_K", "W_V": [KV, d, k],
    "W_O": [H, k, d]} in TransformerLens layout (a streamed checkpoint's, or a loaded model's layer by layer):
    only the bases, moments and factors are kept, never the weights."""
    from headgraph.analysis.composition import composition_factors

    bases, singular, moments, counts, factors = {}, {}, {}, {}, {}
    for layer, weights in enumerate(layers):
        w = {t: weights[f"W_{t}"].to(device=device, dtype=dtype) for t in WEIGHT_TYPES}
        for t in WEIGHT_TYPES:
            matrices = head_matrices(w[t].unsqueeze(0), t)
            if t not in bases:
                bases[t] = torch.empty((n_layers, *matrices.shape[1:]), dtype=dtype, device=device)
                singular[t] = torch.empty((n_layers, *matrices.shape[1:-2], min(matrices.shape[-2:])), dtype=dtype,
                                          device=device)
                moments[t] = torch.zeros(matrices.shape[-2], matrices.shape[-2], dtype=dtype, device=device)
                counts[t] = 0
            found = orthonormal_bases(matrices, t, dtype, tolerance_scale)
            bases[t][layer], singular[t][layer] = found.bases[0], found.singular_values[0]
            stacked = matrices[0].permute(1, 0, 2).reshape(matrices.shape[-2], -1)
            add_lower_gram(moments[t], stacked)
            counts[t] += stacked.shape[1]
        for mode in composition_modes:
            left, right = composition_factors(*(w[t].unsqueeze(0) for t in WEIGHT_TYPES), mode)
            n_heads = left.shape[1]
            u_left = bases["O"][layer:layer + 1]
            u_right = bases[mode][layer:layer + 1].repeat_interleave(n_heads // bases[mode].shape[1], dim=1)
            for key, u, f in (("O", u_left, left), (mode, u_right, right)):
                if key not in factors:
                    factors[key] = torch.empty(n_layers, n_heads, f.shape[-1], f.shape[-1], dtype=dtype, device=device)
                factors[key][layer] = (u.transpose(-2, -1) @ f)[0]
    tolerance = {t: tolerance_scale * rank_tolerance(tuple(bases[t].shape[-2:]), dtype) for t in bases}
    subspaces = {t: SubspaceBases(t, bases[t], _above_rank_threshold(singular[t], tolerance[t]).sum(dim=-1),
                                  singular[t]) for t in WEIGHT_TYPES}
    return HeadStatistics(subspaces, {t: lower_to_symmetric(moments[t]) / counts[t] for t in WEIGHT_TYPES}, factors)
