"""Foundation commands: inspect, eval ppl / cost / acc, export, fetch, demo."""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import MLPSurgeryError
from ..report import human_bytes, human_count, plot_cost, table
from . import (check_max_memory, check_plot_path, command, device_of, draw, integer, layer_device, model_name,
               number, progress, stage)

MODEL_HELP = "a model folder, a .gguf file, a folder saved by mlpsurgery, 'smollm2' (default), 'minilm' or 'tiny:ARCH'"


def _load(args, task: str = "auto", **kw):
    from ..models import load_model

    # loading reads (or de-quantises, once) the weights and fingerprints them: seconds on a real model
    stage(args, f"loading {model_name(args.model)}")
    loaded = load_model(args.model, task=task, **kw)
    loaded.model.to(device_of(args))
    return loaded


# ---- inspect ----------------------------------------------------------------------------------------

def run_inspect(args) -> dict:
    from ..measure.cost import inspect

    loaded = _load(args)
    out = inspect(loaded.model, context=args.context)
    out["source"] = loaded.source
    return out


def render_inspect(r: dict) -> str:
    p, f = r["params"], r["flops_per_token"]
    lines = [
        f"{r['source']}",
        f"  {r['model_class']} (architecture {r['architecture']}): {r['layers']} layers, d={r['d']}, "
        f"MLP inner width {r['mlp_inner_width']} ({'gated' if r['gated_mlp'] else 'plain'}, {r['activation']}), "
        f"{r['heads']} heads in {r['kv_groups']} KV groups of {r['head_dim']}, vocab {r['vocab']}",
        "",
        table([{"part": k, "params": human_count(p[k]), "param share": f"{r['param_share'][k]:.1%}"}
               for k in ("embeddings", "attention", "mlp", "head", "other")]),
        f"total parameters {human_count(p['total'])}",
        "",
        table([{"part": k, "FLOPs/token": human_count(f[k]), "share": f"{r['flop_share'][k]:.1%}"}
               for k in ("mlp", "attention_proj", "attention_scores", "head")]),
        f"forward FLOPs per token at context {f['context']}: {human_count(f['total'])}",
        "",
        table(r["sites"]),
    ]
    return "\n".join(lines)


# ---- eval ppl ---------------------------------------------------------------------------------------

def run_ppl(args) -> dict:
    from ..data import default_bos, load_corpus
    from ..measure.memory import peak_rss
    from ..measure.perplexity import default_block_len, is_causal_lm, perplexity, perplexity_layerwise
    from ..models import check_context

    check_max_memory(args)
    if args.layerwise:  # the checkpoint read one decoder layer at a time (layerwise.LayerStream.outputs)
        from ..layerwise import LayerStream
        from ..models import _tokenizer, checkpoint_folder, working_dtype

        folder, source, _ = checkpoint_folder(args.model)
        stage(args, f"reading the parts of {model_name(args.model)} outside its layers")
        stream = LayerStream(folder, dtype=working_dtype(), device=layer_device(args), max_memory_gb=args.max_memory)
        model, tok = stream.model, _tokenizer(folder)
        if tok is None:
            raise MLPSurgeryError(f"{folder} has no tokenizer, which the text needs; add its tokenizer files")
    else:
        loaded = _load(args)
        model, source = loaded.model, loaded.source
    # what can be refused is refused before the seconds of tokenising a corpus, not after
    if not is_causal_lm(model):
        raise MLPSurgeryError(f"perplexity needs a causal language model; {type(model).__name__} is not one "
                              "(for encoders use `mlpsurgery eval acc`)")
    block = args.block_len or default_block_len(model)
    check_context(model, block)
    if not args.layerwise:
        tok = loaded.require_tokenizer()
    bos = {"auto": default_bos(tok), "off": None, "on": tok.bos_token_id}[args.bos]  # auto: as corpus.bos
    if args.bos == "on" and bos is None:
        raise MLPSurgeryError("--bos on: the tokenizer has no BOS token; use --bos auto or off")
    span = block - 1 if bos is not None else block  # the window's text tokens (perplexity checks it again)
    if args.stride is not None and args.stride >= span:
        raise MLPSurgeryError(f"stride must be in 1..{span - 1} (the window's text tokens minus one), not "
                              f"{args.stride}")
    stage(args, f"reading and tokenising {args.data or 'austen'}")
    corpus = load_corpus(args.data, tok)
    t0 = time.perf_counter()
    measure = perplexity_layerwise if args.layerwise else perplexity
    spill = None
    if args.layerwise and args.max_memory is not None:  # the windows' hidden states past the cap: in a temporary
        import tempfile                                 # folder under $TMPDIR, made only now (nothing left behind)

        spill = tempfile.TemporaryDirectory(prefix="mlpsurgery-ppl-")
        stream.spill_dir = Path(spill.name)
    try:
        res = measure(stream if args.layerwise else model, corpus.sequences(args.split), block_len=block,
                      stride=args.stride, batch_size=args.batch_size, max_tokens=args.max_tokens,
                      progress=progress(args), bos_id=bos)
    finally:
        if spill is not None:
            spill.cleanup()
    out = res.as_dict()
    out.update(model=source, data=corpus.source, split=args.split, split_rule=corpus.split,
               documents=corpus.heldout_names if args.split == "heldout" else corpus.train_names,
               seconds=time.perf_counter() - t0, layerwise=args.layerwise, peak_rss_bytes=peak_rss())
    if args.layerwise:
        out["device"] = str(stream.device)
        out["activations_on_disk"] = stream.disk
    return out


def render_ppl(r: dict) -> str:
    p = r["protocol"]
    return (f"perplexity {r['ppl']:.3f} (NLL {r['nll']:.4f} nats/token) over {r['tokens']} tokens\n"
            f"  model {r['model']}\n  data {r['data']}, {r['split']} split: {', '.join(r['documents'][:6])}"
            f"{' ...' if len(r['documents']) > 6 else ''} ({r['split_rule']})\n"
            f"  protocol: windows of {p['block_len']} tokens every {p['stride']}, {p['scored']}; BOS {p['bos']}"
            f"\n  {r['seconds']:.1f} s" + (f", one decoder layer in memory at a time (on {r['device']})"
                                           if r.get("layerwise") else ""))


# ---- eval cost --------------------------------------------------------------------------------------

def run_cost(args) -> dict:
    import torch

    from ..io import check_source, source_spec
    from ..measure.cost import batch_bytes, compare_cost, measure_cost
    from ..models import load_model
    from ..resources import check_memory

    from ..models import check_context

    check_plot_path(args.plot, inputs=[args.model, args.baseline])
    what = f"a batch of {args.batch_size} x {args.seq_len} tokens (--batch-size x --seq-len)"
    fix = "lower --batch-size or --seq-len"
    check_memory(batch_bytes(args.batch_size, args.seq_len), what, fix)  # its token ids, before the model loads
    loaded = _load(args)
    model = loaded.model
    check_context(model, args.seq_len, "--seq-len")
    check_memory(batch_bytes(args.batch_size, args.seq_len, model), what, fix, device=device_of(args))
    baseline = args.baseline or source_spec(model)
    vocab = getattr(model.config, "vocab_size", 256)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=g)
    kw = dict(repeats=args.repeats, memory=not args.no_memory, progress=progress(args))
    if baseline:
        stage(args, f"loading the reference {baseline}")
        base = load_model(baseline).model.to(device_of(args))
        if not args.baseline:
            check_source(model, base, baseline)
        res = compare_cost(base, model, batch, **kw)
        res["reference_model"] = baseline
    else:
        res = {"candidate": measure_cost(model, batch, **kw).as_dict(), "reference": None, "ratio": None}
    res["model"] = loaded.source
    if args.plot:
        title = f"{loaded.source}" + (f" vs {baseline}" if baseline else "") + \
            f", batch {args.batch_size} x {args.seq_len} on {res['candidate']['device']}"
        res["plot"] = draw("cost", lambda: plot_cost(res, args.plot, title=title))
    return res


def render_cost(r: dict) -> str:
    keys = [("forward_s", "inference forward (s)"), ("forward_peak_bytes", "inference peak memory"),
            ("train_forward_s", "train forward (s)"), ("backward_s", "backward (s)"), ("step_s", "train step (s)"),
            ("step_peak_bytes", "train step peak memory"), ("backward_forward_ratio", "backward / forward")]
    rows = []
    for k, label in keys:
        row = {"measure": label}
        for side in ("reference", "candidate"):
            v = (r.get(side) or {}).get(k)
            row[side] = human_bytes(v) if "bytes" in k else (f"{v:.4g}" if v is not None else "-")
        row["ratio"] = f"{r['ratio'][k]:.3f}" if r.get("ratio") and r["ratio"].get(k) is not None else "-"
        rows.append(row)
    head = f"cost of {r['model']}" + (f" vs {r['reference_model']}" if r.get("reference_model") else "")
    c = r["candidate"]
    plot = f"\nplot: {r['plot']}" if r.get("plot") else ""
    return f"{head} on {c['device']}, batch {c['batch']}\n" + table(rows) + plot


# ---- eval acc ---------------------------------------------------------------------------------------

def run_acc(args) -> dict:
    from ..data import read_labelled
    from ..measure.accuracy import accuracy, probe_accuracy
    from ..models import check_context

    loaded = _load(args)
    check_context(loaded.model, args.max_len, "--max-len")
    stage(args, f"reading the labelled sets {args.train} and {args.test}")
    train = read_labelled(args.train)
    test = read_labelled(args.test, classes=train.classes)
    if args.max_train and len(train) > args.max_train:
        train = train.sample(args.max_train, seed=0)
    if args.max_test and len(test) > args.max_test:
        test = test.sample(args.max_test, seed=0)
    if type(loaded.model).__name__.endswith("ForSequenceClassification"):
        acc = accuracy(loaded.model, loaded.require_tokenizer(), test, max_len=args.max_len, progress=progress(args))
        res = {"accuracy": acc, "n_test": len(test), "method": "the model's classification head"}
    else:
        # embeddings of the train and test texts (a bar each), then the probe's fit (a few seconds, no bar)
        stage(args, f"linear probe: embedding {len(train)} training and {len(test)} test texts, then fitting")
        res = probe_accuracy(loaded.model, loaded.require_tokenizer(), train, test, max_len=args.max_len,
                             progress=progress(args))
    res.update(model=loaded.source, train=args.train, test=args.test, chance=1 / test.num_classes)
    return res


def render_acc(r: dict) -> str:
    return (f"accuracy {r['accuracy']:.4f} on {r['n_test']} test examples of {r['test']} (chance {r['chance']:.3f})\n"
            f"  {r['method']}; model {r['model']}")


# ---- export / fetch ---------------------------------------------------------------------------------

def run_export(args) -> dict:
    from ..io import export

    # one call that loads, checks, folds every replaced module into stock layers and writes: no bar inside
    stage(args, f"exporting {args.dir}: loading it, folding its modules into stock layers, writing {args.out}")
    out = export(args.dir, args.out, overwrite=args.overwrite)
    return {"exported": str(out), "from": args.dir}


def run_fetch(args) -> dict:
    from ..models import fetch

    return fetch(progress=progress(args))


# ---- demo -------------------------------------------------------------------------------------------

def run_demo(args) -> dict:
    """The main job on the bundled default: all five methods at a small budget, each measured on held-out text
    and loaded back in stock transformers (see mlpsurgery/demo.py)."""
    from ..demo import run

    return run(args.model, out=args.out, tokens=args.max_tokens, keep_models=args.keep_models,
               progress=not (args.quiet or args.json))


def render_demo(r: dict) -> str:
    from ..demo import table_rows

    h = r["heldout"]
    return "\n".join([
        f"mlpsurgery demo on {r['model']}: held-out perplexity on {h['tokens']} tokens of "
        f"{', '.join(h['documents'])} (never trained on here)",
        table(table_rows(r)),
        "every folder loaded with transformers' AutoModelForCausalLM.from_pretrained (trust_remote_code=True where "
        "the folder carries generated modeling code); max |dlogit| vs mlpsurgery.load shown above",
        f"table and figure: {r['out']}/summary.md, {r['figure']} ({r['seconds']:.0f} s)",
    ])


def register(sub, groups) -> None:
    p = command(sub, "inspect", run_inspect, render_inspect,
                "architecture, sites, MLP inner width, and the parameter / FLOP shares of MLPs, attention, embeddings")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--context", type=integer(1), default=512, help="sequence length for attention-score FLOPs (512)")

    p = command(groups["eval"], "ppl", run_ppl, render_ppl, "token-level perplexity on held-out (or training) text")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--data", help="text file, folder of .txt, or a bundled corpus: austen (default), r8")
    p.add_argument("--split", choices=("heldout", "train"), default="heldout",
                   help="score the held-out text (default) or the training text")
    p.add_argument("--block-len", type=integer(2), help="window length in tokens (512, or the model's context if shorter)")
    p.add_argument("--stride", type=integer(1), help="window stride (default: block length - 1: windows share one token of context)")
    p.add_argument("--batch-size", type=integer(1), default=4, help="windows per forward pass (4)")
    p.add_argument("--max-tokens", type=integer(1), help="score at most this many tokens (default: all)")
    p.add_argument("--bos", choices=("auto", "on", "off"), default="auto",
                   help="prepend BOS to every window: auto (default) does what the tokenizer does by default")
    p.add_argument("--layerwise", action="store_true",
                   help="read the checkpoint's safetensors files one decoder layer at a time, each run on --device: "
                        "memory of one layer plus the embeddings, head and the windows' hidden states (in host "
                        "memory); the same perplexity")
    p.add_argument("--max-memory", type=number(0), metavar="GB",
                   help="with --layerwise: keep the windows' hidden states in a temporary folder ($TMPDIR, removed "
                        "after) when they and one layer would pass this many GiB (refused if one layer alone does "
                        "not fit)")

    p = command(groups["eval"], "cost", run_cost, render_cost,
                "wall time and peak memory of inference and of one training step; ratios against a baseline")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--baseline", help="reference model (default: the model a saved folder was made from, when that "
                                      "is a bundled or tiny model)")
    p.add_argument("--batch-size", type=integer(1), default=2, help="sequences per timed batch (2)")
    p.add_argument("--seq-len", type=integer(1), default=128, help="tokens per timed sequence (128)")
    p.add_argument("--repeats", type=integer(1), default=3, help="timed repeats, the median reported (3)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory passes")
    p.add_argument("--plot", metavar="PNG", help="also draw the time and peak-memory bars, reference beside candidate, "
                   "to this file (none by default: eval commands write no files unless asked)")

    p = command(groups["eval"], "acc", run_acc, render_acc,
                "classification accuracy: the model's head, or a linear probe on its embeddings")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--train", default="r8-train", help="labelled training set (.tab/.csv/.jsonl or r8-train)")
    p.add_argument("--test", default="r8-test", help="labelled test set (.tab/.csv/.jsonl or r8-test)")
    p.add_argument("--max-train", type=integer(1), default=2000, help="training examples used at most (2000)")
    p.add_argument("--max-test", type=integer(1), default=1000, help="test examples scored at most (1000)")
    p.add_argument("--max-len", type=integer(2), default=128, help="tokens per text, truncated (128)")

    p = command(sub, "export", run_export, lambda r: f"wrote {r['exported']} (loads with transformers' from_pretrained)",
                "write a plain transformers folder, where the structure allows")
    p.add_argument("dir", help="a folder saved by mlpsurgery")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a folder mlpsurgery wrote (never one it did not write)")

    command(sub, "fetch", run_fetch, lambda r: "\n".join(f"{k}: {v}" for k, v in r.items()),
            "cache the bundled models (SmolLM2 de-quantised to safetensors; MiniLM located)")

    p = command(sub, "demo", run_demo, render_demo,
                "the main job on the bundled default: all five methods on SmolLM2 at a small budget, measured on "
                "held-out text, every folder loaded back in stock transformers")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--out", default="mlpsurgery-demo",
                   help="folder for the table and figure (mlpsurgery-demo; a previous demo's folder is replaced)")
    p.add_argument("--max-tokens", type=integer(64), default=1024, help="held-out tokens scored per model (1024)")
    p.add_argument("--keep-models", action="store_true",
                   help="keep the written model folders in OUT/models (about 0.5 GB each for SmolLM2)")
