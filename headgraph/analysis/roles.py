"""Head roles by hypothesis testing on attention patterns (Pande et al., "The heads hypothesis", AAAI 2021).

Sieve bias score of one head on one input, for query i with sieve S(i) (the keys that fit the role):

    b(i) = N_i * sum_{j in S(i)} a_ij / |S(i)|

where N_i is the number of keys query i can see (real tokens; for causal models only j <= i), so that uniform
attention over the visible keys scores 1, no attention on the sieve 0 and all of it N_i / |S(i)|. A query is
scored when its sieve is neither empty nor all its visible keys (there the score is 1 whatever the head does,
e.g. the BOS query of a causal model). The sentence score is the mean over scored queries. Per head and role,
a one-sided one-sample t-test over inputs of H0 mean <= tau against H1 mean > tau gives a p-value; the decision
is taken at alpha after the chosen correction across heads (none, bh = Benjamini-Hochberg, bonferroni).

Columns of the heads table: head, layer, index; per role `<role>_score` (mean sieve bias over inputs),
`<role>_p` (uncorrected one-sided p-value), `<role>_sig` (decision after the correction). The identity role is
the exception: `identity_score` is the PK paper's identity-head score (mean attention of a query on itself over
IOI prompts with BOS, the BOS query excluded) and its mean sieve bias is `identity_bias`.
"""

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy import stats

from headgraph.analysis.artifacts import head_index, role_names
from headgraph.analysis.patterns import iter_patterns
from headgraph.analysis.prompts import (
    KIND_A, KIND_B, KIND_CLS, KIND_SEP, RELATIONS, TokenInputs, ioi_inputs, repeated_token_inputs,
    sentence_pair_inputs,
)
from headgraph.analysis.options import CORRECTIONS, RoleOptions
from headgraph.analysis.significance import benjamini_hochberg
from headgraph.errors import ModelUnavailable, UsageError

LOCAL_WINDOW = 2
REPEAT_LENGTH = 20

Sieve = Callable[[TokenInputs, torch.Tensor, torch.Tensor], torch.Tensor]


def _identity(x, q, k):
    return q == k


def _previous_token(x, q, k):
    return k == q - 1


def _bos(x, q, k):
    return k == 0


def _duplicate_token(x, q, k):
    ids = x.input_ids
    return (ids[:, :, None] == ids[:, None, :]) & (k < q)


def _induction(x, q, k):
    ids = x.input_ids
    before = torch.cat([torch.full_like(ids[:, :1], -1), ids[:, :-1]], dim=1)  # before[:, j] = ids[:, j-1]
    return (ids[:, :, None] == before[:, None, :]) & (k < q)


def _local(x, q, k):
    return (q - k).abs() <= LOCAL_WINDOW


def _key_kind(*kinds):
    def sieve(x, q, k):
        return torch.isin(x.token_kind, torch.tensor(kinds))[:, None, :]
    return sieve


def _block(x, q, k):
    kind = x.token_kind
    content = (kind == KIND_A) | (kind == KIND_B)
    return (kind[:, :, None] == kind[:, None, :]) & content[:, :, None]


def _relation(*relations):
    def sieve(x, q, k):
        return torch.stack([x.arcs[r] for r in relations]).any(0)
    return sieve


@dataclass(frozen=True)
class Role:
    """A role: its name, the input set its test runs on, its sieve, and whether scores are entropy-weighted."""

    name: str
    inputs: str
    sieve: Sieve
    entropy_weighted: bool = False


DECODER_ROLES = (
    Role("identity", "ioi", _identity),
    Role("previous_token", "ioi", _previous_token),
    Role("bos", "ioi", _bos),
    Role("duplicate_token", "repeated_tokens", _duplicate_token),
    Role("induction", "repeated_tokens", _induction),
)
ENCODER_ROLES = (
    Role("identity", "sentence_pairs", _identity),
    Role("local", "sentence_pairs", _local),
    Role("delimiter", "sentence_pairs", _key_kind(KIND_CLS, KIND_SEP)),
    Role("cls", "sentence_pairs", _key_kind(KIND_CLS)),
    Role("sep", "sentence_pairs", _key_kind(KIND_SEP)),
    Role("block", "sentence_pairs", _block),
    Role("block_entropy", "sentence_pairs", _block, entropy_weighted=True),
    *(Role(f"syntactic_{r}", "sentence_pairs", _relation(r)) for r in RELATIONS),
    Role("syntactic", "sentence_pairs", _relation(*RELATIONS)),
)


def visible_keys(inputs: TokenInputs, causal: bool) -> torch.Tensor:
    """bool [batch, query, key]: both tokens real, and for causal models key <= query."""
    real = inputs.attention_mask.bool()
    visible = real[:, :, None] & real[:, None, :]
    if causal:
        visible = visible & torch.ones(visible.shape[1:], dtype=torch.bool).tril()
    return visible


def role_sieve(role: Role, inputs: TokenInputs, visible: torch.Tensor) -> torch.Tensor:
    """bool [batch, query, key]: the role's sieve (broadcast from what it depends on) restricted to visible keys."""
    pos = torch.arange(visible.shape[1])
    return role.sieve(inputs, pos[:, None], pos[None, :]) & visible


def sieve_scores(patterns: torch.Tensor, sieve: torch.Tensor, visible: torch.Tensor,
                 entropy_weighted: bool = False) -> torch.Tensor:
    """Sentence scores [batch, layer, head]: the mean over scored queries of N_i * mass on S(i) / |S(i)|.

    patterns [batch, layer, head, query, key]; sieve, visible bool [batch, query, key]. With
    entropy_weighted, each query's score is multiplied by the entropy (nats) of its attention row.
    NaN for an input without any scored query.
    """
    sieve = sieve.to(patterns.device)
    visible = visible.to(patterns.device)
    n_keys = visible.sum(-1).to(patterns.dtype)
    size = sieve.sum(-1).to(patterns.dtype)
    scored = (size > 0) & (size < n_keys)
    mass = torch.einsum("blhqk,bqk->blhq", patterns, sieve.to(patterns.dtype))
    token = n_keys[:, None, None, :] * mass / size.clamp(min=1)[:, None, None, :]
    if entropy_weighted:
        rows = patterns * visible[:, None, None].to(patterns.dtype)
        token = token * -torch.special.xlogy(rows, rows).sum(-1)
    weight = scored[:, None, None, :].to(patterns.dtype)
    return (token * weight).sum(-1) / weight.sum(-1)


def self_attention(patterns: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """[batch, layer, head]: mean attention of a query on itself over queries that see more than one key."""
    visible = visible.to(patterns.device)
    queries = (visible.sum(-1) > 1).to(patterns.dtype)
    diagonal = patterns.diagonal(dim1=-2, dim2=-1)
    return (diagonal * queries[:, None, None, :]).sum(-1) / queries.sum(-1)[:, None, None]


def adjust_pvalues(p: np.ndarray, correction: str) -> np.ndarray:
    """p-values adjusted across the last axis: none, bh (Benjamini-Hochberg) or bonferroni."""
    if correction == "none":
        return p
    if correction == "bh":
        return benjamini_hochberg(p, axis=-1)
    if correction == "bonferroni":
        return np.minimum(p * p.shape[-1], 1.0)
    raise UsageError(f"unknown correction {correction!r}: use one of {', '.join(CORRECTIONS)}")


def ttest_scores(scores: np.ndarray, tau: float = 3.0, alpha: float = 0.05, correction: str = "bh"
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, p, significant) per column of scores [inputs, heads]: t-test of mean > tau, decision at alpha.

    NaN scores (inputs without a scored query) are left out; a head whose p-value is undefined (too few
    scores, or all equal to tau) gets p = 1.
    """
    mean = np.nanmean(scores, axis=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Precision loss", RuntimeWarning)  # constant scores: handled below
        p = stats.ttest_1samp(scores, tau, axis=0, alternative="greater", nan_policy="omit").pvalue
    p = np.where(np.isnan(p), 1.0, np.asarray(p, dtype=float))
    return mean, p, adjust_pvalues(p, correction) < alpha


def input_set_names(decoder: bool) -> list[str]:
    """The generated input sets the role tests of a decoder (or an encoder) run on, in order."""
    return list(dict.fromkeys(role.inputs for role in (DECODER_ROLES if decoder else ENCODER_ROLES)))


def input_set(model, name: str, n: int, seed: int) -> TokenInputs:
    """The generated input set `name` (of `input_set_names`) of a LoadedModel, n inputs (the causal stage
    patches on the same sets)."""
    if name == "ioi":
        return ioi_inputs(model.tokenizer, n, seed)
    if name == "repeated_tokens":
        return repeated_token_inputs(model.tokenizer, n, seed, REPEAT_LENGTH, model.bridge.cfg.d_vocab)
    return sentence_pair_inputs(model.tokenizer, n, seed)


def _scores_on(model, roles: tuple[Role, ...], inputs: TokenInputs, causal: bool, batch_size: int,
               advance: Callable[[], None]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per role, scores [inputs, layer*head]; and self-attention [inputs, layer*head] on the same inputs."""
    parts = {role.name: [] for role in roles}
    selfatt = []
    for batch, patterns in iter_patterns(model.bridge, inputs.by_length(), batch_size):  # the scores' order is free
        patterns = patterns.float()
        visible = visible_keys(batch, causal)
        for role in roles:
            s = sieve_scores(patterns, role_sieve(role, batch, visible), visible, role.entropy_weighted)
            parts[role.name].append(s.flatten(1).cpu())
        selfatt.append(self_attention(patterns, visible).flatten(1).cpu())
        advance()
    return ({name: torch.cat(p).double().numpy() for name, p in parts.items()},
            torch.cat(selfatt).double().numpy())


def check_tokenizer(model) -> None:
    """ModelUnavailable unless the LoadedModel has a tokenizer with a vocabulary: the role tests' inputs are
    text. A folder without tokenizer files still loads (its tokenizer is empty) and analyzes with --no-roles."""
    if model.tokenizer is None or not model.tokenizer.vocab_size:
        raise ModelUnavailable(f"'{model.source}' has no tokenizer files (tokenizer.json, or e.g. vocab.json + "
                               "merges.txt), which the role tests need: add them, or analyze with --no-roles")


def compute_roles(model, seed: int = 0, progress=None, **settings) -> tuple[pd.DataFrame, dict]:
    """Roles of every head of a LoadedModel: the heads table (one row per head) and a meta dict.

    `settings` are RoleOptions fields (n_inputs, tau, alpha, correction, batch_size). Decoder roles
    (model.cfg["is_decoder"]): identity, previous_token, bos on IOI prompts; duplicate_token, induction on
    repeated random tokens. Encoder roles on sentence pairs: identity, local, delimiter, cls, sep, block,
    block_entropy, syntactic_{nsubj,dobj,amod,advmod}, syntactic. `progress` is an optional
    rich.progress.Progress that gets one task advanced per batch. A role flagged here is a statistical
    statement about attention on generated inputs, not a claim about what the head does for the model's output.
    """
    options = RoleOptions(**settings)
    n_inputs, tau, alpha, correction, batch_size = (options.n_inputs, options.tau, options.alpha, options.correction,
                                                    options.batch_size)
    check_tokenizer(model)
    causal = bool(model.cfg["is_decoder"])
    roles = DECODER_ROLES if causal else ENCODER_ROLES
    inputs = {name: input_set(model, name, n_inputs, seed) for name in input_set_names(causal)}
    task = None
    if progress is not None:
        task = progress.add_task("role patterns", total=sum(-(-len(x) // batch_size) for x in inputs.values()))

    def advance():
        if progress is not None:
            progress.advance(task)

    scores, selfatt = {}, None
    for name in inputs:
        got, att = _scores_on(model, tuple(r for r in roles if r.inputs == name), inputs[name], causal,
                              batch_size, advance)
        scores.update(got)
        if name == roles[0].inputs:
            selfatt = att
    n_layers, n_heads = model.cfg["n_layers"], model.cfg["n_heads"]
    table = {**head_index(n_layers, n_heads), "identity_score": selfatt.mean(axis=0)}
    for role in roles:
        mean, p, sig = ttest_scores(scores[role.name], tau, alpha, correction)
        table["identity_bias" if role.name == "identity" else f"{role.name}_score"] = mean
        table[f"{role.name}_p"] = p
        table[f"{role.name}_sig"] = sig
    meta = {
        "model_kind": "decoder" if causal else "encoder",
        "roles": [role.name for role in roles],
        "role_inputs": {role.name: role.inputs for role in roles},
        "inputs": {name: {"n": len(x), "seed": seed} for name, x in inputs.items()},
        "n_inputs": n_inputs, "tau": tau, "alpha": alpha, "correction": correction,
        "test": "one-sided one-sample t-test per head and role over inputs (scipy.stats.ttest_1samp, "
                "alternative='greater') of the sieve bias score against tau; <role>_p uncorrected, "
                f"<role>_sig at alpha after correction '{correction}' across the {n_layers * n_heads} heads",
        "score": "b(i) = N_i * attention mass on the sieve / |sieve|, N_i = keys visible to query i; "
                 "mean over queries whose sieve is neither empty nor all visible keys",
        "identity_score": f"mean attention of a query on itself over the {roles[0].inputs} inputs "
                          "(queries that see more than one key; the BOS query of a causal model excluded)",
    }
    if not causal:
        meta["block_variants"] = {"block": "plain sieve bias ratio",
                                  "block_entropy": "ratio times the attention row's entropy in nats "
                                                   "(Pande et al.'s notebooks)"}
        meta["local_window"] = LOCAL_WINDOW
    else:
        meta["repeat_length"] = REPEAT_LENGTH
    return pd.DataFrame(table), meta


def identity_map(heads: pd.DataFrame) -> np.ndarray:
    """The identity score as a [layer, head] array."""
    out = np.full((heads["layer"].max() + 1, heads["index"].max() + 1), np.nan)
    out[heads["layer"].to_numpy(), heads["index"].to_numpy()] = heads["identity_score"].to_numpy()
    return out


def role_table(heads: pd.DataFrame) -> pd.DataFrame:
    """Number of heads holding each role, per layer (rows) and role (columns), with a total row."""
    roles = role_names(heads)
    counts = heads.groupby("layer")[[f"{r}_sig" for r in roles]].sum().astype(int)
    counts.columns = roles
    counts.loc["total"] = counts.sum()
    return counts
