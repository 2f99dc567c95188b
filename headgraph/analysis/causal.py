"""Direct-path patching: does a head's output reach a later head's query, key or value on real inputs?

PK and the Composition Score read weights only. This module answers the causal question by patching
activations (Wang et al. 2023; Goldowsky-Dill et al. 2023), for sender s (layer l_s) and receiver r
(layer l_r > l_s) along the OQ, OK or OV edge, i.e. r's T input (T = Q, K or V):

- Corrupted input x'. Resample ablation (the default): another input of the same set, drawn (seeded) among
  those at least as long (`resample_inputs`), or the caller's own counterfactuals (`corrupted=`); where x'
  has no token, s stays clean. Mean ablation: s's output averaged over the set's inputs at each position.
- Only r's T input sees Δ_s = out_s(x') − out_s(x), out_s = z_s W_O[s] (TransformerLens `hook_result`):
  pre-LN models (GPT-2): T input = LN(resid_pre[l_r](x) + Δ_s), the LayerNorm recomputed on the patched
  residual. Post-LN models (BERT), whose residual stream is no sum of head outputs: Δ_s enters where s
  writes and passes through the LayerNorms of the layers up to l_r, their attention and MLP outputs clean.
- Local effect (`local_effects`: every OQ/OK/OV pair). T = Q, K: total-variation distance
  ½ Σ_k |A_r − A'_r| between r's clean and patched attention rows, in [0, 1], averaged over inputs and query
  positions (real queries that see more than one key). T = V: ‖out_r' − out_r‖_F / ‖out_r‖_F over the real
  tokens of all inputs.
- Downstream effect (`loss_effects`: given edges). r's patched output replaces its clean one and the rest
  of the model runs on it (layer l_r's MLP and every later layer see the change). Decoder: change of the
  next-token cross-entropy, nats per predicted token; positive = the path helps the model (the loss rises
  when it is ablated). Encoder: ‖h' − h‖_F / ‖h‖_F of the final hidden states (a sentence encoder's MLM
  head may be untrained, so no masked-LM loss).
- Uncertainty: 95 % percentile bootstrap over inputs (seeded). Each effect is a ratio of sums over inputs;
  every bootstrap sample recomputes both sums.

What an effect does NOT mean. It measures the *direct* path s → r.T only: not the total effect of s on r
(paths through the heads and MLPs in between are held clean), not a mediated effect, and not what r does for
the output (the local effect says how far r's attention or output moves; `loss_effects` says whether the
model's predictions care). It depends on the input distribution (IOI prompts, repeated random tokens,
sentence pairs, the user's texts) and on the ablation: a small effect does not rule the path out on other
inputs, and a large one is no proof of a circuit.

Computation: each receiver layer's attention is recomputed from its input with the bridge's weights and
LayerNorm modules (checked against the model's own `hook_z` on every batch; models it cannot reproduce, e.g.
rotary or grouped-query attention, raise UsageError). All senders of one layer × all receivers of one later
layer are one batched tensor operation, no Python loop over head pairs: cost ≈ pairs × tokens × d_model ×
d_head per type (pre-LN models with LayerNorm: pairs × tokens × d_head², the senders' Δz projected through
c(W_O) Γ W, `_FactoredChange`), plus the patched attention rows. `loss_effects` stacks the edges' patched copies
of one input into shared forward passes, each copy joining at its receiver's layer: cost ≈ edges × tokens × the
layers from the receiver's on (and, for a decoder, the unembedding).

>>> import tempfile
>>> from headgraph.analysis.prompts import repeated_token_inputs
>>> from headgraph.loader.models import load_model
>>> from headgraph.testing.synthetic import save_synthetic
>>> model = load_model(save_synthetic(tempfile.mkdtemp()), processing="raw", device="cpu")
>>> inputs = repeated_token_inputs(model.tokenizer, 8, seed=0, length=6)
>>> local = local_effects(model, inputs, n_boot=200)
>>> len(local), local.columns.tolist()  # 4 senders in layer 0 x 4 receivers in layer 1 x 3 types
(48, ['source', 'target', 'source_type', 'target_type', 'effect', 'effect_lo', 'effect_hi'])
>>> bool(((local.effect_lo <= local.effect) & (local.effect <= local.effect_hi)).all())
True
>>> loss = loss_effects(model, inputs, local.head(2), n_boot=200)
>>> loss[["source", "target", "source_type", "target_type"]].values.tolist()
[['L0H0', 'L1H0', 'O', 'Q'], ['L0H0', 'L1H1', 'O', 'Q']]
>>> float(loss_effects(model, inputs, local.head(1), corrupted=inputs).effect_loss.iloc[0])  # x' = x
0.0
"""

import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from headgraph.analysis.options import ABLATIONS, DEFAULT_N_BOOT, CausalOptions
from headgraph.analysis.patterns import model_kwargs, run_with_activations
from headgraph.analysis.prompts import (TokenInputs, ioi_inputs, repeated_token_inputs, sentence_pair_inputs,
                                       text_inputs)
from headgraph.analysis.roles import REPEAT_LENGTH
from headgraph.errors import UsageError
from headgraph.heads import COMPOSITION_TYPES, check_type_pair, head_name

CONFIDENCE = 0.95
DEFAULT_BATCH_SIZE = CausalOptions.batch_size
DEFAULT_MAX_MEMORY = CausalOptions.max_memory
KEY_COLUMNS = ["source", "target", "source_type", "target_type"]
LOCAL_COLUMNS = KEY_COLUMNS + ["effect", "effect_lo", "effect_hi"]
LOSS_COLUMNS = KEY_COLUMNS + ["effect_loss", "effect_loss_lo", "effect_loss_hi"]
DEFINITIONS = {
    "local_QK": "mean over inputs and query positions (real queries seeing more than one key) of the total-"
                "variation distance 1/2 sum_k |A_r - A'_r| between r's clean and patched attention rows",
    "local_V": "||out_r' - out_r||_F / ||out_r||_F over the real tokens of all inputs",
    "loss_decoder": "patched minus clean next-token cross-entropy, nats per predicted token "
                    "(positive = the path helps the model)",
    "loss_encoder": "||h' - h||_F / ||h||_F of the final hidden states over the real tokens",
    "patch": "only r's Q/K/V input sees out_s(x') - out_s(x); the LayerNorm in front of r is recomputed; "
             "post-LN models carry the change through the LayerNorms up to r, attention and MLP outputs clean",
    "interval": f"{CONFIDENCE:.0%} percentile bootstrap over inputs",
}
_HEAD = re.compile(r"^L(\d+)H(\d+)$")
_RESAMPLE_STREAM, _BOOTSTRAP_STREAM = 101, 102
_Z_TOLERANCE = 1e-3  # relative: recomputed vs the model's own z
_BOOTSTRAP_CHUNK = 4096  # pairs per bootstrap matrix product


# ---------- inputs ------------------------------------------------------------------------------------------

def causal_inputs(model, n: int, seed: int = 0, texts: Sequence[str] | None = None) -> tuple[TokenInputs, ...]:
    """The role tests' generated input sets of a LoadedModel's kind, n inputs each: IOI prompts and repeated
    random tokens (decoder), sentence pairs (encoder); or, given `texts`, those texts as one set."""
    bridge = model.bridge
    if texts is not None:
        return (text_inputs(model.tokenizer, list(texts), bridge.cfg.attention_dir == "causal"),)
    if bridge.cfg.attention_dir == "causal":
        return (ioi_inputs(model.tokenizer, n, seed),
                repeated_token_inputs(model.tokenizer, n, seed, REPEAT_LENGTH, bridge.cfg.d_vocab))
    return (sentence_pair_inputs(model.tokenizer, n, seed),)


def read_texts(path) -> list[str]:
    """The non-empty lines of a text file (`--causal-inputs FILE`); an unreadable file raises UsageError."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the causal inputs file '{path}' ({e.__class__.__name__}: {e}); "
                         "give a UTF-8 text file, one input a line") from None
    return [line.strip() for line in lines if line.strip()]


def with_effects(pairs: pd.DataFrame, effects: pd.DataFrame) -> pd.DataFrame:
    """`pairs` with the effect columns of `effects` (rows of `local_effects` or `loss_effects`) joined on the
    pair key, NaN for the pairs they do not cover; earlier columns of the same names are replaced."""
    columns = [c for c in effects.columns if c not in KEY_COLUMNS]
    return pairs.drop(columns=[c for c in columns if c in pairs.columns]).merge(
        effects, on=KEY_COLUMNS, how="left", validate="many_to_one")


def resample_inputs(inputs: TokenInputs, seed: int = 0) -> TokenInputs:
    """Resample ablation's counterfactuals: row i is another input of the set, drawn uniformly (seeded) among
    those at least as long as input i; the longest input, when no other is as long, draws among the longest
    others (its last positions then keep the sender clean)."""
    n = len(inputs)
    if n < 2:
        raise UsageError(f"resample ablation needs at least 2 inputs in set '{inputs.name}', got {n}")
    lengths = inputs.attention_mask.sum(-1).numpy()
    rng = np.random.default_rng([seed, _RESAMPLE_STREAM])
    rows = []
    for i in range(n):
        others = np.delete(np.arange(n), i)
        candidates = others[lengths[others] >= lengths[i]]
        if not len(candidates):
            candidates = others[lengths[others] == lengths[others].max()]
        rows.append(int(rng.choice(candidates)))
    return inputs.rows(torch.tensor(rows))


def _input_sets(inputs, what: str) -> tuple[TokenInputs, ...]:
    sets = (inputs,) if isinstance(inputs, TokenInputs) else tuple(inputs)
    if not sets or any(not isinstance(s, TokenInputs) or len(s) == 0 for s in sets):
        raise UsageError(f"{what} must be a non-empty TokenInputs or a sequence of them")
    return sets


def _counterfactuals(sets, ablation: str, corrupted, seed: int) -> tuple[TokenInputs | None, ...]:
    if ablation not in ABLATIONS:
        raise UsageError(f"unknown ablation {ablation!r}: use one of {', '.join(ABLATIONS)}")
    if ablation == "mean":
        if corrupted is not None:
            raise UsageError("corrupted inputs go with ablation 'resample'; mean ablation takes none")
        return (None,) * len(sets)
    if corrupted is None:
        return tuple(resample_inputs(s, seed) for s in sets)
    pairs = _input_sets(corrupted, "corrupted")
    if len(pairs) != len(sets) or any(len(c) != len(s) for c, s in zip(pairs, sets)):
        raise UsageError(f"corrupted inputs must match the inputs one to one: got sets of "
                         f"{[len(c) for c in pairs]} inputs for {[len(s) for s in sets]}")
    return pairs


# ---------- the model ---------------------------------------------------------------------------------------

class CausalUnsupported(UsageError):
    """The model's attention cannot be recomputed here (rotary, grouped-query, ...): no causal effects for it."""


def _unsupported(bridge, why: str) -> CausalUnsupported:
    return CausalUnsupported(f"causal effects cannot be computed for {bridge.cfg.architecture}: {why}; "
                      "analyze it without causal effects")


def _is_post_ln(bridge, probe: TokenInputs) -> bool:
    """False where attention reads LN(residual) (GPT-2), True where it reads the residual and LayerNorms
    follow each sublayer (BERT); read off one forward pass."""
    names = ["blocks.0.hook_resid_pre", "blocks.0.ln1.hook_in", "blocks.0.ln1.hook_out", "blocks.0.attn.hook_in",
             "blocks.0.ln2.hook_out", "blocks.0.hook_resid_post"]
    _, cache = bridge.run_with_cache(probe.input_ids.to(bridge.cfg.device), names_filter=names, return_type=None,
                                     **model_kwargs(bridge, probe))  # served hooks only: the check names the rest
    if not set(names) <= set(cache.keys()):
        raise _unsupported(bridge, "its blocks lack the TransformerBridge hooks "
                                   f"{', '.join(sorted(set(names) - set(cache.keys())))}")
    attn_in = cache["blocks.0.attn.hook_in"]
    if torch.equal(attn_in, cache["blocks.0.ln1.hook_out"]) and torch.equal(cache["blocks.0.ln1.hook_in"],
                                                                           cache["blocks.0.hook_resid_pre"]):
        return False
    if torch.equal(attn_in, cache["blocks.0.hook_resid_pre"]) and torch.equal(cache["blocks.0.hook_resid_post"],
                                                                             cache["blocks.0.ln2.hook_out"]):
        return True
    raise _unsupported(bridge, "its attention reads neither a LayerNorm of the residual stream (GPT-2) nor the "
                               "residual stream with a LayerNorm after each sublayer (BERT)")


@dataclass(frozen=True)
class _Net:
    """What patching needs of a model: its bridge, sizes, layout and weights in TransformerLens layout."""

    bridge: Any
    n_layers: int
    n_heads: int
    causal: bool
    post_ln: bool
    scale: float
    weights: dict[str, torch.Tensor]  # W_Q/W_K/W_V [L, H, d, e], b_Q/b_K/b_V [L, H, e], W_O [L, H, e, d]; and
    # W_V_out = W_V R [L, H, d, e], the values read so that ||Δz R|| is the output change's norm (`_local_weight`)
    out_root: torch.Tensor  # R [L, H, e, e] with R R^T = W_O W_O^T: ||z W_O|| = ||z R||

    def native_norm(self, layer: int, which: int) -> torch.nn.LayerNorm | None:
        """The torch LayerNorm ln{which} of `layer` wraps where the bridge runs it as it is (observed without
        hooks, its numerics exactly), else None."""
        bridge_norm = getattr(self.bridge.blocks[layer], f"ln{which}")
        wrapped = bridge_norm.original_component
        native = bridge_norm.use_native_layernorm_autograd or getattr(bridge_norm.config, "layer_norm_folding", False)
        return wrapped if native and type(wrapped) is torch.nn.LayerNorm else None

    def layer_norm(self, layer: int, which: int) -> tuple[torch.Tensor | None, float] | None:
        """(weight γ or None, eps) where ln{which} of `layer` computes γ·c(x)/sqrt(mean(c(x)²) + eps) + β
        with c the centring (a LayerNorm, natively or by the bridge's own forward), None otherwise (RMSNorm)."""
        wrapped = self.native_norm(layer, which)
        if wrapped is not None:
            return wrapped.weight, wrapped.eps
        bridge_norm = getattr(self.bridge.blocks[layer], f"ln{which}")
        if bridge_norm.uses_rms_norm:
            return None
        weight = bridge_norm.weight
        return (1.0 + weight if bridge_norm.uses_weight_offset else weight), getattr(bridge_norm.config, "eps", 1e-5)

    def norm(self, layer: int, which: int, x: torch.Tensor) -> torch.Tensor:
        """The model's own LayerNorm ln{which} of `layer` applied to x: the native module's layer_norm directly
        where there is one (`native_norm`; it spares the bridge's hook-point statistics), else the bridge's
        forward (not __call__: the block's capture hooks on ln1 would hold on to x)."""
        wrapped = self.native_norm(layer, which)
        if wrapped is not None and x.dtype in (torch.float32, torch.float64):
            return torch.nn.functional.layer_norm(x, wrapped.normalized_shape, wrapped.weight, wrapped.bias,
                                                  wrapped.eps)
        return getattr(self.bridge.blocks[layer], f"ln{which}").forward(x)


def _network(model, probe: TokenInputs) -> _Net:
    bridge = model.bridge
    cfg = bridge.cfg
    if cfg.n_key_value_heads and cfg.n_key_value_heads != cfg.n_heads:
        raise _unsupported(bridge, f"grouped-query attention ({cfg.n_key_value_heads} key/value heads for "
                                   f"{cfg.n_heads} query heads)")
    weights = {n: getattr(bridge, n).detach().float() for n in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V")}
    root = torch.linalg.qr(weights["W_O"].transpose(-1, -2)).R.transpose(-1, -2)  # W_O^T = Q R^T, Q orthonormal
    weights["W_V_out"] = weights["W_V"] @ root
    return _Net(bridge=bridge, n_layers=int(cfg.n_layers), n_heads=int(cfg.n_heads),
                causal=cfg.attention_dir == "causal", post_ln=_is_post_ln(bridge, probe),
                scale=1.0 / math.sqrt(cfg.d_head), weights=weights, out_root=root)


# ---------- clean and corrupted activations of one batch ----------------------------------------------------

@dataclass(frozen=True)
class _Batch:
    """One batch: its rows among all inputs, masks, the clean residual inputs and z, and Δz of every head."""

    rows: slice
    inputs: TokenInputs
    real: torch.Tensor  # bool [b, T]
    visible: torch.Tensor  # bool [b, T(query), T(key)]: a real key the query may attend to
    queries: torch.Tensor  # float [b, T]: real queries that see more than one key
    resid: list[torch.Tensor]  # resid_pre of every layer [b, T, d]
    z: torch.Tensor  # the model's z [L, b, T, H, e]
    dz: torch.Tensor  # z(x') - z(x) [L, b, T, H, e], 0 where x or x' has no token
    norms: list[tuple[torch.Tensor, ...]] | None  # post-LN: (ln1 in, ln1 out, ln2 in, ln2 out) of layers < L-1


def _z_names(net: _Net) -> list[str]:
    return [f"blocks.{l}.attn.hook_z" for l in range(net.n_layers)]


def _z_of(net: _Net, inputs: TokenInputs, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """z [L, b, length, H, e] of a batch, cut or zero-padded to `length`, and its real-token mask [b, length]."""
    _, cache = run_with_activations(net.bridge, inputs, _z_names(net))
    z = torch.stack([cache[name] for name in _z_names(net)]).float()
    real = inputs.attention_mask.bool().to(z.device)
    pad = length - z.shape[2]
    if pad >= 0:
        return torch.nn.functional.pad(z, (0, 0, 0, 0, 0, pad)), torch.nn.functional.pad(real, (0, pad))
    return z[:, :, :length], real[:, :length]


def _mean_z(net: _Net, inputs: TokenInputs, batch_size: int, advance: Callable[[], None]) -> torch.Tensor:
    """Mean ablation's z [L, T, H, e]: each head's z averaged over the inputs with a real token at each position."""
    length = inputs.input_ids.shape[1]
    total, count = None, torch.zeros(length)
    for start in range(0, len(inputs), batch_size):
        z, real = _z_of(net, inputs.batch(start, min(start + batch_size, len(inputs))), length)
        part = (z * real[None, :, :, None, None]).sum(1)
        total = part if total is None else total + part
        count += real.sum(0).cpu()
        advance()
    return total / count.clamp(min=1).to(total.device)[None, :, None, None]


def _batches(net: _Net, sets, corrupted, batch_size: int, advance: Callable[[], None]) -> Iterator[_Batch]:
    L = net.n_layers
    names = _z_names(net) + [f"blocks.{l}.hook_resid_pre" for l in range(L)]
    if net.post_ln:
        names += [f"blocks.{l}.ln{i}.hook_in" for l in range(L - 1) for i in (1, 2)]
    offset = 0
    for clean_set, corrupt_set in zip(sets, corrupted):
        mean = _mean_z(net, clean_set, batch_size, advance) if corrupt_set is None else None
        for start in range(0, len(clean_set), batch_size):
            stop = min(start + batch_size, len(clean_set))
            batch = clean_set.batch(start, stop)
            _, cache = run_with_activations(net.bridge, batch, names)
            z = torch.stack([cache[name] for name in _z_names(net)]).float()
            T = z.shape[2]
            real = batch.attention_mask.bool().to(z.device)
            if mean is None:
                z_alt, real_alt = _z_of(net, corrupt_set.batch(start, stop), T)
            else:
                z_alt, real_alt = mean[:, None, :T].expand_as(z), real
            both = (real & real_alt)[None, :, :, None, None]
            visible = real[:, None, :].expand(-1, T, -1)
            if net.causal:
                visible = visible & torch.ones(T, T, dtype=torch.bool, device=z.device).tril()
            norms = None
            if net.post_ln:
                norms = []
                for l in range(L - 1):
                    a1, a2 = cache[f"blocks.{l}.ln1.hook_in"], cache[f"blocks.{l}.ln2.hook_in"]
                    norms.append((a1, net.norm(l, 1, a1), a2, net.norm(l, 2, a2)))
            yield _Batch(rows=slice(offset + start, offset + stop), inputs=batch, real=real, visible=visible,
                         queries=(real & (visible.sum(-1) > 1)).float(),
                         resid=[cache[f"blocks.{l}.hook_resid_pre"] for l in range(L)], z=z,
                         dz=torch.where(both, z_alt - z, torch.zeros_like(z)), norms=norms)
            advance()
        offset += len(clean_set)


# ---------- receivers ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Layer:
    """Clean attention of one receiver layer, recomputed from its input: what patched rows are compared to."""

    x: torch.Tensor  # [b, T, d]: what Q, K and V read (after ln1 in a pre-LN model)
    q: torch.Tensor  # [b, T, H, e]
    k: torch.Tensor
    v: torch.Tensor
    scores: torch.Tensor  # [b, H, T, T], -inf on keys a query cannot see
    pattern: torch.Tensor  # [b, H, T, T]
    z: torch.Tensor  # [b, T, H, e]


def _receiver_layer(net: _Net, batch: _Batch, layer: int) -> _Layer:
    """Recompute layer's attention; UsageError unless it reproduces the model's own z on the real tokens."""
    w = net.weights
    x = batch.resid[layer] if net.post_ln else net.norm(layer, 1, batch.resid[layer])
    q, k, v = (torch.einsum("btd,hde->bthe", x, w[f"W_{t}"][layer]) + w[f"b_{t}"][layer] for t in "QKV")
    scores = (torch.einsum("bqhe,bkhe->bhqk", q, k) * net.scale).masked_fill(~batch.visible[:, None], -math.inf)
    pattern = torch.softmax(scores, -1)
    z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
    own = batch.z[layer][batch.real]
    error = (z[batch.real] - own).abs().max().item()
    if error > _Z_TOLERANCE * (own.abs().max().item() + 1e-6):
        raise _unsupported(net.bridge, f"recomputing layer {layer}'s attention from its input misses the model's "
                                       f"own z by {error:.3g} (rotary or relative positions, another score "
                                       "scale or soft-capping are not supported)")
    return _Layer(x=x, q=q, k=k, v=v, scores=scores, pattern=pattern, z=z)


def _sender_writes(net: _Net, batch: _Batch, layer: int, heads: slice) -> torch.Tensor:
    """Δ_s = (z_s(x') - z_s(x)) W_O[s] [S, b, T, d] of the heads `heads` of a sender layer."""
    return torch.einsum("bthe,hed->hbtd", batch.dz[layer][:, :, heads], net.weights["W_O"][layer, heads])


def _carry(net: _Net, batch: _Batch, layer: int, delta: torch.Tensor) -> torch.Tensor:
    """A change of `layer`'s attention output carried to the next layer's residual input, the layer's heads
    and MLP held clean: unchanged in a pre-LN model, through ln1 and ln2 in a post-LN one."""
    if not net.post_ln:
        return delta
    a1, n1, a2, n2 = batch.norms[layer]
    delta = net.norm(layer, 1, a1 + delta) - n1
    return net.norm(layer, 2, a2 + delta) - n2


def _input_change(net: _Net, batch: _Batch, recv: _Layer, layer: int, delta: torch.Tensor) -> torch.Tensor:
    """Change [S, b, T, d] of what the receiver layer's Q/K/V read when its residual input changes by delta."""
    if net.post_ln:
        return delta
    return net.norm(layer, 1, batch.resid[layer] + delta) - recv.x


def _project(dx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dx [S, b, T, d] read by the receiver heads' weights [h, d, e]: [S, b, T, h, e]."""
    return torch.einsum("sbtd,hde->sbthe", dx, weight)


def _local_weight(net: _Net, layer: int, kind: str) -> torch.Tensor:
    """What the local effect projects a changed input through, [H, d, e]: W_Q or W_K, and W_V R for values,
    so that a head's changed z comes out as Δz R, whose squared norm is its output change's ||Δz W_O||²."""
    return net.weights["W_V_out" if kind == "V" else f"W_{kind}"][layer]


class _FactoredWeights:
    """What `_FactoredChange` needs of the weights, the same for every batch: Γ W per (receiver layer, kind),
    with Γ = diag(γ) of the receiver's ln1 and W the `_local_weight`, and c(W_O[s]) Γ W [S, e, H, e] per (sender
    layer, sender heads, receiver layer, kind), c(W_O) = W_O with each row centred, kept while they fit `budget`
    bytes and computed again per batch beyond that."""

    def __init__(self, net: _Net, kinds: Sequence[str], budget: int):
        w_o = net.weights["W_O"]
        self.w_o = w_o - w_o.mean(-1, keepdim=True)  # c(W_O)
        self.budget, self.eps, self.scaled, self.kept = budget, {}, {}, {}
        for layer in range(1, net.n_layers):
            gamma, self.eps[layer] = net.layer_norm(layer, 1)
            for kind in kinds:
                w = _local_weight(net, layer, kind)  # [H, d, e]
                self.scaled[layer, kind] = w if gamma is None else gamma.detach().to(w)[None, :, None] * w  # Γ W

    def mixed(self, sender_layer: int, heads: slice, layer: int, kind: str) -> torch.Tensor:
        key = (sender_layer, heads.start, layer, kind)
        if key in self.kept:
            return self.kept[key]
        mixed = torch.einsum("sed,hdf->sehf", self.w_o[sender_layer, heads], self.scaled[layer, kind])
        if mixed.numel() * mixed.element_size() <= self.budget:
            self.kept[key] = mixed
            self.budget -= mixed.numel() * mixed.element_size()
        return mixed


class _FactoredChange:
    """The receivers' projected input change LN(x + Δ) W − LN(x) W of a pre-LN model, from the senders' Δz
    [b, T, S, e] instead of Δ = Δz W_O [S, b, T, d]: with c the centring, σ the LayerNorm scale and γ its
    weight, LN(x + Δ) − LN(x) = (1/σ' − 1/σ) γ·c(x) + γ·c(Δ)/σ', and γ·c(Δ) W = Δz c(W_O) Γ W. So the change
    is one product of Δz/σ' with c(W_O) Γ W plus one fused multiply-add of the clean term: the d × d projection
    per sender becomes an e × (H e) one (d/e times fewer FLOPs), and no pass over the result corrects it after.
    The result equals `_project` of `_input_change` up to rounding (tested against it and against hooked runs).

    `clean` caches the batch's sender-independent terms, c(x) and var(x) per receiver layer and c(x) Γ W per
    (layer, kind); one dict per batch, shared by its sender chunks."""

    def __init__(self, weights: _FactoredWeights, batch: _Batch, sender_layer: int, heads: slice,
                 delta: torch.Tensor, clean: dict):
        self.weights, self.batch, self.sender_layer, self.heads, self.clean = weights, batch, sender_layer, heads, clean
        self.dz = batch.dz[sender_layer][:, :, heads]  # [b, T, S, e]
        self.delta = delta
        self.delta_var = delta.var(-1, correction=0)  # [S, b, T]
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Δz/σ' [b, T, S, e] and 1/σ' − 1/σ [S, b, T] at a receiver layer."""
        if layer not in self.clean:
            x = self.batch.resid[layer]
            centred = x - x.mean(-1, keepdim=True)
            self.clean[layer] = (centred, centred.pow(2).mean(-1))
        if layer not in self.scales:
            centred, var = self.clean[layer]
            eps = self.weights.eps[layer]
            var_new = var + 2 * torch.einsum("btd,sbtd->sbt", centred, self.delta) / centred.shape[-1] + self.delta_var
            inv_new = (var_new + eps).clamp(min=eps).rsqrt()
            self.scales[layer] = (self.dz * inv_new.permute(1, 2, 0)[..., None], inv_new - (var + eps).rsqrt())
        return self.scales[layer]

    def project(self, layer: int, kind: str) -> torch.Tensor:
        dz_over_sigma, inv_change = self._scales(layer)
        if (layer, kind) not in self.clean:  # γ·c(x) W
            self.clean[layer, kind] = torch.einsum("btd,hde->bthe", self.clean[layer][0],
                                                   self.weights.scaled[layer, kind])
        mixed = self.weights.mixed(self.sender_layer, self.heads, layer, kind)
        change = torch.einsum("btse,sehf->sbthf", dz_over_sigma, mixed)  # γ·c(Δ) W / σ'
        return change.addcmul_(inv_change[..., None, None], self.clean[layer, kind])


def _patched_pattern(net: _Net, recv: _Layer, d: torch.Tensor, kind: str, heads: slice) -> torch.Tensor:
    """Attention [S, b, h, T, T] of the receiver heads `heads` when only their queries (kind Q) or keys (K)
    change by d [S, b, T, h, e] (the changed input, projected)."""
    if kind == "Q":  # the score scale on the small clean side, the clean scores added in place
        change = torch.einsum("sbqhe,bkhe->sbhqk", d, recv.k[:, :, heads] * net.scale)
    else:
        change = torch.einsum("bqhe,sbkhe->sbhqk", recv.q[:, :, heads] * net.scale, d)
    return torch.softmax(change.add_(recv.scores[:, heads]), -1)


def _value_change(recv: _Layer, dv: torch.Tensor, heads: slice) -> torch.Tensor:
    """Change of z [S, b, T, h, e] of the receiver heads `heads` when only their values change by dv
    [S, b, T, h, e] (the changed input, projected)."""
    return torch.einsum("bhqk,sbkhe->sbqhe", recv.pattern[:, heads], dv)


def _squared_outputs(net: _Net, layer: int, z: torch.Tensor) -> torch.Tensor:
    """||z_h W_O[h]||^2 = ||z_h R[h]||^2 [..., T, H] for z [..., T, H, e] of every head of a layer."""
    return torch.einsum("...he,hef->...hf", z, net.out_root[layer]).pow(2).sum(-1)


def _local_sums(net: _Net, batch: _Batch, recv: _Layer, layer: int, d: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-input numerator [S, H, b] of the local effect of the senders behind d (their input change projected
    through `_local_weight` [S, b, T, H, e], of kind `kind`) on every receiver head."""
    if kind == "V":  # the values' change through W_V R: r's z changes by Δz R, ||Δz R||² = ||Δz W_O||²
        change = _value_change(recv, d, slice(None)).pow_(2).sum(-1)
        return (change * batch.real[:, :, None]).sum(2).transpose(1, 2)
    tv = _patched_pattern(net, recv, d, kind, slice(None)).sub_(recv.pattern).abs_().sum(-1).mul_(0.5)
    return (tv * batch.queries[:, None]).sum(-1).transpose(1, 2)


def _sender_bytes(net: _Net, b: int, T: int) -> int:
    """Working bytes of one sender in a batched step over b inputs of length T (float32: the sender writes, the
    patched input and its change, one projection, patched scores, rows and their difference)."""
    return 4 * b * (5 * T * net.weights["W_O"].shape[-1] + 3 * net.n_heads * T * T)


def _sender_chunk(net: _Net, per_sender: int, max_memory: int) -> int:
    """Senders per batched step, each of `per_sender` working bytes, so that the step stays within max_memory."""
    return max(1, min(net.n_heads, max_memory // per_sender))


def _kept_budget(net: _Net, sets, batch_size: int, max_memory: int) -> int:
    """What max_memory leaves for the kept c(W_O) Γ W once the widest batch's step has its working bytes (a
    set's batches are at most batch_size inputs of its padded length), so that both together stay within it."""
    per_sender = max(_sender_bytes(net, min(batch_size, len(s)), s.input_ids.shape[1]) for s in sets)
    return max(0, max_memory - _sender_chunk(net, per_sender, max_memory) * per_sender)


# ---------- bootstrap ---------------------------------------------------------------------------------------

def _bootstrap(num: np.ndarray, den: np.ndarray, n_boot: int, seed: int, root: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(estimate, lo, hi) per row of ratio sum(num) / sum(den) over inputs (columns), sqrt of it when `root`;
    the interval is the bootstrap's percentile interval, inputs resampled with replacement."""
    n = num.shape[1]
    counts = np.random.default_rng([seed, _BOOTSTRAP_STREAM]).multinomial(n, np.full(n, 1.0 / n), size=n_boot)
    counts = counts.T.astype(float)
    tail = 50.0 * (1.0 - CONFIDENCE)
    lo, hi = np.empty(len(num)), np.empty(len(num))
    with np.errstate(divide="ignore", invalid="ignore"):
        estimate = num.sum(1) / den.sum(1)
        for start in range(0, len(num), _BOOTSTRAP_CHUNK):
            part = slice(start, start + _BOOTSTRAP_CHUNK)
            lo[part], hi[part] = np.percentile((num[part] @ counts) / (den[part] @ counts), [tail, 100 - tail], axis=1)
    return (np.sqrt(estimate), np.sqrt(lo), np.sqrt(hi)) if root else (estimate, lo, hi)


# ---------- the public API ----------------------------------------------------------------------------------

def _check_counts(n_boot: int, batch_size: int) -> None:
    if n_boot < 1:
        raise UsageError(f"n_boot must be at least 1, got {n_boot}")
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1, got {batch_size}")


def _progress(progress, label: str, sets, batch_size: int, mean: bool) -> Callable[[], None]:
    if progress is None:
        return lambda: None
    batches = sum(-(-len(s) // batch_size) for s in sets) * (2 if mean else 1)
    task = progress.add_task(label, total=batches)
    return lambda: progress.advance(task)


@torch.no_grad()
def local_effects(model, inputs: TokenInputs | Sequence[TokenInputs], types: Sequence[str] = COMPOSITION_TYPES,
                  ablation: str = "resample", corrupted: TokenInputs | Sequence[TokenInputs] | None = None,
                  n_boot: int = DEFAULT_N_BOOT, seed: int = 0, batch_size: int = DEFAULT_BATCH_SIZE,
                  max_memory: int = DEFAULT_MAX_MEMORY, progress=None) -> pd.DataFrame:
    """Local direct-path effect of every earlier -> later head pair of each type in `types` (OQ, OK, OV).

    `model` is a LoadedModel (its `bridge` is used). `inputs`: one input set or several; resample ablation
    draws each input's counterfactual within its own set (`resample_inputs`, seeded), or takes `corrupted`
    (the same structure, row i the counterfactual of input i); mean ablation averages per set. Statistics pool
    all inputs. Returns one row per pair, types in the order given, then source, then target: source, target
    (`L{l}H{h}`), source_type "O", target_type "Q"/"K"/"V", effect, effect_lo, effect_hi (bootstrap interval;
    NaN where r's clean output is zero, for V). `max_memory` bounds one batched step's working bytes together
    with the c(W_O) Γ W products a pre-LN model's steps share across batches (kept in what the widest step
    leaves of it, computed again per batch beyond that).
    """
    if not types:
        raise UsageError(f"types must name at least one of {', '.join(COMPOSITION_TYPES)}")
    kinds = []
    for t in types:
        if check_type_pair(t) not in COMPOSITION_TYPES:
            raise UsageError(f"causal effects are defined for {', '.join(COMPOSITION_TYPES)}, not {t!r}")
        kinds.append(t[1])
    _check_counts(n_boot, batch_size)
    sets = _input_sets(inputs, "inputs")
    alternatives = _counterfactuals(sets, ablation, corrupted, seed)
    net = _network(model, sets[0].batch(0, 1))
    L, H = net.n_layers, net.n_heads
    later = np.arange(L)[:, None, None, None] < np.arange(L)[None, None, :, None]
    pairs = np.nonzero(np.broadcast_to(later, (L, H, L, H)))  # (source layer, head, target layer, head)
    index = np.full((L, H, L, H), -1)
    index[pairs] = np.arange(len(pairs[0]))
    n = sum(len(s) for s in sets)
    num = {kind: np.zeros((len(pairs[0]), n)) for kind in kinds}
    queries, outputs = np.zeros(n), np.zeros((L, H, n))
    advance = _progress(progress, "causal: local effects", sets, batch_size, ablation == "mean")
    # pre-LN with torch LayerNorms: project the senders' Δz, not their d-wide writes (_FactoredChange)
    factor = not net.post_ln and all(net.layer_norm(layer, 1) is not None for layer in range(1, L))
    kept = _kept_budget(net, sets, batch_size, max_memory) if factor else 0
    weights = _FactoredWeights(net, kinds, kept) if factor else None
    for batch in _batches(net, sets, alternatives, batch_size, advance):
        queries[batch.rows] = batch.queries.sum(-1).cpu().numpy()
        receivers = {l: _receiver_layer(net, batch, l) for l in range(1, L)}
        for l, recv in receivers.items():
            outputs[l, :, batch.rows] = (_squared_outputs(net, l, recv.z) * batch.real[:, :, None]).sum(1).T.cpu()
        chunk, clean = _sender_chunk(net, _sender_bytes(net, *batch.resid[0].shape[:2]), max_memory - kept), {}
        for sender_layer in range(L - 1):
            for first in range(0, H, chunk):
                heads = slice(first, min(first + chunk, H))
                delta = _sender_writes(net, batch, sender_layer, heads)
                factored = _FactoredChange(weights, batch, sender_layer, heads, delta, clean) if factor else None
                for layer in range(sender_layer + 1, L):
                    if factored is None:
                        delta = _carry(net, batch, layer - 1, delta)
                        dx = _input_change(net, batch, receivers[layer], layer, delta)
                    rows = index[sender_layer, heads, layer]
                    for kind in kinds:
                        d = (factored.project(layer, kind) if factored is not None
                             else _project(dx, _local_weight(net, layer, kind)))
                        num[kind][rows, batch.rows] = _local_sums(net, batch, receivers[layer], layer, d, kind).cpu()
    src_layer, src_head, tgt_layer, tgt_head = pairs
    names = {"source": [head_name(l, h) for l, h in zip(src_layer.tolist(), src_head.tolist())],
             "target": [head_name(l, h) for l, h in zip(tgt_layer.tolist(), tgt_head.tolist())]}
    frames = []
    for kind in kinds:
        den = outputs[tgt_layer, tgt_head] if kind == "V" else np.broadcast_to(queries, num[kind].shape)
        effect, lo, hi = _bootstrap(num[kind], den, n_boot, seed, root=kind == "V")
        frames.append(pd.DataFrame({
            "source": pd.Series(names["source"], dtype=str), "target": pd.Series(names["target"], dtype=str),
            "source_type": "O", "target_type": kind, "effect": effect, "effect_lo": lo, "effect_hi": hi}))
    return pd.concat(frames, ignore_index=True)[LOCAL_COLUMNS]


def _parse_head(name, n_layers: int, n_heads: int) -> tuple[int, int]:
    m = _HEAD.match(str(name))
    if not m or int(m[1]) >= n_layers or int(m[2]) >= n_heads:
        raise UsageError(f"head {name!r} is not L<layer>H<head> within {n_layers} layers x {n_heads} heads")
    return int(m[1]), int(m[2])


def _parse_edges(edges: pd.DataFrame, net: _Net) -> list[tuple[int, int, int, int, str]]:
    """(source layer, source head, target layer, target head, "Q"/"K"/"V") of each edge row."""
    missing = [c for c in KEY_COLUMNS if c not in edges.columns]
    if missing:
        raise UsageError(f"edges lack the columns {', '.join(missing)} (pairs.parquet's naming)")
    parsed = []
    for source, target, source_type, target_type in edges[KEY_COLUMNS].itertuples(index=False):
        kind = f"{source_type}{target_type}"
        if kind not in COMPOSITION_TYPES:
            raise UsageError(f"edge {source} -> {target}: causal effects are defined for "
                             f"{', '.join(COMPOSITION_TYPES)}, not {kind!r}")
        (ls, hs), (lr, hr) = (_parse_head(h, net.n_layers, net.n_heads) for h in (source, target))
        if ls >= lr:
            raise UsageError(f"edge {source} -> {target}: the source's layer must come before the target's")
        parsed.append((ls, hs, lr, hr, str(target_type)))
    return parsed


def _head_change(net: _Net, recv: _Layer, layer: int, dx: torch.Tensor, kind: str, head: int) -> torch.Tensor:
    """Change of one receiver head's z [b, T, e] when only its `kind` input reads the changed input dx [1, b, T, d]."""
    heads = slice(head, head + 1)
    d = _project(dx, net.weights[f"W_{kind}"][layer, heads])
    if kind == "V":
        return _value_change(recv, d, heads)[0, :, :, 0]
    new = _patched_pattern(net, recv, d, kind, heads)[0, :, 0]
    return torch.einsum("bqk,bke->bqe", new - recv.pattern[:, head], recv.v[:, :, head])


def _plain_unembed(net: _Net, probe: TokenInputs) -> torch.nn.Linear | None:
    """The decoder's unembedding as the torch Linear whose output is the model's logits (checked on `probe`), or
    None: an encoder, or a model that changes its logits after the unembedding (soft-capping, scaling)."""
    linear = getattr(net.bridge.unembed, "original_component", None) if net.causal else None
    if type(linear) is not torch.nn.Linear:
        return None
    logits, hidden = run_with_activations(net.bridge, probe, ["unembed.hook_in"], return_type="logits")
    mine = torch.nn.functional.linear(hidden["unembed.hook_in"], linear.weight, linear.bias)
    return linear if torch.allclose(mine, logits, rtol=1e-5, atol=1e-5 * float(logits.abs().max())) else None


class _Logits:
    """Logits of the loss passes through a plain unembedding (`_plain_unembed`), written into one buffer grown
    to the largest pass and reused: a pass's logits are its largest tensor (e.g. 60 copies x 41 tokens x 50257,
    half a GB), and fresh memory of that size costs its first touch on every pass."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear, self.buffer = linear, torch.empty(0)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """linear(hidden) [G, T, V] for hidden [G, T, d], in the buffer (valid until the next call)."""
        weight, bias = self.linear.weight, self.linear.bias
        rows, size = hidden.shape[0] * hidden.shape[1], hidden.shape[0] * hidden.shape[1] * weight.shape[0]
        if self.buffer.numel() < size:
            self.buffer = torch.empty(0)  # the old buffer goes before the new one is allocated
            self.buffer = torch.empty(size, dtype=weight.dtype, device=weight.device)
        out = self.buffer[:size].view(rows, weight.shape[0])
        flat = hidden.reshape(rows, -1)
        if bias is None:
            torch.mm(flat, weight.T, out=out)
        else:
            torch.addmm(bias, flat, weight.T, out=out)
        return out.view(*hidden.shape[:2], -1)


def _patched_outputs(net: _Net, inputs: TokenInputs, changes: list[tuple[int, int, torch.Tensor]],
                     logits: _Logits | None = None) -> torch.Tensor:
    """Logits (decoder) or final hidden states (encoder) [1 + G, T, .] of one input (`inputs`, one row, no
    padding) in one forward pass: row 0 clean, row 1 + g with head changes[g][1] of layer changes[g][0] (layers
    in ascending order) with its z changed by changes[g][2] [T, e], the rest of the model run on it. With
    `logits` (a decoder's plain unembedding), the pass stops at the unembedding's input and `logits` computes them.

    Copy g joins the pass at its layer's input as a copy of the clean row, so what comes before its layer runs
    once for all copies: the attention mask and position terms of one input broadcast over the grown batch."""
    from transformer_lens.model_bridge.exceptions import StopAtLayerException

    joining = {}  # layer -> (first row, heads, dz [k, T, e]) of the copies that join there
    for g, (layer, head, dz) in enumerate(changes):
        _, heads, dzs = joining.setdefault(layer, (1 + g, [], []))
        heads.append(head)
        dzs.append(dz)

    def join(resid, hook):
        k = len(joining[int(hook.name.split(".")[1])][1])
        return torch.cat([resid, resid[:1].expand(k, *resid.shape[1:])])

    def patch(z, hook):
        first, heads, dzs = joining[int(hook.name.split(".")[1])]
        z = z.clone()
        rows = torch.arange(first, first + len(heads), device=z.device)
        z[rows, :, torch.tensor(heads, device=z.device)] += torch.stack(dzs).to(z.dtype)
        return z

    def stop(hidden, hook):  # the bridge returns the final hidden states; the MLM head (half the work) is skipped
        raise StopAtLayerException(hidden)

    hooks = [hook for layer in joining for hook in ((f"blocks.{layer}.hook_resid_pre", join),
                                                     (f"blocks.{layer}.attn.hook_z", patch))]
    if not net.causal:
        hooks.append((f"blocks.{net.n_layers - 1}.hook_resid_post", stop))
    elif logits is not None:
        hooks.append(("unembed.hook_in", stop))
    out = net.bridge.run_with_hooks(inputs.input_ids.to(net.bridge.cfg.device), fwd_hooks=hooks,
                                    return_type="logits" if net.causal and logits is None else None,
                                    **model_kwargs(net.bridge, inputs))
    return out if logits is None else logits(out)


def _copies_per_pass(net: _Net, length: int, max_memory: int) -> int:
    """Patched copies of one input of `length` tokens per forward pass (besides its clean row) so that its widest
    activations (the logits and logsumexp's temporary, or the MLP's 4 d_model, float32) stay within max_memory
    bytes."""
    d = net.bridge.cfg.d_model
    width = net.bridge.cfg.d_vocab * 2 if net.causal else 4 * d
    return max(1, max_memory // (4 * length * (width + 8 * d)) - 1)


def _token_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy [G, T-1] of every position of G copies (logits [G, T, V], overwritten) of one
    input (input_ids [T]), as logsumexp minus the target's logit, the logsumexp computed in the logits' own
    memory: no [G, T, V] temporary is written (torch.logsumexp writes one, twice the time of the in-place one)."""
    logits = logits[:, :-1].float()
    targets = input_ids[1:].to(logits.device).expand(len(logits), -1)
    target = logits.gather(-1, targets[..., None])[..., 0]
    top = logits.amax(-1, keepdim=True)
    return logits.sub_(top).exp_().sum(-1).log_() + top[..., 0] - target


@torch.no_grad()
def loss_effects(model, inputs: TokenInputs | Sequence[TokenInputs], edges: pd.DataFrame, ablation: str = "resample",
                 corrupted: TokenInputs | Sequence[TokenInputs] | None = None, n_boot: int = DEFAULT_N_BOOT,
                 seed: int = 0, batch_size: int = DEFAULT_BATCH_SIZE, max_memory: int = DEFAULT_MAX_MEMORY,
                 progress=None) -> pd.DataFrame:
    """Downstream effect of patching only the path s -> r.T of each edge, everything after r run on it.

    `edges`: rows with source, target, source_type ("O"), target_type ("Q"/"K"/"V"), e.g. selected rows of
    pairs.parquet or of `local_effects`. Inputs, ablation, corrupted and seed as in `local_effects` (the same
    arguments give the same counterfactuals). Returns those four columns, in the edges' order, with
    effect_loss, effect_loss_lo, effect_loss_hi: decoder, patched minus clean next-token cross-entropy in nats
    per predicted token (positive = the path helps the model); encoder, ||h' - h||_F / ||h||_F of the final
    hidden states. An input's patched copies share forward passes (`max_memory` bytes each), each copy
    joining at its target layer: the layers before it run once per pass, not once per edge.
    """
    _check_counts(n_boot, batch_size)
    sets = _input_sets(inputs, "inputs")
    alternatives = _counterfactuals(sets, ablation, corrupted, seed)
    net = _network(model, sets[0].batch(0, 1))
    parsed = _parse_edges(edges, net)
    n = sum(len(s) for s in sets)
    num, den = np.zeros((len(parsed), n)), np.zeros((len(parsed), n))
    advance = _progress(progress, "causal: loss effects", sets, batch_size, ablation == "mean")
    order = sorted(range(len(parsed)), key=lambda e: parsed[e][2])  # by target layer: copies join in order
    unembed = _plain_unembed(net, sets[0].batch(0, 1))
    logits = _Logits(unembed) if unembed is not None else None
    for batch in _batches(net, sets, alternatives, batch_size, advance):
        receivers, changes = {}, []
        for e in order:
            sender_layer, sender, layer, head, kind = parsed[e]
            if layer not in receivers:
                receivers[layer] = _receiver_layer(net, batch, layer)
            delta = _sender_writes(net, batch, sender_layer, slice(sender, sender + 1))
            for between in range(sender_layer, layer):
                delta = _carry(net, batch, between, delta)
            dx = _input_change(net, batch, receivers[layer], layer, delta)
            changes.append((layer, head, _head_change(net, receivers[layer], layer, dx, kind, head)))
        for i in range(len(batch.real)):
            one = batch.inputs.batch(i, i + 1)  # trimmed to its real tokens
            T = one.input_ids.shape[1]
            step = _copies_per_pass(net, T, max_memory)
            for first in range(0, len(changes), step):
                out = _patched_outputs(net, one, [(layer, head, dz[i, :T])
                                                  for layer, head, dz in changes[first:first + step]], logits)
                if net.causal:
                    losses = _token_losses(out, one.input_ids[0]).sum(-1)
                    change, count = losses[1:] - losses[0], torch.full_like(losses[1:], T - 1)
                else:
                    change = (out[1:] - out[:1]).pow(2).sum((1, 2))
                    count = out[0].pow(2).sum().expand_as(change)
                edges_here = order[first:first + len(change)]
                num[edges_here, batch.rows.start + i] = change.double().cpu().numpy()
                den[edges_here, batch.rows.start + i] = count.double().cpu().numpy()
    effect, lo, hi = _bootstrap(num, den, n_boot, seed, root=not net.causal)
    table = edges[KEY_COLUMNS].reset_index(drop=True).copy()
    table["effect_loss"], table["effect_loss_lo"], table["effect_loss_hi"] = effect, lo, hi
    return table[LOSS_COLUMNS]


# ---------- the analyze stage -------------------------------------------------------------------------------

@dataclass(frozen=True)
class CausalStage:
    """The causal stage of `headgraph analyze` on one LoadedModel: its inputs are built first (a bad inputs
    file fails before any PK work), then `local` adds the local effects of every OQ/OK/OV pair to the pairs
    table and `loss` the downstream effects of the selected edges."""

    model: Any
    options: CausalOptions
    inputs: tuple[TokenInputs, ...]
    source: str

    @classmethod
    def prepare(cls, model, options: CausalOptions, seed: int) -> "CausalStage":
        texts = read_texts(options.inputs_file) if options.inputs_file else None
        source = "generated" if texts is None else f"the texts of {options.inputs_file}"
        return cls(model, options, causal_inputs(model, options.n_inputs, seed, texts), source)

    def local(self, pairs: pd.DataFrame, types: Sequence[str], seed: int, progress=None
              ) -> tuple[pd.DataFrame, dict[str, Any]]:
        """(pairs with effect / effect_lo / effect_hi, the run record's `causal` entry); raises CausalUnsupported
        for a model whose attention cannot be recomputed."""
        kinds = [t for t in types if t in COMPOSITION_TYPES]
        if not kinds:
            return pairs, {"skipped": f"no {'/'.join(COMPOSITION_TYPES)} type was computed"}
        start = time.perf_counter()
        o = self.options
        local = local_effects(self.model, self.inputs, kinds, o.ablation, n_boot=o.n_boot, seed=seed,
                              batch_size=o.batch_size, max_memory=o.max_memory, progress=progress)
        record = {"types": kinds, "inputs": {s.name: len(s) for s in self.inputs}, "source": self.source,
                  "ablation": o.ablation, "n_boot": o.n_boot, "loss_edges_per_type": o.loss_edges if o.loss else 0,
                  "loss_inputs_per_set": {s.name: min(len(s), o.loss_inputs) for s in self.inputs} if o.loss else {},
                  "definitions": DEFINITIONS,
                  "timings_s": {"local": round(time.perf_counter() - start, 4)}}
        return with_effects(pairs, local), record

    def loss(self, pairs: pd.DataFrame, edges: pd.DataFrame, seed: int, progress=None
             ) -> tuple[pd.DataFrame, pd.DataFrame, float]:
        """(pairs and edges with effect_loss / _lo / _hi, seconds taken) for the edges that have a local
        effect, at most `loss_edges` per type, largest local effect first, on the first `loss_inputs` inputs of
        each set."""
        start = time.perf_counter()
        o = self.options
        chosen = edges[edges["effect"].notna()].sort_values("effect", ascending=False, kind="stable")
        if o.loss_edges is not None:
            chosen = chosen.groupby(chosen["source_type"] + chosen["target_type"]).head(o.loss_edges)
        inputs = tuple(s.batch(0, min(len(s), o.loss_inputs)) for s in self.inputs)
        loss = loss_effects(self.model, inputs, chosen, o.ablation, n_boot=o.n_boot, seed=seed,
                            batch_size=o.batch_size, max_memory=o.max_memory, progress=progress)
        return with_effects(pairs, loss), with_effects(edges, loss), round(time.perf_counter() - start, 4)
