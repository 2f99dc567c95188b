"""A doomed sweep worker, chosen by checkpoint: a sitecustomize on the PYTHONPATH of every Python process of a
sweep (local worker processes, or a Ray cluster's workers) makes the worker that writes the run folder of the
checkpoint named in the file $HEADGRAPH_TEST_DOOMED_FILE (read at that moment; no file, no victim) send itself
SIGKILL right after, before its result reaches the driver. Nothing else changes: the driver, the store, Ray and
the other checkpoints are real. Chosen inside the worker, the moment cannot be missed by a test that watches
from outside and finds the tasks already finished."""

import os
from pathlib import Path

SITECUSTOMIZE = r"""
import os, signal

if os.environ.get("HEADGRAPH_TEST_DOOMED_FILE"):
    import headgraph.workflow as workflow

    write_run = workflow.write_run

    def write_then_die(result, folder):
        write_run(result, folder)
        try:
            with open(os.environ["HEADGRAPH_TEST_DOOMED_FILE"]) as named:
                doomed = named.read().strip()
        except FileNotFoundError:
            return
        if result.run.model.name == doomed:
            os.kill(os.getpid(), signal.SIGKILL)

    workflow.write_run = write_then_die
"""

ROOT = Path(__file__).resolve().parents[1]


def doomed_worker_env(folder: Path) -> tuple[Path, dict[str, str]]:
    """(the file to write a checkpoint's name into, the environment of processes that carry the hook)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    doomed = folder / "doomed"
    return doomed, {"PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)]), "HEADGRAPH_TEST_DOOMED_FILE": str(doomed)}
