"""Head roles by hypothesis testing on attention patterns (Pande et al., "The heads hypothesis", AAAI 2021).

Sieve bias score of one head on one input, for query i with sieve S(i) (the keys that fit the role):

    b(i) = N_i * sum_{j in S(i)} a_ij / |S(i)|

where N_i is the number of keys query i can see (real tokens; for causal models only j <= i), so that uniform
attention over the visible keys scores 1, no attention on the sieve 0 and all of it N_i / |S(i)|. A query is
scored when its sieve is neither empty nor all its visible keys (there the score is 1 whatever the head does,
e.g. the BOS query of a causal model). The sentence score is the mean over scored queries. Per head and role
the test is of H0 mean <= tau against H1 mean > tau, decided at alpha after the chosen correction across heads
(none, bh = Benjamini-Hochberg, bonferroni), in one of two designs (RoleOptions.design):

fixed: a one-sided one-sample t-test over all n_inputs inputs of each set (the paper's test).

sequential (the default): inputs are scored batch by batch in the order drawn, and a head stops needing inputs
once its decision is settled; an input set stops when every head of every role on it is settled, else at
n_inputs. The test is by betting (Shafer 2021; Waudby-Smith & Ramdas, JRSS-B 2023): each head's wealth
K_t = prod_i (1 + lambda_i (s_i - tau)), with the bet lambda_i in [0, 1/(2 tau)] chosen from the scores before
input i only (aGRAPA: (mean - tau) / (var + (mean - tau)^2) of the earlier scores, shrunk to tau by one pseudo
input). The generated inputs are independent draws, fed in the order drawn (not sorted by length), and sieve
bias scores are never negative, so under H0 every factor has mean <= 1 given everything before it, and K is a
nonnegative supermartingale: P(K_t >= 1/alpha at any t) <= alpha (Ville's inequality), whatever the score
distribution and however often one looks, and K at any stopping time (one that reads every head's scores
included) is an e-value. `<role>_p` is min(1, 1/K) at the head's last input. The correction acts on these as
on p-values: bh is then e-BH (Wang & Ramdas, JRSS-B 2022), which bounds the false discovery rate by alpha under
any dependence between heads (all heads see the same inputs); bonferroni needs K >= m/alpha. A head is settled
significant once the correction rejects it at the current look, and frozen there: the frozen e-values alone
make the final correction reject it again, whatever the heads still open do. A head is settled below tau once
the one-sided upper confidence sequence of its mean (the normal-mixture boundary of Howard et al., Ann.
Statist. 2021, eq. 14, with the plug-in standard deviation of its scores, from FUTILITY_MIN_INPUTS scored
inputs on) lies below tau; it is frozen too. That boundary is only asymptotically valid (scores mostly near 0
with rare large values can look settled too early), and an error of it can only cost power (a head with a role
stopped too early), never a false role: the rejections rest on the e-values alone. Why not a group-sequential
t-test with alpha spending: it needs normal scores and a schedule of looks fixed in advance, and BH on its
p-values needs a dependence condition across heads that shared inputs do not promise.

What a stopped decision does not mean: settled below tau says the confidence sequence left out a mean above
tau on these inputs (asymptotically, at alpha), not that the head never does the role; settled significant says
the mean exceeds tau, not by how much, and its `<role>_score` is the mean over the (possibly few) inputs that
head used. The sequential p-values are larger than the t-test's on the same scores (the price of looking after
every batch), so a head just above tau may be flagged by the fixed design and left open at n_inputs, hence not
significant, by the sequential one (all-MiniLM-L6-v2, 200 inputs: 165 of the fixed design's 172 role decisions,
no other).

Columns of the heads table: head, layer, index; per role `<role>_score` (mean sieve bias over the inputs the
head's test used), `<role>_p` (uncorrected one-sided p-value), `<role>_sig` (decision after the correction). The
identity role is the exception: `identity_score` is the PK paper's identity-head score (mean attention of a query
on itself over the IOI prompts the set used, with BOS, the BOS query excluded) and its mean sieve bias is
`identity_bias`.
"""

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy import stats

from headgraph.analysis.artifacts import head_index, role_names
from headgraph.analysis.patterns import capture_patterns, iter_patterns
from headgraph.analysis.prompts import (
    KIND_A, KIND_B, KIND_CLS, KIND_SEP, RELATIONS, TokenInputs, ioi_inputs, missing_pair_tokens,
    repeated_token_inputs, sentence_pair_inputs,
)
from headgraph.analysis.options import Correction, RoleOptions, check_seed
from headgraph.analysis.significance import benjamini_hochberg
from headgraph.errors import ModelUnavailable, check_choice

LOCAL_WINDOW = 2
REPEAT_LENGTH = 20
BET_CAP = 0.5  # a bet stakes at most half the wealth on one input: lambda <= BET_CAP / tau
FUTILITY_MIN_INPUTS = 32  # scored inputs before the upper confidence sequence (plug-in sd) may settle a head
OPEN, SIGNIFICANT, BELOW_TAU = 0, 1, -1  # SequentialTest.state

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


def visible_keys(inputs: TokenInputs, is_decoder: bool) -> torch.Tensor:
    """bool [batch, query, key]: both tokens real, and for causal models key <= query."""
    real = inputs.attention_mask.bool()
    visible = real[:, :, None] & real[:, None, :]
    if is_decoder:
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


def adjust_pvalues(p: np.ndarray, correction: Correction) -> np.ndarray:
    """p-values adjusted across the last axis: none, bh (Benjamini-Hochberg) or bonferroni."""
    check_choice(correction, Correction, "correction")
    if correction == "none":
        return p
    if correction == "bh":
        return benjamini_hochberg(p, axis=-1)
    return np.minimum(p * p.shape[-1], 1.0)  # bonferroni


def ttest_scores(scores: np.ndarray, tau: float = RoleOptions.tau, alpha: float = RoleOptions.alpha,
                 correction: Correction = RoleOptions.correction) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def normal_mixture_rho(alpha: float, v: float) -> float:
    """The mixture precision rho that makes the normal-mixture boundary tightest at intrinsic time v."""
    rho = np.geomspace(v / 1000, v * 1000, 2001)
    return float(rho[np.argmin(normal_mixture_boundary(v, alpha, rho))])


def normal_mixture_boundary(v, alpha: float, rho):
    """One-sided normal-mixture boundary u(v) = sqrt(2 (v + rho) log(sqrt((v + rho) / rho) / (2 alpha) + 1))
    (Howard et al. 2021, eq. 14): P(S_t >= u(V_t) for some t) <= alpha for a 1-sub-Gaussian sum S_t of
    variance process V_t; here V_t is the count of standardised scores."""
    v = np.asarray(v, dtype=float)
    return np.sqrt(2 * (v + rho) * np.log(np.sqrt((v + rho) / rho) / (2 * alpha) + 1))


class SequentialTest:
    """The sequential design's state for one role over m heads (see the module docstring): feed score batches
    [inputs, m] in the order the inputs were drawn with `add`; NaN scores (no scored query) are no input.

    Heads settle after each batch and are frozen there (their later scores are ignored); `settled` says when
    all are. `result` gives (mean, p, significant) per head, `seen` the inputs each head's test used.
    """

    def __init__(self, n_heads: int, tau: float = RoleOptions.tau, alpha: float = RoleOptions.alpha,
                 correction: Correction = RoleOptions.correction,
                 first_look: int = 32):
        self.tau, self.alpha, self.correction = tau, alpha, correction
        self.rho = normal_mixture_rho(alpha, max(first_look, FUTILITY_MIN_INPUTS))
        self.count = np.zeros(n_heads)  # scored inputs
        self.total = np.zeros(n_heads)  # sum of scores
        self.squares = np.zeros(n_heads)  # sum of squared scores
        self.log_wealth = np.zeros(n_heads)
        self.state = np.full(n_heads, OPEN, dtype=np.int8)
        self.seen = np.zeros(n_heads, dtype=np.int64)

    @property
    def settled(self) -> bool:
        return bool((self.state != OPEN).all())

    def add(self, scores: np.ndarray) -> None:
        """One batch of scores [inputs, m]: every open head bets on each input in turn, then the heads settle."""
        tau, live = self.tau, self.state == OPEN
        x = scores[:, live]
        valid = ~np.isnan(x)
        x = np.where(valid, x, 0.0)
        count = self.count[live] + np.cumsum(valid, 0)  # up to and including each input
        total = self.total[live] + np.cumsum(x, 0)
        squares = self.squares[live] + np.cumsum(x * x, 0)
        before = count - valid, total - x, squares - x * x  # what the bet on each input may know
        mean = (tau + before[1]) / (before[0] + 1)  # shrunk to tau by one pseudo input of variance tau^2
        spread = np.maximum(before[2] - before[1] ** 2 / np.maximum(before[0], 1), 0)
        var = (tau * tau + spread) / (before[0] + 1)
        bet = np.clip((mean - tau) / (var + (mean - tau) ** 2), 0, BET_CAP / tau)
        self.log_wealth[live] += np.where(valid, np.log1p(bet * (x - tau)), 0).sum(0)
        self.count[live], self.total[live], self.squares[live] = count[-1], total[-1], squares[-1]
        self.seen[live] += len(scores)
        self._settle(live)

    def p_values(self) -> np.ndarray:
        """min(1, 1/K): anytime-valid one-sided p-values of the heads' current (or frozen) wealth."""
        return np.minimum(1.0, np.exp(-self.log_wealth))

    def _settle(self, live: np.ndarray) -> None:
        rejected = adjust_pvalues(self.p_values(), self.correction) <= self.alpha
        n = self.count
        with np.errstate(invalid="ignore", divide="ignore"):  # heads with fewer than 2 scores: NaN, not below
            mean = self.total / n
            sd = np.sqrt(np.maximum(self.squares - self.total * mean, 0) / (n - 1))
            upper = mean + sd * normal_mixture_boundary(n, self.alpha, self.rho) / n
        below = (n >= FUTILITY_MIN_INPUTS) & (upper < self.tau)
        self.state[live & rejected] = SIGNIFICANT
        self.state[live & ~rejected & below] = BELOW_TAU

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean score, p, significant after the correction at alpha) per head; a head without any scored
        input has mean NaN and p = 1."""
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = self.total / self.count
        p = self.p_values()
        return mean, p, adjust_pvalues(p, self.correction) <= self.alpha

    def counts(self) -> dict[str, int]:
        """How the heads ended: settled significant, settled below tau, or open at the last input."""
        return {name: int((self.state == state).sum())
                for name, state in (("significant", SIGNIFICANT), ("below_tau", BELOW_TAU), ("open", OPEN))}


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


def _batch_scores(roles: tuple[Role, ...], batch: TokenInputs, patterns: torch.Tensor, is_decoder: bool
                  ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per role, the batch's scores [inputs, layer*head]; and its self-attention [inputs, layer*head]."""
    patterns = patterns.float()
    visible = visible_keys(batch, is_decoder)
    scores = {role.name: sieve_scores(patterns, role_sieve(role, batch, visible), visible, role.entropy_weighted)
              .flatten(1).cpu().double().numpy() for role in roles}
    return scores, self_attention(patterns, visible).flatten(1).cpu().double().numpy()


def _fixed_tests(model, roles: tuple[Role, ...], inputs: TokenInputs, is_decoder: bool, options: RoleOptions,
                 advance: Callable[[], None]) -> tuple[dict, np.ndarray, int, None]:
    """The fixed design on one input set: every input scored, then a t-test per head and role."""
    parts, selfatt = [], []
    for batch, patterns in iter_patterns(model.bridge, inputs.by_length(), options.batch_size):  # order is free
        scores, att = _batch_scores(roles, batch, patterns, is_decoder)
        parts.append(scores)
        selfatt.append(att)
        advance()
    results = {role.name: ttest_scores(np.concatenate([part[role.name] for part in parts]), options.tau,
                                       options.alpha, options.correction) for role in roles}
    return results, np.concatenate(selfatt).mean(axis=0), len(inputs), None


def _sequential_tests(model, roles: tuple[Role, ...], inputs: TokenInputs, is_decoder: bool, options: RoleOptions,
                      advance: Callable[[], None]) -> tuple[dict, np.ndarray, int, dict]:
    """The sequential design on one input set: batches in the order drawn until every head is settled."""
    heads = model.cfg["n_layers"] * model.cfg["n_heads"]
    tests = {role.name: SequentialTest(heads, options.tau, options.alpha, options.correction, options.batch_size)
             for role in roles}
    selfatt, used = [], 0
    while used < len(inputs) and not all(test.settled for test in tests.values()):
        batch = inputs.batch(used, min(used + options.batch_size, len(inputs)))
        scores, att = _batch_scores(roles, batch, capture_patterns(model.bridge, batch), is_decoder)
        for name, test in tests.items():
            test.add(scores[name])
        selfatt.append(att)
        used += len(batch)
        advance()
    return ({name: test.result() for name, test in tests.items()}, np.concatenate(selfatt).mean(axis=0), used,
            {name: test.counts() for name, test in tests.items()})


def check_tokenizer(model) -> dict[str, str]:
    """The roles the LoadedModel's tokenizer cannot test, each with why: an encoder's "cls" / "sep" when its
    sentence pairs have no such token, and "delimiter" when they have neither. ModelUnavailable when it cannot
    make the role tests' inputs (text) at all: no tokenizer (a folder without tokenizer files still loads and
    analyzes with --no-roles), or token ids, BOS included, beyond the model's vocabulary (a tokenizer not the
    model's, or one without a BOS or EOS token, to which TransformerLens adds an `<|endoftext|>` of its own)."""
    tokenizer, source, vocab = model.tokenizer, model.source, int(model.bridge.cfg.d_vocab)
    if tokenizer is None or not tokenizer.vocab_size:
        raise ModelUnavailable(f"'{source}' has no tokenizer files (tokenizer.json, or e.g. vocab.json + "
                               "merges.txt), which the role tests need: add them, or analyze with --no-roles")
    decoder = bool(model.cfg["is_decoder"])
    for name in input_set_names(decoder):
        ids = input_set(model, name, 2, 0).input_ids
        if int(ids.max()) >= vocab:
            bos = f" (its BOS {tokenizer.bos_token!r} is id {int(ids[0, 0])})" if decoder else ""
            raise ModelUnavailable(f"the tokenizer of '{source}' gives token ids up to {int(ids.max())}{bos}, beyond "
                                   f"the model's {vocab} tokens: it is not this model's tokenizer, or lacks a BOS/EOS "
                                   "token of the model's own; fix its tokenizer files, or analyze with --no-roles")
    if decoder:
        return {}
    skipped = missing_pair_tokens(tokenizer)
    if len(skipped) == 2:
        skipped["delimiter"] = "the tokenizer's sentence pairs contain neither a cls_token nor a sep_token"
    return skipped


def compute_roles(model, seed: int = 0, progress=None, **settings) -> tuple[pd.DataFrame, dict]:
    """Roles of every head of a LoadedModel: the heads table (one row per head) and a meta dict.

    `settings` are RoleOptions fields (n_inputs, tau, alpha, correction, batch_size, design). Decoder roles
    (model.cfg["is_decoder"]): identity, previous_token, bos on IOI prompts; duplicate_token, induction on
    repeated random tokens. Encoder roles on sentence pairs: identity, local, delimiter, cls, sep, block,
    block_entropy, syntactic_{nsubj,dobj,amod,advmod}, syntactic. `progress` is an optional
    rich.progress.Progress that gets one task advanced per batch. meta["inputs"][set]["n"] is the inputs each
    set used (sequential: at most n_inputs), meta["settled"] (sequential) how each role's heads ended,
    meta["skipped_roles"] the roles the tokenizer cannot test and why (check_tokenizer). A role
    flagged here is a statistical statement about attention on generated inputs, not a claim about what the head
    does for the model's output.
    """
    options, seed = RoleOptions(**settings), check_seed(seed)
    skipped = check_tokenizer(model)
    is_decoder = bool(model.cfg["is_decoder"])
    roles = tuple(r for r in (DECODER_ROLES if is_decoder else ENCODER_ROLES) if r.name not in skipped)
    inputs = {name: input_set(model, name, options.n_inputs, seed) for name in input_set_names(is_decoder)}
    batches = {name: -(-len(x) // options.batch_size) for name, x in inputs.items()}
    task = None
    if progress is not None:
        task = progress.add_task("role patterns", total=sum(batches.values()))

    def advance():
        if progress is not None:
            progress.advance(task)

    tests = _sequential_tests if options.design == "sequential" else _fixed_tests
    results, used, settled, selfatt = {}, {}, {}, None
    for name, x in inputs.items():
        got, att, used[name], counts = tests(model, tuple(r for r in roles if r.inputs == name), x, is_decoder, options,
                                             advance)
        results.update(got)
        settled.update(counts or {})
        if name == roles[0].inputs:
            selfatt = att
        batches[name] = -(-used[name] // options.batch_size)
        if progress is not None:
            progress.update(task, total=sum(batches.values()))
    n_layers, n_heads = model.cfg["n_layers"], model.cfg["n_heads"]
    table = {**head_index(n_layers, n_heads), "identity_score": selfatt}
    for role in roles:
        mean, p, sig = results[role.name]
        table["identity_bias" if role.name == "identity" else f"{role.name}_score"] = mean
        table[f"{role.name}_p"] = p
        table[f"{role.name}_sig"] = sig
    across = f"at alpha after correction '{options.correction}' across the {n_layers * n_heads} heads"
    tests_text = {
        "fixed": "one-sided one-sample t-test per head and role over inputs (scipy.stats.ttest_1samp, "
                 "alternative='greater') of the sieve bias score against tau; <role>_p uncorrected, "
                 f"<role>_sig {across}",
        "sequential": f"sequential test by betting per head and role on batches of {options.batch_size} inputs in the "
                      f"order drawn, until every head of a set is settled or {options.n_inputs} inputs: wealth "
                      f"prod(1 + lambda (score - tau)), lambda in [0, {BET_CAP}/tau] from the earlier scores (aGRAPA); "
                      "<role>_p = min(1, 1/wealth), anytime-valid, uncorrected; <role>_sig on these p-values "
                      f"(bh: e-BH) {across}. A head settles once the correction rejects it, or once the one-sided "
                      "normal-mixture upper confidence sequence of its mean (plug-in sd, from "
                      f"{FUTILITY_MIN_INPUTS} scored inputs) is below tau; its score, p and decision are those "
                      "of the inputs up to then; inputs.n is the inputs each set used",
    }
    meta = {
        "model_kind": "decoder" if is_decoder else "encoder",
        "roles": [role.name for role in roles],
        "role_inputs": {role.name: role.inputs for role in roles},
        "inputs": {name: {"n": used[name], "n_inputs": options.n_inputs, "seed": seed} for name in inputs},
        "design": options.design, "n_inputs": options.n_inputs, "tau": options.tau, "alpha": options.alpha,
        "correction": options.correction, "batch_size": options.batch_size,
        "test": tests_text[options.design],
        "score": "b(i) = N_i * attention mass on the sieve / |sieve|, N_i = keys visible to query i; "
                 "mean over queries whose sieve is neither empty nor all visible keys",
        "identity_score": f"mean attention of a query on itself over the {roles[0].inputs} inputs the set used "
                          "(queries that see more than one key; the BOS query of a causal model excluded)",
    }
    if settled:
        meta["settled"] = settled
    if skipped:
        meta["skipped_roles"] = skipped
    if not is_decoder:
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
