"""What `headgraph analyze` is asked to do (AnalyzeOptions), and the one translator of flat names into it: the
CLI's flags (headgraph.cli), the Python API's keywords (headgraph.api) and so a sweep's analyses all become
AnalyzeOptions in `analyze_options`, so a setting means the same thing whichever way it was given. A light
module (no torch), so that `headgraph --help` stays fast."""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field

from headgraph.analysis.options import CausalOptions, PKOptions, RoleOptions
from headgraph.analysis.selection import SelectionPolicy
from headgraph.errors import UsageError
from headgraph.heads import DEFAULT_TYPES, Processing, parse_types
from headgraph.loader.open_store import StoreSpec


@dataclass(frozen=True)
class AnalyzeOptions:
    """What `headgraph analyze` was asked to do, besides which model; defaults declared once, here and in the
    stage options it holds (the CLI reads them)."""

    out_dir: str | None = None  # run folder (default runs/<run id>)
    processing: Processing = "tl"  # tl: TransformerLens' folded/centred weights; raw: the checkpoint as stored
    pk: PKOptions = field(default_factory=PKOptions)
    roles: RoleOptions | None = field(default_factory=RoleOptions)  # None: no role tests
    causal: CausalOptions | None = field(default_factory=CausalOptions)  # None: no causal effects
    inputs_seed: int | None = None  # seed of the generated role and causal inputs (None: pk.seed)
    stability: bool = False  # recompute under every stability variant before the report (headgraph.stability)
    policy: SelectionPolicy = field(default_factory=SelectionPolicy)
    classes: str | None = None
    store: StoreSpec | None = field(default_factory=StoreSpec)
    report: bool = True
    sweep: str | None = None  # the sweep this run belongs to (headgraph.sweep sets it), recorded with its step
    step: int | None = None
    stream: bool = True  # a folder's weights read layer by layer for the PK stages (headgraph.loader.stream); False: the whole model loaded first


_NEO4J_SCHEMES = ("bolt://", "bolt+s://", "bolt+ssc://", "neo4j://", "neo4j+s://", "neo4j+ssc://")


def store_spec(store) -> StoreSpec:
    """A StoreSpec from what the API takes: a StoreSpec, True (the default store, as the CLI: HEADGRAPH_DB /
    NEO4J_URI / ./headgraph.lbdb), a Neo4j URI ("bolt://..."), or the path of an embedded LadybugDB store."""
    if isinstance(store, StoreSpec):
        return store
    if store is True:
        return StoreSpec()
    if isinstance(store, (str, os.PathLike)):
        text = str(store)
        return StoreSpec(neo4j=text) if text.startswith(_NEO4J_SCHEMES) else StoreSpec(db=text)
    raise UsageError(f"store={store!r} is not a store: give True (the default store), a LadybugDB path, a Neo4j "
                     "URI such as bolt://127.0.0.1:7687, or a headgraph.loader.open_store.StoreSpec")


def _names(cls, prefix: str = "", skip=()) -> dict[str, str]:
    return {prefix + f.name: f.name for f in dataclasses.fields(cls) if f.name not in skip}


_OPTION_GROUPS = {"pk": _names(PKOptions, skip=("types",)), "policy": _names(SelectionPolicy),
                  "analyze": {"processing": "processing", "classes": "classes", "stability": "stability",
                              "stream": "stream"},
                  "roles": _names(RoleOptions, "roles_"), "causal": _names(CausalOptions, "causal_")}
OPTIONS = tuple(name for group in _OPTION_GROUPS.values() for name in group)
"""Every flat name `analyze_options` takes: the fields of PKOptions, SelectionPolicy, `processing`, `classes`,
`stability`, and the fields of RoleOptions / CausalOptions prefixed `roles_` / `causal_` (both have e.g.
`n_inputs`)."""


def _stage(given, cls, settings: dict, name: str, fields=lambda settings: settings):
    """The options of a stage that may be off: True -> cls(**fields(settings)), an instance -> it with them,
    False -> None (then no settings may be given)."""
    if given is False or given is None:
        if settings:
            raise UsageError(f"{', '.join(f'{name}_{k}' for k in settings)} given with {name}=False: drop one")
        return None
    if given is True:
        return cls(**fields(settings))
    if isinstance(given, cls):
        return dataclasses.replace(given, **fields(settings))
    raise UsageError(f"{name}={given!r}: give True, False or a {cls.__name__}")


def _causal_fields(settings: dict) -> dict:
    """The CausalOptions fields of the `causal_*` names, where no loss effects is one setting by either name:
    causal_loss_edges=0 (the CLI's --causal-loss-edges 0) is causal_loss=False."""
    if settings.get("loss_edges") == 0:
        if settings.get("loss") is True:
            raise UsageError("causal_loss_edges=0 (no loss effects) given with causal_loss=True: drop one")
        return {k: v for k, v in settings.items() if k != "loss_edges"} | {"loss": False}
    if settings.get("loss") is False and "loss_edges" in settings:
        raise UsageError(f"causal_loss_edges={settings['loss_edges']} given with causal_loss=False: drop one")
    return settings


def analyze_options(*, types=DEFAULT_TYPES, roles=True, causal=True, store=None, out=None, report=False,
                    **options) -> AnalyzeOptions:
    """The AnalyzeOptions of flat names (OPTIONS), as the API's `analyze` and the CLI's flags give them; an
    unknown name raises UsageError naming it and the choices. types: type pairs ("OQ", ... or "oq,ok", "all");
    roles / causal: True, False or the stage's options; store: None (nothing stored) or what `store_spec`
    takes.

    >>> analyze_options(top_k=5, roles_n_inputs=20, causal=False).policy.top_k
    5
    >>> analyze_options(causal_loss_edges=0) == analyze_options(causal_loss=False)
    True
    >>> analyze_options(topk=5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    headgraph.errors.UsageError: unknown option 'topk' (did you mean top_k?); analyze takes: full_matrix, ...
    """
    unknown = [name for name in options if name not in OPTIONS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], OPTIONS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"unknown option {unknown[0]!r}{hint}; analyze takes: {', '.join(OPTIONS)}")
    given = {group: {field_name: options[key] for key, field_name in names.items() if key in options}
             for group, names in _OPTION_GROUPS.items()}
    return AnalyzeOptions(
        out_dir=None if out is None else str(out), pk=PKOptions(types=parse_types(types), **given["pk"]),
        roles=_stage(roles, RoleOptions, given["roles"], "roles"),
        causal=_stage(causal, CausalOptions, given["causal"], "causal", _causal_fields),
        policy=SelectionPolicy(**given["policy"]), store=None if store is None else store_spec(store), report=report,
        **given["analyze"])
