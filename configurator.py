"""
Flags and presets, as train.py and plan.py read them: every field of the config dataclasses is a
--name=value flag, and a positional argument is a preset, a Python file assigning field names,
applied before the flags. Any mistake is a ConfigError, reported as one line.
"""

import dataclasses
import difflib
import typing
from pathlib import Path


class ConfigError(Exception):
    """A bad flag, preset, data folder or checkpoint: reported as one line before anything is written."""


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
