"""`headgraph sweep`: one `headgraph analyze` per checkpoint of a training run (or per model), every run stored
in the same store and tagged with the sweep's id and the checkpoint's training step.

- Checkpoints: the model folders in `--checkpoints DIR` (its sub-folders holding config.json; other sub-folders
  are skipped and listed), as a training run leaves them, ordered by step. A folder's step is the `global_step`
  of its trainer_state.json (the HF Trainer's `checkpoint-500/`), else the number its name ends in after
  checkpoint, step, global_step or iter (`checkpoint-500`, `step-500`, `step_500`, `step500`, `global_step500`,
  `iter_0000500`, `induction-2l-step3000`; any case); the one folder without a step is the final model and
  needs `--final-step N`. Or MODEL arguments, stepped alike (a name without a step may take `final_step`, or
  none: such runs keep the order given and are left out of the step queries). Or one hub MODEL at several
  `--revisions` (Pythia's `step1000` ...): each revision's snapshot comes from the local hub cache (else the
  hub, when it answers), its step from the revision's name, and its run is stored as model `<name>@<revision>`.
  A `--steps FILE` (CSV rows `checkpoint,step`) gives steps that override all of these.
- Sweep id: given, or `<DIR name>-<8 hex>` of the analysis options, so that rerunning the same command (same
  folder, same options) names the same sweep and another set of options a new one.
- Resumable: a checkpoint whose complete run with this sweep id, model and step is in the store is skipped (a
  revision too, whether or not it is still in the hub cache).
- Execution: worker processes (`spawn`ed, `workers` of them) or Ray tasks (`ray`: a cluster's address, the
  optional extra headgraph[ray]) compute each checkpoint's analysis and run folder (on the worker's machine)
  without touching the store; the driver stores each finished run (the embedded store has one writer) through
  `GraphStore.store_run`, so a run is invisible until complete and a driver killed mid-load leaves a partial run
  that the next read-write open removes. A worker that dies or fails, or a revision neither in the cache nor on
  the hub, is reported, never retried: its checkpoint has no run in the store, the others are stored, and
  rerunning the command analyses only what is missing.

A step is the checkpoint's position in training as its trainer_state.json, its name or --steps says; headgraph
cannot check that it is true.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import os
import re
import socket
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from rich.console import Console

from headgraph.errors import HeadgraphError, ModelUnavailable, UsageError, first_line
from headgraph.loader.store import RunGraph
from headgraph.workflow import AnalyzeOptions, progress_bar, run_analyze

_SWEEP_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
_STEP = re.compile(r"(?:^|[-_.])(?:checkpoint|global_step|step|iter)[-_]?(?P<step>\d+)$", re.IGNORECASE)
TRAINER_STATE = "trainer_state.json"  # the HF Trainer's record of a checkpoint: global_step, log_history
REVISION_LINKS = "revisions"  # the sweep folder's folder of links to the revisions' snapshots
NAME_SHAPES = "checkpoint-500, step-500, step_500, step500, global_step500 or iter_0000500"

StepOrigin = Literal["--steps", "trainer_state.json", "name", "--final-step"]


class SweepFailed(HeadgraphError):
    """Some checkpoints of a sweep were not stored (a worker died or failed, a revision was missing); the rest were."""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")


@dataclass(frozen=True)
class Checkpoint:
    """One model of a sweep: what `headgraph analyze` loads (a folder or model name; a hub repo at `revision`),
    the training step it is tagged with, and where that step was read (None: it has none)."""

    model: str
    step: int | None
    origin: StepOrigin | None = None
    revision: str | None = None

    @property
    def name(self) -> str:
        """Its run folder's name; for a revision `<repo name>@<revision>`, the model name its run is stored as."""
        base = Path(self.model).name
        return base if self.revision is None else f"{base}@{_slug(self.revision)}"

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
    """The training step a checkpoint's (or revision's) name ends in, or None: the number after checkpoint,
    step, global_step or iter, with or without a - or _ between, in any case.

    >>> [parse_step(n) for n in ("checkpoint-500", "step-100", "step_200", "Step300", "global_step400",
    ...                          "iter_0001000", "induction-2l-step3000", "pythia-70m_step_143000", "induction-2l")]
    [500, 100, 200, 300, 400, 1000, 3000, 143000, None]
    """
    match = _STEP.search(Path(name).name)
    return int(match["step"]) if match else None


def trainer_step(folder: Path) -> int | None:
    """The `global_step` of the folder's trainer_state.json, None without that file; UsageError when it cannot
    be read or holds no step."""
    path = Path(folder) / TRAINER_STATE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read {path}: {first_line(e)}; repair it, or give the steps with --steps FILE"
                         ) from None
    step = state.get("global_step") if isinstance(state, dict) else None
    if type(step) is not int or step < 0:
        raise UsageError(f"{path} holds no global_step (a whole number of training steps); repair it, or give the "
                         "steps with --steps FILE")
    return step


def training_losses(folders: Iterable[str]) -> pd.DataFrame:
    """The training loss over the steps (`step`, `loss`) that the trainer_state.json of these checkpoint folders
    logged (their `log_history`; each step once, the later checkpoint's value where two differ), empty when
    none did. A folder without a readable file (gone, or on another machine) adds nothing. A loss is what the
    trainer logged: the HF Trainer's is the mean over the batches since its previous log, not the loss of that
    step's weights."""
    losses: dict[int, float] = {}
    for folder in folders:
        try:
            history = json.loads((Path(folder) / TRAINER_STATE).read_text()).get("log_history")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            continue
        for entry in history if isinstance(history, list) else []:
            if isinstance(entry, dict) and type(entry.get("step")) is int and type(entry.get("loss")) in (int, float):
                losses[entry["step"]] = float(entry["loss"])
    return pd.DataFrame(sorted(losses.items()), columns=["step", "loss"])


def read_steps(path) -> dict[str, int]:
    """{checkpoint: step} of a CSV file of `checkpoint,step` rows: a folder name in --checkpoints DIR, a MODEL
    argument or a revision, and its step (a first row `checkpoint,step` is a header).

    >>> import tempfile; file = Path(tempfile.mkdtemp()) / "steps.csv"
    >>> _ = file.write_text("folder,step\\nfinal, 6000\\n\\nckpt-a,100\\n")
    >>> read_steps(file)
    {'final': 6000, 'ckpt-a': 100}
    """
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read --steps {path}: {first_line(e)}") from None
    steps: dict[str, int] = {}
    reader = csv.reader(io.StringIO(text))
    for row in reader:
        cells = [cell.strip() for cell in row]
        if not any(cells) or (reader.line_num == 1 and len(cells) == 2 and cells[1].lower() == "step"):
            continue
        if len(cells) != 2 or not cells[0] or not re.fullmatch(r"[0-9]+", cells[1]):
            raise UsageError(f"--steps {path} line {reader.line_num}: expected checkpoint,step (a name and a whole "
                             f"number), got {','.join(row)!r}")
        if cells[0] in steps:
            raise UsageError(f"--steps {path} gives {cells[0]} twice")
        steps[cells[0]] = int(cells[1])
    if not steps:
        raise UsageError(f"--steps {path} holds no checkpoint,step row")
    return steps


def _step_of(key: str, folder: Path | None, steps: Mapping[str, int]) -> tuple[int | None, StepOrigin | None]:
    """The step of the checkpoint `key` (a folder at `folder`, if it is one): --steps first, then the folder's
    trainer_state.json, then its name."""
    if key in steps:
        return steps[key], "--steps"
    step = trainer_step(folder) if folder is not None and folder.is_dir() else None
    if step is not None:
        return step, "trainer_state.json"
    step = parse_step(key)
    return (step, "name") if step is not None else (None, None)


def _unknown_steps(steps: Mapping[str, int], names: Iterable[str], what: str) -> None:
    unknown = [name for name in steps if name not in set(names)]
    if unknown:
        raise UsageError(f"--steps names {', '.join(unknown)}: not {what}")


def _final_step(checkpoints: list[Checkpoint], final_step: int | None, where: str, no_step: str | None
                ) -> list[Checkpoint]:
    """The checkpoints, the one without a step given `final_step`. `no_step`: why a checkpoint has none, when
    each needs one (None: a checkpoint may have no step)."""
    stepless = [c.revision or c.name for c in checkpoints if c.step is None]
    if no_step is not None and (len(stepless) > 1 or (stepless and final_step is None)):
        fix = ("give its step with --final-step N" if len(stepless) == 1 else
               "at most one, the final model, may lack it (--final-step N); give the others' with --steps FILE")
        raise UsageError(f"{where}: {', '.join(stepless)} {'has' if len(stepless) == 1 else 'have'} no step "
                         f"({no_step}); {fix}")
    if final_step is not None and len(stepless) != 1:
        raise UsageError(f"--final-step gives the step of the one checkpoint without one; {len(stepless)} of "
                         f"{where} lack one")
    return [dataclasses.replace(c, step=final_step, origin="--final-step") if c.step is None and final_step is not None
            else c for c in checkpoints]


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


def checkpoints_in(folder, final_step: int | None = None, steps: Mapping[str, int] | None = None
                   ) -> tuple[list[Checkpoint], list[str]]:
    """(the model folders in `folder` in step order, the names of its other sub-folders: not checkpoints).
    `steps` ({folder name: step}, from --steps) come first, then each folder's trainer_state.json, then its
    name; the one folder without a step gets `final_step`.

    >>> from headgraph.loader.models import PACKAGED_MODELS_DIR
    >>> found, skipped = checkpoints_in(PACKAGED_MODELS_DIR, final_step=6000)
    >>> [c.step for c in found], skipped
    ([2000, 3000, 4000, 6000], [])
    >>> [(c.name, c.origin) for c in found][-2:]
    [('induction-2l-step4000', 'name'), ('induction-2l', '--final-step')]
    """
    path = Path(folder)
    if not path.is_dir():
        raise UsageError(f"--checkpoints {folder} is not a folder; pass the folder that holds the checkpoints")
    subfolders = sorted(p for p in path.iterdir() if p.is_dir())
    models = [p for p in subfolders if (p / "config.json").is_file()]
    if not models:
        raise UsageError(f"--checkpoints {folder} holds no model folder (a sub-folder with config.json)")
    steps = {Path(name).name: step for name, step in (steps or {}).items()}
    _unknown_steps(steps, (p.name for p in models), f"checkpoints in {folder} (sub-folders with config.json)")
    found = [Checkpoint(str(p), *_step_of(p.name, p, steps)) for p in models]
    no_step = f"no {TRAINER_STATE}, no step in the name such as {NAME_SHAPES}"
    return (_ordered(_final_step(found, final_step, f"--checkpoints {folder}", no_step)),
            [p.name for p in subfolders if p not in models])


def checkpoints_of(models, final_step: int | None = None, steps: Mapping[str, int] | None = None
                   ) -> list[Checkpoint]:
    """MODEL arguments as checkpoints, stepped as in `checkpoints_in`; `final_step` for at most one without a
    step, the others without stay so (None).

    >>> [c.describe() for c in checkpoints_of(["induction-2l", "induction-2l-step2000"], final_step=6000)]
    ['induction-2l-step2000 (step 2000)', 'induction-2l (step 6000)']
    """
    if not models:
        raise UsageError("name the models to sweep, or pass --checkpoints DIR")
    steps = steps or {}
    _unknown_steps(steps, models, "MODEL arguments")
    found = [Checkpoint(m, *_step_of(m, Path(m).expanduser(), steps)) for m in models]
    return _ordered(_final_step(found, final_step, "the MODEL arguments", None))


def parse_revisions(value: str) -> list[str]:
    """The revisions of --revisions: a file with one a line (blank lines and # comments skipped), else a
    comma-separated list.

    >>> parse_revisions("step1000, step2000,")
    ['step1000', 'step2000']
    """
    path = Path(value).expanduser()
    if path.is_file():
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read --revisions {value}: {first_line(e)}") from None
        revisions = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    else:
        revisions = [item.strip() for item in value.split(",") if item.strip()]
    if not revisions:
        raise UsageError(f"--revisions {value} names no revision")
    return revisions


def checkpoints_at(model: str, revisions: list[str], final_step: int | None = None,
                   steps: Mapping[str, int] | None = None) -> list[Checkpoint]:
    """Hub model `model` at each of `revisions`, in step order: its step from `steps` ({revision: step}), else
    the revision's name, else `final_step` (for one); every revision needs a step.

    >>> [c.describe() for c in checkpoints_at("EleutherAI/pythia-70m", ["step2000", "step1000"])]
    ['pythia-70m@step1000 (step 1000)', 'pythia-70m@step2000 (step 2000)']
    """
    from headgraph.loader.models import packaged_models

    if Path(model).expanduser().exists() or model in packaged_models():
        raise UsageError(f"--revisions are revisions of a hub model (such as EleutherAI/pythia-70m); {model} is a "
                         "local model: sweep its checkpoint folders with --checkpoints DIR")
    steps = steps or {}
    _unknown_steps(steps, revisions, "revisions in --revisions")
    found = [Checkpoint(model, *_step_of(revision, None, steps), revision=revision) for revision in revisions]
    no_step = "no step in the revision's name, such as step1000"
    return _ordered(_final_step(found, final_step, f"--revisions of {model}", no_step))


def sweep_id(options: AnalyzeOptions, label: str) -> str:
    """`<label>-<8 hex>`: the hex digest of the analysis options (not of where the runs go), so the same
    command names the same sweep.

    >>> sweep_id(AnalyzeOptions(), "models") == sweep_id(AnalyzeOptions(out_dir="elsewhere"), "models")
    True
    """
    settings = dataclasses.replace(options, out_dir=None, store=None, report=True, sweep=None, step=None)
    digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:8]
    return f"{_slug(label) or 'sweep'}-{digest}"


def _revision_snapshot(checkpoint: Checkpoint) -> Path:
    """The local snapshot folder of a revision checkpoint: from the hub cache, else the hub when it answers."""
    from headgraph.loader.models import _hub_snapshot

    return _hub_snapshot(checkpoint.model, checkpoint.revision)


def _loadable(checkpoint: Checkpoint, links: Path) -> str:
    """What `run_analyze` loads for a checkpoint: its model, or for a revision a link in `links` named
    `<repo name>@<revision>` to the revision's snapshot on this machine, so its run is stored under that name
    (and the snapshot folder as its source)."""
    if checkpoint.revision is None:
        return checkpoint.model
    snapshot = _revision_snapshot(checkpoint)
    links.mkdir(parents=True, exist_ok=True)
    link = links / checkpoint.name
    link.unlink(missing_ok=True)
    link.symlink_to(snapshot, target_is_directory=True)
    return str(link)


def _analyze(checkpoint: Checkpoint, options: AnalyzeOptions, links: Path, threads: int) -> tuple[Path, RunGraph]:
    """In a worker: the whole analysis of one checkpoint on `threads` torch threads, run folder written,
    nothing stored."""
    import torch

    torch.set_num_threads(threads)
    outcome = run_analyze(_loadable(checkpoint, links), options, console=Console(stderr=True), progress=False)
    return outcome.folder, outcome.graph


# a checkpoint's analysis as it comes back: (checkpoint, (folder, graph), None) or (checkpoint, None, why not)
Finished = tuple[Checkpoint, tuple[Path, RunGraph] | None, str | None]


def _in_processes(jobs: list[tuple[Checkpoint, AnalyzeOptions]], links: Path, workers: int) -> Iterator[Finished]:
    """The analyses in `workers` spawned local processes, as each finishes."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        pending = {pool.submit(_analyze, checkpoint, options, links, threads): checkpoint
                   for checkpoint, options in jobs}
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
    _answering(address, ray)
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


def _answering(address: str, ray: Any) -> None:
    """UsageError when `address` names a HOST:PORT (itself, or "auto": RAY_ADDRESS or the last `ray start` of
    this machine, as Ray finds it) where nothing accepts a connection: Ray's own client would wait for that GCS
    for minutes, printing warnings. Ray resolves the rest ("local", ray://, "auto" finding no cluster) itself."""
    if "://" in address:
        return
    try:  # Ray's own reading of the address (not public API: where it fails, ray.init reads it)
        found = ray._private.services.canonicalize_bootstrap_address(address)
    except Exception:  # noqa: BLE001 - ray.init raises on the address itself
        return
    host, colon, port = (found or "").rpartition(":")
    if not colon or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as e:
        where = f"auto ({found})" if address == "auto" else address  # not Ray's own name for localhost
        raise UsageError(f"cannot reach the Ray cluster at --ray {where}: nothing accepts connections there "
                         f"({e.strerror or type(e).__name__}); is its head running (ray start --head)?") from None


def _on_ray(jobs: list[tuple[Checkpoint, AnalyzeOptions]], links: Path, ray: Any) -> Iterator[Finished]:
    """The analyses as Ray tasks (one CPU and one torch thread each) on the connected cluster, as each
    finishes; a task whose worker dies is not retried (it is reported, like a local worker's)."""
    remote = ray.remote(num_cpus=1, max_retries=0)(_analyze)
    pending = {remote.remote(checkpoint, options, links, 1): checkpoint for checkpoint, options in jobs}
    while pending:
        (ready,), _ = ray.wait(list(pending), num_returns=1)
        checkpoint = pending.pop(ready)
        try:
            yield checkpoint, ray.get(ready), None
        except ray.exceptions.RayTaskError as e:  # the task raised: report its own exception
            yield checkpoint, None, f"{type(e.cause).__name__}: {first_line(e.cause)}"
        except ray.exceptions.RayError as e:  # the worker or its node died
            yield checkpoint, None, f"its Ray worker died before it finished ({type(e).__name__})"


def _missing_revisions(checkpoints: list[Checkpoint]) -> dict[Checkpoint, str]:
    """{checkpoint: why not}: the revisions among `checkpoints` that neither the local hub cache holds nor the
    hub gives (a snapshot missing from the cache is fetched here, before any analysis, when the hub answers)."""
    missing = {}
    for checkpoint in (c for c in checkpoints if c.revision is not None):
        try:
            _revision_snapshot(checkpoint)
        except ModelUnavailable:
            missing[checkpoint] = (f"revision {checkpoint.revision} of {checkpoint.model} is not in the local hub "
                                   "cache, and the hub did not give it")
    return missing


def _origins(checkpoints: list[Checkpoint]) -> str:
    """Where the checkpoints' steps were read, e.g. `steps from trainer_state.json` or `steps from name (3),
    --final-step (1)`."""
    counts = Counter(c.origin or "none" for c in checkpoints)
    if len(counts) == 1:
        return f"steps from {next(iter(counts))}"
    return "steps from " + ", ".join(f"{origin} ({n})" for origin, n in counts.items())


def run_sweep(checkpoints: list[Checkpoint], options: SweepOptions, label: str = "sweep",
              console: Console | None = None, progress: bool = True) -> SweepOutcome:
    """Analyse every checkpoint not yet stored for this sweep and store it (see the module docstring).
    Raises SweepFailed, after storing every checkpoint that finished, when a worker died or failed or a revision
    was not to be had."""
    from headgraph.loader.models import resolve_model
    from headgraph.loader.sweeps import stored_runs

    console = console or Console(stderr=True)
    identity = options.sweep_id or sweep_id(options.analyze, label)
    base = Path(options.analyze.out_dir or Path("runs") / identity)
    # the model name its runs are stored under; an unknown model fails here, before any work
    keys = {c: (resolve_model(c.model)[0] if c.revision is None else c.name, c.step) for c in checkpoints}
    description = options.analyze.store.check()
    cluster = _ray_cluster(options.ray) if options.ray is not None else contextlib.nullcontext()
    # the store is held for the whole sweep: the driver is its one writer
    with cluster as ray, options.analyze.store.open() as store:
        stored = stored_runs(store, identity)
        done = [SweepRun(c, stored[keys[c]], None) for c in checkpoints if keys[c] in stored]
        console.print(f"sweep {identity}: {len(checkpoints)} checkpoints, {len(done)} already stored in {description}; "
                      f"{_origins(checkpoints)}", soft_wrap=True)
        missing = _missing_revisions([c for c in checkpoints if keys[c] not in stored])
        failures = [f"{c.describe()}: {why}" for c, why in missing.items()]
        jobs = [(c, dataclasses.replace(options.analyze, out_dir=str(base / c.name), store=None, sweep=identity,
                                        step=c.step))
                for c in checkpoints if keys[c] not in stored and c not in missing]
        links = base / REVISION_LINKS
        with progress_bar(console, progress) as bar:
            task = bar.add_task(f"sweep {identity}", total=len(checkpoints), completed=len(done))
            results = (_on_ray(jobs, links, ray) if ray is not None
                       else _in_processes(jobs, links, min(options.workers, max(1, len(jobs)))))
            for checkpoint, analysed, failure in results if jobs else ():
                if failure is not None:
                    failures.append(f"{checkpoint.describe()}: {failure}")
                    continue
                folder, graph = analysed
                store.store_run(graph)
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
    """The sweep's report from what the store holds of it (earlier invocations' checkpoints included), with the
    training loss that the stored runs' checkpoint folders logged."""
    from headgraph.queries.runner import run_named
    from headgraph.report.sweep import SweepData, render_sweep_report

    emergence = {name: pd.DataFrame(run_named(store, name, {"sweep": identity}).records())
                 for name in ("emergence", "role-emergence")}
    data = SweepData.read(store, identity)
    return render_sweep_report(data, emergence["emergence"], emergence["role-emergence"], base,
                               losses=training_losses(data.runs["source"]))
