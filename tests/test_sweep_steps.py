"""Where a sweep's steps come from, on folders laid out as training runs leave them: every checkpoint name shape
that trainers write (copies of one tiny random GPT-2 checkpoint), trainer_state.json before the name, --steps
before both, folders that are no checkpoint skipped and listed; and each kind of bad input stops with one line
and exit 2 before anything is stored."""

import json
import shutil

import pytest
from _cli import run_cli

from headgraph.errors import UsageError
from headgraph.sweep import checkpoints_at, checkpoints_in, checkpoints_of, parse_step, read_steps
from headgraph.testing.synthetic import save_synthetic

# the folder names trainers write, and the step each stands for
SHAPES = {"checkpoint-500": 500, "step-100": 100, "step_200": 200, "step300": 300, "global_step400": 400,
          "iter_0000600": 600, "STEP-700": 700, "Checkpoint_800": 800, "induction-2l-step900": 900}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One tiny random-init GPT-2 checkpoint folder (config.json, safetensors, tokenizer)."""
    return save_synthetic(tmp_path_factory.mktemp("tiny") / "model", n_layers=2, n_heads=2, d_model=32, d_head=16,
                          n_ctx=64, vocab=300)


def _copies(tiny, folder, names):
    for name in names:
        shutil.copytree(tiny, folder / name)
    return folder


def _trainer_state(folder, step):
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))


def test_every_name_shape_gives_its_step_and_other_folders_are_listed(tiny, tmp_path):
    folder = _copies(tiny, tmp_path, [*SHAPES, "final"])
    (folder / "logs").mkdir()  # no config.json: not a checkpoint
    (folder / "notes.txt").write_text("a file, not a folder")
    found, skipped = checkpoints_in(folder, final_step=1000)
    assert [(c.name, c.step, c.origin) for c in found] == [
        *sorted(((name, step, "name") for name, step in SHAPES.items()), key=lambda row: row[1]),
        ("final", 1000, "--final-step")]
    assert skipped == ["logs"]
    assert [parse_step(n) for n in ("final", "step", "mystep100", "step-1e3", "checkpoint-5-old")] == [None] * 5


def test_trainer_state_comes_before_the_name_and_steps_before_both(tiny, tmp_path):
    folder = _copies(tiny, tmp_path, ["checkpoint-500", "last"])
    _trainer_state(folder / "checkpoint-500", 7)  # the file wins over the name
    _trainer_state(folder / "last", 9)
    found, _ = checkpoints_in(folder)
    assert [(c.name, c.step, c.origin) for c in found] == [("checkpoint-500", 7, "trainer_state.json"),
                                                           ("last", 9, "trainer_state.json")]
    (tmp_path / "steps.csv").write_text("folder,step\ncheckpoint-500,11\n")
    found, _ = checkpoints_in(folder, steps=read_steps(tmp_path / "steps.csv"))
    assert [(c.name, c.step, c.origin) for c in found] == [("last", 9, "trainer_state.json"),
                                                           ("checkpoint-500", 11, "--steps")]
    assert [(c.name, c.step) for c in checkpoints_of(["a", "b-step5"], steps={"a": 3})] == [("a", 3), ("b-step5", 5)]
    revisions = checkpoints_at("org/model", ["step2000", "main"], steps={"main": 143000})
    assert [(c.name, c.step, c.origin) for c in revisions] == [("model@step2000", 2000, "name"),
                                                               ("model@main", 143000, "--steps")]


def test_steps_folders_and_final_step_are_checked(tmp_path):
    for name in ("ckpt-step20", "ckpt-step3", "final", "extra"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="extra, final have no step .*at most one, the final model"):
        checkpoints_in(tmp_path, final_step=100)
    (tmp_path / "extra" / "config.json").unlink()
    with pytest.raises(UsageError, match="final has no step .*give its step with --final-step N"):
        checkpoints_in(tmp_path)
    found, skipped = checkpoints_in(tmp_path, final_step=100)
    assert [(c.name, c.step) for c in found] == [("ckpt-step3", 3), ("ckpt-step20", 20), ("final", 100)]
    assert skipped == ["extra"]
    with pytest.raises(UsageError, match="two checkpoints have step 20: ckpt-step20, final"):
        checkpoints_in(tmp_path, final_step=20)
    with pytest.raises(UsageError, match="--final-step gives the step of the one checkpoint without one; 0 of"):
        checkpoints_in(tmp_path, steps={"final": 5}, final_step=6)
    assert [c.step for c in checkpoints_of(["b", "a-step5"])] == [5, None]  # step-less ones last, as given
    with pytest.raises(UsageError, match="named twice"):
        checkpoints_of(["a-step5", "a-step5"])
    with pytest.raises(UsageError, match="2 of the MODEL arguments lack one"):
        checkpoints_of(["a", "b"], final_step=1)


def _folder_with(tmp_path, tiny, state_text):
    folder = _copies(tiny, tmp_path / "run", ["checkpoint-100", "checkpoint-200"])
    if state_text is not None:
        (folder / "checkpoint-200" / "trainer_state.json").write_text(state_text)
    return folder


@pytest.mark.parametrize("case, message", [
    ("state-not-json", "cannot read {run}/checkpoint-200/trainer_state.json: "),
    ("state-without-step", "{run}/checkpoint-200/trainer_state.json holds no global_step"),
    ("steps-missing-folder", "--steps names checkpoint-999: not checkpoints in {run}"),
    ("steps-bad-row", "--steps {steps} line 2: expected checkpoint,step"),
    ("same-step", "two checkpoints have step 100: checkpoint-100, checkpoint-200"),
    ("revision-without-step", "--revisions of org/tiny: main has no step (no step in the revision's name"),
    ("revisions-of-a-folder", "--revisions are revisions of a hub model"),
    ("revisions-and-checkpoints", "either --checkpoints DIR or MODEL arguments"),
    ("no-such-folder", "--checkpoints /no/such/folder is not a folder"),
    ("no-store", "a sweep stores its runs"),
    ("bad-sweep-id", "bad sweep id 'a b'"),
    ("unknown-model", "no-such-model-step3"),
])
def test_bad_input_is_one_line_exit_2_and_stores_nothing(case, message, tiny, tmp_path, capsys):
    states = {"state-not-json": '{"global_step": 2', "state-without-step": '{"log_history": []}',
              "same-step": '{"global_step": 100}'}
    run = _folder_with(tmp_path, tiny, states.get(case))
    steps = tmp_path / "steps.csv"
    steps.write_text({"steps-missing-folder": "checkpoint-999,5\n",
                      "steps-bad-row": "checkpoint-100,5\ncheckpoint-200,two hundred\n"}.get(case, ""))
    args = {"revision-without-step": ["org/tiny", "--revisions", "step100,main"],
            "revisions-of-a-folder": [str(run / "checkpoint-100"), "--revisions", "step100"],
            "revisions-and-checkpoints": ["--checkpoints", str(run), "--revisions", "step100"],
            "no-such-folder": ["--checkpoints", "/no/such/folder"],
            "no-store": ["--checkpoints", str(run), "--no-store"],
            "bad-sweep-id": ["--checkpoints", str(run), "--sweep-id", "a b"],
            "unknown-model": ["no-such-model-step3"]}.get(case, ["--checkpoints", str(run)])
    if case.startswith("steps-"):
        args = [*args, "--steps", str(steps)]
    code, out, err = run_cli(["sweep", *args, "--db", str(tmp_path / "s.lbdb"), "--out", str(tmp_path / "runs")],
                             capsys)
    assert code == 2, err
    assert message.format(run=run, steps=steps) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "s.lbdb").exists() and not (tmp_path / "runs").exists()
