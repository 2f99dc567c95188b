"""The whole `headgraph analyze` flow through the CLI, on a planted model stored in the embedded LadybugDB:
the planted hub leads the summary and the stored graph, planted roles reach the Head nodes, the report is
written, and bad input stops before any work with one line and a non-zero exit code."""

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from _commands import headgraph
from _fast import FAST, FLAGS

pytestmark = pytest.mark.slow  # real analyses (the shared one: 10-30 s), processes, 256 MiB written per stage test


@pytest.fixture
def analyzed(planted_analysis):
    """The session's `headgraph analyze --json` of the planted model into a LadybugDB store (conftest):
    (truth, store, run folder, summary). Its readers are marked slow: that one analysis takes 10-30 s."""
    return planted_analysis.truth, planted_analysis.db, planted_analysis.folder, planted_analysis.summary


def test_summary_puts_the_planted_hub_first(analyzed):
    truth, _, out, summary = analyzed
    assert summary["hubs"][0]["head"] == truth.hub
    assert summary["edges"] == {"OQ": 5, "OK": 5, "OV": 5}  # the shared analysis selects the top 5 per type
    assert summary["folder"] == str(out)


def test_the_summary_says_where_the_time_went(analyzed):
    *_, summary = analyzed
    steps = ["load", "causal_inputs", "pk_and_significance", "roles", "causal_local", "selection_and_centrality",
             "causal_loss", "artifacts", "report", "store", "other"]
    assert list(summary["timings_s"]) == steps  # in the order they ran; no step of this run is missing
    assert all(seconds >= 0 for seconds in summary["timings_s"].values())


def _clear_refs_writable() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def test_run_json_records_each_stage_before_the_run_folder_with_its_peak_memory(analyzed):
    *_, out, summary = analyzed
    run = json.loads((out / "run.json").read_text())
    before = ["load", "causal_inputs", "pk_and_significance", "roles", "causal_local", "selection_and_centrality",
              "causal_loss"]
    assert list(run["stages"]) == before and run["stages"] == {name: summary["stages"][name] for name in before}
    assert list(summary["stages"]) == list(summary["timings_s"])[:-1]  # every stage the summary timed but "other"
    assert all(summary["timings_s"][name] == stage["seconds"] for name, stage in summary["stages"].items())
    assert all(stage["peak_rss_bytes"] > 2**26 for stage in summary["stages"].values())  # torch alone holds more
    if run["device"] == "cpu":  # no GPU memory where the process never used CUDA
        assert all(stage["peak_gpu_bytes"] is None for stage in summary["stages"].values())
    assert run["peak_rss"] == summary["peak_rss"] == ("vmhwm" if _clear_refs_writable() else "ru_maxrss")
    # the causal stage's seconds are the runner's, not a second clock
    assert run["causal"]["timings_s"] == {"local": run["stages"]["causal_local"]["seconds"],
                                          "loss": run["stages"]["causal_loss"]["seconds"]}


def _resident_bytes() -> int:
    return int(re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1]) * 1024


BLOCK = 256 * 2**20


def _allocate(ctx):
    block = np.ones(BLOCK // 8)  # written, so resident until freed (an mmap of its own, returned on del)
    del block


def _pause(ctx):
    time.sleep(0.05)


def _stages_context():
    from rich.console import Console
    from rich.progress import Progress

    from headgraph.settings import AnalyzeOptions
    from headgraph.stages import Context

    return Context(AnalyzeOptions(), Console(stderr=True), Progress(disable=True))


def test_each_stage_records_its_own_peak_and_a_nested_stage_counts_in_its_parent():
    from headgraph.analysis.heap import release_freed
    from headgraph.stages import peak_rss_method, run_stages, runs_if

    @runs_if(lambda ctx: ctx.model is not None)
    def skipped(ctx):
        raise AssertionError("a stage whose condition fails ran")

    def outer(ctx):
        run_stages(ctx, (_allocate, skipped, _pause), ctx.pk_stages)

    ctx = _stages_context()
    release_freed()  # as run_stages does before each stage: the process's free heap pages are not its stages'
    resident = _resident_bytes()
    run_stages(ctx, (outer, _pause), ctx.stages)
    inner, top = ctx.pk_stages, ctx.stages
    assert list(inner) == ["_allocate", "_pause"] and list(top) == ["outer", "_pause"]  # skipped: not recorded
    assert inner["_pause"].seconds >= 0.05 and top["outer"].seconds >= inner["_pause"].seconds
    assert inner["_allocate"].peak_rss_bytes >= resident + 0.95 * BLOCK
    assert top["outer"].peak_rss_bytes >= inner["_allocate"].peak_rss_bytes  # the inner resets did not lose it
    if peak_rss_method() != "vmhwm":
        pytest.skip("/proc/self/clear_refs cannot be written here: no peak of a stage's own to check")
    assert inner["_allocate"].peak_rss_bytes - inner["_pause"].peak_rss_bytes > 0.9 * BLOCK  # reset between
    assert top["outer"].peak_rss_bytes - top["_pause"].peak_rss_bytes > 0.9 * BLOCK


def _allocate_on_gpu(ctx):
    block = torch.ones(BLOCK // 4, device="cuda")
    del block


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_each_stage_records_its_own_gpu_peak_and_a_nested_stage_counts_in_its_parent():
    from headgraph.stages import run_stages

    def outer(ctx):
        run_stages(ctx, (_allocate_on_gpu, _pause), ctx.pk_stages)

    ctx = _stages_context()
    torch.ones(1, device="cuda")  # CUDA in use before the stages start
    held = torch.cuda.memory_allocated()
    run_stages(ctx, (outer, _pause), ctx.stages)
    inner, top = ctx.pk_stages, ctx.stages
    assert inner["_allocate_on_gpu"].peak_gpu_bytes >= held + BLOCK
    assert top["outer"].peak_gpu_bytes >= inner["_allocate_on_gpu"].peak_gpu_bytes  # not lost to the inner resets
    assert inner["_pause"].peak_gpu_bytes < held + BLOCK and top["_pause"].peak_gpu_bytes < held + BLOCK


class _Allocator:
    """torch.cuda's peak accounting as the stages read it: bytes allocated, and their peak since the last reset."""

    def __init__(self):
        self.allocated = self.peak = 0

    def take(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.allocated -= n

    def max_memory_allocated(self) -> int:
        return self.peak

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.allocated


def test_the_gpu_peaks_of_nested_stages_fold_like_their_rss_peaks(monkeypatch):
    """The GPU peaks' bookkeeping on any machine, through an allocator that keeps torch.cuda's peak statistics;
    a process that never used CUDA records none."""
    import headgraph.stages as stages

    ctx = _stages_context()
    stages.run_stages(ctx, (_pause,), ctx.stages)
    assert ctx.stages["_pause"].peak_gpu_bytes is None or torch.cuda.is_initialized()
    allocator = _Allocator()
    monkeypatch.setattr(stages, "_cuda", lambda: allocator)

    def outer(ctx):
        allocator.take(300)
        stages.run_stages(ctx, (lambda ctx: allocator.take(1000), _pause), ctx.pk_stages)
        allocator.take(200)

    allocator.allocated = 50  # held before the stages
    stages.run_stages(ctx, (outer, _pause), ctx.stages)
    (inner_first, inner_pause), top = ctx.pk_stages.values(), ctx.stages
    assert (inner_first.peak_gpu_bytes, inner_pause.peak_gpu_bytes) == (1050, 50)
    assert (top["outer"].peak_gpu_bytes, top["_pause"].peak_gpu_bytes) == (1050, 50)


def test_without_clear_refs_a_stage_records_the_process_peak(monkeypatch):
    import resource

    import headgraph.stages as stages

    monkeypatch.setattr(stages, "_CLEAR_REFS", Path("/proc/self/headgraph-no-clear-refs"))
    stages.peak_rss_method.cache_clear()
    try:
        ctx = _stages_context()
        stages.run_stages(ctx, (_allocate, _pause), ctx.stages)
        assert stages.peak_rss_method() == "ru_maxrss"
    finally:
        stages.peak_rss_method.cache_clear()
    process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    allocated, after = ctx.stages["_allocate"].peak_rss_bytes, ctx.stages["_pause"].peak_rss_bytes
    assert allocated >= BLOCK and allocated <= after <= process_peak  # no reset: the peak so far, never less


def test_stored_graph_answers_the_hubs_query(analyzed):
    truth, db, _, summary = analyzed
    done = headgraph("query", "hubs", "--db", str(db), "--run", summary["run_id"], "--format", "json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert rows[0]["head"] == truth.hub
    planted_out = {e[2] for e in truth.edges if e[0] == truth.hub}
    assert {r["kind"] for r in rows if r["head"] == truth.hub and r["kind_out"] > 0} >= planted_out


def test_planted_roles_reach_the_artifacts_and_the_store(analyzed):
    truth, db, out, summary = analyzed
    heads = pd.read_parquet(out / "heads.parquet").set_index("head")
    assert set(heads.index[heads["identity_sig"]]) == set(truth.identity_heads)
    assert set(heads.index[heads["previous_token_sig"]]) == set(truth.previous_token_heads)
    done = headgraph("cypher", "MATCH (h:Head) WHERE h.run_id = $run AND h.identity_sig = true RETURN h.name AS name "
                     "ORDER BY name", "--param", f"run={summary['run_id']}", "--db", str(db), "--format", "json")
    assert done.returncode == 0, done.stderr
    assert [r["name"] for r in json.loads(done.stdout)] == sorted(truth.identity_heads)


def test_report_and_figures_are_written(analyzed):
    truth, _, out, summary = analyzed
    for stem in ("pk_distributions", "kl_heatmap", "pk_vs_cs", "topk_graph", "roles", "hubs"):
        assert (out / f"fig_{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert b"<svg" in (out / f"fig_{stem}.svg").read_bytes()[:2000]
    report = (out / "report.md").read_text()
    assert report.startswith(f"# headgraph report — {summary['model']}")
    hubs = report.split("## Hubs")[1]
    assert re.search(r"\*\*(L\d+H\d+)\*\*", hubs)[1] == truth.hub  # the planted hub is described first
    assert json.loads((out / "run.json").read_text())["id"] == summary["run_id"]


def test_unreachable_neo4j_fails_before_any_work(planted, tmp_path):
    path, _ = planted
    done = headgraph("analyze", str(path), "--neo4j", "bolt://127.0.0.1:1", "--out", str(tmp_path / "run"), *FLAGS)
    assert done.returncode == 3
    assert done.stderr.strip().count("\n") == 0 and "cannot reach Neo4j at bolt://127.0.0.1:1" in done.stderr
    assert not (tmp_path / "run").exists()


def test_wrong_neo4j_password_fails_with_one_line(planted, neo4j_config, tmp_path):
    path, _ = planted
    done = headgraph("analyze", str(path), "--neo4j", neo4j_config["uri"], "--out", str(tmp_path / "run"), *FLAGS,
                     env={"NEO4J_USER": neo4j_config["user"], "NEO4J_PASSWORD": "not-the-password"})
    assert done.returncode == 3
    assert done.stderr.strip().count("\n") == 0 and "refused user" in done.stderr
    assert not (tmp_path / "run").exists()


def test_unknown_model_is_one_line_exit_2(tmp_path):
    done = headgraph("analyze", "no-such-model-xyz", "--db", str(tmp_path / "g.lbdb"))
    assert done.returncode == 2
    assert done.stderr.startswith("error: model 'no-such-model-xyz' is not available offline")
    assert done.stderr.strip().count("\n") == 0
    assert not (tmp_path / "g.lbdb").exists()


def test_runs_lists_and_deletes_a_stored_run_and_never_creates_a_store(tmp_path):
    from _pairs import planted_pairs, run_graph

    from headgraph.loader.ladybug_store import LadybugStore

    pairs, heads = planted_pairs()
    db = tmp_path / "g.lbdb"
    with LadybugStore(db) as store:
        store.store_run(run_graph(pairs, heads, {"id": "run-a", "model": "synthetic"}))
    listed = headgraph("runs", "--db", str(db), "--format", "json")
    assert [r["id"] for r in json.loads(listed.stdout)] == ["run-a"]
    assert headgraph("runs", "delete", "run-b", "--db", str(db)).returncode == 2
    done = headgraph("runs", "delete", "run-a", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert json.loads(headgraph("runs", "--db", str(db), "--format", "json").stdout) == []
    missing = headgraph("runs", "delete", "run-a", "--db", str(tmp_path / "none.lbdb"))
    assert missing.returncode == 3 and "no headgraph store" in missing.stderr
    assert not (tmp_path / "none.lbdb").exists()


def test_selection_centrality_and_device_resolution_happen_once_per_analyze(planted, tmp_path, monkeypatch):
    """Every module's binding of select_edges and head_centrality is counted: a second selection anywhere in
    analyze (summary, report, store) would show."""
    import headgraph.analysis.centrality
    import headgraph.analysis.selection
    import headgraph.loader.graph
    import headgraph.report.report  # noqa: F401 - loaded so that its bindings are counted too
    from headgraph.settings import analyze_options
    from headgraph.workflow import run_analyze

    calls = {"select_edges": 0, "head_centrality": 0}
    for name, module in (("select_edges", headgraph.analysis.selection), ("head_centrality", headgraph.analysis.centrality)):
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        for loaded in [m for n, m in sys.modules.items() if n.startswith("headgraph")]:
            if getattr(loaded, name, None) is original:
                monkeypatch.setattr(loaded, name, counted)
    import headgraph.pipeline

    devices = []
    resolve_device = headgraph.pipeline.resolve_device
    monkeypatch.setattr(headgraph.pipeline, "resolve_device",
                        lambda device: devices.append(device) or resolve_device(device))
    options = analyze_options(out=tmp_path / "run", top_k=5, store=tmp_path / "g.lbdb", report=True, **FAST)
    outcome = run_analyze(str(planted[0]), options, progress=False)
    assert calls == {"select_edges": 1, "head_centrality": 1}  # the loss effects extend that one selection
    assert devices == [None]  # the device is resolved once, from what was asked
    edges = outcome.selected.edges
    assert edges.loc[edges["kind"].isin(["OQ", "OK", "OV"]), "effect_loss"].notna().all()
    assert outcome.report and len(outcome.selected.edges) == 15
