"""One interface over the two graph stores (embedded LadybugDB, Neo4j server) and the schema both share.

The property sets below are the single definition of the graph's schema: LadybugDB turns them into typed
tables, Neo4j gets the same property names and values (plus constraints). Loading is generic Cypher run
through `GraphStore._write` (one transaction per call), except the edges, which each backend writes its own
fastest way (`_write_edges`).

Integrity contract (what a reader may rely on):
- A run is created as `Run.status = 'loading'` with the head and edge counts it will hold and its writer's
  identity (host, pid, process start time); its heads and edges follow in batches of `batch_size` rows (one
  transaction each). Every named query matches `Run.status = 'complete'`, so a partial run is never seen.
- `status = 'complete'` is set only after the rows are durable (`_make_durable`: a checkpoint on LadybugDB,
  whose bulk-loaded rows are not replayed from its WAL after a crash; a no-op on Neo4j, whose commits are
  durable) and their counts, read back, equal the recorded ones.
- A run that is not complete and whose writer is gone is removed by the next read-write open of the store
  (`remove_abandoned_runs`); a live writer's run is never touched.
"""

from __future__ import annotations

import functools
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import psutil

from headgraph.analysis.artifacts import records
from headgraph.errors import StoreUnavailable, UsageError
from headgraph.heads import check_type_pair
from headgraph.loader.readonly import bounded_memory

DEFAULT_DB = "./headgraph.lbdb"
DEFAULT_BATCH_SIZE = 5000

# Property name -> LadybugDB column type. Neo4j stores the same names (it is schemaless).
MODEL_PROPERTIES = {
    "name": "STRING",
    "architecture": "STRING",
    "n_layers": "INT64",
    "n_heads": "INT64",
    "n_kv_heads": "INT64",
    "d_model": "INT64",
    "d_head": "INT64",
    "n_ctx": "INT64",
}
RUN_PROPERTIES = {
    "id": "STRING",
    "model": "STRING",
    "source": "STRING",
    "processing": "STRING",
    "types": "STRING[]",
    "top_k": "INT64",
    "max_q": "DOUBLE",
    "min_z": "DOUBLE",
    "min_effect": "DOUBLE",
    "policy": "STRING",
    "created": "STRING",
    "sweep": "STRING",
    "step": "INT64",
    "status": "STRING",
    "n_heads": "INT64",
    "n_edges": "INT64",
    "params": "STRING",
    "attr_reliable": "STRING[]",
    "attr_unreliable": "STRING[]",
    "writer_host": "STRING",
    "writer_pid": "INT64",
    "writer_started": "DOUBLE",
}
CENTRALITY_PROPERTIES = {
    "in_degree": "INT64",
    "out_degree": "INT64",
    "degree": "INT64",
    "weighted_in": "DOUBLE",
    "weighted_out": "DOUBLE",
    "weighted_degree": "DOUBLE",
    "pagerank": "DOUBLE",
    "hits_hub": "DOUBLE",
    "hits_authority": "DOUBLE",
    "betweenness": "DOUBLE",
}
HEAD_PROPERTIES = {
    "key": "STRING",
    "name": "STRING",
    "layer": "INT64",
    "head": "INT64",
    "run_id": "STRING",
    "model": "STRING",
    "rank_q": "INT64",
    "rank_k": "INT64",
    "rank_v": "INT64",
    "rank_o": "INT64",
    "classes": "STRING[]",
    "roles": "STRING[]",
    "identity_score": "DOUBLE",
    "identity_p": "DOUBLE",
    "identity_sig": "BOOLEAN",
    **CENTRALITY_PROPERTIES,
}
"""Head `roles`: the roles whose test is significant for the head (from the `<role>_sig` columns), so that a
query can ask for any role by name; empty when no role was significant, null when roles were not tested."""
EDGE_PROPERTIES = {
    "kind": "STRING",
    "run_id": "STRING",
    "source": "STRING",
    "target": "STRING",
    "source_layer": "INT64",
    "target_layer": "INT64",
    "pk": "DOUBLE",
    "pk_norm": "DOUBLE",
    "z_iso": "DOUBLE",
    "log10_p_iso": "DOUBLE",
    "p_model": "DOUBLE",
    "q_model": "DOUBLE",
    "cs": "DOUBLE",
    "rank": "INT64",
    "effect": "DOUBLE",
    "effect_lo": "DOUBLE",
    "effect_hi": "DOUBLE",
    "effect_loss": "DOUBLE",
    "effect_loss_lo": "DOUBLE",
    "effect_loss_hi": "DOUBLE",
    "effect_attr": "DOUBLE",
    "effect_attr_lo": "DOUBLE",
    "effect_attr_hi": "DOUBLE",
}
"""Edges carry their endpoints' names and layers so queries never need startNode() (LadybugDB lacks it)."""

EXTRA_HEAD_SUFFIXES = {"_score": "DOUBLE", "_bias": "DOUBLE", "_p": "DOUBLE", "_sig": "BOOLEAN"}
"""Role results added later (`<role>_score`, `<role>_bias`, `<role>_p`, `<role>_sig`) become Head properties of these types."""

_IDENTIFIER = re.compile(r"^[a-z][a-z0-9_]*$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")

RUNS_QUERY = """
MATCH (r:Run)
RETURN r.id AS id, r.model AS model, r.processing AS processing, r.types AS types, r.policy AS policy,
       r.created AS created, r.status AS status, r.n_heads AS heads, r.n_edges AS edges
ORDER BY created, id
"""
UNFINISHED_RUNS_QUERY = """
MATCH (r:Run) WHERE r.status <> 'complete'
RETURN r.id AS id, r.status AS status, r.writer_host AS host, r.writer_pid AS pid, r.writer_started AS started
"""
STORED_COUNTS_QUERY = """
MATCH (h:Head) WHERE h.run_id = $run
OPTIONAL MATCH (h)-[e]->(:Head)
RETURN count(DISTINCT h) AS heads, count(e) AS edges
"""
LATEST_SWEEP_QUERY = """
MATCH (r:Run) WHERE r.status = 'complete' AND r.sweep IS NOT NULL
RETURN r.sweep AS sweep ORDER BY r.created DESC, r.id DESC LIMIT 1
"""
SWEEP_EXISTS_QUERY = """
MATCH (r:Run) WHERE r.sweep = $sweep AND r.status = 'complete' RETURN r.id LIMIT 1
"""
NODE_EXISTS_QUERY = """
MATCH (h:Head) WHERE h.run_id = $run
  AND (h.name = $node OR h.name STARTS WITH ($node + 'H') OR h.name STARTS WITH ($node + 'KV'))
RETURN h.name LIMIT 1
"""
LATEST_RUN_QUERY = """
MATCH (r:Run) WHERE r.status = 'complete'
RETURN r.id AS id ORDER BY r.created DESC, r.id DESC LIMIT 1
"""
RUN_COUNT_QUERY = "MATCH (r:Run) WHERE r.id = $run RETURN count(r) AS runs"
RUN_PARAMS_QUERY = "MATCH (r:Run) WHERE r.id = $run RETURN r.params AS params"
SEAL_RUN_STATEMENT = "MATCH (r:Run) WHERE r.id = $run AND r.status = 'loading' SET r.status = 'complete' RETURN count(r)"
DELETE_RUN_STATEMENTS = (
    "MATCH (r:Run) WHERE r.id = $run DETACH DELETE r",
    "MATCH (m:Model) WHERE NOT EXISTS { MATCH (m)<-[:OF_MODEL]-(:Run) } DELETE m",
)
"""The end of every `delete_run` (parameter `run`), in one transaction: the Run node, then each Model no run uses."""


def head_property_type(name: str) -> str:
    """The column type of a Head property: a schema property, or a role result named by its suffix."""
    if name in HEAD_PROPERTIES:
        return HEAD_PROPERTIES[name]
    if _IDENTIFIER.match(name):
        for suffix, kind in EXTRA_HEAD_SUFFIXES.items():
            if name.endswith(suffix) and len(name) > len(suffix):
                return kind
    raise UsageError(
        f"cannot store head property {name!r}: use a schema property or a role result named <role>_score/_p/_sig"
    )


def extra_head_properties(names) -> dict[str, str]:
    """The properties among `names` that are not in the base Head schema, with their types."""
    return {n: head_property_type(n) for n in names if n not in HEAD_PROPERTIES}


def check_run_id(run_id: str) -> str:
    """A run id usable inside Head keys ("<run_id>/L4H7"): letters, digits and . _ : - only."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise UsageError(f"bad run id {run_id!r}: use letters, digits and . _ : - (no spaces or slashes)")
    return run_id


def batches(frame: pd.DataFrame, batch_size: int) -> list[pd.DataFrame]:
    """Consecutive slices of at most `batch_size` rows."""
    return [frame.iloc[i : i + batch_size] for i in range(0, len(frame), batch_size)]


def _present(row: Mapping[str, Any]) -> dict[str, Any]:
    """The non-null entries (a parameter column of nulls only would get no usable type in LadybugDB)."""
    return {k: v for k, v in row.items() if v is not None}


def _property_map(variable: str, names) -> str:
    return "{" + ", ".join(f"{n}: {variable}.{n}" for n in names) + "}"


@dataclass
class RunGraph:
    """Everything stored for one run, shaped by headgraph.loader.graph: Run and Model properties, Head rows
    (with their centralities) and edge rows (the selected edges). The store writes it and computes nothing."""

    run: dict[str, Any]
    model: dict[str, Any]
    heads: pd.DataFrame
    edges: pd.DataFrame
    extra_head_properties: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Writer:
    """The process that writes a run: a partial run whose writer is gone may be removed, a live one never.
    The start time tells a dead writer from a new process that reuses its pid."""

    host: str
    pid: int
    started: float

    @classmethod
    def current(cls) -> Writer:
        process = psutil.Process()
        return cls(socket.gethostname(), process.pid, process.create_time())

    @classmethod
    def of(cls, run: Mapping[str, Any]) -> Writer | None:
        """The writer recorded on a Run row (`host`, `pid`, `started`), or None for a run stored without one."""
        if run.get("host") is None or run.get("pid") is None or run.get("started") is None:
            return None
        return cls(run["host"], int(run["pid"]), float(run["started"]))

    def row(self) -> dict[str, Any]:
        return {"writer_host": self.host, "writer_pid": self.pid, "writer_started": self.started}

    def alive(self) -> bool | None:
        """True or False on this host; None (unknown) for a process on another host."""
        if self.host != socket.gethostname():
            return None
        try:
            process = psutil.Process(self.pid)
            return process.status() != psutil.STATUS_ZOMBIE and abs(process.create_time() - self.started) < 1.0
        except psutil.NoSuchProcess:  # ZombieProcess is a subclass
            return False

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


@dataclass(frozen=True)
class Rows:
    """A query result: column names and row value lists, in order."""

    columns: list[str]
    rows: list[list[Any]]

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row)) for row in self.rows]


class GraphStore(ABC):
    """A graph store holding runs of the head graph; use as a context manager."""

    description: str = ""
    head_label_clause: str = ""
    """Appended to the Head CREATE (variables h, row): extra labels where the store supports them."""

    def __enter__(self) -> GraphStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @abstractmethod
    def close(self) -> None:
        """Release the connection / file lock."""

    @abstractmethod
    def ensure_schema(self, extra_head_properties: Mapping[str, str] | None = None) -> None:
        """Create tables or constraints and indexes (idempotent); add Head columns for extra properties."""

    @abstractmethod
    def read(self, cypher: str, params: Mapping[str, Any] | None = None) -> Rows:
        """Run a read-only query; a write attempt raises ReadOnlyViolation, a bad query UsageError."""

    def bounded_reads(self) -> AbstractContextManager[None]:
        """A block in which reads, and what is made of their rows, may add at most READ_MEMORY to this process
        (`headgraph cypher` and `query` read and print in one): headgraph.loader.readonly.bounded_memory."""
        return bounded_memory()

    @abstractmethod
    def _write(self, statements: list[tuple[str, dict[str, Any]]]) -> None:
        """Run the statements in one write transaction (all or nothing)."""

    @abstractmethod
    def delete_run(self, run_id: str, batch_size: int = DEFAULT_BATCH_SIZE) -> bool:
        """Remove a run (its heads, edges and Run node; its Model when no run uses it). True if it existed."""

    # --- storing -------------------------------------------------------------------------------------

    def store_run(
        self,
        graph: RunGraph,
        batch_size: int = DEFAULT_BATCH_SIZE,
        after_batch: Callable[[int, int], None] | None = None,
        cleanup_on_error: bool = True,
    ) -> None:
        """Store one run so that it becomes visible only once all of it is durable; replaces an earlier copy.

        `after_batch(done, total)` is called after each committed batch (a progress bar, fault injection).
        On an error the partial run is deleted when `cleanup_on_error`; otherwise (or when the process dies)
        it stays invisible, status 'loading', until the next read-write open finds its writer gone.
        """
        if batch_size < 1:
            raise UsageError(f"batch size must be at least 1, got {batch_size}")
        run_id = check_run_id(graph.run["id"])
        self.ensure_schema(graph.extra_head_properties)
        self.delete_run(run_id, batch_size)
        steps = [(self._write_heads, part) for part in batches(graph.heads, batch_size)]
        for kind, edges in graph.edges.groupby("kind", sort=True):
            steps += [(functools.partial(self._write_edges, check_type_pair(kind)), part) for part in batches(edges, batch_size)]
        expected = {"heads": len(graph.heads), "edges": len(graph.edges)}
        try:
            self._begin_run(graph.run | {"n_heads": expected["heads"], "n_edges": expected["edges"]}, graph.model)
            for done, (write, part) in enumerate(steps, start=1):
                write(part)
                if after_batch is not None:
                    after_batch(done, len(steps))
            self._seal_run(run_id, expected)
        except BaseException:
            if cleanup_on_error:
                with suppress(Exception):  # e.g. the connection is gone: the next read-write open cleans up
                    self.delete_run(run_id, batch_size)
            raise

    def _begin_run(self, run: Mapping[str, Any], model: Mapping[str, Any]) -> None:
        run_row = _present({name: run.get(name) for name in RUN_PROPERTIES} | {"status": "loading"} | Writer.current().row())
        model_row = _present({name: model.get(name) for name in MODEL_PROPERTIES})
        described = [n for n in model_row if n != "name"]
        model_update = (
            [(f"UNWIND $rows AS row MATCH (m:Model {{name: row.name}}) SET {_set_list('m', 'row', described)}", {"rows": [model_row]})]
            if described
            else []
        )
        self._write(
            [
                ("MERGE (:Model {name: $name})", {"name": model_row["name"]}),
                *model_update,
                (f"UNWIND $rows AS row CREATE (:Run {_property_map('row', run_row)})", {"rows": [run_row]}),
                (
                    "MATCH (r:Run {id: $run}), (m:Model {name: $model}) CREATE (r)-[:OF_MODEL]->(m)",
                    {"run": run_row["id"], "model": model_row["name"]},
                ),
            ]
        )

    def _write_heads(self, heads: pd.DataFrame) -> None:
        names = [c for c in heads.columns if heads[c].notna().any()]
        cypher = f"UNWIND $rows AS row CREATE (h:Head {_property_map('row', names)}){self.head_label_clause}"
        self._write([(cypher, {"rows": records(heads[names])})])

    @abstractmethod
    def _write_edges(self, kind: str, edges: pd.DataFrame) -> None:
        """Create one batch of `kind` edges (rows of `edge_rows`: endpoint keys plus EDGE_PROPERTIES) in one
        transaction; each engine has its own fast path (Neo4j: UNWIND of value lists, LadybugDB: COPY)."""

    def _make_durable(self) -> None:
        """Make every committed row survive a crash of this process (Neo4j: commits already are)."""

    def _seal_run(self, run_id: str, expected: Mapping[str, int]) -> None:
        """Mark the run complete once its rows are durable and their counts, read back, are the recorded ones."""
        self._make_durable()
        (stored,) = self.read(STORED_COUNTS_QUERY, {"run": run_id}).records()
        if stored != dict(expected):
            raise StoreUnavailable(
                f"run {run_id} was changed while it was being stored ({stored['heads']} of {expected['heads']} heads, "
                f"{stored['edges']} of {expected['edges']} edges present; was it deleted?); run `headgraph analyze` again"
            )
        if self._write_count(SEAL_RUN_STATEMENT, {"run": run_id}) != 1:
            raise StoreUnavailable(f"run {run_id} was deleted while it was being stored; run `headgraph analyze` again")
        self._make_durable()

    @abstractmethod
    def _write_count(self, cypher: str, params: dict[str, Any]) -> int:
        """Run one write statement returning a single count, in its own transaction; return the count."""

    def remove_abandoned_runs(self) -> list[str]:
        """Delete every run that is not complete and whose writer is gone; return their ids."""
        gone = [row["id"] for row in self.read(UNFINISHED_RUNS_QUERY).records() if not self._writer_alive(Writer.of(row))]
        for run_id in gone:
            self.delete_run(run_id)
        return gone

    def live_writer(self, run_id: str) -> Writer | None:
        """The live process still storing or deleting `run_id`, or None (complete, absent, or its writer gone)."""
        for row in self.read(UNFINISHED_RUNS_QUERY).records():
            if row["id"] == run_id and self._writer_alive(Writer.of(row)):
                return Writer.of(row)
        return None

    def _writer_alive(self, writer: Writer | None) -> bool:
        """Whether the process that wrote a partial run may still be writing it (unknown hosts count as alive)."""
        return writer is not None and writer.alive() is not False

    # --- reading -------------------------------------------------------------------------------------

    def runs(self) -> list[dict[str, Any]]:
        """Every run in the store (complete or not), oldest first."""
        return self.read(RUNS_QUERY).records()

    def has_run(self, run_id: str) -> bool:
        """Whether the store holds a Run `run_id`, complete or not."""
        return self.read(RUN_COUNT_QUERY, {"run": run_id}).rows[0][0] > 0

    def run_params(self, run_id: str) -> str | None:
        """The run.json text stored with run `run_id` ('' for a run stored without one), or None when the store
        holds no such run."""
        rows = self.read(RUN_PARAMS_QUERY, {"run": run_id}).rows
        return (rows[0][0] or "") if rows else None

    def latest_run(self) -> str | None:
        """The id of the most recently created complete run, or None."""
        rows = self.read(LATEST_RUN_QUERY).rows
        return rows[0][0] if rows else None

    def latest_sweep(self) -> str | None:
        """The sweep id of the most recently created complete run that belongs to a sweep, or None."""
        rows = self.read(LATEST_SWEEP_QUERY).rows
        return rows[0][0] if rows else None


def _set_list(variable: str, source: str, names) -> str:
    return ", ".join(f"{variable}.{n} = {source}.{n}" for n in names)
