"""A checkpoint's attention weights read one layer at a time, so the PK stages never hold the model.

`open_streamed(folder, processing, device)` boots TransformerLens' bridge over the model's Hugging Face skeleton
with no weights (every parameter a zero-stride stand-in during the boot, then on the meta device), which gives
the run its config, dimensions and TransformerLens-configured tokenizer for the price of a few MB. Its
`head_layers()` then reads each layer's tensors from the safetensors shards (memory-mapped by safe_open, in
their stored dtype, cast to float32 as `from_pretrained(dtype=float32)` casts them), puts them into that layer
of the skeleton and reads W_Q, W_K, W_V, W_O through the bridge's own properties: the tensor names, fused-QKV
splits and grouped-query layouts are the bridge's, not a table of ours. "tl" runs TransformerLens' own
`ProcessWeights.process_weights` over the bridge's state dict with that layer's attention and ln1 real and every
other tensor on the meta device (so no other arithmetic is done; the MLPs are never read); folding a layer's
norm into its attention and centring its W_O only read those, so the result equals the loaded path's `enable_compatibility_mode()`
(tests/test_stream.py: exact equality on GPT-2 (LayerNorm, fused QKV) and Llama (RMSNorm, grouped-query)).
Adapters with their own pre- or post-processing hooks (e.g. Phi-3, Cohere) do not stream "tl": the whole model
loads as before (`streamable` says why).

The forward passes need the whole model, and run it as the checkpoint stores it: once `allow_loading()` is
called (headgraph.pipeline does, once the PK stages have released what they held), `StreamedModel.bridge` is the
raw checkpoint with its weight matrices held in their stored dtype, each block's upcast to float32 while it runs
and again when a backward pass reads it (headgraph.loader.models.raw_bridge: the float32 model's activations and
gradients at half its bytes for a bf16 checkpoint). The role tests read attention patterns, which TransformerLens'
processing does not change (it folds norms into the weights and centres them, leaving the function as it is);
the causal effects read what the processing does change, each head's W_O and the value bias in its z, through
headgraph.analysis.causal.network's view of a raw bridge under "tl" (tests/test_stream.py: the same effects as
the loaded, processed model).
"""

import contextlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from headgraph.errors import BadWeights, ModelUnavailable, UsageError, first_line

COMPUTABLE = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
INDEX_FILE = "model.safetensors.index.json"
HEAD_WEIGHTS = ("W_Q", "W_K", "W_V", "W_O")


@dataclass(frozen=True)
class Shards:
    """Where each tensor of a checkpoint is (tensor name -> shard file) and its stored dtype, every shard's header
    checked: a missing or truncated shard is BadWeights before any work (and so, judged per parameter when the
    model's parameters are known, is a dtype headgraph cannot compute in: _check_names_and_shapes)."""

    folder: Path
    files: dict[str, Path]
    dtypes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors in float32, each shard opened once and closed after (its pages unmapped)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        out = {}
        for file, wanted in by_file.items():
            with _opened(file) as f:
                out.update({name: f.get_tensor(name).to(torch.float32) for name in wanted})
        return out

    def check_finite(self, names: list[str]) -> None:
        """BadWeights naming the first of `names` with a NaN or Inf, read one tensor at a time in its stored dtype."""
        from headgraph.loader.models import all_finite

        for name in names:
            with _opened(self.files[name]) as f:
                if not all_finite(f.get_tensor(name)):
                    raise BadWeights(f"weights in '{self.folder}' contain NaN or Inf in {name}")


@contextlib.contextmanager
def _opened(file: Path):
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            yield f
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
        if isinstance(e, (BadWeights, UsageError, ModelUnavailable)):
            raise
        raise BadWeights(f"cannot read the weights in '{file}': {first_line(e)}") from None


def checkpoint_shards(folder: Path) -> Shards:
    """The shards of `folder`: those its model.safetensors.index.json names (each must exist), else every
    *.safetensors file in it."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = {str(f) for f in weight_map.values()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BadWeights(f"'{index}' is not a safetensors index (a JSON object with a weight_map): "
                             f"{first_line(e)}") from None
        missing = sorted(n for n in names if not (folder / n).is_file())
        if missing:
            raise BadWeights(f"'{index}' names the shard {missing[0]}, which is not in '{folder}'"
                             + (f" ({len(missing)} shards missing)" if len(missing) > 1 else ""))
        shards = [folder / n for n in sorted(names)]
    else:
        shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelUnavailable(f"folder '{folder}' has no *.safetensors weights")
    files, dtypes, shapes = {}, {}, {}
    for shard in shards:
        with _opened(shard) as f:
            for name in f.keys():
                piece = f.get_slice(name)
                files[name], dtypes[name], shapes[name] = shard, piece.get_dtype(), tuple(piece.get_shape())
    return Shards(folder, files, dtypes, shapes)


def _meta_parameters(module: torch.nn.Module) -> None:
    """Every parameter of `module` that is not on the meta device put there (its memory released)."""
    for sub in module.modules():
        for attr, p in list(sub._parameters.items()):
            if p is not None and p.device.type != "meta":
                sub._parameters[attr] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                           requires_grad=False)


def _uses_own_processing(adapter) -> str | None:
    """Why TransformerLens' processing of this adapter cannot run one layer at a time, or None."""
    from transformer_lens.model_bridge.architecture_adapter import ArchitectureAdapter

    for hook in ("preprocess_weights", "postprocess_weights"):
        if getattr(type(adapter), hook) is not getattr(ArchitectureAdapter, hook):
            return f"{type(adapter).__name__} has its own {hook}"
    if not getattr(adapter, "supports_compatibility_mode", True):
        return f"{type(adapter).__name__} does not support compatibility mode"
    return None


@dataclass(eq=False)
class StreamedModel:
    """A model whose attention weights are read layer by layer (`head_layers`); `cfg`, `name`, `source`,
    `processing` and `tokenizer` as a LoadedModel's (cfg's processing_warnings complete once "tl" has run).
    `bridge` is weightless (config, tokenizer) until `allow_loading()`, then the raw checkpoint's with its matrices
    held in their stored dtype (built on first use, see the module docstring); within `patterns_only()` it is that
    bridge too."""

    name: str
    source: str
    cfg: dict
    processing: str
    device: str
    shards: Shards = field(repr=False)
    skeleton: Any = field(repr=False)  # the weightless bridge
    holders: dict[str, tuple[torch.nn.Module, str]] = field(repr=False)  # checkpoint name -> (module, attribute)
    stored_dtypes: tuple[str, ...] = ()  # those of the parameters' tensors, e.g. ("BF16",)
    _may_load: bool = field(default=False, repr=False)
    _forward: Any = field(default=None, repr=False)  # the raw checkpoint's bridge, for forward passes

    @property
    def tokenizer(self):
        return self.skeleton.tokenizer

    @property
    def bridge(self):
        if self._forward is None and self._may_load:
            self._forward = self._raw_bridge()
        return self.skeleton if self._forward is None else self._forward

    @property
    def patterns_dtype(self) -> torch.dtype:
        """The dtype the forward passes hold the weight matrices in: the checkpoint's when all its parameters are
        bf16 or all float16, else float32."""
        stored = set(self.stored_dtypes)
        return COMPUTABLE[stored.pop()] if stored in ({"BF16"}, {"F16"}) else torch.float32

    def _raw_bridge(self):
        """The raw checkpoint's bridge, given the skeleton's tokenizer as TransformerLens configured it, so that
        its boot loads none again (the 1.1B shape, a 32,000-token tokenizer: 1.0-1.5 s against 2.1-3.2 s)."""
        from headgraph.loader.models import raw_bridge

        return raw_bridge(Path(self.source), self.name, self.device, self.patterns_dtype, self.tokenizer)

    @contextlib.contextmanager
    def patterns_only(self):
        """Within it, `bridge` is the raw checkpoint held in `patterns_dtype`, computing in float32 one block at a
        time (headgraph.loader.models.raw_bridge): for forward passes that read attention patterns only. Released
        on exit unless `allow_loading()` keeps it for the causal effects."""
        made = self._forward is None and not self._may_load
        if made:
            self._forward = self._raw_bridge()
        try:
            yield self
        finally:
            if made:
                self._forward = None

    def allow_loading(self) -> None:
        """From now on the first use of `bridge` builds the raw checkpoint's bridge for forward passes and keeps
        it."""
        self._may_load = True

    def head_layers(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each layer's {"W_Q": [H, d, k], "W_K", "W_V": [KV, d, k], "W_O": [H, k, d]} in float32, in the
        processing asked, read from the shards one layer at a time. Every tensor of the layer is checked as
        load_model checks them (the MLP's read one at a time and dropped); BadWeights for a non-finite tensor, or
        once the last layer is read, for a W_* that is zero in every head."""
        blocks = self.skeleton.adapter.component_mapping["blocks"]
        mlp = blocks.submodules["mlp"].name if "mlp" in blocks.submodules else None
        nonzero = dict.fromkeys(HEAD_WEIGHTS, False)
        for layer in range(self.cfg["n_layers"]):
            prefix = f"{blocks.name}.{layer}."
            names = [n for n in self.holders if n.startswith(prefix)]
            wanted = [n for n in names if self._whole_layers or mlp is None or not n.startswith(f"{prefix}{mlp}.")]
            self.shards.check_finite([self._stored_name(n) for n in names if n not in wanted])
            tensors = self.shards.read([self._stored_name(n) for n in wanted])
            for name in wanted:
                module, attr = self.holders[name]
                module._parameters[attr] = torch.nn.Parameter(tensors.pop(self._stored_name(name)),
                                                              requires_grad=False)
            block = self.skeleton.blocks[layer]
            try:
                weights = _checked(self._layer_weights(layer), layer, self.cfg, self.shards.folder, wanted, self.holders)
                nonzero = {n: nonzero[n] or bool(weights[n].any()) for n in HEAD_WEIGHTS}
                yield weights
            finally:
                for name in wanted:
                    module, attr = self.holders[name]
                    module._parameters[attr] = torch.nn.Parameter(
                        torch.empty(module._parameters[attr].shape, device="meta"), requires_grad=False)
                _meta_parameters(block)
        zero = next((n for n in HEAD_WEIGHTS if not nonzero[n]), None)
        if zero is not None:
            raise BadWeights(f"{zero} is zero in every head: the checkpoint holds no attention weights to compare")

    @property
    def _whole_layers(self) -> bool:
        """Whether "tl" reads the whole layer: a block whose attention and MLP read one norm (GPT-J, Phi-2, Falcon)
        folds that norm into both."""
        return self.processing == "tl" and bool(getattr(self.skeleton.cfg, "parallel_attn_mlp", False))

    def _stored_name(self, name: str) -> str:
        """The checkpoint's name of the skeleton's parameter `name` (a base model's checkpoint lacks the prefix)."""
        if name in self.shards.files:
            return name
        prefix = self.skeleton.original_model.base_model_prefix + "."
        for candidate in (name.removeprefix(prefix), prefix + name):
            if candidate in self.shards.files:
                return candidate
        raise BadWeights(f"weights in '{self.shards.folder}' lack the tensor {name}")

    def _layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        attn = self.skeleton.blocks[layer].attn
        if hasattr(attn, "split_qkv_matrix"):  # a fused QKV projection: split again from the real weights
            attn.set_original_component(attn.original_component)
        if self.processing == "tl":
            self._process_layer(layer)
        with torch.no_grad():
            return {n: getattr(attn, n).detach().clone().float() for n in HEAD_WEIGHTS}

    def _process_layer(self, layer: int) -> None:
        """TransformerLens' processing of the whole state dict, every tensor but this layer's on the meta device;
        its processed q, k, v, o weights put into the layer's projections."""
        from transformer_lens.weight_processing import ProcessWeights

        own = f"blocks.{layer}."
        real = (own,) if self._whole_layers else (f"{own}attn.", f"{own}ln1.")
        state = {k: v if k.startswith(real) else torch.empty(v.shape, device="meta")
                 for k, v in self.skeleton.state_dict().items() if k.startswith(own) or not k.startswith("blocks.")}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = ProcessWeights.process_weights(state, self.skeleton.cfg, adapter=self.skeleton.adapter)
        notes = {str(w.message).splitlines()[0] for w in caught if "fold" in str(w.message) or "center" in str(w.message)}
        self.cfg["processing_warnings"] = sorted(set(self.cfg["processing_warnings"]) | notes)  # as load_model's
        for short in ("q", "k", "v", "o"):
            processed = state[f"{own}attn.{short}.weight"]
            if processed.device.type == "meta":
                raise BadWeights(f"TransformerLens' processing of {type(self.skeleton.adapter).__name__} reads more "
                                 f"of layer {layer} than its attention and ln1 to process attn.{short}: analyze "
                                 "with --processing raw")
            linear = self.skeleton.get_submodule(f"blocks.{layer}.attn.{short}").original_component
            linear._parameters["weight"] = torch.nn.Parameter(processed, requires_grad=False)


def _checked(weights: dict[str, torch.Tensor], layer: int, cfg: dict, folder: Path, read: list[str],
             holders: dict) -> dict[str, torch.Tensor]:
    from headgraph.loader.models import all_finite

    bad = next((n for n in read if not all_finite(getattr(*holders[n]))), None)
    if bad is not None:
        raise BadWeights(f"weights in '{folder}' contain NaN or Inf in {bad}")
    H, KV, d, k = (cfg[n] for n in ("n_heads", "n_kv_heads", "d_model", "d_head"))
    expected = {"W_Q": (H, d, k), "W_K": (KV, d, k), "W_V": (KV, d, k), "W_O": (H, k, d)}
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise BadWeights(f"{name} of layer {layer} has shape {tuple(weights[name].shape)}, expected {shape}")
        if not all_finite(weights[name]):
            raise BadWeights(f"{name} of layer {layer} contains NaN or Inf")
    return weights


def _check_names_and_shapes(shards: Shards, holders: dict, skeleton, blocks: str) -> dict[str, str]:
    """What load_model's from_pretrained checks, from the shards' headers: every tensor of the base model present
    (a task head outside it may be missing: from_pretrained initialises it) with the config's shape and a dtype
    headgraph computes in (integer buffers beside the parameters, such as BERT's position_ids, are not read);
    the tensors outside the layers read and checked finite here, one at a time. {parameter: its name in the
    shards}."""
    prefix = skeleton.base_model_prefix
    stored = {}
    for name in holders:
        found = next((c for c in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}") if c in shards.files), None)
        if found is None:
            if not prefix or name.startswith(prefix + "."):
                raise BadWeights(f"weights in '{shards.folder}' lack the tensor {name}")
            continue
        stored[name] = found
        module, attr = holders[name]
        expected = tuple(module._parameters[attr].shape)
        if shards.shapes[found] != expected:
            raise BadWeights(f"weights in '{shards.folder}' do not match the config: {found} has shape "
                             f"{shards.shapes[found]}, expected {expected}")
    bad = sorted({shards.dtypes[found] for found in stored.values()} - set(COMPUTABLE))
    if bad:
        example = next(found for found in stored.values() if shards.dtypes[found] == bad[0])
        raise BadWeights(f"weights in '{shards.folder}' are stored as {', '.join(bad)} (e.g. {example}), which "
                         f"headgraph cannot compute in: it reads {', '.join(COMPUTABLE)} and computes in float32; "
                         "dequantize the checkpoint first")
    shards.check_finite([stored[n] for n in stored if not n.startswith(blocks + ".")])
    return stored


def open_streamed(folder: Path, name: str, processing: str, device: str, tokenizer=None) -> StreamedModel:
    """The weightless bridge of the model in `folder` and its checked shards (see the module docstring).
    ModelUnavailable / BadWeights / UsageError as load_model raises them; RuntimeError("not streamable: ...")
    where the bridge cannot be booted without weights or "tl" cannot run a layer at a time."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.model_bridge.sources._hf_format import determine_architecture_from_hf_config
    from transformer_lens.model_bridge.sources.transformers.helpers import get_hf_model_class_for_architecture
    from transformers import AutoConfig

    from headgraph.loader.models import check_attention_implementation, check_head_counts, model_dims, quiet

    shards = checkpoint_shards(folder)
    try:
        check_attention_implementation(json.loads((folder / "config.json").read_text()), folder)
        config = AutoConfig.from_pretrained(str(folder), output_attentions=True, attn_implementation="eager",
                                            local_files_only=True)
        model_class = get_hf_model_class_for_architecture(determine_architecture_from_hf_config(config))
    except (OSError, ValueError, KeyError) as e:
        raise ModelUnavailable(f"cannot read the model config in '{folder}': {first_line(e)}") from None
    check_head_counts(config, folder)
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "quantization_config", None) is not None:
        raise RuntimeError("not streamable: load_model judges encoder-decoder and quantized checkpoints")
    with quiet():
        with torch.device("meta"):
            skeleton = model_class.from_config(config, attn_implementation="eager")
        holders = {}
        for pname, p in skeleton.named_parameters():
            module_name, _, attr = pname.rpartition(".")
            module = skeleton.get_submodule(module_name)
            holders[pname] = (module, attr)
            module._parameters[attr] = torch.nn.Parameter(torch.zeros((), dtype=torch.float32).expand(p.shape),
                                                          requires_grad=False)
        try:
            bridge = TransformerBridge.boot_transformers(str(folder), hf_model=skeleton, device=device,
                                                         tokenizer=tokenizer)
        except Exception as e:  # noqa: BLE001 - any boot failure means: load the whole model instead
            raise RuntimeError(f"not streamable: the bridge does not boot without weights ({first_line(e)})") from None
    _meta_parameters(bridge)
    stored = _check_names_and_shapes(shards, holders, skeleton, bridge.adapter.component_mapping["blocks"].name)
    why = _uses_own_processing(bridge.adapter) if processing == "tl" else None
    if why is not None:
        raise RuntimeError(f"not streamable: {why}")
    cfg = model_dims(bridge) | {"processing_warnings": []}
    dtypes = tuple(sorted({shards.dtypes[n] for n in stored.values()}))
    return StreamedModel(name=name, source=str(folder), cfg=cfg, processing=processing, device=device,
                         shards=shards, skeleton=bridge, holders=holders, stored_dtypes=dtypes)


def patterns_only(model):
    """A context in which `model` (a StreamedModel or a LoadedModel) runs forward passes that read attention
    patterns only: a StreamedModel's patterns_only(), a LoadedModel as it is."""
    return model.patterns_only() if isinstance(model, StreamedModel) else contextlib.nullcontext(model)


def open_model(model, processing: str = "tl", device: str | None = None, tokenizer=None):
    """A StreamedModel where the model is a folder or name whose weights can be read a layer at a time, else
    (a model passed in, an architecture that does not stream) headgraph.loader.models.load_model's LoadedModel."""
    from headgraph.loader.models import PROCESSINGS, default_device, describe_model, load_model

    if processing not in PROCESSINGS:
        raise UsageError(f"processing must be one of {', '.join(PROCESSINGS)}, got '{processing}'")
    device = device or default_device()
    if isinstance(model, (str, Path)):
        name, source = describe_model(model)
        try:
            return open_streamed(Path(source), name, processing, device, tokenizer)
        except RuntimeError:
            pass  # not streamable: the whole model, as before
    return load_model(model, processing=processing, device=device, tokenizer=tokenizer)
