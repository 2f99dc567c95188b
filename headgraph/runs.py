"""The run record (run.json) and the run folder: written and read by these classes only.

A run folder holds run.json (a `RunRecord`), pairs.parquet (one row per computed pair) and heads.parquet (one
row per head), and stability.json once `headgraph stability` has run on it. `RunRecord.to_json` /
`RunRecord.from_json` are the only code that writes or reads run.json; NaN numbers are stored as null. Format
versions: 4 is this one (it added `full_matrix`, `stages` and `peak_rss`); 3 (which added `sweep` and `step`),
2 (`causal`), 1 and a run.json without `format_version` (written before versions existed, headgraph 0.1) have the
same fields less the newer ones, so they are read as such; a newer version is refused with one line naming it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from headgraph._version import __version__
from headgraph.analysis.artifacts import HEAD_COLUMNS, PAIR_COLUMNS, json_safe, read_table
from headgraph.errors import StoreUnavailable, UsageError
from headgraph.heads import TYPE_PAIRS, WEIGHT_TYPES, Processing

FORMAT_VERSION = 4
READABLE_VERSIONS = (0, 1, 2, 3, FORMAT_VERSION)
RUN_FILE = "run.json"
PAIRS_FILE = "pairs.parquet"
HEADS_FILE = "heads.parquet"
STABILITY_FILE = "stability.json"
_JSON_NAMES = {"fraction_q_model_below_005": "fraction_q_model_below_0.05"}  # field -> run.json key


@dataclass(frozen=True)
class ModelInfo:
    """Which model was analysed: its name, where it came from, its architecture."""

    name: str
    source: str
    architecture: str | None = None
    is_decoder: bool | None = None


@dataclass(frozen=True)
class Dims:
    """The model's sizes (n_kv_heads < n_heads for grouped-query attention)."""

    n_layers: int
    n_heads: int
    d_model: int
    d_head: int
    n_kv_heads: int | None = None
    n_ctx: int | None = None


@dataclass(frozen=True)
class StageRun:
    """One stage of an analysis as its runner measured it (headgraph.stages.run_stages): wall seconds, and the
    peak resident memory of this process while it ran, in bytes. The peak counts everything resident, what
    earlier stages left included, so it is not what the stage itself allocated; it counts neither GPU memory
    nor other processes (the report's figure workers). How it was read is RunRecord.peak_rss. Where the process
    had used CUDA, peak_gpu_bytes is the most GPU memory torch's allocator had handed out while the stage ran
    (torch.cuda.max_memory_allocated, what earlier stages left included; not what it cached beyond that, nor the
    CUDA context); None otherwise."""

    seconds: float
    peak_rss_bytes: int
    peak_gpu_bytes: int | None = None


PeakRss = Literal["vmhwm", "ru_maxrss"]
"""vmhwm: VmHWM of /proc/self/status, reset to the current RSS when each stage starts (/proc/self/clear_refs),
so the stage's own peak; ru_maxrss (where clear_refs cannot be written): the process's peak since it started,
so only an upper bound of a later stage's peak."""


@dataclass(frozen=True)
class RoleRecord:
    """run.json `roles`: what the role tests ran with and on, and what their numbers are, as
    headgraph.analysis.roles.compute_roles describes them. A field None was not recorded: the other model kind's
    (decoders: repeat_length; encoders: block_variants, local_window), or nothing to say (settled, skipped_roles),
    or a setting an older headgraph did not write."""

    model_kind: str  # decoder / encoder: which roles and input sets apply
    roles: tuple[str, ...]  # the roles tested, identity first
    inputs: dict[str, dict[str, int]]  # per input set: n (inputs used), n_inputs (at most), seed
    n_inputs: int
    tau: float
    alpha: float
    correction: str
    role_inputs: dict[str, str] | None = None  # role -> its input set
    design: str | None = None
    batch_size: int | None = None
    test: str | None = None  # the test, in words
    score: str | None = None  # the sieve-bias score, in words
    identity_score: str | None = None
    settled: dict[str, Any] | None = None  # sequential design: when each set's heads settled
    skipped_roles: dict[str, str] | None = None  # role -> why it was not tested
    block_variants: dict[str, str] | None = None
    local_window: int | None = None
    repeat_length: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The run.json `roles` object: the recorded fields only."""
        return json_safe({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                          if getattr(self, f.name) is not None})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoleRecord:
        """A record from run.json's `roles` (or compute_roles' description); an unknown or missing field raises
        TypeError."""
        return cls(**{**data, "roles": tuple(data["roles"])})


@dataclass(frozen=True)
class RunRecord:
    """Everything run.json says about one analysis. `id`, `out_dir` and `selection` are set once the run has
    a place (headgraph.workflow); `roles` holds the role tests' settings when roles were computed, `causal` the
    causal stage's; `sweep` and `step` tag a run of a sweep (headgraph.sweep); `stages` and `peak_rss` say what
    each stage of the analyze cost."""

    model: ModelInfo
    dims: Dims
    processing: Processing
    device: str
    dtype: str
    seed: int
    types: tuple[str, ...]
    pairs: str
    """Which pairs were computed, in words (earlier -> strictly later layer, or the full matrix)."""
    n_pairs: dict[str, int]
    max_memory: int
    engine: dict[str, Any]
    timings_s: dict[str, float]
    reference: dict[str, Any]
    """The isotropic reference: exact moments per subspace width pair, sampled laws, the KL grid."""
    kl: dict[str, Any]
    """KL(P_random || P_observed) per type pair as a 4 x 4 matrix over WEIGHT_TYPES (null: not computed)."""
    mean_pk: dict[str, float]
    fraction_q_model_below_005: dict[str, float]
    null_model: dict[str, Any]
    nulls: dict[str, str]
    """What each statistic of pairs.parquet refers to: a number is only as meaningful as its reference."""
    head_naming: str
    rank_deficient_heads: list[dict[str, Any]]
    processing_warnings: tuple[str, ...] = ()
    headgraph_version: str = __version__
    created: str = ""
    id: str | None = None
    out_dir: str | None = None
    selection: str | None = None
    roles: RoleRecord | None = None
    causal: dict[str, Any] | None = None
    """The causal stage's inputs, settings and definitions, or why it was skipped (None: not run)."""
    sweep: str | None = None
    """The id of the `headgraph sweep` this run belongs to (None: a run of its own)."""
    step: int | None = None
    """The checkpoint's training step within its sweep (None: outside a sweep, or a model without a step)."""
    full_matrix: bool = False
    """Whether same-layer and backward pairs were computed too (the setting `pairs` says in words)."""
    stages: dict[str, StageRun] = field(default_factory=dict)
    """The analyze stages that ran before the run folder was written, in order (empty: PK computed alone)."""
    peak_rss: PeakRss | None = None
    """How the stages' peak_rss_bytes were read (see PeakRss; None: no stages recorded)."""
    format_version: int = FORMAT_VERSION

    @property
    def has_effects(self) -> bool:
        """Whether the causal stage ran and computed effects (not skipped, not --no-causal)."""
        return self.causal is not None and "skipped" not in self.causal

    def to_json(self) -> dict[str, Any]:
        """The run.json object (strict JSON: NaN and infinities become null)."""
        data = {_JSON_NAMES.get(f.name, f.name): getattr(self, f.name) for f in dataclasses.fields(self)}
        data.update(model=dataclasses.asdict(self.model), dims=dataclasses.asdict(self.dims),
                    types=list(self.types), processing_warnings=list(self.processing_warnings),
                    roles=None if self.roles is None else self.roles.to_json(),
                    stages={name: dataclasses.asdict(stage) for name, stage in self.stages.items()})
        return json_safe(data)

    @classmethod
    def from_json(cls, data: Any, origin: str = RUN_FILE) -> RunRecord:
        """A record from a run.json object; a malformed one or an unknown format version raises UsageError."""
        if not isinstance(data, dict):
            raise UsageError(f"{origin} is not a JSON object; rerun `headgraph analyze`")
        version = data.get("format_version", 0)
        if version not in READABLE_VERSIONS:
            readable = ", ".join(map(str, READABLE_VERSIONS))
            raise UsageError(f"{origin} has run format version {version!r}; this headgraph {__version__} reads "
                             f"versions {readable}: upgrade headgraph or rerun `headgraph analyze`")
        names = {_JSON_NAMES.get(f.name, f.name): f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise UsageError(f"{origin} has unknown fields {', '.join(unknown)}; rerun `headgraph analyze`")
        required = [key for key, name in names.items() if key not in data
                    and cls.__dataclass_fields__[name].default is dataclasses.MISSING
                    and cls.__dataclass_fields__[name].default_factory is dataclasses.MISSING]
        if required:
            raise UsageError(f"{origin} lacks the fields {', '.join(required)}; rerun `headgraph analyze`")
        values = {names[key]: value for key, value in data.items()} | {"format_version": FORMAT_VERSION}
        if version < 4:  # before `full_matrix` was recorded, the words of `pairs` were all that said it
            values["full_matrix"] = str(values["pairs"]).startswith("full matrix")
        try:
            values.update(model=ModelInfo(**values["model"]), dims=Dims(**values["dims"]),
                          types=tuple(values["types"]),
                          processing_warnings=tuple(values.get("processing_warnings", ())),
                          roles=None if values.get("roles") is None else RoleRecord.from_json(values["roles"]),
                          stages={name: StageRun(**stage) for name, stage in values.get("stages", {}).items()})
            return cls(**values)
        except (KeyError, TypeError, AttributeError) as e:
            raise UsageError(f"{origin} is not a headgraph run record ({e}); rerun `headgraph analyze`") from None

    @property
    def kl_by_type(self) -> dict[str, float | None]:
        """{type pair: KL in nats, or None where not computed} for all 16 type pairs."""
        rows, cols, matrix = self.kl.get("rows", WEIGHT_TYPES), self.kl.get("cols", WEIGHT_TYPES), self.kl["matrix"]
        found = {r + c: matrix[i][j] for i, r in enumerate(rows) for j, c in enumerate(cols)}
        return {tp: found.get(tp) for tp in TYPE_PAIRS}

    @property
    def reference_by_type(self) -> dict[str, dict[str, Any]]:
        """{type pair: {"k", "k_prime", "mean", "var", ...}}: the isotropic reference at the type's widths."""
        widths = self.reference.get("kl_grid", {}).get("reference_widths", {})
        moments = self.reference.get("moments", {})
        return {tp: moments[f"{k},{kp}"] for tp, (k, kp) in widths.items() if f"{k},{kp}" in moments}


@dataclass
class AnalysisResult:
    """One analysis: its record and its tables (the artifact contract of PAIR_COLUMNS / HEAD_COLUMNS)."""

    run: RunRecord
    pairs: pd.DataFrame
    heads: pd.DataFrame = field(repr=False)


def write_run(result: AnalysisResult, out_dir) -> Path:
    """Write run.json, pairs.parquet and heads.parquet into out_dir (created if missing); returns the folder."""
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {folder} exists and is not a folder; choose another path")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_FILE).write_text(json.dumps(result.run.to_json(), indent=2, allow_nan=False))
    result.pairs.to_parquet(folder / PAIRS_FILE, index=False)
    result.heads.to_parquet(folder / HEADS_FILE, index=False)
    return folder


def write_stability(folder, report: dict) -> Path:
    """stability.json in a run folder: {"variants": {name: {"what", "pairs", "roles"} or {"skipped"}}}."""
    path = Path(folder) / STABILITY_FILE
    path.write_text(json.dumps(json_safe(report), indent=2, allow_nan=False))
    return path


def read_stability(folder) -> dict | None:
    """A run folder's stability.json, or None when `headgraph stability` has not run on it."""
    path = Path(folder) / STABILITY_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise UsageError(f"cannot read {path} ({e}); rerun `headgraph stability`") from None
    if not isinstance(data, dict) or not isinstance(data.get("variants"), dict):
        raise UsageError(f"{path} is not a stability report; rerun `headgraph stability`")
    return data


def write_roles(heads: pd.DataFrame, meta: dict[str, Any], out_dir) -> tuple[Path, Path]:
    """`headgraph roles --out`: roles.parquet (one row per head) and roles.json (the tests' settings)."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    heads.to_parquet(folder / "roles.parquet", index=False)
    (folder / "roles.json").write_text(json.dumps(json_safe(meta), indent=2, allow_nan=False))
    return folder / "roles.parquet", folder / "roles.json"


@dataclass
class RunFolder:
    """One analysis run as read from its folder (the Python API's headgraph.Run adds the graph and its views)."""

    path: Path
    record: RunRecord
    pairs: pd.DataFrame
    heads: pd.DataFrame

    @property
    def model(self) -> str:
        return self.record.model.name

    @property
    def type_pairs(self) -> list[str]:
        present = set(self.pairs["source_type"] + self.pairs["target_type"])
        return [tp for tp in TYPE_PAIRS if tp in present]


def load_run(run_dir) -> RunFolder:
    """Read a run folder; a missing or malformed artifact raises UsageError naming it."""
    path = Path(run_dir)
    if not path.is_dir():
        raise UsageError(f"run folder '{path}' does not exist; pass the --out folder of `headgraph analyze`")
    missing = [name for name in (RUN_FILE, PAIRS_FILE, HEADS_FILE) if not (path / name).is_file()]
    if missing:
        raise UsageError(f"{path} is not an analysis run folder (missing {', '.join(missing)}); "
                         "run `headgraph analyze MODEL --out DIR` first")
    try:
        data = json.loads((path / RUN_FILE).read_text())
    except (ValueError, OSError) as e:
        raise UsageError(f"cannot read {path / RUN_FILE} ({e}); rerun `headgraph analyze` into '{path}'") from None
    record = RunRecord.from_json(data, str(path / RUN_FILE))
    run = RunFolder(path, record, read_table(path / PAIRS_FILE, PAIR_COLUMNS),
                    read_table(path / HEADS_FILE, HEAD_COLUMNS[:3]))
    unreferenced = [tp for tp in run.type_pairs if tp not in record.reference_by_type]
    if unreferenced:
        raise UsageError(f"{path / RUN_FILE} lacks the isotropic reference of {', '.join(unreferenced)}; "
                         f"rerun `headgraph analyze` into '{path}'")
    return run


def resolve_run_dir(run: str, store) -> Path:
    """A run folder from RUN: a folder path, or the id of a stored run whose record names its folder.

    store: what opens the store (a headgraph.loader.open_store.StoreSpec), opened read-only only when RUN is not a
    folder; the store's `run_params(id)` gives the run.json text it holds of the run (None: no such run)."""
    path = Path(run)
    if path.is_dir() or "/" in run or "\\" in run:
        return path
    try:
        opened = store.open(read_only=True)
    except StoreUnavailable as e:
        raise StoreUnavailable(f"'{run}' is not a run folder, and as a run id: {e}") from e
    with opened:
        text, where = opened.run_params(run), opened.description
    if text is None:
        raise UsageError(f"'{run}' is neither a run folder nor a run id in {where}; `headgraph runs` lists the ids")
    folder = RunRecord.from_json(json.loads(text or "{}"), f"the record of run '{run}' in {where}").out_dir
    if not folder or not Path(folder).is_dir():
        raise UsageError(f"run '{run}' does not record an existing run folder ({folder or 'none'}); "
                         "pass the folder that `headgraph analyze --out` wrote")
    return Path(folder)
