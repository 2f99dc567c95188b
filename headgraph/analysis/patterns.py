"""Attention patterns captured with TransformerLens hooks (`blocks.{l}.attn.hook_pattern`) on the TransformerBridge.

Inputs are right-padded; the attention mask goes to the model (padding keys get no attention, and positions
stay those of the unpadded input) and the scores mask padding queries and keys again. BERT-style encoders go
through the same bridge hooks, with their token_type_ids; the bridge runs attention in eager mode, so its
patterns equal transformers' own `output_attentions` under `attn_implementation="eager"`.
"""

from collections.abc import Iterator

import torch

from headgraph.analysis.prompts import TokenInputs


def pattern_hook_names(n_layers: int) -> list[str]:
    """The TransformerLens hook names of the attention patterns of every layer."""
    return [f"blocks.{layer}.attn.hook_pattern" for layer in range(n_layers)]


def capture_patterns(bridge, inputs: TokenInputs) -> torch.Tensor:
    """Attention patterns [batch, layer, head, query, key] of one batch of inputs, on the bridge's device."""
    device = bridge.cfg.device
    kwargs = {"attention_mask": inputs.attention_mask.long().to(device)}
    if inputs.token_type_ids is not None:
        kwargs["token_type_ids"] = inputs.token_type_ids.to(device)
    names = pattern_hook_names(bridge.cfg.n_layers)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(inputs.input_ids.to(device), names_filter=names, return_type=None, **kwargs)
    return torch.stack([cache[name] for name in names], dim=1)


def iter_patterns(bridge, inputs: TokenInputs, batch_size: int = 32) -> Iterator[tuple[TokenInputs, torch.Tensor]]:
    """(batch, patterns) for consecutive batches of `inputs`, each trimmed to its longest input."""
    for start in range(0, len(inputs), batch_size):
        batch = inputs.batch(start, min(start + batch_size, len(inputs)))
        yield batch, capture_patterns(bridge, batch)
