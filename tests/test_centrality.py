"""Centrality of the selected head graph: measures against independent numpy/pandas computations, the hub
report on a planted hub, and the degenerate empty graph."""

import numpy as np
import pandas as pd
import pytest
from _pairs import HUB, planted_pairs

from headgraph.analysis.centrality import MEASURES, head_centrality, hub_report
from headgraph.analysis.selection import SelectionPolicy, select_edges

HEADS = ["a", "b", "c", "d", "e"]
EDGES = pd.DataFrame(
    [
        ("a", "b", "OK", 2.0),
        ("a", "b", "OV", 1.0),  # a second type between the same two heads
        ("b", "c", "OK", 3.0),
        ("a", "c", "OQ", 0.5),
        ("c", "d", "OV", 1.5),
    ],
    columns=["source", "target", "kind", "pk"],
)


@pytest.fixture(scope="module")
def table():
    return head_centrality(EDGES, HEADS).set_index("name")


def _adjacency():
    index = {h: i for i, h in enumerate(HEADS)}
    a = np.zeros((len(HEADS), len(HEADS)))
    np.add.at(a, (EDGES["source"].map(index), EDGES["target"].map(index)), EDGES["pk"])
    return a


def test_degrees_count_typed_edges_and_sum_pk(table):
    out_counts = EDGES["source"].value_counts().reindex(HEADS, fill_value=0)
    in_counts = EDGES["target"].value_counts().reindex(HEADS, fill_value=0)
    assert table["out_degree"].tolist() == out_counts.tolist()
    assert table["in_degree"].tolist() == in_counts.tolist()
    assert table["degree"].tolist() == (out_counts + in_counts).tolist()
    assert table.loc["a", "out_degree"] == 3  # a->b counted once per type
    weighted_out = EDGES.groupby("source")["pk"].sum().reindex(HEADS, fill_value=0.0)
    np.testing.assert_allclose(table["weighted_out"], weighted_out)
    assert table.loc["e", "degree"] == 0  # isolated heads are kept


def test_pagerank_matches_power_iteration(table):
    a = _adjacency()
    n, damping = len(HEADS), 0.85
    out = a.sum(1)
    rank = np.full(n, 1 / n)
    for _ in range(1000):
        spread = np.divide(rank, out, out=np.zeros(n), where=out > 0) @ a
        dangling = rank[out == 0].sum() / n
        rank = (1 - damping) / n + damping * (spread + dangling)
    np.testing.assert_allclose(table["pagerank"], rank, atol=1e-6)


def test_hits_are_the_principal_singular_vectors(table):
    u, _, vt = np.linalg.svd(_adjacency())
    hubs, authorities = np.abs(u[:, 0]), np.abs(vt[0])
    np.testing.assert_allclose(table["hits_hub"], hubs / hubs.sum(), atol=1e-6)
    np.testing.assert_allclose(table["hits_authority"], authorities / authorities.sum(), atol=1e-6)


def test_betweenness_counts_shortest_paths_through_a_head(table):
    # head pairs joined via b or c: a->b->c is longer than a->c (direct), so only paths through c count:
    # a->d and b->d pass through c; normalised by (n-1)(n-2) = 12 ordered pairs.
    assert table.loc["c", "betweenness"] == pytest.approx(2 / 12)
    assert table.loc["b", "betweenness"] == 0.0
    assert table.loc["a", "betweenness"] == 0.0


def test_hub_report_puts_the_planted_hub_first_and_explains_it():
    pairs, heads = planted_pairs()
    edges = select_edges(pairs, SelectionPolicy(top_k=20))
    report = hub_report(head_centrality(edges, heads["head"].tolist()), edges, top=5, per_type=3)
    first = report["hubs"][0]
    assert first["head"] == HUB
    assert report["leaders"]["degree"] == HUB
    assert "degree" in first["top_in"] and "weighted_degree" in first["top_in"]
    # its strongest OV in-edges, from pandas directly
    expected = edges[(edges["target"] == HUB) & (edges["kind"] == "OV")].nlargest(3, "pk")["source"].tolist()
    assert [e["head"] for e in first["edges"]["in"]["OV"]] == expected
    assert set(first["edges"]["out"]) == {"OQ", "OK"}
    assert report["spearman"]["degree"]["degree"] == pytest.approx(1.0)
    assert set(report["measures"]) == set(MEASURES)


def test_empty_graph_gives_zero_scores():
    empty = EDGES.iloc[:0]
    table = head_centrality(empty, HEADS)
    assert (table["degree"] == 0).all()
    assert (table["hits_hub"] == 0).all()
    np.testing.assert_allclose(table["pagerank"], 1 / len(HEADS))


def test_hub_report_of_a_graph_where_every_head_looks_alike():
    """Constant centralities (no edges at all) have no rank correlation: None, not a crash."""
    import pandas as pd

    from headgraph.analysis.centrality import head_centrality, hub_report

    edges = pd.DataFrame(columns=["source", "target", "kind", "pk", "source_layer", "target_layer"])
    report = hub_report(head_centrality(edges, ["L0H0", "L0H1", "L1H0"]), edges)
    assert report["spearman"]["degree"]["pagerank"] is None
