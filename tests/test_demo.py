"""The main job on a tiny model: all five methods run, each folder loads in stock transformers exactly, the
key restores bit for bit, the table and figure are written, and a second run replaces the first's folder."""

import json

from mlpsurgery.cli import main


def test_demo_runs_every_method_and_loads_every_folder_in_transformers(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--model", "tiny:llama", "--out", str(out), "--max-tokens", "256", "--json", "--quiet"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    methods = [row["method"] for row in r["rows"]]
    assert methods == ["original", "CoreLocker", "NSN", "MLP Fusion", "neuron pruning (baseline)", "TwIST subnet",
                       "DLR-Lock"]
    stock = {row["method"]: row["stock"] for row in r["rows"] if "stock" in row}
    assert set(stock) == set(methods[1:]) and all(s["max_abs_logit_diff"] == 0.0 for s in stock.values())
    assert stock["NSN"]["trust_remote_code"] and stock["DLR-Lock"]["trust_remote_code"]
    assert not stock["CoreLocker"]["trust_remote_code"]  # a locked folder is a plain transformers checkpoint
    assert r["rows"][1]["note"] == "unlocked bit for bit: True"
    seen = {row["method"]: row["data"] for row in r["rows"]}  # the table says which data each method saw
    assert "calibration" in seen["NSN"] and "sequential" in seen["MLP Fusion"] and "calibration" in seen["TwIST subnet"]
    assert "data seen" in (out / "summary.md").read_text()
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / "summary.md").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # the model folders were temporary
    assert main(argv) == 0  # the second run replaces the first's folder (it is mlpsurgery's)
