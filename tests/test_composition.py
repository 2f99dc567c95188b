"""Composition Scores equal TransformerLens' (its FactoredMatrix composition_scores and the bridge's
all_composition_scores)."""

import pytest
import torch
from transformer_lens import utilities as tl_utils
from transformer_lens.FactoredMatrix import FactoredMatrix

from headgraph.analysis.composition import composition_scores, expand_kv
from headgraph.analysis.pk import pair_mask


def tl_scores(W_Q, W_K, W_V, W_O, mode):
    """TransformerLens' composition scores [L, H, L, H] from factored W_OV and W_QK (no masking)."""
    left = FactoredMatrix(W_V, W_O)
    qk = FactoredMatrix(W_Q, W_K.transpose(-2, -1))
    right = {"Q": qk, "K": qk.T, "V": left}[mode]
    return tl_utils.composition_scores(left, right, broadcast_dims=True)


def forward_mask(n_layers, n_heads):
    layers = torch.arange(n_layers).repeat_interleave(n_heads)
    return pair_mask(layers, layers, full_matrix=False, same_type=False)


@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_equals_transformer_lens_factored_scores(mode):
    g = torch.Generator().manual_seed(0)
    L, H, d, k = 3, 4, 48, 8
    W_Q, W_K, W_V = (torch.randn(L, H, d, k, generator=g, dtype=torch.float64) for _ in range(3))
    W_O = torch.randn(L, H, k, d, generator=g, dtype=torch.float64)
    mask = forward_mask(L, H)
    ours = composition_scores(W_Q, W_K, W_V, W_O, mode, mask, max_memory=2**30)
    expected = tl_scores(W_Q, W_K, W_V, W_O, mode).reshape(L * H, L * H)
    torch.testing.assert_close(ours[mask], expected[mask], atol=1e-12, rtol=0)
    assert ours[~mask].isnan().all()


def test_grouped_query_heads_are_expanded_like_transformer_lens():
    g = torch.Generator().manual_seed(1)
    L, H, n_kv, d, k = 2, 4, 2, 32, 8
    W_Q = torch.randn(L, H, d, k, generator=g, dtype=torch.float64)
    W_K, W_V = (torch.randn(L, n_kv, d, k, generator=g, dtype=torch.float64) for _ in range(2))
    W_O = torch.randn(L, H, k, d, generator=g, dtype=torch.float64)
    mask = forward_mask(L, H)
    ours = composition_scores(W_Q, W_K, W_V, W_O, "Q", mask, max_memory=2**30)
    expected = tl_scores(W_Q, expand_kv(W_K, H), expand_kv(W_V, H), W_O, "Q").reshape(L * H, L * H)
    torch.testing.assert_close(ours[mask], expected[mask], atol=1e-12, rtol=0)
    assert torch.equal(expand_kv(W_K, H)[:, 1], W_K[:, 0]) and torch.equal(expand_kv(W_K, H)[:, 2], W_K[:, 1])


@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_equals_bridge_all_composition_scores(planted, mode):
    from headgraph.loader.models import load_model

    model = load_model(planted[0], processing="tl", device="cpu")
    L, H = model.cfg["n_layers"], model.cfg["n_heads"]
    mask = forward_mask(L, H)
    ours = composition_scores(model.W_Q, model.W_K, model.W_V, model.W_O, mode, mask, max_memory=2**30)
    expected = model.bridge.all_composition_scores(mode).scores.reshape(L * H, L * H)
    torch.testing.assert_close(ours[mask], expected[mask].to(ours.dtype), atol=1e-5, rtol=0)
