"""JSON Schema -> the OpenAPI subset Gemini accepts in `functionDeclarations[].parameters`
(its schema dialect). Pure; the input is never mutated.

What the cleaner does, and why (each rule answers a 400 that Gemini gives):
  - `$ref` (to `#/$defs/..`, `#/definitions/..` or any local JSON pointer) is inlined; `$defs`
    are dropped. A recursive reference is cut to `{}` where it recurs (as google-genai does);
    a non-local one also becomes `{}`.
  - `type` becomes Gemini's upper-case enum. `type: [T, "null"]` -> `type: T, nullable: true`
    (every keyword of T kept); several non-null types -> `anyOf` with one branch per type, each
    branch getting only the keywords of its type ("properties: only allowed for OBJECT type").
  - `anyOf`/`oneOf` -> `anyOf`, a `{"type": "null"}` branch -> `nullable`, one branch left ->
    merged into the node; `allOf` branches are merged into the node.
  - A missing `type` is inferred from `properties` (OBJECT), `items` (ARRAY) or a string `enum`.
  - `enum`/`const` survive only as strings on STRING ("enum only allowed for STRING type");
    other values are listed in the description instead.
  - `format` is kept only where Gemini allows it (STRING: enum, date-time; NUMBER: float,
    double; INTEGER: int32, int64).
  - `required` keeps only names defined in `properties`; an empty `properties` map is never
    sent ("should be non-empty for OBJECT type"); an ARRAY without `items` gets
    `{"type": "STRING"}` items ("items: missing field").
  - Kept: description, title, nullable, example (or the first of `examples`), minimum,
    maximum (`exclusiveMinimum`/`exclusiveMaximum` become inclusive bounds), minItems,
    maxItems, minLength, maxLength, pattern, minProperties, maxProperties. Everything else is
    dropped: additionalProperties, $schema, $id, $comment, default, multipleOf, uniqueItems,
    patternProperties, propertyNames, not, if/then/else, readOnly...

`default` is dropped although newer v1beta accepts it: it is documentation only, and older
models reject it. The engine validates arguments against the ORIGINAL schema, so anything the
dialect cannot say is still enforced on our side.
"""

from __future__ import annotations

import json
from typing import Any

_TYPES = {
    "string": "STRING",
    "number": "NUMBER",
    "integer": "INTEGER",
    "boolean": "BOOLEAN",
    "array": "ARRAY",
    "object": "OBJECT",
}
_FORMATS = {
    "STRING": frozenset({"enum", "date-time"}),
    "NUMBER": frozenset({"float", "double"}),
    "INTEGER": frozenset({"int32", "int64"}),
}
_INT_KEYS = {
    "ARRAY": ("minItems", "maxItems"),
    "STRING": ("minLength", "maxLength"),
    "OBJECT": ("minProperties", "maxProperties"),
}
_BOUNDS = (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum"))
# bool before int (bool is an int); a number enum is NUMBER unless every value is an int
_ENUM_KINDS: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("STRING", str),
    ("BOOLEAN", bool),
    ("INTEGER", int),
    ("NUMBER", (int, float)),
)
_MAX_DEPTH = 64  # deeper schemas are cut to `{}` (a tool schema that deep is a bug)


def gemini_parameters(schema: Any) -> dict[str, Any] | None:
    """`parameters` for one function declaration, or None when it takes no arguments (Gemini
    rejects an OBJECT with empty `properties`, so such a declaration goes without parameters)."""
    if not isinstance(schema, dict):
        return None
    out = _Cleaner(schema).clean(schema, frozenset(), 0)
    if "anyOf" in out:
        out = _flatten_union(out)  # the root must be one OBJECT
    if not out.get("properties"):
        return None
    out["type"] = "OBJECT"
    out.pop("nullable", None)
    return out


def _flatten_union(node: dict[str, Any]) -> dict[str, Any]:
    """A root union of objects: every property of every branch, required only if in all."""
    branches = [b for b in node.pop("anyOf") if isinstance(b, dict)]
    props: dict[str, Any] = {}
    for branch in branches:
        for name, sub in (branch.get("properties") or {}).items():
            props.setdefault(name, sub)
    required = [
        name
        for name in props
        if branches and all(name in (b.get("required") or []) for b in branches)
    ]
    out = {**node, "properties": props}
    if required:
        out["required"] = required
    return out


class _Cleaner:
    def __init__(self, root: dict[str, Any]) -> None:
        self._root = root

    def clean(self, schema: Any, refs: frozenset[str], depth: int) -> dict[str, Any]:
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return {}  # `true`, `false` or a cut: any value
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = self._resolve(ref) if ref not in refs else None
            siblings = {k: v for k, v in schema.items() if k not in ("$ref", "$defs")}
            if target is None:
                return self._common(siblings)
            # siblings of a $ref (2020-12) refine the target: they win
            return self.clean({**target, **siblings}, refs | {ref}, depth + 1)
        node = dict(schema)
        parts = [self.clean(b, refs, depth + 1) for b in _schemas(node.pop("allOf", None))]
        union = _schemas(node.pop("anyOf", None)) + _schemas(node.pop("oneOf", None))
        out = self._typed(node, refs, depth)
        for part in parts:
            _merge(out, part)
        if union:
            self._union(out, [self.clean(b, refs, depth + 1) for b in union])
        return out

    def _resolve(self, ref: str) -> dict[str, Any] | None:
        if not ref.startswith("#"):
            return None
        node: Any = self._root
        for token in ref[1:].split("/")[1:] if ref != "#" else []:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                return None
        return node if isinstance(node, dict) else None

    def _typed(self, node: dict[str, Any], refs: frozenset[str], depth: int) -> dict[str, Any]:
        raw_type = node.get("type")
        names = raw_type if isinstance(raw_type, list) else [raw_type]
        nullable = "null" in names or node.get("nullable") is True
        types = [_TYPES[t] for t in names if isinstance(t, str) and t in _TYPES]
        if len(types) > 1:
            out = self._common(node)
            out["anyOf"] = [self._single(node, t, refs, depth, common=False) for t in types]
        else:
            out = self._single(node, types[0] if types else _infer(node), refs, depth)
        if nullable:
            out["nullable"] = True
        return out

    def _single(
        self,
        node: dict[str, Any],
        kind: str | None,
        refs: frozenset[str],
        depth: int,
        common: bool = True,
    ) -> dict[str, Any]:
        out = self._common(node) if common else {}
        values = node["enum"] if isinstance(node.get("enum"), list) else None
        if values is None and "const" in node:
            values = [node["const"]]
        if values is not None:
            kind = _enum(out, values, kind, common)
        if kind is not None:
            out["type"] = kind
        fmt = node.get("format")
        if kind in _FORMATS and isinstance(fmt, str) and fmt in _FORMATS[kind]:
            out["format"] = fmt
        for key in _INT_KEYS.get(kind or "", ()):
            if isinstance(node.get(key), int) and not isinstance(node[key], bool):
                out[key] = node[key]
        if kind in ("NUMBER", "INTEGER"):
            for key, exclusive in _BOUNDS:
                value = node.get(key, node.get(exclusive))
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out[key] = value
        if kind == "STRING" and isinstance(node.get("pattern"), str):
            out["pattern"] = node["pattern"]
        if kind == "OBJECT":
            self._object(out, node, refs, depth)
        elif kind == "ARRAY":
            prefix = node.get("prefixItems")
            items = prefix if isinstance(prefix, list) else node.get("items")
            if isinstance(items, list):
                branches = [self.clean(i, refs, depth + 1) for i in items]
                out["items"] = branches[0] if len(branches) == 1 else {"anyOf": branches}
            elif isinstance(items, dict):
                out["items"] = self.clean(items, refs, depth + 1)
            if not out.get("items"):
                out["items"] = {"type": "STRING"}
        return out

    def _object(
        self, out: dict[str, Any], node: dict[str, Any], refs: frozenset[str], depth: int
    ) -> None:
        props = node.get("properties")
        if isinstance(props, dict) and props:
            out["properties"] = {str(k): self.clean(v, refs, depth + 1) for k, v in props.items()}
            required = node.get("required")
            if isinstance(required, list):
                kept = [r for r in required if isinstance(r, str) and r in out["properties"]]
                if kept:
                    out["required"] = list(dict.fromkeys(kept))

    @staticmethod
    def _common(node: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("description", "title"):
            if isinstance(node.get(key), str):
                out[key] = node[key]
        if node.get("nullable") is True:
            out["nullable"] = True
        if "example" in node:
            out["example"] = node["example"]
        elif isinstance(node.get("examples"), list) and node["examples"]:
            out["example"] = node["examples"][0]
        return out

    @staticmethod
    def _union(out: dict[str, Any], branches: list[dict[str, Any]]) -> None:
        kept = []
        for branch in branches:
            if set(branch) - {"description", "title"} == {"nullable"}:  # was {"type": "null"}
                out["nullable"] = True
            else:
                kept.append(branch)
        if len(kept) == 1:
            _merge(out, kept[0])
        elif kept:
            out["anyOf"] = kept


def _schemas(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def _infer(node: dict[str, Any]) -> str | None:
    if isinstance(node.get("properties"), dict):
        return "OBJECT"
    if "items" in node or "prefixItems" in node:
        return "ARRAY"
    values = node.get("enum") if "enum" in node else [node.get("const")] if "const" in node else []
    present = [v for v in values or [] if v is not None]
    for kind, accepted in _ENUM_KINDS:
        if present and all(isinstance(v, accepted) for v in present):
            return kind
    return None


def _enum(out: dict[str, Any], values: list[Any], kind: str | None, common: bool) -> str | None:
    """Keep a string enum on STRING; describe any other. Returns the (maybe inferred) type."""
    present = [v for v in values if v is not None]
    if len(present) < len(values):
        out["nullable"] = True
    if present and all(isinstance(v, str) for v in present) and kind in (None, "STRING"):
        out["enum"] = present
        return "STRING"
    if present and common:
        allowed = "Allowed values: " + ", ".join(json.dumps(v) for v in present) + "."
        text = out.get("description")
        out["description"] = f"{text} {allowed}" if text else allowed
    return kind


def _merge(out: dict[str, Any], part: dict[str, Any]) -> None:
    """allOf / a single union branch: properties and required unite, the node's keys win."""
    for key, value in part.items():
        if key == "properties" and isinstance(out.get(key), dict):
            out[key] = out[key] | {k: v for k, v in value.items() if k not in out[key]}
        elif key == "required" and isinstance(out.get(key), list):
            out[key] = list(dict.fromkeys([*out[key], *value]))
        else:
            out.setdefault(key, value)
