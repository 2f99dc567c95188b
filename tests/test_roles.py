"""Head roles: sieve bias scores from their definition, sieves, t-tests, the sequential test's error rate by
simulation, pattern capture, planted and real models."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats
from transformers import AutoModel

from headgraph.analysis import roles as R
from headgraph.analysis.patterns import capture_patterns
from headgraph.analysis.prompts import (
    KIND_A, KIND_B, KIND_CLS, KIND_PAD, KIND_SEP, TokenInputs, ioi_inputs, sentence_pair_inputs,
)
from headgraph.cli import main
from headgraph.errors import UsageError
from headgraph.loader.models import load_model, minilm_dir
from headgraph.testing.planted import PlantSpec, save_planted
from headgraph.testing.synthetic import save_synthetic


# ---------- helpers -------------------------------------------------------------------------------------------

def random_visible(rng, batch, length, is_decoder):
    lengths = rng.integers(3, length + 1, size=batch)
    mask = torch.arange(length)[None, :] < torch.as_tensor(lengths)[:, None]
    return R.visible_keys(TokenInputs("t", torch.zeros(batch, length, dtype=torch.long), mask), is_decoder)


def random_patterns(rng, visible, n_layers=2, n_heads=3):
    """Rows drawn from a Dirichlet over each query's visible keys (zero rows for padding queries)."""
    raw = torch.as_tensor(rng.gamma(0.5, size=(visible.shape[0], n_layers, n_heads, *visible.shape[1:])))
    raw = raw * visible[:, None, None]
    return raw / raw.sum(-1, keepdim=True).clamp(min=1e-300)


def reference_score(rows, sieve, visible, entropy_weighted=False):
    """The definition, one query at a time: mean attention on the sieve over mean attention on visible keys."""
    scores = []
    for i in range(rows.shape[0]):
        keys = [j for j in range(rows.shape[1]) if visible[i, j]]
        sieve_keys = [j for j in keys if sieve[i, j]]
        if not sieve_keys or len(sieve_keys) == len(keys):
            continue
        b = np.mean([rows[i, j] for j in sieve_keys]) / np.mean([rows[i, j] for j in keys])
        scores.append(b * (stats.entropy([rows[i, j] for j in keys]) if entropy_weighted else 1.0))
    return np.mean(scores) if scores else np.nan


# ---------- the score -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("is_decoder", [True, False])
def test_uniform_attention_scores_one(is_decoder):
    rng = np.random.default_rng(0)
    visible = random_visible(rng, 6, 9, is_decoder)
    sieve = torch.as_tensor(rng.random(visible.shape) < 0.3) & visible
    patterns = (visible / visible.sum(-1, keepdim=True).clamp(min=1))[:, None, None].expand(-1, 2, 3, -1, -1)
    scores = R.sieve_scores(patterns.double(), sieve, visible)
    defined = ~torch.isnan(scores)
    assert defined.any() and torch.allclose(scores[defined], torch.ones_like(scores[defined]))


@pytest.mark.parametrize("is_decoder", [True, False])
def test_all_mass_on_the_sieve_scores_n_over_sieve_size(is_decoder):
    rng = np.random.default_rng(1)
    visible = random_visible(rng, 6, 9, is_decoder)
    sieve = torch.as_tensor(rng.random(visible.shape) < 0.3) & visible
    rows = torch.where(sieve.any(-1, keepdim=True), sieve.double(), visible.double())
    patterns = (rows / rows.sum(-1, keepdim=True).clamp(min=1))[:, None, None]
    scores = R.sieve_scores(patterns, sieve, visible)[:, 0, 0]
    for b in range(6):
        ratios = [visible[b, i].sum().item() / sieve[b, i].sum().item() for i in range(9)
                  if 0 < sieve[b, i].sum() < visible[b, i].sum()]
        assert scores[b].item() == pytest.approx(np.mean(ratios)) if ratios else torch.isnan(scores[b])


@pytest.mark.parametrize("is_decoder, entropy_weighted", [(True, False), (False, False), (False, True)])
def test_scores_match_the_definition_on_random_patterns(is_decoder, entropy_weighted):
    rng = np.random.default_rng(2)
    visible = random_visible(rng, 5, 8, is_decoder)
    sieve = torch.as_tensor(rng.random(visible.shape) < 0.4) & visible
    patterns = random_patterns(rng, visible)
    scores = R.sieve_scores(patterns, sieve, visible, entropy_weighted)
    for b in range(5):
        for layer in range(2):
            for head in range(3):
                expected = reference_score(patterns[b, layer, head].numpy(), sieve[b].numpy(), visible[b].numpy(),
                                           entropy_weighted)
                assert scores[b, layer, head].item() == pytest.approx(expected, nan_ok=True)


def test_self_attention_is_the_mean_diagonal_after_bos():
    rng = np.random.default_rng(3)
    visible = random_visible(rng, 4, 7, is_decoder=True)
    patterns = random_patterns(rng, visible)
    got = R.self_attention(patterns, visible)
    for b in range(4):
        n = int(visible[b].diagonal().sum())
        assert got[b, 1, 2].item() == pytest.approx(np.mean([patterns[b, 1, 2, i, i].item() for i in range(1, n)]))


# ---------- sieves --------------------------------------------------------------------------------------------

def decoder_sieves(ids):
    x = TokenInputs("t", torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))
    visible = R.visible_keys(x, is_decoder=True)
    return {role.name: {i: R.role_sieve(role, x, visible)[0, i].nonzero().flatten().tolist() for i in range(len(ids))}
            for role in R.DECODER_ROLES}


def test_decoder_sieves_on_a_repeated_sequence():
    s = decoder_sieves([99, 5, 6, 7, 5, 6, 7])
    assert s["identity"][3] == [3] and s["previous_token"][3] == [2] and s["bos"][5] == [0]
    assert s["previous_token"][0] == [] and s["identity"][0] == [0]  # the BOS query: only itself is visible
    assert [s["duplicate_token"][i] for i in (2, 4, 5, 6)] == [[], [1], [2], [3]]
    # induction: the token after the earlier copy of the query's token
    assert [s["induction"][i] for i in (3, 4, 5, 6)] == [[], [2], [3], [4]]
    repeat = decoder_sieves([99, 5, 5, 6, 5])
    assert repeat["induction"][2] == [] and repeat["induction"][4] == [2, 3]  # never the query itself
    assert repeat["duplicate_token"][4] == [1, 2]


def encoder_example():
    kinds = [KIND_CLS, KIND_A, KIND_A, KIND_A, KIND_SEP, KIND_B, KIND_B, KIND_SEP, KIND_PAD]
    kind = torch.tensor([kinds])
    x = TokenInputs("t", torch.zeros_like(kind), kind != KIND_PAD, token_kind=kind,
                    arcs={r: torch.zeros(1, 9, 9, dtype=torch.bool) for r in ("nsubj", "dobj", "amod", "advmod")})
    x.arcs["nsubj"][0, 1, 3] = True
    x.arcs["amod"][0, 5, 6] = True
    return x


def encoder_sieve(name):
    x = encoder_example()
    role = next(r for r in R.ENCODER_ROLES if r.name == name)
    return R.role_sieve(role, x, R.visible_keys(x, is_decoder=False))[0]


def test_encoder_sieves():
    local = encoder_sieve("local")
    assert local.sum(-1).tolist() == [3, 4, 5, 5, 5, 5, 4, 3, 0]  # window clipped at both ends and at padding
    assert (encoder_sieve("delimiter").nonzero()[:, 1].unique().tolist()) == [0, 4, 7]
    assert encoder_sieve("cls")[:8, 0].all() and encoder_sieve("cls").sum() == 8
    assert encoder_sieve("sep")[:8][:, [4, 7]].all() and encoder_sieve("sep").sum() == 16
    block = encoder_sieve("block")
    assert block[2].nonzero().flatten().tolist() == [1, 2, 3] and block[6].nonzero().flatten().tolist() == [5, 6]
    assert not block[[0, 4, 7, 8]].any()
    assert encoder_sieve("syntactic").nonzero().tolist() == [[1, 3], [5, 6]]
    assert encoder_sieve("syntactic_amod").nonzero().tolist() == [[5, 6]]


# ---------- the test ------------------------------------------------------------------------------------------

def bh_reference(p):
    """Benjamini-Hochberg adjusted p-values, step by step."""
    m = len(p)
    order = np.argsort(p)
    adjusted = np.empty(m)
    running = 1.0
    for rank in range(m, 0, -1):
        running = min(running, p[order[rank - 1]] * m / rank)
        adjusted[order[rank - 1]] = running
    return adjusted


def test_t_test_per_head_matches_scipy_and_corrections():
    rng = np.random.default_rng(4)
    scores = rng.normal(3.0 + np.linspace(-1, 1.5, 20), 1.0, size=(15, 20))
    scores[3, 5] = np.nan
    mean, p, sig = R.ttest_scores(scores, tau=3.0, alpha=0.05, correction="none")
    for h in range(20):
        column = scores[:, h][~np.isnan(scores[:, h])]
        assert p[h] == pytest.approx(stats.ttest_1samp(column, 3.0, alternative="greater").pvalue)
        assert mean[h] == pytest.approx(column.mean())
    assert np.array_equal(sig, p < 0.05)
    _, _, sig_bh = R.ttest_scores(scores, correction="bh")
    assert np.array_equal(sig_bh, bh_reference(p) < 0.05)
    _, _, sig_bonf = R.ttest_scores(scores, correction="bonferroni")
    assert np.array_equal(sig_bonf, p * 20 < 0.05)
    assert sig.sum() > sig_bh.sum() > sig_bonf.sum() > 0


def test_constant_scores_get_a_defined_decision():
    scores = np.column_stack([np.full(5, 5.0), np.full(5, 3.0), np.full(5, 1.0)])
    _, p, sig = R.ttest_scores(scores, tau=3.0, correction="none")
    assert p.tolist() == [0.0, 1.0, 1.0] and sig.tolist() == [True, False, False]


def test_unknown_correction():
    with pytest.raises(UsageError, match="bh"):
        R.ttest_scores(np.ones((3, 2)), correction="holm")


# ---------- the sequential test -------------------------------------------------------------------------------

TAU, ALPHA = 3.0, 0.05
NULLS = {  # scores >= 0 whose mean is exactly tau
    "exponential": lambda rng, size: rng.exponential(TAU, size),
    "rare large": lambda rng, size: np.where(rng.random(size) < 0.1, 10 * TAU, 0.0),
    "uniform": lambda rng, size: rng.uniform(0, 2 * TAU, size),
}


def run_sequential(draw, n_heads, rng, correction="none", n_inputs=200, batch=8):
    """The sequential design as compute_roles drives it: a batch, a look, until every head settled or n_inputs."""
    test = R.SequentialTest(n_heads, TAU, ALPHA, correction, first_look=batch)
    used = 0
    while used < n_inputs and not test.settled:
        size = min(batch, n_inputs - used)
        test.add(draw(rng, (size, n_heads)))
        used += size
    return test, used


def binomial_ceiling(rate, trials):
    """rate plus 4 binomial standard errors: what a false-rejection count may reach when the true rate is <= rate."""
    return rate + 4 * np.sqrt(rate * (1 - rate) / trials)


@pytest.mark.parametrize("null", NULLS)
def test_sequential_false_rejections_stay_below_alpha_on_null_heads(null):
    """20000 independent heads whose scores have mean tau, a look after every 8 inputs up to 200, no correction:
    at most alpha of them may be flagged (within the binomial margin), however the scores are spread."""
    n_heads = 20000
    test, _ = run_sequential(NULLS[null], n_heads, np.random.default_rng(5))
    _, p, sig = test.result()
    assert sig.mean() <= binomial_ceiling(ALPHA, n_heads)
    assert np.array_equal(sig, p <= ALPHA)


def test_the_same_simulation_flags_t_tests_repeated_at_every_look():
    """The harness can fail: a one-sided t-test after every batch, stopping at the first p < alpha, rejects
    far more than alpha of the same null heads."""
    rng, n_heads, batch = np.random.default_rng(6), 4000, 8
    scores = NULLS["uniform"](rng, (200, n_heads))
    looks = np.arange(batch, 201, batch)
    p = np.stack([stats.ttest_1samp(scores[:n], TAU, axis=0, alternative="greater").pvalue for n in looks])
    assert (p < ALPHA).any(axis=0).mean() > binomial_ceiling(ALPHA, n_heads)


@pytest.mark.slow
def test_sequential_bh_keeps_the_false_discovery_rate_below_alpha_under_dependence():
    """Families of 20 heads that share each input's scale (positively dependent scores), 5 with a role: the
    mean share of false discoveries among the discoveries stays at most alpha, and a head settled significant
    at a look is significant in the end."""
    rng, families, n_heads, with_role = np.random.default_rng(7), 300, 20, 5
    shift = np.r_[np.full(with_role, 1.5), np.zeros(n_heads - with_role)]

    def draw(rng, size):
        return rng.gamma(2.0, 0.5, (size[0], 1)) * rng.exponential(TAU, size) + shift

    false_shares, found = [], []
    for _ in range(families):
        test, _ = run_sequential(draw, n_heads, rng, correction="bh", batch=16)
        _, _, sig = test.result()
        assert sig[test.state == R.SIGNIFICANT].all()
        false_shares.append(sig[with_role:].sum() / max(sig.sum(), 1))
        found.append(sig[:with_role].mean())
    assert np.mean(false_shares) <= binomial_ceiling(ALPHA, families)
    assert np.mean(found) > 0.5  # and it finds most heads with a role


def test_sequential_heads_settle_early_when_the_evidence_is_clear():
    """Heads well above tau are flagged, heads well below settle at the first look allowed, with fewer inputs
    than n_inputs; a head right at tau stays open."""
    rng = np.random.default_rng(8)
    means = np.r_[np.full(50, TAU + 2.0), np.full(50, 1.0)]
    test, used = run_sequential(lambda rng, size: rng.normal(means, 1.0, size), 100, rng)
    _, _, sig = test.result()
    assert sig[:50].all() and not sig[50:].any()
    assert used < 200 and (test.state[50:] == R.BELOW_TAU).all()
    assert (test.seen[50:] == R.FUTILITY_MIN_INPUTS).all()
    flat, _ = run_sequential(lambda rng, size: np.full(size, TAU), 3, rng)
    assert flat.counts() == {"significant": 0, "below_tau": 0, "open": 3}


def test_sequential_skips_inputs_without_a_scored_query():
    test = R.SequentialTest(2, TAU, ALPHA, "none", first_look=4)
    test.add(np.array([[np.nan, 10.0], [np.nan, 10.0]]))
    mean, p, _ = test.result()
    assert np.isnan(mean[0]) and p[0] == 1.0 and mean[1] == 10.0 and test.count.tolist() == [0, 2]


# ---------- models --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    folder, truth = save_planted(tmp_path_factory.mktemp("planted"), PlantSpec())
    return load_model(str(folder), processing="tl", device="cpu"), truth, folder


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    folder = save_synthetic(tmp_path_factory.mktemp("random"), n_layers=3, n_heads=4, d_model=64, d_head=16, seed=7)
    return load_model(str(folder), processing="raw", device="cpu")


@pytest.fixture(scope="module")
def minilm():
    return load_model("all-MiniLM-L6-v2", processing="raw", device="cpu")


@pytest.mark.slow
def test_planted_heads_get_exactly_their_roles(planted):
    model, truth, _ = planted
    heads, meta = R.compute_roles(model, n_inputs=20, seed=0, design="fixed")
    sig = {role: set(heads.loc[heads[f"{role}_sig"], "head"]) for role in meta["roles"]}
    assert sig == {"identity": set(truth.identity_heads), "previous_token": set(truth.previous_token_heads),
                   "bos": set(), "duplicate_token": set(), "induction": set()}
    by_head = heads.set_index("head")
    assert (by_head.loc[list(truth.identity_heads), "identity_p"] < 0.01).all()
    assert (by_head.loc[list(truth.previous_token_heads), "previous_token_p"] < 0.01).all()
    assert (by_head.loc[list(truth.identity_heads), "identity_score"] > 0.9).all()
    assert meta["correction"] == "bh" and "bh" in meta["test"]


@pytest.mark.slow
def test_sequential_design_recovers_the_planted_roles_on_fewer_inputs(planted):
    """The sequential design flags exactly the planted heads, as the fixed design does on all its inputs, and
    stops every input set before n_inputs."""
    model, truth, _ = planted
    expected = {"identity": set(truth.identity_heads), "previous_token": set(truth.previous_token_heads),
                "bos": set(), "duplicate_token": set(), "induction": set()}
    found = {}
    for design in ("fixed", "sequential"):
        heads, meta = R.compute_roles(model, n_inputs=96, seed=0, batch_size=16, design=design)
        found[design] = {role: set(heads.loc[heads[f"{role}_sig"], "head"]) for role in meta["roles"]}
        found[design, "n"] = {name: x["n"] for name, x in meta["inputs"].items()}
    assert found["fixed"] == found["sequential"] == expected
    assert found["fixed", "n"] == {"ioi": 96, "repeated_tokens": 96}
    assert all(n < 96 for n in found["sequential", "n"].values())
    assert meta["design"] == "sequential" and meta["settled"]["identity"]["significant"] == 2


@pytest.mark.slow
def test_random_init_model_gets_roles_for_at_most_5_percent_of_heads(random_model):
    heads, meta = R.compute_roles(random_model, n_inputs=30, seed=1, alpha=0.05, correction="bh")
    any_role = heads[[f"{r}_sig" for r in meta["roles"]]].any(axis=1)
    assert any_role.mean() <= 0.05


@pytest.mark.slow
def test_identity_score_equals_self_attention_of_unpadded_runs(random_model):
    """Whole decoder path: IOI prompts -> padded batched patterns -> identity score, against one prompt at a time."""
    heads, _ = R.compute_roles(random_model, n_inputs=6, seed=2, batch_size=4)
    prompts = ioi_inputs(random_model.tokenizer, 6, seed=2)
    per_prompt = []
    for row in range(6):
        n = int(prompts.attention_mask[row].sum())
        tokens = prompts.input_ids[row, :n][None]
        _, cache = random_model.bridge.run_with_cache(tokens)
        diag = torch.stack([cache[f"blocks.{l}.attn.hook_pattern"][0].diagonal(dim1=-2, dim2=-1)
                            for l in range(3)])  # [layer, head, pos]
        per_prompt.append(diag[:, :, 1:].mean(-1).flatten().numpy())  # the BOS query left out
    assert np.allclose(heads["identity_score"], np.mean(per_prompt, axis=0), atol=1e-5)
    assert R.identity_map(heads).shape == (3, 4)
    assert R.identity_map(heads)[2, 1] == heads.set_index("head").loc["L2H1", "identity_score"]


def test_patterns_stop_the_forward_pass_after_the_last_layers_attention(random_model):
    """The captured patterns equal those of a whole run_with_cache, and nothing after the last layer's
    attention runs: neither its MLP nor the final LayerNorm and unembedding."""
    bridge = random_model.bridge
    inputs = ioi_inputs(random_model.tokenizer, 5, seed=3).batch(0, 5)
    after = []
    with bridge.hooks(fwd_hooks=[(name, lambda x, hook: after.append(hook.name))
                                 for name in ("blocks.2.mlp.hook_in", "ln_final.hook_in", "unembed.hook_in")]):
        patterns = capture_patterns(bridge, inputs)
        assert after == []
        _, cache = bridge.run_with_cache(inputs.input_ids, attention_mask=inputs.attention_mask.long())
        assert len(after) == 3  # the hooks do fire on a whole pass
    expected = torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(3)], dim=1)
    assert torch.equal(patterns, expected)
    assert not any(hook.has_hooks() for hook in bridge.hook_dict.values())  # the stopped pass left no hook


@pytest.mark.slow
def test_bert_patterns_from_the_bridge_equal_eager_transformers(minilm):
    inputs = sentence_pair_inputs(minilm.tokenizer, 4, seed=0).batch(0, 4)
    patterns = capture_patterns(minilm.bridge, inputs)
    hf = AutoModel.from_pretrained(str(minilm_dir()), attn_implementation="eager")
    with torch.no_grad():
        out = hf(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask.long(),
                 token_type_ids=inputs.token_type_ids, output_attentions=True)
    expected = torch.stack(out.attentions, dim=1)
    real = inputs.attention_mask
    assert torch.allclose(patterns * real[:, None, None, :, None], expected * real[:, None, None, :, None], atol=1e-5)


@pytest.mark.slow
def test_minilm_encoder_roles(minilm):
    heads, meta = R.compute_roles(minilm, n_inputs=12, seed=0, design="fixed")
    assert meta["model_kind"] == "encoder" and len(heads) == 72
    for role in ("local", "delimiter", "cls", "sep", "block", "block_entropy", "syntactic_nsubj", "syntactic"):
        assert heads[f"{role}_p"].between(0, 1).all() and heads[f"{role}_sig"].dtype == bool
    table = R.role_table(heads)
    assert table.loc["total", "cls"] == heads["cls_sig"].sum()
    # cls score and p-value of a few heads, recomputed from eager transformers' attentions with the definition
    inputs = sentence_pair_inputs(minilm.tokenizer, 12, seed=0)
    hf = AutoModel.from_pretrained(str(minilm_dir()), attn_implementation="eager")
    with torch.no_grad():
        attentions = hf(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask.long(),
                        token_type_ids=inputs.token_type_ids, output_attentions=True).attentions
    real = inputs.attention_mask.bool().numpy()
    is_cls = inputs.input_ids.numpy() == minilm.tokenizer.cls_token_id
    by_head = heads.set_index("head")
    for layer, head in [(0, 0), (2, 7), (5, 11)]:
        per_input = [reference_score(attentions[layer][b, head].double().numpy(), real[b][:, None] & is_cls[b][None],
                                     real[b][:, None] & real[b][None]) for b in range(12)]
        row = by_head.loc[f"L{layer}H{head}"]
        assert row["cls_score"] == pytest.approx(np.mean(per_input), rel=1e-4)
        expected_p = stats.ttest_1samp(per_input, 3.0, alternative="greater").pvalue
        assert row["cls_p"] == pytest.approx(expected_p, rel=1e-3, abs=1e-12)


def test_compute_roles_rejects_bad_parameters(random_model):
    with pytest.raises(UsageError, match="correction"):
        R.compute_roles(random_model, n_inputs=4, correction="holm")
    with pytest.raises(UsageError, match="at least 2"):
        R.compute_roles(random_model, n_inputs=1)
    with pytest.raises(UsageError, match="design"):
        R.compute_roles(random_model, n_inputs=4, design="adaptive")
    with pytest.raises(UsageError, match="--design fixed"):
        R.compute_roles(random_model, n_inputs=4, tau=0.0)


@pytest.mark.parametrize("design", ["sequential", "fixed"])
def test_roles_command_prints_and_writes(planted, tmp_path, capsys, design):
    _, truth, folder = planted
    main(["roles", str(folder), "--n-inputs", "40", "--design", design, "--out", str(tmp_path), "--identity-map"])
    out = capsys.readouterr().out
    assert "previous_token" in out and "identity score" in out
    heads = pd.read_parquet(tmp_path / "roles.parquet")
    assert set(heads.loc[heads["identity_sig"], "head"]) == set(truth.identity_heads)
    meta = json.loads((tmp_path / "roles.json").read_text())
    assert meta["design"] == design and meta["correction"] == "bh"
    used = meta["inputs"]["ioi"]["n"]
    assert used == 40 if design == "fixed" else used < 40
    assert f"ioi {used} of 40" in " ".join(out.split())


def test_roles_command_unknown_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["roles", "./no/such/folder"])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--device", "foo"], "'foo' is not one of 'cpu', 'cuda'"),
    (["--alpha", "2"], "not in the range 0<x<1"),
    (["--design", "adaptive"], "'adaptive' is not one of 'sequential', 'fixed'"),
])
def test_roles_command_bad_options_exit_2(planted, capsys, args, message):
    _, _, folder = planted
    with pytest.raises(SystemExit) as exit_info:
        main(["roles", str(folder), "--n-inputs", "2", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "internal error" not in err


def test_a_non_finite_tau_is_a_usage_error(synthetic_dir, capsys):
    from headgraph.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["roles", str(synthetic_dir), "--tau", "nan", "--n-inputs", "2"])
    assert capsys.readouterr().err.strip().startswith("error: --tau must be a finite")
    assert stop.value.code == 2
