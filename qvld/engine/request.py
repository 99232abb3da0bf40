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

import math
from dataclasses import dataclass
from typing import Any

from qvld import protocol
from qvld.config import EngineConfig, did_you_mean
from qvld.engine.constraints import parse_response_format
from qvld.engine.model_dir import GenerationDefaults
from qvld.engine.sampling import SamplingParams
from qvld.engine.types import GenerateRequest
from qvld.errors import BadRequest

GENERATE_PARAMS = frozenset({
    "messages", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "stop", "session", "stream",
    "deadline_s", "ignore_eos", "max_image_tokens", "response_format", "logprobs",
})
MAX_TOP_LOGPROBS = 20
ROLES = frozenset({"system", "user", "assistant"})


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
    seed = int_param(params, "seed")
    if seed is not None and not 0 <= seed < 2 ** 63:
        raise BadRequest("seed must be within [0, 2^63)")
    parse_deadline(params)
    logprobs = int_param(params, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"logprobs must be within 0..{MAX_TOP_LOGPROBS} (the alternatives "
                         "given beside each token's own log-probability)")
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
        response_format=parse_response_format(params.get("response_format")),
        logprobs=logprobs,
    )
    return request, bool_param(params, "stream")


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
    if top_k < 0:
        raise BadRequest("top_k must be >= 0 (0 = off)")
    if not 0.0 < repetition <= 10.0:
        raise BadRequest("repetition_penalty must be within (0, 10]")
    if not -2.0 <= request.presence_penalty <= 2.0:
        raise BadRequest("presence_penalty must be within [-2, 2]")
    if not -2.0 <= request.frequency_penalty <= 2.0:
        raise BadRequest("frequency_penalty must be within [-2, 2]")
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                          repetition_penalty=repetition,
                          presence_penalty=float(request.presence_penalty),
                          frequency_penalty=float(request.frequency_penalty),
                          seed=request.seed)


MAX_TOKENS_LIMIT = 2**31 - 1


def max_tokens(request: GenerateRequest, limits: EngineConfig) -> int:
    """A request's max_tokens, clamped to engine.max_new_tokens (clients ask for 1 024-4 096
    by default; the reply's finish_reason "length" says when the cap was reached, or the
    context's end). Beyond a 32-bit count it is a mistake, not a wish."""
    value = limits.default_max_tokens if request.max_tokens is None else request.max_tokens
    if not 1 <= value <= MAX_TOKENS_LIMIT:
        raise BadRequest(f"max_tokens must be within 1..{MAX_TOKENS_LIMIT}; more than "
                         f"engine.max_new_tokens ({limits.max_new_tokens}) is clamped to it")
    return min(value, limits.max_new_tokens)


def image_tokens(request: GenerateRequest, limits: EngineConfig) -> int:
    """Each image's token budget: the request's, capped by engine.max_image_tokens."""
    tokens = limits.default_image_tokens if request.max_image_tokens is None \
        else request.max_image_tokens
    if tokens < 1:
        raise BadRequest("max_image_tokens must be >= 1")
    return min(tokens, limits.max_image_tokens)


def template_messages(messages: Any, max_images: int
                      ) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Messages as the template sees them, and the image bytes."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    shown: list[dict[str, Any]] = []
    images: list[bytes] = []
    for n, message in enumerate(messages):
        # The role may be any msgpack value: test its type before hashing it.
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise BadRequest(f"messages[{n}] needs a role of {sorted(ROLES)}")
        content = message.get("content")
        if isinstance(content, str):
            shown.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{n}].content must be a string or a list of parts")
        parts: list[dict[str, Any]] = []
        for m, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image" and isinstance(part.get("image"), (bytes, bytearray)):
                parts.append({"type": "image"})
                images.append(bytes(part["image"]))
            else:
                raise BadRequest(f"messages[{n}].content[{m}] must be "
                                 "{type: text, text: str} or {type: image, image: bytes}")
        shown.append({"role": role, "content": parts})
    if len(images) > max_images:
        raise BadRequest(f"at most {max_images} images per request")
    return shown, images


def check(request: GenerateRequest, limits: EngineConfig, gen: GenerationDefaults
          ) -> CheckedRequest:
    """``request`` against the engine's limits and the model's defaults."""
    params = sampling(request, gen)
    tokens = max_tokens(request, limits)
    shown, images = template_messages(request.messages, limits.max_images)
    return CheckedRequest(shown, images, params, tokens, image_tokens(request, limits))
