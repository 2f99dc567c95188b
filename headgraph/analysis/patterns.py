"""Attention patterns captured with TransformerLens hooks (`blocks.{l}.attn.hook_pattern`) on the TransformerBridge.

Inputs are right-padded; the attention mask goes to the model (padding keys get no attention, and positions
stay those of the unpadded input) and the scores mask padding queries and keys again. BERT-style encoders go
through the same bridge hooks, with their token_type_ids; the bridge runs attention in eager mode, so its
patterns equal transformers' own `output_attentions` under `attn_implementation="eager"`.
"""

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from headgraph.analysis.prompts import TokenInputs


def pattern_hook_names(n_layers: int) -> list[str]:
    """The TransformerLens hook names of the attention patterns of every layer."""
    return [f"blocks.{layer}.attn.hook_pattern" for layer in range(n_layers)]


def model_kwargs(bridge, inputs: TokenInputs) -> dict:
    """What the bridge's forward reads besides the token ids: the attention mask, and token types where given."""
    device = bridge.cfg.device
    kwargs = {"attention_mask": inputs.attention_mask.long().to(device)}
    if inputs.token_type_ids is not None:
        kwargs["token_type_ids"] = inputs.token_type_ids.to(device)
    return kwargs


def run_with_activations(bridge, inputs: TokenInputs, names: list[str], return_type=None) -> tuple[Any, dict]:
    """(output, {name: activation}) of one batch of inputs at the TransformerLens hooks `names`.

    With return_type None the forward pass stops as soon as every hook in `names` has fired: what runs after
    them would only be discarded. For the attention patterns of GPT-2 small that is the last MLP, the final
    LayerNorm and the 50257-wide unembedding, about a third of the forward pass's FLOPs.
    """
    from transformer_lens.model_bridge.exceptions import StopAtLayerException

    kept, wanted = {}, set(names)

    def keep(name, activation, hook):
        kept[name] = activation
        if return_type is None and wanted <= kept.keys():
            raise StopAtLayerException(activation)  # the bridge's own early stop: hooks removed, forward returns

    with torch.no_grad():
        output = bridge.run_with_hooks(inputs.input_ids.to(bridge.cfg.device),
                                       fwd_hooks=[(name, partial(keep, name)) for name in names],
                                       return_type=return_type, **model_kwargs(bridge, inputs))
    return (output if return_type is not None else None), kept


def capture_patterns(bridge, inputs: TokenInputs) -> torch.Tensor:
    """Attention patterns [batch, layer, head, query, key] of one batch of inputs, on the bridge's device."""
    names = pattern_hook_names(bridge.cfg.n_layers)
    _, patterns = run_with_activations(bridge, inputs, names)
    return torch.stack([patterns[name] for name in names], dim=1)


def iter_patterns(bridge, inputs: TokenInputs, batch_size: int = 32) -> Iterator[tuple[TokenInputs, torch.Tensor]]:
    """(batch, patterns) for consecutive batches of `inputs`, each trimmed to its longest input."""
    for start in range(0, len(inputs), batch_size):
        batch = inputs.batch(start, min(start + batch_size, len(inputs)))
        yield batch, capture_patterns(bridge, batch)
