"""Composition Scores (Elhage et al. 2021) between an earlier head's OV circuit and a later head.

CS(A, B) = ||A B||_F / (||A||_F ||B||_F), A = W_OV = W_V W_O of the source head (d x d) and B = W_QK = W_Q W_K^T
(Q-composition), W_QK^T (K-composition) or the target head's W_OV (V-composition), as TransformerLens'
`all_composition_scores`. Vectorised without forming any d x d matrix: with thin QR factors
W_V = Q_V R_V, W_K = Q_K R_K, W_Q = Q_Q R_Q, W_O^T = Q_O R_O,

    ||W_V W_O W_Q W_K^T||_F = ||(W_O^T R_V^T)^T (W_Q R_K^T)||_F,

so every score's numerator is the Frobenius norm of a k x k block of one block-Gram product: the Projection
Kernel engine's contraction applied to the d x k factors left = W_O^T R_V^T and right = W_Q R_K^T
(K: W_K R_Q^T; V: W_V R_O^T), and ||A||_F = ||left||_F, ||B||_F = ||right||_F.
Grouped-query K/V are expanded to query heads, as TransformerLens does, since W_QK and W_OV are per query head.
"""

import torch

from headgraph.analysis.pk import pk_matrix


def expand_kv(weights: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Repeat each native KV head for the query heads of its group: [L, n_kv, ...] -> [L, n_heads, ...]."""
    return weights.repeat_interleave(n_heads // weights.shape[1], dim=1)


def _r_factor(matrices: torch.Tensor) -> torch.Tensor:
    """R of the thin QR of each d x k matrix (so M^T M = R^T R)."""
    return torch.linalg.qr(matrices, mode="r").R


def composition_factors(W_Q: torch.Tensor, W_K: torch.Tensor, W_V: torch.Tensor, W_O: torch.Tensor,
                        mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """d x k factors (left per source head, right per target head), each [L, H, d, k], whose block product
    has the norm of the composed circuit."""
    n_heads = W_Q.shape[1]
    W_K, W_V = expand_kv(W_K, n_heads), expand_kv(W_V, n_heads)
    left = W_O.transpose(-2, -1) @ _r_factor(W_V).transpose(-2, -1)
    if mode == "Q":
        right = W_Q @ _r_factor(W_K).transpose(-2, -1)
    elif mode == "K":
        right = W_K @ _r_factor(W_Q).transpose(-2, -1)
    elif mode == "V":
        right = W_V @ _r_factor(W_O.transpose(-2, -1)).transpose(-2, -1)
    else:
        raise ValueError(f"mode must be one of 'Q', 'K', 'V', got {mode!r}")
    return left, right


def composition_scores(W_Q: torch.Tensor, W_K: torch.Tensor, W_V: torch.Tensor, W_O: torch.Tensor, mode: str,
                       mask: torch.Tensor, max_memory: int) -> torch.Tensor:
    """CS for every (source head, target head) pair where `mask` [L*H, L*H] is True (NaN elsewhere), as a
    [L*H, L*H] matrix with heads ordered by layer then index."""
    left, right = composition_factors(W_Q, W_K, W_V, W_O, mode)
    d, k = left.shape[-2], left.shape[-1]
    left, right = left.reshape(-1, d, k), right.reshape(-1, d, right.shape[-1])
    numerator = pk_matrix(left, right, mask, max_memory, formulation="gram").sqrt()
    left_norm = left.square().sum(dim=(1, 2)).sqrt()
    right_norm = right.square().sum(dim=(1, 2)).sqrt()
    return numerator / (left_norm[:, None] * right_norm[None, :])


def composition_scores_from_factors(source_bases: torch.Tensor, source_factors: torch.Tensor,
                                    target_bases: torch.Tensor, target_factors: torch.Tensor, mask: torch.Tensor,
                                    max_memory: int) -> torch.Tensor:
    """CS as composition_scores computes it, from what headgraph.analysis.subspaces.head_statistics keeps of the
    weights: per query head its basis U [L, H, d, k] (a grouped-query K/V basis repeated for the query heads that
    read it) and the k x k factor C of the composition factor U C."""
    n_heads = source_factors.shape[1]

    def factor(bases, factors):
        expanded = bases.repeat_interleave(n_heads // bases.shape[1], dim=1)
        return (expanded @ factors).reshape(-1, expanded.shape[-2], factors.shape[-1])

    left, right = factor(source_bases, source_factors), factor(target_bases, target_factors)
    numerator = pk_matrix(left, right, mask, max_memory).sqrt()  # the faster formulation here
    left_norm = left.square().sum(dim=(1, 2)).sqrt()
    right_norm = right.square().sum(dim=(1, 2)).sqrt()
    return numerator / (left_norm[:, None] * right_norm[None, :])
