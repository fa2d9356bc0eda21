"""Property-based fuzzing of every command's numeric and path options (issue 48): from a valid, quick command
line on a tiny model, one option is set to a value a new user might type (0, -1, NaN, 1e30, empty, '.', a file
they own, a FIFO, a name too long, ...). Whatever happens, never a traceback, exit 0 / 2 (130 only when the
example ran past its time and was stopped), and never a change to a file the test made beforehand.

Derandomized (the same examples on every run) and small enough for CI; set MLPSURGERY_FUZZ_EXAMPLES to run
more."""

import argparse
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mlpsurgery.cli import READS, WRITES, build_parser, main

EXAMPLES = int(os.environ.get("MLPSURGERY_FUZZ_EXAMPLES", "20"))
SECONDS = 8  # an example still running after this is stopped (Ctrl-C): an accepted value that means long work
TEXT = "It is a truth universally acknowledged that a single man in possession of a good fortune must be in want. "

# a quick valid command line per command; {out}, {key}, {data}, {dir}, {locked} filled per example
BASES = {
    "eval ppl": "eval ppl tiny:llama --data {data} --max-tokens 64 --block-len 32",
    "eval cost": "eval cost tiny:llama --repeats 1 --seq-len 16 --batch-size 1",
    "eval acc": "eval acc tiny:bert --max-train 8 --max-test 8 --max-len 16",
    "eval ntk": "eval ntk tiny:llama tiny:llama --data {data} --n 4 --block-len 16",
    "lock key": "lock key tiny:llama --out {out} --key {key} --ratio 0.05 --data {data}",
    "lock dlr": "lock dlr tiny:llama --out {out} --rank 4 --block-len 32 --data {data} --phase1-steps 1 "
                "--phase2-steps 0 --eval-tokens 0 --calib-blocks 2",
    "twist train": "twist train tiny:llama --out {out} --steps 1 --block-len 16 --max-blocks 4 --data {data} "
                   "--shared-first 0 --shared-last 0 --blocks 4 --keep 2",
    "twist extract": "twist extract tiny:llama --keep 2 --out {out} --shared-first 0 --shared-last 0 --blocks 4",
    "inspect": "inspect tiny:llama",
    "export": "export {dir} --out {out}",
    "unlock": "unlock {locked} --key {key0} --out {out}",
    "nest": "nest tiny:llama --out {out} --data {data} --train-steps 0 --calib-blocks 2 --calib-len 16",
    "fuse": "fuse tiny:llama --out {out} --width 16 --calib-data {data} --calib-blocks 2 --calib-len 16",
    "prune": "prune tiny:llama --method magnitude --sparsity 0.5 --out {out}",
    "compare": "compare tiny:llama --out {out} --methods neuron --budgets 0.5 --max-tokens 64 --block-len 32 "
               "--calib-blocks 2 --calib-len 16 --repeats 1 --prompt-len 8 --new-tokens 4 --data {data}",
    "attack dlr": "attack dlr {dlr} --out {out} --attacks finetune --steps 1 --lrs 1e-3 --batch 1 --train-blocks 2 "
                  "--eval-blocks 1 --block-len 32 --data {data}",
    "attack key": "attack key tiny:llama --trials 1 --epochs 1 --block-len 16 --eval-size 8 --finetune 0.1 "
                  "--prune 0.2 --batch-size 2 --data {data}",
    "eval lm": "eval lm tiny:llama --tasks corpus --data {data} --write-tasks {out}",
    "demo": "demo --model tiny:llama --out {out} --max-tokens 64",
}

PATHS = ["", ".", "/", "{precious}", "{mine}", "{mine}/inside", "{missing}/x", "{fifo}", "{long}", "{link}",
         "{data}"]
NUMBERS = ["0", "-1", "-7", "nan", "inf", "-inf", "1e9", "1e30", "2.5", "abc", "", "1e-30",
           "99999999999999999999", "0x10", "1_000"]


def _command_parsers():
    found = {}

    def walk(parser, words):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, words + [name])
                return
        found[" ".join(words)] = parser

    walk(build_parser(), [])
    return found


PARSERS = _command_parsers()


def options(command: str):
    """(flag or None for a positional, dest, 'number' | 'path') of each option worth fuzzing."""
    out = []
    for a in PARSERS[command]._actions:
        kind = None
        if getattr(a.type, "__name__", "") in ("integer", "number", "_all_or_count"):
            kind = "number"
        elif a.dest in READS + WRITES + ("key",) and a.nargs in (None, "?"):
            kind = "path"
        if kind:
            out.append((a.option_strings[-1] if a.option_strings else None, a.dest, kind))
    return out


def test_every_command_is_fuzzed():
    assert set(BASES) == set(PARSERS) - {"fetch"}, \
        "a new command needs a base command line here (fetch has no numeric or path option)"


class Stop(BaseException):
    pass


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """What the user owns (checked byte for byte after every example) and the inputs the bases need."""
    root = tmp_path_factory.mktemp("fuzz")
    import mlpsurgery as ms
    from mlpsurgery.tiny import byte_tokenizer, tiny_model

    (root / "data.txt").write_text(TEXT * 60)
    (root / "precious.txt").write_text("the user's own file")
    (root / "mine").mkdir()
    (root / "mine" / "thesis.tex").write_text("years of work")
    os.mkfifo(root / "fifo")
    os.symlink(root / "precious.txt", root / "link")
    ms.save(tiny_model("llama"), root / "dir", tokenizer=byte_tokenizer())
    assert main(["lock", "key", "tiny:llama", "--out", str(root / "locked"), "--key", str(root / "k0.key"),
                 "--ratio", "0.05", "--quiet"]) == 0
    assert main(["lock", "dlr", "tiny:llama", "--out", str(root / "dlr"), "--rank", "4", "--block-len", "32",
                 "--phase1-steps", "1", "--phase2-steps", "0", "--eval-tokens", "0", "--calib-blocks", "2",
                 "--data", str(root / "data.txt"), "--quiet"]) == 0
    return root


def _owned(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p)] = os.readlink(p)
        elif p.is_file():
            out[str(p)] = p.read_bytes()
    return out


def _fill(text: str, root: Path, work: Path) -> str:
    return text.format(out=work / "o", key=work / "k.key", data=root / "data.txt", dir=root / "dir", locked=root / "locked", dlr=root / "dlr", key0=root / "k0.key", precious=root / "precious.txt",
                       mine=root / "mine", missing=work / "missing", fifo=root / "fifo", long="n" * 300,
                       link=root / "link")


def _set(argv: list[str], flag: str | None, dest: str, value: str, command: str) -> list[str]:
    """argv with one option set to value (a positional replaced in place)."""
    if flag is None:
        words = len(command.split())
        positional = [a.dest for a in PARSERS[command]._actions if not a.option_strings]
        i = words + positional.index(dest)
        return argv[:i] + [value] + argv[i + 1:] if i < len(argv) else argv + [value]
    if flag in argv:
        i = argv.index(flag)
        return argv[:i + 1] + [value] + argv[i + 2:]
    return argv + [flag, value]


def _alarm(*_):
    raise KeyboardInterrupt


@pytest.mark.parametrize("command", sorted(BASES))
def test_fuzz_never_a_traceback_never_a_lost_file(world, command):
    owned = _owned(world)
    opts = options(command)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(opts), st.data())
    def check(opt, data):
        flag, dest, kind = opt
        value = data.draw(st.sampled_from(NUMBERS if kind == "number" else PATHS))
        work = Path(tempfile.mkdtemp(dir=world.parent))
        try:
            argv = _fill(BASES[command], world, work).split() + ["--quiet"]
            argv = _set(argv, flag, dest, _fill(value, world, work), command)
            if "--overwrite" in PARSERS[command]._option_string_actions and data.draw(st.booleans()):
                argv.append("--overwrite")  # never a licence to replace what the user owns
            event(f"{flag or dest}={value}")
            old = signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(SECONDS)
            try:
                code = main(argv)
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
            assert code in (0, 2, 130), (argv, code)
            if value == "{fifo}":
                assert code != 130, (argv, "a FIFO must be refused, not waited on")
            now = _owned(world)
            assert {k: now.get(k) for k in owned} == owned, (argv, "a file the user owned changed")
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(world / "mine" / "inside", ignore_errors=True)  # a new folder the user asked for

    check()
