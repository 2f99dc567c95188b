"""Synthetic GPT-2-architecture models with planted structure whose ground truth is known.

Planted on top of GPT-2's random initialisation (`headgraph.testing.synthetic`):
- alignment edges: a source head's O-subspace (row space of its W_O) is made to overlap a later target head's
  Q, K or V column space to a degree `alpha` (target basis = orth(alpha·U_src + (1-alpha)·U_random));
  one source gets several out-edges (the hub);
- identity heads (attention on the query token itself) and previous-token heads (attention on position i-1),
  built from a sinusoidal position code in its own residual subspace: W_Q W_Kᵀ compares position codes,
  shifted by one step (a rotation) for previous-token heads.

Every planted direction lies orthogonal to the all-ones vector and LayerNorm weights stay 1 with zero bias, so
TransformerLens' processing (fold LN, centre reading/writing weights) leaves the planted subspaces unchanged:
the truth holds for processing "tl" and "raw" alike.
"""

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from headgraph.errors import UsageError
from headgraph.testing.synthetic import gpt2_config, random_gpt2_state, save_gpt2_folder

WEIGHT_OFFSETS = {"Q": 0, "K": 1, "V": 2}  # block index of each type inside GPT-2's fused c_attn
TRUTH_FILE = "planted.json"
_HEAD = re.compile(r"^L(\d+)H(\d+)$")
_LOGIT_MARGIN = 16.0  # attention-logit gap between the planted key and every other key
_FREQUENCY_CANDIDATES = 512


@dataclass(frozen=True)
class PlantedEdge:
    """Source head's O-subspace aligned with target head's `type` ("Q", "K" or "V") subspace."""

    source: str
    target: str
    type: str
    alpha: float | None = None  # None: the spec's alpha


def _default_edges():
    return (
        PlantedEdge("L0H2", "L1H0", "Q"),
        PlantedEdge("L0H2", "L1H1", "K"),
        PlantedEdge("L0H2", "L2H3", "V"),
        PlantedEdge("L0H3", "L2H1", "Q"),
        PlantedEdge("L1H2", "L2H0", "K"),
    )


@dataclass(frozen=True)
class PlantSpec:
    """What to plant in a synthetic GPT-2 model; the default has hub L0H2 with three out-edges."""

    n_layers: int = 3
    n_heads: int = 4
    d_model: int = 64
    d_head: int = 16
    n_ctx: int = 128
    vocab: int = 512
    seed: int = 0
    alpha: float = 0.9
    edges: tuple[PlantedEdge, ...] = field(default_factory=_default_edges)
    identity_heads: tuple[str, ...] = ("L0H0", "L1H3")
    previous_token_heads: tuple[str, ...] = ("L0H1",)


@dataclass(frozen=True)
class PlantedTruth:
    """Ground truth of a planted model: edges as (source, target, type pair like "OQ", alpha)."""

    edges: tuple[tuple[str, str, str, float], ...]
    hub: str
    identity_heads: tuple[str, ...]
    previous_token_heads: tuple[str, ...]

    def to_dict(self) -> dict:
        return {k: [list(e) for e in v] if k == "edges" else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class PositionCode:
    """Sinusoidal position code in its own residual subspace: wpe[i] = scale · basis @ code(i)."""

    basis: torch.Tensor  # [d_model, 2m], orthonormal, orthogonal to the all-ones vector
    frequencies: torch.Tensor  # [m]
    scale: float


def parse_head(name: str, n_layers: int, n_heads: int) -> tuple[int, int]:
    """(layer, head) of a name "L{layer}H{head}", checked against the model's size."""
    m = _HEAD.match(name)
    if not m or int(m[1]) >= n_layers or int(m[2]) >= n_heads:
        raise UsageError(f"head '{name}' is not L<layer>H<head> within {n_layers} layers x {n_heads} heads")
    return int(m[1]), int(m[2])


def centring_projector(d: int) -> torch.Tensor:
    """I - 11ᵀ/d: removes the all-ones direction that LayerNorm and TransformerLens' centring remove."""
    return torch.eye(d, dtype=torch.float64) - 1.0 / d


def orthonormal(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of the column space of x (full column rank assumed)."""
    return torch.linalg.qr(x).Q


def centred_frame(d: int, g: torch.Generator) -> torch.Tensor:
    """A random orthonormal basis [d, d-1] of the complement of the all-ones vector."""
    return orthonormal(centring_projector(d) @ torch.randn(d, d - 1, generator=g, dtype=torch.float64))


def position_kernel(frequencies: torch.Tensor, lags: torch.Tensor) -> torch.Tensor:
    """code(i)·code(i+lag) for unit-norm sinusoidal codes: the mean of cos(ω·lag) over frequencies."""
    return torch.cos(lags[..., None] * frequencies).mean(-1)


def position_frequencies(m: int, n_ctx: int, g: torch.Generator) -> torch.Tensor:
    """m frequencies whose position kernel has the deepest dip at every non-zero lag below n_ctx."""
    candidates = math.pi * (0.2 + 0.8 * torch.rand(_FREQUENCY_CANDIDATES, m, generator=g, dtype=torch.float64))
    lags = torch.arange(1, n_ctx, dtype=torch.float64)
    worst = torch.cos(lags[None, :, None] * candidates[:, None, :]).mean(-1).amax(-1)
    return candidates[worst.argmin()]


def position_codes(frequencies: torch.Tensor, n_ctx: int) -> torch.Tensor:
    """[n_ctx, 2m] unit-norm codes (cos, sin pairs) of every position."""
    angles = torch.arange(n_ctx, dtype=torch.float64)[:, None] * frequencies
    return torch.stack([angles.cos(), angles.sin()], -1).flatten(1) / math.sqrt(len(frequencies))


def shift_back(frequencies: torch.Tensor) -> torch.Tensor:
    """The block rotation R with R @ code(i) = code(i-1)."""
    c, s = torch.cos(frequencies), torch.sin(frequencies)
    blocks = torch.stack([torch.stack([c, s], -1), torch.stack([-s, c], -1)], -2)  # [m, 2, 2]
    return torch.block_diag(*blocks)


def plant_position_code(state: dict, cfg: dict, g: torch.Generator) -> PositionCode:
    """Rewrite wte/wpe: positions as sinusoids in a d_head-dim subspace, tokens as unit vectors in the rest.

    Both parts have norm sqrt(d_model) (per-coordinate scale 1, far above the GPT-2-scale block outputs), are
    orthogonal to each other and to the all-ones vector, so every layer's LayerNorm sees a fixed position code.
    """
    d, k, n_ctx, vocab = cfg["n_embd"], cfg["n_embd"] // cfg["n_head"], cfg["n_positions"], cfg["vocab_size"]
    frame = centred_frame(d, g)
    basis, token_frame = frame[:, :k], frame[:, k:]
    frequencies = position_frequencies(k // 2, n_ctx, g)
    scale = math.sqrt(d)
    tokens = torch.nn.functional.normalize(torch.randn(vocab, token_frame.shape[1], generator=g, dtype=torch.float64), dim=-1)
    state["transformer.wpe.weight"] = (scale * position_codes(frequencies, n_ctx) @ basis.T).float()
    state["transformer.wte.weight"] = (scale * tokens @ token_frame.T).float()
    return PositionCode(basis=basis, frequencies=frequencies, scale=scale)


def attention_strength(code: PositionCode, cfg: dict) -> float:
    """Scale a of W_Q = a·basis·Rᵀ, W_K = a·basis that puts a `_LOGIT_MARGIN` logit gap below the planted key.

    At layer input, basisᵀ·LN(x_i) = sqrt(d_model/2)·code(i), so the logit of key j is
    a²·(d_model/2)·kernel(lag)/sqrt(d_head), largest at lag 0 by the kernel's dip at every other lag.
    """
    d, k, n_ctx = cfg["n_embd"], cfg["n_embd"] // cfg["n_head"], cfg["n_positions"]
    dip = 1.0 - position_kernel(code.frequencies, torch.arange(1, n_ctx, dtype=torch.float64)).max().item()
    return math.sqrt(_LOGIT_MARGIN * math.sqrt(k) / (d / 2.0 * dip))


def _set_head_slice(state: dict, cfg: dict, layer: int, head: int, weight_type: str, w: torch.Tensor) -> None:
    d, k = cfg["n_embd"], cfg["n_embd"] // cfg["n_head"]
    start = WEIGHT_OFFSETS[weight_type] * d + head * k
    state[f"transformer.h.{layer}.attn.c_attn.weight"][:, start : start + k] = w.float()


def head_slice(state: dict, cfg: dict, layer: int, head: int, weight_type: str) -> torch.Tensor:
    """W_Q/W_K/W_V [d_model, d_head] or W_O [d_head, d_model] of one head, read from GPT-2's fused layout."""
    d, k = cfg["n_embd"], cfg["n_embd"] // cfg["n_head"]
    if weight_type == "O":
        return state[f"transformer.h.{layer}.attn.c_proj.weight"][head * k : (head + 1) * k, :]
    start = WEIGHT_OFFSETS[weight_type] * d + head * k
    return state[f"transformer.h.{layer}.attn.c_attn.weight"][:, start : start + k]


def _plant_query_key(state, cfg, code: PositionCode, layer: int, head: int, shift: int) -> None:
    a = attention_strength(code, cfg)
    rotation = torch.linalg.matrix_power(shift_back(code.frequencies), shift)
    _set_head_slice(state, cfg, layer, head, "Q", a * code.basis @ rotation.T)
    _set_head_slice(state, cfg, layer, head, "K", a * code.basis)


def plant_identity_head(state: dict, cfg: dict, code: PositionCode, layer: int, head: int) -> None:
    """Make head (layer, head) attend to the query token itself: W_Q W_Kᵀ compares position codes."""
    _plant_query_key(state, cfg, code, layer, head, shift=0)


def plant_previous_token_head(state: dict, cfg: dict, code: PositionCode, layer: int, head: int) -> None:
    """Make head (layer, head) attend to position i-1: the query's position code is rotated back one step."""
    _plant_query_key(state, cfg, code, layer, head, shift=1)


def centre_writer(state: dict, cfg: dict, layer: int, head: int) -> torch.Tensor:
    """Remove the all-ones direction from the head's W_O rows (as TL centring would); returns its O basis."""
    k = cfg["n_embd"] // cfg["n_head"]
    w_o = state[f"transformer.h.{layer}.attn.c_proj.weight"]
    rows = slice(head * k, (head + 1) * k)
    w_o[rows] = w_o[rows] - w_o[rows].mean(-1, keepdim=True)
    return orthonormal(w_o[rows].double().T)


def plant_alignment(state: dict, cfg: dict, source: tuple[int, int], target: tuple[int, int], weight_type: str,
                    alpha: float, g: torch.Generator) -> None:
    """Align target's `weight_type` column space with source's O-subspace to degree alpha in [0, 1].

    Target basis = orth(alpha·U_src + (1-alpha)·U_rand), both centred; the target's W keeps its Frobenius norm.
    """
    d, k = cfg["n_embd"], cfg["n_embd"] // cfg["n_head"]
    u_src = centre_writer(state, cfg, *source)
    u_rand = orthonormal(centring_projector(d) @ torch.randn(d, k, generator=g, dtype=torch.float64))
    basis = orthonormal(alpha * u_src + (1.0 - alpha) * u_rand)
    mixing = orthonormal(torch.randn(k, k, generator=g, dtype=torch.float64))
    norm = head_slice(state, cfg, *target, weight_type).norm().item()
    _set_head_slice(state, cfg, *target, weight_type, basis @ mixing * (norm / math.sqrt(k)))


def _validate(spec: PlantSpec) -> None:
    L, H = spec.n_layers, spec.n_heads
    if spec.d_head % 2 or spec.d_model - 1 - spec.d_head < 8:
        raise UsageError("planted models need an even d_head and d_model >= d_head + 9")
    pattern_heads = [parse_head(h, L, H) for h in spec.identity_heads + spec.previous_token_heads]
    if len(set(pattern_heads)) != len(pattern_heads):
        raise UsageError("a head cannot be planted as both identity and previous-token head")
    seen = set()
    for e in spec.edges:
        (ls, _), (lt, ht) = parse_head(e.source, L, H), parse_head(e.target, L, H)
        alpha = spec.alpha if e.alpha is None else e.alpha
        if e.type not in WEIGHT_OFFSETS or not 0.0 <= alpha <= 1.0 or ls >= lt:
            raise UsageError(f"bad planted edge {e}: type Q/K/V, alpha in [0,1], source layer < target layer")
        if (lt, ht, e.type) in seen or (e.type in "QK" and (lt, ht) in pattern_heads):
            raise UsageError(f"planted edge {e} overwrites another planted {e.type} subspace")
        seen.add((lt, ht, e.type))


def plant(spec: PlantSpec) -> tuple[dict, dict, PlantedTruth]:
    """(state dict, config, truth) of a GPT-2 model with the spec's planted structure."""
    _validate(spec)
    cfg = gpt2_config(spec.n_layers, spec.n_heads, spec.d_model, spec.n_ctx, spec.vocab)
    state = random_gpt2_state(spec.n_layers, spec.n_heads, spec.d_model, spec.n_ctx, spec.vocab, spec.seed)
    g = torch.Generator().manual_seed(spec.seed + 1)
    code = plant_position_code(state, cfg, g)
    L, H = spec.n_layers, spec.n_heads
    for name in spec.identity_heads:
        plant_identity_head(state, cfg, code, *parse_head(name, L, H))
    for name in spec.previous_token_heads:
        plant_previous_token_head(state, cfg, code, *parse_head(name, L, H))
    edges = []
    for e in spec.edges:
        alpha = spec.alpha if e.alpha is None else e.alpha
        plant_alignment(state, cfg, parse_head(e.source, L, H), parse_head(e.target, L, H), e.type, alpha, g)
        edges.append((e.source, e.target, "O" + e.type, float(alpha)))
    out_degree = {s: sum(e[0] == s for e in edges) for s, *_ in edges}
    hub = max(out_degree, key=out_degree.get) if edges else ""
    truth = PlantedTruth(tuple(edges), hub, tuple(spec.identity_heads), tuple(spec.previous_token_heads))
    return state, cfg, truth


def save_planted(path, spec: PlantSpec | None = None) -> tuple[Path, PlantedTruth]:
    """Write a planted model as a local HF folder (plus planted.json with the truth); returns (folder, truth)."""
    state, cfg, truth = plant(spec or PlantSpec())
    folder = save_gpt2_folder(path, state, cfg)
    (folder / TRUTH_FILE).write_text(json.dumps(truth.to_dict(), indent=2))
    return folder, truth
