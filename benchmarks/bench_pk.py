"""Benchmark (run by hand): headgraph's PK engine vs TransformerLens vs a per-pair scipy loop, same inputs.

    python3 benchmarks/bench_pk.py                       # GPT-2-small shape + the large shape's CPU subset
    python3 benchmarks/bench_pk.py --large-layers 32     # the full large shape (use a GPU)

For each shape, random Gaussian weights in TransformerLens layout; all three compute OQ, OK and OV for every
earlier -> later pair from the raw weight matrices (bases included):
- headgraph: `headgraph.analysis` subspaces + `pk_matrix` (plan chosen by its cost model);
- TransformerLens 4.3: `attention_head_subspace_affinity(model, source_role="O", target_role=...)`. It reads
  only `model.blocks_with("attn")`, each block's `attn.W_Q/W_K/W_V/W_O` and `model.cfg.device`, so a small
  adapter hands it the same tensors (no TransformerBridge needed for random weights). It computes all pairs,
  then masks;
- scipy: `scipy.linalg.subspace_angles` on each pair's raw matrices (timed on a random sample of pairs and
  extrapolated linearly to all pairs — printed as such).
Also: the machine's fp32 GEMM FLOP/s (best of 10 square matmuls, before and after) and the engine's achieved FLOP/s (its
plan's FLOPs / PK time) as a fraction of it; peak memory above the inputs (CUDA: max_memory_allocated; CPU:
resident-set size sampled every 5 ms, since tracemalloc does not see torch's allocator).
"""

import argparse
import math
import os
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from scipy.linalg import subspace_angles

from headgraph.analysis.pk import pair_mask, pk_matrix, plan_pk
from headgraph.analysis.subspaces import head_matrices, orthonormal_bases

TARGETS = ("Q", "K", "V")


@dataclass(frozen=True)
class Shape:
    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int


def random_weights(shape: Shape, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    L, H, KV, d, k = shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.d_model, shape.d_head
    w = {"Q": torch.randn(L, H, d, k, generator=g), "K": torch.randn(L, KV, d, k, generator=g),
         "V": torch.randn(L, KV, d, k, generator=g), "O": torch.randn(L, H, k, d, generator=g)}
    return {t: v.to(device) for t, v in w.items()}


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


def run_headgraph(w: dict, device: str) -> tuple[dict, float, float, float, dict]:
    """(scores per target, total seconds, PK-only seconds, PK FLOPs, plans)."""
    sync(device)
    start = time.perf_counter()
    bases = {t: orthonormal_bases(head_matrices(w[t], t), t, torch.float32) for t in "QKVO"}
    sync(device)
    pk_start = time.perf_counter()
    scores, flops, plans = {}, 0.0, {}
    src = bases["O"]
    for t in TARGETS:
        tgt = bases[t]
        mask = pair_mask(src.flat_layers(), tgt.flat_layers(), full_matrix=False, same_type=False)
        plan = plan_pk(mask, src.d_model, src.width, tgt.width, 4)
        scores[t] = pk_matrix(src.flat(), tgt.flat(), mask.to(device), plan)
        flops += plan.flops
        plans[t] = plan
    sync(device)
    end = time.perf_counter()
    return scores, end - start, end - pk_start, flops, plans


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
    o = head_matrices(w["O"], "O").cpu().double()
    o = o.reshape(-1, *o.shape[2:]).numpy()
    layers_o = np.repeat(np.arange(w["O"].shape[0]), w["O"].shape[1])
    total, elapsed, sampled = 0, 0.0, {}
    per_target = max(1, n_sample // len(TARGETS))
    for t in TARGETS:
        m = w[t].cpu().double()
        m = m.reshape(-1, *m.shape[2:]).numpy()
        layers_t = np.repeat(np.arange(w[t].shape[0]), w[t].shape[1])
        pairs = np.argwhere(layers_o[:, None] < layers_t[None, :])
        total += len(pairs)
        start = time.perf_counter()
        for i, j in pairs[rng.choice(len(pairs), per_target, replace=False)]:
            sampled[(t, i, j)] = float(np.sum(np.cos(subspace_angles(o[i], m[j])) ** 2))
        elapsed += time.perf_counter() - start
    return elapsed / (per_target * len(TARGETS)), total, sampled


def bench(shape: Shape, device: str, args) -> None:
    print(f"\n== {shape.name}: {shape.n_layers} layers x {shape.n_heads} heads ({shape.n_kv_heads} KV), "
          f"d_model {shape.d_model}, d_head {shape.d_head}, device {device}, fp32 ==")
    w = random_weights(shape, device)
    gemm_before = gemm_flops_per_s(device, args.gemm_n)
    with PeakMemory(device) as mem_hg:
        ours, t_hg, t_pk, flops, plans = run_headgraph(w, device)
    for t, plan in plans.items():
        print(f"  plan O{t}: {plan.formulation}, tiles {plan.src_tile}x{plan.tgt_tile}, "
              f"{plan.flops / 1e9:.1f} GFLOP, working set {plan.working_bytes / 2**20:.0f} MiB")
    tl_time = None
    if not args.skip_tl:
        with PeakMemory(device) as mem_tl:
            theirs, tl_time = run_transformer_lens(w, device)
        diff = max(float((ours[t].reshape(theirs[t].scores.shape)[theirs[t].valid_mask]
                          - theirs[t].scores[theirs[t].valid_mask]).abs().max()) for t in TARGETS)
        print(f"  max |headgraph - TransformerLens| = {diff:.2e}")
    per_pair, n_pairs, sampled = run_scipy_sample(w, args.scipy_pairs, seed=1)
    scipy_time = per_pair * n_pairs
    flat = {t: ours[t].reshape(ours[t].shape[0], -1).cpu().double() for t in TARGETS}
    scipy_diff = max(abs(flat[t][i, j].item() - v) for (t, i, j), v in sampled.items())
    print(f"  max |headgraph - scipy| on {len(sampled)} sampled pairs = {scipy_diff:.2e}")
    gemm = max(gemm_before, gemm_flops_per_s(device, args.gemm_n))  # best of before / after: a shared box
    print(f"  pairs: {n_pairs} (OQ+OK+OV, earlier -> later)")
    print(f"  headgraph        {t_hg:9.3f} s  (bases {t_hg - t_pk:.3f} s + PK {t_pk:.3f} s), "
          f"peak +{mem_hg.peak / 2**20:.0f} MiB")
    if tl_time is not None:
        print(f"  TransformerLens  {tl_time:9.3f} s  peak +{mem_tl.peak / 2**20:.0f} MiB   "
              f"-> headgraph {tl_time / t_hg:.1f}x faster")
    print(f"  scipy loop      ~{scipy_time:9.1f} s  (extrapolated: {per_pair * 1e3:.2f} ms/pair x {n_pairs} pairs, "
          f"{len(sampled)} pairs timed) -> headgraph {scipy_time / t_hg:.0f}x faster")
    print(f"  fp32 GEMM peak {gemm / 1e9:.1f} GFLOP/s ({args.gemm_n}^3); engine PK {flops / t_pk / 1e9:.1f} GFLOP/s "
          f"= {flops / t_pk / gemm:.0%} of it")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--large-layers", type=int, default=None,
                        help="layers of the large shape (default: 32 on CUDA, 4 on CPU — a documented subset)")
    parser.add_argument("--scipy-pairs", type=int, default=60, help="pairs timed in the scipy loop")
    parser.add_argument("--gemm-n", type=int, default=None, help="square GEMM size for the FLOP/s peak")
    parser.add_argument("--skip-tl", action="store_true", help="skip TransformerLens (e.g. on a huge shape)")
    parser.add_argument("--only", choices=["gpt2", "large"], default=None)
    args = parser.parse_args()
    args.gemm_n = args.gemm_n or (8192 if args.device == "cuda" else 2048)
    large_layers = args.large_layers or (32 if args.device == "cuda" else 4)
    shapes = [Shape("GPT-2 small", 12, 12, 12, 768, 64),
              Shape("large" + ("" if large_layers == 32 else f" (subset: {large_layers} of 32 layers)"),
                    large_layers, 32, 8, 4096, 128)]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}")
    for shape in shapes:
        if args.only is None or (args.only == "gpt2") == shape.name.startswith("GPT-2"):
            bench(shape, args.device, args)


if __name__ == "__main__":
    main()
