"""Folders mlpsurgery writes run in stock transformers: every method's output on llama, gpt2, opt and bert is
loaded in a subprocess where mlpsurgery cannot be imported, with trust_remote_code=True: the same logits as
mlpsurgery.load (max |diff| printed), generate() on the causal models, the runtime rank of nested models; the
same folders without trust_remote_code: a refusal, never random weights. And the rules that keep the module
files copyable."""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mlpsurgery as ms
from conftest import outputs
from mlpsurgery.errors import IntegrityError
from mlpsurgery.methods import nsn
from mlpsurgery.methods.dlr_lock import locked_like
from mlpsurgery.methods.fusion import FusionConfig, fuse
from mlpsurgery.methods.pruning import magnitude_prune
from mlpsurgery.methods.twist import twist_extract
from mlpsurgery.tiny import byte_tokenizer, tiny_model

IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 84, 59, 4]])


def _dlr(m):
    return locked_like(m, rank=4, depth=3)


def _nest(m):
    nsn.nest(m)
    n = len(ms.find_sites(m))
    nsn.set_rank(m, [5 + i for i in range(n)])  # per-layer ranks
    return m


def _fuse(m):
    fuse(m, FusionConfig(width=16, layers="0", n_init=1), progress=False)  # one layer: widths differ
    return m


def _svd(m):
    fuse(m, FusionConfig(width=8, layers="all", method="svd"), progress=False)
    return m


def _twist(m):
    return twist_extract(m, keep=2, blocks=4, parts="both", shared_first=1, shared_last=0, seed=1)


def _prune(m):
    magnitude_prune(m, 0.5, parts="ffn")
    return m


def _heads(m):
    sites = ms.find_sites(m)
    return ms.subset_model(m, attn_groups={0: list(range(sites.attn[0].n_kv))[:1]})


METHODS = {"dlr": _dlr, "nest": _nest, "fuse": _fuse, "svd": _svd, "twist": _twist, "prune": _prune,
           "heads": _heads}
ARCHS = ("llama", "gpt2", "opt", "bert")
CUSTOM_CODE = {"dlr", "nest", "fuse", "svd", "twist", "heads"}  # "prune" stays a stock folder (masks apart)


LOADER = r"""
import json, sys
class NoMlpsurgery:  # prove the folder needs nothing of mlpsurgery
    def find_spec(self, name, path=None, target=None):
        if name == "mlpsurgery" or name.startswith("mlpsurgery."):
            raise ImportError("mlpsurgery is not importable in this process")
sys.meta_path.insert(0, NoMlpsurgery())
sys.path = [p for p in sys.path if not p.endswith("/src")]
import torch, transformers
jobs = json.loads(sys.argv[1])
out = {}
for job in jobs:
    folder, auto = job["folder"], getattr(transformers, job["auto"])
    ids = torch.tensor(job["ids"])
    row = {}
    try:
        auto.from_pretrained(folder)
        row["without_trust"] = "loaded"
    except Exception as e:
        row["without_trust"] = type(e).__name__ + ": " + " ".join(str(e).split())
    model = auto.from_pretrained(folder, trust_remote_code=True).eval()
    row["class"] = type(model).__name__
    with torch.no_grad():
        o = model(input_ids=ids)
        got = o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state
        ref = torch.load(job["ref"])
        row["max_abs_diff"] = float((got - ref).abs().max())
        row["same_shape"] = list(got.shape) == list(ref.shape)
        if job.get("generate"):
            row["generated"] = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).tolist()
        if job.get("rank"):
            model.set_rank(job["rank"])
            rk = model(input_ids=ids).logits
            row["rank_diff"] = float((rk - torch.load(job["rank_ref"])).abs().max())
            row["budget_rank"] = model.set_budget(0.5)
    out[job["name"]] = row
print("RESULT" + json.dumps(out))
"""


def _run_loader(jobs: list[dict]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-c", LOADER, json.dumps(jobs)], capture_output=True, text=True, env=env,
                       stdin=subprocess.DEVNULL, timeout=600)
    assert r.returncode == 0 and "RESULT" in r.stdout, r.stderr[-4000:]
    return json.loads(r.stdout.split("RESULT", 1)[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_every_method_loads_in_stock_transformers_exactly(tmp_path, arch):
    jobs, expected = [], {}
    for name, method in METHODS.items():
        if arch == "bert" and name in ("twist",):
            continue  # TwIST blocks are a decoder method
        base = tiny_model(arch)
        model = method(copy.deepcopy(base)).eval()
        folder = ms.save(model, tmp_path / name, tokenizer=byte_tokenizer())
        again = ms.load(folder)
        ref = outputs(again, IDS)
        assert torch.equal(ref, outputs(model, IDS))  # mlpsurgery's own round trip is exact
        torch.save(ref, tmp_path / f"{name}.pt")
        decoder = arch != "bert"
        job = {"name": name, "folder": str(folder), "auto": "AutoModelForCausalLM" if decoder else "AutoModel",
               "ids": IDS.tolist(), "ref": str(tmp_path / f"{name}.pt"), "generate": decoder}
        if name == "nest" and decoder:
            nsn.set_rank(again, 3)
            torch.save(outputs(again, IDS), tmp_path / "nest_r3.pt")
            job.update(rank=3, rank_ref=str(tmp_path / "nest_r3.pt"))
            expected["nest_budget"] = nsn.budget_rank(again, 0.5)
        jobs.append(job)
        expected[name] = (folder / "modeling_mlpsurgery.py").exists()
    rows = _run_loader(jobs)
    for name, row in rows.items():
        print(f"{arch:5s} {name:6s} {row['class']:40s} max |logit diff| {row['max_abs_diff']:.3g}; "
              f"without trust_remote_code: {row['without_trust'][:60]}")
        assert row["same_shape"] and row["max_abs_diff"] == 0.0, (name, row)
        if name in CUSTOM_CODE:
            assert expected[name] and row["class"].startswith("Mlpsurgery"), (name, row)
            assert row["without_trust"].startswith("ValueError") and "custom code" in row["without_trust"] and \
                "trust_remote_code=True" in row["without_trust"], row["without_trust"]
        else:
            assert not expected[name] and row["without_trust"] == "loaded"
        if arch != "bert":
            assert len(row["generated"][0]) == 7
        if "rank" in next(j for j in jobs if j["name"] == name):
            assert row["rank_diff"] == 0.0 and row["budget_rank"] == expected["nest_budget"]


def test_bert_classifier_head_and_base_both_load(tmp_path):
    """A fused sequence classifier: AutoModelForSequenceClassification and AutoModel (the encoder inside)."""
    model = tiny_model("bert", task="classifier", num_labels=3)
    fuse(model, FusionConfig(width=16, layers="0", n_init=1), progress=False)
    folder = ms.save(model, tmp_path / "cls", tokenizer=byte_tokenizer())
    torch.save(model(input_ids=IDS).logits.detach(), tmp_path / "cls.pt")
    torch.save(model.bert(input_ids=IDS).last_hidden_state.detach(), tmp_path / "enc.pt")
    rows = _run_loader([
        {"name": "cls", "folder": str(folder), "auto": "AutoModelForSequenceClassification", "ids": IDS.tolist(),
         "ref": str(tmp_path / "cls.pt")},
        {"name": "enc", "folder": str(folder), "auto": "AutoModel", "ids": IDS.tolist(), "ref": str(tmp_path / "enc.pt")}])
    assert rows["cls"]["max_abs_diff"] == 0.0 and rows["cls"]["class"] == "MlpsurgeryBertForSequenceClassification"
    assert rows["enc"]["max_abs_diff"] == 0.0 and rows["enc"]["class"] == "MlpsurgeryBertModel"


def test_a_tampered_or_missing_modeling_file_is_refused(tmp_path):
    model = _dlr(tiny_model("llama"))
    folder = ms.save(model, tmp_path / "m")
    (folder / "mlpsurgery_dlr.py").write_text((folder / "mlpsurgery_dlr.py").read_text() + "\nimport os\n")
    with pytest.raises(IntegrityError, match="mlpsurgery_dlr.py does not match the checksum"):
        ms.load(folder)
    folder2 = ms.save(model, tmp_path / "m2")
    (folder2 / "modeling_mlpsurgery.py").unlink()
    with pytest.raises(IntegrityError, match="no modeling_mlpsurgery.py"):
        ms.load(folder2)


def test_export_gives_a_plain_folder_where_it_can_and_modeling_code_where_it_cannot(tmp_path):
    """Uniform fusion and a nested model folded at one rank export plain; fusion of one layer exports as resized
    stock linears with modeling code; mlpsurgery.load gives the same logits as the source either way."""
    cases = {"uniform": lambda m: fuse(m, FusionConfig(width=16, layers="all", n_init=1), progress=False),
             "one-layer": lambda m: fuse(m, FusionConfig(width=16, layers="0", n_init=1), progress=False),
             "nested": lambda m: (nsn.nest(m), nsn.set_rank(m, 6))}
    for name, apply in cases.items():
        model = tiny_model("llama")
        apply(model)
        src = ms.save(model, tmp_path / f"{name}-src")
        out = ms.export(src, tmp_path / name)
        plain = not (out / "modeling_mlpsurgery.py").exists()
        assert plain == (name != "one-layer"), name
        if plain:
            import transformers as T

            loaded = T.AutoModelForCausalLM.from_pretrained(out).eval()
        else:
            loaded = ms.load(out)
        torch.testing.assert_close(outputs(loaded, IDS), outputs(model, IDS), rtol=1e-4, atol=1e-5)


def test_module_files_stay_copyable():
    """What lets a folder carry copies of modules/*.py: they import only the standard library, torch,
    transformers, ..errors and their siblings (library names only for methods inference never calls), and never
    relatively inside a function."""
    from mlpsurgery import standalone

    root = Path(standalone.__file__).parent / "modules"
    for path in sorted(root.glob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node in tree.body, f"{path.name}: relative import inside a function"
                spec = "." * node.level + (node.module or "")
                ok = spec.startswith(".") and not spec.startswith("..") or spec == "..errors" or \
                    all((spec, a.name) in standalone.LIBRARY_ONLY for a in node.names)
                assert ok, f"{path.name} imports {spec}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for n in names:
                    top = n.split(".")[0]
                    assert top in ("torch", "transformers", "__future__") or top in sys.stdlib_module_names, \
                        f"{path.name} imports {n}"
    files = standalone.module_files({"DLRNet", "NestedLinear", "FusedMLP", "TruncatedSVDLinear",
                                     "NarrowGPT2Attention", "NarrowOPTAttention", "NarrowPhi3Attention"})
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and f"{node.module}.py" in files, (name, node.module)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert not any(m.split(".")[0] == "mlpsurgery" for m in mods), (name, mods)
