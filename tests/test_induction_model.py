"""The shipped in-context-bigram decoder (scripts/train_induction.py): offline by name, and its induction circuit.

The circuit is read from the model's own attention (transformers, eager attention) on sequences generated here,
independently of the training script: a layer-0 head attends to the previous token, every layer-1 head to the
token after the earlier occurrences of the current one; a checkpoint before the phase change has neither.
"""

import numpy as np
import pytest
import torch
from transformers import GPT2LMHeadModel

from headgraph.analysis.roles import compute_roles
from headgraph.loader.models import PACKAGED_MODELS_DIR, load_model, offline_models, resolve_model

FINAL = "induction-2l"
CHECKPOINTS = ("induction-2l-step2000", "induction-2l-step3000", "induction-2l-step4000")
BEFORE = CHECKPOINTS[0]
DISTINCT, JUMP = 12, 0.25  # the training recipe (method note §4)


def bigram_sequences(config, n: int, seed: int) -> torch.Tensor:
    """n sequences: BOS, then a walk on a random successor map over DISTINCT tokens with uniform jumps."""
    rng = np.random.default_rng(seed)
    length = config.n_positions - 1
    ids = np.full((n, 1 + length), config.bos_token_id, dtype=np.int64)
    for row in range(n):
        tokens = rng.choice(config.bos_token_id, size=DISTINCT, replace=False)
        successor = rng.integers(DISTINCT, size=DISTINCT)
        state = rng.integers(DISTINCT)
        for t in range(length):
            if t > 0:
                state = rng.integers(DISTINCT) if rng.random() < JUMP else successor[state]
            ids[row, 1 + t] = tokens[state]
    return torch.from_numpy(ids)


def circuit_attention(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(previous-token, induction) attention [layer, head] of a shipped model on fresh in-context bigrams."""
    model = GPT2LMHeadModel.from_pretrained(str(PACKAGED_MODELS_DIR / name), attn_implementation="eager").eval()
    ids = bigram_sequences(model.config, 256, seed=12345)
    with torch.no_grad():
        att = torch.stack(model(ids, output_attentions=True).attentions, dim=1)  # [batch, layer, head, q, k]
    previous = att.diagonal(offset=-1, dim1=-2, dim2=-1).mean((0, -1))
    q, k = torch.meshgrid(torch.arange(ids.shape[1]), torch.arange(ids.shape[1]), indexing="ij")
    after_occurrence = (ids[:, :, None] == ids[:, None, :].roll(1, dims=-1)) & (k >= 1) & (k < q)
    scored = after_occurrence.any(-1)
    mass = (att * after_occurrence[:, None, None]).sum(-1)
    induction = (mass * scored[:, None, None]).sum((0, -1)) / scored.sum()
    return previous.numpy(), induction.numpy()


def test_shipped_models_resolve_offline_by_name():
    for name in (FINAL, *CHECKPOINTS):
        assert resolve_model(name) == (name, PACKAGED_MODELS_DIR / name)
        assert name in offline_models()
        folder = PACKAGED_MODELS_DIR / name
        assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in folder.iterdir()}
        assert sum(p.stat().st_size for p in folder.iterdir()) < 1_000_000


@pytest.fixture(scope="module")
def final_model():
    return load_model(FINAL, device="cpu")


def test_shipped_model_loads_as_a_decoder_with_its_tokenizer(final_model):
    cfg = final_model.cfg
    assert (cfg["n_layers"], cfg["n_heads"], cfg["d_model"], cfg["is_decoder"]) == (2, 4, 64, True)
    assert final_model.W_Q.shape == (2, 4, 64, 16)
    tokenizer = final_model.tokenizer
    assert tokenizer("t3 t7 t3", add_special_tokens=False)["input_ids"] == [3, 7, 3]
    assert tokenizer.bos_token_id == 64


def test_final_model_has_a_previous_token_head_and_induction_heads():
    previous, induction = circuit_attention(FINAL)
    assert previous[0].max() >= 0.8, previous
    assert (induction[1] >= 0.8).all(), induction


def test_checkpoint_before_the_phase_change_has_no_circuit_head():
    previous, induction = circuit_attention(BEFORE)
    assert previous.max() < 0.5, previous
    assert induction.max() < 0.5, induction


@pytest.mark.slow
def test_role_tests_flag_the_previous_token_head_and_the_induction_heads(final_model):
    previous, _ = circuit_attention(FINAL)
    heads, _ = compute_roles(final_model)
    layer0, layer1 = heads[heads["layer"] == 0], heads[heads["layer"] == 1]
    prev_head = f"L0H{previous[0].argmax()}"
    assert heads.set_index("head").loc[prev_head, "previous_token_sig"]
    assert layer1["induction_sig"].all()
    assert not layer0["induction_sig"].any()
