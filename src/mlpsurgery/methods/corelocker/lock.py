"""Lock and unlock a model in memory: extract the key, restore from it."""

from __future__ import annotations

from dataclasses import asdict

from torch import Tensor, nn

from ...errors import IntegrityError
from ...io import record
from ...report import ends_stages, stage
from .config import CoreLockerConfig
from .keyfile import KEY_FORMAT, KEY_VERSION, Key
from .ranking import Extraction, Ranking, _flat, apply_extraction, fingerprint, restore_values, tensor_hashes
from .units import unit_groups


@ends_stages
def lock_key(model: nn.Module, cfg: CoreLockerConfig, ranking: Ranking | None = None, progress: bool = False) -> Key:
    """Extract the key from `model` in place (the model becomes the locked model). Returns the key.
    progress: a stage line on stderr before each step (on SmolLM2 each takes seconds: hashing every tensor,
    ranking ~10^8 weights, gathering the chosen positions)."""
    cfg.validate()
    stage("hashing every tensor of the original model", progress)
    original = fingerprint(tensor_hashes(model))
    own = ranking is None
    if own:
        stage(f"ranking the {cfg.unit} units by {cfg.indicator} ({cfg.scope})", progress)
        ranking = Ranking(unit_groups(model, cfg), cfg.scope, cfg.ratio, ordered=False)  # only cfg.ratio is taken
    ranking.require_some(cfg.ratio, cfg.unit)
    stage(f"extracting {ranking.count(cfg.ratio):,} of {ranking.n_units:,} {cfg.unit} units", progress)
    extraction, n_units = ranking.take(cfg.ratio)
    n_eligible = ranking.n_units
    if own:
        del ranking  # its selection (two ids per unit) is not needed past here; the caller's is the caller's
    values = apply_extraction(model, extraction)
    stage("hashing every tensor of the locked model", progress)
    return make_key(model, cfg, extraction, values, n_units, n_eligible, tensor_hashes(model), original)


def make_key(model: nn.Module, cfg: CoreLockerConfig, extraction: Extraction, values: dict[str, Tensor],
             n_units: int, n_eligible: int, locked: dict[str, str], original: str) -> Key:
    """The key of a finished extraction (`values`: the originals, in the extraction's order; `locked`: every tensor's
    hash after it; `original`: the original model's fingerprint), recorded in the model's history."""
    header = {
        "format": KEY_FORMAT, "version": KEY_VERSION, "config": asdict(cfg),
        "model_class": type(model).__name__, "model_type": getattr(getattr(model, "config", None), "model_type", None),
        "units_extracted": n_units, "units_eligible": n_eligible,
        "entries": sum(len(p) for p, _ in extraction.values()),
        "model_params": sum(p.numel() for p in model.parameters()),
        "locked_fingerprint": fingerprint(locked), "locked_tensors": locked, "original_fingerprint": original,
    }
    record(model, "corelocker", asdict(cfg), units_extracted=n_units, units_eligible=n_eligible,
           locked_fingerprint=header["locked_fingerprint"])
    return Key({n: p for n, (p, _) in extraction.items()}, values, header)


def check_original(key: Key, original: str, where: str) -> None:
    """Refuse a key whose original fingerprint is not the one recorded apart from it (`where`: in the locked folder)."""
    if original != key.header["original_fingerprint"]:
        mine = key.header["original_fingerprint"][:16]
        raise IntegrityError(f"the key restores an original model (fingerprint {mine}...) other than the one recorded "
                             f"in {where} ({original[:16]}...): the key or the folder was altered; use the key "
                             "written with this folder")


def check_entries(key: Key, params: dict[str, Tensor]) -> None:
    """Refuse a key whose entries do not fit the model's parameters (names, counts, sizes, positions in range)."""
    for name, pos in key.positions.items():
        if name not in params or len(pos) != len(key.values[name]) or \
                (key.numels is not None and key.numels.get(name) != params[name].numel()) or \
                (len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= params[name].numel())):
            raise IntegrityError(f"the key's entry for {name} does not fit the model: the key was altered")


def unlock_key(model: nn.Module, key: Key, original: str | None = None, where: str = "the locked folder") -> None:
    """Restore `model` in place from `key`, bit for bit. Refuses (changing nothing) a model that is
    not exactly the locked model of this key, and a key whose values do not give back the original.
    `original`: the original model's fingerprint as recorded apart from the key (`where`: in the locked
    folder); the key's must be the same, so that a forged plain key also needs a forged locked folder."""
    hashes = tensor_hashes(model)
    if fingerprint(hashes) != key.header["locked_fingerprint"]:
        expected = key.header.get("locked_tensors", {})
        differ = sorted(n for n in set(hashes) | set(expected) if hashes.get(n) != expected.get(n))
        raise IntegrityError(
            "this key does not belong to this model, or the locked model was modified after locking: "
            f"{len(differ)} tensor(s) differ from the locked model the key was made for "
            f"({', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}); use the key written with this model")
    if original is not None:
        check_original(key, original, where)
    params = dict(model.named_parameters())
    check_entries(key, params)
    before = {n: _flat(params[n], n)[pos.to(params[n].device)].cpu().clone() for n, pos in key.positions.items()}
    restore_values(model, key.positions, key.values)
    if fingerprint(tensor_hashes(model)) != key.header["original_fingerprint"]:
        restore_values(model, key.positions, before)
        raise IntegrityError("the key's values do not restore the original model (its fingerprint differs): the "
                             "key was altered; use an intact copy of the key")
    record(model, "corelocker-unlock", {}, original_fingerprint=key.header["original_fingerprint"])
