"""Centrality of heads in the selected (thresholded) head graph, computed with networkx, and the hub report.

Input edges: a DataFrame with `source`, `target`, `kind`, `pk` (one row per selected edge; a head pair may be
joined by several weight-pair types). Degrees count every typed edge; weighted degrees sum PK. PageRank and
HITS use the head-pair graph with PK summed over types as weight; betweenness counts hops (unweighted).
"""

from __future__ import annotations

import networkx as nx
import pandas as pd

MEASURES = (
    "degree",
    "in_degree",
    "out_degree",
    "weighted_degree",
    "weighted_in",
    "weighted_out",
    "pagerank",
    "hits_hub",
    "hits_authority",
    "betweenness",
)


COUNT_MEASURES = ("degree", "in_degree", "out_degree")


def pair_graph(edges: pd.DataFrame, heads: list[str]) -> nx.DiGraph:
    """One edge per (source, target) head pair, weighted by PK summed over the pair's weight-pair types."""
    weights = edges.groupby(["source", "target"], as_index=False)["pk"].sum().rename(columns={"pk": "weight"})
    graph = nx.from_pandas_edgelist(weights, "source", "target", edge_attr="weight", create_using=nx.DiGraph)
    graph.add_nodes_from(heads)
    return graph


def _hits(pairs: nx.DiGraph) -> tuple[dict, dict]:
    if pairs.size(weight="weight") == 0:  # no edges, or only PK-0 ones (all-zero heads): HITS is undefined
        zero = dict.fromkeys(pairs.nodes, 0.0)
        return zero, dict(zero)
    if pairs.number_of_nodes() == 1:  # a 1-head model's self-pairs (--full-matrix); scipy's svds needs 2 nodes
        one = dict.fromkeys(pairs.nodes, 1.0)
        return one, dict(one)
    return nx.hits(pairs, max_iter=1000, normalized=True)


def head_centrality(edges: pd.DataFrame, heads: list[str]) -> pd.DataFrame:
    """One row per head (column `name`) with every measure in MEASURES, on the selected edges only: a head's
    degree counts its typed edges in this selection, so it changes with the policy and says nothing of how
    much the model relies on the head.

    >>> edges = pd.DataFrame({"source": ["L0H0", "L0H0", "L1H0"], "target": ["L1H0", "L2H0", "L2H0"],
    ...                       "kind": ["OK", "OV", "OQ"], "pk": [2.0, 1.0, 3.0]})
    >>> table = head_centrality(edges, ["L0H0", "L1H0", "L2H0", "L2H1"])
    >>> table[["name", "in_degree", "out_degree", "weighted_degree", "betweenness"]]
       name  in_degree  out_degree  weighted_degree  betweenness
    0  L0H0          0           2              3.0          0.0
    1  L1H0          1           1              5.0          0.0
    2  L2H0          2           0              4.0          0.0
    3  L2H1          0           0              0.0          0.0

    (No head lies between two others: the direct edge L0H0 -> L2H0 is shorter than the route through L1H0.)
    """
    pairs = pair_graph(edges, heads)
    hubs, authorities = _hits(pairs)
    # degrees of the typed multigraph, straight from the edge rows (a self-pair counts in and out, as in networkx)
    incoming, outgoing = edges.groupby("target")["pk"], edges.groupby("source")["pk"]
    counts = {"in_degree": incoming.size(), "out_degree": outgoing.size(),
              "weighted_in": incoming.sum(), "weighted_out": outgoing.sum()}
    counts = {name: column.reindex(heads, fill_value=0) for name, column in counts.items()}
    table = pd.DataFrame(
        {
            "in_degree": counts["in_degree"],
            "out_degree": counts["out_degree"],
            "degree": counts["in_degree"] + counts["out_degree"],
            "weighted_in": counts["weighted_in"],
            "weighted_out": counts["weighted_out"],
            "weighted_degree": counts["weighted_in"] + counts["weighted_out"],
            "pagerank": nx.pagerank(pairs, weight="weight"),
            "hits_hub": hubs,
            "hits_authority": authorities,
            "betweenness": nx.betweenness_centrality(pairs, normalized=True),
        }
    )
    table = table.reindex(heads)
    table.index.name = "name"
    return table.reset_index().astype({m: int if m in COUNT_MEASURES else float for m in MEASURES})


def _top(centrality: pd.DataFrame, measure: str, n: int) -> list[str]:
    ordered = centrality.sort_values([measure, "name"], ascending=[False, True], kind="stable")
    return ordered["name"].head(n).tolist()


def _top_edges(edges: pd.DataFrame, head: str, per_type: int) -> dict[str, dict[str, list[dict]]]:
    out: dict[str, dict[str, list[dict]]] = {"in": {}, "out": {}}
    for direction, own, other in (("in", "target", "source"), ("out", "source", "target")):
        mine = edges[edges[own] == head].sort_values(["kind", "pk"], ascending=[True, False])
        for kind, group in mine.groupby("kind", sort=True):
            out[direction][kind] = [
                {"head": h, "pk": float(p)} for h, p in group[[other, "pk"]].head(per_type).itertuples(index=False)
            ]
    return out


def hub_report(centrality: pd.DataFrame, edges: pd.DataFrame, top: int = 10, per_type: int = 3) -> dict:
    """The top heads by degree, which measures agree, and each hub's strongest in/out edges per type.

    Returns plain data: `top`, `hubs` (ranked by degree, ties by weighted degree then name; each with its measures,
    `rank_by` = the head's rank under every measure, `top_in` = the measures whose top-`top` it is in, and
    `edges` = its top in/out edges per type), `leaders` (the first head under each measure), `consensus`
    (heads in the top `top` of every measure) and `spearman` (rank correlation between measures)."""
    ranks = {m: centrality.set_index("name")[m].rank(ascending=False, method="min").astype(int) for m in MEASURES}
    tops = {m: _top(centrality, m, top) for m in MEASURES}
    ordered = centrality.sort_values(
        ["degree", "weighted_degree", "name"], ascending=[False, False, True], kind="stable"
    ).head(top)
    hubs = [
        {
            "head": row["name"],
            **{m: int(row[m]) if m in COUNT_MEASURES else float(row[m]) for m in MEASURES},
            "rank_by": {m: int(ranks[m][row["name"]]) for m in MEASURES},
            "top_in": [m for m in MEASURES if row["name"] in tops[m]],
            "edges": _top_edges(edges, row["name"], per_type),
        }
        for _, row in ordered.iterrows()
    ]
    rho = centrality[list(MEASURES)].corr(method="spearman") if len(centrality) > 2 else None
    spearman = (
        {a: {b: None if pd.isna(rho.at[a, b]) else float(rho.at[a, b]) for b in MEASURES} for a in MEASURES}
        if rho is not None
        else {}
    )
    return {
        "measures": list(MEASURES),
        "top": top,
        "hubs": hubs,
        "leaders": {m: tops[m][0] if tops[m] else None for m in MEASURES},
        "consensus": [h for h in tops["degree"] if all(h in tops[m] for m in MEASURES)],
        "spearman": spearman,
    }
