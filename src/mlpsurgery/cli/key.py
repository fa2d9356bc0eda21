"""CoreLocker commands: `lock key` (extract an access key), `unlock` (restore with it), `attack key`
(fine-tuning and pruning attacks on a locked model). Passphrases come from $MLPSURGERY_PASSPHRASE or a
prompt, never from the command line."""

from __future__ import annotations

from ..errors import MLPSurgeryError
from ..report import human_bytes, table
from . import check_plot_path, command, draw, integer, layer_device, number, progress, stage
from .core import MODEL_HELP, _load

TASKS = ("auto", "causal-lm", "encoder", "classifier")


def _floats(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise MLPSurgeryError(f"{text!r} is not a comma-separated list of numbers, e.g. 0.05,0.1") from None


# ---- lock key ---------------------------------------------------------------------------------------

def run_lock(args) -> dict:
    from ..methods.corelocker import (CoreLockerConfig, check_lock_targets, default_utility, lock_folder,
                                      passphrase_from_user)
    from ..methods.corelocker.utility import TargetNotReached

    cfg = CoreLockerConfig(ratio=args.ratio if args.ratio is not None else 0.0, indicator=args.indicator,
                           unit=args.unit, scope=args.scope, include_io=args.include_io, seed=args.seed)
    cfg.validate()
    if args.layerwise:
        layer_device(args, on_device=False, what="lock key")
        return _lock_layerwise(args, cfg)
    # before the passphrase prompt and the model load: a bad --out / --key / --plot costs nothing and writes nothing
    check_lock_targets(args.out, args.key, args.overwrite, inputs=[args.model])
    check_plot_path(args.plot, inputs=[args.model, args.data])
    passphrase = passphrase_from_user(confirm=True) if args.encrypt else None
    loaded = _load(args, task=args.task)
    # a plot needs points: with --ratio, --plot measures the utility before and after as --measure does
    measure = args.target_utility is None and (args.measure or bool(args.plot))
    utility = None
    if args.target_utility is not None or measure:
        stage(args, "reading the calibration data")
        utility = default_utility(loaded.model, loaded.tokenizer, args.data, args.calib_size)
    title = f"CoreLocker {cfg.indicator} / {cfg.unit} on {loaded.source}"
    try:
        res = lock_folder(loaded.model, args.out, args.key, cfg, tokenizer=loaded.tokenizer, passphrase=passphrase,
                          target=args.target_utility, utility=utility, tolerance=args.tolerance,
                          max_ratio=args.max_ratio, measure=measure, overwrite=args.overwrite,
                          progress=progress(args), inputs=[args.model])
    except TargetNotReached as e:
        _plot_unreached(args, e, title, utility.chance)
        raise
    res["model"] = loaded.source
    _plot_result(args, res, cfg, title)
    return res


def _plot_unreached(args, e, title: str, chance) -> None:
    """The points a search evaluated before it gave up, into the error's details (and --plot): they show why the
    target is out of reach."""
    e.details = {"curve": e.curve}
    if args.plot:
        plot = draw("utility", lambda: _plot_lock(args.plot, e.curve, e.metric, title, e.original, e.target, chance))
        if plot:
            e.args = (f"{e}; the evaluated points are plotted in {plot}",)
            e.details["plot"] = plot


def _plot_result(args, res: dict, cfg, title: str) -> None:
    if args.plot:
        u = res["utility"]
        curve = res["search"]["curve"] if "search" in res else \
            [{"ratio": 0.0, u["metric"]: u["original"]}, {"ratio": cfg.ratio, u["metric"]: u["locked"]}]
        target = res["search"]["target"] if "search" in res else None
        res["plot"] = draw("utility", lambda: _plot_lock(args.plot, curve, u["metric"], title, u["original"], target,
                                                         u["chance"]))


def _lock_layerwise(args, cfg) -> dict:
    """`lock key --layerwise`: the checkpoint read one layer at a time (methods/corelocker/layerwise.py); with
    --target-utility (a causal LM) the ratio found first by bisection on the perplexity measured layer by layer."""
    import dataclasses

    from ..data import load_corpus
    from ..methods.corelocker import check_lock_targets, passphrase_from_user
    from ..methods.corelocker.layerwise import check_layerwise, find_ratio_layerwise, lock_layerwise
    from ..methods.corelocker.utility import TargetNotReached
    from ..models import _tokenizer, checkpoint_folder, working_dtype

    if args.measure or (args.plot and args.target_utility is None):
        raise MLPSurgeryError("--layerwise measures the model only to find a --target-utility (--measure, and --plot "
                              "without a target, run it whole): drop those, or drop --layerwise")
    if args.task != "auto":
        raise MLPSurgeryError("--layerwise locks the checkpoint's own class (--task auto): drop --task or --layerwise")
    check_layerwise(cfg)
    check_lock_targets(args.out, args.key, args.overwrite, inputs=[args.model])
    check_plot_path(args.plot, inputs=[args.model, args.data])
    folder, source, name = checkpoint_folder(args.model)
    tok = _tokenizer(folder)
    passphrase = passphrase_from_user(confirm=True) if args.encrypt else None
    search = None
    title = f"CoreLocker {cfg.indicator} / {cfg.unit} on {source}"
    if args.target_utility is not None:
        if tok is None:
            raise MLPSurgeryError(f"{folder} has no tokenizer, which the calibration text needs; add its tokenizer "
                                  "files")
        stage(args, "reading the calibration data")
        corpus = load_corpus(args.data, tok)
        try:
            search = find_ratio_layerwise(folder, cfg, corpus.heldout, args.target_utility, args.tolerance,
                                          max_ratio=args.max_ratio, dtype=working_dtype(),
                                          max_tokens=args.calib_size or 4096, bos_id=corpus.bos,
                                          progress=progress(args))
        except TargetNotReached as e:
            _plot_unreached(args, e, title, None)
            raise
        cfg = dataclasses.replace(cfg, ratio=search["ratio"])
    res = lock_layerwise(folder, args.out, args.key, cfg, dtype=working_dtype(), tokenizer=tok,
                         passphrase=passphrase, overwrite=args.overwrite, inputs=[args.model],
                         source_name=name, progress=progress(args))
    res["model"] = source
    if search is not None:
        res["search"] = {k: search[k] for k in ("ratio", "utility", "within_tolerance", "target", "tolerance",
                                                "curve")}
        res["utility"] = {"metric": "perplexity", "data": search["data"], "original": search["curve"][0]["perplexity"],
                          "locked": search["utility"], "chance": None}
        _plot_result(args, res, cfg, title)
    return res


def _plot_lock(path, curve: list[dict], metric: str, title: str, original: float, target: float | None,
               chance: float | None):
    from ..methods.corelocker import plot_curves

    return plot_curves({"locked model": curve}, metric, path, title=title, original=original, target=target,
                       chance=chance if metric.endswith("accuracy") else None, logy=metric == "perplexity")


def render_lock(r: dict) -> str:
    c = r["config"]
    lines = [f"locked {r['model']} into {r['locked']} (a plain transformers checkpoint; useless without the key)",
             f"  extracted {r['units_extracted']:,} of {r['units_eligible']:,} {c['unit']} units (ratio {c['ratio']:.6g}, "
             f"indicator {c['indicator']}, {c['scope']} ranking) = {r['entries']:,} weights",
             f"  key {r['key']}: {human_bytes(r['key_bytes'])} ({r['key_bytes']:,} bytes"
             + (f", {r['key_bytes'] / r['model_bytes']:.2%} of the {human_bytes(r['model_bytes'])} weights file"
                if r.get("model_bytes") else "") + "), readable by you only (0600)"
             + (", encrypted" if r["encrypted"] else ", NOT encrypted (anyone who reads it can unlock; --encrypt)")]
    u = r.get("utility")
    if u:
        chance = f" (chance {u['chance']:.3g})" if u.get("chance") and u["metric"].endswith("accuracy") else ""
        lines.append(f"  {u['metric']} on {u['data']}: original {u['original']:.4g} -> locked {u['locked']:.4g}{chance}")
    s = r.get("search")
    if s:
        state = "reached" if s["within_tolerance"] else "closest point to"
        lines.append(f"  {state} the target {s['target']:g} +- {s['tolerance']:.3g} at ratio {s['ratio']:.6g}; "
                     "evaluated ratio -> utility:")
        lines.append("    " + table(s["curve"]).replace("\n", "\n    "))
    if r.get("plot"):
        lines.append(f"  utility plotted to {r['plot']}")
    return "\n".join(lines)


# ---- unlock -----------------------------------------------------------------------------------------

def run_unlock(args) -> dict:
    from ..methods.corelocker import check_unlock_targets, is_sealed, passphrase_from_user, unlock_folder

    if args.layerwise:
        layer_device(args, on_device=False, what="unlock")
    check_unlock_targets(args.dir, args.key, args.out, args.overwrite)  # before asking for a passphrase
    passphrase = passphrase_from_user() if is_sealed(args.key) else None
    if args.layerwise:
        from ..methods.corelocker.layerwise import unlock_layerwise
        from ..models import working_dtype

        return unlock_layerwise(args.dir, args.key, args.out, passphrase=passphrase, dtype=working_dtype(),
                                overwrite=args.overwrite, progress=progress(args))
    return unlock_folder(args.dir, args.key, args.out, passphrase=passphrase, overwrite=args.overwrite,
                         progress=progress(args))


def render_unlock(r: dict) -> str:
    if r["check"] == "authenticated":
        check = ("key authenticated: it is sealed (AES-256-GCM) under your passphrase, so it is exactly the key that "
                 "was sealed")
    else:
        check = ("key consistent, not authenticated: a plain key carries checksums only, so it is intact and fits "
                 "this locked model, but whoever can edit it can recompute them (seal keys with `lock key --encrypt`)")
    cross = ("the original fingerprint is also the one the locked folder recorded at lock time" if r["cross_checked"]
             else "the locked folder records no original fingerprint (locked by an older mlpsurgery, or re-saved), so "
                  "the restored model was checked against the key's fingerprint only")
    return (f"unlocked {r['from']} with {r['key']} into {r['unlocked']}: {r['entries_restored']:,} weights restored; "
            f"every tensor matches the original model's fingerprint {r['original_fingerprint'][:16]}...\n"
            f"  {check}\n  {cross}")


# ---- attack key -------------------------------------------------------------------------------------

def run_attack(args) -> dict:
    from ..data import load_corpus, read_labelled
    from ..methods.corelocker import (attack_table, classifier_finetune, classifier_utility, lm_finetune,
                                      lm_utility)

    fractions, sparsities = _floats(args.finetune), _floats(args.prune)  # refused before the model loads
    bad = [x for x in fractions if not 0 < x <= 1] + [x for x in sparsities if not 0 <= x < 1]
    if bad:
        raise MLPSurgeryError(f"--finetune fractions must be in (0, 1] and --prune sparsities in [0, 1), not {bad}")
    loaded = _load(args, task=args.task)
    model, tok = loaded.model, loaded.require_tokenizer()
    show = progress(args)
    stage(args, "reading the attacker's training data and the evaluation data")
    if type(model).__name__.endswith("ForSequenceClassification"):
        train = read_labelled(args.data or "r8-train")
        test = read_labelled(args.eval_data or "r8-test", classes=train.classes)
        if args.eval_size and len(test) > args.eval_size:
            test = test.sample(args.eval_size, seed=0)
        utility = classifier_utility(tok, test, balanced=args.balanced)
        make_loss = classifier_finetune(tok, train, batch_size=args.batch_size, epochs=args.epochs)
    else:
        from ..models import check_context

        check_context(model, args.block_len)
        corpus = load_corpus(args.data, tok)
        utility = lm_utility(corpus.heldout, max_tokens=args.eval_size or 4096, bos_id=corpus.bos)
        make_loss = lm_finetune(corpus.blocks("train", args.block_len), batch_size=args.batch_size, epochs=args.epochs)
    res = attack_table(model, utility, make_loss, finetune=fractions, prune=sparsities,
                       trials=args.trials, lr=args.lr, progress=show)
    res["model"] = loaded.source
    return res


def render_attack(r: dict) -> str:
    m = r["metric"]
    rows = [{"attack": x["attack"], "setting": x["setting"], m: f"{x[m]:.4g}", "std": f"{x['std']:.3g}",
             "delta vs locked": f"{x['delta']:+.4g}"} for x in r["rows"]]
    return (f"attacks on {r['model']} ({m} on {r['data']}; locked: {r['locked']:.4g}; "
            f"{'higher' if r['higher_is_better'] else 'lower'} is better)\n" + table(rows))


def register(sub, groups) -> None:
    p = command(groups["lock"], "key", run_lock, render_lock,
                "CoreLocker: extract the most important weights as an access key; the locked folder is a plain "
                "transformers checkpoint that is useless without it")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--out", required=True, help="folder for the locked model (what you hand out)")
    p.add_argument("--key", required=True, help="file for the access key (keep it; never inside --out)")
    p.set_defaults(writes=("key",))  # --key is written here (an input of `unlock`): see cli.check_paths
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--ratio", type=number(0, 1, high_open=True), help="fraction of eligible units to extract, e.g. 0.05")
    how.add_argument("--target-utility", type=number(None),
                     help="extract just enough to bring the utility here (accuracy for a classifier, e.g. 0.5; "
                          "perplexity for a causal LM, e.g. 200), found by bisection on calibration data")
    p.add_argument("--indicator", choices=("l1", "scale", "random"), default="l1",
                   help="how units are ranked: |w| sums (l1), normalisation scale factors (scale), or at random (the "
                        "baseline) (l1)")
    p.add_argument("--unit", choices=("weight", "neuron", "head", "filter"), default="weight",
                   help="what is extracted: single weights, MLP neurons, attention heads, conv filters (weight)")
    p.add_argument("--scope", choices=("global", "layer"), default="global",
                   help="rank across all layers, or take the ratio in every layer (global)")
    p.add_argument("--include-io", action="store_true", help="also extract from the embeddings and the output layer")
    p.add_argument("--seed", type=integer(0, 2 ** 32 - 1), default=0, help="seed of the random indicator (0)")
    p.add_argument("--encrypt", action="store_true",
                   help="seal the key with a passphrase (AES-256-GCM, scrypt); read from $MLPSURGERY_PASSPHRASE "
                        "or a prompt")
    p.add_argument("--task", choices=TASKS, default="auto",
                   help="model head to load: auto (as saved / LM for decoders), classifier, causal-lm, encoder")
    p.add_argument("--data", help="calibration data: a labelled set for classifiers (r8-train), a corpus for LMs "
                                  "(austen, held-out split)")
    p.add_argument("--calib-size", type=integer(1), help="calibration examples (256) or held-out tokens (4096)")
    p.add_argument("--tolerance", type=number(0),
                   help="how close to the target counts as reached (0.025 accuracy; 5%% of a perplexity target)")
    p.add_argument("--max-ratio", type=number(0, 1, high_open=True), default=0.5, help="largest ratio the bisection may use (0.5)")
    p.add_argument("--measure", action="store_true", help="with --ratio: measure the utility before and after")
    p.add_argument("--plot", metavar="PNG",
                   help="draw utility against extraction ratio to this file: the points --target-utility evaluated "
                        "(also when the target cannot be reached), or with --ratio the original and the locked "
                        "model (implies --measure); never inside --out, which you hand out")
    p.add_argument("--layerwise", action="store_true",
                   help="read the checkpoint's safetensors one decoder layer at a time: memory of one layer and the "
                        "key, not the model (the same key and folder; weight units, --ratio; docs/memory.md)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder / --key file")

    p = command(sub, "unlock", run_unlock, render_unlock,
                "restore a CoreLocker-locked folder with its key, bit for bit (a wrong, truncated or tampered key, or "
                "a wrong passphrase, is refused and nothing is written)")
    p.add_argument("dir", help="the locked folder")
    p.add_argument("--key", required=True, help="the key file written by `mlpsurgery lock key`")
    p.add_argument("--out", required=True, help="folder for the restored model")
    p.add_argument("--layerwise", action="store_true",
                   help="read the locked folder one decoder layer at a time: memory of one layer and the key, not the "
                        "model (the same checks and result; docs/memory.md)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a folder mlpsurgery wrote (never one it did not write)")

    p = command(groups["attack"], "key", run_attack, render_attack,
                "attack a CoreLocker-locked model: fine-tune it on a fraction of the training data, prune it; "
                "report the utility recovered (the paper's Tables 2-3)")
    p.add_argument("model", nargs="?", help="the locked folder (or any MODEL)")
    p.add_argument("--task", choices=TASKS, default="auto", help="model head to load (auto: from the config)")
    p.add_argument("--finetune", default="0.05,0.1", help="fractions of the training data to fine-tune on (0.05,0.1)")
    p.add_argument("--prune", default="0.2,0.4", help="magnitude-pruning sparsities (0.2,0.4)")
    p.add_argument("--trials", type=integer(1), default=3, help="fine-tuning trials, each on a freshly drawn subset (3)")
    p.add_argument("--epochs", type=integer(1), default=3, help="passes over the fine-tuning subset (3)")
    p.add_argument("--batch-size", type=integer(1), default=16, help="fine-tuning batch size (16)")
    p.add_argument("--lr", type=number(0), default=5e-5, help="fine-tuning learning rate (5e-5)")
    p.add_argument("--block-len", type=integer(2), default=256, help="LM fine-tuning block length (256)")
    p.add_argument("--data", help="training data: labelled set (r8-train) or corpus (austen)")
    p.add_argument("--eval-data", help="labelled test set for classifiers (r8-test)")
    p.add_argument("--eval-size", type=integer(1), help="test examples (all) / held-out tokens for LMs (4096)")
    p.add_argument("--balanced", action="store_true", help="classifiers: balanced accuracy (mean per-class recall)")
