"""The causal stage of `headgraph analyze`: its inputs built first, the local effects of every OQ/OK/OV pair,
the loss effects of the selected edges, and what the run record says of them."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from headgraph.analysis.artifacts import PAIR_KEY
from headgraph.analysis.bootstrap import CONFIDENCE
from headgraph.analysis.causal.inputs import causal_inputs, read_texts
from headgraph.analysis.causal.local import local_effects
from headgraph.analysis.causal.loss import loss_effects
from headgraph.analysis.causal.network import ATTRIBUTION_STEPS
from headgraph.analysis.options import CausalOptions
from headgraph.analysis.prompts import TokenInputs
from headgraph.analysis.stability import spearman
from headgraph.errors import UsageError
from headgraph.heads import COMPOSITION_TYPES

AGREEMENT_RHO = 0.8  # below it on a type, that type's attribution is flagged unreliable
AGREEMENT_SAMPLE = 10  # pairs per type drawn at random, beside the top edges, for the agreement figure
SAMPLE_STREAM = 103  # their random stream beside the seed (the bootstrap is 102)
DEFINITIONS = {
    "local_QK": "mean over inputs and query positions (real queries seeing more than one key) of the total-"
                "variation distance 1/2 sum_k |A_r - A'_r| between r's clean and patched attention rows",
    "local_V": "||out_r' - out_r||_F / ||out_r||_F over the real tokens of all inputs",
    "loss_decoder": "patched minus clean next-token cross-entropy, nats per predicted token "
                    "(positive = the path helps the model)",
    "loss_encoder": "||h' - h||_F / ||h||_F of the final hidden states over the real tokens",
    "patch": "only r's Q/K/V input sees out_s(x') - out_s(x); the norm in front of r is recomputed; "
             "post-LN models carry the change through the LayerNorms up to r, attention and MLP outputs clean; "
             "where a norm acts on the attention output (Gemma 2/3, OLMo-2) s writes ln1_post(a + dz_s W_O[s]) - "
             "ln1_post(a), the other heads clean",
    "receiver": "OQ: r is the query head L{l}H{h}; OK/OV of a grouped- or multi-query model: r is the key/value "
                "head L{l}KV{g} (PK's KV-native pairs), its Q/K effect the attention rows of every query head "
                "that reads it, its V effect over those query heads' outputs (each head's output a block of the "
                "Frobenius norm); the loss effect changes all of their outputs",
    "mechanism": "recompute: headgraph's own scaled dot-product attention from W_Q, W_K, W_V (models it "
                 "reproduces exactly: learned positions, LayerNorm, multi-head); module: the bridge's own "
                 "attention module run on the patched inputs, the other projections held clean (rotary, grouped-"
                 "query, RMSNorm, QK-norm, soft-capping, sliding windows, ALiBi); either is checked against the "
                 "model's own hook_z on every batch",
    "attribution": "effect_attr, decoders: the first-order change of the next-token loss (nats per predicted "
                   "token) that the receiver's exact change causes, sum (A'_r - A_r) . dL/dA_r for Q/K (the exact "
                   "patched attention rows) and sum dz_r . dL/dz_r for V; the gradients are read at "
                   f"{ATTRIBUTION_STEPS + 1} points alpha = k / {ATTRIBUTION_STEPS} of the path from the clean "
                   "to the counterfactual activations (every "
                   "head's z moved together), and each edge, on each input, takes their mean over its own stretch "
                   "[0, c] of that path, c in [0, 1] its change's projection on the receiver's whole "
                   "counterfactual change (output metric): a small change reads the clean gradient, one as large "
                   "as the receiver's counterfactual change the integrated gradient of the whole path; it "
                   "approximates effect_loss, and `agreement` says how well on the edges patched exactly; "
                   "encoders: not computed",
    "interval": f"{CONFIDENCE:.0%} percentile bootstrap over inputs; a loss effect's per-input numerator is "
                "the patched minus clean loss on the same input, so the resampling is paired",
}


def with_effects(pairs: pd.DataFrame, effects: pd.DataFrame) -> pd.DataFrame:
    """`pairs` with the effect columns of `effects` (rows of `local_effects` or `loss_effects`) joined on the
    pair key, NaN for the pairs they do not cover; earlier columns of the same names are replaced."""
    columns = [c for c in effects.columns if c not in PAIR_KEY]
    return pairs.drop(columns=[c for c in columns if c in pairs.columns]).merge(
        effects, on=PAIR_KEY, how="left", validate="many_to_one")


@dataclass(frozen=True)
class CausalStage:
    """The causal stage of `headgraph analyze` on one LoadedModel: its inputs are built first (a bad inputs
    file fails before any PK work), then `local` adds the local effects of every OQ/OK/OV pair to the pairs
    table and `loss` the downstream effects of the selected edges."""

    model: Any
    options: CausalOptions
    inputs: tuple[TokenInputs, ...]
    source: str

    @classmethod
    def prepare(cls, model, options: CausalOptions, seed: int) -> "CausalStage":
        texts = read_texts(options.inputs_file) if options.inputs_file else None
        source = "generated" if texts is None else f"the texts of {options.inputs_file}"
        inputs = causal_inputs(model, options.n_inputs, seed, texts)
        fewest = min(len(s) for s in inputs)
        if options.loss and options.loss_inputs is not None and options.loss_inputs > fewest:
            raise UsageError(f"--causal-loss-inputs {options.loss_inputs} is more than the {fewest} causal inputs of "
                             "a set: give at most that many, or raise --causal-n")
        return cls(model, options, inputs, source)

    def local(self, pairs: pd.DataFrame, types: Sequence[str], seed: int, progress=None
              ) -> tuple[pd.DataFrame, dict[str, Any]]:
        """(pairs with effect / effect_lo / effect_hi, the run record's `causal` entry); raises CausalUnsupported
        for a model whose attention cannot be recomputed."""
        kinds = [t for t in types if t in COMPOSITION_TYPES]
        if not kinds:
            return pairs, {"skipped": f"no {'/'.join(COMPOSITION_TYPES)} type was computed"}
        o = self.options
        local = local_effects(self.model, self.inputs, kinds, o.ablation, n_boot=o.n_boot, seed=seed,
                              batch_size=o.batch_size, max_memory=o.max_memory, progress=progress)
        record = {"types": kinds, "inputs": {s.name: len(s) for s in self.inputs}, "source": self.source,
                  "ablation": o.ablation, "n_boot": o.n_boot, "max_memory": o.max_memory,
                  "loss_edges_per_type": o.loss_edges if o.loss else 0,
                  "agreement_sample": {"per_type": AGREEMENT_SAMPLE, "seed": [seed, SAMPLE_STREAM]} if o.loss else {},
                  "loss_inputs_per_set": {s.name: min(len(s), o.loss_inputs or len(s)) for s in self.inputs}
                  if o.loss else {},
                  "definitions": DEFINITIONS}
        return with_effects(pairs, local), record

    def loss(self, pairs: pd.DataFrame, edges: pd.DataFrame, seed: int, progress=None
             ) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, dict[str, Any]]]:
        """(pairs and edges with effect_loss / _lo / _hi, `agreement` of attribution with them) for the checked
        edges: the selected edges that have a local effect, at most `loss_edges` per type, largest |attribution|
        first (encoders: local effect), and (decoders) AGREEMENT_SAMPLE more pairs per type drawn at random
        (seeded) among the rest, on every input (or the first `loss_inputs` of each set). `agreement` is
        measured on them all: the top edges alone are the ones attribution ranks first, no fair sample of it."""
        o = self.options
        order = "effect_attr" if edges["effect_attr"].notna().any() else "effect"
        chosen = edges[edges["effect"].notna()].sort_values(order, ascending=False, kind="stable", key=abs)
        if o.loss_edges is not None:
            chosen = chosen.groupby(chosen["source_type"] + chosen["target_type"]).head(o.loss_edges)
        sample = agreement_sample(pairs, chosen, seed) if order == "effect_attr" else chosen.iloc[:0]
        checked = pd.concat([chosen[PAIR_KEY], sample[PAIR_KEY]], ignore_index=True)
        inputs = tuple(s.batch(0, min(len(s), o.loss_inputs or len(s))) for s in self.inputs)
        loss = loss_effects(self.model, inputs, checked, o.ablation, n_boot=o.n_boot, seed=seed,
                            batch_size=o.batch_size, max_memory=o.max_memory, progress=progress)
        found = agreement(with_effects(pd.concat([chosen, sample], ignore_index=True), loss))
        for kind, entry in found.items():
            drawn = sample[sample["source_type"] + sample["target_type"] == kind]
            entry["sampled"] = [f"{a}->{b}" for a, b in zip(drawn["source"], drawn["target"])]
        return with_effects(pairs, loss), with_effects(edges, loss), found


def agreement_sample(pairs: pd.DataFrame, chosen: pd.DataFrame, seed: int) -> pd.DataFrame:
    """AGREEMENT_SAMPLE pairs per type with an attribution, drawn uniformly (numpy, seeds [seed,
    SAMPLE_STREAM]) among those not in `chosen`, in the pairs' order."""
    rest = pairs[pairs["effect_attr"].notna()].merge(chosen[PAIR_KEY], on=PAIR_KEY, how="left",
                                                      indicator=True)
    rest = rest[rest["_merge"] == "left_only"].drop(columns="_merge")
    rng = np.random.default_rng([seed, SAMPLE_STREAM])
    kinds = rest["source_type"] + rest["target_type"]
    drawn = [np.sort(rng.choice(np.flatnonzero(kinds.values == kind), min(AGREEMENT_SAMPLE, (kinds == kind).sum()),
                                replace=False)) for kind in dict.fromkeys(kinds)]
    return rest.iloc[np.concatenate(drawn)] if drawn else rest.iloc[:0]


def agreement(checked: pd.DataFrame) -> dict[str, dict[str, float]]:
    """How far attribution agrees with exact patching on the edges both measured, per type: Spearman rho,
    the share of edges whose signs agree, the median and largest absolute error in nats, the number of edges,
    and `reliable` (rho >= AGREEMENT_RHO). Types with fewer than 3 such edges are left out; rho is None where one
    side is constant (a random-init model's exact effects can all be 0), and such a type is not reliable."""
    both = checked.dropna(subset=["effect_attr", "effect_loss"])
    found = {}
    for kind, part in both.groupby(both["source_type"] + both["target_type"]):
        if len(part) < 3:
            continue
        error = (part["effect_attr"] - part["effect_loss"]).abs()
        rho = spearman(part["effect_attr"], part["effect_loss"])
        rho = None if rho is None else round(rho, 12)  # 0.8 is 0.8
        found[kind] = {"edges": len(part), "spearman": rho,
                       "sign_agreement": float((np.sign(part["effect_attr"]) == np.sign(part["effect_loss"])).mean()),
                       "median_abs_error": float(error.median()), "max_abs_error": float(error.max()),
                       "reliable": rho is not None and rho >= AGREEMENT_RHO}
    return found
