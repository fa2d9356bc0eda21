"""lm-evaluation-harness (`lm-eval`) on any model mlpsurgery loads, with local tasks only.

The model is loaded by `mlpsurgery.models.load_model` (so every folder mlpsurgery writes works, whatever modules it
holds) and handed to lm-eval as an object: `HFLM(pretrained=<model>, tokenizer=<tokenizer>)`. Tasks are lm-eval YAML
configs written to a folder (`write_tasks`), read by `TaskManager(include_path=...)`, and never fetched from a hub:

- `mlpsurgery_corpus`: rolling log-likelihood (`loglikelihood_rolling`: word / byte perplexity, bits per byte, and
  here the token perplexity) of a text corpus, by default the held-out bundled Austen (*Persuasion*);
- `mlpsurgery_r8`: zero-shot topic classification of Reuters news as multiple choice over the eight R8 topic names,
  286 articles of the bundled r8-test (`_bundled/r8_topics.jsonl`, built by `build_r8_topics`);
- any task YAML folder the user gives (`include_path`).

How lm-eval's rolling log-likelihood relates to `measure.perplexity` (checked in lm-eval 0.4.13's source,
`utils.get_rolling_token_windows` with `context_len=1` and `HFLM._loglikelihood_tokens`): lm-eval encodes a document
to tokens t_0..t_{n-1} and scores *every* one of them, t_0 with a prefix token P as its only context (P: the
tokenizer's BOS, else EOS; for SmolLM2 `<|im_start|>`). Its windows hold `max_length` model inputs: the first is
P t_0..t_{L-2} predicting t_0..t_{L-1}; each next one starts one token before the first token it predicts (one token
of overlap), and the last is pulled back to end at the document's end. That is exactly our protocol (windows of
`block_len` tokens every `block_len - 1`, the last pulled back, each token scored once, a document's first token never)
run on the sequence P t_0 .. t_{n-1} with `block_len = max_length + 1` and no BOS: the same (context, target) pairs, so
the same sum of log-likelihoods (`rolling_agreement` measures it). `mlpsurgery eval ppl` on the document itself differs
by one scored token per document (t_0, which it never scores without BOS) and by window boundaries shifted one token.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

from ..data import Document, backend_encode, default_heldout, encode, read_corpus, read_labelled
from ..errors import MLPSurgeryError
from ..models import check_context
from .perplexity import is_causal_lm, perplexity

CORPUS_TASK = "mlpsurgery_corpus"
R8_TASK = "mlpsurgery_r8"
ALIASES = {"corpus": CORPUS_TASK, "r8": R8_TASK}
R8_FILE = "r8_topics.jsonl"
CORPUS_FILE = "corpus.jsonl"
# The R8 topic codes as the words a zero-shot prompt offers (the codes themselves, 'acq', 'money-fx', are not words).
R8_TOPICS = {"acq": "acquisitions", "crude": "crude oil", "earn": "earnings", "grain": "grain",
             "interest": "interest rates", "money-fx": "currency exchange", "ship": "shipping", "trade": "trade"}
R8_PER_CLASS = 40  # at most this many articles of each topic: 286 in all (grain has 10, ship 36 in r8-test)
R8_WORDS = 100  # the article's first words: R8 articles run to 841 words, and 100 keep a CPU run short
R8_PROMPT = "Reuters news article: {{text}}\nTopic:"


# --------------------------------------------------------------------------------------------------
# Tasks


def build_r8_topics(per_class: int = R8_PER_CLASS, words: int = R8_WORDS, seed: int = 0) -> list[dict]:
    """The multiple-choice R8 set, from the bundled r8-test: for each topic a seeded random `per_class` articles
    (all of them where it has fewer), cut to their first `words` words, in r8-test order. `label` indexes
    R8_TOPICS in its order (the R8 classes sorted by code)."""
    ds = read_labelled("r8-test")
    if list(R8_TOPICS) != ds.classes:
        raise MLPSurgeryError(f"the bundled R8 classes {ds.classes} are not {list(R8_TOPICS)}")
    rng = random.Random(seed)
    keep = []
    for c in range(ds.num_classes):
        idx = [i for i, y in enumerate(ds.labels) if y == c]
        rng.shuffle(idx)
        keep += idx[:per_class]
    return [{"text": " ".join(ds.texts[i].split()[:words]), "label": ds.labels[i], "topic": ds.classes[ds.labels[i]]}
            for i in sorted(keep)]


def _bundled_r8() -> Path:
    return Path(str(resources.files("mlpsurgery").joinpath("_bundled", R8_FILE)))


def corpus_documents(data=None, tokenizer=None, split: str = "heldout",
                     text_col: str | None = None) -> tuple[list[Document], str]:
    """The documents of one split of a corpus as text, with the rule that chose them: the same split as
    `data.load_corpus` (Persuasion held out of the bundled Austen, a DatasetDict's own test split, every 10th document
    of a corpus of ten or more, else the last 10% of each document's tokens). A token cut needs the tokenizer: it is
    made at the character where the first held-out token starts."""
    if split not in ("heldout", "train"):
        raise MLPSurgeryError(f"split must be 'heldout' or 'train', not {split!r}")
    docs = read_corpus(data, text_col=text_col)
    rule = default_heldout(docs)
    if isinstance(rule, tuple):
        names, why = rule
        chosen = [d for d in docs if (d.name in names) == (split == "heldout")]
        if not chosen:
            raise MLPSurgeryError(f"the {split} split of {data or 'austen'} is empty")
        return chosen, why
    if tokenizer is None:
        raise MLPSurgeryError(f"{data}: its held-out part is the last {rule:.0%} of each document's tokens, so the model's "
                              "tokenizer decides the cut; give MODEL")
    out = []
    for d in docs:
        ids = encode(tokenizer, d.text)
        cut = len(ids) - int(round(len(ids) * rule))
        at = _char_of_token(tokenizer, d.text, ids, cut)
        text = d.text[at:] if split == "heldout" else d.text[:at]
        if text.strip():
            out.append(Document(d.name, text, d.split))
    if not out:
        raise MLPSurgeryError(f"the {split} split of {data} is empty; give more text")
    return out, f"last {rule:.0%} of each document's tokens held out (cut at the character where that token starts)"


def _char_of_token(tokenizer, text: str, ids: list[int], k: int) -> int:
    """The character offset in `text` where token k starts (len(text) when k is past the end)."""
    if k >= len(ids):
        return len(text)
    enc = backend_encode(tokenizer, text)
    if enc is not None:
        return enc.offsets[k][0]
    return len(tokenizer.decode(ids[:k]))  # slow tokenizers: the decoded prefix (exact for byte-level BPE)


def _yaml(config: dict) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False, allow_unicode=True, width=120)


def write_tasks(folder: str | Path, documents: list[Document] | None = None, corpus_note: str = "",
                cache_dir: str | Path | None = None, final: str | Path | None = None) -> list[str]:
    """Write lm-eval task YAMLs and their data (JSONL) into `folder` (which must exist); returns the task names.
    The R8 task always; the corpus task when `documents` are given. The YAMLs name their data files by absolute path
    (datasets resolves relative ones against the working directory), so the folder works from anywhere but must stay
    where it was written: `final` is where it will live when it is written elsewhere first (an atomic write).
    cache_dir: where `datasets` may build its Arrow cache (default: its own, ~/.cache/huggingface)."""
    folder = Path(folder)
    at = Path(os.path.abspath(Path(final or folder).expanduser()))
    extra = {"cache_dir": str(cache_dir)} if cache_dir else {}
    shutil.copyfile(_bundled_r8(), folder / R8_FILE)

    def local_task(name: str, data_file: str, output_type: str) -> dict:
        """A task on one local JSONL file, named by its final absolute path (see above)."""
        return {"task": name, "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"test": str(at / data_file)}, **extra},
                "test_split": "test", "output_type": output_type}

    r8 = {
        **local_task(R8_TASK, R8_FILE, "multiple_choice"),
        "doc_to_text": R8_PROMPT,
        "doc_to_choice": list(R8_TOPICS.values()),
        "doc_to_target": "label",
        "num_fewshot": 0,
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    head = ("# Zero-shot topic classification of Reuters news (R8) as multiple choice over the 8 topic names;\n"
            f"# {R8_PER_CLASS} articles per topic at most (286), first {R8_WORDS} words, from mlpsurgery's bundled r8-test."
            "\n# Chance: 1/8 = 0.125 (the largest topic is 40/286 = 0.140).\n")
    (folder / f"{R8_TASK}.yaml").write_text(head + _yaml(r8))
    names = [R8_TASK]
    if documents is not None:
        with open(folder / CORPUS_FILE, "w", encoding="utf-8") as f:
            for d in documents:
                f.write(json.dumps({"name": d.name, "text": d.text}, ensure_ascii=False) + "\n")
        corpus = {
            **local_task(CORPUS_TASK, CORPUS_FILE, "loglikelihood_rolling"),
            "doc_to_text": "",
            # the column's name, not "{{text}}": a Jinja template would drop the document's final newline
            "doc_to_target": "text",
            "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
            "metadata": {"version": 1.0},
        }
        head = ("# Rolling log-likelihood (perplexity) of a text corpus, one document per line of corpus.jsonl:\n"
                f"# {' '.join(corpus_note.split())}\n")
        (folder / f"{CORPUS_TASK}.yaml").write_text(head + _yaml(corpus))
        names.append(CORPUS_TASK)
    return names


# --------------------------------------------------------------------------------------------------
# Running lm-eval


def require_lm_eval():
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401  (HFLM, and the transformers it needs)
    except ImportError as e:
        raise MLPSurgeryError(f"lm-eval is not installed ({e}); pip install 'mlpsurgery[lmeval]' (bash install.sh "
                              "installs it)") from None
    return lm_eval


@contextlib.contextmanager
def _offline_and_quiet(verbose: bool = False, progress: bool = True):
    """No hub is ever contacted (the tasks are local, the model an object); lm-eval's INFO/WARNING lines (e.g. that
    it was given a model object) stay off stderr unless asked for; without progress, no bars either."""
    import functools

    import datasets
    import lm_eval.api.task as task_module

    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    for k in saved:
        os.environ[k] = "1"
    log = logging.getLogger("lm_eval")
    level = log.level
    if not verbose:
        log.setLevel(logging.ERROR)
    bars = datasets.is_progress_bar_enabled()
    task_tqdm = task_module.tqdm
    if not progress:
        datasets.disable_progress_bars()
        # lm-eval's request building has a bar of its own that no argument turns off
        task_module.tqdm = functools.partial(task_tqdm, disable=True)
    try:
        yield
    finally:
        task_module.tqdm = task_tqdm
        if bars:
            datasets.enable_progress_bars()
        log.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_lm(model, tokenizer, max_length: int, batch_size: int = 4, progress: bool = True, verbose: bool = False):
    """lm-eval's HFLM around a loaded model object (its device and dtype as they are)."""
    require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    if not is_causal_lm(model):
        raise MLPSurgeryError(f"lm-eval scores causal language models; {type(model).__name__} is not one (for encoders "
                              "use `mlpsurgery eval acc`)")
    if tokenizer is None:
        raise MLPSurgeryError("the model has no tokenizer files; save it with its tokenizer")
    if max_length < 2:
        raise MLPSurgeryError(f"--max-length must be at least 2 tokens, not {max_length}")
    check_context(model, max_length, "--max-length")

    class QuietHFLM(HFLM):
        # HFLM hard-codes its progress bars on; --quiet turns them off, nothing else differs
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not progress)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or not progress)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm or not progress,
                                                 override_bs=override_bs)

    # HFLM calls model.tie_weights(): a model whose head was deliberately untied must not be re-tied behind our back
    before = {n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)}
    with _offline_and_quiet(verbose, progress):
        # logits_cache=False: lm-eval 0.4.13 groups requests whose tokens (context + continuation minus its last)
        # are equal and reuses one forward for all of them, but for a request whose continuation is shorter than the
        # first one's it scores the *first* positions of the shared logits, not the last: a rolling window that
        # repeats an earlier window's tokens (repeated text) gets a wrong log-likelihood, silently. The cache only
        # saves time on one-token answers; we keep every score right instead.
        lm = QuietHFLM(pretrained=model, tokenizer=tokenizer, backend="causal", max_length=max_length,
                       batch_size=batch_size, logits_cache=False)
    after = {n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)}
    if after != before:
        raise MLPSurgeryError("lm-eval re-tied the model's weights (tie_weights), which changes what it computes; this "
                              "model cannot be evaluated through lm-eval's HFLM")
    return lm


def resolve_tasks(tasks: list[str], include_path: str | Path | None) -> list[str]:
    """Task names: our aliases (corpus, r8) mapped, the rest as given (from --include-path)."""
    out = []
    for t in tasks:
        t = t.strip()
        if not t:
            continue
        out.append(ALIASES.get(t, t))
    if not out:
        raise MLPSurgeryError("no task named; give --tasks corpus,r8 or names from --include-path")
    return list(dict.fromkeys(out))


def _task_manager(paths: list[str]):
    from lm_eval.tasks import TaskManager

    try:
        # local tasks only: lm-eval's own catalogue (which downloads its data sets from the hub) is not indexed
        return TaskManager(include_path=paths, include_defaults=False)
    except Exception as e:  # noqa: BLE001 - a malformed YAML in a user's folder: one line, not lm-eval's traceback
        raise MLPSurgeryError(f"lm-eval could not read the task folders {paths} ({_first_line(e)}); check the YAML "
                              "files") from None


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:300] + " ..."


def token_perplexity(lm, samples: list[dict]) -> dict:
    """Token-level perplexity of a rolling task from lm-eval's per-document log-likelihoods: exp(-sum LL / tokens),
    with tokens counted as lm-eval scored them (HFLM.tok_encode of the document: all of its tokens)."""
    ll = sum(float(s["filtered_resps"][0]) for s in samples)
    tokens = sum(len(lm.tok_encode(s["arguments"][0][0])) for s in samples)
    return {"documents": len(samples), "tokens": tokens, "loglikelihood": ll, "nll": -ll / tokens,
            "token_perplexity": math.exp(-ll / tokens)}


def evaluate(model, tokenizer, tasks: list[str], documents: list[Document] | None = None, corpus_note: str = "",
             include_path: str | Path | None = None, limit: int | float | None = None, max_length: int = 511,
             batch_size: int = 4, num_fewshot: int | None = None, bootstrap_iters: int = 100000,
             progress: bool = True, verbose: bool = False, seed: int = 0) -> dict:
    """Run lm-eval's simple_evaluate on a model object with local tasks. Returns {'results': lm-eval's results dict
    (samples removed: they hold every document), 'token_perplexity': {task: ...} for rolling tasks}."""
    require_lm_eval()
    from lm_eval import simple_evaluate

    names = resolve_tasks(tasks, include_path)
    if CORPUS_TASK in names and documents is None:
        raise MLPSurgeryError("the corpus task needs its documents")
    if include_path is not None:
        include_path = Path(include_path).expanduser()
        if not include_path.is_dir():
            raise MLPSurgeryError(f"--include-path {include_path} is not a folder; give a folder of lm-eval task YAMLs")
    lm = make_lm(model, tokenizer, max_length=max_length, batch_size=batch_size, progress=progress, verbose=verbose)
    with tempfile.TemporaryDirectory(prefix="mlpsurgery-lmeval-") as tmp, _offline_and_quiet(verbose, progress):
        ours = Path(tmp) / "tasks"
        ours.mkdir()
        # datasets' Arrow cache of the task data goes to the temporary folder too: nothing outlives the run
        write_tasks(ours, documents if CORPUS_TASK in names else None, corpus_note, cache_dir=Path(tmp) / "cache")
        paths = [str(ours)] + ([str(include_path)] if include_path is not None else [])
        manager = _task_manager(paths)
        known = set(manager.all_tasks)
        unknown = [n for n in names if n not in known]
        if unknown:
            mine = sorted(k for k in known if not k.startswith("mlpsurgery_"))
            raise MLPSurgeryError(f"unknown task(s) {', '.join(unknown)}: the tasks here are corpus, r8"
                                  + (f" and, from --include-path, {', '.join(mine[:20])}" if mine else "")
                                  + " (lm-eval's hub tasks are not available offline)")
        t0 = time.perf_counter()
        try:
            out = simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                  bootstrap_iters=bootstrap_iters, log_samples=True, random_seed=seed,
                                  numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
        except MLPSurgeryError:
            raise
        except Exception as e:  # noqa: BLE001 - lm-eval and datasets raise anything for a bad task (a missing column,
            # a bad template, a data file that is not there or not JSON): one line that names it, not a traceback
            raise MLPSurgeryError(f"lm-eval could not run {', '.join(names)} ({type(e).__name__}: {_first_line(e)}); "
                                  "check the task YAML and its data") from None
        seconds = time.perf_counter() - t0
        samples = out.pop("samples", {})
        rolling = {t: token_perplexity(lm, s) for t, s in samples.items()
                   if out.get("configs", {}).get(t, {}).get("output_type") == "loglikelihood_rolling"}
    return {"results": out, "token_perplexity": rolling, "seconds": seconds,
            "settings": {"max_length": max_length, "batch_size": batch_size, "limit": limit,
                         "prefix_token_id": lm.prefix_token_id, "add_bos_token": lm.add_bos_token,
                         "lm_eval_version": _version()}}


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


# --------------------------------------------------------------------------------------------------
# Agreement with measure.perplexity


def rolling_agreement(model, tokenizer, documents: list[Document], max_length: int, batch_size: int = 4,
                      progress: bool = False, lm_eval_result: dict | None = None) -> dict:
    """lm-eval's rolling log-likelihood of `documents` against `measure.perplexity` on the same tokens.

    `matched`: our perplexity() on P + tokens (P: lm-eval's prefix token) with block_len = max_length + 1 and no BOS:
    by the correspondence in the module docstring, the same (context, target) pairs as lm-eval, so the sums differ
    only by float rounding (batches of other shapes). `eval_ppl`: what `mlpsurgery eval ppl --block-len
    max_length + 1` computes on the documents (our protocol, the tokenizer's BOS default): one token fewer per
    document, windows shifted by one. lm_eval_result: evaluate()'s token_perplexity entry, when already run."""
    from ..data import default_bos

    lm = make_lm(model, tokenizer, max_length=max_length, batch_size=batch_size, progress=progress)
    if lm_eval_result is None:
        res = evaluate(model, tokenizer, [CORPUS_TASK], documents, max_length=max_length, batch_size=batch_size,
                       progress=progress, bootstrap_iters=0)
        lm_eval_result = res["token_perplexity"][CORPUS_TASK]
    ids = [lm.tok_encode(d.text) for d in documents]
    prefix = lm.prefix_token_id
    t0 = time.perf_counter()
    matched = perplexity(model, [torch.tensor([prefix] + i) for i in ids], block_len=max_length + 1,
                         batch_size=batch_size, progress=progress, bos_id=None)
    matched_s = time.perf_counter() - t0
    plain = [torch.tensor(encode(tokenizer, d.text)) for d in documents]
    bos = default_bos(tokenizer)
    t0 = time.perf_counter()
    ours = perplexity(model, plain, block_len=max_length + 1, batch_size=batch_size, progress=progress, bos_id=bos)
    ours_s = time.perf_counter() - t0
    ll_ours = -matched.nll * matched.tokens
    return {
        "lm_eval": lm_eval_result,
        "matched": {"tokens": matched.tokens, "loglikelihood": ll_ours, "token_perplexity": matched.ppl,
                    "block_len": max_length + 1, "prefix_token_id": prefix, "seconds": matched_s},
        "eval_ppl": {"tokens": ours.tokens, "token_perplexity": ours.ppl, "block_len": max_length + 1,
                     "bos": ours.protocol["bos"], "seconds": ours_s},
        "same_tokens": matched.tokens == lm_eval_result["tokens"],
        "abs_diff_loglikelihood": abs(ll_ours - lm_eval_result["loglikelihood"]),
        "rel_diff_perplexity": abs(matched.ppl / lm_eval_result["token_perplexity"] - 1),
        "rel_diff_eval_ppl": abs(ours.ppl / lm_eval_result["token_perplexity"] - 1),
    }
