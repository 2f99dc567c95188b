"""What patching needs of a model (`Net`: its bridge, layout, weights and norms), the clean and corrupted
activations of each batch of inputs (`batches`), and each receiver layer's attention recomputed from its input
(`receiver_layer`), checked against the model's own `hook_z` on every batch."""

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from headgraph.analysis.options import CausalOptions
from headgraph.analysis.patterns import model_kwargs, run_with_activations
from headgraph.analysis.prompts import TokenInputs
from headgraph.errors import UsageError

DEFAULT_BATCH_SIZE = CausalOptions.batch_size
DEFAULT_MAX_MEMORY = CausalOptions.max_memory
KEY_COLUMNS = ["source", "target", "source_type", "target_type"]  # the pair key of pairs.parquet
BOOTSTRAP_STREAM = 102  # the bootstrap's random stream beside the seed (resample ablation draws on another)
_Z_TOLERANCE = 1e-3  # relative: recomputed vs the model's own z


class CausalUnsupported(UsageError):
    """The model's attention cannot be recomputed here (rotary, grouped-query, ...): no causal effects for it."""


def unsupported(bridge, why: str) -> CausalUnsupported:
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
        raise unsupported(bridge, "its blocks lack the TransformerBridge hooks "
                                   f"{', '.join(sorted(set(names) - set(cache.keys())))}")
    attn_in = cache["blocks.0.attn.hook_in"]
    if torch.equal(attn_in, cache["blocks.0.ln1.hook_out"]) and torch.equal(cache["blocks.0.ln1.hook_in"],
                                                                           cache["blocks.0.hook_resid_pre"]):
        return False
    if torch.equal(attn_in, cache["blocks.0.hook_resid_pre"]) and torch.equal(cache["blocks.0.hook_resid_post"],
                                                                             cache["blocks.0.ln2.hook_out"]):
        return True
    raise unsupported(bridge, "its attention reads neither a LayerNorm of the residual stream (GPT-2) nor the "
                               "residual stream with a LayerNorm after each sublayer (BERT)")


@dataclass(frozen=True)


class Net:
    """What patching needs of a model: its bridge, sizes, layout and weights in TransformerLens layout."""

    bridge: Any
    n_layers: int
    n_heads: int
    causal: bool
    post_ln: bool
    scale: float
    weights: dict[str, torch.Tensor]  # W_Q/W_K/W_V [L, H, d, e], b_Q/b_K/b_V [L, H, e], W_O [L, H, e, d]; and
    # W_V_out = W_V R [L, H, d, e], the values read so that ||Δz R|| is the output change's norm (`local_weight`)
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


def network(model, probe: TokenInputs) -> Net:
    bridge = model.bridge
    cfg = bridge.cfg
    if cfg.n_key_value_heads and cfg.n_key_value_heads != cfg.n_heads:
        raise unsupported(bridge, f"grouped-query attention ({cfg.n_key_value_heads} key/value heads for "
                                   f"{cfg.n_heads} query heads)")
    weights = {n: getattr(bridge, n).detach().float() for n in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V")}
    root = torch.linalg.qr(weights["W_O"].transpose(-1, -2)).R.transpose(-1, -2)  # W_O^T = Q R^T, Q orthonormal
    weights["W_V_out"] = weights["W_V"] @ root
    return Net(bridge=bridge, n_layers=int(cfg.n_layers), n_heads=int(cfg.n_heads),
                causal=cfg.attention_dir == "causal", post_ln=_is_post_ln(bridge, probe),
                scale=1.0 / math.sqrt(cfg.d_head), weights=weights, out_root=root)


@dataclass(frozen=True)


class Batch:
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


def z_names(net: Net) -> list[str]:
    return [f"blocks.{l}.attn.hook_z" for l in range(net.n_layers)]


def _z_of(net: Net, inputs: TokenInputs, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """z [L, b, length, H, e] of a batch, cut or zero-padded to `length`, and its real-token mask [b, length]."""
    _, cache = run_with_activations(net.bridge, inputs, z_names(net))
    z = torch.stack([cache[name] for name in z_names(net)]).float()
    real = inputs.attention_mask.bool().to(z.device)
    pad = length - z.shape[2]
    if pad >= 0:
        return torch.nn.functional.pad(z, (0, 0, 0, 0, 0, pad)), torch.nn.functional.pad(real, (0, pad))
    return z[:, :, :length], real[:, :length]


def _mean_z(net: Net, inputs: TokenInputs, batch_size: int, advance: Callable[[], None]) -> torch.Tensor:
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


def batches(net: Net, sets, corrupted, batch_size: int, advance: Callable[[], None]) -> Iterator[Batch]:
    L = net.n_layers
    names = z_names(net) + [f"blocks.{l}.hook_resid_pre" for l in range(L)]
    if net.post_ln:
        names += [f"blocks.{l}.ln{i}.hook_in" for l in range(L - 1) for i in (1, 2)]
    offset = 0
    for clean_set, corrupt_set in zip(sets, corrupted):
        mean = _mean_z(net, clean_set, batch_size, advance) if corrupt_set is None else None
        for start in range(0, len(clean_set), batch_size):
            stop = min(start + batch_size, len(clean_set))
            batch = clean_set.batch(start, stop)
            _, cache = run_with_activations(net.bridge, batch, names)
            z = torch.stack([cache[name] for name in z_names(net)]).float()
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
            yield Batch(rows=slice(offset + start, offset + stop), inputs=batch, real=real, visible=visible,
                         queries=(real & (visible.sum(-1) > 1)).float(),
                         resid=[cache[f"blocks.{l}.hook_resid_pre"] for l in range(L)], z=z,
                         dz=torch.where(both, z_alt - z, torch.zeros_like(z)), norms=norms)
            advance()
        offset += len(clean_set)


@dataclass(frozen=True)


class Layer:
    """Clean attention of one receiver layer, recomputed from its input: what patched rows are compared to."""

    x: torch.Tensor  # [b, T, d]: what Q, K and V read (after ln1 in a pre-LN model)
    q: torch.Tensor  # [b, T, H, e]
    k: torch.Tensor
    v: torch.Tensor
    scores: torch.Tensor  # [b, H, T, T], -inf on keys a query cannot see
    pattern: torch.Tensor  # [b, H, T, T]
    z: torch.Tensor  # [b, T, H, e]


def receiver_layer(net: Net, batch: Batch, layer: int) -> Layer:
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
        raise unsupported(net.bridge, f"recomputing layer {layer}'s attention from its input misses the model's "
                                       f"own z by {error:.3g} (rotary or relative positions, another score "
                                       "scale or soft-capping are not supported)")
    return Layer(x=x, q=q, k=k, v=v, scores=scores, pattern=pattern, z=z)


def sender_writes(net: Net, batch: Batch, layer: int, heads: slice) -> torch.Tensor:
    """Δ_s = (z_s(x') - z_s(x)) W_O[s] [S, b, T, d] of the heads `heads` of a sender layer."""
    return torch.einsum("bthe,hed->hbtd", batch.dz[layer][:, :, heads], net.weights["W_O"][layer, heads])


def carry(net: Net, batch: Batch, layer: int, delta: torch.Tensor) -> torch.Tensor:
    """A change of `layer`'s attention output carried to the next layer's residual input, the layer's heads
    and MLP held clean: unchanged in a pre-LN model, through ln1 and ln2 in a post-LN one."""
    if not net.post_ln:
        return delta
    a1, n1, a2, n2 = batch.norms[layer]
    delta = net.norm(layer, 1, a1 + delta) - n1
    return net.norm(layer, 2, a2 + delta) - n2


def input_change(net: Net, batch: Batch, recv: Layer, layer: int, delta: torch.Tensor) -> torch.Tensor:
    """Change [S, b, T, d] of what the receiver layer's Q/K/V read when its residual input changes by delta."""
    if net.post_ln:
        return delta
    return net.norm(layer, 1, batch.resid[layer] + delta) - recv.x


def project(dx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dx [S, b, T, d] read by the receiver heads' weights [h, d, e]: [S, b, T, h, e]."""
    return torch.einsum("sbtd,hde->sbthe", dx, weight)


def check_counts(n_boot: int, batch_size: int) -> None:
    if n_boot < 1:
        raise UsageError(f"n_boot must be at least 1, got {n_boot}")
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1, got {batch_size}")


def progress_advance(progress, label: str, sets, batch_size: int, mean: bool) -> Callable[[], None]:
    if progress is None:
        return lambda: None
    batches = sum(-(-len(s) // batch_size) for s in sets) * (2 if mean else 1)
    task = progress.add_task(label, total=batches)
    return lambda: progress.advance(task)
