"""Kernel-rate calibration: measured once, then read from this process's cache and, in a new process, from the
cache file; re-measured when invalidated (clear(), HEADGRAPH_RECALIBRATE=1, a corrupt file, another shape);
rates in FLOP/s, of the order of an independently timed matrix product."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from headgraph.analysis import calibration

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import json, torch; from headgraph.analysis import calibration; "
         "r = calibration.rates('cpu', torch.float64, 32, 8); print(json.dumps([r.source, r.gram]))")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(calibration.RECALIBRATE_ENV, raising=False)
    calibration.clear()
    yield tmp_path
    calibration.clear()


def in_new_process() -> tuple[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # same thread count: the same calibration key
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True,
                          timeout=120)
    return tuple(json.loads(done.stdout))


@pytest.mark.slow
def test_measured_once_then_cached_in_the_process_and_in_the_file(cache_dir):
    first = calibration.rates("cpu", torch.float64, 32, 8)
    assert first.source == "measured" and first.measured
    stored = json.loads((cache_dir / calibration.CACHE_FILE).read_text())
    assert stored[first.key]["gram"] == first.gram
    again = calibration.rates("cpu", torch.float64, 32, 8)
    assert again.source == "process cache" and again.gram == first.gram
    assert in_new_process() == ("cache file", first.gram)


@pytest.mark.slow
def test_processes_started_together_take_turns_and_one_measures(cache_dir):
    """Four processes released at once (each waits for a file, torch imported before) need the same missing key:
    one measures, the other three wait on the lock and read its rates from the file, so all four plan alike."""
    go = cache_dir / "go"
    wait = f"import pathlib, time\nwhile not pathlib.Path({str(go)!r}).exists(): time.sleep(0.001)\n"
    probe = PROBE.replace("; from headgraph", "\nfrom headgraph").replace("; r = ", "\n" + wait + "r = ")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = [subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True, env=env)
               for _ in range(4)]
    time.sleep(5)  # every process has imported torch and polls
    go.touch()
    found = [tuple(json.loads(p.communicate(timeout=120)[0])) for p in started]
    assert sorted(source for source, _ in found) == ["cache file"] * 3 + ["measured"]
    assert len({gram for _, gram in found}) == 1


@pytest.mark.slow
def test_invalidation_measures_again(cache_dir, monkeypatch):
    calibration.rates("cpu", torch.float64, 32, 8)
    monkeypatch.setenv(calibration.RECALIBRATE_ENV, "1")
    assert calibration.rates("cpu", torch.float64, 32, 8).source == "measured"
    monkeypatch.delenv(calibration.RECALIBRATE_ENV)
    calibration.clear()
    assert not (cache_dir / calibration.CACHE_FILE).exists()
    assert calibration.rates("cpu", torch.float64, 32, 8).source == "measured"
    (cache_dir / calibration.CACHE_FILE).write_text("{not json")
    source, _ = in_new_process()
    assert source == "measured" and isinstance(json.loads((cache_dir / calibration.CACHE_FILE).read_text()), dict)


def test_another_shape_or_dtype_is_its_own_calibration(cache_dir):
    a = calibration.rates("cpu", torch.float64, 32, 8)
    b = calibration.rates("cpu", torch.float32, 32, 8)
    c = calibration.rates("cpu", torch.float64, 48, 8)
    assert len({a.key, b.key, c.key}) == 3 and b.source == c.source == "measured"
    assert set(json.loads((cache_dir / calibration.CACHE_FILE).read_text())) == {a.key, b.key, c.key}


def test_rates_are_flop_per_second_of_the_order_of_a_timed_matmul(cache_dir):
    rates = calibration.rates("cpu", torch.float32, 256, 64)
    a, b = torch.randn(1024, 256), torch.randn(256, 1024)
    a @ b
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    matmul = 5 * 2 * 1024 * 256 * 1024 / (time.perf_counter() - start)
    for kernel in calibration.KERNELS:
        assert matmul / 30 < getattr(rates, kernel) < matmul * 30, kernel


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rates_are_their_own_calibration(cache_dir):
    cpu = calibration.rates("cpu", torch.float32, 256, 64)
    cuda = calibration.rates("cuda", torch.float32, 256, 64)
    assert cuda.key.startswith("cuda:") and cuda.key != cpu.key and cuda.source == "measured"
    assert all(getattr(cuda, kernel) > 0 for kernel in calibration.KERNELS)
