
# ---- loader fixtures (helper "loader"): tiny synthetic and planted models saved as local HF folders ----
import pytest as _loader_pytest

from headgraph.analysis.planted import PlantSpec as _PlantSpec
from headgraph.analysis.planted import save_planted as _save_planted
from headgraph.loader.synthetic import save_synthetic as _save_synthetic


@_loader_pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory):
    """A random-init GPT-2-architecture folder: 2 layers x 4 heads, d_model 64, d_head 16, n_ctx 128."""
    return _save_synthetic(tmp_path_factory.mktemp("synthetic") / "gpt2-tiny", seed=0)


@_loader_pytest.fixture(scope="session")
def planted(tmp_path_factory):
    """(folder, truth) of the default planted model: 3 layers x 4 heads, hub L0H2, identity L0H0/L1H3, prev L0H1."""
    return _save_planted(tmp_path_factory.mktemp("planted") / "gpt2-planted", _PlantSpec())
# ---- end loader fixtures ----
