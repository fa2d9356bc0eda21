"""Issue 45, session 29: the ridge of NSN's down refit (`nest --refit`, methods/nsn/local.py NSN_REFIT_RIDGE) and its
weighting of the ranks (NSN_REFIT_WEIGH). Sets them from RIDGE and WEIGH (1 / 0) in this process and runs the CLI
with the arguments given:

    WEIGH=0 RIDGE=1e-3 python benchmarks/notes/nsn_refit_ridge.py compare smollm2 --out runs/proto/nsn-refit-r3 \
        --methods nsn --budgets 0.75,0.5,0.33 --nsn-refit --max-tokens 2048 --threads 2 --repeats 1 --no-models

Answer (docs/notes/nsn.md), rows alike (WEIGH=0): 1e-3 (the refit's default elsewhere) 58.98 / 84.41 / 139.93, 1e-4 57.81 / 83.04 / 135.60,
1e-5 57.61 / 82.53 / 138.63 at 0.75 / 0.5 / 0.33 of the MLP FLOPs; 1e-4 kept."""
import os
import sys

from mlpsurgery.methods.nsn import local

local.NSN_REFIT_RIDGE = float(os.environ.get("RIDGE", local.NSN_REFIT_RIDGE))
local.NSN_REFIT_WEIGH = os.environ.get("WEIGH", "1") == "1"
if __name__ == "__main__":
    from mlpsurgery.cli import main

    sys.exit(main(sys.argv[1:]))
