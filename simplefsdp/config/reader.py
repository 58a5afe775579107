"""Reading a config: a TOML file and ``--section.key value`` overrides -> dataclasses.

A config is a dataclass whose fields are sections, each a dataclass whose field types
are the schema: ``int``, ``float``, ``bool``, ``str``, a ``Literal`` of allowed strings,
``list[X]`` (a TOML array; comma-separated on the command line), ``X | None`` or a union
of those (``bool | Literal["auto"]``: the first alternative that reads the value). Every
value is checked against its type and every error names the key, so a typo fails at
start-up instead of hours into a run. The trainer (``config.job.JobConfig``) and the
benchmark (``bench.config.BenchConfig``) are both read this way: one file format, one
override syntax, one ``--help`` layout.

    cfg = read_config(JobConfig(), "job.toml", ["--training.steps", "10"])
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import textwrap
import tomllib
import types
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from ..errors import ConfigError, choices, config_errors, require  # noqa: F401 (re-exported)

C = TypeVar("C")


# ---------------------------------------------------------------------------------------
# Reading values: TOML values are checked, command-line strings are parsed.
# ---------------------------------------------------------------------------------------
def _union(tp: Any) -> tuple[list[Any], bool] | None:
    """(the alternatives, whether None is allowed) of a union type; None for any other."""
    if get_origin(tp) in (types.UnionType, Union):
        args = get_args(tp)
        return [a for a in args if a is not type(None)], type(None) in args
    return None


def _type_name(tp: Any) -> str:
    union = _union(tp)
    if union is not None:
        names = [_type_name(a) for a in union[0]] + (["none"] if union[1] else [])
        return " or ".join(names)
    if get_origin(tp) is Literal:
        return f"one of {choices(get_args(tp))}"
    if get_origin(tp) is list:
        return f"a list, each {_type_name(get_args(tp)[0])} (comma-separated on the command line)"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number",
            str: "a string"}[tp]


def _first_that_reads(read, value: Any, tp: Any, key: str) -> Any:
    """``read(value, alternative, key)`` for the union ``tp``'s first alternative that
    accepts ``value``; a ConfigError naming every alternative if none does."""
    for alternative in _union(tp)[0]:
        try:
            return read(value, alternative, key)
        except NotFinite:
            raise  # the type matched: the value itself is wrong, whatever the union
        except ConfigError:
            continue
    raise ConfigError(f"{key} = {value!r} is invalid: expected {_type_name(tp)}")


def _check(value: Any, tp: Any, key: str) -> Any:
    """Check a TOML value against the field type ``tp``; ints are accepted as floats."""
    union = _union(tp)
    if union is not None:
        if value is None and union[1]:
            return None
        return _first_that_reads(_check, value, tp, key)
    if get_origin(tp) is list:
        if isinstance(value, list):
            return [_check(v, get_args(tp)[0], key) for v in value]
        ok = False
    elif get_origin(tp) is Literal:
        ok = isinstance(value, str) and value in get_args(tp)
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = _finite(float(value), key) if ok else value
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    if not ok:
        raise ConfigError(f"{key} = {value!r} is invalid: expected {_type_name(tp)}")
    return value


class NotFinite(ConfigError):
    """A float field read NaN or an infinity."""


def _finite(value: float, key: str) -> float:
    """Reject NaN and infinities (``1e400`` in TOML reads as inf): they would train to NaN."""
    if not math.isfinite(value):
        raise NotFinite(f"{key} = {value!r} is invalid: expected a finite number")
    return value


def _parse(text: str | None, tp: Any, key: str) -> Any:
    """Parse a command-line string for a field of type ``tp`` (``None``: a bare flag)."""
    union = _union(tp)
    if union is not None:
        if union[1] and text is not None and text.lower() in ("none", "null"):
            return None
        return _first_that_reads(_parse, text, tp, key)
    if tp is bool:
        if text is None:
            return True
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
    elif text is None:
        raise ConfigError(f"--{key} needs a value ({_type_name(tp)})")
    elif get_origin(tp) is list:
        return [_parse(item.strip(), get_args(tp)[0], key)
                for item in text.split(",") if item.strip()]
    elif tp is int or tp is float:
        try:
            value = tp(text)
        except ValueError:
            pass
        else:
            return _finite(value, key) if tp is float else value
    else:  # str or Literal
        return _check(text, tp, key)
    raise ConfigError(f"{key} = {text!r} is invalid: expected {_type_name(tp)}")


def _section(cfg: Any, name: str) -> Any:
    names = [f.name for f in fields(cfg)]
    if name not in names:
        raise ConfigError(f"unknown section [{name}]{_did_you_mean(name, names)}; sections "
                          f"are {', '.join(names)}")
    return getattr(cfg, name)


def _field_type(section_obj: Any, section: str, key: str) -> Any:
    hints = get_type_hints(type(section_obj))
    if key not in hints:
        raise ConfigError(f"unknown key {section}.{key}{_did_you_mean(key, list(hints))}; "
                          f"keys of [{section}] are {', '.join(hints)}")
    return hints[key]


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------------------
# Whole configs: files, overrides, command lines, help.
# ---------------------------------------------------------------------------------------
def apply_toml(cfg: Any, data: dict[str, Any]) -> None:
    """Set the values of a parsed TOML document on ``cfg``, checking each one."""
    for section, table in data.items():
        obj = _section(cfg, section)
        if not isinstance(table, dict):
            raise ConfigError(f"{section} must be a table: write it as [{section}]")
        for key, value in table.items():
            setattr(obj, key, _check(value, _field_type(obj, section, key), f"{section}.{key}"))


def apply_overrides(cfg: Any, overrides: list[str]) -> None:
    """Apply ``["--section.key", "value", "--section.key=value", "--bool.flag", ...]``."""
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like "
                              f"--section.key value")
        dotted, eq, text = arg[2:].partition("=")
        value: str | None = text if eq else None
        if not eq and i + 1 < len(overrides) and not overrides[i + 1].startswith("--"):
            value = overrides[i + 1]
            i += 1
        section, dot, key = dotted.partition(".")
        if not dot:
            raise ConfigError(f"--{dotted}: overrides are named --section.key, e.g. "
                              f"--training.steps")
        obj = _section(cfg, section)
        setattr(obj, key, _parse(value, _field_type(obj, section, key), dotted))
        i += 1


def read_config(cfg: C, path: str | Path | None, overrides: list[str] | None = None) -> C:
    """``cfg`` (the defaults), then the TOML file at ``path`` (if any), then ``overrides``;
    returns ``cfg``. Types are checked here, ranges by the caller's ``validate``."""
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"--config {path}: no such file (the presets are in configs/)")
        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: invalid TOML: {e}") from None
        apply_toml(cfg, data)
    apply_overrides(cfg, list(overrides or []))
    return cfg


def explicit_keys(path: str | Path | None, overrides: list[str] | None = None) -> set[str]:
    """The ``section.key`` names the TOML file at ``path`` and ``overrides`` set (whatever
    their values), e.g. for keys a search must keep as the user wrote them. Call it after
    ``read_config`` has accepted both: nothing is checked here."""
    keys: set[str] = set()
    if path is not None:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        keys |= {f"{section}.{key}" for section, table in data.items()
                 if isinstance(table, dict) for key in table}
    for arg in overrides or []:
        if arg.startswith("--"):
            keys.add(arg[2:].partition("=")[0])
    return keys


def split_argv(argv: list[str], aliases: Mapping[str, str] | None = None
               ) -> tuple[str | None, list[str]]:
    """``[--config FILE] [--alias ...] [--section.key value ...]`` -> (FILE, overrides).

    ``aliases`` maps a short flag to the override it stands for (``"--resume"`` ->
    ``"--checkpoint.resume=true"``, ``"--device"`` -> ``"--job.device"``); its value, if
    any, follows as for the override itself."""
    aliases = aliases or {}
    out, path, i = [], None, 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name == "--config":
            if not eq and i + 1 >= len(argv):
                raise ConfigError("--config needs a path to a TOML file")
            path = value if eq else argv[i + 1]
            i += 1 if eq else 2
            continue
        out.append(aliases[name] + eq + value if name in aliases else argv[i])
        i += 1
    return path, out


def config_help(cfg: Any, usage: str, aliases: Mapping[str, str] | None = None) -> str:
    """Every key of ``cfg``'s sections with its type, default and meaning (the comment
    next to its field, :func:`field_docs`), for ``--help``."""
    aliases = aliases or {}
    lines = [f"usage: {usage}",
             *(f"  {short} is short for {long}" for short, long in aliases.items()), ""]
    for section in fields(cfg):
        obj = getattr(cfg, section.name)
        lines.append(f"[{section.name}]")
        docs = field_docs(type(obj))
        for key, tp in get_type_hints(type(obj)).items():
            flag = f"--{section.name}.{key}"
            lines.append(f"  {flag:<40} {_type_name(tp)}; default {getattr(obj, key)!r}")
            lines += textwrap.wrap(docs.get(key, ""), 88, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
    return "\n".join(lines)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: meaning}`` of a config section: the comment lines right above each field
    and the comment after it on its line, as written in the class's source (the one
    place a key's meaning is kept)."""
    names = {f.name for f in fields(cls)}
    docs: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("#").strip())
            continue
        name = text.split(":", 1)[0]
        if name in names and line.startswith("    ") and not line.startswith("     "):
            after = text.partition("  # ")[2].strip()
            docs[name] = " ".join([*above, after] if after else above)
        above = []
    return docs
