"""Corpora: documents read from any source, tokenized, split into train / held-out without overlap, and cut into
fixed-length token blocks inside one side of the split (inside one document; the documents too short for a block
joined end to end)."""

from __future__ import annotations

import hashlib

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..errors import MLPSurgeryError
from .labelled import is_tab_separated, read_labelled, tab_separated_rows
from .sources import AUSTEN, AUSTEN_HELDOUT, BUNDLED_CORPORA, Document, _bundled, _read_text, check_data_path
from .tables import _table_documents, is_table, split_spec


def read_corpus(path: str | Path | None = None, text_col: str | None = None) -> list[Document]:
    """Documents of a corpus: None or 'austen' (bundled), 'r8' (bundled Reuters news test articles, one document
    per article), 'r8-train' (the training articles, one document per topic), A+B (a mix: both corpora's
    documents; 'austen+r8-train' keeps Persuasion held out and trains on both), a text file, a folder of .txt / .txt.gz files (sorted by name), or a table (one document per row):
    a datasets folder (save_to_disk), .parquet, .jsonl / .json, .csv, .tab (Orange) / .tsv. `PATH:text=COL` (or
    text_col) names the text column; a DatasetDict with train + test (else validation) keeps its own split (Document.split)."""
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
    check_data_path(p)
    if is_table(p):
        docs = _table_documents(p, text_col)
    elif is_tab_separated(p):
        docs = _tab_separated_documents(p, text_col)
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


def _tab_separated_documents(path: Path, text_col: str | None) -> list[Document]:
    """One document per row of an Orange .tab or a .tsv file: the column `text_col`, else Orange's text column (named
    text / content, else the first of type string), else the first named like text (TEXT_NAMES)."""
    from .tables import TEXT_NAMES

    header, records, hints = tab_separated_rows(path)
    lowered = {h.lower(): h for h in header}
    col = text_col or hints.get("text") or next((lowered[n] for n in TEXT_NAMES if n in lowered), None)
    if col is None or col not in header:
        raise MLPSurgeryError(f"{path} has no text column {col or '(none named text, content or sentence)'!r} "
                              f"(columns: {header}); name it with PATH:text=COL")
    texts = [str(r.get(col) or "") for r in records]
    prefix, width = path.name.split(".")[0], len(str(len(texts) - 1))
    docs = [Document(f"{prefix}-{i:0{width}d}", t) for i, t in enumerate(texts) if t.strip()]
    if not docs:
        raise MLPSurgeryError(f"{path} has no text: every row's {col!r} is empty")
    return docs


def check_data(spec: str | Path | None) -> None:
    """Refuse, before any work, a data argument (a corpus, a mix A+B, a table with :text=COL options, a labelled set)
    that names a path which is neither a regular file nor a folder (a FIFO, a socket, a device: see
    sources.check_data_path); bundled names and missing paths are left to the reader, which words their refusal."""
    if spec is None:
        return
    text = str(spec)
    parts = text.split("+") if "+" in text and not Path(text).expanduser().exists() else [text]
    for part in parts:
        if part:
            check_data_path(Path(split_spec(part)[0]).expanduser())


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


_ENCODED: dict[tuple[str, str], list[int]] = {}  # (tokenizer digest, text digest) -> ids, for long texts
_ENCODED_MAX = 16
_LONG = 100_000  # characters: a text worth remembering (a novel takes seconds to tokenize)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens, however long (no truncation, no length warning). A long text
    encoded by a fast tokenizer is remembered for this process (the bundled corpora are read by several steps of
    one run: calibration, recovery, evaluation), keyed by the digests of the tokenizer's full definition and the
    text, so another tokenizer or text never meets it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    key = None
    if backend is not None and len(text) >= _LONG:
        key = (hashlib.sha256(backend.to_str().encode()).hexdigest(), hashlib.sha256(text.encode()).hexdigest())
        if key in _ENCODED:
            return list(_ENCODED[key])
    enc = backend_encode(tokenizer, text)
    ids = enc.ids if enc is not None else tokenizer.encode(text, add_special_tokens=False)
    if key is not None:
        if len(_ENCODED) >= _ENCODED_MAX:
            _ENCODED.pop(next(iter(_ENCODED)))
        _ENCODED[key] = list(ids)
    return ids


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


def separator(tokenizer) -> int | None:
    """The token that ends a document for the model: the tokenizer's EOS, else its SEP (BERT), else None."""
    for name in ("eos_token_id", "sep_token_id"):
        tok = getattr(tokenizer, name, None)
        if isinstance(tok, int):
            return tok
    return None


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
    sep: int | None = None  # the token that joins documents shorter than a block (the tokenizer's EOS, else SEP)

    def sequences(self, split: str) -> list[Tensor]:
        if split not in ("train", "heldout"):
            raise MLPSurgeryError(f"split must be 'train' or 'heldout', not {split!r}")
        return self.train if split == "train" else self.heldout

    def n_tokens(self, split: str) -> int:
        return sum(len(s) for s in self.sequences(split))

    def blocks(self, split: str, block_len: int, max_blocks: int | None = None, seed: int | None = None) -> Tensor:
        """Non-overlapping (N, block_len) blocks of one split, cut inside documents; the documents shorter than one
        block (a table of tweets, reviews, short articles) are joined in order, each followed by `sep`, into one
        stream cut the same way after the others' blocks (the packing of causal-LM training, applied only where a
        document alone gives no block). With max_blocks, a subset: the first ones, or a random sample when a seed is
        given."""
        if block_len < 2:
            raise MLPSurgeryError(f"block length must be at least 2 tokens, not {block_len}")
        seqs = self.sequences(split)
        short = [s for s in seqs if len(s) < block_len]
        if short:
            tail = [] if self.sep is None else [torch.tensor([self.sep], dtype=short[0].dtype)]
            seqs = [s for s in seqs if len(s) >= block_len] + [torch.cat([p for s in short for p in [s, *tail]])]
        pieces = [s[: len(s) // block_len * block_len].view(-1, block_len) for s in seqs]
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


MANY_DOCUMENTS = 10  # from this many documents on, every 10th is held out whole


def default_heldout(docs: list[Document]) -> tuple[tuple[str, ...], str] | float:
    """The held-out rule of a corpus when none is given: (names of whole documents, why) for a DatasetDict's own
    test / validation split, for the bundled Austen (Persuasion) and for a corpus of MANY_DOCUMENTS or more (every
    10th document: the held-out text is whole documents spread over the corpus, never the tails of many short ones
    strung together); else 0.1, the last 10% of each of its few documents."""
    names = [d.name for d in docs]
    own = sorted({d.split for d in docs if d.split and d.split != "train"})
    if own and any(d.split == "train" for d in docs):
        held = tuple(d.name for d in docs if d.split in own)
        return held, f"the dataset's own split: {', '.join(own)} held out ({len(held)} whole documents), train trains"
    if set(AUSTEN_HELDOUT) <= set(names) and len(names) > 1:
        return AUSTEN_HELDOUT, f"whole documents held out: {', '.join(AUSTEN_HELDOUT)}"
    if len(docs) >= MANY_DOCUMENTS:
        held = tuple(names[MANY_DOCUMENTS - 1::MANY_DOCUMENTS])
        return held, f"every {MANY_DOCUMENTS}th document held out whole ({len(held)} of {len(docs)})"
    return 0.1


def tokenize_corpus(docs: list[Document], tokenizer, heldout: float | list[str] | tuple[str, ...] | None = None,
                    source: str = "") -> TokenizedCorpus:
    """Split documents into train and held-out token sequences.

    heldout: a fraction in (0, 1) of each document's tokens (its tail), or the names of whole documents to
    hold out. Default: `default_heldout`.
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
    return TokenizedCorpus(train, held, tn, hn, split, source=source or "corpus", bos=default_bos(tokenizer),
                           sep=separator(tokenizer))


def load_corpus(path: str | Path | None, tokenizer, heldout=None, text_col: str | None = None) -> TokenizedCorpus:
    """read_corpus + tokenize_corpus."""
    docs = read_corpus(path, text_col=text_col)
    return tokenize_corpus(docs, tokenizer, heldout=heldout, source=str(path) if path else "austen")


def text_blocks(path: str | Path | None, tokenizer, block_len: int = 256, split: str = "train",
                max_blocks: int | None = None, seed: int | None = None, heldout=None) -> Tensor:
    """(N, block_len) token blocks of one split of a corpus: the one-line way to get calibration data."""
    return load_corpus(path, tokenizer, heldout).blocks(split, block_len, max_blocks, seed)
