"""`mlpsurgery eval lm`: lm-evaluation-harness on any model mlpsurgery loads, with local tasks only."""

from __future__ import annotations

import json
import time

from ..errors import MLPSurgeryError
from ..report import table
from . import command, integer
from .core import MODEL_HELP

TASKS_HELP = ("comma-separated tasks: corpus (rolling log-likelihood of --data), r8 (zero-shot Reuters topic, multiple "
              "choice), and names from --include-path (default: corpus,r8)")


def _inputs(args) -> list:
    """What an output must not be, hold or lie inside: the model folder, the data, a task folder."""
    from ..data import split_spec

    out = [args.model, args.include_path]
    if args.data:
        out.append(split_spec(args.data)[0])
    return out


def run_lm(args) -> dict:
    from ..files import atomic_dir, check_file_out, write_text
    from ..measure import lmeval as L

    names = L.resolve_tasks(args.tasks.split(","), args.include_path)
    if args.out:
        check_file_out(args.out, args.overwrite, _inputs(args), what="--out file")
    if args.agreement and L.CORPUS_TASK not in names:
        raise MLPSurgeryError("--agreement compares the corpus task with `eval ppl`: add corpus to --tasks")
    if args.write_tasks:
        # the task folder needs a tokenizer only where the corpus is cut by tokens; then MODEL must be named
        loaded = _load(args) if args.model else None
        docs, why = L.corpus_documents(args.data, loaded.require_tokenizer() if loaded else None, args.split,
                                       args.text_col)
        with atomic_dir(args.write_tasks, args.overwrite, _inputs(args), kind="lm-eval tasks") as tmp:
            written = L.write_tasks(tmp, docs, _note(args, why, docs), final=args.write_tasks)
        return {"wrote_tasks": str(args.write_tasks), "tasks": written, "documents": [d.name for d in docs][:50],
                "split_rule": why}
    L.require_lm_eval()  # before a model is loaded: say at once when the extra is missing
    loaded = _load(args)
    tok = loaded.require_tokenizer()
    docs, why = (None, "")
    if L.CORPUS_TASK in names:
        docs, why = L.corpus_documents(args.data, tok, args.split, args.text_col)
    max_length = args.max_length or _default_max_length(loaded.model)
    t0 = time.perf_counter()
    res = L.evaluate(loaded.model, tok, names, docs, _note(args, why, docs or []), include_path=args.include_path,
                     limit=args.limit, max_length=max_length, batch_size=args.batch_size,
                     num_fewshot=args.num_fewshot, progress=not args.quiet, verbose=args.verbose)
    results = res["results"]
    out = {"model": loaded.source, "tasks": _metrics(results), "token_perplexity": res["token_perplexity"],
           "settings": res["settings"], "seconds": res["seconds"]}
    if docs is not None:
        out["corpus"] = {"data": args.data or "austen", "split": args.split, "split_rule": why,
                         "documents": [d.name for d in docs][:50], "n_documents": len(docs)}
    if args.agreement:
        out["agreement"] = L.rolling_agreement(loaded.model, tok, docs if args.limit is None else docs[:args.limit],
                                               max_length, batch_size=args.batch_size, progress=not args.quiet,
                                               lm_eval_result=res["token_perplexity"][L.CORPUS_TASK])
    if args.out:
        from lm_eval.utils import handle_non_serializable

        from ..files import SIGNATURE

        # signed first, so that a later --overwrite may replace this file and no other (files.file_is_ours)
        write_text(args.out, json.dumps({"created_by": f"mlpsurgery {SIGNATURE}", **results}, indent=2,
                                        default=handle_non_serializable, ensure_ascii=False))
        out["out"] = str(args.out)
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def _load(args):
    from .core import _load as load

    return load(args)


def _default_max_length(model) -> int:
    # `eval ppl`'s default block (512, or the model's context) minus one: lm-eval's windows of L inputs score L tokens,
    # ours of L + 1 tokens score L (the last input only closes the window), so both give every token <= L of context
    from ..measure.perplexity import default_block_len

    return default_block_len(model) - 1


def _note(args, why: str, docs) -> str:
    return f"data {args.data or 'austen'}, {args.split} split, {len(docs)} documents; {why}"


def _metrics(results: dict) -> dict:
    """{task: {metric: value, metric_stderr: value, n: samples}} from lm-eval's results (filter 'none' dropped)."""
    out = {}
    for task, row in results.get("results", {}).items():
        m = {}
        for key, v in row.items():
            if "," not in key:
                continue
            name, _filter = key.split(",", 1)
            m[name] = v
        m["n"] = results.get("n-samples", {}).get(task, {}).get("effective")
        out[task] = m
    return out


def _num(v):
    if not isinstance(v, float):
        return v
    return f"{v:.4f}" if abs(v) < 1e6 else f"{v:.4e}"  # a random model's word perplexity runs to 1e15


def render_lm(r: dict) -> str:
    if "wrote_tasks" in r:
        return (f"wrote lm-eval tasks {', '.join(r['tasks'])} to {r['wrote_tasks']} ({r['split_rule']})\n"
                f"  run them: lm_eval --model hf --model_args pretrained=MODEL_DIR,logits_cache=False "
                f"--include_path {r['wrote_tasks']} --tasks {','.join(r['tasks'])}")
    rows = []
    for task, m in r["tasks"].items():
        for name, v in m.items():
            if name.endswith("_stderr") or name == "n":
                continue
            err = m.get(f"{name}_stderr")
            rows.append({"task": task, "metric": name, "value": _num(v), "stderr": _num(err) if isinstance(err, float)
                         else "", "n": m.get("n")})
    lines = [f"lm-eval {r['settings']['lm_eval_version']} on {r['model']} (max_length {r['settings']['max_length']}, "
             f"batch {r['settings']['batch_size']}" + (f", limit {r['settings']['limit']}" if r['settings']['limit'] else "")
             + ")", table(rows)]
    for task, t in r["token_perplexity"].items():
        lines.append(f"{task}: token perplexity {t['token_perplexity']:.4f} over {t['tokens']} tokens of "
                     f"{t['documents']} documents (lm-eval's summed log-likelihood; every token of a document scored)")
    if "corpus" in r:
        c = r["corpus"]
        lines.append(f"  corpus {c['data']}, {c['split']} split: {c['split_rule']}")
    a = r.get("agreement")
    if a:
        lines.append(f"agreement with measure.perplexity on the same tokens (prefix token + document, windows of "
                     f"{a['matched']['block_len']}): {a['matched']['token_perplexity']:.4f}, relative difference "
                     f"{a['rel_diff_perplexity']:.1e}; `eval ppl --block-len {a['eval_ppl']['block_len']}` (first token "
                     f"unscored, BOS {a['eval_ppl']['bos']}): {a['eval_ppl']['token_perplexity']:.4f} over "
                     f"{a['eval_ppl']['tokens']} tokens ({a['rel_diff_eval_ppl']:.1e})")
    if r.get("out"):
        lines.append(f"lm-eval's results JSON: {r['out']}")
    lines.append(f"({r['seconds']:.1f} s in lm-eval)")
    return "\n".join(lines)


def register(sub, groups) -> None:
    p = command(groups["eval"], "lm", run_lm, render_lm,
                "lm-evaluation-harness on the model (local tasks: corpus perplexity, R8 topic multiple choice, your "
                "own YAML folder)")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--tasks", default="corpus,r8", help=TASKS_HELP)
    p.add_argument("--data", help="corpus of the corpus task: a text file, folder, table (.parquet/.jsonl/.csv/.tsv/.tab, "
                                  "datasets folder; PATH:text=COL) or austen (default: its held-out Persuasion)")
    p.add_argument("--split", choices=("heldout", "train"), default="heldout",
                   help="which part of --data the corpus task scores (the split `eval ppl` uses)")
    p.add_argument("--text-col", help="text column of a table --data (else text/content/sentence or the only string one)")
    p.add_argument("--include-path", help="a folder of your own lm-eval task YAMLs (their names go in --tasks)")
    p.add_argument("--limit", type=integer(1), help="at most this many examples per task (quick runs)")
    p.add_argument("--max-length", type=integer(2),
                   help="lm-eval's window of model inputs (default: eval ppl's block length - 1, i.e. 511)")
    p.add_argument("--batch-size", type=integer(1), default=4, help="requests per forward pass (4)")
    p.add_argument("--num-fewshot", type=integer(0), help="few-shot examples (default: each task's own; ours are 0-shot)")
    p.add_argument("--agreement", action="store_true",
                   help="also score the corpus with measure.perplexity on the same tokens and report the difference")
    p.add_argument("--out", help="write lm-eval's results JSON to this file")
    p.add_argument("--overwrite", action="store_true", help="replace --out / --write-tasks written before")
    p.add_argument("--write-tasks", metavar="DIR",
                   help="write the task YAMLs and their data to DIR (for the plain lm_eval command) and stop")
    p.add_argument("--verbose", action="store_true", help="show lm-eval's own log lines")
