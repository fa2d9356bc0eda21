import gzip
import json

import pytest
import torch

from mlpsurgery.data import (AUSTEN, Document, encode, load_corpus, read_corpus, read_labelled, tokenize_corpus)
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


# ---- tables read through `datasets`: save_to_disk folders, parquet, JSONL, CSV ---------------------------------

datasets = pytest.importorskip("datasets", reason="the datasets package is not installed (bash install.sh)")
NEWS = [f"story number {i} about markets, rates and the weather in town. " * 3 for i in range(6)]


@pytest.fixture(autouse=False)
def private_tmp(tmp_path, monkeypatch):
    """Temporary files of the readers go here, so a test can see that nothing outlives a read."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    return scratch


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "json", "csv", "jsonl.gz"])
def test_corpus_from_table_files(tmp_path, tokenizer, private_tmp, fmt):
    ds = datasets.Dataset.from_dict({"id": list(range(6)), "content": NEWS, "source": ["wire"] * 6})
    path = tmp_path / f"news.{fmt}"
    if fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "csv":
        ds.to_csv(str(path), index=False)
    elif fmt == "jsonl.gz":
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ds).encode()))
    else:
        ds.to_json(str(path), lines=True)
    docs = read_corpus(path)  # two string columns: the one named 'content' is the text
    assert [d.text for d in docs] == NEWS and docs[0].name == "news-0" and docs[0].split == ""
    c = load_corpus(path, tokenizer)
    assert "last 10%" in c.split and len(c.heldout) == 6
    assert not list(private_tmp.iterdir())  # the Arrow cache of the read is gone


def test_corpus_table_columns(tmp_path):
    datasets.Dataset.from_dict({"n": [1, 2], "body": ["one text", "two text"]}).to_parquet(str(tmp_path / "a.parquet"))
    assert [d.text for d in read_corpus(tmp_path / "a.parquet")] == ["one text", "two text"]  # the only string column
    datasets.Dataset.from_dict({"a": ["x", "y"], "b": ["first", "second"]}).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(MLPSurgeryError, match=r"several string columns \(a, b\).*:text=COL"):
        read_corpus(tmp_path / "b.parquet")
    assert [d.text for d in read_corpus(f"{tmp_path / 'b.parquet'}:text=b")] == ["first", "second"]
    assert [d.text for d in read_corpus(tmp_path / "b.parquet", text_col="b")] == ["first", "second"]
    with pytest.raises(MLPSurgeryError, match=r"no column 'c' \(columns: a \(string\), b \(string\)\)"):
        read_corpus(f"{tmp_path / 'b.parquet'}:text=c")
    with pytest.raises(MLPSurgeryError, match="holds int64, not text"):
        read_corpus(f"{tmp_path / 'a.parquet'}:text=n")
    (tmp_path / "plain.txt").write_text("words " * 50)
    with pytest.raises(MLPSurgeryError, match="plain text, not a table"):
        read_corpus(f"{tmp_path / 'plain.txt'}:text=body")


def test_corpus_from_datasetdict_keeps_its_split(tmp_path, tokenizer):
    train = datasets.Dataset.from_dict({"text": NEWS[:4]})
    test = datasets.Dataset.from_dict({"text": NEWS[4:]})
    datasets.DatasetDict(train=train, test=test, validation=datasets.Dataset.from_dict({"text": ["unused"]})) \
        .save_to_disk(str(tmp_path / "dd"))
    docs = read_corpus(tmp_path / "dd")
    assert [d.split for d in docs] == ["train"] * 4 + ["test"] * 2  # validation is not read when test exists
    c = load_corpus(tmp_path / "dd", tokenizer)
    assert c.heldout_names == ["test-0", "test-1"] and len(c.train_names) == 4
    assert "own split: test held out (2 whole documents)" in c.split
    assert torch.equal(c.heldout[0], torch.tensor(encode(tokenizer, NEWS[4])))  # whole documents, untouched
    assert "last 10%" in load_corpus(tmp_path / "dd", tokenizer, heldout=0.1).split  # an explicit rule still wins

    datasets.DatasetDict(train=train, validation=test).save_to_disk(str(tmp_path / "dv"))
    assert load_corpus(tmp_path / "dv", tokenizer).heldout_names == ["validation-0", "validation-1"]
    # one split's folder is a Dataset folder of its own: the usual 10% rule
    one = load_corpus(tmp_path / "dd" / "test", tokenizer)
    assert one.train_names == ["test-0", "test-1"] and "last 10%" in one.split
    datasets.DatasetDict(a=train, b=test).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(MLPSurgeryError, match=r"splits a, b: it needs a 'train' split.*ab/a"):
        read_corpus(tmp_path / "ab")
    datasets.DatasetDict(train=train, test=datasets.Dataset.from_dict({"text": ["  ", ""]})).save_to_disk(
        str(tmp_path / "blank"))
    with pytest.raises(MLPSurgeryError, match="split 'test' of .* has no text"):
        read_corpus(tmp_path / "blank")


def test_labelled_from_tables(tmp_path, private_tmp):
    feats = datasets.Features({"sentence": datasets.Value("string"), "topic": datasets.Value("string"),
                               "label": datasets.ClassLabel(names=["neg", "pos"])})
    rows = {"sentence": ["good film", "bad film", "fine film", ""], "topic": ["f"] * 4, "label": [1, 0, 1, 0]}
    ds = datasets.Dataset.from_dict(rows, features=feats)
    ds.to_parquet(str(tmp_path / "s.parquet"))
    got = read_labelled(tmp_path / "s.parquet")  # ClassLabel ids become their names; the empty row is dropped
    assert got.texts == ["good film", "bad film", "fine film"] and got.classes == ["neg", "pos"] and got.labels == [1, 0, 1]
    ds.save_to_disk(str(tmp_path / "one"))
    assert read_labelled(tmp_path / "one").texts == got.texts  # a Dataset folder
    test = datasets.Dataset.from_dict({"sentence": ["awful film", "great film"], "topic": ["f", "f"], "label": [0, -1]},
                                      features=feats)
    datasets.DatasetDict(train=ds, test=test).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(MLPSurgeryError, match=r"splits train, test: name the one to read, .*dd/train or .*dd/test"):
        read_labelled(tmp_path / "dd")  # which side it plays is the caller's to say: never guessed
    held = read_labelled(tmp_path / "dd", split="heldout", classes=got.classes)
    assert held.texts == ["awful film"]  # label -1 (unlabelled) is dropped
    assert read_labelled(tmp_path / "dd", split="train").texts == got.texts
    assert read_labelled(tmp_path / "dd" / "test").texts == ["awful film"]
    # columns by name, by the suffix, or refused
    datasets.Dataset.from_dict({"body": ["a", "b"], "who": ["x", "y"]}).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(MLPSurgeryError, match="no column named label, labels, class, category.*:label=COL"):
        read_labelled(tmp_path / "t.parquet")
    named = read_labelled(f"{tmp_path / 't.parquet'}:text=body,label=who")
    assert named.texts == ["a", "b"] and named.classes == ["x", "y"] and named.name == "t.parquet"
    assert read_labelled(f"{tmp_path / 't.parquet'}:label=who").texts == ["a", "b"]  # body: the other string column
    datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0.5, 1.5]}).to_parquet(str(tmp_path / "f.parquet"))
    with pytest.raises(MLPSurgeryError, match="holds float64, not class labels"):
        read_labelled(tmp_path / "f.parquet")
    # the JSONL / CSV reader knows the same column names
    (tmp_path / "c.csv").write_text("sentence,category\nnice,pos\nugly,neg\n")
    assert read_labelled(tmp_path / "c.csv").classes == ["neg", "pos"]
    assert not list(private_tmp.iterdir())


def test_malformed_tables_are_refused_in_one_line(tmp_path, private_tmp):
    cases = {
        "empty.jsonl": (b"", "is empty"),
        "bad.jsonl": (b'{"text": "a"}\n{oops\n', r"could not be read as JSON lines \(JSON parse error.*row 1"),
        "bad.parquet": (b"PAR1 not really parquet", "could not be read as parquet .*magic bytes"),
        "header.csv": (b"text,label\n", "header.csv has no rows"),
        "numbers.csv": (b"a,b\n1,2\n3,4\n", "no text column: no column holds strings"),
    }
    for name, (body, message) in cases.items():
        (tmp_path / name).write_bytes(body)
        with pytest.raises(MLPSurgeryError, match=message) as e:
            read_corpus(tmp_path / name)
        assert "\n" not in str(e.value), name
    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})) \
        .save_to_disk(str(tmp_path / "none"))
    with pytest.raises(MLPSurgeryError, match="has no rows|could not be read as a datasets folder"):
        read_corpus(tmp_path / "none")  # (datasets itself cannot reload a folder of zero shards)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "state.json").write_text("{not json")
    (tmp_path / "broken" / "dataset_info.json").write_text("{}")
    with pytest.raises(MLPSurgeryError, match="could not be read as a datasets folder") as e:
        read_labelled(tmp_path / "broken")
    assert "\n" not in str(e.value)
    with pytest.raises(MLPSurgeryError, match="names the text column twice"):
        read_corpus(f"{tmp_path}/x.parquet:text=a,text=b")
    assert not list(private_tmp.iterdir())


def test_cli_reads_a_table(tmp_path, capsys):
    from mlpsurgery.cli import main

    datasets.Dataset.from_dict({"n": [1, 2], "body": NEWS[:2], "tag": ["a", "b"]}).to_parquet(str(tmp_path / "n.parquet"))
    assert main(["eval", "ppl", "tiny:llama", "--data", f"{tmp_path / 'n.parquet'}:text=body", "--json", "--quiet",
                 "--block-len", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["documents"] == ["n-0", "n-1"] and out["tokens"] > 0
    assert main(["eval", "ppl", "tiny:llama", "--data", str(tmp_path / "n.parquet"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "several string columns (body, tag)" in err


def test_damaged_tables_give_documents_or_a_refusal(tmp_path, private_tmp):
    """Truncated and bit-flipped parquet / JSONL / CSV files: documents or one MLPSurgeryError, never another error."""
    import random as rnd

    ds = datasets.Dataset.from_dict({"text": NEWS, "label": ["a", "b"] * 3})
    ds.to_parquet(str(tmp_path / "ok.parquet"))
    ds.to_json(str(tmp_path / "ok.jsonl"), lines=True)
    ds.to_csv(str(tmp_path / "ok.csv"), index=False)
    g = rnd.Random(0)
    for name in ("ok.parquet", "ok.jsonl", "ok.csv"):
        raw = (tmp_path / name).read_bytes()
        for trial in range(8):
            body = bytearray(raw[:g.randrange(len(raw))] if trial % 2 else raw)
            if trial % 2 == 0:
                for _ in range(3):
                    body[g.randrange(len(body))] ^= g.randrange(1, 256)
            bad = tmp_path / f"bad{trial}.{name.split('.')[1]}"
            bad.write_bytes(bytes(body))
            for read in (read_corpus, read_labelled):
                try:
                    read(bad)
                except MLPSurgeryError as e:
                    assert "\n" not in str(e)
    assert not list(private_tmp.iterdir())


def test_a_corpus_mix_holds_every_parts_documents_and_keeps_the_held_out_rule(tmp_path, tokenizer):
    train = read_labelled("r8-train")
    docs = read_corpus("austen+r8-train")
    names = [d.name for d in docs]
    assert names[:6] == list(AUSTEN) and names[6:] == [f"r8-train-{c}" for c in train.classes]
    # the Reuters training articles, one document per topic, every article exactly once; none of the test ones
    topics = {d.name: d.text.split("\n\n") for d in docs[6:]}
    assert sum(len(a) for a in topics.values()) == len(train)
    assert topics["r8-train-earn"][0] == train.texts[0]
    # no test article is added, beyond the texts R8 itself has in both splits (short identical earnings reports)
    test_articles = set(read_labelled("r8-test").texts)
    assert test_articles & {a for arts in topics.values() for a in arts} == test_articles & set(train.texts)
    c = tokenize_corpus(docs, tokenizer)
    assert c.heldout_names == ["austen_persuasion"] and len(c.train_names) == 5 + 8
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "b.txt").write_text("beta " * 50)
    assert [d.name for d in read_corpus(f"{tmp_path / 'a.txt'}+{tmp_path / 'b.txt'}")] == ["a", "b"]
    with pytest.raises(MLPSurgeryError, match="twice"):
        read_corpus(f"{tmp_path / 'a.txt'}+{tmp_path / 'a.txt'}")
    with pytest.raises(MLPSurgeryError, match="empty part"):
        read_corpus("austen+")
    with pytest.raises(MLPSurgeryError, match="does not exist"):
        read_corpus(f"austen+{tmp_path / 'missing.txt'}")


def test_tab_separated_tables_are_corpora_of_their_text_column(tmp_path, tokenizer):
    # Orange's three header lines (names, types, flags): the text column, never the metadata, one document per row
    rows = [("2016-09-28", "HillaryClinton", "a tweet about the election"), ("2016-09-29", "x", "")]
    tab = tmp_path / "tweets.tab"
    tab.write_text("Time\tAuthor\tContent\ntime\tdiscrete\tstring\n\tclass\tmeta\n"
                   + "".join(f"{a}\t{b}\t{c}\n" for a, b, c in rows))
    docs = read_corpus(tab)
    assert [d.text for d in docs] == [rows[0][2]] and docs[0].name == "tweets-0"  # the empty row is dropped
    assert [d.text for d in read_corpus(f"{tab}:text=Author")] == ["HillaryClinton", "x"]
    tsv = tmp_path / "news.tsv"
    tsv.write_text("id\ttext\n" + "".join(f"{i}\t{t}\n" for i, t in enumerate(NEWS)))
    assert [d.text for d in read_corpus(tsv)] == NEWS
    (tmp_path / "bare.tsv").write_text("id\tbody\n1\tsome words\n")
    with pytest.raises(MLPSurgeryError, match=r"no text column.*columns: \['id', 'body'\].*:text=COL"):
        read_corpus(tmp_path / "bare.tsv")
    assert [d.text for d in read_corpus(f"{tmp_path / 'bare.tsv'}:text=body")] == ["some words"]


def test_many_documents_hold_out_whole_documents_and_few_their_tails(tokenizer):
    many = [Document(f"d{i:02d}", f"document {i} has a few words of its own. " * 3) for i in range(25)]
    c = tokenize_corpus(many, tokenizer)
    assert c.heldout_names == ["d09", "d19"] and len(c.train_names) == 23
    assert "every 10th document" in c.split
    assert all(torch.equal(h, torch.tensor(encode(tokenizer, many[i].text))) for h, i in zip(c.heldout, (9, 19)))
    few = tokenize_corpus(many[:9], tokenizer)
    assert "last 10%" in few.split and few.train_names == few.heldout_names == [d.name for d in many[:9]]


def test_documents_shorter_than_a_block_are_joined_with_the_separator(tokenizer):
    long_text, short = "a long document, " * 40, [f"short {i}." for i in range(30)]
    docs = [Document("long", long_text)] + [Document(f"s{i:02d}", t) for i, t in enumerate(short)]
    c = tokenize_corpus(docs, tokenizer, heldout=["s29"])
    assert c.sep == tokenizer.eos_token_id is not None
    blocks = c.blocks("train", 64)
    n_long = len(c.train[0]) // 64
    assert torch.equal(blocks[:n_long].flatten(), c.train[0][:n_long * 64])  # a long document's own blocks first
    joined = torch.cat([p for s in c.train[1:] for p in (s, torch.tensor([c.sep]))])
    assert len(blocks) == n_long + len(joined) // 64  # the short ones, joined, give the rest
    assert torch.equal(blocks[n_long:].flatten(), joined[:(len(blocks) - n_long) * 64])
    assert (blocks[n_long:] == c.sep).any() and not (blocks[:n_long] == c.sep).any()
    with pytest.raises(MLPSurgeryError, match="fewer than one block"):
        c.blocks("heldout", 64)  # one short document: no block, a refusal
