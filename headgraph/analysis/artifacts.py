"""Artifacts of one analysis run: run.json, pairs.parquet (one row per computed pair), heads.parquet (one row
per head). NaN numbers are stored as nulls (parquet) and null (JSON)."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from headgraph.errors import UsageError
from headgraph.heads import head_name

RUN_FILE = "run.json"
PAIRS_FILE = "pairs.parquet"
HEADS_FILE = "heads.parquet"
PAIR_COLUMNS = ["source", "target", "source_layer", "source_head", "target_layer", "target_head", "source_type",
                "target_type", "pk", "pk_norm", "z_iso", "log10_p_iso", "p_model", "q_model", "cs"]
HEAD_COLUMNS = ["head", "layer", "index", "rank_q", "rank_k", "rank_v", "rank_o"]


def head_index(n_layers: int, n_heads: int) -> dict[str, list[str] | np.ndarray]:
    """heads.parquet's key columns, heads ordered by layer then index: head (L{l}H{h}), layer, index."""
    layer, index = np.divmod(np.arange(n_layers * n_heads), n_heads)
    return {"head": [head_name(l, h) for l, h in zip(layer.tolist(), index.tolist())], "layer": layer, "index": index}


@dataclass
class AnalysisResult:
    """One run: its metadata (run.json), its pairs and its heads."""

    run: dict
    pairs: pd.DataFrame
    heads: pd.DataFrame


def json_safe(value):
    """The value with NaN / inf floats replaced by None, recursively (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_artifacts(result: AnalysisResult, out_dir) -> Path:
    """Write run.json, pairs.parquet and heads.parquet into out_dir (created if missing); returns the folder."""
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {folder} exists and is not a folder; choose another path")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_FILE).write_text(json.dumps(json_safe(result.run), indent=2, allow_nan=False))
    result.pairs.to_parquet(folder / PAIRS_FILE, index=False)
    result.heads.to_parquet(folder / HEADS_FILE, index=False)
    return folder


def require_columns(frame: pd.DataFrame, columns, path) -> None:
    """UsageError naming the artifact at `path` when `frame` lacks any of `columns`."""
    absent = [c for c in columns if c not in frame.columns]
    if absent:
        raise UsageError(f"{path} lacks columns {', '.join(absent)}; rerun `headgraph analyze`")


def read_table(path, columns=()) -> pd.DataFrame:
    """One parquet artifact holding `columns`; an unreadable or incomplete file raises UsageError naming it."""
    try:
        frame = pd.read_parquet(path)
    except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise UsageError(f"cannot read {path} ({str(e).splitlines()[0]}); rerun `headgraph analyze`") from e
    require_columns(frame, columns, path)
    return frame


def read_artifacts(out_dir) -> AnalysisResult:
    """Read a run folder written by `write_artifacts`."""
    folder = Path(out_dir)
    missing = [name for name in (RUN_FILE, PAIRS_FILE, HEADS_FILE) if not (folder / name).is_file()]
    if missing:
        raise UsageError(f"{folder} is not an analysis run folder (missing {', '.join(missing)}); "
                         "run `headgraph analyze MODEL --out DIR` first")
    run = json.loads((folder / RUN_FILE).read_text())
    return AnalysisResult(run, pd.read_parquet(folder / PAIRS_FILE), pd.read_parquet(folder / HEADS_FILE))
