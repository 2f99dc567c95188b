"""The real Neo4j server: Bolt round trip, and the local server script (scripts/neo4j-local) that runs it."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from neo4j.exceptions import AuthError

from headgraph.errors import StoreUnavailable
from headgraph.neo4j_local import LocalServer, assemble, server_version, start, status

pytestmark = pytest.mark.neo4j
REPO = Path(__file__).resolve().parents[1]


def test_a_node_written_through_bolt_reads_back(neo4j_driver, neo4j_run_id):
    key = f"{neo4j_run_id}/L4H7"
    neo4j_driver.execute_query(
        "CREATE (:Head {key: $key, name: 'L4H7', layer: 4, head: 7, run_id: $run, pk: 0.8125})",
        key=key, run=neo4j_run_id, database_="neo4j",
    )  # fmt: skip
    with neo4j_driver.session(database="neo4j", default_access_mode="READ") as session:
        rows = session.execute_read(
            lambda tx: tx.run("MATCH (h:Head {run_id: $run}) RETURN h.key AS key, h.layer AS layer, h.pk AS pk",
                              run=neo4j_run_id).data()
        )
    assert rows == [{"key": key, "layer": 4, "pk": 0.8125}]


def _listening_addresses(port: int) -> set[str]:
    """Hex local addresses of TCP sockets in LISTEN state on `port`, from /proc/net/tcp and tcp6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def test_the_local_neo4j_listens_on_loopback_only(local_neo4j):
    for port in (local_neo4j.bolt_port, local_neo4j.http_port, local_neo4j.assets_port):
        addresses = _listening_addresses(port)
        assert addresses, f"nothing listens on port {port}"
        assert addresses <= LOOPBACK, f"port {port} listens on {addresses}"


def test_status_reports_a_live_neo4j_5_26_process(local_neo4j):
    running = status(local_neo4j)
    assert running.version.startswith("Neo4j/5.26.")
    cmdline = Path(f"/proc/{running.pid}/cmdline").read_bytes().split(b"\0")
    assert b"org.neo4j.server.CommunityEntryPoint" in cmdline
    assert f"--home-dir={local_neo4j.home}".encode() in cmdline


def test_start_when_running_is_a_no_op_that_exports_the_uri(local_neo4j):
    before = status(local_neo4j).pid
    shell = f'eval "$({REPO}/scripts/neo4j-local start --print-env)" && echo "$NEO4J_URI $NEO4J_USER"'
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{local_neo4j.uri} neo4j"
    assert "already running" in done.stderr
    assert status(local_neo4j).pid == before


def test_the_cli_status_names_uri_pid_and_version(local_neo4j):
    done = subprocess.run([sys.executable, "-m", "headgraph", "neo4j", "status"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    fields = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert fields["uri"] == local_neo4j.uri
    assert int(fields["pid"]) == status(local_neo4j).pid
    assert fields["version"].startswith("Neo4j/5.26.")


def test_a_wrong_password_is_refused_and_reported_in_one_line(local_neo4j):
    wrong = LocalServer(local_neo4j.home, local_neo4j.bolt_port, local_neo4j.http_port,
                        local_neo4j.assets_port, password="not-the-password")  # fmt: skip
    with pytest.raises(AuthError):
        server_version(wrong)
    with pytest.raises(StoreUnavailable, match="NEO4J_PASSWORD") as caught:
        status(wrong)
    assert "\n" not in str(caught.value)
    assert server_version(local_neo4j).startswith("Neo4j/")  # a good login clears the failed-attempt counter


def test_an_assembled_home_is_reused_without_maven(local_neo4j, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no mvn (nor anything else) on PATH
    recorded = json.loads((local_neo4j.home / "assembled.json").read_text())["neo4j"]
    assert assemble(local_neo4j) == recorded
    assert (local_neo4j.lib / f"neo4j-{recorded}.jar").is_file()


def _fake_assembled_home(home: Path) -> None:
    (home / "lib").mkdir(parents=True)
    for folder in ("conf", "data", "logs", "run"):
        (home / folder).mkdir()
    (home / "assembled.json").write_text('{"neo4j": "5.26.0"}')


def test_a_taken_port_is_a_one_line_error(tmp_path):
    _fake_assembled_home(tmp_path / "home")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        server = LocalServer(tmp_path / "home", bolt_port=port, http_port=port + 1, assets_port=port + 2)
        with pytest.raises(StoreUnavailable, match=f"port {port} on 127.0.0.1 is used by another process"):
            start(server, log=lambda message: None)


def test_a_home_without_jars_fails_clearly_and_leaves_nothing_running(tmp_path):
    _fake_assembled_home(tmp_path / "home")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    server = LocalServer(tmp_path / "home", bolt_port=free, http_port=free, assets_port=free)
    with pytest.raises(StoreUnavailable, match="initial Neo4j password failed"):
        start(server, log=lambda message: None)
    assert status(server) is None
