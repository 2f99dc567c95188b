"""All-pairs Projection Kernel for many type pairs in one pass, tiled to a memory budget.

PK(S, S') = ||U^T U'||_F^2 = tr(P P') for orthonormal bases U (d x k), U' (d x k') and projectors P = U U^T.
A pass takes named basis sets (e.g. one per weight type: Q, K, V, O) and named requests (e.g. one per type
pair: OQ = sources from set O, targets from set Q, where a mask is True) and computes them together:

- Each set's heads are built once into the formulation's vectors (stacked bases for "gram", vectorised
  projectors for "projector"; headgraph.analysis.projectors) in groups of heads, and every request that reads
  the set reuses them: all 16 type pairs of a model build 4 sets, not 32.
- A set against itself (QQ, KK, ...) is symmetric: only the upper triangle of the pairs either orientation
  needs is computed. Two requests XY and YX share one product (PK_YX = PK_XY^T).
- Each product's needed pairs are covered by rectangular tiles, split in halves until at least 60 % (projector)
  or 90 % (gram) of a tile is needed: for the projector an earlier -> later triangle is a few large GEMMs
  (GPT-2 small: 3 tiles, 1.28x the needed pairs), since thin tiles of its memory-bound GEMM cost more than
  the pairs they save (GPT-2 small's O -> Q on a busy 2-core CPU: 1 tile at 1.83x the pairs 0.28 s, 3 tiles
  at 1.28x 0.27 s, 53 tiles at 1.0x 0.66 s); the FLOP-bound gram tiles waste little (46 tiles, 1.01x: 0.29 s,
  3 tiles at 1.28x 0.41 s).
- The groups held at once fit `max_memory` (working memory: built vectors, build temporaries and tiles; the
  input bases and the output matrices are not counted). Groups are as large as lets every group be held at
  once; when none does, groups are rebuilt as the tiles need them, evicting the one needed furthest in the
  future (Belady), with the group size of lowest predicted time.
- "auto" picks the formulation of lower predicted time, from the kernels' FLOP/s measured on this machine and
  device (headgraph.analysis.calibration), among those that fit; the plan says which ran and why.

No Python loop runs over head pairs: the loops run over tiles and groups. Same code on CUDA and CPU; the
dtype is the bases' dtype.
"""

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from headgraph.analysis import calibration, projectors
from headgraph.analysis.calibration import Rates
from headgraph.analysis.options import DEFAULT_MEMORY, Formulation
from headgraph.analysis.projectors import FORMULATIONS
from headgraph.errors import check_choice

# A tile is split in halves until at least this fraction of its pairs is needed: the projector tile is a
# memory-bound GEMM that wants few large tiles, the gram tile is FLOP-bound (7x less waste was 30 % faster).
TILE_DENSITY = {"gram": 0.9, "projector": 0.6}


def pair_mask(src_layers: torch.Tensor, tgt_layers: torch.Tensor, full_matrix: bool,
              same_type: bool) -> torch.Tensor:
    """Which (source, target) pairs to compute: earlier -> strictly later layer, or every pair but a head
    with itself when `full_matrix` (a head's subspace against itself is always PK = rank)."""
    src = src_layers[:, None]
    tgt = tgt_layers[None, :]
    if not full_matrix:
        return src < tgt
    mask = torch.ones(len(src_layers), len(tgt_layers), dtype=torch.bool)
    if same_type:
        mask.fill_diagonal_(False)
    return mask


@dataclass(frozen=True)
class PKRequest:
    """One PK matrix: every (source head of set `source`, target head of set `target`) pair where `mask`
    [n_source, n_target] is True."""

    source: str
    target: str
    mask: torch.Tensor


@dataclass(frozen=True)
class Product:
    """One product between two sets (left == right: symmetric, computed on its upper triangle), the pairs it
    must compute, and the requests it answers: (name, read transposed)."""

    left: str
    right: str
    needed: torch.Tensor
    answers: tuple[tuple[str, bool], ...]


@dataclass(frozen=True)
class Tile:
    """One tile: heads rows[0]:rows[1] of the product's left set against cols[0]:cols[1] of its right set,
    inside one group of each."""

    product: int
    rows: tuple[int, int]
    cols: tuple[int, int]


@dataclass(frozen=True)
class PKPlan:
    """How one pass runs: formulation, layout, groups, tiles and their build schedule, FLOPs, predicted time
    (from measured kernel rates; a prediction, not a measurement) and working bytes."""

    formulation: str
    block: int
    group: int
    shapes: dict[str, tuple[int, int, int]]
    requests: dict[str, PKRequest] = field(repr=False)
    products: tuple[Product, ...] = field(repr=False)
    tiles: tuple[Tile, ...] = field(repr=False)
    schedule: tuple[tuple[tuple, tuple], ...] = field(repr=False)  # per tile: (groups to build, to evict)
    builds: int
    built_heads: int
    build_flops: float
    tile_flops: float
    needed_pairs: int
    computed_pairs: int
    seconds: float
    working_bytes: int
    predicted: dict[str, float]
    reason: str
    rates: Rates
    chunks: tuple = field(default=(), repr=False)  # projector: the pieces of each chunk (projectors.projector_chunks)

    @property
    def steps(self) -> int:
        """Steps of the pass, for a progress display: chunks (projector) or tiles (gram)."""
        return len(self.chunks) if self.formulation == "projector" else len(self.tiles)

    @property
    def flops(self) -> float:
        return self.build_flops + self.tile_flops

    def describe(self) -> dict:
        """The plan as run.json's engine info records it."""
        return {"formulation": self.formulation, "reason": self.reason,
                "predicted_s": {f: (round(s, 4) if math.isfinite(s) else None) for f, s in self.predicted.items()},
                "flops": self.flops, "build_flops": self.build_flops, "tile_flops": self.tile_flops,
                "projector_block": self.block, "group_heads": self.group, "group_builds": self.builds,
                "built_heads": self.built_heads, "sets": {name: {"heads": s[0], "d": s[1], "k": s[2]}
                                                          for name, s in self.shapes.items()},
                "tiles": len(self.tiles), "chunks": len(self.chunks), "needed_pairs": self.needed_pairs, "computed_pairs": self.computed_pairs,
                "working_bytes": self.working_bytes, "calibration": self.rates.describe()}


def _products(requests: dict[str, PKRequest]) -> list[Product]:
    """Requests merged into products: XY and YX into one, a set against itself on its upper triangle."""
    merged: dict[tuple[str, str], tuple[torch.Tensor, list]] = {}
    for name, request in requests.items():
        mask = request.mask.to("cpu", torch.bool)
        if request.source == request.target:
            key, needed, transposed = (request.source, request.source), torch.triu(mask | mask.T), False
        elif (request.target, request.source) in merged:
            key, needed, transposed = (request.target, request.source), mask.T, True
        else:
            key, needed, transposed = (request.source, request.target), mask, False
        previous, answers = merged.get(key, (torch.zeros_like(needed), []))
        merged[key] = (previous | needed, answers + [(name, transposed)])
    return [Product(left, right, needed, tuple(answers)) for (left, right), (needed, answers) in merged.items()]


def _cover(needed: np.ndarray, r0: int, r1: int, c0: int, c1: int, max_area: int, density: float,
           out: list) -> None:
    """Rectangles covering the True entries of needed[r0:r1, c0:c1]: its bounding box if at least `density`
    of it is needed and it has at most max_area entries, else the cover of each half."""
    block = needed[r0:r1, c0:c1]
    rows, cols = np.flatnonzero(block.any(axis=1)), np.flatnonzero(block.any(axis=0))
    if rows.size == 0:
        return
    r0, r1, c0, c1 = r0 + rows[0], r0 + rows[-1] + 1, c0 + cols[0], c0 + cols[-1] + 1
    area = (r1 - r0) * (c1 - c0)
    if area <= max_area and (needed[r0:r1, c0:c1].sum() >= density * area or area == 1):
        out.append(((int(r0), int(r1)), (int(c0), int(c1))))
    elif r1 - r0 >= c1 - c0:
        mid = (r0 + r1) // 2
        _cover(needed, r0, mid, c0, c1, max_area, density, out)
        _cover(needed, mid, r1, c0, c1, max_area, density, out)
    else:
        mid = (c0 + c1) // 2
        _cover(needed, r0, r1, c0, mid, max_area, density, out)
        _cover(needed, r0, r1, mid, c1, max_area, density, out)


def _tiles(products: list[Product], group: int, max_area: int, density: float) -> list[Tile]:
    """Tiles of every product inside each (left group, right group) block, ordered so that each left group
    is used by consecutive tiles (its products one after another)."""
    tiles = []
    for p, product in enumerate(products):
        needed = product.needed.numpy()
        for g0 in range(0, needed.shape[0], group):
            for h0 in range(0, needed.shape[1], group):
                rects = []
                _cover(needed, g0, min(g0 + group, needed.shape[0]), h0, min(h0 + group, needed.shape[1]),
                       max_area, density, rects)
                tiles += [Tile(p, rows, cols) for rows, cols in rects]
    return sorted(tiles, key=lambda t: (products[t.product].left, t.rows[0] // group, t.product,
                                        t.cols[0] // group, t.rows, t.cols))


def _uses(tile: Tile, products: list[Product], group: int) -> tuple:
    product = products[tile.product]
    return tuple(dict.fromkeys([(product.left, tile.rows[0] // group), (product.right, tile.cols[0] // group)]))


def _schedule(tiles: list[Tile], products: list[Product], group: int, capacity: int) -> list[tuple[tuple, tuple]]:
    """For each tile, the groups to build before it and the groups to evict first, holding at most
    `capacity` groups; evicts the held group whose next use is furthest away (optimal for the rebuild count)."""
    uses = [_uses(t, products, group) for t in tiles]
    next_use, upcoming = [], {}
    for i in range(len(uses) - 1, -1, -1):  # next_use[i][key]: the first tile after i that uses key
        next_use.append(dict(upcoming))
        for key in uses[i]:
            upcoming[key] = i
    next_use.reverse()
    held: set = set()
    steps = []
    for i, needed_now in enumerate(uses):
        missing = [key for key in needed_now if key not in held]
        evict = []
        while len(held) + len(missing) > capacity:
            victim = max((key for key in held if key not in needed_now),
                         key=lambda key: next_use[i].get(key, math.inf))
            held.remove(victim)
            evict.append(victim)
        held.update(missing)
        steps.append((tuple(missing), tuple(evict)))
    return steps


@dataclass(frozen=True)
class _Candidate:
    formulation: str
    group: int
    tiles: list
    schedule: list
    builds: int
    built_heads: int
    build_flops: float
    tile_flops: float
    computed_pairs: int
    seconds: float
    working_bytes: int
    chunks: tuple = ()


def _candidate(formulation: str, products: list[Product], shapes: dict, d: int, block: int, group: int,
               itemsize: int, budget: int, rates: Rates) -> _Candidate | None:
    """The gram plan with groups of `group` heads, or None if it cannot fit `budget`."""
    k_max = max(s[2] for s in shapes.values())
    group_bytes = itemsize * group * projectors.vector_elements(formulation, d, k_max, block)
    n_groups = sum(math.ceil(s[0] / group) for s in shapes.values())
    capacity = min(n_groups, max(2, budget // 2 // group_bytes))  # groups: at most half the budget, two at least
    tile_budget = min(projectors.GRAM_TILE_BYTES, budget - capacity * group_bytes)
    max_area = tile_budget // projectors.tile_bytes("gram", 1, 1, k_max, k_max, itemsize)
    if capacity < min(2, n_groups) or max_area < 1:
        return None
    tiles = _tiles(products, group, max_area, TILE_DENSITY[formulation])
    schedule = _schedule(tiles, products, group, capacity)
    heads = {name: s[0] for name, s in shapes.items()}
    built = [(name, min(group, heads[name] - g * group)) for missing, _ in schedule for name, g in missing]
    areas = [(t.rows[1] - t.rows[0]) * (t.cols[1] - t.cols[0]) for t in tiles]
    tile_flops = sum(area * projectors.tile_flops(formulation, d, shapes[products[t.product].left][2],
                                                  shapes[products[t.product].right][2], block)
                     for t, area in zip(tiles, areas))
    held = np.cumsum([len(missing) - len(evict) for missing, evict in schedule]).max(initial=0)
    largest = max((projectors.tile_bytes(formulation, 1, 1, k_max, k_max, itemsize) * a for a in areas), default=0)
    return _Candidate(formulation, group, tiles, schedule, len(built), sum(n for _, n in built), 0.0, tile_flops,
                      sum(areas), rates.seconds("gram", tile_flops), int(held) * group_bytes + largest)


def _projector_candidate(products: list[Product], shapes: dict, d: int, block: int, itemsize: int, budget: int,
                         rates: Rates) -> _Candidate | None:
    """The projector plan: one chunk of every head's projector held at a time (and the temporary of its widest
    piece), chunks as wide as `budget` allows, each head built once; None if a one-column chunk does not fit."""
    heads = sum(s[0] for s in shapes.values())
    tiles = _tiles(products, max(s[0] for s in shapes.values()), math.inf, TILE_DENSITY["projector"])
    areas = [(t.rows[1] - t.rows[0]) * (t.cols[1] - t.cols[0]) for t in tiles]
    largest = max((projectors.tile_bytes("projector", 1, 1, 1, 1, itemsize) * a for a in areas), default=0)
    entries = (budget - largest) // (2 * itemsize * heads)  # the chunk and its widest piece's product
    if entries < min(block, d):
        return None
    chunks = projectors.projector_chunks(d, block, entries)
    length = projectors.projector_length(d, block)
    build_flops = sum(2.0 * s[2] * s[0] * length for s in shapes.values())
    tile_flops = 2.0 * length * sum(areas)
    widest = max(sum(p.entries for p in chunk) for chunk in chunks)
    seconds = rates.seconds("projector_build", build_flops) + rates.seconds("projector_tile", tile_flops)
    return _Candidate("projector", max(s[0] for s in shapes.values()), tiles, [], len(shapes), heads, build_flops,
                      tile_flops, sum(areas), seconds, 2 * itemsize * heads * widest + largest, tuple(chunks))


def _best_candidate(formulation: str, products: list[Product], shapes: dict, d: int, block: int, itemsize: int,
                    budget: int, rates: Rates) -> _Candidate | None:
    """The largest group size (halving from the largest set) that holds every group at once, each built once
    in large tiles; if none fits, the fastest predicted of the three largest that fit (the cost model counts
    FLOPs, so among groups that all hold everything it would favour small, tight but slower tiles). The projector
    has no groups: its chunks are as wide as the budget allows."""
    if formulation == "projector":
        return _projector_candidate(products, shapes, d, block, itemsize, budget, rates)
    n_max = max(s[0] for s in shapes.values())
    fits = []
    for group in sorted({max(1, math.ceil(n_max / 2**i)) for i in range(n_max.bit_length() + 1)}, reverse=True):
        candidate = _candidate(formulation, products, shapes, d, block, group, itemsize, budget, rates)
        if candidate is None:
            continue
        if candidate.builds == len({key for missing, _ in candidate.schedule for key in missing}):
            return candidate
        fits.append(candidate)
        if len(fits) == 3:
            break
    return min(fits, key=lambda c: (c.seconds, -c.group)) if fits else None


def plan_pk(shapes: dict[str, tuple[int, int, int]], requests: dict[str, PKRequest], itemsize: int, rates: Rates,
            max_memory: int = DEFAULT_MEMORY, formulation: Formulation = "auto") -> PKPlan:
    """Plan one pass over basis sets of shapes {name: (n_heads, d, k)} for `requests`: for each formulation,
    its group size under `max_memory` (_best_candidate); "auto" returns the formulation of lower predicted
    time. Raises ValueError when even one-head groups and tiles do not fit."""
    check_choice(formulation, Formulation, "formulation")
    dims = {s[1] for s in shapes.values()}
    if len(dims) != 1:
        raise ValueError(f"all basis sets must share d_model, got {sorted(dims)}")
    for name, request in requests.items():
        expected = (shapes[request.source][0], shapes[request.target][0])
        if tuple(request.mask.shape) != expected:
            raise ValueError(f"request {name}: mask shape {tuple(request.mask.shape)} is not {expected}")
    d = dims.pop()
    block = projectors.projector_block(d, max(s[2] for s in shapes.values()))
    products = _products(requests)
    best = {f: c for f in FORMULATIONS if (c := _best_candidate(f, products, shapes, d, block, itemsize, max_memory,
                                                                  rates))}
    allowed = [f for f in best if formulation in ("auto", f)]
    if not allowed:
        raise ValueError(f"max_memory {max_memory} bytes is too small for d_model={d}: "
                         f"even one-head groups and tiles of the {'formulations' if formulation == 'auto' else formulation} "
                         "do not fit")
    chosen = best[min(allowed, key=lambda f: best[f].seconds)]
    predicted = {f: best[f].seconds if f in best else math.inf for f in FORMULATIONS}
    if formulation == "auto":
        other = [f for f in FORMULATIONS if f != chosen.formulation][0]
        why = (f"predicted {predicted[chosen.formulation]:.3g} s vs {other} {predicted[other]:.3g} s"
               if other in best else f"{other} does not fit max_memory")
        reason = f"auto: {why} (kernel rates: {rates.source}, {rates.key or 'given'})"
    else:
        reason = f"requested: formulation={formulation!r}"
    return PKPlan(chosen.formulation, block, chosen.group, dict(shapes), dict(requests), tuple(products),
                  tuple(chosen.tiles), tuple(chosen.schedule), chosen.builds, chosen.built_heads, chosen.build_flops,
                  chosen.tile_flops, sum(int(p.needed.sum()) for p in products), chosen.computed_pairs,
                  chosen.seconds, chosen.working_bytes, predicted, reason, rates, chosen.chunks)


def plan_bases(bases: dict[str, torch.Tensor], requests: dict[str, PKRequest], max_memory: int = DEFAULT_MEMORY,
               formulation: str = "auto", rates: Rates | None = None) -> PKPlan:
    """`plan_pk` for these bases {name: [n_heads, d, k]}: their shapes and itemsize, and (unless given) this
    machine's kernel rates for their device, dtype, d_model and widest head."""
    first = next(iter(bases.values()))
    rates = rates or calibration.rates(first.device, first.dtype, first.shape[1], max(b.shape[2] for b in bases.values()))
    return plan_pk({name: tuple(b.shape) for name, b in bases.items()}, requests, first.element_size(), rates,
                   max_memory, formulation)


def pk_pass(bases: dict[str, torch.Tensor], plan: PKPlan,
            advance: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """Run a plan over bases {name: [n_heads, d, k]} (heads ordered by layer); returns each request's
    [n_source, n_target] PK matrix, NaN where its mask is False. `advance(1)` is called after each step
    (plan.steps: a tile, or a projector chunk)."""
    device, dtype = next(iter(bases.values())).device, next(iter(bases.values())).dtype
    outputs = [torch.zeros((plan.shapes[p.left][0], plan.shapes[p.right][0]), dtype=dtype, device=device)
               for p in plan.products]
    if plan.formulation == "projector":
        _projector_pass(bases, plan, outputs, advance)
    else:
        _gram_pass(bases, plan, outputs, advance)
    results = {}
    for product, out in zip(plan.products, outputs):
        if product.left == product.right:
            upper = torch.ones(out.shape, dtype=torch.bool, device=device).triu_()
            out = torch.where(upper, out, out.T)
        for name, transposed in product.answers:
            mask = plan.requests[name].mask.to(device)
            results[name] = torch.where(mask, out.T if transposed else out, torch.full_like(mask, math.nan, dtype=dtype))
    return results


def _gram_pass(bases, plan: PKPlan, outputs: list[torch.Tensor], advance) -> None:
    held: dict[tuple[str, int], list[torch.Tensor]] = {}
    group = plan.group
    for tile, (build, evict) in zip(plan.tiles, plan.schedule):
        for key in evict:
            del held[key]
        for name, g in build:
            held[(name, g)] = projectors.build(bases[name][g * group:(g + 1) * group])
        product = plan.products[tile.product]
        g, h = tile.rows[0] // group, tile.cols[0] // group
        rows = slice(tile.rows[0] - g * group, tile.rows[1] - g * group)
        cols = slice(tile.cols[0] - h * group, tile.cols[1] - h * group)
        outputs[tile.product][tile.rows[0]:tile.rows[1], tile.cols[0]:tile.cols[1]] = projectors.tile(
            held[(product.left, g)], held[(product.right, h)], rows, cols,
            plan.shapes[product.left][2], plan.shapes[product.right][2])
        if advance is not None:
            advance(1)


def _projector_pass(bases, plan: PKPlan, outputs: list[torch.Tensor], advance) -> None:
    """Each chunk of every head's projector built once (into one buffer per set, reused), then every tile's
    share of the chunk added, one GEMM per piece."""
    widest = max(sum(p.entries for p in chunk) for chunk in plan.chunks)
    buffers = {name: torch.empty(heads.shape[0] * widest, dtype=heads.dtype, device=heads.device)
               for name, heads in bases.items()}
    for chunk in plan.chunks:
        pieces = {name: projectors.build_chunk(heads, chunk, buffers[name]) for name, heads in bases.items()}
        for tile in plan.tiles:
            product = plan.products[tile.product]
            (r0, r1), (c0, c1) = tile.rows, tile.cols
            out = outputs[tile.product][r0:r1, c0:c1]
            for left, right, piece in zip(pieces[product.left], pieces[product.right], chunk):
                out.addmm_(left[r0:r1], right[c0:c1].T, alpha=piece.weight)
        if advance is not None:
            advance(1)


def pk_matrix(src: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor, max_memory: int = DEFAULT_MEMORY,
              formulation: str = "auto", rates: Rates | None = None) -> torch.Tensor:
    """PK between every source [Ns, d, k] and target [Nt, d, k'] basis where `mask` [Ns, Nt] is True (NaN
    elsewhere): a one-request pass (`tgt is src`: one symmetric set). Rates default to this machine's
    calibration. Heads should be ordered by layer, so that earlier -> later masks make few, large tiles.

    PK is the sum of the squared cosines of the principal angles: k for equal subspaces, 0 for orthogonal ones,
    k k'/d on average for random ones (headgraph.analysis.reference). A high PK says the subspaces overlap, not
    that the model sends information from one head to the other.

    Two subspaces: the line at 60 degrees to span{e0} in R^2 has PK cos^2(60) = 0.25 with it.

    >>> import math, torch
    >>> line = torch.tensor([[[1.0], [0.0]]], dtype=torch.float64)
    >>> tilted = torch.tensor([[[math.cos(math.pi / 3)], [math.sin(math.pi / 3)]]], dtype=torch.float64)
    >>> round(pk_matrix(line, tilted, torch.ones(1, 1, dtype=torch.bool)).item(), 12)
    0.25

    All pairs: two 2-d heads span{e0, e1}, span{e2, e3} of R^4 against span{e1, e2} (one shared axis each)
    and span{e0, e1}; the second source's pair is masked out. Both formulations give the same numbers.

    >>> e = torch.eye(4, dtype=torch.float64)
    >>> src, tgt = torch.stack([e[:, :2], e[:, 2:]]), torch.stack([e[:, 1:3], e[:, :2]])
    >>> mask = torch.tensor([[True, True], [True, False]])
    >>> pk_matrix(src, tgt, mask, formulation="gram")
    tensor([[1., 2.],
            [1., nan]], dtype=torch.float64)
    >>> torch.equal(pk_matrix(src, tgt, mask, formulation="projector").nan_to_num(), torch.tensor([[1., 2.], [1., 0.]], dtype=torch.float64))
    True
    """
    same = tgt is src
    bases = {"source": src} | ({} if same else {"target": tgt})
    request = PKRequest("source", "source" if same else "target", mask)
    return pk_pass(bases, plan_bases(bases, {"pk": request}, max_memory, formulation, rates))["pk"]
