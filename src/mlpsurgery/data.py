"""Text for calibration, training and evaluation.

Corpora become fixed-length token blocks with a train / held-out split that never overlaps:
- the bundled default (`austen`: six Jane Austen novels, public domain, shipped in the package):
  five novels train, *Persuasion* is held out whole;
- any other corpus (a text file, or a folder of .txt / .txt.gz files): the last `heldout` fraction
  of every document's tokens is held out; or name whole documents to hold out.
Blocks are cut inside one document and one side of the split, so no block straddles either.

Labelled sets (texts with one class each) load from the tab-separated format of Orange (three header
lines: names, types, flags with `class` on the label column), CSV or JSONL; the Reuters R8 train/test
sets are bundled as `r8-train` / `r8-test`.

Tables the field publishes data in are read through the `datasets` library, for corpora and labelled sets
alike: a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, a `.parquet` file, and for
corpora also `.jsonl` / `.json` / `.csv` (each row one document). Columns: the text column is the one named
text, content or sentence, else the only string column; the label column is the one named label, labels,
class or category. Name them by appending `:text=COL` and/or `:label=COL` to the path (`tweets.parquet:text=body,label=author`),
which works wherever a command takes data. A DatasetDict with a `train` split and a `test` (else `validation`)
split keeps the dataset's own split: train trains, test (or validation) is held out, whole documents.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import json
import random
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from .errors import MLPSurgeryError

AUSTEN = ("austen_emma", "austen_mansfieldpark", "austen_northangerabbey", "austen_prideprejudice",
          "austen_sensesensibility", "austen_persuasion")
AUSTEN_HELDOUT = ("austen_persuasion",)
BUNDLED_CORPORA = ("austen", "r8", "r8-train")
BUNDLED_LABELLED = ("r8-train", "r8-test")


@dataclass
class Document:
    name: str
    text: str
    split: str = ""  # the dataset's own split it came from (a DatasetDict's 'train' / 'test' / 'validation'), else ""


def _bundled(name: str) -> str:
    with resources.files("mlpsurgery").joinpath("_bundled", name).open("rb") as f:
        return gzip.decompress(f.read()).decode("utf-8")


def _read_text(path: Path) -> str:
    if path.is_dir():
        raise MLPSurgeryError(f"{path} is a folder; a file is expected here")
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
    except (gzip.BadGzipFile, EOFError, OSError) as e:
        what = "not a valid gzip file" if path.suffix == ".gz" else "unreadable"
        raise MLPSurgeryError(f"{path} is {what} ({type(e).__name__}: {e}); give an intact file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise MLPSurgeryError(f"{path} is not UTF-8 text; convert it (e.g. `iconv -t utf-8`)") from None


# --------------------------------------------------------------------------------------------------
# Tables, read through the `datasets` library: save_to_disk folders, parquet, JSONL / JSON, CSV

TABLE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv",
                 ".jsonl.gz": "json", ".json.gz": "json", ".csv.gz": "csv"}
TEXT_NAMES = ("text", "content", "sentence")
LABEL_NAMES = ("label", "labels", "class", "category")
HELDOUT_SPLITS = ("test", "validation")  # a DatasetDict's held-out split: test, else validation
# PATH:text=COL[,label=COL] (or :label=COL, ':' or ',' between the two). A column name holding ',', ':' or '='
# cannot be named this way; such tables need the Python API (read_corpus(path, text_col=...)).
_OPTIONS = re.compile(r"^(?P<path>.+?):(?P<opts>(?:text|label)=[^,:=]+(?:[,:](?:text|label)=[^,:=]+)*)$")


def split_spec(spec: str | Path) -> tuple[str, dict[str, str]]:
    """'PATH:text=COL,label=COL' -> ('PATH', {'text': COL, 'label': COL}). A string that names an existing path is
    taken whole, so a file whose name happens to end in ':text=x' still loads."""
    text = str(spec)
    if Path(text).expanduser().exists():
        return text, {}
    m = _OPTIONS.match(text)
    if m is None:
        return text, {}
    opts: dict[str, str] = {}
    for part in re.split(r"[,:]", m["opts"]):
        key, value = part.split("=", 1)
        if key in opts:
            raise MLPSurgeryError(f"{text!r} names the {key} column twice; give :{key}=COL once")
        opts[key] = value
    return m["path"], opts


def table_format(path: Path) -> str | None:
    """The `datasets` builder for a table file ('parquet', 'json', 'csv'), or None when it is not one."""
    name = path.name.lower()
    for suffix, fmt in sorted(TABLE_FORMATS.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(suffix):
            return fmt
    return None


def is_datasets_folder(path: Path) -> bool:
    """A folder written by Dataset.save_to_disk (state.json + dataset_info.json) or DatasetDict.save_to_disk
    (dataset_dict.json)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def is_table(path: Path) -> bool:
    return is_datasets_folder(path) or (path.is_file() and table_format(path) is not None)


def _cause(e: BaseException) -> str:
    """The most specific message in an exception chain, on one line: `datasets` wraps pyarrow's precise error
    ('JSON parse error: ... in row 1') in a vague one of its own ('An error occurred while generating the dataset')."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    own = [x for x in chain if not type(x).__module__.startswith("datasets") and str(x).strip()]
    pick = (own or [x for x in chain if str(x).strip()] or chain)[0]
    msg = " ".join(str(pick).split()) or type(pick).__name__
    return msg if len(msg) <= 240 else msg[:240] + " ..."


@contextlib.contextmanager
def _datasets_quietly():
    try:
        import datasets
    except ImportError:
        raise MLPSurgeryError("reading tables (parquet, JSONL, CSV, save_to_disk folders) needs the `datasets` "
                              "package: pip install datasets (bash install.sh installs it)") from None
    import logging

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a corpus read is not a download: no bars on stderr
    # datasets logs a reader's failure before raising it; the refusal we raise says it, on one line
    log = logging.getLogger("datasets")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield datasets
    finally:
        log.setLevel(level)
        if was:
            datasets.enable_progress_bars()


def read_table(path: Path) -> dict[str, object]:
    """The splits of a table as `datasets.Dataset`s: {split: Dataset} for a DatasetDict folder, {'': Dataset} for a
    Dataset folder or a file. Anything unreadable is a one-line refusal."""
    with _datasets_quietly() as hf:
        if path.is_dir():
            what = "a datasets folder (save_to_disk)"
            try:
                obj = hf.load_from_disk(str(path))
            except Exception as e:  # noqa: BLE001 - datasets/pyarrow/json errors of a damaged folder: say so in one line
                raise MLPSurgeryError(f"{path} could not be read as {what} ({_cause(e)}); restore it or save it again "
                                      "with save_to_disk") from None
            splits = dict(obj) if isinstance(obj, hf.DatasetDict) else {"": obj}
        else:
            fmt = table_format(path)
            what = {"json": "JSON lines", "csv": "CSV", "parquet": "parquet"}[fmt]
            if path.stat().st_size == 0:
                raise MLPSurgeryError(f"{path} is empty; give a {what} file with a text column")
            # load_dataset builds an Arrow cache; keep it in memory and in a private folder removed afterwards, so
            # that reading a file writes nothing that outlives the read.
            cache = tempfile.mkdtemp(prefix="mlpsurgery-table-")
            try:
                obj = hf.load_dataset(fmt, data_files=str(path.resolve()), split="train", cache_dir=cache,
                                      keep_in_memory=True)
            except Exception as e:  # noqa: BLE001 - as above, for a damaged or malformed file
                if "corresponds to no data" in str(e):  # how datasets says that a file held a header and no rows
                    raise MLPSurgeryError(f"{path} has no rows; give a table with data") from None
                raise MLPSurgeryError(f"{path} could not be read as {what} ({_cause(e)}); give an intact file") from None
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            splits = {"": obj}
    for name, ds in splits.items():
        if ds.num_rows == 0:
            where = f"split {name!r} of {path}" if name else str(path)
            raise MLPSurgeryError(f"{where} has no rows; give a table with data")
    return splits


def _own_splits(path: Path, splits: dict) -> tuple[str, str]:
    """(train split, held-out split) of a DatasetDict with several splits, or a refusal naming them."""
    held = next((s for s in HELDOUT_SPLITS if s in splits), None)
    if "train" not in splits or held is None:
        raise MLPSurgeryError(f"{path} is a DatasetDict with splits {', '.join(splits)}: it needs a 'train' split and a "
                              f"'test' or 'validation' split, or name one split's folder (e.g. {path / next(iter(splits))})")
    return "train", held


def _values(ds, col: str, where: str) -> list:
    """A column's values. Arrow decodes lazily, so a damaged file (invalid UTF-8 in a string column) can fail only
    here, after it opened fine."""
    try:
        return list(ds[col])  # datasets 5 returns a lazy Column: decode every value here
    except Exception as e:  # noqa: BLE001 - pyarrow's decode errors of a damaged file: a one-line refusal
        raise MLPSurgeryError(f"column {col!r} of {where} could not be read ({_cause(e)}); give an intact file") from None


def _feature_type(feature) -> str:
    return str(getattr(feature, "dtype", None) or type(feature).__name__)


def _is_string(feature) -> bool:
    return type(feature).__name__ == "Value" and feature.dtype in ("string", "large_string")


def _columns(ds) -> str:
    return ", ".join(f"{k} ({_feature_type(f)})" for k, f in ds.features.items())


def text_column(ds, where: str, wanted: str | None = None, exclude: tuple[str, ...] = ()) -> str:
    """The text column: `wanted`, else one named text / content / sentence, else the only string column."""
    feats = ds.features
    if wanted is not None:
        if wanted not in feats:
            raise MLPSurgeryError(f"{where} has no column {wanted!r} (columns: {_columns(ds)}); name the text column "
                                  "with PATH:text=COL")
        if not _is_string(feats[wanted]):
            raise MLPSurgeryError(f"column {wanted!r} of {where} holds {_feature_type(feats[wanted])}, not text; name a "
                                  "string column with PATH:text=COL")
        return wanted
    candidates = [k for k in feats if k not in exclude]
    lowered = {k.lower(): k for k in candidates}
    for name in TEXT_NAMES:
        if name in lowered and _is_string(feats[lowered[name]]):
            return lowered[name]
    strings = [k for k in candidates if _is_string(feats[k])]
    if len(strings) == 1:
        return strings[0]
    if not strings:
        raise MLPSurgeryError(f"{where} has no text column: no column holds strings (columns: {_columns(ds)}); give a "
                              "table with a text column")
    raise MLPSurgeryError(f"{where} has several string columns ({', '.join(strings)}) and none is named "
                          f"{', '.join(TEXT_NAMES)}; name the text column with PATH:text=COL")


def label_column(ds, where: str, wanted: str | None = None) -> str:
    """The label column: `wanted`, else one named label / labels / class / category, else the only ClassLabel."""
    feats = ds.features
    if wanted is not None:
        if wanted not in feats:
            raise MLPSurgeryError(f"{where} has no column {wanted!r} (columns: {_columns(ds)}); name the label column "
                                  "with PATH:label=COL")
        return wanted
    lowered = {k.lower(): k for k in feats}
    for name in LABEL_NAMES:
        if name in lowered:
            return lowered[name]
    class_labels = [k for k, f in feats.items() if type(f).__name__ == "ClassLabel"]
    if len(class_labels) == 1:
        return class_labels[0]
    raise MLPSurgeryError(f"{where} has no column named {', '.join(LABEL_NAMES)} (columns: {_columns(ds)}); name the "
                          "label column with PATH:label=COL")


def label_values(ds, col: str, where: str) -> list[str]:
    """The labels as class names ('' where a row has none: ClassLabel -1, as in unlabelled test splits, or null)."""
    f = ds.features[col]
    values = _values(ds, col, where)
    kind = type(f).__name__
    if kind == "ClassLabel":
        return [f.int2str(v) if v is not None and v >= 0 else "" for v in values]
    if kind == "Value" and (_is_string(f) or f.dtype == "bool" or re.fullmatch(r"u?int\d+", f.dtype)):
        return ["" if v is None else str(v) for v in values]
    # floats would each become a class of their own (a regression target), lists a multi-label set: refuse both
    raise MLPSurgeryError(f"column {col!r} of {where} holds {_feature_type(f)}, not class labels (strings, integers or "
                          "a ClassLabel); name the label column with PATH:label=COL")


def _table_documents(path: Path, text_col: str | None) -> list[Document]:
    splits = read_table(path)
    if len(splits) == 1:
        (only, ds), = splits.items()
        use = [(only, ds, "")]  # one split: the usual held-out rule (last 10% of each document) applies
    else:
        train, held = _own_splits(path, splits)
        use = [(train, splits[train], train), (held, splits[held], held)]
    docs = []
    for name, ds, split in use:
        where = f"split {name!r} of {path}" if name else str(path)
        texts = _values(ds, text_column(ds, where, text_col), where)
        prefix = name or path.name.split(".")[0]
        width = len(str(len(texts) - 1))
        part = [Document(f"{prefix}-{i:0{width}d}", t, split) for i, t in enumerate(texts) if t and t.strip()]
        if not part:
            raise MLPSurgeryError(f"{where} has no text: every row's text is empty")
        docs += part
    return docs


def _table_labelled(path: Path, text_col: str | None, label_col: str | None,
                    split: str | None) -> tuple[list[str], list[str]]:
    splits = read_table(path)
    if len(splits) == 1:
        (name, ds), = splits.items()
    else:
        train, held = _own_splits(path, splits)
        if split not in ("train", "heldout"):
            raise MLPSurgeryError(f"{path} is a DatasetDict with splits {', '.join(splits)}: name the one to read, "
                                  f"{path / train} or {path / held} (its folder)")
        name = train if split == "train" else held
        ds = splits[name]
    where = f"split {name!r} of {path}" if name else str(path)
    lcol = label_column(ds, where, label_col)
    tcol = text_column(ds, where, text_col, exclude=(lcol,))
    return ["" if t is None else t for t in _values(ds, tcol, where)], label_values(ds, lcol, where)


def read_corpus(path: str | Path | None = None, text_col: str | None = None) -> list[Document]:
    """Documents of a corpus: None or 'austen' (bundled), 'r8' (bundled Reuters news test articles, one document
    per article), 'r8-train' (the training articles, one document per topic), A+B (a mix: both corpora's
    documents; 'austen+r8-train' keeps Persuasion held out and trains on both), a text file, a folder of .txt / .txt.gz files (sorted by name), or a table (one document per row):
    a datasets folder (save_to_disk), .parquet, .jsonl / .json, .csv. `PATH:text=COL` (or text_col) names the
    text column; a DatasetDict with train + test (else validation) keeps its own split (Document.split)."""
    if path is None or str(path) == "austen":
        return [Document(n, _bundled(n + ".txt.gz")) for n in AUSTEN]
    if str(path) == "r8":
        ds = read_labelled("r8-test")
        return [Document(f"r8-{i:04d}", t) for i, t in enumerate(ds.texts)]
    if str(path) == "r8-train":  # the training articles, one document per topic (so that they fill whole blocks)
        ds = read_labelled("r8-train")
        return [Document(f"r8-train-{c}", "\n\n".join(t for t, y in zip(ds.texts, ds.labels) if y == k))
                for k, c in enumerate(ds.classes)]
    if "+" in str(path) and not Path(str(path)).expanduser().exists():  # a mix: every part's documents
        docs = []
        for part in str(path).split("+"):
            if not part:
                raise MLPSurgeryError(f"corpus mix {str(path)!r} has an empty part; join corpora as austen+r8-train")
            docs += read_corpus(part, text_col=text_col)
        if len({d.name for d in docs}) < len(docs):
            raise MLPSurgeryError(f"corpus mix {str(path)!r} names a document twice; give each corpus once")
        return docs
    spec, opts = split_spec(path)
    text_col = text_col or opts.get("text")  # a :label= option is for labelled sets; a corpus has no labels
    p = Path(spec).expanduser()
    if not p.exists():
        raise MLPSurgeryError(f"corpus {spec!r} does not exist; give a text file, a folder of .txt files, a table "
                              f"(.parquet, .jsonl, .csv, a datasets save_to_disk folder), or one of the bundled "
                              f"corpora: {', '.join(BUNDLED_CORPORA)}")
    if is_table(p):
        docs = _table_documents(p, text_col)
    elif text_col is not None:
        raise MLPSurgeryError(f"{p} is plain text, not a table: :text=COL names a column of a .parquet, .jsonl, .csv "
                              "file or a datasets folder")
    elif p.is_dir():
        files = sorted(f for f in p.iterdir() if f.name.endswith((".txt", ".txt.gz")) and f.is_file())
        if not files:
            raise MLPSurgeryError(f"folder {p} has no .txt or .txt.gz files and is not a datasets folder (save_to_disk); "
                                  "give a folder of text files, a datasets folder, or a .parquet/.jsonl/.csv file")
        docs = [Document(f.name.removesuffix(".gz").removesuffix(".txt"), _read_text(f)) for f in files]
    else:
        docs = [Document(p.name.removesuffix(".gz").removesuffix(".txt"), _read_text(p))]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise MLPSurgeryError(f"corpus {p} is empty")
    return docs


def backend_encode(tokenizer, text: str):
    """The fast tokenizer's own Encoding of `text` (ids, offsets) without special tokens, truncation or padding;
    None for a slow tokenizer. Some tokenizer.json files (all-MiniLM-L6-v2's) carry truncation and padding to 128
    tokens, which the backend applies to every encode: they are lifted for this call, then put back."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    trunc, pad = backend.truncation, backend.padding
    backend.no_truncation()
    backend.no_padding()
    try:
        return backend.encode(text, add_special_tokens=False)
    finally:
        if trunc is not None:
            backend.enable_truncation(**trunc)
        if pad is not None:
            backend.enable_padding(**pad)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens, however long (no truncation, no length warning)."""
    enc = backend_encode(tokenizer, text)
    return enc.ids if enc is not None else tokenizer.encode(text, add_special_tokens=False)


def default_bos(tokenizer) -> int | None:
    """The BOS id when the tokenizer adds one by default (its models were trained with it), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        ids = tokenizer("a")["input_ids"]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode plain text adds nothing we can use
        return None
    return bos if len(ids) and ids[0] == bos else None


@dataclass
class TokenizedCorpus:
    """Token ids per document and split. `split` says how held-out text was chosen."""

    train: list[Tensor]
    heldout: list[Tensor]
    train_names: list[str]
    heldout_names: list[str]
    split: str
    source: str = ""
    meta: dict = field(default_factory=dict)
    bos: int | None = None  # the tokenizer's BOS when it adds one by default: perplexity prepends it to windows

    def sequences(self, split: str) -> list[Tensor]:
        if split not in ("train", "heldout"):
            raise MLPSurgeryError(f"split must be 'train' or 'heldout', not {split!r}")
        return self.train if split == "train" else self.heldout

    def n_tokens(self, split: str) -> int:
        return sum(len(s) for s in self.sequences(split))

    def blocks(self, split: str, block_len: int, max_blocks: int | None = None, seed: int | None = None) -> Tensor:
        """Non-overlapping (N, block_len) blocks of one split, cut inside documents. With max_blocks,
        a subset: the first ones, or a random sample when a seed is given."""
        if block_len < 2:
            raise MLPSurgeryError(f"block length must be at least 2 tokens, not {block_len}")
        pieces = [s[: len(s) // block_len * block_len].view(-1, block_len) for s in self.sequences(split)]
        pieces = [p for p in pieces if len(p)]
        if not pieces:
            raise MLPSurgeryError(
                f"the {split} split of {self.source or 'the corpus'} has {self.n_tokens(split)} tokens, fewer than "
                f"one block of {block_len}; give more text or a smaller --block-len")
        out = torch.cat(pieces)
        if max_blocks is not None and max_blocks < len(out):
            if seed is None:
                out = out[:max_blocks]
            else:
                g = torch.Generator().manual_seed(seed)
                out = out[torch.randperm(len(out), generator=g)[:max_blocks]]
        return out


def default_heldout(docs: list[Document]) -> tuple[tuple[str, ...], str] | float:
    """The held-out rule of a corpus when none is given: (names of whole documents, why) for a DatasetDict's own
    test / validation split and for the bundled Austen (Persuasion); else 0.1, the last 10% of each document."""
    names = [d.name for d in docs]
    own = sorted({d.split for d in docs if d.split and d.split != "train"})
    if own and any(d.split == "train" for d in docs):
        held = tuple(d.name for d in docs if d.split in own)
        return held, f"the dataset's own split: {', '.join(own)} held out ({len(held)} whole documents), train trains"
    if set(AUSTEN_HELDOUT) <= set(names) and len(names) > 1:
        return AUSTEN_HELDOUT, f"whole documents held out: {', '.join(AUSTEN_HELDOUT)}"
    return 0.1


def tokenize_corpus(docs: list[Document], tokenizer, heldout: float | list[str] | tuple[str, ...] | None = None,
                    source: str = "") -> TokenizedCorpus:
    """Split documents into train and held-out token sequences.

    heldout: a fraction in (0, 1) of each document's tokens (its tail), or the names of whole documents to
    hold out. Default: the bundled Austen corpus holds out Persuasion; anything else its last 10%.
    """
    names = [d.name for d in docs]
    why = ""
    if heldout is None:
        rule = default_heldout(docs)
        heldout, why = (list(rule[0]), rule[1]) if isinstance(rule, tuple) else (rule, "")
    train, held, tn, hn = [], [], [], []
    if isinstance(heldout, (list, tuple)):
        unknown = sorted(set(heldout) - set(names))
        if unknown:
            raise MLPSurgeryError(f"held-out documents {unknown} are not in the corpus (it has {names})")
        if set(heldout) == set(names):
            raise MLPSurgeryError("every document is held out; leave at least one for training")
        for d in docs:
            ids = torch.tensor(encode(tokenizer, d.text), dtype=torch.long)
            (held if d.name in heldout else train).append(ids)
            (hn if d.name in heldout else tn).append(d.name)
        split = why or f"whole documents held out: {', '.join(heldout)}"
    else:
        frac = float(heldout)
        if not 0.0 < frac < 1.0:
            raise MLPSurgeryError(f"held-out fraction must be in (0, 1), not {frac}")
        for d in docs:
            ids = torch.tensor(encode(tokenizer, d.text), dtype=torch.long)
            cut = len(ids) - int(round(len(ids) * frac))
            train.append(ids[:cut])
            held.append(ids[cut:])
            tn.append(d.name)
            hn.append(d.name)
        split = f"last {frac:.0%} of each document's tokens held out"
    return TokenizedCorpus(train, held, tn, hn, split, source=source or "corpus", bos=default_bos(tokenizer))


def load_corpus(path: str | Path | None, tokenizer, heldout=None, text_col: str | None = None) -> TokenizedCorpus:
    """read_corpus + tokenize_corpus."""
    docs = read_corpus(path, text_col=text_col)
    return tokenize_corpus(docs, tokenizer, heldout=heldout, source=str(path) if path else "austen")


def text_blocks(path: str | Path | None, tokenizer, block_len: int = 256, split: str = "train",
                max_blocks: int | None = None, seed: int | None = None, heldout=None) -> Tensor:
    """(N, block_len) token blocks of one split of a corpus: the one-line way to get calibration data."""
    return load_corpus(path, tokenizer, heldout).blocks(split, block_len, max_blocks, seed)


# --------------------------------------------------------------------------------------------------
# Labelled text


@dataclass
class LabelledSet:
    texts: list[str]
    labels: list[int]
    classes: list[str]
    name: str = ""

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def subset(self, idx) -> "LabelledSet":
        idx = list(idx)
        return LabelledSet([self.texts[i] for i in idx], [self.labels[i] for i in idx], self.classes, self.name)

    def split(self, fraction: float, seed: int = 0) -> tuple["LabelledSet", "LabelledSet"]:
        """Stratified split: (the rest, `fraction` of each class)."""
        rng = random.Random(seed)
        a, b = [], []
        for c in range(self.num_classes):
            idx = [i for i, y in enumerate(self.labels) if y == c]
            rng.shuffle(idx)
            k = int(round(len(idx) * fraction))
            b += idx[:k]
            a += idx[k:]
        return self.subset(sorted(a)), self.subset(sorted(b))

    def sample(self, fraction_or_n: float, seed: int = 0) -> "LabelledSet":
        """A stratified random part: a fraction (< 1) or a count (>= 1) of the examples."""
        frac = fraction_or_n if fraction_or_n < 1 else fraction_or_n / len(self)
        return self.split(frac, seed)[1]


def _labelled_rows(path: Path, text_col: str | None, label_col: str | None) -> tuple[list[str], list[str]]:
    raw = _read_text(path)
    lines = raw.splitlines()
    name = path.name.removesuffix(".gz")
    if name.endswith((".tab", ".tsv")):
        rows = [r for r in csv.reader(lines, delimiter="\t") if r]
        if name.endswith(".tab") and len(rows) >= 3 and "class" in rows[2]:
            header, types, flags, rows = rows[0], rows[1], rows[2], rows[3:]
            label_col = label_col or header[flags.index("class")]
            if text_col is None:
                strings = [h for h, t in zip(header, types) if t == "string"]
                named = [h for h in header if h.lower() in ("text", "content")]
                text_col = (named or strings or [None])[0]
        else:
            header, rows = rows[0], rows[1:]
        records = [dict(zip(header, r)) for r in rows]
    elif name.endswith(".csv"):
        records = list(csv.DictReader(lines))
        header = list(records[0]) if records else []
    elif name.endswith((".jsonl", ".json")):
        records = []
        for n, line in enumerate(lines, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise MLPSurgeryError(f"{path}:{n} is not valid JSON ({e.msg}); JSONL needs one object per line") from None
        header = list(records[0]) if records else []
    else:
        raise MLPSurgeryError(f"{path}: labelled data must be .tab (Orange), .tsv, .csv or .jsonl")
    # default names: text / label as always, then the other usual names (content, sentence; labels, class, ...)
    lowered = {str(h).lower(): h for h in header}
    text_col = text_col or next((lowered[n] for n in TEXT_NAMES if n in lowered), "text")
    label_col = label_col or next((lowered[n] for n in LABEL_NAMES if n in lowered), "label")
    for col in (text_col, label_col):
        if col not in header:
            raise MLPSurgeryError(f"{path} has no column {col!r} (columns: {header}); name them with "
                                  "PATH:text=COL,label=COL")
    texts = [str(r.get(text_col) or "") for r in records]
    labels = [str(r.get(label_col) or "") for r in records]
    return texts, labels


def read_labelled(path: str | Path, text_col: str | None = None, label_col: str | None = None,
                  classes: list[str] | None = None, split: str | None = None) -> LabelledSet:
    """A labelled text set. Bundled: 'r8-train', 'r8-test'. Files: .tab (Orange), .tsv, .csv, .jsonl; tables read
    through `datasets`: .parquet and save_to_disk folders (`PATH:text=COL,label=COL` or the arguments name the
    columns). A DatasetDict folder needs `split`: 'train' reads its train split, 'heldout' its test (else
    validation) split; or give one split's folder. Rows with empty text or label are dropped.
    Pass `classes` to keep the class numbering of another split (unknown labels are an error)."""
    text = str(path)
    if split not in (None, "train", "heldout"):
        raise MLPSurgeryError(f"split must be 'train' or 'heldout', not {split!r}")
    if text in BUNDLED_LABELLED:
        import io

        rows = [r for r in csv.reader(io.StringIO(_bundled(f"reuters-{text}.tab.gz")), delimiter="\t") if r][3:]
        texts, labels = [r[1] for r in rows], [r[0] for r in rows]
    else:
        spec, opts = split_spec(path)
        text_col, label_col = text_col or opts.get("text"), label_col or opts.get("label")
        p = Path(spec).expanduser()
        text = spec
        if not p.exists():
            raise MLPSurgeryError(f"labelled data {text!r} does not exist; give a .tab/.csv/.jsonl/.parquet file, a "
                                  f"datasets folder (save_to_disk), or one of {', '.join(BUNDLED_LABELLED)}")
        if is_datasets_folder(p) or (p.is_file() and table_format(p) == "parquet"):
            texts, labels = _table_labelled(p, text_col, label_col, split)
        else:
            texts, labels = _labelled_rows(p, text_col, label_col)
    keep = [i for i, (t, y) in enumerate(zip(texts, labels)) if t.strip() and y.strip()]
    texts, labels = [texts[i] for i in keep], [labels[i] for i in keep]
    if not texts:
        raise MLPSurgeryError(f"labelled data {text!r} has no rows with both text and label")
    if classes is None:
        classes = sorted(set(labels))
    unknown = sorted(set(labels) - set(classes))
    if unknown:
        raise MLPSurgeryError(f"labels {unknown} of {text!r} are not among the classes {classes}")
    index = {c: i for i, c in enumerate(classes)}
    return LabelledSet(texts, [index[y] for y in labels], list(classes), name=Path(text).name)
