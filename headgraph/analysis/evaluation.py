"""PK and Composition Score judged against known head classes.

Two statistics per metric (a column of pairs.parquet, e.g. `pk` or `cs`):
- the PK paper's Figure-1 count: take the top-k pairs of each composition type (OQ, OK, OV) by the metric,
  and count the distinct heads of that union graph that are in a known class ("in-class") and not;
- ROC-AUC and PR-AUC (average precision) of the metric at separating pairs whose source and target heads are
  both in known classes from all other pairs, per type and pooled over the types.
"""

import numpy as np
import pandas as pd
from scipy import stats

from headgraph.analysis.classes import HeadClasses
from headgraph.errors import UsageError
from headgraph.heads import COMPOSITION_TYPES

PAIR_KEYS = ("source", "target", "source_type", "target_type")  # the pairs.parquet columns evaluated on


def typed_pairs(pairs: pd.DataFrame, types=COMPOSITION_TYPES) -> pd.DataFrame:
    """The pairs of the given types, with a `type` column (source type + target type)."""
    typed = pairs.assign(type=pairs["source_type"] + pairs["target_type"])
    typed = typed[typed["type"].isin(types)]
    if typed.empty:
        raise UsageError(f"no pairs of type {', '.join(types)} in this run: rerun analyze with those types")
    return typed


def top_k_edges(pairs: pd.DataFrame, metric: str, k: int = 20, types=COMPOSITION_TYPES) -> pd.DataFrame:
    """The k highest-`metric` pairs of each type (pairs where the metric is undefined are skipped)."""
    typed = typed_pairs(pairs, types).dropna(subset=[metric])
    return typed.sort_values(metric, ascending=False, kind="stable").groupby("type").head(k)


def union_heads(edges: pd.DataFrame) -> set[str]:
    """Distinct heads incident to any of the edges."""
    return set(edges["source"]) | set(edges["target"])


def in_class_counts(pairs: pd.DataFrame, classes: HeadClasses, metric: str, k: int = 20,
                    types=COMPOSITION_TYPES) -> dict[str, int]:
    """In-class and out-of-class head counts of the top-k union graph (the PK paper's Figure 1 statistic)."""
    heads = union_heads(top_k_edges(pairs, metric, k, types))
    inside = len(heads & classes.heads)
    return {"in_class": inside, "out_of_class": len(heads) - inside}


def both_in_class(pairs: pd.DataFrame, classes: HeadClasses) -> np.ndarray:
    """bool per pair: source and target are both in known classes."""
    known = list(classes.heads)
    return (pairs["source"].isin(known) & pairs["target"].isin(known)).to_numpy()


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half); NaN without both classes."""
    labels = np.asarray(labels, dtype=bool)
    n_pos, n_neg = labels.sum(), (~labels).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = stats.rankdata(scores)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the precision-recall curve as average precision (step-wise, ties as one threshold)."""
    labels = np.asarray(labels, dtype=bool)
    if labels.sum() == 0:
        return float("nan")
    order = np.argsort(-np.asarray(scores), kind="stable")
    s, y = np.asarray(scores)[order], labels[order]
    last_of_tie = np.r_[s[1:] != s[:-1], True]
    tp = np.cumsum(y)[last_of_tie]
    fp = np.cumsum(~y)[last_of_tie]
    recall = tp / labels.sum()
    precision = tp / (tp + fp)
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def evaluate_pairs(pairs: pd.DataFrame, classes: HeadClasses, k: int = 20, types=COMPOSITION_TYPES,
                   metrics=("pk", "cs")) -> pd.DataFrame:
    """One row per metric and scope (each type, then `all` pooled): pairs, positives, in/out-of-class, AUCs.

    Metrics absent from the pairs or undefined for every pair of the types are skipped.
    """
    typed = typed_pairs(pairs, types)
    rows = []
    for metric in metrics:
        if metric not in typed.columns or typed[metric].isna().all():
            continue
        for scope in (*types, "all"):
            part = typed if scope == "all" else typed[typed["type"] == scope]
            part = part.dropna(subset=[metric])
            scope_types = types if scope == "all" else (scope,)
            labels = both_in_class(part, classes)
            counts = in_class_counts(part, classes, metric, k, scope_types) if len(part) else {
                "in_class": 0, "out_of_class": 0}
            rows.append({"metric": metric, "scope": scope, "pairs": len(part), "positives": int(labels.sum()),
                         **counts, "roc_auc": roc_auc(part[metric].to_numpy(), labels),
                         "pr_auc": average_precision(part[metric].to_numpy(), labels),
                         "positive_rate": float(labels.mean()) if len(part) else float("nan")})
    if not rows:
        raise UsageError(f"none of the metrics {', '.join(metrics)} has values for types {', '.join(types)}")
    return pd.DataFrame(rows)
