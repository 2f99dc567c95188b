"""Head subspace bases: orthonormal, spanning the weights' column spaces, numerical ranks as numpy measures them."""

import numpy as np
import pytest
import torch

from headgraph.analysis.subspaces import head_matrices, head_statistics, orthonormal_bases, rank_deficient_heads


def model_subspaces(weights, types, dtype, device):
    """The bases of `types` as the subspaces stage builds them: layer by layer (head_statistics)."""
    layers = [{f"W_{t}": w[layer] for t, w in weights.items()} for layer in range(weights["Q"].shape[0])]
    return {t: s for t, s in head_statistics(layers, len(layers), dtype, device).subspaces.items() if t in types}


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(0)
    L, H, d, k = 3, 4, 32, 8
    w = {t: torch.randn(L, H, d, k, generator=g, dtype=torch.float64) for t in "QKV"}
    w["O"] = torch.randn(L, H, k, d, generator=g, dtype=torch.float64)
    w["Q"][1, 2, :, 5] = w["Q"][1, 2, :, 0] - 2 * w["Q"][1, 2, :, 3]  # one rank-deficient Q head
    w["O"][2, 0, 7] = 0.0  # one rank-deficient O head (a zero row of W_O)
    return w


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_bases_are_orthonormal_and_span_the_weights(weights, dtype, atol):
    subspaces = model_subspaces(weights, {"Q", "O"}, dtype, torch.device("cpu"))
    for t in ("Q", "O"):
        u = subspaces[t].bases.double()
        m = head_matrices(weights[t], t)
        gram = u.transpose(-2, -1) @ u
        ranks = subspaces[t].ranks
        expected = torch.diag_embed((torch.arange(u.shape[-1]) < ranks[..., None]).double())
        torch.testing.assert_close(gram, expected, atol=atol, rtol=0)
        torch.testing.assert_close(u @ (u.transpose(-2, -1) @ m), m, atol=10 * atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ranks_match_numpy_and_deficient_heads_are_listed(weights, dtype):
    weights = {t: w.to(dtype) for t, w in weights.items()}
    subspaces = model_subspaces(weights, {"Q", "K", "V", "O"}, dtype, torch.device("cpu"))
    for t, sub in subspaces.items():
        expected = np.linalg.matrix_rank(head_matrices(weights[t], t).numpy())  # eps of the input's dtype
        np.testing.assert_array_equal(sub.ranks.numpy(), expected)
    listed = {(r["type"], r["layer"], r["head"], r["rank"]) for r in rank_deficient_heads(subspaces)}
    assert listed == {("Q", 1, 2, 7), ("O", 2, 0, 7)}


def test_o_subspace_is_the_row_space_of_w_o(weights):
    sub = orthonormal_bases(head_matrices(weights["O"], "O"), "O", torch.float64)
    w_o = weights["O"][0, 1].numpy()  # d_head x d_model: the head writes w_o^T x into the residual stream
    writes = w_o.T @ np.random.default_rng(1).standard_normal(w_o.shape[0])
    u = sub.bases[0, 1].numpy()
    np.testing.assert_allclose(u @ (u.T @ writes), writes, atol=1e-10)


def test_grouped_query_keys_keep_their_native_heads():
    w_k = torch.randn(2, 2, 16, 4, dtype=torch.float64)  # 2 native KV heads per layer
    sub = orthonormal_bases(head_matrices(w_k, "K"), "K", torch.float64)
    assert sub.bases.shape == (2, 2, 16, 4) and sub.flat().shape == (4, 16, 4)
    assert sub.flat_layers().tolist() == [0, 0, 1, 1]


def test_bad_weight_type_is_refused():
    with pytest.raises(ValueError, match="weight type"):
        head_matrices(torch.zeros(1, 1, 4, 2), "X")


@pytest.mark.parametrize("d", [32, 50])  # blocks of rows that divide d, and that do not
def test_layer_by_layer_moments_equal_the_second_moment_of_all_heads(weights, d):
    """Each type's moment, summed layer by layer below its diagonal blocks and mirrored, is the mean of M M^T / k
    over all heads, symmetric."""
    from headgraph.analysis.significance import second_moment

    if d != 32:
        g = torch.Generator().manual_seed(1)
        weights = {t: torch.randn(3, 2, *((8, d) if t == "O" else (d, 8)), generator=g, dtype=torch.float64)
                   for t in "QKVO"}
    layers = [{f"W_{t}": w[layer] for t, w in weights.items()} for layer in range(3)]
    moments = head_statistics(layers, 3, torch.float64, torch.device("cpu")).moments
    for t in "QKVO":
        torch.testing.assert_close(moments[t], second_moment(weights[t], t), atol=1e-12, rtol=0)
        assert torch.equal(moments[t], moments[t].T)
