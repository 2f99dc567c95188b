"""Synthetic GPT-2-architecture models saved as ordinary local Hugging Face folders.

A synthetic folder holds `config.json`, `model.safetensors` and an offline byte-level BPE tokenizer, so it
loads through exactly the same `load_model` path as a hub model saved locally.
"""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from headgraph.errors import UsageError

BOS = "<|endoftext|>"

# Training text for the synthetic tokenizer's merges: enough English (IOI-style prompts, names, places,
# objects) that such prompts tokenise into word-sized pieces. Byte-level BPE still encodes any text.
TOKENIZER_CORPUS = """
When Mary and John went to the store, John gave a drink to Mary.
When Tom and James went to the park, James gave the ball to Tom.
Then, Sarah and Anna had a long argument. Afterwards Anna said to Sarah.
After Lisa and Paul went to the school, Paul gave a book to Lisa.
While Kate and Alex were working at the office, Alex gave a pen to Kate.
Friends Michael and David found a ring at the garden. David gave it to Michael.
The cat sat on the mat. The dog ran in the house. A bird sang in the tree.
She read the letter and he wrote a song. They played a game at the station.
Emma Olivia Sophia Daniel Matthew Andrew Robert William Thomas Richard Laura Jessica Rachel Emily
restaurant hospital library kitchen bank church market beach river city village airport museum
bag apple ring book key pen bottle cup phone flower box coin necklace snack milk basket
is was are were has had have will would can could should do does did not no yes of in on at by for with
from up down out over under about into through before after because while then so but or if
a an the this that these those it its he she they we you I me him her them his their our my your
good new first last long great little own other old right big high different small large next early
said went gave took made came saw knew got found thought told became left felt brought began kept
0 1 2 3 4 5 6 7 8 9 . , ; : ! ? ' " ( ) - [ ]
"""


def _check_shape(n_layers, n_heads, d_model, d_head, n_ctx, vocab):
    if min(n_layers, n_heads, d_model, d_head, n_ctx) < 1:
        raise UsageError("synthetic model sizes must be positive integers")
    if n_heads * d_head != d_model:
        raise UsageError(
            f"GPT-2 architecture needs n_heads*d_head == d_model, got {n_heads}*{d_head} != {d_model}"
        )
    if vocab < 300:
        raise UsageError(f"vocab must be at least 300 (256 bytes + BOS + merges), got {vocab}")


def gpt2_config(n_layers, n_heads, d_model, n_ctx, vocab) -> dict:
    """The config.json content of a GPT-2-architecture model with these sizes."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": n_ctx,
        "n_embd": d_model,
        "n_layer": n_layers,
        "n_head": n_heads,
        "n_inner": 4 * d_model,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "bos_token_id": vocab - 1,
        "eos_token_id": vocab - 1,
        "pad_token_id": vocab - 1,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def random_gpt2_state(n_layers, n_heads, d_model, n_ctx, vocab, seed=0) -> dict[str, torch.Tensor]:
    """A GPT-2 state dict with GPT-2's initialisation (N(0, 0.02); residual writers scaled by 1/sqrt(2L))."""
    del n_heads  # the fused GPT-2 layout does not depend on the head split
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    d_mlp = 4 * d_model
    writer_std = 0.02 / math.sqrt(2 * n_layers)
    state = {"transformer.wte.weight": normal(vocab, d_model), "transformer.wpe.weight": normal(n_ctx, d_model, std=0.01)}
    for layer in range(n_layers):
        p = f"transformer.h.{layer}."
        state.update(
            {
                p + "ln_1.weight": torch.ones(d_model),
                p + "ln_1.bias": torch.zeros(d_model),
                p + "attn.c_attn.weight": normal(d_model, 3 * d_model),
                p + "attn.c_attn.bias": torch.zeros(3 * d_model),
                p + "attn.c_proj.weight": normal(d_model, d_model, std=writer_std),
                p + "attn.c_proj.bias": torch.zeros(d_model),
                p + "ln_2.weight": torch.ones(d_model),
                p + "ln_2.bias": torch.zeros(d_model),
                p + "mlp.c_fc.weight": normal(d_model, d_mlp),
                p + "mlp.c_fc.bias": torch.zeros(d_mlp),
                p + "mlp.c_proj.weight": normal(d_mlp, d_model, std=writer_std),
                p + "mlp.c_proj.bias": torch.zeros(d_model),
            }
        )
    state["transformer.ln_f.weight"] = torch.ones(d_model)
    state["transformer.ln_f.bias"] = torch.zeros(d_model)
    return state


def save_tokenizer(path: Path, vocab: int) -> None:
    """Write an offline byte-level BPE tokenizer with `vocab` entries, BOS/EOS/PAD `<|endoftext|>` = id vocab-1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=1,
    )
    tok.train_from_iterator(TOKENIZER_CORPUS.split("\n"), trainer=trainer)
    # Pad the vocabulary with unused filler tokens so the BOS id is always vocab-1, whatever the corpus yields.
    fillers = [f"<|unused{i}|>" for i in range(vocab - 1 - tok.get_vocab_size())]
    tok.add_special_tokens(fillers + [BOS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=BOS, unk_token=BOS, pad_token=BOS,
        model_max_length=10**6,
    )
    fast.save_pretrained(str(path))


def save_gpt2_folder(path, state: dict[str, torch.Tensor], config: dict) -> Path:
    """Write `config.json`, `model.safetensors` and the tokenizer for a GPT-2-architecture state dict."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    save_tokenizer(path, config["vocab_size"])
    return path


def save_synthetic(
    path,
    n_layers: int = 2,
    n_heads: int = 4,
    d_model: int = 64,
    d_head: int = 16,
    n_ctx: int = 128,
    vocab: int = 512,
    seed: int = 0,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save a random-init (or given-`weights`) GPT-2-architecture model as a local HF folder; returns the folder."""
    _check_shape(n_layers, n_heads, d_model, d_head, n_ctx, vocab)
    state = weights if weights is not None else random_gpt2_state(n_layers, n_heads, d_model, n_ctx, vocab, seed)
    return save_gpt2_folder(path, state, gpt2_config(n_layers, n_heads, d_model, n_ctx, vocab))


def save_synthetic_gqa(
    path,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_model: int = 64,
    d_head: int = 16,
    n_ctx: int = 128,
    vocab: int = 512,
    seed: int = 0,
) -> Path:
    """Save a random-init Llama-architecture model with grouped-query attention (n_kv_heads < n_heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from headgraph.loader.models import quiet

    if n_heads % n_kv_heads or min(n_layers, n_kv_heads, d_model, d_head, n_ctx) < 1 or vocab < 300:
        raise UsageError("GQA model needs positive sizes, n_heads a multiple of n_kv_heads and vocab >= 300")
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=d_head, max_position_embeddings=n_ctx,
        bos_token_id=vocab - 1, eos_token_id=vocab - 1, pad_token_id=vocab - 1, tie_word_embeddings=False,
    )
    path = Path(path)
    with torch.random.fork_rng(), quiet():
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(str(path))
    save_tokenizer(path, vocab)
    return path


def as_bf16(folder: Path) -> Path:
    """The checkpoint in `folder` with its floating tensors stored as bf16, as most released checkpoints are."""
    for shard in Path(folder).glob("*.safetensors"):
        state = load_file(str(shard))
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}, str(shard),
                  metadata={"format": "pt"})
    return Path(folder)
