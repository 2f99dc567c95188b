"""PK and the causal effects judged on a real trained circuit: the shipped in-context-bigram model induction-2l,
whose layer-0 previous-token head L0H2 (measured from its own attention in its model card, and by
tests/test_induction_model.py) feeds the induction heads L1H0-L1H3 through their keys (K-composition).

Ground truth is the training, not headgraph: the circuit is named by the attention the model learned."""

import pytest

from headgraph.analysis.causal import causal_inputs, local_effects, loss_effects
from headgraph.loader.models import load_model
from headgraph.pipeline import compute_pk

pytestmark = pytest.mark.slow  # PK and causal effects of two trained checkpoints, 8-32 s each at load ~10

CIRCUIT = {("L0H2", f"L1H{h}") for h in range(4)}
KEYS = ["source", "target", "source_type", "target_type"]


def ok_pairs(name):
    model = load_model(name, processing="raw", device="cpu")
    pk = compute_pk(model, types=("OK",), null_heads=20, reference_samples=2000, progress=False).pairs
    inputs = causal_inputs(model, 48, seed=0)
    effects = local_effects(model, inputs, types=("OK",), n_boot=500, seed=0)
    pairs = pk.merge(effects, on=KEYS, validate="one_to_one")
    pairs["circuit"] = [(s, t) in CIRCUIT for s, t in zip(pairs.source, pairs.target)]
    return model, inputs, pairs


@pytest.fixture(scope="module")
def trained():
    return ok_pairs("induction-2l")


def test_the_circuit_edges_have_the_largest_local_effects_with_intervals_clear_of_every_other_source(trained):
    _, _, pairs = trained
    circuit, others = pairs[pairs.circuit], pairs[~pairs.circuit]
    assert len(circuit) == 4 and len(others) == 12
    assert circuit.effect_lo.min() > others.effect_hi.max()
    assert set(zip(*pairs.nlargest(4, "effect")[["source", "target"]].values.T)) == CIRCUIT


def test_pk_ranks_the_circuit_edges_first(trained):
    _, _, pairs = trained
    assert set(zip(*pairs.nlargest(4, "pk")[["source", "target"]].values.T)) == CIRCUIT
    assert pairs[pairs.circuit].pk.min() > 1.5 * pairs[~pairs.circuit].pk.max()


def test_the_circuit_edges_help_the_model(trained):
    model, inputs, pairs = trained
    losses = loss_effects(model, inputs, pairs[pairs.circuit][KEYS], n_boot=500, seed=0)
    assert (losses.effect_loss_lo > 0).all()  # ablating the path raises the next-token loss


def test_before_the_phase_change_no_edge_stands_out():
    _, _, pairs = ok_pairs("induction-2l-step2000")
    circuit, others = pairs[pairs.circuit], pairs[~pairs.circuit]
    assert circuit.effect.min() < others.effect.max()  # the circuit is not there yet ...
    assert pairs.effect.max() < 0.4  # ... and no receiver's keys depend much on one sender
