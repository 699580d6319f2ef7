"""
Flags and presets, as train.py and plan.py read them: every field of the config dataclasses is a
--name=value flag, and a positional argument is a preset, a Python file assigning field names,
applied before the flags. Any mistake is a ConfigError, reported as one line. Beside them, what
every script shares in reading its input: ArgumentParser, whose errors are one line, and
check_fields, which checks a record read from a file (meta.json, a checkpoint) field by field; and
in ending, run_main, which turns a reader that closed the script's output early into a quiet exit,
and Ctrl-C, SIGTERM and SIGHUP into one line and the shell's exit code.
"""

import argparse
import dataclasses
import difflib
import os
import select
import signal
import sys
import typing
from pathlib import Path

# torch.manual_seed takes a seed in [0, 2**64): one outside it is refused before anything runs
SEED_LIMIT = 2**64


class ConfigError(Exception):
    """A bad flag, preset, data folder or checkpoint: reported as one line before anything is written."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but an error is one line on stderr, `prog: error: message` (where
    argparse knows them, the valid choices are in the message), and exit code 2, argparse's;
    not the usage block. prog is the script's file name, however the script was started."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the script is, as Ctrl-C's KeyboardInterrupt is (a subclass of it),
    so that what cleans up after Ctrl-C (atomic writes, eval.py's and export_hf.py's) cleans up after it."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop(signum, frame):
    raise Stopped(signum)


def interruption(e):
    """What a KeyboardInterrupt e (Ctrl-C's, or Stopped) ended a script with: its words, "interrupted" or
    "stopped by SIGTERM", and its exit code, 128 + the signal's number (130 for Ctrl-C)."""
    signum = getattr(e, "signum", signal.SIGINT)
    said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return said, 128 + signum


def run_main(main):
    """main()'s exit code, for a script's `sys.exit(run_main(main))`; or, where its stdout is a pipe
    whose reader has gone (`python eval.py --list | head -n 1`), 141 and no traceback: what a shell
    reports for a Unix tool that SIGPIPE ends at its next write (Python ignores SIGPIPE, so the
    write raises BrokenPipeError instead). What stdout still buffers is flushed here, so that the
    pipe's end is met inside; then stdout points at /dev/null, so that Python's flush at exit writes
    nowhere. A BrokenPipeError from another pipe is raised as it is. Ctrl-C, and SIGTERM and SIGHUP
    (where not ignored, as nohup ignores SIGHUP), end main() by an exception of the KeyboardInterrupt
    kind, which says so in one line (rank 0's alone under torchrun) and gives 128 + the signal's number
    (130 for Ctrl-C): no traceback, and what the script writes atomically whole."""
    caught = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) == signal.SIG_DFL]
    for signum in caught:
        signal.signal(signum, stop)
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        if not reader_gone(sys.stdout):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as e:
        said, code = interruption(e)
        if os.environ.get("RANK", "0") == "0":
            print(f"{os.path.basename(sys.argv[0])}: {said}", file=sys.stderr)
        return code
    finally:
        for signum in caught:
            signal.signal(signum, signal.SIG_DFL)
    return code


def reader_gone(stream):
    """Whether stream writes into a pipe (or socket) whose reading end is closed: poll's POLLERR."""
    poller = select.poll()
    poller.register(stream.fileno(), select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def seed(text):
    """An argparse type: an integer seed that torch.manual_seed takes."""
    n = int(text)  # not an integer: argparse's "invalid seed value"
    if not 0 <= n < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{text}: must be between 0 and 2**64 - 1")
    return n


def positive_int(text):
    """An argparse type: an integer of at least 1."""
    n = int(text)  # not an integer: argparse's "invalid positive_int value"
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be at least 1")
    return n


def kv_quant(text):
    """An argparse type: the name of a KV cache storage of lib/attention/quant.py (none, int8, int4)."""
    from lib.attention.quant import CACHES
    if text not in CACHES:
        raise argparse.ArgumentTypeError(f"{text!r}: must be one of {', '.join(CACHES)}")
    return text


def check_fields(where, record, spec, optional=()):
    """record as spec describes it, or a ValueError naming where (a file) and the field. spec maps
    each field to a type (or a tuple of types), to a dict spec of its own fields, or to [spec], a
    list of such values. Every field is required but those in optional (top-level only); fields
    that spec does not name are left alone."""
    def check(name, value, kind):
        if isinstance(kind, dict):
            if not isinstance(value, dict):
                what = f"field {name!r}" if name else "it"
                raise ValueError(f"{where}: {what} is {type(value).__name__}, expected dict")
            for field, field_kind in kind.items():
                path = f"{name}.{field}" if name else field
                if field in value:
                    check(path, value[field], field_kind)
                elif not (name == "" and field in optional):
                    raise ValueError(f"{where}: field {path!r} is missing")
        elif isinstance(kind, list):
            if not isinstance(value, list):
                raise ValueError(f"{where}: field {name!r} is {type(value).__name__}, expected list")
            for i, item in enumerate(value):
                check(f"{name}[{i}]", item, kind[0])
        else:
            kinds = kind if isinstance(kind, tuple) else (kind,)
            # True is an int to isinstance, but no count of anything
            if not isinstance(value, kinds) or type(value) is bool and bool not in kinds:
                names = " or ".join(k.__name__ for k in kinds)
                raise ValueError(f"{where}: field {name!r} is {type(value).__name__}, expected {names}")
    check("", record, spec)
    return record


def base_type(field):
    """The type a field's values have: bool for `bool | None`, whose None means "decided by device"."""
    return next((t for t in typing.get_args(field.type) if t is not type(None)), field.type)


def lookup(name, fields):
    if name in fields:
        return fields[name]
    close = difflib.get_close_matches(name, fields, n=5, cutoff=0.6)
    listed = ", ".join("--" + n for n in (close or fields))
    raise ConfigError(f"unknown setting {name!r}; "
                      + (f"did you mean {listed}?" if close else f"valid: {listed}"))


def parse_flag(name, text, kind):
    if kind is bool and text.lower() in ("true", "1", "false", "0"):
        return text.lower() in ("true", "1")
    if kind is not bool:
        try:
            return kind(text)
        except ValueError:
            pass
    raise ConfigError(f"--{name}={text}: expected {kind.__name__}")


def check_preset_value(path, name, value, field):
    """A preset's value, checked against its field's type: an int passes for a float, None only
    where the field allows it."""
    kind = base_type(field)
    if value is None and kind is not field.type:
        return value
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:
        raise ConfigError(f"{path}: {name} = {value!r}: expected {kind.__name__}")
    return value


def parse(argv, *classes):
    """One instance of each dataclass in classes from its defaults, then the preset files in argv
    in order, then its --name=value flags; each field name belongs to one class."""
    fields = {f.name: f for cls in classes for f in dataclasses.fields(cls)}
    values = {}
    for arg in argv:
        if arg.startswith("--"):
            name, has_value, text = arg[2:].partition("=")
            kind = base_type(lookup(name, fields))
            if not has_value and kind is not bool:
                raise ConfigError(f"--{name} needs a value: --{name}=...")
            values[name] = parse_flag(name, text, kind) if has_value else True
        else:
            try:
                preset = {}
                exec(Path(arg).read_text(), {}, preset)
            except FileNotFoundError:
                raise ConfigError(f"no preset file {arg}") from None
            except Exception as e:  # a preset is the user's own code: report its error in one line
                raise ConfigError(f"{arg}: {type(e).__name__}: {e}") from None
            for name, value in preset.items():
                try:
                    field = lookup(name, fields)
                except ConfigError as e:
                    raise ConfigError(f"{arg}: {e}") from None
                values[name] = check_preset_value(arg, name, value, field)
    try:
        return [cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
                for cls in classes]
    except ValueError as e:
        raise ConfigError(str(e)) from None
