"""Direct-path patching: does a head's output reach a later head's query, key or value on real inputs?

The package: `inputs` (input sets and counterfactuals), `network` (the model adapter and the batched clean and
corrupted activations), `local` (every pair's local effect), `loss` (the selected edges' downstream effect),
`stage` (the analyze stage and the run record's definitions); the bootstrap is headgraph.analysis.bootstrap,
shared with the evaluation.

PK and the Composition Score read weights only. This module answers the causal question by patching
activations (Wang et al. 2023; Goldowsky-Dill et al. 2023), for sender s (layer l_s) and receiver r
(layer l_r > l_s) along the OQ, OK or OV edge, i.e. r's T input (T = Q, K or V):

- Corrupted input x'. Resample ablation (the default): another input of the same set, drawn (seeded) among
  those at least as long (`resample_inputs`), or the caller's own counterfactuals (`corrupted=`); where x'
  has no token, s stays clean. Mean ablation: s's output averaged over the set's inputs at each position.
- Only r's T input sees Δ_s = out_s(x') − out_s(x), out_s = z_s W_O[s] (TransformerLens `hook_result`):
  pre-LN models (GPT-2): T input = LN(resid_pre[l_r](x) + Δ_s), the LayerNorm recomputed on the patched
  residual. Post-LN models (BERT), whose residual stream is no sum of head outputs: Δ_s enters where s
  writes and passes through the LayerNorms of the layers up to l_r, their attention and MLP outputs clean.
- Local effect (`local_effects`: every OQ/OK/OV pair). T = Q, K: total-variation distance
  ½ Σ_k |A_r − A'_r| between r's clean and patched attention rows, in [0, 1], averaged over inputs and query
  positions (real queries that see more than one key). T = V: ‖out_r' − out_r‖_F / ‖out_r‖_F over the real
  tokens of all inputs.
- Downstream effect (`loss_effects`: given edges). r's patched output replaces its clean one and the rest
  of the model runs on it (layer l_r's MLP and every later layer see the change). Decoder: change of the
  next-token cross-entropy, nats per predicted token; positive = the path helps the model (the loss rises
  when it is ablated). Encoder: ‖h' − h‖_F / ‖h‖_F of the final hidden states (a sentence encoder's MLM
  head may be untrained, so no masked-LM loss).
- Uncertainty: 95 % percentile bootstrap over inputs (seeded). Each effect is a ratio of sums over inputs;
  every bootstrap sample recomputes both sums.

What an effect does NOT mean. It measures the *direct* path s → r.T only: not the total effect of s on r
(paths through the heads and MLPs in between are held clean), not a mediated effect, and not what r does for
the output (the local effect says how far r's attention or output moves; `loss_effects` says whether the
model's predictions care). It depends on the input distribution (IOI prompts, repeated random tokens,
sentence pairs, the user's texts) and on the ablation: a small effect does not rule the path out on other
inputs, and a large one is no proof of a circuit.

Computation: each receiver layer's attention is recomputed from its input with the bridge's weights and
LayerNorm modules (checked against the model's own `hook_z` on every batch; models it cannot reproduce, e.g.
rotary or grouped-query attention, raise UsageError). All senders of one layer × all receivers of one later
layer are one batched tensor operation, no Python loop over head pairs: cost ≈ pairs × tokens × d_model ×
d_head per type (pre-LN models with LayerNorm: pairs × tokens × d_head², the senders' Δz projected through
c(W_O) Γ W, `_FactoredChange`), plus the patched attention rows. `loss_effects` stacks the edges' patched copies
of one input into shared forward passes, each copy joining at its receiver's layer: cost ≈ edges × tokens × the
layers from the receiver's on (and, for a decoder, the unembedding).

>>> import tempfile
>>> from headgraph.analysis.prompts import repeated_token_inputs
>>> from headgraph.loader.models import load_model
>>> from headgraph.testing.synthetic import save_synthetic
>>> model = load_model(save_synthetic(tempfile.mkdtemp()), processing="raw", device="cpu")
>>> inputs = repeated_token_inputs(model.tokenizer, 8, seed=0, length=6)
>>> local = local_effects(model, inputs, n_boot=200)
>>> len(local), local.columns.tolist()  # 4 senders in layer 0 x 4 receivers in layer 1 x 3 types
(48, ['source', 'target', 'source_type', 'target_type', 'effect', 'effect_lo', 'effect_hi', 'effect_attr', 'effect_attr_lo', 'effect_attr_hi'])
>>> bool(((local.effect_lo <= local.effect) & (local.effect <= local.effect_hi)).all())
True
>>> loss = loss_effects(model, inputs, local.head(2), n_boot=200)
>>> loss[["source", "target", "source_type", "target_type"]].values.tolist()
[['L0H0', 'L1H0', 'O', 'Q'], ['L0H0', 'L1H1', 'O', 'Q']]
>>> float(loss_effects(model, inputs, local.head(1), corrupted=inputs).effect_loss.iloc[0])  # x' = x
0.0
"""

from headgraph.analysis.causal.inputs import causal_inputs, read_texts, resample_inputs
from headgraph.analysis.causal.local import LOCAL_COLUMNS, local_effects
from headgraph.analysis.causal.loss import LOSS_COLUMNS, loss_effects
from headgraph.analysis.artifacts import PAIR_KEY
from headgraph.analysis.causal.network import CausalUnsupported
from headgraph.analysis.causal.stage import DEFINITIONS, CausalStage, with_effects

__all__ = ["DEFINITIONS", "PAIR_KEY", "LOCAL_COLUMNS", "LOSS_COLUMNS", "CausalStage", "CausalUnsupported",
           "causal_inputs", "local_effects", "loss_effects", "read_texts", "resample_inputs", "with_effects"]
