"""`headgraph stability` and `analyze --stability`: a saved run recomputed under each of STABILITY_VARIANTS, one
setting changed at a time from the settings its record holds, and compared with it (headgraph.analysis.stability);
the report is the run folder's stability.json."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable

from rich.console import Console

from headgraph.analysis.options import STABILITY_VARIANTS, CausalOptions, PKOptions, RoleOptions
from headgraph.analysis.selection import SelectionPolicy
from headgraph.analysis.stability import compare_variant
from headgraph.errors import UsageError
from headgraph.runs import RunFolder, load_run, write_stability
from headgraph.settings import AnalyzeOptions


def rerun_options(run: RunFolder) -> AnalyzeOptions:
    """The settings a run was made with, read off its record (no store, no report): what `run_stability`
    varies one at a time."""
    record = run.record
    pk = PKOptions(types=record.types, full_matrix=record.full_matrix, device=record.device, dtype=record.dtype,
                   seed=record.seed, max_memory=record.max_memory, reference_samples=record.reference["samples"],
                   null_heads=record.null_model["null_heads"])
    roles = None
    if record.roles:
        recorded = {f.name: getattr(record.roles, f.name) for f in dataclasses.fields(RoleOptions)}
        roles = RoleOptions(**{name: value for name, value in recorded.items() if value is not None})
    causal = None
    if record.has_effects:
        per_set = list(record.causal["inputs"].values())
        causal = CausalOptions(n_inputs=max(per_set), ablation=record.causal["ablation"],
                               n_boot=record.causal["n_boot"], loss=False)  # every pair's local effect is compared
    return AnalyzeOptions(processing=record.processing, pk=pk, roles=roles, causal=causal,
                          policy=SelectionPolicy.parse(record.selection), store=None, report=False)


def _variant(options: AnalyzeOptions, name: str) -> AnalyzeOptions | str:
    """The options of one stability variant, or why it cannot run here."""
    import torch

    pk = options.pk
    if name == "float64":
        return dataclasses.replace(options, pk=dataclasses.replace(pk, dtype="float64"))
    if name == "null_seed":
        return dataclasses.replace(options, pk=dataclasses.replace(pk, seed=pk.seed + 1), inputs_seed=pk.seed)
    if name == "inputs":
        if options.roles is None and options.causal is None:
            return "the run has neither role tests nor causal effects"
        return dataclasses.replace(options, inputs_seed=pk.seed + 1)
    if name in ("rank_tol_x10", "rank_tol_div10"):
        factor = 10.0 if name == "rank_tol_x10" else 0.1
        return dataclasses.replace(options, pk=dataclasses.replace(pk, rank_tolerance=pk.rank_tolerance * factor))
    if name == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device"
        if pk.device == "cuda":
            return "the run itself was computed on CUDA"
        return dataclasses.replace(options, pk=dataclasses.replace(pk, device="cuda"))
    raise UsageError(f"unknown stability variant {name!r}: use {', '.join(STABILITY_VARIANTS)}")


def run_stability(run: RunFolder, analyze: Callable, variants=tuple(STABILITY_VARIANTS), console: Console | None = None,
                  progress: bool = True) -> dict:
    """Recompute `run` under each variant with `analyze` (headgraph.workflow.run_analyze, passed in because the
    workflow runs this as one of its stages), compare, and write stability.json into the run folder; returns
    the report."""
    base = rerun_options(run)
    report = {"run": run.record.id, "policy": base.policy.describe(), "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants:
            options = _variant(base, name)
            if isinstance(options, str):
                report["variants"][name] = {"what": STABILITY_VARIANTS[name], "skipped": options}
                continue
            (console or Console(stderr=True)).print(f"stability: {name} ({STABILITY_VARIANTS[name]})")
            outcome = analyze(run.record.model.source, dataclasses.replace(options, out_dir=f"{tmp}/{name}"),
                              console=console, progress=progress)
            other = load_run(outcome.folder)
            compared = compare_variant(run.pairs, other.pairs, run.heads if base.roles else None,
                                       other.heads if base.roles else None, base.policy)
            report["variants"][name] = {"what": STABILITY_VARIANTS[name], "pairs": compared.pairs,
                                        "roles": compared.roles}
    write_stability(run.path, report)
    return report
