"""Scale benchmark (run by hand): whole `headgraph analyze` runs on random-init checkpoints of real models' shapes.

Checkpoints are built offline; each stage's seconds and peak memory are printed against the checkpoint's bytes.

    python3 benchmarks/bench_scale.py                                   # GPT-2-small and TinyLlama-1.1B shapes
    python3 benchmarks/bench_scale.py --shape tinyllama-1.1b --no-causal
    python3 benchmarks/bench_scale.py --shape llama3-8b --layers 4      # a subset of the 8B on a small machine
    python3 benchmarks/bench_scale.py --shape llama3-8b --device cuda --types all
    python3 benchmarks/bench_scale.py --shape tinyllama-1.1b --causal-n 4 --floors   # causal stages vs their floor

Shapes (--shape, repeatable): gpt2-small (12 layers x 12 heads, d_model 768, vocab 50257, tied embeddings),
tinyllama-1.1b (22 x 32 heads, 4 KV heads, d_model 2048, MLP 5632, vocab 32000), llama3-8b (32 x 32 heads, 8 KV
heads, d_model 4096, MLP 14336, vocab 128256). --layers N keeps the first N layers of every shape asked for, each
layer and the embeddings exactly the shape's: the per-head and per-layer work is the full model's, what grows
with the number of layers (pairs of heads, ~L^2; the forward passes, ~L) is not, so the printed numbers are
that subset's, not the full model's.

A checkpoint is written tensor by tensor as bf16 safetensors, one shard per layer plus the embeddings' and the
head's, with a model.safetensors.index.json: building the 8B one holds at most one tensor's float32 draw (in row
chunks of CHUNK_BYTES) and one layer's bf16 tensors, never the model (the build's own peak RSS is printed). Weights are
N(0, 0.02) (GPT-2: its residual writers / sqrt(2L), as GPT-2's init), norms 1, biases 0, drawn on --device; the
tokenizer is headgraph.testing.synthetic's offline byte-level BPE padded to the shape's vocabulary. Random init:
the role tests settle at their first look and the graph has no structure, so this measures cost, not findings.

Each analyze is a fresh process, as a user runs it: `python -m headgraph analyze DIR --json --device D`, an
embedded store in the work folder, the report unless --no-report, and --types / --no-roles / --no-causal /
--max-memory passed on. Read back: the --json summary's `timings_s` (seconds per step) and, where the run has
them, `stages` (each stage's peak RSS, and on CUDA its peak GPU memory); run.json's PK stage seconds, the
engine's built and distinct heads and the role tests' inputs used per set. Peak RSS of a step is what analyze
itself recorded (VmHWM per stage, or the process's running maximum: the table says which); the process's peak
RSS is the largest of those and its ru_maxrss from os.wait4 (this child's own, unlike RUSAGE_CHILDREN's maximum
over every child so far), which alone would miss a peak before analyze's last reset of the high-water mark. On
CUDA each step's peak GPU memory is what torch's allocator had handed out (analyze's record), and the process's,
device-wide above the level before it (the CUDA context and torch's cache included), is sampled from nvidia-smi
every POLL_S seconds.
"""

import argparse
import json
import math
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save_file

from headgraph.testing.synthetic import gpt2_config, save_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CHUNK_BYTES = 256 * 2**20  # float32 bytes drawn at once while writing one tensor
POLL_S = 0.5
STD = 0.02
GIB = 2**30


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str  # "gpt2" or "llama"
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int
    d_mlp: int
    vocab: int
    n_ctx: int
    rope_theta: float = 10000.0

    def describe(self) -> str:
        kv = f" ({self.n_kv_heads} KV)" if self.n_kv_heads != self.n_heads else ""
        return (f"{self.n_layers} layers x {self.n_heads} heads{kv}, d_model {self.d_model}, d_head {self.d_head}, "
                f"MLP {self.d_mlp}, vocab {self.vocab}")


SHAPES = {
    "gpt2-small": Shape("gpt2-small", "gpt2", 12, 12, 12, 768, 64, 3072, 50257, 1024),
    "tinyllama-1.1b": Shape("tinyllama-1.1b", "llama", 22, 32, 4, 2048, 64, 5632, 32000, 2048),
    "llama3-8b": Shape("llama3-8b", "llama", 32, 32, 8, 4096, 128, 14336, 128256, 8192, rope_theta=500000.0),
}
DEFAULT_SHAPES = ("gpt2-small", "tinyllama-1.1b")


# ---------- building a checkpoint -----------------------------------------------------------------------------

def layer_tensors(shape: Shape, layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, init)} of one layer in the checkpoint's own layout; init is "normal", "writer", "ones" or
    "zeros" ("writer": GPT-2's residual writers, std / sqrt(2L))."""
    d, f = shape.d_model, shape.d_mlp
    if shape.arch == "gpt2":
        p = f"transformer.h.{layer}."
        return {p + "ln_1.weight": ((d,), "ones"), p + "ln_1.bias": ((d,), "zeros"),
                p + "attn.c_attn.weight": ((d, 3 * d), "normal"), p + "attn.c_attn.bias": ((3 * d,), "zeros"),
                p + "attn.c_proj.weight": ((d, d), "writer"), p + "attn.c_proj.bias": ((d,), "zeros"),
                p + "ln_2.weight": ((d,), "ones"), p + "ln_2.bias": ((d,), "zeros"),
                p + "mlp.c_fc.weight": ((d, f), "normal"), p + "mlp.c_fc.bias": ((f,), "zeros"),
                p + "mlp.c_proj.weight": ((f, d), "writer"), p + "mlp.c_proj.bias": ((d,), "zeros")}
    q, kv = shape.n_heads * shape.d_head, shape.n_kv_heads * shape.d_head
    p = f"model.layers.{layer}."
    return {p + "input_layernorm.weight": ((d,), "ones"),
            p + "self_attn.q_proj.weight": ((q, d), "normal"), p + "self_attn.k_proj.weight": ((kv, d), "normal"),
            p + "self_attn.v_proj.weight": ((kv, d), "normal"), p + "self_attn.o_proj.weight": ((d, q), "normal"),
            p + "post_attention_layernorm.weight": ((d,), "ones"),
            p + "mlp.gate_proj.weight": ((f, d), "normal"), p + "mlp.up_proj.weight": ((f, d), "normal"),
            p + "mlp.down_proj.weight": ((d, f), "normal")}


def outer_tensors(shape: Shape) -> tuple[dict, dict]:
    """The tensors before the first layer and after the last one, as layer_tensors gives them."""
    d, v = shape.d_model, shape.vocab
    if shape.arch == "gpt2":
        return ({"transformer.wte.weight": ((v, d), "normal"), "transformer.wpe.weight": ((shape.n_ctx, d), "normal")},
                {"transformer.ln_f.weight": ((d,), "ones"), "transformer.ln_f.bias": ((d,), "zeros")})
    return ({"model.embed_tokens.weight": ((v, d), "normal")},
            {"model.norm.weight": ((d,), "ones"), "lm_head.weight": ((v, d), "normal")})


def config_of(shape: Shape) -> dict:
    """config.json of the shape (bf16), BOS/EOS/PAD the tokenizer's last id as headgraph.testing.synthetic's."""
    if shape.arch == "gpt2":
        return {**gpt2_config(shape.n_layers, shape.n_heads, shape.d_model, shape.n_ctx, shape.vocab),
                "torch_dtype": "bfloat16"}
    from transformers import LlamaConfig

    bos = shape.vocab - 1
    return LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.d_model, intermediate_size=shape.d_mlp,
        num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads,
        head_dim=shape.d_head, max_position_embeddings=shape.n_ctx, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        bos_token_id=bos, eos_token_id=bos, pad_token_id=bos, tie_word_embeddings=False, dtype="bfloat16",
    ).to_dict()


def draw(size: tuple[int, ...], init: str, shape: Shape, g: torch.Generator) -> torch.Tensor:
    """One bf16 tensor on the CPU, drawn in float32 row chunks of at most CHUNK_BYTES on the generator's device."""
    out = torch.empty(size, dtype=torch.bfloat16)
    if init in ("ones", "zeros"):
        return out.fill_(1.0 if init == "ones" else 0.0)
    std = STD / math.sqrt(2 * shape.n_layers) if init == "writer" else STD
    rows = max(1, CHUNK_BYTES // (4 * math.prod(size[1:])))
    for start in range(0, size[0], rows):
        stop = min(start + rows, size[0])
        chunk = torch.empty((stop - start, *size[1:]), device=g.device).normal_(0.0, std, generator=g)
        out[start:stop] = chunk.to(torch.bfloat16).cpu()
    return out


def build_checkpoint(shape: Shape, folder: Path, device: str, seed: int = 0) -> dict:
    """Write the shape's random-init bf16 checkpoint into `folder`, one shard at a time; returns its bytes, tensor
    and parameter counts, shard count and build seconds."""
    start = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(seed)
    first, last = outer_tensors(shape)
    groups = [first, *(layer_tensors(shape, layer) for layer in range(shape.n_layers)), last]
    weight_map, total, params = {}, 0, 0
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: draw(size, init, shape, g) for name, (size, init) in group.items()}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        params += sum(t.numel() for t in tensors.values())
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(config_of(shape), indent=2))
    save_tokenizer(folder, shape.vocab)
    files = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return {"tensor_bytes": total, "file_bytes": files, "params": params, "shards": len(groups),
            "seconds": time.perf_counter() - start}


# ---------- running analyze -----------------------------------------------------------------------------------

class GpuMemory:
    """Peak GPU memory in use, device-wide, above the level at entry: nvidia-smi sampled every POLL_S s."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.peak = self.base = 0
        self._stop = threading.Event()

    @staticmethod
    def _used() -> int:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[0]) * 2**20  # MiB

    def _poll(self):
        while not self._stop.wait(POLL_S):
            self.peak = max(self.peak, self._used())

    def __enter__(self):
        if self.enabled:
            self.base = self.peak = self._used()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._stop.set()
            self._thread.join()

    def above_base(self) -> int | None:
        return self.peak - self.base if self.enabled else None


# `python -m headgraph`, with faulthandler set to write every thread's Python stack on SIGUSR1: an analyze cut
# at --timeout is sent SIGUSR1, then killed, so that its stack says where it was.
HEADGRAPH_MAIN = ("import faulthandler, runpy, signal; faulthandler.register(signal.SIGUSR1, all_threads=True); "
                  "runpy.run_module('headgraph', run_name='__main__', alter_sys=True)")
STACK_S = 2  # seconds between SIGUSR1 and SIGKILL


def stop_with_stack(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGUSR1)
    time.sleep(STACK_S)
    process.kill()


def headgraph_frames(stderr: str) -> list[str]:
    """The thread headers of a faulthandler dump and, under each, its frames in headgraph's own files."""
    return [line.strip() for line in stderr.splitlines()
            if "/headgraph/" in line or line.startswith(("Thread 0x", "Current thread 0x"))]


def run_analyze(folder: Path, work: Path, args) -> dict:
    """One fresh `headgraph analyze` process on the folder: wall seconds, ru_maxrss, GPU peak, its --json summary
    and run.json (None where the process failed; its stderr's tail is then printed, and where --timeout cut it,
    the headgraph frames of its stack)."""
    command = [sys.executable, "-c", HEADGRAPH_MAIN, "analyze", str(folder), "--json", "--device", args.device,
               "--out", str(work / "run"), "--db", str(work / "graph.lbdb"), "--max-memory", args.max_memory]
    if args.types:
        command += ["--types", args.types]
    for flag, value in (("--causal-n", args.causal_n), ("--causal-loss-inputs", args.causal_loss_inputs)):
        if value is not None:
            command += [flag, str(value)]
    command += [flag for flag, on in (("--no-roles", args.no_roles), ("--no-causal", args.no_causal),
                                      ("--no-report", args.no_report)) if on]
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))  # this checkout first
    env = {**os.environ, "PYTHONPATH": path, "NEO4J_URI": ""}
    print(f"  $ headgraph {' '.join(command[3:])}", flush=True)
    with open(work / "analyze.out", "w") as out, open(work / "analyze.err", "w") as err, \
            GpuMemory(args.device == "cuda") as gpu:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        limit = threading.Timer(args.timeout, stop_with_stack, (process,)) if args.timeout else None
        if limit is not None:
            limit.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage
        except BaseException:  # Ctrl-C, or SIGTERM's exit (`main`): the analyze goes too
            process.kill()
            process.wait()
            raise
        finally:
            if limit is not None:
                limit.cancel()
        wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    result = {"wall": wall, "maxrss": usage.ru_maxrss * 1024, "gpu_peak": gpu.above_base(),
              "rc": process.returncode, "summary": None, "run": None}
    if process.returncode != 0:
        stderr = (work / "analyze.err").read_text()
        if process.returncode == -9 and args.timeout:
            why, lines = f"killed at --timeout {args.timeout} s", ["its stack then, headgraph's frames, innermost "
                                                                   "first:", *headgraph_frames(stderr)]
        else:
            why, lines = "failed", stderr.strip().splitlines()[-15:]
        print(f"  analyze {why} (exit {process.returncode}) after {wall:.1f} s:\n    " + "\n    ".join(lines))
        return result
    result["summary"] = json.loads((work / "analyze.out").read_text())
    result["run"] = json.loads((work / "run" / "run.json").read_text())
    return result


# ---------- the table -----------------------------------------------------------------------------------------

def gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def stage_rows(result: dict) -> list[tuple[str, float | None, int | None, int | None]]:
    """(step, seconds, peak RSS bytes, peak GPU bytes) in the order analyze ran them, the PK stages of run.json
    indented under their step; the peaks where analyze recorded them (--json `stages`, else run.json's; the GPU's
    only where the process used CUDA: torch's allocator, per stage)."""
    summary, run = result["summary"], result["run"]
    stages = summary.get("stages") or run.get("stages") or {}
    rows = []
    for step, seconds in summary["timings_s"].items():
        stage = stages.get(step) or {}
        rows.append((step, seconds, stage.get("peak_rss_bytes"), stage.get("peak_gpu_bytes")))
        if step == "pk_and_significance":
            rows += [(f"  {name}", s, None, None) for name, s in (run.get("timings_s") or {}).items()
                     if isinstance(s, (int, float))]
    return rows


def notes(result: dict) -> list[str]:
    """What the run did besides its seconds: the engine's builds, the role tests' inputs, the RSS measure."""
    run, summary, lines = result["run"], result["summary"], []
    engine = (run.get("engine") or {}).get("pass") or {}
    distinct = sum(s.get("heads", 0) for s in (engine.get("sets") or {}).values())
    if engine.get("built_heads") is not None and distinct:
        lines.append(f"PK engine: {engine['formulation']}, built {engine['built_heads']} projector heads for "
                     f"{distinct} distinct heads ({engine['built_heads'] / distinct:.1f}x), "
                     f"{engine.get('computed_pairs')} pairs")
        predicted = (engine.get("predicted_s") or {}).get(engine["formulation"])
        took = (run.get("timings_s") or {}).get("projection_kernel")
        if predicted and took:
            lines.append(f"PK pass: {took:.1f} s against the plan's predicted {predicted:.1f} s "
                         f"({took / predicted:.2f}x; calibrated kernel rates of this machine)")
    roles = run.get("roles") or {}
    if roles.get("inputs"):
        used = ", ".join(f"{name} {x['n']} of {x.get('n_inputs', roles.get('n_inputs'))}"
                         for name, x in roles["inputs"].items())
        lines.append(f"role tests ({roles.get('design', 'fixed')}): inputs used {used}")
    causal = run.get("causal") or {}
    if causal.get("inputs"):
        lines.append(f"causal inputs: {causal['inputs']}" + (f"; skipped: {causal['skipped']}" if causal.get("skipped")
                                                              else ""))
    how = summary.get("peak_rss") or run.get("peak_rss")
    if how:
        lines.append(f"per-step peak RSS: {'VmHWM of each stage' if how == 'vmhwm' else how}")
    return lines


def print_result(built: dict, result: dict) -> None:
    checkpoint = built["file_bytes"]
    if result["summary"] is None:
        print(f"  no table: analyze exited {result['rc']} after {result['wall']:.1f} s, ru_maxrss "
              f"{gib(result['maxrss'])} GiB")
        return
    rows = stage_rows(result)
    on_gpu = any(gpu is not None for *_, gpu in rows)
    print(f"  {'step':<28}{'seconds':>10}{'peak RSS GiB':>14}" + (f"{'peak GPU GiB':>14}" if on_gpu else ""))
    for name, seconds, peak, gpu in rows:
        print(f"  {name:<28}{seconds:>10.1f}{gib(peak):>14}" + (f"{gib(gpu):>14}" if on_gpu else ""))
    steps = sum(s for name, s, *_ in rows if not name.startswith(" "))
    peak = max([result["maxrss"], *(p for _, _, p, _ in rows if p is not None)])
    print(f"  {'python start, imports':<28}{result['wall'] - steps:>10.1f}")
    print(f"  {'process wall, peak RSS':<28}{result['wall']:>10.1f}{gib(peak):>14}  ({peak / checkpoint:.1f}x the "
          "checkpoint's bytes)")
    if result["gpu_peak"] is not None:
        print(f"  {'GPU memory peak (nvidia-smi)':<28}{'':>10}{gib(result['gpu_peak']):>14}  (device-wide, above "
              "the level before the process)")
    for line in notes(result):
        print(f"  {line}")


GEMM_N = 2048  # the square matmul whose best time gives the fp32 GEMM peak of the floors


def gemm_peak(device: str) -> float:
    """FLOP/s of the best of 10 GEMM_N^3 fp32 products (bench_pk.gemm_flops_per_s)."""
    from bench_pk import gemm_flops_per_s

    return gemm_flops_per_s(device, GEMM_N)


def print_floors(folder: Path, run_dir: Path, result: dict, device: str, peak_before: float) -> None:
    """Each model stage's matmul FLOPs (bench_pk.counted_flops: the stage rerun as the run ran it, under torch's
    FlopCounterMode) at the fp32 GEMM peak of a GEMM_N^3 product, measured before the analyze process and again
    after it, beside the seconds analyze took for it: a shared VM's peak moves between such readings (259.7 and
    328.0 GFLOP/s an hour apart on one day), and each stage's ratio with it, so both are printed."""
    from bench_pk import counted_flops

    peak_after = gemm_peak(device)
    peaks = sorted([peak_before, peak_after])
    took = {"roles": "roles", "causal local": "causal_local", "causal loss": "causal_loss"}
    print(f"  floors at the fp32 GEMM peak ({GEMM_N}^3 matmul, best of 10) of {peak_before / 1e9:.1f} GFLOP/s "
          f"before the run and {peak_after / 1e9:.1f} after it:")
    for name, flops in counted_flops(folder, device, run_dir).items():
        low, high = flops / peaks[1], flops / peaks[0]
        ran = result["summary"]["timings_s"].get(took[name])
        print(f"  {name:<26}{flops / 1e9:>10.0f} GFLOP = {low:.1f}-{high:.1f} s floor; ran {ran:.1f} s "
              f"({ran / high:.2f}-{ran / low:.2f}x the floor)")


def _proc_field(file: str, key: str) -> str | None:
    """The value of the first `key` line of a /proc file, or None (not Linux)."""
    path = Path("/proc") / file
    lines = path.read_text().splitlines() if path.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), None)


def machine() -> str:
    """Date, host, CPU, cores, memory, GPU, versions and the checkout's commit: what the numbers were measured on."""
    import transformers

    cpu = _proc_field("cpuinfo", "model name") or platform.processor()
    memory = int((_proc_field("meminfo", "MemTotal") or "0 kB").split()[0]) * 1024
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], check=False,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    return (f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()}: {cpu}, "
            f"{len(os.sched_getaffinity(0))} of {os.cpu_count()} cores, {memory / GIB:.0f} GiB RAM, GPU {gpu}; "
            f"torch {torch.__version__}, transformers {transformers.__version__}, headgraph {commit}")


def shape_spec(text: str) -> tuple[str, int | None]:
    """--shape NAME or NAME:LAYERS (the first LAYERS layers of that shape)."""
    name, _, layers = text.partition(":")
    if name not in SHAPES or (layers and (not layers.isdigit() or int(layers) < 1)):
        raise argparse.ArgumentTypeError(f"{text!r}: use one of {', '.join(SHAPES)}, optionally :LAYERS (>= 1)")
    return name, int(layers) if layers else None


def print_summary(results: list[tuple[Shape, dict, dict]]) -> None:
    """One table of every shape's steps: seconds and peak RSS (GiB) side by side, and peak GPU memory (GiB) where
    the processes used CUDA."""
    done = [(shape, built, result) for shape, built, result in results if result["summary"] is not None]
    if len(done) < 2:
        return
    tables = [{name: row for name, *row in stage_rows(result)} for _, _, result in done]
    on_gpu = any(row[2] is not None for table in tables for row in table.values())
    width = 36 if on_gpu else 26
    steps = list(dict.fromkeys(name for table in tables for name in table))
    print("\n== all shapes: seconds / peak RSS GiB" + (" / peak GPU GiB" if on_gpu else "") + " per step")
    print(f"  {'step':<28}" + "".join(f"{shape.name.split(' ')[0]:>{width}}" for shape, _, _ in done))
    for step in steps:
        cells = [table.get(step) for table in tables]
        print(f"  {step:<28}" + "".join(f"{'-':>{width}}" if c is None else f"{c[0]:>16.1f}{gib(c[1]):>10}"
                                         + (f"{gib(c[2]):>10}" if on_gpu else "") for c in cells))
    print(f"  {'process wall':<28}" + "".join(f"{r['wall']:>16.1f}{'':>{width - 16}}" for _, _, r in done))
    print(f"  {'checkpoint GB (bf16)':<28}" + "".join(f"{b['file_bytes'] / 1e9:>{width}.2f}" for _, b, _ in done))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", action="append", type=shape_spec, metavar="NAME[:LAYERS]",
                        help=f"shape to build and analyze, one of {', '.join(SHAPES)}, :LAYERS for its first layers "
                             f"only (repeatable; default {', '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers of every shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--types", default=None, help="analyze --types (default: analyze's own)")
    parser.add_argument("--max-memory", default="2GiB", help="analyze --max-memory")
    parser.add_argument("--no-roles", action="store_true")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--no-report", action="store_true")
    parser.add_argument("--work", default=None, help="where the temporary folder of the checkpoints and runs goes "
                        "(default: the system's temporary folder); removed after")
    parser.add_argument("--timeout", type=float, default=None, help="kill each analyze process after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--causal-n", type=int, default=None, help="analyze --causal-n")
    parser.add_argument("--causal-loss-inputs", type=int, default=None, help="analyze --causal-loss-inputs")
    parser.add_argument("--floors", action="store_true", help="after each analyze, rerun its role tests and causal "
                        "stages under torch's FlopCounterMode and print each one's matmul FLOPs at this machine's "
                        "fp32 GEMM peak beside its time (as long again as those stages)")
    args = parser.parse_args()
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be at least 1")
    print(f"== bench_scale, {machine()}", flush=True)
    # stopped by a signal (gpu_check's timeout sends SIGTERM): exit through Python, the checkpoints' temporary folder
    # (GBs) removed on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"bench_scale: stopped by signal {signum}"))
    results = []
    if args.work is not None:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for name, layers in args.shape or [(name, None) for name in DEFAULT_SHAPES]:
            shape, layers = SHAPES[name], layers or args.layers
            if layers is not None and layers < shape.n_layers:
                shape = replace(shape, name=f"{name} (first {layers} of {shape.n_layers} layers)", n_layers=layers)
            print(f"\n== {shape.name}: {shape.describe()}; device {args.device}", flush=True)
            work = Path(tmp) / name
            built = build_checkpoint(shape, work / "checkpoint", args.device, args.seed)
            print(f"  checkpoint: {built['params'] / 1e9:.2f} B parameters, {built['file_bytes'] / 1e9:.2f} GB bf16 "
                  f"in {built['shards']} shards, built in {built['seconds']:.1f} s (this process's peak RSS so far "
                  f"{gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)} GiB)", flush=True)
            peak_before = gemm_peak(args.device) if args.floors else None
            result = run_analyze(work / "checkpoint", work, args)
            print_result(built, result)
            if args.floors and result["run"] is not None:
                print_floors(work / "checkpoint", work / "run", result, args.device, peak_before)
            results.append((shape, built, result))
            shutil.rmtree(work)
    print_summary(results)
    unfinished = [shape.name for shape, _, result in results if result["rc"] != 0]
    if unfinished:
        sys.exit(f"bench_scale: analyze did not finish on {', '.join(unfinished)}")


if __name__ == "__main__":
    main()
