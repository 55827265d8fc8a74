"""A setting declared once: its config field, default, flag, type, bounds, choices and help in one place.

A program's config is a dataclass whose fields are made with :func:`setting`; :func:`add_flags` writes its command
line from them, and :mod:`neurons.settings` reads the environment and the TOML file through that command line. So a
new setting is one field: at once a flag (``--gateway.port``), an environment variable
(``TENSORGATE_GATEWAY_PORT``) and a file key (``[gateway] port``), checked alike everywhere (a number refuses what
is outside its bounds, a choice what is not one). Before, each was a field with its default and a flag with the
same default and its range in a table apart (issue 40: 58 flags declared twice, config reshaped four times).

Example::

    @dataclass
    class Config:
        port: int = setting(8000, flag="gateway.port", group="gateway", bounds=(0, 65535), help="bind port")

    parser = argparse.ArgumentParser()
    add_flags(parser, Config, groups=("gateway",))
    config_of(vars(parser.parse_args(["--gateway.port", "8001"])), Config).port   # 8001
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .flag_types import number

Kind = Literal["value", "switch", "append", "onoff"]
_SAME = object()  # the flag's default is the field's


@dataclass(frozen=True, slots=True)
class Flag:
    """How a config field appears on the command line."""

    name: str  # without dashes: "gateway.port"
    help: str
    group: str | None  # the help's section (None: the top level)
    type: Callable[[str], Any] | None = None  # int and float need bounds
    bounds: tuple[float, float] | None = None
    choices: tuple[str, ...] | None = None
    kind: Kind = "value"  # "switch": --x sets True; "append": repeatable; "onoff": a bool spelled on | off
    flag_default: Any = _SAME  # where the flag's default differs from the field's (None: "was it given?")
    metavar: str | None = None


def setting(default: Any = None, *, flag: str, help: str, group: str | None = None,
            factory: Callable[[], Any] | None = None, **how: Any) -> Any:
    """A dataclass field that is also a flag (see :class:`Flag` for ``how``)."""
    meta = {"flag": Flag(flag, help, group, **how)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _flag(f: dataclasses.Field[Any]) -> Flag | None:
    flag = f.metadata.get("flag")
    return flag if isinstance(flag, Flag) else None


def _default(f: dataclasses.Field[Any], flag: Flag) -> Any:
    if flag.flag_default is not _SAME:
        return flag.flag_default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    value = f.default
    return ("on" if value else "off") if flag.kind == "onoff" else value


def add_flags(parser: argparse.ArgumentParser, config: type, *, groups: Sequence[str]) -> None:
    """Every :func:`setting` of ``config`` as a flag, under its group's heading (``groups``: their order)."""
    sections: dict[str | None, Any] = {None: parser}
    sections.update((g, parser.add_argument_group(g)) for g in groups)
    for f in dataclasses.fields(config):
        flag = _flag(f)
        if flag is None:
            continue
        kw: dict[str, Any] = {"dest": f.name, "help": flag.help}
        if flag.kind == "switch":
            kw["action"] = "store_true"
        else:
            kw["default"] = _default(f, flag)
            if flag.kind == "append":
                kw["action"] = "append"
            if flag.kind == "onoff":
                kw["choices"] = ("on", "off")
            elif flag.choices is not None:
                kw["choices"] = flag.choices
            kind = flag.type
            if kind in (int, float):
                if flag.bounds is None:
                    raise KeyError(f"number flag --{flag.name} has no bounds")  # a new flag says what it accepts
                kind = number(kind, *flag.bounds)
            if kind is not None:
                kw["type"] = kind
            if flag.metavar is not None:
                kw["metavar"] = flag.metavar
        sections[flag.group].add_argument("--" + flag.name, **kw)


def config_of(values: Mapping[str, Any], config: type) -> Any:
    """The config a parse gave (``values``: its namespace's dict): on/off flags back to bools, the rest as parsed."""
    out = dict(values)
    for f in dataclasses.fields(config):
        flag = _flag(f)
        if flag is not None and flag.kind == "onoff" and f.name in out:
            out[f.name] = out[f.name] == "on"
    return config(**out)
