"""How much a run's graph moves when nothing about the model changes: the same analysis recomputed under
another numeric precision, another rank tolerance, another seed of the null, another draw of the role and
causal inputs (and on CUDA vs CPU where a GPU is present), compared with the run.

Per weight-pair type and variant (`compare_variant`): Spearman's rho of PK and of the local causal effect between
the run and the variant over the same pairs; the Jaccard overlap of the selected edges (the run's policy on both);
how many significance decisions (q_model <= 0.05) flip. Per role: how many heads' decisions flip. The report is
kept in the run folder as stability.json (headgraph.runs). A rho of 1
and no flips say the graph does not depend on that choice; they say nothing about whether it is right.

>>> import pandas as pd
>>> pairs = pd.DataFrame({"source": ["L0H0", "L0H1", "L0H0"], "target": ["L1H0", "L1H0", "L1H1"],
...                       "source_layer": 0, "target_layer": 1, "source_type": "O", "target_type": "K",
...                       "pk": [3.0, 2.0, 1.0], "q_model": [0.01, 0.2, 0.04]})
>>> other = pairs.assign(pk=[3.1, 0.9, 2.0], q_model=[0.01, 0.03, 0.06])
>>> row = compare_variant(pairs, other, None, None, SelectionPolicy(top_k=1)).pairs[0]
>>> row["pk_spearman"], row["jaccard"], row["significance_flips"]
(0.5, 1.0, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from headgraph.analysis.artifacts import PAIR_KEY, SIGNIFICANT_Q, role_names
from headgraph.analysis.selection import SelectionPolicy, select_edges



@dataclass(frozen=True)
class Comparison:
    """One variant against the run: rows per type pair (`pairs`) and per role (`roles`)."""

    pairs: list[dict]
    roles: list[dict]


def spearman(a: pd.Series, b: pd.Series) -> float | None:
    """Spearman's rho of the rows where both are defined; None where it is not (fewer than 3 such rows, or one
    side constant: no ranking to correlate)."""
    both = a.notna() & b.notna()
    if both.sum() < 3 or a[both].nunique() < 2 or b[both].nunique() < 2:
        return None
    return float(stats.spearmanr(a[both], b[both]).statistic)


def compare_variant(pairs: pd.DataFrame, other: pd.DataFrame, heads: pd.DataFrame | None,
                    other_heads: pd.DataFrame | None, policy: SelectionPolicy) -> Comparison:
    """The run's pairs / heads against a variant's (module docstring); pairs are matched on their key."""
    merged = pairs.merge(other, on=PAIR_KEY, suffixes=("", "_other"), validate="one_to_one")
    merged["kind"] = merged["source_type"] + merged["target_type"]
    kept = {name: set(map(tuple, select_edges(frame, policy)[PAIR_KEY].values)) for name, frame in
            (("run", pairs), ("other", other))}
    rows = []
    for kind, part in merged.groupby("kind", sort=True):
        mine = {k for k in kept["run"] if k[2] + k[3] == kind}
        theirs = {k for k in kept["other"] if k[2] + k[3] == kind}
        union = mine | theirs
        row = {"type": kind, "pairs": len(part), "pk_spearman": spearman(part["pk"], part["pk_other"]),
               "effect_spearman": spearman(part["effect"], part["effect_other"]) if "effect" in part and
               "effect_other" in part else None,
               "jaccard": len(mine & theirs) / len(union) if union else None, "edges_only_run": len(mine - theirs),
               "edges_only_variant": len(theirs - mine)}
        if "q_model" in part and "q_model_other" in part:
            significant = part["q_model"] <= SIGNIFICANT_Q, part["q_model_other"] <= SIGNIFICANT_Q
            row["significance_flips"] = int((significant[0] != significant[1]).sum())
        rows.append(row)
    roles = []
    if heads is not None and other_heads is not None:
        both = heads.merge(other_heads, on="head", suffixes=("", "_other"))
        for role in role_names(heads):
            if f"{role}_sig_other" in both:
                mine = both[f"{role}_sig"].fillna(False).astype(bool)
                theirs = both[f"{role}_sig_other"].fillna(False).astype(bool)
                roles.append({"role": role, "significant": int(mine.sum()), "flips": int((mine != theirs).sum()),
                              "flipped": both.loc[mine != theirs, "head"].tolist()})
    return Comparison(rows, roles)


def summary_rows(report: dict) -> pd.DataFrame:
    """One row per variant and type: the table the report and the CLI show."""
    rows = [{"variant": name, **row} for name, entry in report["variants"].items() for row in entry.get("pairs", [])]
    columns = ["variant", "type", "pk_spearman", "effect_spearman", "jaccard", "significance_flips"]
    return pd.DataFrame(rows).reindex(columns=columns) if rows else pd.DataFrame(columns=columns)


def role_flips(report: dict) -> dict[str, int]:
    """{variant: role decisions that flip, all roles}, variants that tested roles only."""
    return {name: int(np.sum([r["flips"] for r in entry["roles"]])) for name, entry in report["variants"].items()
            if entry.get("roles")}
