"""The package's structure, read from its source with `ast`: no import cycle between modules (function-level and
TYPE_CHECKING imports count), no import against the layers below, and one definition site for the vocabulary."""

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "headgraph"

# Each room and the rooms it may import (besides itself). Data flows one way: model -> subspaces -> PK / roles
# -> selection -> centrality -> store -> queries / reports; the orchestrator and the CLI sit on top.
ALLOWED = {
    "errors": set(),
    "_version": set(),
    "heads": {"errors"},
    "files": set(),
    "analysis": {"errors", "heads"},
    "runs": {"errors", "heads", "analysis.artifacts", "_version"},
    # types, table rows; the heap's memory advice (the streamed model's float32 copies)
    "loader": {"errors", "heads", "files", "runs", "analysis.selection", "analysis.artifacts", "analysis.heap"},
    "queries": {"errors", "heads", "loader"},
    "report": {"errors", "heads", "files", "analysis", "runs", "loader"},
    # what analyze is asked, and the stage protocol (its Context and runner) under the orchestrator's stages
    "settings": {"errors", "heads", "analysis", "loader.open_store"},
    "stages": {"errors", "heads", "analysis", "runs", "loader", "settings"},
    "pipeline": {"errors", "heads", "analysis", "runs", "settings", "stages"},
    "stability": {"errors", "analysis", "runs", "settings"},  # given the orchestrator's run_analyze, not importing it
    "workflow": {"errors", "heads", "files", "analysis", "runs", "loader", "pipeline", "report", "settings", "stages",
                 "stability"},
    "testing": {"errors", "heads", "loader"},
    "neo4j_local": {"errors"},
    "doctor": {"errors", "loader"},
    "export": {"errors", "heads", "files", "analysis", "runs", "loader.graph"},  # loader.graph: the stores' Run rows
    "sweep": {"errors", "heads", "files", "analysis", "runs", "loader", "queries", "report", "workflow"},
    # the public Python API: what the orchestrator imports, and the orchestrator
    "api": {"errors", "heads", "files", "analysis", "runs", "loader", "pipeline", "report", "settings", "workflow"},
    "cli": {"errors", "heads", "files", "analysis", "runs", "loader", "queries", "report", "pipeline", "settings",
            "stability", "workflow", "doctor", "neo4j_local", "export", "api", "sweep", "_version"},
    "__main__": {"cli"},
    "__init__": {"_version", "api"},  # api lazily, on first use of headgraph.analyze / load_run / Run
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def imports(path: Path) -> set[str]:
    """Every headgraph module `path` imports, anywhere in the file (module level, functions, TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("headgraph.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "headgraph":
            if node.module == "headgraph":  # `from headgraph import x`: a submodule or a name of __init__
                found |= {f"headgraph.{a.name}" if (PACKAGE / a.name).exists() or (PACKAGE / f"{a.name}.py").exists()
                          else "headgraph.__init__" for a in node.names}
            else:
                found.add(node.module)
    return {name.removeprefix("headgraph.") for name in found}


def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for path in PACKAGE.rglob("*.py"):
        source = module_name(path)
        graph.add_node(source)
        for target in imports(path):
            graph.add_edge(source, target)
    return graph


def room(module: str) -> str:
    return module.split(".")[0]


def allowed(source: str, target: str) -> bool:
    if room(source) == room(target):
        return True
    return any(target == rule or target.startswith(rule + ".") for rule in ALLOWED[room(source)])


def test_every_room_is_named_in_the_layer_rules():
    assert {room(m) for m in import_graph()} <= set(ALLOWED)


def test_no_import_cycle_between_modules():
    cycles = list(nx.simple_cycles(import_graph()))
    assert cycles == []


def test_no_import_against_the_layers():
    wrong = sorted((s, t) for s, t in import_graph().edges if not allowed(s, t))
    assert wrong == []


def test_the_rules_catch_what_they_forbid():
    graph = import_graph()
    assert ("workflow", "analysis.selection") in graph.edges and allowed("workflow", "analysis.selection")
    assert not allowed("analysis.pk", "loader.store")  # analysis never imports loader ...
    assert not allowed("loader.graph", "analysis.centrality")  # ... and the store computes nothing
    assert not allowed("report.summary", "workflow")


def assigned_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}


def test_the_vocabulary_is_defined_once():
    vocabulary = {"WEIGHT_TYPES", "TYPE_PAIRS", "COMPOSITION_TYPES", "DEFAULT_TYPES", "KINDS", "ALL_TYPES",
                  "WeightType"}
    sites = {module_name(p): assigned_names(p) & vocabulary for p in PACKAGE.rglob("*.py")}
    assert {m: names for m, names in sites.items() if names} == {
        "heads": {"WeightType", "WEIGHT_TYPES", "TYPE_PAIRS", "COMPOSITION_TYPES", "DEFAULT_TYPES"}}
    literal = '("Q", "K", "V", "O")'
    assert [p.name for p in PACKAGE.rglob("*.py") if literal in p.read_text()] == []


def closed_sets(source: str) -> dict[str, frozenset[str]]:
    """{name: members} of each closed set `source` declares: a module-level `Name = Literal[...]`, whose members
    may name another closed set of the module (Literal["auto", Kernel])."""
    found: dict[str, frozenset[str]] = {}
    for node in ast.parse(source).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if (isinstance(target, ast.Name) and isinstance(value, ast.Subscript)
                and isinstance(value.value, ast.Name) and value.value.id == "Literal"):
            items = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
            found[target.id] = frozenset(
                m for item in items
                for m in ([item.value] if isinstance(item, ast.Constant) else found.get(getattr(item, "id", None), ())))
    return found


def spelled_sets(source: str, sets: dict[str, frozenset[str]]) -> list[tuple[int, str]]:
    """(line, name) of each place `source` spells out a closed set of `sets`: a tuple, list or set display (a
    click.Choice list, a membership test, another Literal) of string literals only, two or more, that are exactly
    the set's members in any order. A dict keyed by the members (a value per member) is data about the set."""
    spelled = []
    for node in ast.walk(ast.parse(source)):
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
        if len(items) < 2 or not all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
            continue
        members = frozenset(i.value for i in items)
        spelled += [(node.lineno, name) for name, closed in sets.items() if members == closed]
    return sorted(spelled)


def test_each_closed_set_is_spelled_in_its_module_only():
    """A closed set is a Literal declared once, in the module that checks it (headgraph.errors.check_choice);
    elsewhere it is `typing.get_args(TheLiteral)`, never its members written out again."""
    sources = {module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    declared = {(module, name): members for module, source in sources.items()
                for name, members in closed_sets(source).items() if len(members) >= 2}
    expected = {("analysis.options", n) for n in ("Device", "Dtype", "Kernel", "Formulation", "Correction",
                                                  "RoleDesign", "Ablation")}
    expected |= {("heads", "WeightType"), ("heads", "CompositionType"), ("heads", "Processing"),
                 ("loader.open_store", "StoreBackend"), ("export", "ExportFormat"), ("cli", "OutputFormat")}
    assert expected <= set(declared)
    twice = {name: [m for (m, n), members in declared.items() if members == closed]
             for (module, name), closed in declared.items()}
    assert {name: modules for name, modules in twice.items() if len(modules) > 1} == {}
    elsewhere = {f"{module}:{line}": name for module, source in sources.items()
                 for line, name in spelled_sets(source, {n: c for (m, n), c in declared.items() if m != module})}
    assert elsewhere == {}


def test_the_pair_key_is_spelled_once():
    """pairs.parquet's key (source, target, source_type, target_type) is analysis.artifacts.PAIR_KEY everywhere."""
    from headgraph.analysis.artifacts import PAIR_KEY

    key = {"PAIR_KEY": frozenset(PAIR_KEY)}
    found = [module_name(p) for p in PACKAGE.rglob("*.py") for _ in spelled_sets(p.read_text(), key)]
    assert found == ["analysis.artifacts"]


def test_the_closed_set_check_catches_a_set_spelled_again():
    declaring = 'from typing import Literal\nKernel = Literal["gram", "projector"]\nFormulation = Literal["auto", Kernel]\n'
    sets = closed_sets(declaring)
    assert sets == {"Kernel": {"gram", "projector"}, "Formulation": {"auto", "gram", "projector"}}
    assert spelled_sets(declaring, {}) == []
    planted = ('import click\nOPTION = click.option("--kernel", type=click.Choice(["projector", "gram"]))\n'
               'def check(f):\n    """Is it in ("gram", "projector")? A docstring spells nothing."""\n'
               '    if f not in ("auto", "gram", "projector"):\n        raise ValueError(f)\n'
               '    return {"gram", "projector"}, {"gram": 1, "projector": 2}[f], f == "gram", ("gram", "x"), ("gram",)\n')
    assert spelled_sets(planted, sets) == [(2, "Kernel"), (5, "Formulation"), (7, "Kernel")]


CYPHER = re.compile(r"\b(?:MATCH|MERGE|CREATE)\s*\(|\bDETACH\s+DELETE\b|\bRETURN\s")
CYPHER_ROOMS = {"loader", "queries"}  # the stores and the named queries; everything else calls their functions


def cypher_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string literal in `source` that reads as Cypher (MATCH (, MERGE (, CREATE (,
    DETACH DELETE, RETURN ); a documentation string (a string standing alone as a statement) is not one."""
    tree = ast.parse(source)
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and CYPHER.search(n.value)]


def test_cypher_lives_in_the_stores_and_the_named_queries_only():
    found = {f"{module_name(p)}:{line}": text.strip()[:60] for p in PACKAGE.rglob("*.py")
             if room(module_name(p)) not in CYPHER_ROOMS for line, text in cypher_literals(p.read_text())}
    assert found == {}


def test_the_cypher_check_catches_cypher():
    source = ('ROWS = """\nMATCH (r:Run) RETURN r.params\n"""\n'
              'def drop(name):\n    """Removes it with DETACH DELETE (no MATCH ( here counts)."""\n'
              '    return f"MERGE (m:Model {{name: {name}}})", "RETURN 1", "MATCH (a)-[e]->(b) DETACH DELETE e"\n')
    assert [line for line, _ in cypher_literals(source)] == [1, 6, 6, 6]


README = PACKAGE.parent / "README.md"


def layout_entries(readme: str) -> dict[str, str]:
    """The README's Layout block as {entry: its text}: an entry is a line's first word at the block's first
    indent (`cli.py`, `loader/`, `analysis/causal/`); its text runs on over the deeper-indented lines below."""
    block = readme.split("\n## Layout\n", 1)[1].split("```", 2)[1]
    entries, entry = {}, None
    for line in block.splitlines():
        if match := re.match(r"^  (\S+)(.*)$", line):
            entry = match.group(1)
            entries[entry] = match.group(2)
        elif entry and line.startswith("   "):
            entries[entry] += " " + line.strip()
    return entries


def missing_from_layout(entries: dict[str, str], files: list[str]) -> list[str]:
    """The package files (paths under headgraph/) the Layout does not name: a top-level module needs its own
    entry; a module in a folder needs its stem in the text of the deepest folder entry above it, or, below that
    entry, the name of its first subfolder (`neo4j_local/` naming `browser/`)."""
    missing = []
    for file in files:
        parts = file.split("/")
        if len(parts) == 1:
            missing += [] if file in entries else [file]
            continue
        folders = [i for i in range(len(parts) - 1, 0, -1) if "/".join(parts[:i]) + "/" in entries]
        if not folders:
            missing.append(file)
            continue
        depth = folders[0]
        named = Path(parts[-1]).stem if depth == len(parts) - 1 else parts[depth]
        if parts[-1] != "__init__.py" and not re.search(rf"\b{re.escape(named)}\b", entries["/".join(parts[:depth]) + "/"]):
            missing.append(file)
    return missing


def test_the_readme_layout_names_every_module_and_nothing_else():
    entries = layout_entries(README.read_text())
    files = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
    assert missing_from_layout(entries, files) == []
    assert [entry for entry in entries if not (PACKAGE / entry).exists()] == []


def test_the_layout_check_catches_an_unnamed_module():
    readme = ("# x\n\n## Layout\n\n```\nheadgraph/\n  cli.py   the commands\n  loader/  models.py (in) ·\n"
              "                 store.py\n  neo4j_local/  server.py, browser/\n```\n")
    entries = layout_entries(readme)
    assert entries == {"cli.py": "   the commands", "loader/": "  models.py (in) · store.py",
                       "neo4j_local/": "  server.py, browser/"}
    files = ["cli.py", "api.py", "loader/__init__.py", "loader/models.py", "loader/store.py", "loader/stream.py",
             "neo4j_local/server.py", "neo4j_local/browser/assets_server.py", "report/report.py"]
    assert missing_from_layout(entries, files) == ["api.py", "loader/stream.py", "report/report.py"]


@pytest.mark.slow
def test_the_cli_process_settings_reach_torch():
    """`headgraph` sets OMP_WAIT_POLICY (read once, when torch loads) in main(): that works only while importing
    the CLI does not load torch; a value the user set is kept."""
    import os
    import subprocess
    import sys

    probe = ("import os, sys; import headgraph.cli as cli; loaded = 'torch' in sys.modules; cli.main(['--version']); "
             "print(loaded, os.environ['OMP_WAIT_POLICY'])")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"PYTHONPATH": str(PACKAGE.parent)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "False PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "False ACTIVE"
