"""The Neo4j store: uniqueness constraints and indexes created before loading, batched managed transactions,
reads in READ_ACCESS sessions, checked and bounded by headgraph.loader.readonly (plan allow-list, transaction
timeout; no driver retries, so a bound that is hit fails at once with one line). The client's memory is bounded
as the embedded store's (`bounded_reads`), except while the driver decodes records: under RLIMIT_DATA its Rust
PackStream decoder aborts the process when a value does not fit (a 256 MiB string did), so there the bound is
checked after each batch of records instead (readonly.checked_memory).

Edge load speed (250k edges, 14 properties each, 2 cores; benchmarks/bench_load.py): the client was the
bottleneck: packing 5k rows as dicts took 0.33 s in the pure-Python PackStream encoder. With the Rust
encoder (package neo4j-rust-ext, 0.02 s) and rows sent as value lists instead of dicts the load went from
5.9k-7.0k to 13.4k-17.4k edges/s at batch 5000; what remains is mostly server time, half of it the
relationship properties. Tried without gain: edges grouped per source head, sorted batches, batches of 10k–50k,
`CALL { … } IN CONCURRENT TRANSACTIONS` (slower: lock contention on the shared dense head nodes)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import neo4j
import pandas as pd
from neo4j import GraphDatabase
from neo4j.exceptions import AuthError, ClientError, ConfigurationError, Neo4jError, ServiceUnavailable, SessionExpired
from neo4j.graph import Node, Path, Relationship

from headgraph.errors import ReadOnlyViolation, StoreUnavailable, UsageError, first_line
from headgraph.heads import check_type_pair
from headgraph.loader.readonly import (
    check_neo4j_plan,
    check_statement,
    checked_memory,
    memory_exceeded,
    neo4j_memory_bound,
    query_timeout,
    time_exceeded,
)
from headgraph.loader.store import (
    DEFAULT_BATCH_SIZE,
    DELETE_RUN_STATEMENTS,
    EDGE_PROPERTIES,
    GraphStore,
    Rows,
    Writer,
    check_run_id,
)

SCHEMA = (
    "CREATE CONSTRAINT head_key IF NOT EXISTS FOR (h:Head) REQUIRE h.key IS UNIQUE",
    "CREATE CONSTRAINT run_id IF NOT EXISTS FOR (r:Run) REQUIRE r.id IS UNIQUE",
    "CREATE CONSTRAINT model_name IF NOT EXISTS FOR (m:Model) REQUIRE m.name IS UNIQUE",
    "CREATE INDEX head_run_id IF NOT EXISTS FOR (h:Head) ON (h.run_id)",
    "CREATE INDEX head_name IF NOT EXISTS FOR (h:Head) ON (h.name)",
    "CREATE INDEX run_status IF NOT EXISTS FOR (r:Run) ON (r.status)",
)
HIDE_RUN_STATEMENT = ("MATCH (r:Run) WHERE r.id = $run SET r.status = 'deleting', r.writer_host = $writer_host, "
                      "r.writer_pid = $writer_pid, r.writer_started = $writer_started RETURN count(r)")
DELETE_EDGES_BATCH = "MATCH (:Head {run_id: $run})-[e]->() WITH e LIMIT $n DELETE e RETURN count(*)"
DELETE_HEADS_BATCH = "MATCH (h:Head {run_id: $run}) WITH h LIMIT $n DETACH DELETE h RETURN count(*)"
CHECKED_ROWS = 1000  # the driver's fetch size: the process's memory is checked once per batch of records
ACCESS_MODE_CODES = ("Neo.ClientError.Statement.AccessMode", "Neo.ClientError.General.ForbiddenOnReadOnlyDatabase")




def connect(uri: str, user: str, password: str) -> neo4j.Driver:
    """A driver with verified connectivity and credentials; failures become one-line StoreUnavailable.

    A lost server fails fast: managed transactions are retried for 2 s (driver default 30 s, and a failed load
    runs two: the batch, then the clean-up), new connections time out after 5 s. The driver logs its retries and
    dropped connections as warnings and errors, which the one-line StoreUnavailable replaces: unless the
    application gave the `neo4j` logger a handler, they go to a NullHandler instead of stderr."""
    schemes = ("bolt", "bolt+s", "bolt+ssc", "neo4j", "neo4j+s", "neo4j+ssc")
    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018 - parses the port, raising ValueError for a bad one
    except ValueError as e:
        raise StoreUnavailable(f"bad Neo4j URI {uri!r} ({e}); use e.g. bolt://127.0.0.1:7687") from None
    if parts.scheme not in schemes:
        raise StoreUnavailable(f"bad Neo4j URI {uri!r}: headgraph talks Bolt: use one of {', '.join(schemes)}, "
                               "e.g. bolt://127.0.0.1:7687")
    driver_log = logging.getLogger("neo4j")
    if not driver_log.handlers:
        driver_log.addHandler(logging.NullHandler())
    try:
        driver = GraphDatabase.driver(uri, auth=(user, password), notifications_min_severity="OFF",
                                      max_transaction_retry_time=2.0, connection_timeout=5.0,
                                      connection_acquisition_timeout=10.0)
    except (ConfigurationError, ValueError) as e:
        raise StoreUnavailable(f"bad Neo4j URI {uri!r} ({first_line(e)}); use e.g. bolt://127.0.0.1:7687") from None
    try:
        driver.verify_connectivity()
    except AuthError:
        driver.close()
        raise StoreUnavailable(
            f"Neo4j at {uri} refused user {user!r}: set NEO4J_USER / NEO4J_PASSWORD to valid credentials"
        ) from None
    except (ServiceUnavailable, SessionExpired, OSError):
        driver.close()
        raise StoreUnavailable(
            f"cannot reach Neo4j at {uri}: start it (scripts/neo4j-local start) or check --neo4j / NEO4J_URI"
        ) from None
    return driver


def _plain(value: Any) -> Any:
    """Driver graph types as plain Python, shaped like the embedded store's values."""
    if isinstance(value, Node):
        return {"_label": ":".join(sorted(value.labels)), **{k: _plain(v) for k, v in value.items()}}
    if isinstance(value, Relationship):
        return {"_label": value.type, **{k: _plain(v) for k, v in value.items()}}
    if isinstance(value, Path):
        return {"nodes": [_plain(n) for n in value.nodes], "relationships": [_plain(r) for r in value.relationships]}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def value_lists(frame: pd.DataFrame) -> list[list[Any]]:
    """DataFrame rows as lists of plain-Python values (NaN -> None): half the Bolt bytes of one dict per row."""
    return frame.astype(object).where(frame.notna(), None).values.tolist()


class Neo4jStore(GraphStore):
    """A Neo4j database reached over Bolt. Head nodes also get a `Layer<l>` label (Browser colours by it)."""

    head_label_clause = " SET h:$('Layer' + toString(row.layer))"

    def __init__(self, uri: str, user: str, password: str, database: str = "neo4j", read_only: bool = False):
        self.uri, self.database, self.read_only = uri, database, read_only
        self.description = f"Neo4j at {uri} (database {database})"
        self.driver = connect(uri, user, password)
        if not read_only:
            self.ensure_schema()
            self.remove_abandoned_runs()

    def close(self) -> None:
        self.driver.close()

    def _session(self, access_mode: str):
        return self.driver.session(database=self.database, default_access_mode=access_mode)

    def _guarded(self, work: Callable[[], Any]) -> Any:
        try:
            return work()
        except (ServiceUnavailable, SessionExpired) as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__  # the innermost cause
            raise StoreUnavailable(f"lost the connection to {self.description}: {reason}; check that it is running "
                                   "and rerun") from None
        except ClientError as e:
            if e.code in ACCESS_MODE_CODES:
                raise ReadOnlyViolation("this Cypher would write; only read queries are allowed here") from None
            if e.code == "Neo.ClientError.Database.DatabaseNotFound":
                raise StoreUnavailable(f"{self.description}: no such database; set NEO4J_DATABASE") from None
            raise

    def ensure_schema(self, extra_head_properties: Mapping[str, str] | None = None) -> None:
        """Constraints and indexes; Neo4j needs nothing per extra property (it is schemaless)."""

        def create() -> None:
            with self._session(neo4j.WRITE_ACCESS) as session:
                for statement in SCHEMA:
                    session.run(statement).consume()
                session.run("CALL db.awaitIndexes(300)").consume()

        if self.read_only:
            raise ReadOnlyViolation(f"{self.description} is open read-only; writes are refused")
        self._guarded(create)

    def _write(self, statements: list[tuple[str, dict[str, Any]]]) -> None:
        def work(tx) -> None:
            for cypher, params in statements:
                tx.run(cypher, params).consume()

        def run() -> None:
            with self._session(neo4j.WRITE_ACCESS) as session:
                session.execute_write(work)

        self._guarded(run)

    def _write_edges(self, kind: str, edges: pd.DataFrame) -> None:
        names = [n for n in EDGE_PROPERTIES if edges[n].notna().any()]
        properties = ", ".join(f"{name}: row[{i}]" for i, name in enumerate(names, start=2))
        cypher = (
            "UNWIND $rows AS row MATCH (a:Head {key: row[0]}), (b:Head {key: row[1]}) "
            f"CREATE (a)-[:{check_type_pair(kind)} {{{properties}}}]->(b)"
        )
        self._write([(cypher, {"rows": value_lists(edges[["source_key", "target_key", *names]])})])

    def _write_count(self, cypher: str, params: dict[str, Any]) -> int:
        def work(tx) -> int:
            return tx.run(cypher, params).single()[0]

        def run() -> int:
            with self._session(neo4j.WRITE_ACCESS) as session:
                return session.execute_write(work)

        return self._guarded(run)

    def read(self, cypher: str, params: Mapping[str, Any] | None = None) -> Rows:
        """Plan the statement (EXPLAIN), check the plan, then run it in the same transaction, which the server
        ends after query_timeout() s; see headgraph.loader.readonly."""
        statement = check_statement(cypher)
        values = dict(params or {})

        def run() -> Rows:
            with self._session(neo4j.READ_ACCESS) as session, session.begin_transaction(timeout=query_timeout()) as tx:
                summary = tx.run(f"EXPLAIN {statement}", values).consume()
                check_neo4j_plan(summary.query_type, summary.plan)
                with checked_memory() as check:
                    result, rows = tx.run(statement, values), []
                    for record in result:
                        rows.append([_plain(v) for v in record.values()])
                        if len(rows) % CHECKED_ROWS == 0:
                            check()
                return Rows(list(result.keys()), rows)

        try:
            return self._guarded(run)
        except Neo4jError as e:
            if e.code == "Neo.ClientError.Transaction.TransactionTimedOutClientConfiguration":
                raise time_exceeded() from None
            if e.code == "Neo.TransientError.General.MemoryPoolOutOfMemoryError":
                raise memory_exceeded(neo4j_memory_bound(first_line(e))) from None
            if e.code == "Neo.TransientError.General.OutOfMemoryError":  # past the tracking, out of the server's heap
                raise memory_exceeded("the Neo4j server's heap") from None
            raise UsageError(f"Neo4j rejected the query: {first_line(e)}") from None

    def delete_run(self, run_id: str, batch_size: int = DEFAULT_BATCH_SIZE) -> bool:
        """Hide the run first (status 'deleting', this process as its writer, so that no other process takes it
        for abandoned while it goes), then delete edges and heads in batches, then the Run."""
        check_run_id(run_id)
        params = {"run": run_id, "n": batch_size, **Writer.current().row()}
        found = self._write_count(HIDE_RUN_STATEMENT, params)
        for batch in (DELETE_EDGES_BATCH, DELETE_HEADS_BATCH):
            while self._write_count(batch, params):
                pass
        self._write([(statement, params) for statement in DELETE_RUN_STATEMENTS])
        return found > 0
