"""Tables, read through the `datasets` library: save_to_disk folders, parquet, JSONL / JSON, CSV; the text and
label columns found by name or named by `PATH:text=COL,label=COL`."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import MLPSurgeryError
from .sources import Document


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
        use = [(only, ds, "")]  # one split: the usual held-out rule (corpus.default_heldout) applies
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
