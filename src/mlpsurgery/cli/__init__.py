"""The `mlpsurgery` command line: thin wrappers, one library call per command.

Commands live in small modules (core, and one per method); each registers its subcommands on the
shared top-level groups (`eval`, `lock`, `attack`, ...). Every command takes --json (machine-readable
result on stdout; progress bars go to stderr) and --quiet. User errors print one line naming the
problem and the fix, and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable

from ..errors import MLPSurgeryError

# Command modules, in the order their commands appear in --help.
COMMAND_MODULES = ("core", "dlr", "key", "nest", "fusion", "twist", "lmeval")
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
    """argparse type: an integer in [low, high]."""
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
    return p


def command(sub, name: str, run: Callable, render: Callable[[dict], str], help: str, **kw) -> argparse.ArgumentParser:
    """Add a subcommand whose handler returns a JSON-able dict and whose renderer turns it into text."""
    p = sub.add_parser(name, help=help, description=help, parents=[common()], **kw)
    p.set_defaults(run=run, render=render)
    return p


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
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def one_line(message: str) -> str:
    """The message on one line: control and line-break characters (which a damaged file can put into a
    message, e.g. U+0085) are shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(f"mlpsurgery: error: {one_line(e)}", file=sys.stderr)
        return 2
    if not hasattr(args, "run"):
        (getattr(args, "group_parser", None) or parser).print_help()
        return 0
    if args.quiet or args.json:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        result = args.run(args)
    except MLPSurgeryError as e:
        print(f"mlpsurgery: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mlpsurgery: interrupted (long runs resume from their checkpoint when started again)", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(args.render(result))
    return 0
