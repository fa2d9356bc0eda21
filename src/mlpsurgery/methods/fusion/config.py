"""What `fuse` compresses and how: the methods and their settings (FusionConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import MLPSurgeryError


METHODS = ("fusion", "cluster", "svd", "sketch", "mmd", "magnitude", "neuron", "random")


DEFAULT_LAYERS = "last2/3"


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
    importance: str = "weight"  # neuron pruning score: weight (data-free) | activation (needs tune data)
    tune_steps: int | None = None  # layer-wise tuning steps; None: one epoch over the tune tokens
    tune_lr: float = 1e-3
    tune_batch: int = 512  # token rows per tuning step

    def validate(self) -> None:
        if self.method not in METHODS:
            raise MLPSurgeryError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.importance not in ("weight", "activation"):
            raise MLPSurgeryError(f"importance must be 'weight' or 'activation', not {self.importance!r}")
        if self.n_init < 1 or self.max_iter < 1:
            raise MLPSurgeryError("n_init and max_iter must be at least 1")

