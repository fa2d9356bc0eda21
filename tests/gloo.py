"""Real gloo processes for the distributed tests, forked from the test process instead of started by torchrun:
each rank gets the environment torchrun would give it (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) and runs either
`mlpsurgery ARGV` (`ranks`) or a function (`run_ranks`), starting in well under a second instead of re-importing
torch and transformers. The torchrun path itself is tested in test_twist_distributed.py."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch


def _child(rank: int, world: int, port: int, target: Callable[[], Any], log: str) -> None:
    torch.set_num_threads(1)  # a forked OpenMP pool is not usable; one thread never touches it
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.stderr = open(fd, "w", closefd=False)  # not pytest's capture objects
    code = 1
    try:
        code = target()
        code = code if isinstance(code, int) else 0
    except BaseException:  # noqa: BLE001 - the traceback goes to the rank's log
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(tmp_path, target: Callable[[], Any], world: int = 2, timeout: float = 120) -> list[tuple[int, str]]:
    """Run `target()` in `world` forked processes that form a torch.distributed group (gloo once the target
    calls init); (exit code, output) per rank. An exception in a rank is its exit code 1 and traceback."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    logs = [str(tmp_path / f"rank{r}.log") for r in range(world)]
    procs = [ctx.Process(target=_child, args=(r, world, port, target, logs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} hung"
    return [(p.exitcode, open(log).read()) for p, log in zip(procs, logs)]


def _cli(argv: list[str]) -> Callable[[], int]:
    def run() -> int:
        from mlpsurgery.cli import main

        return main(argv)

    return run


def ranks(tmp_path, argv: list[str], world: int = 2, timeout: float = 120) -> list[tuple[int, str]]:
    """Run `mlpsurgery ARGV` as `world` torch.distributed ranks (gloo); (exit code, output) per rank."""
    return run_ranks(tmp_path, _cli(argv), world, timeout)
