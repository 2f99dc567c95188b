"""The tables of one analysis run: pairs.parquet (one row per computed pair) and heads.parquet (one row per head),
their key columns, and reading them back (NaN numbers are stored as nulls). The run folder itself, with its
run.json, is headgraph.runs."""

import math

import numpy as np
import pandas as pd

from headgraph.errors import UsageError
from headgraph.heads import head_name

PAIR_COLUMNS = ["source", "target", "source_layer", "source_head", "target_layer", "target_head", "source_type",
                "target_type", "pk", "pk_norm", "z_iso", "log10_p_iso", "p_model", "q_model", "cs"]
HEAD_COLUMNS = ["head", "layer", "index", "rank_q", "rank_k", "rank_v", "rank_o"]
PAIR_KEY = ["source", "target", "source_type", "target_type"]  # one pairs.parquet row; joins the effect tables
SIGNIFICANT_Q = 0.05  # the q_model level the summaries, the stability check and the sweep report count as significant


def head_index(n_layers: int, n_heads: int) -> dict[str, list[str] | np.ndarray]:
    """heads.parquet's key columns, heads ordered by layer then index: head (L{l}H{h}), layer, index."""
    layer, index = np.divmod(np.arange(n_layers * n_heads), n_heads)
    return {"head": [head_name(l, h) for l, h in zip(layer.tolist(), index.tolist())], "layer": layer, "index": index}


def role_names(heads: pd.DataFrame) -> list[str]:
    """The roles tested in a heads table: the one rule, a role is a `<role>_sig` column (identity first, then
    by name)."""
    return sorted((c[: -len("_sig")] for c in heads.columns if c.endswith("_sig")), key=lambda r: (r != "identity", r))


def roles_of(heads: pd.DataFrame) -> dict[str, list[str]]:
    """{head: the roles whose test is significant for it}; heads without one are left out."""
    found: dict[str, list[str]] = {}
    for role in role_names(heads):
        for head in heads.loc[heads[f"{role}_sig"].fillna(False).astype(bool), "head"]:
            found.setdefault(head, []).append(role)
    return found


def records(frame: pd.DataFrame) -> list[dict]:
    """DataFrame rows as plain-Python dicts: NaN and infinities -> None, numpy scalars -> Python (the one
    conversion for query parameters and JSON output)."""
    plain = frame.astype(object).where(frame.notna(), None)
    return [{k: json_safe(v.item() if hasattr(v, "item") and not isinstance(v, (list, tuple)) else v)
             for k, v in row.items()} for row in plain.to_dict("records")]


def json_safe(value):
    """The value with NaN / inf floats replaced by None, recursively (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


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
