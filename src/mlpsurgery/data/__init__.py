"""Text for calibration, training and evaluation.

Corpora become fixed-length token blocks with a train / held-out split that never overlaps:
- the bundled default (`austen`: six Jane Austen novels, public domain, shipped in the package):
  five novels train, *Persuasion* is held out whole;
- any other corpus (a text file, a folder of .txt / .txt.gz files, a table): from ten documents on, every 10th
  is held out whole; a corpus of fewer holds out the last `heldout` fraction of every document's tokens; or name
  whole documents to hold out.
Blocks are cut inside one document and one side of the split; documents shorter than one block (tweets, reviews)
are joined end to end, each followed by the tokenizer's EOS, and that stream is cut the same way.

Labelled sets (texts with one class each) load from the tab-separated format of Orange (three header
lines: names, types, flags with `class` on the label column), CSV or JSONL; the Reuters R8 train/test
sets are bundled as `r8-train` / `r8-test`.

Tables the field publishes data in are read through the `datasets` library, for corpora and labelled sets
alike: a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, a `.parquet` file, and for
corpora also `.jsonl` / `.json` / `.csv` (each row one document); Orange `.tab` and `.tsv` files are read here
(labelled.py), as labelled sets and as corpora (each row one document). Columns: the text column is the one named
text, content or sentence, else the only string column; the label column is the one named label, labels,
class or category. Name them by appending `:text=COL` and/or `:label=COL` to the path (`tweets.parquet:text=body,label=author`),
which works wherever a command takes data. A DatasetDict with a `train` split and a `test` (else `validation`)
split keeps the dataset's own split: train trains, test (or validation) is held out, whole documents.

Files: sources.py (the bundled texts, text files), tables.py (tables through `datasets`), corpus.py (corpora,
tokenized and cut into blocks), labelled.py (labelled sets).
"""

from .corpus import (TokenizedCorpus, backend_encode, check_data, default_bos, default_heldout, encode, load_corpus,
                     read_corpus, text_blocks, tokenize_corpus)
from .labelled import LabelledSet, read_labelled
from .sources import AUSTEN, AUSTEN_HELDOUT, BUNDLED_CORPORA, BUNDLED_LABELLED, Document
from .tables import (HELDOUT_SPLITS, LABEL_NAMES, TABLE_FORMATS, TEXT_NAMES, is_datasets_folder, is_table, label_column,
                     label_values, read_table, split_spec, table_format, text_column)

__all__ = ["AUSTEN", "AUSTEN_HELDOUT", "BUNDLED_CORPORA", "BUNDLED_LABELLED", "Document", "HELDOUT_SPLITS",
           "LABEL_NAMES", "LabelledSet", "TABLE_FORMATS", "TEXT_NAMES", "TokenizedCorpus", "backend_encode", "check_data",
           "default_bos", "default_heldout", "encode", "is_datasets_folder", "is_table", "label_column", "label_values",
           "load_corpus", "read_corpus", "read_labelled", "read_table", "split_spec", "table_format", "text_blocks",
           "text_column", "tokenize_corpus"]
