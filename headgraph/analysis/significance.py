"""Calibrated significance: a model-matched null for PK, empirical p-values and Benjamini-Hochberg q-values.

Trained weights are anisotropic, so almost every trained pair sits far above the isotropic reference. The
model-matched null ("second_moment") keeps each weight type's anisotropy and drops everything else: a null
head of type T is the column space of Sigma_T^(1/2) G, with G a d_model x d_head standard Gaussian and
Sigma_T the second moment of the model's own type-T head matrices (the mean of W W^T over heads, divided by
d_head). PK between n null source heads and n independent null target heads gives n^2 null values per type
pair (exchangeable, not independent); an edge's p_model is its upper-tail position among them,
(1 + #{null >= pk}) / (n^2 + 1), while at least TAIL_EXCEEDANCES null values reach it. Further out the
empirical tail has no resolution (it would floor at 1 / (n^2 + 1), and then the few strongest edges of a large
model could never pass BH), so there p_model is the upper tail of a Beta on [0, min(k, k')] matched to the
null sample's mean and variance — the same family that fits the isotropic PK null — and is an extrapolation.
q_model applies Benjamini-Hochberg within each type pair.
"""

import numpy as np
from scipy import stats
import torch

from headgraph.analysis.pk import PKPlan, PKRequest, pk_pass, plan_bases
from headgraph.analysis.reference import beta_log_sf, beta_parameters
from headgraph.analysis.subspaces import head_matrices, orthonormal_bases, row_blocks, small_lapack
from headgraph.heads import WEIGHT_TYPES

NULL_NAME = "second_moment"
NULL_DESCRIPTION = ("PK between random subspaces Sigma_T^(1/2) G drawn from each weight type's own second "
                    "moment Sigma_T (n null heads per type, all n^2 source-target pairs); empirical upper tail "
                    "(1 + #exceed) / (n^2 + 1) while at least 10 null values exceed, beyond that the tail of a "
                    "Beta on [0, min(k, k')] moment-matched to the null sample (an extrapolation)")
TAIL_EXCEEDANCES = 10
BH_DESCRIPTION = "Benjamini-Hochberg over the computed edges of each type pair"


def second_moment(weights: torch.Tensor, weight_type: str) -> torch.Tensor:
    """Sigma = mean over heads of M M^T / d_head for the d x d_head head matrices M of one type."""
    matrices = head_matrices(weights, weight_type)
    flat = matrices.reshape(-1, matrices.shape[-2], matrices.shape[-1])
    stacked = flat.permute(1, 0, 2).reshape(flat.shape[1], -1)
    return stacked @ stacked.T / stacked.shape[1]


def sigma_root(sigma: torch.Tensor) -> torch.Tensor:
    """A root R with R R^T = Sigma: its Cholesky factor where Sigma is positive definite, else V diag(sqrt(lambda))
    of its eigendecomposition (eigenvalues below Sigma's rank floor set to 0). Either makes R G Gaussian with
    covariance Sigma; the Cholesky factor costs a tenth of the eigendecomposition at d_model 2048 and a twentieth at
    4096. Both run on one CPU thread, several times faster there than on two waking workers. A factor with a
    non-finite entry is not taken even where the factorisation reports success: on CUDA (torch 2.11, an H100) a
    singular Sigma whose last pivot rounds below zero came back with info 0 and a row of NaN."""
    with small_lapack(sigma.device):
        factor, info = torch.linalg.cholesky_ex(sigma)
        if int(info) == 0 and bool(torch.isfinite(factor).all()):
            return factor
        eigenvalues, eigenvectors = torch.linalg.eigh(sigma)
    floor = sigma.shape[0] * torch.finfo(sigma.dtype).eps * eigenvalues.abs().max()
    return eigenvectors * torch.where(eigenvalues > floor, eigenvalues, 0.0).sqrt()


def root_product(root: torch.Tensor, gaussian: torch.Tensor) -> torch.Tensor:
    """root @ G [n, d, w] for every G of gaussian [n, d, w], as one product of each block of root's rows
    (`row_blocks`) with all the G side by side, over the columns up to the block's last nonzero one: a Cholesky
    factor (lower-triangular) costs (ROW_BLOCKS + 1) / (2 ROW_BLOCKS) of the full product (d_model 2048, 200
    heads of 64: 0.62 s against 0.93 s for the batched product of the whole root with each G)."""
    d = root.shape[0]
    n, _, w = gaussian.shape
    flat = gaussian.to(root.device).permute(1, 0, 2).reshape(d, n * w)
    out = torch.zeros(d, n * w, dtype=root.dtype, device=root.device)
    for start, end in row_blocks(d):
        used = torch.nonzero(root[start:end].any(0))
        if len(used):
            columns = int(used[-1]) + 1
            torch.mm(root[start:end, :columns], flat[:columns], out=out[start:end])
    return out.view(d, n, w).permute(1, 0, 2)


def null_bases(root: torch.Tensor, n_heads: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """Orthonormal bases [n_heads, d, width] of the column space of Sigma^(1/2) G, G Gaussian, from
    root = sigma_root(Sigma) (any R with R R^T = Sigma gives R G the law of Sigma^(1/2) G: the rotation between them
    is absorbed by G)."""
    gaussian = torch.randn(n_heads, root.shape[0], width, generator=generator, dtype=root.dtype)
    return orthonormal_bases(root_product(root, gaussian).unsqueeze(0), "null", root.dtype).bases[0]


def null_head_sets(moments: dict[str, torch.Tensor], widths: dict[str, int], type_pairs, n_heads: int,
                   seed: int) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Two independent sets (one for sources, one for targets) of n_heads null bases per weight type, from each
    type's second moment (`moments`, e.g. HeadStatistics.moments) and head width, so that a same-type pair
    (e.g. QQ) compares independent draws. Only the sets `type_pairs` read are drawn and computed (None for the
    others), each from its own generator (`set_generator`), so that every set is the same whichever type pairs
    are asked."""
    sources, targets = {tp[0] for tp in type_pairs}, {tp[1] for tp in type_pairs}
    sets = {}
    for weight_type in sorted(sources | targets):
        root = sigma_root(moments[weight_type])
        sets[weight_type] = tuple(
            null_bases(root, n_heads, widths[weight_type], set_generator(seed, weight_type, side)) if used else None
            for side, used in enumerate((weight_type in sources, weight_type in targets)))
    return sets


def set_generator(seed: int, weight_type: str, side: int) -> torch.Generator:
    """The generator of one null set (side 0: sources, 1: targets): seeded from (seed, type, side) by numpy's
    SeedSequence, so the sets' streams are independent and none is drawn to reach another."""
    state = np.random.SeedSequence((seed, WEIGHT_TYPES.index(weight_type), side)).generate_state(1, np.uint64)
    return torch.Generator().manual_seed(int(state[0]))


def _named_sets(sets: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    return {f"{t}_{side}": heads for t, pair in sets.items() for side, heads in zip(("source", "target"), pair)
            if heads is not None}


def plan_null(sets: dict[str, tuple[torch.Tensor, torch.Tensor]], type_pairs, max_memory: int) -> PKPlan:
    """One PK-engine pass for the null of every type pair XY: all n x n pairs of X's source set against Y's
    target set. Each null set's vectors are built once and shared by every type pair that reads it (16 type
    pairs build 8 sets, not 32); the formulation is the engine's choice from this machine's measured rates.
    Raises ValueError when max_memory cannot hold one-head groups."""
    requests = {tp: PKRequest(f"{tp[0]}_source", f"{tp[1]}_target",
                              torch.ones(len(sets[tp[0]][0]), len(sets[tp[1]][1]), dtype=torch.bool))
                for tp in type_pairs}
    used = {name for r in requests.values() for name in (r.source, r.target)}
    return plan_bases({name: heads for name, heads in _named_sets(sets).items() if name in used}, requests,
                      max_memory)


def null_pk_samples(sets: dict[str, tuple[torch.Tensor, torch.Tensor]], plan: PKPlan,
                    advance=None) -> dict[str, np.ndarray]:
    """The null PK values of each type pair of `plan` (plan_null), flat: n^2 per type pair."""
    bases = {name: heads for name, heads in _named_sets(sets).items() if name in plan.shapes}
    return {tp: pk.reshape(-1).cpu().numpy() for tp, pk in pk_pass(bases, plan, advance).items()}


def upper_p(observed: np.ndarray, null: np.ndarray, upper: float,
            min_exceed: int = TAIL_EXCEEDANCES) -> np.ndarray:
    """p_model: the empirical upper tail where at least `min_exceed` null values reach the observed value,
    else the upper tail of the Beta on [0, upper] with the null sample's mean and variance."""
    ordered = np.sort(null)
    exceed = len(ordered) - np.searchsorted(ordered, observed, side="left")
    p = (1.0 + exceed) / (len(ordered) + 1.0)
    far = exceed < min_exceed
    if far.any():
        a, b = beta_parameters(ordered.mean(), ordered.var(ddof=1), upper)
        p[far] = np.exp(beta_log_sf(np.asarray(observed, dtype=np.float64)[far] / upper, a, b))
    return p


def benjamini_hochberg(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """BH q-values along `axis` (monotone step-up adjusted p-values, capped at 1): scipy's, the one BH of
    headgraph. A q-value bounds the expected share of false discoveries among pairs at or below it, under
    the null's assumptions; it is not the probability that one pair is a false discovery."""
    p = np.asarray(p, dtype=np.float64)
    return p.copy() if p.size == 0 else stats.false_discovery_control(p, axis=axis, method="bh")
