"""Measured speed of the PK engine's kernels on this machine and device, so that the planner chooses a
formulation from what runs here rather than from a fixed efficiency constant.

`rates(device, dtype, d, k)` times the engine's own kernels (headgraph.analysis.projectors) on random data of
the run's d_model and head width, at tile sizes like a run's: the gram tile, the projector build and the
projector tile, each best of three after a warm-up, as FLOP/s. For GPT-2 small's shape this takes about a
second on a 2-core CPU. Results are cached per process and in a small JSON file, keyed by device, dtype, shape,
torch version, CPU thread count and the calibration's own version, so a changed machine or torch is measured
afresh.

Invalidate: delete the file, call `clear()`, or set HEADGRAPH_RECALIBRATE=1 (measure again and overwrite).
The file is `pk-calibration.json` in HEADGRAPH_CACHE_DIR (default ~/.cache/headgraph). Processes that need a
key the file lacks take turns on a lock beside it: the first measures, alone, and the others read what it wrote.
So the workers of a sweep started together plan from one measurement, not each from its own taken under the
others' load (plans that differ give PK and p-values that differ in their last bits).

A rate is a speed at the calibration's tile sizes, not a promise for every tile: thin tiles of the
memory-bound projector GEMM run slower, and a busy machine measures slow.
"""

import contextlib
import fcntl
import json
import math
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from headgraph.analysis import projectors

CACHE_ENV = "HEADGRAPH_CACHE_DIR"
RECALIBRATE_ENV = "HEADGRAPH_RECALIBRATE"
CACHE_FILE = "pk-calibration.json"
KERNELS = ("gram", "projector_build", "projector_tile")
VERSION = 6  # of the measurement: part of the cache key
_CALIBRATION_BYTES = 64 * 2**20  # bound on the calibration's vectors
_MEMORY: dict[str, "Rates"] = {}


@dataclass(frozen=True)
class Rates:
    """FLOP/s of each kernel, and where the numbers come from (`source`: measured now, this process's cache,
    the cache file, or given by the caller)."""

    gram: float
    projector_build: float
    projector_tile: float
    key: str = ""
    measured: str = ""
    source: str = "given"

    def seconds(self, kernel: str, flops: float) -> float:
        return flops / getattr(self, kernel)

    def describe(self) -> dict:
        return asdict(self)


def cache_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "headgraph") / CACHE_FILE


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu:{model}:{torch.get_num_threads()} threads"


def cache_key(device: torch.device, dtype: torch.dtype, d: int, k: int) -> str:
    return (f"{_device_name(device)}|{str(dtype).removeprefix('torch.')}|d={d}|k={k}|torch {torch.__version__}"
            f"|calibration v{VERSION}")


def _read_file() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_file(key: str, rates: "Rates") -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_file() | {key: {k: getattr(rates, k) for k in (*KERNELS, "measured")}}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs a new measurement next time


def clear() -> None:
    """Forget every calibration: this process's and the cache file."""
    _MEMORY.clear()
    cache_path().unlink(missing_ok=True)


def _best_seconds(fn, device: torch.device, repeats: int = 3) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure(device: torch.device, dtype: torch.dtype, d: int, k: int) -> dict[str, float]:
    """FLOP/s of the three kernels at sizes like a run's (random data: speed does not depend on the values): a gram
    tile of s x 32 heads whose Gram block is GRAM_TILE_BYTES; the first piece right of a diagonal block (as wide as
    64 MiB holds: such pieces are all but d b / 2 of a projector's entries) built for n <= 256 heads (what 64 MiB
    of bases holds) and its n x n-head tile, as a pass runs them."""
    block = projectors.projector_block(d, k)
    itemsize = torch.finfo(dtype).bits // 8
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype).to(device)

    n = max(1, min(256, _CALIBRATION_BYTES // (d * k * itemsize)))
    pieces = projectors.projector_pieces(d, block, max(block, _CALIBRATION_BYTES // (2 * n * itemsize)))
    chunk = (next((p for p in pieces if p.weight == 2.0), pieces[0]),)  # a block row's right part, the bulk of L
    entries = sum(p.entries for p in chunk)
    t = 32
    s = max(1, min(t, projectors.GRAM_TILE_BYTES // projectors.tile_bytes("gram", 1, t, k, k, itemsize)))
    stacked, heads = projectors.build(randn(t, d, k)), randn(n, d, k)
    buffer = torch.empty(n * entries, dtype=dtype, device=device)
    pieces = projectors.build_chunk(heads, chunk, buffer)
    out = torch.zeros(n, n, dtype=dtype, device=device)

    def tile():
        for v in pieces:
            out.addmm_(v, v.T)

    seconds = {
        "gram": _best_seconds(lambda: projectors.tile(stacked, stacked, slice(0, s), slice(0, t), k, k), device),
        "projector_build": _best_seconds(lambda: projectors.build_chunk(heads, chunk, buffer), device),
        "projector_tile": _best_seconds(tile, device),
    }
    flops = {
        "gram": s * t * projectors.tile_flops("gram", d, k, k, block),
        "projector_build": 2.0 * k * n * entries,
        "projector_tile": 2.0 * n * n * entries,
    }
    return {kernel: flops[kernel] / seconds[kernel] for kernel in KERNELS}


def _stored(key: str) -> "Rates | None":
    """The cache file's rates for `key`, or None (absent or malformed)."""
    stored = _read_file().get(key)
    if not isinstance(stored, dict) or not all(isinstance(stored.get(kn), (int, float)) and stored[kn] > 0
                                               for kn in KERNELS):
        return None
    return Rates(**{kn: float(stored[kn]) for kn in KERNELS}, key=key, measured=str(stored.get("measured", "")),
                 source="cache file")


@contextlib.contextmanager
def _measuring() -> Iterator[None]:
    """This machine's turn to measure: an exclusive lock on pk-calibration.lock beside the cache file, held while
    inside (none where it cannot be opened: an unwritable cache folder)."""
    try:
        path = cache_path().with_suffix(".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def rates(device: torch.device | str, dtype: torch.dtype, d: int, k: int) -> Rates:
    """The kernels' FLOP/s for this (device, dtype, d, k): this process's cache, else the cache file, else
    measured now (and cached), by one process at a time (`_measuring`). HEADGRAPH_RECALIBRATE=1 measures again.

    >>> r = rates("cpu", torch.float64, 16, 4)
    >>> r.source in ("measured", "process cache", "cache file") and r.projector_tile > 0
    True
    """
    device = torch.device(device)
    key = cache_key(device, dtype, d, k)
    again = os.environ.get(RECALIBRATE_ENV, "") not in ("", "0")
    if again:
        _MEMORY.pop(key, None)
    elif key in _MEMORY:
        return Rates(**{**asdict(_MEMORY[key]), "source": "process cache"})
    found = None if again else _stored(key)
    if found is None:
        with _measuring():
            found = None if again else _stored(key)  # written by the process that measured while this one waited
            if found is None:
                found = Rates(**measure(device, dtype, d, k), key=key,
                              measured=datetime.now(timezone.utc).isoformat(timespec="seconds"), source="measured")
                _write_file(key, found)
    _MEMORY[key] = found
    return found
