"""load_model: the offline MiniLM, synthetic GPT-2 folders, and clean failures for bad names and bad weights."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from headgraph.errors import BadWeights, ModelUnavailable, UsageError
from headgraph.loader.models import load_model, minilm_dir, offline_models, resolve_model
from headgraph.testing.synthetic import random_gpt2_state, save_synthetic, save_synthetic_gqa

IOI = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(scope="module")
def minilm_raw():
    return load_model("all-MiniLM-L6-v2", processing="raw", device="cpu")


@pytest.fixture(scope="module")
def minilm_tl():
    return load_model("sentence-transformers/all-MiniLM-L6-v2", processing="tl", device="cpu")


@pytest.fixture(scope="module")
def minilm_checkpoint():
    return load_file(str(minilm_dir() / "model.safetensors"))


def test_minilm_dimensions_and_layout(minilm_raw):
    cfg = minilm_raw.cfg
    assert (cfg["n_layers"], cfg["n_heads"], cfg["n_kv_heads"], cfg["d_model"], cfg["d_head"]) == (6, 12, 12, 384, 32)
    assert cfg["is_decoder"] is False and cfg["architecture"].startswith("Bert")
    assert minilm_raw.W_Q.shape == minilm_raw.W_K.shape == minilm_raw.W_V.shape == (6, 12, 384, 32)
    assert minilm_raw.W_O.shape == (6, 12, 32, 384)
    for w in (minilm_raw.W_Q, minilm_raw.W_K, minilm_raw.W_V, minilm_raw.W_O):
        assert torch.isfinite(w).all() and w.abs().max() > 0


@pytest.mark.parametrize("hf, tl", [("query", "W_Q"), ("key", "W_K"), ("value", "W_V")])
def test_minilm_raw_reading_weights_match_checkpoint(minilm_raw, minilm_checkpoint, hf, tl):
    for layer in (0, 5):
        linear = minilm_checkpoint[f"encoder.layer.{layer}.attention.self.{hf}.weight"]  # [out, in]
        expected = linear.T.reshape(384, 12, 32).permute(1, 0, 2)  # head h reads columns h*32:(h+1)*32
        torch.testing.assert_close(getattr(minilm_raw, tl)[layer], expected, rtol=0, atol=0)


def test_minilm_raw_output_weights_match_checkpoint(minilm_raw, minilm_checkpoint):
    linear = minilm_checkpoint["encoder.layer.3.attention.output.dense.weight"]
    torch.testing.assert_close(minilm_raw.W_O[3], linear.T.reshape(12, 32, 384), rtol=0, atol=0)


def test_minilm_tl_centres_writing_weights_and_records_unfolded_ln(minilm_raw, minilm_tl):
    centred = minilm_raw.W_O - minilm_raw.W_O.mean(-1, keepdim=True)
    torch.testing.assert_close(minilm_tl.W_O, centred, rtol=0, atol=1e-6)
    assert minilm_tl.processing == "tl" and minilm_tl.name == "all-MiniLM-L6-v2"
    assert any("fold_ln" in w for w in minilm_tl.cfg["processing_warnings"])


def test_minilm_tokenizes_and_hooks_patterns(minilm_raw):
    tokens = minilm_raw.bridge.to_tokens("the cat sat on the mat")
    assert minilm_raw.tokenizer.convert_ids_to_tokens(tokens[0].tolist())[0] == "[CLS]"
    _, cache = minilm_raw.bridge.run_with_cache(tokens)
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert pattern.shape == (1, 12, tokens.shape[1], tokens.shape[1])
    torch.testing.assert_close(pattern.sum(-1), torch.ones(1, 12, tokens.shape[1]))


def test_minilm_aliases_resolve_to_the_packaged_folder():
    assert resolve_model("all-MiniLM-L6-v2")[1] == resolve_model("sentence-transformers/all-MiniLM-L6-v2")[1]
    assert "all-MiniLM-L6-v2" in offline_models()


def test_synthetic_round_trip_matches_the_saved_state(synthetic_dir):
    state = random_gpt2_state(n_layers=2, n_heads=4, d_model=64, n_ctx=128, vocab=512, seed=0)
    model = load_model(synthetic_dir, processing="raw", device="cpu")
    assert model.cfg | {"processing_warnings": []} == {
        "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "d_model": 64, "d_head": 16, "n_ctx": 128,
        "architecture": "GPT2LMHeadModel", "is_decoder": True, "processing_warnings": [],
    }
    fused = state["transformer.h.1.attn.c_attn.weight"]  # [d_model, 3*d_model]: Q | K | V, heads contiguous
    for i, name in enumerate(("W_Q", "W_K", "W_V")):
        expected = fused[:, 64 * i : 64 * (i + 1)].reshape(64, 4, 16).permute(1, 0, 2)
        torch.testing.assert_close(getattr(model, name)[1], expected, rtol=0, atol=0)
    torch.testing.assert_close(model.W_O[1], state["transformer.h.1.attn.c_proj.weight"].reshape(4, 16, 64))


def test_synthetic_processing_keeps_attention_patterns(synthetic_dir):
    raw = load_model(synthetic_dir, processing="raw", device="cpu")
    tl = load_model(synthetic_dir, processing="tl", device="cpu")
    assert not torch.allclose(raw.W_Q, tl.W_Q)  # LN folding centres the reading weights
    tokens = raw.bridge.to_tokens(IOI)
    _, raw_cache = raw.bridge.run_with_cache(tokens)
    _, tl_cache = tl.bridge.run_with_cache(tokens)
    for layer in range(2):
        key = f"blocks.{layer}.attn.hook_pattern"
        torch.testing.assert_close(tl_cache[key], raw_cache[key], rtol=0, atol=1e-5)


def test_synthetic_tokenizer_is_offline_with_bos(synthetic_dir):
    model = load_model(synthetic_dir, processing="raw", device="cpu")
    tokens = model.bridge.to_tokens(IOI)
    assert tokens[0, 0].item() == model.tokenizer.bos_token_id == 511
    assert model.tokenizer.bos_token == "<|endoftext|>"
    assert model.tokenizer.decode(tokens[0, 1:]) == IOI
    assert tokens.shape[1] < 30  # word-sized pieces, not bytes


def test_synthetic_seeds_differ(tmp_path):
    a = load_model(save_synthetic(tmp_path / "a", seed=1), processing="raw", device="cpu")
    b = load_model(save_synthetic(tmp_path / "b", seed=2), processing="raw", device="cpu")
    assert not torch.allclose(a.W_Q, b.W_Q)


def test_loading_is_quiet(synthetic_dir, capfd):
    load_model(synthetic_dir, processing="tl", device="cpu")
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_unknown_name_is_one_clear_line():
    with pytest.raises(ModelUnavailable) as e:
        load_model("headgraph-test/no-such-model")
    expected = (
        "model 'headgraph-test/no-such-model' is not available offline; pass a local directory "
        f"(config.json + safetensors) or one of: {', '.join(offline_models())}"
    )
    assert str(e.value) == expected and "\n" not in str(e.value)
    assert e.value.exit_code == 2


def test_gpt2_without_hub_or_cache_fails_cleanly():
    if "gpt2" in offline_models() or "openai-community/gpt2" in offline_models():
        pytest.skip("gpt2 is in the local Hugging Face cache here")
    with pytest.raises(ModelUnavailable, match="model 'gpt2' is not available offline"):
        load_model("gpt2")


def test_cli_unknown_model_exits_2(capsys):
    from headgraph.cli import main

    with pytest.raises(SystemExit) as e:
        main(["roles", "headgraph-test/no-such-model"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model 'headgraph-test/no-such-model' is not available offline") and err.count("\n") == 1


def test_folder_without_config_or_weights(tmp_path, synthetic_dir):
    with pytest.raises(ModelUnavailable, match="config.json"):
        load_model(tmp_path)
    shutil.copy(synthetic_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelUnavailable, match="safetensors"):
        load_model(tmp_path)


def test_bad_processing_is_a_usage_error(synthetic_dir):
    with pytest.raises(UsageError):
        load_model(synthetic_dir, processing="folded")


def _copy(synthetic_dir, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(synthetic_dir, folder)
    return folder


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_is_bad_weights(synthetic_dir, tmp_path, damage):
    folder = _copy(synthetic_dir, tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x00not a safetensors file" * 8 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(BadWeights) as e:
        load_model(folder, device="cpu")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight_is_bad_weights(synthetic_dir, tmp_path, value):
    folder = _copy(synthetic_dir, tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    state["transformer.h.1.attn.c_attn.weight"][3, 7] = value
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(BadWeights, match=r"NaN or Inf in transformer\.h\.1\.attn\.c_attn\.weight"):
        load_model(folder, device="cpu")


def test_wrong_shape_is_bad_weights(synthetic_dir, tmp_path):
    folder = _copy(synthetic_dir, tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    state["transformer.h.0.attn.c_proj.weight"] = torch.zeros(32, 64)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(BadWeights, match="c_proj.weight has shape"):
        load_model(folder, device="cpu")


def test_missing_tensor_is_bad_weights(synthetic_dir, tmp_path):
    folder = _copy(synthetic_dir, tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    del state["transformer.h.1.attn.c_attn.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(BadWeights, match="lack 1 tensors"):
        load_model(folder, device="cpu")


def test_gqa_keys_and_values_stay_per_kv_head(tmp_path):
    folder = save_synthetic_gqa(tmp_path / "gqa", n_layers=2, n_heads=4, n_kv_heads=2, d_model=64, d_head=16)
    state = load_file(str(folder / "model.safetensors"))
    for processing in ("raw", "tl"):
        model = load_model(folder, processing=processing, device="cpu")
        assert (model.cfg["n_heads"], model.cfg["n_kv_heads"], model.cfg["architecture"]) == (4, 2, "LlamaForCausalLM")
        assert model.W_Q.shape == (2, 4, 64, 16) and model.W_O.shape == (2, 4, 16, 64)
        assert model.W_K.shape == model.W_V.shape == (2, 2, 64, 16)
    raw = load_model(folder, processing="raw", device="cpu")
    k_proj = state["model.layers.1.self_attn.k_proj.weight"]  # [n_kv*d_head, d_model]
    torch.testing.assert_close(raw.W_K[1], k_proj.T.reshape(64, 2, 16).permute(1, 0, 2), rtol=0, atol=0)


def test_hub_name_loads_from_the_local_hf_cache(synthetic_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--headgraph-test--tiny-gpt2"
    shutil.copytree(synthetic_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert "headgraph-test/tiny-gpt2" in offline_models()
    model = load_model("headgraph-test/tiny-gpt2", processing="raw", device="cpu")
    assert model.name == "headgraph-test/tiny-gpt2" and model.source == str(repo / "snapshots" / commit)
    torch.testing.assert_close(model.W_Q, load_model(synthetic_dir, processing="raw", device="cpu").W_Q)


def test_cuda_request_without_cuda_is_a_usage_error(synthetic_dir):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    with pytest.raises(UsageError, match="no CUDA"):
        load_model(synthetic_dir, device="cuda")


def test_gpt2_through_the_fused_gelu_computes_what_transformers_gelu_new_computes():
    from transformers import AutoModelForCausalLM

    from headgraph.analysis.prompts import repeated_token_inputs
    from headgraph.loader.models import PACKAGED_MODELS_DIR

    folder = PACKAGED_MODELS_DIR / "induction-2l"  # trained: its MLPs are not near-silent as at random init
    model = load_model(folder, processing="raw", device="cpu")
    kinds = {type(m).__name__ for m in model.bridge.original_model.modules()}
    assert "GELUTanh" in kinds and "NewGELUActivation" not in kinds
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert "NewGELUActivation" in {type(m).__name__ for m in hf.modules()}  # the reference runs the unfused one
    ids = repeated_token_inputs(model.tokenizer, 8, 0, 20, model.bridge.cfg.d_vocab).input_ids
    with torch.no_grad():
        logits = model.bridge(ids, return_type="logits")
        expected = hf(ids).logits
    assert expected.abs().max() > 1  # a real output, which the tolerance below is small against
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def _family_copy(name, tmp_path, **config_changes):
    """A fresh checkpoint of family `name` with `config_changes` written into its config.json."""
    import json

    from headgraph.testing.families import save_family

    folder = save_family(name, tmp_path / name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | config_changes))
    return folder


def test_phi3_tl_folds_its_rmsnorm_into_the_joint_qkv_and_records_no_unfolded_ln(tmp_path):
    folder = _family_copy("phi3", tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    raw = load_model(folder, processing="raw", device="cpu")
    tl = load_model(folder, processing="tl", device="cpu")
    for layer in (0, 1):
        scale = state[f"model.layers.{layer}.input_layernorm.weight"]  # multiplies the residual before W_Q
        assert (scale - 1).abs().max() > 0.05  # the family's norms are not the identity
        for name in ("W_Q", "W_K", "W_V"):
            torch.testing.assert_close(getattr(tl, name)[layer], getattr(raw, name)[layer] * scale[:, None],
                                       rtol=1e-6, atol=1e-7)
    assert tl.cfg["processing_warnings"] == []  # TransformerLens' "does not support fold_ln" is not true here


def test_olmo2_tl_keeps_its_reading_weights_and_records_the_unfolded_norms(tmp_path):
    folder = _family_copy("olmo2", tmp_path)
    raw = load_model(folder, processing="raw", device="cpu")
    tl = load_model(folder, processing="tl", device="cpu")
    for name in ("W_Q", "W_K", "W_V", "W_O"):  # norms after attention and QK-norm: nothing to fold, no centring
        torch.testing.assert_close(getattr(tl, name), getattr(raw, name), rtol=0, atol=0)
    assert [w.split(" ")[0] for w in tl.cfg["processing_warnings"]] == ["Olmo2ArchitectureAdapter"]
    assert "fold_ln" in tl.cfg["processing_warnings"][0]


@pytest.mark.parametrize("implementation", ["sdpa", "flash_attention_2"])
def test_a_checkpoint_asking_for_a_known_fast_attention_loads_with_eager_attention(tmp_path, implementation):
    folder = _family_copy("llama", tmp_path, attn_implementation=implementation)
    model = load_model(folder, processing="raw", device="cpu")
    assert model.bridge.original_model.config._attn_implementation == "eager"
    tokens = model.bridge.to_tokens(IOI)
    _, cache = model.bridge.run_with_cache(tokens)
    assert cache["blocks.1.attn.hook_pattern"].shape == (1, 4, tokens.shape[1], tokens.shape[1])


def _analyze_exits_2_storing_nothing(folder, tmp_path, capsys) -> str:
    """The one line of `headgraph analyze FOLDER` into a LadybugDB file, after checking it exits 2 and leaves
    neither the store nor a run folder behind."""
    from headgraph.cli import main

    db, out = tmp_path / "store.lbdb", tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(folder), "--db", str(db), "--out", str(out), "--null-heads", "4",
              "--reference-samples", "100", "--n-inputs", "4", "--causal-n", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not db.exists() and not (out / "run.json").exists()
    return err


@pytest.mark.parametrize("key", ["attn_implementation", "_attn_implementation"])
def test_an_attention_implementation_transformers_does_not_know_is_one_line(tmp_path, capsys, key):
    folder = _family_copy("llama", tmp_path, **{key: "flash_magic"})
    err = _analyze_exits_2_storing_nothing(folder, tmp_path, capsys)
    assert "attention implementation 'flash_magic', which transformers does not know" in err


@pytest.mark.parametrize("name, changes, says", [
    ("llama", {"num_key_value_heads": 3}, "has 4 attention heads, not a multiple of its 3 key/value heads"),
    ("gemma2", {"num_key_value_heads": 3}, "has 4 attention heads, not a multiple of its 3 key/value heads"),
    ("llama", {"num_key_value_heads": 0}, "has 4 attention heads and 0 key/value heads"),
    ("gpt2", {"n_head": 3}, "hidden size 64, not a multiple of its 3 attention heads"),
    ("bert", {"num_attention_heads": 3}, "hidden size 64, not a multiple of its 3 attention heads"),
    ("mpt", {"n_heads": 3}, "hidden size 64, not a multiple of its 3 attention heads"),
])
def test_head_counts_that_do_not_divide_are_one_line(tmp_path, capsys, name, changes, says):
    err = _analyze_exits_2_storing_nothing(_family_copy(name, tmp_path, **changes), tmp_path, capsys)
    assert says in err


def test_a_decoder_tokenizer_without_bos_or_eos_is_one_line_before_any_work(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from headgraph.testing.synthetic import TOKENIZER_CORPUS

    folder = _family_copy("gpt2", tmp_path)
    for old in folder.glob("*token*"):
        old.unlink()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(TOKENIZER_CORPUS.split("\n"), trainers.BpeTrainer(
        vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    assert bpe.get_vocab_size() == 512  # every id of the model's vocabulary taken, none special
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(str(folder))
    err = _analyze_exits_2_storing_nothing(folder, tmp_path, capsys)
    assert "gives token ids up to 512 (its BOS '<|endoftext|>' is id 512), beyond the model's 512 tokens" in err


def test_a_tokenizer_of_a_larger_vocabulary_is_one_line(tmp_path, capsys):
    from headgraph.testing.synthetic import save_tokenizer

    folder = _family_copy("llama", tmp_path, vocab_size=400, bos_token_id=399, eos_token_id=399, pad_token_id=399)
    state = load_file(str(folder / "model.safetensors"))
    save_file({k: v[:400] if v.shape[0] == 512 else v for k, v in state.items()}, str(folder / "model.safetensors"))
    save_tokenizer(folder, 512)  # BOS 511 and merged words above id 400
    err = _analyze_exits_2_storing_nothing(folder, tmp_path, capsys)
    assert "beyond the model's 400 tokens: it is not this model's tokenizer" in err
