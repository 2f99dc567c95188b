"""Streamed weights (headgraph.loader.stream.open_model) on every model family and under load_model's own checks:
the same W_* as the loaded model, or the whole model loaded where an adapter's processing cannot run a layer at a
time; the same one-line errors as load_model for weights it refuses."""

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from headgraph.errors import BadWeights, ModelUnavailable
from headgraph.loader.models import load_model
from headgraph.loader.stream import StreamedModel, open_model
from headgraph.testing.synthetic import random_gpt2_state, save_synthetic, save_synthetic_gqa


@pytest.mark.slow
def test_every_family_streams_the_loaded_models_weights_or_loads_whole(family_dirs):
    """Every family of headgraph.testing.families (norms and biases perturbed off 1 / 0), raw and tl."""
    from headgraph.testing.families import FAMILIES

    fell_back = []
    for family in FAMILIES:
        for processing in ("raw", "tl"):
            opened = open_model(family_dirs[family], processing=processing, device="cpu")
            loaded = load_model(family_dirs[family], processing=processing, device="cpu")
            if not isinstance(opened, StreamedModel):
                fell_back.append((family, processing))
                continue
            layers = list(opened.head_layers())
            assert opened.cfg == loaded.cfg, family
            for name in ("W_Q", "W_K", "W_V", "W_O"):
                torch.testing.assert_close(torch.stack([w[name] for w in layers]), getattr(loaded, name), atol=0,
                                           rtol=0, msg=f"{family} {processing} {name}")
    assert fell_back == [("phi3", "tl")]  # Phi-3's adapter preprocesses its joint QKV weights itself


@pytest.mark.slow
def test_every_familys_effects_from_its_stored_bf16_weights_equal_the_processed_models(family_dirs, tmp_path):
    """The causal effects of a streamed bf16 checkpoint run on its raw weights, held in bf16 (each block's matrices
    upcast while it runs, a torch Linear's by chunks of rows, and again for the backward pass of attribution; a
    family that read a Linear's weight values in its module would get NaN), with TransformerLens' processing applied
    only to what the effects read of it (headgraph.analysis.causal.network.processed_outputs): the local effects and
    attributions of every OQ/OK/OV pair equal those of the same checkpoint loaded in float32 and processed. Without
    that view the V effects of the LayerNorm families and of Qwen2 (value biases) differ by far more."""
    from headgraph.analysis.causal import causal_inputs, local_effects
    from headgraph.testing.families import FAMILIES
    from headgraph.testing.synthetic import as_bf16

    streamed_families = []
    for family in FAMILIES:
        folder = as_bf16(shutil.copytree(family_dirs[family], tmp_path / family))
        streamed = open_model(folder, device="cpu")
        if not isinstance(streamed, StreamedModel):
            continue  # Phi-3 (test_every_family_streams_the_loaded_models_weights_or_loads_whole)
        streamed.allow_loading()
        loaded = load_model(folder, device="cpu")
        inputs = causal_inputs(loaded, 2, seed=0)
        found, expected = (local_effects(m, inputs, ("OQ", "OK", "OV"), n_boot=20, seed=0) for m in (streamed, loaded))
        matrices = {p.dtype for block in streamed.bridge.blocks for p in block.parameters() if p.dim() >= 2}
        assert matrices == {torch.bfloat16}, family
        assert list(found["target"]) == list(expected["target"]), family
        for column in ("effect", "effect_lo", "effect_hi", "effect_attr"):
            np.testing.assert_allclose(found[column], expected[column], rtol=1e-4, atol=1e-6, err_msg=family)
        streamed_families.append(family)
    assert len(streamed_families) == len(FAMILIES) - 1


def test_all_zero_attention_is_the_loaded_paths_error(tmp_path):
    zero = {name: torch.zeros_like(t) for name, t in random_gpt2_state(2, 4, 64, 128, 512).items()}
    folder = save_synthetic(tmp_path / "zero", weights=zero)
    with pytest.raises(BadWeights) as loaded:
        load_model(folder, device="cpu")
    with pytest.raises(BadWeights) as streamed:
        list(open_model(folder, device="cpu").head_layers())
    assert str(streamed.value) == str(loaded.value) == ("W_Q is zero in every head: the checkpoint holds no "
                                                        "attention weights to compare")


@pytest.mark.parametrize("damage", ["nan_in_an_mlp", "missing_tensor", "wrong_shape"])
def test_weights_load_model_refuses_are_refused_before_any_pk(tmp_path, damage):
    folder = save_synthetic_gqa(tmp_path / damage)
    state = load_file(str(folder / "model.safetensors"))
    if damage == "nan_in_an_mlp":
        state["model.layers.1.mlp.up_proj.weight"][3, 2] = float("nan")
    elif damage == "missing_tensor":
        del state["model.layers.1.self_attn.k_proj.weight"]
    else:
        state["model.layers.0.self_attn.v_proj.weight"] = state["model.layers.0.self_attn.v_proj.weight"][:-1]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadWeights) as loaded:
        load_model(folder, device="cpu")
    with pytest.raises(BadWeights) as streamed:
        list(open_model(folder, device="cpu").head_layers())
    name = {"nan_in_an_mlp": "mlp.up_proj", "missing_tensor": "k_proj", "wrong_shape": "v_proj"}[damage]
    assert name in str(streamed.value) and name in str(loaded.value)


def test_an_encoder_decoder_folder_gets_load_models_error(tmp_path):
    from transformers import BartConfig, BartForConditionalGeneration

    from headgraph.loader.models import quiet

    config = BartConfig(vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    with quiet():
        BartForConditionalGeneration(config).save_pretrained(str(tmp_path / "bart"))
    with pytest.raises(ModelUnavailable, match="unsupported architecture"):
        open_model(tmp_path / "bart", device="cpu")
