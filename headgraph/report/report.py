"""The report of one analysis run: figures plus `report.md` and a self-contained `report.html`.

The report leads with its findings (warnings that qualify them, the top hubs with their roles, the strongest
edges per type with their effects), then the interactive graph, then the sections with the figures; the model and
settings table closes it.

The table builders take a run folder read by headgraph.runs.load_run (or DataFrames) and return DataFrames;
`render_report` writes everything into the run folder.
"""

import base64
import contextlib
import html
import math
import multiprocessing
import os
import re
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pandas as pd

from headgraph.analysis.artifacts import SIGNIFICANT_Q, role_names, roles_of
from headgraph.analysis.causal.stage import AGREEMENT_RHO
from headgraph.analysis.classes import default_classes
from headgraph.analysis.evaluation import (CAUSAL_DEFINITION, CAUSAL_THRESHOLD, DEFAULT_EVAL_K, causal_evaluation,
                                           causal_pairs, evaluate_pairs)
from headgraph.analysis.network import head_network
from headgraph.analysis.options import RoleOptions
from headgraph.analysis.selection import SelectionPolicy, select_graph
from headgraph.heads import COMPOSITION_TYPES, TYPE_PAIRS, WEIGHT_TYPES
from headgraph.report import figures
from headgraph.report.interactive import MAX_EDGES, interactive_graph
from headgraph.report.summary import hub_rows
from headgraph.analysis.stability import role_flips, summary_rows
from headgraph.runs import RunFolder, load_run, read_stability

FINDINGS_PER_TYPE = 3
"""Strongest edges per type in the report's findings."""
EFFECT_COLUMNS = ("effect", "effect_loss", "effect_attr")
_EFFECT_TEXT = {
    "effect": "`effect` is the local effect of the source's output on the target's query, key or value input "
              "alone: attention moved (total variation, 0…1) for Q/K, relative change of the output for V",
    "effect_loss": "`effect_loss` runs the rest of the model on it (decoder: nats of next-token loss, positive = "
                   "the path helps; encoder: relative change of the final hidden states)",
    "effect_attr": "`effect_attr` is its first-order (gradient) estimate of that loss change, in the same nats",
}


def type_summary(run, fraction=0.03, q_level=SIGNIFICANT_Q):
    """One row per computed type pair: PK statistics against the isotropic reference, KL, significance."""
    pairs = run.pairs.assign(type=run.pairs["source_type"] + run.pairs["target_type"])
    stats = pairs.groupby("type").agg(pairs=("pk", "size"), mean_pk=("pk", "mean"), sd_pk=("pk", "std"),
                                      q_below=("q_model", lambda q: int((q < q_level).sum())))
    stats["top_cutoff"] = pairs.groupby("type")["pk"].quantile(1 - fraction)
    ref = pd.DataFrame(run.record.reference_by_type).T.reindex(stats.index)
    stats["ref_mean"] = ref["mean"].astype(float)
    stats["ref_sd"] = np.sqrt(ref["var"].astype(float))
    stats["mean_z"] = (stats["mean_pk"] - stats["ref_mean"]) / stats["ref_sd"]
    stats["kl"] = [run.record.kl_by_type.get(tp) for tp in stats.index]
    return stats.reindex([tp for tp in TYPE_PAIRS if tp in stats.index])


def role_counts_by_layer(heads):
    """Layer × role: the number of heads with a significant role (and their names when few)."""
    roles = role_names(heads)
    if not roles:
        return None
    table = pd.DataFrame(index=pd.Index(sorted(heads["layer"].unique()), name="layer"))
    for role in roles:
        sig = heads[heads[f"{role}_sig"].astype(bool)]
        by_layer = sig.groupby("layer")["head"].agg(list)
        table[role] = [_count_with_names(by_layer.get(layer, [])) for layer in table.index]
    table.loc["all"] = [str(int(heads[f"{r}_sig"].astype(bool).sum())) for r in roles]
    return table


def _count_with_names(names):
    if not names:
        return "0"
    return f"{len(names)} ({', '.join(names)})" if len(names) <= 4 else str(len(names))


def hub_table(report, heads):
    """The hub report (headgraph.analysis.centrality.hub_report) as a table with each hub's edges and roles."""
    roles = roles_of(heads)
    rows = []
    for hub in report["hubs"]:
        rows.append({"head": hub["head"], "degree": hub["degree"], "in": hub["in_degree"], "out": hub["out_degree"],
                     "weighted degree": hub["weighted_degree"], "pagerank": hub["pagerank"],
                     "betweenness": hub["betweenness"],
                     "in-edges (strongest per type)": _edge_summary(hub["edges"]["in"]),
                     "out-edges (strongest per type)": _edge_summary(hub["edges"]["out"]),
                     "significant roles": ", ".join(roles.get(hub["head"], [])) or "—",
                     f"top-{report['top']} under": f"{len(hub['top_in'])}/{len(report['measures'])} measures"})
    return pd.DataFrame(rows).set_index("head")


def _edge_summary(by_kind):
    """'OV: L1H11, L2H2; OK: L5H5' from {kind: [{"head", "pk"}, ...]} in the project's type order."""
    parts = [f"{kind}: " + ", ".join(e["head"] for e in by_kind[kind])
             for kind in TYPE_PAIRS if by_kind.get(kind)]
    return "; ".join(parts) or "—"


def _strongest(edges, per_type):
    """The `per_type` strongest edges of each kind by PK, kinds in the project's type order, with `edge`."""
    table = edges.assign(order=edges["kind"].map(TYPE_PAIRS.index))
    table = table.sort_values(["order", "pk"], ascending=[True, False], kind="stable")
    table = table.groupby("kind", sort=False).head(per_type)
    return table.assign(edge=table["source"] + " → " + table["target"])


def strongest_edges(edges, per_type=10):
    """Table of the strongest selected edges per type."""
    columns = ["kind", "rank", "edge", "pk", "pk_norm", "z_iso", "log10_p_iso", "q_model", "cs"]
    return _strongest(edges, per_type)[columns].set_index(["kind", "rank"])


def effect_columns(edges):
    """The causal effect columns (EFFECT_COLUMNS) that `edges` has with at least one value."""
    return [c for c in EFFECT_COLUMNS if c in edges.columns and edges[c].notna().any()]


def findings_edges(edges, per_type=FINDINGS_PER_TYPE):
    """The strongest selected edges per type by PK with q_model, CS and the causal effects the run has
    (`effect_columns`), each effect as "value [lo, hi]" (3 significant digits) when its 95 % interval columns
    are there."""
    table = _strongest(edges, per_type)
    out = table[["kind", "rank", "edge", "pk", "q_model", "cs"]]
    for column in effect_columns(table):
        bounds = [f"{column}_lo", f"{column}_hi"]
        if set(bounds) <= set(table.columns):
            cells = [_short(v) if pd.isna(v) else f"{_short(v)} [{_short(lo)}, {_short(hi)}]"
                     for v, lo, hi in zip(table[column], table[bounds[0]], table[bounds[1]])]
        else:
            cells = [_short(v) for v in table[column]]
        out = out.assign(**{column: cells})
    return out.set_index(["kind", "rank"])


def findings_warnings(run):
    """What qualifies the findings, as sentences: a causal stage not run or skipped, no role tests or roles the
    tokenizer could not test, the weight processing's warnings, and (one sentence) the types on which attribution
    ranks the exactly patched edges unlike their loss effects (run.json `causal.agreement`: Spearman rho below
    AGREEMENT_RHO, the causal stage's own bar)."""
    causal = run.record.causal
    warnings = []
    if causal is None:
        warnings.append("Causal effects were not computed (the run was made without its causal stage, e.g. "
                        "`--no-causal`): every edge rests on the weights alone.")
    elif "skipped" in causal:
        warnings.append(f"Causal effects were skipped: {causal['skipped']}. Every edge rests on the weights alone.")
    if not role_names(run.heads):
        warnings.append("No head roles were tested (`--no-roles`): a hub without roles here is untested, "
                        "not role-less.")
    skipped_roles = (run.record.roles.skipped_roles if run.record.roles else None) or {}
    warnings += [f"Role `{role}` was not tested: {why}." for role, why in skipped_roles.items()]
    warnings += [f"Weight processing: {warning}" for warning in run.record.processing_warnings]
    agreement = (causal or {}).get("agreement", {})
    poor = [f"{tp} ρ {agreement[tp]['spearman']:.2f} ({agreement[tp]['edges']} edges)" for tp in TYPE_PAIRS
            if agreement.get(tp, {}).get("spearman") is not None and agreement[tp]["spearman"] < AGREEMENT_RHO]
    if poor:
        warnings.append(f"Attribution agrees poorly with exact patching on {', '.join(poor)}: the Spearman ρ between "
                        f"`effect_attr` and `effect_loss` over the edges patched exactly is below {AGREEMENT_RHO}; "
                        "trust `effect_loss` there.")
    return warnings


# ---------------------------------------------------------------- rendering (markdown and html)

def _fmt(value):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        if math.isinf(value):
            return "−inf" if value < 0 else "inf"
        return f"{value:.4g}"
    return str(value)


def _short(value):
    return _fmt(value) if pd.isna(value) else f"{value:.3g}"


def _rows(table):
    index_names = [n or "" for n in table.index.names]
    header = index_names + [str(c) for c in table.columns]
    body = []
    for idx, row in zip(table.index, table.itertuples(index=False)):
        idx = idx if isinstance(idx, tuple) else (idx,)
        body.append([_fmt(v) for v in idx] + [_fmt(v) for v in row])
    return header, body


def _md_table(table):
    header, body = _rows(table)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    return "\n".join(lines)


def _html_table(table):
    header, body = _rows(table)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _html_inline(text):
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)


def to_markdown(blocks):
    """Markdown for report blocks: ("h", level, text), ("p", text), ("table", DataFrame), ("fig", caption, paths),
    ("nowrap table", DataFrame: a table whose cells report.html keeps on one line, scrolling it when too wide),
    ("warnings", [sentence, ...]), ("interactive", HTML fragment: only report.html shows it; the markdown links
    to the page)."""
    out = []
    for block in blocks:
        kind = block[0]
        if kind == "h":
            out.append("#" * block[1] + " " + block[2])
        elif kind == "p":
            out.append(block[1])
        elif kind in ("table", "nowrap table"):
            out.append(_md_table(block[1]))
        elif kind == "fig":
            out.append(f"![{block[1]}]({block[2]['png'].name})\n\n*{block[1]}* (vector: `{block[2]['svg'].name}`)")
        elif kind == "warnings":
            out.append("**Warnings**\n\n" + "\n".join(f"- {line}" for line in block[1]))
        elif kind == "interactive":
            out.append("The interactive graph (hover an edge, click a head, filter by type and PK) is in "
                       "[report.html](report.html); `headgraph view <run folder>` opens it.")
    return "\n\n".join(out) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}th,td{border:1px solid #ccc;padding:3px 8px;
text-align:left}th{background:#f2f2f2}img{max-width:100%}figure{margin:1.5em 0}figcaption{font-style:italic}
code{background:#f4f4f4;padding:0 3px}
.warnings{background:#fff4e0;border-left:4px solid #e69500;padding:.6em 1em;margin:1em 0}
.warnings ul{margin:.3em 0;padding-left:1.4em}.nowrap{overflow-x:auto}.nowrap table{font-size:.8em}.nowrap td{white-space:nowrap}"""


_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
"""The page's Content-Security-Policy: the browser itself refuses to fetch anything (the page is self-contained)."""


def to_html(blocks, title):
    """A self-contained HTML page for report blocks; figures are embedded as base64 PNG, the interactive graph
    inline, and the page forbids itself any fetch (`_CSP`)."""
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'>"
           f"<meta http-equiv='Content-Security-Policy' content=\"{_CSP}\"><title>{html.escape(title)}</title>"
           f"<style>{_CSS}</style></head><body>"]
    for block in blocks:
        kind = block[0]
        if kind == "h":
            out.append(f"<h{block[1]}>{_html_inline(block[2])}</h{block[1]}>")
        elif kind == "p":
            out.append(f"<p>{_html_inline(block[1])}</p>")
        elif kind == "table":
            out.append(_html_table(block[1]))
        elif kind == "nowrap table":
            out.append(f"<div class='nowrap'>{_html_table(block[1])}</div>")
        elif kind == "fig":
            data = base64.b64encode(block[2]["png"].read_bytes()).decode("ascii")
            caption = html.escape(block[1])
            out.append(f"<figure><img alt='{caption}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{caption}</figcaption></figure>")
        elif kind == "warnings":
            items = "".join(f"<li>{_html_inline(line)}</li>" for line in block[1])
            out.append(f"<div class='warnings'><strong>Warnings</strong><ul>{items}</ul></div>")
        elif kind == "interactive":
            out.append(block[1])
    out.append("</body></html>")
    return "\n".join(out)


# ---------------------------------------------------------------- the story

def _settings_table(run):
    record, dims = run.record, run.record.dims
    reference = record.reference
    kv = dims.n_kv_heads
    rows = {
        "model": run.model,
        "source": record.model.source,
        "architecture": record.model.architecture,
        "layers × heads": f"{dims.n_layers} × {dims.n_heads}" + (f" ({kv} KV heads)" if kv not in (None, dims.n_heads) else ""),
        "d_model / d_head": f"{dims.d_model} / {dims.d_head}",
        "weight processing": record.processing,
        "processing warnings": "; ".join(record.processing_warnings) or "none",
        "dtype / device": f"{record.dtype} / {record.device}",
        "seed": record.seed,
        "type pairs computed": ", ".join(run.type_pairs) or "none",
        "pairs": f"{len(run.pairs)} ({record.pairs})",
        "heads below full rank": len(record.rank_deficient_heads),
        "reference sampler": f"{reference.get('sampler')} ({reference.get('samples')} samples)",
        "KL grid": "bin width {bin_width:.4g} from {start:g}, ε {eps:g}".format(**reference["kl_grid"])
                   if "kl_grid" in reference else None,
    }
    if record.sweep is not None:
        rows["sweep (step)"] = f"{record.sweep} ({'no step' if record.step is None else record.step})"
    rows.update({f"null for {key}": value for key, value in record.nulls.items()})
    rows.update({f"time {key} (s)": value for key, value in record.timings_s.items()})
    rows.update({"headgraph version": record.headgraph_version, "created": record.created})
    return pd.DataFrame({"value": [_fmt(v) for v in rows.values()]}, index=pd.Index(list(rows), name="setting"))


def _informativeness_text(summary):
    with_kl = summary.dropna(subset=["kl"])
    if with_kl.empty:
        return "No KL values were computed for this run."
    best, worst = with_kl["kl"].astype(float).idxmax(), with_kl["kl"].astype(float).idxmin()
    return (f"The most informative computed type pair is **{best}** (KL {_fmt(with_kl.loc[best, 'kl'])} nats, "
            f"mean PK {_fmt(with_kl.loc[best, 'mean_pk'])} vs reference {_fmt(with_kl.loc[best, 'ref_mean'])}); "
            f"the least is **{worst}** (KL {_fmt(with_kl.loc[worst, 'kl'])} nats). "
            "`mean_z` is the distance of the observed mean from the reference mean in reference sd; trained "
            "weights are anisotropic, so large values are expected and the calibrated q-values are the "
            "per-edge measure to trust.")


def _no_pairs_text(run):
    """Why a run has no head pairs, and so no edges."""
    if run.record.dims.n_layers == 1:
        return ("**No head pairs**: this model has a single layer, so no head has a later head to compare with and "
                "the graph has 0 edges. `headgraph analyze --full-matrix` also compares heads within a layer.")
    return "**No head pairs** were computed for this run, so the graph has 0 edges."


def _hub_text(hubs):
    lines = []
    for head, row in hubs.head(3).iterrows():
        lines.append(f"**{head}** ({row['degree']} edges: {row['in']} in, {row['out']} out) — "
                     f"in from {row['in-edges (strongest per type)']}; out to {row['out-edges (strongest per type)']}; "
                     f"significant roles: {row['significant roles']}; in the top 10 of {row['top-10 under']}.")
    return " ".join(lines)


def _kl_table(kl):
    return pd.DataFrame([[kl[s + t] for t in WEIGHT_TYPES] for s in WEIGHT_TYPES],
                        index=pd.Index(WEIGHT_TYPES, name="source \\ target"),
                        columns=list(WEIGHT_TYPES))


def class_evaluation(run, classes, top_k):
    """In-class / out-of-class head counts and AUCs of PK and CS (None without composition pairs)."""
    types = [tp for tp in COMPOSITION_TYPES if tp in run.type_pairs]
    if not types:
        return None
    return evaluate_pairs(run.pairs, classes, k=top_k, types=types).set_index(["metric", "scope"])


FIGURES = ("pk_distributions", "kl_heatmap", "pk_vs_cs", "causal", "topk_graph", "roles", "hubs")
"""The report's figures (a)–(g), by name; each is written as fig_<name>.png / .svg."""
FIGURE_COUNT = len(FIGURES)


def figure_builders(run, edges, centrality, classes=None, hub_order=None, selection="selected edges"):
    """{name in FIGURES: a function that draws it as a matplotlib Figure, or returns None when the run lacks
    its data (no causal effects, no roles)}."""
    model = run.model
    n_layers, n_heads = run.record.dims.n_layers, run.record.dims.n_heads
    class_sets = dict(classes.classes) if classes is not None else None
    measures = ["pagerank", "hits_hub", "hits_authority", "betweenness", "weighted_degree"]
    return {
        "pk_distributions": lambda: figures.pk_distributions(run.pairs, run.record.reference_by_type, run.record.kl_by_type, model),
        "kl_heatmap": lambda: figures.kl_heatmap(run.record.kl_by_type, model),
        "pk_vs_cs": lambda: figures.pk_vs_cs(run.pairs, model),
        "causal": lambda: figures.effect_scatter(run.pairs, model, CAUSAL_THRESHOLD,
                                                 causal_pairs(run.pairs, CAUSAL_THRESHOLD))
        if "effect_lo" in run.pairs.columns else None,
        "topk_graph": lambda: figures.topk_graph(edges, n_layers, n_heads, model, class_sets,
                                                 selection=selection, n_kv_heads=run.record.dims.n_kv_heads),
        "roles": lambda: figures.role_heatmaps(run.heads, model,
                                               tau=run.record.roles.tau if run.record.roles else RoleOptions.tau),
        "hubs": lambda: figures.hub_centralities(edges, model, centrality.set_index("name")[measures],
                                                 heads=hub_order),
    }


def selection_figures(run, selected, classes=None):
    """`figure_builders` for a run's SelectedGraph, with the hub order of the report's hub table."""
    return figure_builders(run, selected.edges, selected.centrality, classes,
                           hub_order=list(hub_table(selected.hubs, run.heads).index),
                           selection=selected.policy.describe())


_PENDING: dict = {}  # what forked figure workers draw: {"builders": ..., "out_dir": ...}, set only while they run


def _draw(name):
    fig = _PENDING["builders"][name]()
    return name, None if fig is None else figures.save_figure(fig, _PENDING["out_dir"], f"fig_{name}")


def _figure_workers(n_figures: int) -> int:
    """Processes to draw figures in: one per CPU (at most 4) where processes fork (Linux), else 1; always 1 in a
    Jupyter kernel, whose inline backend shows figures in the kernel process itself, and in a daemonic process
    (a multiprocessing.Pool worker), which may not have children."""
    if sys.platform != "linux" or "ipykernel" in sys.modules or multiprocessing.current_process().daemon:
        return 1
    return max(1, min(n_figures, os.cpu_count() or 1, 4))


def _start_figure_worker() -> None:
    """A figure worker ignores Ctrl-C, which reaches the whole process group (the parent aborts and terminates
    its workers), and asks Linux to SIGKILL it when the parent dies (prctl PR_SET_PDEATHSIG), so that none
    outlives a killed `headgraph` process."""
    import ctypes

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


@contextlib.contextmanager
def _ctrl_c_held():
    """Hold Ctrl-C (SIGINT) back while the enclosed code runs, then deliver it: one that lands in fork() would
    surface in an at-fork handler, where Python prints and drops it, and the command would go on as if never
    interrupted. Only the main thread handles signals; elsewhere nothing is held."""
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or handler is None:
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda *_: held.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if held:
            signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def drawing_figures(builders, out_dir, advance=lambda: None):
    """Draw the figures of `builders` (figure_builders) that the run's data allows while the enclosed code runs;
    yields a function that waits for them and returns {"fig_<name>": {"png": path, "svg": path}} in `builders`'
    order. advance() is called after each figure (FIGURE_COUNT calls), e.g. to move a progress bar.

    Each figure is one independent drawing (saved as PNG, then SVG), so they are drawn in forked worker
    processes, the largest (the role heatmaps) first, where `_figure_workers` allows more than one; else one
    after another when the function is called."""
    workers = _figure_workers(len(builders))
    order = sorted(builders, key=lambda name: name != "roles")

    def collect(results):
        drawn = {}
        for name, paths in results:
            drawn[name] = paths
            advance()
        return {f"fig_{name}": drawn[name] for name in builders if drawn[name] is not None}

    _PENDING.update(builders=builders, out_dir=out_dir)
    try:
        if workers == 1:
            yield lambda: collect(map(_draw, order))
            return
        with contextlib.ExitStack() as stack:
            with _ctrl_c_held():  # while the workers fork
                pool = stack.enter_context(multiprocessing.get_context("fork").Pool(workers, _start_figure_worker))
            results = pool.imap_unordered(_draw, order)
            yield lambda: collect(results)
    finally:
        _PENDING.clear()


def _interactive_blocks(run, selected, classes):
    """The interactive graph of the selected edges (headgraph.report.interactive), or why it is left out."""
    n_edges = len(selected.edges)
    if n_edges == 0:
        return []
    if n_edges > MAX_EDGES:
        return [("p", f"The interactive graph is left out: {n_edges} selected edges are more than it draws "
                      f"({MAX_EDGES}); narrow the selection with `--top-k` or `--max-q`.")]
    dims = run.record.dims
    fragment = interactive_graph(head_network(selected), dims.n_layers, dims.n_heads, dims.n_kv_heads,
                                 dict(classes.classes) if classes is not None else None)
    return [("h", 2, "Interactive graph"), ("interactive", fragment)]


def _stability_blocks(run):
    """"Stability": the run recomputed under each variant (stability.json, when `headgraph stability` ran)."""
    report = read_stability(run.path)
    if report is None:
        return []
    skipped = [f"{name} ({entry['skipped']})" for name, entry in report["variants"].items() if "skipped" in entry]
    flips = role_flips(report)
    text = ("The same analysis recomputed with one setting changed at a time; `pk_spearman` / `effect_spearman`: "
            "rank correlation with this run over the same pairs, `jaccard`: overlap of the selected edges, "
            "`significance_flips`: q_model <= 0.05 decisions that change. A value of 1 and no flips say the graph "
            "does not depend on that setting, not that it is right.")
    if flips:
        text += " Role decisions that flip: " + ", ".join(f"{name} {n}" for name, n in flips.items()) + "."
    if skipped:
        text += " Not run: " + ", ".join(skipped) + "."
    return [("h", 2, "Stability"), ("p", text), ("table", summary_rows(report))]


def _causal_blocks(run, figs, table):
    """"Do the edges carry information?": the strongest effects, PK and CS judged against them (`table`:
    causal_evaluation), the scatter."""
    causal = run.record.causal
    if causal is None:
        return []
    blocks = [("h", 2, "Do the edges carry information?")]
    if "skipped" in causal:
        return blocks + [("p", f"Causal effects were not computed: {causal['skipped']}.")]
    inputs = ", ".join(f"{n} {name}" for name, n in causal["inputs"].items())
    blocks.append(("p", f"Direct-path patching ({causal['ablation']} ablation) on {inputs} inputs ({causal['source']}). "
                        + "; ".join(_EFFECT_TEXT[c] for c in effect_columns(run.pairs)) + ". "
                        "Intervals: 95 % bootstrap over inputs. An effect is evidence on these inputs, not a "
                        "circuit."))
    with_effect = run.pairs[run.pairs["effect"].notna()]
    strongest = with_effect.assign(kind=with_effect["source_type"] + with_effect["target_type"]).sort_values(
        "effect", ascending=False).groupby("kind", sort=True).head(5)
    columns = ["kind", "source", "target", "effect", "effect_lo", "effect_hi", "pk", "cs"]
    columns += [f"{c}{end}" for c in ("effect_loss", "effect_attr") for end in ("", "_lo", "_hi")
                if f"{c}{end}" in strongest.columns]
    blocks += [("p", "Largest local effects per type:"),
               ("table", strongest.sort_values(["kind", "effect"], ascending=[True, False])[columns]
                .reset_index(drop=True))]
    blocks += [("p", f"PK and CS against the effects. {CAUSAL_DEFINITION.format(threshold=CAUSAL_THRESHOLD)}. "
                     "`spearman` with its 95 % bootstrap interval over pairs (pairs share heads: the interval is "
                     "optimistic); ROC / PR-AUC at finding the causal pairs; precision of the top-k pairs and of "
                     "the top c (c = causal pairs); `base_rate` is what a random ranking scores."),
               ("table", table)]
    if "fig_causal" in figs:
        blocks.append(("fig", "PK and CS against the local causal effect per type", figs["fig_causal"]))
    return blocks


def _findings_blocks(run, selected):
    """"Findings": the warnings that qualify them, the top hubs with their roles (the summary's `hub_rows`) and the
    strongest edges per type with their effects (`findings_edges`)."""
    edges, warnings = selected.edges, findings_warnings(run)
    blocks = [("h", 2, "Findings"), *([("warnings", warnings)] if warnings else [])]
    if run.pairs.empty:
        return blocks + [("p", _no_pairs_text(run))]
    blocks.append(("p", f"Selected graph: {selected.policy.describe()} ({len(edges)} edges). Each finding is "
                        "summarised here; the sections below give the detail."))
    if not len(edges):
        return blocks + [("p", "The selected graph has no edges, so no head is a hub.")]
    hubs = pd.DataFrame([{"head": h["head"], "degree": h["degree"], "PageRank": h["pagerank"],
                          "significant roles": ", ".join(h["roles"]) or "—"} for h in hub_rows(selected.hubs, run.heads)])
    effects = effect_columns(edges)
    measured = ("; ".join(_EFFECT_TEXT[c] for c in effects) + ". In brackets: the 95 % bootstrap interval over inputs. "
                "An effect is evidence on the run's inputs, not a circuit." if effects
                else "This run has no causal effects.")
    return blocks + [
        ("h", 3, "Top hubs"),
        ("p", "The heads with the most selected edges (degree), their PageRank in the selected graph and their "
              "significant roles. Many strong weight alignments make a hub, not a shown effect on the output."),
        ("table", hubs.set_index("head")),
        ("h", 3, "Strongest edges and their effects"),
        ("p", f"The {FINDINGS_PER_TYPE} strongest selected edges per type by PK, with their calibrated `q_model` "
              f"and Composition Score `cs`. {measured}"),
        ("nowrap table", findings_edges(edges)),
    ]


def report_blocks(run, selected, figs, evaluation=None, classes=None, causal_table=None):
    """The report as blocks (see `to_markdown`), findings first: the findings, the interactive graph of
    `selected` (a SelectedGraph, in report.html), the sections with the figures `figs`, the settings last;
    causal_table: causal_evaluation of the run's pairs when it has effects."""
    edges = selected.edges
    hubs = hub_table(selected.hubs, run.heads)
    summary = type_summary(run)
    blocks = [("h", 1, f"headgraph report — {run.model}"),
              ("p", f"Run folder `{run.path}`. Every z / p refers to the isotropic random-subspace (Haar) "
                    "reference; every q refers to the run's calibrated null named in the settings at the end."),
              *_findings_blocks(run, selected),
              *_interactive_blocks(run, selected, classes),
              ("h", 2, "Strongest edges"),
              ("p", f"Selected graph: {selected.policy.describe()} ({len(edges)} edges). `rank` is the PK rank "
                    "among all computed pairs of the type. Strongest per type:"),
              ("table", strongest_edges(edges))]
    for name, caption in (("fig_topk_graph", "Selected edges by layer and head, opacity = PK / max PK of type"),
                          ("fig_pk_vs_cs", "PK vs Composition Score with top-3 % cut-offs")):
        if name in figs:
            blocks.append(("fig", caption, figs[name]))
    blocks += [("h", 2, "Hubs"), *([("p", _hub_text(hubs)), ("table", hubs)] if len(edges)
                                    else [("p", "The selected graph has no edges, so no head is a hub.")])]
    if "fig_hubs" in figs:
        blocks.append(("fig", "Hub heads: degree by edge type and centralities", figs["fig_hubs"]))
    roles = role_counts_by_layer(run.heads)
    blocks.append(("h", 2, "Head roles"))
    if roles is None:
        blocks.append(("p", "No role results in heads.parquet (run `headgraph analyze` with roles)."))
    else:
        blocks += [("p", "Heads with a significant role, per layer:"), ("table", roles)]
    if "fig_roles" in figs:
        blocks.append(("fig", "Role scores by layer and head", figs["fig_roles"]))
    blocks += _causal_blocks(run, figs, causal_table)
    blocks += [("h", 2, "Informativeness per weight-type pair"),
               ("p", _informativeness_text(summary)),
               ("table", summary.rename(columns={"q_below": "edges q<0.05", "top_cutoff": "top-3% cut-off"})),
               ("p", "KL(random ‖ observed) in nats, rows = source type, columns = target type (— = not computed):"),
               ("table", _kl_table(run.record.kl_by_type))]
    for name, caption in (("fig_pk_distributions", "PK distribution per type pair against the random reference"),
                          ("fig_kl_heatmap", "KL(random ‖ observed) per type pair")):
        if name in figs:
            blocks.append(("fig", caption, figs[name]))
    blocks += _stability_blocks(run)
    if evaluation is not None:
        blocks += [("h", 2, "Known head classes"),
                   ("p", f"Class set `{classes.name}` ({classes.source}). `in_class` / `out_of_class` count the "
                         "distinct heads of the top-k union graph per metric; the AUCs measure how well the metric "
                         "separates pairs whose heads are both in a known class from the rest."),
                   ("table", evaluation)]
    return blocks + [("h", 2, "Model and settings"), ("table", _settings_table(run))]


def render_report(run_dir, *, policy=SelectionPolicy(), classes=None, out_dir=None, advance=lambda: None,
                  selected=None):
    """Render figures, report.md and report.html for a run folder (or a loaded RunFolder); return {name: path}.

    policy: the edge selection (default: top 20 per type by PK); classes: a HeadClasses (default: the
    project's known classes for the model, if any). Output goes to out_dir (default: the run folder).
    advance() is called FIGURE_COUNT + 1 times as the work proceeds. selected: the SelectedGraph of this run
    and policy when the caller already has it (headgraph.analysis.selection.select_graph); else computed here.
    """
    run = run_dir if isinstance(run_dir, RunFolder) else load_run(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run.path
    classes = classes if classes is not None else default_classes(run.model)
    selected = selected if selected is not None else select_graph(run.pairs, run.heads, policy)
    with drawing_figures(selection_figures(run, selected, classes), out_dir, advance=advance) as figures_drawn:
        # the evaluations while the figures are drawn
        evaluation = class_evaluation(run, classes, policy.top_k or DEFAULT_EVAL_K) if classes is not None else None
        causal_table = causal_evaluation(run.pairs, CAUSAL_THRESHOLD) if run.record.has_effects else None
        figs = figures_drawn()
    blocks = report_blocks(run, selected, figs, evaluation, classes, causal_table)
    paths = {"report.md": out_dir / "report.md", "report.html": out_dir / "report.html"}
    paths["report.md"].write_text(to_markdown(blocks))
    paths["report.html"].write_text(to_html(blocks, f"headgraph report — {run.model}"))
    advance()
    for name, files in figs.items():
        paths[f"{name}.png"], paths[f"{name}.svg"] = files["png"], files["svg"]
    return paths


def report_page(run_dir):
    """The run folder's report.html, rendered first (default selection and classes) when the folder has none;
    (path, whether it was rendered now). An existing page is shown as it is: `headgraph report` re-renders it."""
    path = Path(run_dir) / "report.html"
    if path.is_file():
        return path, False
    return render_report(run_dir)["report.html"], True
