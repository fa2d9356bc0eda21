"""What CoreLocker extracts: the configuration and its allowed values."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import MLPSurgeryError

INDICATORS = ("l1", "scale", "random")
UNITS = ("weight", "neuron", "head", "filter")
SCOPES = ("global", "layer")


@dataclass
class CoreLockerConfig:
    """What to extract. Defaults follow the paper: the l1 indicator, a global ranking, 5% extracted,
    input and output layers kept."""

    ratio: float = 0.05  # fraction of eligible units extracted (the paper's 1 - alpha)
    indicator: str = "l1"  # l1 | scale | random
    unit: str = "weight"  # weight | neuron | head | filter
    scope: str = "global"  # global | layer
    include_io: bool = False  # also extract from embeddings / output layer (first / last layer)
    seed: int = 0  # for the random indicator

    def validate(self) -> None:
        for name, value, allowed in (("indicator", self.indicator, INDICATORS), ("unit", self.unit, UNITS),
                                     ("scope", self.scope, SCOPES)):
            if value not in allowed:
                raise MLPSurgeryError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        if not 0.0 <= self.ratio <= 1.0:
            raise MLPSurgeryError(f"the extraction ratio must be in [0, 1], not {self.ratio}")
