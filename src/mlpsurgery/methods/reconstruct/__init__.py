"""Data-aware reconstruction shared by every compressor: what the field learned after the papers we implement.

- sequential.py: sequential calibration -- each chosen layer compressed on the activations the already-compressed
  layers before it produce (SparseGPT's order), in one pass through the layers;
- refit.py: closed-form compensation -- the down projection of a narrowed MLP refit by ridge least squares to the
  original MLP's output (FLAP, SlimGPT);
- obs.py: which neurons to keep when the refit follows -- greedy structured optimal brain surgeon (ZipLM);
- whiten.py: whitened, truncation-aware SVD (SVD-LLM) for the svd baseline and NSN's nested start;
- local.py: on-policy local tuning -- a compressed layer's MLP trained on its calibration rows toward the original
  sub-block's output before the next layer is calibrated (gradient steps, an option: `local_epochs`);
- layer.py: the per-MLP pieces the methods call (MLP inputs, second moments, refit of a module, whitened SVD of a site).

Methods use these through their own entry points: `fuse(..., calib_data=...)`, `nest(..., calib_data=...)`."""

# The default calibration: 256 blocks of 128 tokens (32,768) of the corpus's train split. On SmolLM2 (half-width
# neuron pruning of 20 layers) 2k / 8k / 32k / 128k tokens gave 66.0 / 57.2 / 53.5 / 53.5: stable from 32k
# (docs/calibration.md); a calibrated compression costs about four times the 8k one's time.
CALIB_BLOCKS = 256
CALIB_LEN = 128

from .obs import OBSPath, obs_prune
from .refit import refit_down
from .sequential import sequential
from .whiten import truncation_error, whitened_factors, whitening

__all__ = ["CALIB_BLOCKS", "CALIB_LEN", "OBSPath", "obs_prune", "refit_down", "sequential", "truncation_error",
           "whitened_factors", "whitening"]
