"""Tool calling as Qwen3-VL does it: tools in, ``<tool_call>`` blocks out.

The model is told its tools by the chat template (``tools=``, a system block listing
each definition as JSON) and answers a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(several blocks, one per line, for parallel calls). ``<tool_call>`` and ``</tool_call>``
are single added tokens of Qwen's vocabulary.

- ``parse_tools`` types a request's ``tools``, ``tool_choice`` and
  ``parallel_tool_calls`` (OpenAI's shapes; protocol v1 takes the same);
- ``ToolSet.response_format``: for ``tool_choice`` ``required`` or a named function, a
  grammar the structured-output engine enforces (the call's block, its arguments
  following the function's JSON Schema), so even a weak model returns a valid call;
  ``auto`` leaves the model free; ``none`` does not show the tools at all. Arguments
  are compact JSON with no properties beyond those declared, where the schema does not
  say otherwise (xgrammar's strict mode; a weak model otherwise never closes them);
- ``split_calls``: a finished answer -> its content and its calls. All or nothing: an
  answer whose blocks do not all parse (bad JSON, an unknown function, text after a
  call, a block cut off by the token budget) is text, never a guessed call;
- ``HeldText``: a streaming answer's text is passed on up to the first ``<tool_call>``;
  what follows is held for ``split_calls``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from qvld.engine.decoding.response_format import MAX_SOURCE_BYTES, ResponseFormat, schema_text
from qvld.errors import BadRequest

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
MAX_TOOLS = 128  # OpenAI's own limit
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function-name rule
Mode = Literal["auto", "none", "required", "named"]


@dataclass(frozen=True)
class Tool:
    name: str
    definition: dict[str, Any]  # as the client sent it: the template shows it so
    parameters: str  # the arguments' JSON Schema, as JSON text


@dataclass(frozen=True)
class ToolSet:
    """A request's tools and what it asks of them."""

    tools: tuple[Tool, ...]
    mode: Mode = "auto"
    name: str | None = None  # the function a named tool_choice asks for
    parallel: bool = True

    @property
    def shown(self) -> list[dict[str, Any]] | None:
        """The definitions the template lists (none when the tools may not be called)."""
        return None if self.mode == "none" else [t.definition for t in self.tools]

    @property
    def parses(self) -> bool:
        """Whether the answer may hold calls."""
        return self.mode != "none"

    def response_format(self) -> ResponseFormat | None:
        """The grammar that enforces ``required`` or a named function; None otherwise."""
        if self.mode not in ("required", "named"):
            return None
        chosen = [t for t in self.tools if self.mode == "required" or t.name == self.name]
        rules = [f"call_{i}: <tool_call> {_lark(chr(10) + _head(t.name))} args_{i} "
                 f"{_lark('}' + chr(10))} </tool_call>\nargs_{i}: %json {_compact(t.parameters)}"
                 for i, t in enumerate(chosen)]
        one = " | ".join(f"call_{i}" for i in range(len(chosen)))
        repeat = self.mode == "required" and self.parallel
        start = f"start: call ({_lark(chr(10))} call)*" if repeat else "start: call"
        return ResponseFormat("grammar", "\n".join([start, f"call: {one}", *rules]) + "\n")


def _head(name: str) -> str:
    return f'{{"name": "{name}", "arguments": '


def _lark(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def _compact(parameters: str) -> str:
    """The schema as the call's grammar follows it: compact JSON (llguidance's option; a
    weak model otherwise fills its budget with whitespace) and objects closed."""
    schema = json.loads(parameters)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return json.dumps({**_closed(schema), "x-guidance": {"whitespace_flexible": False}},
                      ensure_ascii=False)


# Where JSON Schema keeps subschemas: maps of them, lists of them, or one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "not", "if",
               "then", "else", "contains", "propertyNames", "additionalItems")


def _closed(schema: Any) -> Any:
    """Every object schema that does not say otherwise takes no properties beyond those
    it declares (``additionalProperties: false``, as xgrammar's strict mode does and
    OpenAI's strict mode requires): a function's arguments are its parameters, and a
    weak model otherwise adds properties until the budget ends. Walks subschemas only
    (never data such as ``enum`` values), iteratively."""
    root: Any = json.loads(json.dumps(schema))  # a copy to change
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if ("properties" in node or node.get("type") == "object") and not {
                "additionalProperties", "patternProperties",
                "unevaluatedProperties"} & set(node):
            node["additionalProperties"] = False
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        stack.extend(node[key] for key in _SCHEMA_ONE if isinstance(node.get(key), dict))
    return root


def _tool(value: Any, where: str) -> Tool:
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" \
            or not isinstance(function, dict):
        raise BadRequest(f"{where} must be {{type: function, function: {{name, "
                         "description, parameters}}}")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise BadRequest(f"{where}.function.name must be 1-64 characters of [A-Za-z0-9_-]")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise BadRequest(f"{where}.function.description must be a string")
    if function.get("strict") not in (None, True, False):
        raise BadRequest(f"{where}.function.strict must be true or false")
    parameters = function.get("parameters")
    text = ('{"type":"object"}' if parameters is None
            else schema_text(parameters, f"{where}.function.parameters"))
    return Tool(name, value, text)


def parse_tools(tools: Any, tool_choice: Any = None,
                parallel_tool_calls: Any = None) -> ToolSet | None:
    """protocol v1's ``tools``, ``tool_choice``, ``parallel_tool_calls`` -> a ToolSet
    (None when no tools are given and none are asked for)."""
    if parallel_tool_calls not in (None, True, False):
        raise BadRequest("parallel_tool_calls must be true or false")
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice asks for a tool but no tools are given")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"tools must be a list of at most {MAX_TOOLS} functions")
    parsed = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise BadRequest("tools: each function needs a name of its own")
    if sum(len(t.parameters) for t in parsed) > MAX_SOURCE_BYTES:
        raise BadRequest(f"tools: the parameters' schemas are over {MAX_SOURCE_BYTES} bytes "
                         "together")
    parallel = parallel_tool_calls is not False
    if tool_choice in (None, "auto", "none", "required"):
        return ToolSet(parsed, tool_choice or "auto", None, parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" \
            or not isinstance(name, str):
        raise BadRequest("tool_choice must be none, auto, required or "
                         "{type: function, function: {name}}")
    if name not in names:
        raise BadRequest(f"tool_choice names {name!r}, which is not among the tools "
                         f"({', '.join(names)})")
    return ToolSet(parsed, "named", name, parallel)


# -- the answer ------------------------------------------------------------------------

@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def split_calls(text: str, tools: ToolSet) -> tuple[str, list[ToolCall]] | None:
    """(content, calls) when ``text`` ends in well-formed calls of known functions;
    None when it holds none, or any block that is not one (then it is all text)."""
    start = text.find(CALL_OPEN)
    if start < 0 or not tools.parses:
        return None
    names = {t.name for t in tools.tools}
    calls: list[ToolCall] = []
    rest = text[start:]
    while rest:
        if not rest.startswith(CALL_OPEN):
            return None  # text between or after the calls
        end = rest.find(CALL_CLOSE)
        if end < 0:
            return None  # cut off before its end
        call = _members(rest[len(CALL_OPEN):end])
        if call is None or set(call) != {"name", "arguments"} \
                or call["name"][0] not in names or not isinstance(call["arguments"][0], dict):
            return None
        # The arguments as the model wrote them: valid JSON, never re-serialised (8e5
        # stays 8e5; a number past a double's range stays a number, not Infinity).
        calls.append(ToolCall(call["name"][0], call["arguments"][1]))
        rest = rest[end + len(CALL_CLOSE):].lstrip("\n")
    if tools.mode == "named" or not tools.parallel:
        calls = calls[:1]
    return text[:start].rstrip("\n"), calls


def _not_json(literal: str) -> Any:
    raise ValueError(f"{literal} is not JSON")


_STRICT = json.JSONDecoder(parse_constant=_not_json)  # NaN and Infinity are not JSON
_SPACE = " \t\n\r"


def _members(text: str) -> dict[str, tuple[Any, str]] | None:
    """A JSON object's members: each value and its text as written; None when ``text``
    is not one strict JSON object (or repeats a key)."""
    try:
        at = len(text) - len(text.lstrip(_SPACE))
        if text[at:at + 1] != "{":
            return None
        at += 1
        members: dict[str, tuple[Any, str]] = {}
        while True:
            while text[at:at + 1] in tuple(_SPACE):
                at += 1
            if text[at:at + 1] == "}" and not members:
                at += 1
                break
            key, at = _STRICT.raw_decode(text, at)
            while text[at:at + 1] in tuple(_SPACE):
                at += 1
            if not isinstance(key, str) or key in members or text[at:at + 1] != ":":
                return None
            at += 1
            while text[at:at + 1] in tuple(_SPACE):
                at += 1
            value, end = _STRICT.raw_decode(text, at)
            members[key] = (value, text[at:end])
            at = end
            while text[at:at + 1] in tuple(_SPACE):
                at += 1
            if text[at:at + 1] == "}":
                at += 1
                break
            if text[at:at + 1] != ",":
                return None
            at += 1
    except (ValueError, RecursionError):
        return None
    return members if not text[at:].strip(_SPACE) else None


class HeldText:
    """An ``on_token`` that passes text up to the first ``<tool_call>`` and holds the
    rest (a trailing partial ``<tool_call>`` is held until the next token tells); the
    ids and logprobs always go on. ``release`` passes the held text when the answer
    turned out not to be calls."""

    def __init__(self, on_token: Callable[..., None]) -> None:
        self._on_token = on_token
        self.passed = ""  # the text passed on so far
        self.held = ""
        self._holding = False  # a <tool_call> was seen: hold everything from here

    def __call__(self, text: str, ids: list[int], **kw: Any) -> None:
        if not self._holding:
            pending = self.held + text
            at = pending.find(CALL_OPEN)
            if at >= 0:
                self._holding = True
                passed, self.held = pending[:at], pending[at:]
            else:
                keep = _partial_suffix(pending, CALL_OPEN)
                passed, self.held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        else:
            passed, self.held = "", self.held + text
        self.passed += passed
        self._on_token(passed, ids, **kw)

    def release(self, content: str) -> None:
        """Pass whatever of ``content`` (the answer's final text) is not passed yet."""
        if content.startswith(self.passed) and len(content) > len(self.passed):
            rest = content[len(self.passed):]
            self.passed = content
            self._on_token(rest, [])


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
