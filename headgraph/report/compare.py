"""Compare two runs of one architecture (e.g. a base and a fine-tuned checkpoint).

Edges: the selected graph of each run (same selection policy) gives edges that appear (selected in B
only) or vanish (A only); every pair computed in both runs gets ΔPK = PK_B − PK_A, also in units of
the isotropic reference sd of its type (`delta_sd`), and the pairs with the largest |delta_sd| are
listed as changes even when their selection did not flip. Rows are sorted by |delta_sd|, largest first.
Roles: heads whose significance for a role flips between the runs, sorted by the change in log10 p.
"""

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from headgraph.analysis.artifacts import records, role_names
from headgraph.analysis.selection import SelectionPolicy, rank_pairs, select_edges
from headgraph.errors import UsageError

ARCH_KEYS = ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head")
EDGE_KEYS = ["source", "target", "kind"]
LOG10_P_FLOOR = -300.0


@dataclass
class Comparison:
    """The differences between run A and run B."""

    run_a: str
    run_b: str
    policy: SelectionPolicy
    edges: pd.DataFrame
    roles: pd.DataFrame
    notes: list[str] = field(default_factory=list)


def check_same_architecture(run_a, run_b):
    """Raise UsageError unless both runs have the same dims."""
    dims_a = {k: getattr(run_a.record.dims, k) for k in ARCH_KEYS}
    dims_b = {k: getattr(run_b.record.dims, k) for k in ARCH_KEYS}
    differing = [f"{k} {dims_a[k]} vs {dims_b[k]}" for k in ARCH_KEYS if dims_a[k] != dims_b[k]]
    if differing:
        raise UsageError(f"runs have different architectures ({'; '.join(differing)}); "
                         "compare needs two runs of one architecture")


def _reference_sd(run):
    return {tp: float(np.sqrt(ref["var"])) for tp, ref in run.record.reference_by_type.items()}


def edge_changes(pairs_a, pairs_b, reference_sd, policy=SelectionPolicy(), changed=10):
    """Edges that appear, vanish, or change most between two pairs tables of the same heads.

    reference_sd: {kind: sd of PK under the isotropic reference}. Returns one row per edge with
    status, pk_a, pk_b, delta_pk, delta_sd, rank_a, rank_b (within-type PK rank among all computed
    pairs), q_model_a, q_model_b, sorted by |delta_sd| (largest first).
    """
    columns = EDGE_KEYS + ["pk", "rank", "q_model", "z_iso"]
    ranked_a, ranked_b = rank_pairs(pairs_a)[columns], rank_pairs(pairs_b)[columns]
    both = ranked_a.merge(ranked_b, on=EDGE_KEYS, suffixes=("_a", "_b"))
    selected_a = select_edges(pairs_a, policy)[EDGE_KEYS].assign(in_a=True)
    selected_b = select_edges(pairs_b, policy)[EDGE_KEYS].assign(in_b=True)
    both = both.merge(selected_a, on=EDGE_KEYS, how="left").merge(selected_b, on=EDGE_KEYS, how="left")
    both[["in_a", "in_b"]] = both[["in_a", "in_b"]].fillna(False).astype(bool)
    both["delta_pk"] = both["pk_b"] - both["pk_a"]
    both["delta_sd"] = both["delta_pk"] / both["kind"].map(reference_sd)
    both["status"] = np.select([both["in_b"] & ~both["in_a"], both["in_a"] & ~both["in_b"]],
                               ["appears", "vanishes"], "changes")
    flipped = both[both["status"] != "changes"]
    steady = both[(both["status"] == "changes") & (both["delta_pk"].abs() > 0)]
    largest = steady.loc[steady["delta_sd"].abs().sort_values(ascending=False, kind="stable").index[:changed]]
    table = pd.concat([flipped, largest])
    order = table["delta_sd"].abs().sort_values(ascending=False, kind="stable").index
    columns = ["status", "source", "target", "kind", "pk_a", "pk_b", "delta_pk", "delta_sd", "rank_a", "rank_b",
               "q_model_a", "q_model_b", "z_iso_a", "z_iso_b"]
    return table.loc[order, columns].reset_index(drop=True)


def _roles(heads):
    return [r for r in role_names(heads) if f"{r}_score" in heads]


def role_changes(heads_a, heads_b):
    """Heads whose significance for a role differs between the runs, sorted by |Δ log10 p| (then |Δ score|)."""
    roles = sorted(set(_roles(heads_a)) & set(_roles(heads_b)))
    merged = heads_a.merge(heads_b, on="head", suffixes=("_a", "_b"))
    frames = []
    for role in roles:
        sig_a, sig_b = merged[f"{role}_sig_a"].astype(bool), merged[f"{role}_sig_b"].astype(bool)
        flips = merged[sig_a != sig_b]
        frame = pd.DataFrame({
            "status": np.where(flips[f"{role}_sig_b"].astype(bool), "appears", "vanishes"),
            "head": flips["head"], "role": role,
            "score_a": flips[f"{role}_score_a"], "score_b": flips[f"{role}_score_b"],
            "p_a": flips.get(f"{role}_p_a", np.nan), "p_b": flips.get(f"{role}_p_b", np.nan),
        })
        frames.append(frame)
    columns = ["status", "head", "role", "score_a", "score_b", "delta_score", "p_a", "p_b", "delta_log10_p"]
    if not frames:
        return pd.DataFrame(columns=columns)
    table = pd.concat(frames, ignore_index=True)
    table["delta_score"] = table["score_b"] - table["score_a"]
    log_p = {s: np.log10(table[f"p_{s}"].astype(float).clip(lower=10 ** LOG10_P_FLOOR)) for s in "ab"}
    table["delta_log10_p"] = log_p["b"] - log_p["a"]
    key = pd.DataFrame({"p": table["delta_log10_p"].abs().fillna(0), "s": table["delta_score"].abs()})
    order = key.sort_values(["p", "s"], ascending=False, kind="stable").index
    return table.loc[order, columns].reset_index(drop=True)


def compare_runs(run_a, run_b, policy=SelectionPolicy(), changed=10):
    """Compare two loaded runs (headgraph.runs.RunFolder) of one architecture."""
    check_same_architecture(run_a, run_b)
    notes = []
    for key in ("processing", "dtype"):
        a, b = getattr(run_a.record, key), getattr(run_b.record, key)
        if a != b:
            notes.append(f"{key} differs: {a} (A) vs {b} (B)")
    kinds_a, kinds_b = set(run_a.type_pairs), set(run_b.type_pairs)
    shared = kinds_a & kinds_b
    if not shared:
        raise UsageError("the runs share no computed type pair; rerun analyze with common --types")
    if kinds_a != kinds_b:
        notes.append(f"type pairs compared: {', '.join(sorted(shared))} (only in one run: "
                     f"{', '.join(sorted(kinds_a ^ kinds_b))})")
    pairs = [r.pairs[(r.pairs["source_type"] + r.pairs["target_type"]).isin(shared)] for r in (run_a, run_b)]
    edges = edge_changes(pairs[0], pairs[1], _reference_sd(run_a), policy, changed)
    only = sorted(set(_roles(run_a.heads)) ^ set(_roles(run_b.heads)))
    if only:
        notes.append(f"roles tested in only one run (not compared): {', '.join(only)}")
    notes.append("delta_sd = ΔPK / sd of PK under the isotropic random-subspace reference; "
                 "q_model = each run's calibrated BH q-value")
    return Comparison(str(run_a.path), str(run_b.path), policy, edges, role_changes(run_a.heads, run_b.heads), notes)


def comparison_json(comparison):
    """A JSON-ready dict of a Comparison (NaN → null)."""
    return {
        "run_a": comparison.run_a, "run_b": comparison.run_b,
        "selection": comparison.policy.describe(),
        "edges": records(comparison.edges),
        "roles": records(comparison.roles),
        "notes": comparison.notes,
    }


def print_comparison(comparison, limit=None):
    """Print the comparison as two rich tables (edges, roles) and its notes."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    edges = comparison.edges.head(limit) if limit else comparison.edges
    table = Table(title=f"Edge changes A → B ({comparison.policy.describe()}; most important first)",
                  box=box.SIMPLE_HEAD)
    for name in ("change", "edge", "PK A → B", "Δ/ref sd", "rank A → B", "q A → B"):
        table.add_column(name, justify="left" if name in ("change", "edge") else "right", no_wrap=True)
    for row in edges.itertuples(index=False):
        table.add_row(row.status, f"{row.source}→{row.target} {row.kind}", f"{row.pk_a:.3g} → {row.pk_b:.3g}",
                      f"{row.delta_sd:+.3g}", f"{row.rank_a} → {row.rank_b}",
                      f"{row.q_model_a:.2g} → {row.q_model_b:.2g}")
    console.print(table)
    if len(comparison.roles):
        roles = comparison.roles.head(limit) if limit else comparison.roles
        role_table = Table(title="Role changes A → B (significance flips; largest change in log10 p first)",
                           box=box.SIMPLE_HEAD)
        for name in ("change", "head", "role", "score A → B", "p A → B"):
            role_table.add_column(name, justify="left" if name in ("change", "head", "role") else "right", no_wrap=True)
        for row in roles.itertuples(index=False):
            role_table.add_row(row.status, row.head, row.role, f"{row.score_a:.3g} → {row.score_b:.3g}",
                               f"{row.p_a:.2g} → {row.p_b:.2g}")
        console.print(role_table)
    else:
        console.print("No role changes (no head's role significance flips between the runs).")
    console.print(f"A: {comparison.run_a}\nB: {comparison.run_b}")
    for note in comparison.notes:
        console.print(f"note: {note}")
