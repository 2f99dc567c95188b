"""The stability report: its comparisons against hand-computed references, the rank-tolerance knob it turns, and
`headgraph stability` / `analyze --stability` end to end on the shipped induction model."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from _commands import headgraph
from _fast import FLAGS, PK, PK_ONLY
from scipy.stats import spearmanr

from headgraph.analysis.selection import SelectionPolicy
from headgraph.analysis.stability import compare_variant
from headgraph.analysis.subspaces import orthonormal_bases


def _pairs(rng, n=40):
    frames = []
    for kind in "QK":
        pk = rng.gamma(2.0, 1.0, n)
        frames.append(pd.DataFrame({"source": [f"L0H{i}" for i in range(n)], "target": "L1H0", "source_layer": 0,
                                    "target_layer": 1, "source_type": "O", "target_type": kind, "pk": pk,
                                    "q_model": rng.uniform(0, 0.1, n), "effect": rng.uniform(0, 1, n)}))
    return pd.concat(frames, ignore_index=True)


def test_comparisons_match_scipy_and_set_arithmetic():
    rng = np.random.default_rng(0)
    run = _pairs(rng)
    variant = run.assign(pk=run.pk + rng.normal(0, 0.5, len(run)), q_model=run.q_model[::-1].to_numpy(),
                         effect=run.effect + rng.normal(0, 0.1, len(run)))
    heads = pd.DataFrame({"head": ["L0H0", "L0H1", "L1H0"], "layer": [0, 0, 1], "index": [0, 1, 0],
                          "induction_sig": [True, False, True]})
    other_heads = heads.assign(induction_sig=[True, True, False])
    compared = compare_variant(run, variant, heads, other_heads, SelectionPolicy(top_k=5))
    rows = {r["type"]: r for r in compared.pairs}
    for kind in "QK":
        mine, theirs = run[run.target_type == kind], variant[variant.target_type == kind]
        row = rows[f"O{kind}"]
        assert row["pk_spearman"] == pytest.approx(spearmanr(mine.pk, theirs.pk).statistic)
        assert row["effect_spearman"] == pytest.approx(spearmanr(mine.effect, theirs.effect).statistic)
        top_mine, top_theirs = set(mine.nlargest(5, "pk").source), set(theirs.nlargest(5, "pk").source)
        assert row["jaccard"] == pytest.approx(len(top_mine & top_theirs) / len(top_mine | top_theirs))
        assert row["significance_flips"] == int(((mine.q_model <= 0.05).to_numpy()
                                                 != (theirs.q_model <= 0.05).to_numpy()).sum())
    assert compared.roles == [{"role": "induction", "significant": 2, "flips": 2, "flipped": ["L0H1", "L1H0"]}]


def test_the_rank_tolerance_scale_moves_the_numerical_rank():
    """A head with one singular value of 1e-6: below float32's threshold 64 * eps * sigma_max = 7.6e-6, above a
    tenth of it."""
    u, _ = torch.linalg.qr(torch.randn(64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    sigma = torch.ones(16, dtype=torch.float64)
    sigma[-1] = 1e-6
    matrices = (u * sigma).float()[None, None]
    ranks = {scale: int(orthonormal_bases(matrices, "Q", torch.float32, scale).ranks) for scale in (10.0, 1.0, 0.1)}
    assert ranks == {10.0: 15, 1.0: 15, 0.1: 16}


@pytest.mark.slow
def test_stability_of_the_induction_model_end_to_end(tmp_path):
    out = tmp_path / "run"
    done = headgraph("analyze", "induction-2l", "--stability", "--out", str(out), "--no-store",
                     "--causal-loss-edges", "0", *FLAGS)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "stability.json").read_text())
    variants = report["variants"]
    assert set(variants) == {"float64", "rank_tol_x10", "rank_tol_div10", "null_seed", "inputs", "cuda"}
    for name in ("float64", "rank_tol_x10", "rank_tol_div10", "null_seed"):  # the PK of this model is robust
        assert all(row["pk_spearman"] > 0.999 for row in variants[name]["pairs"]), name
    inputs = {row["type"]: row for row in variants["inputs"]["pairs"]}
    assert inputs["OK"]["pk_spearman"] > 0.999 and 0.5 < inputs["OK"]["effect_spearman"] < 1.0  # new inputs move effects
    if not torch.cuda.is_available():
        assert variants["cuda"] == {"what": variants["cuda"]["what"], "skipped": "no CUDA device"}
    assert "## Stability" in (out / "report.md").read_text()
    again = headgraph("stability", str(out), "--variant", "null_seed", "--json")
    assert again.returncode == 0, again.stderr
    assert set(json.loads(again.stdout)["variants"]) == {"null_seed"}
    assert set(json.loads((out / "stability.json").read_text())["variants"]) == {"null_seed"}


def test_reruns_read_the_recorded_settings_not_the_words_of_the_record(tmp_path):
    import headgraph
    from headgraph.analysis.options import PKOptions
    from headgraph.runs import load_run
    from headgraph.stability import rerun_options

    run = headgraph.analyze("induction-2l", out=tmp_path / "run", progress=False, device="cpu", full_matrix=True,
                            seed=2, top_k=4, **PK_ONLY)
    path = run.path / "run.json"
    written = json.loads(path.read_text())
    assert written["full_matrix"] is True and written["pairs"].startswith("full matrix")
    path.write_text(json.dumps({**written, "pairs": "earlier layer -> strictly later layer"}))  # words that disagree
    options = rerun_options(load_run(run.path))
    assert options.pk == PKOptions(types=("OQ", "OK", "OV"), full_matrix=True, device="cpu", seed=2, **PK)
    assert options.policy == SelectionPolicy(top_k=4) and options.roles is None and options.causal is None
    assert options.store is None and not options.report
    # a run.json of format 3 recorded the setting only in words: they are read for it there
    older = {k: v for k, v in written.items() if k not in ("full_matrix", "stages", "peak_rss")}
    path.write_text(json.dumps({**older, "format_version": 3}))
    assert rerun_options(load_run(run.path)).pk.full_matrix is True
