"""The closing summary of `headgraph analyze`: a rich table for people, a JSON object for programs."""

from __future__ import annotations

import dataclasses

from rich import box
from rich.console import Console
from rich.table import Table

from headgraph.analysis.artifacts import PAIR_KEY, records, roles_of


def print_roles(model: str, heads, meta: dict, console: Console, identity_map: bool = False) -> None:
    """The role tests' result as tables: heads per role and layer, and optionally the identity-score map."""
    from headgraph.analysis.roles import identity_map as identity_grid
    from headgraph.analysis.roles import role_table

    counts = role_table(heads).T
    table = Table(title=f"{model}: heads per role and layer",
                  caption=f"{meta['model_kind']}; {meta['design']} test of sieve bias > {meta['tau']}, "
                          f"alpha={meta['alpha']}, correction={meta['correction']}; inputs used: "
                          + ", ".join(f"{name} {x['n']} of {meta['n_inputs']}" for name, x in meta["inputs"].items()))
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


TOP_HUBS = 5
"""Hubs the summary and the report's findings list."""


def hub_rows(hubs: dict, heads, top: int = TOP_HUBS) -> list[dict]:
    """The first `top` hubs of a hub report (headgraph.analysis.centrality.hub_report: by degree in the selected
    graph) with their significant roles, as plain data: head, degree, pagerank, roles. A hub is a head with many
    selected edges, not one shown to matter to the model's output."""
    roles = roles_of(heads)
    return [{"head": h["head"], "degree": h["degree"], "pagerank": h["pagerank"], "roles": roles.get(h["head"], [])}
            for h in hubs["hubs"][:top]]


def summary_data(outcome, top_hubs: int = TOP_HUBS) -> dict:
    """Everything the summary shows of a finished analyze (a headgraph.workflow.AnalyzeOutcome), as plain
    JSON-able data."""
    run, heads = outcome.result.run, outcome.result.heads
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
        "hubs": hub_rows(outcome.selected.hubs, heads, top_hubs),
        "causal": _strongest_effects(outcome.result.pairs, run.causal),
        "folder": str(outcome.folder),
        "store": outcome.store,
        "report": {name: str(path) for name, path in outcome.report.items() if name.startswith("report")},
        "timings_s": outcome.timings_s,
        "stages": {name: dataclasses.asdict(stage) for name, stage in outcome.stages.items()},
        "peak_rss": outcome.peak_rss,
    }


def _strongest_effects(pairs, causal: dict | None) -> dict:
    """The causal stage in brief: why it was skipped, or the pair of each type with the largest local effect."""
    if causal is None or "skipped" in causal:
        return {"skipped": "not run (--no-causal)" if causal is None else causal["skipped"]}
    with_effect = pairs[pairs["effect"].notna()]
    top = with_effect.loc[with_effect.groupby(with_effect["source_type"] + with_effect["target_type"])["effect"].idxmax()]
    columns = [*PAIR_KEY, "effect", "effect_lo", "effect_hi", "pk"]
    agreement = {kind: {"spearman": entry["spearman"], "edges": entry["edges"]}
                 for kind, entry in causal.get("agreement", {}).items()}  # attribution vs exact, run.json's
    return {"inputs": causal["inputs"], "strongest": records(top[[c for c in columns + ["effect_loss"] if c in top]]),
            "agreement": agreement}


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
    causal = data["causal"]
    if "skipped" in causal:
        console.print(f"causal effects: {causal['skipped']}")
    else:
        table = Table(title="largest local causal effect per type",
                      caption=f"direct-path patching on {', '.join(f'{n} {k}' for k, n in causal['inputs'].items())}"
                              " inputs; Q/K: attention moved, V: relative output change")
        for column in ("edge", "effect [95% CI]", "PK", "loss effect"):
            table.add_column(column, justify="left" if column == "edge" else "right")
        for e in causal["strongest"]:
            loss = e.get("effect_loss")
            table.add_row(f"{e['source']} →{e['target_type']} {e['target']}",
                          f"{e['effect']:.3f} [{e['effect_lo']:.3f}, {e['effect_hi']:.3f}]", f"{e['pk']:.2f}",
                          "-" if loss is None else f"{loss:+.3f}")
        console.print(table)
        if causal["agreement"]:
            console.print("attribution vs exact loss effect, Spearman rho (edges): " + ", ".join(
                f"{kind} {_num(a['spearman'])} ({a['edges']})" for kind, a in causal["agreement"].items()))
    console.print(f"artifacts: {data['folder']}")
    console.print(f"store: {data['store'] or 'not stored (--no-store)'}")
    for name, path in data["report"].items():
        console.print(f"{name}: {path}")
    steps = data["timings_s"]
    console.print(f"time: {sum(steps.values()):.1f} s (" + ", ".join(f"{step.replace('_', ' ')} {s:.1f}"
                                                                  for step, s in steps.items()) + ")")
    how = "of each stage" if data["peak_rss"] == "vmhwm" else "of the process so far, ru_maxrss"
    peaks = ", ".join(f"{name.replace('_', ' ')} {stage['peak_rss_bytes'] / 2**30:.2f}"
                      for name, stage in data["stages"].items())
    console.print(f"peak resident memory {how} (GiB): {peaks}")
    gpu = {name: stage["peak_gpu_bytes"] for name, stage in data["stages"].items()
           if stage.get("peak_gpu_bytes") is not None}
    if gpu:
        console.print("peak GPU memory allocated by torch (GiB): "
                      + ", ".join(f"{name.replace('_', ' ')} {n / 2**30:.2f}" for name, n in gpu.items()))


def evaluation_data(run_dir, classes_name: str | None, top_k: int, threshold: float) -> dict:
    """`headgraph evaluate`: the class evaluation (when classes apply) and the causal evaluation (when the run
    has effects) of a run folder, as plain data."""
    from pathlib import Path

    from headgraph.analysis.artifacts import read_table
    from headgraph.analysis.classes import default_classes, load_classes
    from headgraph.analysis.evaluation import (CAUSAL_DEFINITION, causal_evaluation,
                                               evaluate_pairs)
    from headgraph.errors import UsageError
    from headgraph.runs import RUN_FILE, load_run

    folder = Path(run_dir)
    path = folder / "pairs.parquet"
    if not path.is_file():
        raise UsageError(f"no pairs.parquet in '{run_dir}': run `headgraph analyze` to make a run folder first")
    if (folder / RUN_FILE).is_file():
        run = load_run(folder)
        pairs, model = run.pairs, run.model
        classes = load_classes(classes_name) if classes_name else default_classes(model)
    else:  # a bare pairs table
        pairs, model = read_table(path, PAIR_KEY), None
        classes = load_classes(classes_name or "pk-paper")
    data = {"run": str(run_dir), "model": model, "top_k": top_k}
    if classes is not None:
        model_heads = set(pairs["source"]) | set(pairs["target"])
        data.update(class_heads_in_run=len(classes.heads & model_heads),
                    classes={"name": classes.name, "source": classes.source, "model": classes.model,
                             "heads": len(classes.heads)},
                    rows=records(evaluate_pairs(pairs, classes, k=top_k)))
    if "effect" in pairs.columns and pairs["effect"].notna().any():
        data["causal"] = {"definition": CAUSAL_DEFINITION.format(threshold=threshold), "threshold": threshold,
                          "rows": records(causal_evaluation(pairs, threshold, k=top_k))}
    if classes is None and "causal" not in data:
        raise UsageError(f"nothing to evaluate in '{run_dir}': no known classes for {model} (pass --classes) "
                         "and no causal effects (analyze without --no-causal)")
    return data


def print_evaluation(data: dict, console: Console) -> None:
    """`evaluation_data` as tables: against known classes, then against causal effects."""
    if "rows" in data:
        classes = data["classes"]
        headers = {"positives": "both in class", "in_class": "in-class", "out_of_class": "out-of-class",
                   "roc_auc": "ROC-AUC", "pr_auc": "PR-AUC", "positive_rate": "base rate"}
        table = Table(title=f"{classes['name']} classes ({data['class_heads_in_run']} of {classes['heads']} class "
                            f"heads in this run), top-{data['top_k']} graph per type",
                      caption=f"classes: {classes['source']}")
        for col in data["rows"][0]:
            table.add_column(headers.get(col, col), justify="left" if col in ("metric", "scope") else "right")
        for row in data["rows"]:
            table.add_row(*(f"{v:.3f}" if isinstance(v, float) else "-" if v is None else str(v)
                            for v in row.values()))
        console.print(table)
    if "causal" in data:
        causal = data["causal"]
        table = Table(title="PK and CS against causal effects", box=box.SIMPLE_HEAD, pad_edge=False,
                      caption=f"{causal['definition']}. by: the metric ranking the n pairs of a type, c of them "
                              "causal; rho: Spearman with the effect, 95% bootstrap interval over pairs; ROC, PR: "
                              "ROC-AUC, PR-AUC at finding the causal pairs; P@k: "
                              f"precision of the top {data['top_k']} pairs; R-P: of the top c, c = causal pairs; "
                              "base: the precision of a random ranking")
        for col in ("by", "type", "n", "c", "rho [95% CI]", "ROC", "PR", "P@k", "R-P", "base"):
            table.add_column(col, justify="left" if col in ("by", "type") else "right", no_wrap=True)
        for r in causal["rows"]:
            table.add_row(r["metric"], r["scope"], str(r["pairs"]), str(r["causal"]),
                          f"{_num(r['spearman'])} [{_num(r['spearman_lo'])}, {_num(r['spearman_hi'])}]",
                          *(_num(r[c]) for c in ("roc_auc", "pr_auc", "precision_at_k", "r_precision", "base_rate")))
        console.print(table)


def _num(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_stability(report: dict, console: Console) -> None:
    """A stability report (headgraph.stability.run_stability) as tables: per variant and type, then roles."""
    from headgraph.analysis.stability import role_flips, summary_rows

    table = Table(title=f"stability of run {report['run']} ({report['policy']})", box=box.SIMPLE_HEAD,
                  caption="rho: Spearman between the run and the variant over the same pairs; Jaccard: of the "
                          "selected edges; flips: q_model <= 0.05 decisions that change")
    for col in ("variant", "type", "rho PK", "rho effect", "Jaccard", "flips"):
        table.add_column(col, justify="left" if col in ("variant", "type") else "right", no_wrap=True)
    for row in records(summary_rows(report)):
        table.add_row(row["variant"], row["type"], _num(row["pk_spearman"], 4), _num(row["effect_spearman"], 4),
                      _num(row["jaccard"]), "-" if row["significance_flips"] is None else str(row["significance_flips"]))
    console.print(table)
    for name, entry in report["variants"].items():
        if "skipped" in entry:
            console.print(f"{name}: skipped ({entry['skipped']})")
    flips = role_flips(report)
    if flips:
        console.print("role decisions that flip: " + ", ".join(f"{name} {n}" for name, n in flips.items()))
