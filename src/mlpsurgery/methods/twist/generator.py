"""The subnet generator (the paper's Algorithm 1) and the deployment draw: which of N_full blocks each subnet
holds, for one layer. Pure index arithmetic, seeded by a torch.Generator; no model is touched here."""

from __future__ import annotations

import math

import torch

from ...errors import MLPSurgeryError


def _check_subnet(n_full: int, n_sub: int, common, what: str) -> None:
    if not 1 <= n_sub <= n_full:
        raise MLPSurgeryError(f"{what}: a subnet keeps N_sub={n_sub} of N_full={n_full}; it must keep between 1 "
                              f"and {n_full}")
    if len(set(common)) > n_sub:
        raise MLPSurgeryError(f"{what}: the common set C has {len(set(common))} blocks, more than a subnet holds "
                              f"(N_sub={n_sub})")
    if any(not 0 <= int(b) < n_full for b in common):
        raise MLPSurgeryError(f"{what}: common blocks {sorted(common)} must lie in 0..{n_full - 1}")


def check_subnet_size(n_full: int, n_sub: int, workers: int, common=(), what: str = "blocks") -> None:
    """The paper's bound (N_full + (S-1)|C|) / S <= N_sub <= N_full, with a message naming the fix."""
    c = len(set(common))
    if workers < 1:
        raise MLPSurgeryError(f"the number of workers S must be at least 1, not {workers}")
    _check_subnet(n_full, n_sub, common, what)
    if n_full + (workers - 1) * c > workers * n_sub:
        need = math.ceil((n_full + (workers - 1) * c) / workers)
        raise MLPSurgeryError(
            f"{what}: S={workers} subnets of N_sub={n_sub} of N_full={n_full} blocks (|C|={c}) cannot cover every "
            f"block: (N_full + (S-1)|C|)/S = {(n_full + (workers - 1) * c) / workers:.2f} > N_sub. Keep at least "
            f"{need} blocks per subnet, use more workers (S >= {math.ceil((n_full - c) / max(n_sub - c, 1e-9))}) "
            "or a smaller common set")


def generate_blueprint(n_full: int, n_sub: int, workers: int, common=(), generator: torch.Generator | None = None
                       ) -> list[list[int]]:
    """Algorithm 1: S sorted rows of N_sub block indices, each holding C, together covering all blocks."""
    check_subnet_size(n_full, n_sub, workers, common)
    common = sorted(set(int(b) for b in common))
    taken = set(common)
    rest = [b for b in range(n_full) if b not in taken]
    rest = [rest[i] for i in torch.randperm(len(rest), generator=generator).tolist()]
    rows = [list(common) for _ in range(workers)]
    for i, b in enumerate(rest):  # every block is assigned
        rows[i % workers].append(b)
    for row in rows:  # every subnet gets N_sub blocks
        taken = set(row)
        pool = [b for b in range(n_full) if b not in taken]
        row += [pool[i] for i in torch.randperm(len(pool), generator=generator)[: n_sub - len(row)].tolist()]
    return [sorted(row) for row in rows]


def deployment_subnet(n_full: int, n_sub: int, common=(), generator: torch.Generator | None = None) -> list[int]:
    """One subnet for deployment: C plus random blocks, sorted (no coverage constraint)."""
    _check_subnet(n_full, n_sub, common, "deployment subnet")
    common = sorted(set(int(b) for b in common))
    taken = set(common)
    rest = [b for b in range(n_full) if b not in taken]
    pick = torch.randperm(len(rest), generator=generator)[: n_sub - len(common)].tolist()
    return sorted(common + [rest[i] for i in pick])


def attn_keep_for(kappa: float, n_kv: int) -> int:
    """KV groups a subnet keeps at subnet ratio kappa: round(kappa * groups), at least 1, halves up."""
    return min(n_kv, max(1, math.floor(kappa * n_kv + 0.5)))
