"""One parser for a generate request: every rule a request must meet lives here.

``parse_generate`` turns the wire's params into a ``GenerateRequest`` (types, ranges that
need no model, unknown params with a did-you-mean); ``check`` completes it against the
engine's limits and the model's generation defaults into a ``CheckedRequest``: the
messages as the chat template sees them, the image bytes, the sampling parameters, the
token and image budgets. The handlers call the first, the engine the second; neither
validates anything itself. Every failure is ``bad_request``: any value of any field
(msgpack can send lists, maps, NaN) is typed before it is compared or hashed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from qvld import protocol
from qvld.config import EngineConfig, did_you_mean
from qvld.engine.decoding.response_format import ResponseFormat, parse_response_format
from qvld.engine.decoding.sampling import SamplingParams
from qvld.engine.inputs.tools import MAX_TOOLS, ToolSet, parse_tools
from qvld.engine.model.model_dir import GenerationDefaults
from qvld.engine.model.tokenizer import TEMPLATE_GLOBALS
from qvld.errors import BadRequest


@dataclass
class GenerateRequest:
    """One generation. ``None`` means: take the model's generation_config / engine default."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    max_image_tokens: int | None = None
    session: str | None = None  # continue (or start) this conversation
    # The turns the client holds for ``session``: refused (session_lost) when the daemon's
    # session holds another count, before anything runs. None: not checked.
    session_turns: int | None = None
    response_format: ResponseFormat | None = None  # what the answer must match
    # Each generated token's log-probability and this many alternatives (0..20); None: off.
    logprobs: int | None = None
    min_p: float | None = None
    tools: ToolSet | None = None  # the tools it may call, and how
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs
    n: int = 1  # answers to the prompt (choices), each sampled on its own
    # Added to these token ids' logits before anything else (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # A raw prompt instead of messages: tokenised as it is, no chat template (text only).
    prompt: str | None = None



GENERATE_PARAMS = frozenset({
    "messages", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "stop", "session", "session_turns", "stream",
    "deadline_s", "ignore_eos", "max_image_tokens", "response_format", "logprobs",
    "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "min_p", "n",
    "logit_bias", "prompt",
})
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's bound)
MAX_CHOICES = 16  # n: answers to one prompt
MAX_TOP_LOGPROBS = 20
ROLES = frozenset({"system", "user", "assistant", "tool"})
# What a request's chat_template_kwargs may not set: what the engine passes itself.
TEMPLATE_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                               *TEMPLATE_GLOBALS})
MAX_TEMPLATE_KWARGS_BYTES = 4096


# -- the wire's params -----------------------------------------------------------------

def int_param(params: dict[str, Any], key: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{key} must be an integer")
    return value


def number_param(params: dict[str, Any], key: str) -> float | None:
    """A finite number: NaN fails every comparison, so a NaN deadline would never pass
    and a NaN sampling parameter would slip through range checks."""
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRequest(f"{key} must be a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise BadRequest(f"{key} must be a finite number")
    return number


def bool_param(params: dict[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false")
    return value


def parse_deadline(params: dict[str, Any]) -> float | None:
    """``deadline_s``: seconds, > 0 (capped by server.request_timeout_s by the caller)."""
    deadline_s = number_param(params, "deadline_s")
    if deadline_s is not None and deadline_s <= 0:
        raise BadRequest("deadline_s must be > 0")
    return deadline_s


def _stop(params: dict[str, Any]) -> list[str]:
    stop = params.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a list of strings")
    if len(stop) > protocol.MAX_STOP_STRINGS or any(
            len(s.encode()) > protocol.MAX_STOP_BYTES for s in stop):
        raise BadRequest(f"at most {protocol.MAX_STOP_STRINGS} stop strings of at most "
                         f"{protocol.MAX_STOP_BYTES} bytes")
    return stop


def _template_kwargs(value: Any) -> dict[str, Any] | None:
    """``chat_template_kwargs``: variables for the chat template (e.g. Qwen3-VL's
    ``add_vision_id``), JSON values, small; never what the engine passes itself."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and k.isidentifier() for k in value):
        raise BadRequest("chat_template_kwargs must map names to values")
    taken = sorted(k for k in value if k in TEMPLATE_RESERVED or k.endswith("_token"))
    if taken:
        raise BadRequest(f"chat_template_kwargs cannot set {taken[0]!r} (the server "
                         "passes it to the template itself, or the template calls it)")
    try:
        size = len(json.dumps(value, allow_nan=False))
    except (ValueError, TypeError):
        raise BadRequest("chat_template_kwargs must hold JSON values") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise BadRequest(f"chat_template_kwargs is over {MAX_TEMPLATE_KWARGS_BYTES} bytes")
    return dict(value)


def parse_generate(params: dict[str, Any]) -> tuple[GenerateRequest, bool]:
    """``generate`` params -> a request and whether to stream."""
    unknown = set(params) - GENERATE_PARAMS
    if unknown:
        name = sorted(map(str, unknown))[0]
        raise BadRequest(f"unknown generate param {name!r}{did_you_mean(name, GENERATE_PARAMS)}")
    session = params.get("session")
    if session is not None and (not isinstance(session, str)
                                or not protocol.SESSION_ID.fullmatch(session)):
        raise BadRequest("session must be 1-128 characters of [A-Za-z0-9._-]")
    session_turns = int_param(params, "session_turns")
    if session_turns is not None and (session is None or session_turns < 0):
        raise BadRequest("session_turns is the count of turns a session holds: an integer "
                         ">= 0, with session")
    seed = int_param(params, "seed")
    if seed is not None and not 0 <= seed < 2 ** 63:
        raise BadRequest("seed must be within [0, 2^63)")
    parse_deadline(params)
    logprobs = int_param(params, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"logprobs must be within 0..{MAX_TOP_LOGPROBS} (the alternatives "
                         "given beside each token's own log-probability)")
    n = int_param(params, "n")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n must be within 1..{MAX_CHOICES}")
    if (n or 1) > 1 and session is not None:
        raise BadRequest("n > 1 cannot continue a session (a session keeps one history)")
    response_format = parse_response_format(params.get("response_format"))
    tools = parse_tools(params.get("tools"), params.get("tool_choice"),
                        params.get("parallel_tool_calls"))
    if tools is not None and tools.response_format() is not None \
            and response_format is not None:
        raise BadRequest("tool_choice required or a named function cannot be combined with "
                         "a response_format: the answer is the call")
    request = GenerateRequest(
        messages=params.get("messages"),  # type: ignore[arg-type]  # check() types them
        max_tokens=int_param(params, "max_tokens"),
        temperature=number_param(params, "temperature"),
        top_p=number_param(params, "top_p"),
        top_k=int_param(params, "top_k"),
        repetition_penalty=number_param(params, "repetition_penalty"),
        presence_penalty=number_param(params, "presence_penalty") or 0.0,
        frequency_penalty=number_param(params, "frequency_penalty") or 0.0,
        seed=seed,
        stop=_stop(params),
        ignore_eos=bool_param(params, "ignore_eos"),
        max_image_tokens=int_param(params, "max_image_tokens"),
        session=session,
        session_turns=session_turns,
        response_format=response_format,
        logprobs=logprobs,
        min_p=number_param(params, "min_p"),
        tools=tools,
        template_kwargs=_template_kwargs(params.get("chat_template_kwargs")),
        n=n or 1,
        logit_bias=_logit_bias(params.get("logit_bias")),
        prompt=_raw_prompt(params, session, tools),
    )
    return request, bool_param(params, "stream")


def _raw_prompt(params: dict[str, Any], session: str | None, tools: ToolSet | None
                ) -> str | None:
    """A raw ``prompt`` (no chat template): text only, instead of messages, without a
    session or tools (both need the template)."""
    prompt = params.get("prompt")
    if prompt is None:
        return None
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string")
    if params.get("messages") is not None:
        raise BadRequest("send messages or a prompt, not both")
    if session is not None or tools is not None or params.get("chat_template_kwargs"):
        raise BadRequest("a raw prompt takes no session, tools or chat_template_kwargs "
                         "(they need the chat template)")
    return prompt


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (ids as strings, as JSON has them), each bias in [-100, 100];
    checked against the vocabulary by ``sampling``."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
    out = []
    for key, bias in value.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isdecimal() and len(key) < 10:
            token = int(key)
        if token is None or isinstance(bias, bool) or not isinstance(bias, int | float) \
                or not -100 <= bias <= 100:
            raise BadRequest("logit_bias maps token ids to numbers within [-100, 100]")
        out.append((token, float(bias)))
    return tuple(out)


# -- against the engine's limits and the model's defaults ------------------------------

@dataclass(frozen=True)
class CheckedRequest:
    """A request that meets every rule, with each default resolved."""

    # The messages as the chat template sees them (images as placeholders), and the
    # images' bytes in order.
    shown: list[dict[str, Any]]
    images: list[bytes]
    sampling: SamplingParams
    max_tokens: int
    image_tokens: int  # the token budget of each image
    # What the template lists as the tools (None: none shown), and the request's own
    # template variables.
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    # The videos in order: a clip's bytes, or its frames (pictures' bytes).
    videos: list[bytes | list[bytes]] = field(default_factory=list)
    prompt: str | None = None  # a raw prompt: no template, no messages


def sampling(request: GenerateRequest, gen: GenerationDefaults) -> SamplingParams:
    """The request's sampling parameters; omitted ones from generation_config.json."""

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    temperature = float(pick(request.temperature, gen.temperature if gen.do_sample else 0.0))
    top_k = int(pick(request.top_k, gen.top_k if gen.do_sample else 0))
    top_p = float(pick(request.top_p, gen.top_p if gen.do_sample else 1.0))
    repetition = float(pick(request.repetition_penalty, gen.repetition_penalty))
    if not 0.0 <= temperature <= 100.0:
        raise BadRequest("temperature must be within [0, 100]")
    if not 0.0 < top_p <= 1.0:
        raise BadRequest("top_p must be within (0, 1]")
    min_p = float(pick(request.min_p, 0.0))
    if not 0.0 <= min_p <= 1.0:
        raise BadRequest("min_p must be within [0, 1]")
    if top_k < 0:
        raise BadRequest("top_k must be >= 0 (0 = off)")
    if not 0.0 < repetition <= 10.0:
        raise BadRequest("repetition_penalty must be within (0, 10]")
    if not -2.0 <= request.presence_penalty <= 2.0:
        raise BadRequest("presence_penalty must be within [-2, 2]")
    if not -2.0 <= request.frequency_penalty <= 2.0:
        raise BadRequest("frequency_penalty must be within [-2, 2]")
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          logit_bias=request.logit_bias,
                          repetition_penalty=repetition,
                          presence_penalty=float(request.presence_penalty),
                          frequency_penalty=float(request.frequency_penalty),
                          seed=request.seed)


MAX_TOKENS_LIMIT = 2**31 - 1


def max_tokens(request: GenerateRequest, limits: EngineConfig) -> int:
    """A request's max_tokens, clamped to engine.max_new_tokens where the operator set
    one; a request naming none gets engine.default_max_tokens, or by default
    ``MAX_TOKENS_LIMIT``: until the model stops or the context ends (the engine cuts it to
    the room left; the reply's finish_reason "length" says when a limit was reached).
    Beyond a 32-bit count it is a mistake, not a wish."""
    value = request.max_tokens
    if value is None:
        value = limits.default_max_tokens or MAX_TOKENS_LIMIT
    if not 1 <= value <= MAX_TOKENS_LIMIT:
        cap = (f"; more than engine.max_new_tokens ({limits.max_new_tokens}) is clamped "
               "to it" if limits.max_new_tokens else "")
        raise BadRequest(f"max_tokens must be within 1..{MAX_TOKENS_LIMIT}{cap}")
    return min(value, limits.max_new_tokens or MAX_TOKENS_LIMIT)


def image_tokens(request: GenerateRequest, limits: EngineConfig) -> int:
    """Each image's token budget: the request's, capped by engine.max_image_tokens."""
    tokens = limits.default_image_tokens if request.max_image_tokens is None \
        else request.max_image_tokens
    if tokens < 1:
        raise BadRequest("max_image_tokens must be >= 1")
    return min(tokens, limits.max_image_tokens)


MAX_VIDEOS = 4  # per request


def template_messages(messages: Any, max_images: int
                      ) -> tuple[list[dict[str, Any]], list[bytes], list[bytes | list[bytes]]]:
    """Messages as the template sees them, the image bytes and the video bytes."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    shown: list[dict[str, Any]] = []
    images: list[bytes] = []
    videos: list[bytes | list[bytes]] = []
    for n, message in enumerate(messages):
        # The role may be any msgpack value: test its type before hashing it.
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise BadRequest(f"messages[{n}] needs a role of {sorted(ROLES)}")
        if role == "system" and n:  # Qwen's template shows a first system message only
            raise BadRequest(f"messages[{n}]: a system message must come first")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""
        if isinstance(content, str):
            shown.append({"role": role, "content": content})
        elif isinstance(content, list):
            shown.append({"role": role, "content": _parts(content, n, images, videos)})
        else:
            raise BadRequest(f"messages[{n}].content must be a string or a list of parts")
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise BadRequest(f"messages[{n}]: only an assistant message has tool_calls")
            shown[-1]["tool_calls"] = _tool_calls(message["tool_calls"], n)
    if len(images) > max_images:
        raise BadRequest(f"at most {max_images} images per request")
    if len(videos) > MAX_VIDEOS:
        raise BadRequest(f"at most {MAX_VIDEOS} videos per request")
    return shown, images, videos


def _parts(content: list[Any], n: int, images: list[bytes],
           videos: list[bytes | list[bytes]]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for m, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image" and isinstance(part.get("image"), (bytes, bytearray)):
            parts.append({"type": "image"})
            images.append(bytes(part["image"]))
        elif kind == "video" and isinstance(part.get("video"), (bytes, bytearray)):
            parts.append({"type": "video"})
            videos.append(bytes(part["video"]))
        elif kind == "video" and (frames := _frames(part.get("frames"))) is not None:
            parts.append({"type": "video"})
            videos.append(frames)
        else:
            raise BadRequest(f"messages[{n}].content[{m}] must be {{type: text, text: "
                             "str}, {type: image, image: bytes} or {type: video, video: "
                             "bytes | frames: [bytes]}")
    return parts


MAX_VIDEO_FRAMES = 768  # a frames list's pictures at most (Qwen's max_frames)


def _frames(frames: Any) -> list[bytes] | None:
    """A video given as its frames (1..768 pictures' bytes); None when it is not one."""
    if not isinstance(frames, list) or not all(isinstance(f, (bytes, bytearray))
                                               for f in frames):
        return None
    if not 1 <= len(frames) <= MAX_VIDEO_FRAMES:
        raise BadRequest(f"a video's frames list holds 1..{MAX_VIDEO_FRAMES} pictures")
    return [bytes(f) for f in frames]


def _tool_calls(calls: Any, n: int) -> list[dict[str, Any]]:
    """An assistant turn's calls as the template shows them (arguments: the JSON text
    the client has, or an object)."""
    where = f"messages[{n}].tool_calls"
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise BadRequest(f"{where} must be a list of at most {MAX_TOOLS} calls")
    shown = []
    for m, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, (str, dict)):
            raise BadRequest(f"{where}[{m}] must be {{id, type: function, function: "
                             "{name: str, arguments: JSON text or object}}")
        shown.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return shown


def check(request: GenerateRequest, limits: EngineConfig, gen: GenerationDefaults
          ) -> CheckedRequest:
    """``request`` against the engine's limits and the model's defaults."""
    params = sampling(request, gen)
    tokens = max_tokens(request, limits)
    if request.prompt is not None:
        return CheckedRequest([], [], params, tokens, image_tokens(request, limits),
                              prompt=request.prompt)
    shown, images, videos = template_messages(request.messages, limits.max_images)
    tools = None if request.tools is None else request.tools.shown
    return CheckedRequest(shown, images, params, tokens, image_tokens(request, limits),
                          tools, request.template_kwargs, videos)
