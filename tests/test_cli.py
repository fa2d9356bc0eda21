import json
import subprocess
import sys

import pytest

from mlpsurgery.cli import main
from mlpsurgery.io import save
from mlpsurgery.tiny import tiny_model


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_json(capsys):
    code, out, _ = run(capsys, "inspect", "tiny:phi3", "--json")
    r = json.loads(out)
    assert code == 0 and r["architecture"] == "phi3" and r["mlp_inner_width"] == 64 and r["gated_mlp"]
    assert len(r["sites"]) == 2


def test_inspect_text(capsys):
    code, out, _ = run(capsys, "inspect", "tiny:bert")
    assert code == 0 and "param share" in out and "BertModel" in out


def test_eval_ppl_json(capsys, tmp_path):
    (tmp_path / "t.txt").write_text("Emma Woodhouse, handsome, clever, and rich. " * 40)
    code, out, _ = run(capsys, "eval", "ppl", "tiny:llama", "--data", str(tmp_path / "t.txt"), "--block-len", "64",
                       "--json", "--quiet")
    r = json.loads(out)
    assert code == 0 and r["ppl"] > 1 and r["protocol"]["block_len"] == 64 and r["tokens"] > 0


def test_eval_cost_against_saved_source(capsys, tmp_path):
    m = tiny_model("llama")
    m._mlpsurgery_source = "tiny:llama"
    save(m, tmp_path / "m")
    code, out, _ = run(capsys, "eval", "cost", str(tmp_path / "m"), "--json", "--repeats", "1", "--seq-len", "16")
    r = json.loads(out)
    assert code == 0 and r["reference_model"] == "tiny:llama"
    assert r["ratio"]["step_peak_bytes"] == pytest.approx(1.0)


def test_export_command(capsys, tmp_path):
    save(tiny_model("gpt2"), tmp_path / "m")
    code, out, _ = run(capsys, "export", str(tmp_path / "m"), "--out", str(tmp_path / "hf"), "--json")
    assert code == 0 and (tmp_path / "hf" / "config.json").exists()


@pytest.mark.parametrize("argv,needle", [
    (["inspect", "tiny:mamba"], "no tiny model"),
    (["inspect", "/no/such/model"], "does not exist"),
    (["eval", "ppl", "tiny:llama", "--data", "/no/such.txt"], "does not exist"),
    (["eval", "ppl", "tiny:bert", "--quiet"], "causal language model"),
    (["export", "/no/such/dir", "--out", "x"], "does not exist"),
])
def test_errors_are_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err and out == ""


def test_unsupported_architecture_from_a_folder(capsys, tmp_path):
    import transformers as T

    cfg = T.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4)
    T.MambaForCausalLM(cfg).save_pretrained(tmp_path / "mamba")
    from mlpsurgery.tiny import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path / "mamba")
    code, _, err = run(capsys, "inspect", str(tmp_path / "mamba"))
    assert code == 2 and "not supported" in err and "llama" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mamba"]


def test_every_command_has_help_and_json():
    from mlpsurgery.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    seen = 0
    for name, p in sub.choices.items():
        inner = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"]
        leaves = inner[0].choices.values() if inner else [p]
        for leaf in leaves:
            opts = {o for a in leaf._actions for o in a.option_strings}
            assert "--json" in opts and "--help" in opts, leaf.prog
            seen += 1
    assert seen >= 7


def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "mlpsurgery", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "inspect" in r.stdout
