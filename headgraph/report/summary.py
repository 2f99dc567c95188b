"""The closing summary of `headgraph analyze`: a rich table for people, a JSON object for programs."""

from __future__ import annotations

import dataclasses

from rich.console import Console
from rich.table import Table

from headgraph.analysis.artifacts import roles_of


def print_roles(model: str, heads, meta: dict, console: Console, identity_map: bool = False) -> None:
    """The role tests' result as tables: heads per role and layer, and optionally the identity-score map."""
    from headgraph.analysis.roles import identity_map as identity_grid
    from headgraph.analysis.roles import role_table

    counts = role_table(heads).T
    table = Table(title=f"{model}: heads per role and layer",
                  caption=f"{meta['model_kind']}; t-test of sieve bias > {meta['tau']}, alpha={meta['alpha']}, "
                          f"correction={meta['correction']}, {meta['n_inputs']} inputs per set")
    table.add_column("role")
    for layer in counts.columns:
        table.add_column(str(layer), justify="right")
    for role, row in counts.iterrows():
        table.add_row(role, *(str(v) for v in row))
    console.print(table)
    if identity_map:
        grid = identity_grid(heads)
        id_table = Table(title="identity score (mean self-attention)", caption="rows: layers, columns: heads")
        id_table.add_column("layer")
        for h in range(grid.shape[1]):
            id_table.add_column(str(h), justify="right")
        for layer, row in enumerate(grid):
            id_table.add_row(str(layer), *(f"{v:.2f}" for v in row))
        console.print(id_table)


def summary_data(outcome, top_hubs: int = 5) -> dict:
    """Everything the summary shows of a finished analyze (a headgraph.workflow.AnalyzeOutcome), as plain
    JSON-able data."""
    run, heads = outcome.result.run, outcome.result.heads
    roles = roles_of(heads)
    per_type = outcome.selected.edges.groupby("kind").size().to_dict() if len(outcome.selected.edges) else {}
    return {
        "run_id": run.id,
        "model": run.model.name,
        "dims": dataclasses.asdict(run.dims),
        "processing": run.processing,
        "device": run.device,
        "dtype": run.dtype,
        "heads": int(len(heads)),
        "pairs": run.n_pairs,
        "selection": run.selection,
        "edges": {tp: int(per_type.get(tp, 0)) for tp in run.types},
        "mean_pk": run.mean_pk,
        "kl": {tp: kl for tp, kl in run.kl_by_type.items() if tp in run.types},
        "hubs": [{"head": h["head"], "degree": h["degree"], "pagerank": h["pagerank"],
                  "roles": roles.get(h["head"], [])} for h in outcome.selected.hubs["hubs"][:top_hubs]],
        "folder": str(outcome.folder),
        "store": outcome.store,
        "report": {name: str(path) for name, path in outcome.report.items() if name.startswith("report")},
    }


def print_summary(data: dict, console: Console) -> None:
    """The summary as tables: run, per-type edges / mean PK / KL, top hubs with roles, where results went."""
    dims = data["dims"]
    head = Table(title=f"headgraph run {data['run_id']}", show_header=False)
    head.add_row("model", f"{data['model']} ({dims['n_layers']} layers x {dims['n_heads']} heads, "
                          f"d_model {dims['d_model']}, d_head {dims['d_head']})")
    head.add_row("settings", f"processing {data['processing']}, {data['device']}, {data['dtype']}")
    head.add_row("graph", f"{data['selection']}")
    console.print(head)
    types = Table(title="per weight-pair type", caption="KL(random || observed) in nats; mean PK vs the "
                  "isotropic mean k·k'/d")
    for column in ("type", "pairs", "edges", "mean PK", "KL"):
        types.add_column(column, justify="right")
    for tp, n_edges in data["edges"].items():
        kl = data["kl"].get(tp)
        types.add_row(tp, str(data["pairs"].get(tp, 0)), str(n_edges), f"{data['mean_pk'].get(tp, float('nan')):.3f}",
                      "-" if kl is None else f"{kl:.3f}")
    console.print(types)
    if dims["n_layers"] == 1 and not any(data["pairs"].values()):
        console.print("no head pairs, so 0 edges: a 1-layer model has no earlier -> later pairs "
                      "(--full-matrix also compares heads within a layer)")
    hubs = Table(title="top hubs (selected graph)")
    for column in ("head", "degree", "PageRank", "significant roles"):
        hubs.add_column(column)
    for hub in data["hubs"]:
        hubs.add_row(hub["head"], str(hub["degree"]), f"{hub['pagerank']:.3f}", ", ".join(hub["roles"]) or "-")
    console.print(hubs)
    console.print(f"artifacts: {data['folder']}")
    console.print(f"store: {data['store'] or 'not stored (--no-store)'}")
    for name, path in data["report"].items():
        console.print(f"{name}: {path}")
