"""Crash consistency on real stores and real processes: `headgraph analyze` is killed with SIGKILL at moments
spread over its load (and over the clean-up of an earlier crash), then the store is read by real commands
(run in the test's own process: a reader other than the killed writer).

After every kill: reads work, no run shown complete holds fewer rows than it records (nor than the model's
pair count), and after the next command that opens the store for writing no earlier partial run is left.

The moment is chosen inside the doomed process: each `headgraph` command is a real process, forked from one
that has already imported headgraph (tests/_commands.py), running the real CLI with one store method wrapped so
that the process sends itself SIGKILL before, during (a timer thread while the call runs) or right after the
n-th call (or pauses there until told to go on). Nothing is mocked: the store files, the Neo4j server and the
processes are real."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from _commands import Command, headgraph
from click.testing import CliRunner

from headgraph.cli import cli
from headgraph.testing.synthetic import save_synthetic

pytestmark = pytest.mark.slow  # each test starts, kills or races real processes: seconds to minutes apiece

ANALYZE = ["--types", "all", "--top-k", "0", "--no-roles", "--no-causal", "--no-report", "--null-heads", "2",
           "--reference-samples", "100", "--processing", "raw"]
COUNTS = ("MATCH (r:Run) WHERE r.id STARTS WITH $prefix OPTIONAL MATCH (h:Head) WHERE h.run_id = r.id "
          "OPTIONAL MATCH (h)-[e]->(:Head) RETURN r.id AS id, count(DISTINCT h) AS heads, count(e) AS edges")


def pair_count(n_layers, n_heads, types=16):
    """Every ordered head pair from an earlier to a strictly later layer, for each of the 16 type pairs."""
    return types * n_heads**2 * n_layers * (n_layers - 1) // 2


def read(*args, env):
    """A reading command (runs, cypher, query) run in this test's process, a reader other than the killed
    writer: (exit code, stdout, stderr)."""
    result = CliRunner().invoke(cli, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr or repr(result.exception)


def analyze_killed_at(moment, model, store_args, out, env):
    """Run `headgraph analyze` that kills itself at `moment`; the exit must be SIGKILL (the moment was reached)."""
    process = headgraph("analyze", str(model), *ANALYZE, "--out", str(out), *store_args, env=env, moment=moment)
    assert process.returncode == -signal.SIGKILL, f"{moment}: exit {process.returncode}\n{process.stderr[-2000:]}"


def check_store(store_args, prefix, expected_heads, expected_edges, env):
    """Reads work; every complete run holds exactly what it records (and what the model implies); returns
    {run id: status} of this test's runs."""
    code, listed, err = read("runs", "--format", "json", *store_args, env=env)
    assert code == 0, err
    runs = {r["id"]: r for r in json.loads(listed) if r["id"].startswith(prefix)}
    code, counted, err = read("cypher", COUNTS, "--param", f"prefix={prefix}", "--format", "json", *store_args, env=env)
    assert code == 0, err
    stored = {r["id"]: (r["heads"], r["edges"]) for r in json.loads(counted)}
    for run_id, run in runs.items():
        if run["status"] == "complete":
            assert (run["heads"], run["edges"]) == (expected_heads, expected_edges)
            assert stored[run_id] == (expected_heads, expected_edges), run_id
    hubs = [r for r in runs.values() if r["status"] == "complete"]
    if hubs:
        code, found, err = read("query", "hubs", "--run", hubs[-1]["id"], "--format", "json", *store_args, env=env)
        assert code == 0 and len(json.loads(found)) > 0, err
    return {run_id: run["status"] for run_id, run in runs.items()}


def kill_and_check(moments, model, store_args, tmp_path, expected_heads, expected_edges, env):
    """Kill one analyze per moment; each next analyze must remove the partial runs found before it."""
    prefix = model.name
    partial = set()
    for i, moment in enumerate(moments):
        analyze_killed_at(moment, model, store_args, tmp_path / f"run{i}", env)
        statuses = check_store(store_args, prefix, expected_heads, expected_edges, env)
        left = partial & set(statuses)
        if "remove_abandoned_runs" not in moment:  # a crash of the clean-up itself leaves it to the next command
            assert not left, f"after {moment}: partial runs of earlier crashes still stored: {left}"
        partial = {run_id for run_id, status in statuses.items() if status != "complete"}
    finished = headgraph("analyze", str(model), *ANALYZE, "--out", str(tmp_path / "final"), *store_args, env=env)
    assert finished.returncode == 0, finished.stderr
    statuses = check_store(store_args, prefix, expected_heads, expected_edges, env)
    assert set(statuses.values()) == {"complete"} and not partial & set(statuses)


def test_kill_9_during_a_152k_edge_load_into_ladybug_loses_nothing_reported_done(tmp_path):
    model = save_synthetic(tmp_path / f"fault-{uuid.uuid4().hex[:6]}", n_layers=12, n_heads=12, d_model=192)
    store_args = ["--db", str(tmp_path / "graph.lbdb")]
    env = {**os.environ, "NEO4J_URI": ""}
    moments = [
        "_begin_run:1:after:load",
        "_write_edges:1:after:load",
        "_write_edges:14:during:load",
        "_write_edges:31:after:load",
        "_make_durable:1:before:_seal_run",  # all rows committed, none checkpointed
        "_make_durable:1:during:_seal_run",  # mid-checkpoint: readers find a pending recovery
        "_write:1:after:remove_abandoned_runs",  # clean-up of the previous crash, before its checkpoint
        "_make_durable:2:before:_seal_run",  # marked complete, not yet checkpointed
        "_make_durable:2:during:_seal_run",
    ]
    kill_and_check(moments, model, store_args, tmp_path, 144, pair_count(12, 12), env)


@pytest.mark.neo4j
def test_kill_9_during_a_neo4j_load_loses_nothing_reported_done(tmp_path, neo4j_config):
    model = save_synthetic(tmp_path / f"fault-{uuid.uuid4().hex[:6]}", n_layers=5, n_heads=8, d_model=128)
    store_args = ["--neo4j", neo4j_config["uri"], "--neo4j-user", neo4j_config["user"]]
    env = {**os.environ, "NEO4J_PASSWORD": neo4j_config["password"]}
    moments = [
        "_begin_run:1:after:load",
        "_write_edges:3:during:load",
        "_write_edges:9:after:load",
        "_write_count:1:after:remove_abandoned_runs",  # clean-up of the previous crash, half done
        "_write_count:1:before:_seal_run",  # every row committed, not yet marked complete
        "_write_count:1:after:_seal_run",  # marked complete
    ]
    try:
        kill_and_check(moments, model, store_args, tmp_path, 40, pair_count(5, 8), env)
    finally:
        listed = json.loads(read("runs", "--format", "json", *store_args, env=env)[1])
        for run in listed:
            if run["id"].startswith(model.name):
                headgraph("runs", "delete", run["id"], *store_args, env=env)


INTERRUPT_IN_REPORT = r"""
import os, signal, sys

from headgraph.cli import main
from headgraph.report import figures, report

signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's job gets Ctrl-C, also where this test's
when, leader = sys.argv[1], os.getpid()                   # runner inherited SIGINT ignored (a background job)
render, save = report.render_report, figures.save_figure

def before_the_report(*args, **kwargs):
    os.kill(leader, signal.SIGINT)  # Ctrl-C as the report starts
    return render(*args, **kwargs)

def while_figures_are_drawn(fig, out_dir, stem):
    if stem == "fig_kl_heatmap":  # in a figure worker: Ctrl-C at a terminal reaches the whole process group
        os.killpg(leader, signal.SIGINT)
    return save(fig, out_dir, stem)

def as_a_figure_worker_forks(*args, **kwargs):
    sent = []

    def ctrl_c():  # in fork(), before the process splits: Python runs it as an at-fork handler
        if not sent:
            sent.append(os.kill(leader, signal.SIGINT))

    os.register_at_fork(before=ctrl_c)
    return render(*args, **kwargs)

if when == "report":
    report.render_report = before_the_report
elif when == "fork":
    report.render_report = as_a_figure_worker_forks
else:
    figures.save_figure = while_figures_are_drawn
main(sys.argv[2:])
"""


@pytest.mark.parametrize("when", ["report", "fork", "figures"])
def test_ctrl_c_during_the_report_stores_no_run_and_leaves_no_process(tmp_path, synthetic_dir, when):
    from _pairs import planted_pairs, run_graph

    from headgraph.loader.ladybug_store import LadybugStore

    path = tmp_path / "graph.lbdb"
    with LadybugStore(path) as store:
        store.store_run(run_graph(*planted_pairs(), {"id": "earlier", "model": "toy"}))
    env = {**os.environ, "NEO4J_URI": ""}
    process = subprocess.Popen([sys.executable, "-c", INTERRUPT_IN_REPORT, when, "analyze", str(synthetic_dir),
                                "--no-roles", "--no-causal", "--null-heads", "2", "--reference-samples", "100",
                                "--out", str(tmp_path / "run"), "--db", str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)  # its own process group, as a terminal's job
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130 and stderr.strip().splitlines()[-1] == "aborted", stderr
    assert "Traceback" not in stderr and "Process ForkPoolWorker" not in stderr, stderr
    with pytest.raises(ProcessLookupError):  # no figure worker outlives the command
        os.killpg(process.pid, 0)
    assert [run["id"] for run in json.loads(read("runs", "--format", "json", "--db", str(path), env=env)[1])] == [
        "earlier"]


KILLED_WHILE_FIGURES_ARE_DRAWN = r"""
import os, signal, sys, time

from headgraph.cli import main
from headgraph.report import figures

leader, draw = os.getpid(), figures.kl_heatmap

def drawn_past_the_kill(*args, **kwargs):
    os.kill(leader, signal.SIGKILL)  # in a figure worker
    time.sleep(300)
    return draw(*args, **kwargs)

figures.kl_heatmap = drawn_past_the_kill
main(sys.argv[1:])
"""


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def test_kill_9_while_figures_are_drawn_leaves_no_figure_worker(tmp_path, synthetic_dir):
    process = subprocess.Popen([sys.executable, "-c", KILLED_WHILE_FIGURES_ARE_DRAWN, "analyze", str(synthetic_dir),
                                "--no-roles", "--no-causal", "--null-heads", "2", "--reference-samples", "100",
                                "--out", str(tmp_path / "run"), "--no-store"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "NEO4J_URI": ""}, start_new_session=True)
    # the workers hold the pipes open: the output ends before the timeout only if they died with the command
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGKILL, stderr
    deadline = time.monotonic() + 30  # a worker killed with its parent is gone once init has reaped it
    while _group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(process.pid), "a figure worker outlived its killed command"


@pytest.mark.neo4j
def test_runs_delete_refuses_a_run_a_live_writer_is_still_storing(tmp_path, synthetic_dir, neo4j_config):
    store_args = ["--neo4j", neo4j_config["uri"], "--neo4j-user", neo4j_config["user"]]
    env = {**os.environ, "NEO4J_PASSWORD": neo4j_config["password"]}
    writer = Command("analyze", str(synthetic_dir), *ANALYZE, "--out", str(tmp_path / "run"), *store_args, env=env,
                     moment="_write_edges:1:pause:load")
    try:
        assert writer.paused()
        run_id = json.loads((tmp_path / "run" / "run.json").read_text())["id"]
        refused = headgraph("runs", "delete", run_id, *store_args, env=env)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr == f"error: run {run_id} is still being stored by pid {writer.pid} on {os.uname().nodename}; wait for it to finish\n"
        other = headgraph("analyze", str(synthetic_dir), *ANALYZE, "--out", str(tmp_path / "other"), *store_args, env=env)
        assert other.returncode == 0, other.stderr  # a second writer's clean-up leaves the live one alone
        writer.go_on()
        assert writer.wait(timeout=120).returncode == 0
    finally:
        writer.kill()
    listed = {r["id"]: r for r in json.loads(read("runs", "--format", "json", *store_args, env=env)[1])}
    assert listed[run_id]["status"] == "complete" and listed[run_id]["edges"] == pair_count(2, 4)
    for name in (run_id, json.loads((tmp_path / "other" / "run.json").read_text())["id"]):
        assert headgraph("runs", "delete", name, *store_args, env=env).returncode == 0


WRITER = r"""
import sys, time

sys.path.insert(0, sys.argv[2])
from _pairs import planted_pairs, run_graph

from headgraph.analysis.selection import SelectionPolicy
from headgraph.loader.ladybug_store import LadybugStore

pairs, heads = planted_pairs(n_layers=12, n_heads=12, types=[s + t for s in "QKVO" for t in "QKVO"])
graph = run_graph(pairs, heads, {"id": "busy", "model": "toy"}, SelectionPolicy(top_k=None))
with LadybugStore(sys.argv[1]) as store:
    print("writing", flush=True)
    deadline = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < deadline:  # each load: delete + checkpoint, load, checkpoint, mark, checkpoint
        store.store_run(graph)
"""


def test_readers_never_fail_while_a_live_writer_loads_and_checkpoints(tmp_path):
    from headgraph.loader.ladybug_store import LadybugStore

    path = tmp_path / "graph.lbdb"
    LadybugStore(path).close()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), os.path.dirname(__file__), "12"],
                              stdout=subprocess.PIPE, text=True)
    reads, complete = 0, 0
    try:
        assert writer.stdout.readline().strip() == "writing"
        while writer.poll() is None:
            with LadybugStore(path, read_only=True) as reader:  # raises StoreUnavailable if a read fails
                complete += [r["status"] for r in reader.runs()].count("complete")
            reads += 1
    finally:
        writer.kill() if writer.poll() is None else None
        assert writer.wait(timeout=60) == 0
    assert reads > 20 and complete > 0
