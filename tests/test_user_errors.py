"""User-caused conditions through the real CLI (`headgraph.cli.main`): each is one line on stderr and exit 2
(usage, model) or 3 (store), never an internal error; and 1-layer and 1-head models, which are valid models,
analysed end to end. Real model folders, a real LadybugDB file and the session's real Neo4j; the Neo4j lost
mid-load is the real server behind a TCP forwarder that the test cuts."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from _cli import run_cli
from _commands import headgraph
from _fast import PK, PK_ONLY_FLAGS, flags
from _pairs import HUB, planted_pairs, run_graph

from headgraph import __version__
from headgraph import queries as query_files
from headgraph.analysis.selection import SelectionPolicy
from headgraph.loader.ladybug_store import LadybugStore
from headgraph.testing.synthetic import random_gpt2_state, save_synthetic

FAST = flags({**PK, "causal": False})
QUICK = [*PK_ONLY_FLAGS, "--no-store", "--no-report"]
BIG_INT = "99999999999999999999"  # beyond int64


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def neo4j_env(neo4j_config, monkeypatch):
    """The CLI's Neo4j credentials for the session's server; returns its URI."""
    monkeypatch.setenv("NEO4J_USER", neo4j_config["user"])
    monkeypatch.setenv("NEO4J_PASSWORD", neo4j_config["password"])
    return neo4j_config["uri"]


# --- the console entry point: a real process, ended by os._exit after its atexit handlers -------------------

ENTRY = ("import atexit, pathlib, sys; from headgraph.cli import main; "
         "atexit.register(pathlib.Path(sys.argv.pop(1)).write_text, 'ran'); main()")
QUERIES = sorted(p.stem for p in Path(query_files.__file__).parent.glob("*.cypher"))


@pytest.mark.parametrize("argv, code", [(["--version"], 0), (["query", "--list"], 0), (["analyze", "--bogus"], 2)])
@pytest.mark.slow
def test_the_console_entry_point_exits_with_the_code_its_output_whole_and_its_atexit_handlers_run(argv, code,
                                                                                                  tmp_path):
    marker = tmp_path / "atexit"
    done = subprocess.run([sys.executable, "-c", ENTRY, str(marker), *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == code, done.stderr
    assert marker.read_text() == "ran"
    if argv == ["--version"]:
        assert done.stdout == f"headgraph, version {__version__}\n"
    elif code == 0:  # a 17 kB table, whole
        assert all(name in done.stdout for name in QUERIES) and done.stdout.endswith("\n")
    else:
        assert "No such option '--bogus'" in done.stderr


# --- models -------------------------------------------------------------------------------------------------


def test_all_zero_weights_are_bad_weights_naming_the_weight(tmp_path, capsys):
    zero = {name: torch.zeros_like(t) for name, t in random_gpt2_state(2, 4, 64, 128, 512).items()}
    folder = save_synthetic(tmp_path / "zero", weights=zero)
    code, _, err = run_cli(["analyze", str(folder), "--out", str(tmp_path / "r"), *QUICK], capsys)
    assert code == 2
    assert one_line(err) == "error: W_Q is zero in every head: the checkpoint holds no attention weights to compare"


def test_heads_with_zero_weights_still_analyse(tmp_path, capsys):
    state = random_gpt2_state(2, 4, 64, 128, 512)
    state["transformer.h.0.attn.c_proj.weight"] = torch.zeros(64, 64)  # W_O of every layer-0 head: OQ PK all 0
    folder = save_synthetic(tmp_path / "pruned", weights=state)
    code, _, err = run_cli(["analyze", str(folder), "--out", str(tmp_path / "r"), "--types", "oq", *QUICK], capsys)
    assert code == 0 and err == ""


def test_a_folder_without_tokenizer_files_analyses_without_roles_and_names_what_roles_miss(synthetic_dir, tmp_path,
                                                                                         capsys):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(synthetic_dir / name, folder / name)
    out = tmp_path / "r"
    code, _, err = run_cli(["analyze", str(folder), "--out", str(out), *FAST, "--n-inputs", "4", "--no-store",
                            "--no-report"], capsys)
    assert code == 2
    assert one_line(err) == (f"error: '{folder.resolve()}' has no tokenizer files (tokenizer.json, or e.g. vocab.json "
                             "+ merges.txt), which the role tests need: add them, or analyze with --no-roles")
    assert not out.exists()
    code, _, err = run_cli(["analyze", str(folder), "--out", str(out), *QUICK], capsys)
    assert code == 0 and err == "" and (out / "pairs.parquet").is_file()


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_folders_are_an_unsupported_architecture(kind, tmp_path, capsys):
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    from headgraph.loader.models import quiet

    if kind == "t5":
        config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                          num_heads=4)
        model, architecture = T5ForConditionalGeneration(config), "T5ForConditionalGeneration"
    else:
        config = BartConfig(vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                            max_position_embeddings=64)
        model, architecture = BartForConditionalGeneration(config), "BartForConditionalGeneration"
    with quiet():
        model.save_pretrained(str(tmp_path / kind))
    code, _, err = run_cli(["analyze", str(tmp_path / kind), "--out", str(tmp_path / "r"), *QUICK], capsys)
    assert code == 2
    assert one_line(err).startswith(f"error: unsupported architecture (encoder–decoder) {architecture} in ")


# --- options ------------------------------------------------------------------------------------------------


def test_an_overflowing_max_memory_is_a_bad_parameter(synthetic_dir, tmp_path, capsys):
    code, _, err = run_cli(["analyze", str(synthetic_dir), "--out", str(tmp_path / "r"), "--max-memory", "1e400"],
                           capsys)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("Error")]  # click's usage + hint + error
    assert errors == ["Error: Invalid value for '--max-memory': '1e400' is too large a size; give one like 2GiB, "
                      "512MB or 1000000000"], err
    assert "internal error" not in err and "Traceback" not in err


@pytest.mark.parametrize("args", [["runs", "--db", ""], ["runs", "--db", "  "],
                                  ["analyze", "MODEL", "--db", "", "--no-roles"]])
def test_an_empty_db_path_is_a_usage_error(args, synthetic_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default store would be ./headgraph.lbdb
    code, _, err = run_cli([str(synthetic_dir) if a == "MODEL" else a for a in args], capsys)
    assert code == 2
    assert one_line(err) == (f"error: --db {args[args.index('--db') + 1]!r} names no store: give the path of a "
                             "LadybugDB store, or leave --db out for HEADGRAPH_DB / ./headgraph.lbdb")
    assert list(tmp_path.iterdir()) == []


# --- Neo4j URIs and parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize("uri, detail", [
    ("http://127.0.0.1:7474", "headgraph talks Bolt: use one of bolt, bolt+s, bolt+ssc, neo4j, neo4j+s, neo4j+ssc"),
    ("bolt://:::::", "(Port could not be cast to integer value as '::::')"),
])
def test_a_neo4j_uri_that_is_not_bolt_is_one_line(uri, detail, capsys):
    code, _, err = run_cli(["runs", "--neo4j", uri], capsys)
    assert code == 3
    line = one_line(err)
    assert line.startswith(f"error: bad Neo4j URI {uri!r}") and detail in line


@pytest.fixture
def empty_ladybug(tmp_path):
    path = tmp_path / "empty.lbdb"
    LadybugStore(path).close()
    return str(path)


@pytest.mark.parametrize("store", [pytest.param("neo4j", marks=pytest.mark.neo4j), "ladybug"])
@pytest.mark.parametrize("args, message", [
    (["query", "hubs", "--param", f"limit={BIG_INT}"],
     f"error: bad value '{BIG_INT}' for parameter limit: expected int from 0 to 9223372036854775807"),
    (["query", "hubs", "--param", "limit=-1"],  # each store's own error otherwise (LIMIT -1), or no rows
     "error: bad value '-1' for parameter limit: expected int from 0 to 9223372036854775807"),
    (["query", "paths", "--param", "source=L0H0", "--param", "target=L1H1", "--param", "max_hops=-2"],
     "error: bad value '-2' for parameter max_hops: expected int from 0 to 9223372036854775807"),
    (["cypher", "RETURN $x AS x", "--param", f"x={BIG_INT}"],
     f"error: bad --param x={BIG_INT}: integers must lie from -9223372036854775808 to 9223372036854775807"),
    (["cypher", "RETURN $x AS x", "--param", f'x=[1, {{"a": -{BIG_INT}}}]'],
     f'error: bad --param x=[1, {{"a": -{BIG_INT}}}]: integers must lie from -9223372036854775808 to '
     "9223372036854775807"),
])
def test_an_integer_beyond_64_bits_or_a_negative_count_is_a_usage_error(store, args, message, request, capsys):
    where = ["--neo4j", request.getfixturevalue("neo4j_env")] if store == "neo4j" else \
        ["--db", request.getfixturevalue("empty_ladybug")]
    code, _, err = run_cli([*args, *where], capsys)
    assert code == 2
    assert one_line(err) == message


@pytest.fixture
def stored_run(tmp_path):
    path = tmp_path / "graph.lbdb"
    graph = run_graph(*planted_pairs(), {"id": "lower-case-types", "model": "toy"}, SelectionPolicy(20))
    with LadybugStore(path) as store:
        store.store_run(graph)
    return str(path)


@pytest.mark.parametrize("query", ["top-edges", "neighbors", "hubs", "in-class"])
def test_weight_pair_types_are_case_insensitive(query, stored_run, capsys):
    extra = ["--param", f"head={HUB}"] if query == "neighbors" else []
    rows = {}
    for types in ("ok,OV", "OK,OV"):
        code, out, err = run_cli(["query", query, "--db", stored_run, "--param", f"types={types}", *extra,
                                  "--format", "json"], capsys)
        assert code == 0, err
        rows[types] = json.loads(out)
    assert rows["ok,OV"] == rows["OK,OV"] and rows["OK,OV"]
    if query != "in-class":
        assert {r["kind"] for r in rows["OK,OV"]} <= {"OK", "OV"}


def test_an_unknown_weight_pair_type_is_one_line(stored_run, capsys):
    code, _, err = run_cli(["query", "top-edges", "--db", stored_run, "--param", "types=ok,zz"], capsys)
    assert code == 2
    assert one_line(err) == ("error: bad value 'ok,zz' for parameter types: not weight-pair types: ZZ (expected "
                             "some of QQ,QK,QV,QO,KQ,KK,KV,KO,VQ,VK,VV,VO,OQ,OK,OV,OO)")


# --- Neo4j lost mid-load ------------------------------------------------------------------------------------


class CuttableForwarder:
    """A TCP forwarder from a local port to the Neo4j server; once `cut_after` bytes went to the server it
    drops every connection and stops listening, as a server that stops does (connections refused)."""

    def __init__(self, upstream: tuple[str, int], cut_after: int):
        self.upstream, self.cut_after = upstream, cut_after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent, self.cut_at, self.sockets, self.lock = 0, None, [], threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self.lock:
                if self.cut_at is not None:
                    client.close()
                    server.close()
                    return
                self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, to_server: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                if to_server:
                    with self.lock:
                        self.sent += len(data)
                        due = self.sent >= self.cut_after and self.cut_at is None
                    if due:
                        self.cut()
                        return
                sink.sendall(data)
            except OSError:
                return

    def cut(self) -> None:
        with self.lock:
            self.cut_at = time.monotonic()
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            self.listener.close()
            for sock in self.sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


@pytest.mark.neo4j
@pytest.mark.slow
def test_neo4j_lost_mid_load_fails_within_15_s_with_one_line(neo4j_config, neo4j_driver, tmp_path):
    uri = neo4j_config["uri"]
    assert uri.startswith("bolt://"), "the forwarder needs a direct (bolt://) URI"
    host, port = uri.removeprefix("bolt://").rsplit(":", 1)
    name = f"cut-{uuid.uuid4().hex[:8]}"  # the run id starts with the model folder's name
    model = save_synthetic(tmp_path / name, n_layers=6, n_heads=8, d_model=64, d_head=8)
    # 15,360 edges (16 types x 960 pairs) are ~2.5 MB of Bolt; the schema, the Run and the heads ~30 kB
    forwarder = CuttableForwarder((host, int(port)), cut_after=300_000)
    env = {"NEO4J_USER": neo4j_config["user"], "NEO4J_PASSWORD": neo4j_config["password"]}
    try:
        done = headgraph("analyze", str(model), "--neo4j", f"bolt://127.0.0.1:{forwarder.port}", "--types", "all",
                         "--top-k", "0", *FAST, "--no-roles", "--no-report", "--out", str(tmp_path / "r"), env=env,
                         timeout=120)
        ended = time.monotonic()
        assert forwarder.cut_at is not None, done.stderr
        assert done.returncode == 3, done.stderr
        line = one_line(done.stderr)
        assert line.startswith(f"error: lost the connection to Neo4j at bolt://127.0.0.1:{forwarder.port}"), line
        assert ended - forwarder.cut_at <= 15, f"{ended - forwarder.cut_at:.1f} s from the cut to the error"
    finally:
        neo4j_driver.execute_query("MATCH (n) WHERE n.run_id STARTS WITH $name OR (n:Run AND n.id STARTS WITH $name) "
                                   "DETACH DELETE n", name=name, database_="neo4j")


# --- 1-layer and 1-head models ------------------------------------------------------------------------------


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("shape, edges", [({"n_layers": 1}, 0), ({"n_heads": 1, "d_model": 16, "d_head": 16}, 3)])
@pytest.mark.slow
def test_one_layer_and_one_head_models_are_analysed_end_to_end(shape, edges, tmp_path, capsys):
    model = save_synthetic(tmp_path / "m", **shape)
    db, out = str(tmp_path / "store.lbdb"), tmp_path / "r"
    code, _, err = run_cli(["analyze", str(model), "--out", str(out), *FAST, "--n-inputs", "4", "--db", db], capsys)
    assert code == 0 and err == "", err
    assert {"report.md", "report.html", "fig_kl_heatmap.png", "fig_roles.png"} <= {p.name for p in out.iterdir()}
    code, listed, err = run_cli(["runs", "--db", db, "--format", "json"], capsys)
    assert code == 0, err
    [run] = json.loads(listed)
    assert run["status"] == "complete" and run["edges"] == edges
    report = (out / "report.md").read_text()
    assert ("**No head pairs**: this model has a single layer" in report) == (shape.get("n_layers") == 1)


# --- run folders and store files ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["out", "db"])
def test_an_unwritable_run_folder_or_store_fails_before_the_work_and_creates_nothing(where, synthetic_dir, tmp_path,
                                                                                     capsys):
    # /proc refuses new files even to root, whom permission bits would not stop
    out, db = (("/proc/headgraph-run", tmp_path / "store.lbdb") if where == "out"
               else (tmp_path / "run", "/proc/headgraph.lbdb"))
    started = time.monotonic()
    code, _, err = run_cli(["analyze", str(synthetic_dir), *FAST, "--no-roles", "--out", str(out), "--db", str(db)],
                           capsys)
    line = one_line(err)
    if where == "out":
        assert code == 2 and line.startswith("error: cannot write the run folder /proc/headgraph-run")
    else:
        assert code == 3 and line == ("error: cannot create the embedded store /proc/headgraph.lbdb: /proc is not "
                                      "a writable folder")
    assert time.monotonic() - started < 10  # refused before the PK work, the null and the report
    assert list(tmp_path.iterdir()) == []


def test_a_failed_analyze_leaves_no_empty_store(synthetic_dir, tmp_path, capsys):
    model = tmp_path / "no-tokenizer"
    shutil.copytree(synthetic_dir, model, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*", "special*"))
    code, _, err = run_cli(["analyze", str(model), *FAST, "--out", str(tmp_path / "run"), "--db",
                            str(tmp_path / "store.lbdb")], capsys)
    assert code == 2 and "has no tokenizer files" in one_line(err)
    assert not (tmp_path / "store.lbdb").exists() and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_rerun_into_the_same_folder_keeps_nothing_of_the_earlier_run(synthetic_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(["analyze", str(synthetic_dir), *FAST, "--no-roles", "--no-store", "--out", str(out)], capsys)[0] == 0
    assert (out / "report.html").is_file() and list(out.glob("fig_*.svg"))
    code, _, err = run_cli(["analyze", str(synthetic_dir), *QUICK, "--out", str(out)], capsys)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["heads.parquet", "pairs.parquet", "run.json"]


@pytest.mark.parametrize("value, message", [
    ("0", "loss effects need at least 2 inputs per set, got --causal-loss-inputs 0"),
    ("-3", "loss effects need at least 2 inputs per set, got --causal-loss-inputs -3"),
    ("9", "--causal-loss-inputs 9 is more than the 4 causal inputs of a set: give at most that many, or raise --causal-n"),
])
def test_a_bad_causal_loss_inputs_is_one_line_and_stores_nothing(value, message, synthetic_dir, tmp_path, capsys):
    code, _, err = run_cli(["analyze", str(synthetic_dir), *flags(PK), "--no-roles", "--causal-n", "4",
                            "--causal-loss-inputs", value, "--out", str(tmp_path / "run"), "--db",
                            str(tmp_path / "store.lbdb")], capsys)
    assert code == 2 and one_line(err) == f"error: {message}"
    assert not (tmp_path / "store.lbdb").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["analyze", "roles"])
def test_a_negative_seed_is_a_usage_error_before_any_work(command, synthetic_dir, tmp_path, capsys):
    code, _, err = run_cli([command, str(synthetic_dir), "--seed", "-1", "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "Invalid value for '--seed': -1 is not in the range x>=0" in err
    assert not (tmp_path / "run").exists()


def test_the_python_api_refuses_a_negative_seed_naming_it(tmp_path):
    import headgraph
    from headgraph.analysis.roles import compute_roles
    from headgraph.errors import UsageError

    with pytest.raises(UsageError, match=r"^seed must be an integer >= 0, got -1$"):
        headgraph.analyze("induction-2l", seed=-1, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    with pytest.raises(UsageError, match=r"^seed must be an integer >= 0, got -2$"):
        compute_roles(object(), seed=-2)  # refused before the model is read


@pytest.mark.parametrize("args, message", [
    (["--max-q", "2"], "--max-q must lie in (0, 1] (got 2.0)"),
    (["--max-q", "0"], "--max-q must lie in (0, 1] (got 0.0)"),
    (["--min-z", "nan"], "--min-z must be a number (got nan)"),
    (["--min-effect", "nan"], "--min-effect must be a number (got nan)"),
])
def test_a_selection_threshold_out_of_its_range_is_one_line_before_any_work(args, message, synthetic_dir, tmp_path,
                                                                           capsys):
    code, _, err = run_cli(["analyze", str(synthetic_dir), *FAST, *args, "--out", str(tmp_path / "run"), "--db",
                            str(tmp_path / "store.lbdb")], capsys)
    assert code == 2 and one_line(err) == f"error: {message}"
    assert not (tmp_path / "run").exists() and not (tmp_path / "store.lbdb").exists()
