"""How much of a DLR-Lock phase-1 perplexity gap a few layers account for: held-out perplexity with every
phase-1 DLR-Net installed, and with the original MLP kept in chosen layers (the rest locked).

    python benchmarks/notes/dlr_keep_original.py runs/dlr/work-r64 --keep none 11,28 [--model smollm2] [--tokens 4096]

WORKDIR is a `mlpsurgery lock dlr --keep-work` folder with a finished phase 1; each value of --keep is
`none` or a comma-separated list of layers that keep their original MLP.
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_file

from mlpsurgery.data import load_corpus
from mlpsurgery.measure.perplexity import perplexity
from mlpsurgery.methods.dlr_lock import install
from mlpsurgery.models import load_model
from mlpsurgery.modules.dlr import StackedDLR
from mlpsurgery.report import table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("workdir")
    ap.add_argument("--keep", nargs="+", default=["none"], help="none, or layers (e.g. 11,28) left original")
    ap.add_argument("--model", default=None, help="the original model (default SmolLM2)")
    ap.add_argument("--data", default=None, help="corpus whose held-out part is scored (default: bundled Austen)")
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    work = Path(args.workdir)
    stage = work / "phase1.stage.json"
    if not harness.read_json(stage, missing={"done": False})["done"]:
        raise SystemExit(f"{work} has no finished phase 1; run `mlpsurgery lock dlr ... --workdir {work} --keep-work`")
    settings = harness.read_json(stage)["settings"]
    layers = settings["layers"]
    state = load_file(str(work / "phase1.safetensors"))
    rows, corpus, net = [], None, None
    for keep in args.keep:
        kept = [] if keep == "none" else [int(v) for v in keep.split(",")]
        loaded = load_model(args.model)  # afresh for each setting: install replaces the MLPs in place
        model = loaded.model
        if corpus is None:
            corpus = load_corpus(args.data, loaded.require_tokenizer())
            net = StackedDLR(len(layers), model.config.hidden_size, settings["rank"], settings["depth"], settings["eps"])
            net.load_state_dict(state)
        install(model, {i: net.unstack(j) for j, i in enumerate(layers) if i not in kept})
        ppl = perplexity(model, corpus.heldout, block_len=512, max_tokens=args.tokens, progress=False, bos_id=corpus.bos).ppl
        rows.append({"original MLP kept in layers": keep, "locked layers": len(layers) - len(kept),
                     "held-out perplexity": round(ppl, 1)})
        print(table(rows[-1:], markdown=True), flush=True)
    print(table(rows, markdown=True))


if __name__ == "__main__":
    main()
