"""The interactive head graph inside report.html: the selected graph (headgraph.analysis.network.head_network)
drawn with the vendored cytoscape.js on the layer × head grid of the static figure `fig_topk_graph`, in the same
colours. Hover an edge for its PK, q, CS and effects; click a head for its roles, centralities and neighbours;
filter by edge type and PK. The template is interactive.html; the page stays self-contained (the library and
the graph are inlined, nothing is fetched).

What the view does NOT show: pairs outside the selection (a head without edges here may still have strong
pairs below the cut), and any causal claim beyond the effect columns of the run (absent: "—").
"""

import json
import re
from importlib.resources import files

import networkx as nx
import pandas as pd

from headgraph.analysis.artifacts import role_names
from headgraph.analysis.centrality import COUNT_MEASURES, MEASURES
from headgraph.heads import TYPE_PAIRS
from headgraph.report.figures import NODE_COLOR, TYPE_COLORS, class_color, head_classes, head_columns

MAX_EDGES = 5000
"""More selected edges than this and the report leaves the view out (the page would be tens of MB)."""
GRID = 100
"""Model units between grid cells; the view zooms to fit."""

_ASSETS = files("headgraph.report")
LIBRARY = _ASSETS / "vendor" / "cytoscape" / "cytoscape.min.js"


def script_json(value) -> str:
    """Strict JSON that cannot close the <script> element it is written into (<, > and & as \\u escapes, which
    JSON.parse reads back unchanged).

    >>> script_json({"class": "</script><b>&"})
    '{"class": "\\\\u003c/script\\\\u003e\\\\u003cb\\\\u003e\\\\u0026"}'
    """
    text = json.dumps(value, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def view_data(graph: nx.MultiDiGraph, n_layers: int, n_heads: int, n_kv_heads=None, classes=None) -> dict:
    """What the page draws: `graph` as cytoscape elements (networkx.cytoscape_data) with each head at
    (GRID × column, GRID × layer), layer 0 at the top; the edge kinds present in the project's type order with
    their colours; the roles tested and the known classes ({class: [heads]}) with theirs.

    >>> graph = nx.MultiDiGraph()
    >>> graph.add_node("L0H1", layer=0, index=1, induction_sig=False, roles=[])
    >>> graph.add_node("L1H0", layer=1, index=0, induction_sig=True, roles=["induction"])
    >>> graph.add_edge("L0H1", "L1H0", key="OK", pk=5.0, kind="OK")
    'OK'
    >>> data = view_data(graph, n_layers=2, n_heads=2)
    >>> [(n["data"]["id"], n["position"]) for n in data["elements"]["nodes"]]
    [('L0H1', {'x': 100.0, 'y': 0.0}), ('L1H0', {'x': 0.0, 'y': 100.0})]
    >>> data["type_colors"], data["roles"]
    ({'OK': '#ff7f0e'}, ['induction'])
    """
    elements = nx.cytoscape_data(graph)["elements"]
    nodes = elements["nodes"]
    names = pd.Series([n["data"]["id"] for n in nodes], dtype=str)
    columns = head_columns(names, pd.Series([n["data"]["index"] for n in nodes]), n_heads, n_kv_heads)
    for node, column in zip(nodes, columns):
        node["position"] = {"x": GRID * float(column), "y": GRID * float(node["data"]["layer"])}
    kinds = {e["data"]["key"] for e in elements["edges"]}
    attributes = {key for _, node in graph.nodes(data=True) for key in node}
    roles = role_names(pd.DataFrame(columns=sorted(attributes)))
    owner = {head: name for head, name in head_classes(classes).items() if head in graph}
    return {
        "elements": elements, "grid": GRID, "n_layers": n_layers, "n_heads": n_heads,
        "type_colors": {tp: TYPE_COLORS[tp] for tp in TYPE_PAIRS if tp in kinds},
        "roles": roles, "role_colors": {role: class_color(role) for role in roles},
        "class_of": owner, "class_colors": {name: class_color(name) for name in dict.fromkeys(owner.values())},
        "node_color": NODE_COLOR, "measures": list(MEASURES), "count_measures": list(COUNT_MEASURES),
    }


def interactive_graph(graph: nx.MultiDiGraph, n_layers: int, n_heads: int, n_kv_heads=None, classes=None) -> str:
    """The HTML fragment (markup, style, the inlined library and the graph) that report.html embeds; arguments as
    for `view_data`."""
    fills = {"CYTOSCAPE": LIBRARY.read_text(encoding="utf-8"),
             "GRAPH": script_json(view_data(graph, n_layers, n_heads, n_kv_heads, classes))}
    template = (_ASSETS / "interactive.html").read_text(encoding="utf-8")
    return re.sub(r"/\*@(\w+)@\*/", lambda match: fills[match[1]], template)
