"""The GPU smoke script's harness (benchmarks/gpu_smoke.py), run here CPU against CPU on a small synthetic llama:
each command runs on both sides in folders of its own, its output is compared, `unlock` is checked bit for bit."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_harness_runs_and_compares(tmp_path):
    out = tmp_path / "smoke.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py"), "--device", "cpu", "--params", "2e6",
                        "--d", "64", "--threads", "1", "--only", "lock key,unlock,nest", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {row["command"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"lock key", "unlock", "nest"}
    assert all(row["ok"] and row["logits_rel_diff"] <= 1e-5 for row in rows.values()), rows  # CPU against CPU
    assert rows["unlock"]["unlock_exact"] is True
