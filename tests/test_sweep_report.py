"""The sweep report's Roles section when no role shows: a sweep whose role tests found nothing (the tiny GPT-2
of test_sweep_trainer at every checkpoint) or that ran with --no-roles says so in a sentence, in report.md,
report.html and in fig_sweep's title, instead of an empty table and a silently missing row of panels; a sweep
with a significant role keeps its table."""

import pandas as pd
import pytest

from headgraph.loader.sweeps import EDGE_COLUMNS, RUN_COLUMNS
from headgraph.report.figures import plt
from headgraph.report.sweep import SweepData, render_sweep_report, strongest_edges, sweep_figure

STEPS = [30, 60]
NONE_SIGNIFICANT = "No role is significant for any head at any step (no role panel, no role emerged)."
NOT_TESTED = "No role was tested (the sweep ran with --no-roles)."


def _data(heads: pd.DataFrame) -> SweepData:
    runs = pd.DataFrame([[s, f"checkpoint-{s}", f"run-{s}", 1, "top 20 per type by PK", "/gone"] for s in STEPS],
                        columns=RUN_COLUMNS)
    edges = pd.DataFrame([[s, "OK", "L0H0", "L1H0", 5.0 + s / 30, 0.5, None] for s in STEPS], columns=EDGE_COLUMNS)
    return SweepData("tiny-sweep", runs, edges, heads)


def _heads(roles=True, significant=False) -> pd.DataFrame:
    rows = []
    for step in STEPS:
        for layer, head in ((0, 0), (1, 0)):
            sig = significant and (layer, step) == (1, STEPS[-1])
            row = {"step": step, "name": f"L{layer}H{head}", "layer": layer, "head": head,
                   "roles": ["induction"] if sig else []}
            if roles:
                row |= {"induction_score": 1.0 + layer * step / 10, "induction_sig": sig}
            else:  # as a store returns a run without roles: its Head has the score columns, empty
                row |= {"roles": None, "identity_score": None, "identity_sig": None}
            rows.append(row)
    return pd.DataFrame(rows)


@pytest.mark.parametrize("heads, sentence", [(_heads(), NONE_SIGNIFICANT), (_heads(roles=False), NOT_TESTED),
                                             (_heads(significant=True), None)])
def test_the_roles_section_says_why_no_role_shows(heads, sentence, tmp_path):
    data = _data(heads)
    no_emergence = pd.DataFrame(columns=["role", "head", "emerged"])
    edge_emergence = pd.DataFrame(columns=["kind", "source", "target", "emerged"])
    paths = render_sweep_report(data, edge_emergence, no_emergence, tmp_path)
    markdown = paths["report.md"].read_text()
    roles = markdown.split("## Roles", 1)[1]
    assert "|  |" not in markdown  # no empty table
    if sentence is None:
        assert "| induction | L1H0 | — | 1 | 4 | 7 |" in roles and NONE_SIGNIFICANT not in markdown
    else:
        assert roles.rstrip().endswith(sentence) and sentence in paths["report.html"].read_text()
    fig = sweep_figure(data, strongest_edges(data.edges), edge_emergence, no_emergence, pd.DataFrame(
        columns=["step", "loss"]))
    title = fig._suptitle.get_text()
    assert (sentence in title if sentence else NONE_SIGNIFICANT not in title and NOT_TESTED not in title)
    assert len(fig.axes) == (1 if sentence else 2)  # the OK panel, and the induction panel when a role shows
    plt.close(fig)
