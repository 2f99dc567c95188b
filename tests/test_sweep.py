"""`headgraph sweep` on the shipped induction-model checkpoints (steps 2000, 3000, 4000 and the final model at
6000): one run per checkpoint in one store, tagged with the sweep and the step; a rerun skips what is stored; a
worker process killed mid-sweep (a real SIGKILL) leaves no run of its checkpoint and the rerun completes the
sweep; the sweep's queries read back what the run folders hold, and show the phase change."""

import dataclasses
import json
import os

import pandas as pd
import pytest
from _cli import run_cli
from _commands import headgraph
from _doomed import doomed_worker_env

from headgraph.analysis.options import CausalOptions, PKOptions, RoleOptions
from headgraph.loader.ladybug_store import LadybugStore
from headgraph.loader.models import PACKAGED_MODELS_DIR
from headgraph.loader.open_store import StoreSpec
from headgraph.queries.runner import run_named
from headgraph.report.report import render_report
from headgraph.runs import load_run
from headgraph.sweep import SweepOptions, checkpoints_in, checkpoints_of, run_sweep
from headgraph.workflow import AnalyzeOptions

STEPS = [2000, 3000, 4000, 6000]
SMALL = ["--no-report", "--null-heads", "8", "--reference-samples", "500", "--n-inputs", "16", "--causal-n", "8"]
pytestmark = pytest.mark.slow  # each test analyses checkpoints (the shared fixture) or runs whole sweeps
PREVIOUS_TOKEN, INDUCTION = "L0H2", ["L1H0", "L1H1", "L1H2", "L1H3"]  # per the model cards


def _options(db, out) -> AnalyzeOptions:
    return AnalyzeOptions(out_dir=str(out), pk=PKOptions(null_heads=8, reference_samples=500),
                          roles=RoleOptions(n_inputs=16), causal=CausalOptions(n_inputs=8),
                          store=StoreSpec(db=str(db)), report=False)


def _shipped():
    checkpoints, skipped = checkpoints_in(PACKAGED_MODELS_DIR, final_step=6000)
    assert skipped == []
    return checkpoints


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The shipped checkpoints swept by two worker processes into a fresh store."""
    folder = tmp_path_factory.mktemp("sweep")
    options = SweepOptions(_options(folder / "sweep.lbdb", folder / "runs"), workers=2)
    outcome = run_sweep(_shipped(), options, "models", progress=False)
    return outcome, options


def test_every_checkpoint_is_one_complete_run_tagged_with_the_sweep_and_its_step(swept):
    outcome, options = swept
    assert [r.checkpoint.step for r in outcome.runs] == STEPS and not any(r.skipped for r in outcome.runs)
    with LadybugStore(options.analyze.store.db, read_only=True) as store:
        stored = store.read("MATCH (r:Run) RETURN r.id AS id, r.sweep AS sweep, r.step AS step, r.status AS status, "
                            "r.model AS model ORDER BY step").records()
    assert [(r["id"], r["step"], r["model"]) for r in stored] == [
        (r.run_id, r.checkpoint.step, r.checkpoint.name) for r in outcome.runs]
    assert {r["sweep"] for r in stored} == {outcome.sweep_id} and {r["status"] for r in stored} == {"complete"}
    for run in outcome.runs:
        record = json.loads((run.folder / "run.json").read_text())
        assert (record["sweep"], record["step"], record["id"]) == (outcome.sweep_id, run.checkpoint.step, run.run_id)


def test_a_rerun_skips_every_stored_checkpoint(swept, capsys):
    outcome, options = swept
    again = run_sweep(_shipped(), options, "models", progress=False)
    assert again.sweep_id == outcome.sweep_id and all(r.skipped for r in again.runs)
    assert [r.run_id for r in again.runs] == [r.run_id for r in outcome.runs]
    code, out, err = run_cli(["sweep", "--checkpoints", str(PACKAGED_MODELS_DIR), "--final-step", "6000",
                              "--db", options.analyze.store.db, "--sweep-id", outcome.sweep_id, *SMALL], capsys)
    assert code == 0 and "4 already stored" in err and out.count("skipped (stored before)") == 4
    assert "steps from name (3), --final-step (1)" in err


def test_edge_history_reads_back_each_run_folder(swept):
    outcome, options = swept
    with LadybugStore(options.analyze.store.db, read_only=True) as store:
        for target in INDUCTION:
            rows = run_named(store, "edge-history", {"sweep": outcome.sweep_id, "source": PREVIOUS_TOKEN,
                                                     "target": target, "types": "OK"}).records()
            assert [r["step"] for r in rows] == STEPS
            for row, run in zip(rows, outcome.runs):
                pairs = load_run(run.folder).pairs
                (pair,) = pairs[pairs.source.eq(PREVIOUS_TOKEN) & pairs.target.eq(target)
                                & pairs.source_type.eq("O") & pairs.target_type.eq("K")].to_dict("records")
                assert (row["pk"], row["q_model"], row["effect"]) == pytest.approx(
                    (pair["pk"], pair["q_model"], pair["effect"]))


def test_the_previous_token_heads_ok_edges_emerge_with_the_induction_role(swept):
    """The phase change (model card: step 3250): between the 2000 and 3000 checkpoints L0H2's OK edges into the
    induction heads become significant and stay so, at the step where the induction role does."""
    outcome, options = swept
    with LadybugStore(options.analyze.store.db, read_only=True) as store:
        edges = {(r["source"], r["target"]): r["emerged"]
                 for r in run_named(store, "emergence", {"sweep": outcome.sweep_id, "types": "OK"}).records()}
        roles = {r["head"]: r["emerged"] for r in run_named(store, "role-emergence", {
            "sweep": outcome.sweep_id, "roles": "induction"}).records()}
        history = pd.DataFrame(run_named(store, "edge-history", {"sweep": outcome.sweep_id, "source": PREVIOUS_TOKEN,
                                                                 "target": "L1H0", "types": "OK"}).records())
    assert roles == {head: 3000 for head in INDUCTION}
    assert all(edges[PREVIOUS_TOKEN, head] == 3000 for head in INDUCTION)
    assert history["q_model"].iloc[0] > 0.05 and (history["q_model"].iloc[1:] < 1e-6).all()
    assert (history["pk"].iloc[1:] > history["pk"].iloc[0]).all()


def test_the_sweep_report_shows_the_strongest_edges_and_roles_over_the_steps(swept, tmp_path):
    outcome, options = swept
    with_report = dataclasses.replace(options, analyze=dataclasses.replace(options.analyze, report=True))
    again = run_sweep(_shipped(), with_report, "models", progress=False)  # all stored: only the report is made
    assert all(r.skipped for r in again.runs) and {p.name for p in again.report.values()} == {
        "report.md", "report.html", "fig_sweep.png", "fig_sweep.svg"}
    report = again.report["report.md"].read_text()
    pks = []
    for run in outcome.runs:
        pairs = load_run(run.folder).pairs
        pks.append(pairs[pairs.source.eq(PREVIOUS_TOKEN) & pairs.target.eq("L1H0") & pairs.target_type.eq("K")
                         & pairs.source_type.eq("O")]["pk"].item())
    assert f"| OK | {PREVIOUS_TOKEN} | L1H0 | 3000 | " + " | ".join(f"{pk:.4g}" for pk in pks) + " |" in report
    assert all(f"| induction | {head} | 3000 | 3 | " in report for head in INDUCTION)  # emerged, significant at
    assert again.report["fig_sweep.png"].stat().st_size > 10_000
    checkpoint = render_report(outcome.runs[1].folder, out_dir=tmp_path)["report.md"].read_text()
    assert f"| sweep (step) | {outcome.sweep_id} (3000) |" in checkpoint  # a checkpoint's own report names its sweep


@pytest.mark.neo4j
def test_a_sweep_into_neo4j_is_tagged_and_resumed(neo4j_config, tmp_path, monkeypatch):
    monkeypatch.setenv("NEO4J_PASSWORD", neo4j_config["password"])
    spec = StoreSpec(neo4j=neo4j_config["uri"], user=neo4j_config["user"])
    analysis = AnalyzeOptions(out_dir=str(tmp_path), pk=PKOptions(null_heads=4, reference_samples=200), roles=None,
                              causal=None, store=spec, report=False)
    options = SweepOptions(analysis, sweep_id=f"neo4j-sweep-{os.getpid()}-{tmp_path.name}")
    checkpoints = checkpoints_of(["induction-2l-step2000", "induction-2l-step3000"])
    outcome = run_sweep(checkpoints, options, progress=False)
    try:
        again = run_sweep(checkpoints, options, progress=False)
        assert [r.run_id for r in again.runs] == [r.run_id for r in outcome.runs] and all(r.skipped for r in again.runs)
        with spec.open(read_only=True) as store:
            rows = run_named(store, "edge-history", {"sweep": options.sweep_id, "source": PREVIOUS_TOKEN,
                                                     "target": "L1H0", "types": "OK"}).records()
        assert [(r["step"], r["run"]) for r in rows] == [(2000, outcome.runs[0].run_id), (3000, outcome.runs[1].run_id)]
    finally:
        with spec.open() as store:
            for run in outcome.runs:
                store.delete_run(run.run_id)


def test_a_killed_worker_leaves_no_run_of_its_checkpoint_and_the_rerun_completes(tmp_path):
    models = ["induction-2l-step2000", "induction-2l-step3000", "induction-2l-step4000"]
    args = ["sweep", *models, "--db", str(tmp_path / "s.lbdb"), "--out", str(tmp_path / "runs"), "--no-causal",
            "--no-roles", *SMALL[:5]]
    doomed, hooks = doomed_worker_env(tmp_path / "hooks")
    env = {**hooks, "OMP_NUM_THREADS": "1"}  # the driver's environment reaches its spawned workers
    doomed.write_text(models[1])
    done = headgraph(*args, env=env, timeout=300)
    doomed.unlink()
    err = done.stderr
    assert done.returncode == 1, err
    folders = [p.name for p in (tmp_path / "runs").iterdir()]
    assert any(name.startswith(models[1]) for name in folders), folders  # it died after writing its run folder
    assert "stored induction-2l-step2000 (step 2000)" in err and "stored induction-2l-step3000" not in err, err
    assert "2 of 3 checkpoints not stored" in err and "induction-2l-step3000 (step 3000): a worker process died" in err
    with LadybugStore(tmp_path / "s.lbdb", read_only=True) as store:
        first = store.read("MATCH (r:Run) RETURN r.id AS id, r.model AS model, r.status AS status").records()
        heads = store.read("MATCH (h:Head) RETURN DISTINCT h.run_id AS run").records()
    assert [(r["model"], r["status"]) for r in first] == [("induction-2l-step2000", "complete")]
    assert heads == [{"run": first[0]["id"]}]  # no rows of the killed checkpoint
    rerun = headgraph(*args, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "3 checkpoints, 1 already stored" in rerun.stderr
    with LadybugStore(tmp_path / "s.lbdb", read_only=True) as store:
        runs = store.read("MATCH (r:Run) RETURN r.id AS id, r.step AS step, r.status AS status ORDER BY step").records()
    assert [(r["step"], r["status"]) for r in runs] == [(2000, "complete"), (3000, "complete"), (4000, "complete")]
    assert runs[0]["id"] == first[0]["id"]
