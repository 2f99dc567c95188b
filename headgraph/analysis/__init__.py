"""Analysis: subspaces, Projection Kernel, random reference, significance, composition, roles, centrality."""
