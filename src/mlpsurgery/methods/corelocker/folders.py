"""Folders: a locked transformers checkpoint plus a key file; unlocking into a new folder."""

from __future__ import annotations

import dataclasses
import glob
import os
import secrets
from dataclasses import asdict
from pathlib import Path
from typing import Iterable

from torch import nn

from ...errors import IntegrityError, MLPSurgeryError
from ...files import check_file_out, check_out, clean_leftovers
from ...io import loaded_from
from ...report import ends_stages, stage
from .config import CoreLockerConfig
from .keyfile import is_key_file, read_key, write_key_file
from .lock import lock_key, unlock_key
from .ranking import restore_values
from .utility import Utility, find_ratio


def _numels(model: nn.Module) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters()}


def _resolved(path: str | Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser().resolve()))


def check_lock_targets(out: str | Path, key_path: str | Path, overwrite: bool = False,
                       inputs: Iterable[str | Path | None] = ()) -> None:
    """Refuse, before any work, a locked folder and key that cannot both be written safely: a key path that
    is a folder, the same as `out`, inside it or above it, inside or equal to an input (the model folder), or
    unwritable; an `out` that cannot be written or is, holds or lies inside an input or the key."""
    out, key_path = Path(out), Path(key_path)
    inputs = [p for p in inputs if p is not None]
    o, k = _resolved(out), _resolved(key_path)
    if k == o:
        raise MLPSurgeryError(f"--key {key_path} and --out {out} are the same path; the key is a file kept apart from "
                              "the locked folder you hand out: give it a path outside --out")
    if o in k.parents:
        raise MLPSurgeryError(f"the key {key_path} would be written inside the locked folder {out}, which is what "
                              "you hand out; put the key elsewhere")
    if k in o.parents:
        raise MLPSurgeryError(f"--out {out} lies inside --key {key_path}, which is the key's file path; give the key "
                              "a path outside the locked folder")
    check_file_out(key_path, overwrite, inputs, what="key", ours=is_key_file)
    check_out(out, overwrite, [*inputs, key_path])
    _mention_staged(key_path)


def _mention_staged(key_path: Path) -> None:
    """Say so when a run killed between writing its locked folder and placing its key left the key staged beside
    --key (KEY.staged-PID-XXXXXXXX): for the locked folder that run wrote, it is the only key. Kept, never removed."""
    from ...files import _pid_alive
    from ...report import warn

    if not key_path.parent.is_dir():
        return
    for p in sorted(key_path.parent.glob(f"{glob.escape(key_path.name)}.staged-*-*")):
        pid = p.name[len(key_path.name) + len(".staged-"):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)) and is_key_file(p):
            warn(f"{p} is a key an interrupted `lock key` run (pid {pid}) wrote but did not put at {key_path}: if "
                 "that run's locked folder is still in use, this is the only key that unlocks it. It is kept; move it "
                 "where you keep keys, or delete it if that folder is gone")


def check_unlock_targets(locked: str | Path, key_path: str | Path, out: str | Path, overwrite: bool = False) -> None:
    """Refuse, before reading anything, an unlock whose inputs are missing or whose `out` cannot be written
    or is, holds or lies inside the locked folder or the key."""
    locked, key_path = Path(locked), Path(key_path)
    if not locked.is_dir():
        raise MLPSurgeryError(f"{locked} {'is not a folder' if locked.exists() else 'does not exist'}; give the "
                              "locked folder written by `mlpsurgery lock key --out`")
    if key_path.is_dir():
        raise MLPSurgeryError(f"key {key_path} is a folder; give the key file written by `mlpsurgery lock key --key`")
    if not key_path.is_file():
        raise MLPSurgeryError(f"key {key_path} does not exist; give the file written by `mlpsurgery lock key --key`")
    check_out(out, overwrite, [locked, key_path])


def _place_key(staged: Path, key_path: Path, out: Path, overwrite: bool) -> None:
    """Move the staged key to its place. The locked model is already written, so the staged key is the only
    way back: if it cannot be placed it stays where it is, and the error says where."""
    try:
        if key_path.exists() and not overwrite:
            raise FileExistsError(17, "it appeared while this command ran")
        if (key_path.exists() or key_path.is_symlink()) and (key_path.is_symlink() or not is_key_file(key_path)):
            raise FileExistsError(17, "a file that is not a key appeared there while this command ran")
        os.replace(staged, key_path)
    except OSError as e:
        raise MLPSurgeryError(f"the locked model was written to {out}, but the key could not be put at {key_path} "
                              f"({e.strerror or type(e).__name__}); the key is kept at {staged}: move it where you "
                              "keep keys, it is the only way to unlock the model") from None


@ends_stages
def lock_folder(model: nn.Module, out: str | Path, key_path: str | Path, cfg: CoreLockerConfig, tokenizer=None,
                passphrase: str | None = None, target: float | None = None, utility: Utility | None = None,
                tolerance: float | None = None, max_ratio: float = 0.5, measure: bool = False,
                overwrite: bool = False, progress: bool = True, inputs: Iterable[str | Path | None] = ()) -> dict:
    """Lock `model` (in place) at cfg.ratio, or at the ratio reaching `target` utility, and write the
    locked model as a plain transformers checkpoint in `out` plus the key in `key_path` (sealed with
    `passphrase` when given; readable by its owner only). `inputs`: the paths the model was loaded from
    (the model folder), which neither output may be, hold or lie inside. Nothing is written unless
    everything succeeded; if only placing the key fails, the key is kept beside its path and the error
    says where."""
    out, key_path = Path(out), Path(key_path)
    inputs = [*inputs, loaded_from(model)]
    check_lock_targets(out, key_path, overwrite, inputs)
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
        stage(f"{utility.name} of the original model on {utility.data}", progress)
        before = utility(model, progress=progress)
    key = lock_key(model, cfg, ranking, progress=progress)
    after = None
    if utility is not None and (measure or target is not None):
        stage(f"{utility.name} of the locked model on {utility.data}", progress)
        after = utility(model, progress=progress)
    from ...io import save

    stage("writing the key and the locked model" + (" (sealing the key: scrypt takes a moment)" if passphrase
                                                     else ""), progress)
    # the key is written first (beside its place, 0600), so a key that cannot be written stops everything
    staged = key_path.with_name(f"{key_path.name}.staged-{os.getpid()}-{secrets.token_hex(4)}")
    summary = {k: key.header[k] for k in ("config", "units_extracted", "units_eligible", "locked_fingerprint",
                                          "original_fingerprint")}
    clean_leftovers(key_path)  # a half-written hidden copy of a key a killed run was staging
    try:
        key_size = write_key_file(staged, key, _numels(model), passphrase)
        save(model, out, tokenizer=tokenizer, overwrite=overwrite, extra={"corelocker": summary},
             inputs=[*inputs, key_path])
    except BaseException:
        staged.unlink(missing_ok=True)  # no locked model was written, so this key unlocks nothing
        restore_values(model, key.positions, key.values)  # and the caller gets the model back as it came
        raise
    _place_key(staged, key_path, out, overwrite)
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


def _recorded_original(locked: Path) -> tuple[bool, str | None]:
    """The original model's fingerprint recorded in the locked folder's manifest at lock time: (whether the
    folder records one, its value). Folders locked before it was recorded, or re-saved without a manifest,
    record none."""
    from ...io import MANIFEST, read_manifest

    if not (locked / MANIFEST).is_file():
        return False, None
    extra = read_manifest(locked).get("extra")
    summary = extra.get("corelocker") if isinstance(extra, dict) else None
    if not isinstance(summary, dict) or "original_fingerprint" not in summary:
        return False, None
    recorded = summary["original_fingerprint"]
    if not isinstance(recorded, str):
        raise IntegrityError(f"{locked}: the original fingerprint its manifest records is not a digest: the folder "
                             "was edited; use the locked folder as it was written")
    return True, recorded


@ends_stages
def unlock_folder(locked: str | Path, key_path: str | Path, out: str | Path, passphrase: str | None = None,
                  overwrite: bool = False, progress: bool = False) -> dict:
    """Restore a locked folder with its key into `out`, bit for bit. A wrong, truncated or tampered key,
    a wrong passphrase or a modified locked folder is refused and nothing is written.

    What a success establishes, in the result's `check`: "authenticated" for a sealed key (AES-GCM under
    the passphrase), "consistent" for a plain one (its checksums, header and entries agree, and the restored
    model matches the original fingerprint the key carries). `cross_checked`: the original fingerprint also
    matched the one the locked folder recorded at lock time (False for folders locked before it was
    recorded), so a forged plain key must come with a forged locked folder."""
    from ...io import save
    from ...models import load_model

    out, locked = Path(out), Path(locked)
    check_unlock_targets(locked, key_path, out, overwrite)
    stage(f"reading the key {key_path}" + (" (unsealing: scrypt takes a moment)" if passphrase else ""), progress)
    key = read_key(key_path, passphrase)
    if not (locked / "config.json").exists():
        raise MLPSurgeryError(f"{locked} is not a model folder (no config.json); give the folder written by "
                              "`mlpsurgery lock key --out`")
    stage(f"loading the locked model {locked}", progress)
    loaded = load_model(locked)  # the class its manifest or config names: heads are kept
    if type(loaded.model).__name__ != key.header.get("model_class"):
        raise IntegrityError(f"{locked} holds a {type(loaded.model).__name__}, the key was made for a "
                             f"{key.header.get('model_class')}: this key does not belong to this model")
    cross_checked, recorded = _recorded_original(locked)
    stage("checking the key against the locked model, restoring, checking the original's fingerprint", progress)
    unlock_key(loaded.model, key, original=recorded if cross_checked else None, where=f"the locked folder {locked}")
    stage(f"writing the restored model to {out}", progress)
    save(loaded.model, out, tokenizer=loaded.tokenizer, overwrite=overwrite, inputs=[locked, key_path])
    return {"unlocked": str(out), "from": str(locked), "key": str(key_path), "entries_restored": key.entries,
            "original_fingerprint": key.header["original_fingerprint"], "check": key.check,
            "cross_checked": cross_checked}
