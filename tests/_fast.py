"""The fast settings of the tests' analyses, declared once: 2,000 reference samples, 20 null heads per type,
20 role-test and 8 causal inputs per input set, instead of the defaults (100,000; 200; 200; 24). They are
enough for the structure the tests recover (planted edges, hub and roles; the trained induction circuit); they
are not enough to measure a model. A test that needs other settings says so with its own.

Each setting is a keyword of the Python API (headgraph.analyze, headgraph.settings.analyze_options); `flags`
writes keywords as the CLI flags that mean the same, and tests/test_api.py checks that the CLI reads these
flags back as these keywords."""

PK = {"reference_samples": 2000, "null_heads": 20}  # PK and significance: compute_pk, PKOptions
FAST = {**PK, "roles_n_inputs": 20, "causal_n_inputs": 8}  # a whole analysis
PK_ONLY = {**PK, "roles": False, "causal": False}  # PK and significance alone

_FLAG = {"reference_samples": "--reference-samples", "null_heads": "--null-heads", "roles_n_inputs": "--n-inputs",
         "causal_n_inputs": "--causal-n"}
_OFF = {"roles": "--no-roles", "causal": "--no-causal"}


def flags(keywords: dict) -> list[str]:
    """The `headgraph analyze` flags of API keywords (roles=False / causal=False: --no-roles / --no-causal)."""
    return [text for name, value in keywords.items()
            for text in ([_OFF[name]] if value is False else [_FLAG[name], str(value)])]


FLAGS = flags(FAST)
PK_ONLY_FLAGS = flags(PK_ONLY)
