"""Attribution (`effect_attr`) against exact patching on models small enough to patch every pair: a 2-layer x
4-head GPT-2 with weights scaled so that its heads attend sharply and its effects are far above float32's noise.
The references are TransformerLens hooks on the model's own bridge, one forward (or backward) per edge, sharing
no code with headgraph.analysis.causal: each edge's change is added to the receiver's hook_q / hook_k / hook_v,
computed from the two runs' caches and the bridge's own ln1."""

import tempfile

import numpy as np
import pytest
import torch
from scipy import stats

from headgraph.analysis.causal import local_effects, loss_effects
from headgraph.analysis.prompts import repeated_token_inputs
from headgraph.loader.models import load_model
from headgraph.testing.synthetic import random_gpt2_state, save_synthetic

pytestmark = pytest.mark.slow  # two bridge loads, their causal stages and one TransformerLens forward per edge: 30-60 s

STEPS = 4  # headgraph.analysis.causal.network.ATTRIBUTION_STEPS, as run.json's definition states it


def _model(writes: float):
    """The 2 x 4 model: queries/keys/values x 8, embeddings x 10, layer 1's writes x 20, layer 0's x `writes`."""
    state = random_gpt2_state(2, 4, 64, 128, 512, seed=0)
    for layer in range(2):
        state[f"transformer.h.{layer}.attn.c_attn.weight"] *= 8
    state["transformer.wte.weight"] *= 10
    state["transformer.h.0.attn.c_proj.weight"] *= writes
    state["transformer.h.1.attn.c_proj.weight"] *= 20
    return load_model(save_synthetic(tempfile.mkdtemp(), weights=state), processing="raw", device="cpu")


@pytest.fixture(scope="module", params=[20.0, 2.0], ids=["writes-x20", "writes-x2"])
def measured(request):
    """(model, clean ids, corrupted ids, headgraph's local effects with attribution, its loss effects)."""
    model = _model(request.param)
    clean = repeated_token_inputs(model.tokenizer, 8, seed=0, length=8)
    corrupt = repeated_token_inputs(model.tokenizer, 8, seed=1, length=8)  # same length: no padding
    local = local_effects(model, clean, corrupted=corrupt, n_boot=20)
    loss = loss_effects(model, clean, local, corrupted=corrupt, n_boot=20)
    return model, clean.input_ids, corrupt.input_ids, local, loss


def _token_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").sum()


def _changes(bridge, ids, alt):
    """{(sender, receiver, kind): the change of the receiver's q/k/v [b, T, e]} when only its input sees the
    sender's output change, and the two runs' caches."""
    _, clean = bridge.run_with_cache(ids)
    _, other = bridge.run_with_cache(alt)
    resid, ln = clean["blocks.1.hook_resid_pre"], bridge.blocks[1].ln1
    weights = {"Q": bridge.W_Q, "K": bridge.W_K, "V": bridge.W_V}
    found = {}
    with torch.no_grad():
        for s in range(4):
            delta = (other["blocks.0.attn.hook_z"][:, :, s] - clean["blocks.0.attn.hook_z"][:, :, s]) @ bridge.W_O[0, s]
            dx = ln(resid + delta) - ln(resid)
            for r in range(4):
                for kind in "QKV":
                    found[s, r, kind] = dx @ weights[kind][1, r]
    return found, clean, other


def _patched(bridge, ids, r, kind, change, names=()):
    """The run with receiver r's q/k/v changed: its summed token loss and the activations `names`."""
    kept = {}

    def add(value, hook):
        value = value.clone()
        value[:, :, r] += change
        return value

    def keep(name):
        def hook(value, hook):
            kept[name] = value.detach()
        return hook

    hooks = [(f"blocks.1.attn.hook_{kind.lower()}", add)] + [(n, keep(n)) for n in names]
    with torch.no_grad():
        return _token_loss(bridge.run_with_hooks(ids, fwd_hooks=hooks), ids), kept


def _key(row):
    return int(row.source[3]), int(row.target[3]), row.target_type


def test_attribution_ranks_every_pair_as_exact_patching_does(measured):
    """Spearman rho >= 0.9 per type between headgraph's attribution and TransformerLens' exact edge patch, over
    all 16 pairs of each type; headgraph's own exact loss effect is that patch to float32 precision."""
    model, ids, alt, local, loss = measured
    bridge = model.bridge
    changes, _, _ = _changes(bridge, ids, alt)
    with torch.no_grad():
        base = _token_loss(bridge(ids), ids)
    predicted = ids.shape[0] * (ids.shape[1] - 1)
    exact = np.array([float(_patched(bridge, ids, r, kind, changes[s, r, kind])[0] - base) / predicted
                      for s, r, kind in map(_key, local.itertuples())])
    assert np.abs(loss.effect_loss.to_numpy() - exact).max() <= 1e-5 + 1e-4 * np.abs(exact).max()
    for kind in "QKV":
        part = (local.target_type == kind).to_numpy()
        assert np.abs(exact[part]).max() > 1e-3  # effects far above the float32 noise of a loss difference
        assert stats.spearmanr(local.effect_attr[part], exact[part]).statistic >= 0.9, kind


def test_a_v_edges_attribution_is_its_definition_computed_with_transformerlens(measured):
    """A value receiver is linear in its input: its change is its attention times the value change, exactly.
    effect_attr of every OV pair equals run.json's definition rebuilt here from TransformerLens alone: that
    exact change of z_r times dL/dz_r, the gradient averaged over the edge's stretch [0, c] of the path on which
    every head's z is z + alpha (z' - z), read at alpha = k/4 and linear between, c the change's projection on
    the receiver's own z' - z in the output metric, clipped to [0, 1]; a fine trapezoid rule, not the closed form."""
    model, ids, alt, local, _ = measured
    bridge = model.bridge
    changes, clean, other = _changes(bridge, ids, alt)
    dz = {l: other[f"blocks.{l}.attn.hook_z"] - clean[f"blocks.{l}.attn.hook_z"] for l in range(2)}
    gradients = []
    for k in range(STEPS + 1):
        leaves = {l: (clean[f"blocks.{l}.attn.hook_z"] + k / STEPS * dz[l]).detach().requires_grad_()
                  for l in range(2)}
        hooks = [(f"blocks.{l}.attn.hook_z", lambda value, hook, z=leaves[l]: z) for l in range(2)]
        _token_loss(bridge.run_with_hooks(ids, fwd_hooks=hooks), ids).backward()
        gradients.append(leaves[1].grad)  # [b, T, H, e]
    grid = np.linspace(0, 1, 4001)
    w_o = bridge.W_O[1].detach()
    predicted = ids.shape[0] * (ids.shape[1] - 1)
    checked = 0
    for row in local[local.target_type == "V"].itertuples():
        s, r, _ = _key(row)
        _, kept = _patched(bridge, ids, r, "V", changes[s, r, "V"], ["blocks.1.attn.hook_z"])
        change = kept["blocks.1.attn.hook_z"][:, :, r] - clean["blocks.1.attn.hook_z"][:, :, r]  # [b, T, e]
        own = dz[1][:, :, r]
        place = ((change @ w_o[r]) * (own @ w_o[r])).sum((1, 2)) / (own @ w_o[r]).pow(2).sum((1, 2))
        total = 0.0
        for i, c in enumerate(place.clamp(0, 1).tolist()):
            dots = np.array([float((change[i] * g[i, :, r]).sum()) for g in gradients])  # at alpha = k/4
            if c == 0:
                total += dots[0]
                continue
            stretch = grid * c
            total += np.trapezoid(np.interp(stretch, np.arange(STEPS + 1) / STEPS, dots), stretch) / c
        assert row.effect_attr == pytest.approx(total / predicted, rel=1e-3, abs=1e-7)
        checked += 1
    assert checked == 16


def test_agreement_is_spearmans_rho_per_type_and_undefined_where_the_exact_effects_are_constant():
    """The ranks [1, 2, 3, 4] against [1, 3, 2, 4]: rho = 1 - 6 (1 + 1) / (4 (16 - 1)) = 0.8, the bar itself; exact
    effects all 0 (a random-init model's edges can move the loss by nothing) rank nothing: no rho, not reliable,
    and no warning from scipy about a constant input."""
    import warnings

    import pandas as pd

    from headgraph.analysis.causal.stage import agreement

    checked = pd.DataFrame({"source_type": "O", "target_type": ["K"] * 4 + ["V"] * 4,
                            "effect_attr": [0.1, 0.2, 0.3, 0.4] * 2, "effect_loss": [0.0] * 4 + [0.1, 0.3, 0.2, 0.4]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = agreement(checked)
    assert found["OK"]["spearman"] is None and found["OK"]["reliable"] is False and found["OK"]["edges"] == 4
    assert found["OV"]["spearman"] == 0.8 and found["OV"]["reliable"] is True
    assert found["OV"]["sign_agreement"] == 1.0 and found["OV"]["max_abs_error"] == pytest.approx(0.1)
