"""compare: two checkpoints of one architecture; the planted difference must come first."""

import json

import numpy as np
import pytest
from _runfolder import build_bases, plant, write_run

from headgraph.analysis.selection import SelectionPolicy
from headgraph.cli import main
from headgraph.errors import UsageError
from headgraph.report.compare import compare_runs
from headgraph.runs import load_run

D_MODEL, D_HEAD = 64, 8
PLANTED = ("L1H2", "L3H1", "OK")


def _reference_sd(d, k):
    return np.sqrt(2 * k * k * (d - k) * (d - k) / (d**2 * (d - 1) * (d + 2)))


def _top(run, k):
    pairs = run.pairs.assign(kind=run.pairs["source_type"] + run.pairs["target_type"])
    top = pairs.sort_values("pk", ascending=False).groupby("kind").head(k)
    return set(zip(top["source"], top["target"], top["kind"]))


def _perturbed(bases, scale, seed):
    """Every head subspace rotated a little (a 'fine-tuned' checkpoint)."""
    rng = np.random.default_rng(seed)
    out = {}
    for t, b in bases.items():
        q, _ = np.linalg.qr(b + scale * rng.standard_normal(b.shape))
        out[t] = q
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    base = build_bases(4, 4, D_MODEL, D_HEAD, seed=11)
    tuned = _perturbed(base, 0.03, seed=12)
    planted = {t: b.copy() for t, b in tuned.items()}
    plant(planted, (1, 2), (3, 1), "K", strength=0.8)
    return {
        "base": load_run(write_run(root / "base", bases=base)),
        "tuned": load_run(write_run(root / "tuned", bases=tuned)),
        "planted": load_run(write_run(root / "planted", bases=planted, identity_heads=("L0H1", "L3H2"))),
    }


def test_the_planted_edge_is_reported_first(runs):
    result = compare_runs(runs["base"], runs["planted"], SelectionPolicy(top_k=5))
    first = result.edges.iloc[0]
    assert (first["source"], first["target"], first["kind"]) == PLANTED
    assert first["status"] == "appears" and first["rank_b"] == 1
    pk = {name: runs[name].pairs.query("source == 'L1H2' and target == 'L3H1' and target_type == 'K'")["pk"].item()
          for name in ("base", "planted")}
    assert first["delta_pk"] == pytest.approx(pk["planted"] - pk["base"])
    assert first["delta_sd"] == pytest.approx((pk["planted"] - pk["base"]) / _reference_sd(D_MODEL, D_HEAD))
    assert first["delta_sd"] > 10 * abs(result.edges["delta_sd"].iloc[1])
    assert list(result.edges["delta_sd"].abs()) == sorted(result.edges["delta_sd"].abs(), reverse=True)


def test_reverse_comparison_reports_the_edge_vanishing(runs):
    result = compare_runs(runs["planted"], runs["base"], SelectionPolicy(top_k=5))
    first = result.edges.iloc[0]
    assert (first["source"], first["target"], first["kind"], first["status"]) == (*PLANTED, "vanishes")
    assert first["delta_pk"] < 0


def test_small_uniform_drift_has_no_dominant_change(runs):
    drift = compare_runs(runs["base"], runs["tuned"], SelectionPolicy(top_k=5)).edges
    planted = compare_runs(runs["base"], runs["planted"], SelectionPolicy(top_k=5)).edges
    assert drift["delta_sd"].abs().max() < planted["delta_sd"].abs().max() / 4
    assert set(drift["status"]) <= {"appears", "vanishes", "changes"}
    flips = drift[drift["status"] != "changes"]
    flipped = set(zip(flips["source"], flips["target"], flips["kind"]))
    assert flipped == _top(runs["base"], 5) ^ _top(runs["tuned"], 5)


def test_role_flip_is_reported(runs):
    roles = compare_runs(runs["base"], runs["planted"]).roles
    assert (roles.iloc[0]["head"], roles.iloc[0]["role"], roles.iloc[0]["status"]) == ("L3H2", "identity", "appears")
    assert roles.iloc[0]["delta_log10_p"] == pytest.approx(np.log10(1e-6) - np.log10(0.6))


def test_different_architectures_are_refused(runs, tmp_path):
    other = load_run(write_run(tmp_path / "other", n_layers=3, n_heads=4, d_model=64, d_head=8))
    with pytest.raises(UsageError, match="different architectures.*n_layers 4 vs 3"):
        compare_runs(runs["base"], other)


def test_cli_json_and_table(runs, capsys):
    main(["compare", str(runs["base"].path), str(runs["planted"].path), "--top-k", "5", "--json"])
    data = json.loads(capsys.readouterr().out)
    first = data["edges"][0]
    assert (first["source"], first["target"], first["kind"], first["status"]) == (*PLANTED, "appears")
    assert data["selection"] == "top 5 per type by PK" and data["roles"][0]["head"] == "L3H2"
    main(["compare", str(runs["base"].path), str(runs["planted"].path), "--top-k", "5", "--limit", "3"])
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if "→L" in line]
    assert len(rows) == 3 and "L1H2→L3H1 OK" in rows[0] and "appears" in rows[0]


@pytest.fixture(scope="module")
def planted_checkpoints(tmp_path_factory):
    """Two planted GPT-2 checkpoints, run through the PK pipeline, that differ by one planted edge."""
    from headgraph.loader.models import load_model
    from headgraph.pipeline import compute_pk
    from headgraph.runs import write_run as write_run_folder
    from headgraph.testing.planted import PlantSpec, save_planted

    root = tmp_path_factory.mktemp("checkpoints")
    full = PlantSpec()
    runs, truths = {}, {}
    for name, spec in (("base", PlantSpec(edges=full.edges[:-1])), ("tuned", full)):
        folder, truths[name] = save_planted(root / name, spec)
        result = compute_pk(load_model(str(folder), processing="tl"), progress=False, null_heads=50,
                         reference_samples=2000)
        runs[name] = load_run(write_run_folder(result, root / f"run-{name}"))
    added = set(truths["tuned"].edges) - set(truths["base"].edges)
    return runs, added, truths["tuned"]


@pytest.mark.slow
def test_pipeline_checkpoints_differing_by_one_planted_edge(planted_checkpoints):
    runs, added, truth = planted_checkpoints
    (source, target, kind, _alpha), = added
    planted_of_kind = sum(edge[2] == kind for edge in truth.edges)
    result = compare_runs(runs["base"], runs["tuned"], SelectionPolicy(top_k=5))
    first = result.edges.iloc[0]
    assert (first["source"], first["target"], first["kind"], first["status"]) == (source, target, kind, "appears")
    assert first["rank_b"] <= planted_of_kind and first["delta_sd"] > 5 * abs(result.edges["delta_sd"].iloc[1])
    back = compare_runs(runs["tuned"], runs["base"], SelectionPolicy(top_k=5)).edges.iloc[0]
    assert (back["source"], back["target"], back["kind"], back["status"]) == (source, target, kind, "vanishes")
