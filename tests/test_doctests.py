"""The runnable examples in the docstrings of the public functions (vocabulary, PK of two subspaces and of all
pairs, selection, centrality, the networkx graph, its exports, the interactive view's data, loading a model, the
Python API) run as part of the suite, so that they cannot rot."""

import doctest

import pytest

from headgraph import api, errors, export, heads, settings, sweep
from headgraph.analysis import bootstrap, centrality, network, pk, selection, stability
from headgraph.loader import models
from headgraph.report import interactive
from headgraph.report import sweep as sweep_report


@pytest.mark.parametrize("module", [heads, errors, bootstrap, pk, selection, centrality, network, stability, models, export, interactive, api,
                                    settings, sweep, sweep_report], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
