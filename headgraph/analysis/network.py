"""The selected head graph of a run as one networkx graph: the object exports, the interactive view and notebook
users work with.

Nodes are heads (`L{layer}H{head}`) with every column of the heads table (layer, index, ranks, each role's
score / p / q / significance), `roles` (the significant roles, a list) and every centrality measure. Edges are
the selected typed edges, keyed by their kind ("OK", ...): two heads may be joined by several types, so the graph
is a `networkx.MultiDiGraph` (a `DiGraph` subclass). Each edge carries every column of its pairs.parquet row
(pk, pk_norm, z_iso, q_model, cs, rank, and the causal effects where computed). Numbers that were not computed
(NaN) are left out of the attributes rather than stored as NaN, so an absent attribute means "not computed".

>>> import pandas as pd
>>> from headgraph.analysis.selection import SelectionPolicy, select_graph
>>> pairs = pd.DataFrame({"source": ["L0H0", "L0H1"], "target": ["L1H0", "L1H0"], "source_layer": 0,
...                       "source_head": [0, 1], "target_layer": 1, "target_head": 0, "source_type": "O",
...                       "target_type": "K", "pk": [3.0, 5.0], "cs": [0.2, float("nan")]})
>>> heads = pd.DataFrame({"head": ["L0H0", "L0H1", "L1H0"], "layer": [0, 0, 1], "index": [0, 1, 0],
...                       "induction_sig": [False, False, True]})
>>> graph = head_network(select_graph(pairs, heads, SelectionPolicy(top_k=1)))
>>> list(graph.edges(keys=True, data="pk"))
[('L0H1', 'L1H0', 'OK', 5.0)]
>>> graph.nodes["L1H0"]["roles"], graph.nodes["L1H0"]["in_degree"], "cs" in graph.edges["L0H1", "L1H0", "OK"]
(['induction'], 1, False)
"""

from __future__ import annotations

import networkx as nx
from headgraph.analysis.artifacts import records, roles_of
from headgraph.analysis.selection import SelectedGraph

_ENDS = ("source", "target")


def _present(row: dict) -> dict:
    return {k: v for k, v in row.items() if v is not None}


def head_network(selected: SelectedGraph) -> nx.MultiDiGraph:
    """The nodes (with the heads-table columns the selection was given, e.g. roles), centralities and edges of
    `selected` as a MultiDiGraph keyed by edge kind (module docstring)."""
    nodes = selected.nodes.merge(selected.centrality.rename(columns={"name": "head"}), on="head", how="left")
    roles = roles_of(nodes)
    graph = nx.MultiDiGraph()
    for row in records(nodes):
        graph.add_node(row["head"], **_present({k: v for k, v in row.items() if k != "head"}),
                       roles=roles.get(row["head"], []))
    for row in records(selected.edges):
        graph.add_edge(row["source"], row["target"], key=row["kind"],
                       **_present({k: v for k, v in row.items() if k not in _ENDS}))
    return graph
