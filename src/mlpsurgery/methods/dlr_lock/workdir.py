"""The work folder's stages: each records the settings it was made with, so a resume with other settings is
refused instead of silently mixing two runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from ...errors import IntegrityError, MLPSurgeryError
from ...io import atomic_write_text


def _stage(workdir: Path, name: str, settings: dict) -> bool:
    """Whether stage `name` already finished in `workdir` with these settings. A stage started or finished
    with other settings is an error: its state would silently corrupt this run."""
    path = workdir / f"{name}.stage.json"
    if path.exists():
        try:
            old = json.loads(path.read_text())
            old["settings"], old["done"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise IntegrityError(f"{path} is damaged; delete it to recompute the {name} stage, or start with a new "
                                 "work folder") from None
        if old["settings"] != settings:
            diff = sorted(k for k in set(old["settings"]) | set(settings) if old["settings"].get(k) != settings.get(k))
            raise MLPSurgeryError(f"work folder {workdir} holds a {name} stage made with other settings ({', '.join(diff)}); "
                                  "resume with the same settings, or use (or empty) another folder")
        return bool(old["done"])
    workdir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"settings": settings, "done": False}, indent=1))
    return False


def _save_stage_file(path: Path, tensors: dict[str, Tensor]) -> None:
    """Write a stage's tensors (e.g. a net's state dict) whole or not at all: a stop mid-write leaves no
    half-written file for _stage_file to find."""
    tmp = Path(str(path) + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _stage_file(path: Path) -> dict[str, Tensor]:
    """A finished stage's tensors, or a one-line refusal when the file was damaged."""
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for damaged files
        raise IntegrityError(f"{path} in the work folder is damaged ({type(e).__name__}); delete it and its "
                             f"{path.stem.split('_')[0]}.stage.json to recompute that stage, or start with a new "
                             "work folder") from None


def _finish(workdir: Path, name: str) -> None:
    path = workdir / f"{name}.stage.json"
    state = json.loads(path.read_text())
    state["done"] = True
    atomic_write_text(path, json.dumps(state, indent=1))
