"""Tiny random-init checkpoints of the model families headgraph is run on, written by `transformers`'
`save_pretrained` with an offline tokenizer beside them: one folder per family, built in about a second.

Every family has 2 layers (Gemma 3: 3, so that both its attention types occur), 4 query heads of width 16,
d_model 64, a 512-token vocabulary and 128 positions; what differs is what the family does to attention:

    gpt2        learned positions, LayerNorm, fused QKV with biases (headgraph.testing.synthetic)
    opt         learned positions (offset 2), separate Q/K/V with biases
    bert        encoder, WordPiece tokenizer with [CLS] / [SEP]
    roberta     encoder, byte-level BPE with <s> / </s>
    llama       rotary with Llama 3 rope scaling, RMSNorm, grouped-query (2 KV heads), no biases
    llama-mqa   multi-query attention: Llama with 1 KV head
    qwen2       rotary, grouped-query, Q/K/V biases
    qwen3       rotary, grouped-query, QK-norm (RMSNorm over each head's query and key)
    mistral     rotary, grouped-query, sliding-window attention (window 16)
    gemma2      rotary, soft-capped attention logits, pre- and post-norms, alternating sliding / full layers
    gemma3      rotary, QK-norm, sliding and full layers with their own rope
    pythia      GPT-NeoX: partial rotary (rotary_pct 0.25), parallel attention and MLP
    phi3        rotary, grouped-query, fused QKV without biases
    olmo2       rotary, QK-norm over the whole projection, no biases, norms after attention and MLP
    gptj        partial rotary (rotary_dim 8), parallel attention and MLP, no Q/K/V biases
    phi2        Phi: partial rotary (0.5), parallel attention and MLP, Q/K/V biases
    bloom       ALiBi, fused QKV
    mpt         ALiBi, fused QKV, no biases
    falcon      multi-query attention (1 KV head), rotary, parallel attention and MLP

Decoders get the byte-level BPE tokenizer of headgraph.testing.synthetic (BOS `<|endoftext|>` = id 511), the
encoders a BertTokenizer / RobertaTokenizer trained offline on the same text. The weights are the families' own
initialisations, seeded, with every norm scale and bias moved off its initial ones / zeros by N(0, VECTOR_STD)
so that folding a norm or a bias is visible in the weights: nothing here is trained, so a role or a PK pair
found on one of these models says that the analysis runs on the family, not what the family learns. Every
family loads through TransformerLens 4.3's TransformerBridge.
"""

from pathlib import Path

import torch

from headgraph.errors import UsageError
from headgraph.testing.synthetic import TOKENIZER_CORPUS, random_gpt2_state, save_synthetic, save_tokenizer

LAYERS, HEADS, D_MODEL, D_HEAD, VOCAB, N_CTX = 2, 4, 64, 16, 512, 128
KV_HEADS = 2  # the grouped-query families
SLIDING_WINDOW = 16
VECTOR_STD = 0.1

FAMILIES = ("gpt2", "opt", "bert", "roberta", "llama", "llama-mqa", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
            "pythia", "phi3", "olmo2", "gptj", "phi2", "bloom", "mpt", "falcon")
ENCODERS = ("bert", "roberta")

_DECODER_IDS = {"bos_token_id": VOCAB - 1, "eos_token_id": VOCAB - 1, "pad_token_id": VOCAB - 1}
# Llama 3's rope scaling, with a context short enough that these small models' inputs reach its long wavelengths
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _rotary_common() -> dict:
    return {"vocab_size": VOCAB, "hidden_size": D_MODEL, "intermediate_size": 2 * D_MODEL,
            "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "max_position_embeddings": N_CTX,
            "tie_word_embeddings": False, **_DECODER_IDS}


def family_config(name: str):
    """The `transformers` config of family `name` (see the module docstring)."""
    import transformers as tf

    common = _rotary_common()
    gqa = {"num_key_value_heads": KV_HEADS, "head_dim": D_HEAD}
    if name == "opt":
        return tf.OPTConfig(vocab_size=VOCAB, hidden_size=D_MODEL, ffn_dim=2 * D_MODEL, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, max_position_embeddings=N_CTX, word_embed_proj_dim=D_MODEL,
                            dropout=0.0, attention_dropout=0.0, **_DECODER_IDS)
    if name == "bert":
        return tf.BertConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, intermediate_size=2 * D_MODEL, max_position_embeddings=N_CTX,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    if name == "roberta":
        return tf.RobertaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS,
                                num_attention_heads=HEADS, intermediate_size=2 * D_MODEL,
                                max_position_embeddings=N_CTX + 2, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, bos_token_id=0, pad_token_id=1, eos_token_id=2)
    if name == "llama":
        return tf.LlamaConfig(**common, **gqa, rope_parameters=LLAMA3_ROPE)
    if name == "llama-mqa":
        return tf.LlamaConfig(**common, num_key_value_heads=1, head_dim=D_HEAD)
    if name == "qwen2":
        return tf.Qwen2Config(**common, num_key_value_heads=KV_HEADS)
    if name == "qwen3":
        return tf.Qwen3Config(**common, **gqa)
    if name == "mistral":
        return tf.MistralConfig(**common, **gqa, sliding_window=SLIDING_WINDOW)
    if name == "gemma2":
        return tf.Gemma2Config(**common, **gqa, query_pre_attn_scalar=D_HEAD, sliding_window=SLIDING_WINDOW,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                               layer_types=["sliding_attention", "full_attention"])
    if name == "gemma3":
        return tf.Gemma3TextConfig(**common | {"num_hidden_layers": 3}, **gqa, query_pre_attn_scalar=D_HEAD,
                                   sliding_window=SLIDING_WINDOW,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    if name == "pythia":
        return tf.GPTNeoXConfig(**common, rotary_pct=0.25, use_parallel_residual=True, hidden_dropout=0.0,
                                attention_dropout=0.0)
    if name == "phi3":
        return tf.Phi3Config(**common, num_key_value_heads=KV_HEADS, resid_pdrop=0.0, embd_pdrop=0.0)
    if name == "olmo2":
        return tf.Olmo2Config(**common)
    if name == "gptj":
        return tf.GPTJConfig(vocab_size=VOCAB, n_positions=N_CTX, n_embd=D_MODEL, n_layer=LAYERS, n_head=HEADS,
                             rotary_dim=8, n_inner=2 * D_MODEL, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             **_DECODER_IDS)
    if name == "phi2":
        return tf.PhiConfig(**common, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
                            attention_dropout=0.0)
    if name == "bloom":
        return tf.BloomConfig(vocab_size=VOCAB, hidden_size=D_MODEL, n_layer=LAYERS, n_head=HEADS,
                              hidden_dropout=0.0, attention_dropout=0.0, **_DECODER_IDS)
    if name == "mpt":
        return tf.MptConfig(d_model=D_MODEL, n_heads=HEADS, n_layers=LAYERS, expansion_ratio=2, max_seq_len=N_CTX,
                            vocab_size=VOCAB, attn_config={"alibi": True}, no_bias=True, **_DECODER_IDS)
    if name == "falcon":
        return tf.FalconConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS,
                               num_attention_heads=HEADS, multi_query=True, new_decoder_architecture=False,
                               parallel_attn=True, alibi=False, bias=False, max_position_embeddings=N_CTX,
                               hidden_dropout=0.0, attention_dropout=0.0, **_DECODER_IDS)
    raise UsageError(f"unknown family {name!r}: use one of {', '.join(FAMILIES)}")


def save_bert_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A BertTokenizer over a WordPiece vocabulary trained offline: [PAD]=0, [UNK], [CLS], [SEP], [MASK];
    pairs `[CLS] A [SEP] B [SEP]`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertTokenizer

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(TOKENIZER_CORPUS.split("\n"),
                            trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False))
    BertTokenizer(vocab=tok.get_vocab(), model_max_length=N_CTX).save_pretrained(str(path))


def save_roberta_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A RobertaTokenizer over a byte-level BPE trained offline: <s>=0, <pad>=1, </s>=2, <unk>, <mask>; pairs
    `<s> A </s></s> B </s>`."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import RobertaTokenizer

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TOKENIZER_CORPUS.split("\n"), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False, min_frequency=1))
    merges = [tuple(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    RobertaTokenizer(vocab=tok.get_vocab(), merges=merges, model_max_length=N_CTX).save_pretrained(str(path))


def _perturb_vectors(tensors, seed: int) -> None:
    """Add N(0, VECTOR_STD) to every 1-D tensor (norm scales and shifts, biases), in place: an initialisation
    leaves them all ones or zeros, where folding a norm into the weights, or dropping a bias, changes nothing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in tensors:
            if t.ndim == 1:
                t.add_(torch.randn(t.shape, generator=g) * VECTOR_STD)


def save_family(name: str, folder, seed: int = 0) -> Path:
    """Save a random-init checkpoint of family `name` (one of FAMILIES) and its tokenizer into `folder`; returns
    the folder. The same name and seed give the same weights."""
    folder = Path(folder)
    if name == "gpt2":
        state = random_gpt2_state(LAYERS, HEADS, D_MODEL, N_CTX, VOCAB, seed)
        _perturb_vectors(state.values(), seed)
        return save_synthetic(folder, n_layers=LAYERS, n_heads=HEADS, d_model=D_MODEL, d_head=D_HEAD, n_ctx=N_CTX,
                              vocab=VOCAB, weights=state)
    import transformers

    from headgraph.loader.models import quiet

    config = family_config(name)
    model_class = transformers.AutoModelForMaskedLM if name in ENCODERS else transformers.AutoModelForCausalLM
    with torch.random.fork_rng(), quiet():
        torch.manual_seed(seed)
        model = model_class.from_config(config)
        _perturb_vectors(model.parameters(), seed)
        model.save_pretrained(str(folder))
    if name == "bert":
        save_bert_tokenizer(folder)
    elif name == "roberta":
        save_roberta_tokenizer(folder)
    else:
        save_tokenizer(folder, VOCAB)
    return folder

