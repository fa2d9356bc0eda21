"""Does the data-aware compression hold on other text than the Austen it is tuned on, and does a model calibrated on
one text keep its quality on another? (issue 45: "works on other models and texts than SmolLM2 and Austen")

SmolLM2's MLPs of the last two thirds of the layers compressed to half width, one shot (no gradient step), each
method calibrated on 32k training tokens (256 x 128, seed 0) of one corpus, then scored on the held-out text of every
corpus (--tokens tokens each, windows of 512):
- austen: the bundled novels, Persuasion held out;
- r8: the bundled Reuters news articles (lower-cased, no punctuation: the R8 preprocessing), every 10th held out;
- tweets: ../shared/data/labelled/election-tweets-2016.tab (or --tweets), one document per tweet, every 10th held out,
  the short ones joined with EOS for calibration;
- self: 256 x 128 tokens sampled from the model itself (temperature 1, from BOS), the data-free calibration of
  LLM-QAT (Liu et al. 2023) -- no text of any domain;
- mixes (--mixes): equal shares of the calibration blocks from each named corpus's training split (self: the
  first of the sampled blocks);
- default: what `fuse` / `nest` calibrate on when no text is named (data/sampled.py: a third sampled from the
  model, a third each of the bundled Austen and R8 training articles), its sampling and reading time recorded.
Every result is cached in OUT/results.json (a rerun resumes; other settings are refused).

    python benchmarks/cross_corpus.py --out runs/cross-corpus --json docs/results/cross-corpus-smollm2.json \\
        --md docs/results/cross-corpus-smollm2.md
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import harness


def main() -> None:
    ap = harness.parser(__doc__, summary=True, json=True, md=True, threads=2)
    ap.add_argument("--out", default="runs/cross-corpus")
    ap.add_argument("--methods", default="neuron,fusion,svd", help="fuse methods (neuron,fusion,svd)")
    ap.add_argument("--width", type=int, default=768, help="MLP width kept (768: half)")
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored per corpus (2048)")
    ap.add_argument("--calib-blocks", type=int, default=256, help="calibration blocks of 128 tokens (256: 32k)")
    ap.add_argument("--tweets", default=str(harness.ROOT.parent / "shared/data/labelled/election-tweets-2016.tab"))
    ap.add_argument("--mixes", default="austen+r8,austen+r8+tweets,self+austen+r8",
                    help="calibration mixes: equal shares of blocks from each named corpus's training split")
    ap.add_argument("--mix-methods", default="neuron", help="methods also calibrated on each mix (neuron)")
    ap.add_argument("--no-default", dest="default_calib", action="store_false",
                    help="skip the calibration fuse and nest use when no text is named (self+austen+r8-train)")
    ap.add_argument("--no-self", dest="self_calib", action="store_false",
                    help="skip the calibration on text sampled from the model itself")
    args = ap.parse_args()
    harness.set_threads(args.threads, tokenizers_parallelism=False)

    import torch

    import mlpsurgery as ms
    from mlpsurgery.methods.fusion import FusionConfig, fuse

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_path = out / "results.json"
    settings = {k: getattr(args, k) for k in ("width", "tokens", "calib_blocks")}
    data = json.loads(cache_path.read_text()) if cache_path.exists() else {"settings": settings, "results": {}}
    if data["settings"] != settings:
        raise SystemExit(f"{out} holds results made with {data['settings']}, not {settings}: use another --out")
    results = data["results"]

    loaded = ms.load_model()
    model, tok = loaded.model, loaded.tokenizer
    corpora = {"austen": ms.load_corpus(None, tok), "r8": ms.load_corpus("r8", tok),
               "tweets": ms.load_corpus(args.tweets, tok)}

    def scores(m) -> dict:
        return {name: ms.perplexity(m, c.heldout, block_len=512, max_tokens=args.tokens, progress=False,
                                    bos_id=c.bos).ppl for name, c in corpora.items()}

    def get(key: str, fn):
        if key not in results:
            results[key] = fn()
            cache_path.write_text(json.dumps(data, indent=1) + "\n")
            print(key, {k: round(v, 2) if isinstance(v, float) else v for k, v in results[key].items()}, flush=True)
        return results[key]

    get("original", lambda: {"ppl": scores(model)})

    def build(method: str, make_calib, **extra) -> dict:
        """The original's copy compressed by `method` on the blocks make_calib() returns, scored on every corpus."""
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        calib = make_calib()
        t1 = time.perf_counter()
        fuse(m, FusionConfig(width=args.width, method=method), progress=False, calib_data=calib)
        return {"ppl": scores(m), "build_s": time.perf_counter() - t1, "calib_s": t1 - t0,
                "calib_tokens": int(calib.numel()), **extra}

    def sampled() -> torch.Tensor:
        path = out / "self-blocks.pt"
        if not path.exists():
            t0 = time.perf_counter()
            torch.save(self_blocks(model, tok, args.calib_blocks, 128, seed=0), path)
            print(f"sampled {args.calib_blocks} x 128 tokens from the model in {time.perf_counter() - t0:.0f} s")
        return torch.load(path)

    mix_methods = [m for m in args.mix_methods.split(",") if m]
    for method in args.methods.split(","):
        for name, c in corpora.items():
            get(f"{method}/{name}", lambda: build(method, lambda: c.blocks("train", 128, max_blocks=args.calib_blocks,
                                                                            seed=0)))
    if args.self_calib:
        for method in mix_methods:
            get(f"{method}/self", lambda: build(method, sampled))
    if args.default_calib:  # what fuse and nest use when no text is named: the library's own blocks
        from mlpsurgery.data.sampled import DEFAULT_MIX, calibration_blocks

        for method in mix_methods:
            get(f"{method}/default", lambda: build(method, lambda: calibration_blocks(None, model, tok, 128,
                                                                                      args.calib_blocks, seed=0),
                                                   spec=DEFAULT_MIX))
    for mix in filter(None, args.mixes.split(",")):
        parts = mix.split("+")
        share = args.calib_blocks // len(parts)
        for method in mix_methods:
            get(f"{method}/{mix}", lambda: build(method, lambda: torch.cat([
                sampled()[:share] if p == "self" else corpora[p].blocks("train", 128, max_blocks=share, seed=0)
                for p in parts])))

    result = {"model": loaded.source, "machine": harness.machine(), "width": args.width, "tokens": args.tokens,
              "corpora": {name: c.split for name, c in corpora.items()}, "results": results}
    if args.json:
        harness.write_json(args.json, result)
    text = markdown(result, args)
    if args.md:
        harness.write_md(args.md, text)
    print(text)


def self_blocks(model, tok, n: int, length: int, seed: int, batch: int = 32):
    """(n, length) token blocks sampled from the model itself (temperature 1, no top-k / top-p), each from the
    tokenizer's BOS (else EOS), the end of text suppressed so that every block is full."""
    import torch

    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    torch.manual_seed(seed)
    out = []
    with torch.no_grad():
        for b in range(0, n, batch):
            ids = torch.full((min(batch, n - b), 1), start, dtype=torch.long)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                 top_p=1.0, temperature=1.0, max_new_tokens=length, min_new_tokens=length,
                                 pad_token_id=tok.eos_token_id)
            out.append(gen[:, 1:length + 1])
    return torch.cat(out)


def markdown(r: dict, args) -> str:
    res, names = r["results"], list(r["corpora"])
    orig = res["original"]["ppl"]
    lines = [f"SmolLM2's MLPs in the last two thirds of the layers at width {r['width']} (half), one shot, calibrated on "
             f"32k tokens of one corpus (rows), held-out perplexity on {r['tokens']} tokens of each corpus (columns) "
             f"and its ratio to the original's. {r['machine']}. `python benchmarks/cross_corpus.py`.", "",
             "| method | calibrated on | " + " | ".join(f"{n} (original {orig[n]:.2f})" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    mixes = [m for m in args.mixes.split(",") if m]
    for method in dict.fromkeys(args.methods.split(",") + args.mix_methods.split(",")):
        for cal in names + ["self"] + mixes + ["default"]:
            row = res.get(f"{method}/{cal}")
            if row is None:
                continue
            cells = []
            for n in names:
                cell = f"{row['ppl'][n]:.2f} ({row['ppl'][n] / orig[n]:.2f}x)"
                cells.append(f"**{cell}**" if n == cal else cell)
            lines.append(f"| {method} | {cal} | " + " | ".join(cells) + " |")
    lines += ["", "Bold: scored on the held-out text of the corpus it was calibrated on. A mix A+B: equal shares of "
              "the 256 calibration blocks from each corpus's training split. Held-out rules: "
              + "; ".join(f"{n}: {s}" for n, s in r["corpora"].items()) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
