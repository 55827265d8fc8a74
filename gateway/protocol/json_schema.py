"""The JSON Schema subset the subnet serves, and its bounds: what a client's schema may ask of a miner.

A ``response_format`` schema and every tool's ``parameters`` become a grammar the miner decodes under and the
validator's reference audits under (:mod:`gateway.protocol.structure`, :mod:`neurons.model.grammar`). A grammar's
size and nesting grow with what the schema asks: llama.cpp's converter writes a string's ``maxLength`` of 20,000 as
20,000 nested optional groups (160 kB of grammar), and llama.cpp's recursive parser then overflows its thread's stack
and kills the process (issue 56: the miners, and the validator through its audit); an ``enum`` of 10,000 values took
44.6 s for 16 tokens. A schema outside what the converter understands (a ``pattern`` without anchors, an unknown type,
``minLength: "ten"``) made the miner refuse it, and the gateway booked the refusal against the miner.

So the gateway owns the schema: :func:`check_schema` admits only the subset below, within :class:`Bounds` chosen so
that every runtime compiles the grammar safely and quickly, and refuses anything else with a 400 naming the field,
before any miner is asked. What a miner then refuses for an admitted schema is the miner's failure. The runtimes and
the reference run the same check before they build a grammar (:func:`neurons.model.grammar.gbnf`), so a schema that
reaches them some other way is refused there too, never compiled.

The subset, every keyword of it enforced by the grammar (an annotation changes nothing and is accepted):

* ``type``: ``object``, ``array``, ``string``, ``number``, ``integer``, ``boolean``, ``null``, or a list of them;
* objects: ``properties``, ``required``, ``additionalProperties`` (a boolean or a schema);
* arrays: ``items`` (a schema, or a list of schemas: a tuple), ``prefixItems``, ``minItems``, ``maxItems``;
* strings: ``minLength``, ``maxLength``, ``format`` (:data:`FORMATS`);
* any: ``enum``, ``const``, ``anyOf``, ``oneOf``, ``allOf`` (of object schemas: their properties merged), ``$ref``
  to ``#/$defs/NAME`` or ``#/definitions/NAME`` of the schema's root (no cycles), ``$defs`` and ``definitions`` at
  the root;
* annotations: :data:`ANNOTATIONS`.

Refused by name: ``pattern`` (llama.cpp's converter translates only part of regular-expression syntax, so an admitted
pattern could fail to compile on a miner), numeric bounds (``minimum``, ``maximum``, ``multipleOf``: the converter
does not enforce them), ``not``, conditionals, ``patternProperties``, other string formats, and anything else.

Example::

    check_schema({"type": "string", "maxLength": 20000}, "response_format.json_schema.schema")
    # SchemaError: response_format.json_schema.schema.maxLength: at most 512
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
FORMATS = ("date", "time", "date-time", "uuid")  # what llama.cpp's converter writes a rule for
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "discriminator"})
_REPEATS = ("minLength", "maxLength", "minItems", "maxItems")
KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "prefixItems", "format",
                      "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", *_REPEATS})
_REFUSED_HINTS = {
    "pattern": "use 'enum' or 'format'",
    "minimum": "numbers are not bounded by the grammar", "maximum": "numbers are not bounded by the grammar",
    "exclusiveMinimum": "numbers are not bounded by the grammar",
    "exclusiveMaximum": "numbers are not bounded by the grammar",
    "multipleOf": "numbers are not bounded by the grammar",
}
_REF = re.compile(r"#/(\$defs|definitions)/([^/]+)")


class SchemaError(ValueError):
    """A schema outside the subset or its bounds: ``param`` is the path of the field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one request's schemas may ask, together (every tool's ``parameters`` go into one grammar).

    ``repeat`` bounds a grammar's nesting (a length or count of N is N nested groups), ``repeat_total`` and
    ``subschemas`` its size, ``enum_values`` and ``alternatives`` the branches llama.cpp's grammar sampler follows at
    once (its cost a token). Measured on llama.cpp with Gemma 3 270M on this CPU: grammars at these bounds convert
    and compile in milliseconds and decode at 1.1x a free token greedy (an enum of 256 values: 3.2x, so 128 here);
    llama.cpp refuses a grammar nested about 1,000 deep. ``docs/pages/api.md`` has the figures,
    ``tests/test_schema_bounds.py`` compiles every bound on llama.cpp.
    """

    schema_bytes: int = 16_384  # one schema's JSON text
    depth: int = 10  # nesting of subschemas, through $refs too (OpenAI allows 10)
    subschemas: int = 512  # in all of a request's schemas
    properties: int = 64  # one object's properties, one tuple's items
    alternatives: int = 16  # one anyOf, oneOf, allOf or type list
    enum_values: int = 128  # in all of a request's schemas
    literal_chars: int = 256  # one enum or const value as JSON text
    repeat: int = 512  # one string's minLength / maxLength, one array's minItems / maxItems
    repeat_total: int = 2_048  # all of those together
    least_chars: int = 4_096  # the shortest answer the schema allows, as JSON text (nested minItems multiply)


BOUNDS = Bounds()


@dataclass(slots=True)
class Budget:
    """What a request's schemas have used of :class:`Bounds` so far: pass one to every :func:`check_schema` of a
    request."""

    bounds: Bounds = BOUNDS
    subschemas: int = 0
    enum_values: int = 0
    repeat_total: int = 0
    defs: dict[str, str] = field(default_factory=dict)  # root definitions' names -> JSON, across a request's tools


def check_schema(schema: Any, param: str, budget: Budget | None = None) -> None:
    """Refuse ``schema`` (a :class:`SchemaError` naming the field) unless it is in the subset and, with what
    ``budget`` already holds, within its bounds."""
    budget = budget or Budget()
    b = budget.bounds
    if not isinstance(schema, dict):
        raise SchemaError(param, "a schema must be a JSON object")
    try:
        size = len(json.dumps(schema, ensure_ascii=False, allow_nan=False))
    except (ValueError, TypeError, RecursionError):
        raise SchemaError(param, "cannot be written as JSON text (NaN, an infinity, or nested too deeply)") from None
    if size > b.schema_bytes:
        raise SchemaError(param, f"a schema may be at most {b.schema_bytes} bytes as JSON, this one is {size}")
    _Walk(schema, param, budget).root()


class _Walk:
    """One schema's check: each node's keywords, the request's totals, and each definition once."""

    def __init__(self, schema: dict[str, Any], param: str, budget: Budget) -> None:
        self.schema, self.param, self.budget, self.b = schema, param, budget, budget.bounds
        self.defs: dict[str, tuple[str, Any]] = {}  # name -> (its path, its schema)
        self.heights: dict[str, tuple[int, int]] = {}  # a definition checked: its height and least size
        self.open: set[str] = set()  # definitions being checked: a $ref back to one is a cycle

    def root(self) -> None:
        for key in ("$defs", "definitions"):
            found = self.schema.get(key)
            if found is None:
                continue
            if not isinstance(found, dict):
                raise SchemaError(f"{self.param}.{key}", "must map names to schemas")
            for name, sub in found.items():
                self._define(name, f"{self.param}.{key}.{name}", sub)
        _, least = self.node(self.schema, self.param, 1, root=True)
        for name, (path, _) in self.defs.items():  # unreferenced definitions are checked too
            self._height_of(name, path)
        if least > self.b.least_chars:
            raise SchemaError(self.param, f"the shortest answer this schema allows is about {least} characters, over "
                                          f"{self.b.least_chars} (minItems and minLength multiply through nesting)")

    def _define(self, name: str, path: str, sub: Any) -> None:
        text = json.dumps(sub, sort_keys=True)
        seen = self.budget.defs.get(name)
        if seen is not None and seen != text:
            raise SchemaError(path, f"another schema of this request defines {name!r} otherwise (one grammar "
                                    "holds them all: give it another name)")
        self.budget.defs[name] = text
        if name in self.defs:
            raise SchemaError(path, f"{name!r} is defined twice ($defs and definitions)")
        self.defs[name] = (path, sub)

    def node(self, s: Any, path: str, depth: int, *, root: bool = False) -> tuple[int, int]:
        """Check subschema ``s`` at ``depth``: its height (1 for a leaf) and the length of its shortest instance as
        JSON text, as the grammar reads it (llama.cpp's converter takes ``$ref``, then ``anyOf``/``oneOf``, a type
        list, ``const``, ``enum``, an object's, an array's, a string's keywords, in that order)."""
        b, budget = self.b, self.budget
        if depth > b.depth:
            raise SchemaError(path, f"schemas may nest at most {b.depth} levels deep")
        if not isinstance(s, dict):
            raise SchemaError(path, "a schema must be a JSON object")
        budget.subschemas += 1
        if budget.subschemas > b.subschemas:
            raise SchemaError(path, f"a request's schemas may hold at most {b.subschemas} subschemas in all")
        for key in s:
            if key in ANNOTATIONS or key in KEYWORDS:
                continue
            hint = _REFUSED_HINTS.get(key)
            raise SchemaError(f"{path}.{key}", f"'{key}' is not supported in a schema"
                              f"{f' ({hint})' if hint else ''}; see the subnet's subset in the API docs")
        if not root:
            for key in ("$defs", "definitions"):
                if key in s:
                    raise SchemaError(f"{path}.{key}", "definitions are read at the schema's root only")
        self._type(s, path)
        literal = self._literals(s, path)
        self._repeats(s, path)
        fmt = s.get("format")
        if fmt is not None and not (isinstance(fmt, str) and (fmt in FORMATS or re.fullmatch(r"uuid[1-5]", fmt))):
            raise SchemaError(f"{path}.format", f"supported formats: {', '.join(FORMATS)}")
        # (height, least size) of each part, in the converter's order: the first that applies makes the grammar
        parts: list[tuple[int, int]] = []
        if "$ref" in s:
            parts.append(self._ref(s["$ref"], f"{path}.$ref", depth))
        for key in ("anyOf", "oneOf"):
            if key in s:
                parts.append(self._alternatives(s[key], f"{path}.{key}", depth, merged=False))
        parts.append((0, 1 if isinstance(s.get("type"), list) else _NOT_THIS))
        parts.append((0, _NOT_THIS if literal is None else literal))
        parts.append(self._object(s, path, depth))
        if "allOf" in s:
            parts.append(self._alternatives(s["allOf"], f"{path}.allOf", depth, merged=True))
        parts.append(self._array(s, path, depth))
        parts.append((0, 2 + int(s.get("minLength") or 0) if s.get("type") == "string" else 1))
        height = max(h for h, _ in parts)
        least = next(n for _, n in parts if n != _NOT_THIS)
        return 1 + height, least

    def _type(self, s: dict[str, Any], path: str) -> None:
        kind = s.get("type")
        if kind is None or (isinstance(kind, str) and kind in TYPES):
            return
        if isinstance(kind, list) and kind and all(isinstance(k, str) and k in TYPES for k in kind) \
                and len(set(kind)) == len(kind):
            return
        raise SchemaError(f"{path}.type", f"must be one of {', '.join(TYPES)}, or a list of them, each once")

    def _literals(self, s: dict[str, Any], path: str) -> int | None:
        """Check ``const`` and ``enum``; the shortest value's JSON length when the grammar is one of them."""
        values: list[tuple[str, Any]] = []
        if "enum" in s:
            enum = s["enum"]
            if not isinstance(enum, list) or not enum:
                raise SchemaError(f"{path}.enum", "must be a non-empty list")
            self.budget.enum_values += len(enum)
            if self.budget.enum_values > self.b.enum_values:
                raise SchemaError(f"{path}.enum", f"a request's schemas may list at most {self.b.enum_values} "
                                                  "enum values in all")
            values.extend((f"{path}.enum[{i}]", v) for i, v in enumerate(enum))
        if "const" in s:
            values.insert(0, (f"{path}.const", s["const"]))  # const comes first, as the converter reads it
        sizes = []
        for where, value in values:
            sizes.append(len(json.dumps(value, ensure_ascii=False)))
            if sizes[-1] > self.b.literal_chars:
                raise SchemaError(where, f"a value may be at most {self.b.literal_chars} characters as JSON")
        if not sizes:
            return None
        return sizes[0] if "const" in s else min(sizes)

    def _repeats(self, s: dict[str, Any], path: str) -> None:
        for low, high in (("minLength", "maxLength"), ("minItems", "maxItems")):
            got = {}
            for key in (low, high):
                v = s.get(key)
                if v is None:
                    continue
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= self.b.repeat:
                    raise SchemaError(f"{path}.{key}", f"must be an integer from 0 to {self.b.repeat}")
                got[key] = v
            if low in got and high in got and got[low] > got[high]:
                raise SchemaError(f"{path}.{low}", f"is over {high}")
            self.budget.repeat_total += max(got.values(), default=0)
            if self.budget.repeat_total > self.b.repeat_total:
                raise SchemaError(f"{path}.{high if high in got else low}",
                                  f"a request's schemas may ask for at most {self.b.repeat_total} characters and "
                                  "items in all through minLength, maxLength, minItems and maxItems")

    def _ref(self, ref: Any, path: str, depth: int) -> tuple[int, int]:
        found = _REF.fullmatch(ref) if isinstance(ref, str) else None
        if found is None or found.group(2) not in self.defs:
            raise SchemaError(path, "must name a definition of the schema's root: '#/$defs/NAME' or "
                                    "'#/definitions/NAME'")
        height, least = self._height_of(found.group(2), path)
        if depth + height > self.b.depth:
            raise SchemaError(path, f"schemas may nest at most {self.b.depth} levels deep, through $refs too")
        return height, least

    def _height_of(self, name: str, via: str) -> tuple[int, int]:
        if name in self.heights:
            return self.heights[name]
        if name in self.open:
            raise SchemaError(via, f"definition {name!r} refers back to itself (recursive schemas are not served)")
        self.open.add(name)
        path, sub = self.defs[name]
        self.heights[name] = self.node(sub, path, 1)
        self.open.discard(name)
        return self.heights[name]

    def _alternatives(self, options: Any, path: str, depth: int, merged: bool) -> tuple[int, int]:
        """``anyOf``/``oneOf`` (the shortest option) or ``allOf`` (``merged``: object schemas, their sizes summed)."""
        if not isinstance(options, list) or not options or len(options) > self.b.alternatives:
            raise SchemaError(path, f"must be a list of 1 to {self.b.alternatives} schemas")
        parts = []
        for i, option in enumerate(options):
            where = f"{path}[{i}]"
            if merged and not (isinstance(option, dict) and ("properties" in option or "$ref" in option)):
                raise SchemaError(where, "allOf combines object schemas (with 'properties', or a '$ref' to one)")
            parts.append(self.node(option, where, depth + 1))
        height = max(h for h, _ in parts)
        return height, sum(n for _, n in parts) if merged else min(n for _, n in parts)

    def _object(self, s: dict[str, Any], path: str, depth: int) -> tuple[int, int]:
        """An object's keywords: its height, and its shortest instance (its required properties) when it is one."""
        height, least = 0, 2
        props = s.get("properties")
        required = s.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)
                                         and len(set(required)) == len(required)):
            raise SchemaError(f"{path}.required", "must be a list of property names, each once")
        if props is not None:
            if not isinstance(props, dict) or len(props) > self.b.properties:
                raise SchemaError(f"{path}.properties", f"must map at most {self.b.properties} names to schemas")
            for name, sub in props.items():
                if len(name) > self.b.literal_chars:
                    raise SchemaError(f"{path}.properties", f"a property name may be at most "
                                                            f"{self.b.literal_chars} characters")
                h, n = self.node(sub, f"{path}.properties.{name}", depth + 1)
                height = max(height, h)
                if name in (required or ()):
                    least += len(json.dumps(name, ensure_ascii=False)) + 2 + n
        extra = s.get("additionalProperties")
        if isinstance(extra, dict):
            height = max(height, self.node(extra, f"{path}.additionalProperties", depth + 1)[0])
        elif extra is not None and not isinstance(extra, bool):
            raise SchemaError(f"{path}.additionalProperties", "must be a boolean or a schema")
        is_object = s.get("type") in (None, "object") and (props is not None or extra not in (None, True))
        return height, least if is_object else _NOT_THIS

    def _array(self, s: dict[str, Any], path: str, depth: int) -> tuple[int, int]:
        """An array's keywords: its height, and its shortest instance (``minItems`` items, or the tuple's)."""
        parts: list[tuple[int, int]] = []
        tuple_form = False
        for key in ("items", "prefixItems"):
            items = s.get(key)
            if items is None:
                continue
            if isinstance(items, dict) and key == "items":
                if not items:  # the converter reads an empty schema here as no items at all, and fails
                    raise SchemaError(f"{path}.items", "an empty schema: leave 'items' out for items of any type")
                parts.append(self.node(items, f"{path}.{key}", depth + 1))
                continue
            if not isinstance(items, list) or not items or len(items) > self.b.properties:
                what = "a schema or a list" if key == "items" else "a list"
                raise SchemaError(f"{path}.{key}", f"must be {what} of 1 to {self.b.properties} schemas")
            tuple_form = tuple_form or key == "items" or "items" not in s
            parts.extend(self.node(item, f"{path}.{key}[{i}]", depth + 1) for i, item in enumerate(items))
        if not parts or s.get("type") not in (None, "array"):
            return max((h for h, _ in parts), default=0), _NOT_THIS
        height = max(h for h, _ in parts)
        if tuple_form:
            return height, 2 + sum(n + 1 for _, n in parts)
        return height, 2 + int(s.get("minItems") or 0) * (parts[0][1] + 1)


_NOT_THIS = -1  # a part the schema's grammar is not made of (its least size is another part's)
