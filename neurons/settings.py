"""Every flag also from the environment and a TOML file: flags win, then the environment, then the file.

The command line stays the one definition of each setting (its name, type, choices and help); this module reads
the other two sources *through* it, so nothing is declared twice and a new flag is at once an environment variable
and a file key:

* ``--gateway.port 8001`` on the command line;
* ``TENSORGATE_GATEWAY_PORT=8001`` in the environment (the program's prefix, ``TENSORGATE_`` for the validator and
  ``TENSORGATE_MINER_`` for the miner and ``TENSORGATE_REFERENCE_`` for the reference service, so one shell can
  hold all three, + the flag's name in capitals, dots and dashes
  as underscores; a repeatable flag takes a comma-separated list, a switch ``true``/``false``);
* ``[gateway] port = 8001`` in the file named by ``--config`` (or ``<PREFIX>CONFIG``): a table per dotted
  prefix, keys as the flag spells them (``keys-file = "keys.txt"``, top-level ``netuid = 7``). A switch whose name
  is also a table (``--local`` and ``[local]``) is ``enabled`` in that table, since TOML cannot hold both
  ``local = true`` and ``[local]``.

A value from the environment or the file goes through the flag's own type and choices, so a bad one is refused as
a bad flag would be: one line naming where it came from, exit 2. An unknown file key is refused the same way (a
typo must not be a silently ignored setting).

Example::

    parser = build_parser()
    ns = resolve(parser, ["--gateway.port", "8001"], env={"TENSORGATE_NETUID": "7"}, prefix=VALIDATOR_PREFIX)
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

VALIDATOR_PREFIX = "TENSORGATE_"
MINER_PREFIX = "TENSORGATE_MINER_"
REFERENCE_PREFIX = "TENSORGATE_REFERENCE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A value from the environment or the config file that its flag would refuse."""


def add_config_flag(parser: argparse.ArgumentParser, prefix: str) -> None:
    parser.add_argument("--config", default=None, metavar="FILE.toml",
                        help=f"settings file (TOML): any flag, as '[gateway] port = 8001'; ${prefix}CONFIG names one "
                             f"too. Flags win over ${prefix}<FLAG> variables, which win over the file")


def env_name(flag: str, prefix: str) -> str:
    """``gateway.keys-file`` -> ``TENSORGATE_GATEWAY_KEYS_FILE`` (prefix ``TENSORGATE_``)."""
    return prefix + re.sub(r"[.-]", "_", flag).upper()


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each long flag's name without dashes (``gateway.port``), to its action; not --help and --config."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse has no public list of its actions
        if action.dest in ("help", "config"):
            continue
        for opt in action.option_strings:
            if opt.startswith("--"):
                out[opt[2:]] = action
    return out


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _one(action: argparse.Action, raw: Any, where: str) -> Any:
    """One value as the flag's own type and choices would take it from the command line."""
    if isinstance(raw, bool) or isinstance(raw, list | dict):
        raise SettingsError(f"{where}: expected one value, got {raw!r}")
    text = str(raw)
    try:
        value = action.type(text) if callable(action.type) else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise SettingsError(f"{where}: invalid value {raw!r} ({e})") from None
    if action.choices is not None and value not in action.choices:
        raise SettingsError(f"{where}: {raw!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def _coerce(action: argparse.Action, raw: Any, where: str, from_env: bool) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        if isinstance(raw, bool):
            return raw
        if from_env and str(raw).strip().lower() in _TRUE | _FALSE:
            return str(raw).strip().lower() in _TRUE
        raise SettingsError(f"{where}: a switch is true or false, got {raw!r}")
    if isinstance(action, argparse._AppendAction):
        items = [s.strip() for s in str(raw).split(",") if s.strip()] if from_env else raw
        if not isinstance(items, list):
            raise SettingsError(f"{where}: a repeatable setting is a list, got {raw!r}")
        if not items:  # an empty variable is a mistake, not "the default": unset it to mean that
            raise SettingsError(f"{where}: empty; give at least one value, or leave the setting out for its default")
        return [_one(action, item, where) for item in items]
    return _one(action, raw, where)


def file_settings(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's settings, by destination; SettingsError for an unreadable file, an unknown key or a bad value."""
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SettingsError(f"config file {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SettingsError(f"config file {path}: not TOML ({e})") from None
    except RecursionError:
        raise SettingsError(f"config file {path}: tables nested too deeply to be settings") from None
    options = _options(parser)
    out: dict[str, Any] = {}
    try:
        flat = _flatten(table)
    except RecursionError:
        raise SettingsError(f"config file {path}: tables nested too deeply to be settings") from None
    for key, raw in flat.items():
        action = options.get(key)
        owner, _, leaf = key.rpartition(".")
        if action is None and leaf == "enabled" and isinstance(options.get(owner), argparse._StoreTrueAction):
            action = options[owner]  # a switch whose name is also a table: `[local] enabled = true` is `--local`
        if action is None:
            raise SettingsError(f"config file {path}: unknown setting {key!r} (a flag's name, e.g. "
                                f"[gateway] port for --gateway.port)")
        out[action.dest] = _coerce(action, raw, f"config file {path}: {key}", from_env=False)
    return out


# Variables with a program's prefix that are not flags: secrets, test switches, paths (docs/pages/operators.md,
# *Every flag*, names each).
NON_FLAG_VARIABLES = frozenset(VALIDATOR_PREFIX + n for n in (
    "CONFIG", "API_KEYS", "METRICS_KEY", "AUDIT_KEY", "SKIP_REAL", "SKIP_REDIS", "SKIP_VLLM", "MODEL_DIR",
    "FIELD_DIR", "DOCKER_BASE"))
_PREFIXES = (VALIDATOR_PREFIX, MINER_PREFIX, REFERENCE_PREFIX)


def env_settings(env: Mapping[str, str], parser: argparse.ArgumentParser, prefix: str) -> dict[str, Any]:
    """The environment's settings (``<prefix><FLAG>``), by destination. A variable with the program's prefix that
    names no flag is refused like an unknown file key (a typo must not be a silently ignored setting); another
    program's prefix and :data:`NON_FLAG_VARIABLES` are not this program's settings."""
    out: dict[str, Any] = {}
    names: dict[str, str] = {}
    for flag, action in _options(parser).items():
        name = env_name(flag, prefix)
        names[name] = flag
        if name in env:
            out[action.dest] = _coerce(action, env[name], f"${name}", from_env=True)
    others = tuple(p for p in _PREFIXES if p != prefix and p.startswith(prefix))
    for name in env:
        if (name.startswith(prefix) and name not in names and name not in NON_FLAG_VARIABLES
                and not name.startswith(others) and name != prefix + "CONFIG"):
            near = difflib.get_close_matches(name, list(names), n=1)
            hint = f"; did you mean ${near[0]} (--{names[near[0]]})?" if near else ""
            raise SettingsError(f"${name}: no such setting (a flag's name in capitals after {prefix}){hint}")
    return out


def resolve(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
            env: Mapping[str, str] | None = None, *, prefix: str = VALIDATOR_PREFIX) -> argparse.Namespace:
    """Parse ``argv`` with defaults taken from the config file, then the environment (exit 2 on a bad value)."""
    env = os.environ if env is None else env
    args = list(argv) if argv is not None else None
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=env.get(prefix + "CONFIG"))
    known, _ = pre.parse_known_args(args)
    try:
        values = file_settings(Path(known.config).expanduser(), parser) if known.config else {}
        values.update(env_settings(env, parser, prefix))
    except SettingsError as e:
        parser.error(str(e))
    appended = {a.dest for a in parser._actions if isinstance(a, argparse._AppendAction)}
    parser.set_defaults(**{k: v for k, v in values.items() if k not in appended})
    ns = parser.parse_args(args)
    for dest in appended & values.keys():  # a repeated flag replaces the list; argparse would append to it
        if not getattr(ns, dest, None):
            setattr(ns, dest, values[dest])
    return ns
