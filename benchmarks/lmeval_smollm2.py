"""lm-evaluation-harness on SmolLM2-135M-Instruct through `mlpsurgery.measure.lmeval`, and its agreement with our
perplexity: the numbers in docs/lm-eval.md.

    python benchmarks/lmeval_smollm2.py [--chars 40000] [--r8-limit 80] [--out docs/results/lmeval-smollm2.json]

The corpus task scores the opening `--chars` characters of the held-out novel (Persuasion; cut at a paragraph
break), so that the run fits a few CPU-minutes; the whole novel is `mlpsurgery eval lm --tasks corpus` (116k tokens:
about 10 minutes per pass here, three passes with --agreement). The r8 task scores the first `--r8-limit` of the
286 bundled articles (lm-eval's own --limit; 8 choices each).
"""

from __future__ import annotations

import sys
import time

import torch

import harness
from mlpsurgery.data import Document, read_corpus
from mlpsurgery.measure import lmeval as L
from mlpsurgery.models import load_model


def main(argv=None) -> int:
    ap = harness.parser(__doc__, summary=True, threads=2)
    ap.add_argument("--chars", type=int, default=40000)
    ap.add_argument("--r8-limit", type=int, default=80)
    ap.add_argument("--max-length", type=int, default=511)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    harness.set_threads(args.threads)
    loaded = load_model("smollm2")
    novel = next(d for d in read_corpus("austen") if d.name == "austen_persuasion")
    cut = novel.text.rfind("\n\n", 0, args.chars)
    docs = [Document(novel.name, novel.text[: cut if cut > 0 else args.chars], "test")]
    t0 = time.perf_counter()
    corpus = L.evaluate(loaded.model, loaded.tokenizer, [L.CORPUS_TASK], docs, max_length=args.max_length,
                        progress=True)
    agreement = L.rolling_agreement(loaded.model, loaded.tokenizer, docs, args.max_length, progress=True,
                                    lm_eval_result=corpus["token_perplexity"][L.CORPUS_TASK])
    r8 = L.evaluate(loaded.model, loaded.tokenizer, [L.R8_TASK], limit=args.r8_limit, max_length=args.max_length,
                    progress=True)
    res = {
        "model": "SmolLM2-135M-Instruct", "machine": harness.machine("{arch} CPU, {threads} threads"),
        "torch": torch.__version__, "corpus_chars": len(docs[0].text),
        "corpus": corpus["results"]["results"][L.CORPUS_TASK], "corpus_seconds": corpus["seconds"],
        "agreement": agreement,
        "r8": r8["results"]["results"][L.R8_TASK], "r8_limit": args.r8_limit, "r8_seconds": r8["seconds"],
        "settings": corpus["settings"], "seconds": time.perf_counter() - t0,
    }
    if args.out:
        harness.write_json(args.out, res, default=str)
    a = agreement
    print(f"| corpus: opening of Persuasion, {a['lm_eval']['tokens']} tokens | lm-eval token perplexity "
          f"{a['lm_eval']['token_perplexity']:.4f} | matched perplexity() {a['matched']['token_perplexity']:.4f} "
          f"(|dLL| {a['abs_diff_loglikelihood']:.2e}) | eval ppl {a['eval_ppl']['token_perplexity']:.4f} |")
    print(f"| r8 (first {args.r8_limit}) | acc {res['r8'].get('acc,none')} | acc_norm {res['r8'].get('acc_norm,none')} |")
    print(f"total {res['seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
