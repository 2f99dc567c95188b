"""Downstream (loss) effects of given edges: the receiver's patched output replaces its clean one and the rest
of the model runs on it. An input's patched copies share forward passes, each copy joining at its receiver's
layer, so the layers before it run once per pass, not once per edge."""

import re
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from headgraph.analysis.artifacts import PAIR_KEY
from headgraph.analysis.bootstrap import ratio_intervals
from headgraph.analysis.causal.inputs import counterfactuals, input_sets
from headgraph.analysis.causal.local import patched_pattern, value_change
from headgraph.analysis.causal.network import (BOOTSTRAP_STREAM, DEFAULT_BATCH_SIZE, DEFAULT_PATCH_MEMORY,
                                               PER_ROW_HEAD, Batch, Layer, Net, batch_bytes, batch_sizes, batches,
                                               carry, check_counts, coupled, input_change, network, patched_attention,
                                               plain_unembed, progress_advance, project, receiver_layer, releasing,
                                               sender_writes, stop_pass, unembed)
from headgraph.analysis.options import DEFAULT_N_BOOT
from headgraph.analysis.patterns import model_kwargs
from headgraph.analysis.prompts import TokenInputs
from headgraph.errors import UsageError
from headgraph.heads import COMPOSITION_TYPES

LOSS_COLUMNS = PAIR_KEY + ["effect_loss", "effect_loss_lo", "effect_loss_hi"]
_HEAD = re.compile(r"^L(\d+)(H|KV)(\d+)$")


def _parse_head(name, net: Net, kind: str = "O") -> tuple[int, int]:
    """(layer, head) of a head name: L{l}H{h}, or for a K/V receiver of a grouped-query model its KV head
    L{l}KV{g} (`Net.receiver_name`)."""
    kv = net.kv_group > 1 and kind in ("K", "V")
    heads = net.n_kv_heads if kv else net.n_heads
    m = _HEAD.match(str(name))
    if not m or (m[2] == "KV") != kv or int(m[1]) >= net.n_layers or int(m[3]) >= heads:
        raise UsageError(f"head {name!r} is not L<layer>{'KV' if kv else 'H'}<head> within {net.n_layers} layers "
                         f"x {heads} {'key/value ' if kv else ''}heads")
    return int(m[1]), int(m[3])


def _parse_edges(edges: pd.DataFrame, net: Net) -> list[tuple[int, int, int, int, str]]:
    """(source layer, source head, target layer, target head, "Q"/"K"/"V") of each edge row."""
    missing = [c for c in PAIR_KEY if c not in edges.columns]
    if missing:
        raise UsageError(f"edges lack the columns {', '.join(missing)} (pairs.parquet's naming)")
    parsed = []
    for source, target, source_type, target_type in edges[PAIR_KEY].itertuples(index=False):
        kind = f"{source_type}{target_type}"
        if kind not in COMPOSITION_TYPES:
            raise UsageError(f"edge {source} -> {target}: causal effects are defined for "
                             f"{', '.join(COMPOSITION_TYPES)}, not {kind!r}")
        (ls, hs), (lr, hr) = _parse_head(source, net), _parse_head(target, net, str(target_type))
        if ls >= lr:
            raise UsageError(f"edge {source} -> {target}: the source's layer must come before the target's")
        parsed.append((ls, hs, lr, hr, str(target_type)))
    return parsed


def _head_change(net: Net, batch: Batch, recv: Layer, delta: torch.Tensor, kind: str, head: int
                 ) -> tuple[slice, torch.Tensor]:
    """(the query heads whose z changes, the change of their z [b, T, h, e]) when only the receiver's `kind`
    input sees the residual change delta [1, b, T, d]: one query head for Q, the KV head's group for K/V; every
    head where the heads' projections are normed together (OLMo-2: one receiver's input moves them all)."""
    layer = recv.layer
    if net.path == "module":
        x = net.attention_input(layer, batch.resid[layer] + delta)
        group = 1 if kind == "Q" else net.kv_group
        together = coupled(net, layer, kind)
        heads = slice(0, net.n_heads) if together else slice(head * group, (head + 1) * group)
        _, z = patched_attention(net, batch, recv, kind, x, head if together else None)
        return heads, (z[0, :, :, heads] - recv.z[:, :, heads])
    heads = slice(head, head + 1)
    d = project(input_change(net, batch, recv, layer, delta), net.weight(f"W_{kind}", layer, heads))
    if kind == "V":
        return heads, value_change(recv, d, heads)[0]
    new = patched_pattern(net, recv, d, kind, heads)[0, :, 0]
    return heads, torch.einsum("bqk,bke->bqe", new - recv.pattern[:, head], recv.v[:, :, head])[:, :, None]


class _Logits:
    """Logits of the loss passes through a plain unembedding (`plain_unembed`), written into one buffer grown
    to the largest pass and reused: a pass's logits are its largest tensor (e.g. 60 copies x 41 tokens x 50257,
    half a GB), and fresh memory of that size costs its first touch on every pass. `release` lets it go between
    batches: the budget leaves room for the passes' copies beside one batch, not beside the next one's build."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear, self.buffer = linear, torch.empty(0)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """linear(hidden) [G, T, V] for hidden [G, T, d], in the buffer (valid until the next call)."""
        vocab = self.linear.weight.shape[0]
        rows, size = hidden.shape[0] * hidden.shape[1], hidden.shape[0] * hidden.shape[1] * vocab
        if self.buffer.numel() < size:
            self.buffer = torch.empty(0)  # the old buffer goes before the new one is allocated
            self.buffer = torch.empty(size, dtype=torch.float32, device=hidden.device)
        out = unembed(self.linear, hidden.reshape(rows, -1), self.buffer[:size].view(rows, vocab))
        return out.view(*hidden.shape[:2], -1)

    def release(self) -> None:
        self.buffer = torch.empty(0)


def _patched_outputs(net: Net, inputs: TokenInputs, changes: list[tuple[int, slice, torch.Tensor]],
                     logits: _Logits | None = None) -> torch.Tensor:
    """Logits (decoder) or final hidden states (encoder) [1 + G, T, .] of one input (`inputs`, one row, no
    padding) in one forward pass: row 0 clean, row 1 + g with the heads changes[g][1] of layer changes[g][0]
    (layers in ascending order) with their z changed by changes[g][2] [T, h, e], the rest of the model run on it. With
    `logits` (a decoder's plain unembedding), the pass stops at the unembedding's input and `logits` computes them.

    Copy g joins the pass at its layer's input as a copy of the clean row, so what comes before its layer runs
    once for all copies: the attention mask and position terms of one input broadcast over the grown batch."""
    joining = {}  # layer -> (first row, head slices, dz [T, h, e] each) of the copies that join there
    for g, (layer, changed, dz) in enumerate(changes):
        _, heads, dzs = joining.setdefault(layer, (1 + g, [], []))
        heads.append(changed)
        dzs.append(dz)

    def join(resid, hook):
        k = len(joining[int(hook.name.split(".")[1])][1])
        return torch.cat([resid, resid[:1].expand(k, *resid.shape[1:])])

    def patch(z, hook):
        first, heads, dzs = joining[int(hook.name.split(".")[1])]
        z = z.clone()
        rows = torch.tensor([first + g for g, h in enumerate(heads) for _ in range(h.start, h.stop)], device=z.device)
        columns = torch.tensor([i for h in heads for i in range(h.start, h.stop)], device=z.device)
        z[rows, :, columns] += torch.cat([dz.transpose(0, 1) for dz in dzs]).to(z.dtype)
        return z

    hooks = [hook for layer in joining for hook in ((f"blocks.{layer}.hook_resid_pre", join),
                                                     (f"blocks.{layer}.attn.hook_z", patch))]
    if not net.is_decoder:  # the bridge returns the final hidden states; the MLM head (half the work) is skipped
        hooks.append((f"blocks.{net.n_layers - 1}.hook_resid_post", stop_pass))
    elif logits is not None:
        hooks.append(("unembed.hook_in", stop_pass))
    first = min(joining, default=net.n_layers)  # the pass is grown from here on
    grown = [net.bridge.blocks[layer].attn.register_forward_pre_hook(_grown_rows, with_kwargs=True)
             for layer in range(first, net.n_layers)]
    try:
        with releasing(net, first):  # the grown blocks' activations, freed out of order
            out = net.bridge.run_with_hooks(inputs.input_ids.to(net.bridge.cfg.device), fwd_hooks=hooks,
                                            return_type="logits" if net.is_decoder and logits is None else None,
                                            **model_kwargs(net.bridge, inputs))
    finally:
        for handle in grown:
            handle.remove()
    return out if logits is None else logits(out)


def _grown_rows(module, args, kwargs):
    """An attention call inside a grown pass gets its per-row position terms (BLOOM's ALiBi bias, [rows * heads,
    1, T], made for the one input) repeated for every row; the rest broadcast as they are."""
    rows = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[0]
    for name in PER_ROW_HEAD:
        bias = kwargs.get(name)
        if torch.is_tensor(bias) and bias.shape[0] < rows * module.config.n_heads:
            kwargs[name] = bias.repeat(rows * module.config.n_heads // bias.shape[0], *[1] * (bias.dim() - 1))
    return args, kwargs


def _copies_per_pass(net: Net, length: int, max_memory: int) -> int:
    """Patched copies of one input of `length` tokens per forward pass (besides its clean row) so that its widest
    activations (the logits and logsumexp's temporary, or the MLP's 4 d_model, float32) stay within max_memory
    bytes."""
    d = net.bridge.cfg.d_model
    width = net.bridge.cfg.d_vocab * 2 if net.is_decoder else 4 * d
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


def _batch_losses(net: Net, batch: Batch, parsed: list[tuple[int, int, int, int, str]], order: list[int],
                  budget: int, logits: _Logits | None, num: np.ndarray, den: np.ndarray) -> None:
    """Each edge's patched minus clean loss (decoder) or squared change of the final hidden states (encoder) on
    every input of `batch`, into num and den at the batch's columns; the receivers' clean attention and the
    edges' changes are let go on return, before the next batch is built."""
    room = budget - batch_bytes(net, len(batch.real), batch.z.shape[2], False)  # for the passes' copies
    receivers, changes = {}, []
    for e in order:
        sender_layer, sender, layer, head, kind = parsed[e]
        if layer not in receivers:
            receivers[layer] = receiver_layer(net, batch, layer)
        delta = sender_writes(net, batch, sender_layer, slice(sender, sender + 1))
        for between in range(sender_layer, layer):
            delta = carry(net, batch, between, delta)
        changes.append((layer, *_head_change(net, batch, receivers[layer], delta, kind, head)))
    for i in range(len(batch.real)):
        one = batch.inputs.batch(i, i + 1)  # trimmed to its real tokens
        T = one.input_ids.shape[1]
        step = _copies_per_pass(net, T, max(0, room))
        for first in range(0, len(changes), step):
            out = _patched_outputs(net, one, [(layer, head, dz[i, :T])
                                              for layer, head, dz in changes[first:first + step]], logits)
            if net.is_decoder:
                losses = _token_losses(out, one.input_ids[0]).sum(-1)
                change, count = losses[1:] - losses[0], torch.full_like(losses[1:], T - 1)
            else:
                change = (out[1:] - out[:1]).pow(2).sum((1, 2))
                count = out[0].pow(2).sum().expand_as(change)
            edges_here = order[first:first + len(change)]
            num[edges_here, batch.rows.start + i] = change.double().cpu().numpy()
            den[edges_here, batch.rows.start + i] = count.double().cpu().numpy()
            net.release_freed()  # the pass's activations, freed out of order (its logits buffer stays for the next)


@torch.no_grad()
def loss_effects(model, inputs: TokenInputs | Sequence[TokenInputs], edges: pd.DataFrame, ablation: str = "resample",
                 corrupted: TokenInputs | Sequence[TokenInputs] | None = None, n_boot: int = DEFAULT_N_BOOT,
                 seed: int = 0, batch_size: int = DEFAULT_BATCH_SIZE, max_memory: int = DEFAULT_PATCH_MEMORY,
                 progress=None) -> pd.DataFrame:
    """Downstream effect of patching only the path s -> r.T of each edge, everything after r run on it.

    `edges`: rows with source, target, source_type ("O"), target_type ("Q"/"K"/"V"), e.g. selected rows of
    pairs.parquet or of `local_effects`. Inputs, ablation, corrupted and seed as in `local_effects` (the same
    arguments give the same counterfactuals). Returns those four columns, in the edges' order, with
    effect_loss, effect_loss_lo, effect_loss_hi: decoder, patched minus clean next-token cross-entropy in nats
    per predicted token (positive = the path helps the model); encoder, ||h' - h||_F / ||h||_F of the final
    hidden states. An input's patched copies share forward passes, each copy joining at its target layer: the layers
    before it run once per pass, not once per edge. `max_memory` bounds the Net's copies of the weights, a batch
    (`batch_bytes`: at most `batch_size` inputs, fewer where they would take more than half of what is left; the
    passes that build it keep about as much again) and a pass's copies (`_copies_per_pass`, at least one) within the
    rest.
    """
    check_counts(n_boot, batch_size)
    sets = input_sets(inputs, "inputs")
    alternatives = counterfactuals(sets, ablation, corrupted, seed)
    net = network(model, sets[0].batch(0, 1))
    parsed = _parse_edges(edges, net)
    n = sum(len(s) for s in sets)
    num, den = np.zeros((len(parsed), n)), np.zeros((len(parsed), n))
    budget = max(0, max_memory - net.nbytes)  # a batch and its passes' copies, beside the Net's copies of the weights
    sizes = batch_sizes(sets, batch_size, budget, lambda T: 2 * batch_bytes(net, 1, T, False))  # at most half of it
    advance = progress_advance(progress, "causal: loss effects", sets, sizes, ablation == "mean")
    order = sorted(range(len(parsed)), key=lambda e: parsed[e][2])  # by target layer: copies join in order
    linear = plain_unembed(net, sets[0].batch(0, 1))
    logits = _Logits(linear) if linear is not None else None
    for batch in batches(net, sets, alternatives, sizes, advance):
        _batch_losses(net, batch, parsed, order, budget, logits, num, den)
        del batch  # neither this batch nor the largest pass's buffer is held while the next batch is built
        if logits is not None:
            logits.release()
    effect, lo, hi = ratio_intervals(num, den, n_boot, [seed, BOOTSTRAP_STREAM], root=not net.is_decoder)
    table = edges[PAIR_KEY].reset_index(drop=True).copy()
    table["effect_loss"], table["effect_loss_lo"], table["effect_loss_hi"] = effect, lo, hi
    return table[LOSS_COLUMNS]
