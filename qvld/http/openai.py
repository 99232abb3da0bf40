"""OpenAI chat completions <-> protocol v1 ``generate``: translation only, no I/O.

``parse_chat`` turns a ``POST /v1/chat/completions`` body into the params the socket's
``generate`` takes (so one parser, ``qvld.engine.inputs.request``, still checks every value);
the other functions shape results, stream chunks and errors the way OpenAI's clients
read them. Images come as ``data:`` URLs (PNG, JPEG, WebP, GIF); http(s) URLs are left
for the caller to fetch, where the admin allows it.

``response_format`` is OpenAI's (``text``, ``json_object``, ``json_schema`` with its
``name``, ``description``, ``schema`` and ``strict``; every schema is enforced, strict or
not), plus protocol v1's ``regex`` and ``grammar`` types as extensions.
``tools``, ``tool_choice`` and ``parallel_tool_calls`` go to protocol v1 as they are
(``qvld.engine.inputs.tools``); the answer's calls come back as ``message.tool_calls`` (and, in
a stream, as ``delta.tool_calls``: each call's id and name, then its arguments).
Fields OpenAI defines but qvld does not do (legacy ``functions``, audio, ...) are refused
when they ask for something, and accepted at their "off" value, because clients send
them by default. Unknown fields are refused with a did-you-mean.
Extensions, as llama-server and vLLM accept them: ``top_k``, ``min_p``,
``repetition_penalty``, ``chat_template_kwargs``, ``max_image_tokens``, ``ignore_eos``,
``session`` (or the ``X-Qvld-Session`` header).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from qvld.config import did_you_mean
from qvld.engine.inputs.request import MAX_CHOICES
from qvld.engine.inputs.tools import parse_tools
from qvld.errors import BadRequest, QvlError
from qvld.http.dialect import bad, error_status
from qvld.http.media import RemoteImage, data_url_bytes, is_http_url, video_data_url_bytes

FIELDS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "seed", "stop", "presence_penalty", "frequency_penalty", "n", "user", "stream",
    "stream_options", "response_format", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "logit_bias",
    # accepted for what current clients send; they change nothing here (checked types)
    "metadata", "store", "prompt_cache_key", "safety_identifier", "service_tier",
    "verbosity", "reasoning_effort",
    # what vLLM, llama-server and ollama accept: the prefix cache is automatic
    # (cache_prompt), the model stays loaded (keep_alive); n_predict is max_tokens
    "cache_prompt", "keep_alive", "n_predict",
    # extensions
    "top_k", "min_p", "repetition_penalty", "chat_template_kwargs", "max_image_tokens",
    "ignore_eos", "session", "session_turns",
})
# name -> the values that ask for nothing (what clients send by default).
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "prediction": (None,),
    "audio": (None,), "web_search_options": (None,),
}
# Passed through to protocol v1 as they are (its parser checks types and ranges).
PASSED = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
          "top_k", "min_p", "repetition_penalty", "max_image_tokens", "ignore_eos", "session",
          "session_turns", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
          "logit_bias")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
# A tool message's tool_call_id ties it to a call; Qwen's template shows the results in
# order, so it is accepted and not used.
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id",
                          "refusal"})
MAX_USER_CHARS = 256

# The error "type" OpenAI's clients show, by HTTP status.
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
         409: "invalid_request_error",
         413: "invalid_request_error", 415: "invalid_request_error",
         421: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 503: "unavailable_error",
         504: "timeout_error"}


@dataclass
class ChatRequest:
    params: dict[str, Any]  # protocol v1 generate params
    stream: bool
    include_usage: bool
    model: str | None
    user: str | None
    remote_images: list[RemoteImage] = field(default_factory=list)


def parse_chat(body: Any, session: str | None = None,
               low_detail_tokens: int = 64) -> ChatRequest:
    """A chat-completions body -> protocol v1 generate params (``session``: the
    X-Qvld-Session header, which wins over the body's field)."""
    if not isinstance(body, dict):
        raise bad("", "the request body must be a JSON object")
    for name in body:
        if name in FIELDS:
            continue
        if name in OFF_VALUES:
            if body[name] not in OFF_VALUES[name]:
                raise bad(name, f"{name} is not supported by this server")
            continue
        hint = did_you_mean(str(name), FIELDS | set(OFF_VALUES))
        raise bad(str(name), f"unknown field {name!r}{hint}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string")
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool)
                          or not 1 <= n <= MAX_CHOICES):
        raise bad("n", f"n must be an integer within 1..{MAX_CHOICES}")
    _accepted(body)
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise bad("user", f"user must be a string of at most {MAX_USER_CHARS} characters")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    include_usage = stream_options(body.get("stream_options"), stream)
    messages, remote, details = _messages(body.get("messages"))
    params: dict[str, Any] = {"messages": messages, "stream": stream}
    tokens = _max_tokens(body)
    if tokens is not None:
        params["max_tokens"] = tokens
    for name in PASSED:
        if body.get(name) is not None:
            params[name] = body[name]
    if session is not None:
        params["session"] = session
    if n is not None and n > 1:
        if "session" in params:
            raise bad("n", "n > 1 cannot continue a session (a session keeps one history)")
        params["n"] = n
    _tools(body)
    logprobs = _logprobs(body)
    if logprobs is not None:
        params["logprobs"] = logprobs
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        params["response_format"] = response_format
    if "max_image_tokens" not in params and details and all(d == "low" for d in details):
        params["max_image_tokens"] = low_detail_tokens
    return ChatRequest(params, stream, include_usage, model, user, remote)


# The fields accepted and ignored, by the type each must have (what OpenAI documents).
ACCEPTED: dict[str, tuple[type, ...]] = {
    "metadata": (dict,), "store": (bool,), "prompt_cache_key": (str,),
    "safety_identifier": (str,), "service_tier": (str,), "verbosity": (str,),
    "reasoning_effort": (str,), "cache_prompt": (bool,), "keep_alive": (str, int, float)}


def _accepted(body: dict[str, Any]) -> None:
    """Fields current clients send that mean nothing here: the KV prefix cache is
    automatic (``prompt_cache_key``), nothing is stored (``store``), there is one tier;
    checked for their type so that a typo in a value is still told."""
    for name, types in ACCEPTED.items():
        value = body.get(name)
        if value is not None and not isinstance(value, types):
            raise bad(name, f"{name} must be {' or '.join(t.__name__ for t in types)}")
    metadata = body.get("metadata")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in metadata.items()):
        raise bad("metadata", "metadata must map strings to strings")


JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` -> protocol v1's (which checks the content)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_schema":
        assert isinstance(value, dict)
        if set(value) != {"type", "json_schema"}:
            raise bad("response_format", "response_format of type json_schema has "
                      "exactly type and json_schema")
        spec = value["json_schema"]
        if not isinstance(spec, dict):
            raise bad("response_format.json_schema", "response_format.json_schema must be "
                      "an object {name, schema, strict, description}")
        extra = sorted(map(str, set(spec) - JSON_SCHEMA_KEYS))
        if extra:
            raise bad(f"response_format.json_schema.{extra[0]}",
                      f"response_format.json_schema.{extra[0]} is not a field "
                      f"(it has {', '.join(sorted(JSON_SCHEMA_KEYS))})")
        name = spec.get("name")
        if name is not None and (not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name)):
            raise bad("response_format.json_schema.name", "response_format.json_schema.name "
                      "must be 1-64 characters of [A-Za-z0-9_-]")
        if spec.get("strict") not in (None, True, False):
            raise bad("response_format.json_schema.strict",
                      "response_format.json_schema.strict must be true or false")
        if spec.get("schema") is None:  # OpenAI's schema is optional: any JSON object
            return {"type": "json_object"}
        return {"type": "json_schema", "schema": spec["schema"]}
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind in ("text", "json_object", "regex", "grammar"):
        return dict(value)  # protocol v1's shape: its parser checks the rest
    raise bad("response_format", "response_format.type must be text, json_object, "
              "json_schema (or, as extensions, regex or grammar)")


def _tools(body: dict[str, Any]) -> None:
    """Checked here too (protocol v1 checks them again), so that an error names its
    field."""
    try:
        parse_tools(body.get("tools"), body.get("tool_choice"),
                    body.get("parallel_tool_calls"))
    except BadRequest as exc:
        field = next((name for name in ("tool_choice", "parallel_tool_calls")
                      if exc.message.startswith(name)), "tools")
        raise bad(field, exc.message) from None


def _logprobs(body: dict[str, Any]) -> int | None:
    """``logprobs: true`` (and ``top_logprobs``: 0..20 alternatives) -> protocol v1's
    ``logprobs: N``; None when not asked."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted not in (None, True, False):
        raise bad("logprobs", "logprobs must be true or false")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                            or not 0 <= top <= 20):
        raise bad("top_logprobs", "top_logprobs must be an integer within 0..20")
    if not wanted:
        if top:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    return top or 0


def stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage",
                                                         "include_obfuscation"}:
        raise bad("stream_options", "stream_options may hold include_usage only")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad("stream_options.include_usage", "include_usage must be true or false")
    return include


def _max_tokens(body: dict[str, Any]) -> Any:
    """``max_completion_tokens``, ``max_tokens`` or llama-server's ``n_predict`` (-1: no
    limit), which must agree where several are sent."""
    given = {name: body[name] for name in ("max_completion_tokens", "max_tokens",
                                           "n_predict") if body.get(name) is not None}
    if given.get("n_predict") == -1:
        del given["n_predict"]
    if len(set(map(repr, given.values()))) > 1:
        raise bad(sorted(given)[0], f"{' and '.join(sorted(given))} disagree; send one "
                  "of them")
    return next(iter(given.values()), None)


def _messages(messages: Any) -> tuple[list[dict[str, Any]], list[RemoteImage], list[str]]:
    """Messages in protocol v1's shape, the remote images to fetch, each image's detail."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    remote: list[RemoteImage] = []
    details: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object")
        extra = sorted(map(str, set(message) - MESSAGE_KEYS))
        if extra:
            raise bad(f"{where}.{extra[0]}", f"{where}.{extra[0]} is not supported "
                      f"(a message has {', '.join(sorted(MESSAGE_KEYS))})")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of {sorted(ROLES)}")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        shown: dict[str, Any] = {"role": ROLES[role]}
        if isinstance(content, str):
            shown["content"] = content
        elif isinstance(content, list):
            shown["content"] = [_part(part, f"{where}.content[{j}]", remote, details)
                                for j, part in enumerate(content)]
        else:
            raise bad(f"{where}.content", f"{where}.content must be a string or a list "
                      "of parts")
        if message.get("tool_calls") is not None:  # protocol v1 checks their content
            if role != "assistant":
                raise bad(f"{where}.tool_calls", f"{where}: only an assistant message "
                          "has tool_calls")
            shown["tool_calls"] = message["tool_calls"]
        out.append(shown)
    return out, remote, details


def _part(part: Any, where: str, remote: list[RemoteImage],
          details: list[str]) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{where}.text", f"{where}.text must be a string")
        return {"type": "text", "text": text}
    if kind == "video_url":
        return _video_part(part, where, remote)
    if kind != "image_url":
        raise bad(f"{where}.type", f"{where} must be {{type: text}}, {{type: image_url}} "
                  "or {type: video_url}")
    image = part.get("image_url")
    if isinstance(image, str):  # some clients send the URL itself
        image = {"url": image}
    url = image.get("url") if isinstance(image, dict) else None
    if not isinstance(url, str):
        raise bad(f"{where}.image_url.url", f"{where}.image_url.url must be a string")
    detail = image.get("detail", "auto")
    if detail not in ("auto", "low", "high"):
        raise bad(f"{where}.image_url.detail", f"{where}.image_url.detail must be auto, "
                  "low or high")
    details.append(detail)
    if url[:5].lower() == "data:":
        return {"type": "image", "image": data_url_bytes(url, where)}
    if is_http_url(url):
        placeholder: dict[str, Any] = {"type": "image", "image": None}
        remote.append(RemoteImage(url, placeholder))
        return placeholder
    raise bad(f"{where}.image_url.url", f"{where}.image_url.url must be a data: URL "
              "(or http(s) where the server fetches images)")


def _video_part(part: dict[str, Any], where: str,
                remote: list[RemoteImage]) -> dict[str, Any]:
    """``{type: video_url, video_url: {url}}`` (vLLM's shape): a data: URL of a clip, or
    an http(s) URL fetched under the image rules."""
    video = part.get("video_url")
    if isinstance(video, str):
        video = {"url": video}
    url = video.get("url") if isinstance(video, dict) else None
    if not isinstance(url, str):
        raise bad(f"{where}.video_url.url", f"{where}.video_url.url must be a string")
    if url[:5].lower() == "data:":
        data = video_data_url_bytes(url, where)
        return {"type": "video", "video": data}
    if is_http_url(url):
        placeholder: dict[str, Any] = {"type": "video", "video": None}
        remote.append(RemoteImage(url, placeholder, "video"))
        return placeholder
    raise bad(f"{where}.video_url.url", f"{where}.video_url.url must be a data: URL "
              "(or http(s) where the server fetches URLs)")


def error_body(exc: QvlError | None = None, *, code: str = "", message: str = "",
               param: str | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI's error object) for a qvld error or an HTTP-level one."""
    status, message = error_status(exc, code, message)
    if exc is not None:
        code, param = exc.code, getattr(exc, "param", None)
        if code == "prompt_too_long":  # the code OpenAI's clients (litellm, LangChain) know
            code, param = "context_length_exceeded", param or "messages"
    return status, {"error": {"message": message, "type": TYPES.get(status, "server_error"),
                              "param": param, "code": code}}
