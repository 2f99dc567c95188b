"""The analyze pipeline and command on tiny synthetic models: artifact contract, planted edges on top, a
random-init model without discoveries, options, and one-line errors."""

import dataclasses
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from _cli import run_cli
from _commands import command_environment
from _fast import FAST, PK, flags

from headgraph.analysis.artifacts import HEAD_COLUMNS, PAIR_COLUMNS, PAIR_KEY
from headgraph.errors import UsageError
from headgraph.loader.models import load_model
from headgraph.pipeline import compute_pk
from headgraph.runs import RoleRecord, load_run, write_run

ROOT = Path(__file__).resolve().parents[1]

# Its own settings, not tests/_fast.py's: these tests judge significance (q_model of planted and random pairs),
# so the null is 120 heads per type (14,400 null pairs) rather than 20, and the reference 20,000 samples.
SIGNIFICANCE = {"reference_samples": 20_000, "null_heads": 120, "progress": False}


@pytest.fixture(scope="module")
def planted_model(planted):
    return load_model(planted[0], processing="tl", device="cpu")


@pytest.fixture(scope="module")
def planted_run(planted_model):
    return compute_pk(planted_model, seed=1, **SIGNIFICANCE)


@pytest.fixture(scope="module")
def random_model(synthetic_dir):
    return load_model(synthetic_dir, processing="tl", device="cpu")


def test_pairs_and_heads_follow_the_artifact_contract(planted_run, planted_model):
    pairs, heads = planted_run.pairs, planted_run.heads
    assert list(pairs.columns) == PAIR_COLUMNS and list(heads.columns) == HEAD_COLUMNS
    assert len(pairs) == 3 * 3 * 16  # OQ, OK, OV x 3 layer pairs (earlier -> later) x 4 x 4 heads
    assert (pairs.source_layer < pairs.target_layer).all()
    assert (pairs.source == "L" + pairs.source_layer.astype(str) + "H" + pairs.source_head.astype(str)).all()
    assert set(pairs.source_type) == {"O"} and set(pairs.target_type) == {"Q", "K", "V"}
    assert pairs.cs.notna().all() and pairs.pk.between(0, 16 + 1e-4).all()
    np.testing.assert_allclose(pairs.pk_norm, pairs.pk / 16)
    assert heads["head"].tolist() == [f"L{l}H{h}" for l in range(3) for h in range(4)]
    assert (heads[["rank_q", "rank_k", "rank_v", "rank_o"]] == 16).all().all()


def test_run_metadata_records_the_run(planted_run):
    run = planted_run.run
    assert run.model.name and run.processing == "tl" and run.device == "cpu"
    assert run.dtype == "float32" and run.seed == 1 and run.dims.d_model == 64
    assert run.reference["moments"]["16,16"]["mean"] == pytest.approx(16 * 16 / 64)
    kl = run.kl["matrix"]
    assert kl[3][0] is not None and kl[3][1] is not None and kl[3][2] is not None  # OQ, OK, OV
    assert sum(v is None for row in kl for v in row) == 13
    assert set(run.mean_pk) == {"OQ", "OK", "OV"}
    assert {"z_iso", "log10_p_iso", "p_model", "q_model", "cs"} <= set(run.nulls)
    assert set(run.timings_s) == {"subspaces", "projection_kernel", "reference", "model_null", "composition"}
    assert run.rank_deficient_heads == []
    engine = run.engine["pass"]  # one pass for OQ, OK, OV: O, Q, K and V built once each
    assert engine["built_heads"] == 4 * 12 and engine["needed_pairs"] == 3 * 3 * 16
    assert engine["reason"].startswith("auto: predicted") and engine["calibration"]["projector_tile"] > 0
    assert {run.engine[tp]["formulation"] for tp in ("OQ", "OK", "OV")} == {engine["formulation"]}


def test_planted_edges_rank_on_top_and_are_significant(planted_run, planted):
    truth = {(s, t, tp) for s, t, tp, _ in planted[1].edges}
    pairs = planted_run.pairs
    ranked = pairs.sort_values("pk", ascending=False)
    top = set(list(zip(ranked.source, ranked.target, ranked.source_type + ranked.target_type))[: len(truth)])
    assert len(top & truth) / len(truth) >= 0.95
    key = list(zip(pairs.source, pairs.target, pairs.source_type + pairs.target_type))
    planted_rows = pairs[[k in truth for k in key]]
    assert len(planted_rows) == len(truth)
    assert (planted_rows.q_model < 0.05).all() and (planted_rows.z_iso > 5).all()
    assert (pairs[[k not in truth for k in key]].q_model < 0.05).mean() <= 0.05


def test_random_init_model_gives_at_most_five_percent_discoveries(random_model):
    result = compute_pk(random_model, types="all", **SIGNIFICANCE)
    assert len(result.pairs) == 16 * 16  # 16 type pairs x (1 layer pair x 4 x 4 heads)
    engine = result.run.engine
    assert engine["pass"]["built_heads"] == 4 * 8  # all 16 type pairs from four sets built once
    assert engine["QQ"]["symmetric"] and engine["QK"]["product"] == engine["KQ"]["product"] == "QK"
    assert (result.pairs.q_model < 0.05).mean() <= 0.05
    assert all(v is not None for row in result.run.kl["matrix"] for v in row)
    assert result.pairs.cs.notna().sum() == 3 * 16  # only OQ, OK, OV have a Composition Score


def test_full_matrix_and_float64(random_model):
    full = compute_pk(random_model, types=("OQ", "QQ"), full_matrix=True, dtype="float64", **SIGNIFICANCE)
    counts = (full.pairs.source_type + full.pairs.target_type).value_counts()
    assert counts["OQ"] == 8 * 8 and counts["QQ"] == 8 * 8 - 8  # a head's own Q subspace is left out
    forward = compute_pk(random_model, types=("OQ",), **SIGNIFICANCE).pairs
    merged = forward.merge(full.pairs, on=["source", "target", "source_type", "target_type"])
    assert len(merged) == len(forward)
    np.testing.assert_allclose(merged.pk_x, merged.pk_y, atol=1e-5)


def test_run_folder_round_trips_exactly_with_nulls(random_model, tmp_path):
    result = compute_pk(random_model, types=("OQ", "QK"), **SIGNIFICANCE)
    result.run = dataclasses.replace(result.run, id="round-trip", out_dir=str(tmp_path / "run"), selection="top 20")
    folder = write_run(result, tmp_path / "run")
    back = load_run(folder)
    pd.testing.assert_frame_equal(back.pairs, result.pairs)
    pd.testing.assert_frame_equal(back.heads, result.heads)
    assert back.record == result.run  # every field, through run.json and back
    written = json.loads((folder / "run.json").read_text())
    assert written["format_version"] == 4 and written == back.record.to_json()
    cs = pq.read_table(folder / "pairs.parquet").column("cs")
    assert cs.null_count == 16  # QK has no Composition Score: stored as null, not NaN
    assert written["kl"]["matrix"][1][1] is None and math.isfinite(written["kl"]["matrix"][0][1])


def test_run_folders_of_earlier_formats_load_and_a_newer_one_is_one_line(random_model, tmp_path):
    result = compute_pk(random_model, types=("OQ",), **SIGNIFICANCE)
    folder = write_run(result, tmp_path / "run")
    written = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps({k: v for k, v in written.items() if k != "format_version"}))
    assert load_run(folder).record == result.run  # headgraph 0.1 wrote the same fields without a version
    (folder / "run.json").write_text(json.dumps({**{k: v for k, v in written.items() if k != "causal"},
                                                 "format_version": 1}))
    assert load_run(folder).record == result.run  # version 1: the same fields less `causal`
    (folder / "run.json").write_text(json.dumps({**{k: v for k, v in written.items() if k not in ("sweep", "step")},
                                                 "format_version": 2}))
    assert load_run(folder).record == result.run  # version 2: the same fields less `sweep` and `step`
    v4_only = ("full_matrix", "stages", "peak_rss")
    (folder / "run.json").write_text(json.dumps({**{k: v for k, v in written.items() if k not in v4_only},
                                                 "format_version": 3}))
    assert load_run(folder).record == result.run  # version 3: less those three; `pairs` says it was not full
    (folder / "run.json").write_text(json.dumps({**written, "format_version": 7}))
    with pytest.raises(UsageError, match=r"run format version 7; this headgraph .* reads versions 0, 1, 2, 3") as e:
        load_run(folder)
    assert "\n" not in str(e.value)




# run.json `roles` as compute_roles writes it for a decoder (sequential design, nothing skipped or settled)
DECODER_ROLES_JSON = {
    "model_kind": "decoder", "roles": ["identity", "previous_token", "induction"],
    "role_inputs": {"identity": "repeated_tokens", "previous_token": "repeated_tokens", "induction": "repeated_tokens"},
    "inputs": {"repeated_tokens": {"n": 32, "n_inputs": 200, "seed": 0}}, "design": "sequential", "n_inputs": 200,
    "tau": 3.0, "alpha": 0.05, "correction": "bh", "batch_size": 32, "test": "sequential test by betting",
    "score": "b(i) = N_i * attention mass on the sieve / |sieve|", "identity_score": "mean attention on itself",
    "repeat_length": 20}


def test_the_roles_record_is_typed_and_run_json_keeps_its_keys(random_model, tmp_path):
    result = compute_pk(random_model, types=("OQ",), **SIGNIFICANCE)
    roles = RoleRecord.from_json(DECODER_ROLES_JSON)
    assert roles.roles == ("identity", "previous_token", "induction") and roles.tau == 3.0
    assert roles.skipped_roles is None and roles.block_variants is None  # not recorded for this run
    result.run = dataclasses.replace(result.run, roles=roles)
    folder = write_run(result, tmp_path / "run")
    assert json.loads((folder / "run.json").read_text())["roles"] == DECODER_ROLES_JSON
    assert load_run(folder).record == result.run
    older = {k: v for k, v in DECODER_ROLES_JSON.items() if k not in ("design", "batch_size", "role_inputs")}
    written = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps({**written, "roles": older}))
    assert load_run(folder).record.roles.design is None  # an older run's roles: what it recorded
    (folder / "run.json").write_text(json.dumps({**written, "roles": {**DECODER_ROLES_JSON, "taus": 3}}))
    with pytest.raises(UsageError, match="is not a headgraph run record .*taus") as e:
        load_run(folder)
    assert "\n" not in str(e.value)


def test_analyze_command_writes_artifacts_and_prints_summary(synthetic_dir, tmp_path, capsys):
    code, out, _ = run_cli(["analyze", str(synthetic_dir), "--out", str(tmp_path / "r"), "--types", "oq,ok",
                            *flags(PK), "--max-memory", "64MiB",
                            "--no-roles", "--no-causal", "--no-store", "--no-report"], capsys)
    assert code == 0
    assert {p.name for p in (tmp_path / "r").iterdir()} == {"run.json", "pairs.parquet", "heads.parquet"}
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["types"] == ["OQ", "OK"] and run["max_memory"] == 64 * 2**20
    assert "KL(random || observed) in nats" in out and "OK" in out


@pytest.mark.slow  # the whole analysis at the defaults, in a fresh interpreter
def test_the_readmes_main_job_runs_as_written_on_the_embedded_default(tmp_path):
    """The README's first set-up command after its install, read from the README and run in a fresh process in an
    empty folder (no store chosen: the embedded default) on the offline all-MiniLM-L6-v2, whose safetensors hold
    an int64 buffer (embeddings.position_ids) beside its float32 parameters: a complete run, stored and reported."""
    from headgraph.loader.ladybug_store import LadybugStore

    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Set up", 1)[1].split("```", 2)[1]
    command = shlex.split(block.strip().split("&&")[-1])
    assert command[:2] == ["headgraph", "analyze"], block
    done = subprocess.run([sys.executable, "-m", "headgraph", *command[1:]], cwd=tmp_path, capture_output=True,
                          text=True, env=command_environment({"PYTHONPATH": str(ROOT)}), timeout=600)
    assert done.returncode == 0, done.stderr
    (folder,) = (tmp_path / "runs").iterdir()
    run = json.loads((folder / "run.json").read_text())
    assert run["engine"]["weights"]["stored_dtypes"] == ["F32"] and (folder / "report.html").exists()
    with LadybugStore(tmp_path / "headgraph.lbdb", read_only=True) as store:
        runs = store.read("MATCH (r:Run) RETURN r.model AS model, r.status AS status").records()
    assert runs == [{"model": "all-MiniLM-L6-v2", "status": "complete"}]


@pytest.mark.parametrize("args,message", [
    (["--types", "ox"], "bad --types"),
    (["--max-memory", "lots"], "not a size"),
    (["--max-memory", "1000"], "raise --max-memory"),
    (["--dtype", "float16"], "float16"),
])
def test_bad_options_are_one_line_usage_errors(synthetic_dir, tmp_path, capsys, args, message):
    code, _, err = run_cli(["analyze", str(synthetic_dir), "--out", str(tmp_path / "r"), *args], capsys)
    assert code == 2
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_requested_without_cuda_is_a_clear_error(synthetic_dir, tmp_path, capsys):
    code, _, err = run_cli(["analyze", str(synthetic_dir), "--out", str(tmp_path / "r"), "--device", "cuda"], capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "no CUDA device" in err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_run_equals_the_cpu_run(planted_model):
    cuda = compute_pk(planted_model, seed=1, device="cuda", types="all", **SIGNIFICANCE)
    assert cuda.run.device == "cuda" and cuda.run.engine["pass"]["calibration"]["key"].startswith("cuda:")
    cpu = compute_pk(planted_model, seed=1, types="all", **SIGNIFICANCE)
    keys = ["source", "target", "source_type", "target_type"]
    merged = cpu.pairs.merge(cuda.pairs, on=keys, suffixes=("_cpu", "_cuda"))
    assert len(merged) == len(cpu.pairs) == len(cuda.pairs)
    for column in ("pk", "z_iso", "cs"):
        np.testing.assert_allclose(merged[f"{column}_cuda"], merged[f"{column}_cpu"], atol=1e-4, rtol=1e-4)
    assert ((merged.q_model_cuda < 0.05) == (merged.q_model_cpu < 0.05)).mean() >= 0.99  # ties may differ


def _same_analysis_on(device: str, folder: Path, tmp_path: Path) -> None:
    """The whole analysis of `folder` on `device` equals the CPU's: PK, role scores and p-values with the same
    decisions, local effects and attributions, loss effects (float32 products summed in other orders; TF32 off).
    A loss effect is a difference of float32 losses of about log(vocabulary) = 6 nats a token, so it is held to
    1e-5 nats, not to its own size (a random GPT-2's are about 1e-5 nats)."""
    from headgraph import analyze

    cpu, other = (analyze(folder, device=d, out=tmp_path / f"run-{i}", progress=False, seed=1, **FAST)
                  for i, d in enumerate(("cpu", device)))
    assert other.record.device == device and not cpu.pairs.effect_loss.isna().all()
    merged = cpu.pairs.merge(other.pairs, on=PAIR_KEY, suffixes=("_cpu", "_other"))
    assert len(merged) == len(cpu.pairs) == len(other.pairs)
    for column in ("pk", "cs", "effect", "effect_lo", "effect_hi", "effect_attr", "effect_loss"):
        found, expected = merged[f"{column}_other"], merged[f"{column}_cpu"]
        assert found.isna().equals(expected.isna()), column
        atol = 1e-5 if column == "effect_loss" else 1e-4 * np.nanmax(np.abs(expected))
        np.testing.assert_allclose(found, expected, rtol=1e-3, atol=atol, err_msg=column)
    roles = [c for c in cpu.heads.columns if c.endswith(("_score", "_p"))]
    assert roles
    np.testing.assert_allclose(other.heads[roles], cpu.heads[roles], rtol=1e-3, atol=1e-6)
    decided = [c for c in cpu.heads.columns if c.endswith("_sig")]
    assert (other.heads[decided] == cpu.heads[decided]).to_numpy().mean() >= 0.98  # a p-value at α may flip


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_a_whole_cuda_analysis_with_roles_and_causal_effects_equals_the_cpu_one(family, tmp_path):
    """A bf16 checkpoint streamed onto the GPU (LayerNorm; rotary grouped-query RMSNorm; QK-norm): what the PK
    test above checks for PK, for roles, the local effects with attribution's backward passes and the loss
    effects too."""
    from headgraph.testing.families import save_family
    from headgraph.testing.synthetic import as_bf16

    _same_analysis_on("cuda", as_bf16(save_family(family, tmp_path / family)), tmp_path)


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    from headgraph.testing.synthetic import save_synthetic_gqa

    folder = save_synthetic_gqa(tmp_path_factory.mktemp("gqa") / "llama-gqa", n_layers=2, n_heads=4, n_kv_heads=2)
    return load_model(folder, processing="tl", device="cpu")


def test_grouped_query_keys_and_values_are_native_kv_heads(gqa_model):
    from transformer_lens.tools.analysis.projection_kernel import attention_head_subspace_affinity

    result = compute_pk(gqa_model, types=("OQ", "OK", "OV"), **SIGNIFICANCE)
    pairs = result.pairs
    counts = (pairs.source_type + pairs.target_type).value_counts()
    assert counts["OQ"] == 4 * 4 and counts["OK"] == 4 * 2 and counts["OV"] == 4 * 2
    assert set(pairs[pairs.target_type == "K"].target) == {"L1KV0", "L1KV1"}
    assert pairs[pairs.target_type == "Q"].cs.notna().all() and pairs[pairs.target_type != "Q"].cs.isna().all()
    assert len(result.heads) == 8 and (result.heads.rank_k == 16).all()
    for target in ("K", "V"):
        tl = attention_head_subspace_affinity(gqa_model.bridge, source_role="O", target_role=target)
        rows = pairs[pairs.target_type == target]
        index = [torch.as_tensor(rows[c].to_numpy().copy()) for c in
                 ("source_layer", "source_head", "target_layer", "target_head")]
        expected = tl.scores[tuple(index)]
        np.testing.assert_allclose(rows.pk.values, expected.double().numpy(), atol=1e-5)
