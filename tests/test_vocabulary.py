"""The closed sets (headgraph.analysis.options, headgraph.heads, headgraph.export, ...) are checked where they are
declared: a value outside one is a UsageError naming it and the members, raised when the options are made (before
any work), and the CLI offers exactly the members as its choices."""

import click
import pytest

from headgraph.analysis.options import CausalOptions, PKOptions, RoleOptions
from headgraph.cli import cli
from headgraph.errors import UsageError
from headgraph.settings import analyze_options


@pytest.mark.parametrize("make, message", [
    (lambda: PKOptions(dtype="float16"), "unknown dtype 'float16': use one of float32, float64"),
    (lambda: PKOptions(device="gpu"), "unknown device 'gpu': use one of cpu, cuda"),
    (lambda: PKOptions(formulation="fft"), "unknown formulation 'fft': use one of auto, gram, projector"),
    (lambda: RoleOptions(correction="holm"), "unknown correction 'holm': use one of none, bh, bonferroni"),
    (lambda: RoleOptions(design="adaptive"), "unknown role design 'adaptive': use one of sequential, fixed"),
    (lambda: CausalOptions(ablation="zero"), "unknown ablation 'zero': use one of resample, mean"),
    (lambda: analyze_options(dtype="half"), "unknown dtype 'half': use one of float32, float64"),
    (lambda: analyze_options(roles_correction="BH"), "unknown correction 'BH': use one of none, bh, bonferroni"),
])
def test_a_value_outside_a_closed_set_is_named_with_the_members(make, message):
    with pytest.raises(UsageError) as error:
        make()
    assert str(error.value) == message


def test_the_cli_offers_exactly_the_members():
    analyze = {p.name: p.type.choices for p in cli.commands["analyze"].params if isinstance(p.type, click.Choice)}
    assert analyze == {"processing": ("tl", "raw"), "device": ("cpu", "cuda"), "dtype": ("float32", "float64"),
                       "correction": ("none", "bh", "bonferroni"), "role_design": ("sequential", "fixed")}
    query = {p.name: p.type.choices for p in cli.commands["query"].params if isinstance(p.type, click.Choice)}
    assert query == {"fmt": ("table", "json", "csv")}
