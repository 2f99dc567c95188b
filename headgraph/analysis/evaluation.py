"""PK and Composition Score judged against known head classes and against causal effects.

Against known classes, two statistics per metric (a column of pairs.parquet, e.g. `pk` or `cs`):
- the PK paper's Figure-1 count: take the top-k pairs of each composition type (OQ, OK, OV) by the metric,
  and count the distinct heads of that union graph that are in a known class ("in-class") and not;
- ROC-AUC and PR-AUC (average precision) of the metric at separating pairs whose source and target heads are
  both in known classes from all other pairs, per type and pooled over the types.

Against causal effects (`causal_evaluation`, runs analysed with them), per type: Spearman's rho between the
metric and the local effect with a bootstrap interval, ROC-AUC and PR-AUC of the metric at finding the causal
pairs, and the precision of its top-k pairs. A pair is *causal* when the lower end of its local effect's 95 %
interval exceeds the threshold (`CAUSAL_DEFINITION`): a statement about these inputs and this ablation, not
about the model on all inputs. The rho interval resamples pairs as if independent; pairs share heads, so the
interval is narrower than a resampling of heads would give.
"""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pandas as pd
from scipy import stats

from headgraph.analysis.bootstrap import draw_counts, percentile_interval
from headgraph.analysis.classes import HeadClasses
from headgraph.analysis.options import DEFAULT_N_BOOT
from headgraph.errors import UsageError
from headgraph.heads import COMPOSITION_TYPES

DEFAULT_EVAL_K = 20  # edges per type of precision@k, when the graph's selection has no top_k
DRAWN_AT_ONCE = 2**22  # draws of spearman_intervals' resamples at once (each block's arrays: 32 MB of floats)


def typed_pairs(pairs: pd.DataFrame, types=COMPOSITION_TYPES) -> pd.DataFrame:
    """The pairs of the given types, with a `type` column (source type + target type)."""
    typed = pairs.assign(type=pairs["source_type"] + pairs["target_type"])
    typed = typed[typed["type"].isin(types)]
    if typed.empty:
        raise UsageError(f"no pairs of type {', '.join(types)} in this run: rerun analyze with those types")
    return typed


def top_k_edges(pairs: pd.DataFrame, metric: str, k: int = DEFAULT_EVAL_K, types=COMPOSITION_TYPES) -> pd.DataFrame:
    """The k highest-`metric` pairs of each type (pairs where the metric is undefined are skipped)."""
    typed = typed_pairs(pairs, types).dropna(subset=[metric])
    return typed.sort_values(metric, ascending=False, kind="stable").groupby("type").head(k)


def union_heads(edges: pd.DataFrame) -> set[str]:
    """Distinct heads incident to any of the edges."""
    return set(edges["source"]) | set(edges["target"])


def in_class_counts(pairs: pd.DataFrame, classes: HeadClasses, metric: str, k: int = DEFAULT_EVAL_K,
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


def evaluate_pairs(pairs: pd.DataFrame, classes: HeadClasses, k: int = DEFAULT_EVAL_K, types=COMPOSITION_TYPES,
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


CAUSAL_THRESHOLD = 0.05
CAUSAL_DEFINITION = ("causal pair: the lower end of the local effect's 95% interval exceeds {threshold:g} "
                     "(Q/K: attention moved, total variation; V: relative change of the output)")


def causal_pairs(pairs: pd.DataFrame, threshold: float = CAUSAL_THRESHOLD) -> np.ndarray:
    """bool per pair: its local effect is above `threshold` with 95 % confidence (effect_lo > threshold)."""
    return (pairs["effect_lo"] > threshold).to_numpy()


class _Ranking(NamedTuple):
    """How the items of one array rank within any resample, found once for all of them: the order that sorts the
    values (stable), each item's place in it, and the places of tied values (None: no ties) with the first and
    last place of each one's group of ties."""

    order: np.ndarray
    place: np.ndarray
    tied: tuple[np.ndarray, np.ndarray, np.ndarray] | None


def _ranking(values: np.ndarray) -> _Ranking:
    order = np.argsort(values, kind="stable")
    place = np.empty(len(values), dtype=np.intp)
    place[order] = np.arange(len(values))
    _, starts, sizes = np.unique(values[order], return_index=True, return_counts=True)
    if len(starts) == len(values):
        return _Ranking(order, place, None)
    first, last = np.repeat(starts, sizes), np.repeat(starts + sizes - 1, sizes)  # per place, its group's
    tied = np.flatnonzero(first != last)
    return _Ranking(order, place, (tied, first[tied], last[tied]))


def _resampled_ranks(ranking: _Ranking, counts: np.ndarray, work: Sequence[np.ndarray] | None = None,
                     ) -> np.ndarray:
    """Average ranks [B, n] of each item within each resample given by `counts` [B, n] (copies of item i in
    resample b), `ranking` that of the items' values (`_ranking`): the copies of a value share rank (copies
    below it) + (its copies + 1) / 2, ties of the original values included (their group's copies averaged,
    only at the tied places); exactly scipy's average ranks of the resampled values, in O(n) per resample.

    A resample is a row, so that the running sum of copies runs along contiguous memory (axis 0 of [n, B] took
    2.5 times as long on [236,544, 17] blocks). `work`: two contiguous float arrays shaped like `counts` to
    compute in (the result is one of them); without it they are allocated. Arrays this large are fresh pages on
    every allocation, whose first touch costs more than the arithmetic, hence reusable buffers; `np.take` writes
    into them with mode="clip" (the indices are permutations, always in range), as its default mode copies
    through a temporary.
    """
    work = work if work is not None else (np.empty_like(counts, dtype=float), np.empty_like(counts, dtype=float))
    copies = np.take(counts, ranking.order, axis=1, out=work[1], mode="clip")  # in value order
    upto = np.cumsum(copies, axis=1, out=work[0])  # copies at or below each place
    if ranking.tied is not None:  # a group of ties: its copies below, plus the mean of 1 .. its own copies
        tied, first, last = ranking.tied
        below = np.take(upto, np.maximum(first - 1, 0), axis=1) * (first > 0)
        shared = (np.take(upto, last, axis=1) + below + 1) * 0.5
    copies -= 1
    copies *= -0.5
    copies += upto  # the average rank of a value's copies
    if ranking.tied is not None:
        copies[:, tied] = shared
    return np.take(copies, ranking.place, axis=1, out=work[0], mode="clip")


def spearman_intervals(xs, y: np.ndarray, n_boot: int = DEFAULT_N_BOOT, seed: int = 0,
                       confidence: float = 0.95) -> list[tuple[float, float, float]]:
    """Spearman's rho of each x in `xs` with y and its percentile bootstrap interval over pairs, every x on the
    same resamples (and y ranked once in each): a resample's rho is the count-weighted Pearson correlation of the
    resample's own average ranks (`_resampled_ranks`). The ranks of n draws always average (n + 1) / 2, so they
    are centred on that. Resamples are drawn in blocks of max(1, DRAWN_AT_ONCE // n), block after block from
    `np.random.default_rng(seed)` as `integers(0, n, size=(block, n))` (one block, all n_boot resamples, up to
    DRAWN_AT_ONCE draws), so that a million pairs take a few hundred MB, not n x n_boot floats several times.

    >>> x = np.arange(50.0)
    >>> [tuple(round(v, 9) for v in r) for r in spearman_intervals([x, -x], x ** 3)]  # monotone: every resample
    [(1.0, 1.0, 1.0), (-1.0, -1.0, -1.0)]
    """
    y = np.asarray(y, float)
    xs = [np.asarray(x, float) for x in xs]
    n = len(y)
    if n < 3:
        return [(float("nan"),) * 3 for _ in xs]
    rng, block, centre = np.random.default_rng(seed), max(1, DRAWN_AT_ONCE // n), (n + 1) / 2
    y_ranking, x_rankings = _ranking(y), [_ranking(x) for x in xs]
    boots, buffers = [[] for _ in xs], [np.empty(min(block, n_boot) * n) for _ in range(3)]
    for start in range(0, n_boot, block):
        counts = draw_counts(rng, n, min(block, n_boot - start), by_resample=True)  # copies per pair per resample
        *work, ry = (buffer[:counts.size].reshape(counts.shape) for buffer in buffers)
        np.subtract(_resampled_ranks(y_ranking, counts, work), centre, out=ry)
        syy = np.einsum("bi,bi,bi->b", counts, ry, ry)
        for ranking, boot in zip(x_rankings, boots):
            rx = _resampled_ranks(ranking, counts, work)
            rx -= centre
            sxy = np.einsum("bi,bi,bi->b", counts, rx, ry)
            sxx = np.einsum("bi,bi,bi->b", counts, rx, rx)
            with np.errstate(invalid="ignore", divide="ignore"):
                boot.append(sxy / np.sqrt(sxx * syy))
    results = []
    for x, boot in zip(xs, boots):
        boot = np.concatenate(boot)
        finite = boot[np.isfinite(boot)]
        lo, hi = percentile_interval(finite, confidence) if len(finite) else (np.nan, np.nan)
        results.append((float(stats.spearmanr(x, y).statistic), float(lo), float(hi)))
    return results


def causal_evaluation(pairs: pd.DataFrame, threshold: float = CAUSAL_THRESHOLD, k: int = DEFAULT_EVAL_K, n_boot: int = DEFAULT_N_BOOT,
                      seed: int = 0, metrics=("pk", "cs")) -> pd.DataFrame:
    """One row per metric and type (OQ, OK, OV): pairs, causal pairs, Spearman rho(metric, effect) with its
    interval, ROC-AUC / PR-AUC at finding the causal pairs, precision of the top-k pairs by the metric and of
    its top-c pairs, c the number of causal pairs (R-precision), and the base rate (the precision a random
    ranking expects). Pairs without an effect or a metric value are
    left out; a run without effects raises UsageError."""
    if "effect" not in pairs.columns or pairs["effect"].isna().all():
        raise UsageError("this run has no causal effects: rerun `headgraph analyze` without --no-causal")
    typed = typed_pairs(pairs.dropna(subset=["effect"]), COMPOSITION_TYPES)
    rows = {}
    for scope in COMPOSITION_TYPES:
        of_type = typed[typed["type"] == scope]
        defined = {metric: of_type[metric].notna().to_numpy() for metric in metrics}
        for key in dict.fromkeys(mask.tobytes() for mask in defined.values()):  # metrics on the same pairs
            group = [metric for metric in metrics if defined[metric].tobytes() == key]
            part = of_type[defined[group[0]]]
            if part.empty:
                continue
            labels = causal_pairs(part, threshold)
            rhos = spearman_intervals([part[m].to_numpy() for m in group], part["effect"].to_numpy(), n_boot, seed)
            for metric, (rho, lo, hi) in zip(group, rhos):
                ranked = part.sort_values(metric, ascending=False, kind="stable")
                top = ranked.head(k)
                rows[metric, scope] = {
                    "metric": metric, "scope": scope, "pairs": len(part), "causal": int(labels.sum()),
                    "spearman": rho, "spearman_lo": lo, "spearman_hi": hi,
                    "roc_auc": roc_auc(part[metric].to_numpy(), labels),
                    "pr_auc": average_precision(part[metric].to_numpy(), labels),
                    "precision_at_k": float(causal_pairs(top, threshold).mean()), "k": len(top),
                    "r_precision": float(causal_pairs(ranked.head(labels.sum()), threshold).mean())
                    if labels.any() else float("nan"),
                    "base_rate": float(labels.mean())}
    rows = [rows[key] for key in sorted(rows, key=lambda key: (metrics.index(key[0]), COMPOSITION_TYPES.index(key[1])))]
    return pd.DataFrame(rows)
