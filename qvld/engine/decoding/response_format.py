"""A request's ``response_format``, typed from the wire's value: a JSON Schema (as JSON
text in the client's key order: properties come out in it), any JSON object, a regex,
or a Lark/GBNF grammar. Sources too large or nested too deep are refused here, before
anything compiles them (``constraints.GrammarCompiler``); no llguidance needed."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from qvld.errors import BadRequest

FormatType = Literal["json_schema", "json_object", "regex", "grammar"]
FORMAT_TYPES: tuple[FormatType, ...] = ("json_schema", "json_object", "regex", "grammar")
# Sources past these are refused before anything compiles them.
MAX_SOURCE_BYTES = 128 * 1024
MAX_SCHEMA_DEPTH = 64  # JSON nesting; llguidance's own parser stops at 128
FORMAT_KEYS: dict[str, frozenset[str]] = {
    "json_schema": frozenset({"type", "schema"}), "json_object": frozenset({"type"}),
    "regex": frozenset({"type", "pattern"}), "grammar": frozenset({"type", "grammar"}),
    "text": frozenset({"type"}),
}


@dataclass(frozen=True)
class ResponseFormat:
    """What the answer must match: the kind, and its source as llguidance takes it (a
    JSON Schema as JSON text, in the client's key order: properties come out in it)."""

    type: FormatType
    source: str

    @property
    def key(self) -> str:
        """The cache key: the same content compiles once."""
        return hashlib.sha256(f"{self.type}\0{self.source}".encode()).hexdigest()


def _depth(value: Any) -> int:
    """How deep JSON containers nest (iterative: a hostile value cannot overflow)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def schema_text(schema: Any, what: str = "response_format.schema") -> str:
    """A schema (a map, or JSON text: deeper than a protocol frame may nest) -> JSON;
    errors name it as ``what``."""
    if isinstance(schema, str):
        if len(schema.encode()) > MAX_SOURCE_BYTES:
            raise BadRequest(f"{what} is over {MAX_SOURCE_BYTES} bytes")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise BadRequest(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise BadRequest(f"{what} must be a JSON Schema (an object)")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise BadRequest(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError) as exc:  # NaN, bytes or other non-JSON values
        raise BadRequest(f"{what} is not JSON: {exc}") from None
    if len(text.encode()) > MAX_SOURCE_BYTES:
        raise BadRequest(f"{what} is over {MAX_SOURCE_BYTES} bytes")
    return text


def _text_field(value: dict[str, Any], key: str) -> str:
    text = value.get(key)
    if not isinstance(text, str) or not text:
        raise BadRequest(f"response_format.{key} must be a non-empty string")
    if len(text.encode()) > MAX_SOURCE_BYTES:
        raise BadRequest(f"response_format.{key} is over {MAX_SOURCE_BYTES} bytes")
    if "\0" in text:
        raise BadRequest(f"response_format.{key} must not contain a NUL character")
    return text


def parse_response_format(value: Any) -> ResponseFormat | None:
    """protocol v1's ``response_format`` -> what to compile; None for free text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in FORMAT_KEYS:
        raise BadRequest("response_format must be {type: json_schema, schema}, "
                         "{type: json_object}, {type: regex, pattern} or "
                         "{type: grammar, grammar}")
    assert isinstance(value, dict)
    extra = sorted(map(str, set(value) - FORMAT_KEYS[kind]))
    if extra:
        raise BadRequest(f"response_format of type {kind} takes no {extra[0]!r} "
                         f"(it has {', '.join(sorted(FORMAT_KEYS[kind]))})")
    if kind == "text":
        return None
    if kind == "json_schema":
        if "schema" not in value:
            raise BadRequest("response_format of type json_schema needs a schema")
        return ResponseFormat("json_schema", schema_text(value["schema"]))
    if kind == "json_object":
        return ResponseFormat("json_object", '{"type":"object"}')
    if kind == "regex":
        return ResponseFormat("regex", _text_field(value, "pattern"))
    return ResponseFormat("grammar", _text_field(value, "grammar"))
