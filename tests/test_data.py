import gzip
import json

import pytest
import torch

from mlpsurgery.data import (AUSTEN, encode, load_corpus, read_corpus, read_labelled, tokenize_corpus)
from mlpsurgery.errors import MLPSurgeryError


def test_bundled_corpus_holds_out_persuasion(tokenizer):
    docs = read_corpus(None)
    assert [d.name for d in docs] == list(AUSTEN)
    assert docs[-1].text.lstrip().startswith("Persuasion")
    c = tokenize_corpus(docs[-2:], tokenizer)  # Sense and Sensibility + Persuasion, byte-level tokens
    assert c.heldout_names == ["austen_persuasion"] and c.train_names == ["austen_sensesensibility"]
    assert "whole documents" in c.split


def test_fraction_split_never_overlaps(tmp_path, tokenizer):
    text = "".join(f"sentence number {i}. " for i in range(400))
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(("other " + text).encode()))
    (tmp_path / "ignored.md").write_text("not a corpus file")
    c = load_corpus(tmp_path, tokenizer, heldout=0.25)
    assert c.train_names == ["a", "b"]
    for doc, tr, he in zip(read_corpus(tmp_path), c.train, c.heldout):
        full = torch.tensor(encode(tokenizer, doc.text))
        assert torch.equal(torch.cat([tr, he]), full)  # a partition of the document, in order
        assert abs(len(he) - 0.25 * len(full)) <= 1
    tr_blocks = c.blocks("train", 64)
    he_blocks = c.blocks("heldout", 64)
    assert tr_blocks.shape[1] == he_blocks.shape[1] == 64
    assert len(tr_blocks) == sum(len(t) // 64 for t in c.train)


def test_blocks_sampling_is_seeded(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("word " * 5000)
    c = load_corpus(tmp_path / "a.txt", tokenizer)
    a = c.blocks("train", 32, max_blocks=10, seed=3)
    assert torch.equal(a, c.blocks("train", 32, max_blocks=10, seed=3))
    assert len(a) == 10


def test_corpus_errors(tmp_path, tokenizer):
    with pytest.raises(MLPSurgeryError, match="does not exist"):
        read_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MLPSurgeryError, match="no .txt"):
        read_corpus(tmp_path / "empty")
    (tmp_path / "blank.txt").write_text("   \n")
    with pytest.raises(MLPSurgeryError, match="empty"):
        read_corpus(tmp_path / "blank.txt")
    (tmp_path / "short.txt").write_text("too short to make a block")
    c = load_corpus(tmp_path / "short.txt", tokenizer)
    with pytest.raises(MLPSurgeryError, match="fewer than one block"):
        c.blocks("heldout", 256)
    with pytest.raises(MLPSurgeryError, match="fraction"):
        load_corpus(tmp_path / "short.txt", tokenizer, heldout=1.5)
    with pytest.raises(MLPSurgeryError, match="not in the corpus"):
        load_corpus(tmp_path / "short.txt", tokenizer, heldout=["nope"])


def test_bundled_r8():
    train, test = read_labelled("r8-train"), read_labelled("r8-test")
    assert train.classes == test.classes and train.num_classes == 8
    assert len(train) == 5485 and len(test) == 2189
    assert train.classes[train.labels[0]] == "earn"


def test_tab_format_from_shared(shared_data):
    ds = read_labelled(shared_data / "labelled" / "election-tweets-2016.tab")
    assert ds.classes == ["HillaryClinton", "realDonaldTrump"]
    assert len(ds) > 6000
    assert any('"smart."' in t for t in ds.texts)  # doubled quotes inside quoted fields are unescaped
    r8 = read_labelled(shared_data / "labelled" / "reuters-r8-test.tab")
    assert r8.num_classes == 8


def test_csv_and_jsonl(tmp_path):
    (tmp_path / "d.csv").write_text('text,label\n"good, very good",pos\nbad,neg\n,neg\n')
    ds = read_labelled(tmp_path / "d.csv")
    assert ds.texts == ["good, very good", "bad"] and ds.classes == ["neg", "pos"] and ds.labels == [1, 0]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"body": t, "y": y}) for t, y in [("a", "x"), ("b", "y")]))
    ds = read_labelled(tmp_path / "d.jsonl", text_col="body", label_col="y")
    assert ds.labels == [0, 1]
    with pytest.raises(MLPSurgeryError, match="no column 'text'"):
        read_labelled(tmp_path / "d.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"text": "a", "label": "b"}\n{oops\n')
    with pytest.raises(MLPSurgeryError, match=r"bad.jsonl:2"):
        read_labelled(tmp_path / "bad.jsonl")
    with pytest.raises(MLPSurgeryError, match="not among the classes"):
        read_labelled(tmp_path / "d.csv", classes=["pos"])


def test_stratified_split_and_sample():
    ds = read_labelled("r8-test")
    rest, part = ds.split(0.1, seed=0)
    assert len(rest) + len(part) == len(ds)
    assert not set(rest.texts[:50]) & set(part.texts)
    for c in range(ds.num_classes):
        n = ds.labels.count(c)
        assert abs(part.labels.count(c) - 0.1 * n) <= 1
    assert len(ds.sample(100)) in range(95, 106)
