"""The inputs of direct-path patching and their counterfactuals: the generated input sets of the role tests (or
the user's texts, one a line), and resample ablation's x' (another input of the same set, drawn seeded among those
at least as long) or the caller's own corrupted inputs."""

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from headgraph.analysis.options import Ablation
from headgraph.analysis.prompts import TokenInputs, text_inputs
from headgraph.analysis.roles import input_set, input_set_names
from headgraph.errors import UsageError, check_choice

_RESAMPLE_STREAM = 101


def causal_inputs(model, n: int, seed: int = 0, texts: Sequence[str] | None = None) -> tuple[TokenInputs, ...]:
    """The role tests' generated input sets of a LoadedModel's kind, n inputs each: IOI prompts and repeated
    random tokens (decoder), sentence pairs (encoder); or, given `texts`, those texts as one set."""
    decoder = model.bridge.cfg.attention_dir == "causal"
    if texts is not None:
        return (text_inputs(model.tokenizer, list(texts), decoder),)
    return tuple(input_set(model, name, n, seed) for name in input_set_names(decoder))


def read_texts(path) -> list[str]:
    """The non-empty lines of a text file (`--causal-inputs FILE`); an unreadable file raises UsageError."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the causal inputs file '{path}' ({e.__class__.__name__}: {e}); "
                         "give a UTF-8 text file, one input a line") from None
    return [line.strip() for line in lines if line.strip()]


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


def input_sets(inputs, what: str) -> tuple[TokenInputs, ...]:
    sets = (inputs,) if isinstance(inputs, TokenInputs) else tuple(inputs)
    if not sets or any(not isinstance(s, TokenInputs) or len(s) == 0 for s in sets):
        raise UsageError(f"{what} must be a non-empty TokenInputs or a sequence of them")
    return sets


def counterfactuals(sets, ablation: Ablation, corrupted, seed: int) -> tuple[TokenInputs | None, ...]:
    check_choice(ablation, Ablation, "ablation")
    if ablation == "mean":
        if corrupted is not None:
            raise UsageError("corrupted inputs go with ablation 'resample'; mean ablation takes none")
        return (None,) * len(sets)
    if corrupted is None:
        return tuple(resample_inputs(s, seed) for s in sets)
    pairs = input_sets(corrupted, "corrupted")
    if len(pairs) != len(sets) or any(len(c) != len(s) for c, s in zip(pairs, sets)):
        raise UsageError(f"corrupted inputs must match the inputs one to one: got sets of "
                         f"{[len(c) for c in pairs]} inputs for {[len(s) for s in sets]}")
    return pairs
