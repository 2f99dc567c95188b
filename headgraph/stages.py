"""The one stage protocol of an analysis. A stage is a function `def stage(ctx: Context) -> None` that reads
and extends the run's one Context; `run_stages` runs a list of them in order, timing each and reading the peak
resident memory of the process while it ran. headgraph.workflow.STAGES is the whole `headgraph analyze`; its
PK stage runs headgraph.pipeline.PK_STAGES through the same runner. A stage that applies only to some runs
says when with `runs_if`: run_stages skips it otherwise, and records nothing of it."""

from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from headgraph.analysis.classes import HeadClasses
from headgraph.analysis.heap import release_freed
from headgraph.analysis.selection import SelectedGraph
from headgraph.loader.store import RunGraph
from headgraph.runs import AnalysisResult, PeakRss, RunFolder, StageRun
from headgraph.settings import AnalyzeOptions


@dataclass(eq=False)
class Context:
    """What the stages of one analysis share, filled in as they run (None / empty: not yet, or a stage that did
    not run). The PK stages work in the fields between `model` and `result`, which ends them."""

    options: AnalyzeOptions  # checked: the PK types parsed, the device resolved (headgraph.pipeline.checked_pk_options)
    console: Console
    progress: Progress  # the one progress display; a stage adds its own tasks
    source: Any = None  # the model as given: a name, a folder, a loaded model (the load stage reads it)
    model_name: str | None = None
    tokenizer: Any = None  # the tokenizer given with a loaded model, if any
    model: Any = None  # the LoadedModel (headgraph.loader.models)
    # the PK stages' work (headgraph.pipeline): per weight type, per type pair, and what run.json says of it
    statistics: Any = None  # what the PK stages keep of the weights (headgraph.analysis.subspaces.HeadStatistics)
    subspaces: dict[str, Any] = field(default_factory=dict)
    edges: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)
    kl: dict[str, float] = field(default_factory=dict)
    null: dict[str, Any] = field(default_factory=dict)
    pk_stages: dict[str, StageRun] = field(default_factory=dict)  # run.json `timings_s`
    result: AnalysisResult | None = None  # the pairs and heads tables and the run record
    # what headgraph.workflow builds on the PK
    run_id: str | None = None
    folder: Path | None = None
    classes: HeadClasses | None = None  # the known head classes the report colours and the store labels
    store_description: str | None = None
    causal: Any = None  # the prepared headgraph.analysis.causal.CausalStage
    role_settings: dict[str, Any] | None = None  # run.json `roles`
    causal_record: dict[str, Any] | None = None  # run.json `causal`
    selected: SelectedGraph | None = None
    run: RunFolder | None = None  # the run as written to its folder
    graph: RunGraph | None = None  # the rows a store writes of the selected graph
    report_files: dict[str, Path] = field(default_factory=dict)
    stages: dict[str, StageRun] = field(default_factory=dict)  # workflow's stages as run_stages measured them

    @property
    def has_effects(self) -> bool:
        """Whether the local causal effects were computed (not skipped, not --no-causal)."""
        return self.causal_record is not None and "skipped" not in self.causal_record


Stage = Callable[[Context], None]


def runs_if(condition: Callable[[Context], bool]) -> Callable[[Stage], Stage]:
    """Mark a stage as run only when `condition(ctx)` holds as its turn comes (a decorator)."""

    def mark(stage: Stage) -> Stage:
        stage.runs_if = condition
        return stage

    return mark


def run_stages(ctx: Context, stages: Iterable[Stage], into: dict[str, StageRun]) -> None:
    """Run each stage that applies, in order; into[its name] = its wall seconds and peak resident memory (from
    the memory in use when it starts: what earlier stages freed is given back first, `release_freed`), and where
    this process has used CUDA, its peak of GPU memory allocated by torch."""
    for stage in stages:
        condition = getattr(stage, "runs_if", None)
        if condition is not None and not condition(ctx):
            continue
        release_freed()
        start = time.perf_counter()
        _start_peak()
        try:
            stage(ctx)
        finally:
            peak, gpu = _stop_peak()
        into[stage.__name__] = StageRun(round(time.perf_counter() - start, 4), peak, gpu)


_CLEAR_REFS, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")
_open_peaks: list[tuple[int, int | None]] = []  # running peaks (RSS, GPU) of each stage now running, outermost first


@functools.cache
def peak_rss_method() -> PeakRss:
    """vmhwm where this process may reset its VmHWM (Linux), else ru_maxrss (see headgraph.runs.PeakRss)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return "ru_maxrss"
    return "vmhwm"


def _peak_bytes() -> int:
    """VmHWM since its last reset, or the process's peak since it started (ru_maxrss), in bytes."""
    if peak_rss_method() == "vmhwm":
        return int(re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.M)[1]) * 1024
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _cuda():
    """torch.cuda where this process has used it (torch imported and CUDA initialised), else None."""
    torch = sys.modules.get("torch")
    return torch.cuda if torch is not None and torch.cuda.is_initialized() else None


def _peaks() -> tuple[int, int | None]:
    """The peak RSS and GPU memory allocated since their last reset (GPU None without CUDA)."""
    cuda = _cuda()
    return _peak_bytes(), None if cuda is None else cuda.max_memory_allocated()


def _higher(a: tuple[int, int | None], b: tuple[int, int | None]) -> tuple[int, int | None]:
    """The higher of two (RSS, GPU) peaks, each on its own (a GPU peak of None is no peak)."""
    gpu = a[1] if b[1] is None else b[1] if a[1] is None else max(a[1], b[1])
    return max(a[0], b[0]), gpu


def _fold_peak(peaks: tuple[int, int | None]) -> None:
    _open_peaks[:] = [_higher(open_peak, peaks) for open_peak in _open_peaks]


def _start_peak() -> None:
    """A stage starts: the stages around it keep the peaks so far, then the high-water marks restart from the
    current RSS and GPU memory allocated (so a nested stage's reset does not lose its parent's peak)."""
    if _open_peaks:
        _fold_peak(_peaks())
    if peak_rss_method() == "vmhwm":
        _CLEAR_REFS.write_text("5")
    cuda = _cuda()
    if cuda is not None:
        cuda.reset_peak_memory_stats()
    _open_peaks.append((0, None))


def _stop_peak() -> tuple[int, int | None]:
    """A stage ends: its peaks (RSS, GPU), also counted in the stages around it."""
    peaks = _higher(_open_peaks.pop(), _peaks())
    _fold_peak(peaks)
    return peaks
