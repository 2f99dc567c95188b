"""The whole `headgraph analyze`: STAGES, one ordered list of stages over the run's one Context (the protocol of
headgraph.stages: each stage a function `def stage(ctx: Context) -> None`, timed and its peak memory read by
`run_stages`): load -> causal inputs -> PK, references, significance, CS (headgraph.pipeline.PK_STAGES) -> roles
-> local causal effects -> selection and centrality -> loss effects of the selected edges -> artifacts ->
(stability) -> report -> store. A new stage is one function added to STAGES; each stage is a library call,
this module orders them and records where the results went. The store comes last so that a run marked
complete there is never followed by a failure."""

from __future__ import annotations

import dataclasses
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from headgraph.analysis.selection import SelectedGraph, select_graph
from headgraph.errors import UsageError
from headgraph.files import writable_folder
from headgraph.loader.graph import build_run_graph
from headgraph.loader.store import RunGraph
from headgraph.runs import (HEADS_FILE, PAIRS_FILE, RUN_FILE, STABILITY_FILE, AnalysisResult, PeakRss, RoleRecord,
                            RunFolder, RunRecord, StageRun, write_run)
from headgraph.settings import AnalyzeOptions
from headgraph.stages import Context, peak_rss_method, run_stages, runs_if

__all__ = ["AnalyzeOptions", "AnalyzeOutcome", "STAGES", "progress_bar", "run_analyze"]


@dataclass
class AnalyzeOutcome:
    """A finished analyze: the result tables (its id is result.run.id), the selected graph and the rows a store
    writes of it (`graph`, stored or not), where everything went, and what each stage cost."""

    folder: Path
    result: AnalysisResult
    selected: SelectedGraph
    graph: RunGraph
    store: str | None
    report: dict[str, Path]
    stages: dict[str, StageRun]  # every stage that ran, in order: wall seconds and peak RSS (see StageRun)
    peak_rss: PeakRss  # how the stages' peak RSS was read
    timings_s: dict[str, float]  # the stages' wall seconds in order, then "other" (imports, checks)


def new_run_id(model_name: str) -> str:
    """`<model>-<UTC time>-<4 hex>`: readable, sortable, unique."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name.split("/")[-1]).strip("-") or "run"
    return f"{slug}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{secrets.token_hex(2)}"


def progress_bar(console: Console, enabled: bool) -> Progress:
    """The progress display of analyze and sweep: spinner, description, bar, done of total, time."""
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    return Progress(*columns, console=console, disable=not enabled, transient=False)


def _check_folder(folder: Path) -> None:
    """Fail before any computation when the run folder cannot be created or written."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {folder} exists and is not a folder; choose another path")
    if writable_folder(folder) is None:
        raise UsageError(f"cannot write the run folder {folder}: no file can be created there; choose another --out")


def _clear_earlier_run(folder: Path) -> None:
    """Remove what an earlier run wrote into the same folder, so no old report or figure sits beside the new run."""
    if (folder / RUN_FILE).is_file():
        for pattern in (RUN_FILE, PAIRS_FILE, HEADS_FILE, STABILITY_FILE, "report.md", "report.html", "fig_*.png", "fig_*.svg"):
            for path in folder.glob(pattern):
                path.unlink()


def _inputs_seed(options: AnalyzeOptions) -> int:
    return options.pk.seed if options.inputs_seed is None else options.inputs_seed


def load(ctx: Context) -> None:
    """The model in the processing asked, on the resolved device; the role tests' tokenizer checked before any
    PK work; the run's id and folder."""
    from headgraph.loader.models import load_model
    from headgraph.loader.stream import open_model  # a folder's weights streamed to the PK, else load_model's

    task = ctx.progress.add_task(f"loading {ctx.model_name}", total=1)
    ctx.model = (open_model if ctx.options.stream else load_model)(
        ctx.source, processing=ctx.options.processing, device=ctx.options.pk.device, tokenizer=ctx.tokenizer)
    ctx.progress.advance(task)
    if ctx.options.roles:
        from headgraph.analysis.roles import check_tokenizer

        check_tokenizer(ctx.model)
    ctx.run_id = new_run_id(ctx.model.name)
    ctx.folder = Path(ctx.options.out_dir or Path("runs") / ctx.run_id)


@runs_if(lambda ctx: ctx.options.causal is not None)
def causal_inputs(ctx: Context) -> None:
    """The causal effects' inputs (generated, or read from --causal-inputs: a bad file fails before the PK)."""
    from headgraph.analysis.causal import CausalStage

    ctx.causal = CausalStage.prepare(ctx.model, ctx.options.causal, _inputs_seed(ctx.options))


def pk_and_significance(ctx: Context) -> None:
    """PK of every pair, its references and significance, CS (headgraph.pipeline): the tables and the record."""
    from headgraph.pipeline import run_pk

    run_pk(ctx)


@runs_if(lambda ctx: ctx.options.roles is not None)
def roles(ctx: Context) -> None:
    """Each head's role tests, as columns of the heads table."""
    from headgraph.analysis.roles import compute_roles
    from headgraph.loader.stream import patterns_only

    with patterns_only(ctx.model) as model:
        table, ctx.role_settings = compute_roles(model, seed=_inputs_seed(ctx.options), progress=ctx.progress,
                                                 **dataclasses.asdict(ctx.options.roles))
    ctx.result.heads = ctx.result.heads.merge(table, on=["head", "layer", "index"], how="left", validate="one_to_one")


@runs_if(lambda ctx: ctx.causal is not None)
def causal_local(ctx: Context) -> None:
    """The local effects of the OQ/OK/OV pairs into the pairs table, or why there are none (recorded, and a
    warning for a model whose attention cannot be recomputed)."""
    from headgraph.analysis.causal import CausalUnsupported

    try:
        ctx.result.pairs, ctx.causal_record = ctx.causal.local(ctx.result.pairs, ctx.options.pk.types,
                                                               _inputs_seed(ctx.options), ctx.progress)
    except CausalUnsupported as e:
        ctx.console.print(f"[yellow]causal effects skipped:[/] {e}")
        ctx.causal_record = {"skipped": str(e)}


def selection_and_centrality(ctx: Context) -> None:
    """The selected graph and its centrality: once, for the summary, the report and the store."""
    ctx.selected = select_graph(ctx.result.pairs, ctx.result.heads, ctx.options.policy)


@runs_if(lambda ctx: ctx.has_effects and ctx.options.causal.loss)
def causal_loss(ctx: Context) -> None:
    """The loss effects of the selected edges, into the pairs table and that one selection."""
    ctx.result.pairs, edges, agreement = ctx.causal.loss(ctx.result.pairs, ctx.selected.edges,
                                                         _inputs_seed(ctx.options), ctx.progress)
    ctx.selected = dataclasses.replace(ctx.selected, edges=edges)
    ctx.causal_record = {**ctx.causal_record, "agreement": agreement}  # its seconds: the runner's, as every stage's


def _record(ctx: Context) -> RunRecord:
    """The PK's run record completed, in the one place it is: where the run went, what the later stages did and
    what each stage before the run folder cost (the causal effects' seconds among them)."""
    causal = ctx.causal_record
    if ctx.has_effects:
        causal = {**causal, "timings_s": {name.removeprefix("causal_"): ctx.stages[name].seconds
                                          for name in ("causal_local", "causal_loss") if name in ctx.stages}}
    options = ctx.options
    return dataclasses.replace(ctx.result.run, id=ctx.run_id, out_dir=str(ctx.folder.resolve()),
                               selection=options.policy.describe(), sweep=options.sweep, step=options.step,
                               roles=None if ctx.role_settings is None else RoleRecord.from_json(ctx.role_settings),
                               causal=causal, stages=dict(ctx.stages),
                               peak_rss=peak_rss_method())


def artifacts(ctx: Context) -> None:
    """The run folder (run.json, pairs / heads tables), and the rows a store writes of the selected graph."""
    ctx.result.run = _record(ctx)
    _clear_earlier_run(ctx.folder)
    write_run(ctx.result, ctx.folder)
    ctx.run = RunFolder(ctx.folder, ctx.result.run, ctx.result.pairs, ctx.result.heads)  # as written, not read back
    ctx.graph = build_run_graph(ctx.selected, ctx.result.run, ctx.classes.labels() if ctx.classes else None)


@runs_if(lambda ctx: ctx.options.stability)
def stability(ctx: Context) -> None:
    """The run recomputed under each stability variant (headgraph.stability), before the report shows them."""
    from headgraph.stability import run_stability

    run_stability(ctx.run, run_analyze, console=ctx.console, progress=not ctx.progress.disable)


@runs_if(lambda ctx: ctx.options.report)
def report(ctx: Context) -> None:
    """report.md / .html and the figures, into the run folder."""
    from headgraph.report.report import FIGURE_COUNT, render_report

    task = ctx.progress.add_task("report and figures", total=FIGURE_COUNT + 1)
    ctx.report_files = render_report(ctx.run, policy=ctx.options.policy, classes=ctx.classes,
                                     advance=lambda: ctx.progress.advance(task), selected=ctx.selected)


@runs_if(lambda ctx: ctx.options.store is not None)
def store(ctx: Context) -> None:
    """The selected graph into the store: last, so a run is marked complete only when nothing after it can fail."""
    task = ctx.progress.add_task(f"storing {len(ctx.selected.edges)} edges in {ctx.store_description}", total=1)
    with ctx.options.store.open() as opened:
        opened.store_run(ctx.graph)
    ctx.progress.advance(task)


STAGES = (load, causal_inputs, pk_and_significance, roles, causal_local, selection_and_centrality, causal_loss,
          artifacts, stability, report, store)


def run_analyze(model, options: AnalyzeOptions, console: Console | None = None, progress: bool = True,
                tokenizer=None) -> AnalyzeOutcome:
    """Run STAGES on one model and return what they produced (see the module docstring).

    model: a name or folder, or a model already loaded (a transformers PreTrainedModel, with `tokenizer` or the
    one saved beside it, or a TransformerBridge): headgraph.loader.models.load_model takes each the same way."""
    start = time.perf_counter()
    from headgraph.analysis.classes import default_classes, load_classes
    from headgraph.loader.models import describe_model
    from headgraph.pipeline import checked_pk_options

    console = console or Console(stderr=True)
    options = dataclasses.replace(options, pk=checked_pk_options(options.pk))  # the device resolved, once
    model_name, _ = describe_model(model)  # an unknown model fails here, before the store is touched
    classes = load_classes(options.classes) if options.classes else default_classes(model_name)
    _check_folder(Path(options.out_dir or "runs"))
    if options.policy.min_effect is not None and options.causal is None:
        raise UsageError("--min-effect selects by causal effect, which --no-causal skips: drop one of them")
    store_description = options.store.check() if options.store is not None else None
    with progress_bar(console, progress) as bar:
        ctx = Context(options, console, bar, source=model, model_name=model_name, tokenizer=tokenizer,
                      classes=classes, store_description=store_description)
        run_stages(ctx, STAGES, ctx.stages)
    timings = {name: stage.seconds for name, stage in ctx.stages.items()}
    timings["other"] = round(time.perf_counter() - start - sum(timings.values()), 3)
    return AnalyzeOutcome(ctx.folder, ctx.result, ctx.selected, ctx.graph, store_description, ctx.report_files,
                          dict(ctx.stages), peak_rss_method(), timings)
