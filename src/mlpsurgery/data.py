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
"""

from __future__ import annotations

import csv
import gzip
import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from .errors import MLPSurgeryError

AUSTEN = ("austen_emma", "austen_mansfieldpark", "austen_northangerabbey", "austen_prideprejudice",
          "austen_sensesensibility", "austen_persuasion")
AUSTEN_HELDOUT = ("austen_persuasion",)
BUNDLED_CORPORA = ("austen", "r8")
BUNDLED_LABELLED = ("r8-train", "r8-test")


@dataclass
class Document:
    name: str
    text: str


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


def read_corpus(path: str | Path | None = None) -> list[Document]:
    """Documents of a corpus: None or 'austen' (bundled), 'r8' (bundled Reuters news, one document per
    article), a text file, or a folder of .txt / .txt.gz files (sorted by name)."""
    if path is None or str(path) == "austen":
        return [Document(n, _bundled(n + ".txt.gz")) for n in AUSTEN]
    if str(path) == "r8":
        ds = read_labelled("r8-test")
        return [Document(f"r8-{i:04d}", t) for i, t in enumerate(ds.texts)]
    p = Path(path).expanduser()
    if not p.exists():
        raise MLPSurgeryError(f"corpus {str(path)!r} does not exist; give a text file, a folder of .txt files, "
                              f"or one of the bundled corpora: {', '.join(BUNDLED_CORPORA)}")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.name.endswith((".txt", ".txt.gz")) and f.is_file())
        if not files:
            raise MLPSurgeryError(f"folder {p} has no .txt or .txt.gz files")
        docs = [Document(f.name.removesuffix(".gz").removesuffix(".txt"), _read_text(f)) for f in files]
    else:
        docs = [Document(p.name.removesuffix(".gz").removesuffix(".txt"), _read_text(p))]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise MLPSurgeryError(f"corpus {p} is empty")
    return docs


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens, however long (no truncation, no length warning)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # Some tokenizer.json files (all-MiniLM-L6-v2's) carry truncation and padding to 128 tokens, which
        # the backend applies to every encode: lift them for this call, then put them back.
        trunc, pad = backend.truncation, backend.padding
        backend.no_truncation()
        backend.no_padding()
        try:
            return backend.encode(text, add_special_tokens=False).ids
        finally:
            if trunc is not None:
                backend.enable_truncation(**trunc)
            if pad is not None:
                backend.enable_padding(**pad)
    return tokenizer.encode(text, add_special_tokens=False)


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


def tokenize_corpus(docs: list[Document], tokenizer, heldout: float | list[str] | tuple[str, ...] | None = None,
                    source: str = "") -> TokenizedCorpus:
    """Split documents into train and held-out token sequences.

    heldout: a fraction in (0, 1) of each document's tokens (its tail), or the names of whole documents to
    hold out. Default: the bundled Austen corpus holds out Persuasion; anything else its last 10%.
    """
    names = [d.name for d in docs]
    if heldout is None:
        heldout = list(AUSTEN_HELDOUT) if set(AUSTEN_HELDOUT) <= set(names) and len(names) > 1 else 0.1
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
        split = f"whole documents held out: {', '.join(heldout)}"
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


def load_corpus(path: str | Path | None, tokenizer, heldout=None) -> TokenizedCorpus:
    """read_corpus + tokenize_corpus."""
    docs = read_corpus(path)
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
    text_col, label_col = text_col or "text", label_col or "label"
    for col in (text_col, label_col):
        if col not in header:
            raise MLPSurgeryError(f"{path} has no column {col!r} (columns: {header}); name them with "
                                  "--text-col / --label-col")
    texts = [str(r.get(text_col) or "") for r in records]
    labels = [str(r.get(label_col) or "") for r in records]
    return texts, labels


def read_labelled(path: str | Path, text_col: str | None = None, label_col: str | None = None,
                  classes: list[str] | None = None) -> LabelledSet:
    """A labelled text set. Bundled: 'r8-train', 'r8-test'. Rows with empty text or label are dropped.
    Pass `classes` to keep the class numbering of another split (unknown labels are an error)."""
    text = str(path)
    if text in BUNDLED_LABELLED:
        import io

        rows = [r for r in csv.reader(io.StringIO(_bundled(f"reuters-{text}.tab.gz")), delimiter="\t") if r][3:]
        texts, labels = [r[1] for r in rows], [r[0] for r in rows]
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise MLPSurgeryError(f"labelled data {text!r} does not exist; give a .tab/.csv/.jsonl file or one of "
                                  f"{', '.join(BUNDLED_LABELLED)}")
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
