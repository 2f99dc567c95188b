"""The whole `headgraph analyze` flow through the CLI, on a planted model stored in the embedded LadybugDB:
the planted hub leads the summary and the stored graph, planted roles reach the Head nodes, the report is
written, and bad input stops before any work with one line and a non-zero exit code."""

import json
import re
import sys

import pandas as pd
import pytest
from _commands import headgraph

FAST = ["--top-k", "5", "--n-inputs", "20", "--causal-n", "8", "--reference-samples", "2000"]


@pytest.fixture(scope="module")
def analyzed(planted, tmp_path_factory):
    path, truth = planted
    work = tmp_path_factory.mktemp("workflow")
    db, out = work / "graph.lbdb", work / "run"
    done = headgraph("analyze", str(path), "--db", str(db), "--out", str(out), "--json", *FAST)
    assert done.returncode == 0, done.stderr
    return truth, db, out, json.loads(done.stdout)


def test_summary_puts_the_planted_hub_first(analyzed):
    truth, _, out, summary = analyzed
    assert summary["hubs"][0]["head"] == truth.hub
    assert summary["edges"] == {"OQ": 5, "OK": 5, "OV": 5}
    assert summary["folder"] == str(out)


def test_the_summary_says_where_the_time_went(analyzed):
    *_, summary = analyzed
    steps = ["load", "causal_inputs", "pk_and_significance", "roles", "causal_local", "selection_and_centrality",
             "causal_loss", "artifacts", "report", "store", "other"]
    assert list(summary["timings_s"]) == steps  # in the order they ran; no step of this run is missing
    assert all(seconds >= 0 for seconds in summary["timings_s"].values())


def test_stored_graph_answers_the_hubs_query(analyzed):
    truth, db, _, summary = analyzed
    done = headgraph("query", "hubs", "--db", str(db), "--run", summary["run_id"], "--format", "json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert rows[0]["head"] == truth.hub
    planted_out = {e[2] for e in truth.edges if e[0] == truth.hub}
    assert {r["kind"] for r in rows if r["head"] == truth.hub and r["kind_out"] > 0} >= planted_out


def test_planted_roles_reach_the_artifacts_and_the_store(analyzed):
    truth, db, out, summary = analyzed
    heads = pd.read_parquet(out / "heads.parquet").set_index("head")
    assert set(heads.index[heads["identity_sig"]]) == set(truth.identity_heads)
    assert set(heads.index[heads["previous_token_sig"]]) == set(truth.previous_token_heads)
    done = headgraph("cypher", "MATCH (h:Head) WHERE h.run_id = $run AND h.identity_sig = true RETURN h.name AS name "
                     "ORDER BY name", "--param", f"run={summary['run_id']}", "--db", str(db), "--format", "json")
    assert done.returncode == 0, done.stderr
    assert [r["name"] for r in json.loads(done.stdout)] == sorted(truth.identity_heads)


def test_report_and_figures_are_written(analyzed):
    truth, _, out, summary = analyzed
    for stem in ("pk_distributions", "kl_heatmap", "pk_vs_cs", "topk_graph", "roles", "hubs"):
        assert (out / f"fig_{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert b"<svg" in (out / f"fig_{stem}.svg").read_bytes()[:2000]
    report = (out / "report.md").read_text()
    assert report.startswith(f"# headgraph report — {summary['model']}")
    hubs = report.split("## Hubs")[1]
    assert re.search(r"\*\*(L\d+H\d+)\*\*", hubs)[1] == truth.hub  # the planted hub is described first
    assert json.loads((out / "run.json").read_text())["id"] == summary["run_id"]


def test_unreachable_neo4j_fails_before_any_work(planted, tmp_path):
    path, _ = planted
    done = headgraph("analyze", str(path), "--neo4j", "bolt://127.0.0.1:1", "--out", str(tmp_path / "run"), *FAST)
    assert done.returncode == 3
    assert done.stderr.strip().count("\n") == 0 and "cannot reach Neo4j at bolt://127.0.0.1:1" in done.stderr
    assert not (tmp_path / "run").exists()


def test_wrong_neo4j_password_fails_with_one_line(planted, neo4j_config, tmp_path):
    path, _ = planted
    done = headgraph("analyze", str(path), "--neo4j", neo4j_config["uri"], "--out", str(tmp_path / "run"), *FAST,
                     env={"NEO4J_USER": neo4j_config["user"], "NEO4J_PASSWORD": "not-the-password"})
    assert done.returncode == 3
    assert done.stderr.strip().count("\n") == 0 and "refused user" in done.stderr
    assert not (tmp_path / "run").exists()


def test_unknown_model_is_one_line_exit_2(tmp_path):
    done = headgraph("analyze", "no-such-model-xyz", "--db", str(tmp_path / "g.lbdb"))
    assert done.returncode == 2
    assert done.stderr.startswith("error: model 'no-such-model-xyz' is not available offline")
    assert done.stderr.strip().count("\n") == 0
    assert not (tmp_path / "g.lbdb").exists()


def test_runs_lists_and_deletes_a_stored_run_and_never_creates_a_store(tmp_path):
    from _pairs import planted_pairs, run_graph

    from headgraph.loader.ladybug_store import LadybugStore

    pairs, heads = planted_pairs()
    db = tmp_path / "g.lbdb"
    with LadybugStore(db) as store:
        store.load_run(run_graph(pairs, heads, {"id": "run-a", "model": "synthetic"}))
    listed = headgraph("runs", "--db", str(db), "--format", "json")
    assert [r["id"] for r in json.loads(listed.stdout)] == ["run-a"]
    assert headgraph("runs", "delete", "run-b", "--db", str(db)).returncode == 2
    done = headgraph("runs", "delete", "run-a", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert json.loads(headgraph("runs", "--db", str(db), "--format", "json").stdout) == []
    missing = headgraph("runs", "delete", "run-a", "--db", str(tmp_path / "none.lbdb"))
    assert missing.returncode == 3 and "no headgraph store" in missing.stderr
    assert not (tmp_path / "none.lbdb").exists()


def test_selection_and_centrality_run_once_per_analyze(planted, tmp_path, monkeypatch):
    """Every module's binding of select_edges and head_centrality is counted: a second selection anywhere in
    analyze (summary, report, store) would show."""
    import headgraph.analysis.centrality
    import headgraph.analysis.selection
    import headgraph.loader.graph
    import headgraph.report.report  # noqa: F401 - loaded so that its bindings are counted too
    from headgraph.analysis.options import CausalOptions, PKOptions, RoleOptions
    from headgraph.analysis.selection import SelectionPolicy
    from headgraph.loader.open_store import StoreSpec
    from headgraph.workflow import AnalyzeOptions, run_analyze

    calls = {"select_edges": 0, "head_centrality": 0}
    for name, module in (("select_edges", headgraph.analysis.selection), ("head_centrality", headgraph.analysis.centrality)):
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        for loaded in [m for n, m in sys.modules.items() if n.startswith("headgraph")]:
            if getattr(loaded, name, None) is original:
                monkeypatch.setattr(loaded, name, counted)
    options = AnalyzeOptions(out_dir=str(tmp_path / "run"), pk=PKOptions(reference_samples=2000, null_heads=20),
                             roles=RoleOptions(n_inputs=8), causal=CausalOptions(n_inputs=4, n_boot=50),
                             policy=SelectionPolicy(top_k=5), store=StoreSpec(db=str(tmp_path / "g.lbdb")))
    outcome = run_analyze(str(planted[0]), options, progress=False)
    assert calls == {"select_edges": 1, "head_centrality": 1}  # the loss effects extend that one selection
    edges = outcome.selected.edges
    assert edges.loc[edges["kind"].isin(["OQ", "OK", "OV"]), "effect_loss"].notna().all()
    assert outcome.report and len(outcome.selected.edges) == 15
