"""`headgraph sweep MODEL --revisions ...` offline, on a hub cache laid out as huggingface_hub lays it out
(models--ORG--NAME/refs/<revision> naming a commit, snapshots/<commit>/ holding the model) with two revisions of
a tiny random GPT-2: each revision is analysed from its own snapshot and stored as `<name>@<revision>` with the
step of its name; a revision missing from the cache is reported by name (exit 1) while the others are stored;
a rerun skips the stored revisions, even once their snapshots are gone from the cache."""

import hashlib
import shutil

import huggingface_hub.constants
import pytest
from _cli import run_cli

from headgraph.loader.ladybug_store import LadybugStore
from headgraph.testing.synthetic import save_synthetic

FAST = ["--no-report", "--no-roles", "--no-causal", "--null-heads", "8", "--reference-samples", "500"]
REPO, CACHED = "org/tiny", {"step100": 1, "step200": 2}  # revision: seed of its weights


def _snapshot(cache, revision):
    return cache / "models--org--tiny" / "snapshots" / hashlib.sha1(revision.encode()).hexdigest()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline hub cache holding CACHED revisions of REPO, for this process and the workers it spawns."""
    cache = tmp_path / "hub"
    for revision, seed in CACHED.items():
        save_synthetic(_snapshot(cache, revision), n_layers=2, n_heads=2, d_model=32, d_head=16, n_ctx=64, vocab=300,
                       seed=seed)
        (cache / "models--org--tiny" / "refs").mkdir(parents=True, exist_ok=True)
        (cache / "models--org--tiny" / "refs" / revision).write_text(_snapshot(cache, revision).name)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # the spawned workers read them when they import the hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def _stored(db):
    with LadybugStore(db, read_only=True) as store:
        return store.read("MATCH (r:Run) RETURN r.model AS model, r.step AS step, r.source AS source, "
                          "r.status AS status, r.id AS id ORDER BY step").records()


@pytest.mark.slow
def test_revisions_from_the_hub_cache_are_stored_and_a_missing_one_is_named(hub_cache, tmp_path, capsys):
    args = ["sweep", REPO, "--db", str(tmp_path / "s.lbdb"), "--out", str(tmp_path / "runs"), *FAST]
    code, out, err = run_cli([*args, "--revisions", "step200,step100,step300"], capsys)
    assert code == 1, err
    assert "3 checkpoints, 0 already stored" in err and "steps from name" in err
    assert ("1 of 3 checkpoints not stored (tiny@step300 (step 300): revision step300 of org/tiny is not in the "
            "local hub cache, and the hub did not give it)") in err, err
    stored = _stored(tmp_path / "s.lbdb")
    assert [(r["model"], r["step"], r["status"]) for r in stored] == [("tiny@step100", 100, "complete"),
                                                                     ("tiny@step200", 200, "complete")]
    # each run read its own revision's snapshot
    assert [r["source"] for r in stored] == [str(_snapshot(hub_cache, rev).resolve()) for rev in ("step100", "step200")]

    shutil.rmtree(_snapshot(hub_cache, "step100"))  # a stored revision is skipped, cached or not
    revisions = tmp_path / "revisions.txt"
    revisions.write_text("# the cached ones\nstep100\nstep200\n")
    code, out, err = run_cli([*args, "--revisions", str(revisions)], capsys)
    assert code == 0, err
    assert "2 checkpoints, 2 already stored" in err and out.count("skipped (stored before)") == 2
    assert [r["id"] for r in _stored(tmp_path / "s.lbdb")] == [r["id"] for r in stored]
