"""`headgraph doctor` reports the real environment: the Neo4j server behind the fixture, the offline model."""

import pytest
from _commands import headgraph

pytestmark = pytest.mark.slow  # each test runs `headgraph doctor` (TransformerLens loaded, every family listed): 2-18 s


def _doctor(*args, env=None):
    return headgraph("doctor", *args, env={**(env or {}), "COLUMNS": "400"})  # one table row per line


def test_doctor_reports_neo4j_server_version_and_offline_model(neo4j_config, neo4j_driver, tmp_path):
    env = {"NEO4J_USER": neo4j_config["user"], "NEO4J_PASSWORD": neo4j_config["password"]}
    done = _doctor("--neo4j", neo4j_config["uri"], "--db", str(tmp_path / "g.lbdb"), env=env)
    assert done.returncode == 0, done.stderr
    agent = neo4j_driver.get_server_info().agent  # e.g. Neo4j/5.26.x, asked independently of doctor
    flat = " ".join(done.stdout.split())
    assert f"reachable at {neo4j_config['uri']}, {agent}" in flat
    assert "all-MiniLM-L6-v2" in flat
    assert f"{tmp_path / 'g.lbdb'} (will be created on first store)" in flat


def test_doctor_says_why_neo4j_is_unreachable(tmp_path):
    done = _doctor("--neo4j", "bolt://127.0.0.1:1", "--db", str(tmp_path / "g.lbdb"))
    assert done.returncode == 0, done.stderr
    assert "cannot reach Neo4j at bolt://127.0.0.1:1" in " ".join(done.stdout.split())


def test_doctor_reads_the_embedded_store_and_counts_its_runs_by_status(tmp_path):
    from _pairs import planted_pairs, run_graph

    from headgraph.loader.ladybug_store import LadybugStore

    pairs, heads = planted_pairs()
    path = tmp_path / "g.lbdb"

    def stop_half_way(done, total):
        if done == total // 2:
            raise KeyboardInterrupt

    with LadybugStore(path) as store:
        store.store_run(run_graph(pairs, heads, {"id": "done", "model": "toy"}))
        try:
            store.store_run(run_graph(pairs, heads, {"id": "half", "model": "toy"}), batch_size=8,
                           after_batch=stop_half_way, cleanup_on_error=False)
        except KeyboardInterrupt:
            pass
    done = _doctor("--db", str(path))
    assert done.returncode == 0, done.stderr
    assert f"{path} (readable: 1 complete, 1 loading)" in " ".join(done.stdout.split())
