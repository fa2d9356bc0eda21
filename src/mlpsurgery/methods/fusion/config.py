"""What `fuse` compresses and how: the methods and their settings (FusionConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import MLPSurgeryError


METHODS = ("fusion", "cluster", "svd", "sketch", "mmd", "magnitude", "neuron", "random")


DEFAULT_LAYERS = "last2/3"
IMPORTANCE = ("auto", "weight", "obs", "output", "activation")
CALIBRATION = ("sequential", "original", "corrective")
BUDGETS = ("uniform", "per-layer")
CLUSTER_ON = ("auto", "weights", "activations")


@dataclass
class FusionConfig:
    """What to compress and how. Defaults follow the paper (k = h/4 on the last two thirds of the layers)."""

    width: int | None = None  # k, the new inner width; None: h // 4 (the paper's 3072 -> 768)
    method: str = "fusion"  # one of METHODS
    layers: str = DEFAULT_LAYERS  # 'all', '8-11', '0,3,5', 'last2/3' (see sites.parse_layers)
    seed: int = 0  # k-means++ / sketch / MMD init / random neurons
    n_init: int = 3  # k-means restarts (best inertia kept)
    max_iter: int = 300  # Lloyd iterations per restart
    tol: float = 1e-4  # Lloyd stops when centres move less than tol x mean feature variance (as scikit-learn)
    device: str | None = None  # where k-means / MMD run (default: the model's device)
    mmd_steps: int = 150  # Adam steps on the support vectors
    mmd_lr: float = 0.03  # in units of the neuron vectors' standard deviation
    # neuron pruning selection: auto (output with calibration data, else weight) | weight (data-free) | obs (greedy
    # structured optimal brain surgeon on the inner activations, methods/reconstruct/obs.py) | output (the neuron's
    # output energy on data: RMS activation x ||down column||) | activation (mean |activation| x ||down column||)
    importance: str = "auto"
    # Data-aware mode (fuse(calib_data=...)): every layer compressed on what the compressed layers before it produce
    # sequential | original (every layer on the original model's activations) | corrective (sequential, and the refit
    # aims the sub-block at where the original model's residual stream goes: it also undoes the drift of the layers
    # before it)
    calibration: str = "sequential"
    # fusion / cluster: what k-means groups neurons by -- auto (activations with calibration data, else weights) |
    # weights (the paper's neuron weight vectors) | activations (each neuron's contribution on calibration rows)
    cluster_on: str = "auto"
    refit: bool = True  # the down projection refit by ridge least squares to the original MLP's output (not svd)
    whiten: bool = True  # svd: factorise each projection in the metric of its inputs (SVD-LLM) instead of plainly
    calib_batch: int = 8  # calibration blocks per forward
    budget: str = "uniform"  # uniform: every layer at width k | per-layer: the same total width, each layer's by its
    # measured sensitivity (methods/reconstruct/budget.py; needs calibration data)
    # on-policy local tuning (methods/reconstruct/local.py; needs calibration data): after its compression and refit,
    # each layer's MLP trained this many epochs over its calibration rows toward the original sub-block's output on
    # them (Adam, local_lr, cosine), before the next layer is calibrated on what it produces. 0: one-shot (default)
    local_epochs: float = 0.0
    local_lr: float = 3e-3
    tune_steps: int | None = None  # layer-wise tuning steps; None: one epoch over the tune tokens
    tune_lr: float = 1e-3
    tune_batch: int = 512  # token rows per tuning step

    def validate(self) -> None:
        if self.method not in METHODS:
            raise MLPSurgeryError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.importance not in IMPORTANCE:
            raise MLPSurgeryError(f"importance must be one of {', '.join(IMPORTANCE)}, not {self.importance!r}")
        if self.cluster_on not in CLUSTER_ON:
            raise MLPSurgeryError(f"cluster_on must be one of {', '.join(CLUSTER_ON)}, not {self.cluster_on!r}")
        if self.budget not in BUDGETS:
            raise MLPSurgeryError(f"budget must be one of {', '.join(BUDGETS)}, not {self.budget!r}")
        if self.calibration not in CALIBRATION:
            raise MLPSurgeryError(f"calibration must be one of {', '.join(CALIBRATION)}, not {self.calibration!r}")
        if not (self.local_epochs >= 0 and self.local_epochs < float("inf")) or self.local_lr <= 0:
            raise MLPSurgeryError(f"local tuning needs epochs >= 0 and a learning rate > 0, not {self.local_epochs} "
                                  f"and {self.local_lr}")
        if self.n_init < 1 or self.max_iter < 1:
            raise MLPSurgeryError("n_init and max_iter must be at least 1")

    def check_calibrated(self, calibrated: bool) -> None:
        """Refuse local tuning, and clustering on activations, where there are no calibration rows (whole model and
        layer by layer)."""
        if self.cluster_on == "activations" and self.method in ("fusion", "cluster") and not calibrated:
            raise MLPSurgeryError("clustering on activations needs calibration rows: give calibration data "
                                  "(--calib-data), or cluster on weights (--cluster-on weights / auto)")
        if self.local_epochs > 0 and not calibrated:
            raise MLPSurgeryError("local tuning trains each layer on its calibration rows: give calibration data "
                                  "(--calib-data), or drop --local-epochs")
