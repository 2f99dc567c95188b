"""The vocabulary: weight types, weight-pair types and head names, defined once for typing and validation.

A head reads the residual stream through W_Q, W_K, W_V and writes to it through W_O; a weight-pair type names
the source head's weight, then the target head's ("OK": what the earlier head writes, against what the later
one's keys read). Heads are `L{layer}H{head}`; the native key/value heads of a grouped-query model are
`L{layer}KV{head}`.

>>> TYPE_PAIRS[:4], COMPOSITION_TYPES
(('QQ', 'QK', 'QV', 'QO'), ('OQ', 'OK', 'OV'))
>>> head_name(4, 7), head_name(3, 1, kv=True)
('L4H7', 'L3KV1')
>>> check_type_pair("OX")
Traceback (most recent call last):
...
headgraph.errors.UsageError: unknown weight-pair type 'OX': expected one of QQ, QK, QV, QO, KQ, KK, KV, KO, VQ, VK, VV, VO, OQ, OK, OV, OO
"""

from __future__ import annotations

from typing import Literal, get_args

from headgraph.errors import UsageError

WeightType = Literal["Q", "K", "V", "O"]
WEIGHT_TYPES: tuple[WeightType, ...] = get_args(WeightType)
TYPE_PAIRS: tuple[str, ...] = tuple(s + t for s in WEIGHT_TYPES for t in WEIGHT_TYPES)
"""All 16 weight-pair types, source type then target type, in the order of the figures and tables."""
CompositionType = Literal["OQ", "OK", "OV"]
COMPOSITION_TYPES: tuple[CompositionType, ...] = get_args(CompositionType)
"""The types of Elhage et al.'s Q-, K- and V-composition: an earlier head's output read by a later head."""
DEFAULT_TYPES = COMPOSITION_TYPES
Processing = Literal["tl", "raw"]
"""Which weights a head's matrices are: "tl", TransformerLens' processing (folded LayerNorm, centred writing
weights, folded value biases); "raw", the checkpoint as stored (headgraph.loader.models)."""


def head_name(layer: int, head: int, kv: bool = False) -> str:
    """`L{layer}H{head}`, or `L{layer}KV{head}` for a native key/value head of a grouped-query model."""
    return f"L{layer}{'KV' if kv else 'H'}{head}"


def check_type_pair(type_pair: str) -> str:
    """A weight-pair type, checked (it also becomes a relationship type in Cypher)."""
    if type_pair not in TYPE_PAIRS:
        raise UsageError(f"unknown weight-pair type {type_pair!r}: expected one of {', '.join(TYPE_PAIRS)}")
    return type_pair


def parse_types(types) -> tuple[str, ...]:
    """("OQ", "OK") / "oq,ok" / "all" -> a tuple of distinct upper-case type pairs, in {Q,K,V,O}^2."""
    items = [t.strip() for t in types.split(",")] if isinstance(types, str) else list(types)
    if [t.lower() for t in items] == ["all"]:
        return TYPE_PAIRS
    parsed = tuple(dict.fromkeys(t.upper() for t in items))
    bad = [t for t in parsed if len(t) != 2 or any(c not in WEIGHT_TYPES for c in t)]
    if bad or not parsed:
        raise UsageError(f"bad --types {','.join(bad) or '(empty)'}: use type pairs of Q,K,V,O like oq,ok,ov, "
                         "or 'all'")
    return parsed
