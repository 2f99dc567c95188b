"""headgraph: attention-head subspace affinity (Projection Kernel) and head roles, as a queryable graph.

The Python API (headgraph.api) is imported on first use, so that `import headgraph` and `headgraph --help`
stay fast (no torch):

>>> import headgraph
>>> run = headgraph.analyze("induction-2l")          # doctest: +SKIP
>>> headgraph.load_run(run.path).hubs(3)            # doctest: +SKIP
"""

from headgraph._version import __version__

__all__ = ["Run", "__version__", "analyze", "load_run"]
_API = ("Run", "analyze", "load_run")


def __getattr__(name):
    if name in _API:
        from headgraph import api

        return getattr(api, name)
    raise AttributeError(f"module 'headgraph' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_API))
