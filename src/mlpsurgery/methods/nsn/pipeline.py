"""NSN end-to-end jobs (what the CLI runs): nest and train a model, fix a rank, sweep a folder."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from torch import nn

from ...errors import MLPSurgeryError
from ...io import check_out
from ...io.provenance import history
from ...report import ends_stages, stage
from ..reconstruct import CALIB_BLOCKS, CALIB_LEN
from .surgery import NSNConfig, _require_nested, check_config, max_rank, nest, nest_layer, nested_linears
from .ranks import nested_flops, set_budget, set_rank
from .training import NSNTrainConfig, learned_log_variances, train_nsn, training_updates
from .analysis import classifier_metrics, sweep
from .export import fold, truncate
from .plots import plot_frontier


def _is_classifier(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def is_labelled(data: str | None) -> bool:
    from ...data import BUNDLED_LABELLED

    return data is not None and (data in BUNDLED_LABELLED or
                                 str(data).removesuffix(".gz").endswith((".tab", ".tsv", ".csv", ".jsonl")))


@ends_stages
def nest_model(model_spec: str | None, out: str | Path, cfg: NSNConfig, train: NSNTrainConfig | None = None,
               data: str | None = None, batch_size: int = 8, block_len: int = 128, max_len: int = 128,
               checkpoint_dir: str | Path | None = None, overwrite: bool = False, device: str = "cpu",
               progress: bool = True, calib_data: str | None = None, calib_blocks: int = CALIB_BLOCKS,
               calib_len: int = CALIB_LEN,
               data_free: bool = False, local_epochs: float = 0.0, local_lr: float | None = None,
               refit: bool = False) -> dict:
    """Load MODEL, nest it, train it with the multi-rank objective when train.fit.steps > 0 (language
    modelling on a corpus; classification on a labelled set, with a new head), save to `out`.

    The nested start is the whitened SVD on calib_blocks x calib_len tokens of calib_data (its train split; 'self'
    samples from the model; by default data/sampled.py's mix, Austen for an encoder; `nest(calib_data=...)`), or the
    plain SVD with data_free (the paper's B.2). local_epochs > 0: then each nested MLP tuned at every rank at once on
    its calibration rows, layer after layer (local.py). refit: the down projections refit at every rank (local.py).

    Checkpoints go to checkpoint_dir (default: `out` + ".ckpt" beside it) and are removed once the model is
    saved; rerunning the same command after an interruption resumes."""
    from ...data import read_labelled
    from ...measure.perplexity import is_causal_lm
    from ...models import load_model
    from ...train import classifier_loss

    from ...files import check_state

    from ... import parallel
    from ...data import check_data

    out = Path(out)
    steps = train.fit.steps if train else 0
    ckpt = Path(checkpoint_dir) if checkpoint_dir else out.with_name(out.name + ".ckpt")
    rank, world = parallel.world()
    if world > 1 and steps == 0:
        raise MLPSurgeryError("under torchrun `nest` shards its training over the ranks: give --train-steps N, or run "
                              "it as one process")
    progress = progress and rank == 0
    for flag, given in (("--local-epochs", local_epochs), ("--refit", refit)):
        if given and (data_free or world > 1):
            raise MLPSurgeryError(f"{flag} fits each nested MLP on calibration rows in one process: drop it, or "
                                  + ("drop --data-free" if data_free else "run `nest` without torchrun"))
        if given and cfg.modules != "mlp":
            raise MLPSurgeryError(f"{flag} fits the nested MLPs to the original's output: use --modules mlp with it")

    for given in (data, calib_data):  # a FIFO or a device as data is refused before any work, not waited on
        check_data(given)

    def claims():  # rank 0's (every rank hears of a refusal); before hours of training
        check_out(out, overwrite, inputs=[model_spec, data, calib_data, ckpt if steps > 0 else None])
        if steps > 0:
            check_state(ckpt, inputs=[model_spec, data, out])

    parallel.on_rank0(claims)
    if world > 1 and not is_labelled(data) and _language_model(model_spec):
        return _nest_sharded(model_spec, out, cfg, train, data, batch_size, block_len, max_len, ckpt, overwrite,
                             device, progress)
    stage(f"loading {model_spec or 'smollm2 (the default model)'}", progress)
    probe = load_model(model_spec)
    if not _is_classifier(probe.model) and any(a.endswith("ForSequenceClassification")
                                          for a in getattr(probe.model.config, "architectures", None) or []):
        probe = load_model(model_spec, task="classifier")
    encoder = not is_causal_lm(probe.model) and not _is_classifier(probe.model)
    classify = _is_classifier(probe.model) or is_labelled(data) or (data is None and encoder and steps > 0)
    if encoder and data is not None and not classify:
        raise MLPSurgeryError(f"{probe.source} is an encoder without an LM head: train it on labelled data "
                              "(--data r8-train, or a .tab/.csv/.jsonl file)")
    labelled, loaded = None, probe
    if classify and _is_classifier(probe.model):
        id2label = probe.model.config.id2label
        labelled = read_labelled(data or "r8-train", classes=[id2label[i] for i in range(len(id2label))])
    elif classify:
        labelled = read_labelled(data or "r8-train")
        loaded = load_model(model_spec, task="classifier", num_labels=labelled.num_classes)
        loaded.model.config.id2label = dict(enumerate(labelled.classes))
        loaded.model.config.label2id = {c: i for i, c in enumerate(labelled.classes)}
    model, tok = loaded.model.to(device), loaded.tokenizer
    calib = None
    if not data_free:
        from ...data.sampled import calibration_blocks, default_calibration

        calib_data = calib_data or default_calibration(model)
        stage(f"reading the calibration text {calib_data} for the whitened start", progress)
        calib = calibration_blocks(calib_data, model, loaded.require_tokenizer(), block_len=calib_len,
                                   max_blocks=calib_blocks, seed=train.fit.seed if train else 0, progress=progress)
    nest(model, cfg, progress=progress, calib_data=calib, local_epochs=local_epochs, local_lr=local_lr,
         seed=train.fit.seed if train else 0, refit=refit)
    prov = history(model)[-1]["provenance"]
    local = prov.get("local")
    result: dict = {"model": loaded.source, "out": str(out), "config": asdict(cfg),
                    "init": "plain svd" if calib is None else f"whitened svd ({int(calib.numel())} calibration tokens)"
                    + prov["init"].removeprefix("whitened svd"),  # what `nest` recorded: sequential, refit, tuning
                    **({"local": local} if local else {}),
                    "projections": len(nested_linears(model)), "max_rank": max_rank(model),
                    "full_rank_flops_fraction": nested_flops(model)["fraction"]}
    if steps > 0:
        tok = loaded.require_tokenizer()
        if classify:
            task = classifier_loss(model, tok, labelled, batch_size, max_len=max_len, seed=train.fit.seed)
            result["data"] = {"labelled": data or "r8-train", "examples": len(labelled), "classes": labelled.classes}
        else:
            task, result["data"] = _lm_task(model, tok, data, block_len, batch_size, train.fit.seed)
        res = train_nsn(model, task, train, checkpoint_dir=ckpt, progress=progress,
                        settings={"data": result["data"], "batch_size": batch_size, "max_len": max_len},
                        unshard=world == 1)
        result["train"] = _train_summary(res, train)
    return _save(model, out, tok, overwrite, [model_spec, data], ckpt if steps > 0 else None, result, progress)


def _save(model: nn.Module, out: Path, tok, overwrite: bool, inputs: list, ckpt: Path | None, result: dict,
          progress: bool) -> dict:
    """Save the nested model (under torchrun, still sharded: each tensor gathered and written by rank 0 in turn,
    never the whole model in one process), then remove the training checkpoint; rank r > 0 reports its rank."""
    from ... import parallel
    from ...files import remove_ours
    from ...io import save

    rank, world = parallel.world()
    stage(f"saving the nested model to {out}", progress)
    if parallel.is_sharded(model):
        parallel.save_sharded(model, out, tokenizer=tok, overwrite=overwrite, inputs=inputs)
    else:
        save(model.cpu(), out, tokenizer=tok, overwrite=overwrite, inputs=inputs)
    if rank != 0:
        return {**result, "rank": rank, "world_size": world}
    if ckpt is not None:
        remove_ours(ckpt)
    return result


def _lm_task(model: nn.Module, tok, data, block_len: int, batch_size: int, seed: int):
    """(the language-modelling loss of a step, what the result records of the data)."""
    from ...data import load_corpus
    from ...models import check_context
    from ...train import lm_loss

    check_context(model, block_len)
    corpus = load_corpus(data, tok)
    blocks = corpus.blocks("train", block_len)
    return lm_loss(model, blocks, batch_size, seed=seed), {"corpus": corpus.source, "train_blocks": len(blocks),
                                                           "block_len": block_len, "split": corpus.split}


def _train_summary(res, train: NSNTrainConfig) -> dict:
    return {"ranks": res.ranks, "anchor": res.anchor, "log_var": res.log_var, "updates": res.updates,
            "steps": res.steps, "resumed_from": res.resumed_from, "seconds": res.seconds,
            "final_loss": res.history[-1]["loss"] if res.history else None, "objective": train.objective,
            "sampling": train.sampling, "memory": res.memory, "history": res.history}


def _language_model(spec: str | None) -> bool:
    """Whether MODEL loads as a causal LM, from its config alone (no weights read)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ...io import MANIFEST, read_manifest
    from ...models import DEFAULT_MODEL, _model_class, checkpoint_folder, read_config
    from ...tiny import ENCODERS

    text = DEFAULT_MODEL if spec is None else str(spec)
    if text.startswith("tiny:"):
        return text[5:] not in ENCODERS
    folder, _, _ = checkpoint_folder(text)
    if (folder / MANIFEST).exists():
        name = read_manifest(folder)["model_class"]
    else:
        klass = _model_class(read_config(folder), "auto")
        if klass is AutoModelForCausalLM:
            return True
        name = getattr(klass, "__name__", "")
    return name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _nest_sharded(model_spec, out: Path, cfg: NSNConfig, train: NSNTrainConfig, data, batch_size: int,
                  block_len: int, max_len: int, ckpt: Path, overwrite: bool, device, progress: bool) -> dict:
    """`nest_model` of a language model under torchrun: the checkpoint read into FSDP shards one decoder layer at a
    time, each layer nested (SVD) while it is whole (parallel.load_sharded), so that no rank holds the whole model
    (saved by save_sharded: a tensor at a time)."""
    from ... import parallel
    from ...io import record

    check_config(cfg)
    rank, world = parallel.world()
    stage(f"loading {model_spec or 'smollm2 (the default model)'} into {world} shards, nesting it layer by layer",
          progress)
    count = 0

    def work(model: nn.Module, i: int) -> None:
        nonlocal count
        count += nest_layer(model, cfg, i)

    loaded, _ = parallel.load_sharded(model_spec, device, work, progress=progress)
    model = loaded.model
    record(model, "nsn", asdict(cfg), projections=count)
    result: dict = {"model": loaded.source, "out": str(out), "config": asdict(cfg),
                    "init": "plain svd",  # (under torchrun the start is data-free)
                    "projections": len(nested_linears(model)), "max_rank": max_rank(model),
                    "full_rank_flops_fraction": nested_flops(model)["fraction"], "loaded_into_shards": True}
    tok = loaded.require_tokenizer()
    task, result["data"] = _lm_task(model, tok, data, block_len, batch_size, train.fit.seed)
    res = train_nsn(model, task, train, checkpoint_dir=ckpt, progress=progress,
                    settings={"data": result["data"], "batch_size": batch_size, "max_len": max_len}, unshard=False)
    result["train"] = _train_summary(res, train)
    return _save(model, out, tok, overwrite, [model_spec, data], ckpt, result, progress)


def check_rank_args(rank: int | None, budget: float | None, form: str) -> None:
    if (rank is None) == (budget is None):
        raise MLPSurgeryError("give exactly one of --rank and --budget")
    if form not in ("lowrank", "dense", "nested"):
        raise MLPSurgeryError(f"form must be lowrank, dense or nested, not {form!r}")


def choose_rank(model, rank: int | None, budget: float | None) -> dict:
    """Set the nested model's rank (by value or FLOPs budget; shapes only, so `model` may be a skeleton); returns
    the rank and the FLOPs fraction reached."""
    if budget is not None:
        return set_budget(model, budget)
    set_rank(model, rank)
    return {"rank": rank, **nested_flops(model)}


def export_rank(folder: str | Path, out: str | Path, rank: int | None = None, budget: float | None = None,
                form: str = "lowrank", overwrite: bool = False) -> dict:
    """Fix the rank of a nested model folder (by value or FLOPs budget) and write it as `lowrank` (truncated
    NestedLinears; mlpsurgery.load), `dense` (folded; a plain transformers folder) or `nested` (every
    component kept, the rank saved as the serving default)."""
    from ...io import export, save
    from ...measure.cost import count_params
    from ...models import load_model

    check_out(out, overwrite, inputs=[folder])
    check_rank_args(rank, budget, form)
    loaded = load_model(folder)
    model = loaded.model
    before = count_params(model)["total"]
    chosen = choose_rank(model, rank, budget)
    if form == "lowrank":
        truncate(model)
    elif form == "dense":
        fold(model)
    if form == "dense":
        export(model, out, tokenizer=loaded.tokenizer, overwrite=overwrite)
    else:
        save(model, out, tokenizer=loaded.tokenizer, overwrite=overwrite, inputs=[folder])
    return {"from": str(folder), "out": str(out), "form": form, "rank": chosen["rank"], "budget": budget,
            "flops_fraction": chosen["fraction"], "params_before": before, "params_after": count_params(model)["total"],
            "loads_with": "transformers from_pretrained" if form == "dense" else "mlpsurgery.load"}


@ends_stages
def sweep_folder(folder: str | Path, data: str | None = None, ranks: Sequence[int] | None = None,
                 max_tokens: int = 8192, block_len: int | None = None, max_examples: int | None = 1000,
                 max_len: int = 128,
                 plot: str | Path | None = None, device: str = "cpu", progress: bool = True) -> dict:
    """Metric at every rank of a nested model folder: accuracy and loss of a classifier on labelled data
    (default r8-test), perplexity of a causal LM on held-out text (default the bundled Austen split; windows of
    `block_len`, default 256 or the model's context if shorter)."""
    from ...data import load_corpus, read_labelled
    from ...measure.perplexity import default_block_len, perplexity
    from ...models import load_model

    stage(f"loading {folder}", progress)
    loaded = load_model(folder)
    model = loaded.model.to(device)
    tok = loaded.require_tokenizer()
    _require_nested(model)
    if _is_classifier(model):
        classes = [model.config.id2label[i] for i in range(model.config.num_labels)]
        test = read_labelled(data or "r8-test", classes=classes)
        if max_examples and len(test) > max_examples:
            test = test.sample(max_examples, seed=0)

        def evaluate() -> dict:  # a bar per rank, left above the bar over the ranks
            return classifier_metrics(model, tok, test, max_len=max_len, progress=progress)

        metric, what = "accuracy", {"labelled": data or "r8-test", "examples": len(test)}
    else:
        if is_labelled(data):
            raise MLPSurgeryError(f"{folder} is a language model: sweep it on text (--data FILE|FOLDER|austen), "
                                  "not on a labelled set")
        corpus = load_corpus(data, tok)
        block_len = block_len or default_block_len(model, 256)

        def evaluate() -> dict:
            p = perplexity(model, corpus.heldout, block_len=block_len, max_tokens=max_tokens, progress=progress,
                           bos_id=corpus.bos)
            return {"ppl": p.ppl, "loss": p.nll, "tokens": p.tokens}

        metric, what = "ppl", {"corpus": corpus.source, "split": corpus.split, "max_tokens": max_tokens}
    t0 = time.perf_counter()
    rows = sweep(model, evaluate, ranks, progress=progress)
    out = {"model": str(folder), "metric": metric, "data": what, "rows": rows,
           "log_var": learned_log_variances(model), "updates": training_updates(model),
           "seconds": time.perf_counter() - t0}
    if plot is not None:
        out["plot"] = str(plot_frontier({Path(folder).name: rows}, metric, plot, title=f"{folder}: {metric} per rank"))
    return out
