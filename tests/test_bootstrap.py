"""The shared percentile bootstrap (`headgraph.analysis.bootstrap`) against numpy's own percentile."""

import numpy as np
import pytest

from headgraph.analysis.bootstrap import percentile_interval, ratio_intervals, resample_counts


@pytest.mark.parametrize("n", [1, 2, 3, 8, 999, 1000])
@pytest.mark.parametrize("confidence", [0.95, 0.9, 0.5])
def test_the_interval_is_numpys_linear_percentile_bit_for_bit(n, confidence):
    """Rows with a NaN (NaN bounds), infinities of either sign, ties and constants; along either axis."""
    rng = np.random.default_rng(n)
    boot = rng.standard_normal((40, n))
    boot[1, 0], boot[2, -1], boot[3], boot[4] = np.nan, np.inf, np.inf, 1.5
    boot[5, : n // 2] = -np.inf
    boot[6] = np.round(boot[6])
    tail = 50.0 * (1.0 - confidence)
    with np.errstate(invalid="ignore"):  # inf - inf in the interpolation, numpy's as ours
        want = np.percentile(boot, [tail, 100 - tail], axis=-1)
        for got in (percentile_interval(boot, confidence), percentile_interval(boot.T, confidence, axis=0)):
            assert np.array_equal(got[0], want[0], equal_nan=True) and np.array_equal(got[1], want[1], equal_nan=True)
    assert np.isnan(want[0][1]) and np.isnan(want[1][1])


def test_ratio_intervals_resample_numerator_and_denominator_together():
    """Each resample's ratio of sums, recomputed by drawing the items themselves."""
    rng = np.random.default_rng(3)
    num, den = rng.normal(size=(5, 12)), rng.uniform(1, 2, size=(5, 12))
    estimate, lo, hi = ratio_intervals(num, den, n_boot=200, seed=[4, 1])
    draws = np.random.default_rng([4, 1]).integers(0, 12, size=(200, 12))
    boot = np.stack([num[:, d].sum(1) / den[:, d].sum(1) for d in draws], 1)
    np.testing.assert_allclose(estimate, num.sum(1) / den.sum(1))
    np.testing.assert_allclose(np.stack([lo, hi]), np.percentile(boot, [2.5, 97.5], axis=1), rtol=1e-12)
    assert resample_counts(12, 200, [4, 1]).sum(0).tolist() == [12.0] * 200


@pytest.mark.parametrize("threads", [1, 3])
def test_rows_in_blocks_with_a_shorter_last_one_get_their_own_intervals(monkeypatch, threads):
    """Rows are resampled in blocks that reuse two buffers per thread; the last, shorter block reads no row of the
    one before it in its thread (23 rows in blocks of 7: 7, 7, 7 and 2; in 3 threads the first thread's are the
    first and the last)."""
    import torch

    from headgraph.analysis import bootstrap

    monkeypatch.setattr(bootstrap, "_CHUNK", 7)
    rng = np.random.default_rng(5)
    num, den = rng.normal(size=(23, 9)), rng.uniform(1, 2, size=(23, 9))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _, lo, hi = ratio_intervals(num, den, n_boot=150, seed=6)
    finally:
        torch.set_num_threads(before)
    draws = np.random.default_rng(6).integers(0, 9, size=(150, 9))
    boot = np.stack([num[:, d].sum(1) / den[:, d].sum(1) for d in draws], 1)
    np.testing.assert_allclose(np.stack([lo, hi]), np.percentile(boot, [2.5, 97.5], axis=1), rtol=1e-12)


def test_float32_items_give_the_intervals_of_their_float64_copies():
    """The local effects hold their per-input sums in float32: the ratios and their resamples are summed in
    float64 all the same (a float32 sum of these 600 items differs in its last bits)."""
    rng = np.random.default_rng(8)
    num, den = rng.normal(size=(6, 600)).astype(np.float32), rng.uniform(1, 2, size=(6, 600)).astype(np.float32)
    assert not np.array_equal(num.sum(1), num.astype(float).sum(1))
    got = ratio_intervals(num, den, n_boot=300, seed=2)
    want = ratio_intervals(num.astype(float), den.astype(float), n_boot=300, seed=2)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
