"""Seeded role-test inputs: IOI prompts, repeated random tokens, grammar sentence pairs with known arcs."""

import re

import pytest
import torch
from transformers import AutoTokenizer

from headgraph.analysis import prompts as P
from headgraph.errors import UsageError
from headgraph.loader.models import minilm_dir
from headgraph.testing.synthetic import save_tokenizer

SLOT_OF = {**{w: "ADJ" for w in P.ADJECTIVES}, **{w: "NOUN" for w in P.NOUNS}, **{w: "VERB" for w in P.VERBS},
           **{w: "ADV" for w in P.ADVERBS}}
ARC_SLOTS = {"nsubj": ("NOUN", "VERB"), "dobj": ("NOUN", "VERB"), "amod": ("ADJ", "NOUN"), "advmod": ("ADV", "VERB")}


@pytest.fixture(scope="module")
def gpt_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(folder, 512)
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def bert_tokenizer():
    return AutoTokenizer.from_pretrained(str(minilm_dir()))


def test_ioi_prompts_are_seeded_and_have_ioi_structure():
    a, b = P.ioi_prompts(40, seed=3), P.ioi_prompts(40, seed=3)
    assert a == b and a != P.ioi_prompts(40, seed=4)
    for prompt in a:
        names = [w for w in re.findall(r"[A-Z][a-z]+", prompt) if w in P.NAMES]
        # IO once, S twice: the subject is repeated, the indirect object is not
        assert len(names) == 3 and len(set(names)) == 2 and names[1] == names[2]


def test_ioi_inputs_start_with_bos_and_pad_on_the_right(gpt_tokenizer):
    x = P.ioi_inputs(gpt_tokenizer, 12, seed=0)
    bos = gpt_tokenizer.bos_token_id
    assert (x.input_ids[:, 0] == bos).all()
    lengths = x.attention_mask.sum(-1)
    for row, prompt in enumerate(P.ioi_prompts(12, seed=0)):
        expected = [bos] + gpt_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert x.input_ids[row, : lengths[row]].tolist() == expected
        assert not x.attention_mask[row, lengths[row]:].any()


def test_repeated_tokens_repeat_and_avoid_special_tokens(gpt_tokenizer):
    x = P.repeated_token_inputs(gpt_tokenizer, 30, seed=1, length=7, vocab_size=400)
    assert x.input_ids.shape == (30, 15)
    assert torch.equal(x.input_ids[:, 1:8], x.input_ids[:, 8:])
    body = x.input_ids[:, 1:]
    assert body.max() < 400 and not torch.isin(body, torch.tensor(gpt_tokenizer.all_special_ids)).any()
    assert not torch.equal(x.input_ids, P.repeated_token_inputs(gpt_tokenizer, 30, seed=2, length=7).input_ids)


def test_grammar_arcs_link_the_right_parts_of_speech():
    for sentence in P.grammar_sentences(50, seed=0):
        words = [sentence.text[s:e] for s, e in sentence.spans]
        assert sentence.text.rstrip(".").split(" ") == words
        for dep, gov, rel in sentence.arcs:
            assert (SLOT_OF[words[dep]], SLOT_OF[words[gov]]) == ARC_SLOTS[rel]


def test_sentence_pairs_mark_cls_sep_segments(bert_tokenizer):
    x = P.sentence_pair_inputs(bert_tokenizer, 10, seed=0)
    kind, ids = x.token_kind, x.input_ids
    assert (kind[:, 0] == P.KIND_CLS).all() and (ids[:, 0] == bert_tokenizer.cls_token_id).all()
    assert ((kind == P.KIND_SEP) == (ids == bert_tokenizer.sep_token_id)).all()
    assert ((kind == P.KIND_SEP).sum(-1) == 2).all()
    assert ((kind == P.KIND_PAD) == ~x.attention_mask).all()
    content = (kind == P.KIND_A) | (kind == P.KIND_B)
    assert torch.equal(x.token_type_ids[content] == 1, kind[content] == P.KIND_B)


def test_sentence_pair_arcs_align_to_word_pieces(bert_tokenizer):
    """Arcs equal those rebuilt from the tokenizer's own word ids (word_ids / word_to_chars), piece by piece."""
    n = 20
    x = P.sentence_pair_inputs(bert_tokenizer, n, seed=5, sentences_per_segment=2)
    sentences = P.grammar_sentences(4 * n, seed=5)
    segments = [P.join_sentences(sentences[i: i + 2]) for i in range(0, 4 * n, 2)]
    enc = bert_tokenizer([s.text for s in segments[0::2]], [s.text for s in segments[1::2]], padding=True)
    multi_piece = False
    for row in range(n):
        word_ids, seq_ids = enc.word_ids(row), enc.sequence_ids(row)
        for which in (0, 1):
            seg = segments[2 * row + which]
            start_to_word = {s: w for w, (s, _) in enumerate(seg.spans)}
            pieces = {}  # my word index -> token positions
            for t, (w, sid) in enumerate(zip(word_ids, seq_ids)):
                if sid == which and w is not None:
                    start = enc.word_to_chars(row, w, sequence_index=which).start
                    if start in start_to_word:
                        pieces.setdefault(start_to_word[start], []).append(t)
            for dep, gov, rel in seg.arcs:
                q, k = pieces[dep], pieces[gov]
                multi_piece |= len(q) > 1 or len(k) > 1
                assert x.arcs[rel][row][q][:, k].all()
    assert multi_piece  # the grammar's rarer words split into several pieces


def test_sentence_pair_arcs_have_no_extra_entries(bert_tokenizer):
    """Every arc entry joins a piece of a dependent to a piece of its governor: counts match exactly."""
    n = 20
    x = P.sentence_pair_inputs(bert_tokenizer, n, seed=5, sentences_per_segment=2)
    sentences = P.grammar_sentences(4 * n, seed=5)
    segments = [P.join_sentences(sentences[i: i + 2]) for i in range(0, 4 * n, 2)]
    for rel in P.RELATIONS:
        expected = 0
        for seg in segments:
            for dep, gov, r in seg.arcs:
                if r == rel:
                    dep_word = seg.text[slice(*seg.spans[dep])]
                    gov_word = seg.text[slice(*seg.spans[gov])]
                    expected += (len(bert_tokenizer(dep_word, add_special_tokens=False)["input_ids"])
                                 * len(bert_tokenizer(gov_word, add_special_tokens=False)["input_ids"]))
        assert int(x.arcs[rel].sum()) == expected


def test_batches_trim_to_their_longest_input(gpt_tokenizer):
    x = P.ioi_inputs(gpt_tokenizer, 9, seed=0)
    b = x.batch(2, 5)
    assert len(b) == 3 and b.input_ids.shape[1] == int(x.attention_mask[2:5].sum(-1).max())
    assert torch.equal(b.input_ids, x.input_ids[2:5, : b.input_ids.shape[1]])


def test_inputs_by_length_keep_every_row_whole_shortest_first(bert_tokenizer):
    x = P.sentence_pair_inputs(bert_tokenizer, 40, seed=1)
    y = x.by_length()
    drawn, ordered = x.attention_mask.sum(-1), y.attention_mask.sum(-1)
    assert (ordered[1:] >= ordered[:-1]).all() and not (drawn[1:] >= drawn[:-1]).all()
    rows = {}  # each input's tokens, token types, kinds and arcs, keyed by its tokens (seeded draws: no repeats)
    for inputs in (x, y):
        rows[inputs is y] = sorted(
            (inputs.input_ids[i].tolist(), inputs.token_type_ids[i].tolist(), inputs.token_kind[i].tolist(),
             [inputs.arcs[r][i].nonzero().tolist() for r in sorted(inputs.arcs)]) for i in range(len(inputs)))
    assert rows[True] == rows[False]
    padded = {inputs is y: sum(inputs.batch(s, s + 8).attention_mask.numel() for s in range(0, 40, 8))
              for inputs in (x, y)}
    assert padded[True] < padded[False]


def test_sentence_pairs_of_a_tokenizer_without_cls_or_sep_have_neither(gpt_tokenizer):
    assert gpt_tokenizer.cls_token is None and gpt_tokenizer.sep_token is None
    x = P.sentence_pair_inputs(gpt_tokenizer, 6, seed=0)
    real = x.attention_mask
    assert set(x.token_kind[real].tolist()) == {P.KIND_A, P.KIND_B}  # the two segments, back to back
    first_b = (x.token_kind == P.KIND_B).int().argmax(-1)
    assert ((x.token_kind == P.KIND_A).sum(-1) == first_b).all()
    assert P.missing_pair_tokens(gpt_tokenizer) == {"cls": "the tokenizer has no cls_token",
                                                     "sep": "the tokenizer has no sep_token"}


def test_a_bos_between_the_segments_is_neither_cls_nor_sep(tmp_path):
    """A generic pair template `<s> A <s> B` (what a RoBERTa tokenizer saved as a plain fast tokenizer becomes
    once TransformerLens asks it for a BOS): the first <s> is the CLS token, the middle one no delimiter."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from headgraph.testing.synthetic import TOKENIZER_CORPUS

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(TOKENIZER_CORPUS.split("\n"), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "<pad>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", cls_token="<s>", sep_token="</s>",
                                        pad_token="<pad>")
    x = P.sentence_pair_inputs(tokenizer, 4, seed=0)
    middle = x.attention_mask & (x.input_ids == 0) & (torch.arange(x.input_ids.shape[1]) > 0)
    assert (middle.sum(-1) == 1).all()
    assert (x.token_kind[middle] == P.KIND_SPECIAL).all() and (x.token_kind[:, 0] == P.KIND_CLS).all()
    assert not (x.token_kind == P.KIND_SEP).any()
    assert P.missing_pair_tokens(tokenizer) == {"sep": "the tokenizer's sentence pairs do not contain its "
                                                       "sep_token '</s>'"}


def test_sentence_pairs_of_a_roberta_tokenizer_mark_its_own_delimiters(tmp_path):
    from headgraph.testing.families import save_roberta_tokenizer

    save_roberta_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    x = P.sentence_pair_inputs(tokenizer, 6, seed=0)
    assert (x.input_ids[:, 0] == 0).all() and (x.token_kind[:, 0] == P.KIND_CLS).all()
    assert ((x.token_kind == P.KIND_SEP) == (x.input_ids == 2)).all()  # <s> A </s></s> B </s>
    assert ((x.token_kind == P.KIND_SEP).sum(-1) == 3).all() and P.missing_pair_tokens(tokenizer) == {}


def test_repeated_tokens_need_an_ordinary_token(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    only_specials = Tokenizer(models.WordLevel({"<s>": 0, "<unk>": 1}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=only_specials, bos_token="<s>", unk_token="<unk>")
    with pytest.raises(UsageError, match="no ordinary token among the model's first 2 ids"):
        P.repeated_token_inputs(tokenizer, 2, vocab_size=2)
