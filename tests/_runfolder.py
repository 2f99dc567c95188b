"""A small analysis run folder with the exact artifact contract, built from random weights.

Used by the report/figure/compare tests until they can run the real PK pipeline on a planted model.
Head subspaces are random orthonormal (Haar) bases; planted edges replace the target's subspace by
one close to the source's O subspace, so their PK is large. Composition scores come from the same
weights (W = U @ S with a random square S), so they agree with the subspaces.
"""

import json
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from headgraph.analysis.reference import isotropic_log10_p
from headgraph.runs import Dims, ModelInfo, RunRecord

TYPES = "QKVO"


def _orthonormal(rng, *shape):
    q, _ = np.linalg.qr(rng.standard_normal(shape))
    return q


def _reference(d, k, kp):
    mean = k * kp / d
    var = 2 * k * kp * (d - k) * (d - kp) / (d**2 * (d - 1) * (d + 2))
    return mean, var


def _beta(mean, var, upper):
    x, v = mean / upper, var / upper**2
    common = x * (1 - x) / v - 1
    return stats.beta(x * common, (1 - x) * common, scale=upper)


def build_bases(n_layers, n_heads, d_model, d_head, seed):
    rng = np.random.default_rng(seed)
    return {t: _orthonormal(rng, n_layers, n_heads, d_model, d_head) for t in TYPES}


def plant(bases, source, target, target_type, strength=0.9, seed=1):
    """Make target's `target_type` subspace close to source's O subspace (source, target = (layer, head))."""
    rng = np.random.default_rng(seed)
    u_o = bases["O"][source]
    noise = rng.standard_normal(u_o.shape)
    mixed, _ = np.linalg.qr(strength * u_o + (1 - strength) * noise / np.sqrt(u_o.shape[0]))
    bases[target_type] = bases[target_type].copy()
    bases[target_type][target] = mixed


def _weights(bases, seed):
    rng = np.random.default_rng(seed + 1000)
    n_layers, n_heads, _, k = bases["Q"].shape
    mix = {t: rng.standard_normal((n_layers, n_heads, k, k)) for t in TYPES}
    w = {t: np.einsum("lhdk,lhkj->lhdj", bases[t], mix[t]) for t in "QKV"}
    w["O"] = np.einsum("lhdk,lhkj->lhjd", bases["O"], mix["O"])  # [l, h, d_head, d_model]
    return w


def _composition_scores(w, target_type):
    """CS(A, B) = |AB| / (|A||B|) for A = W_V W_O of the source and B by target type, as [L, H, L, H].

    With A = V O and B = R Lᵀ (Q: R=W_Q, L=W_K; K: R=W_K, L=W_Q; V: R=W_V, L=W_Oᵀ) all norms reduce to
    traces of d_head × d_head Gram matrices, so no d_model × d_model matrix is formed.
    """
    right = {"Q": w["Q"], "K": w["K"], "V": w["V"]}[target_type]
    left = {"Q": w["K"], "K": w["Q"], "V": np.swapaxes(w["O"], -1, -2)}[target_type]
    g_v = np.einsum("lhdk,lhdj->lhkj", w["V"], w["V"], optimize=True)
    g_left = np.einsum("lhdk,lhdj->lhkj", left, left, optimize=True)
    m = np.einsum("lhkd,mgdj->lhmgkj", w["O"], right, optimize=True)
    ab = np.einsum("lhmgkj,lhki,lhmgin,mgjn->lhmg", m, g_v, m, g_left, optimize=True)
    a = np.einsum("lhki,lhid,lhkd->lh", g_v, w["O"], w["O"], optimize=True)
    b = np.einsum("lhdk,lhdj,lhkj->lh", right, right, g_left, optimize=True)
    return np.sqrt(ab) / np.sqrt(a[:, :, None, None] * b[None, None, :, :])


def _bh(p):
    return stats.false_discovery_control(p)


def write_run(run_dir, *, n_layers=4, n_heads=4, d_model=64, d_head=8, seed=0, bases=None,
              types=("OQ", "OK", "OV"), model="synthetic-4x4", identity_heads=("L0H1",)):
    """Write run.json, pairs.parquet and heads.parquet for random (or given) bases; return the folder."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if bases is None:
        bases = build_bases(n_layers, n_heads, d_model, d_head, seed)
    n_layers, n_heads, d_model, d_head = bases["Q"].shape
    w = _weights(bases, seed)
    ls, hs = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")
    names = np.array([f"L{l}H{h}" for l, h in zip(ls.ravel(), hs.ravel())])
    earlier = (ls.ravel()[:, None] < ls.ravel()[None, :])
    mean, var = _reference(d_model, d_head, d_head)
    ref = _beta(mean, var, d_head)
    frames, kl, mean_pk = [], {}, {}
    edges = np.arange(0, d_head + 0.252, 0.252)
    ref_hist = np.diff(ref.cdf(edges))
    for tp in types:
        s, t = tp
        g = np.einsum("lhdk,mgdj->lhmgkj", bases[s], bases[t], optimize=True)
        pk = (g**2).sum(axis=(-2, -1)).reshape(n_layers * n_heads, n_layers * n_heads)
        src, tgt = np.nonzero(earlier)
        vals = pk[src, tgt]
        order = np.argsort(-vals)
        ranks = np.empty_like(order)
        ranks[order] = np.arange(len(vals))
        p_model = (ranks + 1) / len(vals)
        cs = (_composition_scores(w, t).reshape(pk.shape)[src, tgt] if s == "O" and t in "QKV"
              else np.full(len(vals), np.nan))
        frames.append(pd.DataFrame({
            "source": names[src], "target": names[tgt],
            "source_layer": ls.ravel()[src], "source_head": hs.ravel()[src],
            "target_layer": ls.ravel()[tgt], "target_head": hs.ravel()[tgt],
            "source_type": s, "target_type": t,
            "pk": vals, "pk_norm": vals / d_head,
            "z_iso": (vals - mean) / np.sqrt(var),
            "log10_p_iso": isotropic_log10_p(vals, d_model, d_head, d_head),
            "p_model": p_model, "q_model": _bh(p_model), "cs": cs,
        }))
        obs = np.histogram(vals, edges)[0] / len(vals)
        obs = np.where(obs > 0, obs, 1e-10)
        keep = ref_hist > 0
        kl[tp] = float(np.sum(ref_hist[keep] * np.log(ref_hist[keep] / obs[keep])))
        mean_pk[tp] = float(vals.mean())
    pairs = pd.concat(frames, ignore_index=True)
    pairs.to_parquet(run_dir / "pairs.parquet", index=False)

    rng = np.random.default_rng(seed + 7)
    identity = rng.uniform(0.02, 0.2, len(names))
    identity[np.isin(names, identity_heads)] = 0.95
    prev = rng.uniform(0.5, 2.0, len(names))
    heads = pd.DataFrame({
        "head": names, "layer": ls.ravel(), "index": hs.ravel(),
        "rank_q": d_head, "rank_k": d_head, "rank_v": d_head, "rank_o": d_head,
        "identity_score": identity,
        "identity_p": np.where(identity > 0.5, 1e-6, 0.6),
        "identity_sig": identity > 0.5,
        "previous_token_score": prev,
        "previous_token_p": np.where(prev > 1.9, 1e-3, 0.5),
        "previous_token_sig": prev > 1.9,
    })
    heads.to_parquet(run_dir / "heads.parquet", index=False)

    a, b = _beta(mean, var, d_head).args
    run = RunRecord(
        headgraph_version="test",
        created="2026-01-01T00:00:00+00:00",
        model=ModelInfo(model, str(run_dir / "model"), "GPT2LMHeadModel", True),
        dims=Dims(n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads, d_model=d_model, d_head=d_head, n_ctx=128),
        processing="tl", device="cpu", dtype="float32", seed=seed,
        types=tuple(types),
        pairs="earlier layer -> strictly later layer",
        n_pairs={tp: int(len(src)) for tp in types},
        max_memory=2**30,
        engine={},
        timings_s={"projection_kernel": 0.01},
        reference={
            "moments": {f"{d_head},{d_head}": {"k": d_head, "k_prime": d_head, "mean": mean, "var": var,
                                               "beta_a": a, "beta_b": b}},
            "samples": 0, "sampler": "none (test fixture: Beta cdf on the grid)", "tail": "moment-matched Beta",
            "kl_grid": {"start": 0.0, "bin_width": 0.252, "n_bins": len(edges) - 1, "eps": 1e-10,
                        "reference_widths": {tp: [d_head, d_head] for tp in types}},
        },
        kl={"definition": "KL(P_random || P_observed)", "rows": list(TYPES), "cols": list(TYPES),
            "matrix": [[kl.get(s + t) for t in TYPES] for s in TYPES]},
        mean_pk=mean_pk,
        fraction_q_model_below_005={tp: float((pairs["q_model"][pairs["source_type"] + pairs["target_type"] == tp] < 0.05).mean())
                                    for tp in types},
        null_model={"name": "within_type_rank"},
        nulls={"z_iso": "isotropic Haar reference, exact mean and variance",
               "p_model": "within_type_rank: rank of the pair within its type (test fixture)",
               "q_model": "Benjamini-Hochberg within each type pair (p_model)"},
        head_naming="L{layer}H{head}",
        rank_deficient_heads=[],
    )
    (run_dir / "run.json").write_text(json.dumps(run.to_json(), indent=2))
    return run_dir
