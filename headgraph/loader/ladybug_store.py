"""The embedded store: LadybugDB (a Kùzu fork) in one file, typed tables built from the shared schema.

Differences from Neo4j handled here:
- typed tables must exist before writes (DDL below, generated from the property sets in store.py); a new
  role property becomes a new Head column (`ALTER TABLE Head ADD IF NOT EXISTS`);
- edges are written with `COPY <type> FROM <arrow table>` per batch inside the batch's transaction:
  `UNWIND $rows … MATCH … CREATE` measured ~3.4k edges/s on LadybugDB 0.22, COPY 23k–69k edges/s;
- rows loaded with COPY are not replayed from the WAL after a crash (LadybugDB 0.22), so a load checkpoints
  before its run is marked complete (`_make_durable`; automatic checkpoints are off, see `_open_database`);
- one read-write process per file: a second one gets "Could not set lock on file"; we retry briefly,
  then raise StoreUnavailable. Since the lock is exclusive, a partial run found by a read-write open was
  left by a dead writer (or by this process) and is removed at once;
- read-only opens work beside a live writer, except while it applies a checkpoint ("checkpoint recovery is
  pending") or appends to the WAL ("Checksum verification failed": a record half written): a reader then
  waits for the writer, or, when no process holds the lock (the writer died), completes the recovery with a
  brief read-write open;
- reads follow headgraph.loader.readonly (allow-listed statements and plan operators, a query timeout, a
  bounded buffer pool for read-only opens) and run in `BEGIN TRANSACTION READ ONLY`.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import ladybug
import pandas as pd
import pyarrow as pa

from headgraph.errors import ReadOnlyViolation, StoreUnavailable, UsageError, first_line
from headgraph.heads import TYPE_PAIRS, check_type_pair
from headgraph.loader.readonly import (
    LADYBUG_UNPLANNABLE,
    READ_BUFFER_POOL,
    check_ladybug_plan,
    check_statement,
    memory_exceeded,
    query_timeout,
    time_exceeded,
)
from headgraph.loader.store import (
    DEFAULT_BATCH_SIZE,
    DELETE_RUN_STATEMENTS,
    EDGE_PROPERTIES,
    HEAD_PROPERTIES,
    MODEL_PROPERTIES,
    RUN_PROPERTIES,
    GraphStore,
    Rows,
    Writer,
    check_run_id,
)

LOCK_TIMEOUT_S = 10.0
DELETE_HEADS_STATEMENT = "MATCH (h:Head) WHERE h.run_id = $run DETACH DELETE h"
_ARROW_TYPES = {
    "STRING": pa.string(),
    "INT64": pa.int64(),
    "DOUBLE": pa.float64(),
    "BOOLEAN": pa.bool_(),
    "STRING[]": pa.list_(pa.string()),
}
_READ_ONLY_REFUSALS = ("read-only transaction", "read-only database", "READ ONLY mode")


def _columns(properties: Mapping[str, str]) -> str:
    return ", ".join(f"{name} {kind}" for name, kind in properties.items())


def schema_ddl() -> list[str]:
    """CREATE statements for every table (idempotent)."""
    return [
        f"CREATE NODE TABLE IF NOT EXISTS Model({_columns(MODEL_PROPERTIES)}, PRIMARY KEY(name))",
        f"CREATE NODE TABLE IF NOT EXISTS Run({_columns(RUN_PROPERTIES)}, PRIMARY KEY(id))",
        f"CREATE NODE TABLE IF NOT EXISTS Head({_columns(HEAD_PROPERTIES)}, PRIMARY KEY(key))",
        "CREATE REL TABLE IF NOT EXISTS OF_MODEL(FROM Run TO Model)",
        *(f"CREATE REL TABLE IF NOT EXISTS {kind}(FROM Head TO Head, {_columns(EDGE_PROPERTIES)})" for kind in TYPE_PAIRS),
    ]




def _open_database(path: str, read_only: bool, lock_timeout: float) -> ladybug.Database:
    """Open, waiting up to `lock_timeout` s while another process holds the write lock (read-write) or is
    caught mid-checkpoint or mid-WAL-record (read-only); a reader completes what a dead writer left half done.
    Automatic checkpoints are off: with them every batch's commit rewrote the growing file (0.5-0.7 s per
    5k-edge batch); the store checkpoints once per load (before the run is marked complete) or delete."""
    deadline = time.monotonic() + lock_timeout
    while True:
        try:
            pool = READ_BUFFER_POOL if read_only else 0  # 0: LadybugDB's default, 80% of the memory
            return ladybug.Database(path, read_only=read_only, auto_checkpoint=False, buffer_pool_size=pool)
        except RuntimeError as e:
            message = str(e)
            locked = "Could not set lock" in message
            if read_only and not locked and _recover(path):
                continue  # no process holds the store: its recovery is done, open again
            if not read_only and not locked:
                raise StoreUnavailable(f"cannot open the embedded store {path}: {first_line(e)}") from None
            if time.monotonic() >= deadline:
                holder = re.search(r"Lock is held by PID (\d+)", message)
                by = f" (PID {holder.group(1)})" if holder else ""
                seen = "" if locked else f" ({first_line(e)})"
                raise StoreUnavailable(
                    f"the embedded store {path} is in use by another process{by}{seen}; "
                    "wait for it to finish or pass another --db PATH"
                ) from None
            time.sleep(0.2)


def _recover(path: str) -> bool:
    """Complete what a dead writer left (a half-applied checkpoint, a torn WAL tail) with a read-write open;
    False while a live writer holds the lock."""
    try:
        ladybug.Database(path, auto_checkpoint=False).close()
    except RuntimeError as e:
        if "Could not set lock" in str(e):
            return False
        raise StoreUnavailable(f"cannot recover the embedded store {path}: {first_line(e)}") from None
    return True


def _plain(value: Any) -> Any:
    """LadybugDB values as plain Python: no internal ids, Decimal sums as numbers."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        if "_NODES" in value:
            return {"nodes": _plain(value["_NODES"]), "relationships": _plain(value["_RELS"])}
        out = {"_label": value["_LABEL"]} if "_LABEL" in value else {}
        out.update({k: _plain(v) for k, v in value.items() if k not in ("_ID", "_SRC", "_DST", "_LABEL")})
        return out
    return value


class LadybugStore(GraphStore):
    """The embedded store at a file path (created on first read-write open)."""

    def __init__(self, path: str | os.PathLike, read_only: bool = False, lock_timeout: float = LOCK_TIMEOUT_S):
        self.path = str(path)
        self.read_only = read_only
        self.description = f"LadybugDB at {self.path}"
        if read_only and not os.path.exists(self.path):
            raise StoreUnavailable(f"no headgraph store at {self.path}: run `headgraph analyze` first or pass --db PATH")
        self._db = _open_database(self.path, read_only, lock_timeout)
        self._conn = ladybug.Connection(self._db)
        self._columns: dict[str, set[str]] = {}
        if read_only:
            tables = {row[0] for row in self._conn.execute("CALL show_tables() RETURN name").get_all()}
            if "Run" not in tables:
                self.close()
                raise StoreUnavailable(f"{self.path} holds no headgraph runs: run `headgraph analyze` first")
        else:
            self.ensure_schema()
            self.remove_abandoned_runs()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._db.close()
            self._conn = None

    def ensure_schema(self, extra_head_properties: Mapping[str, str] | None = None) -> None:
        if self.read_only:
            raise ReadOnlyViolation(f"{self.description} is open read-only; writes are refused")
        if not self._columns:
            for statement in schema_ddl():
                self._conn.execute(statement)
            for table in ("Run", "Head", *TYPE_PAIRS):  # stores made by an earlier version lack newer columns
                info = self._conn.execute(f"CALL table_info('{table}') RETURN name").get_all()
                self._columns[table] = {row[0] for row in info}
            self._add_columns("Run", RUN_PROPERTIES)
            for kind in TYPE_PAIRS:
                self._add_columns(kind, EDGE_PROPERTIES)
        self._add_columns("Head", {**HEAD_PROPERTIES, **(extra_head_properties or {})})

    def _add_columns(self, table: str, properties: Mapping[str, str]) -> None:
        for name, kind in properties.items():
            if name not in self._columns[table]:
                self._conn.execute(f"ALTER TABLE {table} ADD IF NOT EXISTS {name} {kind}")
                self._columns[table].add(name)

    def _writer_alive(self, writer: Writer | None) -> bool:
        """This process holds the file's only write lock, so any other writer of a partial run is gone."""
        return writer == Writer.current()

    def _execute_in_transaction(self, begin: str, statements: list[tuple[str, dict[str, Any]]]) -> Any:
        self._conn.execute(begin)
        try:
            results = [self._conn.execute(cypher, params) for cypher, params in statements]
            self._conn.execute("COMMIT")
        except BaseException:
            try:
                self._conn.execute("ROLLBACK")
            except RuntimeError:
                pass  # the failed statement already ended the transaction
            raise
        return results

    def _write(self, statements: list[tuple[str, dict[str, Any]]]) -> None:
        try:
            self._execute_in_transaction("BEGIN TRANSACTION", statements)
        except RuntimeError as e:
            if any(marker in str(e) for marker in _READ_ONLY_REFUSALS):
                raise ReadOnlyViolation(f"{self.description} is open read-only; writes are refused") from None
            raise

    def read(self, cypher: str, params: Mapping[str, Any] | None = None) -> Rows:
        """Plan the statement (EXPLAIN), check the plan, then run it; see headgraph.loader.readonly."""
        statement = check_statement(cypher, LADYBUG_UNPLANNABLE)
        values = dict(params or {})
        self._conn.set_query_timeout(round(query_timeout() * 1000))
        try:
            (plan,) = self._execute_in_transaction("BEGIN TRANSACTION READ ONLY", [(f"EXPLAIN {statement}", values)])
            check_ladybug_plan(plan.get_all()[0][0])
            (result,) = self._execute_in_transaction("BEGIN TRANSACTION READ ONLY", [(statement, values)])
        except RuntimeError as e:
            message = first_line(e)
            if any(marker in message for marker in _READ_ONLY_REFUSALS):
                raise ReadOnlyViolation("refused: the query would write; only reads run here") from None
            if message == "Interrupted.":
                raise time_exceeded() from None
            if message == "std::bad_alloc":  # an allocation outside the buffer pool failed (see bounded_memory)
                raise MemoryError(message) from None
            if message.startswith("Buffer manager exception"):
                size = f"{READ_BUFFER_POOL >> 20} MiB " if self.read_only else ""
                raise memory_exceeded(f"the embedded store's {size}buffer pool") from None
            older = re.match(r"Binder exception: Cannot find property (\w+) for (\w+)\.", message)
            if older and older.group(1) in {**RUN_PROPERTIES, **HEAD_PROPERTIES, **EDGE_PROPERTIES}:
                raise StoreUnavailable(f"{self.description} was written by an earlier headgraph: it has no "
                                       f"{older.group(1)} yet; the next analyze or sweep into it adds it "
                                       "(reads never change the file)") from None
            raise UsageError(f"LadybugDB rejected the query: {message}") from None
        finally:
            self._conn.set_query_timeout(0)
        return Rows(result.get_column_names(), [[_plain(v) for v in row] for row in result.get_all()])

    def _write_edges(self, kind: str, edges: pd.DataFrame) -> None:
        names = ["source_key", "target_key", *EDGE_PROPERTIES]
        schema = pa.schema(
            [("source_key", pa.string()), ("target_key", pa.string())]
            + [(n, _ARROW_TYPES[t]) for n, t in EDGE_PROPERTIES.items()]
        )
        table = pa.Table.from_pandas(edges.reindex(columns=names), schema=schema, preserve_index=False)
        self._write([(f"COPY {check_type_pair(kind)} FROM $rows", {"rows": table})])

    def _write_count(self, cypher: str, params: dict[str, Any]) -> int:
        (result,) = self._execute_in_transaction("BEGIN TRANSACTION", [(cypher, params)])
        return result.get_all()[0][0]

    def _make_durable(self) -> None:
        """A checkpoint: COPY-loaded rows survive a crash only once they are in the database file."""
        if self._conn is not None and not self.read_only:
            self._conn.execute("CHECKPOINT")

    def delete_run(self, run_id: str, batch_size: int = DEFAULT_BATCH_SIZE) -> bool:
        """Heads, edges, the Run and unused Models in one transaction, then a checkpoint."""
        found = self.has_run(check_run_id(run_id))
        params = {"run": run_id}
        self._write([(DELETE_HEADS_STATEMENT, params), *((statement, params) for statement in DELETE_RUN_STATEMENTS)])
        self._make_durable()
        return found
