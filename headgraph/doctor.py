"""`headgraph doctor`: what this installation has — versions, torch device, stores, offline models, and the
model families with what headgraph computes on each."""

from __future__ import annotations

import importlib.util
import os
import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from headgraph.errors import HeadgraphError

PACKAGES = ("headgraph", "torch", "transformer-lens", "transformers", "numpy", "scipy", "networkx", "neo4j",
            "ladybug", "pyarrow", "matplotlib")


def versions() -> dict[str, str]:
    """Installed versions of Python and the packages headgraph stands on."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def torch_device() -> str:
    """The device analyses use by default: the CUDA GPU's name when there is one, else cpu."""
    import torch

    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    return "cpu (no CUDA device)"


def neo4j_status(uri: str | None, user: str, password: str) -> str:
    """Reachability of the Neo4j server at `uri` (or why it is not used)."""
    if not uri:
        return "not configured (set NEO4J_URI or pass --neo4j; scripts/neo4j-local start runs one here)"
    from headgraph.loader.neo4j_store import connect

    try:
        driver = connect(uri, user, password)
    except HeadgraphError as e:
        return f"unreachable: {e}"
    with driver:
        info = driver.get_server_info()
    return f"reachable at {uri}, {info.agent}"


def embedded_status(path: str) -> str:
    """Where the embedded store is and what a reader finds there: its runs by status, or why it cannot read."""
    if not os.path.exists(path):
        return f"{os.path.abspath(path)} (will be created on first store)"
    from headgraph.loader.ladybug_store import LadybugStore

    try:
        with LadybugStore(path, read_only=True) as store:
            statuses = [run["status"] for run in store.runs()]
    except HeadgraphError as e:
        return f"{os.path.abspath(path)} (unreadable: {e})"
    counts = ", ".join(f"{statuses.count(s)} {s}" for s in sorted(set(statuses))) or "no runs"
    return f"{os.path.abspath(path)} (readable: {counts})"


@dataclass(frozen=True)
class Family:
    """A model family and what headgraph computes on it, as checked on a tiny checkpoint of it
    (headgraph.testing.families, tests/test_families.py). `adapter` names TransformerLens' module for it."""

    name: str
    architecture: str
    adapter: str
    pk: bool = True
    roles: bool = True
    causal: bool = True


FAMILIES = (
    Family("GPT-2", "GPT2LMHeadModel", "gpt2"),
    Family("OPT", "OPTForCausalLM", "opt"),
    Family("BERT", "BertForMaskedLM", "bert"),
    Family("RoBERTa", "RobertaForMaskedLM", "roberta"),
    Family("Llama (grouped- and multi-query, Llama 3 rope scaling)", "LlamaForCausalLM", "llama"),
    Family("Qwen2", "Qwen2ForCausalLM", "qwen2"),
    Family("Qwen3 (QK-norm)", "Qwen3ForCausalLM", "qwen3"),
    Family("Mistral (sliding window)", "MistralForCausalLM", "mistral"),
    Family("Gemma 2 (soft-capping, sliding window)", "Gemma2ForCausalLM", "gemma2"),
    Family("Gemma 3 (QK-norm)", "Gemma3ForCausalLM", "gemma3"),
    Family("Pythia / GPT-NeoX (partial rotary, parallel)", "GPTNeoXForCausalLM", "neox"),
    Family("Phi-3", "Phi3ForCausalLM", "phi3"),
    Family("OLMo-2 (QK-norm, norms after attention)", "Olmo2ForCausalLM", "olmo2"),
    Family("GPT-J (parallel)", "GPTJForCausalLM", "gptj"),
    Family("Phi-2 (partial rotary, parallel)", "PhiForCausalLM", "phi"),
    Family("BLOOM (ALiBi)", "BloomForCausalLM", "bloom"),
    Family("MPT (ALiBi)", "MptForCausalLM", "mpt"),
    Family("Falcon (multi-query)", "FalconForCausalLM", "falcon"),
)


def _adapters_dir() -> Path | None:
    """TransformerLens' folder of architecture adapters, found without importing it (that takes seconds)."""
    spec = importlib.util.find_spec("transformer_lens")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "model_bridge" / "supported_architectures"


def family_rows() -> list[tuple[str, str]]:
    """One row per model family: its architecture, what headgraph computes on it, and whether the installed
    TransformerLens has its adapter (without one, the family does not load at all)."""
    adapters = _adapters_dir()
    rows = []
    for f in FAMILIES:
        if adapters is None or not (adapters / f"{f.adapter}.py").is_file():
            rows.append((f.name, f"{f.architecture}: no adapter in the installed TransformerLens"))
            continue
        stages = {"PK": f.pk, "roles": f.roles, "causal": f.causal}
        missing = [name for name, ok in stages.items() if not ok]
        value = f"{f.architecture}: " + ", ".join(name for name, ok in stages.items() if ok)
        rows.append((f.name, value + (f" (no {', '.join(missing)} yet)" if missing else "")))
    return rows


def report(db: str, neo4j_uri: str | None, user: str, password: str) -> list[tuple[str, str]]:
    """All the facts doctor prints, as (label, value) rows."""
    from headgraph.loader.models import offline_models

    rows = [(name, version) for name, version in versions().items()]
    rows += [
        ("torch device", torch_device()),
        ("neo4j server", neo4j_status(neo4j_uri, user, password)),
        ("embedded store", embedded_status(db)),
        ("offline models", ", ".join(offline_models()) or "none"),
    ]
    return rows + family_rows()
