"""`headgraph sweep --ray` against a real Ray head started by the test on loopback (`ray start --head --block`,
its own processes, stopped by signalling that one process): the same store content as the local worker
processes, and a Ray worker killed mid-sweep (a real SIGKILL, which the worker of the chosen checkpoint sends
itself right after writing its run folder: tests/_doomed.py) leaves no run of its checkpoint while the other
tasks' runs are stored and the rerun completes the sweep. Needs the optional extra headgraph[ray], which
scripts/test installs."""

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from _commands import headgraph
from _doomed import doomed_worker_env
from _ports import unclaimed_port

from headgraph.loader.ladybug_store import LadybugStore

pytestmark = pytest.mark.slow  # a real Ray head and its workers
MODELS = ["induction-2l-step2000", "induction-2l-step3000", "induction-2l-step4000"]
SMALL = ["--no-report", "--null-heads", "8", "--reference-samples", "500", "--n-inputs", "16", "--causal-n", "8"]
VOLATILE = {"key", "run_id", "_label"}  # differ between two stores of the same content: ids and labels


class Cluster(NamedTuple):
    address: str  # HOST:PORT of the head
    doomed: Path  # write a checkpoint's name here to doom its worker (tests/_doomed.py)
    env: dict[str, str]  # what its clients add to their environment: the authentication token


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The Cluster of a two-CPU Ray head on 127.0.0.1 with token
    authentication and a token of its own (Ray 2.60 turns it on only where it finds a token, such as one a
    local `ray.init()` left in ~/.ray, so the test sets both, for the head and its clients); its workers carry
    the doomed-worker hook (tests/_doomed.py)."""
    port, log = unclaimed_port(), tmp_path_factory.mktemp("ray") / "head.log"
    ray_cli = Path(sys.executable).with_name("ray")
    doomed, hooks = doomed_worker_env(tmp_path_factory.mktemp("hooks"))
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # Ray starts its workers at nice 15, behind every other process: beside the suite's other workers they were
    # starved (the first test took 40 s alone, 331 s beside two busy processes), so this head's run at nice 0
    env = {**os.environ, **hooks, **auth, "OMP_NUM_THREADS": "1", "RAY_worker_niceness": "0"}
    with log.open("w") as out:
        head = subprocess.Popen([str(ray_cli), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                                 f"--ray-client-server-port={unclaimed_port()}", "--num-cpus=2",
                                 "--include-dashboard=false", "--disable-usage-stats", "--block"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 90
        while "--block" not in log.read_text() or "will now block" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield Cluster(f"127.0.0.1:{port}", doomed, {**auth, "OMP_NUM_THREADS": "1"})
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        head.wait(timeout=60)


def _content(db) -> dict:
    """Everything a store holds per step, without what names a particular store's rows (ids, keys)."""
    with LadybugStore(db, read_only=True) as store:
        runs = store.read("MATCH (r:Run) RETURN r.step AS step, r.model AS model, r.sweep AS sweep, r.status AS status, "
                          "r.n_heads AS heads, r.n_edges AS edges, r.policy AS policy, r.types AS types "
                          "ORDER BY step").records()
        heads = store.read("MATCH (r:Run) MATCH (h:Head) WHERE h.run_id = r.id RETURN r.step AS step, h AS head "
                           "ORDER BY step, h.layer, h.head").records()
        edges = store.read("MATCH (r:Run) MATCH (a:Head)-[e]->(:Head) WHERE a.run_id = r.id "
                           "RETURN r.step AS step, e AS edge ORDER BY step, e.kind, e.source, e.target").records()

    def strip(row):
        return {k: v for k, v in row.items() if k not in VOLATILE}

    return {"runs": runs, "heads": [(r["step"], strip(r["head"])) for r in heads],
            "edges": [(r["step"], strip(r["edge"])) for r in edges]}


def test_ray_tasks_store_what_local_workers_store(cluster, tmp_path):
    def sweep(where, *engine):
        done = headgraph("sweep", *MODELS[:2], *engine, "--db", str(tmp_path / f"{where}.lbdb"), "--out",
                         str(tmp_path / where), *SMALL, env=cluster.env, timeout=300)
        assert done.returncode == 0, done.stderr
        return _content(tmp_path / f"{where}.lbdb")

    # one torch thread per analysis in both: Ray tasks take one CPU, two local workers share the two cores
    on_ray, local = sweep("ray", "--ray", cluster.address), sweep("local", "--workers", "2")
    assert [r["step"] for r in on_ray["runs"]] == [2000, 3000] and on_ray["runs"] == local["runs"]
    assert len(on_ray["edges"]) == 96 and len(on_ray["heads"]) == 16
    assert on_ray["edges"] == local["edges"]  # every value, to the bit
    for (step, a), (same_step, b) in zip(on_ray["heads"], local["heads"], strict=True):
        floats = sorted(k for k, v in a.items() if isinstance(v, float))
        assert step == same_step and {k: v for k, v in a.items() if k not in floats} == {
            k: v for k, v in b.items() if k not in floats}
        # HITS (networkx through ARPACK, from a random start vector) differs in the last bit between processes
        assert [a[k] for k in floats] == pytest.approx([b[k] for k in floats], rel=1e-12, abs=1e-15)


def test_a_killed_ray_worker_leaves_no_run_of_its_checkpoint_and_the_rerun_completes(cluster, tmp_path):
    address, doomed, env = cluster.address, cluster.doomed, cluster.env
    args = ["sweep", *MODELS, "--ray", address, "--db", str(tmp_path / "s.lbdb"), "--out", str(tmp_path / "runs"),
            "--no-causal", "--no-roles", *SMALL[:5]]
    doomed.write_text(MODELS[1])  # its worker dies with SIGKILL right after writing the checkpoint's run folder
    try:
        done = headgraph(*args, env=env, timeout=300)
    finally:
        doomed.unlink()
    err = done.stderr
    assert done.returncode == 1, err
    assert any(p.name.startswith(MODELS[1]) for p in (tmp_path / "runs").iterdir()), err  # died after writing it
    assert "induction-2l-step3000 (step 3000): its Ray worker died before it finished" in err, err
    stored = sorted(line.split()[1] for line in err.splitlines() if line.startswith("stored "))
    assert stored == [MODELS[0], MODELS[2]], err  # a Ray task's death takes no other task with it
    with LadybugStore(tmp_path / "s.lbdb", read_only=True) as store:
        runs = store.read("MATCH (r:Run) RETURN r.id AS id, r.model AS model, r.status AS status").records()
        heads = {r["run"] for r in store.read("MATCH (h:Head) RETURN DISTINCT h.run_id AS run").records()}
    assert sorted(r["model"] for r in runs) == stored and {r["status"] for r in runs} == {"complete"}
    assert heads == {r["id"] for r in runs}  # no rows of a killed task's checkpoint
    rerun = headgraph(*args, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(MODELS)} checkpoints, {len(stored)} already stored" in rerun.stderr
    with LadybugStore(tmp_path / "s.lbdb", read_only=True) as store:
        after = store.read("MATCH (r:Run) RETURN r.id AS id, r.step AS step, r.status AS status ORDER BY step").records()
    assert [(r["step"], r["status"]) for r in after] == [(2000, "complete"), (3000, "complete"), (4000, "complete")]
    assert {r["id"] for r in runs} <= {r["id"] for r in after}


def test_a_client_without_the_clusters_token_is_one_line_exit_2_and_stores_nothing(cluster, tmp_path):
    env = {k: v for k, v in cluster.env.items() if k != "RAY_AUTH_TOKEN"}
    env["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "no-token")  # not ~/.ray/auth_token, which a local ray.init() writes
    done = headgraph("sweep", MODELS[0], "--ray", cluster.address, "--db", str(tmp_path / "s.lbdb"), "--out",
                     str(tmp_path / "runs"), *SMALL, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: cannot reach the Ray cluster at --ray {cluster.address}: "), done.stderr
    assert len(done.stderr.splitlines()) == 1 and "RAY_AUTH_TOKEN" in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "s.lbdb").exists()  # refused before any write


@pytest.mark.parametrize("given", ["HOST:PORT", "auto"])
def test_an_address_where_nothing_listens_is_one_line_exit_2_within_seconds_and_stores_nothing(tmp_path, given):
    """HOST:PORT itself, or found by "auto" in RAY_ADDRESS as Ray reads it: Ray's own client waits minutes for a
    GCS that is not there (the timeout here fails that wait)."""
    address = f"127.0.0.1:{unclaimed_port()}"  # nothing listens: the port is free and no server is given it
    argv = ["sweep", MODELS[0], "--ray", address if given == "HOST:PORT" else "auto", "--db", str(tmp_path / "s.lbdb"),
            "--out", str(tmp_path / "runs"), *SMALL]
    done = headgraph(*argv, env={"RAY_ADDRESS": address} if given == "auto" else None, timeout=60)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    where = address if given == "HOST:PORT" else "auto ("
    assert done.stderr.startswith(f"error: cannot reach the Ray cluster at --ray {where}"), done.stderr
    assert done.stderr.endswith(": nothing accepts connections there (Connection refused); is its head running "
                                "(ray start --head)?\n"), done.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "s.lbdb").exists()
