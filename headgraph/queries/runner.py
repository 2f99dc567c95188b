"""The named Cypher query library: parse each file's header, check and cast parameters, run; the rows come back
as data (`Rows`: columns and row lists), which the caller prints.

A query file starts with `//` comment lines: free text (its purpose), then one line per parameter:

    // param <name>: <type> [= <default>] -- <description>

Types: string, int (a count: 0 to 2^63 - 1, the largest integer both stores take), float, list (comma-separated
strings), types (comma-separated weight-pair types such as OK,OV, any case), head (L4H7, or a native KV head
L4KV1 of a grouped-query model), node (a head or a layer L4).
A parameter without a default is required, except `run`, which defaults to the latest complete run, and `sweep`,
which defaults to the sweep of the latest complete run that belongs to one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from headgraph.errors import UsageError
from headgraph.heads import TYPE_PAIRS
from headgraph.loader.store import NODE_EXISTS_QUERY, SWEEP_EXISTS_QUERY, GraphStore, Rows

_PARAM = re.compile(r"^//\s*param\s+(\w+)\s*:\s*(\w+)\s*(?:=\s*(.*?))?\s*--\s*(.*)$")
_HEAD = re.compile(r"^L\d+(H|KV)\d+$")
_NODE = re.compile(r"^L\d+((H|KV)\d+)?$")
RUN_PARAMS = {"run", "other"}  # parameters that name a stored run
DEFAULTED = {"run", "sweep"}  # parameters whose default is read from the store
INT64 = (-(2**63), 2**63 - 1)  # the integers both stores take as parameters


def _cast_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError("expected int") from None
    if not 0 <= value <= INT64[1]:  # each query's int is a count; a negative one errs differently per store
        raise ValueError(f"expected int from 0 to {INT64[1]}")
    return value


def _cast_list(text: str) -> list[str]:
    return [item.strip() for item in text.strip().strip("[]").split(",") if item.strip()]


def _cast_types(text: str) -> list[str]:
    types = [item.upper() for item in _cast_list(text)]
    unknown = [t for t in types if t not in TYPE_PAIRS]
    if unknown:
        raise ValueError(f"not weight-pair types: {', '.join(unknown)} (expected some of {','.join(TYPE_PAIRS)})")
    return types


def _cast_pattern(pattern: re.Pattern, what: str):
    def cast(text: str) -> str:
        if not pattern.match(text):
            raise ValueError(f"expected {what}")
        return text

    return cast


CASTS = {
    "string": str,
    "int": _cast_int,
    "float": float,
    "list": _cast_list,
    "types": _cast_types,
    "head": _cast_pattern(_HEAD, "a head name like L4H7"),
    "node": _cast_pattern(_NODE, "a head (L4H7) or a layer (L4)"),
}


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    default: str | None
    description: str

    @property
    def required(self) -> bool:
        return self.default is None and self.name not in DEFAULTED

    def cast(self, text: str) -> Any:
        try:
            return CASTS[self.type](text)
        except ValueError as e:
            detail = str(e) if self.type in ("int", "types", "head", "node") else f"expected {self.type}"
            raise UsageError(f"bad value {text!r} for parameter {self.name}: {detail}") from None


@dataclass(frozen=True)
class NamedQuery:
    name: str
    purpose: str
    params: tuple[Param, ...]
    cypher: str

    def usage(self) -> str:
        return " ".join(f"{p.name}=<{p.type}>" if p.required else f"[{p.name}={p.default or 'latest'}]" for p in self.params)


def parse_query(name: str, text: str) -> NamedQuery:
    """A query file's purpose (header text), declared parameters and Cypher body."""
    header = []
    for line in text.splitlines():
        if not line.startswith("//"):
            break
        header.append(line)
    purpose, params = [], []
    for line in header:
        match = _PARAM.match(line)
        if line.lstrip("/ ").startswith("param ") and (match is None or match.group(2) not in CASTS):
            raise ValueError(f"{name}.cypher: malformed parameter line {line!r}")
        if match:
            params.append(Param(*match.groups()))
        else:
            purpose.append(line.lstrip("/").strip())
    return NamedQuery(name, " ".join(p for p in purpose if p), tuple(params), text)


def query_names() -> list[str]:
    """Every named query shipped with headgraph."""
    files = resources.files("headgraph.queries").iterdir()
    return sorted(f.name[: -len(".cypher")] for f in files if f.name.endswith(".cypher"))


def load_query(name: str) -> NamedQuery:
    """The named query `name`; an unknown name raises UsageError listing the known ones."""
    if name not in query_names():
        raise UsageError(f"unknown query {name!r}: choose one of {', '.join(query_names())} (headgraph query --list)")
    return parse_query(name, resources.files("headgraph.queries").joinpath(f"{name}.cypher").read_text())


def query_listing() -> Rows:
    """Every named query as rows of its name, its parameters (usage) and its purpose."""
    listed = [load_query(name) for name in query_names()]
    return Rows(["query", "parameters", "purpose"], [[q.name, q.usage(), q.purpose] for q in listed])


def parse_assignments(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`key=value` strings (from --param) as a dict; a malformed one raises UsageError."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"bad --param {item!r}: write it as key=value")
        out[key.strip()] = value.strip()
    return out


def _beyond_int64(value: Any) -> bool:
    if isinstance(value, list):
        return any(_beyond_int64(v) for v in value)
    if isinstance(value, dict):
        return any(_beyond_int64(v) for v in value.values())
    return isinstance(value, int) and not INT64[0] <= value <= INT64[1]


def parse_values(assignments: dict[str, str]) -> dict[str, Any]:
    """Ad-hoc Cypher parameters: each value read as JSON when it parses (numbers, lists, true), else a string.
    An integer beyond 64 bits, which neither store takes, raises UsageError."""
    out = {}
    for key, text in assignments.items():
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
        if _beyond_int64(out[key]):
            raise UsageError(f"bad --param {key}={text}: integers must lie from {INT64[0]} to {INT64[1]}")
    return out


def bind_params(query: NamedQuery, given: dict[str, str], store: GraphStore) -> dict[str, Any]:
    """Check `given` against the query's declared parameters, cast them, fill defaults and the latest run."""
    declared = {p.name: p for p in query.params}
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise UsageError(f"query {query.name} has no parameter {', '.join(unknown)} (takes: {query.usage()})")
    missing = [p.name for p in query.params if p.required and p.name not in given]
    if missing:
        raise UsageError(f"query {query.name} needs --param {' --param '.join(f'{m}=…' for m in missing)} (takes: {query.usage()})")
    bound = {}
    for p in query.params:
        if p.name in given:
            bound[p.name] = p.cast(given[p.name])
        elif p.default is not None:
            bound[p.name] = p.cast(p.default)
    for name in sorted(RUN_PARAMS & set(given) & set(declared)):  # a run named by hand must be stored
        if not store.has_run(bound[name]):
            raise UsageError(f"no run {bound[name]!r} in {store.description}; `headgraph runs` lists them")
    if "sweep" in given and "sweep" in declared and not store.read(SWEEP_EXISTS_QUERY, {"sweep": bound["sweep"]}).rows:
        raise UsageError(f"no sweep {bound['sweep']!r} in {store.description}; `headgraph runs` lists the runs")
    if "run" in declared and "run" not in bound:
        latest = store.latest_run()
        if latest is None:
            raise UsageError(f"{store.description} holds no complete run; run `headgraph analyze` first")
        bound["run"] = latest
    if "sweep" in declared and "sweep" not in bound:
        latest = store.latest_sweep()
        if latest is None:
            raise UsageError(f"{store.description} holds no complete run of a sweep; run `headgraph sweep` first")
        bound["sweep"] = latest
    for p in query.params:  # a head or layer the run lacks (a typo, another model's) would answer no rows
        if p.type in ("head", "node") and p.name in bound and "run" in bound and not store.read(
                NODE_EXISTS_QUERY, {"run": bound["run"], "node": bound[p.name]}).rows:
            what = "head" if p.type == "head" else "head or layer"
            raise UsageError(f"no {what} {bound[p.name]} in run {bound['run']} (parameter {p.name})")
    return bound


def run_named(store: GraphStore, name: str, params: dict[str, str] | None = None) -> Rows:
    """Run the named query with `params` given as strings (cast per its header)."""
    query = load_query(name)
    return store.read(query.cypher, bind_params(query, params or {}, store))

