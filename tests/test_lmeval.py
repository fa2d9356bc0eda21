"""lm-evaluation-harness on mlpsurgery models: real lm-eval runs on tiny models built from configs (offline, local
tasks), the plain `lm_eval` command on a stock folder, and the agreement of lm-eval's rolling log-likelihood with
measure.perplexity."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'mlpsurgery[lmeval]'; install.sh does)")

from mlpsurgery.cli import main  # noqa: E402
from mlpsurgery.data import Document, load_corpus  # noqa: E402
from mlpsurgery.errors import MLPSurgeryError  # noqa: E402
from mlpsurgery.measure import lmeval as L  # noqa: E402
from mlpsurgery.tiny import byte_tokenizer, tiny_model  # noqa: E402

# Documents that exercise every kind of window at max_length 32: shorter than one window, several full windows and a
# partial last one, and a text that repeats itself with a period of 40 bytes, so that windows 32 * k - 1 .. apart
# hold the same tokens (what lm-eval's logits cache mis-scores, see make_lm).
DOCS = [Document("repeats", "It is a truth universally acknowledged. " * 6),
        Document("short", "short one"),
        Document("emma", "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, "
                         "seemed to unite some of the best blessings of existence.")]
# |difference of summed log-likelihoods| / |sum| allowed between lm-eval and measure.perplexity on the same
# (context, target) pairs. Both take float32 logits of the same windows, in batches of other shapes (lm-eval pads
# windows to the longest of its batch, we group equal lengths), so single log-probabilities differ by float rounding,
# ~1e-7 relative (measured: 4e-9 on DOCS). A protocol difference of one token per document (the first token scored or
# not, windows shifted by one) moves the sum by ~1e-2 relative here: 1e-6 tells the two apart by four orders.
REL_TOL = 1e-6


@pytest.fixture(scope="module")
def sharp():
    """A tiny llama whose predictions depend strongly on context (large random weights): a window that starts one
    token off changes its scores, so the agreement test has the power to see a protocol mismatch."""
    return tiny_model("llama", initializer_range=0.5)


def test_rolling_loglikelihood_equals_our_perplexity_with_the_prefix_token(sharp):
    tok = byte_tokenizer()
    a = L.rolling_agreement(sharp, tok, DOCS, max_length=32, batch_size=4)
    lm, ours = a["lm_eval"], a["matched"]
    n_tokens = sum(len(tok(d.text)["input_ids"]) for d in DOCS)
    assert lm["tokens"] == ours["tokens"] == n_tokens  # lm-eval scores every token, the first after its prefix
    assert a["abs_diff_loglikelihood"] <= REL_TOL * abs(lm["loglikelihood"])
    # eval ppl's own protocol leaves each document's first token unscored and shifts windows by one: visibly different
    assert a["eval_ppl"]["tokens"] == n_tokens - len(DOCS)
    assert a["rel_diff_eval_ppl"] > 1000 * REL_TOL


def test_lm_eval_logits_cache_is_off_because_it_misscores_repeated_windows(sharp):
    """lm-eval 0.4.13 with its logits cache scores the last window of the repeating document from the wrong positions;
    make_lm turns the cache off, and with it every window agrees with a forward pass of its own."""
    from lm_eval import utils

    tok = byte_tokenizer()
    lm = L.make_lm(sharp, tok, max_length=32, batch_size=4, progress=False)
    assert lm.logits_cache is False
    ids = lm.tok_encode(DOCS[0].text)
    windows = [(None,) + w for w in map(utils.make_disjoint_window,
                                        utils.get_rolling_token_windows(ids, lm.prefix_token_id, 32, 1))]
    together = [ll for ll, _ in lm._loglikelihood_tokens(windows, disable_tqdm=True)]
    alone = [lm._loglikelihood_tokens([w], disable_tqdm=True)[0][0] for w in windows]
    assert together == pytest.approx(alone, rel=1e-5)
    lm.logits_cache = True  # what lm-eval does by default
    cached = [ll for ll, _ in lm._loglikelihood_tokens(windows, disable_tqdm=True)]
    assert abs(cached[-1] - alone[-1]) > 1.0  # the bug the setting avoids (update this test when lm-eval fixes it)


def test_corpus_task_scores_the_split_eval_ppl_uses(tmp_path):
    tok = byte_tokenizer()
    text = "".join(f"sentence number {i}, with a comma. " for i in range(200))
    (tmp_path / "a.txt").write_text(text)
    docs, why = L.corpus_documents(tmp_path / "a.txt", tok)
    corpus = load_corpus(tmp_path / "a.txt", tok)
    assert "last 10%" in why
    assert torch.equal(torch.tensor(tok(docs[0].text)["input_ids"]), corpus.heldout[0])  # the same held-out tokens
    train, _ = L.corpus_documents(tmp_path / "a.txt", tok, split="train")
    assert train[0].text + docs[0].text == text
    with pytest.raises(MLPSurgeryError, match="tokenizer decides the cut; give MODEL"):
        L.corpus_documents(tmp_path / "a.txt", None)
    held, why = L.corpus_documents(None, None)  # bundled Austen: Persuasion whole, no tokenizer needed
    assert [d.name for d in held] == ["austen_persuasion"] and "austen_persuasion" in why


def test_bundled_r8_task_data_is_what_the_builder_makes():
    rows = [json.loads(line) for line in L._bundled_r8().read_text().splitlines()]
    assert rows == L.build_r8_topics()
    assert len(rows) == 286 and max(len(r["text"].split()) for r in rows) <= L.R8_WORDS
    counts = {t: sum(r["topic"] == t for r in rows) for t in L.R8_TOPICS}
    assert counts == {"acq": 40, "crude": 40, "earn": 40, "grain": 10, "interest": 40, "money-fx": 40, "ship": 36,
                      "trade": 40}
    assert all(list(L.R8_TOPICS)[r["label"]] == r["topic"] for r in rows)


def _run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_eval_lm_cli_on_a_tiny_model(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("It is a truth universally acknowledged, that a single man. " * 12)
    out = tmp_path / "results.json"
    code, stdout, err = _run(["eval", "lm", "tiny:llama", "--data", tmp_path / "t.txt", "--limit", 6, "--max-length", 32,
                              "--agreement", "--out", out, "--json", "--quiet"], capsys)
    assert code == 0, err
    r = json.loads(stdout)
    assert set(r["tasks"]) == {L.CORPUS_TASK, L.R8_TASK}
    assert r["tasks"][L.R8_TASK]["n"] == 6 and 0 <= r["tasks"][L.R8_TASK]["acc"] <= 1
    c = r["tasks"][L.CORPUS_TASK]
    t = r["token_perplexity"][L.CORPUS_TASK]
    # lm-eval's byte perplexity and our token perplexity are the same number for a byte-level tokenizer
    assert t["token_perplexity"] == pytest.approx(c["byte_perplexity"], rel=1e-9)
    assert r["agreement"]["rel_diff_perplexity"] < REL_TOL
    written = json.loads(out.read_text())  # lm-eval's own results JSON
    assert written["results"][L.R8_TASK]["acc,none"] == r["tasks"][L.R8_TASK]["acc"]
    assert "samples" not in written
    # again without --overwrite: refused before any work, the file untouched
    before = out.read_bytes()
    code, _, err = _run(["eval", "lm", "tiny:llama", "--tasks", "r8", "--limit", 2, "--out", out, "--quiet"], capsys)
    assert code == 2 and err.count("\n") == 1 and "already exists" in err and out.read_bytes() == before
    code, stdout, _ = _run(["eval", "lm", "tiny:llama", "--tasks", "r8", "--limit", 2, "--quiet"], capsys)
    assert code == 0 and "mlpsurgery_r8" in stdout and "acc" in stdout


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "hellaswag"], "unknown task.*hellaswag.*not available offline"),
    (["--tasks", "r8", "--agreement"], "add corpus to --tasks"),
    (["--include-path", "/nonexistent/tasks", "--tasks", "r8"], "not a folder"),
    (["--max-length", "500"], "--max-length 500 exceeds the model's context of 128"),
    (["--data", "/nonexistent.txt"], "does not exist"),
    (["--tasks", ","], "no task named"),
])
def test_eval_lm_refusals_are_one_line(argv, message, capsys, tmp_path):
    out = tmp_path / "r.json"
    code, _, err = _run(["eval", "lm", "tiny:llama", "--limit", 2, "--out", out, "--quiet", *argv], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert __import__("re").search(message, err), err
    assert not out.exists()


def test_eval_lm_refuses_an_encoder(capsys):
    code, _, err = _run(["eval", "lm", "tiny:bert", "--tasks", "r8", "--limit", 2, "--quiet"], capsys)
    assert code == 2 and "causal language models" in err and err.count("\n") == 1


def test_user_task_folder(tmp_path, capsys):
    """--include-path: a task the user wrote (multiple choice over local JSONL), run beside ours; a broken one refused."""
    tasks = tmp_path / "mine"
    tasks.mkdir()
    rows = [{"q": "one plus one is", "a": 0}, {"q": "the sky is", "a": 1}]
    (tasks / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "toy.yaml").write_text(
        "task: toy_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'toy.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: ['two', 'blue']\ndoc_to_target: a\nmetric_list:\n  - metric: acc\n")
    code, stdout, err = _run(["eval", "lm", "tiny:llama", "--include-path", tasks, "--tasks", "toy_mc,r8", "--limit", 2,
                              "--json", "--quiet"], capsys)
    assert code == 0, err
    r = json.loads(stdout)
    assert r["tasks"]["toy_mc"]["n"] == 2 and "acc" in r["tasks"]["toy_mc"]
    (tasks / "broken.yaml").write_text("task: broken\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                       f"    test: {tmp_path / 'missing.jsonl'}\ntest_split: test\n"
                                       "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: ['a']\n"
                                       "doc_to_target: a\n")
    code, _, err = _run(["eval", "lm", "tiny:llama", "--include-path", tasks, "--tasks", "broken", "--quiet"], capsys)
    assert code == 2 and err.count("\n") == 1 and "lm-eval could not run broken" in err, err


def test_a_folder_mlpsurgery_wrote_evaluates_like_its_source(tmp_path, capsys):
    """`eval lm` loads through load_model: a saved folder whose MLPs are mlpsurgery modules runs in lm-eval and scores
    as the stock folder it was made from (the modules are exact replacements)."""
    import mlpsurgery as ms
    from mlpsurgery.modules.dense import DenseMLP

    tok = byte_tokenizer()
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "stock")
    tok.save_pretrained(tmp_path / "stock")
    for site in ms.find_sites(model).mlp:
        site.replace_mlp(DenseMLP.from_weights(site.read()))
    ms.save(model, tmp_path / "m", tokenizer=tok)
    assert "DenseMLP" in (tmp_path / "m" / "surgery.json").read_text()
    (tmp_path / "c.txt").write_text(DOCS[2].text * 3)
    scores = []
    for folder in ("stock", "m"):
        code, stdout, err = _run(["eval", "lm", tmp_path / folder, "--tasks", "corpus", "--data", tmp_path / "c.txt",
                                  "--split", "train", "--max-length", 32, "--json", "--quiet"], capsys)
        assert code == 0, err
        scores.append(json.loads(stdout)["token_perplexity"][L.CORPUS_TASK])
    assert scores[0]["tokens"] == scores[1]["tokens"] > 300
    assert scores[1]["loglikelihood"] == pytest.approx(scores[0]["loglikelihood"], rel=REL_TOL)


def test_write_tasks_and_the_plain_lm_eval_command(tmp_path, capsys):
    """`eval lm --write-tasks DIR` gives a folder the plain lm_eval command runs on a stock transformers folder, with
    the numbers `eval lm` gives on the same folder."""
    stock = tmp_path / "stock"
    tiny_model("llama").save_pretrained(stock)
    byte_tokenizer().save_pretrained(stock)
    import datasets

    data = tmp_path / "dd"  # held out by its own test split: whole documents, so no model (tokenizer) is needed
    datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": [DOCS[0].text]}),
                         test=datasets.Dataset.from_dict({"text": [DOCS[2].text, DOCS[1].text]})).save_to_disk(str(data))
    tasks = tmp_path / "tasks"
    code, _, err = _run(["eval", "lm", "--write-tasks", tasks, "--data", data, "--quiet"], capsys)
    assert code == 0, err
    assert [json.loads(x)["text"] for x in (tasks / "corpus.jsonl").read_text().splitlines()] == [DOCS[2].text,
                                                                                                  DOCS[1].text]
    assert {p.name for p in tasks.iterdir()} == {".mlpsurgery", "corpus.jsonl", "r8_topics.jsonl",
                                                  "mlpsurgery_corpus.yaml", "mlpsurgery_r8.yaml"}
    assert str(tasks / "r8_topics.jsonl") in (tasks / "mlpsurgery_r8.yaml").read_text()  # the final place, not a temp
    # a folder of the user's is never replaced
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    code, _, err = _run(["eval", "lm", "--write-tasks", tmp_path / "theirs", "--overwrite", "--quiet"], capsys)
    assert code == 2 and "not written by mlpsurgery" in err
    # The plain route: lm-eval loads the folder itself from its path (model "hf" and a model_args string, parsed as
    # the lm_eval command parses --model_args). In-process rather than the `lm_eval` command, which adds only its
    # argument parser and an index of lm-eval's 14,000 own tasks (14 s here); docs/lm-eval.md shows the command run.
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(model="hf", model_args=f"pretrained={stock},logits_cache=False,dtype=float32,max_length=32",
                          tasks=[L.R8_TASK, L.CORPUS_TASK], limit=4, device="cpu", batch_size=4,
                          task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    plain = res["results"][L.R8_TASK]
    code, stdout, err = _run(["eval", "lm", stock, "--tasks", "r8", "--limit", 4, "--max-length", 32, "--json",
                              "--quiet"], capsys)
    assert code == 0, err
    ours = json.loads(stdout)["tasks"][L.R8_TASK]
    assert plain["acc,none"] == ours["acc"] and plain["acc_norm,none"] == ours["acc_norm"]
    code, stdout, err = _run(["eval", "lm", stock, "--tasks", "corpus", "--data", data, "--max-length", 32, "--json",
                              "--quiet"], capsys)
    corpus = json.loads(stdout)["tasks"][L.CORPUS_TASK]
    assert res["results"][L.CORPUS_TASK]["bits_per_byte,none"] == pytest.approx(corpus["bits_per_byte"], rel=REL_TOL)


def test_plain_lm_eval_runs_a_folder_with_generated_modeling_code(tmp_path, capsys):
    """A folder whose modules transformers does not have (a fused MLP, nested projections) runs in the plain lm_eval
    route through its generated modeling code (trust_remote_code=True) and scores what `eval lm` scores."""
    import mlpsurgery as ms
    from mlpsurgery.methods import nsn
    from mlpsurgery.methods.fusion import FusionConfig, fuse

    model = tiny_model("llama")
    fuse(model, FusionConfig(width=16, layers="0", n_init=1), progress=False)
    nsn.nest(model, nsn.NSNConfig(layers="1"))
    nsn.set_rank(model, 8)
    folder = ms.save(model, tmp_path / "m", tokenizer=byte_tokenizer())
    assert json.loads((folder / "config.json").read_text())["auto_map"]
    tasks = tmp_path / "tasks"
    code, _, err = _run(["eval", "lm", "--write-tasks", tasks, "--quiet"], capsys)
    assert code == 0, err
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(model="hf", model_args=f"pretrained={folder},trust_remote_code=True,logits_cache=False,"
                                                 "dtype=float32,max_length=32",
                          tasks=[L.R8_TASK], limit=6, device="cpu", batch_size=4,
                          task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    code, stdout, err = _run(["eval", "lm", folder, "--tasks", "r8", "--limit", 6, "--max-length", 32, "--json",
                              "--quiet"], capsys)
    assert code == 0, err
    ours = json.loads(stdout)["tasks"][L.R8_TASK]
    plain = res["results"][L.R8_TASK]
    assert plain["acc,none"] == ours["acc"] and plain["acc_norm,none"] == ours["acc_norm"]


@pytest.mark.realmodel
def test_smollm2_rolling_agreement(smollm2):
    """SmolLM2 on the opening of Persuasion (about 700 tokens: two windows of 511 + 1): lm-eval and measure.perplexity
    on the same pairs agree to float rounding; docs/lm-eval.md has the whole novel."""
    from mlpsurgery.data import read_corpus

    text = read_corpus(None)[-1].text[:3000]
    a = L.rolling_agreement(smollm2.model, smollm2.tokenizer, [Document("persuasion", text)], max_length=511,
                            batch_size=4)
    assert a["same_tokens"] and a["rel_diff_perplexity"] < 1e-5
    assert 5 < a["lm_eval"]["token_perplexity"] < 60  # a 135M model on Austen: tens, not thousands
