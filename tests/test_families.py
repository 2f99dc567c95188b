"""The family matrix: every family of headgraph.testing.families (tiny random-init checkpoints written by
transformers) through the whole default analyze of the Python API, fast settings: the pair counts of each
type from the layers, query heads and key/value heads written by hand below, KV-native head names on
grouped-query models, PK inside its bounds [0, d_head], every role of the model kind tested, and a local causal
effect with its interval on every OQ/OK/OV pair, the report and a complete stored run. TransformerLens'
processed weights are checked against transformers' own forward pass, family by family, and `headgraph doctor`'s
family rows against what ran."""

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

import headgraph
from headgraph import doctor
from headgraph.loader.ladybug_store import LadybugStore
from headgraph.loader.models import load_model
from headgraph.report.report import FIGURES
from headgraph.testing.families import D_HEAD, FAMILIES
from headgraph.testing.synthetic import save_tokenizer

pytestmark = pytest.mark.slow

# (layers, query heads, key/value heads) of each family, by hand from headgraph.testing.families' docstring
SHAPES = {
    "gpt2": (2, 4, 4), "opt": (2, 4, 4), "bert": (2, 4, 4), "roberta": (2, 4, 4), "llama": (2, 4, 2),
    "llama-mqa": (2, 4, 1), "qwen2": (2, 4, 2), "qwen3": (2, 4, 2), "mistral": (2, 4, 2), "gemma2": (2, 4, 2),
    "gemma3": (3, 4, 2), "pythia": (2, 4, 4), "phi3": (2, 4, 2), "olmo2": (2, 4, 4), "gptj": (2, 4, 4),
    "phi2": (2, 4, 4), "bloom": (2, 4, 4), "mpt": (2, 4, 4), "falcon": (2, 4, 1),
}
ENCODERS = {"bert", "roberta"}
DECODER_ROLES = {"identity", "previous_token", "bos", "duplicate_token", "induction"}
ENCODER_ROLES = {"identity", "local", "delimiter", "cls", "sep", "block", "block_entropy", "syntactic_nsubj",
                 "syntactic_dobj", "syntactic_amod", "syntactic_advmod", "syntactic"}
# loss effects (the slowest part of a causal run on these families) are left to tests/test_causal_families.py
FAST = {"device": "cpu", "progress": False, "reference_samples": 200, "null_heads": 4, "roles_n_inputs": 4,
        "causal_n_inputs": 2, "causal_n_boot": 20, "causal_loss": False}


@pytest.fixture(scope="module")
def runs(family_dirs, tmp_path_factory):
    """{family: its run}, each family analysed once, on first use (a failure too: each test of the family
    raises it again)."""
    done = {}

    def run_of(name):
        if name not in done:
            try:
                work = tmp_path_factory.mktemp(name)
                done[name] = headgraph.analyze(family_dirs[name], out=work / "run", store=str(work / "graph.lbdb"),
                                               report=True, **FAST)
            except Exception as e:  # noqa: BLE001 - reported by every test that reads the run
                done[name] = e
        if isinstance(done[name], Exception):
            raise done[name]
        return done[name]

    return run_of


def test_every_family_is_in_the_matrix():
    assert set(FAMILIES) == set(SHAPES)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_checkpoint_has_the_shape_written_here(family_dirs, name):
    config = AutoConfig.from_pretrained(family_dirs[name])
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    assert (config.num_hidden_layers, config.num_attention_heads, kv) == SHAPES[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_tl_processing_computes_the_attention_and_logits_transformers_computes(family_dirs, name):
    """TransformerLens' processed weights (folded norms, centred writers) run the model transformers runs: the
    same attention patterns, and logits equal up to a constant per position (the centred unembedding)."""
    model = load_model(family_dirs[name], processing="tl", device="cpu")
    reference = (AutoModelForMaskedLM if name in ENCODERS else AutoModelForCausalLM).from_pretrained(
        family_dirs[name], attn_implementation="eager").eval()
    ids = torch.randint(5, 500, (2, 40), generator=torch.Generator().manual_seed(0))  # longer than the windows
    with torch.no_grad():
        expected = reference(ids, output_attentions=True)
        logits, cache = model.bridge.run_with_cache(ids)
    for layer, pattern in enumerate(expected.attentions):
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_pattern"], pattern, rtol=0, atol=2e-6)
    centred = expected.logits - expected.logits.mean(-1, keepdim=True)
    assert centred.abs().max() > 0.1
    torch.testing.assert_close(logits - logits.mean(-1, keepdim=True), centred, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_pairs_of_every_type_with_kv_native_heads(runs, name):
    run = runs(name)
    layers, heads, kv = SHAPES[name]
    later = layers * (layers - 1) // 2  # (source layer, later target layer) pairs
    counts = (run.pairs.source_type + run.pairs.target_type).value_counts().to_dict()
    assert counts == {"OQ": later * heads * heads, "OK": later * heads * kv, "OV": later * heads * kv}
    expected_kv = {f"L{layer}KV{g}" if kv < heads else f"L{layer}H{g}" for layer in range(1, layers)
                   for g in range(kv)}
    for target in ("K", "V"):
        assert set(run.pairs.loc[run.pairs.target_type == target, "target"]) == expected_kv
    assert set(run.pairs.loc[run.pairs.target_type == "Q", "target"]) == {
        f"L{layer}H{h}" for layer in range(1, layers) for h in range(heads)}


@pytest.mark.parametrize("name", FAMILIES)
def test_pk_is_finite_and_inside_its_bounds(runs, name):
    pk = runs(name).pairs["pk"].to_numpy()
    assert np.isfinite(pk).all() and (pk >= 0).all() and (pk <= D_HEAD + 1e-4).all()
    assert pk.std() > 0  # random heads: not all pairs alike


@pytest.mark.parametrize("name", FAMILIES)
def test_every_role_of_the_model_kind_is_tested(runs, name):
    run = runs(name)
    layers, heads, _ = SHAPES[name]
    expected = ENCODER_ROLES if name in ENCODERS else DECODER_ROLES
    assert set(run.record.roles.roles) == expected and run.record.roles.skipped_roles is None
    assert len(run.heads) == layers * heads
    for role in expected:
        assert run.heads[f"{role}_p"].between(0, 1).all(), role
        score = "identity_bias" if role == "identity" else f"{role}_score"
        assert np.isfinite(run.heads[score].to_numpy(dtype=float)).all(), role
    assert np.isfinite(run.heads["identity_score"].to_numpy(dtype=float)).all()


def test_an_encoder_tokenizer_without_cls_and_sep_skips_their_roles_and_says_why(family_dirs, tmp_path):
    folder = shutil.copytree(family_dirs["bert"], tmp_path / "bert-bpe")
    for old in folder.iterdir():
        if old.name not in ("config.json", "model.safetensors"):
            old.unlink()
    save_tokenizer(folder, 512)  # the byte-level BPE of the decoders: no [CLS], no [SEP]
    run = headgraph.analyze(folder, out=tmp_path / "run", causal=False,
                            **{k: v for k, v in FAST.items() if not k.startswith("causal_")})
    skipped = {"cls": "the tokenizer has no cls_token", "sep": "the tokenizer has no sep_token",
               "delimiter": "the tokenizer's sentence pairs contain neither a cls_token nor a sep_token"}
    assert run.record.roles.skipped_roles == skipped
    assert json.loads((run.path / "run.json").read_text())["roles"]["skipped_roles"] == skipped
    assert set(run.record.roles.roles) == ENCODER_ROLES - set(skipped)
    assert not [c for c in run.heads.columns if c.split("_")[0] in skipped]
    assert run.heads["block_sig"].notna().all()


@pytest.mark.parametrize("name", FAMILIES)
def test_causal_effects_of_every_oq_ok_ov_pair(runs, name):
    run = runs(name)
    assert run.record.causal and "skipped" not in run.record.causal, run.record.causal
    pairs = run.pairs
    effect, lo, hi = (pairs[c].to_numpy(dtype=float) for c in ("effect", "effect_lo", "effect_hi"))
    assert np.isfinite(effect).all() and (effect >= 0).all() and effect.max() > 0
    assert (lo <= effect + 1e-12).all() and (effect <= hi + 1e-12).all()


@pytest.mark.parametrize("name", FAMILIES)
def test_the_report_is_written_and_the_run_stored_complete(runs, name):
    """The default analyze's last two stages: the report (markdown, the interactive page, every figure) and the
    store, whose run is complete and holds the heads and the selected edges it records."""
    run = runs(name)
    assert {"report.md", "report.html"} <= {p.name for p in run.path.iterdir()}
    assert {p.stem for p in run.path.glob("fig_*.png")} == {f"fig_{plot}" for plot in FIGURES}
    with LadybugStore(run.path.parent / "graph.lbdb", read_only=True) as store:
        (recorded,) = store.read("MATCH (r:Run {id: $id}) RETURN r.status AS status, r.n_heads AS heads, "
                                 "r.n_edges AS edges", {"id": run.id}).records()
        (heads,) = store.read("MATCH (h:Head) WHERE h.run_id = $id RETURN count(h) AS n", {"id": run.id}).records()
        (edges,) = store.read("MATCH (a:Head)-[e]->(:Head) WHERE a.run_id = $id RETURN count(e) AS n",
                              {"id": run.id}).records()
    assert recorded == {"status": "complete", "heads": heads["n"], "edges": len(run.edges)} and heads["n"] > 0
    assert edges["n"] == len(run.edges) > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_doctor_says_what_the_family_gets(family_dirs, runs, name):
    architecture = AutoConfig.from_pretrained(family_dirs[name]).architectures[0]
    listed = {f.architecture: f for f in doctor.FAMILIES}[architecture]
    run = runs(name)
    assert (listed.pk, listed.roles, listed.causal) == (len(run.pairs) > 0, bool(run.record.roles),
                                                        "skipped" not in run.record.causal)
    assert dict(doctor.family_rows())[listed.name].startswith(f"{architecture}: PK, roles")
