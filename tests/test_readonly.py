"""`headgraph cypher` and every other read are read-only by allow-list (headgraph.loader.readonly), on both stores.

Each escape found in issue 9 is tried through the real CLI and must be refused with one line, exit 2, and must
have done nothing: no file read (its content is in no output) or written, no folder made, no library loaded
(a real gcc-built shared library whose constructor writes a marker), no URL fetched (a local HTTP server
counts requests), no transaction killed (another client's open write transaction still commits). Both layers
of the policy refuse on their own: the statement check, and the engine's plan of the statement. Ordinary
reads and every named query still run, and `query paths` on a dense run stops at a bound, under 1 GB RSS; so do
string and list functions, which allocate outside the embedded store's buffer pool, and large results.
Neo4j tests use the real server (fixture neo4j_config), never mocked, never skipped.
"""

import http.server
import os
import shutil
import subprocess
import sys
import threading
import uuid

import ladybug
import neo4j
import pytest
from _cli import run_cli
from _commands import headgraph
from _pairs import HUB, planted_pairs, run_graph

from headgraph.analysis.selection import SelectionPolicy
from headgraph.errors import ReadOnlyViolation
from headgraph.heads import TYPE_PAIRS
from headgraph.loader.ladybug_store import LadybugStore
from headgraph.loader.open_store import open_store
from headgraph.loader.readonly import READ_MEMORY, check_ladybug_plan, check_neo4j_plan
from headgraph.queries.runner import load_query, query_names, run_named

SESSION = f"rotest-{uuid.uuid4().hex[:6]}"
SMALL, DENSE, SWEEP = f"{SESSION}-small", f"{SESSION}-dense", f"{SESSION}-sweep"  # the small run is a sweep's
SECRET = f"headgraph-secret-{uuid.uuid4().hex[:8]}"
NAMED_PARAMS = {"neighbors": {"head": HUB}, "paths": {"source": "L0", "target": "L5"}, "compare-runs": {"other": SMALL},
                "edge-history": {"source": "L0H0", "target": HUB}, "role-history": {"role": "identity"}}
ROLELESS = {"identity-hubs", "role-emergence", "model-roles"}  # empty: no roles were stored for the small run




def refused(capsys, statement, *store_args):
    """Run `headgraph cypher STATEMENT`; assert one line, exit 2, nothing on stdout; return all output."""
    code, out, err = run_cli(["cypher", statement, *store_args], capsys)
    assert (code, out) == (ReadOnlyViolation.exit_code, ""), (code, out, err)
    assert err.startswith("error: refused") and err.count("\n") == 1, err
    return out + err


def small_graph():
    pairs, heads = planted_pairs()
    return run_graph(pairs, heads, {"id": SMALL, "model": "ro-model", "processing": "tl", "sweep": SWEEP, "step": 1},
                     SelectionPolicy(20))


def dense_graph():
    """A random 12-layer x 12-head model's every pair of all 16 types (--types all --top-k 0): 152,064 edges."""
    pairs, heads = planted_pairs(n_layers=12, n_heads=12, types=TYPE_PAIRS, boost=0.0)
    return run_graph(pairs, heads, {"id": DENSE, "model": "ro-dense", "processing": "tl"}, SelectionPolicy(None))


@pytest.fixture(scope="module")
def lbdb(tmp_path_factory):
    path = tmp_path_factory.mktemp("readonly") / "graph.lbdb"
    with LadybugStore(path) as store:
        store.store_run(small_graph())
    return str(path)


@pytest.fixture(scope="module")
def neo4j_args(neo4j_config):
    """CLI store arguments for the real server holding this module's small run (removed afterwards)."""
    config = neo4j_config
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NEO4J_PASSWORD", config["password"])
        with open_store(neo4j=config["uri"], user=config["user"], password=config["password"]) as store:
            store.store_run(small_graph())
            yield ["--neo4j", config["uri"], "--neo4j-user", config["user"]]
            store.delete_run(SMALL)


@pytest.fixture(params=["ladybug", pytest.param("neo4j", marks=pytest.mark.neo4j)])
def store(request, lbdb):
    """The small run's store, opened read-only the way `headgraph cypher` opens it."""
    if request.param == "ladybug":
        opened = LadybugStore(lbdb, read_only=True)
    else:
        request.getfixturevalue("neo4j_args")
        config = request.getfixturevalue("neo4j_config")
        opened = open_store(neo4j=config["uri"], user=config["user"], password=config["password"], read_only=True)
    yield opened
    opened.close()


# --- LadybugDB escapes ------------------------------------------------------------------------------------


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret.csv"
    path.write_text(f"{SECRET}a:{SECRET}b\n{SECRET}c:42\n")
    return path


@pytest.mark.parametrize(
    "template",
    [
        "LOAD FROM '/etc/passwd' (file_format='csv', header=false, delim=':') RETURN *",
        "LOAD FROM '{path}' (file_format='csv', header=false, delim=':') RETURN *",
        "MATCH (r:Run) WITH r LIMIT 1 LOAD FROM '{path}' (header=true, delim=':') RETURN *",
        "MATCH (r:Run) WITH r LOAD WITH HEADERS (a STRING, b STRING) FROM '{path}' (delim=':') RETURN a",
        "UNWIND [1] AS x CALL READ_CSV_SERIAL('{path}') RETURN *",
    ],
    ids=["issue-etc-passwd", "load-from", "load-from-mid-query", "load-with-headers", "call-read-csv"],
)
def test_ladybug_does_not_read_a_file(capsys, lbdb, secret_file, template):
    output = refused(capsys, template.format(path=secret_file), "--db", lbdb)
    assert SECRET not in output and "root:" not in output


@pytest.mark.parametrize("exists", [True, False], ids=["overwrite", "create"])
def test_ladybug_copy_to_writes_no_file(capsys, lbdb, tmp_path, exists):
    victim = tmp_path / "victim.csv"
    if exists:
        victim.write_text("original\n")
    refused(capsys, f"COPY (RETURN 'x' AS x) TO '{victim}'", "--db", lbdb)
    refused(capsys, f"COPY (MATCH (r:Run) RETURN r.id) TO '{victim}'", "--db", lbdb)
    assert victim.read_text() == "original\n" if exists else not victim.exists()


def test_ladybug_export_database_makes_no_folder(capsys, lbdb, tmp_path):
    target = tmp_path / "some" / "dir"
    refused(capsys, f"EXPORT DATABASE '{target}'", "--db", lbdb)
    refused(capsys, f"EXPORT DATABASE '{tmp_path / 'flat'}' (format='csv')", "--db", lbdb)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def evil_extension(tmp_path):
    """(library, marker): a real shared library whose constructor writes `marker` when it is loaded."""
    gcc = shutil.which("gcc")
    assert gcc, "these tests build a shared library and need gcc on PATH"
    marker, source, library = tmp_path / "constructor-ran", tmp_path / "evil.c", tmp_path / "evil.lbug_extension"
    source.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void evil(void) {\n"
        f'    FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n'
        "}\n"
    )
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(library), str(source)], check=True, capture_output=True)
    # control: loading it really runs the constructor (in a throwaway process)
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(library)!r})"], check=True)
    assert marker.read_text() == "ran"
    marker.unlink()
    return library, marker


@pytest.mark.parametrize("template", ["LOAD EXTENSION '{lib}'", "LOAD '{lib}'", "INSTALL '{lib}'"])
def test_ladybug_loads_no_extension(capsys, lbdb, evil_extension, template):
    library, marker = evil_extension
    refused(capsys, template.format(lib=library), "--db", lbdb)
    assert not marker.exists()


@pytest.mark.parametrize(
    "statement",
    [
        "ATTACH '{other}' AS other (dbtype lbug)",
        "IMPORT DATABASE '{folder}'",
        "CALL timeout=0",
        "CALL show_tables() RETURN *",
        "MATCH (r:Run) CALL current_setting('timeout') RETURN *",
        "CHECKPOINT",
        "BEGIN TRANSACTION",
        "CREATE NODE TABLE Evil(id STRING, PRIMARY KEY(id))",
        "MATCH (r:Run) SET r.status = 'loading'",
        "MATCH (r:Run) RETURN r.id; MATCH (r:Run) DETACH DELETE r",
        "EXPLAIN EXPORT DATABASE '{folder}'",
        "PROFILE MATCH (r:Run) RETURN r.id",
    ],
)
def test_ladybug_refuses_every_other_statement_kind(capsys, lbdb, tmp_path, statement):
    refused(capsys, statement.format(other=tmp_path / "other.lbdb", folder=tmp_path / "folder"), "--db", lbdb)
    assert list(tmp_path.iterdir()) == []
    with LadybugStore(lbdb, read_only=True) as store:
        assert store.read("MATCH (r:Run) RETURN r.id, r.status").rows == [[SMALL, "complete"]]


def test_ladybug_plan_check_alone_refuses_reads_of_files(tmp_path, secret_file):
    """The second layer, without the first: LadybugDB's own plans of LOAD FROM and COPY TO are refused."""
    connection = ladybug.Connection(ladybug.Database(str(tmp_path / "plain.lbdb")))
    victim = tmp_path / "victim.csv"

    def plan(statement):
        return connection.execute(f"EXPLAIN {statement}").get_all()[0][0]

    for statement in (f"LOAD FROM '{secret_file}' (header=false, delim=':') RETURN *", f"COPY (RETURN 1 AS x) TO '{victim}'"):
        with pytest.raises(ReadOnlyViolation, match="READ_CSV|COPY_TO"):
            check_ladybug_plan(plan(statement))
    assert not victim.exists()
    check_ladybug_plan(plan("UNWIND [1, 2] AS x RETURN x ORDER BY x LIMIT 1"))


# --- Neo4j escapes ----------------------------------------------------------------------------------------


@pytest.fixture
def http_server():
    """(url, hits): a local HTTP server in a thread that counts the requests it gets."""
    hits = []

    class Counting(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"a,b\n1,2\n")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", hits
    server.shutdown()
    server.server_close()


NEO4J_URL_READS = [
    "LOAD CSV FROM '{url}' AS l RETURN l",
    "MATCH (r:Run) WITH r LIMIT 1 LOAD CSV FROM '{url}' AS l RETURN l",
    "MATCH (r:Run) WITH r LIMIT 1 CALL { LOAD CSV FROM '{url}' AS l RETURN l } RETURN l",
]


@pytest.mark.neo4j
@pytest.mark.parametrize("template", NEO4J_URL_READS, ids=["load-csv", "load-csv-mid-query", "load-csv-in-subquery"])
def test_neo4j_fetches_no_url(capsys, neo4j_args, http_server, template):
    url, hits = http_server
    refused(capsys, template.replace("{url}", url), *neo4j_args)
    assert hits == []


@pytest.mark.neo4j
def test_neo4j_reads_no_file(capsys, neo4j_args):
    output = refused(capsys, "MATCH (r:Run) WITH r LIMIT 1 LOAD CSV FROM 'file:///etc/passwd' AS l RETURN l", *neo4j_args)
    assert "root:" not in output


@pytest.fixture
def held_transaction(neo4j_driver, neo4j_run_id):
    """(tag, transaction): another client's open write transaction, tagged with metadata; it still has to commit."""
    tag = uuid.uuid4().hex
    with neo4j_driver.session(database="neo4j") as session:
        transaction = session.begin_transaction(metadata={"headgraph_test": tag})
        transaction.run("UNWIND [1] AS i CREATE (:ReadonlyProbe {run_id: $run})", run=neo4j_run_id).consume()
        yield tag, transaction
        if transaction.closed():
            return
        transaction.rollback()


@pytest.mark.neo4j
def test_neo4j_terminates_no_other_transaction(capsys, neo4j_args, neo4j_driver, neo4j_run_id, held_transaction):
    # the statement matched `currentQuery STARTS WITH 'UNWIND'`; on a shared server the test kills
    # nothing but its own held transaction if the policy fails, so it is chosen by its metadata instead
    tag, transaction = held_transaction
    (row,), _, _ = neo4j_driver.execute_query(
        "SHOW TRANSACTIONS YIELD transactionId, metaData WHERE metaData.headgraph_test = $tag RETURN transactionId",
        tag=tag, database_="neo4j",
    )  # fmt: skip
    for attack in (
        "SHOW TRANSACTIONS YIELD transactionId AS t, metaData AS m WHERE m.headgraph_test = '{tag}' "
        "TERMINATE TRANSACTIONS t YIELD transactionId AS k, message RETURN k, message",
        "TERMINATE TRANSACTIONS '{id}'",
    ):
        refused(capsys, attack.format(tag=tag, id=row["transactionId"]), *neo4j_args)
    transaction.commit()
    records, _, _ = neo4j_driver.execute_query(
        "MATCH (p:ReadonlyProbe {run_id: $run}) RETURN count(p) AS n", run=neo4j_run_id, database_="neo4j"
    )
    assert records[0]["n"] == 1


@pytest.mark.neo4j
@pytest.mark.parametrize(
    "statement",
    [
        "CALL db.labels()",
        "MATCH (r:Run) WITH r LIMIT 1 CALL db.labels() YIELD label RETURN label",
        "UNWIND [1] AS x CALL (x) { MATCH (r:Run) RETURN r LIMIT 1 } IN TRANSACTIONS RETURN r",
        "MATCH (r:Run) WITH r LIMIT 1 CALL (r) { CREATE (:Evil) } IN TRANSACTIONS",
        "SHOW SETTINGS",
        "SHOW USERS",
        "CREATE USER evil SET PASSWORD 'evil-password'",
        "USE system SHOW USERS",
        "CYPHER runtime=slotted MATCH (r:Run) RETURN r.id",
        "MATCH (r:Run) SET r.status = 'loading'",
        "MATCH (r:Run) FOREACH (x IN [1] | CREATE (:Evil))",
        "MATCH (r:Run) RETURN r.id; MATCH (r:Run) DETACH DELETE r",
    ],
)
def test_neo4j_refuses_procedures_commands_and_writes(capsys, neo4j_args, neo4j_driver, statement):
    refused(capsys, statement, *neo4j_args)
    records, _, _ = neo4j_driver.execute_query(
        "MATCH (r:Run {id: $run}) RETURN r.status AS status", run=SMALL, database_="neo4j"
    )
    assert [r["status"] for r in records] == ["complete"]


@pytest.mark.neo4j
@pytest.mark.parametrize(
    "statement",
    [
        *(t.replace("{url}", "http://127.0.0.1:9/") for t in NEO4J_URL_READS),
        "SHOW TRANSACTIONS YIELD transactionId AS t TERMINATE TRANSACTIONS t YIELD transactionId AS k RETURN k",
        "CALL db.labels()",
        "UNWIND [1] AS x CALL (x) { MATCH (r:Run) RETURN r LIMIT 1 } IN TRANSACTIONS RETURN r",
        "SHOW USERS",
    ],
)
def test_neo4j_plan_check_alone_refuses_them(neo4j_driver, statement):
    """The second layer, without the first: Neo4j's own plans (EXPLAIN runs nothing) are refused."""
    with neo4j_driver.session(database="neo4j", default_access_mode=neo4j.READ_ACCESS) as session:
        summary = session.run(f"EXPLAIN {statement}").consume()
    with pytest.raises(ReadOnlyViolation):
        check_neo4j_plan(summary.query_type, summary.plan)


# --- what still runs --------------------------------------------------------------------------------------

ORDINARY_READS = [
    ("MATCH (h:Head) WHERE h.run_id = $run RETURN count(h) AS n", [[24]]),
    ("MATCH (h:Head) WHERE h.run_id = $run RETURN h.layer AS l, count(*) AS n ORDER BY l LIMIT 2", [[0, 4], [1, 4]]),
    ("MATCH (h:Head) WHERE h.run_id = $run RETURN min(h.layer), max(h.layer), sum(h.layer), sum(h.head)", [[0, 5, 60, 36]]),
    ("MATCH (h:Head) WHERE h.run_id = $run RETURN h.name ORDER BY h.layer DESC, h.head DESC SKIP 1 LIMIT 1", [["L5H2"]]),
    ("UNWIND [3, 1, 2] AS x WITH x WHERE x > 1 RETURN x ORDER BY x", [[2], [3]]),
    ("MATCH (h:Head {name: $hub}) WHERE h.run_id = $run OPTIONAL MATCH (h)-[r:OO]->(:Head) RETURN count(r)", [[0]]),
    ("MATCH (h:Head) WHERE h.run_id = $run AND EXISTS { MATCH (h)-[:OV]->(:Head {name: $hub}) } RETURN count(h)", [[8]]),
    ("MATCH (h:Head) WHERE h.run_id = $run AND COUNT { MATCH (h)-[:OK]->(:Head) } > 3 RETURN h.name", [[HUB]]),
    ("MATCH (a:Head {name: 'L0H0'})-[*1..2]->(b:Head {name: $hub}) WHERE a.run_id = $run RETURN count(*) > 0", [[True]]),
    ("MATCH (r:Run {id: $run}) RETURN r.id UNION MATCH (r:Run {id: $run}) RETURN r.id", [[SMALL]]),
    ("// a comment naming LOAD and CALL\nMATCH (r:Run {id: $run}) /* COPY */ RETURN 'LOAD CALL' AS s;", [["LOAD CALL"]]),
    ("MATCH (call:Run {id: $run}) RETURN call.id", [[SMALL]]),
]


@pytest.mark.parametrize("statement, expected", ORDINARY_READS)
def test_ordinary_reads_still_run(store, statement, expected):
    assert store.read(statement, {"run": SMALL, "hub": HUB}).rows == expected


@pytest.mark.parametrize("name", query_names())
def test_every_named_query_still_runs(store, name):
    declared = {p.name for p in load_query(name).params}
    scope = {"run": SMALL} if "run" in declared else {"sweep": SWEEP} if "sweep" in declared else {}
    rows = run_named(store, name, {**scope, **NAMED_PARAMS.get(name, {})})
    assert rows.rows or name in ROLELESS


# --- bounds -----------------------------------------------------------------------------------------------


# A child's peak RSS counts what it held before exec, i.e. a copy of the forking process: so the command is
# started by a small wrapper process, which reports the command's own peak RSS (KiB) into a file.
MEASURE = """import os, subprocess, sys
process = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(process.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(args, tmp_path, env=None):
    """(exit code, stdout, stderr, peak RSS in bytes) of `python -m headgraph ARGS` in its own process."""
    out, err, peak = tmp_path / "stdout", tmp_path / "stderr", tmp_path / "peak-kib"
    command = [sys.executable, "-c", MEASURE, str(peak), sys.executable, "-m", "headgraph", *args]
    with open(out, "w") as stdout, open(err, "w") as stderr:
        code = subprocess.run(command, stdout=stdout, stderr=stderr, env={**os.environ, **(env or {})}).returncode
    return code, out.read_text(), err.read_text(), int(peak.read_text()) * 1024


PATHS = ["query", "paths", "--param", "source=L0", "--param", "target=L11"]


def assert_bounded(code, out, err):
    """Either an answer, or one line naming the bound that was hit and how to narrow the query."""
    if code == 0:
        assert out.strip() and err == ""
    else:
        assert code == 2 and out == "" and err.count("\n") == 1, (code, out, err)
        assert ("memory" in err or "limit of a read" in err) and "narrow it" in err, err


@pytest.mark.slow
def test_paths_on_a_dense_embedded_run_stays_under_1_gb(tmp_path):
    path = tmp_path / "dense.lbdb"
    with LadybugStore(path) as store:
        store.store_run(dense_graph())
    code, out, err, peak = run_measured([*PATHS, "--db", str(path)], tmp_path)
    assert peak < 2**30, f"peak RSS {peak / 2**20:.0f} MiB"
    assert_bounded(code, out, err)


def assert_held(code, out, err):
    """One line naming what a read may add to the process, exit 2, nothing printed."""
    assert (code, out) == (2, "") and err.count("\n") == 1, (code, out[:200], err[-2000:])
    assert f"more memory than the {READ_MEMORY >> 20} MiB a read may add to this process" in err and "narrow it" in err


@pytest.mark.parametrize(
    "statement",
    [
        "RETURN size(lpad('x', 1500000000, 'y'))",  # unbounded: 2.1 GB, until the buffer pool refused the string
        "RETURN size(range(1, 400000000))",  # unbounded: 4.2 GB, and the answer after 18 s
        "RETURN size(list_transform(range(1, 100000000), x -> x * 2))",  # unbounded: 2.1 GB, and the answer
        "UNWIND range(1, 200) AS i RETURN range(1, 100000) AS r",  # the rows made in Python: unbounded 1.4 GB
    ],
    ids=["lpad", "range", "list-function", "result-rows"],
)
@pytest.mark.slow
def test_an_embedded_read_cannot_grow_the_process_past_its_bound(tmp_path, lbdb, statement):
    code, out, err, peak = run_measured(["cypher", statement, "--db", lbdb, "--format", "csv"], tmp_path)
    assert_held(code, out, err)
    assert peak < 2**30, f"peak RSS {peak / 2**20:.0f} MiB"  # the command's start (~0.2 GB) + READ_MEMORY + pool use


@pytest.mark.neo4j
@pytest.mark.slow
def test_a_neo4j_read_is_held_to_the_bound_without_aborting(tmp_path, neo4j_config):
    """A 256 MiB string, which the server builds past its transaction limit: unbounded the client printed it at a
    2.3 GB peak; under RLIMIT_DATA while the driver decodes it, its Rust decoder aborted the process (SIGABRT).
    The check after the record lets the process hold it once (inbox, decoder, str), then stops with one line."""
    config = neo4j_config
    statement = "RETURN reduce(s = 'x', i IN range(1, 28) | s + s) AS s"
    code, out, err, peak = run_measured(["cypher", statement, "--neo4j", config["uri"], "--neo4j-user",
                                         config["user"], "--format", "csv"], tmp_path,
                                        env={"NEO4J_PASSWORD": config["password"]})
    assert_held(code, out, err)
    assert peak < 1.25 * 2**30, f"peak RSS {peak / 2**20:.0f} MiB"


@pytest.mark.neo4j
@pytest.mark.slow
def test_paths_on_a_dense_neo4j_run_fails_cleanly_or_answers(tmp_path, neo4j_config):
    config = neo4j_config
    with open_store(neo4j=config["uri"], user=config["user"], password=config["password"]) as store:
        store.store_run(dense_graph())
        try:
            done = headgraph(*PATHS, "--run", DENSE, "--neo4j", config["uri"], "--neo4j-user", config["user"],
                             env={"NEO4J_PASSWORD": config["password"], "HEADGRAPH_QUERY_TIMEOUT": "2"})
        finally:
            store.delete_run(DENSE)
    assert_bounded(done.returncode, done.stdout, done.stderr)


def test_a_bad_query_timeout_is_named(capsys, lbdb, monkeypatch):
    monkeypatch.setenv("HEADGRAPH_QUERY_TIMEOUT", "soon")
    code, _, err = run_cli(["cypher", "RETURN 1", "--db", lbdb], capsys)
    assert code == 2 and "HEADGRAPH_QUERY_TIMEOUT" in err and "'soon'" in err and err.count("\n") == 1


def test_a_query_past_the_timeout_stops_with_one_line(capsys, lbdb, monkeypatch):
    monkeypatch.setenv("HEADGRAPH_QUERY_TIMEOUT", "0.5")
    slow = "UNWIND range(1, 100000) AS a UNWIND range(1, 30000) AS b WITH a * b AS p WHERE p % 7 = 3 RETURN count(*)"
    code, out, err = run_cli(["cypher", slow, "--db", lbdb], capsys)
    assert (code, out) == (2, "") and "0.5 s limit of a read" in err and err.count("\n") == 1, err
