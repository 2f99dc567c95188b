"""Model-matched null: BH and empirical p-values against independent computations, and calibration on random
weights — isotropic and anisotropic — where no edge is real."""

import numpy as np
import pytest
import torch
from scipy import stats

from headgraph.analysis.pk import pair_mask, pk_matrix
from headgraph.analysis.reference import isotropic_log10_p
from headgraph.analysis.significance import (benjamini_hochberg, null_bases, null_head_sets, null_pk_samples,
                                             plan_null, root_product, upper_p, second_moment, sigma_root)
from headgraph.analysis.subspaces import ROW_BLOCKS, head_matrices, orthonormal_bases

L, H, D, K = 4, 4, 64, 16


def test_benjamini_hochberg_equals_scipy():
    p = np.random.default_rng(0).uniform(size=500) ** 3
    np.testing.assert_allclose(benjamini_hochberg(p), stats.false_discovery_control(p, method="bh"), rtol=1e-12)


def test_upper_p_counts_exceedances_where_the_null_reaches():
    rng = np.random.default_rng(1)
    null, observed = rng.uniform(0, 8, size=1000), np.array([0.0, 0.3, 4.0, 7.9, rng.uniform(0, 8)])
    expected = [(1 + np.sum(null >= x)) / 1001 for x in observed]
    assert all(np.sum(null >= x) >= 10 for x in observed)
    np.testing.assert_allclose(upper_p(observed, null, upper=8.0), expected)


def test_upper_p_beyond_the_null_sample_follows_the_beta_tail():
    """A Beta(a, b) null on [0, 16]: where no null value reaches, p follows the true tail (down to 1e-12),
    instead of flooring at 1 / (n + 1)."""
    a, b, upper = 40.0, 80.0, 16.0
    null = stats.beta(a, b).rvs(size=40_000, random_state=np.random.default_rng(2)) * upper
    observed = stats.beta(a, b).isf([1e-6, 1e-9, 1e-12]) * upper
    p = upper_p(observed, null, upper)
    np.testing.assert_allclose(np.log10(p), [-6, -9, -12], atol=0.35)
    assert p.min() < 1 / (len(null) + 1) / 1000


def test_second_moment_is_the_mean_outer_product_per_column():
    w = torch.randn(2, 3, 10, 4, dtype=torch.float64)
    cols = w.permute(2, 0, 1, 3).reshape(10, -1).numpy()
    np.testing.assert_allclose(second_moment(w, "Q").numpy(), cols @ cols.T / cols.shape[1], atol=1e-12)
    w_o = torch.randn(2, 3, 4, 10, dtype=torch.float64)
    rows = w_o.reshape(-1, 10).numpy()  # O: the rows of W_O are the written directions
    np.testing.assert_allclose(second_moment(w_o, "O").numpy(), rows.T @ rows / rows.shape[0], atol=1e-12)


def test_null_heads_live_in_the_support_of_sigma():
    basis = torch.linalg.qr(torch.randn(20, 6, dtype=torch.float64)).Q
    sigma = basis @ torch.diag(torch.tensor([9.0, 5, 4, 3, 2, 1], dtype=torch.float64)) @ basis.T
    heads = null_bases(sigma_root(sigma), 50, 3, torch.Generator().manual_seed(0))
    assert heads.shape == (50, 20, 3)
    torch.testing.assert_close(basis @ (basis.T @ heads), heads, atol=1e-10, rtol=0)


@pytest.mark.parametrize("rank", [8, 5])
def test_the_root_of_sigma_draws_gaussians_of_covariance_sigma(rank):
    """Positive definite (rank 8 of 8: its Cholesky factor) or singular (rank 5: its eigendecomposition): R G has
    the covariance Sigma, measured on 400,000 draws."""
    g = torch.Generator().manual_seed(3)
    factor = torch.randn(8, rank, generator=g, dtype=torch.float64)
    sigma = factor @ factor.T
    draws = sigma_root(sigma) @ torch.randn(8, 400_000, generator=g, dtype=torch.float64)
    np.testing.assert_allclose((draws @ draws.T / draws.shape[1]).numpy(), sigma.numpy(),
                               atol=0.02 * float(sigma.diagonal().max()))


@pytest.mark.parametrize("rank", [50, 30])
def test_the_root_times_each_gaussian_is_the_float64_product(rank):
    """root_product skips only zeros: a Cholesky factor's (lower-triangular, rank 50 of 50), an eigendecomposition's
    (dense, rank 30) and one with a block of zero rows give root @ G of every G as float64 computes it, d not a
    multiple of ROW_BLOCKS."""
    assert 50 % ROW_BLOCKS
    g = torch.Generator().manual_seed(5)
    factor = torch.randn(50, rank, generator=g, dtype=torch.float64)
    root = sigma_root(factor @ factor.T).float()
    assert torch.equal(root, root.tril()) == (rank == 50)
    gaussian = torch.randn(7, 50, 3, generator=g)
    for r in (root, torch.cat([root[:20], torch.zeros(10, 50), root[30:]])):
        expected = r.double() @ gaussian.double()
        torch.testing.assert_close(root_product(r, gaussian).double(), expected, atol=1e-5, rtol=0)


def test_a_cholesky_factor_reported_good_but_not_finite_is_not_the_root(monkeypatch):
    """cuSOLVER (torch 2.11, an H100) factored a singular Sigma with info 0 and a last row of NaN: the root then
    comes from the eigendecomposition, and R R^T is still Sigma."""
    factor = torch.randn(8, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    sigma = factor @ factor.T
    cholesky_ex = torch.linalg.cholesky_ex

    def as_cuda_reported(matrix):
        lower, _ = cholesky_ex(matrix)
        lower[-1] = float("nan")
        return lower, torch.zeros((), dtype=torch.int32)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", as_cuda_reported)
    root = sigma_root(sigma)
    assert torch.isfinite(root).all()
    torch.testing.assert_close(root @ root.T, sigma, atol=1e-10, rtol=0)


def random_model(covariance_root: torch.Tensor | None, seed: int) -> dict[str, torch.Tensor]:
    """Gaussian weights (GPT-2's init scale); each column / written direction ~ N(0, C C^T) if a root C is given."""
    g = torch.Generator().manual_seed(seed)
    w = {t: 0.02 * torch.randn(L, H, D, K, generator=g) for t in "QKV"}
    w["O"] = 0.02 * torch.randn(L, H, K, D, generator=g)
    if covariance_root is not None:
        w = {t: (covariance_root @ v if t != "O" else v @ covariance_root.T) for t, v in w.items()}
    return w


def model_null_sets(w: dict[str, torch.Tensor], type_pairs, n_heads: int, seed: int):
    """The null sets of these weights' own second moments for `type_pairs`."""
    moments = {t: second_moment(v, t) for t, v in w.items()}
    return null_head_sets(moments, {t: head_matrices(v, t).shape[-1] for t, v in w.items()}, type_pairs, n_heads, seed)


def edge_statistics(w: dict[str, torch.Tensor], type_pair: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(q_model, log10_p_iso) of every earlier -> later edge of one type pair."""
    src, tgt = (orthonormal_bases(head_matrices(w[t], t), t, torch.float32) for t in type_pair)
    mask = pair_mask(src.flat_layers(), tgt.flat_layers(), full_matrix=False, same_type=type_pair[0] == type_pair[1])
    pk = pk_matrix(src.flat(), tgt.flat(), mask)[mask].double().numpy()
    sets = model_null_sets(w, [type_pair], n_heads=150, seed=seed)
    null = null_pk_samples(sets, plan_null(sets, [type_pair], max_memory=2**30))[type_pair]
    return benjamini_hochberg(upper_p(pk, null, K)), isotropic_log10_p(pk, D, K, K)


def test_the_null_of_all_16_type_pairs_is_one_pass_that_builds_each_set_once():
    from headgraph.heads import TYPE_PAIRS

    sets = model_null_sets(random_model(None, seed=7), TYPE_PAIRS, n_heads=12, seed=8)
    plan = plan_null(sets, TYPE_PAIRS, max_memory=2**30)
    assert plan.built_heads == 8 * 12  # a source and a target set per weight type, each built once
    nulls = null_pk_samples(sets, plan)
    for tp in TYPE_PAIRS:
        src, tgt = sets[tp[0]][0], sets[tp[1]][1]
        expected = torch.einsum("adk,bde->abke", src.double(), tgt.double()).square().sum(dim=(2, 3))
        np.testing.assert_allclose(nulls[tp], expected.reshape(-1).numpy(), atol=1e-4)


def test_a_null_set_is_the_same_whichever_type_pairs_are_asked_and_only_the_read_ones_are_drawn():
    from headgraph.heads import TYPE_PAIRS

    w = random_model(None, seed=7)
    alone, every = (model_null_sets(w, pairs, n_heads=6, seed=8) for pairs in (["OQ"], TYPE_PAIRS))
    assert set(alone) == {"O", "Q"} and alone["O"][1] is None and alone["Q"][0] is None
    assert torch.equal(alone["O"][0], every["O"][0]) and torch.equal(alone["Q"][1], every["Q"][1])
    assert not torch.allclose(every["O"][0], every["O"][1])  # a same-type pair compares independent draws
    assert not torch.allclose(model_null_sets(w, ["OQ"], n_heads=6, seed=9)["O"][0], alone["O"][0])


@pytest.mark.parametrize("type_pair", ["OQ", "OK", "OV", "QQ", "VO"])
def test_random_init_model_has_at_most_five_percent_discoveries(type_pair):
    q, _ = edge_statistics(random_model(None, seed=2), type_pair, seed=3)
    assert len(q) == 6 * H * H
    assert np.mean(q < 0.05) <= 0.05


def test_model_null_is_calibrated_where_the_isotropic_null_is_not():
    g = torch.Generator().manual_seed(4)
    scales = torch.ones(D)
    scales[:12] = 6.0  # a shared 12-dim high-variance subspace: every head leans into it
    root = torch.linalg.qr(torch.randn(D, D, generator=g)).Q * scales
    q, log10_p_iso = edge_statistics(random_model(root, seed=5), "OK", seed=6)
    assert np.mean(log10_p_iso < np.log10(0.05)) > 0.5
    assert np.mean(q < 0.05) <= 0.05
