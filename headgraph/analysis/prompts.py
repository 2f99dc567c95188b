"""Inputs for role tests, generated in code from a seed (no download).

Three input sets, each returned as a `TokenInputs` (right-padded token tensors plus what the sieves need):

- `ioi_inputs`: indirect-object-identification prompts from templates ("When Mary and John went to the store,
  John gave a drink to"), BOS first, as in the PK paper's identity-head score.
- `repeated_token_inputs`: BOS, then a random token sequence, then the same sequence again (induction,
  previous-token and duplicate-token heads).
- `sentence_pair_inputs`: `[CLS] A [SEP] B [SEP]` pairs of sentences from a small grammar whose dependency arcs
  (nsubj, dobj, amod, advmod) are known by construction, aligned to word pieces by character offsets. The
  delimiters are the tokenizer's own: a tokenizer whose pairs have no CLS or SEP token yields pairs without them
  (`missing_pair_tokens` says which).
"""

from dataclasses import dataclass, replace

import numpy as np
import torch

from headgraph.errors import UsageError

# token_kind codes of `TokenInputs.token_kind` (sentence pairs); KIND_SPECIAL: a token the tokenizer adds that is
# neither its CLS (first) nor its SEP token, e.g. a BOS a generic pair template puts between the segments
KIND_PAD, KIND_A, KIND_B, KIND_CLS, KIND_SEP, KIND_SPECIAL = 0, 1, 2, 3, 4, 5
RELATIONS = ("nsubj", "dobj", "amod", "advmod")

NAMES = (
    "Mary", "John", "Alice", "Bob", "Tom", "James", "Sarah", "Michael", "David", "Paul", "Lisa", "Anna",
    "Kevin", "Laura", "Mark", "Emma", "Daniel", "Rachel", "Steven", "Jessica", "Peter", "Kate", "Robert", "Linda",
)
PLACES = (
    "store", "park", "school", "station", "hospital", "restaurant", "office", "garden", "market", "library",
    "beach", "museum", "church", "house", "river", "bank",
)
OBJECTS = (
    "drink", "ring", "book", "bag", "kiss", "necklace", "letter", "basketball", "computer", "snack", "bone",
    "flower", "key", "ticket", "hat", "pen",
)
IOI_TEMPLATES = (
    "When {A} and {B} went to the {PLACE}, {B} gave a {OBJECT} to",
    "When {A} and {B} got a {OBJECT} at the {PLACE}, {B} decided to give it to",
    "After {A} and {B} went to the {PLACE}, {B} gave a {OBJECT} to",
    "While {A} and {B} were working at the {PLACE}, {B} gave a {OBJECT} to",
    "Then, {A} and {B} went to the {PLACE}. {B} gave a {OBJECT} to",
    "Friends {A} and {B} found a {OBJECT} at the {PLACE}. {B} gave it to",
    "The {PLACE} {A} and {B} went to had a {OBJECT}. {B} gave it to",
    "When {A} and {B} arrived at the {PLACE}, {B} handed a {OBJECT} to",
)

ADJECTIVES = (
    "big", "small", "old", "young", "happy", "quiet", "brave", "tired", "clever", "angry", "gentle", "tall",
    "lazy", "proud", "red", "strange", "grumpy",
)
NOUNS = (
    "dog", "cat", "teacher", "farmer", "child", "doctor", "bird", "horse", "student", "king", "sailor", "baker",
    "girl", "boy", "painter", "driver", "ferret", "walrus", "wombat",
)
VERBS = (
    "chased", "saw", "liked", "found", "helped", "followed", "watched", "pushed", "called", "visited", "admired",
    "feared", "greeted", "thanked", "painted", "carried", "tickled", "scolded",
)
ADVERBS = (
    "quickly", "slowly", "quietly", "happily", "suddenly", "gently", "rarely", "often", "loudly", "calmly",
    "proudly", "carefully", "sheepishly", "grudgingly",
)
# Grammar templates: word slots and dependency arcs (dependent index, governor index, relation) over word indices.
GRAMMAR = (
    (("the", "ADJ", "NOUN", "ADV", "VERB", "the", "ADJ", "NOUN"),
     ((1, 2, "amod"), (2, 4, "nsubj"), (3, 4, "advmod"), (7, 4, "dobj"), (6, 7, "amod"))),
    (("the", "NOUN", "VERB", "the", "ADJ", "NOUN", "ADV"),
     ((1, 2, "nsubj"), (5, 2, "dobj"), (4, 5, "amod"), (6, 2, "advmod"))),
    (("the", "ADJ", "ADJ", "NOUN", "VERB", "the", "NOUN"),
     ((1, 3, "amod"), (2, 3, "amod"), (3, 4, "nsubj"), (6, 4, "dobj"))),
    (("the", "NOUN", "ADV", "VERB", "the", "NOUN"),
     ((1, 3, "nsubj"), (2, 3, "advmod"), (5, 3, "dobj"))),
)
_SLOT_WORDS = {"ADJ": ADJECTIVES, "NOUN": NOUNS, "VERB": VERBS, "ADV": ADVERBS}


@dataclass(frozen=True)
class Sentence:
    """A grammar sentence: its text, each word's character span, and its dependency arcs over word indices."""

    text: str
    spans: tuple[tuple[int, int], ...]
    arcs: tuple[tuple[int, int, str], ...]


@dataclass(frozen=True)
class TokenInputs:
    """One input set: right-padded tokens and what the sieves need.

    input_ids, attention_mask [n, T]; token_type_ids [n, T] (encoders) or None; token_kind [n, T] with the
    KIND_* codes (sentence pairs) or None; arcs: relation -> bool [n, T, T], True where the query token is a
    word piece of a dependent and the key token a word piece of its governor (sentence pairs) or None.
    """

    name: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor | None = None
    token_kind: torch.Tensor | None = None
    arcs: dict[str, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, start: int, stop: int) -> "TokenInputs":
        """Rows start..stop, trimmed to the longest real input among them."""
        length = int(self.attention_mask[start:stop].sum(-1).max())

        def cut(t):
            return None if t is None else t[start:stop, :length]

        arcs = None if self.arcs is None else {r: a[start:stop, :length, :length] for r, a in self.arcs.items()}
        return replace(self, input_ids=cut(self.input_ids), attention_mask=cut(self.attention_mask),
                       token_type_ids=cut(self.token_type_ids), token_kind=cut(self.token_kind), arcs=arcs)

    def rows(self, index: torch.Tensor) -> "TokenInputs":
        """The inputs at `index` (row numbers, in that order)."""
        def take(t):
            return None if t is None else t[index]

        arcs = None if self.arcs is None else {r: a[index] for r, a in self.arcs.items()}
        return replace(self, input_ids=take(self.input_ids), attention_mask=take(self.attention_mask),
                       token_type_ids=take(self.token_type_ids), token_kind=take(self.token_kind), arcs=arcs)

    def by_length(self) -> "TokenInputs":
        """The same inputs, shortest first (a stable order), so that consecutive batches pad little: MiniLM's
        200 sentence pairs in batches of 32 run 14 % more tokens than they hold in the order drawn, 1 % sorted."""
        return self.rows(torch.argsort(self.attention_mask.sum(-1), stable=True))


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def ioi_prompts(n: int, seed: int = 0) -> list[str]:
    """n IOI prompts: a template, two distinct names (both orders occur), a place and an object."""
    rng = _rng(seed, 1)
    prompts = []
    for _ in range(n):
        a, b = rng.choice(len(NAMES), size=2, replace=False)
        template = IOI_TEMPLATES[rng.integers(len(IOI_TEMPLATES))]
        prompts.append(template.format(A=NAMES[a], B=NAMES[b], PLACE=PLACES[rng.integers(len(PLACES))],
                                       OBJECT=OBJECTS[rng.integers(len(OBJECTS))]))
    return prompts


def grammar_sentences(n: int, seed: int = 0) -> list[Sentence]:
    """n sentences from GRAMMAR with words drawn at random; arcs come from the template."""
    rng = _rng(seed, 2)
    sentences = []
    for _ in range(n):
        slots, arcs = GRAMMAR[rng.integers(len(GRAMMAR))]
        words = [w if w not in _SLOT_WORDS else _SLOT_WORDS[w][rng.integers(len(_SLOT_WORDS[w]))] for w in slots]
        starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
        spans = tuple((int(s), int(s) + len(w)) for s, w in zip(starts, words))
        sentences.append(Sentence(" ".join(words) + ".", spans, arcs))
    return sentences


def join_sentences(sentences: list[Sentence]) -> Sentence:
    """One text of several sentences separated by spaces; spans and arcs re-indexed into it."""
    texts, spans, arcs = [], [], []
    offset = 0
    for sentence in sentences:
        arcs += [(d + len(spans), g + len(spans), r) for d, g, r in sentence.arcs]
        spans += [(s + offset, e + offset) for s, e in sentence.spans]
        texts.append(sentence.text)
        offset += len(sentence.text) + 1
    return Sentence(" ".join(texts), tuple(spans), tuple(arcs))


def _bos_id(tokenizer) -> int:
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if bos is None:
        raise UsageError("the tokenizer has neither a BOS nor an EOS token: decoder role tests need one to prepend")
    return bos


def _pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = True
    return ids, mask


def ioi_inputs(tokenizer, n: int, seed: int = 0) -> TokenInputs:
    """IOI prompts tokenized without the tokenizer's own special tokens, BOS prepended, right-padded."""
    bos = _bos_id(tokenizer)
    sequences = [[bos] + tokenizer(p, add_special_tokens=False)["input_ids"] for p in ioi_prompts(n, seed)]
    ids, mask = _pad(sequences, bos)
    return TokenInputs("ioi", ids, mask)


def repeated_token_inputs(tokenizer, n: int, seed: int = 0, length: int = 20, vocab_size: int | None = None
                          ) -> TokenInputs:
    """BOS + r + r for n random sequences r of `length` tokens, never a special token, drawn uniformly."""
    bos = _bos_id(tokenizer)
    vocab = len(tokenizer) if vocab_size is None else min(vocab_size, len(tokenizer))
    allowed = np.setdiff1d(np.arange(vocab), np.asarray(tokenizer.all_special_ids, dtype=np.int64))
    if allowed.size == 0:
        raise UsageError(f"the tokenizer has no ordinary token among the model's first {vocab} ids: the "
                         "repeated-token inputs are drawn from them")
    r = _rng(seed, 3).choice(allowed, size=(n, length))
    ids = torch.as_tensor(np.concatenate([np.full((n, 1), bos), r, r], axis=1), dtype=torch.long)
    return TokenInputs("repeated_tokens", ids, torch.ones_like(ids, dtype=torch.bool))


def _piece_membership(offsets: torch.Tensor, seq_ids: torch.Tensor, which: int, spans: torch.Tensor
                      ) -> torch.Tensor:
    """bool [words, T]: token t is a piece of word w (sentence `which`, character offsets overlapping the span)."""
    s, e = offsets[:, 0], offsets[:, 1]
    token_ok = (seq_ids == which) & (e > s)
    return token_ok[None, :] & (s[None, :] < spans[:, 1:2]) & (e[None, :] > spans[:, 0:1])


def sentence_pair_inputs(tokenizer, n: int, seed: int = 0, sentences_per_segment: int = 2) -> TokenInputs:
    """n pairs [CLS] A [SEP] B [SEP], each segment a few grammar sentences; token kinds and arcs over word pieces."""
    if not getattr(tokenizer, "is_fast", False):
        raise UsageError("encoder role tests need a fast tokenizer (character offsets); this model's is not")
    k = sentences_per_segment
    sentences = grammar_sentences(2 * k * n, seed)
    segments = [join_sentences(sentences[i: i + k]) for i in range(0, len(sentences), k)]
    pairs = list(zip(segments[0::2], segments[1::2]))
    enc = tokenizer([a.text for a, _ in pairs], [b.text for _, b in pairs], padding=True,
                    return_offsets_mapping=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"].bool()
    seq_ids = torch.tensor([[-1 if s is None else s for s in enc.sequence_ids(row)] for row in range(n)])
    kind = torch.where(seq_ids == 0, KIND_A, torch.where(seq_ids == 1, KIND_B, KIND_SPECIAL))
    if tokenizer.sep_token_id is not None:
        kind = torch.where((kind == KIND_SPECIAL) & (ids == tokenizer.sep_token_id), KIND_SEP, kind)
    if tokenizer.cls_token_id is not None:
        kind[:, 0] = torch.where((kind[:, 0] == KIND_SPECIAL) & (ids[:, 0] == tokenizer.cls_token_id), KIND_CLS,
                                 kind[:, 0])
    kind = torch.where(mask, kind, KIND_PAD)
    length = ids.shape[1]
    arcs = {r: torch.zeros((n, length, length), dtype=torch.bool) for r in RELATIONS}
    for row, pair in enumerate(pairs):
        for which, sentence in enumerate(pair):
            pieces = _piece_membership(enc["offset_mapping"][row], seq_ids[row], which, torch.tensor(sentence.spans))
            for rel in RELATIONS:
                dep = torch.tensor([d for d, _, r in sentence.arcs if r == rel], dtype=torch.long)
                gov = torch.tensor([g for _, g, r in sentence.arcs if r == rel], dtype=torch.long)
                arcs[rel][row] |= (pieces[dep][:, :, None] & pieces[gov][:, None, :]).any(0)
    return TokenInputs("sentence_pairs", ids, mask, enc.get("token_type_ids"), kind, arcs)


def missing_pair_tokens(tokenizer) -> dict[str, str]:
    """{"cls" / "sep": why} for the delimiter the tokenizer's sentence pairs lack (none for a BERT or RoBERTa
    tokenizer): a [CLS] first, a [SEP] after a segment. Read off one encoded pair."""
    kind = sentence_pair_inputs(tokenizer, 1).token_kind
    missing = {}
    for name, code, token in (("cls", KIND_CLS, tokenizer.cls_token), ("sep", KIND_SEP, tokenizer.sep_token)):
        if not (kind == code).any():
            missing[name] = (f"the tokenizer has no {name}_token" if token is None else
                             f"the tokenizer's sentence pairs do not contain its {name}_token {token!r}")
    return missing


def text_inputs(tokenizer, texts: list[str], decoder: bool, name: str = "texts") -> TokenInputs:
    """The user's texts as one input set: a decoder's BOS + tokens (no other special tokens), an encoder's own
    encoding ([CLS] text [SEP], token types); right-padded."""
    if len(texts) < 2:
        raise UsageError(f"{name}: causal effects need at least 2 texts (one a line), got {len(texts)}")
    if decoder:
        bos = _bos_id(tokenizer)
        ids, mask = _pad([[bos] + tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], bos)
        return TokenInputs(name, ids, mask)
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return TokenInputs(name, enc["input_ids"], enc["attention_mask"].bool(), enc.get("token_type_ids"))
