"""Issue 45, tried in session 31: NSN's multi-rank local tuning with the low ranks weighed more. Each rank's loss is
divided by its error before tuning to the power SETTING_POWER (reconstruct/local.py; 2, the default until session 31, makes every rank's
relative improvement count alike); with 1 a rank weighs in proportion to its error, so the low ranks, whose errors are
largest, pull harder -- the question is whether that closes NSN's gap to the fixed-rank SVD at 33% of the FLOPs
(134.11 against 112.16) without losing the top ranks.

    POWER=1 python benchmarks/notes/prototype_nsn_rank_weights.py compare smollm2 --out runs/proto/nsn-p1 \
        --methods nsn --budgets 0.75,0.5,0.33 --nsn-refit --local-epochs 8 --max-tokens 2048 --threads 2 --repeats 1 \
        --no-models
"""
import os
import sys

from mlpsurgery.cli import main
from mlpsurgery.methods.reconstruct import local

local.SETTING_POWER = float(os.environ.get("POWER", "1"))
sys.exit(main(sys.argv[1:]))
