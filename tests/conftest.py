"""Shared fixtures. Each helper's fixtures live in their own delimited section; add yours below the others (their
imports go in the one block here)."""

import json
import os
import shutil
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from headgraph.testing.planted import PlantedTruth, PlantSpec, save_planted
from headgraph.testing.synthetic import save_synthetic

# ---- Neo4j fixtures (helper "neo4j"): one real server per session, never mocked, never skipped ----
# Where the server comes from, in order: NEO4J_URI (+ NEO4J_USER, default neo4j; NEO4J_PASSWORD, default
# headgraph) -- CI and local runs use `eval "$(scripts/neo4j-local start --print-env)"`; else a testcontainers
# neo4j:5.26-community when a Docker engine answers; else the test fails, naming the script that starts one.
# Tests share the server: keep what you write under a unique run id (fixture `neo4j_run_id`).

NEO4J_TEST_IMAGE = "neo4j:5.26-community"


def _docker_engine_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
    except Exception:  # noqa: BLE001 - any failure means "no usable engine"
        return False
    return True


@pytest.fixture(scope="session")
def neo4j_config():
    """{"uri", "user", "password"} of a real Neo4j server for this test session."""
    env = os.environ
    if env.get("NEO4J_URI"):
        yield {"uri": env["NEO4J_URI"], "user": env.get("NEO4J_USER", "neo4j"),
               "password": env.get("NEO4J_PASSWORD", "headgraph")}
        return
    if _docker_engine_answers():
        try:
            from testcontainers.community.neo4j import Neo4jContainer
        except ImportError:  # testcontainers before the community/ split
            from testcontainers.neo4j import Neo4jContainer
        with Neo4jContainer(NEO4J_TEST_IMAGE, password="headgraph-tests") as container:
            yield {"uri": container.get_connection_url(), "user": "neo4j", "password": container.password}
        return
    pytest.fail(
        "no Neo4j for the tests: NEO4J_URI is unset and no Docker engine answers; start the local server with "
        '`eval "$(scripts/neo4j-local start --print-env)"` and rerun',
        pytrace=False,
    )


@pytest.fixture(scope="session")
def neo4j_driver(neo4j_config):
    """A neo4j.Driver to the session's server, connectivity and credentials verified."""
    import neo4j

    driver = neo4j.GraphDatabase.driver(neo4j_config["uri"], auth=(neo4j_config["user"], neo4j_config["password"]))
    driver.verify_connectivity()
    yield driver
    driver.close()


@pytest.fixture(scope="session")
def local_neo4j():
    """The scripts/neo4j-local server (headgraph.neo4j_local.LocalServer), with Browser and its style/guide server;
    started here, and stopped at the end, only when it was not already running."""
    from headgraph.neo4j_local.server import LocalServer, start, status, stop

    server = LocalServer.from_env()
    was_running = status(server) is not None
    if not was_running:
        start(server, log=lambda message: None, short_lived=True)
    yield server
    if not was_running:
        stop(server, log=lambda message: None)


@pytest.fixture
def neo4j_run_id(neo4j_driver):
    """A unique run id for one test; afterwards every node with that `run_id` (and a Run with that `id`) is removed."""
    run_id = f"test-{uuid.uuid4().hex[:12]}"
    yield run_id
    neo4j_driver.execute_query(
        "MATCH (n) WHERE n.run_id = $run OR (n:Run AND n.id = $run) DETACH DELETE n", run=run_id, database_="neo4j"
    )
# ---- end Neo4j fixtures ----

# ---- built once per session, across the xdist workers ----

def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `name` after `build(folder)` has filled it, once per test session: the xdist workers share one
    folder (beside their own temporary folders), the first to ask builds it under a file lock and the others wait
    for it, then read what it built. Only for what the tests read and never change."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed in another worker
            folder.mkdir()
            build(folder)
            done.touch()
    return folder
# ---- end built once ----

# ---- test order (helper "suite") ----
# scripts/test hands each xdist worker whole modules (--dist loadfile) in this order (--no-loadscope-reorder):
# first every module that takes more than a few seconds, longest first by one worker's seconds in a full run on the
# 2-core CI VM (2026-12-07: 229, 213, 157, 124, 112, 104, 50, 45, 33, 33, 31, 30, 27, 27, 23, 20, 19, 19, 18, 14,
# 13, 12, 12, 10, 10, 9, 9, 9, 8 s), so that the short ones fill the workers' last minutes; then the rest by their
# number of tests, as xdist would order them all. Ordered by number of tests alone, the faults and Ray modules
# started last and ran on past the others by a minute; with only the 14 longest first, one worker still ran on
# 18 s past the others, on two modules of 19 and 9 s.
LONGEST_MODULES = ("test_stream", "test_faults", "test_families", "test_readonly", "test_sweep_ray", "test_sweep",
                   "test_analyze", "test_view", "test_api", "test_user_errors", "test_report", "test_store",
                   "test_export", "test_stream_families", "test_sweep_queries", "test_causal", "test_sweep_trainer",
                   "test_causal_analyze", "test_browser", "test_calibration", "test_stability", "test_reference",
                   "test_workflow", "test_queries", "test_causal_families", "test_pk", "test_figures",
                   "test_sweep_revisions", "test_architecture")


def pytest_collection_modifyitems(config, items):
    tests = Counter(item.path.stem for item in items)
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: (rank.get(item.path.stem, len(rank)), -tests[item.path.stem], item.path.stem))
# ---- end test order ----

# ---- loader fixtures (helper "loader"): tiny synthetic and planted models saved as local HF folders ----

@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory):
    """A random-init GPT-2-architecture folder: 2 layers x 4 heads, d_model 64, d_head 16, n_ctx 128."""
    return save_synthetic(tmp_path_factory.mktemp("synthetic") / "gpt2-tiny", seed=0)


@pytest.fixture(scope="session")
def planted(tmp_path_factory):
    """(folder, truth) of the default planted model: 3 layers x 4 heads, hub L0H2, identity L0H0/L1H3, prev L0H1."""
    return save_planted(tmp_path_factory.mktemp("planted") / "gpt2-planted", PlantSpec())
# ---- end loader fixtures ----

# ---- browser fixtures (helpers "neo4j-browser" and "view"): headless Debian Chromium through Selenium ----

CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1600,1000")  # fmt: skip


@pytest.fixture
def chromium(tmp_path):
    """Headless Debian Chromium through Selenium and /usr/bin/chromedriver (never a downloaded browser)."""
    binary, driver_binary = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver_binary):
        pytest.fail("headless Chromium is missing: apt-get install -y chromium chromium-driver", pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(driver_binary), options=options)
    yield browser
    browser.quit()
# ---- end browser fixtures ----

# ---- PK calibration (helper "pk"): the tests never read or write the user's calibration cache ----

@pytest.fixture(scope="session", autouse=True)
def _pk_calibration_cache(tmp_path_factory):
    """HEADGRAPH_CACHE_DIR points at a session folder (subprocesses inherit it), so kernel rates are measured
    once per session there, not read from or written to ~/.cache/headgraph."""
    previous = os.environ.get("HEADGRAPH_CACHE_DIR")
    os.environ["HEADGRAPH_CACHE_DIR"] = str(tmp_path_factory.mktemp("headgraph-cache"))
    yield
    if previous is None:
        os.environ.pop("HEADGRAPH_CACHE_DIR")
    else:
        os.environ["HEADGRAPH_CACHE_DIR"] = previous
# ---- end PK calibration ----

# ---- family fixtures (helper "families"): one tiny random-init checkpoint of every model family ----

@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """{family: folder} of every family of headgraph.testing.families.FAMILIES, built once per session."""
    from headgraph.testing.families import FAMILIES, save_family

    root = built_once(tmp_path_factory, "families", lambda root: [save_family(name, root / name) for name in FAMILIES])
    return {name: root / name for name in FAMILIES}
# ---- end family fixtures ----

# ---- shared analyses (helper "suite"): the planted model and induction-2l, each analysed once per session ----
# Every test that only reads an analysis's results reads these; a test that needs other settings, or that watches
# an analysis run, keeps its own. Settings: tests/_fast.py.

SHARED_TOP_K = 5  # the selection of both shared analyses: the top 5 per type by PK


@dataclass(frozen=True)
class PlantedAnalysis:
    """`headgraph analyze --json` of the planted model (fixture `planted`) in its own process, every stage (PK,
    roles, causal effects, report) and stored in its own LadybugDB: the planted truth, the run folder, the
    store and the printed summary."""

    truth: PlantedTruth
    folder: Path
    db: Path
    summary: dict
    top_k: int = SHARED_TOP_K


@pytest.fixture(scope="session")
def planted_analysis(planted, tmp_path_factory):
    """The session's one full analysis of the planted model (PlantedAnalysis), shared by the workers."""
    from _commands import headgraph
    from _fast import FLAGS

    from headgraph.testing.planted import TRUTH_FILE

    def analyze(work: Path) -> None:
        model, _ = save_planted(work / "gpt2-planted", PlantSpec())
        done = headgraph("analyze", str(model), "--db", str(work / "graph.lbdb"), "--out", str(work / "run"), "--json",
                         "--top-k", str(SHARED_TOP_K), *FLAGS)
        assert done.returncode == 0, done.stderr
        (work / "summary.json").write_text(done.stdout)

    work = built_once(tmp_path_factory, "planted-analysis", analyze)
    _, truth = planted
    assert json.loads((work / "gpt2-planted" / TRUTH_FILE).read_text()) == json.loads(json.dumps(truth.to_dict()))
    return PlantedAnalysis(truth, work / "run", work / "graph.lbdb", json.loads((work / "summary.json").read_text()))


@pytest.fixture(scope="session")
def induction_run(tmp_path_factory):
    """The session's one full analysis of the shipped induction-2l through the Python API (a headgraph.Run):
    every stage and its report, on the CPU, nothing stored."""
    from _fast import FAST

    import headgraph

    return headgraph.analyze("induction-2l", out=tmp_path_factory.mktemp("induction-analysis") / "run",
                             top_k=SHARED_TOP_K, report=True, device="cpu", progress=False, **FAST)
# ---- end shared analyses ----
