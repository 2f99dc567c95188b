"""From an analysis run (pairs, heads, run dict) to the rows stored as the head graph.

Edge selection (the thresholded graph): pairs must pass `q_model <= max_q` and `z_iso >= min_z` when those
are given, then at most `top_k` edges per weight-pair type are kept, strongest PK first (default 20, the
paper's figure). Every edge keeps `rank`: its PK rank among all computed pairs of its type (1 = strongest).
The policy is stored on the Run node.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import click
import pandas as pd

from headgraph.analysis.centrality import head_centrality
from headgraph.errors import UsageError
from headgraph.loader.store import (
    DEFAULT_BATCH_SIZE,
    EDGE_PROPERTIES,
    EXTRA_HEAD_SUFFIXES,
    HEAD_PROPERTIES,
    MODEL_PROPERTIES,
    GraphStore,
    check_run_id,
    extra_head_properties,
)

DEFAULT_TOP_K = 20
PAIR_COLUMNS = ("source", "target", "source_layer", "target_layer", "source_type", "target_type", "pk")
_ROLE_COLUMN = re.compile(r"^[a-z][a-z0-9_]*(" + "|".join(EXTRA_HEAD_SUFFIXES) + ")$")


@dataclass(frozen=True)
class SelectionPolicy:
    """Which computed pairs become edges: thresholds first, then the top_k strongest per type."""

    top_k: int | None = DEFAULT_TOP_K
    max_q: float | None = None
    min_z: float | None = None

    def __post_init__(self):
        if self.top_k is not None and self.top_k < 1:
            raise UsageError(f"top_k must be at least 1, or None for no per-type limit (got {self.top_k})")
        if self.max_q is not None and not 0 < self.max_q <= 1:
            raise UsageError(f"--max-q must lie in (0, 1] (got {self.max_q})")

    def describe(self) -> str:
        rules = [f"q_model <= {self.max_q:g}"] if self.max_q is not None else []
        rules += [f"z_iso >= {self.min_z:g}"] if self.min_z is not None else []
        rules += [f"top {self.top_k} per type by PK"] if self.top_k is not None else ["all passing pairs"]
        return ", then ".join(rules)


def rank_pairs(pairs: pd.DataFrame) -> pd.DataFrame:
    """Pairs with `kind` (e.g. "OK") and `rank` by PK within the kind (ties by layer/head order)."""
    missing = [c for c in PAIR_COLUMNS if c not in pairs.columns]
    if missing:
        raise UsageError(f"pairs table lacks columns {', '.join(missing)}; rerun `headgraph analyze`")
    ranked = pairs.assign(kind=pairs["source_type"].astype(str) + pairs["target_type"].astype(str))
    ranked = ranked.sort_values(
        ["kind", "pk", "source_layer", "source", "target_layer", "target"],
        ascending=[True, False, True, True, True, True],
        kind="stable",
    )
    ranked["rank"] = ranked.groupby("kind").cumcount() + 1
    return ranked.reset_index(drop=True)


def select_edges(pairs: pd.DataFrame, policy: SelectionPolicy) -> pd.DataFrame:
    """The edges of the thresholded graph, each with `kind` and its within-type `rank`."""
    ranked = rank_pairs(pairs)
    keep = pd.Series(True, index=ranked.index)
    if policy.max_q is not None:
        keep &= ranked["q_model"] <= policy.max_q
    if policy.min_z is not None:
        keep &= ranked["z_iso"] >= policy.min_z
    passing = ranked[keep]
    if policy.top_k is not None:
        passing = passing[passing.groupby("kind").cumcount() < policy.top_k]
    return passing.reset_index(drop=True)


@dataclass
class RunGraph:
    """Everything stored for one run: Run and Model properties, Head rows and edge rows."""

    run: dict[str, Any]
    model: dict[str, Any]
    heads: pd.DataFrame
    edges: pd.DataFrame
    extra_head_properties: dict[str, str] = field(default_factory=dict)


def _model_record(run: Mapping[str, Any]) -> dict[str, Any]:
    model = run.get("model")
    info = dict(model) if isinstance(model, Mapping) else {"name": model}
    info.update({k: v for k, v in dict(run.get("cfg") or run.get("dims") or {}).items() if k not in info})
    if not info.get("name"):
        raise UsageError("the run record names no model; rerun `headgraph analyze`")
    return {name: info.get(name) for name in MODEL_PROPERTIES}


def _model_source(run: Mapping[str, Any]) -> str | None:
    model = run.get("model")
    return model.get("source") if isinstance(model, Mapping) else None


def _run_id(run: Mapping[str, Any], model_name: str) -> str:
    given = run.get("id") or run.get("run_id")
    if given:
        return check_run_id(str(given))
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip("-") or "run"
    return f"{slug}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{secrets.token_hex(2)}"


def class_labels(head_classes) -> dict[str, list[str]]:
    """{head: its class names} from a `headgraph.analysis.classes.HeadClasses`, for `classes=` below."""
    return {head: head_classes.classes_of(head) for head in head_classes.heads}


def with_pair_endpoints(heads: pd.DataFrame | None, pairs: pd.DataFrame) -> pd.DataFrame:
    """The heads table plus every pair endpoint it lacks (e.g. the native KV heads `L3KV1` of a
    grouped-query model), so that every edge has both of its Head nodes."""
    ends = pd.concat(
        [
            pairs[["source", "source_layer", "source_head"]].set_axis(["head", "layer", "index"], axis=1),
            pairs[["target", "target_layer", "target_head"]].set_axis(["head", "layer", "index"], axis=1),
        ],
        ignore_index=True,
    ).drop_duplicates("head")
    if heads is None or not len(heads):
        return ends.reset_index(drop=True)
    return pd.concat([heads, ends[~ends["head"].isin(heads["head"])]], ignore_index=True)


def head_rows(
    heads: pd.DataFrame,
    run_id: str,
    model_name: str,
    classes: Mapping[str, Sequence[str]] | None = None,
) -> pd.DataFrame:
    """Head node rows: schema columns plus role result columns (`<role>_score/_p/_sig`); others are not stored."""
    frame = heads.rename(columns={"head": "name", "index": "head"})
    frame = frame[[c for c in frame.columns if c in HEAD_PROPERTIES or _ROLE_COLUMN.match(c)]].copy()
    frame["key"] = run_id + "/" + frame["name"].astype(str)
    frame["run_id"] = run_id
    frame["model"] = model_name
    if "classes" not in frame.columns:
        labels = classes or {}
        frame["classes"] = [sorted(labels.get(name, ())) for name in frame["name"]]
    return frame.sort_values(["layer", "head"], kind="stable").reset_index(drop=True)


def edge_rows(edges: pd.DataFrame, run_id: str) -> pd.DataFrame:
    """Edge rows: endpoint keys plus every edge property (absent statistics stay null)."""
    rows = edges.reindex(columns=[*EDGE_PROPERTIES]).assign(run_id=run_id)
    rows.insert(0, "target_key", run_id + "/" + edges["target"].astype(str))
    rows.insert(0, "source_key", run_id + "/" + edges["source"].astype(str))
    return rows


def build_run_graph(
    pairs: pd.DataFrame,
    heads: pd.DataFrame | None,
    run: Mapping[str, Any],
    policy: SelectionPolicy = SelectionPolicy(),
    classes: Mapping[str, Sequence[str]] | None = None,
    centrality: pd.DataFrame | None = None,
) -> RunGraph:
    """Select the edges, compute centrality on them (unless given, computed on the same selection), and shape
    Run/Model/Head/edge rows for a store."""
    model = _model_record(run)
    run_id = _run_id(run, model["name"])
    edges = select_edges(pairs, policy)
    rows = head_rows(with_pair_endpoints(heads, pairs), run_id, model["name"], classes)
    if centrality is None:
        centrality = head_centrality(edges, rows["name"].tolist())
    rows = rows.drop(columns=[c for c in centrality.columns if c != "name" and c in rows.columns])
    rows = rows.merge(centrality, on="name", how="left")
    kinds = sorted(set(pairs["source_type"].astype(str) + pairs["target_type"].astype(str)))
    record = {
        "id": run_id,
        "model": model["name"],
        "source": str(run.get("source") or _model_source(run) or model["name"]),
        "processing": run.get("processing"),
        "types": list(run.get("types") or kinds),
        "top_k": policy.top_k,
        "max_q": policy.max_q,
        "min_z": policy.min_z,
        "policy": policy.describe(),
        "created": str(run.get("created") or datetime.now(timezone.utc).isoformat(timespec="seconds")),
        "params": json.dumps(dict(run), sort_keys=True, default=str),
    }
    return RunGraph(record, model, rows, edge_rows(edges, run_id), extra_head_properties(rows.columns))


def store_run(
    store: GraphStore,
    pairs: pd.DataFrame,
    heads: pd.DataFrame | None,
    run: Mapping[str, Any],
    policy: SelectionPolicy = SelectionPolicy(),
    classes: Mapping[str, Sequence[str]] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = True,
    centrality: pd.DataFrame | None = None,
) -> RunGraph:
    """Build the run's graph and load it into `store` (replacing an earlier copy of the same run id)."""
    graph = build_run_graph(pairs, heads, run, policy, classes, centrality)
    store.load_run(graph, batch_size=batch_size, progress=progress)
    return graph


def selection_options(command: Callable) -> Callable:
    """Click options --top-k / --max-q / --min-z, passed to the command as one `policy: SelectionPolicy`."""

    @click.option("--min-z", type=float, default=None, metavar="Z", help="Keep edges with isotropic z >= Z.")
    @click.option("--max-q", type=float, default=None, metavar="Q", help="Keep edges with calibrated q_model <= Q (BH).")
    @click.option(
        "--top-k", type=click.IntRange(min=0), default=DEFAULT_TOP_K, show_default=True, metavar="N",
        help="Keep the N strongest edges per weight-pair type (0: no per-type limit).",
    )
    @functools.wraps(command)
    def wrapper(*args, top_k, max_q, min_z, **kwargs):
        return command(*args, policy=SelectionPolicy(top_k or None, max_q, min_z), **kwargs)

    return wrapper
