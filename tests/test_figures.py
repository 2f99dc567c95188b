"""Figures: files are valid PNG/SVG and each figure encodes exactly the data it claims to."""

import json
import unicodedata
import xml.etree.ElementTree as ET

import matplotlib.colors as mcolors
import matplotlib.image as mimage
import numpy as np
import pandas as pd
import pytest
from _runfolder import build_bases, plant, write_run
from matplotlib.collections import PathCollection
from matplotlib.patches import FancyArrowPatch, Rectangle

from headgraph.analysis.selection import SelectionPolicy, select_edges
from headgraph.report import figures
from headgraph.runs import load_run

N_LAYERS, N_HEADS, D_MODEL, D_HEAD = 4, 4, 64, 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    bases = build_bases(N_LAYERS, N_HEADS, D_MODEL, D_HEAD, seed=3)
    plant(bases, (0, 2), (2, 1), "K")
    folder = write_run(tmp_path_factory.mktemp("run"), bases=bases)
    meta = json.loads((folder / "run.json").read_text())
    kl = {r + c: meta["kl"]["matrix"][i][j] for i, r in enumerate("QKVO") for j, c in enumerate("QKVO")}
    return {"dir": folder, "meta": meta, "kl": kl, "reference": load_run(folder).record.reference_by_type, "pairs": pd.read_parquet(folder / "pairs.parquet"),
            "heads": pd.read_parquet(folder / "heads.parquet")}


def _svg_ids(path):
    return {el.get("id") for el in ET.parse(path).iter() if el.get("id")}


def test_save_figure_writes_valid_png_and_svg(run, tmp_path):
    paths = figures.save_figure(figures.kl_heatmap(run["kl"], "m"), tmp_path, "kl")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = mimage.imread(paths["png"])
    assert image.shape[0] > 200 and image.shape[1] > 200
    assert ET.parse(paths["svg"]).getroot().tag == "{http://www.w3.org/2000/svg}svg"


def test_type_colours_follow_tab10_for_composition_and_are_distinct():
    assert figures.TYPE_COLORS["OQ"] == mcolors.to_hex("tab:blue")
    assert figures.TYPE_COLORS["OK"] == mcolors.to_hex("tab:orange")
    assert figures.TYPE_COLORS["OV"] == mcolors.to_hex("tab:green")
    assert set(figures.TYPE_COLORS) == {s + t for s in "QKVO" for t in "QKVO"}
    assert len(set(figures.TYPE_COLORS.values())) == 16


def test_topk_graph_draws_exactly_the_selected_edges(run, tmp_path):
    edges = select_edges(run["pairs"], SelectionPolicy(top_k=4))
    fig = figures.topk_graph(edges, N_LAYERS, N_HEADS, "m", {"induction": ["L2H1"]})
    arrows = {p.get_gid(): p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)}
    expected = {f"edge:{s}->{t}:{k}" for s, t, k in zip(edges["source"], edges["target"], edges["kind"])}
    assert set(arrows) == expected and len(arrows) == len(edges) == 12
    # opacity = PK / max PK of the edge's type, computed here from the pairs table
    for s, t, k, pk in zip(edges["source"], edges["target"], edges["kind"], edges["pk"]):
        max_pk = edges.loc[edges["kind"] == k, "pk"].max()
        assert arrows[f"edge:{s}->{t}:{k}"].get_alpha() == pytest.approx(pk / max_pk)
        assert mcolors.to_hex(arrows[f"edge:{s}->{t}:{k}"].get_edgecolor()) == figures.TYPE_COLORS[k]
    paths = figures.save_figure(fig, tmp_path, "graph")
    ids = _svg_ids(paths["svg"])
    assert {i for i in ids if i.startswith("edge:")} == expected
    assert len({i for i in ids if i.startswith("head:")}) == N_LAYERS * N_HEADS


def test_topk_graph_colours_known_class_nodes(run):
    edges = select_edges(run["pairs"], SelectionPolicy(top_k=2))
    fig = figures.topk_graph(edges, N_LAYERS, N_HEADS, "m", {"induction": ["L2H1"], "identity": ["L0H1"]})
    nodes = {c.get_gid(): c for c in fig.axes[0].collections if (c.get_gid() or "").startswith("head:")}
    assert mcolors.to_hex(nodes["head:L2H1"].get_facecolor()[0]) == figures.CLASS_COLORS["induction"]
    assert mcolors.to_hex(nodes["head:L0H1"].get_facecolor()[0]) == figures.CLASS_COLORS["identity"]
    assert mcolors.to_hex(nodes["head:L3H3"].get_facecolor()[0]) == mcolors.to_hex(figures.NODE_COLOR)


def test_kl_heatmap_greys_uncomputed_cells_and_annotates_values(run):
    fig = figures.kl_heatmap(run["kl"], "m")
    ax = fig.axes[0]
    data = ax.images[0].get_array()
    for i, s in enumerate("QKVO"):
        for j, t in enumerate("QKVO"):
            assert bool(data.mask[i, j]) == (run["kl"][s + t] is None)
    texts = {t.get_text() for t in ax.texts}
    assert {f"{run['kl'][tp]:.3f}" for tp in ("OQ", "OK", "OV")} <= texts
    assert "n/c" in texts


@pytest.mark.slow
def test_reference_distribution_has_the_exact_moments():
    d, k = 768, 64
    mean = k * k / d
    var = 2 * k * k * (d - k) * (d - k) / (d**2 * (d - 1) * (d + 2))
    ref = figures.reference_distribution(mean, var, k)
    assert ref.mean() == pytest.approx(5.3333, abs=1e-4)
    assert ref.var() == pytest.approx(0.011655, rel=1e-3)
    # a sampled reference (Gaussian-block form of the method note) agrees in its upper tail
    d, k = 128, 16
    mean = k * k / d
    var = 2 * k * k * (d - k) * (d - k) / (d**2 * (d - 1) * (d + 2))
    ref = figures.reference_distribution(mean, var, k)
    rng = np.random.default_rng(0)
    g = rng.standard_normal((20000, d, k))
    g1 = g[:, :k, :]
    samples = np.einsum("nij,nji->n", np.linalg.inv(g.transpose(0, 2, 1) @ g), g1.transpose(0, 2, 1) @ g1)
    cut = np.quantile(samples, 0.95)
    assert ref.sf(cut) == pytest.approx(0.05, abs=0.006)


def test_pk_distributions_marks_the_reference_mean_and_kl(run):
    fig = figures.pk_distributions(run["pairs"], run["reference"], run["kl"], "synthetic")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 3
    for ax, tp in zip(axes, ("OQ", "OK", "OV")):
        assert f"{run['kl'][tp]:.3f}" in ax.get_title()
        vlines = [line.get_xdata()[0] for line in ax.lines if len(set(line.get_xdata())) == 1]
        assert pytest.approx(D_HEAD * D_HEAD / D_MODEL) in vlines
    assert "synthetic" in fig.get_suptitle() and "Haar" in fig.get_suptitle()


def test_a_spread_out_pk_histogram_gets_a_log_axis_labelled_in_plain_decades(run):
    pairs = run["pairs"].copy()
    oq = (pairs["source_type"] + pairs["target_type"]) == "OQ"
    pairs.loc[oq, "pk"] = np.linspace(0, D_HEAD, int(oq.sum()))  # flat, far below the reference's narrow peak
    fig = figures.pk_distributions(pairs, run["reference"], run["kl"], "synthetic")
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    low, high = ax.get_ylim()
    shown = [(tick, label.get_text()) for tick, label in zip(ax.get_yticks(), ax.get_yticklabels())
             if low <= tick <= high]
    assert len(shown) >= 2
    for tick, text in shown:  # 10⁻³ -> (NFKC) 10−3 -> 10^-3
        written = unicodedata.normalize("NFKC", text).replace("\u2212", "-")
        assert written.startswith("10") and 10.0 ** int(written[2:]) == pytest.approx(tick)


def test_pk_vs_cs_draws_the_top_three_percent_cutoffs(run):
    fig = figures.pk_vs_cs(run["pairs"], "m")
    for ax, tp in zip(fig.axes, ("OQ", "OK", "OV")):
        sub = run["pairs"][(run["pairs"]["source_type"] + run["pairs"]["target_type"]) == tp]
        horizontal = [line.get_ydata()[0] for line in ax.lines if len(set(line.get_ydata())) == 1]
        vertical = [line.get_xdata()[0] for line in ax.lines if len(set(line.get_xdata())) == 1]
        assert horizontal == [pytest.approx(np.percentile(sub["pk"], 97))]
        assert vertical == [pytest.approx(np.percentile(sub["cs"], 97))]
        assert len(ax.collections[0].get_offsets()) == len(sub)
    assert figures.pk_vs_cs(run["pairs"].assign(cs=np.nan), "m") is None


def test_role_heatmaps_box_the_significant_heads(run):
    heads = run["heads"]
    fig = figures.role_heatmaps(heads, "m")
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title().split(" score")[0] for ax in panels] == ["identity", "previous token"]
    for ax, role in zip(panels, ("identity", "previous_token")):
        boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert len(boxes) == int(heads[f"{role}_sig"].sum())
        grid = ax.images[0].get_array()
        row = heads.iloc[5]
        assert grid[row["layer"], row["index"]] == pytest.approx(row[f"{role}_score"])
        (labels,) = [c for c in ax.collections if isinstance(c, PathCollection)]  # one value label per cell
        cells = {(h, l) for l, h in np.ndindex(grid.shape)}
        assert {tuple(xy) for xy in labels.get_offsets().tolist()} == cells and len(labels.get_paths()) == len(cells)
        strongest = heads.loc[heads[f"{role}_score"].idxmax()]
        top = labels.get_offsets().tolist().index([strongest["index"], strongest["layer"]])
        low, high = ax.images[0].get_clim()  # dark text on light cells: viridis is light at the top, Greens dark
        light_cell = (heads[f"{role}_score"].max() - low > 0.6 * (high - low)) != (role == "identity")
        assert tuple(labels.get_facecolors()[top]) == mcolors.to_rgba("black" if light_cell else "white")
    assert figures.role_heatmaps(heads[["head", "layer", "index"]], "m") is None


def test_hub_chart_bars_sum_to_the_degrees(run):
    edges = select_edges(run["pairs"], SelectionPolicy(top_k=5))
    counts = pd.concat([edges["source"], edges["target"]]).value_counts()
    fig = figures.hub_centralities(edges, "m", top=4)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    widths = {}
    for bar in ax.patches:
        y = round(bar.get_y() + bar.get_height() / 2)
        widths[labels[y]] = widths.get(labels[y], 0) + abs(bar.get_width())
    assert widths == {head: counts[head] for head in labels}
    assert labels[-1] == counts.index[0]  # the top hub is drawn at the top


def test_topk_graph_places_kv_heads_at_their_query_group(tmp_path):
    edges = pd.DataFrame({"source": ["L0H1", "L0H5"], "target": ["L1KV0", "L2KV1"], "source_layer": [0, 0],
                          "source_head": [1, 5], "target_layer": [1, 2], "target_head": [0, 1],
                          "source_type": ["O", "O"], "target_type": ["K", "V"], "pk": [3.0, 2.0]})
    fig = figures.topk_graph(edges, 3, 8, "gqa", n_kv_heads=2)  # groups of 4 query heads
    kv = {c.get_gid(): c.get_offsets()[0] for c in fig.axes[0].collections if "KV" in (c.get_gid() or "")}
    assert kv["head:L1KV0"].tolist() == [1.5, 1.0] and kv["head:L2KV1"].tolist() == [5.5, 2.0]
    ends = {p.get_gid(): p._posA_posB[1] for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)}
    assert ends["edge:L0H1->L1KV0:OK"] == (1.5, 1) and ends["edge:L0H5->L2KV1:OV"] == (5.5, 2)


def _effect_pairs(n_per_type=400, seed=0):
    """OQ/OK/OV pairs with PK and a local effect; CS on the OQ rows only, as on a grouped-query model (whose OK/OV
    receivers are KV heads)."""
    rng = np.random.default_rng(seed)
    kinds = np.repeat(["Q", "K", "V"], n_per_type)
    effect = rng.gamma(1.0, 0.03, len(kinds))
    return pd.DataFrame({"source_type": "O", "target_type": kinds, "pk": rng.normal(2.0, 0.1, len(kinds)),
                         "cs": np.where(kinds == "Q", rng.normal(0.02, 0.001, len(kinds)), np.nan),
                         "effect": effect, "effect_lo": effect - 0.01})


def test_effect_scatter_legends_stay_where_matplotlibs_best_placement_puts_them():
    """The legends are placed once, where loc="best" puts them on the laid-out figure, and stay there when points
    are drawn under them (the search for the best place would run at every draw otherwise)."""
    pairs = _effect_pairs()

    def legends():
        fig = figures.effect_scatter(pairs, "m", 0.05, (pairs["effect_lo"] > 0.05).to_numpy())
        return fig, [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]

    fig, fixed = legends()
    assert len(fixed) == 4  # PK of each type and CS of OQ
    placed = [legend.get_window_extent().bounds for legend in fixed]
    for legend in fixed:  # a dense blob of points under each legend
        box = legend.get_window_extent().transformed(legend.axes.transData.inverted())
        grid = np.meshgrid(np.linspace(box.x0, box.x1, 30), np.linspace(box.y0, box.y1, 30))
        legend.axes.scatter(grid[0].ravel(), grid[1].ravel(), s=4)
    fig.draw_without_rendering()
    assert [legend.get_window_extent().bounds for legend in fixed] == placed
    fig, best = legends()
    for legend in best:
        legend.set_loc("best")
    fig.draw_without_rendering()
    np.testing.assert_allclose([legend.get_window_extent().bounds for legend in best], placed, atol=1e-6)


def test_effect_scatter_names_a_metric_a_type_lacks_instead_of_an_empty_panel():
    pairs = _effect_pairs()
    fig = figures.effect_scatter(pairs, "m", 0.05, (pairs["effect_lo"] > 0.05).to_numpy())
    empty = [ax for ax in fig.axes if not ax.axison]
    assert [ax.get_title() for ax in empty] == ["O→K", "O→V"]
    assert all(ax.texts[0].get_text().startswith("no Composition Score for these pairs") for ax in empty)
    assert not any(ax.collections for ax in empty)


def test_pk_vs_cs_names_the_types_without_composition_scores():
    pairs = _effect_pairs()
    fig = figures.pk_vs_cs(pairs, "m")
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["O→Q"]
    assert "OK, OV: no Composition Score" in fig.get_suptitle()
    full = pairs.assign(cs=pairs["pk"] / 100)
    assert "no Composition Score" not in figures.pk_vs_cs(full, "m").get_suptitle()
