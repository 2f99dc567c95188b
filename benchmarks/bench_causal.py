"""Benchmark (run by hand): the cost of direct-path patching (headgraph.analysis.causal) on this machine.

    python3 benchmarks/bench_causal.py                  # MiniLM (offline) and a GPT-2-small-shaped random model
    python3 benchmarks/bench_causal.py --inputs 16 --edges 3
    python3 benchmarks/bench_causal.py --inputs 48 --no-minilm   # attribution on 48 inputs of each shape
    python3 benchmarks/bench_causal.py --analyze 3       # `headgraph analyze all-MiniLM-L6-v2`, causal on vs off
    python3 benchmarks/bench_causal.py --gqa --repeat 3  # only the GPT-2 and Llama shapes' local effects
    python3 benchmarks/bench_causal.py --tl              # exact loss effects against TransformerLens' own

For each model: `local_effects` on every OQ/OK/OV pair over N generated inputs (the role-test inputs of its
kind: sentence pairs for MiniLM, IOI prompts + repeated random tokens for the decoder) and `loss_effects` on a
few edges; printed as seconds, seconds per input, pairs per second, and seconds per edge, each measured in
this one run. The GPT-2-small shape is 12 layers x 12 heads, d_model 768, d_head 64 with a 512-token
vocabulary (random weights: the cost does not depend on what the weights learned); the Llama shape beside it
has the same sizes with grouped-query attention (4 KV heads), rotary positions and RMSNorm, patched through the
bridge's own attention modules (the "module" path), and its cost per pair is printed as a ratio to GPT-2's.

`--analyze N` times the README's main command as whole processes, N times each with causal effects on (the
default) and off (`--no-causal`), alternating so that a drifting machine moves both alike, and prints the median
ratio on / off (the target: at most 1.5) with the causal stage's own seconds from run.json.

`--gqa` times only the two shapes' local effects (no attribution), `--repeat` times each, alternating, and
prints the fastest run of each in wall-clock and in CPU seconds (this process's, both threads): on a machine
other jobs share, the fastest run and the CPU seconds move least with the load.

`--tl` times the exact loss effects of one sender's paths into every later head's query, key and value on the
GPT-2-small shape against TransformerLens' `get_act_patch_direct_path` (one bridge forward per path) on the
same edges, inputs and counterfactuals: TransformerLens patches its "corrupted" run with the clean-minus-
corrupted write, so headgraph's clean inputs are its corrupted tokens and headgraph's counterfactuals its clean
cache. Both are timed alternating, `--repeat` times, the fastest of each kept; the two sets of effects must agree
(their largest difference is printed)."""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_pk import gemm_flops_per_s, matmul_counter

from headgraph.analysis.causal import causal_inputs, local_effects, loss_effects
from headgraph.analysis.prompts import repeated_token_inputs
from headgraph.loader.models import load_model
from headgraph.testing.synthetic import save_synthetic, save_synthetic_gqa


def bench(name: str, model, n_inputs: int, n_edges: int, n_boot: int) -> float:
    """Print the costs of one model; returns local_effects' seconds per pair and input."""
    inputs = causal_inputs(model, n_inputs)
    tokens = sum(int(x.attention_mask.sum()) for x in inputs)
    n = sum(len(x.input_ids) for x in inputs)
    started = time.perf_counter()
    local = local_effects(model, inputs, n_boot=n_boot, attribution=False)
    local_s = time.perf_counter() - started
    started = time.perf_counter()
    local_effects(model, inputs, n_boot=n_boot)
    attribution_s = time.perf_counter() - started - local_s  # the gradient passes and their products
    edges = local.sort_values("effect", ascending=False).head(n_edges)
    started = time.perf_counter()
    loss_effects(model, inputs, edges, n_boot=n_boot)
    loss_s = time.perf_counter() - started
    print(f"{name}: {n} inputs ({tokens} tokens), {len(local)} pairs")
    print(f"  local_effects {local_s:7.2f} s = {local_s / n:.3f} s per input, {len(local) / local_s:,.0f} pairs/s")
    if model.cfg["is_decoder"]:
        flops = attribution_flops(model, inputs, n_boot)
        gemm = gemm_flops_per_s("cpu", 4096)
        print(f"  attribution: {len(local)} pairs in {attribution_s:.2f} s (beside the local effects); its floor: "
              f"{flops / 1e9:.0f} GFLOP of matmuls (its gradient passes and products) = {flops / gemm:.2f} s at this "
              f"CPU's fp32 GEMM peak of {gemm / 1e9:.0f} GFLOP/s")
    print(f"  loss_effects  {loss_s:7.2f} s = {loss_s / max(len(edges), 1):.2f} s per edge ({len(edges)} edges)")
    return local_s / len(local) / n


def attribution_flops(model, inputs, n_boot: int) -> float:
    """Matmul FLOPs (`matmul_counter`, backward passes included) that attribution adds to local_effects."""
    counted = []
    for attribution in (False, True):
        with matmul_counter() as counter:
            local_effects(model, inputs, n_boot=n_boot, attribution=attribution)
        counted.append(counter.get_total_flops())
    return float(counted[1] - counted[0])


def bench_gqa(models: dict, n_inputs: int, n_boot: int, repeat: int) -> None:
    """Local effects (no attribution) of each model, `repeat` times alternating; the fastest of each printed,
    wall-clock and CPU seconds, per input and per pair and input, and the ratio of the last model to the first."""
    inputs = {name: causal_inputs(model, n_inputs) for name, model in models.items()}
    wall, cpu, pairs = {name: [] for name in models}, {name: [] for name in models}, {}
    for _ in range(repeat):
        for name, model in models.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            pairs[name] = len(local_effects(model, inputs[name], n_boot=n_boot, attribution=False))
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - started_cpu)
    per_pair = {}
    for name in models:
        n = sum(len(x.input_ids) for x in inputs[name])
        tokens = sum(int(x.attention_mask.sum()) for x in inputs[name])
        w, c = min(wall[name]), min(cpu[name])
        per_pair[name] = (w / pairs[name] / n, c / pairs[name] / n)
        print(f"{name}: {n} inputs ({tokens} tokens), {pairs[name]} pairs, fastest of {repeat}")
        print(f"  local_effects {w:7.2f} s = {w / n:.3f} s per input, {pairs[name] / w:,.0f} pairs/s; "
              f"CPU {c:.2f} s = {c / n:.3f} s per input (runs: {', '.join(f'{x:.1f}' for x in wall[name])} s)")
    first, last = (per_pair[name] for name in (next(iter(models)), list(models)[-1]))
    print(f"GQA / GPT-2 local cost per pair and input: {last[0] / first[0]:.2f}x wall-clock, "
          f"{last[1] / first[1]:.2f}x CPU (goal: at most 1.5x)")


def bench_tl(model, n_inputs: int, n_boot: int, repeat: int, source: str = "L4H7") -> None:
    """Exact loss effects of `source` into every later head's Q, K and V: headgraph's loss_effects against
    TransformerLens' get_act_patch_direct_path, same edges, inputs and counterfactuals; fastest of `repeat`."""
    import pandas as pd
    from transformer_lens.patching import get_act_patch_direct_path

    bridge, layer, head = model.bridge, int(source[1:source.index("H")]), int(source[source.index("H") + 1:])
    n_layers, n_heads = model.cfg["n_layers"], model.cfg["n_heads"]
    clean = repeated_token_inputs(model.tokenizer, n_inputs, seed=0, length=32)
    other = repeated_token_inputs(model.tokenizer, n_inputs, seed=1, length=32)  # same length: no padding
    receivers = [(l, h) for l in range(layer + 1, n_layers) for h in range(n_heads)]
    edges = pd.DataFrame([(source, f"L{l}H{h}", "O", kind) for kind in "QKV" for l, h in receivers],
                         columns=["source", "target", "source_type", "target_type"])
    ids = clean.input_ids

    def mean_loss(logits):  # headgraph's unit: nats per predicted token
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    with torch.no_grad():
        base = float(mean_loss(bridge(ids)))
        _, clean_cache = bridge.run_with_cache(ids)
        _, other_cache = bridge.run_with_cache(other.input_ids)

    def ours():
        return loss_effects(model, clean, edges, corrupted=other, n_boot=n_boot).effect_loss.to_numpy()

    def theirs():
        with torch.no_grad():
            found = [get_act_patch_direct_path(bridge, ids, other_cache, clean_cache, mean_loss, layer, head,
                                               kind.lower(), verbose=False) for kind in "QKV"]
        return torch.stack([f[layer + 1:].flatten() for f in found]).flatten().numpy() - base

    times = {"headgraph": [], "TransformerLens": []}
    for _ in range(repeat):
        for name, run in (("headgraph", ours), ("TransformerLens", theirs)):
            started = time.perf_counter()
            effects = run()
            times[name].append(time.perf_counter() - started)
            if name == "headgraph":
                mine = effects
            else:
                gap = float(abs(mine - effects).max())
    ours_s, theirs_s = min(times["headgraph"]), min(times["TransformerLens"])
    print(f"{len(edges)} edges from {source} (Q, K, V of every later head), {n_inputs} inputs of {ids.shape[1]} "
          f"tokens, fastest of {repeat}: headgraph {ours_s:.2f} s, TransformerLens {theirs_s:.2f} s; largest "
          f"difference of the effects {gap:.1e} nats")
    print(f"exact loss vs TransformerLens get_act_patch_direct_path: headgraph {theirs_s / ours_s:.1f}x faster "
          "(goal: at least 5x)")


def bench_analyze(runs: int) -> None:
    walls, stages = {"on": [], "off": []}, []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            for mode in ("on", "off"):
                out = f"{tmp}/{mode}{i}"
                command = [sys.executable, "-m", "headgraph", "analyze", "all-MiniLM-L6-v2", "--out", out, "--db",
                           f"{tmp}/{mode}{i}.lbdb", *(["--no-causal"] if mode == "off" else [])]
                started = time.perf_counter()
                subprocess.run(command, check=True, capture_output=True)
                walls[mode].append(time.perf_counter() - started)
                if mode == "on":
                    stages.append(json.loads(Path(out, "run.json").read_text())["causal"]["timings_s"])
    ratios = [a / b for a, b in zip(walls["on"], walls["off"])]
    print(f"headgraph analyze all-MiniLM-L6-v2, {runs} runs each (whole processes)")
    for mode in ("on", "off"):
        print(f"  causal {mode:3s}: median {statistics.median(walls[mode]):6.1f} s "
              f"(min {min(walls[mode]):.1f}, max {max(walls[mode]):.1f})")
    print(f"  causal stage: local {statistics.median(s['local'] for s in stages):.1f} s, "
          f"loss {statistics.median(s['loss'] for s in stages):.1f} s (medians)")
    print(f"  ratio on / off: median {statistics.median(ratios):.2f} (pairwise: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=32, help="inputs per input set")
    parser.add_argument("--edges", type=int, default=5, help="edges for loss_effects")
    parser.add_argument("--boot", type=int, default=1000, help="bootstrap samples")
    parser.add_argument("--analyze", type=int, default=0, metavar="N",
                        help="instead: N whole `headgraph analyze all-MiniLM-L6-v2` runs each with causal on and off")
    parser.add_argument("--gqa", action="store_true",
                        help="only the GPT-2 and Llama shapes' local effects (no attribution, no loss effects, no "
                             "MiniLM): the GQA / GPT-2 cost ratio")
    parser.add_argument("--no-minilm", action="store_true", help="leave MiniLM out (the decoder shapes only)")
    parser.add_argument("--tl", action="store_true",
                        help="only the exact loss effects against TransformerLens' get_act_patch_direct_path")
    parser.add_argument("--repeat", type=int, default=1, help="with --gqa or --tl: runs of each, the fastest kept")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.analyze:
        bench_analyze(args.analyze)
        return
    if not (args.gqa or args.tl or args.no_minilm):
        bench("all-MiniLM-L6-v2", load_model("all-MiniLM-L6-v2", processing="raw", device="cpu"), args.inputs,
              args.edges, args.boot)
    with tempfile.TemporaryDirectory() as tmp:
        gpt2 = load_model(str(save_synthetic(f"{tmp}/gpt2-small-shape", n_layers=12, n_heads=12, d_model=768,
                                             d_head=64, vocab=512)), processing="raw", device="cpu")
        if args.tl:
            bench_tl(gpt2, args.inputs // 2, args.boot, args.repeat)
            return
        llama = load_model(str(save_synthetic_gqa(f"{tmp}/llama-gqa-shape", n_layers=12, n_heads=12, n_kv_heads=4,
                                                  d_model=768, d_head=64, vocab=512)), processing="raw", device="cpu")
        names = ("GPT-2-small shape", "Llama shape (GQA, 4 KV heads)")
        if args.gqa:
            bench_gqa(dict(zip(names, (gpt2, llama))), args.inputs // 2, args.boot, args.repeat)
            return
        gpt2_s = bench(names[0], gpt2, args.inputs // 2, args.edges, args.boot)
        llama_s = bench(names[1], llama, args.inputs // 2, args.edges, args.boot)
        print(f"GQA / GPT-2 local cost per pair and input: {llama_s / gpt2_s:.2f}x (goal: at most 1.5x)")


if __name__ == "__main__":
    main()
