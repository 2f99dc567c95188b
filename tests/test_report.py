"""The report: files, numbers taken from the run's data, a self-contained HTML page, clear errors."""

import base64
import dataclasses
import json
import re
from collections import Counter

import numpy as np
import pandas as pd
import pytest
from _runfolder import build_bases, plant, write_run

from headgraph.analysis.classes import HeadClasses
from headgraph.analysis.evaluation import CAUSAL_THRESHOLD, causal_evaluation
from headgraph.analysis.selection import SelectionPolicy, select_graph
from headgraph.cli import main
from headgraph.errors import UsageError
from headgraph.report.report import (findings_warnings, render_report, report_blocks, role_counts_by_layer, to_html,
                                     to_markdown)
from headgraph.runs import RunRecord, load_run, resolve_run_dir

pytestmark = pytest.mark.slow  # nearly every test reads a rendered report (its figures: 9 s of CPU) or renders one: 12-50 s at load 4-10

TOP_K = 5
FIGURES = ("fig_pk_distributions", "fig_kl_heatmap", "fig_pk_vs_cs", "fig_topk_graph", "fig_roles", "fig_hubs")
CLASSES = HeadClasses("test-classes", "written in this test", None,
                      {"induction": ("L2H1", "L3H0"), "previous_token": ("L0H2",)})


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    bases = build_bases(4, 4, 64, 8, seed=5)
    plant(bases, (0, 2), (2, 1), "K")
    plant(bases, (0, 2), (3, 0), "Q", seed=2)
    plant(bases, (0, 2), (1, 3), "V", seed=3)
    plant(bases, (0, 2), (3, 2), "K", seed=4)
    folder = write_run(tmp_path_factory.mktemp("run"), bases=bases, model="planted-4x4")
    paths = render_report(folder, policy=SelectionPolicy(top_k=TOP_K), classes=CLASSES)
    return {"dir": folder, "paths": paths, "md": paths["report.md"].read_text(),
            "html": paths["report.html"].read_text(), "pairs": pd.read_parquet(folder / "pairs.parquet"),
            "heads": pd.read_parquet(folder / "heads.parquet"), "meta": json.loads((folder / "run.json").read_text())}


def _top_edges(pairs, k):
    kind = pairs["source_type"] + pairs["target_type"]
    return pairs.assign(kind=kind).sort_values("pk", ascending=False).groupby("kind").head(k)


def test_all_figures_and_reports_are_written(rendered):
    for name in FIGURES:
        png, svg = rendered["paths"][f"{name}.png"], rendered["paths"][f"{name}.svg"]
        assert png.parent == rendered["dir"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert b"<svg" in svg.read_bytes()[:2000]
    assert rendered["md"].startswith("# headgraph report — planted-4x4")


def _render_elsewhere(folder, out_dir):
    return sorted(name for name in render_report(folder, policy=SelectionPolicy(top_k=TOP_K), classes=CLASSES,
                                                 out_dir=out_dir) if name.startswith("fig_"))


@pytest.mark.slow
def test_a_report_rendered_in_a_pool_worker_has_every_figure(rendered, tmp_path):
    import multiprocessing

    # a daemonic worker may not fork figure workers of its own: it draws them itself, all of them
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        names = pool.apply(_render_elsewhere, (rendered["dir"], tmp_path))
    assert names == sorted(f"{name}.{ext}" for name in FIGURES for ext in ("png", "svg"))
    for name in names:
        assert (tmp_path / name).stat().st_size > 0


def test_report_states_settings_and_nulls(rendered):
    md, meta = rendered["md"], rendered["meta"]
    for value in (meta["processing"], meta["dtype"], meta["device"], *meta["nulls"].values()):
        assert value in md
    assert "4 × 4" in md and "64 / 8" in md


def test_report_contains_kl_and_means_computed_from_the_data(rendered):
    md, pairs, meta = rendered["md"], rendered["pairs"], rendered["meta"]
    kind = pairs["source_type"] + pairs["target_type"]
    for i, tp in [(3, "OQ"), (3, "OK"), (3, "OV")]:
        kl = meta["kl"]["matrix"][i]["QKVO".index(tp[1])]
        assert f"| {f'{kl:.4g}'} |" in md
        row = next(line for line in md.splitlines() if line.startswith(f"| {tp} | {int((kind == tp).sum())} |"))
        assert f"| {pairs.loc[kind == tp, 'pk'].mean():.4g} |" in row
        var = 2 * 8 * 8 * (64 - 8) ** 2 / (64**2 * 63 * 66)  # the method note's formula, d=64, k=k'=8
        assert f"| {np.sqrt(var):.4g} |" in row and f"| {8 * 8 / 64:.4g} |" in row


def test_strongest_edges_table_lists_the_planted_edges_first(rendered):
    md, pairs = rendered["md"], rendered["pairs"]
    top = _top_edges(pairs, 1).set_index("kind")
    for tp in ("OQ", "OK"):
        edge = top.loc[tp]
        assert f"| {tp} | 1 | {edge['source']} → {edge['target']} | {edge['pk']:.4g} |" in md
    assert "| OK | 1 | L0H2 → L2H1 |" in md and "| OQ | 1 | L0H2 → L3H0 |" in md


def test_hub_section_names_the_head_with_most_selected_edges(rendered):
    edges = _top_edges(rendered["pairs"], TOP_K)
    degree = Counter(edges["source"]) + Counter(edges["target"])
    (hub, count), (_, runner_up) = degree.most_common(2)
    assert hub == "L0H2" and count > runner_up  # the planted hub, unambiguous
    section = rendered["md"].split("## Hubs")[1].split("## Head roles")[0]
    first = re.search(r"\*\*(L\d+H\d+)\*\* \((\d+) edges", section)
    assert first.groups() == (hub, str(count))


def test_role_table_counts_significant_heads_per_layer(rendered):
    heads = rendered["heads"]
    table = role_counts_by_layer(heads)
    for role in ("identity", "previous_token"):
        per_layer = heads[heads[f"{role}_sig"]].groupby("layer").size()
        for layer in range(4):
            assert table.loc[layer, role].split(" ")[0] == str(per_layer.get(layer, 0))
        assert table.loc["all", role] == str(int(heads[f"{role}_sig"].sum()))


def test_known_class_counts_match_the_top_k_union_graph(rendered):
    edges = _top_edges(rendered["pairs"], TOP_K)
    union = set(edges["source"]) | set(edges["target"])
    inside = len(union & {"L2H1", "L3H0", "L0H2"})
    assert f"| pk | all | {len(rendered['pairs'])} |" in rendered["md"]
    row = next(line for line in rendered["md"].splitlines() if line.startswith("| pk | all |"))
    assert row.split(" | ")[4:6] == [str(inside), str(len(union) - inside)]


def test_html_is_self_contained_with_the_figures_embedded(rendered):
    page = rendered["html"]
    sources = re.findall(r"src='([^']*)'", page)
    assert len(sources) == len(FIGURES)
    embedded = {base64.b64decode(s.split(",", 1)[1]) for s in sources if s.startswith("data:image/png;base64,")}
    assert embedded == {rendered["paths"][f"{name}.png"].read_bytes() for name in FIGURES}
    assert "<link" not in page and "href=" not in page  # scripts: the interactive graph, tests/test_view.py
    assert "<table>" in page and "L0H2 → L2H1" in page


def test_missing_artifacts_give_a_one_line_usage_error(tmp_path):
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(UsageError, match="missing pairs.parquet, heads.parquet"):
        load_run(tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        load_run(tmp_path / "nope")


@pytest.mark.parametrize("meta, message", [
    (lambda good: [1, 2], "run.json is not a JSON object"),
    (lambda good: {}, "run.json lacks the fields model, dims, processing, device"),
    (lambda good: {**good, "reference": {}}, "run.json lacks the isotropic reference of OQ, OK, OV"),
    (lambda good: {**good, "colour": "blue"}, "run.json has unknown fields colour"),
])
def test_a_malformed_run_json_gives_a_one_line_usage_error(rendered, tmp_path, capsys, meta, message):
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("pairs.parquet", "heads.parquet"):
        (folder / name).write_bytes((rendered["dir"] / name).read_bytes())
    (folder / "run.json").write_text(json.dumps(meta(rendered["meta"])))
    with pytest.raises(UsageError, match=message):
        load_run(folder)
    for args in (["report", str(folder)], ["compare", str(rendered["dir"]), str(folder)]):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


def test_cli_report_renders_and_fails_cleanly(rendered, tmp_path, capsys):
    out = tmp_path / "out"
    main(["report", str(rendered["dir"]), "--top-k", "3", "--out", str(out)])
    assert "| OK | 1 | L0H2 → L2H1 |" in (out / "report.md").read_text()
    assert "top 3 per type by PK (9 edges)" in (out / "report.md").read_text()
    assert "6 figures" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path / "missing")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: run folder") and "Traceback" not in err


def test_a_stored_run_id_resolves_to_its_folder(rendered, tmp_path):
    from _pairs import run_graph

    from headgraph.loader.open_store import StoreSpec, open_store

    spec = StoreSpec(db=str(tmp_path / "store.lbdb"))
    run = dataclasses.replace(RunRecord.from_json(rendered["meta"]), id="report-test-run", out_dir=str(rendered["dir"]))
    with open_store(spec.db) as store:
        store.store_run(run_graph(rendered["pairs"], rendered["heads"], run, SelectionPolicy(top_k=2)))
    assert resolve_run_dir("report-test-run", spec) == rendered["dir"]
    with pytest.raises(UsageError, match="neither a run folder nor a run id"):
        resolve_run_dir("no-such-run", spec)


# ---------- findings first: `headgraph analyze` on the planted model (conftest), every stage run ----------

ANALYSED_TOP_K = 4


@pytest.fixture(scope="module")
def analysed(planted, tmp_path_factory):
    """(truth, run folder) of `headgraph analyze` on the planted model with roles and causal effects, its report
    rendered by analyze itself."""
    folder, truth = planted
    out = tmp_path_factory.mktemp("analysed") / "run"
    main(["analyze", str(folder), "--no-store", "--out", str(out), "--top-k", str(ANALYSED_TOP_K), "--causal-n", "8",
          "--n-inputs", "40", "--null-heads", "40", "--reference-samples", "2000", "--json"])
    return truth, out


def _findings(md):
    return md.split("## Findings\n")[1].split("\n## ")[0]


@pytest.mark.slow
def test_the_report_leads_with_findings_then_the_graph_then_figures_and_ends_with_settings(analysed):
    _, out = analysed
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    marks = [md.index("## Findings"), md.index("## Interactive graph"), md.index("[report.html](report.html)"),
             md.index("!["), md.index("## Model and settings")]
    assert marks == sorted(marks) and md.rindex("\n## ") == marks[-1] - 1  # settings: the last section
    marks = [page.index("<h2>Findings</h2>"), page.index('id="hg-view"'), page.index("<figure><img"),
             page.index("<h2>Model and settings</h2>")]
    assert marks == sorted(marks) and page.rindex("<h2>") == marks[-1]
    before, settings = md.split("## Model and settings")
    assert "time subspaces (s)" in settings and "time subspaces (s)" not in before


@pytest.mark.slow
def test_the_findings_name_the_planted_hub_and_each_types_strongest_edge_with_its_effects(analysed):
    truth, out = analysed
    findings = _findings((out / "report.md").read_text())
    pairs = pd.read_parquet(out / "pairs.parquet")
    top = _top_edges(pairs, ANALYSED_TOP_K)  # the selected graph, recomputed here
    degree = Counter(top["source"]) + Counter(top["target"])
    assert degree.most_common(1)[0][0] == truth.hub
    hub_rows = [line for line in findings.split("### Top hubs")[1].splitlines() if line.startswith("| L")]
    assert hub_rows[0].startswith(f"| {truth.hub} | {degree[truth.hub]} |")
    planted = {(s, t, tp) for s, t, tp, _ in truth.edges}
    for tp, edge in _top_edges(pairs, 1).set_index("kind").iterrows():
        assert (edge["source"], edge["target"], tp) in planted
        row = next(line for line in findings.splitlines() if line.startswith(f"| {tp} | 1 | "))
        assert row.startswith(f"| {tp} | 1 | {edge['source']} → {edge['target']} | {edge['pk']:.4g} | ")
        for effect in [c for c in ("effect", "effect_loss", "effect_attr") if c in pairs.columns]:
            lo, hi = edge[f"{effect}_lo"], edge[f"{effect}_hi"]
            assert f" {edge[effect]:.3g} [{lo:.3g}, {hi:.3g}] |" in row, (effect, row)


def _with_causal(run, **causal):
    """The run with `causal` as its run.json causal record."""
    return dataclasses.replace(run, record=dataclasses.replace(run.record, causal=causal))


@pytest.mark.slow
def test_the_findings_warn_on_poor_attribution_agreement_and_on_nothing_else_when_every_stage_ran(analysed):
    _, out = analysed
    findings = _findings((out / "report.md").read_text())
    agreement = json.loads((out / "run.json").read_text())["causal"]["agreement"]
    poor = [tp for tp in ("OQ", "OK", "OV") if tp in agreement and agreement[tp]["spearman"] < 0.8]
    lines = [line for line in findings.splitlines() if line.startswith("- ")]
    warned = re.findall(r"(O[QKV]) ρ (-?\d+\.\d\d) \((\d+) edges\)", "\n".join(lines))
    assert len(lines) == (1 if poor else 0) and all(line.startswith("- Attribution agrees poorly") for line in lines)
    assert warned == [(tp, f"{agreement[tp]['spearman']:.2f}", str(agreement[tp]["edges"])) for tp in poor]
    run = load_run(out)  # roles tested, causal effects computed, no processing warnings: with agreement, no warning
    causal = {key: value for key, value in run.record.causal.items() if key != "agreement"}
    agreeing = _with_causal(run, **causal, agreement={tp: {**entry, "spearman": 0.9} for tp, entry in agreement.items()})
    blocks = report_blocks(agreeing, select_graph(run.pairs, run.heads, SelectionPolicy(top_k=ANALYSED_TOP_K)),
                           figs={}, causal_table=causal_evaluation(run.pairs, CAUSAL_THRESHOLD))
    assert "Warnings" not in _findings(to_markdown(blocks)) and "class='warnings'" not in to_html(blocks, "t")


@pytest.mark.slow
def test_a_skipped_causal_stage_is_warned_in_the_findings(analysed):
    run = load_run(analysed[1])
    effects = [c for c in run.pairs.columns if c.startswith("effect")]
    skipped = dataclasses.replace(_with_causal(run, skipped="no OQ/OK/OV type"),
                                  pairs=run.pairs.drop(columns=effects))  # as a skipped stage leaves them
    blocks = report_blocks(skipped, select_graph(skipped.pairs, skipped.heads, SelectionPolicy(top_k=4)), figs={})
    findings = _findings(to_markdown(blocks))
    assert "**Warnings**\n\n- Causal effects were skipped: no OQ/OK/OV type." in findings
    assert "| effect" not in findings and "This run has no causal effects." in findings
    assert "<div class='warnings'><strong>Warnings</strong><ul><li>Causal effects were skipped" in to_html(blocks, "t")


@pytest.mark.slow
def test_poor_attribution_agreement_is_warned_on_the_types_below_08(analysed):
    run = load_run(analysed[1])
    causal = {key: value for key, value in run.record.causal.items() if key != "agreement"}
    agreement = {"OQ": {"spearman": 0.93, "edges": 5}, "OK": {"spearman": 0.41, "edges": 5},
                 "OV": {"spearman": None, "edges": 2}}
    warnings = findings_warnings(_with_causal(run, **causal, agreement=agreement))
    assert len(warnings) == 1 and warnings[0].startswith("Attribution agrees poorly with exact patching on OK ρ 0.41 "
                                                         "(5 edges): ")


def test_a_run_without_causal_effects_says_so_and_its_hubs_carry_their_roles(rendered):
    findings = _findings(rendered["md"])
    assert "- Causal effects were not computed" in findings
    heads = rendered["heads"].set_index("head")
    hub_rows = [line.split(" | ") for line in findings.split("### Top hubs")[1].splitlines() if line.startswith("| L")]
    assert hub_rows[0][0] == "| L0H2"  # the planted hub
    for row in hub_rows:
        head = row[0].removeprefix("| ")
        sig = {role for role in ("identity", "previous_token") if heads.loc[head, f"{role}_sig"]}
        assert set(row[-1].removesuffix(" |").split(", ")) - {"—"} == sig
