"""`headgraph sweep`: one `headgraph analyze` per checkpoint of a training run (or per model), every run stored
in the same store and tagged with the sweep's id and the checkpoint's training step.

- Checkpoints: the model folders in `--checkpoints DIR` (a folder holding config.json), ordered by the step that
  ends their name (`induction-2l-step3000` is step 3000); the one folder without a step is the final model and
  needs `--final-step N`. Or MODEL arguments: the step that ends each name, `final_step` for a name without one,
  or no step at all (such runs keep the order given and are left out of the step queries).
- Sweep id: given, or `<DIR name>-<8 hex>` of the analysis options, so that rerunning the same command (same
  folder, same options) names the same sweep and another set of options a new one.
- Resumable: a checkpoint whose complete run with this sweep id, model and step is in the store is skipped.
- Execution: worker processes (`spawn`ed, `workers` of them) or Ray tasks (`ray`: a cluster's address, the
  optional extra headgraph[ray]) compute each checkpoint's analysis and run folder (on the worker's machine)
  without touching the store; the driver stores each finished run (the embedded store has one writer) through
  `GraphStore.load_run`, so a run is invisible until complete and a driver killed mid-load leaves a partial run
  that the next read-write open removes. A worker that dies or fails is reported, never retried: its checkpoint
  has no run in the store, the others are stored, and rerunning the command analyses only what is missing.

A step is the checkpoint's position in training, read from its name; headgraph cannot check that it is true.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from rich.console import Console

from headgraph.errors import HeadgraphError, UsageError, first_line
from headgraph.loader.store import RunGraph
from headgraph.workflow import AnalyzeOptions, progress_bar, run_analyze

_SWEEP_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
_STEP = re.compile(r"^(?P<stem>.+?)[-_]step[-_]?(?P<step>\d+)$")
SWEEP_RUNS_QUERY = """
MATCH (r:Run) WHERE r.sweep = $sweep AND r.status = 'complete'
RETURN r.id AS id, r.model AS model, r.step AS step
"""


class SweepFailed(HeadgraphError):
    """Some checkpoints of a sweep were not stored (a worker died or failed); the rest were."""


@dataclass(frozen=True)
class Checkpoint:
    """One model of a sweep: what `headgraph analyze` loads and the training step it is tagged with."""

    model: str
    step: int | None

    @property
    def name(self) -> str:
        return Path(self.model).name

    def describe(self) -> str:
        return self.name if self.step is None else f"{self.name} (step {self.step})"


@dataclass(frozen=True)
class SweepOptions:
    """What `headgraph sweep` was asked to do besides which checkpoints: the analysis of each (its `out_dir` is
    the sweep's folder, its store the sweep's store), the sweep id (None: derived, see `sweep_id`), and where
    to compute: `workers` local processes, or the Ray cluster at `ray`."""

    analyze: AnalyzeOptions = dataclasses.field(default_factory=AnalyzeOptions)
    sweep_id: str | None = None
    workers: int = 1
    ray: str | None = None  # a Ray cluster's address ("auto", "HOST:PORT", "local": a new one) instead of workers

    def __post_init__(self):
        if self.sweep_id is not None and not _SWEEP_ID.match(self.sweep_id):
            raise UsageError(f"bad sweep id {self.sweep_id!r}: use letters, digits and . _ : - (no spaces or slashes)")
        if self.workers < 1:
            raise UsageError(f"--workers must be at least 1 (got {self.workers})")
        if self.ray is not None and self.workers != 1:
            raise UsageError("--workers counts local processes; with --ray the cluster's CPUs decide: drop --workers")
        if self.analyze.store is None:
            raise UsageError("a sweep stores its runs: drop --no-store (the run folders are written as well)")


@dataclass(frozen=True)
class SweepRun:
    """One checkpoint's outcome: its run id and folder (folder None when skipped: stored by an earlier sweep)."""

    checkpoint: Checkpoint
    run_id: str
    folder: Path | None

    @property
    def skipped(self) -> bool:
        return self.folder is None


@dataclass(frozen=True)
class SweepOutcome:
    """A finished sweep: its id, folder and store, one SweepRun per checkpoint in step order, the report's files."""

    sweep_id: str
    folder: Path
    store: str
    runs: tuple[SweepRun, ...]
    report: dict[str, Path]


def parse_step(name: str) -> int | None:
    """The training step that ends a checkpoint's name, or None.

    >>> parse_step("induction-2l-step3000"), parse_step("pythia-70m_step_143000"), parse_step("induction-2l")
    (3000, 143000, None)
    """
    match = _STEP.match(Path(name).name)
    return int(match["step"]) if match else None


def _ordered(checkpoints: list[Checkpoint]) -> list[Checkpoint]:
    names = [c.name for c in checkpoints]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"checkpoint {repeated[0]} is named twice: each checkpoint is analysed once per sweep")
    steps = [c.step for c in checkpoints if c.step is not None]
    twice = sorted({s for s in steps if steps.count(s) > 1})
    if twice:
        raise UsageError(f"two checkpoints have step {twice[0]}: "
                         f"{', '.join(c.name for c in checkpoints if c.step == twice[0])}")
    return sorted(checkpoints, key=lambda c: (c.step is None, c.step or 0))  # stable: step-less ones as given


def checkpoints_in(folder, final_step: int | None = None) -> list[Checkpoint]:
    """The model folders in `folder`, ordered by step; the one without a step in its name gets `final_step`.

    >>> from headgraph.loader.models import PACKAGED_MODELS_DIR
    >>> [c.describe() for c in checkpoints_in(PACKAGED_MODELS_DIR, final_step=6000)]
    ['induction-2l-step2000 (step 2000)', 'induction-2l-step3000 (step 3000)', 'induction-2l-step4000 (step 4000)', 'induction-2l (step 6000)']
    """
    path = Path(folder)
    if not path.is_dir():
        raise UsageError(f"--checkpoints {folder} is not a folder; pass the folder that holds the checkpoints")
    models = sorted(p for p in path.iterdir() if (p / "config.json").is_file())
    if not models:
        raise UsageError(f"--checkpoints {folder} holds no model folder (a folder with config.json)")
    stepless = [p.name for p in models if parse_step(p.name) is None]
    if len(stepless) > 1:
        raise UsageError(f"--checkpoints {folder}: {', '.join(stepless)} have no step in their names "
                         "(…-step3000); at most one, the final model, may lack it")
    if stepless and final_step is None:
        raise UsageError(f"--checkpoints {folder}: {stepless[0]} has no step in its name; give its step with "
                         "--final-step N")
    return _ordered([Checkpoint(str(p), parse_step(p.name) if p.name not in stepless else final_step)
                     for p in models])


def checkpoints_of(models, final_step: int | None = None) -> list[Checkpoint]:
    """MODEL arguments as checkpoints: the step in each name, else `final_step` (for at most one), else None.

    >>> [c.describe() for c in checkpoints_of(["induction-2l", "induction-2l-step2000"], final_step=6000)]
    ['induction-2l-step2000 (step 2000)', 'induction-2l (step 6000)']
    """
    if not models:
        raise UsageError("name the models to sweep, or pass --checkpoints DIR")
    stepless = [m for m in models if parse_step(m) is None]
    if final_step is not None and len(stepless) != 1:
        raise UsageError(f"--final-step gives the step of the one model without a step in its name; "
                         f"{len(stepless)} models lack one")
    return _ordered([Checkpoint(m, parse_step(m) if parse_step(m) is not None else final_step) for m in models])


def sweep_id(options: AnalyzeOptions, label: str) -> str:
    """`<label>-<8 hex>`: the hex digest of the analysis options (not of where the runs go), so the same
    command names the same sweep.

    >>> sweep_id(AnalyzeOptions(), "models") == sweep_id(AnalyzeOptions(out_dir="elsewhere"), "models")
    True
    """
    settings = dataclasses.replace(options, out_dir=None, store=None, report=True, sweep=None, step=None)
    digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:8]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "sweep"
    return f"{slug}-{digest}"


def _analyze(checkpoint: Checkpoint, options: AnalyzeOptions, threads: int) -> tuple[Path, RunGraph]:
    """In a worker: the whole analysis of one checkpoint on `threads` torch threads, run folder written,
    nothing stored."""
    import torch

    torch.set_num_threads(threads)
    outcome = run_analyze(checkpoint.model, options, console=Console(stderr=True), progress=False)
    return outcome.folder, outcome.graph


# a checkpoint's analysis as it comes back: (checkpoint, (folder, graph), None) or (checkpoint, None, why not)
Finished = tuple[Checkpoint, tuple[Path, RunGraph] | None, str | None]


def _in_processes(jobs: list[tuple[Checkpoint, AnalyzeOptions]], workers: int) -> Iterator[Finished]:
    """The analyses in `workers` spawned local processes, as each finishes."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        pending = {pool.submit(_analyze, checkpoint, options, threads): checkpoint for checkpoint, options in jobs}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                checkpoint = pending.pop(future)
                try:
                    yield checkpoint, future.result(), None
                except BrokenProcessPool:
                    yield checkpoint, None, "a worker process died before it finished"
                except Exception as e:  # noqa: BLE001 - reported with the checkpoint it belongs to
                    yield checkpoint, None, f"{type(e).__name__}: {first_line(e)}"


@contextlib.contextmanager
def _ray_cluster(address: str) -> Iterator[Any]:
    """The `ray` module connected to the cluster at `address` (UsageError when Ray is missing or the cluster
    does not answer), shut down on exit; connected before the store is opened, so a refused connection writes
    nothing."""
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'headgraph[ray]'") from None
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError, ray.exceptions.RayError) as e:  # RayError: a missing token
        raise UsageError(f"cannot reach the Ray cluster at --ray {address}: {first_line(e)} (a cluster with token "
                         "authentication needs RAY_AUTH_MODE=token and its token, RAY_AUTH_TOKEN or "
                         "RAY_AUTH_TOKEN_PATH, here too)") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def _on_ray(jobs: list[tuple[Checkpoint, AnalyzeOptions]], ray: Any) -> Iterator[Finished]:
    """The analyses as Ray tasks (one CPU and one torch thread each) on the connected cluster, as each
    finishes; a task whose worker dies is not retried (it is reported, like a local worker's)."""
    remote = ray.remote(num_cpus=1, max_retries=0)(_analyze)
    pending = {remote.remote(checkpoint, options, 1): checkpoint for checkpoint, options in jobs}
    while pending:
        (ready,), _ = ray.wait(list(pending), num_returns=1)
        checkpoint = pending.pop(ready)
        try:
            yield checkpoint, ray.get(ready), None
        except ray.exceptions.RayTaskError as e:  # the task raised: report its own exception
            yield checkpoint, None, f"{type(e.cause).__name__}: {first_line(e.cause)}"
        except ray.exceptions.RayError as e:  # the worker or its node died
            yield checkpoint, None, f"its Ray worker died before it finished ({type(e).__name__})"


def run_sweep(checkpoints: list[Checkpoint], options: SweepOptions, label: str = "sweep",
              console: Console | None = None, progress: bool = True) -> SweepOutcome:
    """Analyse every checkpoint not yet stored for this sweep and store it (see the module docstring).
    Raises SweepFailed, after storing every checkpoint that finished, when a worker died or failed."""
    from headgraph.loader.models import resolve_model

    console = console or Console(stderr=True)
    identity = options.sweep_id or sweep_id(options.analyze, label)
    base = Path(options.analyze.out_dir or Path("runs") / identity)
    # the model name its runs are stored under; an unknown model fails here, before any work
    keys = {c: (resolve_model(c.model)[0], c.step) for c in checkpoints}
    description = options.analyze.store.check()
    cluster = _ray_cluster(options.ray) if options.ray is not None else contextlib.nullcontext()
    # the store is held for the whole sweep: the driver is its one writer
    with cluster as ray, options.analyze.store.open() as store:
        stored = {(row["model"], row["step"]): row["id"] for row in store.read(SWEEP_RUNS_QUERY, {"sweep": identity}).records()}
        done = [SweepRun(c, stored[keys[c]], None) for c in checkpoints if keys[c] in stored]
        jobs = [(c, dataclasses.replace(options.analyze, out_dir=str(base / c.name), store=None, sweep=identity,
                                        step=c.step)) for c in checkpoints if keys[c] not in stored]
        console.print(f"sweep {identity}: {len(checkpoints)} checkpoints, {len(done)} already stored in {description}",
                      soft_wrap=True)
        failures: list[str] = []
        with progress_bar(console, progress) as bar:
            task = bar.add_task(f"sweep {identity}", total=len(checkpoints), completed=len(done))
            results = (_on_ray(jobs, ray) if ray is not None
                       else _in_processes(jobs, min(options.workers, max(1, len(jobs)))))
            for checkpoint, analysed, failure in results if jobs else ():
                if failure is not None:
                    failures.append(f"{checkpoint.describe()}: {failure}")
                    continue
                folder, graph = analysed
                store.load_run(graph)
                done.append(SweepRun(checkpoint, graph.run["id"], folder))
                bar.advance(task)
                console.print(f"stored {checkpoint.describe()} as run {graph.run['id']}", soft_wrap=True)
        report = _render_report(store, identity, base) if options.analyze.report and not failures else {}
    if failures:
        raise SweepFailed(f"sweep {identity}: {len(failures)} of {len(checkpoints)} checkpoints not stored "
                          f"({'; '.join(failures)}); the others are, rerun the same command to analyse the rest")
    order = {c: i for i, c in enumerate(checkpoints)}
    return SweepOutcome(identity, base, description, tuple(sorted(done, key=lambda r: order[r.checkpoint])), report)


def _render_report(store, identity: str, base: Path) -> dict[str, Path]:
    """The sweep's report from what the store holds of it (earlier invocations' checkpoints included)."""
    import pandas as pd

    from headgraph.queries.runner import run_named
    from headgraph.report.sweep import SweepData, render_sweep_report

    emergence = {name: pd.DataFrame(run_named(store, name, {"sweep": identity}).records())
                 for name in ("emergence", "role-emergence")}
    return render_sweep_report(SweepData.read(store, identity), emergence["emergence"], emergence["role-emergence"], base)
