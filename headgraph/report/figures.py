"""Figures of one analysis run (matplotlib, Agg): each function builds one Figure from DataFrames/dicts.

`save_figure` writes it as PNG and SVG. Colours are shared across the project: `TYPE_COLORS` for edge
types (weight pairs such as "OK") and `CLASS_COLORS` for known head classes and roles; the Neo4j
Browser style uses the same values.
"""

import math
import sys
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules:  # a Jupyter kernel keeps its own (inline) backend, so figures show there
    matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle  # noqa: E402
from matplotlib.path import Path as GlyphPath  # noqa: E402
from matplotlib.textpath import TextPath  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402
from matplotlib.transforms import Affine2D  # noqa: E402
from scipy import stats  # noqa: E402

from headgraph.analysis.artifacts import role_names  # noqa: E402
from headgraph.analysis.options import RoleOptions  # noqa: E402
from headgraph.analysis.reference import beta_parameters  # noqa: E402
from headgraph.heads import COMPOSITION_TYPES, TYPE_PAIRS, WEIGHT_TYPES, head_name  # noqa: E402

_TAB10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
_TAB20_LIGHT = ["#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5"]
_OTHER_COLORS = [_TAB10[i] for i in (3, 4, 5, 6, 8, 9)] + _TAB20_LIGHT + [_TAB10[7]]

#: Edge colour per weight pair: OQ tab:blue, OK tab:orange, OV tab:green, the other 13 from the rest of
#: tab10 and its light tab20 partners (one map for figures, reports and the Browser style).
TYPE_COLORS = {
    "OQ": _TAB10[0], "OK": _TAB10[1], "OV": _TAB10[2],
    **dict(zip([tp for tp in TYPE_PAIRS if tp not in COMPOSITION_TYPES], _OTHER_COLORS)),
}

#: Node colour per known head class / role (keys lower-case with underscores; see `class_color`).
CLASS_COLORS = {
    "name_mover": "#e6194b",
    "backup_name_mover": "#f58231",
    "negative_name_mover": "#911eb4",
    "s_inhibition": "#4363d8",
    "induction": "#3cb44b",
    "duplicate_token": "#f032e6",
    "previous_token": "#42d4f4",
    "identity": "#ffe119",
    "bos": "#9a6324",
    "delimiter": "#469990",
    "local": "#808000",
    "block": "#000075",
    "syntactic": "#dcbeff",
}
_FALLBACK_CLASS_COLORS = ["#aaffc3", "#fabed4", "#ffd8b1", "#a9a9a9", "#800000", "#fffac8"]
NODE_COLOR = "#e0e0e0"

ISOTROPIC_NULL = "isotropic random subspaces (Haar)"


def class_color(name):
    """The colour of a known class or role name ("Induction", "previous-token", ...)."""
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    if key in CLASS_COLORS:
        return CLASS_COLORS[key]
    return _FALLBACK_CLASS_COLORS[sum(map(ord, key)) % len(_FALLBACK_CLASS_COLORS)]


def save_figure(fig, out_dir, stem):
    """Write `fig` as `<stem>.png` (150 dpi) and `<stem>.svg` into out_dir; close it; return both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"png": out_dir / f"{stem}.png", "svg": out_dir / f"{stem}.svg"}
    fig.savefig(paths["png"], dpi=150, bbox_inches="tight")
    fig.savefig(paths["svg"], bbox_inches="tight")
    plt.close(fig)
    return paths


_SUPERSCRIPTS = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _log_axis(axis):
    """Label a log axis' decades as plain-text 10ⁿ and leave its minor ticks bare: matplotlib's default labels
    are mathtext, whose first parses took 0.7 s of the 1.8 s a PK-distribution figure took to draw and save."""
    decade = FuncFormatter(lambda value, _: f"10{str(round(math.log10(value))).translate(_SUPERSCRIPTS)}")
    axis.set_major_formatter(decade)
    axis.set_minor_formatter(NullFormatter())


def reference_distribution(mean, var, upper):
    """Beta distribution on [0, upper] with the given mean and variance (the isotropic PK reference)."""
    a, b = beta_parameters(mean, var, upper)
    return stats.beta(float(a), float(b), scale=upper)


def _grid(n, max_cols=4):
    cols = min(int(np.ceil(np.sqrt(n))), max_cols)
    return int(np.ceil(n / cols)), cols


def _present_types(pairs):
    present = set(pairs["source_type"] + pairs["target_type"])
    return [tp for tp in TYPE_PAIRS if tp in present]


def _histogram_range(values, ref_lo, ref_hi, upper, max_stretch=8.0):
    """The x range of a PK histogram: all values and the reference's ±5 sd, unless a few far outliers would
    stretch it more than `max_stretch` times the bulk (1 %–99 % of values), then the bulk only."""
    q_lo, q_hi = np.quantile(values, [0.01, 0.99], method="inverted_cdf")
    bulk = (min(q_lo, ref_lo), max(q_hi, ref_hi))
    full = (min(values.min(), ref_lo), max(values.max(), ref_hi))
    lo, hi = full if full[1] - full[0] <= max_stretch * (bulk[1] - bulk[0]) else bulk
    if hi - lo < 1e-3 * upper:  # a constant PK (subspaces as wide as d_model): a window around it
        lo, hi = lo - 0.5, hi + 0.5
    return max(0.0, lo), min(upper, hi)


def pk_distributions(pairs, reference, kl, model):
    """Histogram of PK per type pair against its isotropic reference density; KL in each title.

    reference: {type pair: {"mean", "var", "k", "k_prime"}}; kl: {type pair: nats or None}. None without pairs.
    """
    types = _present_types(pairs)
    if not types:
        return None
    nrows, ncols = _grid(len(types))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    pk_by_type = pairs.groupby(pairs["source_type"] + pairs["target_type"])["pk"]
    for ax, tp in zip(axes.flat, types):
        values = pk_by_type.get_group(tp).to_numpy()
        ref = reference[tp]
        sd = np.sqrt(ref["var"])
        upper = min(ref["k"], ref["k_prime"])
        lo, hi = _histogram_range(values, ref["mean"] - 5 * sd, ref["mean"] + 5 * sd, float(upper))
        bins = np.linspace(lo, hi, 61)
        shown = values[(values >= lo) & (values <= hi)]
        heights, _, _ = ax.hist(shown, bins=bins, weights=np.full(len(shown), 1 / (len(values) * (bins[1] - bins[0]))),
                                color=TYPE_COLORS[tp], alpha=0.75, label=f"observed ({len(values):,} pairs)")
        outside = values[(values < lo) | (values > hi)]
        if len(outside):
            ax.text(0.98, 0.45, f"{len(outside)} pair(s) off scale\n(range {outside.min():.3g} … {outside.max():.3g})",
                    transform=ax.transAxes, ha="right", fontsize=7, color=TYPE_COLORS[tp])
        xs = np.linspace(lo, hi, 600)
        if ref["var"] > 0:
            density = reference_distribution(ref["mean"], ref["var"], upper).pdf(xs)
            ax.plot(xs, density, color="black", lw=1.4, label="random reference (Beta)")
        else:  # a subspace as wide as d_model: the reference PK is the constant k·k'/d
            density = np.zeros_like(xs)
        ax.axvline(ref["mean"], color="black", ls="--", lw=1,
                   label=f"reference mean k·k'/d = {ref['mean']:.3g}")
        ax.axvline(values.mean(), color=TYPE_COLORS[tp], ls=":", lw=1.6,
                   label=f"observed mean = {values.mean():.3g}")
        if density.any() and (density.max() > 5 * max(heights.max(), 1e-12) or heights.max() > 5 * density.max()):
            ax.set_yscale("log")
            _log_axis(ax.yaxis)
            ax.set_ylim(bottom=max(min(heights[heights > 0].min(), density.max()) / 10, 1e-4),
                        top=5 * max(heights.max(), density.max()))
            ax.set_ylabel("density (1/PK, log scale)")
        else:
            ax.set_ylabel("density (1/PK)")
        kl_text = "not computed" if kl.get(tp) is None else f"{kl[tp]:.3f} nats"
        ax.set_title(f"{tp[0]}→{tp[1]}   KL(random‖observed) = {kl_text}", fontsize=10)
        ax.set_xlabel(f"PK (0 … {upper})")
        ax.legend(fontsize=7, loc="upper right")
    for ax in axes.flat[len(types):]:
        ax.set_visible(False)
    fig.suptitle(f"{model}: Projection Kernel per weight-type pair (bars) vs random reference (null: {ISOTROPIC_NULL})")
    fig.tight_layout()
    return fig


def kl_heatmap(kl, model):
    """4×4 KL(random‖observed) heatmap, rows source type, columns target type, grey where not computed."""
    matrix = np.array([[np.nan if kl.get(s + t) is None else kl[s + t] for t in WEIGHT_TYPES]
                       for s in WEIGHT_TYPES], dtype=float)
    fig, ax = plt.subplots(figsize=(5.8, 4.8))
    cmap = plt.get_cmap("viridis").with_extremes(bad="#bdbdbd")
    finite = matrix[np.isfinite(matrix)]
    vmax = finite.max() if finite.size else 1.0
    im = ax.imshow(np.ma.masked_invalid(matrix), cmap=cmap, vmin=0, vmax=vmax)
    for (i, j), value in np.ndenumerate(matrix):
        if np.isfinite(value):
            ax.text(j, i, f"{value:.3f}", ha="center", va="center",
                    color="white" if value < 0.6 * vmax else "black", fontsize=11)
        else:
            ax.text(j, i, "n/c", ha="center", va="center", color="#555555", fontsize=9)
    ax.set_xticks(range(4), WEIGHT_TYPES)
    ax.set_yticks(range(4), WEIGHT_TYPES)
    ax.set_xlabel("target weight type (later head)")
    ax.set_ylabel("source weight type (earlier head)")
    fig.colorbar(im, ax=ax, label="KL(random ‖ observed) (nats)")
    ax.legend(handles=[Patch(color="#bdbdbd", label="n/c = not computed")], loc="upper center",
              bbox_to_anchor=(0.5, -0.14), fontsize=8, frameon=False)
    ax.set_title(f"{model}: informativeness of each weight pair\n(reference: {ISOTROPIC_NULL})",
                 fontsize=10)
    fig.tight_layout()
    return fig


def top_fraction_cutoff(values, fraction=0.03):
    """The value above which the top `fraction` of values lie."""
    return float(np.quantile(np.asarray(values, dtype=float), 1 - fraction))


NO_CS_REASON = "it is per query head; these pairs' receivers are KV heads"  # a grouped-query model's OK / OV


def pk_vs_cs(pairs, model, fraction=0.03):
    """PK against Composition Score per composition type with the top-`fraction` cut-offs, the types without CS
    named in the title (a grouped-query model's OK / OV: their receivers are KV heads); None if no CS."""
    with_cs = pairs[pairs["cs"].notna()]
    types = [tp for tp in COMPOSITION_TYPES if tp in set(with_cs["source_type"] + with_cs["target_type"])]
    if not types:
        return None
    lacking = [tp for tp in COMPOSITION_TYPES if tp in set(pairs["source_type"] + pairs["target_type"])
               and tp not in types]
    fig, axes = plt.subplots(1, len(types), figsize=(5 * len(types), 4.4), squeeze=False)
    pct = f"{fraction * 100:g} %"
    for ax, tp in zip(axes.flat, types):
        sub = with_cs[(with_cs["source_type"] == tp[0]) & (with_cs["target_type"] == tp[1])]
        pk_cut, cs_cut = top_fraction_cutoff(sub["pk"], fraction), top_fraction_cutoff(sub["cs"], fraction)
        both = int(((sub["pk"] > pk_cut) & (sub["cs"] > cs_cut)).sum())
        ax.scatter(sub["cs"], sub["pk"], s=6, alpha=0.5, color=TYPE_COLORS[tp], rasterized=True,
                   label=f"head pairs ({len(sub):,})")
        ax.axhline(pk_cut, color="black", ls="--", lw=1, label=f"top-{pct} PK cut-off = {pk_cut:.3g}")
        ax.axvline(cs_cut, color="#d62728", ls="--", lw=1, label=f"top-{pct} CS cut-off = {cs_cut:.3g}")
        rho = stats.spearmanr(sub["cs"], sub["pk"]).statistic
        ax.set_title(f"{tp[0]}→{tp[1]}: Spearman ρ = {rho:.2f}; in both tops: {both}", fontsize=10)
        ax.set_xlabel("Composition Score (Elhage et al., unitless 0…1)")
        ax.set_ylabel("PK (raw)")
        ax.legend(fontsize=7, loc="upper left")
    title = f"{model}: Projection Kernel vs Composition Score, earlier → later head pairs"
    if lacking:
        title += f"\n{', '.join(lacking)}: no Composition Score ({NO_CS_REASON})"
    fig.suptitle(title, fontsize=10 if lacking else None)
    fig.tight_layout()
    return fig


def effect_scatter(pairs, model, threshold, causal):
    """PK (top row) and Composition Score (bottom row) against the local causal effect per composition type,
    the causal pairs (`causal`: bool per row of pairs) marked; None if the run has no effects."""
    if "effect" not in pairs.columns or pairs["effect"].isna().all():
        return None
    causal = pd.Series(np.asarray(causal, dtype=bool), index=pairs.index)
    with_effect = pairs[pairs["effect"].notna()]
    kinds = with_effect["source_type"] + with_effect["target_type"]
    types = [tp for tp in COMPOSITION_TYPES if tp in set(kinds)]
    fig, axes = plt.subplots(2, len(types), figsize=(4.6 * len(types), 7.6), squeeze=False)
    units = {"Q": "attention moved (TV)", "K": "attention moved (TV)", "V": "relative output change"}
    legends = []
    for col, tp in enumerate(types):
        sub = with_effect[kinds == tp]
        marked = causal[with_effect.index[kinds == tp]]
        for row, (metric, label) in enumerate((("pk", "PK (raw)"), ("cs", "Composition Score"))):
            ax = axes[row, col]
            part = sub[sub[metric].notna()]
            if part.empty:  # e.g. CS, defined per query head, of a grouped-query model's KV-head receivers
                ax.set_title(f"{tp[0]}→{tp[1]}", fontsize=10)
                why = f"\n({NO_CS_REASON})" if metric == "cs" else ""
                ax.text(0.5, 0.5, f"no {label} for these pairs{why}", ha="center", va="center", transform=ax.transAxes)
                ax.set_axis_off()
                continue
            hit = marked[part.index]
            ax.scatter(part.loc[~hit, metric], part.loc[~hit, "effect"], s=7, alpha=0.45, color="#999999",
                       rasterized=True, label=f"pairs ({int((~hit).sum()):,})")
            ax.scatter(part.loc[hit, metric], part.loc[hit, "effect"], s=12, alpha=0.8, color=TYPE_COLORS[tp],
                       rasterized=True, label=f"causal ({int(hit.sum()):,}): effect CI above {threshold:g}")
            ax.axhline(threshold, color="black", ls=":", lw=1)
            rho = stats.spearmanr(part[metric], part["effect"]).statistic if len(part) > 2 else float("nan")
            ax.set_title(f"{tp[0]}→{tp[1]}: Spearman ρ = {rho:.2f}", fontsize=10)
            ax.set_xlabel(label)
            ax.set_ylabel(f"local effect: {units[tp[1]]}")
            legends.append(ax.legend(fontsize=7, loc="best"))
    fig.suptitle(f"{model}: weights (PK, CS) against causal effect (direct-path patching), earlier → later pairs")
    fig.tight_layout()
    _fix_legends(fig, legends)
    return fig


def _fix_legends(fig, legends):
    """Fix each legend where matplotlib's loc="best" puts it in `fig` as laid out now: that search counts the
    points under each candidate box, and it runs at every draw (saving as PNG and SVG draws four times): 10.5 s
    of the 13.0 s that a 1.1B-parameter run's effect scatter took to save, 236,544 points in two of its panels."""
    fig.draw_without_rendering()
    for legend in legends:
        box = legend.get_window_extent().transformed(legend.axes.transAxes.inverted())
        legend.set_loc((box.x0, box.y0))


def head_classes(classes):
    """{head: first class name} from {class name: [heads]}."""
    owner = {}
    for name, heads in (classes or {}).items():
        for head in heads:
            owner.setdefault(head, name)
    return owner


def head_columns(names, index, n_heads, n_kv_heads):
    """The grid column of each head (names, index: Series): its index, or for a native KV head L{l}KV{g} of a
    grouped-query model the centre of its query-head group (the graph figure and the interactive view)."""
    group = n_heads // (n_kv_heads or n_heads)
    return np.where(names.str.contains("KV"), index * group + (group - 1) / 2, index).astype(float)


def topk_graph(edges, n_layers, n_heads, model, classes=None, selection="top-k per type by PK", n_kv_heads=None):
    """The selected edges drawn on a layer (rows, layer 0 at the top) × head (columns) grid.

    edges: DataFrame with source, target, source_layer, source_head, target_layer, target_head,
    source_type, target_type, pk. Opacity = PK / max PK of the edge's type. Each edge artist has the
    gid "edge:<source>-><target>:<type>" (kept in the SVG), each head node "head:<name>". Native KV heads
    of grouped-query models (L{l}KV{g}) are diamonds at the centre of their query-head group.
    classes: optional {class name: [head names]} colouring nodes. None without edges.
    """
    if edges.empty:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * n_heads + 3.5), max(4.0, 0.6 * n_layers + 2.0)))
    owner = head_classes(classes)
    edge_types = pd.Series(edges["source_type"] + edges["target_type"], index=edges.index)
    max_pk = edges.groupby(edge_types)["pk"].transform("max")
    alpha = (edges["pk"] / max_pk).clip(0, 1).fillna(0)
    type_order = [tp for tp in TYPE_PAIRS if tp in set(edge_types)]
    source_x = head_columns(edges["source"], edges["source_head"], n_heads, n_kv_heads)
    target_x = head_columns(edges["target"], edges["target_head"], n_heads, n_kv_heads)
    for i, (idx, row) in enumerate(edges.iterrows()):
        tp = edge_types[idx]
        rad = 0.18 + 0.1 * type_order.index(tp)
        arrow = FancyArrowPatch((source_x[i], row["source_layer"]), (target_x[i], row["target_layer"]),
                                connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>", mutation_scale=9,
                                color=TYPE_COLORS[tp], alpha=float(alpha[idx]), lw=1.6,
                                shrinkA=7, shrinkB=7, zorder=2)
        arrow.set_gid(f"edge:{row['source']}->{row['target']}:{tp}")
        ax.add_patch(arrow)
    involved = set(edges["source"]) | set(edges["target"])
    for layer in range(n_layers):
        for head in range(n_heads):
            name = head_name(layer, head)
            color = class_color(owner[name]) if name in owner else NODE_COLOR
            node = ax.scatter([head], [layer], s=150 if name in involved else 60, color=color,
                              edgecolors="black" if name in involved else "#9e9e9e", linewidths=0.8,
                              zorder=3)
            node.set_gid(f"head:{name}")
            if name in involved:
                ax.annotate(name, (head, layer), xytext=(0, -11), textcoords="offset points",
                            ha="center", va="top", fontsize=6.5, zorder=4)
    kv_ends = pd.DataFrame({"name": np.r_[edges["source"], edges["target"]],
                            "x": np.r_[source_x, target_x],
                            "layer": np.r_[edges["source_layer"], edges["target_layer"]]}).drop_duplicates("name")
    for name, x, layer in kv_ends[kv_ends["name"].str.contains("KV")].itertuples(index=False):
        node = ax.scatter([x], [layer], s=110, marker="D", color="white", edgecolors="black", linewidths=0.8,
                          zorder=3)
        node.set_gid(f"head:{name}")
        ax.annotate(name, (x, layer), xytext=(0, 9), textcoords="offset points", ha="center", va="bottom",
                    fontsize=6.5, zorder=4)
    ax.set_xlim(-0.8, n_heads - 0.2)
    ax.set_ylim(n_layers - 0.3, -0.7)
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set_xlabel("head index")
    ax.set_ylabel("layer (input at the top)")
    handles = [Line2D([], [], color=TYPE_COLORS[tp], lw=2, label=f"{tp} edge ({int((edge_types == tp).sum())})")
               for tp in type_order]
    present_classes = [c for c in (classes or {}) if any(owner.get(h) == c for h in owner)]
    handles += [Line2D([], [], marker="o", ls="", markerfacecolor=class_color(c), markeredgecolor="black",
                       markersize=8, label=c.replace("_", " ")) for c in present_classes]
    handles.append(Line2D([], [], marker="o", ls="", markerfacecolor=NODE_COLOR, markeredgecolor="#9e9e9e",
                          markersize=6, label="other head"))
    if kv_ends["name"].str.contains("KV").any():
        handles.append(Line2D([], [], marker="D", ls="", markerfacecolor="white", markeredgecolor="black",
                              markersize=6, label="KV head (shared by a query group)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
              title="edges (opacity = PK / max of type)\nand head classes", title_fontsize=8)
    ax.set_title(f"{model}: {len(edges)} edges, {selection}", fontsize=10)
    fig.tight_layout()
    return fig


def _layer_head_grid(heads, column):
    grid = np.full((int(heads["layer"].max()) + 1, int(heads["index"].max()) + 1), np.nan)
    grid[heads["layer"].to_numpy(int), heads["index"].to_numpy(int)] = heads[column].to_numpy(float)
    return grid


def cell_labels(ax, xy, texts, colors, fontsize):
    """Short labels (`texts`, centred on the data points `xy`, `fontsize` points tall, in `colors`) drawn as one
    PathCollection of their glyph outlines instead of one Text artist each: a role figure's hundreds of cell
    values then cost one draw call per panel, not a text layout per value, and look the same (matplotlib
    writes SVG text as paths by default too). Returns the collection; its offsets are `xy`."""
    prop = FontProperties(size=fontsize)
    outlines = {}
    for text in dict.fromkeys(texts):  # each distinct label laid out once
        glyphs = TextPath((0, 0), text, prop=prop)
        low, high = glyphs.vertices.min(0), glyphs.vertices.max(0)
        outlines[text] = GlyphPath(glyphs.vertices - (low + high) / 2, glyphs.codes)
    labels = PathCollection([outlines[text] for text in texts], offsets=xy, offset_transform=ax.transData,
                            facecolors=colors, edgecolors="none",
                            transform=Affine2D().scale(1 / 72) + ax.figure.dpi_scale_trans)
    ax.add_collection(labels, autolim=False)
    return labels


def role_heatmaps(heads, model, tau=RoleOptions.tau):
    """Layer × head heatmap per role score column (significant heads boxed); None if no role columns.

    Sieve bias scores share one colour range from 0 to at least the test threshold tau (marked on the
    colour bar), so a uniform head (score 1) never looks strong.
    """
    roles = [r for r in role_names(heads) if f"{r}_score" in heads]
    if not roles:
        return None
    n_layers, n_heads = int(heads["layer"].max()) + 1, int(heads["index"].max()) + 1
    nrows, ncols = _grid(len(roles), max_cols=3)
    annotate = n_layers * n_heads <= 256
    cell = 0.32 if annotate else 0.2  # inches per head: room for a 5.5 pt "12.34", else for the colour alone
    # each panel: its grid, plus the colour bar and labels beside it and the title and head axis below/above it
    fig, axes = plt.subplots(nrows, ncols, squeeze=False,
                             figsize=(ncols * (cell * n_heads + 1.9), nrows * (cell * n_layers + 1.1)))
    for ax, role in zip(axes.flat, roles):
        grid = _layer_head_grid(heads, f"{role}_score")
        if role == "identity":
            im = ax.imshow(grid, cmap="Greens", vmin=0, vmax=1, aspect="equal")
            fig.colorbar(im, ax=ax, label="mean self-attention (probability)", shrink=0.85)
        else:
            im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=max(tau * 1.25, np.nanmax(grid)), aspect="equal")
            bar = fig.colorbar(im, ax=ax, label=f"sieve bias (1 = uniform, τ = {tau:g})", shrink=0.85)
            bar.ax.axhline(tau, color="#d62728", lw=2)
        if f"{role}_sig" in heads:
            sig = heads[heads[f"{role}_sig"].astype(bool)]
            for layer, head in zip(sig["layer"], sig["index"]):
                ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, ec="#d62728", lw=2))
        if annotate:
            low, high = im.get_clim()
            light = ("white", "black") if role == "identity" else ("black", "white")  # (high, low) text colour
            layer, head = np.indices(grid.shape).reshape(2, -1)
            values = grid.ravel()
            cell_labels(ax, np.column_stack([head, layer]), [f"{value:.2f}" for value in values],
                        np.where(values - low > 0.6 * (high - low), *light), 5.5)
        ax.set_xticks(range(n_heads))
        ax.set_yticks(range(n_layers))
        ax.tick_params(labelsize=7)
        ax.set_xlabel("head index")
        ax.set_ylabel("layer")
        ax.set_title(f"{role.replace('_', ' ')} score" + ("  (red box = significant)" if f"{role}_sig" in heads
                                                          else ""), fontsize=9)
    for ax in axes.flat[len(roles):]:
        ax.set_visible(False)
    fig.suptitle(f"{model}: head role scores by layer and head")
    fig.tight_layout()
    return fig


def degree_by_type(edges):
    """Per head and type: in- and out-degree in the selected graph; columns in_<tp>, out_<tp>, degree."""
    tp = edges["source_type"] + edges["target_type"]
    out = pd.crosstab(edges["source"], tp).add_prefix("out_")
    inn = pd.crosstab(edges["target"], tp).add_prefix("in_")
    table = out.join(inn, how="outer").fillna(0).astype(int)
    table["degree"] = table.sum(axis=1)
    table.index.name = "head"
    return table.sort_values("degree", ascending=False)


def hub_centralities(edges, model, centralities=None, heads=None, top=10):
    """Hub chart: in/out degree by edge type (left) and normalised centralities (right) for the top heads.

    centralities: optional DataFrame indexed by head with numeric columns (pagerank, hits_hub, ...);
    heads: the hubs in rank order (default: the top heads by total degree in `edges`). None without edges.
    """
    if edges.empty:
        return None
    degrees = degree_by_type(edges)
    ranked = list(heads)[:top] if heads is not None else list(degrees.index[:top])
    degrees = degrees.reindex(ranked).fillna(0).iloc[::-1]
    heads = list(degrees.index)
    types = [tp for tp in TYPE_PAIRS if f"out_{tp}" in degrees or f"in_{tp}" in degrees]
    panels = 2 if centralities is not None and len(centralities.columns) else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 0.38 * len(heads) + 2.2), squeeze=False)
    ax = axes[0, 0]
    y = np.arange(len(heads))
    left_in, left_out = np.zeros(len(heads)), np.zeros(len(heads))
    for tp in types:
        inn = degrees[f"in_{tp}"].to_numpy(float) if f"in_{tp}" in degrees else np.zeros(len(heads))
        out = degrees[f"out_{tp}"].to_numpy(float) if f"out_{tp}" in degrees else np.zeros(len(heads))
        ax.barh(y, -inn, left=-left_in, color=TYPE_COLORS[tp], label=tp, edgecolor="white", lw=0.5)
        ax.barh(y, out, left=left_out, color=TYPE_COLORS[tp], edgecolor="white", lw=0.5)
        left_in += inn
        left_out += out
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(y, heads)
    limit = max(left_in.max(), left_out.max(), 1)
    ax.set_xlim(-limit * 1.1, limit * 1.1)
    ticks = ax.get_xticks()
    ax.set_xticks(ticks, [f"{abs(t):g}" for t in ticks])
    ax.set_xlabel("← in-edges   |   out-edges →   (number of selected edges)")
    ax.set_ylabel("head (hub rank, first at the top)")
    ax.legend(title="edge type", fontsize=8, title_fontsize=8, loc="lower right")
    ax.set_title("degree by edge type", fontsize=10)
    if panels == 2:
        ax2 = axes[0, 1]
        cols = list(centralities.columns)
        values = centralities.reindex(heads)[cols].astype(float)
        scaled = values / centralities[cols].astype(float).abs().max().replace(0, 1)
        width = 0.8 / len(cols)
        colors = plt.get_cmap("Set2").colors
        for i, col in enumerate(cols):
            ax2.barh(y + (i - (len(cols) - 1) / 2) * width, scaled[col].fillna(0), height=width,
                     color=colors[i % len(colors)], label=col.replace("_", " "))
        ax2.set_yticks(y, heads)
        ax2.set_xlim(0, 1.05)
        ax2.set_xlabel("centrality / its maximum over all heads")
        ax2.legend(fontsize=8, loc="lower right")
        ax2.set_title("centralities (networkx, selected graph)", fontsize=10)
    fig.suptitle(f"{model}: hub heads of the selected graph ({len(edges)} edges)")
    fig.tight_layout()
    return fig
