"""The PK of one loaded model: PK_STAGES (subspaces -> projection kernel -> isotropic reference ->
model-matched null -> composition scores), stages of the one protocol of headgraph.stages over the run's
Context, then the pairs and heads tables and the run record. `run_pk` is the PK stage of `headgraph analyze`
(headgraph.workflow); `compute_pk` runs it alone."""

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import get_args

import numpy as np
import pandas as pd
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from headgraph.analysis import significance
from headgraph.analysis.artifacts import HEAD_COLUMNS, PAIR_COLUMNS, SIGNIFICANT_Q, head_index
from headgraph.analysis.composition import composition_scores_from_factors
from headgraph.analysis.pk import PKRequest, pair_mask, pk_pass, plan_bases
from headgraph.analysis.reference import (beta_parameters, histogram_edges, isotropic_log10_p, isotropic_moments,
                                          isotropic_z, kl_divergence, sample_isotropic_pk)
from headgraph.analysis.subspaces import head_statistics, rank_deficient_heads
from headgraph.analysis.options import Device, Dtype, PKOptions
from headgraph.errors import UsageError, check_choice
from headgraph.heads import COMPOSITION_TYPES, WEIGHT_TYPES, head_name, parse_types
from headgraph.runs import AnalysisResult, Dims, ModelInfo, RunRecord
from headgraph.settings import AnalyzeOptions
from headgraph.stages import Context, run_stages

__all__ = ["AnalysisResult", "compute_pk", "checked_pk_options", "run_pk"]

DTYPES = {name: getattr(torch, name) for name in get_args(Dtype)}


@dataclass
class TypePairEdges:
    """The computed pairs of one type pair: flat source / target head indices and per-edge columns."""

    src: np.ndarray
    tgt: np.ndarray
    columns: dict[str, np.ndarray] = field(default_factory=dict)


def resolve_device(device: Device | None) -> Device:
    """None -> CUDA when present, else CPU; an explicit 'cuda' without CUDA is a usage error."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    check_choice(device, Device, "device")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was requested but torch sees no CUDA device; use --device cpu")
    return device


def checked_pk_options(options: PKOptions) -> PKOptions:
    """`options` as the PK stages run them: the types parsed, the device resolved (the one place it is) and the
    memory budget in whole bytes; a setting they cannot run with raises UsageError, before any work."""
    if options.null_heads < 2 or options.reference_samples < 100:
        raise UsageError("null_heads must be >= 2 and reference_samples >= 100")
    return dataclasses.replace(options, types=parse_types(options.types), device=resolve_device(options.device),
                               max_memory=int(options.max_memory))


@contextmanager
def _within_memory():
    """A plan that cannot fit --max-memory is the user's setting: a usage error saying which knob to turn."""
    try:
        yield
    except ValueError as e:
        raise UsageError(f"{e}; raise --max-memory") from e


def _kv_group(model) -> int:
    return model.cfg["n_heads"] // model.cfg.get("n_kv_heads", model.cfg["n_heads"])


def typed_head_name(layer: int, head: int, weight_type: str, kv_group: int) -> str:
    """L{l}H{h}; K/V heads of grouped-query models are native KV heads, named L{l}KV{g}."""
    return head_name(layer, head, kv=kv_group > 1 and weight_type in ("K", "V"))


def _layers(model):
    """The model's per-layer weights: read one layer at a time from its checkpoint (a streamed model's
    `head_layers`), or sliced from a loaded model's W_Q ... W_O."""
    if hasattr(model, "head_layers"):
        yield from model.head_layers()
        return
    for layer in range(model.cfg["n_layers"]):
        yield {name: getattr(model, name)[layer] for name in ("W_Q", "W_K", "W_V", "W_O")}


def _composition_modes(ctx: Context) -> tuple[str, ...]:
    """The CS modes the run computes: OQ / OK / OV among its types (only OQ for grouped-query models)."""
    kv_group = _kv_group(ctx.model)
    return tuple(tp[1] for tp in ctx.options.pk.types if tp in COMPOSITION_TYPES and (kv_group == 1 or tp == "OQ"))


def subspaces(ctx: Context) -> None:
    """Orthonormal bases and numerical ranks of every head for all four weight types, with each type's second
    moment (the null's) and the CS factors, built layer by layer: a streamed model is never held whole."""
    opts = ctx.options.pk
    task = ctx.progress.add_task("subspaces (thin SVD)", total=ctx.model.cfg["n_layers"])

    def layers():
        for weights in _layers(ctx.model):
            yield weights
            ctx.progress.advance(task)

    ctx.statistics = head_statistics(layers(), ctx.model.cfg["n_layers"], DTYPES[opts.dtype],
                                     torch.device(opts.device), opts.rank_tolerance, _composition_modes(ctx))
    ctx.subspaces = ctx.statistics.subspaces


def projection_kernel(ctx: Context) -> None:
    """All-pairs PK of every type pair in one pass: each weight type's vectors built once and shared by the
    type pairs that read it, same-type pairs on their upper triangle, the formulation of lower predicted time
    (kernel rates measured on this machine, cached) under the memory budget."""
    opts = ctx.options.pk
    names = sorted({t for tp in opts.types for t in tp}, key=WEIGHT_TYPES.index)
    bases = {t: ctx.subspaces[t].flat() for t in names}
    layers = {t: ctx.subspaces[t].flat_layers() for t in names}
    requests = {tp: PKRequest(tp[0], tp[1], pair_mask(layers[tp[0]], layers[tp[1]], opts.full_matrix,
                                                      tp[0] == tp[1])) for tp in opts.types}
    with _within_memory():
        plan = plan_bases(bases, requests, opts.max_memory, opts.formulation)
    task = ctx.progress.add_task("projection kernel", total=plan.steps)
    pk = pk_pass(bases, plan, advance=lambda n: ctx.progress.advance(task, n))
    for tp in opts.types:
        src_idx, tgt_idx = (i.numpy() for i in torch.nonzero(requests[tp].mask, as_tuple=True))
        values = pk[tp].cpu().double().numpy()[src_idx, tgt_idx]
        ctx.edges[tp] = TypePairEdges(src_idx, tgt_idx, {"pk": values})
        product = next(p for p in plan.products if any(name == tp for name, _ in p.answers))
        ctx.engine[tp] = {"formulation": plan.formulation, "product": f"{product.left}{product.right}",
                          "symmetric": product.left == product.right, "transposed": dict(product.answers)[tp]}
    ctx.engine["pass"] = plan.describe()


def _edge_ranks(ctx: Context, tp: str) -> tuple[np.ndarray, np.ndarray]:
    edges = ctx.edges[tp]
    src_ranks = ctx.subspaces[tp[0]].ranks.reshape(-1).cpu().numpy()[edges.src]
    tgt_ranks = ctx.subspaces[tp[1]].ranks.reshape(-1).cpu().numpy()[edges.tgt]
    return src_ranks, tgt_ranks


def reference(ctx: Context) -> None:
    """Isotropic z / log10 p per edge, reference moments per (k, k'), KL(random || observed) per type pair."""
    opts = ctx.options.pk
    d = ctx.subspaces["Q"].d_model
    task = ctx.progress.add_task("isotropic reference", total=len(opts.types))
    moments, samples = {}, {}
    widths = {tp: (ctx.subspaces[tp[0]].width, ctx.subspaces[tp[1]].width) for tp in opts.types}
    grid_upper = max(min(w) for w in widths.values())
    edges_grid = histogram_edges(grid_upper, opts.bin_width)
    for tp in opts.types:
        edges = ctx.edges[tp]
        k, k_prime = _edge_ranks(ctx, tp)
        pk = edges.columns["pk"]
        with np.errstate(divide="ignore", invalid="ignore"):
            edges.columns["pk_norm"] = pk / np.sqrt(k * k_prime)
            edges.columns["z_iso"] = isotropic_z(pk, d, k, k_prime)
            edges.columns["log10_p_iso"] = isotropic_log10_p(pk, d, k, k_prime)
        for pair in set(zip(k.tolist(), k_prime.tolist())) | {widths[tp]}:  # the widths: the KL's reference
            mean, var = isotropic_moments(d, *pair)
            defined = min(pair) > 0 and var > 0  # var 0: a subspace as wide as d_model, PK is constant
            a, b = beta_parameters(mean, var, min(pair)) if defined else (np.nan, np.nan)
            moments[f"{pair[0]},{pair[1]}"] = {"k": pair[0], "k_prime": pair[1], "mean": float(mean),
                                               "var": float(var), "beta_a": float(a), "beta_b": float(b)}
        if widths[tp] not in samples:
            samples[widths[tp]] = sample_isotropic_pk(d, *widths[tp], opts.reference_samples, opts.seed)
        ctx.kl[tp] = kl_divergence(samples[widths[tp]], pk, edges_grid, opts.kl_eps) if len(pk) else float("nan")
        ctx.progress.advance(task)
    ctx.reference = {
        "moments": moments,
        "samples": opts.reference_samples,
        "sampler": "bidiagonal beta-Jacobi model (Edelman & Sutton 2008), exact for Haar subspaces",
        "tail": "moment-matched Beta on [0, min(k, k')]; validated to p ~ 1e-5, an extrapolation beyond",
        "kl_grid": {"start": float(edges_grid[0]), "bin_width": opts.bin_width,
                    "n_bins": len(edges_grid) - 1, "eps": opts.kl_eps,
                    "reference_widths": {tp: list(w) for tp, w in widths.items()}},
    }


def model_null(ctx: Context) -> None:
    """p_model per edge against the second-moment null (empirical, Beta-fitted far tail), and BH q_model within
    each type pair."""
    opts = ctx.options.pk
    widths = {t: sub.width for t, sub in ctx.subspaces.items()}
    sets = significance.null_head_sets(ctx.statistics.moments, widths, opts.types, opts.null_heads, opts.seed)
    with _within_memory():
        plan = significance.plan_null(sets, opts.types, opts.max_memory)
    task = ctx.progress.add_task("model-matched null", total=plan.steps)
    nulls = significance.null_pk_samples(sets, plan, advance=lambda n: ctx.progress.advance(task, n))
    for tp in opts.types:
        edges = ctx.edges[tp]
        upper = min(sets[tp[0]][0].shape[2], sets[tp[1]][1].shape[2])
        edges.columns["p_model"] = significance.upper_p(edges.columns["pk"], nulls[tp], upper)
        edges.columns["q_model"] = significance.benjamini_hochberg(edges.columns["p_model"])
    ctx.null = {"name": significance.NULL_NAME, "null_heads": opts.null_heads, "n_values": opts.null_heads**2,
                "empirical_until": f"{significance.TAIL_EXCEEDANCES} null values exceed the edge's PK",
                "far_tail": "Beta on [0, min(k, k')] moment-matched to the null sample (an extrapolation)",
                "pass": plan.describe()}


def composition(ctx: Context) -> None:
    """Composition Scores for the OQ / OK / OV pairs (null where undefined: other type pairs, and OK / OV of
    grouped-query models, whose PK pairs are per native KV head)."""
    opts, stats = ctx.options.pk, ctx.statistics
    wanted = [f"O{mode}" for mode in _composition_modes(ctx)]
    task = ctx.progress.add_task("composition scores", total=max(1, len(wanted)))
    layers = ctx.subspaces["Q"].flat_layers()
    mask = pair_mask(layers, layers, opts.full_matrix, same_type=False)
    for tp in opts.types:
        edges = ctx.edges[tp]
        edges.columns["cs"] = np.full(len(edges.src), np.nan)
        if tp not in wanted:
            continue
        cs = composition_scores_from_factors(ctx.subspaces["O"].bases, stats.composition["O"],
                                             ctx.subspaces[tp[1]].bases, stats.composition[tp[1]], mask,
                                             opts.max_memory)
        edges.columns["cs"] = cs.cpu().double().numpy()[edges.src, edges.tgt]
        ctx.progress.advance(task)


PK_STAGES = (subspaces, projection_kernel, reference, model_null, composition)


def _pairs_table(ctx: Context) -> pd.DataFrame:
    kv_group = _kv_group(ctx.model)
    frames = []
    for tp, edges in ctx.edges.items():
        src_sub, tgt_sub = ctx.subspaces[tp[0]], ctx.subspaces[tp[1]]
        src_layer, src_head = edges.src // src_sub.n_heads, edges.src % src_sub.n_heads
        tgt_layer, tgt_head = edges.tgt // tgt_sub.n_heads, edges.tgt % tgt_sub.n_heads
        sources = [typed_head_name(l, h, tp[0], kv_group) for l, h in zip(src_layer.tolist(), src_head.tolist())]
        targets = [typed_head_name(l, h, tp[1], kv_group) for l, h in zip(tgt_layer.tolist(), tgt_head.tolist())]
        frames.append(pd.DataFrame({
            # str also when empty (a 1-layer model has no earlier -> later pairs)
            "source": pd.Series(sources, dtype=str), "target": pd.Series(targets, dtype=str),
            "source_layer": src_layer, "source_head": src_head, "target_layer": tgt_layer, "target_head": tgt_head,
            "source_type": tp[0], "target_type": tp[1], **edges.columns,
        }))
    pairs = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=PAIR_COLUMNS)
    return pairs[PAIR_COLUMNS]


def _heads_table(ctx: Context) -> pd.DataFrame:
    cfg = ctx.model.cfg
    n_layers, n_heads, kv_group = cfg["n_layers"], cfg["n_heads"], _kv_group(ctx.model)
    table = head_index(n_layers, n_heads)
    layer, index = table["layer"], table["index"]
    for t in WEIGHT_TYPES:
        ranks = ctx.subspaces[t].ranks.cpu().numpy()
        heads_of_type = index // kv_group if t in ("K", "V") else index
        table[f"rank_{t.lower()}"] = ranks[layer, heads_of_type]
    return pd.DataFrame(table)[HEAD_COLUMNS]


def _kl_matrix(ctx: Context) -> list[list[float | None]]:
    return [[ctx.kl.get(s + t) for t in WEIGHT_TYPES] for s in WEIGHT_TYPES]


def _run_record(ctx: Context, pairs: pd.DataFrame) -> RunRecord:
    """The record of the PK's facts; headgraph.workflow completes it, once, with what the later stages did."""
    model, opts, cfg = ctx.model, ctx.options.pk, ctx.model.cfg
    by_type = pairs.groupby(pairs.source_type + pairs.target_type)
    kv_group = _kv_group(model)
    return RunRecord(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        model=ModelInfo(model.name, str(model.source), cfg.get("architecture"), cfg.get("is_decoder")),
        dims=Dims(**{key: cfg.get(key) for key in ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "n_ctx")}),
        processing=model.processing,
        processing_warnings=tuple(cfg.get("processing_warnings", [])),
        device=opts.device,
        dtype=opts.dtype,
        seed=opts.seed,
        types=tuple(opts.types),
        pairs="full matrix (all pairs but a head with its own same-type subspace)" if opts.full_matrix
        else "earlier layer -> strictly later layer",
        full_matrix=opts.full_matrix,
        n_pairs={tp: int(n) for tp, n in by_type.size().items()},
        max_memory=opts.max_memory,
        engine=ctx.engine,
        timings_s={name: stage.seconds for name, stage in ctx.pk_stages.items()},
        reference=ctx.reference,
        kl={"definition": "KL(P_random || P_observed) in nats on the shared histogram grid",
            "rows": list(WEIGHT_TYPES), "cols": list(WEIGHT_TYPES), "matrix": _kl_matrix(ctx)},
        mean_pk={tp: float(v) for tp, v in by_type.pk.mean().items()},
        fraction_q_model_below_005={tp: float((q < SIGNIFICANT_Q).mean()) for tp, q in by_type.q_model},
        null_model=ctx.null,
        nulls={
            "pk_norm": "pk / sqrt(rank_source * rank_target) (no null)",
            "z_iso": "isotropic Haar reference, exact mean and variance",
            "log10_p_iso": "isotropic Haar reference: " + ctx.reference["tail"],
            "p_model": f"{significance.NULL_NAME}: {significance.NULL_DESCRIPTION}",
            "q_model": significance.BH_DESCRIPTION + " (p_model)",
            "cs": "Composition Score (Elhage et al. 2021), no null; null for type pairs other than OQ/OK/OV"
                  + (" and for OK/OV of grouped-query models" if kv_group > 1 else ""),
        },
        head_naming="L{layer}H{head}" + ("; K/V endpoints are native KV heads L{layer}KV{kv_head}, "
                                         f"query heads {kv_group}*g .. {kv_group}*g+{kv_group - 1} share KV head g"
                                         if kv_group > 1 else ""),
        rank_deficient_heads=rank_deficient_heads(ctx.subspaces),
    )


def run_pk(ctx: Context) -> None:
    """The PK_STAGES on ctx.model, through the runner of every stage, then ctx.result: the pairs and heads tables
    and the PK's run record (its `timings_s`: the seconds of each PK stage)."""
    ctx.engine["weights"] = _weights_record(ctx.model)
    run_stages(ctx, PK_STAGES, ctx.pk_stages)
    pairs = _pairs_table(ctx)
    ctx.result = AnalysisResult(run=_run_record(ctx, pairs), pairs=pairs, heads=_heads_table(ctx))
    ctx.statistics, ctx.subspaces, ctx.edges = None, {}, {}  # released before any forward pass loads the model
    if hasattr(ctx.model, "allow_loading"):
        ctx.model.allow_loading()


def _weights_record(model) -> dict:
    """run.json engine.weights: how the PK stages read the weights, and the dtype of the forward passes."""
    if hasattr(model, "head_layers"):
        held = str(model.patterns_dtype).removeprefix("torch.")
        return {"read": "streamed layer by layer from the safetensors shards", "stored_dtypes": list(model.stored_dtypes),
                "forward_dtype": f"role tests and causal effects: the raw weight matrices held in {held}, each "
                                 "block's computed in float32 while it runs (the float32 model's activations and "
                                 "gradients, to float32 rounding); the causal effects read each head's W_O and z "
                                 "in the processing asked"}
    return {"read": "from the loaded model", "forward_dtype": str(next(model.bridge.parameters()).dtype).removeprefix("torch.")}


def compute_pk(model, types=None, *, options: PKOptions | None = None, progress: bool = True,
               console: Console | None = None, **settings) -> AnalysisResult:
    """The PK alone of a LoadedModel (no roles, no causal effects, nothing written): the run record, the pairs
    and the heads tables.

    `options` (default PKOptions()) with `types` and any other PKOptions field given by keyword replaced."""
    options = dataclasses.replace(options or PKOptions(), **settings, **({"types": types} if types is not None else {}))
    asked = AnalyzeOptions(pk=checked_pk_options(options), roles=None, causal=None, store=None, report=False)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    console = console or Console(stderr=True)
    with Progress(*columns, console=console, disable=not progress) as bar:
        ctx = Context(asked, console, bar, model=model)
        run_pk(ctx)
    return ctx.result
