"""Planted models: the planted edges, hub, identity and previous-token heads are recoverable after loading.

PK is computed here independently of headgraph's engine, as the sum of squared cosines of scipy's principal
angles, and attention through the bridge's own `hook_pattern`.
"""

import json

import numpy as np
import pytest
import torch
from scipy.linalg import subspace_angles

from headgraph.errors import UsageError
from headgraph.loader.models import load_model
from headgraph.testing.planted import TRUTH_FILE, PlantedEdge, PlantSpec, save_planted


def pk(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((np.cos(subspace_angles(a.double().numpy(), b.double().numpy())) ** 2).sum())


def o_to_qkv_pk(model) -> dict[tuple[str, str, str], float]:
    """PK of every earlier-O -> later-Q/K/V head pair, keyed (source, target, "OQ"|"OK"|"OV")."""
    L, H = model.cfg["n_layers"], model.cfg["n_heads"]
    reads = {"Q": model.W_Q, "K": model.W_K, "V": model.W_V}
    return {
        (f"L{ls}H{hs}", f"L{lt}H{ht}", "O" + t): pk(model.W_O[ls, hs].T, reads[t][lt, ht])
        for ls in range(L) for hs in range(H) for lt in range(ls + 1, L) for ht in range(H) for t in "QKV"
    }


@pytest.fixture(scope="module", params=["tl", "raw"])
def planted_model(request, planted):
    folder, truth = planted
    return load_model(folder, processing=request.param, device="cpu"), truth


def test_planted_edges_have_pk_far_above_all_others(planted_model):
    model, truth = planted_model
    scores = o_to_qkv_pk(model)
    planted_keys = {(s, t, ty) for s, t, ty, _ in truth.edges}
    planted = [scores[k] for k in planted_keys]
    others = np.array([v for k, v in scores.items() if k not in planted_keys])
    k, d = model.cfg["d_head"], model.cfg["d_model"]
    assert len(planted) == 5 and len(others) == len(scores) - 5
    assert min(planted) > 0.9 * k  # alpha 0.9: nearly the same subspace (PK <= d_head)
    assert others.max() < 0.4 * k
    assert abs(others.mean() - k * k / d) < 0.5  # unplanted pairs look like random subspaces: E[PK] = k k'/d


def test_hub_has_the_most_planted_out_edges(planted):
    _, truth = planted
    out_degree = {s: sum(e[0] == s for e in truth.edges) for s, *_ in truth.edges}
    assert truth.hub == "L0H2" and out_degree["L0H2"] == 3 == max(out_degree.values())


def _pattern_mass(model, tokens, head: str, offset: int) -> float:
    layer, index = int(head[1:].split("H")[0]), int(head.split("H")[1])
    _, cache = model.bridge.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    pattern = cache[f"blocks.{layer}.attn.hook_pattern"][:, index]
    return pattern.diagonal(offset=-offset, dim1=-2, dim2=-1).mean().item()


def test_planted_attention_patterns(planted_model):
    model, truth = planted_model
    tokens = torch.randint(0, len(model.tokenizer) - 1, (4, 100), generator=torch.Generator().manual_seed(0))
    for head in truth.identity_heads:
        assert _pattern_mass(model, tokens, head, offset=0) > 0.95
    for head in truth.previous_token_heads:
        assert _pattern_mass(model, tokens, head, offset=1) > 0.95
    for head in ("L1H0", "L2H2"):  # unplanted queries: spread out, no self or previous-token focus
        assert _pattern_mass(model, tokens, head, offset=0) < 0.3
        assert _pattern_mass(model, tokens, head, offset=1) < 0.3


def test_planted_patterns_on_a_prompt(planted_model):
    model, truth = planted_model
    tokens = model.bridge.to_tokens("When Mary and John went to the store, John gave a drink to")
    assert _pattern_mass(model, tokens, truth.identity_heads[0], offset=0) > 0.95
    assert _pattern_mass(model, tokens, truth.previous_token_heads[0], offset=1) > 0.95


def test_alignment_degree_orders_pk(tmp_path):
    edges = (
        PlantedEdge("L0H0", "L1H0", "Q", alpha=1.0),
        PlantedEdge("L0H1", "L1H1", "K", alpha=0.5),
        PlantedEdge("L0H2", "L1H2", "V", alpha=0.2),
        PlantedEdge("L0H3", "L1H3", "V", alpha=0.0),
    )
    spec = PlantSpec(n_layers=2, edges=edges, identity_heads=(), previous_token_heads=(), seed=3)
    folder, _ = save_planted(tmp_path / "graded", spec)
    model = load_model(folder, processing="tl", device="cpu")
    scores = o_to_qkv_pk(model)
    full, half, weak, none = (scores[(e.source, e.target, "O" + e.type)] for e in edges)
    assert full == pytest.approx(16.0, abs=1e-4)  # alpha 1: identical subspaces, PK = d_head
    assert full > half > weak > none
    assert none < 6.0  # alpha 0: a random subspace, E[PK] = 4


def test_truth_file_matches_returned_truth(planted):
    folder, truth = planted
    saved = json.loads((folder / TRUTH_FILE).read_text())
    assert saved["hub"] == truth.hub and [tuple(e) for e in saved["edges"]] == list(truth.edges)
    assert saved["identity_heads"] == list(truth.identity_heads)


@pytest.mark.parametrize(
    "spec",
    [
        PlantSpec(edges=(PlantedEdge("L1H0", "L0H1", "Q"),)),  # backwards
        PlantSpec(edges=(PlantedEdge("L0H2", "L1H0", "O"),)),  # O is not a target type
        PlantSpec(edges=(PlantedEdge("L0H2", "L9H0", "Q"),)),  # no such layer
        PlantSpec(edges=(PlantedEdge("L0H2", "L1H3", "K"),)),  # L1H3's K is the planted identity code
        PlantSpec(edges=(PlantedEdge("L0H2", "L1H0", "Q", alpha=1.5),)),
        PlantSpec(identity_heads=("L0H1",)),  # both identity and previous-token
        PlantSpec(d_head=15, d_model=60),
    ],
)
def test_bad_specs_are_usage_errors(tmp_path, spec):
    with pytest.raises(UsageError):
        save_planted(tmp_path / "bad", spec)
