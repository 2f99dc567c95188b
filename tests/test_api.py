"""The Python API (headgraph.analyze / load_run / Run) on the shipped induction-2l model: the same PK from its
folder, from the model loaded by transformers and from a TransformerBridge; the networkx graph holds exactly the
selected edges with their properties; saved, stored and re-selected runs read back equal; figures, the Jupyter
summary and bad options."""

import dataclasses
import io
import subprocess
import sys
from pathlib import Path

import _fast
import matplotlib.figure
import networkx as nx
import pandas as pd
import pytest
import torch

import headgraph
from headgraph.errors import ModelUnavailable, UsageError
from headgraph.loader.models import PACKAGED_MODELS_DIR
from headgraph.analysis.selection import SelectionPolicy
from headgraph.loader.open_store import StoreSpec
from headgraph.report.report import FIGURES

MODEL = PACKAGED_MODELS_DIR / "induction-2l"
ON_CPU = {"device": "cpu", "progress": False}  # the same PK on every run of this module, whatever the machine
PK_ONLY = {**ON_CPU, **_fast.PK_ONLY}
TOP_K = 5  # the shared analysis's selection (conftest)


def top_k_by_pk(pairs: pd.DataFrame, k: int) -> pd.DataFrame:
    """The k strongest pairs per kind with their PK rank among all pairs of the kind, by hand (not select_edges)."""
    table = pairs.assign(kind=pairs["source_type"] + pairs["target_type"])
    table["rank"] = table.groupby("kind")["pk"].rank(ascending=False, method="first").astype(int)
    return table[table["rank"] <= k]


@pytest.fixture
def run(induction_run):
    """The session's analysis of induction-2l through the API (conftest): roles, causal effects, its report.
    Its readers are marked slow: that one analysis takes 20-50 s."""
    return induction_run


@pytest.fixture(scope="module")
def pk_only(tmp_path_factory):
    """The PK alone of induction-2l, analysed from its folder."""
    return headgraph.analyze(MODEL, out=tmp_path_factory.mktemp("api") / "pk", **PK_ONLY)


def pk_table(run) -> pd.DataFrame:
    return run.pairs.set_index(["source", "target", "source_type", "target_type"])["pk"].sort_index()


@pytest.mark.slow
def test_pk_is_identical_from_the_folder_the_loaded_model_and_a_bridge(pk_only, tmp_path):
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModel, AutoModelForCausalLM

    lm_head_model = AutoModelForCausalLM.from_pretrained(MODEL)
    weights_before = {k: v.clone() for k, v in lm_head_model.state_dict().items()}
    base_model = AutoModel.from_pretrained(MODEL)  # no LM head: placed into the class the bridge expects
    bridge = TransformerBridge.boot_transformers(str(MODEL), device="cpu")
    from_folder = pk_table(pk_only)
    assert len(from_folder) == 3 * 16 and from_folder.notna().all()
    for name, model in {"lm_head": lm_head_model, "base": base_model, "bridge": bridge}.items():
        loaded = headgraph.analyze(model, out=tmp_path / name, **PK_ONLY)
        assert loaded.model == "induction-2l"
        pd.testing.assert_series_equal(pk_table(loaded), from_folder, check_exact=True)
    # the caller's objects are left as they were: weights, attention implementation, unprocessed bridge
    assert all(torch.equal(v, lm_head_model.state_dict()[k]) for k, v in weights_before.items())
    assert lm_head_model.config._attn_implementation == "sdpa" and not bridge.compatibility_mode


@pytest.mark.slow
def test_a_model_without_its_tokenizer_needs_tokenizer(pk_only, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

    config = AutoConfig.from_pretrained(MODEL)
    config._name_or_path = ""  # built in memory: nothing names where a tokenizer lies
    model = GPT2LMHeadModel(config)
    model.load_state_dict(AutoModelForCausalLM.from_pretrained(MODEL).state_dict())
    with pytest.raises(ModelUnavailable, match="no tokenizer found for 'GPT2LMHeadModel'.*pass tokenizer="):
        headgraph.analyze(model, out=tmp_path / "none", **PK_ONLY)
    given = headgraph.analyze(model, tokenizer=AutoTokenizer.from_pretrained(MODEL), out=tmp_path / "given", **PK_ONLY)
    assert given.record.model.source == "GPT2LMHeadModel in memory"
    pd.testing.assert_series_equal(pk_table(given), pk_table(pk_only), check_exact=True)


def test_a_decoder_base_model_with_an_untied_head_is_refused(tmp_path):
    from transformers import AutoModel

    base = AutoModel.from_pretrained(MODEL)
    base.config.tie_word_embeddings = False  # its LM head would be random, and the loss effects with it
    with pytest.raises(UsageError, match="GPT2Model has no LM head.*AutoModelForCausalLM"):
        headgraph.analyze(base, out=tmp_path / "run", **PK_ONLY)


@pytest.mark.slow
def test_the_graph_holds_exactly_the_selected_edges_with_every_property(run):
    expected = top_k_by_pk(run.pairs, TOP_K)
    graph = run.graph
    assert isinstance(graph, nx.DiGraph) and graph.is_multigraph()
    assert sorted(graph.edges(keys=True)) == sorted(zip(expected["source"], expected["target"], expected["kind"]))
    for row in expected.to_dict("records"):
        attributes = graph.edges[row["source"], row["target"], row["kind"]]
        present = {k: v for k, v in row.items() if k not in ("source", "target") and not pd.isna(v)}
        assert attributes == present
    assert set(graph.nodes) == set(run.heads["head"])
    induction = set(run.heads.loc[run.heads["induction_sig"], "head"])
    assert {h for h, roles in graph.nodes(data="roles") if "induction" in roles} == induction
    assert graph.nodes["L0H2"]["out_degree"] == int((expected["source"] == "L0H2").sum())


@pytest.mark.slow
def test_causal_effects_reach_the_edges_and_single_out_the_circuit(run):
    assert run.record.causal is not None and "skipped" not in run.record.causal
    ok = run.pairs[(run.pairs["source_type"] == "O") & (run.pairs["target_type"] == "K")]
    assert ok["effect"].notna().all()
    circuit = ok["source"].eq("L0H2")  # the previous-token head feeds every induction head through K
    assert ok.loc[circuit, "effect"].min() > ok.loc[~circuit, "effect"].max()
    strongest = run.edges[run.edges["kind"] == "OK"].nlargest(4, "effect")
    assert set(strongest["source"]) == {"L0H2"}
    assert all("effect_loss" in run.graph.edges[s, t, "OK"] for s, t in zip(strongest["source"], strongest["target"]))


@pytest.mark.slow
def test_load_run_of_a_saved_run_equals_the_original(run, tmp_path):
    again = headgraph.load_run(run.path)
    assert again.record == run.record
    saved = run.save(tmp_path / "copy")
    loaded = headgraph.load_run(tmp_path / "copy")
    assert loaded.record == saved.record
    assert loaded.record.out_dir == str((tmp_path / "copy").resolve()) and loaded.id == run.id
    assert dataclasses.replace(loaded.record, out_dir=run.record.out_dir) == run.record
    for table in ("pairs", "heads"):
        pd.testing.assert_frame_equal(getattr(loaded, table), getattr(run, table), check_exact=True)
    assert loaded.policy == run.policy  # read back from the record's selection
    pd.testing.assert_frame_equal(loaded.edges, run.edges, check_exact=True)
    run.select(top_k=2, max_q=0.5).save(tmp_path / "fewer")
    assert headgraph.load_run(tmp_path / "fewer").policy == SelectionPolicy(top_k=2, max_q=0.5)
    assert headgraph.load_run(tmp_path / "fewer", policy=SelectionPolicy(top_k=1)).record.selection == \
        "top 1 per type by PK"


def test_a_selection_headgraph_did_not_write_is_refused():
    with pytest.raises(UsageError, match="selection 'top five' is not one headgraph writes"):
        SelectionPolicy.parse("top five")
    with pytest.raises(UsageError, match="no rule 'pk >= 3'"):
        SelectionPolicy.parse("pk >= 3, then top 5 per type by PK")


@pytest.mark.slow
def test_select_reselects_without_recomputing(run, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("select() must not load a model or compute PK")

    monkeypatch.setattr("headgraph.loader.models.load_model", refuse)
    monkeypatch.setattr("headgraph.pipeline.run_pk", refuse)  # the PK of compute_pk and of analyze
    fewer = run.select(top_k=2)
    expected = top_k_by_pk(run.pairs, 2)
    assert sorted(fewer.graph.edges(keys=True)) == sorted(zip(expected["source"], expected["target"], expected["kind"]))
    assert fewer.record.selection == "top 2 per type by PK" and fewer.pairs is run.pairs
    assert len(run.edges) == 3 * TOP_K  # the original keeps its own selection
    strict = run.select(SelectionPolicy(top_k=None, max_q=0.05))
    assert (strict.edges["q_model"] <= 0.05).all() and len(strict.edges) == int((run.pairs["q_model"] <= 0.05).sum())


@pytest.mark.slow
def test_hubs_rank_heads_by_degree_in_the_selection(run):
    degree = pd.concat([run.edges["source"], run.edges["target"]]).value_counts()
    hubs = run.hubs(3)
    assert len(hubs) == 3 and list(hubs["degree"]) == sorted(degree.values, reverse=True)[:3]
    assert all(degree[head] == d for head, d in hubs["degree"].items())
    assert list(run.hubs(12).index)[:3] == list(hubs.index) and len(run.hubs(12)) == 8


@pytest.mark.parametrize("name", FIGURES)
@pytest.mark.slow
def test_plot_returns_the_figure_the_report_drew(run, name):
    fig = run.plot(name)
    assert isinstance(fig, matplotlib.figure.Figure) and fig.axes
    drawn = io.BytesIO()
    fig.savefig(drawn, format="png", dpi=150, bbox_inches="tight")  # as the report saves it
    assert drawn.getvalue() == (run.path / f"fig_{name}.png").read_bytes()


@pytest.mark.slow
def test_plot_names_its_choices_and_the_missing_data(run, pk_only):
    with pytest.raises(UsageError, match="unknown figure 'kl'.*pk_distributions, kl_heatmap"):
        run.plot("kl")
    with pytest.raises(UsageError, match="no data for the 'causal' figure"):
        pk_only.plot("causal")


@pytest.mark.slow
def test_repr_html_shows_model_id_and_top_hubs(run):
    text = run._repr_html_()
    degree = pd.concat([run.edges["source"], run.edges["target"]]).value_counts()
    top = degree[degree == degree.max()].index
    assert "induction-2l" in text and run.id in text and all(f"{h}: degree {degree.max()}" in text for h in top)
    assert len(text) < 4000 and "causal effects computed" in text


@pytest.mark.slow
def test_to_store_and_load_run_by_id_round_trip(run, tmp_path):
    db = tmp_path / "graph.lbdb"
    assert "LadybugDB" in run.to_store(db)
    with StoreSpec(db=str(db)).open(read_only=True) as store:
        rows = store.read("MATCH (r:Run {id: $id}) RETURN r.n_edges, r.status", {"id": run.id}).rows
    assert [list(row) for row in rows] == [[len(run.edges), "complete"]]
    loaded = headgraph.load_run(run.id, store=db)
    assert loaded.record == run.record
    pd.testing.assert_frame_equal(loaded.pairs, run.pairs, check_exact=True)
    with pytest.raises(UsageError, match="neither a run folder nor a run id"):
        headgraph.load_run("no-such-run", store=db)


def test_unknown_and_conflicting_options_stop_before_any_work(monkeypatch):
    monkeypatch.setattr("headgraph.workflow.run_analyze", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(UsageError, match=r"unknown option 'topk' \(did you mean top_k\?\)"):
        headgraph.analyze("induction-2l", topk=3)
    with pytest.raises(UsageError, match="roles_n_inputs given with roles=False"):
        headgraph.analyze("induction-2l", roles=False, roles_n_inputs=5)
    with pytest.raises(UsageError, match="store=3 is not a store"):
        headgraph.analyze("induction-2l", store=3)
    with pytest.raises(UsageError, match=r"causal_loss_edges=0 \(no loss effects\) given with causal_loss=True"):
        headgraph.analyze("induction-2l", causal_loss=True, causal_loss_edges=0)
    with pytest.raises(UsageError, match="causal_loss_edges=5 given with causal_loss=False: drop one"):
        headgraph.analyze("induction-2l", causal_loss=False, causal_loss_edges=5)


def test_the_cli_flags_and_the_api_keywords_ask_for_the_same_analysis(monkeypatch):
    """One translator of flat names: the CLI's --causal-loss-edges 0 is the API's causal_loss=False, and the
    CLI's defaults and flags are the API's keywords (what `headgraph analyze` hands the orchestrator, caught)."""
    from click.testing import CliRunner

    from headgraph.cli import cli
    from headgraph.settings import analyze_options

    asked = []

    def caught(model, options, **kwargs):
        asked.append(options)
        raise SystemExit(0)

    monkeypatch.setattr("headgraph.workflow.run_analyze", caught)

    def cli_options(*flags):
        done = CliRunner().invoke(cli, ["analyze", "induction-2l", *flags])
        assert done.exit_code == 0, done.output
        return asked.pop()

    for keywords in (_fast.FAST, _fast.PK_ONLY):  # the tests' fast settings mean the same either way
        assert cli_options(*_fast.flags(keywords), "--no-store", "--no-report") == analyze_options(**keywords)
    no_loss = cli_options("--causal-loss-edges", "0", "--no-store", "--no-report")
    assert no_loss == analyze_options(causal_loss=False) and no_loss.causal.loss is False
    assert cli_options() == analyze_options(store=True, report=True)
    assert cli_options("--types", "all", "--top-k", "0", "--max-q", "0.1", "--no-roles", "--causal-n", "5",
                       "--seed", "3", "--out", "there", "--db", "g.lbdb", "--stability", "--full-matrix") == \
        analyze_options(types="all", top_k=None, max_q=0.1, roles=False, causal_n_inputs=5, seed=3, out="there",
                        store="g.lbdb", report=True, stability=True, full_matrix=True)


def test_import_headgraph_and_its_api_load_no_torch():
    code = "import sys, headgraph; headgraph.Run; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_the_quickstart_notebook_runs(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(Path(__file__).parents[1] / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # a figure was drawn
    assert any("L0H2" in o.get("data", {}).get("text/html", "") for o in outputs)  # the run's summary and hubs
    assert (tmp_path / "runs").is_dir()  # the default run folder, under the notebook's working directory
