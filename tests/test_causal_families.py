"""Direct-path patching on the families of headgraph.testing.families (rotary, grouped- and multi-query, RMSNorm,
QK-norm, post-attention norms, soft-capping, sliding windows, parallel blocks, ALiBi) against one edge at a time
through the bridge's own hooks: the sender's write read off a forward pass with its z replaced (its layer's MLP
held clean), added to the receiver's split Q/K/V input (`set_use_split_qkv_input`: the model's own norm, rotary,
QK-norm and attention after it), the receiver's pattern, z and the next-token loss read off that forward."""

import numpy as np
import pytest
import torch

from headgraph.analysis import causal as C
from headgraph.analysis.prompts import repeated_token_inputs
from headgraph.loader.models import load_model
from headgraph.testing.families import save_family

# every attention variant the module path meets; GPT-2 and OPT (recompute path) are covered by test_causal.py
FAMILIES = ("llama", "llama-mqa", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "pythia", "phi3", "olmo2", "gptj",
            "phi2", "bloom", "mpt", "falcon")
# GPT-J, MPT: no split Q/K/V input in the bridge; BLOOM's split input differs from its own forward by 1 % of these
# small effects (its own forward with hook_q replaced agrees with headgraph to 1e-7): projections by hand
BY_HAND = ("GPTJForCausalLM", "MptForCausalLM", "BloomForCausalLM")
N_INPUTS, HALF = 6, 4
pytestmark = pytest.mark.slow  # 15 families built and loaded once for the module
LENGTH = 1 + 2 * HALF  # BOS, then the random half twice


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: load_model(save_family(name, root / name), processing="tl", device="cpu") for name in FAMILIES}


def _sender_write(model, inputs, alt, layer: int, head: int) -> torch.Tensor:
    """resid_pre[layer + 1](x with the sender's z from x') - resid_pre[layer + 1](x), the sender layer's MLP
    output held clean: what the sender alone writes into the next layer's residual input."""
    bridge = model.bridge
    _, clean = bridge.run_with_cache(inputs.input_ids, names_filter=lambda n: n in (
        f"blocks.{layer}.hook_mlp_out", f"blocks.{layer + 1}.hook_resid_pre"))
    _, other = bridge.run_with_cache(alt.input_ids, names_filter=lambda n: n == f"blocks.{layer}.attn.hook_z")

    def swap(z, hook):
        z = z.clone()
        z[:, :, head] = other[f"blocks.{layer}.attn.hook_z"][:, :, head]
        return z

    got = {}
    bridge.run_with_hooks(inputs.input_ids, fwd_hooks=[
        (f"blocks.{layer}.attn.hook_z", swap),
        (f"blocks.{layer}.hook_mlp_out", lambda out, hook: clean[f"blocks.{layer}.hook_mlp_out"]),
        (f"blocks.{layer + 1}.hook_resid_pre", lambda r, hook: got.setdefault("r", r))])
    return got["r"] - clean[f"blocks.{layer + 1}.hook_resid_pre"]


def _patched_receiver(model, inputs, delta, layer: int, receiver: int, kind: str):
    """(logits, {pattern, z} of `layer`) with delta added to the receiver's split `kind` input only; where the
    bridge has no exact split input (`BY_HAND`), the receiver's projection ln1(resid + delta) W + b computed by
    hand replaces its own at hook_q / hook_k / hook_v (the model's rotary, masks and ALiBi after it)."""
    bridge = model.bridge
    got = {}
    keep = [(f"blocks.{layer}.attn.hook_pattern", lambda p, hook: got.setdefault("pattern", p)),
            (f"blocks.{layer}.attn.hook_z", lambda z, hook: got.setdefault("z", z))]
    if model.cfg["architecture"] in BY_HAND:
        _, cache = bridge.run_with_cache(inputs.input_ids, names_filter=f"blocks.{layer}.hook_resid_pre")
        x = bridge.blocks[layer].ln1(cache[f"blocks.{layer}.hook_resid_pre"] + delta)
        try:
            bias = getattr(bridge, f"b_{kind}")[layer, receiver]
        except AttributeError:  # bias-free
            bias = 0.0
        new = x @ getattr(model, f"W_{kind}")[layer, receiver] + bias

        def swap(projected, hook):
            projected = projected.clone()
            projected[:, :, receiver] = new
            return projected

        return bridge.run_with_hooks(inputs.input_ids, fwd_hooks=[(f"blocks.{layer}.attn.hook_{kind.lower()}", swap),
                                                                  *keep]), got

    def add(x, hook):
        x = x.clone()
        x[:, :, receiver] += delta
        return x

    bridge.set_use_split_qkv_input(True)
    try:
        logits = bridge.run_with_hooks(inputs.input_ids, fwd_hooks=[(f"blocks.{layer}.hook_{kind.lower()}_input", add),
                                                                    *keep])
    finally:
        bridge.set_use_split_qkv_input(False)
    return logits, got


def _losses(logits, ids) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].double().transpose(1, 2), ids[:, 1:], reduction="none").sum()


def _reference(model, inputs, alt, sender: int, receiver: int, kind: str) -> tuple[float, float]:
    """(local effect, loss effect) of L0H{sender} -> layer 1's receiver (a query head for Q, a KV head for K/V)."""
    bridge = model.bridge
    kv = bridge.cfg.n_key_value_heads or bridge.cfg.n_heads
    group = 1 if kind == "Q" else bridge.cfg.n_heads // kv
    heads = slice(receiver * group, (receiver + 1) * group)
    delta = _sender_write(model, inputs, alt, 0, sender)
    clean_logits, clean = _patched_receiver(model, inputs, torch.zeros_like(delta), 1, receiver, kind)
    logits, patched = _patched_receiver(model, inputs, delta, 1, receiver, kind)
    loss = float((_losses(logits, inputs.input_ids) - _losses(clean_logits, inputs.input_ids))
                 / (len(inputs) * (LENGTH - 1)))
    if kind == "V":
        w_o = model.W_O[1, heads].float()
        change = torch.einsum("bthe,hed->bthd", (patched["z"] - clean["z"])[:, :, heads].float(), w_o)
        out = torch.einsum("bthe,hed->bthd", clean["z"][:, :, heads].float(), w_o)
        return float(change.pow(2).sum().sqrt() / out.pow(2).sum().sqrt()), loss
    tv = 0.5 * (patched["pattern"] - clean["pattern"])[:, heads].abs().sum(-1)  # [b, h, T]
    return float(tv[:, :, 1:].mean()), loss  # the first query sees one key only


@pytest.mark.parametrize("family", FAMILIES)
def test_effects_equal_one_edge_at_a_time_through_the_bridges_hooks(models, family):
    model = models[family]
    inputs = repeated_token_inputs(model.tokenizer, N_INPUTS, seed=1, length=HALF)  # one length: no padding
    assert inputs.input_ids.shape[1] == LENGTH and bool(inputs.attention_mask.all())
    alt = C.resample_inputs(inputs, seed=0)
    local = C.local_effects(model, inputs, corrupted=alt, n_boot=20)
    kv = model.cfg["n_kv_heads"]
    grouped = kv < model.cfg["n_heads"]
    edges = [(1, 2, "Q"), (2, kv - 1, "K"), (3, 0, "V")]  # (sender in layer 0, receiver in layer 1, kind)
    rows = [local[(local.source == f"L0H{s}") & (local.target_type == kind)
                  & (local.target == (f"L1KV{r}" if grouped and kind != "Q" else f"L1H{r}"))] for s, r, kind in edges]
    assert [len(r) for r in rows] == [1, 1, 1]
    loss = C.loss_effects(model, inputs, local.iloc[[r.index[0] for r in rows]], corrupted=alt, n_boot=20)
    for (s, r, kind), row, loss_effect in zip(edges, rows, loss.effect_loss):
        want_local, want_loss = _reference(model, inputs, alt, s, r, kind)
        assert want_local > 1e-6  # the edge moves its receiver: the comparison is not of two zeros
        assert float(row.effect.iloc[0]) == pytest.approx(want_local, rel=1e-5, abs=1e-8), (family, kind)
        # float32 logits of passes shaped differently (one input and its copies, the whole batch) differ by ~1e-7
        # per token, which is 1e-3 of these untrained models' loss effects: the loss agrees to that
        assert float(loss_effect) == pytest.approx(want_loss, rel=1e-3, abs=1e-6), (family, kind)


@pytest.mark.parametrize("family", ["llama", "gemma2", "olmo2", "bloom"])
def test_effects_are_zero_when_the_counterfactual_is_the_input(models, family):
    model = models[family]
    sets = C.causal_inputs(model, 4, seed=0)
    local = C.local_effects(model, sets, corrupted=sets, n_boot=10)
    assert (local.effect.fillna(0) == 0).all() and (local.effect_attr == 0).all()
    loss = C.loss_effects(model, sets, local.groupby("target_type").head(2), corrupted=sets, n_boot=10)
    assert (loss.effect_loss == 0).all()


def test_grouped_query_receivers_are_the_kv_heads(models):
    model = models["llama"]
    L, H, KV = (model.cfg[k] for k in ("n_layers", "n_heads", "n_kv_heads"))
    local = C.local_effects(model, C.causal_inputs(model, 4, seed=0), n_boot=10)
    counts = local.groupby("target_type").size().to_dict()
    later = L * (L - 1) // 2  # (earlier, later) layer pairs
    assert counts == {"Q": later * H * H, "K": later * H * KV, "V": later * H * KV}
    assert set(local[local.target_type != "Q"].target) == {f"L{l}KV{g}" for l in range(1, L) for g in range(KV)}
    assert np.isfinite(local.effect).all()


STEPS = 4  # headgraph.analysis.causal.network.ATTRIBUTION_STEPS, as run.json's definition states it


def test_a_grouped_value_receivers_attribution_is_its_definition(models):
    """effect_attr of a grouped-query V edge (Llama's L0H3 -> L1KV0) equals run.json's definition rebuilt from
    the bridge's hooks: for each query head of the KV head's group, the exact change of its z (the receiver's
    split value input moved by the sender's write) times dL/dz, the gradient averaged over the edge's stretch
    [0, c] of the path on which every head's z is z + alpha (z' - z), read at alpha = k/4 and linear between, c
    the change's projection on the head's own z' - z in the output metric, clipped to [0, 1]; summed over the
    group and the inputs, per predicted token (a fine trapezoid rule, not the closed form)."""
    model = models["llama"]
    bridge = model.bridge
    inputs = repeated_token_inputs(model.tokenizer, N_INPUTS, seed=1, length=HALF)
    alt = C.resample_inputs(inputs, seed=0)
    local = C.local_effects(model, inputs, corrupted=alt, n_boot=20)
    row = local[(local.source == "L0H3") & (local.target == "L1KV0") & (local.target_type == "V")]
    ids, names = inputs.input_ids, [f"blocks.{l}.attn.hook_z" for l in range(model.cfg["n_layers"])]
    _, clean = bridge.run_with_cache(ids, names_filter=lambda n: n in names)
    _, other = bridge.run_with_cache(alt.input_ids, names_filter=lambda n: n in names)
    dz = {n: other[n] - clean[n] for n in names}
    gradients = []
    for k in range(STEPS + 1):
        with torch.enable_grad():
            leaves = {n: (clean[n] + k / STEPS * dz[n]).detach().requires_grad_() for n in names}
            hooks = [(n, lambda value, hook, z=leaves[n]: z) for n in names]
            _losses(bridge.run_with_hooks(ids, fwd_hooks=hooks), ids).backward()
        gradients.append(leaves[names[1]].grad.float())  # [b, T, H, e]
    delta = _sender_write(model, inputs, alt, 0, 3)
    _, before = _patched_receiver(model, inputs, torch.zeros_like(delta), 1, 0, "V")
    _, after = _patched_receiver(model, inputs, delta, 1, 0, "V")
    w_o, grid, total = model.W_O[1].float(), np.linspace(0, 1, 4001), 0.0
    for h in range(model.cfg["n_heads"] // model.cfg["n_kv_heads"]):  # the query heads reading KV head 0
        change, own = (after["z"] - before["z"])[:, :, h].float(), dz[names[1]][:, :, h].float()  # [b, T, e]
        place = ((change @ w_o[h]) * (own @ w_o[h])).sum((1, 2)) / (own @ w_o[h]).pow(2).sum((1, 2))
        for i, c in enumerate(place.clamp(0, 1).tolist()):
            dots = np.array([float((change[i] * g[i, :, h]).sum()) for g in gradients])
            if c == 0:
                total += dots[0]
                continue
            stretch = grid * c
            total += np.trapezoid(np.interp(stretch, np.arange(STEPS + 1) / STEPS, dots), stretch) / c
    want = total / (len(inputs) * (LENGTH - 1))
    assert abs(want) > 1e-6  # the edge moves the loss: the comparison is not of two zeros
    assert float(row.effect_attr.iloc[0]) == pytest.approx(want, rel=1e-3, abs=1e-7)
