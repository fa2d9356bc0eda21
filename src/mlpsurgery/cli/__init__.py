"""The `mlpsurgery` command line: thin wrappers, one library call per command.

Commands live in small modules (core, and one per method); each registers its subcommands on the
shared top-level groups (`eval`, `lock`, `attack`, ...). Every command takes --json (machine-readable
result on stdout) and --quiet; progress bars and stage lines go to stderr, and either flag silences them.
User errors print one line naming the problem and the fix, and exit with status 2; with --json the same
error is also printed on stdout as a JSON object, so that a script reading stdout always gets JSON.
"""

from __future__ import annotations

import argparse
import importlib
import errno
import json
import os
import sys
from pathlib import Path
from typing import Callable

from ..errors import MLPSurgeryError

# Command modules, in the order their commands appear in --help.
COMMAND_MODULES = ("core", "dlr", "dlr_attack", "key", "nest", "fusion", "twist", "lmeval", "compare")
GROUPS = {
    "eval": "measure a model: perplexity, accuracy, cost",
    "lock": "lock a model (DLR-Lock against fine-tuning, CoreLocker access key)",
    "attack": "attack a locked model the way an adaptive adversary would",
    "twist": "TwIST: train independent subnets so that random subnets need no pruning search; extract one",
}


class Parser(argparse.ArgumentParser):
    """argparse with the one-line error every mlpsurgery refusal has (exit status 2, the problem and the fix)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


class UsageError(MLPSurgeryError):
    """A command line argparse could not accept."""


def _number(kind, text: str, low, high, low_open: bool, high_open: bool):
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and v != v:
        raise argparse.ArgumentTypeError("NaN is not a value")
    below = low is not None and (v <= low if low_open else v < low)
    above = high is not None and (v >= high if high_open else v > high)
    if below or above:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
        raise argparse.ArgumentTypeError(f"must be {' and '.join(x for x in (lo, hi) if x)}, not {text}")
    return v


def integer(low: int | None = 1, high: int | None = None):
    """argparse type: an integer in [low, high] (high: 2^53 unless given; more than any count a run could use, and
    what every library below takes without overflow)."""
    high = 2 ** 53 if high is None else high
    f = lambda text: _number(int, text, low, high, False, False)  # noqa: E731
    f.__name__ = "integer"
    return f


def number(low: float | None = None, high: float | None = None, low_open: bool = True, high_open: bool = False):
    """argparse type: a finite number in (low, high] (open/closed ends as given)."""
    def f(text):
        v = _number(float, text, low, high, low_open, high_open)
        if v in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"must be finite, not {text}")
        return v
    f.__name__ = "number"
    return f


def common() -> argparse.ArgumentParser:
    p = Parser(add_help=False)
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help="precision the model is loaded and worked in (default: float32 for a stock checkpoint, the "
                        "saved one for a folder mlpsurgery wrote; auto: the checkpoint's own); steps that need "
                        "float32 upcast one matrix at a time")
    return p


def command(sub, name: str, run: Callable, render: Callable[[dict], str], help: str, ranks: bool = False,
            **kw) -> argparse.ArgumentParser:
    """Add a subcommand whose handler returns a JSON-able dict and whose renderer turns it into text. ranks: it
    works over several processes under torchrun (the others are refused there: each rank would run the whole
    command and write the same --out)."""
    p = sub.add_parser(name, help=help, description=help, parents=[common()], **kw)
    p.set_defaults(run=run, render=render, over_ranks=ranks)  # (not `ranks`: nest's --ranks)
    return p


# the commands that work over several processes (command(..., ranks=True)); named in the refusal of the others
RANKED = "nest, lock dlr, attack dlr, fuse and twist train"


def progress(args) -> bool:
    """Whether to show progress bars and stage lines: not with --quiet, nor with --json (main() sets quiet)."""
    return not (args.quiet or getattr(args, "json", False))


def stage(args, message: str) -> None:
    """A stage line on stderr (see report.stage), unless --quiet / --json."""
    from ..report import stage as _stage

    _stage(message, progress(args))


def model_name(spec) -> str:
    return str(spec) if spec else "smollm2 (the default model)"


def check_plot_path(path, inputs=()) -> None:
    """Refuse, before any work, a --plot path that cannot be written or that is, holds or lies inside an
    input (its overlap with the command's other outputs, e.g. a plot inside a locked folder that would be handed out
    with it, is refused for every command by check_paths)."""
    from ..files import check_file_out

    if path is None:
        return
    # an old plot mlpsurgery drew at the path is replaced; any other file there is the user's and is refused
    check_file_out(path, overwrite=True, inputs=inputs, what="plot")


def draw(what: str, fn: Callable[[], object]) -> str | None:
    """Run a plotting function; return the path it wrote, or None with a warning on stderr if it failed.
    A plot is a view of a result that is already complete (and saved), so its failure must not turn a
    successful run into an error."""
    from ..report import warn

    try:
        return str(fn())
    except Exception as e:  # noqa: BLE001 - any plotting failure (matplotlib, disk) is only a warning
        warn(f"the {what} plot could not be drawn ({type(e).__name__}: {one_line(e)}); the result is complete "
             "without it")
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mlpsurgery", description="Surgery on the MLP blocks and attention heads "
                    "of pretrained transformers.")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"mlpsurgery {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=Parser)
    groups = {}
    for name, text in GROUPS.items():
        g = sub.add_parser(name, help=text, description=text)
        groups[name] = g.add_subparsers(title="subcommands", metavar="SUBCOMMAND", parser_class=Parser)
        g.set_defaults(group_parser=g)
    for mod in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{mod}").register(sub, groups)
    return parser


def device_of(args) -> str:
    """--device as a device this process can use (auto: cuda when available); one that it cannot is refused here,
    before any work, not with a traceback from the first tensor sent there."""
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(args.device)
    except (RuntimeError, ValueError):
        raise MLPSurgeryError(f"--device {args.device!r} is not a device name: give cpu, cuda, cuda:N or auto") \
            from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MLPSurgeryError(f"--device {args.device}: this machine's torch sees no CUDA device (no GPU, or a "
                                  "CPU-only torch build); drop --device (auto) or give --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise MLPSurgeryError(f"--device {args.device}: there are {torch.cuda.device_count()} CUDA devices "
                                  f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return args.device


def layer_device(args, on_device: bool = True, what: str = "this command") -> str:
    """Where a --layerwise command works each layer (layerwise.LayerStream's device). on_device: it can work them
    on --device (auto: cuda when available): pruning, fusion, NSN surgery, perplexity. Otherwise (`what` names it)
    it works on the CPU -- CoreLocker, TwIST extraction, `nest rank`, which mostly read, hash and write tensors, and
    Fisher's per-layer backward -- so auto means the CPU there and a GPU named with --device is refused rather
    than ignored."""
    if on_device:
        return device_of(args)
    if args.device not in ("auto", "cpu"):
        raise MLPSurgeryError(f"{what} --layerwise works each layer on the CPU, not on {args.device}: drop --device, "
                              "or drop --layerwise")
    return "cpu"


def check_max_memory(args, layerwise: bool | None = None) -> None:
    """Refuse --max-memory where it caps nothing: it bounds the activations of the layer-by-layer mode
    (`layerwise`: whether that mode runs; default args.layerwise)."""
    if args.max_memory is not None and not (args.layerwise if layerwise is None else layerwise):
        raise MLPSurgeryError("--max-memory caps the layer-by-layer mode: add --layerwise")


def calibration_blocks(args, tokenizer, where, why: str = "the data-aware compression"):
    """(N, T) token blocks of --calib-data for the layer-by-layer modes (its train split: the bundled Austen's leaves
    Persuasion unseen; text sampled from the model is refused, the whole model is never held), with
    --calib-blocks and --calib-len; None without --calib-data. `where` names the model whose tokenizer is missing."""
    from ..data import text_blocks
    from ..data.sampled import refuse_layer_by_layer
    from ..errors import MLPSurgeryError

    if not args.calib_data:
        return None
    refuse_layer_by_layer(args.calib_data)
    if tokenizer is None:
        raise MLPSurgeryError(f"{where} has no tokenizer, which the calibration data needs; add its tokenizer files")
    stage(args, f"reading and tokenising the calibration data {args.calib_data} for {why}")
    return text_blocks(args.calib_data, tokenizer, block_len=args.calib_len, max_blocks=args.calib_blocks,
                       seed=args.seed)


def join_ranks(args, join: bool = True) -> tuple[str, int, int]:
    """(device, rank, world size): under torchrun (and `join`), this process joins the group on its rank's device
    (the GPU of its LOCAL_RANK on CUDA); ranks other than 0 go quiet (rank 0 shows the stages and progress)."""
    from .. import parallel

    device = device_of(args)
    if join and parallel.launched():
        device = parallel.rank_device(device)
        parallel.init(device)
    rank, world = parallel.world()
    if rank != 0:
        args.quiet = True
    return device, rank, world


def one_line(message: str) -> str:
    """The message on one line: control and line-break characters (which a damaged file can put into a
    message, e.g. U+0085) are shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message))


def _command_words(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The command an argument list names ("lock key", "inspect"), read through the parser's subcommands
    without parsing the rest (which may be what failed)."""
    words, current = [], parser
    for token in map(str, argv):
        if token.startswith("-"):
            continue
        action = next((a for a in current._actions if isinstance(a, argparse._SubParsersAction)), None)
        if action is None or token not in action.choices:
            break
        words.append(token)
        current = action.choices[token]
    return " ".join(words) or None


def _fail(message: str, status: int, as_json: bool, command: str | None, details: dict | None = None) -> int:
    """The one-line error on stderr; with --json also a JSON object on stdout."""
    print(f"mlpsurgery: {'error: ' if status == 2 else ''}{one_line(message)}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": str(message), "exit_status": status, "command": command, **(details or {})},
                         indent=2, default=str))
    return status


# argument names (argparse dests) that every command uses for what it reads and what it writes; a command whose
# flag of another name is written says so with set_defaults(writes=(dest, ...))
READS = ("model", "model_a", "model_b", "locked", "dir", "data", "calib_data", "tune_data", "eval_data", "train",
         "test", "second_corpus", "baseline", "original", "include_path", "key")
WRITES = ("out", "plot", "write_tasks", "workdir", "checkpoint", "checkpoint_dir")


def _flag(dest: str) -> str:
    return dest if dest in ("model", "model_a", "model_b", "locked", "dir") else "--" + dest.replace("_", "-")


def check_paths(args) -> None:
    """The rule that no output is an input, and no two outputs overlap, for every command at once, before any
    work: each path a command writes (--out, --key of `lock key`, --plot, --workdir, a checkpoint folder) is
    refused when it is, holds or lies inside a path it reads (the model, --data, --calib-data, ...) or another
    path it writes, and an empty path is refused."""
    from ..files import check_apart, check_path

    writes = tuple(getattr(args, "writes", ())) + WRITES
    outs = [(d, getattr(args, d)) for d in writes if isinstance(getattr(args, d, None), str)]
    ins = [(d, getattr(args, d)) for d in READS if d not in writes and isinstance(getattr(args, d, None), str)]
    for d, v in outs:  # (an empty input may mean "none": --second-corpus "")
        if v.strip() == "":
            raise MLPSurgeryError(f"{_flag(d)} is empty; give a path")
    for d, v in outs:
        check_path(v, what=_flag(d))
        check_apart(v, [v2 for _, v2 in ins if v2.strip()], what=_flag(d))
    for i, (d, v) in enumerate(outs):
        a = Path(os.path.abspath(Path(v).expanduser()))
        for d2, v2 in outs[i + 1:]:
            if {d, d2} == {"out", "key"}:
                continue  # `lock key` says more about these two (methods/corelocker/folders.py: check_lock_targets)
            b = Path(os.path.abspath(Path(v2).expanduser()))
            if a == b or a in b.parents or b in a.parents:
                raise MLPSurgeryError(f"{_flag(d2)} {v2} overlaps the output {_flag(d)} {v}; give each output its own "
                                      "path, none inside another")


_DISK_FULL = ("No space left", "StorageFull", "code: 28,", "Disk quota", "QuotaExceeded", "File too large",
              "FileTooLarge", "code: 27,", "file write failed")


def os_failure(e: BaseException) -> str | None:
    """One line for a failure of the machine rather than of mlpsurgery (a full disk, a read-only file system,
    no permission), from an OSError or from a library's error that wraps one (safetensors, torch.save); None
    for anything else. Every writer is atomic, so nothing half-written is left behind by such a failure."""
    code = getattr(e, "errno", None) if isinstance(e, OSError) else None
    where = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
    text = str(e)
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or (code is None and any(k in text for k in _DISK_FULL)):
        what = "a file grew beyond the file system's or the process's size limit (ulimit -f)" if (
            code == errno.EFBIG or "large" in text.lower() or "code: 27," in text) else "no space left on the disk"
        return (f"{what}{where}; nothing half-written was kept: free some space (or write elsewhere) and run again, "
                "long runs resume from their checkpoint")
    if code == errno.EROFS:
        return f"read-only file system{where}; write somewhere writable"
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied{where}; write somewhere you may write, or fix the permissions"
    if code == errno.ENAMETOOLONG:
        return f"a file name is too long for the file system{where}; give a shorter path"
    if code in (errno.EIO, errno.EMFILE, errno.ENFILE):
        return f"{e.strerror}{where}; check the disk (or raise `ulimit -n`) and run again"
    return None


def main(argv: list[str] | None = None) -> int:
    from ..report import end_stage, restart_clock

    argv = sys.argv[1:] if argv is None else list(argv)
    restart_clock()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        # --json is honoured even when the command line is what failed (it may not have been parsed)
        return _fail(str(e), 2, "--json" in argv, _command_words(parser, argv))
    if not hasattr(args, "run"):
        (getattr(args, "group_parser", None) or parser).print_help()
        return 0
    if args.json:
        args.quiet = True  # progress is for a person at a terminal; --json is for a program
    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    command = _command_words(parser, argv)
    from .. import parallel
    from ..models import default_dtype

    if parallel.launched() and not args.over_ranks:
        return _fail(f"`{command}` runs as one process; under torchrun every rank would run it whole and write the "
                     f"same output: launch it without torchrun ({RANKED} use several processes)", 2, args.json,
                     command)

    try:
        check_paths(args)
        with default_dtype(getattr(args, "dtype", None)):
            result = args.run(args)
    except MLPSurgeryError as e:
        end_stage()
        return _fail(str(e), 2, args.json, command, getattr(e, "details", None))
    except Exception as e:  # noqa: BLE001 - only a machine's failure (os_failure) becomes one line
        end_stage()
        message = os_failure(e)
        if message is None:
            raise
        return _fail(message, 2, args.json, command)
    except KeyboardInterrupt:
        end_stage()
        return _fail("interrupted (long runs resume from their checkpoint when started again)", 130, args.json,
                     command)
    finally:
        end_stage()  # the command's last step is over: its line, if not printed yet, never will be
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(args.render(result))
    return 0
