"""Issue 45, session 33: the MLP refit's products within a chunk in float32 against float64 (`refit_stats` dtype; the
sums across chunks are float64 either way). SmolLM2, the demo's 8k calibration tokens, layers 10 / 20 / 28 / 29 at
half width (the 768 neurons of largest output energy), the refit's relative output error on the rows:

    python benchmarks/notes/refit_chunk_dtype.py
        # float64 and float32 give 0.0711598 / 0.0744196 / 0.000891924 / 0.00205682 alike; 0.70-0.80 s against
        # 0.58-0.68 s a layer (docs/notes/calibration.md)
"""
import time

import torch

from mlpsurgery.capture import capture_mlp_io
from mlpsurgery.data import load_corpus
from mlpsurgery.methods.fusion.compress import _importance
from mlpsurgery.methods.reconstruct.layer import mlp_inputs
from mlpsurgery.methods.reconstruct.refit import fit_error, refit_stats, solve_down
from mlpsurgery.models import load_model
from mlpsurgery.sites import find_sites


def main() -> None:
    torch.set_num_threads(2)
    loaded = load_model(None)
    model, tok = loaded.model, loaded.require_tokenizer()
    calib = load_corpus(None, tok).blocks("train", 128, max_blocks=64, seed=0)
    layers = [10, 20, 28, 29]
    cap = capture_mlp_io(model, calib, layers=layers, progress=False)
    sites = find_sites(model)
    for i in layers:
        w = sites.mlp[i].read()
        xin = mlp_inputs(sites.mlp[i], cap.layer(i)[0])
        keep = _importance(w, xin, "output").argsort(descending=True)[:w.h // 2].sort().values
        new = w.select(keep)
        exact = refit_stats(new, w, xin, dtype=torch.float64)  # the error of either fit, measured in float64
        for dtype in (torch.float64, torch.float32):
            t = time.perf_counter()
            stats = refit_stats(new, w, xin, dtype=dtype)
            seconds = time.perf_counter() - t
            D, b = solve_down(stats, False)
            print(f"layer {i} {dtype}: {seconds:.2f} s, error {fit_error(exact, D, b):.6g}", flush=True)


if __name__ == "__main__":
    main()
