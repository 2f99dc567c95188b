"""Load throughput of a large synthetic run (default 250k edges) into LadybugDB and the real Neo4j.

    python3 benchmarks/bench_load.py [--edges 250000] [--batch-size 5000 ...] [--neo4j bolt://127.0.0.1:7687]
                                     [--stored-runs N]

Neo4j credentials come from NEO4J_USER / NEO4J_PASSWORD (and --neo4j or NEO4J_URI); the embedded store is a
fresh temporary file unless --db is given. Prints edges/s per store and batch size; the run is deleted after.
Centrality is not part of the timing (the graph rows are built first). With --stored-runs N, N runs of the same
size are stored first, each timed as it goes in (what a sweep into one store pays run after run), and deleted
after. Measured on 2 cores, batch 5000: Neo4j 5.9k-7.0k edges/s before (dict rows, pure-Python PackStream),
13.4k-17.4k after (value-list rows, neo4j-rust-ext); see headgraph/loader/neo4j_store.py.
"""

import argparse
import importlib.util
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from headgraph.analysis.selection import SelectionPolicy, select_edges
from headgraph.loader.graph import edge_rows, head_rows
from headgraph.loader.open_store import open_store
from headgraph.loader.store import RunGraph

RUN_ID = "bench-load"


def synthetic_pairs(n_edges: int, n_layers: int, n_heads: int, kinds: list[str], seed: int = 0) -> pd.DataFrame:
    """About `n_edges` distinct random earlier->later head pairs spread over `kinds`, with the pairs columns."""
    rng = np.random.default_rng(seed)
    per_kind = n_edges // len(kinds)
    frames = []
    for kind in kinds:
        draw = int(per_kind * 1.2)
        source_layer = rng.integers(0, n_layers - 1, draw)
        target_layer = source_layer + 1 + rng.integers(0, n_layers, draw) % (n_layers - 1 - source_layer)
        source_head, target_head = rng.integers(0, n_heads, draw), rng.integers(0, n_heads, draw)
        frame = pd.DataFrame(
            {
                "source_layer": source_layer, "source_head": source_head,
                "target_layer": target_layer, "target_head": target_head,
            }
        ).drop_duplicates().head(per_kind)
        pk = rng.normal(5.0, 0.1, len(frame))
        frames.append(
            frame.assign(
                source="L" + frame["source_layer"].astype(str) + "H" + frame["source_head"].astype(str),
                target="L" + frame["target_layer"].astype(str) + "H" + frame["target_head"].astype(str),
                source_type=kind[0], target_type=kind[1], pk=pk, pk_norm=pk / 64, z_iso=(pk - 4) / 0.1,
                log10_p_iso=-(pk - 4), p_model=rng.uniform(0, 1, len(frame)), q_model=rng.uniform(0, 1, len(frame)),
                cs=rng.uniform(0, 0.1, len(frame)),
            )
        )
    return pd.concat(frames, ignore_index=True)


def bench_graph(n_edges: int, n_layers: int, n_heads: int, run_id: str = RUN_ID) -> RunGraph:
    kinds = ["OQ", "OK", "OV", "QK"]
    pairs = synthetic_pairs(n_edges, n_layers, n_heads, kinds)
    layer, head = (a.ravel() for a in np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij"))
    heads = pd.DataFrame({"head": [f"L{l}H{h}" for l, h in zip(layer, head)], "layer": layer, "index": head})
    policy = SelectionPolicy(top_k=None)
    run = {"id": run_id, "model": "bench-synthetic", "types": kinds, "policy": policy.describe()}
    return RunGraph(run, {"name": "bench-synthetic", "n_layers": n_layers, "n_heads": n_heads},
                    head_rows(heads, run_id, "bench-synthetic"), edge_rows(select_edges(pairs, policy), run_id))


def store_earlier_runs(store, args, stored: list[str]) -> None:
    """Store --stored-runs runs of the bench's size before it, printing the seconds each took to go in; each run's
    id is appended to `stored` once it is in."""
    for i in range(args.stored_runs):
        graph = bench_graph(args.edges, args.layers, args.heads, f"{RUN_ID}-earlier-{i}")
        started = time.perf_counter()
        store.store_run(graph)
        stored.append(graph.run["id"])
        print(f"{store.description}: run {i + 1} stored beside {i} others in {time.perf_counter() - started:.1f} s",
              flush=True)


def bench(store, graph: RunGraph, batch_size: int) -> None:
    started = time.perf_counter()
    store.store_run(graph, batch_size=batch_size)
    elapsed = time.perf_counter() - started
    stored = store.read("MATCH (r:Run) WHERE r.id = $run RETURN r.n_edges", {"run": RUN_ID}).rows[0][0]
    deleting = time.perf_counter()
    store.delete_run(RUN_ID, batch_size)
    deleted = time.perf_counter() - deleting
    print(
        f"{store.description}: {stored} edges + {len(graph.heads)} heads, batch size {batch_size}: "
        f"{elapsed:.1f} s, {stored / elapsed:,.0f} edges/s (delete {deleted:.1f} s)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", type=int, default=250_000)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[5000])
    parser.add_argument("--stores", nargs="+", default=["ladybug", "neo4j"], choices=["ladybug", "neo4j"])
    parser.add_argument("--db", default=None, help="embedded store path (default: a temporary file)")
    parser.add_argument("--neo4j", default=os.environ.get("NEO4J_URI", "bolt://127.0.0.1:7687"))
    parser.add_argument("--stored-runs", type=int, default=0, help="runs of the same size stored first (deleted after)")
    args = parser.parse_args()

    graph = bench_graph(args.edges, args.layers, args.heads)
    encoder = "Rust (neo4j-rust-ext)" if importlib.util.find_spec("neo4j._rust") else "pure Python: pip install neo4j-rust-ext"
    print(f"synthetic run: {len(graph.edges)} edges over {len(graph.heads)} heads; Neo4j PackStream encoder {encoder}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.stores:
            opened = open_store(db=args.db or str(Path(tmp) / "bench.lbdb")) if kind == "ladybug" else open_store(neo4j=args.neo4j)
            with opened as store:
                earlier: list[str] = []
                try:
                    store_earlier_runs(store, args, earlier)
                    for batch_size in args.batch_size:
                        bench(store, graph, batch_size)
                finally:  # a --db given keeps none of the bench's runs, also when it stops half way
                    for run_id in earlier:
                        store.delete_run(run_id)


if __name__ == "__main__":
    main()
