"""Which store the user chose (--db / --neo4j / the environment) and opening it; the backends are imported only
when opened, so that a LadybugDB user never loads the Neo4j driver and the other way round."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from headgraph.errors import StoreUnavailable, UsageError
from headgraph.files import writable_folder
from headgraph.loader.store import DEFAULT_DB, GraphStore

StoreBackend = Literal["ladybug", "neo4j"]  # the embedded LadybugDB store, a Neo4j server


def embedded_path(db: str | os.PathLike | None = None) -> str:
    """The embedded store's path: `db`, else HEADGRAPH_DB, else ./headgraph.lbdb."""
    return str(db or os.environ.get("HEADGRAPH_DB") or DEFAULT_DB)


def neo4j_settings(uri: str | None = None, user: str | None = None,
                   password: str | None = None) -> tuple[str | None, str, str, str]:
    """(URI, user, password, database) from the arguments, else NEO4J_URI / NEO4J_USER (neo4j) /
    NEO4J_PASSWORD / NEO4J_DATABASE (neo4j): the one place headgraph reads them."""
    env = os.environ
    return (uri or env.get("NEO4J_URI") or None, user or env.get("NEO4J_USER") or "neo4j",
            password if password is not None else env.get("NEO4J_PASSWORD", ""), env.get("NEO4J_DATABASE") or "neo4j")


def resolve_store(db: str | os.PathLike | None = None, neo4j: str | None = None) -> tuple[StoreBackend, str]:
    """The store the user selected, unopened: ("neo4j", URI) when a URI is given (or NEO4J_URI is set and no
    --db), else ("ladybug", path) of `db` / HEADGRAPH_DB / ./headgraph.lbdb."""
    if db is not None and not str(db).strip():
        raise UsageError(f"--db {str(db)!r} names no store: give the path of a LadybugDB store, or leave --db out "
                         f"for HEADGRAPH_DB / {DEFAULT_DB}")
    if neo4j is not None and not neo4j.strip():
        raise UsageError(f"--neo4j {neo4j!r} names no server: give a URI such as bolt://127.0.0.1:7687, or leave "
                         "--neo4j out")
    if db is not None and neo4j:
        raise UsageError("give either --db PATH (embedded store) or --neo4j URI, not both")
    uri = neo4j or (None if db is not None else neo4j_settings()[0])
    if uri:
        return "neo4j", uri
    return "ladybug", embedded_path(db)


def open_store(
    db: str | os.PathLike | None = None,
    neo4j: str | None = None,
    user: str | None = None,
    password: str | None = None,
    read_only: bool = False,
) -> GraphStore:
    """Open the store the user selected (see `resolve_store`)."""
    backend, where = resolve_store(db, neo4j)
    if backend == "neo4j":
        from headgraph.loader.neo4j_store import Neo4jStore

        _, user, password, database = neo4j_settings(where, user, password)
        return Neo4jStore(where, user, password, database=database, read_only=read_only)
    from headgraph.loader.ladybug_store import LadybugStore

    return LadybugStore(where, read_only=read_only)


@dataclass(frozen=True)
class StoreSpec:
    """The store chosen on the command line; `open()` it when needed."""

    db: str | None = None
    neo4j: str | None = None
    user: str | None = None

    def open(self, read_only: bool = False) -> GraphStore:
        return open_store(self.db, self.neo4j, self.user, read_only=read_only)

    def check(self) -> str:
        """Fail now, with one line, if the store cannot be written later; return its description. A server or an
        existing file is opened and closed (which also removes abandoned runs); a missing file is not created,
        only its folder checked, so a failed analyze leaves no empty store behind."""
        backend, where = resolve_store(self.db, self.neo4j)
        if backend == "ladybug" and not os.path.exists(where):
            folder = os.path.dirname(os.path.abspath(where))
            if not os.path.isdir(folder) or writable_folder(folder) is None:
                raise StoreUnavailable(f"cannot create the embedded store {where}: {folder} is not a writable folder")
            return f"LadybugDB at {where}"
        with self.open() as store:
            return store.description
