"""The `headgraph` command line: one click group, each command a thin layer over the library."""

import atexit
import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from typing import Literal, get_args

import click

from headgraph._version import __version__
from headgraph.analysis.options import STABILITY_VARIANTS, Correction, Device, Dtype, RoleDesign
from headgraph.analysis.evaluation import CAUSAL_THRESHOLD
from headgraph.analysis.selection import DEFAULT_TOP_K, SelectionPolicy
from headgraph.errors import HeadgraphError
from headgraph.heads import Processing
from headgraph.loader.open_store import StoreSpec
from headgraph.loader.store import DEFAULT_DB
from headgraph import settings
from headgraph.sweep import SweepOptions

ANALYZE = settings.AnalyzeOptions()  # the defaults every option below shows
SWEEP = SweepOptions()
PK, ROLES, CAUSAL = ANALYZE.pk, ANALYZE.roles, ANALYZE.causal


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.version_option(__version__, prog_name="headgraph")
@click.pass_context
def cli(ctx, debug):
    """Map attention heads' subspace affinities (Projection Kernel) and roles as a queryable graph."""
    ctx.obj = {"debug": debug}


_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "kib": 1024, "mib": 1024**2, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_memory_size(ctx, param, value):
    """'2GiB', '512MB', '1e9' or a byte count -> bytes (click callback)."""
    import math
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(value).lower())
    if not match or match[2] not in _SIZE_UNITS or float(match[1]) * _SIZE_UNITS[match[2]] < 1:
        raise click.BadParameter(f"{value!r} is not a size like 2GiB, 512MB or 1000000000")
    size = float(match[1]) * _SIZE_UNITS[match[2]]
    if not math.isfinite(size):
        raise click.BadParameter(f"{value!r} is too large a size; give one like 2GiB, 512MB or 1000000000")
    return int(size)


def selection_options(command: Callable) -> Callable:
    """Click options --top-k / --max-q / --min-z / --min-effect, passed to the command as one
    `policy: SelectionPolicy`."""

    @click.option("--min-effect", type=float, default=None, metavar="E",
                  help="Keep edges whose local causal effect is >= E (OQ/OK/OV edges only: others have none).")
    @click.option("--min-z", type=float, default=None, metavar="Z", help="Keep edges with isotropic z >= Z.")
    @click.option("--max-q", type=float, default=None, metavar="Q", help="Keep edges with calibrated q_model <= Q (BH).")
    @click.option(
        "--top-k", type=click.IntRange(min=0), default=DEFAULT_TOP_K, show_default=True, metavar="N",
        help="Keep the N strongest edges per weight-pair type (0: no per-type limit).",
    )
    @functools.wraps(command)
    def wrapper(*args, top_k, max_q, min_z, min_effect, **kwargs):
        return command(*args, policy=SelectionPolicy(top_k or None, max_q, min_z, min_effect), **kwargs)

    return wrapper


def store_options(command: Callable) -> Callable:
    """Click options --db / --neo4j / --neo4j-user, passed to the command as one `store: StoreSpec`."""

    @click.option("--db", default=None, metavar="PATH", help=f"Embedded LadybugDB store (env HEADGRAPH_DB, default {DEFAULT_DB}).")
    @click.option("--neo4j", "neo4j", default=None, metavar="URI", help="Use a Neo4j server, e.g. bolt://127.0.0.1:7687 (env NEO4J_URI).")
    @click.option("--neo4j-user", default=None, metavar="USER", help="Neo4j user (env NEO4J_USER, default neo4j); password from env NEO4J_PASSWORD.")
    @functools.wraps(command)
    def wrapper(*args, db, neo4j, neo4j_user, **kwargs):
        return command(*args, store=StoreSpec(db, neo4j, neo4j_user), **kwargs)

    return wrapper


def show(data, as_json: bool, printer: Callable) -> None:
    """A command's result: JSON on stdout, or the printer's tables on the console."""
    import json

    from rich.console import Console

    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        printer(data, Console())


DEVICE_OPTION = click.option("--device", type=click.Choice(get_args(Device)), default=None,
                             help="torch device (default: cuda when present, else cpu).")

CLASSES_OPTION = click.option(
    "--classes", "classes_name", default=None, metavar="NAME|FILE",
    help="Known head classes to colour and count: ioi, pk-paper or a JSON file (default: pk-paper for gpt2).")


def analyze_options(command: Callable) -> Callable:
    """The options of one analysis (everything of `headgraph analyze` but the model and --json), passed to the
    command as one `options: AnalyzeOptions` made of their flat names by the one translator the Python API uses
    too (headgraph.settings.analyze_options); shared by analyze and sweep."""

    @click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
                  help="Run folder for run.json, pairs/heads.parquet, figures and report (default: runs/<run id>; "
                       "sweep: the folder of its checkpoints' run folders, default runs/<sweep id>).")
    @click.option("--types", default=",".join(PK.types).lower(), show_default=True,
                  help="Type pairs (source type, target type) of Q,K,V,O, comma-separated, or 'all' for all 16.")
    @click.option("--processing", type=click.Choice(get_args(Processing)), default=ANALYZE.processing, show_default=True,
                  help="tl: TransformerLens' folded/centred weights; raw: the checkpoint's weights as stored.")
    @DEVICE_OPTION
    @click.option("--dtype", type=click.Choice(get_args(Dtype)), default=PK.dtype, show_default=True)
    @click.option("--seed", default=PK.seed, show_default=True, type=click.IntRange(min=0),
                  help="Seed of the samplers and generated inputs.")
    @click.option("--max-memory", default=f"{PK.max_memory / 2**30:g}GiB", show_default=True, callback=parse_memory_size,
                  help="Working-memory budget of each stage: the PK engine's tiles, the causal effects' batches and "
                       "steps (e.g. 512MB, 8GiB).")
    @click.option("--full-matrix", is_flag=True,
                  help="Also compute same-layer and backward pairs (default: earlier -> strictly later layer).")
    @click.option("--null-heads", default=PK.null_heads, show_default=True, type=click.IntRange(min=2),
                  help="Random heads per type of the model-matched null (its n^2 pairs give p_model).")
    @click.option("--reference-samples", default=PK.reference_samples, show_default=True, type=click.IntRange(min=100),
                  help="Samples of the isotropic reference distribution (for the KL matrix).")
    @click.option("--roles/--no-roles", default=True, show_default=True, help="Test each head's roles.")
    @click.option("--n-inputs", default=ROLES.n_inputs, show_default=True, type=click.IntRange(min=2),
                  help="Generated inputs per input set of the role tests (sequential: at most).")
    @click.option("--correction", type=click.Choice(get_args(Correction)), default=ROLES.correction, show_default=True,
                  help="Multiple-testing correction of the role tests across heads.")
    @click.option("--design", "role_design", type=click.Choice(get_args(RoleDesign)), default=ROLES.design,
                  show_default=True, help="Role tests: sequential stops an input set once every head is settled; "
                                          "fixed: t-tests on all --n-inputs.")
    @click.option("--causal/--no-causal", default=True, show_default=True,
                  help="Direct-path patching: local effect of every OQ/OK/OV pair, loss effect of the selected edges.")
    @click.option("--causal-n", default=CAUSAL.n_inputs, show_default=True, type=click.IntRange(min=2),
                  help="Generated inputs per input set of the causal effects.")
    @click.option("--causal-inputs", default=None, metavar="FILE", type=click.Path(dir_okay=False),
                  help="Patch on these texts (one a line) instead of the generated inputs.")
    @click.option("--causal-loss-edges", default=CAUSAL.loss_edges, show_default=True, type=click.IntRange(min=0),
                  help="Loss effects for at most N selected edges per type, largest attribution first (0: none).")
    @click.option("--causal-loss-inputs", default=None, type=int, metavar="N",
                  help="Loss effects on the first N causal inputs of each set (default: every input).")
    @CLASSES_OPTION
    @selection_options
    @click.option("--stability", is_flag=True,
                  help="Also recompute under each stability variant (see `headgraph stability`), shown in the report.")
    @click.option("--stream/--no-stream", default=ANALYZE.stream, show_default=True,
                  help="Read a folder's safetensors layer by layer for the PK stages, and run roles and causal effects "
                       "on the weights in their stored dtype; --no-stream loads the whole model first, in float32.")
    @click.option("--no-store", is_flag=True, help="Write the run folder only; store nothing.")
    @click.option("--no-report", is_flag=True, help="Skip the figures and report.")
    @store_options
    @functools.wraps(command)
    def wrapper(*args, out_dir, types, processing, device, dtype, seed, max_memory, full_matrix, null_heads,
                reference_samples, roles, n_inputs, correction, role_design, causal, causal_n, causal_inputs,
                causal_loss_edges, causal_loss_inputs, classes_name, policy, stability, stream, no_store, no_report, store,
                **kwargs):
        role_settings = ({"roles_n_inputs": n_inputs, "roles_correction": correction, "roles_design": role_design}
                         if roles else {})
        causal_settings = {"causal_n_inputs": causal_n, "causal_inputs_file": causal_inputs,
                           "causal_max_memory": max_memory,
                           "causal_loss_edges": causal_loss_edges,  # 0: no loss effects
                           **({"causal_loss_inputs": causal_loss_inputs} if causal_loss_inputs is not None else {})
                           } if causal else {}
        options = settings.analyze_options(
            types=types, roles=roles, causal=causal, store=None if no_store else store, out=out_dir,
            report=not no_report, processing=processing, device=device, dtype=dtype, seed=seed,
            max_memory=max_memory, full_matrix=full_matrix, null_heads=null_heads,
            reference_samples=reference_samples, classes=classes_name, stability=stability, stream=stream,
            **dataclasses.asdict(policy), **role_settings, **causal_settings)
        return command(*args, options=options, **kwargs)

    return wrapper


@cli.command("analyze")
@click.argument("model")
@analyze_options
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def analyze_command(model, options, as_json):
    """Whole pipeline on MODEL (hub name, local folder, or all-MiniLM-L6-v2 / induction-2l offline): PK with
    references and significance, Composition Score, roles, causal effects, graph selection and centrality,
    store, report."""
    from rich.console import Console

    from headgraph.report.summary import print_summary, summary_data
    from headgraph.workflow import run_analyze

    console = Console(stderr=True)
    # progress bars only on a terminal: in a pipe or log they are frames of noise around the one-line error
    outcome = run_analyze(model, options, console=console, progress=console.is_terminal)
    data = summary_data(outcome)
    show(data, as_json, print_summary)


@cli.command("sweep")
@click.argument("models", nargs=-1)
@click.option("--checkpoints", "checkpoints_dir", default=None, metavar="DIR",
              help="Sweep the model folders in DIR (a Trainer's output folder as it is): each step from the "
                   "folder's trainer_state.json, else from its name (checkpoint-500, step-500, step_500, step500, "
                   "global_step500, iter_0000500, ...-step500).")
@click.option("--revisions", default=None, metavar="LIST|FILE",
              help="Sweep the one MODEL (a hub name) at these hub revisions: step1000,step2000 or a file with one a "
                   "line; each from the local hub cache when it is there, its step from its name.")
@click.option("--steps", "steps_file", default=None, metavar="FILE", type=click.Path(dir_okay=False),
              help="CSV of checkpoint,step rows (a folder in DIR, a MODEL or a revision): these steps override "
                   "every other.")
@click.option("--final-step", type=click.IntRange(min=0), default=None, metavar="N",
              help="The training step of the one checkpoint that has none (the final model).")
@click.option("--sweep-id", default=None, metavar="ID",
              help="The sweep's id (default: DIR's or MODEL's name and a digest of the analysis options; the same "
                   "command resumes the same sweep).")
@click.option("--workers", default=SWEEP.workers, show_default=True, type=click.IntRange(min=1),
              help="Worker processes analysing checkpoints at once (the store is written by this process only).")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Run each checkpoint as a task on this Ray cluster (auto, HOST:PORT, or local for a new one); "
                   "needs headgraph[ray].")
@analyze_options
def sweep_command(models, checkpoints_dir, revisions, steps_file, final_step, sweep_id, workers, ray_address,
                  options):
    """One analyze per checkpoint (--checkpoints DIR), per MODEL, or per hub revision of MODEL (--revisions),
    all in one store, each run tagged with the sweep id and its step; checkpoints already stored for the sweep
    are skipped (rerun to resume). Query it with edge-history, role-history and emergence."""
    from pathlib import Path

    from rich.console import Console

    from headgraph.errors import UsageError
    from headgraph.sweep import (SweepOptions, checkpoints_at, checkpoints_in, checkpoints_of, parse_revisions,
                                 read_steps, run_sweep)

    if checkpoints_dir is not None and (models or revisions is not None):
        raise UsageError("give either --checkpoints DIR or MODEL arguments (with --revisions), not both")
    if revisions is not None and len(models) != 1:
        raise UsageError(f"--revisions are revisions of one MODEL; got {len(models)} MODEL arguments")
    steps = read_steps(steps_file) if steps_file is not None else None
    console = Console(stderr=True)
    if checkpoints_dir is not None:
        checkpoints, skipped = checkpoints_in(checkpoints_dir, final_step, steps)
        if skipped:
            console.print(f"skipped the folders in {checkpoints_dir} without config.json (not checkpoints): "
                          f"{', '.join(skipped)}", soft_wrap=True)
        label = Path(checkpoints_dir).resolve().name
    elif revisions is not None:
        checkpoints = checkpoints_at(models[0], parse_revisions(revisions), final_step, steps)
        label = Path(models[0]).name
    else:
        checkpoints, label = checkpoints_of(models, final_step, steps), "sweep"
    outcome = run_sweep(checkpoints, SweepOptions(options, sweep_id, workers, ray_address), label, console=console,
                        progress=console.is_terminal)
    for run in outcome.runs:
        click.echo(f"{run.checkpoint.step if run.checkpoint.step is not None else '-'}\t{run.checkpoint.name}\t"
                   f"{run.run_id}\t{'skipped (stored before)' if run.skipped else run.folder}")
    click.echo(f"sweep {outcome.sweep_id}: {len(outcome.runs)} runs in {outcome.store}")


OutputFormat = Literal["table", "json", "csv"]
FORMAT_OPTION = click.option(
    "--format", "fmt", type=click.Choice(get_args(OutputFormat)), default="table", show_default=True,
    help="Output: a table, a JSON list of row objects, or CSV.",
)


def _cell(value) -> str:
    """A table cell: floats to 4 significant digits, lists joined by ', ', maps as JSON, null as nothing."""
    import json

    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, default=str)
    return str(value)


def print_rows(rows, fmt: OutputFormat) -> None:
    """Query rows (a headgraph.loader.store.Rows) on stdout: `json` a JSON list of row objects, `csv` a header
    and the rows (lists joined by '; '), `table` a rich table."""
    import csv
    import io
    import json

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if fmt == "json":
        click.echo(json.dumps(rows.records(), indent=2, default=str))
    elif fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(rows.columns)
        for row in rows.rows:
            writer.writerow(["; ".join(map(str, v)) if isinstance(v, list) else ("" if v is None else v) for v in row])
        click.echo(buffer.getvalue(), nl=False)
    else:
        table = Table(*rows.columns, show_lines=False)
        for row in rows.rows:
            table.add_row(*(escape(_cell(v)) for v in row))
        Console().print(table)


@cli.command()
@click.argument("action", required=False, type=click.Choice(["delete"]))
@click.argument("run_id", required=False)
@FORMAT_OPTION
@store_options
def runs(action, run_id, fmt, store):
    """List the runs in the store with their status; `runs delete RUN_ID` removes one."""
    from headgraph.errors import UsageError
    from headgraph.loader.store import RUNS_QUERY

    if action is None:
        if run_id is not None:
            raise UsageError(f"unexpected argument {run_id!r}: use `headgraph runs` or `headgraph runs delete RUN_ID`")
        with store.open(read_only=True) as opened:
            rows = opened.read(RUNS_QUERY)
            if not rows.rows and fmt == "table":
                click.echo(f"no runs in {opened.description}; `headgraph analyze MODEL` stores one")
                return
            print_rows(rows, fmt)
        return
    if run_id is None:
        raise UsageError("name the run to delete: headgraph runs delete RUN_ID (ids: headgraph runs)")
    with store.open(read_only=True) as opened:  # a missing embedded store fails here instead of being created
        if not opened.has_run(run_id):
            raise UsageError(f"no run {run_id!r} in {opened.description}; `headgraph runs` lists them")
    with store.open() as opened:
        writer = opened.live_writer(run_id)
        if writer is not None:
            raise UsageError(f"run {run_id} is still being stored by {writer.describe()}; wait for it to finish")
        opened.delete_run(run_id)
        click.echo(f"deleted run {run_id} from {opened.description}")


@cli.command()
@click.argument("name", required=False)
@click.option("--run", "run_id", default=None, metavar="ID", help="Run to query (default: the latest complete run).")
@click.option("--param", "-p", "params", multiple=True, metavar="KEY=VALUE", help="A query parameter (repeatable).")
@click.option("--list", "list_queries", is_flag=True, help="List the named queries and their parameters.")
@FORMAT_OPTION
@store_options
def query(name, run_id, params, list_queries, fmt, store):
    """Run a named Cypher query from the library (headgraph query --list shows them)."""
    from headgraph.errors import UsageError
    from headgraph.queries.runner import parse_assignments, query_listing, run_named

    if list_queries:
        print_rows(query_listing(), fmt)
        return
    if name is None:
        raise UsageError("name a query to run, e.g. headgraph query hubs (headgraph query --list shows them)")
    given = parse_assignments(params)
    if run_id is not None:
        if given.get("run", run_id) != run_id:
            raise UsageError("give the run once: either --run ID or --param run=ID")
        given["run"] = run_id
    with store.open(read_only=True) as opened, opened.bounded_reads():
        print_rows(run_named(opened, name, given), fmt)


@cli.command()
@click.argument("statement")
@click.option("--param", "-p", "params", multiple=True, metavar="KEY=VALUE", help="A parameter; JSON values are parsed.")
@FORMAT_OPTION
@store_options
def cypher(statement, params, fmt, store):
    """Run ad-hoc read-only Cypher against the store (writes are refused)."""
    from headgraph.queries.runner import parse_assignments, parse_values

    with store.open(read_only=True) as opened, opened.bounded_reads():
        print_rows(opened.read(statement, parse_values(parse_assignments(params))), fmt)


@cli.command("roles")
@click.argument("model")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Write roles.parquet and roles.json here.")
@click.option("--n-inputs", default=ROLES.n_inputs, show_default=True, type=click.IntRange(min=2),
              help="Inputs per input set (sequential: at most).")
@click.option("--seed", default=PK.seed, show_default=True, type=click.IntRange(min=0),
              help="Seed of the generated inputs.")
@click.option("--tau", default=ROLES.tau, show_default=True, help="Sieve bias threshold of the one-sided test.")
@click.option("--alpha", default=ROLES.alpha, show_default=True,
              type=click.FloatRange(0, 1, min_open=True, max_open=True), help="Significance level of the decision.")
@click.option("--correction", type=click.Choice(get_args(Correction)), default=ROLES.correction, show_default=True,
              help="Multiple-testing correction across heads.")
@click.option("--design", "role_design", type=click.Choice(get_args(RoleDesign)), default=ROLES.design, show_default=True,
              help="sequential: stop an input set once every head is settled; fixed: t-tests on all --n-inputs.")
@click.option("--identity-map", is_flag=True, help="Also print the layer x head map of identity scores.")
@DEVICE_OPTION
def roles_command(model, out_dir, n_inputs, seed, tau, alpha, correction, role_design, identity_map, device):
    """Test every head of MODEL for roles (sieve bias tests) and print the heads per role per layer."""
    from rich.console import Console
    from rich.progress import Progress

    from headgraph.analysis.roles import compute_roles
    from headgraph.loader.stream import open_model, patterns_only
    from headgraph.report.summary import print_roles
    from headgraph.runs import write_roles

    opened = open_model(model, processing="raw", device=device)  # a folder's weights held as stored
    with patterns_only(opened) as loaded, Progress(transient=True, console=Console(stderr=True)) as progress:
        heads, meta = compute_roles(loaded, seed=seed, progress=progress, n_inputs=n_inputs, tau=tau, alpha=alpha,
                                    correction=correction, design=role_design)
    print_roles(loaded.name, heads, meta, Console(), identity_map=identity_map)
    if out_dir:
        paths = write_roles(heads, {"model": loaded.name, "source": str(loaded.source), **meta}, out_dir)
        click.echo(f"wrote {' and '.join(str(p) for p in paths)}")


@cli.command("evaluate")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--classes", "classes_name", default=None,
              help="Known classes: ioi (Wang et al. 2023), pk-paper (the PK paper's colouring) or a JSON file "
                   '{"source": ..., "classes": {"name": ["L5H1", ...]}} (default: the model\'s known classes, '
                   "pk-paper for gpt2 and for a folder without run.json; none otherwise).")
@click.option("--top-k", default=20, show_default=True, type=click.IntRange(min=1), help="Top pairs per type.")
@click.option("--causal-threshold", default=CAUSAL_THRESHOLD, show_default=True, type=float,
              help="A pair is causal when the lower end of its local effect's 95% interval exceeds this.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def evaluate_command(run_dir, classes_name, top_k, causal_threshold, as_json):
    """PK and Composition Score against known head classes and against causal effects, from RUN_DIR.

    Classes, per metric and type (OQ, OK, OV, and all pooled): in-class / out-of-class heads of the top-k
    graph, and ROC-AUC / PR-AUC at separating pairs with both heads in known classes from the rest. Causal
    effects (runs analysed with them), per metric and type: Spearman rho with the local effect and its
    bootstrap interval, ROC-AUC / PR-AUC at finding the causal pairs, precision of the top-k pairs.
    """
    from headgraph.report.summary import evaluation_data, print_evaluation

    data = evaluation_data(run_dir, classes_name, top_k, causal_threshold)
    show(data, as_json, print_evaluation)


@cli.command("report")
@click.argument("run")
@CLASSES_OPTION
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Write the report here instead of into the run folder.")
@selection_options
@store_options
def report_command(run, classes_name, out_dir, policy, store):
    """Render report.md, report.html and the figures of RUN (a run folder, or a stored run's id)."""
    from rich.console import Console
    from rich.progress import Progress

    from headgraph.analysis.classes import load_classes
    from headgraph.report.report import FIGURE_COUNT, render_report
    from headgraph.runs import load_run, resolve_run_dir

    loaded = load_run(resolve_run_dir(run, store))
    classes = load_classes(classes_name) if classes_name else None
    with Progress(transient=True, console=Console(stderr=True)) as progress:
        task = progress.add_task("rendering report", total=FIGURE_COUNT + 1)
        paths = render_report(loaded, policy=policy, classes=classes, out_dir=out_dir,
                              advance=lambda: progress.advance(task))
    click.echo(f"wrote {paths['report.md']}, {paths['report.html']} and "
               f"{sum(name.endswith('.png') for name in paths)} figures (PNG + SVG) to {paths['report.md'].parent}")


@cli.command("view")
@click.argument("run")
@click.option("--no-open", is_flag=True, help="Print the path of report.html instead of opening a browser.")
@store_options
def view_command(run, no_open, store):
    """Open the report.html of RUN (a run folder, or a stored run's id) with its interactive graph in the web
    browser; render it first when the folder has none."""
    import webbrowser

    from headgraph.errors import UsageError
    from headgraph.report.report import report_page
    from headgraph.runs import resolve_run_dir

    path, rendered = report_page(resolve_run_dir(run, store))
    if rendered:
        click.echo(f"rendered {path} (default selection; `headgraph report` takes other options)", err=True)
    if no_open:
        click.echo(path)
    elif webbrowser.open(path.resolve().as_uri()):
        click.echo(f"opened {path}")
    else:
        raise UsageError(f"no web browser found to open {path}; open the file yourself or pass --no-open")


@cli.command("stability")
@click.argument("run_dir", metavar="RUN", type=click.Path(file_okay=False))
@click.option("--variant", "variants", multiple=True, type=click.Choice(list(STABILITY_VARIANTS)),
              help="Recompute under this variant only (repeatable; default: all of them).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def stability_command(run_dir, variants, as_json):
    """Recompute RUN (a run folder) under fp64, rank tolerance x10 and /10, another null seed, another draw of
    the role and causal inputs (and CUDA where present); per type: Spearman of PK and of effect, Jaccard of the
    selected edges, significance and role decisions that flip. Written to RUN/stability.json (shown in the
    report)."""
    from rich.console import Console

    from headgraph.report.summary import print_stability
    from headgraph.runs import load_run
    from headgraph.stability import run_stability
    from headgraph.workflow import run_analyze

    console = Console(stderr=True)
    report = run_stability(load_run(run_dir), run_analyze, variants or tuple(STABILITY_VARIANTS), console=console,
                           progress=console.is_terminal)
    show(report, as_json, print_stability)


@cli.command("compare")
@click.argument("run_a")
@click.argument("run_b")
@click.option("--changes", default=10, show_default=True, type=click.IntRange(min=0),
              help="Also list the N pairs whose PK changed most among those that stay in (or out of) the graph.")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=0),
              help="Rows printed per table (0: all); --json always gives all.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@selection_options
@store_options
def compare_command(run_a, run_b, changes, limit, as_json, policy, store):
    """Edges and roles that appear, vanish or change most from RUN_A to RUN_B (same architecture)."""
    import json

    from headgraph.report.compare import compare_runs, comparison_json, print_comparison
    from headgraph.runs import load_run, resolve_run_dir

    comparison = compare_runs(load_run(resolve_run_dir(run_a, store)), load_run(resolve_run_dir(run_b, store)),
                              policy, changes)
    if as_json:
        click.echo(json.dumps(comparison_json(comparison), indent=2))
    else:
        print_comparison(comparison, limit or None)


@cli.command("export")
@click.argument("run_dir", metavar="RUN")
@click.option("--format", "fmt", required=True, metavar="FORMAT",
              help="graphml, gexf, cytoscape (Cytoscape.js JSON), csv (nodes.csv + edges.csv) or neo4j-import "
                   "(CSVs for neo4j-admin database import full).")
@click.option("--out", "out", required=True, metavar="PATH",
              help="The file to write (graphml, gexf, cytoscape) or the folder (csv, neo4j-import).")
@selection_options
def export_command(run_dir, fmt, out, policy):
    """Write the selected head graph of RUN (a run folder) for Gephi, Cytoscape, networkx, pandas or Neo4j."""
    from headgraph.export import export_run
    from headgraph.runs import load_run

    exported = export_run(load_run(run_dir), policy, fmt, out)
    click.echo(f"wrote {', '.join(str(p) for p in exported.paths)}")
    if exported.command:
        click.echo(f"import into a stopped, empty Neo4j database: {exported.command}")


@cli.group("neo4j")
def neo4j_group():
    """A local loopback Neo4j 5.26 built from Maven Central jars (no Docker); same as scripts/neo4j-local."""


@neo4j_group.command("assemble")
@click.option("--resolve", is_flag=True, help="First re-resolve the jars with Maven and rewrite the lock file.")
def neo4j_assemble(resolve):
    """Fetch the locked jars once into the server's home (reused afterwards)."""
    import time

    from headgraph.neo4j_local.server import (LOCK_FILE, LocalServer, locked_server_version, assemble,
                                              assembled_version, resolve_lock)

    server, began = LocalServer.from_env(), time.monotonic()
    if resolve:
        locked = locked_server_version(resolve_lock(LOCK_FILE), LOCK_FILE)
        click.echo(f"Neo4j {locked} pinned in {LOCK_FILE} ({time.monotonic() - began:.1f} s)")
        if assembled_version(server) not in (None, locked):
            click.echo(f"{server.home} holds Neo4j {assembled_version(server)}; remove it to assemble {locked}")
    click.echo(f"Neo4j {assemble(server)} assembled in {server.home} ({time.monotonic() - began:.1f} s)")


@neo4j_group.command("start")
@click.option("--print-env", is_flag=True, help="Print only `export NEO4J_...` lines on stdout (for eval).")
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait for Bolt.")
@click.option("--short-lived", is_flag=True,
              help="For a server stopped after a brief workload (a test run): the JVM's quick JIT and serial "
                   "collector, less CPU overall, slower on long heavy queries.")
def neo4j_start(print_env, timeout, short_lived):
    """Assemble once, start in the background, wait for Bolt (no-op when already running)."""
    from headgraph.neo4j_local.server import LocalServer, env_lines, start

    server = LocalServer.from_env()
    start(server, timeout=timeout, log=lambda m: click.echo(m, err=print_env), short_lived=short_lived)
    click.echo("\n".join(env_lines(server)) if print_env else f"NEO4J_URI={server.uri}")


@neo4j_group.command("stop")
def neo4j_stop():
    """Stop the local server cleanly (SIGTERM; SIGKILL only if it hangs)."""
    from headgraph.neo4j_local.server import LocalServer, stop

    stop(LocalServer.from_env(), log=click.echo)


@neo4j_group.command("status")
def neo4j_status():
    """URI, pid and server version of the local server; exit 3 when it is not running."""
    from headgraph.errors import StoreUnavailable
    from headgraph.neo4j_local.server import LocalServer, status

    server = LocalServer.from_env()
    running = status(server)
    if running is None:
        raise StoreUnavailable(f"the local Neo4j ({server.home}) is not running; start it: headgraph neo4j start")
    click.echo(f"uri      {server.uri}\npid      {running.pid}\nversion  {running.version}\nhome     {server.home}")


@neo4j_group.command("browser")
def neo4j_browser():
    """Where Neo4j Browser is, how to connect, and how to load headgraph's style and guide."""
    from headgraph.neo4j_local.server import LocalServer, browser_hint

    click.echo("\n".join(browser_hint(LocalServer.from_env())))


# Process settings read once, when torch loads (this module does not import torch); the user's environment wins.
# GNU OpenMP's default active wait keeps torch's idle worker threads spinning, which on a shared machine takes
# the cores the working threads need: on a busy 2-core box GPT-2 small's bases took 1-3 s instead of 0.4 s and
# TransformerLens' O->Q/K/V 18 s instead of 8 s. (Transparent huge pages, THP_MEM_ALLOC_ENABLE=1, were tried
# and left out: faster re-allocation, but a fresh process's first PK pass took 1.1-1.3 s instead of 0.6 s.)
PROCESS_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply_process_environment() -> None:
    """Set PROCESS_ENVIRONMENT where the user has not: call it before torch loads (the benchmarks and the tests'
    command server run their processes as `headgraph` does)."""
    for name, value in PROCESS_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def _exit_code(args: list[str]) -> int:
    """Run the command line `args`; user-facing errors become one line on stderr and their exit code."""
    try:
        cli.main(args=args, prog_name="headgraph", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except HeadgraphError as e:
        if "--debug" in args:
            raise
        click.echo(f"error: {e}", err=True)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - last line of defence for the CLI
        if "--debug" in args:
            raise
        click.echo(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", err=True)
        return 1
    return 0


def _end_process(code: int) -> None:
    """End the process with `code` once the atexit handlers have run (temporary folders, logging, Ray) and the
    output is flushed, skipping the interpreter's own teardown: with torch, transformers and TransformerLens
    loaded, its last garbage collection over half a million objects and torch's operator deregistration took
    about 2 s of every `headgraph` command on a 2-core machine, and nothing in it outlives the process (every
    store and file is closed by the command itself)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv=None):
    """Console entry point (argv None: the process's own arguments, and the process ends here); called with
    argv, as tests do, a failure raises SystemExit with its exit code."""
    apply_process_environment()
    code = _exit_code(sys.argv[1:] if argv is None else list(argv))
    if argv is None:
        _end_process(code)
    if code:
        sys.exit(code)


@cli.command()
@click.option("--db", default=None, metavar="PATH", help="Embedded store to check (env HEADGRAPH_DB).")
@click.option("--neo4j", "neo4j_uri", default=None, metavar="URI", help="Neo4j server to check (env NEO4J_URI).")
def doctor(db, neo4j_uri):
    """Versions, torch device, Neo4j reachability, embedded store path and offline models."""
    from rich.console import Console
    from rich.table import Table

    from headgraph.doctor import report
    from headgraph.loader.open_store import embedded_path, neo4j_settings

    table = Table(title="headgraph doctor", show_header=False)
    uri, user, password, _ = neo4j_settings(neo4j_uri)
    rows = report(embedded_path(db), uri, user, password)
    for label, value in rows:
        table.add_row(label, value)
    Console().print(table)
