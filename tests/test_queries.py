"""The named query library: every file's header, each query's answer checked against pandas/networkx on the
same selected edges, parity between Neo4j (real server) and LadybugDB, parameter errors, the CLI."""

import json
import re
import uuid

import networkx as nx
import pandas as pd
import pytest
from _pairs import HUB, planted_pairs, run_graph
from click.testing import CliRunner

from headgraph.analysis.centrality import head_centrality
from headgraph.analysis.selection import SelectionPolicy
from headgraph.cli import cli
from headgraph.errors import UsageError
from headgraph.loader.ladybug_store import LadybugStore
from headgraph.loader.open_store import open_store
from headgraph.queries.runner import load_query, query_names, run_named

SESSION = f"qtest-{uuid.uuid4().hex[:6]}"
RUN_A, RUN_B = f"{SESSION}-a", f"{SESSION}-b"
CLASSES = {HUB: ["identity"], "L3H0": ["induction"], "L4H2": ["induction", "previous_token"], "L0H0": ["induction"]}
AGREEMENT = {"OK": {"edges": 12, "spearman": 0.93, "reliable": True},  # run A's attribution vs exact, as run.json's
             "OV": {"edges": 12, "spearman": 0.41, "reliable": False}}  # OQ: none measured
IDENTITY = pd.DataFrame({"name": [HUB, "L5H3"], "identity_score": [0.9, 0.8], "identity_sig": [True, True]})


@pytest.fixture(scope="module")
def graphs():
    pairs, heads = planted_pairs()
    run = {"model": "toy-model", "processing": "tl"}
    with_identity = heads.merge(IDENTITY.rename(columns={"name": "head"}), on="head", how="left")  # roles of run A
    a = run_graph(pairs, with_identity, {**run, "id": RUN_A, "created": "2026-01-01T00:00:00+00:00",
                                         "causal": {"agreement": AGREEMENT}}, SelectionPolicy(20), CLASSES)
    b = run_graph(pairs, heads, {**run, "id": RUN_B, "created": "2026-01-02T00:00:00+00:00"},
                  SelectionPolicy(10), CLASSES)
    return a, b


def _fill(store, graphs):
    for graph in graphs:
        store.store_run(graph, batch_size=25)
    return store


@pytest.fixture(scope="module")
def ladybug(graphs, tmp_path_factory):
    with LadybugStore(tmp_path_factory.mktemp("queries") / "graph.lbdb") as store:
        yield _fill(store, graphs)


@pytest.fixture(scope="module")
def neo4j(graphs, neo4j_config):
    with open_store(neo4j=neo4j_config["uri"], user=neo4j_config["user"], password=neo4j_config["password"]) as store:
        yield _fill(store, graphs)
        for run_id in (RUN_A, RUN_B):
            store.delete_run(run_id)


@pytest.fixture(scope="module", params=["ladybug", pytest.param("neo4j", marks=pytest.mark.neo4j)])
def store(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def edges(graphs):
    return graphs[0].edges


PARAMS = {
    "hubs": {"limit": "5"},
    "top-edges": {"limit": "3"},
    "neighbors": {"head": HUB},
    "paths": {"source": "L0", "target": "L5", "limit": "15"},
    "type-summary": {},
    "in-class": {"classes": "induction"},
    "compare-runs": {"other": RUN_B},
    "identity-hubs": {},
    "centrality": {"limit": "30"},
    "causal-edges": {"limit": "10"},
}


SWEEP_QUERIES = {"edge-history", "role-history", "emergence", "role-emergence"}  # tests/test_sweep_queries.py
MODEL_QUERIES = {"model-hubs", "model-roles"}  # across models: tests/test_sweep_queries.py


def test_every_query_file_documents_itself_and_its_parameters():
    assert set(query_names()) == set(PARAMS) | SWEEP_QUERIES | MODEL_QUERIES
    for name in query_names():
        query = load_query(name)
        assert len(query.purpose) > 20, name
        declared = {p.name for p in query.params}
        used = set(re.findall(r"\$(\w+)", query.cypher))
        assert declared == used, name
        body = "\n".join(line for line in query.cypher.splitlines() if not line.startswith("//"))
        scope = "sweep" if name in SWEEP_QUERIES else "models" if name in MODEL_QUERIES else "run"
        assert scope in declared and "status = 'complete'" in body, name
        assert not re.search(r"\btype\(|shortestPath|\| ", body), name  # constructs LadybugDB lacks


def _rounded(rows):
    return [[round(v, 9) if isinstance(v, float) else v for v in row] for row in rows]


@pytest.mark.neo4j
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_neo4j_and_ladybug_return_the_same_rows(name, ladybug, neo4j):
    params = {"run": RUN_A, **PARAMS[name]}
    on_ladybug, on_neo4j = run_named(ladybug, name, params), run_named(neo4j, name, params)
    assert on_ladybug.columns == on_neo4j.columns
    assert _rounded(on_ladybug.rows) == _rounded(on_neo4j.rows)
    assert on_ladybug.rows, f"{name} returned no rows"


def test_hubs_puts_the_planted_hub_first_with_a_per_type_breakdown(store, edges):
    rows = run_named(store, "hubs", {"run": RUN_A, "limit": "3"}).records()
    assert rows[0]["head"] == HUB
    hub_rows = [r for r in rows if r["head"] == HUB]
    assert hub_rows[0]["in_degree"] == (edges["target"] == HUB).sum()
    assert hub_rows[0]["out_degree"] == (edges["source"] == HUB).sum()
    breakdown = {r["kind"]: (r["kind_in"], r["kind_out"]) for r in hub_rows}
    expected = {
        k: (int((g["target"] == HUB).sum()), int((g["source"] == HUB).sum())) for k, g in edges.groupby("kind")
    }
    assert breakdown == {k: v for k, v in expected.items() if sum(v)}
    assert len({r["head"] for r in rows}) == 3
    degrees = [r["degree"] for r in rows]
    assert degrees == sorted(degrees, reverse=True)


def test_causal_edges_are_the_selected_edges_by_effect(store, edges):
    rows = pd.DataFrame(run_named(store, "causal-edges", {"run": RUN_A, "limit": "7", "types": "ok,ov"}).records())
    expected = edges[edges.kind.isin(["OK", "OV"])].sort_values(["effect", "kind", "source", "target"],
                                                                ascending=[False, True, True, True]).head(7)
    assert list(zip(rows.kind, rows.source, rows.target)) == list(zip(expected.kind, expected.source, expected.target))
    assert rows.effect.tolist() == pytest.approx(expected.effect.tolist())
    assert rows.pk_rank.tolist() == expected["rank"].tolist() and rows.effect_loss.isna().all()


def test_causal_edges_flag_the_types_whose_attribution_disagrees_with_exact_patching(store):
    rows = pd.DataFrame(run_named(store, "causal-edges", {"run": RUN_A, "limit": "1000"}).records())
    flags = {kind: set(part.attr_reliable.tolist()) for kind, part in rows.groupby("kind")}
    assert flags["OK"] == {True} and flags["OV"] == {False}  # rho 0.93 and 0.41 against 0.8
    assert rows[rows.kind == "OQ"].attr_reliable.isna().all()  # nothing patched exactly: not known
    other = pd.DataFrame(run_named(store, "causal-edges", {"run": RUN_B, "limit": "1000"}).records())
    assert len(other) > 0 and other.attr_reliable.isna().all()  # a run without loss effects


def test_top_edges_are_the_strongest_per_type(store, edges):
    rows = pd.DataFrame(run_named(store, "top-edges", {"run": RUN_A, "limit": "3"}).records())
    expected = edges.sort_values("pk", ascending=False).groupby("kind").head(3).sort_values(["kind", "rank"])
    assert rows[["kind", "source", "target"]].values.tolist() == expected[["kind", "source", "target"]].values.tolist()


def test_neighbors_lists_every_edge_of_the_head(store, edges):
    rows = pd.DataFrame(run_named(store, "neighbors", {"run": RUN_A, "head": HUB}).records())
    assert (rows["direction"] == "in").sum() == (edges["target"] == HUB).sum()
    assert (rows["direction"] == "out").sum() == (edges["source"] == HUB).sum()
    for _, group in rows.groupby(["direction", "kind"]):
        assert group["pk"].is_monotonic_decreasing


def test_paths_match_a_brute_force_search(store, edges):
    rows = run_named(store, "paths", {"run": RUN_A, "source": "L0", "target": "L5", "limit": "15"}).records()
    graph = nx.MultiDiGraph()
    graph.add_edges_from((s, t, {"kind": k, "pk": p}) for s, t, k, p in edges[["source", "target", "kind", "pk"]].values)
    scored = []
    for s in [n for n in graph if n.startswith("L0H")]:
        for t in [n for n in graph if n.startswith("L5H")]:
            for path in nx.all_simple_edge_paths(graph, s, t, cutoff=3):
                pks = [graph.edges[e]["pk"] for e in path]
                route = [f"{u} -{graph.edges[(u, v, k)]['kind']}-> {v}" for u, v, k in path]
                scored.append((min(pks), sum(pks), route))
    scored.sort(key=lambda x: (-x[0], -x[1], len(x[2])))
    assert len(rows) == min(15, len(scored)) > 0
    assert [r["route"] for r in rows] == [route for _, _, route in scored[: len(rows)]]
    assert [r["bottleneck"] for r in rows] == pytest.approx([b for b, _, _ in scored[: len(rows)]])


def test_type_summary_matches_pandas(store, edges):
    rows = pd.DataFrame(run_named(store, "type-summary", {"run": RUN_A}).records()).set_index("kind")
    expected = edges.groupby("kind").agg(edges=("pk", "size"), mean_pk=("pk", "mean"), mean_cs=("cs", "mean"))
    assert rows["edges"].tolist() == expected["edges"].tolist() == [20, 20, 20]
    assert rows["mean_pk"].tolist() == pytest.approx(expected["mean_pk"].tolist())
    assert rows["mean_cs"].tolist() == pytest.approx(expected["mean_cs"].tolist())


def test_in_class_counts_heads_of_the_graph(store, edges):
    in_graph = set(edges["source"]) | set(edges["target"])
    labelled = {h for h, labels in CLASSES.items() if "induction" in labels}
    rows = {r["membership"]: r for r in run_named(store, "in-class", {"run": RUN_A, "classes": "induction"}).records()}
    assert set(rows["in-class"]["names"]) == in_graph & labelled
    assert rows["out-of-class"]["n_heads"] == len(in_graph - labelled)
    by_name = {r["membership"]: r for r in run_named(store, "in-class", {"run": RUN_A, "heads": f"{HUB},L9H9"}).records()}
    assert by_name["in-class"]["names"] == [HUB]


def test_compare_runs_finds_shared_and_missing_edges(store):
    rows = pd.DataFrame(run_named(store, "compare-runs", {"run": RUN_A, "other": RUN_B}).records())
    assert rows["status"].value_counts().to_dict() == {"shared": 30, "only_a": 30}
    shared = rows[rows["status"] == "shared"]
    assert (shared["rank_a"] == shared["rank_b"]).all() and (shared["rank_a"] <= 10).all()


def test_identity_hubs_need_the_identity_role(store):
    rows = run_named(store, "identity-hubs", {"run": RUN_A}).records()
    assert [r["head"] for r in rows][:1] == [HUB] and {r["head"] for r in rows} == {HUB, "L5H3"}
    assert run_named(store, "identity-hubs", {"run": RUN_B}).rows == []  # role never written for run B


def test_stored_centrality_is_networkx_on_the_selected_edges(store, edges, graphs):
    rows = pd.DataFrame(run_named(store, "centrality", {"run": RUN_A, "limit": "100"}).records()).set_index("head")
    expected = head_centrality(edges, graphs[0].heads["name"].tolist()).set_index("name").loc[rows.index]
    assert rows.index[0] == HUB
    for measure in ("degree", "pagerank", "hits_hub", "hits_authority", "betweenness"):
        assert rows[measure].tolist() == pytest.approx(expected[measure].tolist()), measure
    # and independently of headgraph's centrality code: typed-edge degree by pandas, PageRank by networkx
    degree = pd.concat([edges["source"], edges["target"]]).value_counts().reindex(rows.index, fill_value=0)
    assert rows["degree"].tolist() == degree.tolist()
    weights = edges.groupby(["source", "target"])["pk"].sum()
    pair_graph = nx.DiGraph()
    pair_graph.add_nodes_from(graphs[0].heads["name"])
    pair_graph.add_weighted_edges_from((s, t, w) for (s, t), w in weights.items())
    pagerank = nx.pagerank(pair_graph, weight="weight")
    assert rows["pagerank"].tolist() == pytest.approx([pagerank[h] for h in rows.index])


def test_run_defaults_to_the_latest_complete_run(ladybug):
    assert ladybug.latest_run() == RUN_B
    assert [r["edges"] for r in run_named(ladybug, "type-summary").records()] == [10, 10, 10]


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("neighbors", {}, "needs --param head"),
        ("neighbors", {"head": "4.7"}, "head name like L4H7"),
        ("hubs", {"limit": "many"}, "expected int"),
        ("hubs", {"colour": "red"}, "no parameter colour"),
        ("paths", {"source": "L0", "target": "layer five"}, "a head (L4H7) or a layer"),
        ("no-such-query", {}, "unknown query"),
        ("hubs", {"run": "no-such-run"}, "no run 'no-such-run' in"),
        ("compare-runs", {"other": "no-such-run"}, "no run 'no-such-run' in"),
        ("neighbors", {"head": "L9H0"}, "no head L9H0 in run RUN_A (parameter head)"),  # RUN_A: the run's id
        ("neighbors", {"head": "L1H40"}, "no head L1H40 in run RUN_A (parameter head)"),
        ("paths", {"source": "L0", "target": "L6"}, "no head or layer L6 in run RUN_A (parameter target)"),
        ("paths", {"source": "L0H9", "target": "L5"}, "no head or layer L0H9 in run RUN_A (parameter source)"),
    ],
)
def test_bad_parameters_are_usage_errors(store, name, params, message):
    with pytest.raises(UsageError, match=re.escape(message.replace("RUN_A", RUN_A))) as error:
        run_named(store, name, {"run": RUN_A, **params})
    assert "\n" not in str(error.value)


def test_an_empty_store_has_no_latest_run(tmp_path):
    with LadybugStore(tmp_path / "empty.lbdb") as empty, pytest.raises(UsageError, match="no complete run"):
        run_named(empty, "hubs")


@pytest.mark.slow
def test_query_command_formats(graphs, tmp_path):
    path = str(tmp_path / "cli.lbdb")
    with LadybugStore(path) as store:  # closed again: the CLI opens the file itself
        _fill(store, graphs)
    runner = CliRunner()
    as_json = runner.invoke(cli, ["query", "hubs", "--db", path, "--run", RUN_A, "-p", "limit=1", "--format", "json"])
    assert as_json.exit_code == 0, as_json.output
    assert {r["head"] for r in json.loads(as_json.output)} == {HUB}
    as_csv = runner.invoke(cli, ["query", "top-edges", "--db", path, "--run", RUN_A, "-p", "limit=1", "--format", "csv"])
    lines = as_csv.output.splitlines()
    assert lines[0].startswith("kind,rank,source,target,pk") and len(lines) == 1 + 3
    listing = runner.invoke(cli, ["query", "--list", "--format", "json"])
    assert {r["query"] for r in json.loads(listing.output)} == set(PARAMS) | SWEEP_QUERIES | MODEL_QUERIES
    table = runner.invoke(cli, ["query", "type-summary", "--db", path, "--run", RUN_A])
    assert table.exit_code == 0 and "OQ" in table.output
