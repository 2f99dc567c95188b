"""Neo4j Browser exploration: the GraSS style, the guide's canned queries, the loopback assets server, and
headless Chromium driving the real Browser against the local server (screenshot in test-artifacts/)."""

import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from html.parser import HTMLParser
from pathlib import Path

import neo4j
import networkx as nx
import pytest

from headgraph.figures import TYPE_COLORS

BROWSER_DIR = Path(__file__).resolve().parents[1] / "headgraph" / "browser"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
HUB = "L0H2"
# The planted run: 3 layers x 4 heads; L0H2 sends five edges, one more edge elsewhere; identity on two heads.
PLANTED_EDGES = [  # (source, target, type, rank within type)
    ("L0H2", "L1H0", "OK", 1), ("L0H2", "L1H1", "OQ", 1), ("L0H2", "L1H2", "OV", 1),
    ("L0H2", "L2H0", "OK", 2), ("L0H2", "L2H3", "OV", 2), ("L1H3", "L2H1", "OK", 7),
]  # fmt: skip
IDENTITY = {"L1H3": 0.9, "L2H2": 0.7}


def grass_rules(text: str) -> dict[str, dict[str, str]]:
    """GraSS text as {selector: {property: value}}, read the way Neo4j Browser 5's parseGrass does: quotes
    protect braces, whitespace outside a body is dropped (so a comment would glue onto the next selector),
    a declaration is kept only when it splits on ':' into exactly two parts."""
    rules, selector, body, in_quotes, in_body = {}, "", "", False, False
    for char in text:
        if char in "'\"":
            in_quotes = not in_quotes
        if char == "{" and not in_quotes:
            in_body = True
        elif char == "}" and not in_quotes:
            rules[selector], selector, body, in_body = body, "", "", False
        elif in_body:
            body += char
        elif not char.isspace():
            selector += char
    parsed = {}
    for name, declarations in rules.items():
        pairs = [d.split(":") for d in declarations.split(";")]
        parsed[name] = {k.strip(): v.strip().strip('"') for k, v in (p for p in pairs if len(p) == 2)}
    return parsed


class _RunnableBlocks(HTMLParser):
    """The text of each <pre class="runnable" data-query=NAME> in a Browser guide."""

    def __init__(self):
        super().__init__()
        self.blocks, self._current = {}, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "pre" and "runnable" in attrs.get("class", "").split():
            self._current = attrs["data-query"]
            self.blocks[self._current] = ""

    def handle_endtag(self, tag):
        if tag == "pre":
            self._current = None

    def handle_data(self, data):
        if self._current:
            self.blocks[self._current] += data


def guide_blocks() -> dict[str, str]:
    parser = _RunnableBlocks()
    parser.feed((BROWSER_DIR / "guide.html").read_text())
    return {name: text.strip() for name, text in parser.blocks.items()}


def planted_graph() -> nx.MultiDiGraph:
    graph = nx.MultiDiGraph()
    graph.add_nodes_from(f"L{layer}H{head}" for layer in range(3) for head in range(4))
    for source, target, kind, rank in PLANTED_EDGES:
        graph.add_edge(source, target, kind=kind, rank=rank)
    return graph


def _layer_head(name: str) -> tuple[int, int]:
    layer, head = re.match(r"L(\d+)H(\d+)", name).groups()
    return int(layer), int(head)


def hubs_by_degree(graph: nx.MultiDiGraph) -> list[str]:
    """Heads with edges, by total degree (descending), then layer and head."""
    return sorted((n for n in graph if graph.degree(n)), key=lambda n: (-graph.degree(n), *_layer_head(n)))


def test_the_style_parses_like_browser_and_colours_edges_like_the_figures():
    rules = grass_rules((BROWSER_DIR / "style.grass").read_text())
    assert all(re.fullmatch(r"(node|relationship)(\.\w+)?", s) for s in rules), "Browser's parser has no comments"
    assert {tp: rules[f"relationship.{tp}"]["color"] for tp in TYPE_COLORS} == TYPE_COLORS
    assert rules["node.Head"]["caption"] == "{name}"
    layer_colors = [rules[f"node.Layer{layer}"]["color"] for layer in range(12)]
    assert len(set(layer_colors)) == 12
    assert list(rules).index("node.Head") < list(rules).index("node.Layer0")  # later rules win in Browser


@pytest.fixture(scope="module")
def assets_server():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "headgraph.browser.assets_server", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{url}/guide.html", timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    yield url
    process.terminate()
    process.wait(10)


def test_the_assets_server_hands_browser_the_two_files_with_cors(assets_server):
    request = urllib.request.Request(f"{assets_server}/style.grass", headers={"Origin": "http://127.0.0.1:7474"})
    with urllib.request.urlopen(request) as response:
        assert response.headers["Access-Control-Allow-Origin"] == "*"
        assert response.read() == (BROWSER_DIR / "style.grass").read_bytes()
    preflight = urllib.request.Request(
        f"{assets_server}/guide.html", method="OPTIONS",
        headers={"Origin": "http://127.0.0.1:7474", "Access-Control-Request-Headers": "pragma,cache-control"},
    )  # fmt: skip
    with urllib.request.urlopen(preflight) as response:
        assert response.status == 204
        allowed = {h.strip() for h in response.headers["Access-Control-Allow-Headers"].split(",")}
        assert {"pragma", "cache-control"} <= allowed


@pytest.mark.parametrize("path", ["/assets_server.py", "/__init__.py", "/../neo4j_local.py", "/"])
def test_the_assets_server_serves_nothing_else(assets_server, path):
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{assets_server}{path}")
    assert caught.value.code == 404


@pytest.fixture(scope="module")
def planted_run(local_neo4j):
    """A complete run written straight through Bolt into the local server: (driver, run id)."""
    run_id = f"browser-{uuid.uuid4().hex[:12]}"
    heads = [
        {"name": n, "layer": _layer_head(n)[0], "head": _layer_head(n)[1],
         "identity_sig": n in IDENTITY, "identity_score": IDENTITY.get(n, 0.0)}
        for n in planted_graph()
    ]  # fmt: skip
    edges = [{"source": s, "target": t, "kind": k, "rank": r, "pk": 1.0 - r / 10} for s, t, k, r in PLANTED_EDGES]
    driver = neo4j.GraphDatabase.driver(local_neo4j.uri, auth=(local_neo4j.user, local_neo4j.password))
    write = """
        CREATE (:Run {id: $run, model: 'planted', status: 'complete', created: '2000-01-01T00:00:00+00:00',
                      n_heads: size($heads), n_edges: size($edges)})
        WITH 1 AS one UNWIND $heads AS row
        CREATE (h:Head {key: $run + '/' + row.name, name: row.name, layer: row.layer, head: row.head, run_id: $run,
                        identity_sig: row.identity_sig, identity_score: row.identity_score})
        SET h:$('Layer' + toString(row.layer))
        WITH count(*) AS created UNWIND $edges AS e
        MATCH (a:Head {key: $run + '/' + e.source}), (b:Head {key: $run + '/' + e.target})
        CREATE (a)-[:$(e.kind) {kind: e.kind, rank: e.rank, pk: e.pk, run_id: $run,
                                source: e.source, target: e.target}]->(b)
    """
    driver.execute_query(write, run=run_id, heads=heads, edges=edges, database_="neo4j")
    yield driver, run_id
    driver.execute_query("MATCH (n) WHERE n.run_id = $run OR (n:Run AND n.id = $run) DETACH DELETE n",
                         run=run_id, database_="neo4j")  # fmt: skip
    driver.close()


def _run_block(driver, block: str, params: dict) -> list[dict]:
    """Run one guide block as Browser would: `:param name => expr` becomes `RETURN expr AS name`."""
    if block.startswith(":param"):
        name, expression = re.fullmatch(r":param (\w+) => (.+)", block, re.S).groups()
        return driver.execute_query(f"RETURN {expression} AS {name}", database_="neo4j").records[0].data()
    return [r.data() for r in driver.execute_query(block, params, database_="neo4j").records]


def test_the_guide_picks_the_newest_complete_run(planted_run):
    driver, _ = planted_run
    picked = _run_block(driver, guide_blocks()["pick-run"], {})["run"]
    runs = driver.execute_query("MATCH (r:Run) RETURN r.id AS id, r.status AS status, r.created AS created",
                                database_="neo4j").records  # fmt: skip
    complete = [r for r in runs if r["status"] == "complete"]
    assert picked == max(complete, key=lambda r: r["created"])["id"]


def test_the_guide_queries_find_the_planted_structure(planted_run):
    driver, run_id = planted_run
    blocks, graph = guide_blocks(), planted_graph()
    params = {"run": run_id, "head": HUB}
    hubs = _run_block(driver, blocks["hubs"], params)
    expected = hubs_by_degree(graph)
    assert [row["head"] for row in hubs] == expected[:10]
    assert hubs[0]["out_degree"] == graph.out_degree(HUB) and hubs[0]["in_degree"] == 0
    top = _run_block(driver, blocks["top-edges"], params)
    assert sorted((r["kind"], r["rank"], r["source"], r["target"]) for r in top) == sorted(
        (k, r, s, t) for s, t, k, r in PLANTED_EDGES if r <= 5
    )
    neighbors = _run_block(driver, blocks["neighbors"], params)
    assert sorted(r["neighbor"] for r in neighbors) == sorted(graph.successors(HUB))
    assert {r["direction"] for r in neighbors} == {"out"}
    identity = _run_block(driver, blocks["identity-hubs"], params)
    assert [r["head"] for r in identity] == sorted(IDENTITY, key=lambda n: (-graph.degree(n), -IDENTITY[n]))
    summary = {r["kind"]: r["edges"] for r in _run_block(driver, blocks["type-summary"], params)}
    assert summary == {k: sum(e[2] == k for e in PLANTED_EDGES) for k in {"OK", "OQ", "OV"}}
    for name in ("runs", "hubs-graph", "top-edges-graph", "run-graph", "neighbors-graph"):
        assert _run_block(driver, blocks[name], params), f"guide block {name} returned no rows"


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


def _frames_by_command(browser) -> dict[str, object]:
    from selenium.webdriver.common.by import By

    found = {}
    for frame in browser.find_elements(By.CSS_SELECTOR, "[data-testid=frame]"):
        commands = frame.find_elements(By.CSS_SELECTOR, "[data-testid=frameCommand]")
        if commands:
            found.setdefault(commands[0].text.strip(), frame)
    return found


def _run_in_editor(browser, command: str) -> None:
    """Type a command into Browser's editor (one line: Enter would run early) and press its Run button."""
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, "[data-testid=activeEditor]").click()
    browser.switch_to.active_element.send_keys(" ".join(command.split()))
    browser.find_element(By.CSS_SELECTOR, "[data-testid=editor-Run]").click()


def _wait_for(browser, condition, what: str, timeout: float = 90):
    """WebDriverWait that, on timeout, leaves a screenshot in test-artifacts/ and fails naming the step."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(browser, timeout).until(condition)
    except TimeoutException:
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "browser-failure.png"))
        pytest.fail(f"Neo4j Browser: no {what} after {timeout} s (screenshot: test-artifacts/browser-failure.png)")


def _frame_text(browser, command: str) -> str:
    """The text of the newest frame that ran `command`, or "" while there is none."""
    frame = _frames_by_command(browser).get(command)
    return frame.text if frame is not None else ""


def _drawn_nodes(browser, command: str) -> list:
    """The graph nodes (<g class="node">) drawn in the frame that ran `command`."""
    from selenium.webdriver.common.by import By

    frame = _frames_by_command(browser).get(command)
    return frame.find_elements(By.CSS_SELECTOR, "g.node") if frame is not None else []


def test_browser_shows_the_planted_hub_with_headgraph_style(planted_run, local_neo4j, chromium):
    from selenium.webdriver.common.by import By

    _, run_id = planted_run
    chromium.get(local_neo4j.browser_url)
    password = _wait_for(chromium, lambda b: b.find_element(By.CSS_SELECTOR, "[data-testid=password]"), "login form")
    chromium.find_element(By.CSS_SELECTOR, "[data-testid=username]").send_keys(local_neo4j.user)
    password.send_keys(local_neo4j.password)
    chromium.find_element(By.CSS_SELECTOR, "[data-testid=connect]").click()

    # browser.post_connect_cmd: the style and the guide come from the assets server on connect
    style_cmd, play_cmd = f":style {local_neo4j.assets_url}/style.grass", f":play {local_neo4j.assets_url}/guide.html"
    _wait_for(chromium, lambda b: "node.Head" in _frame_text(b, style_cmd), ":style frame")
    _wait_for(chromium, lambda b: "headgraph: the head graph of a run" in _frame_text(b, play_cmd), "guide frame")

    set_run = f":param run => '{run_id}'"
    _run_in_editor(chromium, set_run)
    _wait_for(chromium, lambda b: "Successfully set your parameters" in _frame_text(b, set_run), "run parameter")
    query = guide_blocks()["hubs-graph"]
    _run_in_editor(chromium, query)
    command = " ".join(query.split())
    _wait_for(chromium, lambda b: _drawn_nodes(b, command), "hubs graph")
    frame = _frames_by_command(chromium)[command]
    time.sleep(2)  # let the force layout settle for the screenshot
    ARTIFACTS.mkdir(exist_ok=True)
    frame.screenshot(str(ARTIFACTS / "browser-hubs.png"))
    chromium.save_screenshot(str(ARTIFACTS / "browser-page.png"))

    graph = planted_graph()
    top5 = hubs_by_degree(graph)[:5]
    expected = set(top5) | {n for hub in top5 for n in nx.all_neighbors(graph, hub)}
    nodes = {g.find_element(By.CSS_SELECTOR, "text.caption").text.strip(): g for g in _drawn_nodes(chromium, command)}
    assert set(nodes) == expected
    assert f"Head ({len(expected)})" in frame.text
    rules = grass_rules((BROWSER_DIR / "style.grass").read_text())
    hub_fill = nodes[HUB].find_element(By.CSS_SELECTOR, "circle.b-outline").get_attribute("fill")
    assert hub_fill.lower() == rules["node.Layer0"]["color"].lower()
    edges = frame.find_elements(By.CSS_SELECTOR, "g.relationship")
    edge_fills = {(g.find_element(By.TAG_NAME, "text").text,
                   g.find_element(By.CSS_SELECTOR, "path.b-outline").get_attribute("fill")) for g in edges}  # fmt: skip
    assert edge_fills == {(k, TYPE_COLORS[k]) for _, _, k, _ in PLANTED_EDGES}
