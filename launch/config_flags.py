"""Command-line flags derived from a frozen config dataclass, and the config built back.

A config field declares its flag in `dataclasses.field(metadata=...)` as plain data, so a
role's config module needs nothing from the server to declare it:

    flag       the option, e.g. "--block-size" (no `flag`: the field has no option)
    help       the help text; "(default: ...)" is appended from the field's default
    parse      how the text becomes the field's value when the type is not enough:
               "size" (bytes: '4GiB', '512MB', '1e9'), "gib" (GiB as a float, to bytes),
               "mm_limit" (an int or vLLM's '{"image": N, "video": M}'),
               "rate" (a float in [0, 1))
    min        the smallest value allowed (after `parse`); `min_error` words the refusal
    metavar    the value's name in the help
    group      the help section (a key of the `groups` given to `add_config_flags`)
    aliases    more flags (each a dict of these keys) that set the same field
    const      what a `bool` field's flag stores (default: the opposite of the field's
               default; a field defaulting to None may have a flag for each value); on
               a field of another type, a flag that takes no value and stores this one

The rest follows the field's type: a `Literal` gives the choices; `bool` defaulting to
True gives a flag that sets it False (`--disable-...`), defaulting to False (or None) one
that sets it True; `tuple[...]`/`list[...]` take one or more values.

Every such flag defaults to `argparse.SUPPRESS`, so the namespace holds only the flags
that were given and `config_kwargs` returns only those: the dataclass supplies every
other value, its defaults are stated once, and an unset flag can never override them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

GiB = 1 << 30
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20,
          "gi": 1 << 30, "ti": 1 << 40}  # fmt: skip
_Container = argparse.ArgumentParser | argparse._ArgumentGroup


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9' or a plain number of bytes."""
    try:
        return int(float(text))
    except ValueError:
        pass
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MB)")
    unit = (match.group(2) or "").lower().removesuffix("b")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_gib(text: str) -> int:
    """GiB as a non-negative float, to bytes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return int(value * GiB)


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def parse_mm_limit(text: str) -> dict[str, int]:
    """`--limit-mm-per-prompt 4` (images) or vLLM's JSON form `'{"image": 4, "video": 1}'`:
    the limit of each modality given (the others keep their defaults)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not a number or JSON object: {text!r}") from None
    limits = value if isinstance(value, dict) else {"image": value}
    unknown = sorted(set(limits) - {"image", "video"})
    if unknown:
        raise argparse.ArgumentTypeError(
            f"Iris takes images and videos, not {', '.join(map(repr, unknown))}: {text!r}"
        )
    for modality, limit in limits.items():
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise argparse.ArgumentTypeError(
                f"the {modality} limit must be a non-negative int: {text!r}"
            )
    return dict(limits)


def parse_rate(text: str) -> float:
    """A fraction in [0, 1): 0 included (off), 1 excluded (nothing left)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {text}")
    return value


PARSERS: dict[str, Callable[[str], Any]] = {
    "size": parse_bytes,
    "gib": parse_gib,
    "mm_limit": parse_mm_limit,
    "rate": parse_rate,
}


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    section: _Container | None = None,
    groups: Mapping[str, _Container] | None = None,
) -> None:
    """Add a flag for every field of the dataclass `cls` whose metadata names one, to
    `groups[metadata["group"]]`, else to `section` (default: the parser itself)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        spec = field.metadata
        if "flag" not in spec:
            continue
        container = (groups or {}).get(spec.get("group", ""), section or parser)
        kind = _unwrap_optional(hints[field.name])
        for flag_spec in (spec, *spec.get("aliases", ())):
            container.add_argument(
                flag_spec["flag"],
                dest=_dest(cls, field.name),
                default=argparse.SUPPRESS,
                help=_help(flag_spec, field, kind),
                **_kind_kwargs(flag_spec, field, kind),
            )


def config_kwargs(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` whose flags were given, by field name, as the field's type."""
    prefix = _dest(cls, "")
    given = {
        dest.removeprefix(prefix): value
        for dest, value in vars(namespace).items()
        if dest.startswith(prefix)
    }
    hints = typing.get_type_hints(cls)
    for name, value in given.items():
        if typing.get_origin(_unwrap_optional(hints[name])) is tuple:
            given[name] = tuple(value)
    return given


def _dest(cls: type, name: str) -> str:
    """Namespaced per config, so that two configs may have fields of the same name."""
    return f"{cls.__name__}.{name}"


def _unwrap_optional(hint: Any) -> Any:
    """`X | None` → X."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def _kind_kwargs(spec: Mapping[str, Any], field: dataclasses.Field, kind: Any) -> dict[str, Any]:
    """argparse's action, type, choices and nargs for one flag of `field`."""
    if kind is bool:
        return {"action": "store_const", "const": spec.get("const", not field.default)}
    if "const" in spec:
        return {"action": "store_const", "const": spec["const"]}
    origin = typing.get_origin(kind)
    if origin is Literal:
        return {"choices": typing.get_args(kind)}
    # argparse would name the value after the (namespaced) dest; name it after the flag
    kwargs: dict[str, Any] = {"metavar": spec.get("metavar") or _flag_metavar(spec["flag"])}
    if origin in (tuple, list):
        return {**kwargs, "nargs": "+"}
    # argparse's own int and float where nothing else is asked, so errors read as before
    plain = kind if kind in (int, float) else str
    parse = PARSERS[spec["parse"]] if "parse" in spec else plain
    if "min" in spec:
        parse = _at_least(parse_int if parse is int else parse, spec["min"], spec.get("min_error"))
    kwargs["type"] = parse
    return kwargs


def _flag_metavar(flag: str) -> str:
    """'--max-model-len' → 'MAX_MODEL_LEN', as argparse names an option's value."""
    return flag.lstrip("-").replace("-", "_").upper()


def _at_least(
    parse: Callable[[str], Any], minimum: float, error: str | None
) -> Callable[[str], Any]:
    def checked(text: str) -> Any:
        value = parse(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(error or f"must be at least {minimum}, got {value}")
        return value

    checked.__name__ = parse.__name__  # argparse names the type in some errors
    return checked


def _help(spec: Mapping[str, Any], field: dataclasses.Field, kind: Any) -> str:
    """The help text, with the field's default in the flag's unit unless it says one."""
    text = spec["help"]
    default = field.default
    if kind is bool or "const" in spec or default is None or default is dataclasses.MISSING:
        return text
    if "default" in text:
        return text
    if spec.get("parse") == "gib":
        shown = f"{default / GiB:g}"
    elif spec.get("parse") == "size":
        shown = _size_text(default)
    else:
        shown = str(default)
    return f"{text} (default: {shown})"


def _size_text(size: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit[:2].lower()]
        if size >= scale and size % scale == 0:
            return f"{size // int(scale)}{unit}"
    return str(size)
