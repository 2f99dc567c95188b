"""Isotropic reference: samplers against the exact moments and an independent QR sampler, the Beta tail
against sampled tails and mpmath, KL against scipy's entropy."""

import math

import mpmath
import numpy as np
import pytest
from scipy import stats

from headgraph.analysis.reference import (beta_log_sf, beta_parameters, histogram_edges, isotropic_log10_p,
                                          isotropic_moments, isotropic_z, kl_divergence, sample_isotropic_pk)

SHAPES = [(64, 16, 16), (64, 16, 8), (20, 12, 15), (30, 20, 25), (384, 32, 32), (10, 10, 3)]
SLOW_CASES = {("wishart", 30, 20, 25), ("wishart", 384, 32, 32)}  # 6-12 s each
MOMENT_CASES = [pytest.param(method, *shape, id=f"{'-'.join(map(str, shape))}-{method}",
                             marks=pytest.mark.slow if (method, *shape) in SLOW_CASES else ())
                for shape in SHAPES for method in ("jacobi", "wishart")]


def qr_pk_samples(d, k, k_prime, n, seed):
    """The obvious sampler: PK between the column spaces of two independent Gaussian matrices."""
    rng = np.random.default_rng(seed)
    a = np.linalg.qr(rng.standard_normal((n, d, k)))[0]
    b = np.linalg.qr(rng.standard_normal((n, d, k_prime)))[0]
    return np.square(a.transpose(0, 2, 1) @ b).sum(axis=(1, 2))


@pytest.mark.parametrize("method, d, k, k_prime", MOMENT_CASES)
def test_sampled_moments_within_three_standard_errors(method, d, k, k_prime):
    n = 100_000 if method == "jacobi" else 20_000
    samples = sample_isotropic_pk(d, k, k_prime, n, seed=1, method=method)
    mean, var = isotropic_moments(d, k, k_prime)
    if var == 0:  # k' = d: the second subspace is everything, PK = k exactly
        assert np.allclose(samples, min(k, k_prime))
        return
    assert abs(samples.mean() - mean) <= 3 * math.sqrt(var / n)
    centred = samples - samples.mean()
    se_var = math.sqrt((np.mean(centred**4) - np.mean(centred**2) ** 2) / n)
    assert abs(samples.var(ddof=1) - var) <= 3 * se_var


def test_variance_formula_for_lines_is_that_of_a_squared_unit_coordinate():
    d = 11
    _, var = isotropic_moments(d, 1, 1)
    # a uniform unit vector's squared coordinate is Beta(1/2, (d-1)/2)
    assert var == pytest.approx(stats.beta(0.5, (d - 1) / 2).var(), rel=1e-12)


@pytest.mark.parametrize("d,k,k_prime", [(24, 6, 4), pytest.param(20, 12, 15, marks=pytest.mark.slow)])
def test_samplers_match_the_qr_sampler_in_distribution(d, k, k_prime):
    qr = qr_pk_samples(d, k, k_prime, 20_000, seed=7)
    for method in ("jacobi", "wishart"):
        assert stats.ks_2samp(qr, sample_isotropic_pk(d, k, k_prime, 20_000, seed=8, method=method)).pvalue > 1e-3


def test_samplers_are_seedable():
    np.testing.assert_array_equal(sample_isotropic_pk(64, 8, 8, 100, seed=3), sample_isotropic_pk(64, 8, 8, 100, seed=3))
    assert not np.array_equal(sample_isotropic_pk(64, 8, 8, 100, seed=3), sample_isotropic_pk(64, 8, 8, 100, seed=4))


@pytest.mark.slow
def test_beta_tail_matches_the_sampled_tail():
    d, k = 128, 16
    n = 1_000_000
    samples = sample_isotropic_pk(d, k, k, n, seed=11)
    mean, var = isotropic_moments(d, k, k)
    for p in (1e-1, 1e-2, 1e-3, 1e-4):
        x = np.quantile(samples, 1 - p)
        tolerance = 4 * math.sqrt(p * (1 - p) / n)
        assert abs(10 ** isotropic_log10_p(x, d, k, k) - p) <= tolerance
        if p <= 1e-2:  # the test can tell: a Normal with the same moments misses these tails
            assert abs(stats.norm.sf(x, mean, math.sqrt(var)) - p) > tolerance


@pytest.mark.parametrize("x", [0.2, 0.5, 0.8, 0.99])
def test_beta_log_tail_matches_mpmath_far_beyond_underflow(x):
    a, b = beta_parameters(*isotropic_moments(200, 20, 20), 20)
    mpmath.mp.dps = 30
    exact = float(mpmath.log(mpmath.re(mpmath.betainc(b, a, 0, 1 - x, regularized=True))))  # P(X > x)
    assert exact < -80  # e^-80: scipy's survival function is still finite here, e^-800 is not
    assert beta_log_sf(x, a, b) == pytest.approx(exact, rel=1e-9)


def test_isotropic_p_values_stay_finite_and_ordered():
    pk = np.array([5.0, 5.5, 8.0, 20.0, 50.0, 64.0])
    log_p = isotropic_log10_p(pk, 768, 64, 64)
    assert np.isfinite(log_p).all() and (np.diff(log_p) < 0).all()
    assert isotropic_z(5.333333333333333 + 0.1079, 768, 64, 64) == pytest.approx(1.0, abs=1e-3)


def test_kl_divergence_equals_scipy_entropy_on_the_grid():
    edges = histogram_edges(64.0)
    assert len(edges) == 255 and edges[1] == pytest.approx(64 / 254)
    rng = np.random.default_rng(0)
    reference = rng.normal(5.33, 0.11, 50_000)
    observed = rng.gamma(9.0, 0.6, 20_000)
    p = np.histogram(reference, edges)[0] / len(reference)
    q = np.histogram(observed, edges)[0] / len(observed)
    assert (q[p > 0] > 0).all()
    assert kl_divergence(reference, observed, edges) == pytest.approx(stats.entropy(p, q), rel=1e-10)


def test_kl_uses_eps_for_empty_observed_bins():
    edges = np.array([0.0, 1.0, 2.0])
    # all reference mass in bin 0, observed all in bin 1: KL = log(1 / eps)
    assert kl_divergence(np.full(10, 0.5), np.full(10, 1.5), edges, eps=1e-6) == pytest.approx(math.log(1e6))
    assert kl_divergence(np.full(10, 0.5), np.array([0.5, 1.5]), edges) == pytest.approx(math.log(2))
