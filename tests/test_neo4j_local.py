"""The real Neo4j server: Bolt round trip, and the local server script (scripts/neo4j-local) that runs it,
including its assembly from the lock file (served here by a loopback HTTP server, never the network)."""

import functools
import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from neo4j.exceptions import AuthError

from headgraph.errors import StoreUnavailable
from headgraph.neo4j_local.server import (
    BROWSER_VERSION,
    LOCK_FILE,
    JarSources,
    LocalServer,
    assemble,
    assembled_version,
    read_lock,
    server_command,
    server_version,
    start,
    status,
)

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


@pytest.mark.parametrize("short_lived", [False, True])
def test_the_jvm_accepts_the_servers_flags_and_a_short_lived_one_gets_the_quick_jit(local_neo4j, short_lived):
    """The JVM itself runs with the flags of each kind of server (one collector each: G1 beside the serial
    collector would be refused); the short-lived server compiles with C1 only."""
    command = server_command(local_neo4j, short_lived)
    flags = command[1:command.index("-cp")]
    assert ("-XX:TieredStopAtLevel=1" in flags) == short_lived
    assert len([f for f in flags if f.endswith("GC") and f.startswith("-XX:+Use")]) == 1
    done = subprocess.run([command[0], *flags, "-XX:+PrintFlagsFinal", "-version"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    final = {line.split()[1]: line.split()[3] for line in done.stdout.splitlines() if line.count("=") == 1}
    assert (final["UseSerialGC"], final["UseG1GC"]) == (("true", "false") if short_lived else ("false", "true"))
    assert final["TieredStopAtLevel"] == ("1" if short_lived else "4")


@pytest.mark.slow
def test_start_when_running_is_a_no_op_that_exports_the_uri(local_neo4j):
    before = status(local_neo4j).pid
    shell = f'eval "$({REPO}/scripts/neo4j-local start --print-env)" && echo "$NEO4J_URI $NEO4J_USER"'
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{local_neo4j.uri} neo4j"
    assert "already running" in done.stderr
    assert status(local_neo4j).pid == before


@pytest.mark.slow
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


def test_the_committed_lock_pins_neo4j_5_26_browser_and_the_linux_native_transport():
    jars = {(jar.group, jar.artifact, jar.classifier): jar for jar in read_lock(LOCK_FILE)}
    assert len(jars) > 150
    assert jars["org.neo4j", "neo4j", None].version.startswith("5.26.")
    assert jars["org.neo4j.client", "neo4j-browser", None].version == BROWSER_VERSION
    assert ("io.netty", "netty-transport-native-epoll", "linux-x86_64") in jars
    assert not {artifact for _, artifact, _ in jars} & {"junit", "junit-jupiter-api", "mockito-core", "assertj-core"}


def test_the_running_home_holds_exactly_the_locked_jars(local_neo4j):
    on_disk = {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in local_neo4j.lib.glob("*.jar")}
    assert on_disk == {jar.file_name: jar.sha1 for jar in read_lock(LOCK_FILE)}


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture
def maven_repository(tmp_path):
    """(folder, url): a folder served as a Maven repository by a loopback HTTP server."""
    root = tmp_path / "remote"
    root.mkdir()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=root))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


SERVER_JAR = ("org/neo4j/neo4j/5.26.99/neo4j-5.26.99.jar", "org.neo4j:neo4j:5.26.99")
NATIVE_JAR = (
    "io/netty/netty-transport-native-epoll/4.1.0.Final/netty-transport-native-epoll-4.1.0.Final-linux-x86_64.jar",
    "io.netty:netty-transport-native-epoll:4.1.0.Final:linux-x86_64",
)


def _plant(root: Path, path: str, content: bytes) -> None:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_bytes(content)


def _lock(tmp_path: Path, pins: dict[str, bytes]) -> Path:
    """A lock file pinning each coordinate to the SHA-1 of the given bytes (hashed here, independently)."""
    lock = tmp_path / "test.lock"
    lines = [f"{coordinates} {hashlib.sha1(content).hexdigest()}" for coordinates, content in pins.items()]
    lock.write_text("# a comment line\n" + "\n".join(lines) + "\n")
    return lock


def test_assembly_downloads_the_locked_jars_into_lib(maven_repository, tmp_path):
    root, url = maven_repository
    server_bytes, native_bytes = os.urandom(50_000), os.urandom(3_000)
    _plant(root, SERVER_JAR[0], server_bytes)
    _plant(root, NATIVE_JAR[0], native_bytes)
    lock = _lock(tmp_path, {SERVER_JAR[1]: server_bytes, NATIVE_JAR[1]: native_bytes})
    server = LocalServer(tmp_path / "home")
    assert assemble(server, lock, JarSources(url, None)) == "5.26.99"
    assert (server.lib / "neo4j-5.26.99.jar").read_bytes() == server_bytes
    assert (server.lib / "netty-transport-native-epoll-4.1.0.Final-linux-x86_64.jar").read_bytes() == native_bytes
    assert assembled_version(server) == "5.26.99"
    assert sorted(p.name for p in server.home.iterdir() if p.name.startswith(".")) == []


def test_a_tampered_sha1_is_refused_in_one_line_and_leaves_no_home(maven_repository, tmp_path):
    root, url = maven_repository
    genuine = os.urandom(20_000)
    _plant(root, SERVER_JAR[0], genuine)
    _plant(root, NATIVE_JAR[0], b"native")
    tampered = bytes([genuine[0] ^ 1]) + genuine[1:]
    lock = _lock(tmp_path, {SERVER_JAR[1]: tampered, NATIVE_JAR[1]: b"native"})
    server = LocalServer(tmp_path / "home")
    with pytest.raises(StoreUnavailable, match=r"refusing .*neo4j-5\.26\.99\.jar: its SHA-1 is") as caught:
        assemble(server, lock, JarSources(url, None))
    assert "\n" not in str(caught.value)
    assert hashlib.sha1(genuine).hexdigest() in str(caught.value)
    assert assembled_version(server) is None
    assert sorted(p.name for p in server.home.iterdir()) == []  # no lib/, no marker, no staging folder


def test_a_good_local_maven_copy_is_used_and_a_corrupt_one_is_downloaded_again(maven_repository, tmp_path):
    root, url = maven_repository
    local = tmp_path / "m2"
    server_bytes, native_bytes = os.urandom(10_000), os.urandom(10_000)
    _plant(local, SERVER_JAR[0], server_bytes)  # only here: the remote would answer 404
    _plant(local, NATIVE_JAR[0], b"truncated")
    _plant(root, NATIVE_JAR[0], native_bytes)
    lock = _lock(tmp_path, {SERVER_JAR[1]: server_bytes, NATIVE_JAR[1]: native_bytes})
    server = LocalServer(tmp_path / "home")
    assert assemble(server, lock, JarSources(url, local)) == "5.26.99"
    assert (server.lib / "neo4j-5.26.99.jar").read_bytes() == server_bytes
    assert (server.lib / "netty-transport-native-epoll-4.1.0.Final-linux-x86_64.jar").read_bytes() == native_bytes


def test_a_jar_missing_from_the_repository_is_a_one_line_error(maven_repository, tmp_path):
    _, url = maven_repository
    lock = _lock(tmp_path, {SERVER_JAR[1]: b"never served"})
    with pytest.raises(StoreUnavailable, match=r"downloading org\.neo4j:neo4j:5\.26\.99 from .* failed") as caught:
        assemble(LocalServer(tmp_path / "home"), lock, JarSources(url, None))
    assert "\n" not in str(caught.value)


def test_a_malformed_lock_line_is_named(tmp_path):
    lock = tmp_path / "bad.lock"
    lock.write_text("org.neo4j:neo4j:5.26.99 " + "0" * 40 + "\norg.neo4j:neo4j-kernel 1234\n")
    with pytest.raises(StoreUnavailable, match=f"line 2 of {lock} is not"):
        read_lock(lock)
