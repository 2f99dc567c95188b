"""`headgraph analyze` with causal effects (the default) on the shipped induction model, whose circuit is known
from its own attention (the previous-token head L0H2 feeds the keys of the induction heads L1H0..L1H3): the
effects reach pairs.parquet, the run record, both stores, the `causal-edges` query, the selection, the report and
`headgraph evaluate`."""

import json

import pandas as pd
import pytest
from _commands import headgraph
from rich.console import Console

from headgraph.analysis.selection import SelectionPolicy, select_edges, select_graph
from headgraph.loader.graph import build_run_graph
from headgraph.loader.open_store import open_store
from headgraph.queries.runner import run_named
from headgraph.report.summary import print_summary
from headgraph.runs import load_run

pytestmark = pytest.mark.slow  # one analysis of induction-2l with every stage, 70-90 s at load ~10

CIRCUIT = {("L0H2", f"L1H{h}") for h in range(4)}  # the OK edges of the induction circuit
KEY = ["source", "target", "source_type", "target_type"]
EFFECTS = ["effect", "effect_lo", "effect_hi"]
LOSS = ["effect_loss", "effect_loss_lo", "effect_loss_hi"]


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    work = tmp_path_factory.mktemp("causal-analyze")
    db, out = work / "graph.lbdb", work / "run"
    done = headgraph("analyze", "induction-2l", "--db", str(db), "--out", str(out), "--top-k", "4",
                     "--n-inputs", "40", "--null-heads", "40", "--reference-samples", "2000", "--json")
    assert done.returncode == 0, done.stderr
    return db, out, json.loads(done.stdout)


def test_every_composition_pair_has_a_local_effect_and_the_selected_edges_a_loss_effect(analyzed):
    _, out, _ = analyzed
    run = load_run(out)
    pairs = run.pairs
    assert set(EFFECTS + LOSS) <= set(pairs.columns)
    assert pairs[EFFECTS].notna().all().all()  # OQ, OK, OV: every computed pair
    assert ((pairs.effect_lo <= pairs.effect) & (pairs.effect <= pairs.effect_hi)).all()
    selected = select_edges(pairs, SelectionPolicy(top_k=4))  # the run's policy, recomputed here
    with_loss = pairs[pairs.effect_loss.notna()]
    agreement = json.loads((out / "run.json").read_text())["causal"]["agreement"]
    sampled = {(e.split("->")[0], e.split("->")[1], kind[0], kind[1]) for kind in agreement
               for e in agreement[kind]["sampled"]}  # the random pairs beside the selected ones
    assert len(sampled) == 30 and not sampled & set(map(tuple, selected[KEY].values))
    assert set(map(tuple, with_loss[KEY].values)) == set(map(tuple, selected[KEY].values)) | sampled
    ok = pairs[pairs.target_type == "K"]
    circuit = ok[[(s, t) in CIRCUIT for s, t in zip(ok.source, ok.target)]]
    others = ok.drop(circuit.index)
    assert circuit.effect_lo.min() > others.effect_hi.max()  # the circuit's keys move, clear of every other pair
    assert (circuit.effect_loss_lo > 0).all()  # and ablating them hurts the next-token loss


def test_attribution_ranks_the_circuit_first_and_the_record_says_how_far_it_agrees(analyzed):
    """Every OQ/OK/OV pair gets an attribution; the induction circuit's four OK edges have the four largest, each
    with its interval above 0; run.json records attribution against exact patching on the checked edges (the 4
    selected and 10 drawn at random per type), and on OK it ranks them as exact patching does (rho >= 0.9)."""
    _, out, _ = analyzed
    pairs = load_run(out).pairs
    attr = ["effect_attr", "effect_attr_lo", "effect_attr_hi"]
    assert pairs[attr].notna().all().all()
    assert ((pairs.effect_attr_lo <= pairs.effect_attr) & (pairs.effect_attr <= pairs.effect_attr_hi)).all()
    ok = pairs[pairs.target_type == "K"].sort_values("effect_attr", ascending=False)
    assert set(zip(ok.source.head(4), ok.target.head(4))) == CIRCUIT
    assert (ok.head(4).effect_attr_lo > 0).all()
    agreement = json.loads((out / "run.json").read_text())["causal"]["agreement"]
    checked = pairs.dropna(subset=["effect_loss"])
    ok_checked = checked[checked.target_type == "K"]
    assert agreement["OK"]["edges"] == len(ok_checked) == 14
    rho = ok_checked[["effect_attr", "effect_loss"]].corr(method="spearman").iloc[0, 1]  # pandas, not ours
    assert agreement["OK"]["spearman"] == pytest.approx(rho) and rho >= 0.9
    assert agreement["OK"]["max_abs_error"] == pytest.approx((ok_checked.effect_attr - ok_checked.effect_loss).abs().max())


def test_the_run_record_and_the_summary_say_how_effects_were_measured(analyzed):
    _, out, summary = analyzed
    strongest = {e["target_type"]: e for e in summary["causal"]["strongest"]}
    assert (strongest["K"]["source"], strongest["K"]["target"]) in CIRCUIT and strongest["K"]["effect_loss"] > 0
    causal = json.loads((out / "run.json").read_text())["causal"]
    assert causal["inputs"] == {"ioi": 24, "repeated_tokens": 24} and causal["source"] == "generated"
    assert causal["ablation"] == "resample" and causal["types"] == ["OQ", "OK", "OV"]
    assert "total-variation" in causal["definitions"]["local_QK"]
    assert set(causal["timings_s"]) == {"local", "loss"}
    assert causal["loss_inputs_per_set"] == {"ioi": 24, "repeated_tokens": 24} and causal["loss_edges_per_type"] == 50
    assert causal["agreement_sample"] == {"per_type": 10, "seed": [0, 103]}
    assert summary["causal"]["agreement"] == {kind: {"spearman": a["spearman"], "edges": a["edges"]}
                                              for kind, a in causal["agreement"].items()}
    console = Console(record=True, width=200)
    print_summary(summary, console)  # what analyze prints without --json
    line = next(t for t in console.export_text().splitlines() if t.startswith("attribution vs exact"))
    assert all(f"{kind} {a['spearman']:.2f} ({a['edges']})" in line for kind, a in causal["agreement"].items())


@pytest.fixture(params=["ladybug", pytest.param("neo4j", marks=pytest.mark.neo4j)])
def stored(request, analyzed):
    """The analyzed run in the embedded store analyze wrote, or loaded into the real Neo4j server."""
    db, out, summary = analyzed
    if request.param == "ladybug":
        with open_store(db=str(db), read_only=True) as store:
            yield store, summary["run_id"]
        return
    config = request.getfixturevalue("neo4j_config")
    run = load_run(out)
    selected = select_graph(run.pairs, run.heads, SelectionPolicy(top_k=4))
    with open_store(neo4j=config["uri"], user=config["user"], password=config["password"]) as store:
        store.store_run(build_run_graph(selected, run.record))
        try:
            yield store, run.record.id
        finally:
            store.delete_run(run.record.id)


def test_both_stores_hold_the_effects_and_causal_edges_ranks_the_circuit_first(stored, analyzed):
    store, run_id = stored
    rows = run_named(store, "causal-edges", {"run": run_id, "limit": "100"})
    table = pd.DataFrame(rows.rows, columns=rows.columns)
    assert len(table) == 12  # the 4 selected edges of each of OQ, OK, OV
    assert set(zip(table.source.head(4), table.target.head(4))) == CIRCUIT and set(table.kind.head(4)) == {"OK"}
    pairs = load_run(analyzed[1]).pairs
    joined = table.merge(pairs.assign(kind=pairs.source_type + pairs.target_type), on=["kind", "source", "target"],
                         suffixes=("", "_file"))
    assert len(joined) == 12
    for column in EFFECTS + LOSS + ["pk", "cs"]:
        pd.testing.assert_series_equal(joined[column], joined[f"{column}_file"], check_names=False, rtol=1e-12)
    assert list(table.effect) == sorted(table.effect, reverse=True)
    agreement = json.loads((analyzed[1] / "run.json").read_text())["causal"]["agreement"]
    assert table.attr_reliable.tolist() == [agreement[kind]["spearman"] >= 0.8 for kind in table.kind]


def test_min_effect_keeps_only_edges_with_that_effect(analyzed):
    _, out, _ = analyzed
    pairs = load_run(out).pairs
    kept = select_edges(pairs, SelectionPolicy(top_k=None, min_effect=0.3))
    assert (kept.effect >= 0.3).all() and CIRCUIT <= set(zip(kept.source, kept.target))
    assert len(kept) == (pairs.effect >= 0.3).sum()


def test_min_effect_without_causal_effects_is_one_line(tmp_path):
    done = headgraph("analyze", "induction-2l", "--no-causal", "--min-effect", "0.1", "--out", str(tmp_path / "r"),
                     "--no-store")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--no-causal" in done.stderr


def test_the_report_shows_the_evaluation_and_evaluate_finds_the_circuit(analyzed):
    _, out, _ = analyzed
    report = (out / "report.md").read_text()
    assert "## Do the edges carry information?" in report and "fig_causal.png" in report
    assert (out / "fig_causal.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    done = headgraph("evaluate", str(out), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert "rows" not in data  # no known classes for this model: the causal evaluation only
    rows = {(r["metric"], r["scope"]): r for r in data["causal"]["rows"]}
    assert "lower end of the local effect" in data["causal"]["definition"]
    for metric in ("pk", "cs"):  # both weight metrics rank the circuit's four keys first
        ok = rows[(metric, "OK")]
        assert ok["causal"] == 4 and ok["roc_auc"] == 1.0 and ok["r_precision"] == 1.0
        assert ok["spearman_lo"] > 0


def test_the_users_texts_are_the_inputs(tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("t1 t5 t9 t2 t7 t1 t5 t9 t2 t7\n\n"  # the model's own vocabulary; other words are <unk>
                     "t3 t4 t8 t3 t4 t8\nt10 t11 t12 t13 t10 t11 t12 t13\n")
    out = tmp_path / "run"
    done = headgraph("analyze", "induction-2l", "--causal-inputs", str(texts), "--causal-loss-edges", "0",
                     "--no-roles", "--no-report", "--no-store", "--null-heads", "20", "--reference-samples", "1000",
                     "--max-memory", "512MiB", "--out", str(out))
    assert done.returncode == 0, done.stderr
    run = json.loads((out / "run.json").read_text())
    causal = run["causal"]
    assert causal["inputs"] == {"texts": 3} and str(texts) in causal["source"]  # the blank line is no input
    assert causal["max_memory"] == run["max_memory"] == 512 * 2**20  # --max-memory bounds both stages
    pairs = pd.read_parquet(out / "pairs.parquet")
    assert pairs.effect.notna().all() and "effect_loss" not in pairs.columns
    missing = headgraph("analyze", "induction-2l", "--causal-inputs", str(tmp_path / "none.txt"), "--no-store",
                        "--out", str(tmp_path / "r2"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "none.txt" in missing.stderr


def test_after_the_phase_change_the_circuit_is_found_the_same_way(tmp_path):
    """The training checkpoint after the phase change (step 4000), with the default causal settings: the four
    circuit OK edges have the four largest attributions, positive exact loss effects with lower bounds above 0,
    and attribution ranks the checked OK edges as exact patching does (rho >= 0.9, pandas)."""
    out = tmp_path / "run"
    done = headgraph("analyze", "induction-2l-step4000", "--no-store", "--no-report", "--no-roles", "--out", str(out),
                     "--top-k", "4", "--null-heads", "40", "--reference-samples", "2000")
    assert done.returncode == 0, done.stderr
    pairs = load_run(out).pairs
    ok = pairs[pairs.target_type == "K"].sort_values("effect_attr", ascending=False)
    assert set(zip(ok.source.head(4), ok.target.head(4))) == CIRCUIT
    circuit = ok.head(4)
    assert (circuit.effect_loss > 0).all() and (circuit.effect_loss_lo > 0).all()
    checked = ok.dropna(subset=["effect_loss"])
    assert len(checked) == 14 and checked[["effect_attr", "effect_loss"]].corr(method="spearman").iloc[0, 1] >= 0.9
