"""What the scripts of benchmarks/ share: the machine line a result records, thread settings (this process's and a
child's), the common options (--json, --md, --plot, --threads), median timing, a deadline, and writing results.

    import harness          # benchmarks/ is on sys.path when one of its scripts runs; benchmarks/notes/ adds it

    p = harness.parser(__doc__, json=True, md=True, threads=2)
    args = p.parse_args()
    harness.set_threads(args.threads)
    res = {"machine": harness.machine(), ...}
    harness.write_json(args.json, res)          # UTF-8, parent folders created, a trailing newline
    harness.write_md(args.md, render(res))

Only the standard library is imported here (torch when a function needs it): memory.py's parent process must stay
small, since a child's peak RSS (os.wait4) includes its parent's resident memory at the fork. Paired timing of two
models and the cost of a training step are mlpsurgery.measure's (speed.paired_speed, cost.compare_cost); plots go
through mlpsurgery.report.pyplot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import string
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]  # the repository
SRC = ROOT / "src"


def cpu_name() -> str:
    """The CPU's model name, and whether it has bfloat16 instructions (without them bfloat16 matmuls are slow)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown CPU")
    bf16 = any(f in info for f in ("avx512_bf16", "amx_bf16"))
    return f"{name}, {'with' if bf16 else 'no'} bfloat16 instructions"


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _torch_version() -> str:
    import torch

    return torch.__version__


# the fields a machine line may name; each is read only when the format names it
FIELDS: dict[str, Callable[[], Any]] = {
    "arch": platform.machine,  # x86_64
    "processor": lambda: platform.processor() or platform.machine(),
    "uname_processor": platform.processor,  # as uname -p says it, often empty
    "cpu_name": cpu_name,  # the model name, with or without bfloat16 instructions
    "cores": os.cpu_count,
    "threads": _torch_threads,  # torch's intra-op threads
    "torch": _torch_version,
    "platform": platform.platform,  # Linux-6.8.0-...-x86_64-with-glibc2.39
    "python": platform.python_version,
}
MACHINE = "{arch} {cpu_name}, {threads} threads, torch {torch}"


def machine(fmt: str = MACHINE) -> str:
    """The machine line a result records, in `fmt` over FIELDS (the default: architecture, CPU name, torch threads,
    torch version). Scripts whose committed results use another line pass its format, so that it stays the same."""
    names = {name for _, name, _, _ in string.Formatter().parse(fmt) if name}
    return fmt.format(**{name: FIELDS[name]() for name in names})


def set_threads(n: int, tokenizers_parallelism: bool | None = None) -> int:
    """torch's intra-op threads for this process; with `tokenizers_parallelism`, the Hugging Face tokenizers'
    setting too unless the environment gives one (false: no thread pool of theirs beside torch's). Returns n."""
    import torch

    torch.set_num_threads(n)
    if tokenizers_parallelism is not None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", str(tokenizers_parallelism).lower())
    return n


def child_env(threads: int | str | None = None, src: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a child process: this one's, OMP_NUM_THREADS = `threads` (when given), the repository's
    src/ first on PYTHONPATH (`src`: the checkout's mlpsurgery rather than an installed one), then `extra`
    (e.g. MKL_NUM_THREADS, TOKENIZERS_PARALLELISM, or a PYTHONPATH of its own)."""
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def parser(description: str | None, *, summary: bool = False, json: bool | str = False, md: bool | str = False,
           plot: bool | str = False, print_json: bool = False, threads: int | None = None,
           required: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """An argument parser with the options the scripts share; the script adds its own.

    description: the script's docstring, shown whole (`summary`: its first line only). json / md / plot: the option
    --json / --md / --plot PATH, True for no default, a string for that default; `required` names those that must be
    given. print_json: --json as a switch instead (print the result as JSON rather than as a table). threads: the
    default of --threads (torch threads; give it to set_threads), None for no such option."""
    if summary:
        p = argparse.ArgumentParser(description=(description or "").split("\n")[0])
    else:
        p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if print_json:
        p.add_argument("--json", action="store_true")
    for name, given in (("json", json), ("md", md), ("plot", plot)):
        if given is not False:
            p.add_argument(f"--{name}", default=None if given is True else given, required=name in required)
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads)
    return p


def grid_parser(description: str | None, variants: str, threads: int = 2) -> argparse.ArgumentParser:
    """parser() for a one-off grid over variants: --out, a JSON-lines file one row per variant is appended to (a rerun
    skips the variants already there), and --variants, comma-separated, each of the form `variants`."""
    p = parser(description, threads=threads)
    p.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    p.add_argument("--variants", required=True, help=f"comma-separated {variants}")
    return p


def smollm2_calibration(block_len: int, blocks: int):
    """(the loaded SmolLM2, the bundled Austen corpus, `blocks` train-split blocks of `block_len` tokens, seed 0): the
    setting the calibration grids share. Imports torch: call set_threads first."""
    import mlpsurgery as ms

    loaded = ms.load_model()
    corpus = ms.load_corpus(None, loaded.tokenizer)
    return loaded, corpus, corpus.blocks("train", block_len, max_blocks=blocks, seed=0)


def print_result(obj: Any, as_json: bool, text: str, indent: int = 1) -> None:
    """The result on stdout: as JSON (a --json switch, parser's print_json) or as its text (a header and a table)."""
    print(json.dumps(obj, indent=indent) if as_json else text)


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall-clock seconds of `repeats` calls of fn(), after `warmup` untimed ones."""
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def deadline(seconds: float) -> Callable[[], bool]:
    """A test of whether `seconds` have passed since this call (a --deadline of 0: never)."""
    start = time.perf_counter()
    return lambda: bool(seconds) and time.perf_counter() - start > seconds


_MISSING = object()


def read_json(path: str | Path, missing: Any = _MISSING) -> Any:
    """The JSON value in a file; `missing` where the file does not exist, when given."""
    path = Path(path)
    if missing is not _MISSING and not path.exists():
        return missing
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: str | Path, obj: Any, indent: int = 1, default: Callable | None = None) -> Path:
    """obj as JSON (UTF-8, `indent`, `default` for what JSON cannot hold), parent folders created, a trailing
    newline; the path."""
    return _write_text(path, json.dumps(obj, indent=indent, default=default))


def write_md(path: str | Path, text: str) -> Path:
    """Text (a Markdown table) to a file: UTF-8, parent folders created, ending in a newline; the path."""
    return _write_text(path, text)


def _write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSON-lines file (none when it does not exist)."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def append_jsonl(path: str | Path, row: dict) -> None:
    """One row appended to a JSON-lines file (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
