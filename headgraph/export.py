"""`headgraph export`: a run's selected head graph as files that other tools read, in five formats.

Every format is written from one graph, `headgraph.analysis.network.head_network` of the run's selection
(nodes: heads with the heads-table columns, `roles` and the centralities; edges keyed by their kind with every
pairs column; an attribute that was not computed is absent, never NaN), so all of them carry the same nodes,
edges and attributes:

- `graphml`, `gexf` (one file each): networkx's writers. Neither format has lists, so a list attribute (`roles`)
  is written as one ";"-joined string ("" for a head without roles); booleans, integers, floats and strings keep
  their types. The edge key (the kind, e.g. "OK") is GraphML's edge id and GEXF's `key` attribute; reading GEXF
  back adds a node `label` and an edge `id`, which are the format's, not headgraph's.
- `cytoscape` (one file): Cytoscape.js JSON from `networkx.cytoscape_data` (`elements.nodes[].data` with `id`,
  `elements.edges[].data` with `source`, `target` and `key`); lists stay lists.
- `csv` (a folder): nodes.csv (`head`, then the attributes) and edges.csv (`source`, `target`, `kind`, then the
  other attributes); lists ";"-joined, booleans `true` / `false`, an empty cell where the attribute is absent.
- `neo4j-import` (a folder): CSVs with typed headers (`key:ID(Head)`, `layer:long`, `pk:double`, `roles:string[]`,
  `:LABEL`, `:START_ID(Head)`, `:END_ID(Head)`, `:TYPE`, ...) for `neo4j-admin database import full`
  (`neo4j_import_arguments`), which build the graph model that `headgraph analyze --neo4j` stores: a `Model`,
  a complete `Run` -[:OF_MODEL]-> it, `Head:Layer<l>` nodes keyed `<run id>/L4H7` with `name`, `head` (the index),
  `run_id` and `model`, and one relationship per edge whose type is its kind, carrying `run_id`, `source` and
  `target`; so `headgraph query` and every named query run on the imported database. Heads and edges carry
  every attribute of the graph (as the store does, `roles` included), but no known-class labels
  (`classes`, which `analyze` stores from its --classes). An integer is written as `long`, as the Bolt driver
  stores it; an empty cell is no value, so a head without roles has no `roles` property there.

A file format writes PATH itself; a folder format creates the folder and replaces its files of the same names.
An export is a view of the run's selection, not a new analysis: an edge is a PK link that passed the policy.
"""

from __future__ import annotations

import csv
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import networkx as nx

from headgraph.analysis.network import head_network
from headgraph.analysis.selection import SelectionPolicy, select_graph
from headgraph.errors import UsageError, check_choice
from headgraph.files import writable_folder
from headgraph.loader.graph import head_key, model_properties, run_properties
from headgraph.runs import RunFolder

FileFormat = Literal["graphml", "gexf", "cytoscape"]
FolderFormat = Literal["csv", "neo4j-import"]
ExportFormat = Literal[FileFormat, FolderFormat]
LIST_SEPARATOR = ";"
"""Joins list values in GraphML, GEXF and CSV; also neo4j-admin's default --array-delimiter."""
NEO4J_FILES = {"model.csv": "nodes", "run.csv": "nodes", "heads.csv": "nodes", "of_model.csv": "relationships",
               "edges.csv": "relationships"}
_NEO4J_TYPES = {bool: "boolean", int: "long", float: "double", str: "string", list: "string[]"}


@dataclass(frozen=True)
class Exported:
    """What `export_run` wrote: the files, and for neo4j-import the neo4j-admin command that imports them."""

    paths: tuple[Path, ...]
    command: str | None = None


def scalar_lists(graph: nx.MultiDiGraph) -> nx.MultiDiGraph:
    """A copy of `graph` whose list attributes are ";"-joined strings (for formats without lists).

    >>> graph = nx.MultiDiGraph()
    >>> graph.add_node("L1H0", roles=["induction", "previous_token"], layer=1)
    >>> scalar_lists(graph).nodes["L1H0"]
    {'roles': 'induction;previous_token', 'layer': 1}
    """
    flat = graph.copy()
    for data in [*(d for _, d in flat.nodes(data=True)), *(d for *_, d in flat.edges(keys=True, data=True))]:
        data.update({k: LIST_SEPARATOR.join(map(str, v)) for k, v in data.items() if isinstance(v, list)})
    return flat


def neo4j_import_arguments(folder, database: str = "neo4j") -> list[str]:
    """The arguments of `neo4j-admin` that import a neo4j-import export in `folder` into `database`, which must
    be stopped and empty or absent (add --overwrite-destination=true to replace an existing one).

    The database comes first: --nodes and --relationships take several files each and would swallow it.

    >>> " ".join(neo4j_import_arguments("/tmp/g"))  # doctest: +ELLIPSIS
    'database import full neo4j --nodes=/tmp/g/model.csv --nodes=/tmp/g/run.csv ... --relationships=/tmp/g/edges.csv'
    """
    folder = Path(folder).absolute()
    return ["database", "import", "full", database,
            *(f"--{kind}={folder / name}" for name, kind in NEO4J_FILES.items())]


def export_run(run: RunFolder, policy: SelectionPolicy, fmt: ExportFormat, out) -> Exported:
    """Select `run`'s graph by `policy` and write it to `out` in format `fmt` (module docstring)."""
    check_choice(fmt, ExportFormat, "export format")
    out = _prepared(Path(out), folder=fmt in get_args(FolderFormat))
    graph = head_network(select_graph(run.pairs, run.heads, policy))
    if fmt == "graphml":
        nx.write_graphml(scalar_lists(graph), out)
    elif fmt == "gexf":
        nx.write_gexf(scalar_lists(graph), out)
    elif fmt == "cytoscape":
        out.write_text(json.dumps(nx.cytoscape_data(graph), indent=1, allow_nan=False))
    elif fmt == "csv":
        return Exported((_write_csv(out / "nodes.csv", [{"head": n, **d} for n, d in graph.nodes(data=True)]),
                         _write_csv(out / "edges.csv", [{"source": u, "target": v, "kind": k, **d}
                                                        for u, v, k, d in graph.edges(keys=True, data=True)])))
    else:
        return _write_neo4j_import(graph, run, policy, out)
    return Exported((out,))


def _prepared(out: Path, folder: bool) -> Path:
    """`out`, with its folder (or its parent folder) created; one-line UsageError when it cannot be written."""
    target = out if folder else out.parent
    if folder and out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; this format writes a folder: choose a folder path")
    if not folder and out.is_dir():
        raise UsageError(f"--out {out} is a folder; this format writes one file: name the file")
    if writable_folder(target) is None:
        raise UsageError(f"cannot write --out {out}: no file can be created there; choose another path")
    target.mkdir(parents=True, exist_ok=True)
    return out


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return LIST_SEPARATOR.join(map(str, value))
    return str(value)  # floats: the shortest text that reads back as the same float


def _columns(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for row in rows for k in row))


def _write_csv(path: Path, rows: list[dict], header: dict[str, str] | None = None) -> Path:
    """Write the `header` columns of `rows` under the header's names (default: every key, as named)."""
    header = header or {c: c for c in _columns(rows)}
    with open(path, "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(header.values())
        writer.writerows([[_cell(row.get(c)) for c in header] for row in rows])
    return path


def _neo4j_header(rows: list[dict], fixed: dict[str, str]) -> dict[str, str]:
    """`name:type` for every property column that has a value (integers become double in a column that also
    holds floats); the `fixed` columns (ids, label, type) keep the names given."""
    header = dict(fixed)
    for column in _columns(rows):
        kinds = {type(row[column]) for row in rows if row.get(column) is not None}
        if column in fixed or not kinds:
            continue
        (kind,) = kinds - {int} if kinds == {int, float} else kinds  # one type per column: pandas columns
        header[column] = f"{column}:{_NEO4J_TYPES[kind]}"
    return header


def _write_neo4j_import(graph: nx.MultiDiGraph, run: RunFolder, policy: SelectionPolicy, folder: Path) -> Exported:
    record = run_properties(run.record, policy) | {"status": "complete", "n_heads": graph.number_of_nodes(),
                                                   "n_edges": graph.number_of_edges()}
    model = model_properties(run.record)
    run_id, model_name = record["id"], model["name"]
    heads = [{"key": head_key(run_id, n), ":LABEL": f"Head;Layer{d['layer']}", "name": n,
              **{("head" if k == "index" else k): v for k, v in d.items()}, "run_id": run_id, "model": model_name}
             for n, d in graph.nodes(data=True)]
    edges = [{":START_ID": head_key(run_id, u), ":END_ID": head_key(run_id, v), ":TYPE": kind, "source": u,
              "target": v, **d, "run_id": run_id} for u, v, kind, d in graph.edges(keys=True, data=True)]
    tables = {
        "model.csv": ([model | {":LABEL": "Model"}], {"name": "name:ID(Model)", ":LABEL": ":LABEL"}),
        "run.csv": ([record | {":LABEL": "Run"}], {"id": "id:ID(Run)", ":LABEL": ":LABEL"}),
        "heads.csv": (heads, {"key": "key:ID(Head)", ":LABEL": ":LABEL"}),
        "of_model.csv": ([{":START_ID": run_id, ":END_ID": model_name, ":TYPE": "OF_MODEL"}],
                         {":START_ID": ":START_ID(Run)", ":END_ID": ":END_ID(Model)", ":TYPE": ":TYPE"}),
        "edges.csv": (edges, {":START_ID": ":START_ID(Head)", ":END_ID": ":END_ID(Head)", ":TYPE": ":TYPE"}),
    }
    paths = tuple(_write_csv(folder / name, rows, _neo4j_header(rows, fixed)) for name, (rows, fixed) in tables.items())
    return Exported(paths, "neo4j-admin " + shlex.join(neo4j_import_arguments(folder)))
