"""`headgraph doctor`: what this installation has — versions, torch device, stores, offline models."""

from __future__ import annotations

import os
import platform
from importlib import metadata

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
    return rows
