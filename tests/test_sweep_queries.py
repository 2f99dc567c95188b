"""The queries across runs, on synthetic runs in both stores: a sweep's edge-history, role-history, emergence and
role-emergence against a pandas reference over the same selected edges and role decisions, and model-hubs /
model-roles on two different models side by side; the same rows on Neo4j (real server) and LadybugDB."""

import uuid

import numpy as np
import pandas as pd
import pytest
from _pairs import HUB, planted_pairs, run_graph

from headgraph.analysis.selection import SelectionPolicy
from headgraph.errors import UsageError
from headgraph.loader.ladybug_store import LadybugStore
from headgraph.loader.open_store import open_store
from headgraph.queries.runner import run_named

pytestmark = pytest.mark.slow  # its module store fixtures load a sweep's runs into both stores: 12-18 s, the pre-sweep store 6 s, at load ~4

SESSION = f"swq-{uuid.uuid4().hex[:6]}"
SWEEP, OTHER_SWEEP = f"{SESSION}-sweep", f"{SESSION}-other"
STEPS = (100, 200, 300, 400, 500)
POLICY = SelectionPolicy(top_k=12)  # 12 of 72 pairs per type: edges come and go between steps
# q_model of planted OK edges per step (PK raised so that they are selected at every step)
PLANTED_Q = {
    (HUB, "L3H0"): (0.5, 0.01, 0.3, 0.01, 0.001),  # significant from 200, a gap at 300: emerged at 400
    (HUB, "L3H1"): (0.5, 0.5, 0.01, 0.02, 0.03),  # emerged at 300
    (HUB, "L4H0"): (0.01, 0.5, 0.5, 0.5, 0.5),  # significant at 100 only: never emerged
}
# the heads whose induction test is significant per step (other roles: none)
INDUCTION = {100: {"L4H2"}, 200: set(), 300: {"L3H0", "L4H2"}, 400: {"L3H0", "L4H2"}, 500: {"L3H0", "L4H2", "L5H1"}}


def _step_tables(step):
    pairs, heads = planted_pairs(seed=step)
    ok = pairs["source_type"].eq("O") & pairs["target_type"].eq("K")
    for (source, target), qs in PLANTED_Q.items():
        edge = ok & pairs["source"].eq(source) & pairs["target"].eq(target)
        pairs.loc[edge, ["pk", "q_model"]] = [9.0, qs[STEPS.index(step)]]
    heads["induction_score"] = np.linspace(0, 1, len(heads))
    heads["induction_p"] = 0.5
    heads["induction_sig"] = heads["head"].isin(INDUCTION[step])
    heads["previous_token_sig"] = False
    return pairs, heads


def _sweep_graphs():
    graphs = []
    for i, step in enumerate(STEPS):
        pairs, heads = _step_tables(step)
        run = {"id": f"{SWEEP}-{step}", "model": f"toy-step{step}", "created": f"2026-02-0{i + 1}T00:00:00+00:00",
               "sweep": SWEEP, "step": step}
        graphs.append(run_graph(pairs, heads, run, POLICY))
    pairs, heads = _step_tables(100)  # a run of another sweep and a run of no sweep: never in SWEEP's answers
    graphs.append(run_graph(pairs, heads, {"id": f"{OTHER_SWEEP}-1", "model": "toy-step100", "sweep": OTHER_SWEEP,
                                           "step": 999, "created": "2026-01-01T00:00:00+00:00"}, POLICY))
    return graphs


def _model_graphs():
    """Model toy-a (6 layers x 4 heads) twice, the later run counts; model toy-b (3 x 2) once."""
    pairs, heads = planted_pairs()
    heads = heads.assign(induction_sig=heads["head"].isin(["L3H0", "L4H2"]),
                         previous_token_sig=heads["head"].isin(["L2H1"]))
    older = run_graph(pairs, heads.assign(induction_sig=False), {"id": f"{SESSION}-a-old", "model": "toy-a",
                                                                 "created": "2026-03-01T00:00:00+00:00"})
    newer = run_graph(pairs, heads, {"id": f"{SESSION}-a", "model": "toy-a", "created": "2026-03-02T00:00:00+00:00"},
                      SelectionPolicy(8))
    pairs_b, heads_b = planted_pairs(n_layers=3, n_heads=2, hub="L1H0", seed=5)
    heads_b = heads_b.assign(induction_sig=heads_b["head"].isin(["L2H0", "L2H1"]), previous_token_sig=False)
    b = run_graph(pairs_b, heads_b, {"id": f"{SESSION}-b", "model": "toy-b", "created": "2026-03-01T00:00:00+00:00"},
                  SelectionPolicy(3))
    return older, newer, b


@pytest.fixture(scope="module")
def graphs():
    return _sweep_graphs() + list(_model_graphs())


@pytest.fixture(scope="module")
def ladybug(graphs, tmp_path_factory):
    with LadybugStore(tmp_path_factory.mktemp("sweepq") / "graph.lbdb") as store:
        for graph in graphs:
            store.store_run(graph)
        yield store


@pytest.fixture(scope="module")
def neo4j(graphs, neo4j_config):
    with open_store(neo4j=neo4j_config["uri"], user=neo4j_config["user"], password=neo4j_config["password"]) as store:
        for graph in graphs:
            store.store_run(graph)
        yield store
        for graph in graphs:
            store.delete_run(graph.run["id"])


@pytest.fixture(scope="module", params=["ladybug", pytest.param("neo4j", marks=pytest.mark.neo4j)])
def store(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def selected(graphs):
    """The selected edges of the sweep's runs with their step, as the stores were given them."""
    return pd.concat([g.edges.assign(step=g.run["step"]) for g in graphs[: len(STEPS)]], ignore_index=True)


def _emerged(significant: dict, steps=STEPS) -> dict:
    """{item: (emerged, first significant, how many steps)}: the first significant step s such that every
    sweep step from s on is significant, by brute force over the steps."""
    out = {}
    for item, sig in significant.items():
        stays = [s for s in sorted(sig) if all(t in sig for t in steps if t >= s)]
        if stays:
            out[item] = (stays[0], min(sig), len(sig))
    return out


MODELS = ",".join([f"toy-step{step}" for step in STEPS] + ["toy-a", "toy-b"])  # every model this module stores
PARAMS = {  # each scoped to this module's runs: the Neo4j server is shared with the rest of the suite
    "edge-history": {"sweep": SWEEP, "source": HUB, "target": "L3H0"},
    "role-history": {"sweep": SWEEP, "role": "induction"},
    "emergence": {"sweep": SWEEP},
    "role-emergence": {"sweep": SWEEP},
    "model-hubs": {"models": "toy-a,toy-b", "limit": "3"},
    "model-roles": {"models": MODELS},
}


@pytest.mark.neo4j
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_neo4j_and_ladybug_return_the_same_rows(name, ladybug, neo4j):
    on_ladybug, on_neo4j = run_named(ladybug, name, PARAMS[name]), run_named(neo4j, name, PARAMS[name])
    assert on_ladybug.columns == on_neo4j.columns
    rounded = [[[round(v, 9) if isinstance(v, float) else v for v in row] for row in r.rows] for r in (on_ladybug, on_neo4j)]
    assert rounded[0] == rounded[1] and on_ladybug.rows, name


def test_edge_history_lists_every_step_with_the_stored_statistics(store, selected):
    for target in ("L3H0", "L5H2"):
        rows = pd.DataFrame(run_named(store, "edge-history", {"sweep": SWEEP, "source": HUB, "target": target,
                                                                "types": "OK"}).records())
        assert rows["step"].tolist() == list(STEPS)
        expected = selected[selected.kind.eq("OK") & selected.source.eq(HUB) & selected.target.eq(target)]
        expected = expected.set_index("step").reindex(list(STEPS))
        assert rows["selected"].tolist() == expected["pk"].notna().tolist()
        for column in ("pk", "q_model", "effect", "effect_lo", "effect_hi"):
            assert rows[column].tolist() == pytest.approx(expected[column].tolist(), nan_ok=True), column
    planted = run_named(store, "edge-history", {"sweep": SWEEP, "source": HUB, "target": "L3H0", "types": "OK"})
    assert [r["q_model"] for r in planted.records()] == pytest.approx(PLANTED_Q[HUB, "L3H0"])


def test_emergence_is_the_first_step_that_stays_significant(store, selected):
    rows = run_named(store, "emergence", {"sweep": SWEEP, "max_q": "0.05"}).records()
    found = {(r["kind"], r["source"], r["target"]): (r["emerged"], r["first_significant"], r["significant_steps"])
             for r in rows}
    significant = selected[selected.q_model <= 0.05].groupby(["kind", "source", "target"])["step"].agg(set)
    assert found == _emerged(significant.to_dict())
    assert found["OK", HUB, "L3H0"] == (400, 200, 3) and found["OK", HUB, "L3H1"] == (300, 300, 3)
    assert ("OK", HUB, "L4H0") not in found and {r["steps"] for r in rows} == {len(STEPS)}
    assert [r["emerged"] for r in rows] == sorted(r["emerged"] for r in rows)
    only_ok = run_named(store, "emergence", {"sweep": SWEEP, "types": "OK"}).records()
    assert {r["kind"] for r in only_ok} == {"OK"} and len(only_ok) == sum(k == "OK" for k, _, _ in found)


def test_role_history_and_role_emergence_follow_the_role_decisions(store):
    rows = run_named(store, "role-history", {"sweep": SWEEP, "role": "induction", "heads": "L3H0,L4H2"}).records()
    assert [(r["step"], r["head"]) for r in rows] == [(s, h) for s in STEPS for h in ("L3H0", "L4H2")]
    assert all(r["significant"] == (r["head"] in INDUCTION[r["step"]]) for r in rows)
    assert all(r["roles"] == (["induction"] if r["significant"] else []) for r in rows)
    emerged = {(r["role"], r["head"]): (r["emerged"], r["first_significant"], r["significant_steps"])
               for r in run_named(store, "role-emergence", {"sweep": SWEEP}).records()}
    heads = {h for s in INDUCTION.values() for h in s}
    reference = _emerged({("induction", h): {s for s in STEPS if h in INDUCTION[s]} for h in heads})
    assert emerged == reference == {("induction", "L3H0"): (300, 300, 3), ("induction", "L4H2"): (300, 100, 4),
                                    ("induction", "L5H1"): (500, 500, 1)}
    assert run_named(store, "role-emergence", {"sweep": SWEEP, "roles": "previous_token"}).rows == []


def test_model_hubs_compare_the_latest_run_of_each_model(store, graphs):
    rows = pd.DataFrame(run_named(store, "model-hubs", {"models": "toy-a,toy-b", "limit": "3"}).records())
    older, newer, b = graphs[len(STEPS) + 1:]
    assert set(rows["run"]) == {newer.run["id"], b.run["id"]}  # toy-a's later run, not its first
    for graph in (newer, b):
        degree = pd.concat([graph.edges["source"], graph.edges["target"]]).value_counts()
        ranked = (degree.rename("degree").rename_axis("head").reset_index()
                  .assign(layer=lambda d: d["head"].str.extract(r"L(\d+)H", expand=False).astype(int),
                          index=lambda d: d["head"].str.extract(r"H(\d+)$", expand=False).astype(int))
                  .sort_values(["degree", "layer", "index"], ascending=[False, True, True]).head(3))
        mine = rows[rows["model"] == graph.run["model"]]
        assert mine["head"].tolist() == ranked["head"].tolist() and mine["hub_rank"].tolist() == [1, 2, 3]
        assert mine["degree"].tolist() == ranked["degree"].tolist()
    assert rows[rows.model == "toy-a"]["head"].iloc[0] == HUB and rows[rows.model == "toy-b"]["head"].iloc[0] == "L1H0"
    hub = rows[(rows.model == "toy-a") & (rows["head"] == HUB)].iloc[0]
    assert hub["roles"] == ["previous_token"]


def test_model_roles_put_the_models_of_a_role_side_by_side(store):
    rows = run_named(store, "model-roles", {"models": "toy-a,toy-b"}).records()
    assert [(r["role"], r["model"], r["heads"], r["names"], r["model_heads"]) for r in rows] == [
        ("induction", "toy-a", 2, ["L3H0", "L4H2"], 24),
        ("induction", "toy-b", 2, ["L2H0", "L2H1"], 6),
        ("previous_token", "toy-a", 1, ["L2H1"], 24),
    ]
    assert [r["model"] for r in run_named(store, "model-roles", {"models": "toy-b"}).records()] == ["toy-b"]


def test_model_roles_without_models_covers_every_model_in_the_store(ladybug):
    """The embedded store holds this module's runs only, so no models means all of them."""
    assert run_named(ladybug, "model-roles", {}).rows == run_named(ladybug, "model-roles", {"models": MODELS}).rows
    assert {r["model"] for r in run_named(ladybug, "model-roles", {}).records()} >= {"toy-a", "toy-b", "toy-step500"}


def test_the_sweep_defaults_to_the_latest_and_an_unknown_one_is_a_usage_error(ladybug):
    assert ladybug.latest_sweep() == SWEEP
    rows = run_named(ladybug, "role-history", {"role": "induction", "heads": "L4H2"}).records()
    assert [r["step"] for r in rows] == list(STEPS)
    with pytest.raises(UsageError, match="no sweep 'nope' in"):
        run_named(ladybug, "emergence", {"sweep": "nope"})


def test_an_embedded_store_made_before_sweeps_gains_sweep_step_and_roles(tmp_path):
    """Run and Head tables created without `sweep`, `step` and `roles` (headgraph before sweeps) take a sweep's
    runs: the tables are altered on the read-write open, the earlier run keeps nulls and no sweep."""
    import ladybug

    from headgraph.loader import ladybug_store, store as store_module

    path = tmp_path / "old.lbdb"
    old = {"Run": {n: t for n, t in store_module.RUN_PROPERTIES.items() if n not in ("sweep", "step")},
           "Head": {n: t for n, t in store_module.HEAD_PROPERTIES.items() if n != "roles"}}
    connection = ladybug.Connection(ladybug.Database(str(path)))
    for statement in ladybug_store.schema_ddl():
        for table, properties in old.items():
            if statement.startswith(f"CREATE NODE TABLE IF NOT EXISTS {table}("):
                statement = f"CREATE NODE TABLE {table}({ladybug_store._columns(properties)}, PRIMARY KEY({list(properties)[0]}))"
        connection.execute(statement)
    connection.close()
    earlier, *sweep = _sweep_graphs()[:3]
    earlier.run.update(sweep=None, step=None)
    with LadybugStore(path) as store:
        for graph in (earlier, *sweep):
            store.store_run(graph)
        rows = store.read("MATCH (r:Run) RETURN r.id AS id, r.sweep AS sweep, r.step AS step ORDER BY id").records()
        assert [(r["sweep"], r["step"]) for r in rows] == [(None, None), (SWEEP, 200), (SWEEP, 300)]
        history = run_named(store, "role-history", {"sweep": SWEEP, "role": "induction", "heads": "L4H2"}).records()
        assert [(r["step"], r["significant"]) for r in history] == [(200, False), (300, True)]
