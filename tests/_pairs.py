"""Synthetic analysis tables (pairs + heads, the artifact contract) with a planted hub, for the store,
query and centrality tests: no model or PK computation needed.

Every earlier->later head pair of each type gets PK ~ N(5, 0.1); the hub's OV in-edges (from every earlier
head) and OQ/OK out-edges (to every later head) get +`boost`, so the top-20 graph of each type holds all of
them and the hub has by far the highest degree. Local causal effects ~ U(0, 0.5) (their own stream, so the PK
draws do not depend on them), intervals ±0.05.
"""

import numpy as np
import pandas as pd

from headgraph.analysis.selection import SelectionPolicy, select_graph
from headgraph.heads import TYPE_PAIRS
from headgraph.loader.graph import build_run_graph
from headgraph.runs import Dims, ModelInfo, RunRecord

HUB = "L2H1"


def record(pairs, heads, id, model="toy-model", processing="tl", created="2026-01-01T00:00:00+00:00", **fields):
    """The RunRecord of a run of these tables that no analysis produced: its sizes and types read from them,
    the analysis fields empty."""
    kinds = set(pairs["source_type"] + pairs["target_type"])
    return RunRecord(
        model=ModelInfo(model, model), dims=Dims(int(heads["layer"].max()) + 1, int(heads["index"].max()) + 1, 64, 16),
        processing=processing, device="cpu", dtype="float32", seed=0, types=tuple(t for t in TYPE_PAIRS if t in kinds),
        pairs="earlier layer -> strictly later layer", n_pairs={}, max_memory=0, engine={}, timings_s={},
        reference={}, kl={"matrix": []}, mean_pk={}, fraction_q_model_below_005={}, null_model={}, nulls={},
        head_naming="L{layer}H{head}", rank_deficient_heads=[], created=created, id=id, **fields)


def run_graph(pairs, heads, run, policy=SelectionPolicy(), classes=None):
    """The stored graph of a run, built as `headgraph analyze` builds it: select once, then shape the rows.
    `run` is a RunRecord, or the fields of `record` as a dict."""
    run = run if isinstance(run, RunRecord) else record(pairs, heads, **run)
    return build_run_graph(select_graph(pairs, heads, policy), run, classes)


def planted_pairs(n_layers=6, n_heads=4, types=("OQ", "OK", "OV"), seed=0, hub=HUB, boost=1.0):
    """(pairs, heads) DataFrames with the columns of pairs.parquet / heads.parquet."""
    rng, effects = np.random.default_rng(seed), np.random.default_rng([seed, 1])
    layer, head = (a.ravel() for a in np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij"))
    names = np.array([f"L{l}H{h}" for l, h in zip(layer, head)])
    src, tgt = (a.ravel() for a in np.meshgrid(np.arange(len(names)), np.arange(len(names)), indexing="ij"))
    keep = layer[src] < layer[tgt]
    src, tgt = src[keep], tgt[keep]
    frames = []
    for kind in types:
        pk = rng.normal(5.0, 0.1, len(src))
        planted = (names[tgt] == hub) if kind == "OV" else (names[src] == hub)
        pk = pk + boost * planted
        frames.append(
            pd.DataFrame(
                {
                    "source": names[src],
                    "target": names[tgt],
                    "source_layer": layer[src],
                    "source_head": head[src],
                    "target_layer": layer[tgt],
                    "target_head": head[tgt],
                    "source_type": kind[0],
                    "target_type": kind[1],
                    "pk": pk,
                    "pk_norm": pk / 16.0,
                    "z_iso": (pk - 4.0) / 0.1,
                    "log10_p_iso": -(pk - 4.0),
                    "p_model": rng.uniform(0, 1, len(src)),
                    "q_model": rng.uniform(0, 1, len(src)),
                    "cs": np.where(rng.uniform(0, 1, len(src)) < 0.2, np.nan, rng.uniform(0, 0.1, len(src))),
                    "effect": (effect := effects.uniform(0, 0.5, len(src))),
                    "effect_lo": effect - 0.05,
                    "effect_hi": effect + 0.05,
                }
            )
        )
    pairs = pd.concat(frames, ignore_index=True)
    heads = pd.DataFrame(
        {"head": names, "layer": layer, "index": head, "rank_q": 16, "rank_k": 16, "rank_v": 16, "rank_o": 16}
    )
    return pairs, heads

