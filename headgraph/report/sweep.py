"""The report of a sweep (headgraph.sweep), read back from the store, as a training story: its checkpoints with
the training loss their trainer logged, then the strongest edges' PK and the role scores over the steps, each
beside the step where it emerged, in a figure and in tables.

The strongest edges are those of highest PK at the sweep's last step (`per_type` of each type); an edge that is
not selected at a step has no point there (the store holds the selected edges only). A filled marker is a
significant value (edge: q_model <= 0.05; role: the role test's decision), a hollow one is not; a star marks
where the edge or role emerged: the first step from which it is significant at every later step (the queries
emergence and role-emergence). The loss is the one the trainer logged in trainer_state.json (the HF Trainer's:
a mean over the batches since its previous log), not one headgraph measured, and its fall says nothing by
itself about which edge or head caused it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from headgraph.analysis.artifacts import SIGNIFICANT_Q
from headgraph.heads import TYPE_PAIRS
from headgraph.loader.store import GraphStore
from headgraph.loader.sweeps import sweep_edges, sweep_heads, sweep_runs
from headgraph.report.figures import TYPE_COLORS, plt, save_figure
from headgraph.report.report import to_html, to_markdown

_MAX_TICKS = 8  # steps labelled one by one up to this many; matplotlib's ticks beyond


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
        return cls(sweep, sweep_runs(store, sweep), sweep_edges(store, sweep), sweep_heads(store, sweep))


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


def checkpoint_losses(runs: pd.DataFrame, losses: pd.DataFrame) -> pd.DataFrame:
    """Per run (in step order): the training loss logged last at or before its step and the step it was logged
    at (none when nothing was logged by then).

    >>> runs = pd.DataFrame({"step": [100, 200], "run": ["a", "b"]})
    >>> checkpoint_losses(runs, pd.DataFrame({"step": [50, 100, 150], "loss": [3.0, 2.0, 1.5]}))
       step run  loss  logged at
    0   100   a   2.0        100
    1   200   b   1.5        150
    """
    logged = losses.rename(columns={"step": "logged at"}).sort_values("logged at")
    merged = pd.merge_asof(runs.sort_values("step"), logged, left_on="step", right_on="logged at",
                           direction="backward")
    return merged.assign(**{"logged at": _steps(merged["logged at"])})[[*runs.columns, "loss", "logged at"]]


def _steps(values) -> list[int | None]:
    """Steps as whole numbers, None where there is none (a float column would print 143000 as 1.43e+05)."""
    return [None if pd.isna(v) else int(v) for v in values]


def _roles_seen(heads: pd.DataFrame) -> list[str]:
    """The roles significant for some head at some step (those with a stored score)."""
    seen = sorted({role for roles in heads.get("roles", pd.Series(dtype=object)).dropna() for role in roles})
    return [role for role in seen if f"{role}_score" in heads]


def _no_roles(heads: pd.DataFrame) -> str:
    """Why a sweep shows no role: its runs tested none (no role score stored: a store's Head has the score
    columns of every run it holds, empty for runs without roles), or no head was significant.

    >>> _no_roles(pd.DataFrame({"name": ["L0H0"], "roles": [[]], "induction_score": [0.1]}))
    'No role is significant for any head at any step (no role panel, no role emerged).'
    >>> _no_roles(pd.DataFrame({"name": ["L0H0"], "roles": [None], "identity_score": [None]}))
    'No role was tested (the sweep ran with --no-roles).'
    """
    if not heads.filter(regex="_score$").notna().to_numpy().any():
        return "No role was tested (the sweep ran with --no-roles)."
    return "No role is significant for any head at any step (no role panel, no role emerged)."


def _role_heads(heads: pd.DataFrame, role: str) -> list[str]:
    """The heads for which `role` is significant at some step, by layer and index."""
    has_role = heads["roles"].map(lambda found: role in found if isinstance(found, list) else False)
    return heads[has_role].drop_duplicates("name").sort_values(["layer", "head"])["name"].tolist()


def _emerged(emergence: pd.DataFrame, keys: list[str]) -> dict[tuple, int]:
    """{key tuple: emerged step} of the rows of the query emergence or role-emergence."""
    if emergence.empty:
        return {}
    return {tuple(row[:-1]): int(row[-1]) for row in emergence[[*keys, "emerged"]].itertuples(index=False)}


def _mark(ax, x, y, significant, label, emerged: int | None):
    """One series: a line, a filled (significant) or hollow marker per step, a star at its emergence."""
    x, y = list(x), list(y)
    (line,) = ax.plot(x, y, lw=1.4, label=label if emerged is None else f"{label} · emerged {emerged}")
    color = line.get_color()
    ax.scatter(x, y, s=28, zorder=3, edgecolors=color, facecolors=[color if s else "white" for s in significant])
    if emerged in x:
        ax.scatter([emerged], [y[x.index(emerged)]], marker="*", s=170, zorder=4, color=color, edgecolors="black",
                   linewidths=0.6)


def _loss_panel(ax, losses: pd.DataFrame, at_checkpoints: pd.DataFrame, role_emergence: pd.DataFrame):
    ax.plot(losses["step"], losses["loss"], color="0.35", lw=1.2, label="training loss (logged)")
    logged = at_checkpoints.dropna(subset=["loss"])
    ax.scatter(logged["step"], logged["loss"], s=36, zorder=3, color="black", label="checkpoints analysed")
    if not role_emergence.empty:
        for step, rows in role_emergence.groupby("emerged"):
            ax.axvline(step, color="tab:red", lw=0.9, ls="--", zorder=1)
            names = "; ".join(f"{role.replace('_', ' ')} {', '.join(group['head'])}"
                              for role, group in rows.groupby("role"))
            ax.annotate(f"emerged: {names}", (step, 1), xycoords=("data", "axes fraction"), xytext=(3, -3),
                        textcoords="offset points", va="top", fontsize=7, color="tab:red")
    ax.set_title("training loss (trainer_state.json) and the checkpoints analysed", fontsize=9)
    ax.set_ylabel("loss")


def sweep_figure(data: SweepData, strongest: pd.DataFrame, edge_emergence: pd.DataFrame,
                 role_emergence: pd.DataFrame, losses: pd.DataFrame):
    """A row with the training loss over the steps (when logged), one panel per edge type (PK of its strongest
    edges) and one per role seen (the score of every head for which it is significant at some step), on one
    step axis; a star where an edge or role emerged."""
    kinds = [kind for kind in TYPE_PAIRS if kind in set(strongest.get("kind", []))]
    roles = _roles_seen(data.heads) if not data.heads.empty else []
    panels = [row for row, present in (("loss", not losses.empty), ("edges", kinds), ("roles", roles)) if present]
    ncols = max(len(kinds), len(roles), 1)
    fig = plt.figure(figsize=(3.6 * ncols, 3.2 * max(len(panels), 1)))
    grid = fig.add_gridspec(max(len(panels), 1), ncols)
    axes = []
    if "loss" in panels:
        axes.append(fig.add_subplot(grid[0, :]))
        _loss_panel(axes[-1], losses, checkpoint_losses(data.runs, losses), role_emergence)
    edges_emerged = _emerged(edge_emergence, ["kind", "source", "target"])
    for column, kind in enumerate(kinds):
        ax = fig.add_subplot(grid[panels.index("edges"), column])
        for (source, target), edge in strongest[strongest["kind"] == kind].groupby(["source", "target"]):
            _mark(ax, edge["step"], edge["pk"], edge["q_model"] <= SIGNIFICANT_Q, f"{source}→{target}",
                  edges_emerged.get((kind, source, target)))
        ax.set_title(f"{kind}: PK of the strongest edges", fontsize=9, color=TYPE_COLORS.get(kind))
        ax.set_ylabel("PK")
        axes.append(ax)
    roles_emerged = _emerged(role_emergence, ["role", "head"])
    for column, role in enumerate(roles):
        ax = fig.add_subplot(grid[panels.index("roles"), column])
        for head in _role_heads(data.heads, role):
            rows = data.heads[data.heads["name"] == head].sort_values("step")
            _mark(ax, rows["step"], rows[f"{role}_score"], rows[f"{role}_sig"].fillna(False).astype(bool), head,
                  roles_emerged.get((role, head)))
        ax.set_title(f"{role.replace('_', ' ')} score (heads significant at some step)", fontsize=9)
        ax.set_ylabel("mean self-attention" if role == "identity" else "sieve bias")
        axes.append(ax)
    steps = data.runs["step"].tolist()
    span = [min(steps + losses["step"].tolist()), max(steps + losses["step"].tolist())] if steps else [0, 1]
    pad = 0.03 * (span[1] - span[0] or 1)
    for ax in axes:
        if len(steps) <= _MAX_TICKS:
            ax.set_xticks(steps)
        ax.set_xlim(span[0] - pad, span[1] + pad)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("training step")
        ax.legend(fontsize=6, loc="best")
    absent = "" if roles else f"\n{_no_roles(data.heads)}"
    fig.suptitle(f"sweep {data.sweep}: filled = significant (edge q_model ≤ {SIGNIFICANT_Q:g}; role test), "
                 f"★ = emerged (significant from there on){absent}", fontsize=10)
    fig.tight_layout()
    return fig


def _emerged_column(table: pd.DataFrame, emergence: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    emerged = emergence.set_index(keys)["emerged"].reindex(table.index) if not emergence.empty else None
    table.insert(0, "emerged", pd.Series(_steps(emerged) if emerged is not None else None, index=table.index,
                                         dtype=object))
    return table


def _pk_by_step(strongest: pd.DataFrame, edge_emergence: pd.DataFrame) -> pd.DataFrame:
    table = strongest.pivot_table(index=["kind", "source", "target"], columns="step", values="pk")
    table.columns = [f"PK @ {step}" for step in table.columns]
    return _emerged_column(table, edge_emergence, ["kind", "source", "target"])


def _roles_by_step(heads: pd.DataFrame, role_emergence: pd.DataFrame) -> pd.DataFrame:
    """Per role and head significant for it at some step: when it emerged, at how many steps it is significant,
    and its score at every step."""
    rows = []
    for role in _roles_seen(heads):
        for head in _role_heads(heads, role):
            steps = heads[heads["name"] == head].set_index("step").sort_index()
            rows.append({"role": role, "head": head, "significant at": int(steps[f"{role}_sig"].fillna(False).sum()),
                         **{f"score @ {s}": v for s, v in steps[f"{role}_score"].items()}})
    if not rows:
        return pd.DataFrame()
    return _emerged_column(pd.DataFrame(rows).set_index(["role", "head"]), role_emergence, ["role", "head"])


def render_sweep_report(data: SweepData, edge_emergence: pd.DataFrame, role_emergence: pd.DataFrame, out_dir,
                        losses: pd.DataFrame | None = None, per_type: int = 4) -> dict[str, Path]:
    """Write report.md, report.html and fig_sweep.png/.svg of a sweep into out_dir; return {name: path}.
    `edge_emergence` and `role_emergence` are the rows of the named queries emergence and role-emergence;
    `losses` the training loss logged over the steps (`step`, `loss`: headgraph.sweep.training_losses)."""
    out_dir = Path(out_dir)
    losses = losses if losses is not None else pd.DataFrame(columns=["step", "loss"])
    strongest = strongest_edges(data.edges, per_type)
    fig = save_figure(sweep_figure(data, strongest, edge_emergence, role_emergence, losses), out_dir, "fig_sweep")
    runs = data.runs.drop(columns="source")
    if not losses.empty:
        runs = checkpoint_losses(runs, losses)
    roles = _roles_by_step(data.heads, role_emergence) if not data.heads.empty else pd.DataFrame()
    title = f"headgraph sweep — {data.sweep}"
    loss_note = (" `loss` is the training loss the trainer logged last at or before the step (trainer_state.json, "
                 "at step `logged at`), not measured by headgraph." if not losses.empty else "")
    blocks = [
        ("h", 1, title),
        ("p", f"{len(data.runs)} checkpoints, one stored run each, in step order. A step is read from the "
              "checkpoint's trainer_state.json, else from its name (or given by --steps / --final-step). Every q "
              "refers to each run's calibrated null; PKs of different checkpoints compare the same heads' "
              f"subspaces as training changed them.{loss_note}"),
        ("table", runs.set_index("step")),
        ("fig", "Training loss, PK of the strongest edges and role scores over the training steps; ★ where each "
                "emerged", fig),
        ("h", 2, "Edges"),
        ("p", f"The {per_type} edges of each type with the highest PK at the last step: the step from which they "
              "are significant (q_model ≤ 0.05) at every later step (`emerged`, — : not emerged) and their PK at "
              "every step. An edge that is not selected at a step has no PK there."),
        ("table", _pk_by_step(strongest, edge_emergence) if not strongest.empty else pd.DataFrame()),
        ("p", f"{len(edge_emergence)} selected edges emerged in all (`headgraph query emergence`)."),
        ("h", 2, "Roles"),
        ("p", "Every head for which the role test finds a role significant at some step: the step from which it is "
              "significant at every later step (`emerged`, — : not emerged), at how many steps it is, and the head's "
              "score at every step. "
              "The change happened between `emerged` and the step before it; these checkpoints cannot place it "
              "more finely (`headgraph query role-emergence`)."),
        ("table", roles) if not roles.empty else ("p", _no_roles(data.heads)),
    ]
    paths = {"report.md": out_dir / "report.md", "report.html": out_dir / "report.html"}
    paths["report.md"].write_text(to_markdown(blocks))
    paths["report.html"].write_text(to_html(blocks, title))
    return {**paths, "fig_sweep.png": fig["png"], "fig_sweep.svg": fig["svg"]}
