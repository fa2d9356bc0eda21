"""Folders: a locked transformers checkpoint plus a key file; unlocking into a new folder."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict
from pathlib import Path

from torch import nn

from ...errors import IntegrityError, MLPSurgeryError
from ...io import check_out
from .config import CoreLockerConfig
from .keyfile import read_key, save_key
from .lock import lock_key, unlock_key
from .utility import Utility, find_ratio


def _numels(model: nn.Module) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters()}


def _check_targets(out: Path, key_path: Path | None, overwrite: bool) -> None:
    check_out(out, overwrite)
    if key_path is None:
        return
    if key_path.exists() and not overwrite:
        raise MLPSurgeryError(f"{key_path} already exists; choose another --key or pass --overwrite")
    if out.resolve() in key_path.resolve().parents:
        raise MLPSurgeryError(f"the key {key_path} would be written inside the locked folder {out}, which is what "
                              "you hand out; put the key elsewhere")


def lock_folder(model: nn.Module, out: str | Path, key_path: str | Path, cfg: CoreLockerConfig, tokenizer=None,
                passphrase: str | None = None, target: float | None = None, utility: Utility | None = None,
                tolerance: float | None = None, max_ratio: float = 0.5, measure: bool = False,
                overwrite: bool = False, progress: bool = True) -> dict:
    """Lock `model` (in place) at cfg.ratio, or at the ratio reaching `target` utility, and write the
    locked model as a plain transformers checkpoint in `out` plus the key in `key_path` (sealed with
    `passphrase` when given). Nothing is written unless everything succeeded."""
    out, key_path = Path(out), Path(key_path)
    _check_targets(out, key_path, overwrite)
    if not hasattr(model, "config"):
        raise MLPSurgeryError("lock_folder writes a transformers checkpoint; for plain PyTorch models use lock_key "
                              "and save_key")
    if (target is not None or measure) and utility is None:
        raise MLPSurgeryError("a target utility (or measuring it) needs a Utility: calibration data and a metric")
    search, ranking, before = None, None, None
    if target is not None:
        search = find_ratio(model, cfg, utility, target, tolerance, max_ratio=max_ratio, progress=progress)
        cfg = dataclasses.replace(cfg, ratio=search.ratio)
        ranking, before = search.ranking, search.curve[0][utility.name]
    elif measure:
        before = utility(model)
    key = lock_key(model, cfg, ranking)
    after = utility(model) if utility is not None and (measure or target is not None) else None
    from ...io import save

    tmp_key = key_path.with_name(f".{key_path.name}.tmp-{os.getpid()}")
    key_size = save_key(key, tmp_key, _numels(model), passphrase=passphrase, overwrite=True)
    try:
        summary = {k: key.header[k] for k in ("config", "units_extracted", "units_eligible", "locked_fingerprint")}
        save(model, out, tokenizer=tokenizer, overwrite=overwrite, extra={"corelocker": summary})
        os.replace(tmp_key, key_path)
    finally:
        tmp_key.unlink(missing_ok=True)
    weights = out / "model.safetensors"
    result = {
        "locked": str(out), "key": str(key_path), "encrypted": passphrase is not None, "config": asdict(cfg),
        "units_extracted": key.header["units_extracted"], "units_eligible": key.header["units_eligible"],
        "entries": key.entries, "model_params": key.header["model_params"], "key_bytes": key_size,
        "model_bytes": weights.stat().st_size if weights.exists() else None,
        "locked_fingerprint": key.header["locked_fingerprint"],
    }
    if utility is not None and after is not None:
        result["utility"] = {"metric": utility.name, "data": utility.data, "original": before, "locked": after,
                             "chance": utility.chance}
    if search is not None:
        result["search"] = search.as_dict()
    return result


def _task_of(model_class: str) -> str:
    if model_class.endswith("ForSequenceClassification"):
        return "classifier"
    if model_class.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal-lm"
    return "encoder"


def unlock_folder(locked: str | Path, key_path: str | Path, out: str | Path, passphrase: str | None = None,
                  overwrite: bool = False) -> dict:
    """Restore a locked folder with its key into `out`, bit for bit. A wrong, truncated or tampered key,
    a wrong passphrase or a modified locked folder is refused and nothing is written."""
    from ...io import save
    from ...models import load_model

    out, locked = Path(out), Path(locked)
    _check_targets(out, None, overwrite)
    key = read_key(key_path, passphrase)
    if not (locked / "config.json").exists():
        raise MLPSurgeryError(f"{locked} is not a model folder (no config.json); give the folder written by "
                              "`mlpsurgery lock key --out`")
    loaded = load_model(locked, task=_task_of(key.header.get("model_class", "")))
    if type(loaded.model).__name__ != key.header.get("model_class"):
        raise IntegrityError(f"{locked} holds a {type(loaded.model).__name__}, the key was made for a "
                             f"{key.header.get('model_class')}: this key does not belong to this model")
    unlock_key(loaded.model, key)
    save(loaded.model, out, tokenizer=loaded.tokenizer, overwrite=overwrite)
    return {"unlocked": str(out), "from": str(locked), "key": str(key_path), "entries_restored": key.entries,
            "original_fingerprint": key.header["original_fingerprint"], "verified": True}
