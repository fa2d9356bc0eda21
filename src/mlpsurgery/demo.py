"""The main job (`mlpsurgery demo`): a small-budget pass of all five methods on the bundled SmolLM2, each
measured on the same held-out text, each written as a folder that stock transformers then loads.

1. CoreLocker: lock 5% of the weights into a key -> held-out perplexity collapses -> unlock -> every tensor
   identical to the original (SHA-256 per tensor).
2. Nested Subspace Networks: the MLPs of the later two thirds of the layers nested (whitened SVD on calibration
   text, then each layer tuned at every rank at once on its calibration rows), perplexity at several ranks against
   the FLOPs each costs; the folder switches rank after loading (`set_rank`).
3. MLP Fusion at half the MLP width (the later two thirds of the layers), against neuron pruning at the same width,
   both calibrated (each layer on what the compressed layers before it produce: neurons clustered / scored on their
   activations there, the down projection refit).
4. TwIST: one random subnet at kappa = 6/12 of the MLP chunks and the KV groups, its narrowed projections refit on
   the calibration text (the pretrained model was not TwIST-trained, so this shows the deployment step;
   docs/twist.md has what training buys).
5. DLR-Lock of a few layers (a short phase 1), with the training-step peak memory against the original.
Then every written folder is loaded with `transformers.AutoModelForCausalLM.from_pretrained` (with
`trust_remote_code=True` where the folder carries generated modeling code) and its logits compared with
mlpsurgery.load. One table (summary.md, summary.json) and one figure (demo.png) go to the output folder;
the model folders (about 0.5 GB each) are kept only with keep_models.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from . import files
from .errors import MLPSurgeryError

CALIB_BLOCKS = 64  # x 128 tokens of the train split: what the calibrated methods see
# multi-rank local tuning of the nested start (methods/nsn/local.py), over the calibration rows: 1 epoch gives the
# sweep of 2 (75 / 50 / 33%: 59.4 / 104.7 / 225.5 against 59.4 / 104.2 / 222.7) in 20 s less (session 33)
NSN_LOCAL_EPOCHS = 1
NSN_FRACTIONS = (1.0, 0.75, 0.5, 0.33, 0.25)  # of the nested MLPs' dense FLOPs: the sweep; the row shows the second


class _Clock:
    def __init__(self, progress: bool):
        self.progress, self.stages, self.t0 = progress, {}, time.perf_counter()

    def stage(self, name: str):
        clock = self

        class _Stage:
            def __enter__(self):
                self.t = time.perf_counter()
                if clock.progress:
                    import sys

                    print(f"[demo {time.perf_counter() - clock.t0:5.0f} s] {name} ...", file=sys.stderr, flush=True)

            def __exit__(self, *exc):
                clock.stages[name] = time.perf_counter() - self.t

        return _Stage()


def _stock_load(folder: Path, probe: torch.Tensor) -> dict:
    """Load `folder` with transformers' auto class, as a user would, and compare with mlpsurgery.load."""
    import transformers

    from .io import load

    custom = (folder / "modeling_mlpsurgery.py").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=custom).eval()
    ref = load(folder) if (folder / "surgery.json").exists() else None
    with torch.no_grad():
        got = model(input_ids=probe).logits
        want = ref(input_ids=probe).logits if ref is not None else got
    return {"class": type(model).__name__, "trust_remote_code": custom,
            "max_abs_logit_diff": float((got - want).abs().max())}


def run(model_spec: str | None = None, out: str | Path = "mlpsurgery-demo", tokens: int = 1024,
        keep_models: bool = False, progress: bool = True) -> dict:
    from .data import load_corpus
    from .io import save
    from .measure.cost import compare_cost, count_params
    from .measure.perplexity import default_block_len, is_causal_lm, perplexity
    from .methods import nsn
    from .methods.corelocker import CoreLockerConfig, fingerprint, lock_folder, tensor_hashes, unlock_folder
    from .methods.dlr_lock import DLRConfig, dlr_lock
    from .methods.fusion import FusionConfig, fuse
    from .methods.twist import refit_subnet_, twist_extract
    from .models import load_model
    from .sites import find_sites

    out = Path(out)
    files.check_out(out, overwrite=True, inputs=[model_spec])  # a previous demo's folder (ours) is replaced
    clock = _Clock(progress)
    with clock.stage("load the model and the held-out text"):
        loaded = load_model(model_spec)
        model, tok = loaded.model, loaded.require_tokenizer()
        if not is_causal_lm(model):
            raise MLPSurgeryError(f"the demo needs a causal language model; {loaded.source} is not one")
        corpus = load_corpus(None, tok)
        block = default_block_len(model)
        probe = corpus.blocks("heldout", 32, max_blocks=2)
        calib = corpus.blocks("train", 128, max_blocks=CALIB_BLOCKS, seed=0)  # Persuasion is never calibrated on
        seen = f"{calib.numel():,} calibration tokens (train split)"

    def ppl(m: nn.Module) -> float:
        return perplexity(m, corpus.heldout, block_len=block, max_tokens=tokens, progress=False,
                          bos_id=corpus.bos).ppl

    def params(m: nn.Module) -> int:
        return count_params(m)["total"]

    rows: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix=".mlpsurgery-demo-", dir=out.parent if out.parent.exists() else None))
    files.mark(work, "demo-work")
    try:
        with clock.stage("original"):
            base_ppl, base_params = ppl(model), params(model)
            original_hash = fingerprint(tensor_hashes(model))
        rows.append({"method": "original", "what": loaded.source, "params": base_params, "ppl": base_ppl,
                     "data": "-"})

        with clock.stage("CoreLocker: lock 5% of the weights into a key, then unlock"):
            locked_dir, key = work / "corelocker-locked", work / "corelocker.key"
            res = lock_folder(model, locked_dir, key, CoreLockerConfig(ratio=0.05), tokenizer=tok, progress=False)
            locked_ppl = ppl(model)  # the model object is the locked one now
            unlocked = unlock_folder(locked_dir, key, work / "corelocker-unlocked")
            back = load_model(work / "corelocker-unlocked").model
            identical = fingerprint(tensor_hashes(back)) == original_hash
            del back
            from .methods.corelocker import read_key, unlock_key

            unlock_key(model, read_key(key))  # back to the original in memory for the next methods
        rows.append({"method": "CoreLocker", "folder": locked_dir, "what": f"key of {res['entries']:,} weights ({res['key_bytes'] / 2**20:.1f} "
                     f"MiB), unlocked {unlocked['check']}", "params": base_params, "ppl": locked_ppl,
                     "note": f"unlocked bit for bit: {identical}", "data": "none"})

        with clock.stage("Nested Subspace Networks: nested MLPs tuned at every rank, rank sweep"):
            nested = copy.deepcopy(model)
            nsn.nest(nested, nsn.NSNConfig(layers="last2/3"), calib_data=calib, local_epochs=NSN_LOCAL_EPOCHS)
            nsn.set_budget(nested, max(NSN_FRACTIONS))  # components past the break-even rank were never tuned, and
            nsn.truncate(nested)  # without them the checkpoint of every rank is no larger than the dense MLPs
            ranks = sorted({nsn.budget_rank(nested, f) for f in NSN_FRACTIONS}, reverse=True)
            sweep = []
            for r in ranks:
                nsn.set_rank(nested, r)
                sweep.append({"rank": r, "mlp_flops": nsn.nested_flops(nested)["fraction"], "ppl": ppl(nested)})
            shown = ranks[1] if len(ranks) > 1 else ranks[0]
            nsn.set_rank(nested, shown)
            nsn_folder = save(nested, work / "nsn", tokenizer=tok)
            nsn_params = params(nested)
            del nested
        at = next(s for s in sweep if s["rank"] == shown)
        rows.append({"method": "NSN", "folder": nsn_folder, "what": "one nested checkpoint of the MLPs in the last two "
                     "thirds of the layers (whitened SVD, tuned at every rank at once), rank chosen at "
                     f"inference; here rank {shown}", "params": nsn_params, "ppl": at["ppl"],
                     "data": seen + f", sequential, {NSN_LOCAL_EPOCHS:g} "
                             f"epoch{'s' if NSN_LOCAL_EPOCHS != 1 else ''} of local tuning",
                     "note": f"{at['mlp_flops']:.0%} of their FLOPs; at "
                             + " / ".join(f"{s['mlp_flops']:.0%}" for s in sweep) + ": "
                             + ", ".join(f"{s['ppl']:.0f}" for s in sweep)})

        h = find_sites(model).mlp[0].h
        for method, label in (("fusion", "MLP Fusion"), ("neuron", "neuron pruning (baseline)")):
            with clock.stage(f"{label} to width {h // 2}, calibrated"):
                m = copy.deepcopy(model)
                fuse(m, FusionConfig(width=h // 2, method=method, n_init=1), progress=False, calib_data=calib)
                how = "neurons clustered on their activations" if method == "fusion" else "neurons kept by output energy"
                rows.append({"method": label, "what": f"MLP width {h} -> {h // 2} in the last two thirds of the layers, "
                             f"{how}, down projections refit", "params": params(m), "ppl": ppl(m),
                             "folder": save(m, work / method, tokenizer=tok), "data": seen + ", sequential"})
                del m

        n_layers = len(find_sites(model))
        R = max(r for r in range(2, 13, 2) if h % r == 0)  # 12 (the paper's) where the width allows
        with clock.stage(f"TwIST: one random subnet at kappa {R // 2}/{R}"):
            shared = 2 if n_layers >= 8 else 0  # TwIST's default keeps the first and last 2 layers whole
            sub = twist_extract(model, keep=R // 2, blocks=R, seed=0, shared_first=shared, shared_last=shared)
            cut = ppl(sub)
            kv = (find_sites(sub).attn[shared].n_kv, find_sites(model).attn[shared].n_kv)
            refit_subnet_(sub, model, calib, progress=False)
            rows.append({"method": "TwIST subnet", "what": f"random subnet, {R // 2} of {R} MLP chunks and {kv[0]} of "
                         f"{kv[1]} KV groups (first / last {shared} layers whole), of the pretrained model; its narrowed "
                         "MLPs' down and attention's output projections refit", "params": params(sub),
                         "ppl": ppl(sub), "note": f"not TwIST-trained (docs/twist.md); {cut:,.0f} before the refit",
                         "data": seen + ", sequential (the subnet itself is drawn without data)",
                         "folder": save(sub, work / "twist", tokenizer=tok)})
            del sub

        chosen = sorted({n_layers // 6, n_layers // 2, (5 * n_layers) // 6})
        with clock.stage(f"DLR-Lock of {len(chosen)} layers (short phase 1) and its training memory"):
            d = copy.deepcopy(model)
            train = corpus.blocks("train", 128, max_blocks=16, seed=0)
            # 30 phase-1 steps, no on-policy ones: 45.0 on the held-out text against 43.9 after 60 + 20 on-policy,
            # in 24 s instead of 53 (at this size the on-policy steps do not pay: 30 + 10 gave 44.5 in 34 s;
            # benchmarks/notes/demo_short_tuning.py, docs/notes/calibration.md)
            cfg = DLRConfig(rank=16, layers=",".join(map(str, chosen)), calib_blocks=16, block_len=128,
                            phase1_steps=30, phase1_tokens=256, phase2_steps=0, onpolicy_steps=0, compile=False)
            rep = dlr_lock(d, train, train[:2], cfg, work / "dlr-work", progress=False)
            batch = corpus.blocks("train", 128, max_blocks=2, seed=1)
            cost = compare_cost(model, d, batch, repeats=0, warmup=0)  # the peaks alone
            factor = cost["ratio"]["step_peak_bytes"]
            rows.append({"method": "DLR-Lock", "what": f"MLPs of layers {chosen} -> DLR-Nets (rank 16, depth {rep.depth}), "
                         f"{cfg.phase1_steps} phase-1 steps"
                         + (f" + {cfg.onpolicy_count} on-policy" if cfg.onpolicy_count else ""),
                         "params": params(d), "ppl": ppl(d),
                         "note": f"training-step peak memory {factor:.2f}x the original's (batch 2 x 128)",
                         "data": f"{train.numel():,} training tokens (train split)",
                         "folder": save(d, work / "dlr", tokenizer=tok)})
            del d

        with clock.stage("load every folder in stock transformers"):
            for row in rows:
                folder = row.pop("folder", None)
                if folder is not None:
                    row["stock"] = _stock_load(folder, probe)
        result = {"model": loaded.source, "heldout": {"documents": corpus.heldout_names, "tokens": tokens,
                                                       "block_len": block},
                  "rows": rows, "nsn_sweep": sweep, "stages_s": clock.stages}
        result["seconds"] = time.perf_counter() - clock.t0
        with files.atomic_dir(out, overwrite=True, kind="demo") as tmp:
            (tmp / "summary.json").write_text(json.dumps(result, indent=2, default=str))
            (tmp / "summary.md").write_text(table_markdown(result) + "\n")
            plot(result, tmp / "demo.png")
            if keep_models:
                (tmp / "models").mkdir()
                for child in work.iterdir():
                    if child.is_dir() and not child.name.endswith("-work"):
                        child.rename(tmp / "models" / child.name)
                if (work / "corelocker.key").exists():
                    (work / "corelocker.key").rename(tmp / "models" / "corelocker.key")
        result["out"] = str(out)
        result["figure"] = str(out / "demo.png")
        return result
    finally:
        files.remove_ours(work)


def table_rows(result: dict) -> list[dict]:
    base = result["rows"][0]
    out = []
    for r in result["rows"]:
        stock = r.get("stock")
        out.append({"method": r["method"], "what": r["what"], "params": f"{r['params'] / base['params']:.2f}x",
                    "held-out ppl": f"{r['ppl']:,.1f}", "x original": f"{r['ppl'] / base['ppl']:,.2f}",
                    "data seen": r.get("data", "?"),
                    "stock transformers": "-" if stock is None else
                    (f"{'trust_remote_code, ' if stock['trust_remote_code'] else ''}max |dlogit| "
                     f"{stock['max_abs_logit_diff']:.1e}"),
                    "note": r.get("note", "")})
    return out


def table_markdown(result: dict) -> str:
    from .report import table

    h = result["heldout"]
    return (f"mlpsurgery demo on {result['model']}: held-out perplexity on {h['tokens']} tokens of "
            f"{', '.join(h['documents'])} (windows of {h['block_len']}), {result['seconds']:.0f} s\n\n"
            + table(table_rows(result), markdown=True))


def plot(result: dict, path: Path) -> None:
    from .report import save_figure

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [r["method"] for r in rows]
    ax1.barh(names[::-1], [r["ppl"] for r in rows][::-1], color="#4C72B0")
    ax1.set_xscale("log")
    ax1.axvline(rows[0]["ppl"], color="k", lw=0.8, ls="--")
    ax1.set_xlabel("held-out perplexity (log scale; dashed: original)")
    ax1.set_title("every method, same text")
    sweep = result["nsn_sweep"]
    ax2.plot([s["mlp_flops"] for s in sweep], [s["ppl"] for s in sweep], "o-", label="NSN (whitened SVD, local-tuned)")
    for s in sweep:
        ax2.annotate(f"r={s['rank']}", (s["mlp_flops"], s["ppl"]), textcoords="offset points", xytext=(4, 4),
                     fontsize=8)
    ax2.axhline(rows[0]["ppl"], color="k", lw=0.8, ls="--", label="original")
    ax2.set_yscale("log")
    ax2.set_xlabel("FLOPs per token of the nested MLPs vs dense")
    ax2.set_ylabel("held-out perplexity")
    ax2.set_title("one nested checkpoint, rank chosen at inference")
    ax2.legend()
    fig.suptitle(f"mlpsurgery demo: {result['model']}")
    save_figure(fig, path)
