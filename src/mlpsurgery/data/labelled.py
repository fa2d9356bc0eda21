"""Labelled text sets (one class per text): Orange .tab, TSV, CSV, JSONL, and tables through `datasets`."""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..errors import MLPSurgeryError
from .sources import BUNDLED_LABELLED, _bundled, _read_text, check_data_path
from .tables import LABEL_NAMES, TEXT_NAMES, _table_labelled, is_datasets_folder, split_spec, table_format


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


def is_tab_separated(path: Path) -> bool:
    """A tab-separated table this module reads itself: Orange .tab or .tsv (optionally gzipped)."""
    return path.is_file() and path.name.lower().removesuffix(".gz").endswith((".tab", ".tsv"))


def tab_separated_rows(path: Path) -> tuple[list[str], list[dict], dict[str, str]]:
    """(header, records, hints) of an Orange .tab or a .tsv file: Orange's three header lines (names, types, flags)
    give hints {'text': the first column named text / content, else the first of type string; 'label': the column
    flagged class}; a .tsv has one header line and no hints."""
    rows = [r for r in csv.reader(_read_text(path).splitlines(), delimiter="\t") if r]
    hints: dict[str, str] = {}
    if path.name.lower().removesuffix(".gz").endswith(".tab") and len(rows) >= 3 and "class" in rows[2]:
        header, types, flags, rows = rows[0], rows[1], rows[2], rows[3:]
        hints["label"] = header[flags.index("class")]
        strings = [h for h, t in zip(header, types) if t == "string"]
        named = [h for h in header if h.lower() in ("text", "content")]
        if named or strings:
            hints["text"] = (named or strings)[0]
    elif rows:
        header, rows = rows[0], rows[1:]
    else:
        header = []
    return header, [dict(zip(header, r)) for r in rows], hints


def _labelled_rows(path: Path, text_col: str | None, label_col: str | None) -> tuple[list[str], list[str]]:
    name = path.name.removesuffix(".gz")
    tabbed = name.endswith((".tab", ".tsv"))
    lines = [] if tabbed else _read_text(path).splitlines()  # (a tab-separated file is read by its own reader)
    if tabbed:
        header, records, hints = tab_separated_rows(path)
        label_col = label_col or hints.get("label")
        text_col = text_col or hints.get("text")
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
        check_data_path(p)
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
