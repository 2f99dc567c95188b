"""From what one analysis computed (selected edges, heads, centralities, the run record) to the rows a store
writes: Run and Model properties, Head rows keyed `<run id>/L4H7`, edge rows with their endpoint keys."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence

import pandas as pd

from headgraph.analysis.artifacts import role_names, roles_of
from headgraph.analysis.selection import SelectedGraph, SelectionPolicy
from headgraph.errors import UsageError
from headgraph.loader.store import (
    EDGE_PROPERTIES,
    EXTRA_HEAD_SUFFIXES,
    HEAD_PROPERTIES,
    MODEL_PROPERTIES,
    RunGraph,
    check_run_id,
    extra_head_properties,
)
from headgraph.runs import RunRecord

_ROLE_COLUMN = re.compile(r"^[a-z][a-z0-9_]*(" + "|".join(EXTRA_HEAD_SUFFIXES) + ")$")


def head_rows(
    heads: pd.DataFrame,
    run_id: str,
    model_name: str,
    classes: Mapping[str, Sequence[str]] | None = None,
) -> pd.DataFrame:
    """Head node rows: schema columns plus role result columns (`<role>_score/_p/_sig`) and `roles`, the
    significant roles by name (null when no role was tested); other columns are not stored."""
    tested = role_names(heads)
    significant = roles_of(heads)
    frame = heads.rename(columns={"head": "name", "index": "head"})
    frame = frame[[c for c in frame.columns if c in HEAD_PROPERTIES or _ROLE_COLUMN.match(c)]].copy()
    frame["roles"] = [significant.get(name, []) if tested else None for name in frame["name"]]
    frame["key"] = head_key(run_id, frame["name"].astype(str))
    frame["run_id"] = run_id
    frame["model"] = model_name
    if "classes" not in frame.columns:
        labels = classes or {}
        frame["classes"] = [sorted(labels.get(name, ())) for name in frame["name"]]
    return frame.sort_values(["layer", "head"], kind="stable").reset_index(drop=True)


def edge_rows(edges: pd.DataFrame, run_id: str) -> pd.DataFrame:
    """Edge rows: endpoint keys plus every edge property (absent statistics stay null)."""
    rows = edges.reindex(columns=[*EDGE_PROPERTIES]).assign(run_id=run_id)
    rows.insert(0, "target_key", head_key(run_id, edges["target"].astype(str)))
    rows.insert(0, "source_key", head_key(run_id, edges["source"].astype(str)))
    return rows


def head_key(run_id: str, name):
    """The store-wide unique key of a Head node, `<run id>/L4H7` (`name`: one name or a Series of names)."""
    return run_id + "/" + name


def run_properties(run: RunRecord, policy: SelectionPolicy) -> dict:
    """The Run node's properties for a run record (whose `id` must be set) and the policy that selected its edges;
    the store adds status, counts and writer."""
    if run.id is None:
        raise UsageError("the run record has no id yet: a run is stored once headgraph.workflow has given it one")
    return {
        "id": check_run_id(run.id),
        "model": run.model.name,
        "source": run.model.source,
        "processing": run.processing,
        "types": list(run.types),
        "top_k": policy.top_k,
        "max_q": policy.max_q,
        "min_z": policy.min_z,
        "min_effect": policy.min_effect,
        "policy": policy.describe(),
        "created": run.created,
        "sweep": run.sweep,
        "step": run.step,
        "params": json.dumps(run.to_json(), sort_keys=True),
        **attribution_agreement(run),
    }


def attribution_agreement(run: RunRecord) -> dict:
    """attr_reliable / attr_unreliable: the types whose attribution agrees with the exact loss effects of the
    edges patched exactly (run.json causal.agreement `reliable`, Spearman rho >= 0.8) and those where it does
    not; None (not stored) where there are none, e.g. a run without loss effects."""
    agreement = (run.causal or {}).get("agreement", {})
    found = {"attr_reliable": [kind for kind, a in agreement.items() if a["reliable"]],
             "attr_unreliable": [kind for kind, a in agreement.items() if not a["reliable"]]}
    return {name: sorted(kinds) or None for name, kinds in found.items()}


def model_properties(run: RunRecord) -> dict:
    """The Model node's properties: the model's name, architecture and sizes."""
    info = {"name": run.model.name, "architecture": run.model.architecture, **dataclasses.asdict(run.dims)}
    return {name: info.get(name) for name in MODEL_PROPERTIES}


def build_run_graph(
    selected: SelectedGraph,
    run: RunRecord,
    classes: Mapping[str, Sequence[str]] | None = None,
) -> RunGraph:
    """Shape Run/Model/Head/edge rows for a store from what the analysis computed: the selected graph (edges,
    nodes, centralities) and the run record (whose `id` must be set)."""
    record = run_properties(run, selected.policy)
    run_id = record["id"]
    rows = head_rows(selected.nodes, run_id, run.model.name, classes)
    rows = rows.drop(columns=[c for c in selected.centrality.columns if c != "name" and c in rows.columns])
    rows = rows.merge(selected.centrality, on="name", how="left")
    return RunGraph(record, model_properties(run), rows, edge_rows(selected.edges, run_id),
                    extra_head_properties(rows.columns))
