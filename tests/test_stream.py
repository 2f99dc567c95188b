"""Weights streamed layer by layer (headgraph.loader.stream): the same weights as the loaded model for raw and
TransformerLens processing, the same analysis (pairs, PK, roles, effects), a PK stage whose memory does not grow
with the model, and damaged checkpoints refused in one line with nothing stored."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from _cli import run_cli
from headgraph.analysis.options import DEFAULT_MEMORY
from headgraph.loader.models import load_model
from headgraph.loader.stream import StreamedModel, open_model
from headgraph.testing.synthetic import as_bf16, save_synthetic, save_synthetic_gqa

ROOT = Path(__file__).resolve().parents[1]


def perturbed(folder: Path, seed: int = 1) -> Path:
    """The checkpoint with every norm weight and bias moved off 1 / 0, so that folding them changes W_Q ... W_O."""
    state = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, value in state.items():
        if "ln" in name or "norm" in name or name.endswith("bias"):
            state[name] = value + 0.3 * torch.randn(value.shape, generator=g)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny GPT-2 (LayerNorm, fused QKV) and a tiny Llama (RMSNorm, 4 query heads on 2 KV heads), norms random."""
    root = tmp_path_factory.mktemp("stream")
    return {"gpt2": perturbed(save_synthetic(root / "gpt2", n_layers=3)),
            "llama": perturbed(save_synthetic_gqa(root / "llama", n_layers=3))}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("processing", ["raw", "tl"])
def test_streamed_weights_equal_the_loaded_models(checkpoints, family, processing):
    streamed = open_model(checkpoints[family], processing=processing, device="cpu")
    loaded = load_model(checkpoints[family], processing=processing, device="cpu")
    assert isinstance(streamed, StreamedModel) and streamed.cfg == loaded.cfg
    layers = list(streamed.head_layers())
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        torch.testing.assert_close(torch.stack([w[name] for w in layers]), getattr(loaded, name), atol=0, rtol=0)
    raw = load_model(checkpoints[family], processing="raw", device="cpu")
    assert (processing == "tl") == (not torch.equal(raw.W_Q, loaded.W_Q))  # the processing did fold the norms
    assert streamed._forward is None  # nothing loaded the whole model


def test_integer_and_boolean_buffers_stored_beside_the_parameters_are_not_read(checkpoints, tmp_path):
    """A GPT-2 whose safetensors also hold what hub checkpoints carry beside the parameters (GPT-2 and Pythia:
    a boolean causal mask per layer; BERT: int64 position_ids): streamed, its weights are the clean copy's."""
    folder = tmp_path / "with-buffers"
    shutil.copytree(checkpoints["gpt2"], folder)
    state = load_file(str(folder / "model.safetensors"))
    blocks = sorted({n.removesuffix("attn.c_attn.weight") for n in state if n.endswith("attn.c_attn.weight")})
    extra = {f"{block}attn.bias": torch.ones(1, 1, 8, 8, dtype=torch.bool).tril() for block in blocks}
    extra["position_ids"] = torch.arange(8)[None]
    save_file({**state, **extra}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    streamed, clean = (open_model(f, processing="raw", device="cpu") for f in (folder, checkpoints["gpt2"]))
    assert isinstance(streamed, StreamedModel) and streamed.stored_dtypes == ("F32",) and len(blocks) == 3
    for ours, theirs in zip(streamed.head_layers(), clean.head_layers(), strict=True):
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            torch.testing.assert_close(ours[name], theirs[name], atol=0, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_composition_scores_from_the_streamed_factors_equal_those_of_the_weights(checkpoints, family):
    """CS computed from the bases and k x k factors the streamed PK keeps, against composition_scores of the loaded
    model's full W_Q ... W_O (itself tested equal to TransformerLens' in tests/test_composition.py)."""
    from headgraph.analysis.composition import composition_scores
    from headgraph.analysis.pk import pair_mask
    from headgraph.pipeline import compute_pk

    loaded = load_model(checkpoints[family], device="cpu")
    types = ("OQ", "OK", "OV") if family == "gpt2" else ("OQ",)
    pairs = compute_pk(open_model(checkpoints[family], device="cpu"), types, progress=False, null_heads=20,
                       reference_samples=1000).pairs
    n_heads = loaded.cfg["n_heads"]
    layers = torch.arange(loaded.cfg["n_layers"]).repeat_interleave(n_heads)
    mask = pair_mask(layers, layers, full_matrix=False, same_type=False)
    for tp in types:
        expected = composition_scores(loaded.W_Q, loaded.W_K, loaded.W_V, loaded.W_O, tp[1], mask, 2**30)
        rows = pairs[pairs.source_type + pairs.target_type == tp]
        src = torch.tensor((rows.source_layer * n_heads + rows.source_head).to_numpy(copy=True))  # pandas: read-only
        tgt = torch.tensor((rows.target_layer * n_heads + rows.target_head).to_numpy(copy=True))
        np.testing.assert_allclose(rows.cs, expected[src, tgt].numpy(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3", "bert"])
def test_the_role_patterns_of_a_bf16_checkpoint_are_the_float32_models(family, tmp_path):
    """Within patterns_only() a bf16 checkpoint's matrices stay bf16, one block's upcast while it runs, and its
    attention patterns equal those of the checkpoint loaded in float32 (load_model, raw weights) bit for bit."""
    from headgraph.analysis.patterns import capture_patterns
    from headgraph.analysis.roles import input_set, input_set_names
    from headgraph.testing.families import save_family

    folder = as_bf16(save_family(family, tmp_path / family))
    streamed = open_model(folder, device="cpu")
    float32 = load_model(folder, processing="raw", device="cpu")
    inputs = input_set(float32, input_set_names(float32.cfg["is_decoder"])[0], 6, 0)
    with streamed.patterns_only() as model:
        assert streamed.patterns_dtype == torch.bfloat16
        patterns = capture_patterns(model.bridge, inputs)
        blocks = {p.dtype for block in model.bridge.blocks for p in block.parameters() if p.dim() >= 2}
    assert blocks == {torch.bfloat16}  # every block's matrices back in their stored dtype after the pass
    assert torch.equal(patterns, capture_patterns(float32.bridge, inputs))
    assert streamed._forward is None


def _float32_bytes() -> int:
    """Bytes of the float32 tensors Python holds (each storage once; type(), not isinstance: a dead weak proxy
    among the objects raises on any attribute read)."""
    import gc

    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in gc.get_objects()
            if issubclass(type(t), torch.Tensor) and t.dtype == torch.float32 and not t.is_meta}
    return sum(held.values())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_repeated_passes_of_a_bf16_checkpoint_hold_no_more_float32_copies(family, tmp_path):
    """The float32 copies a bf16 checkpoint's blocks run on are reused from pass to pass: GPT-2's fused QKV
    splits into strided views of its c_attn weight, whose copies are laid out otherwise (a pool keyed by the
    copy's layout grew by every such view on every pass: 13.3 GiB in the loss stage of a GPT-2-small shape)."""
    from headgraph.analysis.patterns import capture_patterns
    from headgraph.analysis.roles import input_set, input_set_names
    from headgraph.testing.families import save_family

    folder = as_bf16(save_family(family, tmp_path / family))
    streamed = open_model(folder, device="cpu")
    with streamed.patterns_only() as model:
        inputs = input_set(model, input_set_names(model.cfg["is_decoder"])[0], 6, 0)
        held = []
        for _ in range(3):
            capture_patterns(model.bridge, inputs)
            held.append(_float32_bytes())
    assert held[1] == held[2], held


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_causal_stages_read_a_checkpoints_attention_weights_in_place(family, tmp_path):
    """The Net of the causal stages holds no copy of a bf16 checkpoint's W_Q, W_K, W_V, nor of W_O where the
    processing leaves it as stored (an RMSNorm model; GPT-2's LayerNorm centres it): each layer's is a view of the
    bridge's own parameter, so `nbytes` (what their budget counts) is less than one stored copy of the attention
    weights (a stack of every layer's copied them all: 2.7 GB of a Llama-3-8B shape's budget)."""
    from headgraph.analysis.causal.network import network
    from headgraph.analysis.roles import input_set, input_set_names
    from headgraph.testing.families import save_family

    streamed = open_model(as_bf16(save_family(family, tmp_path / family)), device="cpu")
    streamed.allow_loading()
    net = network(streamed, input_set(streamed, input_set_names(True)[0], 2, 0).batch(0, 1))
    own = {p.untyped_storage().data_ptr() for p in streamed.bridge.parameters()}
    in_place = ("W_Q", "W_K", "W_V") if family == "gpt2" else ("W_Q", "W_K", "W_V", "W_O")
    for name in in_place:
        assert len(net.weights[name]) == streamed.cfg["n_layers"]
        assert all(w.dtype == torch.bfloat16 and w.untyped_storage().data_ptr() in own for w in net.weights[name])
    stored = sum(w.numel() * 2 for name in ("W_Q", "W_K", "W_V", "W_O") for w in net.weights[name])
    assert net.nbytes < stored


_FRAGMENTED = """
import torch
from headgraph.analysis.heap import release_freed

def anon():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) * 1024

block = torch.zeros(4 * 2**20)  # a 16 MB block freed: glibc's mmap threshold rises above the MB tensors below
del block
kept, freed = [], []
for _ in range(300):  # 1 MB tensors, each followed by a small one that stays: the heap cannot shrink from the top
    freed.append(torch.ones(2**18))
    kept.append(torch.ones(64))
freed.clear()
before = anon()
print(release_freed(), before - anon())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap, read in /proc")
def test_memory_freed_between_live_tensors_goes_back_to_the_system():
    """300 MB freed between tensors still in use stays in glibc's heap, counted in RSS (and in the next stage's
    peak), until release_freed gives its pages back (a fresh process: its heap is only this)."""
    found = subprocess.run([sys.executable, "-c", _FRAGMENTED], capture_output=True, text=True, check=True)
    released, given_back = found.stdout.split()
    assert released == "True" and int(given_back) > 250 * 2**20, found.stdout


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if not line[:1].isupper():  # a mapping's first line: "start-end perms ..."
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise, read in /proc")
def test_fresh_memory_is_advised_for_huge_pages_and_keeps_its_values():
    """huge_pages_for marks a new mapping's memory for transparent huge pages (VmFlags "hg"): a float32 copy of a
    tens-of-MB weight matrix is then faulted in 2 MiB at a time; empty_mapped does so above glibc's largest mmap
    threshold only, leaving the heap's memory as it is."""
    from headgraph.analysis.heap import MAPPED_BYTES, empty_mapped, huge_pages_for

    def middle(tensor):
        return tensor.untyped_storage().data_ptr() + tensor.untyped_storage().nbytes() // 2

    fresh = torch.empty(16 * 2**20)  # 64 MiB: a mapping of its own
    assert "hg" not in _vm_flags(middle(fresh))
    assert huge_pages_for(fresh) is fresh and "hg" in _vm_flags(middle(fresh))
    stored = torch.randn(16 * 2**20).bfloat16()
    assert torch.equal(fresh.copy_(stored), stored.float())
    above, below = empty_mapped(fresh, MAPPED_BYTES // 4 + 1024), empty_mapped(fresh, 2**16)
    assert above.shape == (MAPPED_BYTES // 4 + 1024,) and "hg" in _vm_flags(middle(above))
    assert below.shape == (2**16,) and "hg" not in _vm_flags(middle(below))


def test_the_float32_copies_not_pooled_are_advised_for_huge_pages(tmp_path, monkeypatch):
    """Each weight matrix of a bf16 checkpoint upcast whole for a pass outside the pool of small copies (every one
    here, the pool's size set to 0: GPT-2's Conv1D matrices, which are not torch Linears, and its position
    embedding; the patterns' pass stopping before the unembedding) is allocated in huge pages, and the patterns stay
    the float32 model's bit for bit."""
    from headgraph.analysis import heap
    from headgraph.analysis.patterns import capture_patterns
    from headgraph.analysis.roles import input_set, input_set_names
    from headgraph.loader import models
    from headgraph.testing.families import save_family

    advised = []
    monkeypatch.setattr(models, "_POOLED_BYTES", 0)
    monkeypatch.setattr(heap, "MAPPED_BYTES", 0)  # each copy taken for a mapping of its own
    monkeypatch.setattr(heap, "huge_pages_for", lambda t: advised.append(tuple(t.shape)) or t)
    folder = as_bf16(save_family("gpt2", tmp_path / "gpt2"))
    streamed = open_model(folder, device="cpu")
    float32 = load_model(folder, processing="raw", device="cpu")
    inputs = input_set(float32, input_set_names(True)[0], 6, 0)
    with streamed.patterns_only() as model:
        patterns = capture_patterns(model.bridge, inputs)
        token = model.bridge.embed.original_component  # its rows looked up, not copied whole
        matrices = sorted(tuple(p.shape) for m in model.bridge.modules() if type(m) is not torch.nn.Linear and
                          m is not token for p in m._parameters.values() if p is not None and p.dtype == torch.bfloat16)
    assert len(matrices) == 9 and sorted(advised) == matrices  # 2 x (fused QKV, W_O, MLP's two), position embedding
    assert torch.equal(patterns, capture_patterns(float32.bridge, inputs))


def test_a_linears_bf16_weight_is_multiplied_by_chunks_of_rows_both_ways(tmp_path, monkeypatch):
    """A bf16 Llama's Linears (every block matrix, and the unembedding) are never upcast whole: their rows are
    upcast 5 at a time into one buffer per width, forward and backward (`_StoredLinear`). While a module runs, its
    weights read as float32 (the bridge casts the attention's output to W_O's dtype); after, they are the stored
    bf16 tensors again. Patterns, logits and the gradient of the loss at every layer's z equal the float32
    model's to float32 rounding: a product by chunks of a matrix's rows is not bit for bit the whole product on
    every BLAS (on an AMD EPYC, torch's x @ W.T by chunks of 5 rows differs from one product by up to 1e-5 of
    values near 10; on the Xeons before it, not at all)."""
    from headgraph.analysis import heap
    from headgraph.analysis.patterns import capture_patterns
    from headgraph.analysis.roles import input_set, input_set_names
    from headgraph.loader import models
    from headgraph.testing.families import save_family

    whole, chunked, dtypes, real = [], [], [], heap.float32_rows
    monkeypatch.setattr(heap, "ROW_CHUNK_BYTES", 5 * 128 * 4)  # 5 rows of the MLP's [64, 128] down matrix at once
    monkeypatch.setattr(heap, "ROW_CHUNK_ROWS", 1)
    monkeypatch.setattr(models, "_float32", lambda stored: whole.append(tuple(stored.shape)) or stored.float())
    monkeypatch.setattr(heap, "float32_rows", lambda weight, buffer: chunked.append(
        (tuple(weight.shape), tuple(buffer.shape))) or real(weight, buffer))
    folder = as_bf16(save_family("llama", tmp_path / "llama"))
    streamed = open_model(folder, device="cpu")
    float32 = load_model(folder, processing="raw", device="cpu")
    inputs = input_set(float32, input_set_names(True)[0], 6, 0)
    ids, mask = inputs.input_ids, inputs.attention_mask
    names = [f"blocks.{layer}.attn.hook_z" for layer in range(float32.bridge.cfg.n_layers)]

    def gradients(bridge):
        kept = {}

        def keep(name):
            def hook(value, hook):
                kept[name] = value.detach().requires_grad_()
                return kept[name]
            return hook

        with torch.enable_grad():
            loss = bridge.run_with_hooks(ids, return_type="loss", attention_mask=mask,
                                         fwd_hooks=[(name, keep(name)) for name in names])
            return torch.autograd.grad(loss, [kept[name] for name in names])

    with streamed.patterns_only() as model:
        bridge = model.bridge
        o_proj = bridge.blocks[0].attn.o.original_component
        stored = {name: (p.data_ptr(), p.dtype) for name, p in bridge.named_parameters() if p.dim() == 2}
        handle = o_proj.register_forward_hook(lambda m, a, o: dtypes.append(m.weight.dtype))  # its attention runs
        patterns = capture_patterns(bridge, inputs)
        with torch.no_grad():
            logits = bridge(ids, attention_mask=mask)
        grads = gradients(bridge)
        handle.remove()
        assert {name: (p.data_ptr(), p.dtype) for name, p in bridge.named_parameters() if p.dim() == 2} == stored
        linears = {tuple(m.weight.shape) for m in bridge.modules() if type(m) is torch.nn.Linear}
    assert set(dtype for _, dtype in stored.values()) == {torch.bfloat16} and set(dtypes) == {torch.float32}
    assert whole == [] and {shape for shape, _ in chunked} == linears and (512, 64) in linears  # the unembedding's
    assert {buffer for _, buffer in chunked} == {(10, 64), (5, 128)}  # one per width, ROW_CHUNK_BYTES each
    torch.testing.assert_close(patterns, capture_patterns(float32.bridge, inputs), rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(logits, float32.bridge(ids, attention_mask=mask), rtol=1e-5, atol=1e-6)
    for mine, expected in zip(grads, gradients(float32.bridge), strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-7)


def test_a_pass_under_grad_frees_what_no_backward_pass_freed(tmp_path):
    """What autograd saves in a bf16 checkpoint's blocks goes through their saved-tensor hooks. The part of a
    graph a backward pass does not reach (all of it when none runs; the layers before the earliest tensor a
    gradient is asked of) dies with the pass's output: no tensor of either pass that has a grad_fn is left after
    it. A hook that kept a saved output (an RMSNorm's scale, a softmax's rows) with its grad_fn formed a cycle
    through C++ that gc cannot break, and each gradient pass of the local effects left its first layer's
    activations behind. (Llama: GPT-2's attention bridge keeps its last pattern as an attribute till its next
    pass, and that pattern's graph with it.)"""
    import gc

    from headgraph.analysis.roles import input_set, input_set_names
    from headgraph.testing.families import save_family

    def graph_tensors():
        gc.collect()
        return sum(1 for t in gc.get_objects() if issubclass(type(t), torch.Tensor) and t.grad_fn is not None)

    folder = as_bf16(save_family("llama", tmp_path / "llama"))
    streamed = open_model(folder, device="cpu")
    with streamed.patterns_only() as model:
        bridge = model.bridge
        ids = input_set(model, input_set_names(True)[0], 4, 0).input_ids
        layers = bridge.cfg.n_layers
        assert graph_tensors() == 0
        for asked in (None, layers - 1):
            kept = {}

            def keep(value, hook):
                kept[hook.name] = value
                return value

            with torch.enable_grad():
                out = bridge.run_with_hooks(ids, return_type="logits", fwd_hooks=[
                    (f"blocks.{layer}.attn.hook_pattern", keep) for layer in range(layers)])
                if asked is not None:
                    torch.autograd.grad(out.logsumexp(-1).sum(), kept[f"blocks.{asked}.attn.hook_pattern"])
            assert graph_tensors() > 0
            del out
            kept.clear()
            assert graph_tensors() == 0, asked


def test_the_token_embedding_is_upcast_only_in_the_rows_a_pass_looks_up(tmp_path):
    """A bf16 checkpoint's token embedding runs as a float32 table of the distinct ids of the pass, not of the whole
    vocabulary, and is the stored table again after; the patterns and the loss stay the float32 model's."""
    from headgraph.analysis.patterns import capture_patterns
    from headgraph.analysis.roles import input_set, input_set_names
    from headgraph.testing.families import save_family

    folder = as_bf16(save_family("llama", tmp_path / "llama"))
    streamed = open_model(folder, device="cpu")
    float32 = load_model(folder, processing="raw", device="cpu")
    inputs = input_set(float32, input_set_names(True)[0], 6, 0)
    ids = inputs.input_ids
    seen = []
    with streamed.patterns_only() as model:
        embedding = model.bridge.embed.original_component
        stored = (tuple(embedding.weight.shape), embedding.weight.dtype)
        handle = embedding.register_forward_hook(lambda m, a, o: seen.append((tuple(m.weight.shape), m.weight.dtype)))
        patterns = capture_patterns(model.bridge, inputs)
        handle.remove()
        assert (tuple(embedding.weight.shape), embedding.weight.dtype) == stored
        with torch.no_grad():
            losses = [bridge(ids, return_type="loss", attention_mask=inputs.attention_mask) for bridge in
                      (model.bridge, float32.bridge)]
    assert stored[1] == torch.bfloat16 and seen == [((ids.unique().numel(), stored[0][1]), torch.float32)]
    assert torch.equal(patterns, capture_patterns(float32.bridge, inputs))
    assert torch.equal(losses[0], losses[1])


def analyze(source, out: Path, **settings):
    from headgraph.settings import AnalyzeOptions, CausalOptions, RoleOptions
    from headgraph.analysis.options import PKOptions
    from headgraph.workflow import run_analyze

    options = AnalyzeOptions(pk=PKOptions(types="all", null_heads=20, reference_samples=1000, device="cpu"),
                             roles=RoleOptions(n_inputs=8, design="fixed"),
                             causal=CausalOptions(n_inputs=4, loss_inputs=2, n_boot=50),
                             store=None, report=False, out_dir=str(out), **settings)
    return run_analyze(source, options, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_streamed_analysis_equals_the_loaded_models(checkpoints, tmp_path, family):
    """The folder stored in bf16 with the default options (streamed to the PK, its roles and effects run on the
    weights as stored) against the same checkpoint passed in loaded in float32 and processed: a GPT-2 (LayerNorm,
    biases, tied embeddings) and a Llama (RMSNorm, grouped-query), norms random."""
    folder = as_bf16(shutil.copytree(checkpoints[family], tmp_path / family))
    streamed = analyze(folder, tmp_path / "streamed")
    bridge = load_model(folder, device="cpu").bridge
    loaded = analyze(bridge, tmp_path / "loaded")
    assert streamed.result.run.engine["weights"]["read"].startswith("streamed")
    assert loaded.result.run.engine["weights"]["read"] == "from the loaded model"
    a, b = streamed.result.pairs, loaded.result.pairs
    assert list(zip(a.source, a.target, a.source_type + a.target_type)) == list(zip(b.source, b.target,
                                                                                    b.source_type + b.target_type))
    np.testing.assert_allclose(a.pk, b.pk, atol=1e-6, rtol=0)
    for column in ("effect", "effect_attr", "effect_loss"):
        np.testing.assert_allclose(a[column], b[column], atol=1e-6, rtol=0, equal_nan=True, err_msg=column)
        assert a[column].notna().sum() > 0, column
    heads_a, heads_b = streamed.result.heads, loaded.result.heads
    scores = [c for c in heads_a.columns if c.endswith("_score")]
    assert len(scores) == 5 and list(heads_a.columns) == list(heads_b.columns)
    np.testing.assert_allclose(heads_a[scores], heads_b[scores], atol=1e-6, rtol=0)
    decisions = [c for c in heads_a.columns if c.endswith("_sig")]
    assert heads_a[decisions].equals(heads_b[decisions])


def _analyze_process(source: Path, out: Path, max_memory: int, *flags: str, roles: bool = False,
                     causal: bool = False) -> dict:
    """run.json of `headgraph analyze DIR --max-memory B` (no report or store; roles only if asked, on 8 inputs per
    set; causal effects only if asked, on 2) in a fresh process, as a user runs it."""
    from _fast import PK, flags as as_flags

    stages = as_flags({**PK, **({"roles_n_inputs": 8} if roles else {"roles": False}),
                       **({"causal_n_inputs": 2} if causal else {"causal": False})})
    subprocess.run([sys.executable, "-m", "headgraph", "analyze", str(source), "--out", str(out), "--device", "cpu",
                    "--max-memory", str(max_memory), "--no-store", "--no-report", *stages, *flags],
                   check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600, capture_output=True)
    return json.loads((out / "run.json").read_text())


def _wide_llama(folder: Path, vocab: int, layers: int, d_model: int = 256, heads: int = 8,
                mlp: int = 8192) -> tuple[int, int]:
    """A Llama whose MLPs dwarf its attention (by default: 8 heads on 4 KV heads of 32, MLP 8192) saved in float32
    with its tokenizer; (its bytes, one layer's bytes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from headgraph.loader.models import quiet
    from headgraph.testing.synthetic import save_tokenizer

    config = LlamaConfig(vocab_size=vocab, hidden_size=d_model, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=4, head_dim=32, max_position_embeddings=64,
                         bos_token_id=vocab - 1, eos_token_id=vocab - 1, pad_token_id=vocab - 1,
                         tie_word_embeddings=False)
    with quiet():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model_bytes = sum(p.numel() * 4 for p in model.parameters())
        layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
        model.save_pretrained(str(folder))
    save_tokenizer(folder, vocab)
    return model_bytes, layer_bytes


@pytest.mark.slow
def test_the_pk_stage_holds_no_model_and_stays_within_its_budget(tmp_path):
    """A Llama whose MLP and vocabulary dwarf its attention (about 190 MB of float32 weights, 3 MB of bases): by
    default the PK stage grows the process by less than --max-memory plus one layer's weights; with --no-stream
    (the whole model loaded first) the same stage holds the model, far beyond that --max-memory."""
    folder = tmp_path / "wide"
    model_bytes, layer_bytes = _wide_llama(folder, vocab=32000, layers=4)
    budget = 16 * 2**20
    streamed = _analyze_process(folder, tmp_path / "streamed", budget)
    loaded = _analyze_process(folder, tmp_path / "loaded", budget, "--no-stream")
    assert streamed["engine"]["weights"]["read"].startswith("streamed")
    assert loaded["engine"]["weights"]["read"] == "from the loaded model"
    peak = {name: {stage: run["stages"][stage]["peak_rss_bytes"] for stage in ("load", "pk_and_significance")}
            for name, run in (("streamed", streamed), ("loaded", loaded))}
    grown = peak["streamed"]["pk_and_significance"] - peak["streamed"]["load"]
    assert grown < budget + layer_bytes + 48 * 2**20, (grown, budget, layer_bytes)
    assert peak["loaded"]["pk_and_significance"] - peak["streamed"]["pk_and_significance"] > 0.7 * model_bytes, peak
    assert loaded["n_pairs"] == streamed["n_pairs"]


_LOCAL_PEAK = """
import json, re, sys
from pathlib import Path
from headgraph.analysis.causal import causal_inputs, local_effects
from headgraph.analysis.heap import release_freed
from headgraph.loader.models import load_model

def status(key):
    return int(re.search(rf"^{key}:\\s+(\\d+) kB", Path("/proc/self/status").read_text(), re.M)[1]) * 1024

model = load_model(sys.argv[1], device="cpu")
inputs = causal_inputs(model, 8, seed=0)
local_effects(model, [s.batch(0, 2) for s in inputs], n_boot=10)  # what a first run builds, built
grown = {}
for name, max_memory in json.loads(sys.argv[2]).items():
    release_freed()  # the heap the last run freed given back
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    before = status("VmRSS")
    effects = local_effects(model, inputs, n_boot=10, max_memory=max_memory)
    grown[name] = status("VmHWM") - before
    effects.to_parquet(Path(sys.argv[3]) / f"{name}.parquet")
    del effects
print(json.dumps(grown))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="VmHWM is reset through Linux's /proc")
def test_the_local_effects_hold_batches_within_their_budget(tmp_path):
    """A Llama of 6 layers, d_model 512 (16 heads of 32, 4 KV heads) on 8 inputs per set: a batch of all 8 with
    the gradients of attribution holds 54 or 108 MiB (inputs of 24 or 41 tokens) and takes about as much again to
    build, so under a 96 MiB budget its batches take 3 or 4 inputs, and the local effects grow the process by less
    than 1.5 times the budget (what `batch_bytes` does not count, the products c(W_O) Γ W among it, comes on top:
    104-108 MiB when measured); under the 2 GiB default they take all 8, attribution's passes several points of the
    path each, and grow it by more than twice as much (535-555 MiB when measured). Both runs are one process's, each
    after the heap the last one freed is given back, in either order. The effects are the same either way
    (attribution to float32 rounding of its 6-layer backward passes over batches of other sizes: 2e-6 of its
    largest value)."""
    folder = tmp_path / "llama"
    _wide_llama(folder, vocab=512, layers=6, d_model=512, heads=16, mlp=1024)
    budget = 96 * 2**20
    found = subprocess.run([sys.executable, "-c", _LOCAL_PEAK, str(folder),
                            json.dumps({"small": budget, "large": DEFAULT_MEMORY}), str(tmp_path)],
                           check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                           timeout=600)
    grown = json.loads(found.stdout.strip().splitlines()[-1])
    assert grown["small"] < 1.5 * budget, grown
    assert grown["large"] > 2 * grown["small"], grown
    small, large = (pd.read_parquet(tmp_path / f"{name}.parquet") for name in ("small", "large"))
    np.testing.assert_allclose(small.effect, large.effect, rtol=1e-5, atol=1e-8)
    scale = np.abs(large.effect_attr).max()  # gradients of other batches: sums rounded in another order
    np.testing.assert_allclose(small.effect_attr, large.effect_attr, rtol=0, atol=1e-4 * scale)


def _damaged(checkpoints, tmp_path, how: str) -> Path:
    folder = tmp_path / how
    shutil.copytree(checkpoints["llama"], folder)
    weights = folder / "model.safetensors"
    if how == "truncated":
        os.truncate(weights, weights.stat().st_size // 2)
    elif how == "index_names_a_missing_shard":  # a sharded checkpoint, its second shard deleted
        names = load_file(str(weights))
        first = {n: t for n, t in names.items() if "layers.2." not in n}
        save_file(first, str(folder / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
        weights.unlink()
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: f"model-0000{1 + ('layers.2.' in n)}-of-00002.safetensors"
                                            for n in names}}))
    elif how == "shard_missing_without_index":  # the same two shards, the second and the index gone
        names = load_file(str(weights))
        save_file({n: t for n, t in names.items() if "layers.2." not in n},
                  str(folder / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
        weights.unlink()
    elif how == "integer_dtype":
        state = load_file(str(weights))
        name = next(n for n in state if "q_proj" in n)
        state[name] = (state[name] * 100).to(torch.int8)
        save_file(state, str(weights), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("how, says", [("truncated", "cannot read the weights"),
                                       ("index_names_a_missing_shard", "names the shard model-00002-of-00002"),
                                       ("shard_missing_without_index", "lack the tensor model.layers.2."),
                                       ("integer_dtype", "stored as I8")])
def test_a_damaged_checkpoint_is_one_line_and_stores_nothing(checkpoints, tmp_path, capsys, how, says):
    folder = _damaged(checkpoints, tmp_path, how)
    db, out = tmp_path / "graph.lbdb", tmp_path / "run"
    code, _, err = run_cli(["analyze", str(folder), "--db", str(db), "--out", str(out), "--no-roles", "--no-causal",
                            "--no-report"], capsys)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and says in err and "Traceback" not in err, err
    assert len([line for line in lines if "error" in line.lower()]) == 1, err
    assert not db.exists() and not (out / "run.json").exists()


@pytest.mark.slow
def test_the_forward_passes_hold_a_bf16_checkpoint_in_half_the_memory_of_its_float32_copy(tmp_path):
    """A Llama whose MLPs are nearly all of its 610 MB of float32 weights, saved in bf16 and in float32: the role
    tests and the causal effects of OV pairs (local effects with attribution's backward passes, the same for every
    type, and loss effects) of the bf16 one peak lower by about half the float32 bytes less one layer upcast while
    it runs (the same patterns and effects: test_the_role_patterns_of_a_bf16_checkpoint_are_the_float32_models and
    tests/test_stream_families.py). Its 32 MB matrices are as large as glibc's largest mmap threshold, as a
    billion-parameter model's are: freed, their bytes go back to the system instead of staying in the heap. Both
    run at the default --max-memory, where attribution's passes take several points of the path each, as a user's
    do: the stages saved 247-356 MiB when measured, against the 69 MiB asked, and the two analyses took 33.5 s
    (under 16 MiB, a point a pass: 248-270 MiB saved, 45.5 s)."""
    stages = ("roles", "causal_local", "causal_loss")
    peaks, stored = {}, tmp_path / str(torch.float32)
    model_bytes, layer_bytes = _wide_llama(stored, vocab=512, layers=6, d_model=1024)
    as_bf16(shutil.copytree(stored, tmp_path / str(torch.bfloat16)))  # the same weights, stored in bf16
    for dtype in (torch.bfloat16, torch.float32):
        folder = tmp_path / str(dtype)
        run = _analyze_process(folder, tmp_path / f"{dtype}-run", DEFAULT_MEMORY, "--causal-loss-edges", "2",
                               "--causal-loss-inputs", "2", "--types", "OV", roles=True, causal=True)
        assert f"held in {str(dtype).removeprefix('torch.')}" in run["engine"]["weights"]["forward_dtype"]
        assert "skipped" not in run["causal"], run["causal"]
        peaks[dtype] = {stage: run["stages"][stage]["peak_rss_bytes"] for stage in stages}
    for stage in stages:  # half the float32 bytes, less a layer upcast as it runs and one as the backward reads it
        saved = peaks[torch.float32][stage] - peaks[torch.bfloat16][stage]
        assert saved > model_bytes / 2 - 2 * layer_bytes - 32 * 2**20, (stage, saved, model_bytes, layer_bytes, peaks)
