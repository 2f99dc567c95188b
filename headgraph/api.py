"""The Python API, for notebooks and scripts: `analyze` a model, `load_run` a saved run, and work with the `Run`
(its tables, the selected graph as networkx, hubs, figures, re-selection, saving, storing). `headgraph analyze`
is a layer over the same orchestrator (headgraph.workflow.run_analyze), so a run made here is the run the CLI
makes with the same settings.

>>> import headgraph, tempfile
>>> run = headgraph.analyze("induction-2l", roles=False, causal=False, out=tempfile.mkdtemp(), progress=False,
...                         device="cpu", reference_samples=2000, null_heads=20, top_k=4)
>>> run.edges.query("kind == 'OK'")[["source", "target", "rank"]]  # its circuit: L0H2 -> every layer-1 head
  source target  rank
0   L0H2   L1H1     1
1   L0H2   L1H3     2
2   L0H2   L1H0     3
3   L0H2   L1H2     4
>>> sorted(run.graph["L0H2"]["L1H0"])  # a MultiDiGraph: one edge per kind between two heads
['OK']
>>> headgraph.load_run(run.path).pairs.equals(run.pairs)
True
"""

from __future__ import annotations

import dataclasses
import functools
import html
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
import pandas as pd

from headgraph import runs
from headgraph.analysis.artifacts import roles_of
from headgraph.analysis.selection import SelectedGraph, SelectionPolicy, select_graph
from headgraph.errors import UsageError
from headgraph.heads import DEFAULT_TYPES
from headgraph.loader.open_store import StoreSpec
from headgraph.settings import OPTIONS, analyze_options, store_spec

__all__ = ["OPTIONS", "Run", "analyze", "load_run", "store_spec"]  # OPTIONS: every keyword analyze takes


def _console(progress: bool):
    """The console progress goes to, and whether it can show there (in Jupyter rich draws into an ipywidgets
    Output; without ipywidgets it cannot, and says so once)."""
    from rich.console import Console

    console = Console(stderr=True)
    if progress and console.is_jupyter:
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            console.print("progress needs ipywidgets in a notebook: pip install 'headgraph[notebook]'")
            return console, False
    return console, progress


def analyze(model, *, types=DEFAULT_TYPES, roles=True, causal=True, store=None, out=None, report=False,
            progress=True, tokenizer=None, **options) -> Run:
    """Analyse a model as `headgraph analyze` does and return its Run.

    model: a hub name, a local folder, an offline name (all-MiniLM-L6-v2, induction-2l), a loaded
    `transformers.PreTrainedModel` (its tokenizer is `tokenizer`, else the one saved at its `name_or_path`) or a
    `TransformerBridge`; a loaded model is analysed on a copy and left unchanged. types: the weight-pair types
    ("OQ", ...; "all" for all 16). roles / causal: run the role tests / the causal effects (True, False, or a
    RoleOptions / CausalOptions). store: None (unlike the CLI) stores nothing; True is the CLI's default store;
    or a LadybugDB path, a Neo4j URI, a StoreSpec. out: the run folder; None is the CLI's default,
    runs/<run id> under the working directory, so that a stored run's id finds its folder later (a temporary
    folder would vanish under it). report: also render report.md / .html and the figures into it.
    progress: rich progress bars, in the terminal or in Jupyter. options: see OPTIONS, e.g. top_k=10,
    device="cpu", seed=1, roles_n_inputs=50, causal_n_inputs=16, causal_loss=False (as the CLI's
    --causal-loss-edges 0: both pass through headgraph.settings.analyze_options).
    """
    from headgraph.workflow import run_analyze

    settings = analyze_options(types=types, roles=roles, causal=causal, store=store, out=out, report=report,
                               **options)
    console, progress = _console(progress)
    outcome = run_analyze(model, settings, console=console, progress=progress, tokenizer=tokenizer)
    result = outcome.result
    return Run(outcome.folder, result.run, result.pairs, result.heads, policy=settings.policy,
               classes=settings.classes)


def load_run(folder_or_id, store=None, policy: SelectionPolicy | None = None) -> Run:
    """A saved run: its folder, or the id of a stored run (its record names the folder) in `store` (None: the
    default store, as the CLI; or what `analyze` takes). The graph is selected by `policy`, by default the
    selection the run records (run.json `selection`; the top 20 per type for a run that records none)."""
    spec = StoreSpec() if store is None else store_spec(store)
    base = runs.load_run(runs.resolve_run_dir(str(folder_or_id), spec))
    recorded = SelectionPolicy.parse(base.record.selection) if base.record.selection else SelectionPolicy()
    record = dataclasses.replace(base.record, selection=(policy or recorded).describe())
    return Run(base.path, record, base.pairs, base.heads, policy=policy or recorded)


@dataclass(eq=False, repr=False)
class Run(runs.RunFolder):
    """One analysis run in Python: the folder model (headgraph.runs.RunFolder: `path`, `record`, `pairs`, `heads`)
    plus its selected graph under `policy`, selected on first use and never by recomputing PK.

    `classes` names the known head classes the figures colour and the store labels (ioi, pk-paper, a JSON file;
    None: the project's classes for the model, if any). A hub is a head of high degree in this selection, not
    a head shown to matter for the model's behaviour; an edge is a strong PK pair, not a proven circuit path."""

    policy: SelectionPolicy = field(default_factory=SelectionPolicy)
    classes: str | None = None

    @property
    def id(self) -> str | None:
        return self.record.id

    @functools.cached_property
    def selected(self) -> SelectedGraph:
        """The selected graph: edges, nodes, centrality, hubs (headgraph.analysis.selection.SelectedGraph)."""
        return select_graph(self.pairs, self.heads, self.policy)

    @property
    def edges(self) -> pd.DataFrame:
        """The selected edges: their pairs.parquet rows with `kind` ("OK", ...) and `rank` (PK rank in the type)."""
        return self.selected.edges

    @functools.cached_property
    def graph(self) -> nx.MultiDiGraph:
        """The selected graph as networkx: nodes are heads with their heads-table columns, `roles` and
        centralities; edges are the selected edges keyed by kind with every pairs column (NaN: absent).

        A `networkx.MultiDiGraph` (a DiGraph subclass), since two heads may be joined by OQ and OK at once,
        which a plain DiGraph cannot hold: address an edge as graph.edges[source, target, kind]."""
        from headgraph.analysis.network import head_network

        return head_network(self.selected)

    def hubs(self, n: int = 10) -> pd.DataFrame:
        """The n heads of highest degree in the selection (ties: weighted degree, then name), with their
        centralities, strongest edges per type and significant roles: the report's hub table."""
        from headgraph.analysis.centrality import hub_report
        from headgraph.report.report import hub_table

        if n < 1:
            raise UsageError(f"hubs(n) needs n >= 1, got {n}")
        return hub_table(hub_report(self.selected.centrality, self.selected.edges, top=n), self.heads)

    def select(self, policy: SelectionPolicy | None = None, **rules) -> Run:
        """This run under another selection (a SelectionPolicy, or its fields: top_k, max_q, min_z,
        min_effect), from the stored tables: nothing is recomputed but the selection and its centrality."""
        policy = dataclasses.replace(policy or SelectionPolicy(), **rules)
        record = dataclasses.replace(self.record, selection=policy.describe())
        return Run(self.path, record, self.pairs, self.heads, policy=policy, classes=self.classes)

    def _head_classes(self):
        from headgraph.analysis.classes import default_classes, load_classes

        return load_classes(self.classes) if self.classes else default_classes(self.model)

    def plot(self, name: str):
        """The report's figure `name` (one of headgraph.report.report.FIGURES) as a matplotlib Figure, drawn
        from this run and its selection; a figure whose data the run lacks (causal, roles) raises UsageError."""
        import matplotlib.pyplot as plt

        from headgraph.report.report import FIGURES, selection_figures

        if name not in FIGURES:
            raise UsageError(f"unknown figure {name!r}: choose one of {', '.join(FIGURES)}")
        fig = selection_figures(self, self.selected, self._head_classes())[name]()
        if fig is None:
            raise UsageError(f"run {self.id} has no data for the {name!r} figure: analyze with {name}=True")
        plt.close(fig)  # a closed figure still displays as a cell's value, and only once
        return fig

    def save(self, folder) -> Run:
        """Write run.json, pairs.parquet and heads.parquet into `folder` (created if missing) and return the
        run there; the record's `out_dir` names the new folder. Figures and report are not copied:
        `headgraph report FOLDER` renders them."""
        folder = Path(folder)
        record = dataclasses.replace(self.record, out_dir=str(folder.resolve()))
        runs.write_run(runs.AnalysisResult(record, self.pairs, self.heads), folder)
        return Run(folder, record, self.pairs, self.heads, policy=self.policy, classes=self.classes)

    def to_store(self, store=True) -> str:
        """Store the selected graph (replacing an earlier copy of this run id) and return the store's
        description. store: what `analyze` takes; True is the default store. The stored record names this
        run's folder, which `load_run(id, store=...)` reads back."""
        from headgraph.loader.graph import build_run_graph

        classes = self._head_classes()
        graph = build_run_graph(self.selected, self.record, classes.labels() if classes is not None else None)
        with store_spec(store).open() as opened:
            opened.store_run(graph)
            return opened.description

    def __repr__(self) -> str:
        return (f"Run({self.id!r}, model={self.model!r}, pairs={len(self.pairs)}, heads={len(self.heads)}, "
                f"edges={len(self.edges)}, path='{self.path}')")

    def _repr_html_(self) -> str:
        """A compact summary for Jupyter: model, id, sizes, per-type pairs / edges / KL, the top hubs."""
        record, dims = self.record, self.record.dims
        per_type = self.edges.groupby("kind").size() if len(self.edges) else pd.Series(dtype=int)
        kl = record.kl_by_type
        rows = "".join(f"<tr><td>{tp}</td><td>{record.n_pairs.get(tp, 0)}</td><td>{int(per_type.get(tp, 0))}</td>"
                       f"<td>{_number(kl.get(tp))}</td><td>{_number(record.mean_pk.get(tp))}</td></tr>"
                       for tp in record.types)
        roles = roles_of(self.heads)
        hubs = "".join(f"<li>{h['head']}: degree {h['degree']}"
                       f"{' (' + ', '.join(roles[h['head']]) + ')' if roles.get(h['head']) else ''}</li>"
                       for h in self.selected.hubs["hubs"][:5])
        causal = ("not run" if record.causal is None else f"skipped: {record.causal['skipped']}"
                  if "skipped" in record.causal else "computed")
        return (f"<div><b>headgraph run</b> <code>{html.escape(str(self.id))}</code><br>"
                f"model <b>{html.escape(self.model)}</b>: {dims.n_layers} layers × {dims.n_heads} heads, d_model "
                f"{dims.d_model}, d_head {dims.d_head}; processing {record.processing}, {record.dtype}<br>"
                f"selection: {html.escape(self.policy.describe())}; causal effects {html.escape(causal)}"
                "<table><tr><th>type</th><th>pairs</th><th>edges</th><th>KL (nats)</th><th>mean PK</th></tr>"
                f"{rows}</table>top hubs:<ol>{hubs}</ol>folder <code>{html.escape(str(self.path))}</code></div>")


def _number(value) -> str:
    return "—" if value is None else f"{value:.3g}"
