"""What a read may run, and how long and how large it may grow: the one policy behind `GraphStore.read()` on
both stores (`headgraph cypher`, the named queries, the stores' own reads).

A statement runs only when every step below allows it (an allow-list: anything not named here is refused):

1. `check_statement`, on the text before the engine sees it: exactly one statement (a trailing `;` is fine),
   whose first word is MATCH, OPTIONAL, UNWIND, WITH or RETURN. Every other kind of statement — COPY, EXPORT,
   IMPORT, LOAD, INSTALL, ATTACH, USE, CALL, SHOW, TERMINATE, CREATE, EXPLAIN, transactions ... — is refused
   here, because LadybugDB 0.22 acts on some while merely planning them (`EXPLAIN EXPORT DATABASE 'd'` creates
   the folder d). For the same reason the embedded store also refuses the clause words LOAD and CALL anywhere
   in the query (not as names: after `.`, `:` or `$`, or before `.` or `:`): planning `LOAD FROM 'file'` reads
   the file's header (its column names and types then leak through error messages), and planning an in-query
   `CALL READ_CSV_SERIAL(...)` crashes the process.
2. The engine's own plan of the statement (`EXPLAIN`, which plans without running), made in a read-only
   transaction just before the statement runs: every operator must be a pure read listed below. LadybugDB also
   allows TABLE_FUNCTION_CALL only for READ_FTABLE (its in-memory intermediate results), so LOAD FROM, file
   scans and catalog functions are refused. Neo4j must also classify the query as a read (query type 'r');
   LOAD CSV (`LoadCSV`), procedures (`ProcedureCall`), SHOW / TERMINATE TRANSACTIONS and a reading
   CALL { … } IN TRANSACTIONS (`TransactionApply`) are query type 'r' too, which is why operators are checked.
   Functions are not plan operators: those of both engines read no file, URL or setting (no plugins).

A keyword deny-list would have to name every way out and is silently wrong when an engine adds one; here a
new statement kind, clause or operator is refused until it is added below.

Bounds on what is allowed (`time_exceeded`, `memory_exceeded`: one line, exit 2, saying how to narrow the query):
- every read statement gets QUERY_TIMEOUT_S (env HEADGRAPH_QUERY_TIMEOUT): LadybugDB's query timeout, Neo4j's
  transaction timeout, enforced by the server;
- a read-only embedded store is opened with a READ_BUFFER_POOL buffer pool, which holds the intermediate
  results too: `query paths` from L0 to L11 of a dense run (152,064 edges) grew past 3.6 GB RSS in 95 s
  with the default pool (80% of the machine's memory); with 512 MiB it stops after ~11 s at 0.67 GB;
- on Neo4j the server bounds a transaction's memory: `db.memory.transaction.max` (the local server sets
  256 MiB), else the shared `dbms.memory.transaction.total.max` (70% of the heap); what escapes its tracking
  and fills the server's heap is `Java heap space`, named as such;
- `headgraph cypher` / `query` hold the process in `bounded_memory()` once the store is open: on Linux it may
  map at most READ_MEMORY more private memory (RLIMIT_DATA, which counts malloc and anonymous mmap alike), so
  neither engine's functions nor the result rows can grow it further. String and list functions allocate
  outside LadybugDB's buffer pool: `RETURN size(lpad('x', 1500000000, 'y'))` grew the process to 2.1 GB
  (only then did the pool refuse the copy), `RETURN size(range(1, 400000000))` to 4.2 GB (and answered);
  bounded, both stop at once below 0.5 GB. A process's peak is thus the memory it held when the store was
  opened (~0.2 GB for the CLI), the buffer pool (512 MiB) and READ_MEMORY. On Neo4j the driver decodes records
  in this process too; its Rust decoder aborts the process when an allocation fails, so there the bound is
  checked after each batch of records instead (`checked_memory`): one record passes it by its own size.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psutil

from headgraph.errors import ReadOnlyViolation, UsageError

QUERY_TIMEOUT_S = 30.0
READ_BUFFER_POOL = 512 * 2**20
READ_MEMORY = 512 * 2**20
READ_CLAUSES = frozenset({"MATCH", "OPTIONAL", "UNWIND", "WITH", "RETURN"})
LADYBUG_UNPLANNABLE = frozenset({"LOAD", "CALL"})
LADYBUG_READ_OPERATORS = frozenset({
    "AGGREGATE", "AGGREGATE_FINALIZE", "AGGREGATE_SCAN", "COUNT_REL_TABLE", "CROSS_PRODUCT", "DUMMY_SINK",
    "EMPTY_RESULT", "FILTER", "FLATTEN", "HASH_JOIN_BUILD", "HASH_JOIN_PROBE", "INTERSECT", "INTERSECT_BUILD",
    "LIMIT", "MULTIPLICITY_REDUCER", "ORDER_BY", "ORDER_BY_MERGE", "ORDER_BY_SCAN", "PATH_PROPERTY_PROBE",
    "PRIMARY_KEY_SCAN_NODE_TABLE", "PROJECTION", "RECURSIVE_EXTEND", "RESULT_COLLECTOR", "SCAN_NODE_TABLE",
    "SCAN_REL_TABLE", "SEMI_MASKER", "SKIP", "TABLE_FUNCTION_CALL", "TOP_K", "TOP_K_SCAN", "UNION_ALL_SCAN",
    "UNWIND",
})  # fmt: skip
LADYBUG_READ_TABLE_FUNCTIONS = frozenset({"READ_FTABLE"})
NEO4J_READ_OPERATORS = frozenset({
    # leaves: scans, seeks, counts
    "AllNodesScan", "NodeByLabelScan", "UnionNodeByLabelsScan", "IntersectionNodeByLabelsScan",
    "SubtractionNodeByLabelsScan", "NodeByIdSeek", "NodeByElementIdSeek", "NodeIndexSeek", "NodeUniqueIndexSeek",
    "MultiNodeIndexSeek", "NodeIndexSeekByRange", "NodeUniqueIndexSeekByRange", "NodeIndexScan",
    "NodeIndexContainsScan", "NodeIndexEndsWithScan", "NodeCountFromCountStore", "RelationshipCountFromCountStore",
    "DirectedRelationshipTypeScan", "UndirectedRelationshipTypeScan", "DirectedAllRelationshipsScan",
    "UndirectedAllRelationshipsScan", "DirectedUnionRelationshipTypesScan", "UndirectedUnionRelationshipTypesScan",
    "DirectedRelationshipByIdSeek", "UndirectedRelationshipByIdSeek", "DirectedRelationshipByElementIdSeek",
    "UndirectedRelationshipByElementIdSeek", "DirectedRelationshipIndexSeek", "UndirectedRelationshipIndexSeek",
    "DirectedRelationshipIndexScan", "UndirectedRelationshipIndexScan", "DirectedRelationshipIndexSeekByRange",
    "UndirectedRelationshipIndexSeekByRange", "DirectedRelationshipIndexContainsScan",
    "UndirectedRelationshipIndexContainsScan", "DirectedRelationshipIndexEndsWithScan",
    "UndirectedRelationshipIndexEndsWithScan", "Argument",
    # traversal
    "Expand(All)", "Expand(Into)", "OptionalExpand(All)", "OptionalExpand(Into)", "VarLengthExpand(All)",
    "VarLengthExpand(Into)", "VarLengthExpand(Pruning)", "VarLengthExpand(Pruning,BFS)", "ShortestPath",
    "StatefulShortestPath(All)", "StatefulShortestPath(Into)", "Repeat(Trail)", "NullifyMetadata", "ProjectEndpoints",
    "TriadicSelection", "TriadicBuild", "TriadicFilter",
    # joins, subqueries, unions
    "Apply", "SemiApply", "AntiSemiApply", "LetSemiApply", "LetAntiSemiApply", "SelectOrSemiApply",
    "SelectOrAntiSemiApply", "LetSelectOrSemiApply", "LetSelectOrAntiSemiApply", "ConditionalApply",
    "AntiConditionalApply", "RollUpApply", "CartesianProduct", "NodeHashJoin", "ValueHashJoin",
    "NodeLeftOuterHashJoin", "NodeRightOuterHashJoin", "Optional", "Union", "OrderedUnion",
    # rows
    "Filter", "Projection", "CacheProperties", "Unwind", "Distinct", "OrderedDistinct", "EagerAggregation",
    "OrderedAggregation", "Sort", "PartialSort", "Top", "PartialTop", "Limit", "ExhaustiveLimit", "Skip", "Eager",
    "ProduceResults",
})  # fmt: skip
NEO4J_QUERY_TYPES = {"w": "a write", "rw": "a read-write", "s": "a schema or administration"}
NARROW = "narrow it: name heads rather than layers, match fewer hops, add a LIMIT, or query a run stored with --top-k"

_TOKEN = re.compile(
    r"""(?P<space>\s+)
      | (?P<comment>//[^\r\n]*|/\*.*?\*/)
      | (?P<string>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
      | (?P<quoted>`(?:[^`]|``)*`)
      | (?P<word>[^\W\d]\w*)
      | (?P<other>.)""",
    re.VERBOSE | re.DOTALL,
)
_LADYBUG_OPERATOR = re.compile(r"(?<=│)\s*([A-Z][A-Z0-9_]*)\[(\d+)\]\s*(?=│)")
_LADYBUG_FUNCTION = re.compile(r"Function: ([A-Z0-9_]+)")
_NEO4J_MEMORY_LIMIT = re.compile(r"limit ([\d.]+ \w+)\..*?([\w.]+) threshold reached", re.DOTALL)


def _code_tokens(cypher: str) -> list[tuple[int, str, str]]:
    """(offset, kind, text) of every token outside whitespace and comments; strings and `quoted` names are
    single tokens, so nothing inside them counts as a word. Unterminated ones raise UsageError."""
    tokens, position = [], 0
    while position < len(cypher):
        match = _TOKEN.match(cypher, position)
        kind, text = match.lastgroup, match.group()
        if kind == "other" and (text in "'\"`" or cypher.startswith("/*", position)):
            raise UsageError(f"unterminated {'comment' if text == '/' else 'string or name'} at offset {position}")
        if kind not in ("space", "comment"):
            tokens.append((position, kind, text))
        position = match.end()
    return tokens


def check_statement(cypher: str, unplannable: frozenset[str] = frozenset()) -> str:
    """The one read statement in `cypher` (without a trailing `;`); refuses anything else (step 1 above).
    `unplannable`: words (in upper case) the engine must not even plan, wherever they stand in the query."""
    tokens = _code_tokens(cypher)
    if not tokens:
        raise UsageError("empty query: give one Cypher statement")
    _, kind, first = tokens[0]
    if kind != "word" or first.upper() not in READ_CLAUSES:
        raise ReadOnlyViolation(
            f"refused {first.upper() if kind == 'word' else repr(first)}: only reads run here, one statement "
            "starting with MATCH, OPTIONAL MATCH, UNWIND, WITH or RETURN"
        )
    end = len(cypher)
    for index, (offset, kind, text) in enumerate(tokens):
        if text == ";":
            if index + 1 < len(tokens):
                raise ReadOnlyViolation(f"refused a second statement after ';' at offset {offset}: one at a time")
            end = offset
        elif kind == "word" and text.upper() in unplannable:
            before = tokens[index - 1][2] if index else ""
            after = tokens[index + 1][2] if index + 1 < len(tokens) else ""
            if before not in (".", ":", "$") and after not in (".", ":"):  # a property, label, key, variable name
                raise ReadOnlyViolation(
                    f"refused {text.upper()} at offset {offset}: the embedded store runs no "
                    f"{' or '.join(sorted(unplannable))} clause in a read"
                )
    return cypher[:end]


def check_ladybug_plan(plan: str) -> None:
    """Step 2 on LadybugDB: `plan` is the text EXPLAIN returns, one box per operator, headed NAME[id]."""
    operators: dict[int, str] = {}
    for name, number in _LADYBUG_OPERATOR.findall(plan):
        if operators.setdefault(int(number), name) != name:
            raise ReadOnlyViolation(f"refused: LadybugDB's plan names operator {number} twice; cannot check it")
    functions = _LADYBUG_FUNCTION.findall(plan)
    if not operators or sorted(operators) != list(range(len(operators))):
        raise ReadOnlyViolation("refused: LadybugDB's plan of the query could not be read; cannot check it")
    refused = sorted(set(operators.values()) - LADYBUG_READ_OPERATORS)
    if refused:
        raise ReadOnlyViolation(f"refused: the query's plan has {', '.join(refused)}, which is not a pure read")
    refused = sorted(set(functions) - LADYBUG_READ_TABLE_FUNCTIONS)
    if refused:
        raise ReadOnlyViolation(f"refused: the query calls table function {', '.join(refused)}, not a pure read")
    if len(functions) < list(operators.values()).count("TABLE_FUNCTION_CALL"):
        raise ReadOnlyViolation("refused: LadybugDB's plan calls a table function it does not name; cannot check it")


def check_neo4j_plan(query_type: str | None, plan: Mapping[str, Any] | None) -> None:
    """Step 2 on Neo4j: `query_type` and `plan` of the EXPLAIN result's summary."""
    if plan is None:
        raise ReadOnlyViolation("refused: Neo4j returned no plan for the query; cannot check it")
    if query_type != "r":
        raise ReadOnlyViolation(
            f"refused: Neo4j plans this as {NEO4J_QUERY_TYPES.get(query_type, repr(query_type))} query, not a read"
        )
    operators, pending = set(), [plan]
    while pending:
        node = pending.pop()
        operators.add(node["operatorType"].split("@")[0])  # "Expand(All)@neo4j": @ the database
        pending.extend(node.get("children", []))
    refused = sorted(operators - NEO4J_READ_OPERATORS)
    if refused:
        raise ReadOnlyViolation(f"refused: the query's plan has {', '.join(refused)}, which is not a pure read")


def query_timeout() -> float:
    """Seconds a read statement may run: env HEADGRAPH_QUERY_TIMEOUT, else QUERY_TIMEOUT_S."""
    text = os.environ.get("HEADGRAPH_QUERY_TIMEOUT") or str(QUERY_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds <= 86400:
        raise UsageError(f"HEADGRAPH_QUERY_TIMEOUT must be a number of seconds in (0, 86400], got {text!r}")
    return seconds


def time_exceeded() -> UsageError:
    limit = f"{query_timeout():g} s limit of a read (HEADGRAPH_QUERY_TIMEOUT)"
    return UsageError(f"the query ran past the {limit}; {NARROW}")


def memory_exceeded(bound: str) -> UsageError:
    return UsageError(f"the query needs more memory than {bound}; {NARROW}")


def neo4j_memory_bound(message: str) -> str:
    """The limit a Neo4j MemoryPoolOutOfMemoryError names: "Neo4j's limit db.memory.transaction.max (256.0 MiB)"."""
    match = _NEO4J_MEMORY_LIMIT.search(message)
    return f"Neo4j's limit {match.group(2)} ({match.group(1)})" if match else "Neo4j's transaction memory limit"


def _data_memory() -> int:
    """The private memory the process maps (Linux: data and stack pages, what RLIMIT_DATA counts)."""
    return psutil.Process().memory_info().data


_bounds: list[tuple[int, tuple[int, int]]] = []
"""(ceiling, RLIMIT_DATA before it) of each bounded_memory() block running now, innermost last."""


def _bound_exceeded() -> UsageError:
    return memory_exceeded(f"the {READ_MEMORY >> 20} MiB a read may add to this process")


@contextmanager
def bounded_memory() -> Iterator[None]:
    """Run the block with at most READ_MEMORY more private memory than the process maps now (RLIMIT_DATA, on
    Linux; elsewhere unbounded); a MemoryError inside it becomes `memory_exceeded`. Enter it once the store is
    open: LadybugDB maps its buffer pool's whole address range (untouched, 8 TB) when it opens. The limit the
    process had before is restored on the way out."""
    if sys.platform != "linux":
        yield
        return
    import resource

    before = resource.getrlimit(resource.RLIMIT_DATA)
    ceiling = min([_data_memory() + READ_MEMORY, *(v for v in before if v != resource.RLIM_INFINITY)])
    resource.setrlimit(resource.RLIMIT_DATA, (ceiling, before[1]))
    _bounds.append((ceiling, before))
    try:
        yield
    except MemoryError:
        raise _bound_exceeded() from None
    finally:
        _bounds.pop()
        resource.setrlimit(resource.RLIMIT_DATA, before)


@contextmanager
def checked_memory() -> Iterator[Callable[[], None]]:
    """For code that aborts the process when an allocation fails instead of raising MemoryError (the Neo4j
    driver's Rust decoder does): inside a bounded_memory() block its RLIMIT_DATA is lifted while the block runs,
    and the check this yields (call it between steps, e.g. batches of records) and the block's end raise
    `memory_exceeded` once the process maps more than the ceiling. A step overshoots it by what it allocates
    itself. Outside bounded_memory() the check does nothing."""
    if not _bounds:
        yield lambda: None
        return
    import resource

    ceiling, before = _bounds[-1]

    def check() -> None:
        if _data_memory() > ceiling:
            raise _bound_exceeded()

    resource.setrlimit(resource.RLIMIT_DATA, before)
    try:
        yield check
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (ceiling, before[1]))
    check()
