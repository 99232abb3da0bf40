"""The Ollama API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/version``) <-> protocol v1: translation only, no I/O.

For the apps that speak only Ollama's API (VS Code's bring-your-own-model, Open WebUI's
Ollama connection, LangChain ``ChatOllama``, the ``ollama`` package):

- ``/api/chat``: ``messages`` (``content`` and base64 ``images``; an assistant's
  ``tool_calls`` with ``arguments`` as an object; ``tool`` results), ``tools`` (OpenAI's
  shape, as Ollama takes them), ``format`` (``"json"`` or a JSON schema, enforced),
  ``options`` (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``,
  ``num_predict``, ``stop``, ``repeat_penalty``, ``presence_penalty``,
  ``frequency_penalty``; Ollama's runtime options such as ``num_ctx`` or ``num_thread``
  are accepted and mean nothing here), ``stream`` (true by default, as in Ollama:
  newline-delimited JSON), ``keep_alive`` (accepted: the model stays loaded);
- ``/api/generate``: ``prompt`` with ``system`` and ``images``, through the chat
  template (``raw`` prompts are not served);
- unknown fields are ignored as Ollama ignores them, except a likely misspelling of a
  known one, which is refused with a did-you-mean.

Replies carry Ollama's counts and durations (nanoseconds); a call's ``arguments`` are
the model's JSON object as written. Errors are ``{"error": "message"}``.
"""

from __future__ import annotations

import binascii
import json
import time
from dataclasses import dataclass
from typing import Any

import pybase64

from qvld.config import did_you_mean
from qvld.errors import ImageInvalid, QvlError
from qvld.http.dialect import bad, dumps_with_raw, error_status, raw_json
from qvld.http.media import image_format

CHAT_FIELDS = frozenset({"model", "messages", "tools", "format", "options", "stream",
                         "keep_alive", "think", "logprobs", "top_logprobs"})
GENERATE_FIELDS = frozenset({"model", "prompt", "system", "images", "format", "options",
                             "stream", "keep_alive", "think", "raw", "suffix", "template",
                             "context", "logprobs", "top_logprobs"})
# Ollama's options -> protocol v1's names.
OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
           "min_p": "min_p", "seed": "seed", "num_predict": "max_tokens", "stop": "stop",
           "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}
# Ollama's runtime and legacy sampling options: accepted, nothing to do here.
IGNORED_OPTIONS = frozenset({
    "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
    "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "numa",
    "num_keep", "tfs_z", "typical_p", "repeat_last_n", "mirostat", "mirostat_tau",
    "mirostat_eta", "penalize_newline"})
DONE_REASONS = {"length": "length"}  # the rest (stop, tool_calls): "stop"


@dataclass
class OllamaRequest:
    params: dict[str, Any]  # protocol v1 generate params
    stream: bool
    model: str | None


def _known(body: Any, fields: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad("", "the request body must be a JSON object")
    for name in body:
        hint = did_you_mean(str(name), fields) if name not in fields else ""
        if hint:  # a misspelling of a known field; anything else is ignored, as Ollama does
            raise bad(str(name), f"unknown field {name!r}{hint}")
    return body


def _common(body: dict[str, Any], params: dict[str, Any]) -> tuple[bool, str | None]:
    """``model``, ``stream``, ``think``, ``format`` and ``options`` into ``params``."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    if body.get("think") not in (None, False):
        raise bad("think", "this model does not think (think: false)")
    fmt = body.get("format")
    if fmt == "json":
        params["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        params["response_format"] = {"type": "json_schema", "schema": fmt}
    elif fmt not in (None, ""):
        raise bad("format", 'format must be "json" or a JSON schema')
    options = body.get("options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("options", "options must be an object")
        for name, value in options.items():
            if name in OPTIONS:
                if value is not None:
                    params[OPTIONS[name]] = value
            elif name not in IGNORED_OPTIONS:
                hint = did_you_mean(str(name), set(OPTIONS) | IGNORED_OPTIONS)
                raise bad(f"options.{name}", f"unknown option {name!r}{hint}")
    if params.get("max_tokens") == -1:  # Ollama's "no limit"
        del params["max_tokens"]
    return stream, model


def parse_chat(body: Any, session: str | None = None) -> OllamaRequest:
    body = _known(body, CHAT_FIELDS)
    params: dict[str, Any] = {"messages": _messages(body.get("messages"))}
    stream, model = _common(body, params)
    if body.get("tools") is not None:
        params["tools"] = body["tools"]  # OpenAI's shape; protocol v1 checks it
    if session is not None:
        params["session"] = session
    params["stream"] = stream
    return OllamaRequest(params, stream, model)


def parse_generate(body: Any, session: str | None = None) -> OllamaRequest:
    body = _known(body, GENERATE_FIELDS)
    if body.get("raw"):
        raise bad("raw", "raw prompts are not served: the model's chat template is "
                  "always applied")
    for name in ("template", "context", "suffix"):
        if body.get(name) not in (None, "", []):
            raise bad(name, f"{name} is not supported by this server")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad("prompt", "prompt must be a string")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise bad("system", "system must be a string")
        messages.append({"role": "system", "content": system})
    messages.append(_message({"role": "user", "content": prompt,
                              "images": body.get("images")}, "prompt"))
    params: dict[str, Any] = {"messages": messages}
    stream, model = _common(body, params)
    if session is not None:
        params["session"] = session
    params["stream"] = stream
    return OllamaRequest(params, stream, model)


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad(where, f"{where} must be an object")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "tool"):
        raise bad(f"{where}.role", f"{where}.role must be system, user, assistant or tool")
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise bad(f"{where}.content", f"{where}.content must be a string")
    images = message.get("images") or []
    if not isinstance(images, list):
        raise bad(f"{where}.images", f"{where}.images must be a list of base64 images")
    shown: dict[str, Any] = {"role": role, "content": content}
    if images:
        shown["content"] = [*(_image(image, f"{where}.images[{k}]")
                              for k, image in enumerate(images)),
                            {"type": "text", "text": content}]
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise bad(f"{where}.tool_calls", f"{where}: only an assistant message has "
                      "tool_calls, a list")
        shown["tool_calls"] = [_call(call, f"{where}.tool_calls[{k}]", k)
                               for k, call in enumerate(calls)]
    return shown


def _image(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, str):
        raise bad(where, f"{where} must be a base64 string")
    try:
        data = pybase64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise ImageInvalid(f"{where}: not valid base64") from None
    if image_format(data) is None:
        raise ImageInvalid(f"{where}: the image must be PNG, JPEG, WebP, GIF or BMP")
    return {"type": "image", "image": data}


def _call(call: Any, where: str, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not isinstance(function.get("arguments", {}), dict):
        raise bad(where, f"{where} must be {{function: {{name, arguments: {{...}}}}}}")
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": function["name"], "arguments": json.dumps(
                function.get("arguments", {}), ensure_ascii=False)}}


# -- replies ----------------------------------------------------------------------------

def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + \
        f".{int(time.time() * 1e6) % 1_000_000:06d}Z"


def _ns(seconds: Any) -> int:
    return int(float(seconds or 0) * 1e9)


class OllamaReplies:
    """How Ollama answers: one JSON object, or newline-delimited JSON objects (the text
    as it comes, then one with ``done: true``, the reason, counts and durations)."""

    media_type = "application/x-ndjson"

    def __init__(self, model: str, key: str = "message") -> None:
        self.model = model
        self.key = key  # "message" (chat) or "response" (generate)

    def _piece(self, text: str, calls: list[dict[str, Any]] | None = None
               ) -> tuple[Any, list[str]]:
        """The answer's field (text, and a chat's calls with placeholders for the
        model's argument objects as written)."""
        if self.key == "response":
            return text, []
        message: dict[str, Any] = {"role": "assistant", "content": text}
        raws: list[str] = []
        if calls:
            message["tool_calls"] = []
            for call in calls:
                raws.append(call["function"]["arguments"])
                message["tool_calls"].append({"function": {
                    "name": call["function"]["name"], "arguments": raw_json(len(raws) - 1)}})
        return message, raws

    def _done(self, result: dict[str, Any], text: str) -> bytes:
        usage, timings = result["usage"], result["timings"]
        piece, raws = self._piece(text, result.get("tool_calls"))
        body = {"model": self.model, "created_at": _now(), self.key: piece, "done": True,
                "done_reason": DONE_REASONS.get(result["finish_reason"], "stop"),
                "total_duration": _ns(timings.get("total_s")), "load_duration": 0,
                "prompt_eval_count": usage["prompt_tokens"] - usage["cached_tokens"],
                "prompt_eval_duration": _ns(timings.get("prefill_s")),
                "eval_count": usage["completion_tokens"],
                "eval_duration": _ns(timings.get("decode_s"))}
        return dumps_with_raw(body, raws).encode()

    def whole(self, result: dict[str, Any]) -> bytes:
        return self._done(result, result["text"])

    def first(self) -> bytes:
        return b""

    def tokens(self, event: dict[str, Any]) -> bytes:
        if not event["text"]:
            return b""
        piece, _ = self._piece(event["text"])
        return json.dumps({"model": self.model, "created_at": _now(), self.key: piece,
                           "done": False}, ensure_ascii=False).encode() + b"\n"

    def last(self, result: dict[str, Any]) -> bytes:
        return self._done(result, "") + b"\n"

    def failed(self, exc: QvlError) -> bytes:
        return json.dumps({"error": exc.message}, ensure_ascii=False).encode() + b"\n"


def error_body(exc: QvlError | None = None, *, code: str = "", message: str = "",
               param: str | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, Ollama's error object)."""
    status, message = error_status(exc, code, message)
    return status, {"error": message}
