"""The whole `headgraph analyze` flow, one step after another:
load -> subspaces / PK / references / significance / CS -> roles -> local causal effects -> graph selection
and centrality -> loss effects of the selected edges -> artifacts -> (stability) -> report -> store. Each step
is a library call; this module only orders them and records where the results went. The store comes last so that a run marked complete there is never followed by a failure."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from headgraph.analysis.selection import SelectedGraph, SelectionPolicy, select_graph
from headgraph.errors import UsageError
from headgraph.files import writable_folder
from headgraph.analysis.options import STABILITY_VARIANTS, CausalOptions, PKOptions, RoleOptions
from headgraph.loader.graph import build_run_graph
from headgraph.loader.open_store import StoreSpec
from headgraph.loader.store import RunGraph
from headgraph.runs import HEADS_FILE, PAIRS_FILE, RUN_FILE, STABILITY_FILE, AnalysisResult, Run, write_run

@dataclass(frozen=True)
class AnalyzeOptions:
    """What `headgraph analyze` was asked to do, besides which model; defaults declared once, here and in the
    stage options it holds (the CLI reads them)."""

    out_dir: str | None = None  # run folder (default runs/<run id>)
    processing: str = "tl"  # tl: TransformerLens' folded/centred weights; raw: the checkpoint as stored
    pk: PKOptions = field(default_factory=PKOptions)
    roles: RoleOptions | None = field(default_factory=RoleOptions)  # None: no role tests
    causal: CausalOptions | None = field(default_factory=CausalOptions)  # None: no causal effects
    inputs_seed: int | None = None  # seed of the generated role and causal inputs (None: pk.seed)
    stability: bool = False  # recompute under every stability variant before the report (run_stability)
    policy: SelectionPolicy = field(default_factory=SelectionPolicy)
    classes: str | None = None
    store: StoreSpec | None = field(default_factory=StoreSpec)
    report: bool = True
    sweep: str | None = None  # the sweep this run belongs to (headgraph.sweep sets it), recorded with its step
    step: int | None = None


@dataclass
class AnalyzeOutcome:
    """A finished analyze: the result tables (its id is result.run.id), the selected graph and the rows a store
    writes of it (`graph`, stored or not), and where everything went."""

    folder: Path
    result: AnalysisResult
    selected: SelectedGraph
    graph: RunGraph
    store: str | None
    report: dict[str, Path]
    timings_s: dict[str, float] = field(default_factory=dict)  # wall seconds of each step in order, then "other"


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


def _add_roles(result: AnalysisResult, model, options: AnalyzeOptions, progress: Progress) -> None:
    from headgraph.analysis.roles import compute_roles

    roles, meta = compute_roles(model, seed=_inputs_seed(options), progress=progress,
                                **dataclasses.asdict(options.roles))
    result.heads = result.heads.merge(roles, on=["head", "layer", "index"], how="left", validate="one_to_one")
    result.run = dataclasses.replace(result.run, roles=meta)


def _add_local_effects(result: AnalysisResult, stage, seed: int, console: Console, progress: Progress) -> bool:
    """The local effects of the OQ/OK/OV pairs into the pairs table; False (recorded, and a warning for a model
    whose attention cannot be recomputed) when there are none."""
    from headgraph.analysis.causal import CausalUnsupported

    try:
        result.pairs, record = stage.local(result.pairs, result.run.types, seed, progress)
    except CausalUnsupported as e:
        console.print(f"[yellow]causal effects skipped:[/] {e}")
        record = {"skipped": str(e)}
    result.run = dataclasses.replace(result.run, causal=record)
    return "skipped" not in record


def _add_loss_effects(result: AnalysisResult, selected: SelectedGraph, stage, seed: int,
                      progress: Progress) -> SelectedGraph:
    result.pairs, edges, seconds = stage.loss(result.pairs, selected.edges, seed, progress)
    causal = result.run.causal
    result.run = dataclasses.replace(result.run, causal={**causal, "timings_s": {**causal["timings_s"], "loss": seconds}})
    return dataclasses.replace(selected, edges=edges)


def run_analyze(model, options: AnalyzeOptions, console: Console | None = None, progress: bool = True,
                tokenizer=None) -> AnalyzeOutcome:
    """Run the whole pipeline on one model and return what it produced (see the module docstring).

    model: a name or folder, or a model already loaded (a transformers PreTrainedModel, with `tokenizer` or the
    one saved beside it, or a TransformerBridge): headgraph.loader.models.load_model takes each the same way."""
    start = time.perf_counter()
    from headgraph.analysis.classes import load_classes
    from headgraph.loader.models import describe_model, load_model
    from headgraph.pipeline import analyze, resolve_device, timed
    from headgraph.report.report import default_classes, render_report

    console = console or Console(stderr=True)
    device = resolve_device(options.pk.device)
    model_name, _ = describe_model(model)  # an unknown model fails here, before the store is touched
    classes = load_classes(options.classes) if options.classes else default_classes(model_name)
    _check_folder(Path(options.out_dir or "runs"))
    if options.policy.min_effect is not None and options.causal is None:
        raise UsageError("--min-effect selects by causal effect, which --no-causal skips: drop one of them")
    store_description = options.store.check() if options.store is not None else None

    timings: dict[str, float] = {}
    with console.status(f"loading {model_name}") if progress else contextlib.nullcontext(), timed(timings, "load"):
        model = load_model(model, processing=options.processing, device=device, tokenizer=tokenizer)
    if options.roles:
        from headgraph.analysis.roles import check_tokenizer

        check_tokenizer(model)  # before the PK work, not after it
    causal = None
    if options.causal:
        from headgraph.analysis.causal import CausalStage

        with timed(timings, "causal_inputs"):
            causal = CausalStage.prepare(model, options.causal, _inputs_seed(options))
    with timed(timings, "pk_and_significance"):
        result = analyze(model, options=dataclasses.replace(options.pk, device=device), console=console,
                         progress=progress)
    run_id = new_run_id(model.name)
    folder = Path(options.out_dir or Path("runs") / run_id)
    result.run = dataclasses.replace(result.run, id=run_id, out_dir=str(folder.resolve()),
                                     selection=options.policy.describe(), sweep=options.sweep, step=options.step)
    with progress_bar(console, progress) as bar:
        if options.roles:
            with timed(timings, "roles"):
                _add_roles(result, model, options, bar)
        effects = False
        if causal is not None:
            with timed(timings, "causal_local"):
                effects = _add_local_effects(result, causal, _inputs_seed(options), console, bar)
        with timed(timings, "selection_and_centrality"):
            selected = select_graph(result.pairs, result.heads, options.policy)  # once, for summary, report and store
        if effects and options.causal.loss:
            with timed(timings, "causal_loss"):
                selected = _add_loss_effects(result, selected, causal, _inputs_seed(options), bar)
        with timed(timings, "artifacts"):
            _clear_earlier_run(folder)
            write_run(result, folder)
        run = Run(folder, result.run, result.pairs, result.heads)  # as written, not read back from disk
        if options.stability:
            with timed(timings, "stability"):
                run_stability(run, console=console, progress=progress)
        paths = {}
        if options.report:
            from headgraph.report.report import FIGURE_COUNT

            task = bar.add_task("report and figures", total=FIGURE_COUNT + 1)
            with timed(timings, "report"):
                paths = render_report(run, policy=options.policy, classes=classes,
                                      advance=lambda: bar.advance(task), selected=selected)
        graph = build_run_graph(selected, result.run, classes.labels() if classes is not None else None)
        if options.store is not None:  # last: a run is marked complete only when nothing after it can fail
            task = bar.add_task(f"storing {len(selected.edges)} edges in {store_description}", total=1)
            with timed(timings, "store"), options.store.open() as store:
                store.load_run(graph)
            bar.advance(task)
    timings["other"] = round(time.perf_counter() - start - sum(timings.values()), 3)  # imports, checks, graph rows
    return AnalyzeOutcome(folder, result, selected, graph, store_description, paths, timings)


def rerun_options(run: Run) -> AnalyzeOptions:
    """The settings a run was made with, read off its record (no store, no report): what `run_stability`
    varies one at a time."""
    record = run.record
    pk = PKOptions(types=record.types, full_matrix=not record.pairs.startswith("earlier"), device=record.device,
                   dtype=record.dtype, seed=record.seed, max_memory=record.max_memory,
                   reference_samples=record.reference["samples"], null_heads=record.null_model["null_heads"])
    roles = None
    if record.roles:
        roles = RoleOptions(**{f.name: record.roles[f.name] for f in dataclasses.fields(RoleOptions)
                               if f.name in record.roles})
    causal = None
    if record.has_effects:
        per_set = list(record.causal["inputs"].values())
        causal = CausalOptions(n_inputs=max(per_set), ablation=record.causal["ablation"],
                               n_boot=record.causal["n_boot"], loss=False)  # every pair's local effect is compared
    return AnalyzeOptions(processing=record.processing, pk=pk, roles=roles, causal=causal,
                          policy=SelectionPolicy.parse(record.selection), store=None, report=False)


def _variant(options: AnalyzeOptions, name: str) -> AnalyzeOptions | str:
    """The options of one stability variant, or why it cannot run here."""
    import torch

    pk = options.pk
    if name == "float64":
        return dataclasses.replace(options, pk=dataclasses.replace(pk, dtype="float64"))
    if name == "null_seed":
        return dataclasses.replace(options, pk=dataclasses.replace(pk, seed=pk.seed + 1), inputs_seed=pk.seed)
    if name == "inputs":
        if options.roles is None and options.causal is None:
            return "the run has neither role tests nor causal effects"
        return dataclasses.replace(options, inputs_seed=pk.seed + 1)
    if name in ("rank_tol_x10", "rank_tol_div10"):
        factor = 10.0 if name == "rank_tol_x10" else 0.1
        return dataclasses.replace(options, pk=dataclasses.replace(pk, rank_tolerance=pk.rank_tolerance * factor))
    if name == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device"
        if pk.device == "cuda":
            return "the run itself was computed on CUDA"
        return dataclasses.replace(options, pk=dataclasses.replace(pk, device="cuda"))
    raise UsageError(f"unknown stability variant {name!r}: use {', '.join(STABILITY_VARIANTS)}")


def run_stability(run: Run, variants=tuple(STABILITY_VARIANTS), console: Console | None = None,
                  progress: bool = True) -> dict:
    """Recompute `run` under each variant (headgraph.analysis.stability), compare, and write stability.json
    into the run folder; returns the report."""
    import tempfile

    from headgraph.analysis.stability import compare_runs
    from headgraph.runs import load_run, write_stability

    base = rerun_options(run)
    report = {"run": run.record.id, "policy": base.policy.describe(), "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants:
            options = _variant(base, name)
            if isinstance(options, str):
                report["variants"][name] = {"what": STABILITY_VARIANTS[name], "skipped": options}
                continue
            (console or Console(stderr=True)).print(f"stability: {name} ({STABILITY_VARIANTS[name]})")
            outcome = run_analyze(run.record.model.source, dataclasses.replace(options, out_dir=f"{tmp}/{name}"),
                                  console=console, progress=progress)
            other = load_run(outcome.folder)
            compared = compare_runs(run.pairs, other.pairs, run.heads if base.roles else None,
                                    other.heads if base.roles else None, base.policy)
            report["variants"][name] = {"what": STABILITY_VARIANTS[name], "pairs": compared.pairs,
                                        "roles": compared.roles}
    write_stability(run.path, report)
    return report
