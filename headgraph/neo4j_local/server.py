"""A throw-away, loopback-only Neo4j 5.26 Community server assembled from Maven Central jars (no Docker).

    headgraph neo4j assemble|start|stop|status     (scripts/neo4j-local is a wrapper)

The home lives outside the repository (default ~/.cache/headgraph/neo4j-5.26, env HEADGRAPH_NEO4J_HOME) and
is assembled once from the jars pinned in headgraph/data/neo4j-5.26.lock (coordinates + SHA-1), fetched in
parallel from Maven Central or copied from ~/.m2; later starts reuse it. `assemble --resolve` re-resolves the
jars with a throw-away pom and `mvn dependency:list` and rewrites the lock. The server listens on 127.0.0.1
only, with auth enabled and the initial password NEO4J_PASSWORD (default `headgraph`, meant only for this
local test server) set before its first start.
Neo4j Browser is served at http://127.0.0.1:7474/browser/; a tiny loopback HTTP server next to it serves
headgraph's Browser style and guide, which Browser applies on connect (`browser.post_connect_cmd`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import neo4j
from neo4j.exceptions import AuthError, DriverError, Neo4jError
from rich.console import Console
from rich.progress import Progress, TextColumn

from headgraph.errors import StoreUnavailable, UsageError

NEO4J_VERSIONS = "[5.26.0,5.27.0)"  # the 5.26 LTS line, newest patch that resolves; runs on Java 17 and 21
BROWSER_VERSION = "5.24.0"  # newest org.neo4j.client:neo4j-browser on Maven Central
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.6.1"
ENTRY_POINT = "org.neo4j.server.CommunityEntryPoint"
ADMIN_TOOL = "org.neo4j.cli.AdminTool"
JVM_FLAGS = (
    "-Xms512m",
    "-Xmx1g",
    "-XX:-OmitStackTraceInFastThrow",
    "-XX:+DisableExplicitGC",
    "-Djdk.nio.maxCachedBufferSize=1024",
    "-Dio.netty.tryReflectionSetAccessible=true",
    "-Dlog4j2.disable.jmx=true",
    "--add-opens=java.base/java.nio=ALL-UNNAMED",
    "--add-opens=java.base/java.io=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
    "--enable-native-access=ALL-UNNAMED",
)
# the collector and JIT of a server started to stay up, and of a short-lived one (a test run): there C2's
# compilations and G1's threads are mostly overhead; the suite's Neo4j tests on the 2-core CI VM (fresh server,
# 2026-12-04) cost the server 109 CPU-s with the first, 78 with the second, and ran 136 s against 110 s
LONG_LIVED_FLAGS = ("-XX:+UseG1GC",)
SHORT_LIVED_FLAGS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")
# Bolt's shutdown waits twice for idle threads and connections (5 s each); a short-lived server skips both waits
# (its databases are still checkpointed first): it stops in 0.4 s instead of 10 s
SHORT_LIVED_SETTINGS = ("internal.dbms.bolt.netty_server_shutdown_quiet_period=0",
                        "internal.server.bolt.thread_pool_shutdown_wait_time=0s")
PAGE_CACHE = "512m"
# db.memory.transaction.max: a runaway read fails on its own instead of filling the 717 MiB pool that all
# transactions share; a load batch of 5,000 edges holds ~10 MiB of transaction state (~1.8 KiB per edge)
TRANSACTION_MEMORY = "256m"
MIN_PASSWORD_LENGTH = 8  # Neo4j's dbms.security.auth_minimum_password_length default
POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.headgraph</groupId>
  <artifactId>neo4j-local-home</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.neo4j</groupId><artifactId>neo4j</artifactId><version>{neo4j}</version></dependency>
    <dependency>
      <groupId>org.neo4j.client</groupId><artifactId>neo4j-browser</artifactId><version>{browser}</version>
    </dependency>
  </dependencies>
</project>
"""
LOCK_FILE = Path(__file__).parents[1] / "data" / "neo4j-5.26.lock"
MAVEN_CENTRAL = "https://repo.maven.apache.org/maven2/"
FETCH_WORKERS = 16
FETCH_ATTEMPTS = 3
_LOCK_LINE = re.compile(r"([\w.-]+):([\w.-]+):([\w.+-]+)(?::([\w.-]+))? ([0-9a-f]{40})")
# `mvn dependency:list -DoutputAbsoluteArtifactFilename=true`: group:artifact:jar[:classifier]:version:scope:path
_LISTED_JAR = re.compile(
    r"\s*([\w.-]+):([\w.-]+):jar(?::([\w.-]+))?:([\w.+-]+):(?:compile|runtime):(/\S+\.jar)(?:\s|$)"
)


@dataclass(frozen=True)
class LockedJar:
    """One runtime jar of the local server: its Maven coordinates and the SHA-1 its bytes must have."""

    group: str
    artifact: str
    version: str
    classifier: str | None
    sha1: str

    @property
    def coordinates(self) -> str:
        return ":".join(part for part in (self.group, self.artifact, self.version, self.classifier) if part)

    @property
    def file_name(self) -> str:
        """The name in lib/, as `mvn dependency:copy-dependencies` writes it."""
        return f"{self.artifact}-{self.version}{'-' + self.classifier if self.classifier else ''}.jar"

    @property
    def repository_path(self) -> str:
        """The path in a Maven repository (remote or ~/.m2/repository)."""
        return f"{self.group.replace('.', '/')}/{self.artifact}/{self.version}/{self.file_name}"


@dataclass(frozen=True)
class JarSources:
    """Where jars come from: a local Maven repository when it holds the pinned bytes, else a remote repository.

    From the environment: HEADGRAPH_MAVEN_REPOSITORY (default Maven Central), HEADGRAPH_MAVEN_LOCAL (default
    ~/.m2/repository; set it empty to download everything).
    """

    remote: str = MAVEN_CENTRAL
    local: Path | None = None

    @classmethod
    def from_env(cls) -> JarSources:
        env = os.environ
        remote = env.get("HEADGRAPH_MAVEN_REPOSITORY") or MAVEN_CENTRAL
        local = env.get("HEADGRAPH_MAVEN_LOCAL", str(Path.home() / ".m2" / "repository"))
        return cls(remote.rstrip("/") + "/", Path(local).expanduser() if local else None)


@dataclass(frozen=True)
class LocalServer:
    """Where the local server lives and how it is reached; `from_env()` reads the environment."""

    home: Path
    bolt_port: int = 7687
    http_port: int = 7474
    assets_port: int = 7480
    password: str = "headgraph"
    user: str = "neo4j"

    @classmethod
    def from_env(cls) -> LocalServer:
        env = os.environ
        home = Path(env.get("HEADGRAPH_NEO4J_HOME") or Path.home() / ".cache" / "headgraph" / "neo4j-5.26")
        return cls(
            home=home.expanduser().resolve(),
            bolt_port=_port(env, "HEADGRAPH_NEO4J_BOLT_PORT", 7687),
            http_port=_port(env, "HEADGRAPH_NEO4J_HTTP_PORT", 7474),
            assets_port=_port(env, "HEADGRAPH_BROWSER_ASSETS_PORT", 7480),
            password=env.get("NEO4J_PASSWORD") or "headgraph",
        )

    @property
    def uri(self) -> str:
        return f"bolt://127.0.0.1:{self.bolt_port}"

    @property
    def browser_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/browser/"

    @property
    def assets_url(self) -> str:
        return f"http://127.0.0.1:{self.assets_port}"

    @property
    def lib(self) -> Path:
        return self.home / "lib"

    @property
    def pid_file(self) -> Path:
        return self.home / "run" / "headgraph-neo4j.pid"

    @property
    def assets_pid_file(self) -> Path:
        return self.home / "run" / "browser-assets.pid"

    @property
    def log_file(self) -> Path:
        return self.home / "logs" / "neo4j.log"

    @property
    def console_log(self) -> Path:
        return self.home / "logs" / "console.log"


@dataclass(frozen=True)
class ServerStatus:
    """A running local server: its process id and the version it reports over Bolt."""

    pid: int
    version: str


def _port(env, name: str, default: int) -> int:
    text = env.get(name) or str(default)
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise UsageError(f"{name} must be a TCP port number (got {text!r})")
    return int(text)


def assembled_version(server: LocalServer) -> str | None:
    """The Neo4j version of an assembled home, or None when the home is not (completely) assembled."""
    marker = server.home / "assembled.json"
    if not marker.is_file() or not server.lib.is_dir():
        return None
    return json.loads(marker.read_text())["neo4j"]


def read_lock(lock: Path = LOCK_FILE) -> list[LockedJar]:
    """The jars pinned by a lock file: one `group:artifact:version[:classifier] sha1` line each."""
    redo = "regenerate it with: scripts/neo4j-local assemble --resolve"
    if not lock.is_file():
        raise StoreUnavailable(f"the Neo4j lock file {lock} is missing; {redo}")
    jars = []
    for number, line in enumerate(lock.read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _LOCK_LINE.fullmatch(line.strip())
        if match is None:
            raise StoreUnavailable(
                f"line {number} of {lock} is not `group:artifact:version[:classifier] sha1` ({line.strip()!r}); {redo}"
            )
        jars.append(LockedJar(*match.groups()))
    names = [jar.file_name for jar in jars]
    if len(set(names)) != len(names) or not jars:
        raise StoreUnavailable(f"{lock} pins no jars or two jars with one file name; {redo}")
    return jars


def write_lock(lock: Path, jars: list[LockedJar]) -> None:
    """Write `jars` as a lock file (sorted by coordinates), replacing `lock` atomically."""
    lines = [
        "# Runtime jars of the local Neo4j (headgraph.neo4j_local.server): group:artifact:version[:classifier] sha1",
        f"# Neo4j {NEO4J_VERSIONS} + neo4j-browser {BROWSER_VERSION}; "
        "regenerate: scripts/neo4j-local assemble --resolve",
        *sorted(f"{jar.coordinates} {jar.sha1}" for jar in jars),
    ]
    _write_atomically(lock, "\n".join(lines) + "\n")


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def resolve_lock(lock: Path = LOCK_FILE) -> list[LockedJar]:
    """Resolve the newest Neo4j 5.26 + Browser with Maven and pin their runtime jars in `lock`.

    Slow on an empty ~/.m2 (Maven fetches some 1,900 POMs one at a time); the jars' SHA-1s are computed from
    the files Maven resolved.
    """
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StoreUnavailable("Maven (mvn) is needed to resolve the Neo4j jars; install it (apt-get install maven)")
    with tempfile.TemporaryDirectory(prefix="headgraph-neo4j-resolve-") as build:
        pom, listing = Path(build) / "pom.xml", Path(build) / "runtime-jars.txt"
        pom.write_text(POM.format(neo4j=NEO4J_VERSIONS, browser=BROWSER_VERSION))
        command = [
            mvn, "-q", "-B", "-f", str(pom), f"{DEPENDENCY_PLUGIN}:list", "-DincludeScope=runtime",
            "-DexcludeTypes=pom", "-DoutputAbsoluteArtifactFilename=true", f"-DoutputFile={listing}",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
            raise StoreUnavailable(f"resolving Neo4j with Maven failed ({last[0]}); check access to Maven Central")
        listed = [m.groups() for line in listing.read_text().splitlines() if (m := _LISTED_JAR.match(line))]
    jars = [LockedJar(group, artifact, version, classifier, _sha1_of(Path(path)))
            for group, artifact, classifier, version, path in listed]  # fmt: skip
    write_lock(lock, jars)
    return jars


def _sha1_of(path: Path) -> str:
    digest = hashlib.sha1()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _copy_hashed(source, destination: Path) -> str:
    """Copy a binary stream into `destination`; return the SHA-1 of the bytes copied."""
    digest = hashlib.sha1()
    with open(destination, "wb") as out:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def _fetch_jar(jar: LockedJar, folder: Path, sources: JarSources) -> int:
    """Put `jar` into `folder`, from the local Maven repository when it holds the pinned bytes, else downloaded;
    return the number of bytes downloaded. Bytes that do not match the pinned SHA-1 are refused."""
    destination = folder / jar.file_name
    if sources.local is not None and (copy := sources.local / jar.repository_path).is_file():
        with open(copy, "rb") as stream:
            if _copy_hashed(stream, destination) == jar.sha1:
                return 0
    url = sources.remote + jar.repository_path
    for attempt in range(FETCH_ATTEMPTS):
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                sha1 = _copy_hashed(response, destination)
            break
        except OSError as error:  # URLError, HTTPError, timeouts, resets
            client_error = isinstance(error, urllib.error.HTTPError) and error.code < 500
            if client_error or attempt == FETCH_ATTEMPTS - 1:
                reason = getattr(error, "reason", None) or error
                raise StoreUnavailable(
                    f"downloading {jar.coordinates} from {url} failed ({reason}); check access to "
                    f"{urllib.parse.urlsplit(sources.remote).netloc} or set HEADGRAPH_MAVEN_REPOSITORY to a mirror"
                ) from None
            time.sleep(1.0 + attempt)
    if sha1 != jar.sha1:
        raise StoreUnavailable(
            f"refusing {url}: its SHA-1 is {sha1} but the lock pins {jar.coordinates} to {jar.sha1}; "
            "check HEADGRAPH_MAVEN_REPOSITORY or regenerate the lock: scripts/neo4j-local assemble --resolve"
        )
    return destination.stat().st_size


def fetch_jars(jars: list[LockedJar], folder: Path, sources: JarSources, workers: int = FETCH_WORKERS) -> int:
    """Fetch all `jars` into `folder` in parallel (SHA-1 checked); return the number of bytes downloaded."""
    columns = (*Progress.get_default_columns(), TextColumn("{task.fields[mb]:.1f} MB downloaded"))
    downloaded = 0
    with Progress(*columns, console=Console(stderr=True)) as progress, ThreadPoolExecutor(workers) as pool:
        task = progress.add_task("Neo4j jars", total=len(jars), mb=0.0)
        pending = [pool.submit(_fetch_jar, jar, folder, sources) for jar in jars]
        try:
            for done in as_completed(pending):
                downloaded += done.result()
                progress.update(task, advance=1, mb=downloaded / 1e6)
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return downloaded


def locked_server_version(jars: list[LockedJar], lock: Path) -> str:
    server_jar = next((jar for jar in jars if (jar.group, jar.artifact) == ("org.neo4j", "neo4j")), None)
    if server_jar is None or not server_jar.version.startswith("5.26."):
        raise StoreUnavailable(
            f"{lock} pins no org.neo4j:neo4j 5.26.x server jar; regenerate it: scripts/neo4j-local assemble --resolve"
        )
    return server_jar.version


def _remove_abandoned_staging(home: Path) -> None:
    """Remove lib staging folders left by assemblies that were killed (their process is gone)."""
    for folder in home.glob(".lib-partial-*"):
        pid = folder.name.rsplit("-", 1)[-1]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(folder, ignore_errors=True)


def assemble(server: LocalServer, lock: Path = LOCK_FILE, sources: JarSources | None = None) -> str:
    """Assemble the home once from the lock file's jars; return the Neo4j version in it.

    The jars are staged in a folder of their own and renamed to lib/ only when all are there and verified;
    `assembled.json` is written last, so an interrupted assembly is simply redone on the next call.
    """
    version = assembled_version(server)
    if version:
        return version
    jars = read_lock(lock)
    version = locked_server_version(jars, lock)
    server.home.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_staging(server.home)
    staging = server.home / f".lib-partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        fetch_jars(jars, staging, sources or JarSources.from_env())
        shutil.rmtree(server.lib, ignore_errors=True)
        staging.rename(server.lib)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for folder in ("conf", "data", "logs", "run", "plugins", "import"):
        (server.home / folder).mkdir(exist_ok=True)
    marker = {"neo4j": version, "browser": BROWSER_VERSION, "jars": len(jars), "lock_sha1": _sha1_of(lock)}
    _write_atomically(server.home / "assembled.json", json.dumps(marker, indent=2) + "\n")
    return version


def neo4j_conf(server: LocalServer, short_lived: bool = False) -> str:
    """The neo4j.conf text: loopback only, auth on, modest memory, no usage reports, Browser extras; a
    short-lived server (see `start`) also stops without Bolt's graceful waits (SHORT_LIVED_SETTINGS)."""
    home = server.home
    assets = server.assets_url
    lines = [
        "# Written by headgraph.neo4j_local.server on every start; change the code or the environment, not this file.",
        "server.default_listen_address=127.0.0.1",
        "server.default_advertised_address=127.0.0.1",
        f"server.bolt.listen_address=127.0.0.1:{server.bolt_port}",
        f"server.http.listen_address=127.0.0.1:{server.http_port}",
        "server.https.enabled=false",
        "dbms.security.auth_enabled=true",
        "dbms.usage_report.enabled=false",
        "client.allow_telemetry=false",
        f"server.memory.pagecache.size={PAGE_CACHE}",
        f"db.memory.transaction.max={TRANSACTION_MEMORY}",
        *(f"server.directories.{d}={home / d}" for d in ("data", "logs", "run", "plugins", "import")),
        f"browser.post_connect_cmd=style {assets}/style.grass; play {assets}/guide.html",
        "browser.remote_content_hostname_whitelist=127.0.0.1,localhost",
        *(SHORT_LIVED_SETTINGS if short_lived else ()),
    ]
    return "\n".join(lines) + "\n"


def _java_env(server: LocalServer) -> dict[str, str]:
    return {**os.environ, "NEO4J_HOME": str(server.home), "NEO4J_CONF": str(server.home / "conf")}


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise StoreUnavailable("Java 17 or 21 is needed to run the local Neo4j; install a JDK or set JAVA_HOME")
    return java


def set_initial_password(server: LocalServer) -> None:
    """Store the initial password of user neo4j; only effective before the server's first start."""
    if len(server.password) < MIN_PASSWORD_LENGTH:
        raise UsageError(f"NEO4J_PASSWORD must have at least {MIN_PASSWORD_LENGTH} characters (Neo4j's minimum)")
    command = [_java(), "-cp", f"{server.lib}/*", ADMIN_TOOL, "dbms", "set-initial-password", server.password]
    done = subprocess.run(command, capture_output=True, text=True, env=_java_env(server), cwd=server.home)
    if done.returncode != 0:
        last = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
        raise StoreUnavailable(f"setting the initial Neo4j password failed: {last[0]}")


def _running_pid(pid_file: Path, marker: str) -> int | None:
    """The pid in `pid_file` when that process is alive and its command line contains `marker`."""
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists() and marker not in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
        return None
    return pid


def server_pid(server: LocalServer) -> int | None:
    return _running_pid(server.pid_file, f"--home-dir={server.home}")


def server_version(server: LocalServer, timeout: float = 5.0) -> str:
    """Connect over Bolt with the configured password and return the server's agent, e.g. 'Neo4j/5.26.30'."""
    with neo4j.GraphDatabase.driver(server.uri, auth=(server.user, server.password), connection_timeout=timeout) as d:
        d.verify_connectivity()
        return d.get_server_info().agent


def status(server: LocalServer) -> ServerStatus | None:
    """The running server's pid and version, or None when it is not running."""
    pid = server_pid(server)
    if pid is None:
        return None
    try:
        return ServerStatus(pid, server_version(server))
    except AuthError:
        raise StoreUnavailable(_wrong_password(server)) from None
    except (DriverError, Neo4jError, OSError):
        return ServerStatus(pid, "not answering on Bolt yet")


def _wrong_password(server: LocalServer) -> str:
    return (
        f"the local Neo4j in {server.home} was initialised with another password: set NEO4J_PASSWORD to it, "
        f"or stop it and delete {server.home / 'data'} to start over"
    )


def _log_tail(server: LocalServer, lines: int = 15) -> str:
    text = "".join(p.read_text(errors="replace") for p in (server.console_log, server.log_file) if p.exists())
    return "\n".join(text.strip().splitlines()[-lines:])


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_assets_server(server: LocalServer) -> int:
    """Serve headgraph/browser/ (style.grass, guide.html) on the loopback assets port; return its pid."""
    pid = _running_pid(server.assets_pid_file, "headgraph.neo4j_local.browser.assets_server")
    if pid is not None:
        return pid
    if _port_taken(server.assets_port):
        raise StoreUnavailable(
            f"port {server.assets_port} on 127.0.0.1 is taken; set HEADGRAPH_BROWSER_ASSETS_PORT to a free port"
        )
    command = [sys.executable, "-m", "headgraph.neo4j_local.browser.assets_server", "--port", str(server.assets_port)]
    with open(server.home / "logs" / "browser-assets.log", "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    server.assets_pid_file.write_text(f"{process.pid}\n")
    return process.pid


def server_command(server: LocalServer, short_lived: bool = False) -> list[str]:
    """The java command line of the server (see `start` for short_lived)."""
    return [
        _java(), *JVM_FLAGS, *(SHORT_LIVED_FLAGS if short_lived else LONG_LIVED_FLAGS),
        "-cp", f"{server.home}/conf/*:{server.home}/plugins/*:{server.lib}/*", ENTRY_POINT,
        f"--home-dir={server.home}", f"--config-dir={server.home / 'conf'}",
    ]  # fmt: skip


def start(server: LocalServer, timeout: float = 180.0, log=print, short_lived: bool = False) -> ServerStatus:
    """Assemble if needed, start the server in the background, wait until Bolt accepts the password and HTTP answers.

    A server that is already running is left alone (its URI is reported). short_lived: the JVM's quick JIT
    (C1 only) and serial collector, for a server stopped after a brief workload such as a test run: less CPU
    overall, slower on long heavy queries.
    """
    version = assemble(server)
    running = status(server)
    if running is not None:
        start_assets_server(server)
        log(f"Neo4j already running at {server.uri} (pid {running.pid})")
        return running
    for port, name in ((server.bolt_port, "BOLT"), (server.http_port, "HTTP")):
        if _port_taken(port):
            raise StoreUnavailable(
                f"port {port} on 127.0.0.1 is used by another process; stop it or set HEADGRAPH_NEO4J_{name}_PORT"
            )
    (server.home / "conf" / "neo4j.conf").write_text(neo4j_conf(server, short_lived))
    if not (server.home / "data" / "databases").exists():
        set_initial_password(server)
    start_assets_server(server)
    log(f"starting Neo4j {version} from {server.home} ...")
    command = server_command(server, short_lived)
    with open(server.console_log, "ab") as console:
        process = subprocess.Popen(
            command, stdout=console, stderr=console, stdin=subprocess.DEVNULL, cwd=server.home,
            env=_java_env(server), start_new_session=True,
        )  # fmt: skip
    server.pid_file.write_text(f"{process.pid}\n")
    return _wait_for_bolt(server, process, timeout, log)


def _wait_for_bolt(server: LocalServer, process: subprocess.Popen, timeout: float, log) -> ServerStatus:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if process.poll() is not None:
            server.pid_file.unlink(missing_ok=True)
            raise StoreUnavailable(
                f"Neo4j exited during start-up (code {process.returncode}); log tail:\n{_log_tail(server)}"
            )
        try:
            agent = server_version(server, timeout=2.0)
            urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/", timeout=2.0).close()
        except AuthError:
            raise StoreUnavailable(_wrong_password(server)) from None
        except (DriverError, Neo4jError, OSError):
            time.sleep(0.5)
            continue
        log(f"{agent} up at {server.uri} after {time.monotonic() - began:.1f} s (pid {process.pid})")
        return ServerStatus(process.pid, agent)
    process.terminate()
    raise StoreUnavailable(f"Neo4j did not accept Bolt within {timeout:.0f} s; log tail:\n{_log_tail(server)}")


def _terminate(pid: int, timeout: float) -> bool:
    """SIGTERM, wait up to `timeout` s, then SIGKILL; True when it ended on SIGTERM."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    return False


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ", 1)[-1].startswith("Z"))


def stop(server: LocalServer, timeout: float = 90.0, log=print) -> bool:
    """Stop the server (clean shutdown on SIGTERM, SIGKILL only if it hangs) and the assets server.

    Returns False when the server was not running.
    """
    assets = _running_pid(server.assets_pid_file, "headgraph.neo4j_local.browser.assets_server")
    if assets is not None:
        _terminate(assets, 5.0)
    server.assets_pid_file.unlink(missing_ok=True)
    pid = server_pid(server)
    if pid is None:
        server.pid_file.unlink(missing_ok=True)
        log("Neo4j is not running")
        return False
    began = time.monotonic()
    clean = _terminate(pid, timeout)
    server.pid_file.unlink(missing_ok=True)
    log(f"Neo4j stopped in {time.monotonic() - began:.1f} s" if clean else f"Neo4j hung; killed after {timeout:.0f} s")
    return True


def env_lines(server: LocalServer) -> list[str]:
    """`export` lines a shell can eval to point headgraph and the tests at this server."""
    values = {"NEO4J_URI": server.uri, "NEO4J_USER": server.user, "NEO4J_PASSWORD": server.password}
    return [f"export {k}={shlex.quote(v)}" for k, v in values.items()]


def browser_hint(server: LocalServer) -> list[str]:
    """What to open and run to explore the head graph in Neo4j Browser."""
    return [
        f"Neo4j Browser:  {server.browser_url}",
        f"connect to:     {server.uri}   user {server.user}   password {server.password}",
        f"style + guide:  applied on connect; or run  :style {server.assets_url}/style.grass",
        f"                and  :play {server.assets_url}/guide.html",
    ]
