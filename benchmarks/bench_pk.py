"""Benchmark (run by hand): headgraph's PK engine vs TransformerLens vs a per-pair scipy loop, same inputs, one run.

    python3 benchmarks/bench_pk.py --only gpt2            # GPT-2-small shape, then a whole analyze per step
    python3 benchmarks/bench_pk.py --device cuda          # on a GPU (also the large shape, 32 layers)

Fair by construction: random Gaussian weights in TransformerLens layout; every engine is warmed up (one untimed
call each, headgraph's calibration included) before timing; the timed calls are interleaved (headgraph,
TransformerLens, headgraph 16 types, again ...) so that a busy shared machine slows them alike, and each
reports its best of --repeat calls. All compute from the raw weight matrices, bases included:
- headgraph: `headgraph.analysis` subspaces + one `pk_pass` over the requested type pairs (the pipeline's path;
  formulation chosen from the measured kernel rates);
- TransformerLens 4.3: `attention_head_subspace_affinity(model, source_role="O", target_role=...)`. It reads
  only `model.blocks_with("attn")`, each block's `attn.W_Q/W_K/W_V/W_O` and `model.cfg.device`, so a small
  adapter hands it the same tensors (no TransformerBridge needed for random weights). It computes all pairs,
  then masks; it has no other type pairs than O -> Q/K/V;
- scipy: `scipy.linalg.subspace_angles` on each pair's raw matrices (timed on a random sample of pairs and
  extrapolated linearly to all pairs — printed as such).
Printed: `headgraph N.Nx faster` (O -> Q/K/V vs TransformerLens), `16 types:` (all 16 type pairs, and that
time over TransformerLens' O -> Q/K/V time), the floor (FLOPs of the lowest-FLOP formulation at the measured
fp32 GEMM peak, best of square matmuls before and after, and the fraction of that peak headgraph's PK reaches),
peak memory above the inputs (CUDA: max_memory_allocated; CPU: resident set sampled every 5 ms), and a
per-step table of whole default `headgraph analyze` processes (fresh, cold, as a user runs them: roles, causal
effects, report and an embedded store included; the PK stages broken out) on a saved random-init GPT-2-small
folder (GPT-2's own 50257-token vocabulary unless --vocab), with the floor of the stages that run the model or
the null: the matmul FLOPs of the role tests and the causal effects (counted by torch's FlopCounterMode on the
same inputs and edges) and the model-matched null's planned FLOPs, each at the GEMM peak.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from headgraph.cli import PROCESS_ENVIRONMENT, apply_process_environment, parse_memory_size

apply_process_environment()  # as every `headgraph` process runs; before torch loads

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scipy.linalg import subspace_angles  # noqa: E402

from headgraph.analysis import calibration, projectors  # noqa: E402
from headgraph.analysis.pk import PKRequest, pair_mask, pk_pass, plan_pk  # noqa: E402
from headgraph.analysis.subspaces import head_matrices, orthonormal_bases  # noqa: E402
from headgraph.heads import TYPE_PAIRS  # noqa: E402

TARGETS = ("Q", "K", "V")
COMPOSITION = ("OQ", "OK", "OV")
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int


def random_weights(shape: Shape, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gaussian weights drawn on the device that uses them (no copy from the CPU; the large shape's are 5 GiB)."""
    g = torch.Generator(device).manual_seed(seed)
    L, H, KV, d, k = shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.d_model, shape.d_head
    sizes = {"Q": (L, H, d, k), "K": (L, KV, d, k), "V": (L, KV, d, k), "O": (L, H, k, d)}
    return {t: torch.randn(size, generator=g, device=device) for t, size in sizes.items()}


class PeakMemory:
    """Peak bytes allocated above the level at entry (CUDA allocator, or sampled process RSS on CPU)."""

    def __init__(self, device: str):
        self.device, self.peak = device, 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self._base)
            time.sleep(0.005)

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._base, self._stop = self._rss(), threading.Event()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        else:
            self._stop.set()
            self._thread.join()


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def gemm_flops_per_s(device: str, n: int, repeats: int = 10) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b
    best = math.inf
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def plan_types(w: dict, device: str, types, max_memory: int):
    """The pipeline's plan for `types` over bases of w's shapes (the bases themselves are not needed)."""
    shapes = {t: (w[t].shape[0] * w[t].shape[1], w["Q"].shape[2], w["Q"].shape[3]) for t in "QKVO"}
    layers = {t: torch.arange(w[t].shape[0]).repeat_interleave(w[t].shape[1]) for t in "QKVO"}
    requests = {tp: PKRequest(tp[0], tp[1], pair_mask(layers[tp[0]], layers[tp[1]], False, tp[0] == tp[1]))
                for tp in types}
    names = {t for tp in types for t in tp}
    rates = calibration.rates(device, torch.float32, shapes["Q"][1], shapes["Q"][2])
    return plan_pk({t: shapes[t] for t in names}, requests, 4, rates, max_memory)


def run_headgraph(w: dict, device: str, types, max_memory: int) -> tuple[dict, float, float, object]:
    """(PK per type pair, bases seconds, PK seconds, plan): from raw weights, as the pipeline runs it."""
    sync(device)
    start = time.perf_counter()
    names = sorted({t for tp in types for t in tp})
    bases = {t: orthonormal_bases(head_matrices(w[t], t), t, torch.float32).flat() for t in names}
    sync(device)
    pk_start = time.perf_counter()
    plan = plan_types(w, device, types, max_memory)
    scores = pk_pass(bases, plan)
    sync(device)
    end = time.perf_counter()
    return scores, pk_start - start, end - pk_start, plan


def tl_adapter(w: dict, device: str):
    """The attributes TransformerLens' attention_head_subspace_affinity reads, over the same tensors."""
    blocks = [SimpleNamespace(attn=SimpleNamespace(**{f"W_{t}": w[t][layer] for t in "QKVO"}))
              for layer in range(w["Q"].shape[0])]
    return SimpleNamespace(blocks_with=lambda kind: list(enumerate(blocks)), cfg=SimpleNamespace(device=device))


def run_transformer_lens(w: dict, device: str) -> tuple[dict, float]:
    from transformer_lens.tools.analysis.projection_kernel import attention_head_subspace_affinity

    model = tl_adapter(w, device)
    sync(device)
    start = time.perf_counter()
    scores = {t: attention_head_subspace_affinity(model, source_role="O", target_role=t) for t in TARGETS}
    sync(device)
    return scores, time.perf_counter() - start


def run_scipy_sample(w: dict, n_sample: int, seed: int) -> tuple[float, int, dict]:
    """Seconds per pair of a scipy subspace_angles loop (on a random sample), the number of pairs, and the
    sampled PKs {(target, i, j): pk} for a cross-check."""
    rng = np.random.default_rng(seed)
    o = head_matrices(w["O"], "O")
    o = o.reshape(-1, *o.shape[2:])
    layers_o = np.repeat(np.arange(w["O"].shape[0]), w["O"].shape[1])
    total, elapsed, sampled = 0, 0.0, {}
    per_target = max(1, n_sample // len(TARGETS))
    for t in TARGETS:
        m = w[t].reshape(-1, *w[t].shape[2:])
        layers_t = np.repeat(np.arange(w[t].shape[0]), w[t].shape[1])
        pairs = np.argwhere(layers_o[:, None] < layers_t[None, :])
        total += len(pairs)
        chosen = pairs[rng.choice(len(pairs), per_target, replace=False)]
        # only the sampled heads copied to the host, in float64, before the clock starts
        heads = {(x, i): (o if x == "O" else m)[i].cpu().double().numpy()
                 for x, column in (("O", 0), (t, 1)) for i in set(chosen[:, column].tolist())}
        start = time.perf_counter()
        for i, j in chosen:
            sampled[(t, i, j)] = float(np.sum(np.cos(subspace_angles(heads["O", i], heads[t, j])) ** 2))
        elapsed += time.perf_counter() - start
    return elapsed / (per_target * len(TARGETS)), total, sampled


def floor_line(label: str, plan, pk_seconds: float, gemm: float) -> str:
    """The FLOPs of the lowest-FLOP formulation for exactly the needed pairs (each head built once, no tile
    computing a pair twice or one not needed), at the GEMM peak, and the fraction of that peak headgraph's PK
    time reaches on it."""
    n, d, k = next(iter(plan.shapes.values()))
    heads = sum(shape[0] for shape in plan.shapes.values())
    block = projectors.projector_block(d, k)
    floors = {"gram": plan.needed_pairs * projectors.tile_flops("gram", d, k, k, block),
              "projector": heads * projectors.build_flops("projector", d, k, block)
              + plan.needed_pairs * projectors.tile_flops("projector", d, k, k, block)}
    lowest = min(floors, key=floors.get)
    other = [f for f in floors if f != lowest][0]
    return (f"  floor {label}: {lowest} {floors[lowest] / 1e9:.1f} GFLOP ({other} {floors[other] / 1e9:.1f}) for "
            f"{plan.needed_pairs} pairs = {floors[lowest] / gemm:.3f} s at the GEMM peak; headgraph's PK "
            f"{pk_seconds:.3f} s ({plan.formulation}, {plan.flops / 1e9:.1f} GFLOP planned) = "
            f"{floors[lowest] / pk_seconds / gemm:.0%} of peak on the floor")


def bench(shape: Shape, device: str, args) -> None:
    print(f"\n== {shape.name}: {shape.n_layers} layers x {shape.n_heads} heads ({shape.n_kv_heads} KV), "
          f"d_model {shape.d_model}, d_head {shape.d_head}, device {device}, fp32 ==")
    w = random_weights(shape, device)
    gemm_before = gemm_flops_per_s(device, args.gemm_n)
    budget = parse_memory_size(None, None, args.max_memory)
    run_headgraph(w, device, COMPOSITION, budget)  # warm-up, calibration included (measured once, then cached)
    run_headgraph(w, device, TYPE_PAIRS, budget)
    if not args.skip_tl:
        run_transformer_lens(w, device)
    best = {"hg": (math.inf,), "tl": math.inf, "16": (math.inf,)}
    for _ in range(args.repeat):
        with PeakMemory(device) as mem_hg:
            ours, t_bases, t_pk, plan = run_headgraph(w, device, COMPOSITION, budget)
        if t_bases + t_pk < best["hg"][0]:
            best["hg"] = (t_bases + t_pk, t_bases, t_pk, plan, mem_hg.peak)
        if not args.skip_tl:
            with PeakMemory(device) as mem_tl:
                theirs, tl_time = run_transformer_lens(w, device)
            best["tl"] = min(best["tl"], tl_time)
        _, t16_bases, t16_pk, plan16 = run_headgraph(w, device, TYPE_PAIRS, budget)
        if t16_bases + t16_pk < best["16"][0]:
            best["16"] = (t16_bases + t16_pk, t16_bases, t16_pk, plan16)
    t_hg, t_bases, t_pk, plan, peak_hg = best["hg"]
    t16, t16_bases, t16_pk, plan16 = best["16"]
    print(f"  plan O->Q/K/V: {plan.reason}; {len(plan.tiles)} tiles, {plan.flops / 1e9:.1f} GFLOP "
          f"({plan.build_flops / 1e9:.1f} to build {plan.built_heads} heads), working set "
          f"{plan.working_bytes / 2**20:.0f} MiB")
    print(f"  plan 16 types: {plan16.formulation}, {len(plan16.tiles)} tiles, {plan16.flops / 1e9:.1f} GFLOP "
          f"({plan16.build_flops / 1e9:.1f} to build {plan16.built_heads} heads)")
    if not args.skip_tl:
        diff = max(float((ours["O" + t].reshape(theirs[t].scores.shape)[theirs[t].valid_mask]
                          - theirs[t].scores[theirs[t].valid_mask]).abs().max()) for t in TARGETS)
        print(f"  max |headgraph - TransformerLens| = {diff:.2e}")
    per_pair, n_pairs, sampled = run_scipy_sample(w, args.scipy_pairs, seed=1)
    scipy_time = per_pair * n_pairs
    scipy_diff = max(abs(ours["O" + t][i, j].item() - v) for (t, i, j), v in sampled.items())
    print(f"  max |headgraph - scipy| on {len(sampled)} sampled pairs = {scipy_diff:.2e}")
    gemm = max(gemm_before, gemm_flops_per_s(device, args.gemm_n))  # best of before / after: a shared box
    print(f"  pairs: {n_pairs} (OQ+OK+OV, earlier -> later); best of {args.repeat} after a warm-up each")
    print(f"  headgraph        {t_hg:9.3f} s  (bases {t_bases:.3f} s + PK {t_pk:.3f} s), peak +{peak_hg / 2**20:.0f} MiB")
    if not args.skip_tl:
        print(f"  TransformerLens  {best['tl']:9.3f} s  peak +{mem_tl.peak / 2**20:.0f} MiB   "
              f"-> headgraph {best['tl'] / t_hg:.1f}x faster")
    print(f"  scipy loop      ~{scipy_time:9.1f} s  (extrapolated: {per_pair * 1e3:.2f} ms/pair x {n_pairs} pairs, "
          f"{len(sampled)} pairs timed) -> headgraph {scipy_time / t_hg:.0f}x faster")
    ratio = f" = {t16 / best['tl']:.2f}x TransformerLens' O->Q/K/V time" if not args.skip_tl else ""
    print(f"16 types: {t16:.3f} s (bases {t16_bases:.3f} s + PK {t16_pk:.3f} s, "
          f"{sum(int(r.mask.sum()) for r in plan16.requests.values())} pairs){ratio}")
    print(f"  fp32 GEMM peak {gemm / 1e9:.1f} GFLOP/s ({args.gemm_n}^3)")
    print(floor_line("O->Q/K/V", plan, t_pk, gemm))
    print(floor_line("16 types", plan16, t16_pk, gemm))


ANALYZE_STAGES = ("subspaces", "projection_kernel", "reference", "model_null", "composition")


def analyze_steps(device: str, types: str, folder: Path, work: Path, max_memory: str) -> dict:
    """One whole default `headgraph analyze` process on the folder (roles, causal effects, report and an embedded
    store included): its wall time, the summary's seconds per step, and run.json's seconds per PK stage."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NEO4J_URI": ""}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "headgraph", "analyze", str(folder), "--types", types, "--device",
                           device, "--out", str(work / "run"), "--db", str(work / "graph.lbdb"), "--max-memory",
                           max_memory, "--json"], env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    run = json.loads((work / "run" / "run.json").read_text())
    steps = json.loads(done.stdout)["timings_s"]
    return {"wall": wall, "steps": steps, "stages": run["timings_s"], "formulation": run["engine"]["pass"]["formulation"],
            "null_flops": run["null_model"]["pass"]["flops"], "run_dir": work / "run"}


def matmul_counter():
    """torch's FlopCounterMode (not displayed), counting the in-place addmm_ as addmm: its table leaves addmm_ out,
    and the backward of a streamed checkpoint's Linears sums its chunks of rows with it (`heap.rows_gradient`)."""
    from torch.utils.flop_counter import FlopCounterMode

    def addmm_(bias_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):  # the shapes of self, mat1, mat2
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_})


def counted_flops(folder: Path, device: str, run_dir: Path) -> dict[str, float]:
    """Matmul FLOPs (`matmul_counter`, backward passes included) of the stages that run the model, rerun
    as the analyze of `run_dir` ran them: the folder opened as analyze opens it (streamed, its forward passes on
    the stored weights), the role tests with the run's settings, the causal local effects of every pair of the
    run's OQ/OK/OV types on the run's inputs, and the loss effects of exactly the edges that have one (read from
    its pairs.parquet) on the run's loss inputs. Default processing, ablation, seed and batch settings, as
    bench_scale and bench_analyze run analyze."""
    import pandas as pd

    from headgraph.analysis.causal import PAIR_KEY, CausalStage, loss_effects
    from headgraph.analysis.options import CausalOptions
    from headgraph.analysis.roles import compute_roles
    from headgraph.loader.stream import open_model, patterns_only

    run = json.loads((run_dir / "run.json").read_text())
    pairs = pd.read_parquet(run_dir / "pairs.parquet")
    model = open_model(str(folder), device=device)
    if hasattr(model, "allow_loading"):
        model.allow_loading()
    flops, work = {}, {}
    roles = run.get("roles") or {}
    if roles.get("n_inputs"):
        def role_tests():
            with patterns_only(model) as opened:
                compute_roles(opened, n_inputs=roles["n_inputs"], design=roles.get("design", "fixed"))
        work["roles"] = role_tests
    causal = run.get("causal") or {}
    if causal.get("inputs") and "skipped" not in causal:
        loss_inputs = causal.get("loss_inputs_per_set") or {}
        options = CausalOptions(n_inputs=max(causal["inputs"].values()),
                                loss_inputs=max(loss_inputs.values()) if loss_inputs else None)
        stage = CausalStage.prepare(model, options, seed=0)
        work["causal local"] = lambda: stage.local(pairs[PAIR_KEY], causal["types"], seed=0)
        if "effect_loss" in pairs and pairs["effect_loss"].notna().any():
            inputs = tuple(s.batch(0, min(len(s), loss_inputs.get(s.name, len(s)))) for s in stage.inputs)
            checked = pairs.loc[pairs["effect_loss"].notna(), PAIR_KEY]
            work["causal loss"] = lambda: loss_effects(model, inputs, checked, options.ablation, n_boot=options.n_boot,
                                                       seed=0, batch_size=options.batch_size,
                                                       max_memory=options.max_memory)
    for name, stage_work in work.items():
        with matmul_counter() as counter:
            stage_work()
        flops[name] = float(counter.get_total_flops())
    return flops


def floor_rows(runs: dict, folder: Path, device: str, gemm_n: int) -> list[str]:
    """The compute floor of the stages of the analyze that run the model or the null, at the fp32 GEMM peak: the
    counted matmul FLOPs of the role tests and the causal effects, and the model-matched null's planned FLOPs
    (its formulation's, each null head built once; drawing the null heads is not counted)."""
    gemm = gemm_flops_per_s(device, gemm_n)
    lines = [f"  fp32 GEMM peak {gemm / 1e9:.1f} GFLOP/s ({gemm_n}^3)"]
    for types, results in runs.items():
        best = min(results, key=lambda r: r["wall"])
        flops = counted_flops(folder, device, best["run_dir"])
        ran = {"roles": best["steps"]["roles"], "causal local": best["steps"]["causal_local"],
               "causal loss": best["steps"]["causal_loss"]}
        flops["model-matched null"], ran["model-matched null"] = best["null_flops"], best["stages"]["model_null"]
        parts = ", ".join(f"{name} {f / 1e9:.0f} GFLOP = {f / gemm:.1f} s (ran {ran[name]:.1f} s)"
                          for name, f in flops.items())
        lines.append(f"  floor --types {types}: {parts}; their sum {sum(flops.values()) / gemm:.1f} s of the "
                     f"fastest process's {best['wall']:.1f} s")
    return lines


def bench_analyze(device: str, repeat: int, max_memory: str, gemm_n: int, vocab: int) -> None:
    from headgraph.testing.synthetic import save_synthetic

    print(f"\n== whole `headgraph analyze` processes (defaults: roles, causal effects, report, embedded store), "
          f"random-init GPT-2 small (saved folder, vocab {vocab}), device {device}; each a fresh process ==")
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_synthetic(Path(tmp) / "gpt2-small-random", n_layers=12, n_heads=12, d_model=768, d_head=64,
                                n_ctx=1024, vocab=vocab)
        runs = {}
        for types in ("oq,ok,ov", "all"):
            runs[types] = []
            for i in range(repeat):
                work = Path(tmp) / f"{types}-{i}"
                work.mkdir()
                runs[types].append(analyze_steps(device, types, folder, work, max_memory))
        floors = floor_rows(runs, folder, device, gemm_n)
    first = next(iter(runs.values()))[0]
    rows = [(step, lambda r, step=step: r["steps"].get(step, 0.0)) for step in first["steps"]]
    at = [name for name, _ in rows].index("pk_and_significance") + 1
    rows[at:at] = [(f"  {stage}", lambda r, stage=stage: r["stages"][stage]) for stage in ANALYZE_STAGES]
    rows += [("python start, imports", lambda r: r["wall"] - sum(r["steps"].values())),
             ("process wall", lambda r: r["wall"])]
    print(f"  {'step (s)':<26}" + "".join(f"{f'{t} #{i + 1}':>12}" for t in runs for i in range(repeat)))
    for name, value in rows:
        print(f"  {name:<26}" + "".join(f"{value(r):12.2f}" for results in runs.values() for r in results))
    print(f"  formulation: {', '.join(sorted({r['formulation'] for rs in runs.values() for r in rs}))}")
    print("\n".join(floors))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--large-layers", type=int, default=None,
                        help="layers of the large shape (default: 32 on CUDA, 4 on CPU — a documented subset)")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per engine (best is reported)")
    parser.add_argument("--scipy-pairs", type=int, default=60, help="pairs timed in the scipy loop")
    parser.add_argument("--gemm-n", type=int, default=None, help="square GEMM size for the FLOP/s peak")
    parser.add_argument("--skip-tl", action="store_true", help="skip TransformerLens (e.g. on a huge shape)")
    parser.add_argument("--skip-analyze", action="store_true", help="skip the whole-analyze step table")
    parser.add_argument("--analyze-repeat", type=int, default=None, help="analyze processes per type set "
                        "(default: --repeat)")
    parser.add_argument("--max-memory", default="2GiB", help="the engine's working-memory budget (as analyze's)")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary of the analyzed GPT-2-small-shaped "
                        "folder (the loss effects' unembedding scales with it)")
    parser.add_argument("--only", choices=["gpt2", "large"], default=None)
    args = parser.parse_args()
    args.gemm_n = args.gemm_n or (8192 if args.device == "cuda" else 2048)
    large_layers = args.large_layers or (32 if args.device == "cuda" else 4)
    shapes = [Shape("GPT-2 small", 12, 12, 12, 768, 64),
              Shape("large" + ("" if large_layers == 32 else f" (subset: {large_layers} of 32 layers)"),
                    large_layers, 32, 8, 4096, 128)]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          + ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in PROCESS_ENVIRONMENT))
    for shape in shapes:
        if args.only is None or (args.only == "gpt2") == shape.name.startswith("GPT-2"):
            bench(shape, args.device, args)
    if not args.skip_analyze and args.only != "large":
        bench_analyze(args.device, args.analyze_repeat or args.repeat, args.max_memory, args.gemm_n, args.vocab)


if __name__ == "__main__":
    main()
