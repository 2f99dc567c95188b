"""The interactive graph in report.html, driven in headless Chromium with real mouse and keyboard events, and
`headgraph view`.

The run is a planted-structure run folder (tests/_runfolder.py) whose OK pairs also carry causal effect columns.
Expected values come from the run's own tables read with pandas (the top-k selection and the roles recomputed
here) and from the Python graph (headgraph.analysis.network.head_network) for centralities; never from the page.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from _runfolder import build_bases, plant, write_run

from headgraph.analysis.centrality import COUNT_MEASURES, MEASURES
from headgraph.analysis.classes import HeadClasses
from headgraph.analysis.network import head_network
from headgraph.analysis.selection import SelectionPolicy, select_graph
from headgraph.cli import main
from headgraph.report.interactive import LIBRARY
from headgraph.report.report import render_report
from headgraph.runs import load_run

pytestmark = pytest.mark.slow  # headless Chromium, `python -m headgraph view` processes, a report rendered per test

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
TOP_K = 5
HOSTILE_CLASS = "</script><script>window.pwned = 1</script>"
CLASSES = HeadClasses("view-classes", "written in this test", None,
                      {"induction": ("L2H1", "L3H0"), "previous_token": ("L0H2",), HOSTILE_CLASS: ("L1H3",)})


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    bases = build_bases(4, 4, 64, 8, seed=5)
    for target, kind, seed in (((2, 1), "K", 1), ((3, 0), "Q", 2), ((1, 3), "V", 3), ((3, 2), "K", 4)):
        plant(bases, (0, 2), target, kind, seed=seed)
    folder = write_run(tmp_path_factory.mktemp("view") / "run", bases=bases, model="planted-4x4")
    pairs = pd.read_parquet(folder / "pairs.parquet")
    ok = (pairs["target_type"] == "K").to_numpy()
    effect = np.where(ok, np.random.default_rng(3).uniform(0.01, 0.5, len(pairs)), np.nan)
    pairs = pairs.assign(effect=effect, effect_lo=effect * 0.6, effect_hi=effect * 1.5,
                         effect_loss=-effect, effect_loss_lo=-effect * 1.2, effect_loss_hi=-effect * 0.8)
    pairs.to_parquet(folder / "pairs.parquet", index=False)
    render_report(folder, policy=SelectionPolicy(top_k=TOP_K), classes=CLASSES)
    return folder


@pytest.fixture(scope="module")
def expected(run_folder):
    """The selection recomputed with pandas (top TOP_K per kind by PK) and the heads table."""
    pairs = pd.read_parquet(run_folder / "pairs.parquet")
    pairs["kind"] = pairs["source_type"] + pairs["target_type"]
    pairs["rank"] = pairs.groupby("kind")["pk"].rank(ascending=False, method="first").astype(int)
    return {"edges": pairs[pairs["rank"] <= TOP_K].reset_index(drop=True),
            "heads": pd.read_parquet(run_folder / "heads.parquet").set_index("head")}


@pytest.fixture(scope="module")
def python_graph(run_folder):
    run = load_run(run_folder)
    return head_network(select_graph(run.pairs, run.heads, SelectionPolicy(top_k=TOP_K)))


def g4(value) -> str:
    """The report's number format (4 significant digits), -0 shown as 0."""
    return f"{value + 0.0:.4g}"


def _open(browser, folder: Path):
    """Load report.html with a recorder of script errors and CSP violations installed before any page script."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": """
        window.__problems = [];
        addEventListener("error", e => __problems.push("error: " + e.message));
        document.addEventListener("securitypolicyviolation", e => __problems.push("csp: " + e.blockedURI));"""})
    browser.get((folder / "report.html").resolve().as_uri())
    view = browser.find_element(By.ID, "hg-view")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", view)
    WebDriverWait(browser, 30).until(lambda b: view.get_attribute("data-ready") == "true")
    return view


def _viewport_point(browser, element_id: str, edge: bool = False) -> tuple[int, int]:
    """Where the head (or the middle of the edge) is drawn, in viewport pixels."""
    x, y = browser.execute_script(
        "const cy = window.headgraphView, box = cy.container().getBoundingClientRect();"
        "const e = cy.getElementById(arguments[0]), p = arguments[1] ? e.renderedMidpoint() : e.renderedPosition();"
        "return [box.left + p.x, box.top + p.y];", element_id, edge)
    return round(x), round(y)


def _pointer(browser, point, click=False):
    from selenium.webdriver.common.action_chains import ActionChains

    actions = ActionChains(browser)
    actions.w3c_actions.pointer_action.move_to_location(*point)
    if click:
        actions.w3c_actions.pointer_action.click()
    actions.perform()


def _wait(browser, condition, what):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(browser, 10).until(condition)
    except TimeoutException:
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "view-failure.png"))
        pytest.fail(f"interactive graph: no {what} (screenshot: test-artifacts/view-failure.png)")


def _fields(element) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    return {cell.get_attribute("data-field"): cell.text for cell in element.find_elements(By.CSS_SELECTOR, "[data-field]")}


def _shows_edges(browser, count: int, what: str) -> None:
    """Wait until the page counts `count` edges and cytoscape displays exactly that many (it restyles lazily)."""
    _wait(browser, lambda b: b.execute_script(
        "return [document.getElementById('hg-count').dataset.visible, window.headgraphView.edges(':visible').length]")
        == [str(count), count], what)


def test_the_page_is_self_contained(run_folder):
    page = (run_folder / "report.html").read_text()
    library = LIBRARY.read_text()
    assert page.count(library) == 1 and "</script" not in library.lower()
    assert not re.search(r"https?://", page.replace(library, "")), "a URL outside the vendored library"
    library_comments = re.findall(r"/\*[\s\S]*?\*/", library)
    assert re.findall(r"https?://", library) == re.findall(r"https?://", "".join(library_comments))
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert HOSTILE_CLASS not in page  # the class name only appears escaped in the JSON
    assert "`headgraph view <run folder>` opens it" in (run_folder / "report.md").read_text()


def test_a_graph_beyond_the_edge_limit_is_left_out_with_the_reason(tmp_path, monkeypatch):
    from headgraph.report import report

    monkeypatch.setattr(report, "MAX_EDGES", 14)
    folder = write_run(tmp_path / "run")
    render_report(folder, policy=SelectionPolicy(top_k=TOP_K))  # 3 types x 5 = 15 edges
    page, md = (folder / "report.html").read_text(), (folder / "report.md").read_text()
    assert 'id="hg-view"' not in page and "cytoscape" not in page
    assert "The interactive graph is left out: 15 selected edges are more than it draws (14)" in md


def test_clicking_a_head_shows_its_roles_centralities_and_neighbours(run_folder, expected, python_graph, chromium):
    from selenium.webdriver.common.by import By

    view = _open(chromium, run_folder)
    heads, edges = expected["heads"], expected["edges"]
    panel = view.find_element(By.ID, "hg-panel")
    for head in ("L0H2", "L0H1", "L2H1"):  # the planted hub, the identity head, a target of two planted edges
        _pointer(chromium, _viewport_point(chromium, head), click=True)
        _wait(chromium, lambda b, head=head: panel.get_attribute("data-head") == head, f"panel for {head}")
        fields = _fields(panel.find_element(By.CSS_SELECTOR, ".hg-kv"))
        roles = [c[:-4] for c in heads.columns if c.endswith("_sig") and heads.loc[head, c]]
        roles.sort(key=lambda role: (role != "identity", role))
        assert fields["roles"] == (", ".join(roles) or "none")
        tables = panel.find_elements(By.CSS_SELECTOR, ".hg-kv")
        shown = _fields(tables[1])
        node = python_graph.nodes[head]
        assert shown == {m: str(node[m]) if m in COUNT_MEASURES else g4(node[m]) for m in MEASURES}
        for end, other, title in (("target", "source", "in-edges"), ("source", "target", "out-edges")):
            mine = edges[edges[end] == head]
            assert f"{title} ({len(mine)})" in panel.text
            rows = panel.find_elements(By.CSS_SELECTOR, f"tr[data-edge$='>{head}']" if end == "target"
                                       else f"tr[data-edge^='{head}-']")
            assert sorted(tuple(_fields(r).values()) for r in rows) == sorted(
                (r[other], r["kind"], g4(r["pk"])) for _, r in mine.iterrows())
        identity = panel.find_element(By.CSS_SELECTOR, "tr[data-role=identity]").text.split()
        assert identity[1] == g4(heads.loc[head, "identity_score"])
    _pointer(chromium, _viewport_point(chromium, "L1H3"), click=True)
    _wait(chromium, lambda b: panel.get_attribute("data-head") == "L1H3", "panel for L1H3")
    assert f"known class {HOSTILE_CLASS}" in panel.text
    assert chromium.execute_script("return window.pwned") is None
    assert chromium.execute_script("return window.__problems") == []


def test_hovering_and_clicking_an_edge_show_the_pairs_table_numbers(run_folder, expected, chromium):
    from selenium.webdriver.common.by import By

    view = _open(chromium, run_folder)
    edges = expected["edges"].set_index(["source", "kind", "target"])
    tip, panel = view.find_element(By.ID, "hg-tip"), view.find_element(By.ID, "hg-panel")
    for (source, kind, target), how in ((("L0H2", "OK", "L3H2"), "hover"), (("L0H2", "OQ", "L3H0"), "click")):
        for box in view.find_elements(By.CSS_SELECTOR, "input[data-kind]"):  # only this kind: no edge crosses it
            if box.is_selected() != (box.get_attribute("data-kind") == kind):
                box.click()
        _shows_edges(chromium, TOP_K, f"the {kind} edges alone")
        edge_id = f"{source}-{kind}->{target}"
        row = edges.loc[(source, kind, target)]
        _pointer(chromium, _viewport_point(chromium, edge_id, edge=True), click=how == "click")
        shown = tip if how == "hover" else panel
        _wait(chromium, lambda b, shown=shown, edge_id=edge_id: shown.get_attribute("data-edge") == edge_id,
              f"{edge_id} on {how}")
        effect, loss = ("—" if np.isnan(row[c]) else f"{g4(row[c])} [{g4(row[f'{c}_lo'])}, {g4(row[f'{c}_hi'])}]"
                        for c in ("effect", "effect_loss"))
        assert _fields(shown) == {"pk": g4(row["pk"]), "rank": str(row["rank"]), "q_model": g4(row["q_model"]),
                                  "cs": g4(row["cs"]), "effect": effect, "effect_loss": loss}
        assert f"{source} → {target} {kind}" in shown.text
        if how == "hover":
            ARTIFACTS.mkdir(exist_ok=True)
            view.screenshot(str(ARTIFACTS / "view-edge-hover.png"))
    assert _fields(panel)["effect"] == "—"  # the OQ pairs carry no effect: shown as absent, not as 0


def test_type_and_pk_filters_hide_the_expected_edges(run_folder, expected, chromium):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    view = _open(chromium, run_folder)
    edges = expected["edges"]
    count = view.find_element(By.ID, "hg-count")
    _shows_edges(chromium, len(edges), "all edges")
    assert count.text == f"{len(edges)} of {len(edges)} edges shown"
    view.find_element(By.CSS_SELECTOR, "input[data-kind=OV]").click()
    without_ov = int((edges["kind"] != "OV").sum())
    assert without_ov == len(edges) - TOP_K
    _shows_edges(chromium, without_ov, "edges without OV")
    slider = view.find_element(By.ID, "hg-pk")
    slider.send_keys(Keys.END + Keys.LEFT * 100)  # step 100 of 200: PK >= the middle of the PK range
    threshold = edges["pk"].min() + (edges["pk"].max() - edges["pk"].min()) * 100 / 200
    strong = int(((edges["kind"] != "OV") & (edges["pk"] >= threshold)).sum())
    assert 0 < strong < without_ov
    _shows_edges(chromium, strong, "edges above the PK threshold")
    assert view.find_element(By.ID, "hg-pk-value").text == g4(threshold)
    view.find_element(By.CSS_SELECTOR, "input[data-kind=OV]").click()
    both = int((edges["pk"] >= threshold).sum())
    _shows_edges(chromium, both, "edges above the PK threshold with OV back")
    _pointer(chromium, _viewport_point(chromium, "L0H2"), click=True)  # greyed rows = hidden by the filters
    _wait(chromium, lambda b: view.find_element(By.ID, "hg-panel").get_attribute("data-head") == "L0H2", "L0H2 panel")
    hidden_rows = view.find_elements(By.CSS_SELECTOR, "#hg-panel tr.hg-off")
    assert len(hidden_rows) == int(((edges["source"] == "L0H2") & (edges["pk"] < threshold)).sum())
    ARTIFACTS.mkdir(exist_ok=True)
    view.screenshot(str(ARTIFACTS / "view-filtered.png"))


def test_the_page_loads_nothing_from_anywhere(run_folder, chromium):
    _open(chromium, run_folder)
    resources = chromium.execute_script("return performance.getEntriesByType('resource').map(r => r.name)")
    assert [r for r in resources if not r.startswith("data:")] == []
    assert chromium.execute_script("return window.__problems") == []
    ARTIFACTS.mkdir(exist_ok=True)
    chromium.save_screenshot(str(ARTIFACTS / "view-page.png"))


def test_view_prints_or_opens_the_report_and_renders_a_missing_one(run_folder, tmp_path, capsys):
    page = run_folder / "report.html"
    before = page.stat().st_mtime_ns
    main(["view", str(run_folder), "--no-open"])
    assert capsys.readouterr().out == f"{page}\n" and page.stat().st_mtime_ns == before

    bare = write_run(tmp_path / "bare")
    main(["view", str(bare), "--no-open"])
    out, err = capsys.readouterr()
    assert out == f"{bare / 'report.html'}\n" and err.startswith(f"rendered {bare / 'report.html'}")
    assert 'id="hg-view"' in (bare / "report.html").read_text()

    record = tmp_path / "opened.txt"
    opener = tmp_path / "browser.py"
    opener.write_text(f"import sys; open({str(record)!r}, 'w').write(sys.argv[1])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "TERM")}
    command = [sys.executable, "-m", "headgraph", "view", str(run_folder)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**env, "BROWSER": f"{sys.executable} {opener} %s"})
    assert done.returncode == 0, done.stderr
    assert record.read_text() == page.resolve().as_uri() and done.stdout == f"opened {page}\n"

    failed = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**env, "BROWSER": "false %s"})
    assert failed.returncode == 2 and failed.stderr.count("\n") == 1
    assert failed.stderr.startswith("error: no web browser found to open")

    with pytest.raises(SystemExit) as exit_info:
        main(["view", str(tmp_path / "missing"), "--no-open"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith("error: run folder")
