"""The report of a sweep (headgraph.sweep), read back from the store: its checkpoints, a figure of the strongest
edges' PK and of the role scores over the steps, and when edges and roles emerged.

The strongest edges are those of highest PK at the sweep's last step (`per_type` of each type); an edge that is
not selected at a step has no point there (the store holds the selected edges only). A filled marker is a
significant value (edge: q_model <= 0.05; role: the role test's decision), a hollow one is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from headgraph.loader.store import GraphStore
from headgraph.report.figures import TYPE_COLORS, plt, save_figure
from headgraph.report.report import to_html, to_markdown

SIGNIFICANT_Q = 0.05
_RUNS = """
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
RETURN run.step AS step, run.model AS model, run.id AS run, run.n_edges AS edges, run.policy AS policy
ORDER BY step
"""
_EDGES = """
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
MATCH (a:Head)-[r]->(:Head) WHERE a.run_id = run.id
RETURN run.step AS step, r.kind AS kind, r.source AS source, r.target AS target, r.pk AS pk, r.q_model AS q_model,
       r.effect AS effect
"""
_HEADS = """
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
MATCH (h:Head) WHERE h.run_id = run.id
RETURN run.step AS step, h AS head
"""


@dataclass(frozen=True)
class SweepData:
    """A sweep's complete runs with a step, as stored: one row per run, per selected edge and step, and per head
    and step (every stored Head property, role scores and decisions included)."""

    sweep: str
    runs: pd.DataFrame
    edges: pd.DataFrame
    heads: pd.DataFrame

    @classmethod
    def read(cls, store: GraphStore, sweep: str) -> SweepData:
        params = {"sweep": sweep}
        runs = pd.DataFrame(store.read(_RUNS, params).records(), columns=["step", "model", "run", "edges", "policy"])
        edges = pd.DataFrame(store.read(_EDGES, params).records(),
                             columns=["step", "kind", "source", "target", "pk", "q_model", "effect"])
        heads = pd.DataFrame([{"step": r["step"], **r["head"]} for r in store.read(_HEADS, params).records()])
        return cls(sweep, runs, edges, heads)


def strongest_edges(edges: pd.DataFrame, per_type: int = 4) -> pd.DataFrame:
    """The `per_type` edges of each type with the highest PK at the last step, one row per edge and step.

    >>> edges = pd.DataFrame({"step": [1, 2, 2], "kind": "OK", "source": "L0H0", "target": ["L1H0", "L1H0", "L1H1"],
    ...                       "pk": [1.0, 3.0, 2.0], "q_model": 0.01, "effect": None})
    >>> strongest_edges(edges, per_type=1)[["step", "source", "target", "pk"]]
       step source target   pk
    0     1   L0H0   L1H0  1.0
    1     2   L0H0   L1H0  3.0
    """
    if edges.empty:
        return edges
    last = edges[edges["step"] == edges["step"].max()]
    top = last.sort_values(["kind", "pk"], ascending=[True, False]).groupby("kind").head(per_type)
    keys = ["kind", "source", "target"]
    return edges.merge(top[keys], on=keys).sort_values([*keys, "step"]).reset_index(drop=True)


def _roles_seen(heads: pd.DataFrame) -> list[str]:
    """The roles significant for some head at some step (those with a stored score)."""
    seen = sorted({role for roles in heads.get("roles", pd.Series(dtype=object)).dropna() for role in roles})
    return [role for role in seen if f"{role}_score" in heads]


def _mark(ax, x, y, significant, label):
    (line,) = ax.plot(x, y, lw=1.4, label=label)
    color = line.get_color()
    ax.scatter(x, y, s=28, zorder=3, edgecolors=color, facecolors=[color if s else "white" for s in significant])


def sweep_figure(data: SweepData, strongest: pd.DataFrame):
    """One panel per edge type (PK of its strongest edges over the steps) and one per role seen (the score of
    every head for which it is significant at some step)."""
    kinds = list(dict.fromkeys(strongest["kind"])) if not strongest.empty else []
    roles = _roles_seen(data.heads) if not data.heads.empty else []
    ncols = max(len(kinds), len(roles), 1)
    nrows = int(bool(kinds)) + int(bool(roles)) or 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.2 * nrows), squeeze=False)
    steps = data.runs["step"].tolist()
    for ax, kind in zip(axes[0], kinds):
        for (source, target), edge in strongest[strongest["kind"] == kind].groupby(["source", "target"]):
            _mark(ax, edge["step"], edge["pk"], edge["q_model"] <= SIGNIFICANT_Q, f"{source}→{target}")
        ax.set_title(f"{kind}: PK of the strongest edges", fontsize=9, color=TYPE_COLORS.get(kind))
        ax.set_ylabel("PK")
    for ax, role in zip(axes[-1] if roles else [], roles):
        has_role = data.heads["roles"].map(lambda found: isinstance(found, list) and role in found)
        for head in sorted(data.heads.loc[has_role, "name"].unique()):
            rows = data.heads[data.heads["name"] == head].sort_values("step")
            _mark(ax, rows["step"], rows[f"{role}_score"], rows[f"{role}_sig"].fillna(False).astype(bool), head)
        ax.set_title(f"{role.replace('_', ' ')} score (heads significant at some step)", fontsize=9)
        ax.set_ylabel("mean self-attention" if role == "identity" else "sieve bias")
    for ax in axes.flat:
        if ax.has_data():
            ax.set_xticks(steps)
            ax.tick_params(labelsize=7)
            ax.set_xlabel("training step")
            ax.legend(fontsize=6, loc="best")
        else:
            ax.set_visible(False)
    fig.suptitle(f"sweep {data.sweep}: filled = significant (edge q_model ≤ {SIGNIFICANT_Q:g}; role test)", fontsize=10)
    fig.tight_layout()
    return fig


def _pk_by_step(strongest: pd.DataFrame, edge_emergence: pd.DataFrame) -> pd.DataFrame:
    table = strongest.pivot_table(index=["kind", "source", "target"], columns="step", values="pk")
    table.columns = [f"PK @ {step}" for step in table.columns]
    emerged = edge_emergence.set_index(["kind", "source", "target"])["emerged"] if not edge_emergence.empty else None
    table.insert(0, "emerged", emerged.reindex(table.index) if emerged is not None else None)
    return table


def render_sweep_report(data: SweepData, edge_emergence: pd.DataFrame, role_emergence: pd.DataFrame, out_dir,
                        per_type: int = 4) -> dict[str, Path]:
    """Write report.md, report.html and fig_sweep.png/.svg of a sweep into out_dir; return {name: path}.
    `edge_emergence` and `role_emergence` are the rows of the named queries emergence and role-emergence."""
    out_dir = Path(out_dir)
    strongest = strongest_edges(data.edges, per_type)
    fig = save_figure(sweep_figure(data, strongest), out_dir, "fig_sweep")
    title = f"headgraph sweep — {data.sweep}"
    blocks = [
        ("h", 1, title),
        ("p", f"{len(data.runs)} checkpoints, one stored run each, in step order. A step is read from the "
              "checkpoint's name. Every q refers to each run's calibrated null; PKs of different checkpoints "
              "compare the same heads' subspaces as training changed them."),
        ("table", data.runs.set_index("step")),
        ("h", 2, "Sweep"),
        ("p", f"The {per_type} edges of each type with the highest PK at the last step, their PK at every step and "
              "the step from which they are significant (q_model ≤ 0.05) at every later step (`emerged`, — : not "
              "emerged). An edge that is not selected at a step has no PK there."),
        ("table", _pk_by_step(strongest, edge_emergence) if not strongest.empty else pd.DataFrame()),
        ("fig", "PK of the strongest edges and role scores over the training steps", fig),
        ("h", 2, "Emergence of roles"),
        ("p", "The step from which the role test finds the role significant for the head at every later step, the "
              "first step it did at all and at how many steps. The change happened between `emerged` and the "
              "step before it; these checkpoints cannot place it more finely."),
        ("table", role_emergence.set_index(["role", "head"]) if not role_emergence.empty else pd.DataFrame()),
        ("p", f"{len(edge_emergence)} selected edges emerged in all (`headgraph query emergence`)."),
    ]
    paths = {"report.md": out_dir / "report.md", "report.html": out_dir / "report.html"}
    paths["report.md"].write_text(to_markdown(blocks))
    paths["report.html"].write_text(to_html(blocks, title))
    return {**paths, "fig_sweep.png": fig["png"], "fig_sweep.svg": fig["svg"]}
