"""Loading runs into both stores: round trip, one copy on reload, invisible half-loads, deletion, runs and
models side by side, read-only refusal, locking and unreachable servers. Neo4j tests use the real server."""

import dataclasses
import json
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pandas as pd
import pytest
from _cli import run_cli
from _pairs import HUB, planted_pairs, run_graph
from click.testing import CliRunner

from headgraph.analysis.centrality import hub_report
from headgraph.analysis.selection import SelectionPolicy
from headgraph.cli import cli
from headgraph.errors import ReadOnlyViolation, StoreUnavailable, UsageError
from headgraph.loader.ladybug_store import LadybugStore
from headgraph.loader.open_store import open_store
from headgraph.queries.runner import run_named
from headgraph.runs import load_run

EDGES_OF_RUN = "MATCH (a:Head)-[r]->(b:Head) WHERE a.run_id = $run RETURN r.kind, a.name, b.name, r.pk, r.rank"


@pytest.fixture(scope="module")
def tables():
    return planted_pairs()


SESSION = f"test-{uuid.uuid4().hex[:6]}"


def new_run_id():
    return f"{SESSION}-{uuid.uuid4().hex[:8]}"


def graph_of(tables, run_id, model="toy-model", top_k=20):
    pairs, heads = tables
    return run_graph(pairs, heads, {"id": run_id, "model": model, "processing": "tl"}, SelectionPolicy(top_k))


@pytest.fixture(params=["ladybug", pytest.param("neo4j", marks=pytest.mark.neo4j)])
def store(request, tmp_path):
    """An empty embedded store, or the real Neo4j server (this session's runs are deleted afterwards)."""
    if request.param == "ladybug":
        opened = LadybugStore(tmp_path / "graph.lbdb")
    else:
        config = request.getfixturevalue("neo4j_config")
        opened = open_store(neo4j=config["uri"], user=config["user"], password=config["password"])
    yield opened
    for run in opened.runs():
        if run["id"].startswith(SESSION):
            opened.delete_run(run["id"])
    opened.close()


def load(store, graph, **kwargs):
    store.store_run(graph, **kwargs)


def stored_edges(store, run_id):
    rows = store.read(EDGES_OF_RUN, {"run": run_id}).rows
    return pd.DataFrame(rows, columns=["kind", "source", "target", "pk", "rank"])


def count_heads(store, run_id):
    return store.read("MATCH (h:Head) WHERE h.run_id = $run RETURN count(h)", {"run": run_id}).rows[0][0]


def test_round_trip_stores_the_top_k_edges_of_each_type(store, tables):
    run_id = new_run_id()
    load(store, graph_of(tables, run_id, top_k=7), batch_size=10)
    pairs, heads = tables
    kinds = pairs["source_type"] + pairs["target_type"]
    expected = pairs.assign(kind=kinds).sort_values("pk", ascending=False).groupby("kind").head(7)
    got = stored_edges(store, run_id)
    key = ["kind", "source", "target"]
    merged = got.merge(expected, on=key, how="outer", suffixes=("", "_expected"), indicator=True)
    assert (merged["_merge"] == "both").all()
    np.testing.assert_allclose(merged["pk"], merged["pk_expected"])
    assert sorted(got.groupby("kind")["rank"].apply(sorted).sum()) == sorted(list(range(1, 8)) * 3)
    assert count_heads(store, run_id) == len(heads)
    (row,) = [r for r in store.runs() if r["id"] == run_id]
    assert (row["status"], row["heads"], row["edges"], row["policy"]) == ("complete", 24, 21, "top 7 per type by PK")


@pytest.mark.slow
def test_hubs_and_networkx_put_the_planted_hub_first(store, planted_analysis):
    result, truth = load_run(planted_analysis.folder), planted_analysis.truth  # the session's analysis (conftest)
    run_id = new_run_id()
    # 3 layers x 4 heads: 48 pairs per type; the top 5 per type holds every planted edge
    graph = run_graph(result.pairs, result.heads, dataclasses.replace(result.record, id=run_id),
                      SelectionPolicy(top_k=5))
    load(store, graph)
    assert [r["head"] for r in run_named(store, "hubs", {"run": run_id, "limit": "1"}).records()][:1] == [truth.hub]
    report = hub_report(graph.heads, graph.edges)
    assert report["hubs"][0]["head"] == truth.hub
    top = {(r["source"], r["target"], r["kind"]) for r in run_named(store, "top-edges", {"run": run_id, "limit": "2"}).records()}
    assert {(s, t, kind) for s, t, kind, _ in truth.edges} <= top
    (run,) = [r for r in store.runs() if r["id"] == run_id]
    assert (run["model"], run["processing"], run["types"]) == (result.record.model.name, "tl", ["OQ", "OK", "OV"])


@pytest.mark.neo4j
def test_neo4j_heads_carry_a_layer_label_for_browser(neo4j_config, tables):
    run_id = new_run_id()
    with open_store(neo4j=neo4j_config["uri"], user=neo4j_config["user"], password=neo4j_config["password"]) as store:
        try:
            load(store, graph_of(tables, run_id))
            rows = store.read("MATCH (h:Head:Layer2) WHERE h.run_id = $run RETURN h.layer, count(h)", {"run": run_id}).rows
        finally:
            store.delete_run(run_id)
    assert rows == [[2, 4]]


def test_reloading_a_run_leaves_one_copy(store, tables):
    run_id = new_run_id()
    graph = graph_of(tables, run_id)
    load(store, graph, batch_size=16)
    load(store, graph, batch_size=1000)
    assert len(stored_edges(store, run_id)) == len(graph.edges) == 60
    assert count_heads(store, run_id) == 24
    assert [r["id"] for r in store.runs()].count(run_id) == 1


class Crash(Exception):
    """Raised by the fault-injection hook half-way through a load."""


@pytest.mark.slow
def test_a_half_load_is_never_visible_and_the_next_load_cleans_it_up(store, tables):
    complete = new_run_id()
    load(store, graph_of(tables, complete))
    crashing = new_run_id()
    seen_during_load = {}

    def crash_half_way(done, total):
        if done == total // 2:
            seen_during_load["heads_written"] = count_heads(store, crashing)
            seen_during_load["hubs"] = run_named(store, "hubs", {"run": crashing}).rows
            seen_during_load["latest"] = store.latest_run()
            raise Crash("simulated crash")

    with pytest.raises(Crash):
        load(store, graph_of(tables, crashing), batch_size=8, after_batch=crash_half_way, cleanup_on_error=False)
    assert seen_during_load["heads_written"] > 0  # data was there ...
    assert seen_during_load["hubs"] == []  # ... but no query saw it
    assert seen_during_load["latest"] is not None and seen_during_load["latest"] != crashing
    assert {r["id"]: r["status"] for r in store.runs()}[crashing] == "loading"
    assert run_named(store, "top-edges", {"run": crashing}).rows == []

    load(store, graph_of(tables, crashing), batch_size=8)
    assert len(stored_edges(store, crashing)) == 60
    assert count_heads(store, crashing) == 24
    assert run_named(store, "hubs", {"run": crashing, "limit": "1"}).rows[0][0] == HUB


def test_a_failed_load_removes_its_partial_data(store, tables):
    run_id = new_run_id()

    def crash(done, total):
        if done == 3:
            raise Crash("simulated crash")

    with pytest.raises(Crash):
        load(store, graph_of(tables, run_id), batch_size=8, after_batch=crash)
    assert count_heads(store, run_id) == 0
    assert run_id not in [r["id"] for r in store.runs()]


def test_runs_and_models_live_side_by_side_and_delete_removes_one(store, tables):
    first, second = new_run_id(), new_run_id()
    model_b = f"model-{uuid.uuid4().hex[:6]}"
    load(store, graph_of(tables, first, top_k=5))
    load(store, graph_of(tables, second, model=model_b, top_k=10))
    assert len(stored_edges(store, first)) == 15 and len(stored_edges(store, second)) == 30
    models = "MATCH (m:Model) WHERE m.name = $name RETURN count(m)"
    assert store.read(models, {"name": model_b}).rows == [[1]]
    assert store.has_run(second) and json.loads(store.run_params(second))["model"]["name"] == model_b

    assert store.delete_run(second) is True
    assert store.delete_run(second) is False
    assert len(stored_edges(store, second)) == 0 and count_heads(store, second) == 0
    assert not store.has_run(second) and store.run_params(second) is None and store.has_run(first)
    assert store.read(models, {"name": model_b}).rows == [[0]]  # no run uses it any more
    assert len(stored_edges(store, first)) == 15


def test_role_results_become_head_properties(store, tables):
    pairs, heads = tables
    roles = pd.DataFrame({"head": ["L0H1", HUB, "L1H0"], "induction_score": [4.5, 1.0, np.nan],
                          "induction_p": [1e-4, 0.6, np.nan], "induction_sig": [True, False, True],
                          "not a role": ["x", "y", "z"]})
    run_id = new_run_id()
    load(store, run_graph(pairs, heads.merge(roles, on="head", how="left"), {"id": run_id, "model": "toy-model"}))
    rows = store.read(
        "MATCH (h:Head) WHERE h.run_id = $run AND h.induction_sig = true RETURN h.name, h.induction_score "
        "ORDER BY h.name", {"run": run_id},
    ).rows
    assert rows == [["L0H1", 4.5], ["L1H0", None]]  # NaN is stored as null
    absent = "MATCH (h:Head) WHERE h.key = $key RETURN h.induction_score, h.induction_p, h.induction_sig"
    assert store.read(absent, {"key": f"{run_id}/L5H3"}).rows == [[None, None, None]]  # a head without role results
    assert all("not a role" not in r for r in store.read("MATCH (h:Head) RETURN keys(h) AS k LIMIT 1").rows[0][0])


@pytest.mark.slow
def test_an_embedded_store_made_before_causal_effects_gains_their_columns(tmp_path, tables):
    """A store whose edge tables were created without the effect columns (headgraph before causal effects) takes
    a run with effects: its tables are altered, its earlier run keeps null effects."""
    import ladybug

    from headgraph.heads import TYPE_PAIRS
    from headgraph.loader import ladybug_store, store as store_module

    path = tmp_path / "old.lbdb"
    old = {n: t for n, t in store_module.EDGE_PROPERTIES.items() if not n.startswith("effect")}
    connection = ladybug.Connection(ladybug.Database(str(path)))
    edge_tables = {f"CREATE REL TABLE IF NOT EXISTS {kind}(": kind for kind in TYPE_PAIRS}
    for statement in ladybug_store.schema_ddl():
        kind = next((k for prefix, k in edge_tables.items() if statement.startswith(prefix)), None)
        if kind is not None:
            statement = f"CREATE REL TABLE {kind}(FROM Head TO Head, {ladybug_store._columns(old)})"
        connection.execute(statement)
    connection.close()
    pairs, heads = tables
    earlier, later = new_run_id(), new_run_id()
    with LadybugStore(path) as opened:
        load(opened, run_graph(pairs.drop(columns=["effect", "effect_lo", "effect_hi"]), heads, {"id": earlier}))
        load(opened, run_graph(pairs, heads, {"id": later}))
        query = "MATCH (a:Head)-[r:OK]->(b:Head) WHERE a.run_id = $run RETURN r.effect ORDER BY r.rank LIMIT 1"
        assert opened.read(query, {"run": earlier}).rows == [[None]]
        strongest = pairs[pairs.target_type == "K"].nlargest(1, "pk")
        assert opened.read(query, {"run": later}).rows == [[pytest.approx(strongest.effect.iloc[0])]]


def test_the_read_path_refuses_writes(store, tables):
    run_id = new_run_id()
    load(store, graph_of(tables, run_id))
    with pytest.raises(ReadOnlyViolation):
        store.read("MATCH (h:Head) WHERE h.run_id = $run SET h.name = 'x'", {"run": run_id})
    with pytest.raises(ReadOnlyViolation):
        store.read("CREATE (:Run {id: 'sneaky'})")
    assert store.read("MATCH (r:Run) WHERE r.id = 'sneaky' RETURN count(r)").rows == [[0]]




def test_cypher_command_refuses_writes_on_the_embedded_store(tmp_path, tables, capsys):
    path = tmp_path / "cli.lbdb"
    with LadybugStore(path) as opened:
        load(opened, graph_of(tables, "cli-run"))
    code, _, err = run_cli(["cypher", "CREATE (:Run {id: 'x'})", "--db", str(path)], capsys)
    assert code == ReadOnlyViolation.exit_code and err.startswith("error: ") and err.count("\n") == 1
    result = CliRunner().invoke(cli, ["cypher", "MATCH (r:Run) RETURN r.id AS id", "--db", str(path), "--format", "json"])
    assert result.exit_code == 0 and json.loads(result.output) == [{"id": "cli-run"}]


@pytest.mark.neo4j
def test_cypher_command_refuses_writes_on_neo4j(neo4j_config, monkeypatch, capsys):
    monkeypatch.setenv("NEO4J_PASSWORD", neo4j_config["password"])
    args = ["--neo4j", neo4j_config["uri"], "--neo4j-user", neo4j_config["user"]]
    code, _, err = run_cli(["cypher", "CREATE (:Run {id: 'cli-sneaky'})", *args], capsys)
    assert code == ReadOnlyViolation.exit_code and err.startswith("error: ") and err.count("\n") == 1
    check = CliRunner().invoke(cli, ["cypher", "MATCH (r:Run {id: 'cli-sneaky'}) RETURN count(r) AS n", *args, "--format", "csv"])
    assert check.exit_code == 0 and check.output.splitlines() == ["n", "0"]


def test_a_second_writer_waits_then_gets_a_clear_error(tmp_path):
    path = tmp_path / "locked.lbdb"
    LadybugStore(path).close()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, ladybug
            db = ladybug.Database({str(path)!r})
            print("holding", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(StoreUnavailable, match="in use by another process") as error:
            LadybugStore(path, lock_timeout=0.5)
        assert "\n" not in str(error.value)
        with LadybugStore(path, read_only=True) as reader:  # readers are not blocked
            assert reader.runs() == []
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    LadybugStore(path).close()  # free again once the holder exits


def test_store_selection_follows_options_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("NEO4J_URI", raising=False)
    monkeypatch.setenv("HEADGRAPH_DB", str(tmp_path / "from-env.lbdb"))
    with open_store() as opened:
        assert opened.description == f"LadybugDB at {tmp_path / 'from-env.lbdb'}"
    with pytest.raises(UsageError):
        open_store(db=str(tmp_path / "x.lbdb"), neo4j="bolt://127.0.0.1:7687")
    with pytest.raises(StoreUnavailable, match="no headgraph store"):
        open_store(db=str(tmp_path / "missing.lbdb"), read_only=True)


def test_an_unreachable_neo4j_is_one_clear_line(capsys):
    with pytest.raises(StoreUnavailable, match="cannot reach Neo4j") as error:
        open_store(neo4j="bolt://127.0.0.1:1", user="neo4j", password="x")
    assert "\n" not in str(error.value)
    code, _, err = run_cli(["query", "hubs", "--neo4j", "bolt://127.0.0.1:1"], capsys)
    assert code == StoreUnavailable.exit_code and err.startswith("error: cannot reach Neo4j") and err.count("\n") == 1


@pytest.mark.neo4j
def test_a_wrong_neo4j_password_is_one_clear_line(neo4j_config):
    with pytest.raises(StoreUnavailable, match="refused user") as error:
        open_store(neo4j=neo4j_config["uri"], user=neo4j_config["user"], password="definitely-wrong")
    assert "\n" not in str(error.value)


def test_a_store_from_an_earlier_version_is_named_so_on_read_and_gains_the_columns_on_write(tables, tmp_path, capsys):
    """A column added since the store was written (dropped here through LadybugDB itself) is no internal error
    on a read-only query but one line, exit 3; the next read-write open adds it and the query answers."""
    import ladybug

    path = tmp_path / "older.lbdb"
    run_id = new_run_id()
    with LadybugStore(path) as writer:
        writer.store_run(graph_of(tables, run_id))
    database = ladybug.Database(str(path))
    connection = ladybug.Connection(database)
    connection.execute("ALTER TABLE Run DROP attr_unreliable")
    connection.execute("CHECKPOINT")
    connection.close()
    database.close()
    with LadybugStore(path, read_only=True) as reader, pytest.raises(StoreUnavailable) as refused:
        run_named(reader, "causal-edges", {"run": run_id})
    assert str(refused.value) == (f"LadybugDB at {path} was written by an earlier headgraph: it has no "
                                  "attr_unreliable yet; the next analyze or sweep into it adds it (reads never "
                                  "change the file)")
    code, out, err = run_cli(["query", "causal-edges", "--db", str(path), "--run", run_id], capsys)
    assert code == 3 and out == "" and err.count("\n") == 1 and "has no attr_unreliable yet" in err
    LadybugStore(path).close()  # a read-write open brings the schema up to date
    with LadybugStore(path, read_only=True) as reader:
        assert "attr_reliable" in run_named(reader, "causal-edges", {"run": run_id}).columns
