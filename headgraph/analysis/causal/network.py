"""What patching needs of a model (`Net`: its bridge, layout, weights and norms), the clean and corrupted
activations of each batch of inputs (`batches`), and each receiver layer's attention recomputed from its input
(`receiver_layer`), checked against the model's own `hook_z` on every batch."""

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from headgraph.analysis.heap import release_freed, rows_gradient, rows_product
from headgraph.analysis.options import CausalOptions
from headgraph.analysis.patterns import model_kwargs, run_with_activations
from headgraph.analysis.prompts import TokenInputs
from headgraph.errors import UsageError
from headgraph.heads import head_name

DEFAULT_BATCH_SIZE = CausalOptions.batch_size
DEFAULT_PATCH_MEMORY = CausalOptions.max_memory
BOOTSTRAP_STREAM = 102  # the bootstrap's random stream beside the seed (resample ablation draws on another)
_Z_TOLERANCE = 1e-3  # relative: recomputed vs the model's own z
Path = Literal["recompute", "module"]
"""How receivers are patched: headgraph's own attention from W_Q, W_K, W_V (scaled dot-product attention with
the model's rotary positions and grouped key/value heads, batched over all senders of a layer) or the bridge's
own attention modules run on patched inputs (QK-norm, ALiBi, soft-capping: whatever the model's attention
does)."""
# kwargs of a bridge attention call whose first dimension is not the batch: MPT's ALiBi bias, one per head
_NOT_BATCHED = {"position_bias"}
PER_ROW_HEAD = {"alibi"}  # BLOOM's ALiBi bias, [batch * heads, 1, T]


class CausalUnsupported(UsageError):
    """The model's attention cannot be recomputed here (rotary, grouped-query, ...): no causal effects for it."""


def unsupported(bridge, why: str) -> CausalUnsupported:
    return CausalUnsupported(f"causal effects cannot be computed for {bridge.cfg.architecture}: {why}; "
                      "analyze it without causal effects")


Layout = Literal["pre", "post", "resid"]
"""Where a block's attention reads the residual stream: "pre", through a norm ln1 (GPT-2, Llama, Gemma);
"post", the residual itself with a LayerNorm after each sublayer (BERT); "resid", the residual itself with each
sublayer's output normed before it is added (OLMo-2)."""


def _layout(bridge, probe: TokenInputs) -> tuple[Layout, bool]:
    """(layout, whether a norm ln1_post acts on the attention output before the residual adds it: Gemma 2/3,
    OLMo-2), read off one forward pass."""
    block = bridge.blocks[0]
    norms = [n for n in ("ln1", "ln2", "ln1_post") if hasattr(block, n)]
    names = ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_in", "blocks.0.attn.hook_out", "blocks.0.hook_resid_post",
             *(f"blocks.0.{n}.hook_{io}" for n in norms for io in ("in", "out"))]
    _, cache = bridge.run_with_cache(probe.input_ids.to(bridge.cfg.device), names_filter=names, return_type=None,
                                     stop_at_layer=1,  # block 0 only (1.1B shape: 0.03 s, the whole pass 0.7 s)
                                     **model_kwargs(bridge, probe))  # served hooks only: the check names the rest
    if not set(names) <= set(cache.keys()):
        raise unsupported(bridge, "its blocks lack the TransformerBridge hooks "
                                   f"{', '.join(sorted(set(names) - set(cache.keys())))}")
    same = lambda a, b: torch.equal(cache[f"blocks.0.{a}"], cache[f"blocks.0.{b}"])  # noqa: E731
    out_norm = "ln1_post" in norms and same("ln1_post.hook_in", "attn.hook_out")
    if "ln1" in norms and same("attn.hook_in", "ln1.hook_out") and same("ln1.hook_in", "hook_resid_pre"):
        return "pre", out_norm
    if same("attn.hook_in", "hook_resid_pre"):
        if out_norm:
            return "resid", True
        if "ln2" in norms and same("hook_resid_post", "ln2.hook_out"):
            return "post", False
    raise unsupported(bridge, "its attention reads neither a norm of the residual stream (GPT-2, Llama), nor the "
                              "residual stream with a LayerNorm after each sublayer (BERT) or with normed "
                              "sublayer outputs (OLMo-2)")


@dataclass(frozen=True)
class Net:
    """What patching needs of a model: its bridge, sizes, layout and weights in TransformerLens layout."""

    bridge: Any
    n_layers: int
    n_heads: int
    n_kv_heads: int  # key/value heads: n_heads, fewer for grouped-query attention, 1 for multi-query
    is_decoder: bool  # decoder (causal) attention: a query sees only the keys up to it
    layout: Layout
    out_norm: bool  # ln1_post normalises the attention output before the residual adds it
    path: Path  # loss effects' (their recompute handles plain attention only: no rotary, one KV head per head)
    local_path: Path  # local effects': "recompute" also for rotary and grouped-query attention
    rotary: bool  # queries and keys rotated by the cos/sin of each layer's attention call (path "recompute")
    scale: float
    weights: dict[str, Any]  # W_Q [H, d, e], W_K/W_V [KV, d, e], W_O [H, e, d]: a tuple of each layer's (the
    # bridge's own tensors, views of its parameters in its dtype where it gives views: a bf16 checkpoint's raw weights
    # exactly, read in float32 through `weight`); b_Q/b_K/b_V [L, h, e]
    out_root: torch.Tensor  # R [L, H, e, e] with R R^T = W_O W_O^T: ||z W_O|| = ||z R||
    z_offset: torch.Tensor | None = None  # [L, H, e]: what "tl" folds out of a raw bridge's z (`processed_outputs`)

    @property
    def post_ln(self) -> bool:
        return self.layout == "post"

    @property
    def nbytes(self) -> int:
        """The bytes of its copies of the weights (not of the model's own parameters, which it reads in place): what
        a stage's `max_memory` holds besides its working bytes."""
        own = {p.untyped_storage().data_ptr() for p in self.bridge.parameters()}
        held = [t for w in self.weights.values() for t in (w if isinstance(w, tuple) else (w,))]
        held += [self.out_root] + ([] if self.z_offset is None else [self.z_offset])
        copies = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
        return sum(n for ptr, n in copies.items() if ptr not in own)

    @property
    def on_host(self) -> bool:
        """Whether its passes run on the CPU, their activations in this process's heap."""
        return self.out_root.device.type == "cpu"

    def release_freed(self) -> None:
        """Give the heap's free pages back to the system (`heap.release_freed`) where the passes run on the CPU: on
        a GPU their activations are not in the heap, and each call would only hold up the kernels' launches."""
        if self.on_host:
            release_freed()

    def weight(self, name: str, layer: int, heads: slice = slice(None)) -> torch.Tensor:
        """weights[name][layer][heads] in float32."""
        return self.weights[name][layer][heads].float()

    @property
    def kv_group(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def receivers(self, kind: str) -> int:
        """Receiver heads of a kind per layer: query heads for Q, key/value heads for K and V."""
        return self.n_heads if kind == "Q" else self.n_kv_heads

    def receiver_name(self, layer: int, head: int, kind: str) -> str:
        """L{l}H{h}, or the KV head L{l}KV{g} of a grouped-query model's K/V receiver (PK's naming)."""
        return head_name(layer, head, kv=self.kv_group > 1 and kind != "Q")

    def native_norm(self, layer: int, which: int) -> torch.nn.LayerNorm | None:
        """The torch LayerNorm ln{which} of `layer` wraps where the bridge runs it as it is (observed without
        hooks, its numerics exactly), else None."""
        bridge_norm = getattr(self.bridge.blocks[layer], f"ln{which}")
        wrapped = bridge_norm.original_component
        native = (getattr(bridge_norm, "use_native_layernorm_autograd", False)
                  or getattr(bridge_norm.config, "layer_norm_folding", False))
        return wrapped if native and type(wrapped) is torch.nn.LayerNorm else None

    def layer_norm(self, layer: int, which: int) -> tuple[torch.Tensor | None, float, bool] | None:
        """(weight γ or None, eps, centred) where ln{which} of `layer` computes γ·c(x)/sqrt(mean(c(x)²) + eps)
        + β with c the centring (centred: a LayerNorm, natively or by the bridge's own forward) or the identity
        (an RMSNorm, β = 0, γ = 1 + w for Gemma's offset weight), None for a norm of another kind."""
        wrapped = self.native_norm(layer, which)
        if wrapped is not None:
            return wrapped.weight, wrapped.eps, True
        bridge_norm = getattr(self.bridge.blocks[layer], f"ln{which}")
        rms = getattr(bridge_norm, "uses_rms_norm", None)
        if rms is None or not hasattr(bridge_norm, "weight"):
            return None
        weight = bridge_norm.weight
        if rms:  # the eps the model's own RMSNorm adds
            own = bridge_norm.original_component
            eps = getattr(own, "variance_epsilon", getattr(own, "eps", getattr(bridge_norm.config, "eps", None)))
            if not isinstance(eps, float):
                return None
        else:
            eps = getattr(bridge_norm.config, "eps", 1e-5)
        return (1.0 + weight if bridge_norm.uses_weight_offset else weight), eps, not rms

    def attention_input(self, layer: int, resid: torch.Tensor) -> torch.Tensor:
        """What the attention of `layer` reads when its residual input is `resid`."""
        return self.norm(layer, 1, resid) if self.layout == "pre" else resid

    def norm(self, layer: int, which, x: torch.Tensor) -> torch.Tensor:
        """The model's own LayerNorm ln{which} of `layer` applied to x: the native module's layer_norm directly
        where there is one (`native_norm`; it spares the bridge's hook-point statistics), else the bridge's
        forward (not __call__: the block's capture hooks on ln1 would hold on to x)."""
        wrapped = self.native_norm(layer, which)
        if wrapped is not None and x.dtype in (torch.float32, torch.float64):
            return torch.nn.functional.layer_norm(x, wrapped.normalized_shape, wrapped.weight, wrapped.bias,
                                                  wrapped.eps)
        return getattr(self.bridge.blocks[layer], f"ln{which}").forward(x)


def network(model, probe: TokenInputs) -> Net:
    """The Net of a LoadedModel, or of a StreamedModel whose bridge is the raw checkpoint (its W_O and z taken in
    the processing asked: `processed_outputs`), its paths chosen on `probe` (one input): local effects take
    "recompute" where headgraph's own attention (scaled dot products of W_Q, W_K, W_V with biases, rotated by the
    model's rotary cos/sin, each query head reading its KV head, softmax over the visible keys) reproduces the
    model's z on every layer, loss effects where it does so without rotary or grouped heads; else "module", the
    bridge's own attention modules run on patched inputs."""
    bridge = model.bridge
    cfg = bridge.cfg
    n_kv = int(cfg.n_key_value_heads or cfg.n_heads)
    weights = {n: _per_layer(bridge, n) for n in ("W_Q", "W_K", "W_V", "W_O")}
    for t in "QKV":
        try:
            weights[f"b_{t}"] = getattr(bridge, f"b_{t}").detach().float()
        except AttributeError:  # a bias-free projection (the bridge exposes no stacked bias)
            w = weights[f"W_{t}"]
            weights[f"b_{t}"] = w[0].new_zeros((len(w), w[0].shape[0], w[0].shape[2]), dtype=torch.float32)
    offset = None
    if model.processing == "tl" and not bridge.compatibility_mode:  # a streamed checkpoint's raw weights
        weights["W_O"], offset = processed_outputs(bridge, weights)
    root = torch.stack([output_root(w) for w in weights["W_O"]])
    layout, out_norm = _layout(bridge, probe)
    rotary = getattr(cfg, "positional_embedding_type", None) == "rotary"
    net = Net(bridge=bridge, n_layers=int(cfg.n_layers), n_heads=int(cfg.n_heads), n_kv_heads=n_kv,
              is_decoder=cfg.attention_dir == "causal", layout=layout, out_norm=out_norm, path="recompute",
              local_path="recompute", rotary=rotary, scale=1.0 / math.sqrt(cfg.d_head), weights=weights,
              out_root=root, z_offset=offset)
    if layout != "resid" and not out_norm and _recomputes(net, probe):
        return net if n_kv == net.n_heads and not rotary else dataclasses.replace(net, path="module")
    return dataclasses.replace(net, path="module", local_path="module")


def output_root(w_o: torch.Tensor) -> torch.Tensor:
    """R [H, e, e] (float32) with R Rᵀ = W_O W_Oᵀ for one layer's W_O [H, e, d], so that ||z W_O|| = ||z R||: from
    the eigendecomposition of that e × e Gram matrix, formed in float64 (any W_O, a singular one too). A third of the
    time of the QR decomposition of W_Oᵀ (1.1B shape: 22 against 70 ms a layer), the norms as exact."""
    w = w_o.double()
    values, vectors = torch.linalg.eigh(w @ w.transpose(-1, -2))
    return (vectors * values.clamp(min=0).sqrt()[..., None, :]).float()


def _per_layer(bridge, name: str) -> tuple[torch.Tensor, ...]:
    """Each block's W_Q, W_K, W_V [h, d, e] or W_O [H, e, d] as the bridge's stacked property reads it (its own
    reshape), unstacked: a block's tensor is a view of its parameter, where a stack would copy every layer's."""
    reshape = bridge._reshape_o if name == "W_O" else bridge._reshape_qkv
    return tuple(reshape(getattr(block.attn, name).detach()) for block in bridge.blocks)


def processed_outputs(bridge, weights: dict[str, Any]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(each layer's W_O [H, e, d], z offset [L, H, e]) of TransformerLens' processing ("tl") for a bridge that holds raw
    weights (a streamed checkpoint's forward passes): what the processed model's heads write and read that the raw
    one's do not. The processing centres each head's W_O along d_model in a model normed by LayerNorm (not by
    RMSNorm, nor with a final RMSNorm), and folds each value bias into b_O, after folding ln1's shift β into it
    where it folds the norms: its z is the raw z less b_V + β W_V (attention rows sum to 1). Everything else it
    does leaves the function, and so the patterns, losses and changes, as they are. Checked against the
    processed model on every family of headgraph.testing.families (tests/test_stream_families.py)."""
    cfg, adapter = bridge.cfg, bridge.adapter
    w_o, w_v = weights["W_O"], weights["W_V"]
    layer_norm = cfg.normalization_type in ("LN", "LNPre")
    if layer_norm and not getattr(cfg, "final_rms", False) and getattr(adapter, "supports_center_writing_weights",
                                                                         True):
        w_o = tuple(w - w.mean(-1, keepdim=True) for w in (w.float() for w in w_o))
    offset = weights["b_V"].clone()
    if layer_norm and getattr(adapter, "supports_fold_ln", True):
        for layer, block in enumerate(bridge.blocks):
            norm = getattr(block, "ln1", None)
            beta = None if norm is None else getattr(norm.original_component, "bias", None)
            if beta is not None:
                offset[layer] += torch.einsum("d,gde->ge", beta.detach().float(), w_v[layer].float())
    return w_o, offset.repeat_interleave(w_o[0].shape[0] // offset.shape[1], 1)


def _recomputes(net: Net, probe: TokenInputs) -> bool:
    """Whether the recomputed attention of every layer reproduces the model's z on `probe` (rotary or
    relative positions, ALiBi, QK-norm, another score scale or soft-capping do not)."""
    batch = next(batches(net, (probe,), (probe,), (1,), lambda: None))
    return all(_recompute_error(net, batch, layer)[1] <= _Z_TOLERANCE for layer in range(net.n_layers))


@dataclass(frozen=True)
class Gradients:
    """A decoder's loss gradients at one layer's heads, read at the ATTRIBUTION_STEPS + 1 points α = k / steps of
    the path from the clean to the counterfactual activations (every head's z at z + α Δz), and what places an
    edge's change on that path: its projection on each receiver's own Δz, in the output metric (Δz W_O). Each
    is laid out as the products that read it take it, so that they copy no operand."""

    pattern: torch.Tensor  # [b, H, steps + 2, T, T]: ∂L/∂A at each point, then M with Σ ΔA·M = <ΔA v W_O, Δz W_O>
    # one of: z [steps + 2, b, T, H, e], ∂L/∂z at each point, then Δz W_O W_O^T (Σ dz·it = <dz W_O, Δz W_O>), as
    # local path "module" reads a change in z; values [b, KV, T, e, steps + 2, G] (G query heads per KV head),
    # the same read by a change of the values (path "recompute"): Σ_q A[q, k] z[q] of each query head, as
    # Σ dv[k]·it = Σ (A dv)[q]·z[q]
    z: torch.Tensor | None
    values: torch.Tensor | None
    squared: torch.Tensor  # [b, H]: ||Δz W_O||² of each head over the batch's tokens


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
    calls: list[tuple[tuple, dict]] | None = None  # path "module": each layer's attention call (args, kwargs)
    grads: dict[int, Gradients] | None = None  # layer -> a decoder's loss gradients (attribution)
    hooked: dict[str, torch.Tensor] | None = None  # path "module": the clean q/k/v/pattern/attention output


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


def _module_names(net: Net, layer: int) -> list[str]:
    """The clean activations the module path reads of a layer: q, k, v as the attention's hooks see them (the
    patched kind's are replaced by its own, the others held clean), the pattern, the output a ln1_post reads."""
    names = [f"blocks.{layer}.attn.hook_{t}" for t in ("q", "k", "v", "pattern")]
    return names + ([f"blocks.{layer}.attn.hook_out"] if net.out_norm else [])


def _captured_calls(net: Net, batch: TokenInputs, names: list[str]) -> tuple[dict, list[tuple[tuple, dict]]]:
    """The activations `names` of a batch and each layer's attention call (args, kwargs), without its cache."""
    from transformers.cache_utils import Cache

    calls: list = [None] * net.n_layers

    def keep(layer):
        def hook(module, args, kwargs):
            calls[layer] = (args, {k: None if isinstance(v, Cache) else False if k == "use_cache" else v
                                   for k, v in kwargs.items()})
        return hook

    handles = [net.bridge.blocks[l].attn.register_forward_pre_hook(keep(l), with_kwargs=True)
               for l in range(net.n_layers)]
    try:
        _, cache = run_with_activations(net.bridge, batch, names)
    finally:
        for handle in handles:
            handle.remove()
    return cache, calls


RELEASE_EVERY = 2  # blocks of a pass between two releases of the heap they freed (`releasing`)


def _release(module, args, output) -> None:
    release_freed()


@contextlib.contextmanager
def releasing(net: Net, first: int = 0) -> Iterator[None]:
    """While inside, the blocks of a pass give back the heap they freed (`release_freed`), after every
    RELEASE_EVERY-th block from `first` on. A pass frees activations of tens of MB out of order, and in a heap left
    fragmented by what ran before (the local effects' gradient passes, for the loss passes after them) glibc
    serves the next block's activations from pages given back earlier while keeping the pages just freed. On the
    1.1B shape after its local effects a loss pass peaked at 3.20 GiB of anonymous memory for 1.32 GiB in use;
    given back every 2nd block, 2.32 GiB (every block 2.25, every 4th 2.52). Nothing on a GPU (`Net.on_host`)."""
    handles = [net.bridge.blocks[layer].register_forward_hook(_release)
               for layer in range(first + RELEASE_EVERY - 1, net.n_layers, RELEASE_EVERY) if net.on_host]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


ATTRIBUTION_STEPS = 4  # intervals of the clean-to-counterfactual path: its gradients are read at their 5 ends


def path_weights(place: torch.Tensor, steps: int) -> torch.Tensor:
    """Weights [steps + 1, *place.shape] of the gradients at α = k / steps that give the mean gradient over
    [0, place] of the path (place in [0, 1]), the gradient linear in α between the points: Σ_k w_k = 1, and
    place 0 is the clean gradient alone."""
    nodes = torch.arange(steps + 1, dtype=place.dtype, device=place.device).view(-1, *[1] * place.dim()) / steps

    def hat_integral(x):  # ∫_-inf^x max(0, 1 - |u|) du
        return torch.where(x < 0, (x + 1).clamp(min=0).pow(2) / 2, 1 - (1 - x).clamp(min=0).pow(2) / 2)

    area = (hat_integral((place - nodes) * steps) - hat_integral(-nodes * steps)) / steps
    clean = torch.zeros_like(area)
    clean[0] = 1
    tiny = place < 1e-6
    return torch.where(tiny, clean, area / torch.where(tiny, torch.ones_like(place), place))


def attribution(grads: Gradients, change: torch.Tensor, kind: str) -> torch.Tensor:
    """First-order loss change [S, b, H] of the receivers' exact change: A' - A [S, b, H, T, T] (Q/K; read as
    one product without a copy where its memory is heads before senders, [b, H, S, T, T]) or Δz [S, b, T, H, e]
    (V, path "module"; a change of the values themselves: `value_attribution`). Each edge's gradient is the mean
    over its own stretch [0, c] of the clean-to-counterfactual path, c in [0, 1] its change's projection on the
    receiver's whole Δz (an input's all its tokens): a small change reads the clean gradient (first-order exact),
    one as large as the receiver's counterfactual change the integrated gradient of the whole path."""
    if kind == "V":
        return _along_path(grads, torch.einsum("sbthe,nbthe->nsbh", change, grads.z))
    dots = torch.matmul(change.permute(1, 2, 0, 3, 4).flatten(3), grads.pattern.flatten(3).transpose(-1, -2))
    return _along_path(grads, dots.permute(3, 2, 0, 1))


def value_attribution(grads: Gradients, dv: torch.Tensor) -> torch.Tensor:
    """`attribution` [S, b, H] of the change of z that a change of the receivers' values dv [S, b, T, KV, e] causes
    (A dv of each query head), read off dv itself: one product per (input, KV head) with `Gradients.values`."""
    S, b, T, KV, e = dv.shape
    values = grads.values
    dots = torch.bmm(dv.permute(1, 3, 0, 2, 4).reshape(b * KV, S, T * e), values.view(b * KV, T * e, -1))
    return _along_path(grads, dots.view(b, KV, S, *values.shape[-2:]).permute(3, 2, 0, 1, 4).flatten(3))


def _along_path(grads: Gradients, dots: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k dots[k] [S, b, H] from the dots [steps + 2, S, b, H] of a change with the gradient at each point and
    (last) with the receiver's own Δz, which places the change on the path (`path_weights`)."""
    squared = grads.squared[None]
    place = torch.where(squared > 0, dots[-1] / squared.clamp(min=1e-30), torch.zeros_like(dots[-1])).clamp(0, 1)
    return (path_weights(place, len(dots) - 2) * dots[:-1]).sum(0)


def plain_unembed(net: Net, probe: TokenInputs) -> torch.nn.Linear | None:
    """The decoder's unembedding as the torch Linear whose output is the model's logits (checked on `probe`), or
    None: an encoder, or a model that changes its logits after the unembedding (soft-capping, scaling)."""
    linear = getattr(net.bridge.unembed, "original_component", None) if net.is_decoder else None
    if type(linear) is not torch.nn.Linear:
        return None
    logits, hidden = run_with_activations(net.bridge, probe, ["unembed.hook_in"], return_type="logits")
    flat = hidden["unembed.hook_in"].flatten(0, 1)
    mine = unembed(linear, flat, flat.new_empty(len(flat), linear.weight.shape[0])).view_as(logits)
    return linear if torch.allclose(mine, logits, rtol=1e-5, atol=1e-5 * float(logits.abs().max())) else None


def unembed(linear: torch.nn.Linear, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """linear(flat) [rows, V] into `out` in float32, a weight held in another dtype (a streamed checkpoint) upcast
    by chunks of rows (`rows_product`)."""
    return rows_product(flat, linear.weight, None if linear.bias is None else linear.bias.float(), out)


class _TokenLosses(torch.autograd.Function):
    """Cross-entropy [N] of hidden states [N, d] with their target tokens [N] through a plain unembedding
    (`plain_unembed`), whose weight is upcast by chunks both ways (`rows_product`, `rows_gradient`): a float32
    copy of a bf16 unembedding (Llama-3-8B: 2.1 GB) is never made, and the pass keeps one [N, V] tensor, the
    softmax, for its backward pass (the torch path keeps the logits, their log-softmax and the weight)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, linear: torch.nn.Linear, targets: torch.Tensor) -> torch.Tensor:
        probs = unembed(linear, hidden, hidden.new_empty(len(hidden), linear.weight.shape[0]))
        target = probs.gather(-1, targets[:, None])[:, 0]
        top = probs.amax(-1)
        total = probs.sub_(top[:, None]).exp_().sum(-1)
        probs.div_(total[:, None])
        ctx.linear, ctx.probs = linear, probs
        ctx.save_for_backward(targets)
        return top + total.log() - target

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (targets,) = ctx.saved_tensors
        probs, ctx.probs = ctx.probs, None  # softmax minus the targets' one-hot, times the loss's gradient
        probs[torch.arange(len(targets), device=targets.device), targets] -= 1
        probs.mul_(grad[:, None])
        return rows_gradient(probs, ctx.linear.weight), None, None


def stop_pass(hidden, hook):
    """Stop a forward pass at this hook, the bridge returning its activation."""
    from transformer_lens.model_bridge.exceptions import StopAtLayerException

    raise StopAtLayerException(hidden)


def _loss_gradients(net: Net, batch: TokenInputs, dz: torch.Tensor, clean: dict[str, torch.Tensor],
                    linear: torch.nn.Linear | None, steps: int = ATTRIBUTION_STEPS, stack: int = 1
                    ) -> dict[int, Gradients]:
    """{layer: Gradients} of a decoder's next-token loss L (summed over the predicted tokens; each input's
    gradient is its own loss's) at `steps` + 1 points α = k / steps of the path from the clean to the
    counterfactual activations: every head's z is z + α Δz (its value only: the gradient still reaches each
    pattern through the head's own z), the path of integrated-gradients edge attribution (Hanna et al. 2024).
    `clean`: the batch's clean activations, every layer's hook_z and hook_v among them. With `linear` (the plain
    unembedding, `plain_unembed`) the passes stop at its input and `_TokenLosses` forms the loss. `stack` points
    share a pass, each a copy of the batch (a copy's loss reads only its own rows, as an input's reads only its
    own, so its gradients are its point's): on the 1.1B shape, two batches of 4 inputs (20 and 41 tokens) were
    built in 29.5-29.8 s with the five points in one pass against 38.5-39.8 s with one a pass (the products wider,
    each bf16 matrix upcast once a pass), 0.5 GB more per copy (`pass_bytes`)."""
    names = [f"blocks.{l}.attn.hook_{t}" for l in range(net.n_layers) for t in ("pattern", "z")]
    values = [f"blocks.{l}.attn.hook_v" for l in range(net.n_layers)]
    b, device = len(batch), net.bridge.cfg.device
    found, patterns = {name: [] for name in names}, {}  # patterns: the clean A of each layer (α = 0)
    for first in range(0, steps + 1, stack):
        points = range(first, min(first + stack, steps + 1))  # this pass's points, each a copy of the batch
        inputs = batch.rows(torch.arange(b).repeat(len(points)))
        ids = inputs.input_ids.to(device)
        real = inputs.attention_mask.bool().to(device)
        alpha = torch.tensor([k / steps for k in points], device=device).repeat_interleave(b).view(-1, 1, 1, 1)
        kept = {}

        def keep(name):
            def hook(value, hook):
                layer = int(name.split(".")[1])
                if name.endswith("hook_z"):
                    copies = [len(points)] + [1] * (value.dim() - 1)
                    target = clean[name].repeat(copies) + alpha * dz[layer].to(value.dtype).repeat(copies)
                    value = value + (target - value).detach()
                elif first == 0 and net.local_path == "recompute":
                    patterns[layer] = value[:b].detach().float()
                kept[name] = value
                return value
            return hook

        net.release_freed()  # what came before (the batch's forward passes, the last step's gradients) freed
        hooks = [(name, keep(name)) for name in names]
        hooks += [("unembed.hook_in", stop_pass)] if linear is not None else []
        with torch.enable_grad(), releasing(net):
            out = net.bridge.run_with_hooks(ids, fwd_hooks=hooks, return_type=None if linear is not None else "logits",
                                            **model_kwargs(net.bridge, inputs))[:, :-1].float()
            if linear is None:
                losses = torch.nn.functional.cross_entropy(out.transpose(1, 2), ids[:, 1:], reduction="none")
            else:
                losses = _TokenLosses.apply(out.flatten(0, 1), linear, ids[:, 1:].flatten()).view(ids[:, 1:].shape)
            loss = (losses * (real[:, 1:] & real[:, :-1])).sum()
            grads = torch.autograd.grad(loss, [kept[name] for name in names])
        for name, g in zip(names, grads):
            found[name].extend(g.float().unflatten(0, (len(points), b)).unbind(0))
        del out, losses, loss
        kept.clear()
    net.release_freed()  # the last step's activations, freed out of order (a third of the stage's peak otherwise)
    found_by_layer = {}
    for l in range(net.n_layers):
        v = clean[values[l]].float()
        v = v.repeat_interleave(net.n_heads // v.shape[2], dim=2)  # a KV head's values for each query head
        root = net.out_root[l]  # Δz W_O W_O^T = Δz R R^T: an e x e product per head, not two through d_model
        metric = torch.einsum("bthe,hef->bthf", dz[l], root @ root.transpose(-1, -2))
        places = torch.einsum("bkhe,bqhe->bhqk", v, metric)
        z = torch.cat([torch.stack(found.pop(f"blocks.{l}.attn.hook_z")), metric[None]])
        by_value = None
        if l in patterns:  # Σ_q A[q, k] z[q], each query head's, grouped by KV head
            G = net.kv_group
            by_value = torch.einsum("bgmqk,nbqgme->bgkenm", patterns.pop(l).unflatten(1, (-1, G)),
                                    z.unflatten(3, (-1, G))).contiguous()
            z = None
        pattern = torch.cat([torch.stack(found.pop(f"blocks.{l}.attn.hook_pattern"), 2), places[:, :, None]], 2)
        found_by_layer[l] = Gradients(pattern=pattern, z=z, values=by_value,
                                      squared=torch.einsum("bthe,bthe->bh", dz[l], metric))
    return found_by_layer


def batches(net: Net, sets, corrupted, sizes: Sequence[int], advance: Callable[[], None], gradients: bool = False,
            path: Path | None = None, stacks: Sequence[int] | None = None) -> Iterator[Batch]:
    """The clean and corrupted activations of each batch of the input sets, sizes[i] inputs a batch of set i (and,
    with `gradients`, a decoder's loss gradients at every layer's pattern and z, stacks[j] points of the path a
    pass for batch j, 1 without `stacks`) for receivers patched by `path` (default: net.path): the attention calls
    are kept for the module path and for a rotary model's cos/sin."""
    L, path = net.n_layers, path or net.path
    names = z_names(net) + [f"blocks.{l}.hook_resid_pre" for l in range(L)]
    if gradients:
        names += [f"blocks.{l}.attn.hook_v" for l in range(L)]
    if net.post_ln:
        names += [f"blocks.{l}.ln{i}.hook_in" for l in range(L - 1) for i in (1, 2)]
    if path == "module":
        names += [name for l in range(L) for name in _module_names(net, l)]
    linear = plain_unembed(net, sets[0].batch(0, 1)) if gradients else None
    offset, stacks = 0, iter(stacks or itertools.repeat(1))
    for clean_set, corrupt_set, size in zip(sets, corrupted, sizes):
        mean = _mean_z(net, clean_set, size, advance) if corrupt_set is None else None
        for start in range(0, len(clean_set), size):
            stop = min(start + size, len(clean_set))
            batch = clean_set.batch(start, stop)
            if path == "module" or net.rotary:
                cache, calls = _captured_calls(net, batch, names)
            else:
                (_, cache), calls = run_with_activations(net.bridge, batch, names), None
            z = torch.stack([cache[name] for name in z_names(net)]).float()
            T = z.shape[2]
            real = batch.attention_mask.bool().to(z.device)
            if corrupt_set is clean_set:  # its own counterfactual (`_recomputes`' probe): no second pass
                z_alt, real_alt = z, real
            elif mean is None:
                z_alt, real_alt = _z_of(net, corrupt_set.batch(start, stop), T)
            else:
                z_alt, real_alt = mean[:, None, :T].expand_as(z), real
            both = (real & real_alt)[None, :, :, None, None]
            visible = real[:, None, :].expand(-1, T, -1)
            if net.is_decoder:
                visible = visible & torch.ones(T, T, dtype=torch.bool, device=z.device).tril()
            dz = torch.where(both, z_alt - z, torch.zeros_like(z))
            norms = None
            if net.post_ln:
                norms = []
                for l in range(L - 1):
                    a1, a2 = cache[f"blocks.{l}.ln1.hook_in"], cache[f"blocks.{l}.ln2.hook_in"]
                    norms.append((a1, net.norm(l, 1, a1), a2, net.norm(l, 2, a2)))
            made = Batch(rows=slice(offset + start, offset + stop), inputs=batch, real=real, visible=visible,
                         queries=(real & (visible.sum(-1) > 1)).float(),
                         resid=[cache[f"blocks.{l}.hook_resid_pre"] for l in range(L)], z=z,
                         dz=dz, norms=norms, calls=calls,
                         hooked=None if path != "module" else {n: cache[n] for l in range(L)
                                                               for n in _module_names(net, l)},
                         grads=_loss_gradients(net, batch, dz, cache, linear, stack=next(stacks))
                         if gradients else None)
            del cache, z_alt  # the per-layer z and values, the counterfactual z: not kept while the batch is used
            yield made
            del made  # nor the batch once its user let it go, while the next is built
            advance()
        offset += len(clean_set)


@dataclass(frozen=True)
class Layer:
    """Clean attention of one receiver layer, recomputed from its input (path "recompute") or as the model's
    own module computed it (path "module"): what patched rows are compared to."""

    x: torch.Tensor  # [b, T, d]: what Q, K and V read (after ln1 in a pre-LN model)
    q: torch.Tensor  # [b, T, H, e], rotated (path "module": as hook_q sees it)
    k: torch.Tensor  # [b, T, H, e], rotated, each query head's KV head (path "module": [b, T, KV, e], hook_k's)
    v: torch.Tensor
    scores: torch.Tensor | None  # [b, H, T, T], -inf on keys a query cannot see (path "recompute")
    pattern: torch.Tensor  # [b, H, T, T]
    z: torch.Tensor  # [b, T, H, e]
    layer: int = 0
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [b, T, 1, r] (path "recompute", rotary)


def _rotary(net: Net, batch: Batch, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(cos [b, T, 1, e] with 1 beyond the rotated dimensions, the signed sin [b, T, 1, r] = (−sin, sin) of
    the two halves) of a rotary layer's attention call, as the bridge applies them to the first r of each
    head's e dimensions (halves duplicated where they cover e / 2 of a full rotation); None without."""
    from transformer_lens.utilities.hf_utils import get_rotary_pct_from_config

    if not net.rotary or batch.calls[layer] is None:
        return None
    found = batch.calls[layer][1].get("position_embeddings")
    if not isinstance(found, tuple) or len(found) != 2 or not all(torch.is_tensor(t) for t in found):
        return None
    cos, sin = (t.float() for t in found)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    e = net.weights["W_Q"][0].shape[-1]
    if 2 * cos.shape[-1] == e and get_rotary_pct_from_config(net.bridge.cfg) == 1.0:
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    r, shape = cos.shape[-1], (batch.real.shape[0], -1, -1, -1)
    cos = torch.nn.functional.pad(cos, (0, e - r), value=1.0)
    sin = torch.cat([-sin[..., :r // 2], sin[..., r // 2:]], -1)
    return cos[:, :, None].expand(shape), sin[:, :, None].expand(shape)


def rotate(rotary: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Queries or keys x [..., b, T, h, e] rotated by `_rotary`'s cos and signed sin (rotate-half convention,
    the first r dimensions; linear in x, so a change of the input rotates as the input does), into `out` (x's
    shape, any layout) where given; x itself without rotary. Three passes over x: x·cos, then each half's
    multiply-add of the other half."""
    if rotary is None:
        return x
    cos, sin = rotary
    half = sin.shape[-1] // 2
    out = x * cos if out is None else torch.mul(x, cos, out=out)
    out[..., :half].addcmul_(x[..., half:2 * half], sin[..., :half])
    out[..., half:2 * half].addcmul_(x[..., :half], sin[..., half:])
    return out


def _recompute_error(net: Net, batch: Batch, layer: int) -> tuple[Layer, float]:
    """The layer's attention recomputed from its input, and its largest error relative to the model's own z."""
    w = net.weights
    x = batch.resid[layer] if net.post_ln else net.norm(layer, 1, batch.resid[layer])
    q, k, v = (torch.einsum("btd,hde->bthe", x, net.weight(f"W_{t}", layer)) + w[f"b_{t}"][layer] for t in "QKV")
    rotary = _rotary(net, batch, layer)
    if net.rotary and rotary is None:
        return Layer(x=x, q=q, k=k, v=v, scores=None, pattern=q, z=q, layer=layer), math.inf
    q, k = rotate(rotary, q), rotate(rotary, k)
    if net.kv_group > 1:
        k, v = k.repeat_interleave(net.kv_group, 2), v.repeat_interleave(net.kv_group, 2)
    scores = (torch.einsum("bqhe,bkhe->bhqk", q, k) * net.scale).masked_fill(~batch.visible[:, None], -math.inf)
    pattern = torch.softmax(scores, -1)
    z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
    return (Layer(x=x, q=q, k=k, v=v, scores=scores, pattern=pattern, z=z, layer=layer, rotary=rotary),
            _z_error(batch, layer, z))


def _z_error(batch: Batch, layer: int, z: torch.Tensor) -> float:
    own = batch.z[layer][batch.real]
    return (z[batch.real] - own).abs().max().item() / (own.abs().max().item() + 1e-6)


def receiver_layer(net: Net, batch: Batch, layer: int, path: Path | None = None) -> Layer:
    """The clean attention of a receiver layer patched by `path` (default: net.path); UsageError unless it
    reproduces the model's own z on the real tokens (path "module": the module rerun on the captured call, a
    check that the replay is exact)."""
    if (path or net.path) == "recompute":
        recv, error = _recompute_error(net, batch, layer)
    else:
        args, kwargs = batch.calls[layer]
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        h = batch.hooked
        q, k, v, pattern = (h[f"blocks.{layer}.attn.hook_{t}"] for t in ("q", "k", "v", "pattern"))
        recv = Layer(x=x, q=q, k=k, v=v, scores=None, pattern=pattern.float(), z=batch.z[layer], layer=layer)
        error = _z_error(batch, layer, patched_attention(net, batch, recv, "Q", x[None])[1][0])
    if error > _Z_TOLERANCE:
        raise unsupported(net.bridge, f"recomputing layer {layer}'s attention from its input misses the model's "
                                      f"own z by {error:.3g} (relative)")
    return recv


def _copies(value, b: int, S: int, name: str = "", heads: int = 0):
    """An attention call's argument for S stacked copies of a batch of b inputs (sender-major)."""
    if isinstance(value, tuple):
        return tuple(_copies(v, b, S) for v in value)
    if not torch.is_tensor(value) or value.dim() == 0 or name in _NOT_BATCHED:
        return value
    if value.shape[0] == b or (name in PER_ROW_HEAD and value.shape[0] == b * heads):
        return value.repeat(S, *[1] * (value.dim() - 1))
    return value


def coupled(net: Net, layer: int, kind: str) -> bool:
    """Whether the `kind` projections of a layer's heads are normed together (OLMo-2's QK-norm over the whole
    projection), so that patching one receiver's input also moves the others' unless each is patched alone."""
    return kind != "V" and getattr(net.bridge.blocks[layer].attn, "_qk_norm_phase", None) == "pre_reshape"


def patched_attention(net: Net, batch: Batch, recv: Layer, kind: str, x: torch.Tensor, head: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Path "module": (pattern [S, b, H, T, T], z [S, b, T, H, e]) of the receiver layer when only its `kind`
    input (Q, K or V) reads x [S, b, T, d] and the other two read the clean input: the bridge's own attention
    module run on S stacked copies of the batch, the other kinds' projections replaced by their clean values.
    With `head`, only that receiver's (query or KV head's) projection of `kind` reads x, the others' clean."""
    S, b = x.shape[:2]
    args, kwargs = batch.calls[recv.layer]
    kw = {k: _copies(v, b, S, k, net.n_heads) for k, v in kwargs.items()}
    rest = tuple(_copies(a, b, S) for a in args[1:])
    flat = x.reshape(S * b, *x.shape[2:]).to(recv.x.dtype)
    if "hidden_states" in kw or not args:
        kw["hidden_states"], positional = flat, rest
    else:
        positional = (flat, *rest)
    clean = {"Q": recv.q, "K": recv.k, "V": recv.v}
    got = {}

    def hold(t):
        return lambda value, hook: clean[t].repeat(S, *[1] * (clean[t].dim() - 1)).to(value.dtype)

    def only(value, hook):
        held = hold(kind)(value, hook).clone()
        held[:, :, head] = value[:, :, head]
        return held

    def keep(name):
        def hook(value, hook):
            got[name] = value
        return hook

    prefix = f"blocks.{recv.layer}.attn."
    hooks = [(prefix + f"hook_{t.lower()}", hold(t)) for t in "QKV" if t != kind]
    if head is not None:
        hooks.append((prefix + f"hook_{kind.lower()}", only))
    hooks += [(prefix + "hook_pattern", keep("pattern")), (prefix + "hook_z", keep("z"))]
    with net.bridge.hooks(fwd_hooks=hooks):
        net.bridge.blocks[recv.layer].attn(*positional, **kw)
    return (got["pattern"].float().reshape(S, b, *got["pattern"].shape[1:]),
            got["z"].float().reshape(S, b, *got["z"].shape[1:]))


def sender_writes(net: Net, batch: Batch, layer: int, heads: slice) -> torch.Tensor:
    """Δ_s [S, b, T, d]: what each head of `heads` of a sender layer changes in the residual stream, its output
    (z_s(x') - z_s(x)) W_O[s]; through ln1_post where that norm acts on the attention output (Gemma 2/3, OLMo-2):
    ln1_post(a + Δz_s W_O[s]) - ln1_post(a), a the clean attention output, the other heads held clean."""
    delta = torch.einsum("bthe,hed->hbtd", batch.dz[layer][:, :, heads], net.weight("W_O", layer, heads))
    if not net.out_norm:
        return delta
    out = batch.hooked[f"blocks.{layer}.attn.hook_out"].float()
    return net.norm(layer, "1_post", out + delta) - net.norm(layer, "1_post", out)


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


def batch_bytes(net: Net, b: int, T: int, gradients: bool) -> int:
    """Bytes a batch of b inputs of length T holds while it is patched (float32): every layer's residual input, z
    and Δz, its receivers' clean attention (input, q, k, v, z, scores, pattern) and the local effects' clean terms
    (the centred input, c(x) Γ W of each kind), and (`gradients`) the loss gradients at every point of the path."""
    (e, d), H = net.weights["W_O"][0].shape[-2:], net.n_heads
    per_input = 3 * T * d + 9 * T * H * e + 2 * H * T * T
    if gradients:
        per_input += (ATTRIBUTION_STEPS + 2) * (H * T * T + T * H * e)
    return 4 * b * net.n_layers * per_input


def pass_bytes(net: Net, b: int, T: int) -> int:
    """Bytes a gradient pass of `_loss_gradients` over b inputs of length T (one point of the path) holds at its
    peak, about: what its backward pass reads of each layer (the norms' and projections' inputs, q, k and v, the
    attention scores and rows, the MLP's hidden layers) and the softmax over the vocabulary (float32). On the 1.1B
    shape, 4 inputs of 41 tokens: 510 MB more peak RSS per copy of the batch, 580 MB estimated."""
    cfg = net.bridge.cfg
    d = cfg.d_model
    mlp = getattr(cfg, "d_mlp", None) or 4 * d
    return 4 * b * T * (net.n_layers * (6 * d + 4 * mlp + 3 * net.n_heads * T) + cfg.d_vocab)


def batch_sizes(sets, batch_size: int, max_memory: int, per_input: Callable[[int], int]) -> list[int]:
    """Inputs per batch of each set: at most batch_size, and as many as fit in max_memory at per_input(T) bytes an
    input of the set's padded length T (at least 1), in the fewest batches, as even as they can be (24 inputs, at
    most 16 a batch: two of 12)."""
    sizes = []
    for s in sets:
        most = max(1, min(batch_size, len(s), max_memory // per_input(s.input_ids.shape[1])))
        sizes.append(-(-len(s) // -(-len(s) // most)))
    return sizes


def check_counts(n_boot: int, batch_size: int) -> None:
    if n_boot < 1:
        raise UsageError(f"n_boot must be at least 1, got {n_boot}")
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1, got {batch_size}")


def progress_advance(progress, label: str, sets, sizes: Sequence[int], mean: bool) -> Callable[[], None]:
    if progress is None:
        return lambda: None
    batches = sum(-(-len(s) // size) for s, size in zip(sets, sizes)) * (2 if mean else 1)
    task = progress.add_task(label, total=batches)
    return lambda: progress.advance(task)
