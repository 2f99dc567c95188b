"""Neo4j Browser exploration: the GraSS style, the guide's canned queries, the loopback assets server, and
headless Chromium driving the real Browser against the local server (screenshots in test-artifacts/).

The explored run is produced the way a user produces one: `headgraph analyze` on the planted-structure model
(the session's shared analysis), its saved run stored into the local server. Expectations come from the planted truth and from the run's own
pairs.parquet (its top-k selection recomputed here with pandas), never from the store."""

import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import neo4j
import networkx as nx
import pandas as pd
import pytest
from _ports import unclaimed_port

import headgraph
from headgraph.loader.open_store import StoreSpec
from headgraph.report.figures import TYPE_COLORS

BROWSER_DIR = Path(__file__).resolve().parents[1] / "headgraph" / "neo4j_local" / "browser"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


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


def selected_graph(pairs: pd.DataFrame, top_k: int) -> nx.MultiDiGraph:
    """The run's graph recomputed from its pairs table: the top_k pairs of each weight-pair type by PK, with
    their rank within the type (1 = strongest)."""
    pairs = pairs.assign(kind=pairs["source_type"] + pairs["target_type"])
    pairs["rank"] = pairs.groupby("kind")["pk"].rank(ascending=False, method="first").astype(int)
    kept = pairs[pairs["rank"] <= top_k]
    graph = nx.from_pandas_edgelist(kept, "source", "target", ["kind", "rank"], create_using=nx.MultiDiGraph)
    graph.add_nodes_from(set(pairs["source"]) | set(pairs["target"]))
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
    port = unclaimed_port()
    process = subprocess.Popen([sys.executable, "-m", "headgraph.neo4j_local.browser.assets_server", "--port", str(port)])
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


@pytest.mark.parametrize("path", ["/assets_server.py", "/__init__.py", "/../server.py", "/"])
def test_the_assets_server_serves_nothing_else(assets_server, path):
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{assets_server}{path}")
    assert caught.value.code == 404


@pytest.fixture(scope="module")
def analyzed_run(local_neo4j, planted_analysis):
    """The session's `headgraph analyze` of the planted model (conftest), stored into the local server as a user
    stores a saved run (headgraph.load_run(folder).to_store): (driver, run id, truth, selected graph)."""
    run = headgraph.load_run(planted_analysis.folder)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NEO4J_PASSWORD", local_neo4j.password)
        run.to_store(StoreSpec(neo4j=local_neo4j.uri, user=local_neo4j.user))
    graph = selected_graph(pd.read_parquet(planted_analysis.folder / "pairs.parquet"), planted_analysis.top_k)
    driver = neo4j.GraphDatabase.driver(local_neo4j.uri, auth=(local_neo4j.user, local_neo4j.password))
    yield driver, run.id, planted_analysis.truth, graph
    driver.execute_query("MATCH (n) WHERE n.run_id = $run OR (n:Run AND n.id = $run) DETACH DELETE n",
                         run=run.id, database_="neo4j")  # fmt: skip
    driver.close()


def _run_block(driver, block: str, params: dict) -> list[dict]:
    """Run one guide block as Browser would: `:param name => expr` becomes `RETURN expr AS name`."""
    if block.startswith(":param"):
        name, expression = re.fullmatch(r":param (\w+) => (.+)", block, re.S).groups()
        return driver.execute_query(f"RETURN {expression} AS {name}", database_="neo4j").records[0].data()
    return [r.data() for r in driver.execute_query(block, params, database_="neo4j").records]


@pytest.mark.slow
def test_the_guide_picks_the_newest_complete_run(analyzed_run):
    driver = analyzed_run[0]
    picked = _run_block(driver, guide_blocks()["pick-run"], {})["run"]
    runs = driver.execute_query("MATCH (r:Run) RETURN r.id AS id, r.status AS status, r.created AS created",
                                database_="neo4j").records  # fmt: skip
    complete = [r for r in runs if r["status"] == "complete"]
    assert picked == max(complete, key=lambda r: r["created"])["id"]


@pytest.mark.slow
def test_the_guide_queries_find_the_planted_structure_of_the_analyzed_run(analyzed_run):
    driver, run_id, truth, graph = analyzed_run
    blocks, hub = guide_blocks(), truth.hub
    params = {"run": run_id, "head": hub}
    hubs = _run_block(driver, blocks["hubs"], params)
    assert [row["head"] for row in hubs] == hubs_by_degree(graph)[:10]
    assert hubs[0]["head"] == hub
    assert hubs[0]["out_degree"] == graph.out_degree(hub) and hubs[0]["in_degree"] == 0
    top = _run_block(driver, blocks["top-edges"], params)
    assert sorted((r["kind"], r["rank"], r["source"], r["target"]) for r in top) == sorted(
        (d["kind"], d["rank"], s, t) for s, t, d in graph.edges(data=True)
    )
    planted_per_kind = Counter(kind for _, _, kind, _ in truth.edges)
    ranks = {(r["source"], r["target"], r["kind"]): r["rank"] for r in top}
    for source, target, kind, _ in truth.edges:  # each planted edge is among the strongest of its type
        assert ranks.get((source, target, kind), float("inf")) <= planted_per_kind[kind], (source, target, kind)
    neighbors = _run_block(driver, blocks["neighbors"], params)
    assert sorted(r["neighbor"] for r in neighbors) == sorted(target for _, target in graph.out_edges(hub))
    assert {r["direction"] for r in neighbors} == {"out"}
    identity = [r["head"] for r in _run_block(driver, blocks["identity-hubs"], params)]
    assert sorted(identity) == sorted(truth.identity_heads)
    degrees = [graph.degree(head) for head in identity]
    assert degrees == sorted(degrees, reverse=True)
    summary = {r["kind"]: r["edges"] for r in _run_block(driver, blocks["type-summary"], params)}
    assert summary == Counter(kind for _, _, kind in graph.edges(data="kind"))
    for name in ("runs", "hubs-graph", "top-edges-graph", "run-graph", "neighbors-graph"):
        assert _run_block(driver, blocks[name], params), f"guide block {name} returned no rows"


def _frames_by_command(browser) -> dict[str, object]:
    from selenium.webdriver.common.by import By

    found = {}
    for frame in browser.find_elements(By.CSS_SELECTOR, "[data-testid=frame]"):
        commands = frame.find_elements(By.CSS_SELECTOR, "[data-testid=frameCommand]")
        if commands:
            found.setdefault(commands[0].text.strip(), frame)
    return found


def _at_rest(browser, element):
    """`element` once the page's finite animations have finished. Browser rolls every new frame in (a 0.4 s CSS
    animation that also pushes the frames below it down); a click aimed at a button while it moves lands on
    whatever has slid under that point when the mouse is pressed (for the Connect button: the password field)."""
    browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "const moving = document.getAnimations().filter(a => a.effect?.getComputedTiming().endTime < Infinity);"
        "Promise.allSettled(moving.map(a => a.finished)).then(() => done());"
    )
    return element


def _run_in_editor(browser, command: str) -> None:
    """Put a command into Browser's editor as one line and press its Run button. The text goes in as one
    input event (Chromium DevTools Input.insertText), much faster than key by key through the autocompletion."""
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, "[data-testid=activeEditor]").click()
    browser.execute_cdp_cmd("Input.insertText", {"text": " ".join(command.split())})
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


def _table_rows(browser, command: str) -> list[list[str]]:
    """The cells of each body row of the table view in the frame that ran `command`, or [] while there is none or
    a row's cells are still empty (Browser adds a table's rows before it fills their cells: a wait on the rows
    alone once read ['', ''] for the hub's)."""
    from selenium.webdriver.common.by import By

    frame = _frames_by_command(browser).get(command)
    if frame is None:
        return []
    rows = frame.find_elements(By.CSS_SELECTOR, "tbody tr[role=row]")
    cells = [[cell.text.strip() for cell in row.find_elements(By.CSS_SELECTOR, "td[role=cell]")] for row in rows]
    return cells if all(row and all(row) for row in cells) else []


def _run_guide_block(browser, name: str) -> str:
    """Run a guide block through Browser's editor; return the command as the frame shows it."""
    query = guide_blocks()[name]
    _run_in_editor(browser, query)
    return " ".join(query.split())


@pytest.mark.slow
def test_browser_shows_the_planted_hub_first_with_headgraph_style(analyzed_run, local_neo4j, chromium):
    from selenium.webdriver.common.by import By

    _, run_id, truth, graph = analyzed_run
    chromium.get(local_neo4j.browser_url)
    password = _wait_for(chromium, lambda b: b.find_element(By.CSS_SELECTOR, "[data-testid=password]"), "login form")
    chromium.find_element(By.CSS_SELECTOR, "[data-testid=username]").send_keys(local_neo4j.user)
    password.send_keys(local_neo4j.password)
    _at_rest(chromium, chromium.find_element(By.CSS_SELECTOR, "[data-testid=connect]")).click()

    # browser.post_connect_cmd: the style and the guide come from the assets server on connect
    style_cmd, play_cmd = f":style {local_neo4j.assets_url}/style.grass", f":play {local_neo4j.assets_url}/guide.html"
    _wait_for(chromium, lambda b: "node.Head" in _frame_text(b, style_cmd), ":style frame")
    _wait_for(chromium, lambda b: "headgraph: the head graph of a run" in _frame_text(b, play_cmd), "guide frame")

    set_run = f":param run => '{run_id}'"
    _run_in_editor(chromium, set_run)
    _wait_for(chromium, lambda b: "Successfully set your parameters" in _frame_text(b, set_run), "run parameter")

    hubs_cmd = _run_guide_block(chromium, "hubs")
    rows = _wait_for(chromium, lambda b: _table_rows(b, hubs_cmd), "hubs table")
    ARTIFACTS.mkdir(exist_ok=True)
    _at_rest(chromium, _frames_by_command(chromium)[hubs_cmd]).screenshot(str(ARTIFACTS / "browser-hubs-table.png"))
    hub = truth.hub
    assert rows[0][:2] == [f'"{hub}"', str(_layer_head(hub)[0])]
    assert rows[0][2] == str(graph.degree(hub))
    assert [row[0].strip('"') for row in rows] == hubs_by_degree(graph)[:10]

    graph_cmd = _run_guide_block(chromium, "hubs-graph")
    _wait_for(chromium, lambda b: _drawn_nodes(b, graph_cmd), "hubs graph")
    frame = _frames_by_command(chromium)[graph_cmd]
    time.sleep(2)  # let the force layout settle for the screenshot
    frame.screenshot(str(ARTIFACTS / "browser-hubs.png"))
    chromium.save_screenshot(str(ARTIFACTS / "browser-page.png"))

    top5 = hubs_by_degree(graph)[:5]
    expected = set(top5) | {n for h in top5 for n in nx.all_neighbors(graph, h)}
    nodes = {g.find_element(By.CSS_SELECTOR, "text.caption").text.strip(): g for g in _drawn_nodes(chromium, graph_cmd)}
    assert set(nodes) == expected
    assert f"Head ({len(expected)})" in frame.text
    rules = grass_rules((BROWSER_DIR / "style.grass").read_text())
    hub_fill = nodes[hub].find_element(By.CSS_SELECTOR, "circle.b-outline").get_attribute("fill")
    assert hub_fill.lower() == rules[f"node.Layer{_layer_head(hub)[0]}"]["color"].lower()
    edges = frame.find_elements(By.CSS_SELECTOR, "g.relationship")
    edge_fills = {(g.find_element(By.TAG_NAME, "text").text,
                   g.find_element(By.CSS_SELECTOR, "path.b-outline").get_attribute("fill")) for g in edges}  # fmt: skip
    assert edge_fills == {(d["kind"], TYPE_COLORS[d["kind"]]) for _, _, d in graph.edges(top5, data=True)}
