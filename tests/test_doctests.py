"""The runnable examples in the docstrings of the public functions (vocabulary, PK of two subspaces and of all
pairs, selection, centrality, the networkx graph, its exports) run as part of the suite, so that they cannot rot."""

import doctest

import pytest

from headgraph import export, heads, sweep
from headgraph.report import sweep as sweep_report
from headgraph.analysis import centrality, network, pk, selection


@pytest.mark.parametrize("module", [heads, pk, selection, centrality, network, export, sweep, sweep_report], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
