"""headgraph: attention-head subspace affinity (Projection Kernel) and head roles, as a queryable graph."""

__version__ = "0.1.0"
