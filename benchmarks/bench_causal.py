"""Benchmark (run by hand): the cost of direct-path patching (headgraph.analysis.causal) on this machine.

    python3 benchmarks/bench_causal.py                  # MiniLM (offline) and a GPT-2-small-shaped random model
    python3 benchmarks/bench_causal.py --inputs 16 --edges 3

For each model: `local_effects` on every OQ/OK/OV pair over N generated inputs (the role-test inputs of its
kind: sentence pairs for MiniLM, IOI prompts + repeated random tokens for the decoder) and `loss_effects` on a
few edges; printed as seconds, seconds per input, pairs per second, and seconds per edge, each measured in
this one run. The GPT-2-small shape is 12 layers x 12 heads, d_model 768, d_head 64 with a 512-token
vocabulary (random weights: the cost does not depend on what the weights learned)."""

import argparse
import tempfile
import time

import torch

from headgraph.analysis.causal import causal_inputs, local_effects, loss_effects
from headgraph.loader.models import load_model
from headgraph.testing.synthetic import save_synthetic


def bench(name: str, model, n_inputs: int, n_edges: int, n_boot: int) -> None:
    inputs = causal_inputs(model, n_inputs)
    tokens = sum(int(x.attention_mask.sum()) for x in inputs)
    started = time.perf_counter()
    local = local_effects(model, inputs, n_boot=n_boot)
    local_s = time.perf_counter() - started
    edges = local.sort_values("effect", ascending=False).head(n_edges)
    started = time.perf_counter()
    loss_effects(model, inputs, edges, n_boot=n_boot)
    loss_s = time.perf_counter() - started
    n = sum(len(x.input_ids) for x in inputs)
    print(f"{name}: {n} inputs ({tokens} tokens), {len(local)} pairs")
    print(f"  local_effects {local_s:7.2f} s = {local_s / n:.3f} s per input, {len(local) / local_s:,.0f} pairs/s")
    print(f"  loss_effects  {loss_s:7.2f} s = {loss_s / max(len(edges), 1):.2f} s per edge ({len(edges)} edges)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=32, help="inputs per input set")
    parser.add_argument("--edges", type=int, default=5, help="edges for loss_effects")
    parser.add_argument("--boot", type=int, default=1000, help="bootstrap samples")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench("all-MiniLM-L6-v2", load_model("all-MiniLM-L6-v2", processing="raw", device="cpu"), args.inputs,
          args.edges, args.boot)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_synthetic(f"{tmp}/gpt2-small-shape", n_layers=12, n_heads=12, d_model=768, d_head=64, vocab=512)
        bench("GPT-2-small shape", load_model(str(folder), processing="raw", device="cpu"), args.inputs // 2,
              args.edges, args.boot)


if __name__ == "__main__":
    main()
