"""Issue 45, tried in session 34: the refit's target taken from the original model's stream while its features come
from the compressed model's (GPTAQ's "asymmetric calibration", Li et al. 2025, for quantisation): the down projection
is fitted so that the narrowed MLP on the drifted rows x gives what the original MLP gives on the original's rows
x_ref at the same place. MODE=asym: target MLP(x_ref); MODE=blend with ALPHA=a: MLP(x) + a (x_ref + MLP(x_ref) - x -
MLP(x)) (a = 1 is `--calibration corrective`, a = 0 the default sequential target). Patches the library in this
process and runs the CLI with the arguments given:

    MODE=asym python benchmarks/notes/prototype_asym_target.py compare smollm2 --out runs/proto/asym \
        --methods neuron --budgets 0.5 --max-tokens 2048 --threads 2 --repeats 1 --no-models

Answer (docs/notes/calibration.md, session 34): MODE=asym 64.47 at half width against 53.86 with the sequential
target (and 61.99 / 57.21 for the corrective / sequential targets at 8k): worse; not built in."""
import importlib
import os
import sys

from mlpsurgery.methods.reconstruct.local import subblock_rows
from mlpsurgery.sites import find_sites

S = importlib.import_module("mlpsurgery.methods.reconstruct.sequential")  # the module (the package exports a function)
MODE = os.environ.get("MODE", "asym")
ALPHA = float(os.environ.get("ALPHA", "0.5"))
_orig = S.sequential


def sequential(model, blocks, layers, work, *args, reference=False, **kwargs):
    sites = find_sites(model)

    def wrapped(i, x, x_ref=None, y_ref=None):
        if x_ref is None:
            return work(i, x)
        if MODE == "asym":
            target = y_ref
        else:
            m = subblock_rows(sites.mlp[i], x)  # the layer is still the original here
            target = m + ALPHA * (x_ref + y_ref - x - m)
        return work(i, x, x, target)  # work fits to x_ref + y_ref - x, i.e. to `target`

    return _orig(model, blocks, layers, wrapped, *args, reference=True, **kwargs)


S.sequential = sequential
from mlpsurgery.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
