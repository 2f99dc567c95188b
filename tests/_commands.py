"""`headgraph` commands as real processes forked from one that has already imported headgraph and
TransformerLens (a multiprocessing forkserver), so a test that starts many of them does not pay Python's start
and the imports (about 5 s) each time. Each command is its own process with its own pid, environment, store
handles and exit status: a SIGKILL kills it alone, as it would a `headgraph` started from a shell. Tests of
what a fresh interpreter does (process settings, start-up hooks, memory of the whole process, the browser
chosen from the environment) start `python -m headgraph` themselves.

Its environment is this process's without the variables that choose a store (NEO4J_*, HEADGRAPH_DB), so a
command writes only where its arguments say, updated with the test's `env`. Variables that libraries read when
they are imported (HF_*, OMP_*) take effect as they were when the forkserver started: a test that varies them
starts its own interpreter too.

`moment` ("method:n:when:scope", e.g. "_write_edges:12:after:load") makes the process kill itself with SIGKILL
before, during (a timer thread while the call runs) or right after the n-th call of that store method, or
pause right after it until the test says go on (when = "pause"); a scope other than "load" counts only calls
made inside that store method (the load's seal, or the clean-up of abandoned runs)."""

import multiprocessing
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from headgraph.cli import apply_process_environment

# what an analyze of the tests' GPT-2 folders imports besides the CLI (0.5 s of each such command)
PRELOAD = ["headgraph.cli", "headgraph.loader.ladybug_store", "headgraph.loader.neo4j_store", "headgraph.loader.stream",
           "headgraph.pipeline", "headgraph.report.summary", "transformer_lens.model_bridge",
           "transformers.models.gpt2.modeling_gpt2"]
apply_process_environment()  # headgraph's process settings, read when OpenMP loads in the forkserver
_forkserver = multiprocessing.get_context("forkserver")
_forkserver.set_forkserver_preload(PRELOAD)


def _kill_at(moment: str, paused, go) -> None:
    from headgraph.loader.ladybug_store import LadybugStore
    from headgraph.loader.neo4j_store import Neo4jStore

    method, nth, when, scope = moment.split(":")
    nth, calls, inside = int(nth), [0], set()

    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(cls, name, wrapper):
        original = cls.__dict__.get(name) or getattr(cls, name)
        setattr(cls, name, lambda self, *a, **k: wrapper(original, self, *a, **k))

    def scoped(name):  # remember that we are inside `name`
        def run(original, self, *a, **k):
            inside.add(name)
            try:
                return original(self, *a, **k)
            finally:
                inside.discard(name)
        return run

    def target(original, self, *a, **k):
        if scope != "load" and scope not in inside:
            return original(self, *a, **k)
        calls[0] += 1
        if calls[0] != nth:
            return original(self, *a, **k)
        if when == "before":
            kill()
        if when == "during":
            threading.Timer(0.002, kill).start()
        result = original(self, *a, **k)
        if when == "pause":
            paused.set()
            go.wait()
            return result
        kill()
        time.sleep(60)

    for cls in (LadybugStore, Neo4jStore):
        wrap(cls, "_seal_run", scoped("_seal_run"))
        wrap(cls, "remove_abandoned_runs", scoped("remove_abandoned_runs"))
        wrap(cls, method, target)


def _command(argv, env, moment, stdout, stderr, paused, go):
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        with open(path, "w") as file:
            os.dup2(file.fileno(), fd)
    if moment is not None:
        _kill_at(moment, paused, go)
    from headgraph.cli import main

    main(argv)


def command_environment(env: dict | None) -> dict:
    """This process's environment without the variables that choose a store, updated with `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NEO4J_") and k != "HEADGRAPH_DB"}
    return {**base, **(env or {})}


class Command:
    """`headgraph ARGV` started in a forked process (see the module docstring)."""

    def __init__(self, *argv, env=None, moment=None):
        self.argv, self._folder = list(argv), tempfile.mkdtemp(prefix="headgraph-command-")
        self._out, self._err = os.path.join(self._folder, "stdout"), os.path.join(self._folder, "stderr")
        self._paused, self._go = _forkserver.Event(), _forkserver.Event()
        self.process = _forkserver.Process(target=_command, args=(
            self.argv, command_environment(env), moment, self._out, self._err, self._paused, self._go))
        self.process.start()
        self.pid = self.process.pid

    def paused(self, timeout=120) -> bool:
        """Whether it reached the pause moment within `timeout` seconds."""
        return self._paused.wait(timeout)

    def go_on(self) -> None:
        self._go.set()

    def wait(self, timeout=300) -> subprocess.CompletedProcess:
        """Its return code (negative for a signal: -9 when it was killed), stdout and stderr."""
        self.process.join(timeout)
        try:
            if self.process.exitcode is None:
                self.kill()
                raise TimeoutError(f"headgraph {' '.join(self.argv)} still running after {timeout} s")
            with open(self._out) as stdout, open(self._err) as stderr:
                return subprocess.CompletedProcess(self.argv, self.process.exitcode, stdout.read(), stderr.read())
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()


def headgraph(*argv, env=None, moment=None, timeout=600) -> subprocess.CompletedProcess:
    """Run `headgraph ARGV` to its end in a forked process (see Command)."""
    return Command(*argv, env=env, moment=moment).wait(timeout)
