"""`headgraph export` on a real run of the planted model: each format, read back by its own reader (networkx,
pandas, json), holds the nodes, kind-keyed edges and attributes of `head_network`; the neo4j-import CSVs go
through the real `neo4j-admin database import full` into a Neo4j 5.26 of the test's own, where `headgraph query`
answers as the run computed in Python; bad input is one line and exit 2."""

import json
import math
import os
import shutil
import subprocess

import networkx as nx
import pandas as pd
import pytest
from _cli import run_cli
from _ports import unclaimed_port

from headgraph.analysis.centrality import hub_report
from headgraph.analysis.network import head_network
from headgraph.analysis.selection import SelectionPolicy, select_graph
from headgraph.export import neo4j_import_arguments
from headgraph.neo4j_local.server import (
    ADMIN_TOOL,
    LocalServer,
    _java,
    assemble,
    neo4j_conf,
    set_initial_password,
    start,
    stop,
)
from headgraph.runs import load_run

pytestmark = pytest.mark.slow  # every test reads the session's full analysis of the planted model (conftest), 10-30 s to make


@pytest.fixture
def run_dir(planted_analysis):
    """The run folder of the session's analysis of the planted model (conftest)."""
    return planted_analysis.folder


DEFAULT_POLICY = SelectionPolicy()  # what `export` selects without --top-k / --max-q / --min-z


def network(run_dir, policy=DEFAULT_POLICY):
    run = load_run(run_dir)
    return head_network(select_graph(run.pairs, run.heads, policy))


def export(run_dir, fmt, out, capsys, *options):
    code, stdout, err = run_cli(["export", str(run_dir), "--format", fmt, "--out", str(out), *options], capsys)
    assert code == 0 and err == "", err
    return stdout


def same(read, expected, exact_types=True):
    """A value read back equals the graph's: floats to 1e-12, relative or absolute (the formats are text, and
    networkx's HITS scores move by ~1e-16 between two computations on one graph), the rest exactly, of the same
    Python type unless the reader cannot know it (pandas: an integer column with gaps is float)."""
    number = isinstance(expected, int) and not isinstance(expected, bool)
    if isinstance(expected, float) or (number and not exact_types):
        return (isinstance(read, (int, float)) and not isinstance(read, bool)
                and math.isclose(read, expected, rel_tol=1e-12, abs_tol=1e-12))
    return (type(read) is type(expected) or not exact_types) and read == expected


def assert_same_attributes(read: dict, expected: dict, where, exact_types=True):
    assert set(read) == set(expected), (where, set(read) ^ set(expected))
    wrong = {k: (read[k], expected[k]) for k in expected if not same(read[k], expected[k], exact_types)}
    assert wrong == {}, where


def joined(data: dict) -> dict:
    return {k: ";".join(v) if isinstance(v, list) else v for k, v in data.items()}


def assert_same_graph(read: nx.MultiDiGraph, graph: nx.MultiDiGraph, node_extra=(), edge_extra=(), flatten=True):
    """Same nodes, same (source, target, kind) edges, same attributes; `*_extra`: attributes the format adds."""
    assert isinstance(read, nx.MultiDiGraph)
    assert sorted(read.nodes) == sorted(graph.nodes)
    assert sorted(read.edges(keys=True)) == sorted(graph.edges(keys=True))
    shape = joined if flatten else dict
    for node, data in graph.nodes(data=True):
        assert_same_attributes({k: v for k, v in read.nodes[node].items() if k not in node_extra}, shape(data), node)
    for u, v, kind, data in graph.edges(keys=True, data=True):
        assert data["kind"] == kind
        assert_same_attributes({k: x for k, x in read.edges[u, v, kind].items() if k not in edge_extra}, shape(data),
                               (u, v, kind))


def test_the_run_graph_has_roles_lists_and_parallel_kinds(run_dir):
    """The fixture exercises what the formats must carry: role lists, booleans, and two heads joined by several
    kinds (parallel edges)."""
    graph = network(run_dir)
    assert graph.number_of_edges() == 60 and {k for *_, k in graph.edges(keys=True)} == {"OQ", "OK", "OV"}
    assert any(len(roles) == 1 for _, roles in graph.nodes(data="roles"))
    assert any(roles == [] for _, roles in graph.nodes(data="roles"))
    assert any(graph.number_of_edges(u, v) > 1 for u, v in graph.edges())
    assert all(isinstance(graph.nodes[n]["identity_sig"], bool) and isinstance(graph.nodes[n]["rank_q"], int)
               for n in graph)


def test_graphml_reads_back_as_the_graph(run_dir, tmp_path, capsys):
    out = tmp_path / "nested" / "graph.graphml"
    assert export(run_dir, "graphml", out, capsys) == f"wrote {out}\n"
    assert_same_graph(nx.read_graphml(out, edge_key_type=str), network(run_dir))


def test_gexf_reads_back_as_the_graph(run_dir, tmp_path, capsys):
    out = tmp_path / "graph.gexf"
    export(run_dir, "gexf", out, capsys)
    read = nx.read_gexf(out)
    assert all(data["label"] == node for node, data in read.nodes(data=True))
    assert_same_graph(read, network(run_dir), node_extra={"label"}, edge_extra={"id"})


def test_cytoscape_json_reads_back_as_the_graph_with_role_lists(run_dir, tmp_path, capsys):
    out = tmp_path / "graph.cyjs"
    export(run_dir, "cytoscape", out, capsys)
    data = json.loads(out.read_text())
    assert {"nodes", "edges"} == set(data["elements"])
    assert_same_graph(nx.cytoscape_graph(data), network(run_dir), node_extra={"id", "value", "name"},
                      edge_extra={"source", "target", "key"}, flatten=False)


def test_csv_tables_hold_the_nodes_and_edges_under_the_given_policy(planted_analysis, run_dir, tmp_path, capsys):
    """--top-k 3 --max-q 0.01: of each type's three largest PKs, the planted edges (far in the null's tail) and
    none of the others (whose q-values are the null's noise)."""
    export(run_dir, "csv", tmp_path, capsys, "--top-k", "3", "--max-q", "0.01")
    graph = network(run_dir, SelectionPolicy(top_k=3, max_q=0.01))
    nodes, edges = pd.read_csv(tmp_path / "nodes.csv"), pd.read_csv(tmp_path / "edges.csv")
    assert list(nodes.columns[:1]) == ["head"] and list(edges.columns[:3]) == ["source", "target", "kind"]
    assert sorted(nodes["head"]) == sorted(graph.nodes) and len(edges) == graph.number_of_edges()
    assert set(zip(edges.source, edges.target, edges.kind)) == {e[:3] for e in planted_analysis.truth.edges}
    present = {row.pop("head"): {k: v for k, v in row.items() if not pd.isna(v)} for row in nodes.to_dict("records")}
    for node, data in graph.nodes(data=True):
        assert_same_attributes(present[node] | {"roles": present[node].get("roles", "")}, joined(data), node,
                               exact_types=False)
    assert sorted(zip(edges.source, edges.target, edges.kind)) == sorted(graph.edges(keys=True))
    for row in edges.to_dict("records"):
        u, v = row.pop("source"), row.pop("target")
        assert_same_attributes({k: x for k, x in row.items() if not pd.isna(x)}, graph.edges[u, v, row["kind"]],
                               (u, v), exact_types=False)


def neo4j_tables(folder):
    return {name: pd.read_csv(folder / name, keep_default_na=False, dtype=str)
            for name in ("model.csv", "run.csv", "heads.csv", "of_model.csv", "edges.csv")}


def test_neo4j_import_csvs_have_typed_headers_ids_labels_and_the_graph(run_dir, tmp_path, capsys):
    stdout = export(run_dir, "neo4j-import", tmp_path, capsys)
    assert stdout.splitlines()[-1].endswith("neo4j-admin " + " ".join(neo4j_import_arguments(tmp_path)))
    run, graph = load_run(run_dir), network(run_dir)
    tables = neo4j_tables(tmp_path)
    heads, edges = tables["heads.csv"], tables["edges.csv"]
    assert list(heads.columns[:2]) == ["key:ID(Head)", ":LABEL"]
    assert list(edges.columns[:3]) == [":START_ID(Head)", ":END_ID(Head)", ":TYPE"]
    assert {"name:string", "layer:long", "head:long", "run_id:string", "model:string", "roles:string[]",
            "identity_sig:boolean", "degree:long", "pagerank:double"} <= set(heads.columns)
    assert {"kind:string", "run_id:string", "source:string", "target:string", "pk:double", "rank:long",
            "q_model:double"} <= set(edges.columns)
    assert list(tables["run.csv"].columns[:2]) == ["id:ID(Run)", ":LABEL"]
    (record,) = tables["run.csv"].to_dict("records")
    assert (record["id:ID(Run)"], record[":LABEL"], record["status:string"]) == (run.record.id, "Run", "complete")
    assert (record["n_heads:long"], record["n_edges:long"]) == (str(len(graph)), str(graph.number_of_edges()))
    assert tables["of_model.csv"].values.tolist() == [[run.record.id, run.model, "OF_MODEL"]]
    assert list(tables["model.csv"].columns[:2]) == ["name:ID(Model)", ":LABEL"]
    by_name = heads.set_index("name:string")
    for node, data in graph.nodes(data=True):
        row = by_name.loc[node]
        assert row["key:ID(Head)"] == f"{run.record.id}/{node}" and row[":LABEL"] == f"Head;Layer{data['layer']}"
        assert row["head:long"] == str(data["index"]) and row["roles:string[]"] == ";".join(data["roles"])
        assert same(float(row["pagerank:double"]), data["pagerank"])
        assert row["identity_sig:boolean"] == str(data["identity_sig"]).lower()
    triples = sorted(zip(edges["source:string"], edges["target:string"], edges[":TYPE"]))
    assert triples == sorted(graph.edges(keys=True))
    for row in edges.to_dict("records"):
        data = graph.edges[row["source:string"], row["target:string"], row[":TYPE"]]
        assert row[":START_ID(Head)"] == f"{run.record.id}/{row['source:string']}"
        assert row[":END_ID(Head)"] == f"{run.record.id}/{row['target:string']}" and row["kind:string"] == data["kind"]
        assert same(float(row["pk:double"]), data["pk"]) and row["rank:long"] == str(data["rank"])


@pytest.fixture
def import_server(tmp_path):
    """A LocalServer of this test's own: a fresh home whose lib/ is the assembled home's (symlinked), on ports
    of its own (tests/_ports.py; not the session server's 7687 / 7474), never started yet."""
    assembled = LocalServer.from_env()
    assemble(assembled)
    home = tmp_path / "neo4j-home"
    for folder in ("conf", "data", "logs", "run", "plugins", "import"):
        (home / folder).mkdir(parents=True)
    (home / "lib").symlink_to(assembled.lib, target_is_directory=True)
    shutil.copy(assembled.home / "assembled.json", home)
    server = LocalServer(home.resolve(), bolt_port=unclaimed_port(), http_port=unclaimed_port(),
                         assets_port=unclaimed_port(), password="headgraph-export-test")
    yield server
    stop(server, log=lambda message: None)


@pytest.mark.neo4j
@pytest.mark.slow
def test_neo4j_admin_import_answers_the_named_queries_like_the_run(run_dir, tmp_path, import_server, capsys,
                                                                   monkeypatch):
    server, folder = import_server, tmp_path / "import"
    export(run_dir, "neo4j-import", folder, capsys)
    (server.home / "conf" / "neo4j.conf").write_text(neo4j_conf(server))
    set_initial_password(server)  # before the import: start() sets it only for a home without databases
    env = {**os.environ, "NEO4J_HOME": str(server.home), "NEO4J_CONF": str(server.home / "conf")}
    done = subprocess.run([_java(), "-cp", f"{server.lib}/*", ADMIN_TOOL, *neo4j_import_arguments(folder)],
                          check=False, capture_output=True, text=True, cwd=server.home, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "IMPORT DONE" in done.stdout
    start(server, log=lambda message: None, short_lived=True)
    monkeypatch.setenv("NEO4J_USER", server.user)
    monkeypatch.setenv("NEO4J_PASSWORD", server.password)

    def query(*args):
        code, stdout, err = run_cli([*args, "--neo4j", server.uri, "--format", "json"], capsys)
        assert code == 0, err
        return json.loads(stdout)

    run, graph = load_run(run_dir), network(run_dir)
    selected = select_graph(run.pairs, run.heads, DEFAULT_POLICY)
    (stored,) = query("runs")
    assert (stored["id"], stored["status"], stored["heads"], stored["edges"]) == (run.record.id, "complete", 12, 60)

    rows = query("query", "hubs", "--param", f"limit={len(graph)}")  # the latest complete run: the imported one
    found = {r["head"]: (r["degree"], r["in_degree"], r["out_degree"]) for r in rows}
    expected = [h for h in hub_report(selected.centrality, selected.edges, top=len(graph))["hubs"] if h["degree"] > 0]
    assert found == {h["head"]: (h["degree"], h["in_degree"], h["out_degree"]) for h in expected}
    assert [found[r["head"]][0] for r in rows] == sorted((found[r["head"]][0] for r in rows), reverse=True)
    for r in rows:
        counted = [sum(k == r["kind"] for *_, k in edges(r["head"], keys=True))
                   for edges in (graph.in_edges, graph.out_edges)]
        assert [r["kind_in"], r["kind_out"]] == counted

    top = query("query", "top-edges", "--param", "limit=1000")
    assert sorted((r["source"], r["target"], r["kind"]) for r in top) == sorted(graph.edges(keys=True))
    assert all(r["pk"] == graph.edges[r["source"], r["target"], r["kind"]]["pk"]
               and r["rank"] == graph.edges[r["source"], r["target"], r["kind"]]["rank"] for r in top)


def test_bad_input_is_one_line_and_exit_2(run_dir, tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        ([str(run_dir), "--format", "dot", "--out", str(tmp_path / "g")],
         "error: unknown export format 'dot': use one of graphml, gexf, cytoscape, csv, neo4j-import"),
        ([str(tmp_path / "missing"), "--format", "csv", "--out", str(tmp_path / "g")],
         f"error: run folder '{tmp_path / 'missing'}' does not exist; pass the --out folder of `headgraph analyze`"),
        ([str(run_dir), "--format", "graphml", "--out", str(a_file / "g.graphml")],
         f"error: cannot write --out {a_file / 'g.graphml'}: no file can be created there; choose another path"),
        ([str(run_dir), "--format", "graphml", "--out", str(tmp_path)],
         f"error: --out {tmp_path} is a folder; this format writes one file: name the file"),
        ([str(run_dir), "--format", "neo4j-import", "--out", str(a_file)],
         f"error: --out {a_file} is a file; this format writes a folder: choose a folder path"),
    ]
    for args, message in cases:
        code, stdout, err = run_cli(["export", *args], capsys)
        assert (code, stdout, err.strip().splitlines()) == (2, "", [message])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
