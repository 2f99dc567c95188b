"""What a store holds of one sweep (headgraph.sweep): its complete runs, and their selected edges and heads by
step, for resuming a sweep and for its report. Each function takes an opened GraphStore."""

from __future__ import annotations

import pandas as pd

from headgraph.loader.store import GraphStore

_STORED_RUNS = """
MATCH (r:Run) WHERE r.sweep = $sweep AND r.status = 'complete'
RETURN r.id AS id, r.model AS model, r.step AS step
"""
_RUNS = """
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
RETURN run.step AS step, run.model AS model, run.id AS run, run.n_edges AS edges, run.policy AS policy,
       run.source AS source
ORDER BY step
"""
_EDGES = """
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
MATCH (a:Head)-[r]->(:Head) WHERE a.run_id = run.id
RETURN run.step AS step, r.kind AS kind, r.source AS source, r.target AS target, r.pk AS pk, r.q_model AS q_model,
       r.effect AS effect
"""
_HEADS = """
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
MATCH (h:Head) WHERE h.run_id = run.id
RETURN run.step AS step, h AS head
"""
RUN_COLUMNS = ["step", "model", "run", "edges", "policy", "source"]
EDGE_COLUMNS = ["step", "kind", "source", "target", "pk", "q_model", "effect"]


def stored_runs(store: GraphStore, sweep: str) -> dict[tuple[str, int | None], str]:
    """{(model, step): run id} of the sweep's complete runs, with or without a step: what a rerun skips."""
    return {(row["model"], row["step"]): row["id"] for row in store.read(_STORED_RUNS, {"sweep": sweep}).records()}


def sweep_runs(store: GraphStore, sweep: str) -> pd.DataFrame:
    """The sweep's complete runs that have a step, one row each in step order (`source`: the folder the model
    was read from, on the machine that analysed it)."""
    return pd.DataFrame(store.read(_RUNS, {"sweep": sweep}).records(), columns=RUN_COLUMNS)


def sweep_edges(store: GraphStore, sweep: str) -> pd.DataFrame:
    """One row per selected edge and step of the sweep's runs with a step (the store holds selected edges only)."""
    return pd.DataFrame(store.read(_EDGES, {"sweep": sweep}).records(), columns=EDGE_COLUMNS)


def sweep_heads(store: GraphStore, sweep: str) -> pd.DataFrame:
    """One row per head and step of the sweep's runs with a step: every stored Head property (role scores and
    decisions included) and the step."""
    return pd.DataFrame([{"step": r["step"], **r["head"]} for r in store.read(_HEADS, {"sweep": sweep}).records()])
