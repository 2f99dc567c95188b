"""The settings of the analysis stages, defaults declared once: the CLI, headgraph.workflow and the stages
read them here (a light module: no torch, so `headgraph --help` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from headgraph.errors import UsageError, check_choice
from headgraph.heads import DEFAULT_TYPES

DEFAULT_MEMORY = 2 * 1024**3  # 2 GiB: each stage's working memory, the PK engine's tiles (PKOptions) and the causal
# stages' batches, the passes that build them and their steps (CausalOptions); analyze --max-memory sets both
DEFAULT_BIN_WIDTH = 64 / 254  # KL histogram bin width in PK units
DEFAULT_KL_EPS = 1e-10
# The closed sets of the stage settings, declared once: the CLI's choices are their get_args, the options below
# check them (headgraph.errors.check_choice).
Device = Literal["cpu", "cuda"]
Dtype = Literal["float32", "float64"]  # of the subspaces, the PK, the reference and the null
Kernel = Literal["gram", "projector"]  # the PK engine's exact kernels (headgraph.analysis.projectors)
Formulation = Literal["auto", Kernel]  # auto: the kernel of lower predicted time under the memory budget
Correction = Literal["none", "bh", "bonferroni"]  # multiple-testing correction of the role tests across heads
RoleDesign = Literal["sequential", "fixed"]
Ablation = Literal["resample", "mean"]  # the causal stage's counterfactual sender output
STABILITY_VARIANTS = {
    "float64": "subspaces, PK, reference and null in float64 instead of float32 (roles and effects stay float32)",
    "rank_tol_x10": "rank tolerance x10 (more singular directions dropped)",
    "rank_tol_div10": "rank tolerance / 10",
    "null_seed": "another seed of the isotropic reference and the model-matched null",
    "inputs": "another draw of the role-test and causal inputs",
    "cuda": "computed on CUDA instead of the CPU",
}
DEFAULT_N_BOOT = 1000  # bootstrap samples of the causal effects' intervals


def check_seed(seed: int) -> int:
    """`seed` when it can seed numpy's and torch's samplers (an integer >= 0), else a UsageError naming it."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UsageError(f"seed must be an integer >= 0, got {seed!r}")
    return int(seed)


@dataclass(frozen=True)
class PKOptions:
    """Everything that shapes the PK stages besides the model, defaults declared once (the CLI reads them)."""

    types: tuple[str, ...] = DEFAULT_TYPES  # weight-pair types; "oq,ok" or "all" are parsed by analyze()
    full_matrix: bool = False  # also same-layer and backward pairs
    device: Device | None = None  # None: CUDA when present, else CPU
    dtype: Dtype = "float32"
    seed: int = 0  # samplers of the references and the null
    max_memory: int = DEFAULT_MEMORY  # working-memory budget of the engine's tiles, bytes
    reference_samples: int = 100_000  # samples of the isotropic reference (KL matrix)
    null_heads: int = 200  # random heads per type of the model-matched null (n^2 pairs give p_model)
    bin_width: float = DEFAULT_BIN_WIDTH
    kl_eps: float = DEFAULT_KL_EPS
    formulation: Formulation = "auto"
    rank_tolerance: float = 1.0  # multiplier of the numerical-rank threshold max(d, k) * eps * sigma_max

    def __post_init__(self):
        if self.device is not None:
            check_choice(self.device, Device, "device")
        check_choice(self.dtype, Dtype, "dtype")
        check_choice(self.formulation, Formulation, "formulation")
        check_seed(self.seed)


@dataclass(frozen=True)
class RoleOptions:
    """The role tests' settings, defaults declared once (the CLI and headgraph.workflow read them here)."""

    n_inputs: int = 200  # generated inputs per input set (sequential: at most)
    tau: float = 3.0  # sieve-bias threshold of the one-sided test (uniform attention scores 1)
    alpha: float = 0.05  # significance level of the decision
    correction: Correction = "bh"
    batch_size: int = 32  # inputs per forward pass; the sequential design looks after each batch
    design: RoleDesign = "sequential"  # sequential: stop once every head is settled; fixed: t-test on n_inputs

    def __post_init__(self):
        if self.n_inputs < 2:
            raise UsageError(f"role tests need at least 2 inputs per input set, got n_inputs={self.n_inputs}")
        check_choice(self.correction, Correction, "correction")
        check_choice(self.design, RoleDesign, "role design")
        if not np.isfinite(self.tau):
            raise UsageError(f"--tau must be a finite sieve-bias threshold (uniform attention scores 1), got {self.tau}")
        if self.design == "sequential" and self.tau <= 0:
            raise UsageError(f"the sequential role test bets against --tau > 0 (scores are >= 0), got {self.tau}; "
                             "use --design fixed")
        if self.batch_size < 1:
            raise UsageError(f"batch_size must be at least 1, got {self.batch_size}")


@dataclass(frozen=True)
class CausalOptions:
    """The causal stage's settings (headgraph.analysis.causal), defaults declared once: direct-path effects of
    every OQ/OK/OV pair on `n_inputs` generated inputs per set (or the texts of `inputs_file`, one a line), and
    the downstream (loss) effect of the selected edges when `loss`, on every input (or the first `loss_inputs` of
    each set), of at most `loss_edges` per type, largest attribution first: it costs the model's layers from the
    receiver's on, per edge and input, where a local effect and an attribution cost far less."""

    n_inputs: int = 24  # generated inputs per input set (decoder: IOI prompts and repeated tokens)
    inputs_file: str | None = None  # the user's texts, one a line, instead of the generated sets
    ablation: Ablation = "resample"  # resample: another input's sender output; mean: its mean over the inputs
    n_boot: int = DEFAULT_N_BOOT
    batch_size: int = 16
    max_memory: int = DEFAULT_MEMORY  # local effects: the batches held, the passes building the last and a patching
    # step over them; loss: a batch and the passes of its patched copies
    loss: bool = True
    loss_edges: int | None = 50  # per type, largest attribution (encoders: local effect) first; None: every one
    loss_inputs: int | None = None  # the first N inputs of each set (None: all): the layers from the receiver's on

    def __post_init__(self):
        if self.n_inputs < 2:
            raise UsageError(f"causal effects need at least 2 inputs per input set, got {self.n_inputs}")
        check_choice(self.ablation, Ablation, "ablation")
        if self.loss_inputs is not None and self.loss_inputs < 2:
            raise UsageError(f"loss effects need at least 2 inputs per set, got --causal-loss-inputs {self.loss_inputs}")
        if self.loss_edges is not None and self.loss_edges < 1:
            raise UsageError(f"loss_edges must be at least 1, or None for every selected edge (got {self.loss_edges})")
        if self.n_boot < 1 or self.batch_size < 1:
            raise UsageError(f"n_boot and batch_size must be at least 1, got {self.n_boot} and {self.batch_size}")
