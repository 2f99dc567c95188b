"""Edge selection: which computed pairs become the edges of the head graph (the thresholded graph).

Pairs must pass `q_model <= max_q`, `z_iso >= min_z` and `effect >= min_effect` (the local causal effect, which
only OQ/OK/OV pairs have) when those are given, then at most `top_k` edges per weight-pair type are kept,
strongest PK first (default 20, the paper's figure). Every edge keeps `rank`: its
PK rank among all computed pairs of its type (1 = strongest). The policy is recorded with the run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pandas as pd

from headgraph.analysis.centrality import head_centrality, hub_report
from headgraph.errors import UsageError

DEFAULT_TOP_K = 20
RANK_COLUMNS = ("source", "target", "source_layer", "target_layer", "source_type", "target_type", "pk")
"""The pairs.parquet columns that ranking needs."""


@dataclass(frozen=True)
class SelectionPolicy:
    """Which computed pairs become edges: thresholds first, then the top_k strongest per type."""

    top_k: int | None = DEFAULT_TOP_K
    max_q: float | None = None
    min_z: float | None = None
    min_effect: float | None = None

    def __post_init__(self):
        if self.top_k is not None and self.top_k < 1:
            raise UsageError(f"top_k must be at least 1, or None for no per-type limit (got {self.top_k})")
        if self.max_q is not None and not 0 < self.max_q <= 1:
            raise UsageError(f"--max-q must lie in (0, 1] (got {self.max_q})")
        for flag, value in (("--min-z", self.min_z), ("--min-effect", self.min_effect)):
            if value is not None and math.isnan(value):  # nothing is >= NaN: it would keep no edge, silently
                raise UsageError(f"{flag} must be a number (got {value})")

    def describe(self) -> str:
        """The policy in words, as run.json records it; `parse` reads it back exactly (a threshold is written
        with 6 significant digits when they hold its value, in full otherwise).

        >>> SelectionPolicy(top_k=5, max_q=0.05).describe()
        'q_model <= 0.05, then top 5 per type by PK'
        >>> SelectionPolicy.parse(SelectionPolicy(None, min_z=3, min_effect=0.123456789).describe())
        SelectionPolicy(top_k=None, max_q=None, min_z=3.0, min_effect=0.123456789)
        """
        rules = [f"{name} {op} {_number(getattr(self, field))}" for field, (name, op) in _RULES.items()
                 if getattr(self, field) is not None]
        rules += [f"top {self.top_k} per type by PK"] if self.top_k is not None else [_ALL]
        return ", then ".join(rules)

    @classmethod
    def parse(cls, text: str) -> SelectionPolicy:
        """The policy `describe` wrote as `text`; other text raises UsageError naming it."""
        *thresholds, last = text.split(", then ")
        values = {}
        for rule in thresholds:
            found = [field for field, (name, op) in _RULES.items() if rule.startswith(f"{name} {op} ")]
            if not found:
                raise UsageError(f"selection {text!r} is not one headgraph writes: no rule {rule!r}")
            values[found[0]] = float(rule.split()[-1])
        top = re.fullmatch(r"top (\d+) per type by PK", last)
        if top is None and last != _ALL:
            raise UsageError(f"selection {text!r} is not one headgraph writes: it ends in {last!r}")
        return cls(top_k=int(top[1]) if top else None, **values)


_RULES = {"max_q": ("q_model", "<="), "min_z": ("z_iso", ">="), "min_effect": ("effect", ">=")}
_ALL = "all passing pairs"


def _number(value: float) -> str:
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


def rank_pairs(pairs: pd.DataFrame) -> pd.DataFrame:
    """Pairs with `kind` (e.g. "OK") and `rank` by PK within the kind (ties by layer/head order)."""
    missing = [c for c in RANK_COLUMNS if c not in pairs.columns]
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
    """The edges of the thresholded graph, each with `kind` and its within-type `rank`.

    `rank` is the PK rank among all computed pairs of the type, before the thresholds: an edge ranked 3 may be
    the first one kept when the two stronger pairs fail `max_q`. Being selected says nothing about causality.

    >>> pairs = pd.DataFrame({"source": ["L0H0", "L0H1", "L0H0"], "target": ["L1H0", "L1H0", "L1H1"],
    ...                       "source_layer": 0, "target_layer": 1, "source_type": "O",
    ...                       "target_type": ["K", "K", "V"], "pk": [3.0, 5.0, 1.0], "q_model": [0.01, 0.2, 0.01]})
    >>> select_edges(pairs, SelectionPolicy(top_k=1))[["kind", "source", "target", "pk", "rank"]]
      kind source target   pk  rank
    0   OK   L0H1   L1H0  5.0     1
    1   OV   L0H0   L1H1  1.0     1
    >>> select_edges(pairs, SelectionPolicy(top_k=1, max_q=0.05))[["kind", "source", "rank"]]
      kind source  rank
    0   OK   L0H0     2
    1   OV   L0H0     1
    """
    ranked = rank_pairs(pairs)
    keep = pd.Series(True, index=ranked.index)
    if policy.max_q is not None:
        keep &= ranked["q_model"] <= policy.max_q
    if policy.min_z is not None:
        keep &= ranked["z_iso"] >= policy.min_z
    if policy.min_effect is not None:
        if "effect" not in ranked.columns:
            raise UsageError("--min-effect needs causal effects, and this run has none: rerun `headgraph analyze` "
                             "without --no-causal")
        keep &= ranked["effect"] >= policy.min_effect
    passing = ranked[keep]
    if policy.top_k is not None:
        passing = passing[passing.groupby("kind").cumcount() < policy.top_k]
    return passing.reset_index(drop=True)


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
    missing = ends[~ends["head"].isin(heads["head"])]
    if missing.empty:  # concatenating nothing would still turn the integer columns (rank_q, ...) into floats
        return heads.reset_index(drop=True)
    return pd.concat([heads, missing], ignore_index=True)


@dataclass(frozen=True)
class SelectedGraph:
    """The thresholded head graph of one run, computed once and handed to the summary, the report and the store.

    edges: rows of `select_edges`; nodes: the heads table plus every pair endpoint (`with_pair_endpoints`);
    centrality: one row per node (headgraph.analysis.centrality.head_centrality) on these edges only;
    hubs: `hub_report` of it. A hub here is a head of high degree in this selection, not a head shown to matter
    for the model's behaviour."""

    policy: SelectionPolicy
    edges: pd.DataFrame
    nodes: pd.DataFrame
    centrality: pd.DataFrame
    hubs: dict


def select_graph(pairs: pd.DataFrame, heads: pd.DataFrame | None, policy: SelectionPolicy) -> SelectedGraph:
    """Select the edges of `pairs` by `policy`, add the nodes, and compute their centrality and hubs."""
    edges = select_edges(pairs, policy)
    nodes = with_pair_endpoints(heads, pairs)
    centrality = head_centrality(edges, nodes["head"].tolist())
    return SelectedGraph(policy, edges, nodes, centrality, hub_report(centrality, edges))
