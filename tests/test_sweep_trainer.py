"""A real training run swept as it lies on disk: a tiny GPT-2 trained by `transformers.Trainer` on CPU (a
skip-gram task, x[t] = perm(x[t-2]), that its loss falls on within 120 steps) writes checkpoint-30 ... -120 with
their trainer_state.json; `headgraph sweep --checkpoints` on that output folder stores every checkpoint with the
trainer's global_step, `query edge-history` returns its rows in step order, a rerun skips them all, and the sweep
report shows the loss the trainer logged at each checkpoint."""

import contextlib
import io
import json

import pytest
import torch
from _cli import run_cli

from headgraph.loader.ladybug_store import LadybugStore
from headgraph.sweep import checkpoints_in
from headgraph.testing.synthetic import save_tokenizer

MAX_STEPS, SAVE_STEPS, LOGGING_STEPS = 120, 30, 10
VOCAB, TASK_TOKENS, LENGTH = 300, 64, 24
FAST = ["--null-heads", "8", "--reference-samples", "500", "--n-inputs", "16", "--no-causal"]


class SkipGram(torch.utils.data.Dataset):
    """Sequences whose every token after the second is a fixed permutation of the token two before it."""

    def __init__(self, n: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        permutation = torch.randperm(TASK_TOKENS, generator=g)
        x = torch.randint(0, TASK_TOKENS, (n, LENGTH), generator=g)
        for t in range(2, LENGTH):
            x[:, t] = permutation[x[:, t - 2]]
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


@pytest.fixture(scope="module")
def trainer_output(tmp_path_factory):
    """The Trainer's output folder as it leaves it (checkpoint-N folders with model, tokenizer, optimizer and
    trainer_state.json), plus the `runs/` log folder that its TensorBoard logging writes beside them."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    root = tmp_path_factory.mktemp("trainer")
    save_tokenizer(root / "tokenizer", VOCAB)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=VOCAB, bos_token_id=VOCAB - 1,
                        eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    args = TrainingArguments(str(root / "out"), max_steps=MAX_STEPS, save_steps=SAVE_STEPS, logging_steps=LOGGING_STEPS,
                             per_device_train_batch_size=16, learning_rate=1e-2, report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # this model trains 10x faster on one thread than on two contended ones
    try:
        torch.manual_seed(0)
        Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=SkipGram(16 * MAX_STEPS),
                processing_class=AutoTokenizer.from_pretrained(root / "tokenizer")).train()
    finally:
        torch.set_num_threads(threads)
    (root / "out" / "runs").mkdir()
    (root / "out" / "runs" / "events.out.tfevents").write_text("")
    return root / "out"


def _state(folder):
    return json.loads((folder / "trainer_state.json").read_text())


def _headgraph(args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `headgraph ARGS` run in this process, for a module fixture (no capsys)."""
    from headgraph.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def swept(trainer_output, tmp_path_factory):
    """(sweep id, store, sweep folder, the command's arguments, its stderr) of `headgraph sweep --checkpoints` on
    the Trainer's output folder, without the report."""
    folder = tmp_path_factory.mktemp("swept")
    args = ["sweep", "--checkpoints", str(trainer_output), "--db", str(folder / "s.lbdb"), "--out",
            str(folder / "runs"), *FAST]
    code, out, err = _headgraph([*args, "--no-report"])
    assert code == 0, err
    sweep = out.splitlines()[-1].split()[1].rstrip(":")  # the last line: "sweep ID: 4 runs in ..."
    return sweep, folder / "s.lbdb", folder / "runs", args, err


@pytest.mark.slow
def test_the_trainer_wrote_checkpoints_whose_steps_are_their_global_steps(trainer_output):
    steps = sorted(_state(p)["global_step"] for p in trainer_output.glob("checkpoint-*"))
    assert steps == list(range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS))
    found, skipped = checkpoints_in(trainer_output)
    assert [(c.step, c.origin) for c in found] == [(step, "trainer_state.json") for step in steps]
    assert skipped == ["runs"]
    losses = [e["loss"] for e in _state(trainer_output / f"checkpoint-{MAX_STEPS}")["log_history"] if "loss" in e]
    assert losses[-1] < 0.5 * losses[0]  # it learned: the story the sweep report tells


@pytest.mark.slow
def test_every_checkpoint_is_stored_with_its_trainer_step_and_edge_history_is_in_step_order(
        trainer_output, swept, capsys):
    sweep, db, _, _, err = swept
    steps = sorted(_state(p)["global_step"] for p in trainer_output.glob("checkpoint-*"))
    assert f"{len(steps)} checkpoints, 0 already stored" in err and "steps from trainer_state.json" in err, err
    assert f"skipped the folders in {trainer_output} without config.json (not checkpoints): runs\n" in err, err
    with LadybugStore(db, read_only=True) as store:
        runs = store.read("MATCH (r:Run) RETURN r.model AS model, r.step AS step, r.status AS status, r.sweep AS sweep "
                          "ORDER BY model").records()
    assert sorted((r["step"], r["model"], r["status"], r["sweep"]) for r in runs) == [
        (step, f"checkpoint-{step}", "complete", sweep) for step in steps]
    code, out, err = run_cli(["query", "edge-history", "--db", str(db), "--format", "json", "--param", f"sweep={sweep}",
                              "--param", "source=L0H0", "--param", "target=L1H1", "--param", "types=OV"], capsys)
    assert code == 0, err
    rows = json.loads(out)
    assert [r["step"] for r in rows] == steps and [r["model"] for r in rows] == [f"checkpoint-{s}" for s in steps]
    assert all(r["selected"] and r["pk"] > 0 for r in rows)  # 4 OV pairs, all kept by the default top 20


@pytest.mark.slow
def test_a_rerun_skips_every_checkpoint_and_the_report_shows_the_logged_loss(trainer_output, swept, capsys):
    sweep, db, runs, args, _ = swept
    code, out, err = run_cli(args, capsys)  # with the report this time
    assert code == 0, err
    assert "4 already stored" in err and out.count("skipped (stored before)") == 4
    report = (runs / "report.md").read_text()
    logged = {e["step"]: e["loss"] for e in _state(trainer_output / f"checkpoint-{MAX_STEPS}")["log_history"]
              if "loss" in e}
    for folder in sorted(trainer_output.glob("checkpoint-*")):
        step = _state(folder)["global_step"]
        assert f"| {step} | checkpoint-{step} | " in report
        assert f" | {logged[step]:.4g} | {step} |" in report  # the loss logged at the checkpoint's own step
    assert (runs / "fig_sweep.png").stat().st_size > 10_000
