"""How many training steps included each rank in the NSN runs of docs/nsn.md (the anchor every step, a lower
rank when the curriculum sampled it). The uncertainty objective moves a rank's log-variance s_k only on those
steps, so s_k read alone confounds "how well the rank fits" with "how often it was trained"; docs/nsn.md puts
these counts beside the learned values. The counts are a pure function of (ranks, steps, sampling, seed), so
they are computed here without training.

    python benchmarks/notes/nsn_update_counts.py
"""

import sys
from pathlib import Path

from mlpsurgery.methods.nsn import MultiRankObjective

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

RUNS = {  # name: (training ranks, steps, seeds) as benchmarks/nsn_minilm.py and nsn_fig4.py ran them
    "MiniLM post-hoc NSN (nsn_minilm.py --posthoc-steps 100, seed 1)": ((32, 64, 128, 256, 384), 100, [1]),
    "MiniLM NSN from pretrained (nsn_minilm.py --steps 200, seed 0)": ((32, 64, 128, 256, 384), 200, [0]),
    "R8 embedding MLP (nsn_fig4.py --steps 800, seeds 0-2, mean)": ((1, 2, 4, 8, 16, 32, 64), 800, [0, 1, 2]),
}


def main() -> None:
    harness.parser(__doc__).parse_args()
    for name, (ranks, steps, seeds) in RUNS.items():
        mean = {r: 0.0 for r in ranks}
        for seed in seeds:
            counts = MultiRankObjective(ranks, "uncertainty", "curriculum", 0.5, steps, seed).update_counts()
            for r, c in counts.items():
                mean[r] += c / len(seeds)
        print(f"{name}: " + ", ".join(f"{r}: {c:g}" for r, c in mean.items()))


if __name__ == "__main__":
    main()
