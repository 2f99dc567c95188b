"""Local direct-path effects of every earlier -> later head pair: how far the receiver's attention row
(Q/K edges, total variation) or its output (V edges, relative change) moves when only its Q/K/V input sees
the sender's change. All senders of one layer x all receivers of one later layer are one batched tensor
operation; pre-LN models with LayerNorm project the senders' Δz through c(W_O) Γ W (`_FactoredChange`)."""

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from headgraph.analysis.artifacts import PAIR_KEY
from headgraph.analysis.bootstrap import ratio_intervals
from headgraph.analysis.causal.inputs import counterfactuals, input_sets
from headgraph.analysis.causal.network import (ATTRIBUTION_STEPS, BOOTSTRAP_STREAM, DEFAULT_BATCH_SIZE,
                                               DEFAULT_PATCH_MEMORY, Batch, Layer, Net, attribution, batch_bytes,
                                               batch_sizes, batches, carry, check_counts, coupled, input_change,
                                               network, pass_bytes, patched_attention, progress_advance, project,
                                               receiver_layer, rotate, sender_writes, value_attribution)
from headgraph.analysis.heap import empty_mapped
from headgraph.analysis.options import DEFAULT_N_BOOT
from headgraph.analysis.prompts import TokenInputs
from headgraph.errors import UsageError
from headgraph.heads import COMPOSITION_TYPES, check_type_pair, head_name

LOCAL_COLUMNS = PAIR_KEY + ["effect", "effect_lo", "effect_hi", "effect_attr", "effect_attr_lo", "effect_attr_hi"]


def local_weight(net: Net, layer: int, kind: str) -> torch.Tensor:
    """What the local effect projects a changed input through, in float32: W_Q [H, d, e], W_K or W_V [KV, d, e]
    (a grouped-query model's products and value changes are formed on its KV heads, and each query head's R
    applied after: `output_change`)."""
    return net.weight(f"W_{kind}", layer)


class _Workspace:
    """Two buffers that one group's patching steps write their largest tensors into, in turn (the projected change,
    its rotation into heads-first memory, the score products, the patched scores and rows: each reads the last one
    written and writes the other), each grown to the largest step's and reused. A new tensor of tens of MB is a new
    mapping whose first write faults it in, or comes from glibc's heap and leaves it fragmented until the next
    `release_freed` (RSS above the bytes in use): on the 1.1B shape cut to 8 layers, 4 inputs a set, the stage took
    15.9 s against 18.2 s, 2.2 s of system time against 5.0. Let go with the group, before the next group's batches
    are built."""

    def __init__(self):
        self.buffers: list[torch.Tensor | None] = [None, None]

    def take(self, slot: int, like: torch.Tensor, *size: int) -> torch.Tensor:
        """Buffer `slot` (0 or 1) as a contiguous tensor of `size` (like's dtype and device), valid until it is
        taken again."""
        count = math.prod(size)
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() < count or (buffer.dtype, buffer.device) != (like.dtype, like.device):
            self.buffers[slot] = None  # the old buffer goes before the new one is allocated
            buffer = self.buffers[slot] = empty_mapped(like, count)
        return buffer[:count].view(size)


class _FactoredWeights:
    """What `_FactoredChange` needs of the weights, the same for every batch: γ of each receiver layer's ln1 (None
    for a norm without a weight), and c(W_O[s]) Γ W [S, e, h, e] per (sender layer, sender heads, receiver layer,
    kind), with Γ = diag(γ), W the `local_weight` and c(W_O) = W_O with each row centred (a LayerNorm; W_O itself
    for an RMSNorm, `centred` False), formed once per group of batches (`_plan`): c(W_O) once per sender heads
    (`outputs`), Γ W as W is read in float32, into the memory that the product reads (`mixed`; 1.1B shape: Q, K
    and V of one sender and receiver layer in 81-94 ms against 95-106 ms with c(W_O) Γ formed for each)."""

    def __init__(self, net: Net, centred: bool):
        self.net, self.centred, self.gamma, self.eps = net, centred, {}, {}
        self.buffers: dict[tuple, torch.Tensor] = {}  # Γ W per shape, dtype and device (`mixed`), rewritten each time
        for layer in range(1, net.n_layers):
            gamma, self.eps[layer], _ = net.layer_norm(layer, 1)
            self.gamma[layer] = None if gamma is None else gamma.detach().float()

    def scaled(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x Γ: x [..., d] scaled by the receiver layer's γ."""
        return x if self.gamma[layer] is None else x * self.gamma[layer]

    def outputs(self, sender_layer: int, heads: slice) -> torch.Tensor:
        """c(W_O) [S, e, d] of the sender heads `heads`, in float32."""
        w_o = self.net.weight("W_O", sender_layer, heads)
        return w_o - w_o.mean(-1, keepdim=True) if self.centred else w_o

    def mixed(self, outputs: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        """c(W_O) Γ W [S, e, h, e] of the senders' `outputs` (c(W_O) [S, e, d]) at a receiver layer's `kind`. Γ W
        is written in the memory order W is held in, d innermost where it is (a checkpoint's Linear, its rows
        h e by d: the product reads it transposed), else [d, h, e], into a buffer kept for its shape: on the
        1.1B shape, a Q's 32 x 2048 x 64 bf16 weights scaled into new memory in 1-8 against 12-16 ms read across
        their rows, one sender layer's c(W_O) Γ W of Q, K and V at all 21 later layers in 2.4-2.5 s (2.6-2.7 s
        with new memory each time, 2.9-3.0 s across the rows), the same bits."""
        w = self.net.weights[f"W_{kind}"][layer]  # [h, d, e] as held (a bf16 checkpoint's in bf16)
        h, d, e = w.shape
        rows = w.stride(1) == 1  # [h, e, d]: each of the h e rows of W^T contiguous
        w = w.transpose(1, 2) if rows else w.transpose(0, 1)
        key = (w.shape, outputs.dtype, outputs.device)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(w.shape, dtype=outputs.dtype, device=outputs.device)
        scaled = self.buffers[key]
        if self.gamma[layer] is None:
            scaled.copy_(w)
        else:
            torch.mul(w, self.gamma[layer] if rows else self.gamma[layer][:, None, None], out=scaled)
        right = scaled.view(h * e, d).T if rows else scaled.view(d, h * e)
        return (outputs.flatten(0, 1) @ right).view(*outputs.shape[:2], h, e)


class _FactoredChange:
    """The receivers' projected input change LN(x + Δ) W − LN(x) W of a pre-LN model, from the senders' Δz
    [b, T, S, e] instead of Δ = Δz W_O [S, b, T, d]: with c the centring (the identity for an RMSNorm), σ the
    norm's scale and γ its weight, LN(x + Δ) − LN(x) = (1/σ' − 1/σ) γ·c(x) + γ·c(Δ)/σ', and γ·c(Δ) W =
    Δz c(W_O) Γ W. So the change is one product of Δz/σ' with c(W_O) Γ W plus one fused multiply-add of the
    clean term: the d × d projection per sender becomes an e × (H e) one (d/e times fewer FLOPs), and no pass
    over the result corrects it after.
    The result equals `project` of `input_change` up to rounding (tested against it and against hooked runs).

    `clean` caches the batch's sender-independent terms, c(x) and var(x) per receiver layer and c(x) Γ W per
    (layer, kind); one dict per batch, shared by its sender chunks."""

    def __init__(self, weights: _FactoredWeights, batch: Batch, sender_layer: int, heads: slice,
                 delta: torch.Tensor, clean: dict):
        self.weights, self.batch, self.clean = weights, batch, clean
        self.dz = batch.dz[sender_layer][:, :, heads]  # [b, T, S, e]
        self.delta = delta
        self.delta_var = delta.var(-1, correction=0) if weights.centred else delta.pow(2).mean(-1)  # [S, b, T]
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the receiver layer's in hand only

    def _scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Δz/σ' [b, T, S, e] and 1/σ' − 1/σ [S, b, T] at a receiver layer."""
        if layer not in self.clean:
            x = self.batch.resid[layer]
            centred = x - x.mean(-1, keepdim=True) if self.weights.centred else x
            self.clean[layer] = (centred, centred.pow(2).mean(-1))
        if layer not in self.scales:
            centred, var = self.clean[layer]
            eps = self.weights.eps[layer]
            var_new = var + 2 * torch.einsum("btd,sbtd->sbt", centred, self.delta) / centred.shape[-1] + self.delta_var
            inv_new = (var_new + eps).clamp(min=eps).rsqrt()
            self.scales.clear()
            self.scales[layer] = (self.dz * inv_new.permute(1, 2, 0)[..., None], inv_new - (var + eps).rsqrt())
        return self.scales[layer]

    def project(self, layer: int, kind: str, mixed: torch.Tensor, workspace: _Workspace) -> torch.Tensor:
        """The change [S, b, T, h, f] at `layer` through W of `kind`, given their c(W_O) Γ W [S, e, h, f]
        (`_FactoredWeights.mixed`), in `workspace`'s buffer 1."""
        dz_over_sigma, inv_change = self._scales(layer)
        if (layer, kind) not in self.clean:  # γ·c(x) W
            self.clean[layer, kind] = torch.einsum("btd,hde->bthe", self.weights.scaled(self.clean[layer][0], layer),
                                                   local_weight(self.weights.net, layer, kind))
        b, T, S, _ = dz_over_sigma.shape
        change = workspace.take(1, mixed, S, b, T, *mixed.shape[2:])  # γ·c(Δ) W / σ'
        torch.matmul(dz_over_sigma.permute(2, 0, 1, 3).flatten(1, 2), mixed.flatten(2), out=change.view(S, b * T, -1))
        return change.addcmul_(inv_change[..., None, None], self.clean[layer, kind])


def patched_pattern(net: Net, recv: Layer, d: torch.Tensor, kind: str, heads: slice,
                    workspace: _Workspace | None = None) -> torch.Tensor:
    """Attention [S, b, h, T, T] of the receiver heads `heads` when only their queries (kind Q) or keys (K)
    change by d [S, b, T, h, e] (the changed input, projected; rotated here as the receiver's are). On a
    grouped-query model `heads` and d's heads are KV heads for K, and the rows are their query heads'. Its memory
    is heads before senders, [b, h, S, T, T], as d's is written (`_heads_first`): the score products, the
    softmax and `attribution`'s product read and write it without a copy (on the 1.1B shape, a Q change's
    rows and their attribution 40 -> 25 ms). Every tensor of it is written into `workspace`'s buffers (a new one
    if None): the rows are valid until it is used again."""
    S, b, T, h, e = d.shape
    workspace = _Workspace() if workspace is None else workspace
    d = _heads_first(recv.rotary, d, workspace)  # [b, h, S, T, e], in buffer 0
    if kind == "Q":  # the score scale on the small clean side, the clean scores added in place
        k = (recv.k[:, :, heads] * net.scale).permute(0, 2, 3, 1)
        scores = torch.matmul(d.flatten(2, 3), k, out=workspace.take(1, d, b, h, S * T, T))
        scores = scores.view(b, h, S, T, T).add_(recv.scores[:, heads, None])
    else:  # each KV head's change read by the queries of its group: [b, h, G T, S T], G query heads per KV head
        G = net.kv_group
        heads = slice(*(None if end is None else end * G for end in (heads.start, heads.stop)))
        q = (recv.q[:, :, heads] * net.scale).unflatten(2, (h, G)).permute(0, 2, 3, 1, 4).flatten(2, 3)
        change = torch.matmul(q, d.flatten(2, 3).transpose(-1, -2), out=workspace.take(1, d, b, h, G * T, S * T))
        scores = workspace.take(0, d, b, h * G, S, T, T)
        torch.add(change.view(b, h, G, T, S, T).permute(0, 1, 2, 4, 3, 5),
                  recv.scores[:, heads, None].unflatten(1, (h, G)), out=scores.view(b, h, G, S, T, T))
    # into the buffer the scores are not in; torch.softmax has no out= (aten's has: in place it would copy
    # through a temporary, twice the time)
    rows = workspace.take(int(kind != "Q"), scores, *scores.shape)
    return torch.ops.aten._softmax.out(scores, -1, False, out=rows).permute(2, 0, 1, 3, 4)


def _heads_first(rotary: tuple[torch.Tensor, torch.Tensor] | None, d: torch.Tensor, workspace: _Workspace
                 ) -> torch.Tensor:
    """d [S, b, T, h, e] rotated (`rotate`) into memory laid out [b, h, S, T, e] (`workspace`'s buffer 0),
    returned so."""
    S, b, T, h, e = d.shape
    out = workspace.take(0, d, b, h, S, T, e)
    rotated = out.permute(2, 0, 3, 1, 4)
    if rotary is None:
        rotated.copy_(d)
    else:
        rotate(rotary, d, rotated)
    return out


def value_change(recv: Layer, dv: torch.Tensor, heads: slice) -> torch.Tensor:
    """Change of z [S, b, T, h, e] of the receiver heads `heads` when only their values change by dv
    [S, b, T, h, e] (the changed input, projected)."""
    return torch.einsum("bhqk,sbkhe->sbqhe", recv.pattern[:, heads], dv)


def output_change(net: Net, recv: Layer, dv: torch.Tensor, workspace: _Workspace) -> torch.Tensor:
    """Δz R [S, b, T, H, e] of every query head of a receiver layer when only the values of its KV heads change
    by dv [S, b, T, KV, e] (the changed input, projected through W_V): ||Δz R|| = ||Δz W_O||, each query head
    reading its KV head's change through its own attention row. Its memory is [b, H, T, S, e], as the two
    products write it (per input and KV head: A of the group's query heads [G T, T] times dv [T, S e]; per
    input and head: times R), so that neither copies its result; into `workspace`'s buffers."""
    S, b, T, KV, e = dv.shape
    values = dv.permute(1, 3, 2, 0, 4).reshape(b, KV, T, S * e)
    H = recv.pattern.shape[1]
    dz = torch.matmul(recv.pattern.view(b, KV, -1, T), values,
                      out=workspace.take(0, dv, b, KV, H // KV * T, S * e)).view(b, H, T * S, e)
    out = torch.matmul(dz, net.out_root[recv.layer], out=workspace.take(1, dv, b, H, T * S, e))
    return out.view(b, H, T, S, e).permute(3, 0, 2, 1, 4)


def _squared_outputs(net: Net, layer: int, z: torch.Tensor) -> torch.Tensor:
    """||z_h W_O[h]||^2 = ||z_h R[h]||^2 [..., T, H] for z [..., T, H, e] of every head of a layer."""
    return torch.einsum("...he,hef->...hf", z, net.out_root[layer]).pow(2).sum(-1)


def _attribution(batch: Batch, layer: int, change: torch.Tensor, kind: str) -> torch.Tensor | None:
    """Per-input first-order loss change [S, b, H] of the receivers' exact change: Σ (A'_r − A_r) · ∂L/∂A_r
    (Q/K, change = A' − A [S, b, H, T, T]) or Σ Δz_r · ∂L/∂z_r (V, change = Δz [S, b, T, H, e]); None without
    the batch's loss gradients (an encoder)."""
    return None if batch.grads is None else attribution(batch.grads[layer], change, kind)


def _local_sums(net: Net, batch: Batch, recv: Layer, layer: int, d: torch.Tensor, kind: str, workspace: _Workspace
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-input numerator [S, R, b] of the local effect of the senders behind d (their input change projected
    through `local_weight` [S, b, T, h, e], of kind `kind`) on every receiver (R query heads for Q, KV heads
    for K/V, summed over the query heads that read each), and of its attribution; the patched rows or outputs in
    `workspace`."""
    if kind == "V":  # r's z changes by Δz, its output by Δz R: ||Δz R||² = ||Δz W_O||²
        attr = None if batch.grads is None else value_attribution(batch.grads[layer], d)
        change = output_change(net, recv, d, workspace).pow_(2).sum(-1)
        sums = (change * batch.real[:, :, None]).sum(2).transpose(1, 2)
    else:
        moved = patched_pattern(net, recv, d, kind, slice(None), workspace).sub_(recv.pattern)
        attr = _attribution(batch, layer, moved, kind)
        tv = moved.abs_().sum(-1).mul_(0.5)
        sums = (tv * batch.queries[:, None]).sum(-1).transpose(1, 2)
    return _by_receiver(net, kind, sums), None if attr is None else _by_receiver(net, kind, attr.transpose(1, 2))


def _by_receiver(net: Net, kind: str, per_head: torch.Tensor) -> torch.Tensor:
    """Sums [S, H, b] over the query heads that read each receiver: [S, R, b], R KV heads for K/V."""
    group = 1 if kind == "Q" else net.kv_group
    return per_head if group == 1 else per_head.unflatten(1, (-1, group)).sum(2)


def _module_sums(net: Net, batch: Batch, recv: Layer, x: torch.Tensor, kind: str
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Path "module": per-input numerator [S, R, b] of the local effect on every receiver (R query heads for Q,
    KV heads for K/V, summed over the query heads that read each) when only the receivers' `kind` input reads
    x [S, b, T, d], and of its attribution."""
    if coupled(net, recv.layer, kind):  # each receiver patched alone: its rows of its own run
        runs = [patched_attention(net, batch, recv, kind, x, head) for head in range(net.receivers(kind))]
        group = 1 if kind == "Q" else net.kv_group
        pattern = torch.cat([p[:, :, r * group:(r + 1) * group] for r, (p, _) in enumerate(runs)], 2)
        z = torch.cat([z[:, :, :, r * group:(r + 1) * group] for r, (_, z) in enumerate(runs)], 3)
    else:
        pattern, z = patched_attention(net, batch, recv, kind, x)
    if kind == "V":
        change = z.sub_(recv.z)
        attr = _attribution(batch, recv.layer, change, kind)
        sums = (_squared_outputs(net, recv.layer, change) * batch.real[:, :, None]).sum(2)  # [S, b, H]
    else:
        moved = pattern.sub_(recv.pattern)
        attr = _attribution(batch, recv.layer, moved, kind)
        sums = (moved.abs_().sum(-1).mul_(0.5) * batch.queries[:, None]).sum(-1)  # [S, b, H]
    group = 1 if kind == "Q" else net.kv_group

    def by_receiver(per_head):  # [S, b, H] -> [S, R, b]
        per_head = per_head.transpose(1, 2)
        return per_head.reshape(per_head.shape[0], -1, group, per_head.shape[-1]).sum(2)

    return by_receiver(sums), None if attr is None else by_receiver(attr)


def _sender_bytes(net: Net, b: int, T: int) -> int:
    """Working bytes of one sender in a batched step over b inputs of length T (float32: the sender writes, the
    patched input and its change, one projection, patched scores, rows and their difference)."""
    e, d = net.weights["W_O"][0].shape[-2:]
    if net.local_path == "module":  # the patched input, q/k/v of every head, scores, pattern and their difference
        return 4 * b * (4 * T * d + 2 * T * (net.n_heads + 2 * net.n_kv_heads) * e + 4 * net.n_heads * T * T)
    return 4 * b * (5 * T * d + 3 * net.n_heads * T * T)


def _plan(net: Net, sets, sizes: Sequence[int], max_memory: int, grouped: bool, gradients: bool
          ) -> list[tuple[int, int, list[int]]]:
    """(batches, senders per batched step, each batch's points of the path per gradient pass) of each group of
    consecutive batches (set i's batches are sizes[i] inputs of its padded length): a group holds its batches
    (`batch_bytes`) and its steps cover all of them, the batches and one step within max_memory, and so do the
    batches held and the passes that build the next one (its forward pass's activations and the gradient passes'
    keep about its bytes again: on the 1.1B shape cut to 8 layers, 16 inputs of 25 tokens held 388 MB and 833 MB
    at most while built, estimated 554 MB; bytes malloc held in use); its gradient passes take as many points of
    the path each as the room left holds (`pass_bytes` a point), at least one. A pre-LN model's c(W_O) Γ W
    products are formed once per group (`grouped`); otherwise each batch is a group. A batch that leaves no room
    for a sender (one input too many bytes for max_memory) is a group alone, its step sized to max_memory and its
    own bytes on top."""
    shapes = [(min(size, len(s) - start), s.input_ids.shape[1]) for s, size in zip(sets, sizes)
              for start in range(0, len(s), size)]
    plan, held, per_sender, count, stacks = [], 0, 0, 0, []

    def chunk():
        return _sender_chunk(net, per_sender, max_memory - held if max_memory - held >= per_sender else max_memory)

    for b, T in shapes:
        data, step = batch_bytes(net, b, T, gradients), _sender_bytes(net, b, T)
        if count and (not grouped or held + data + max(data, per_sender + step) > max_memory):
            plan.append((count, chunk(), stacks))
            held, per_sender, count, stacks = 0, 0, 0, []
        room = (max_memory - held - data) // pass_bytes(net, b, T) if gradients else 1
        stacks.append(min(ATTRIBUTION_STEPS + 1, max(1, room)))
        held, per_sender, count = held + data, per_sender + step, count + 1
    return plan + [(count, chunk(), stacks)]


def _sender_chunk(net: Net, per_sender: int, max_memory: int) -> int:
    """Senders per batched step, each of `per_sender` working bytes, so that the step stays within max_memory."""
    return max(1, min(net.n_heads, max_memory // per_sender))


@dataclass(frozen=True)
class _Sums:
    """Per-input sums the effects are ratios of, filled batch by batch: numerators [pairs, n] of each kind's local
    effects and (a decoder) attributions, float32 as they are computed (held through the stage: on the 1.1B shape
    at 48 inputs, 227 MB in float64) and on the passes' device (a step's sums copied to the host would wait for
    the GPU at every step), the real queries seeing more than one key and the predicted tokens [n], and every
    head's squared clean output [L, H, n]."""

    num: dict[str, torch.Tensor]
    attributed: dict[str, torch.Tensor] | None
    queries: np.ndarray
    predicted: np.ndarray
    outputs: np.ndarray


def _patch_group(net: Net, group: list[tuple[Batch, dict[int, Layer]]], chunk: int, kinds: Sequence[str],
                 weights: "_FactoredWeights | None", index: dict[str, torch.Tensor], sums: _Sums) -> None:
    """Patch every sender into every later receiver layer on each batch of `group` (with its receiver layers),
    `chunk` senders per step, writing each pair's per-input sums into `sums` at the rows `index` gives; with
    `weights` (a pre-LN model, `_FactoredChange`), each c(W_O) Γ W is formed once for the group. The steps write
    their projected changes and patched rows into one `_Workspace`, let go with the group."""
    L, H = net.n_layers, net.n_heads
    for batch, receivers in group:
        sums.queries[batch.rows] = batch.queries.sum(-1).cpu().numpy()
        sums.predicted[batch.rows] = (batch.real[:, 1:] & batch.real[:, :-1]).sum(-1).cpu().numpy()
        for l, recv in receivers.items():
            z = recv.z if net.z_offset is None else recv.z - net.z_offset[l]
            sums.outputs[l, :, batch.rows] = (_squared_outputs(net, l, z) * batch.real[:, :, None]).sum(1).T.cpu()
    clean, workspace = [{} for _ in group], _Workspace()
    for sender_layer in range(L - 1):
        net.release_freed()  # the last sender layer's patched rows, freed out of order (1.1B: 5.46 -> 5.01 GiB peak)
        for first in range(0, H, chunk):
            heads = slice(first, min(first + chunk, H))
            deltas = [sender_writes(net, batch, sender_layer, heads) for batch, _ in group]
            outputs = weights.outputs(sender_layer, heads) if weights is not None else None
            factored = [_FactoredChange(weights, batch, sender_layer, heads, delta, own)
                        for (batch, _), delta, own in zip(group, deltas, clean)] if weights is not None else None
            for layer in range(sender_layer + 1, L):
                changed = []  # per batch: the receivers' patched input (module) or input change (unfactored)
                for i, (batch, receivers) in enumerate(group):
                    if factored is None:
                        deltas[i] = carry(net, batch, layer - 1, deltas[i])
                    if net.local_path == "module":
                        changed.append(net.attention_input(layer, batch.resid[layer] + deltas[i]))
                    elif factored is None:
                        changed.append(input_change(net, batch, receivers[layer], layer, deltas[i]))
                for kind in kinds:
                    rows = index[kind][sender_layer, heads, layer]
                    mixed = weights.mixed(outputs, layer, kind) if factored is not None else None
                    for i, (batch, receivers) in enumerate(group):
                        if net.local_path == "module":
                            found, attr = _module_sums(net, batch, receivers[layer], changed[i], kind)
                        else:
                            d = (factored[i].project(layer, kind, mixed, workspace) if factored is not None
                                 else project(changed[i], local_weight(net, layer, kind)))
                            found, attr = _local_sums(net, batch, receivers[layer], layer, d, kind, workspace)
                        sums.num[kind][rows, batch.rows] = found
                        if attr is not None:
                            sums.attributed[kind][rows, batch.rows] = attr


@torch.no_grad()
def local_effects(model, inputs: TokenInputs | Sequence[TokenInputs], types: Sequence[str] = COMPOSITION_TYPES,
                  ablation: str = "resample", corrupted: TokenInputs | Sequence[TokenInputs] | None = None,
                  n_boot: int = DEFAULT_N_BOOT, seed: int = 0, batch_size: int = DEFAULT_BATCH_SIZE,
                  max_memory: int = DEFAULT_PATCH_MEMORY, progress=None, attribution: bool = True) -> pd.DataFrame:
    """Local direct-path effect of every earlier -> later head pair of each type in `types` (OQ, OK, OV), and
    (a decoder, `attribution`) its attribution: the first-order change of the next-token loss that the
    receiver's exact change causes, Σ (A'_r − A_r) · ∂L/∂A_r for Q/K and Σ Δz_r · ∂L/∂z_r for V, the gradients
    from one backward pass per batch of clean inputs, in nats per predicted token like `loss_effects`.

    `model` is a LoadedModel or a streamed one after allow_loading() (its `bridge` is used; see `network`).
    `inputs`: one input set or several; resample ablation draws each input's counterfactual within its own set
    (`resample_inputs`, seeded), or takes `corrupted` (the same structure, row i the counterfactual of input i);
    mean ablation averages per set. Statistics pool all inputs. Returns one row per pair, types in the order given,
    then source, then target: source, target (`L{l}H{h}`), source_type "O", target_type "Q"/"K"/"V", effect,
    effect_lo, effect_hi (bootstrap interval; NaN where r's clean output is zero, for V), effect_attr,
    effect_attr_lo, effect_attr_hi (NaN for an encoder). An attribution is a linear estimate of what `loss_effects`
    measures exactly: it can miss where the loss is far from linear in the receiver's change (a saturated softmax
    downstream), which is why exact patching checks it on the selected edges. `max_memory` bounds the Net's copies
    of the weights (`Net.nbytes`), the batches held at once with their activations and gradients (`batch_bytes`),
    the passes building the next (attribution's taking several points of its path together where the room left
    holds them, `pass_bytes`) and one batched step's working bytes over them (`_plan`). A batch takes at most
    `batch_size` inputs, fewer where more would not fit (`batch_sizes`); a pre-LN model forms each c(W_O) Γ W once
    for all the batches held, so a smaller budget costs those products again per group. The model itself and what
    `batch_bytes` estimates short come on top."""
    if not types:
        raise UsageError(f"types must name at least one of {', '.join(COMPOSITION_TYPES)}")
    kinds = []
    for t in types:
        if check_type_pair(t) not in COMPOSITION_TYPES:
            raise UsageError(f"causal effects are defined for {', '.join(COMPOSITION_TYPES)}, not {t!r}")
        kinds.append(t[1])
    check_counts(n_boot, batch_size)
    sets = input_sets(inputs, "inputs")
    alternatives = counterfactuals(sets, ablation, corrupted, seed)
    net = network(model, sets[0].batch(0, 1))
    L, H = net.n_layers, net.n_heads
    later = np.arange(L)[:, None, None, None] < np.arange(L)[None, None, :, None]
    pairs, index, device = {}, {}, net.out_root.device
    for kind in kinds:  # (source layer, head, target layer, receiver): a query head, or a KV head for K/V
        pairs[kind] = np.nonzero(np.broadcast_to(later, (L, H, L, net.receivers(kind))))
        index[kind] = torch.full((L, H, L, net.receivers(kind)), -1, device=device)
        index[kind][pairs[kind]] = torch.arange(len(pairs[kind][0]), device=device)
    n = sum(len(s) for s in sets)
    sums = _Sums(num={kind: torch.zeros(len(pairs[kind][0]), n, device=device) for kind in kinds},
                 attributed={kind: torch.zeros(len(pairs[kind][0]), n, device=device) for kind in kinds}
                 if attribution and net.is_decoder else None,
                 queries=np.zeros(n), predicted=np.zeros(n), outputs=np.zeros((L, H, n)))
    gradients = sums.attributed is not None
    budget = max(0, max_memory - net.nbytes)
    # a batch's bytes twice (held, and again while its passes build it: `_plan`) and a step of one sender over it
    sizes = batch_sizes(sets, batch_size, budget,
                        lambda T: 2 * batch_bytes(net, 1, T, gradients) + _sender_bytes(net, 1, T))
    advance = progress_advance(progress, "causal: local effects", sets, sizes, ablation == "mean")
    # pre-LN with LayerNorms or RMSNorms of one kind: project the senders' Δz, not their d-wide writes
    # (_FactoredChange)
    norms = {l: net.layer_norm(l, 1) for l in range(1, L)} if net.local_path == "recompute" and not net.post_ln else {}
    centring = {None if n is None else n[2] for n in norms.values()}
    factor = bool(norms) and len(centring) == 1 and None not in centring
    weights = _FactoredWeights(net, centring.pop()) if factor else None
    plan = _plan(net, sets, sizes, budget, factor, gradients)
    stream = batches(net, sets, alternatives, sizes, advance, gradients=gradients, path=net.local_path,
                     stacks=[stack for _, _, stacks in plan for stack in stacks])
    for count, chunk, _ in plan:
        _patch_group(net, [(batch, {l: receiver_layer(net, batch, l, net.local_path) for l in range(1, L)})
                           for batch in itertools.islice(stream, count)], chunk, kinds, weights, index, sums)
    frames = []
    for kind in kinds:
        src_layer, src_head, tgt_layer, tgt_head = pairs[kind]
        group = 1 if kind == "Q" else net.kv_group  # query heads reading each receiver
        num = sums.num[kind].cpu().numpy()
        if kind == "V":
            den = sums.outputs.reshape(L, -1, group, n).sum(2)[tgt_layer, tgt_head]
        else:
            den = np.broadcast_to(sums.queries * group, num.shape)
        effect, lo, hi = ratio_intervals(num, den, n_boot, [seed, BOOTSTRAP_STREAM], root=kind == "V")
        attr = attr_lo = attr_hi = np.full(len(effect), np.nan)
        if sums.attributed is not None:  # nats per predicted token, as the loss effect
            attr, attr_lo, attr_hi = ratio_intervals(sums.attributed[kind].cpu().numpy(),
                                                     np.broadcast_to(sums.predicted, num.shape),
                                                     n_boot, [seed, BOOTSTRAP_STREAM])
        frames.append(pd.DataFrame({
            "source": pd.Series([head_name(l, h) for l, h in zip(src_layer.tolist(), src_head.tolist())], dtype=str),
            "target": pd.Series([net.receiver_name(l, h, kind) for l, h in zip(tgt_layer.tolist(), tgt_head.tolist())],
                                dtype=str),
            "source_type": "O", "target_type": kind, "effect": effect, "effect_lo": lo, "effect_hi": hi,
            "effect_attr": attr, "effect_attr_lo": attr_lo, "effect_attr_hi": attr_hi}))
    return pd.concat(frames, ignore_index=True)[LOCAL_COLUMNS]
