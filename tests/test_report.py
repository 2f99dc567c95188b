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
from headgraph.analysis.selection import SelectionPolicy
from headgraph.cli import main
from headgraph.errors import UsageError
from headgraph.report.report import render_report, role_counts_by_layer
from headgraph.runs import RunRecord, load_run, resolve_run_dir

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
        store.load_run(run_graph(rendered["pairs"], rendered["heads"], run, SelectionPolicy(top_k=2)))
    assert resolve_run_dir("report-test-run", spec) == rendered["dir"]
    with pytest.raises(UsageError, match="neither a run folder nor a run id"):
        resolve_run_dir("no-such-run", spec)
