"""Every malformed `generate` field is refused as a typed client error, never
`internal`: the handler's parsing and the engine's validation, in-process, with
arbitrary msgpack-able values in each field (quick; the long fuzz runs are in
test_fuzz.py)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qvld.engine import Engine
from qvld.engine.inputs.request import GENERATE_PARAMS, parse_deadline, parse_generate, sampling
from qvld.engine.model.model_dir import GenerationDefaults
from qvld.errors import BadRequest, ImageInvalid, InternalError, QvlError
from tests.conftest import TINY

IMAGE = (TINY / "images" / "small.png").read_bytes()
BASE: dict[str, Any] = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "image", "image": IMAGE},
                                 {"type": "text", "text": "What is this?"}]}]}

# What a msgpack frame can carry (64-bit integers, floats including NaN and inf).
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                    st.text(max_size=12), st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)

# Where a value can go: every top-level param, and every field inside a message.
PATHS: list[tuple[Any, ...]] = [
    *((name,) for name in sorted(GENERATE_PARAMS)),
    ("messages", 0), ("messages", 1, "role"), ("messages", 0, "content"),
    ("messages", 1, "content"), ("messages", 1, "content", 0),
    ("messages", 1, "content", 0, "type"), ("messages", 1, "content", 0, "image"),
    ("messages", 1, "content", 1, "type"), ("messages", 1, "content", 1, "text"),
    ("messages", 1, "extra"),
]


def with_value(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    params = copy.deepcopy(BASE)
    node: Any = params
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return params


def validate(engine: Engine, params: dict[str, Any]) -> None:
    """What the generate handler does before a request is queued."""
    request, _stream = parse_generate(params)
    parse_deadline(params)
    request.max_tokens = request.max_tokens if request.max_tokens is not None else 2
    engine.prepare(request)


def only_client_errors(engine: Engine, params: dict[str, Any]) -> None:
    try:
        validate(engine, params)
    except QvlError as exc:
        assert not isinstance(exc, InternalError), exc


@pytest.mark.parametrize("name", ["deadline_s", "temperature", "top_p",
                                  "repetition_penalty", "presence_penalty",
                                  "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_bad_requests(name: str, value: float) -> None:
    with pytest.raises(BadRequest, match=f"{name} must be a finite number"):
        validate(Engine.__new__(Engine), {**BASE, name: value})


def sampling_of(params: dict[str, Any]) -> Any:
    request, _stream = parse_generate(params)
    return sampling(request, GenerationDefaults(eos_token_ids=()))


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [-2, -2.0, -0.5, 0, 0.0, 1.25, 2, 2.0])
def test_openai_penalties_within_range_are_accepted(name: str, value: float) -> None:
    assert getattr(sampling_of({**BASE, name: value}), name) == value


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [-2.0001, 2.0001, -3, 3, 1e300])
def test_openai_penalties_out_of_range_are_bad_requests(name: str, value: float) -> None:
    with pytest.raises(BadRequest, match=rf"{name} must be within \[-2, 2\]"):
        sampling_of({**BASE, name: value})


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [True, False, "1", b"1", [1.0], {"v": 1.0}])
def test_openai_penalties_of_other_types_are_bad_requests(name: str, value: Any) -> None:
    with pytest.raises(BadRequest, match=f"{name} must be a number"):
        parse_generate({**BASE, name: value})


def test_frequency_penalty_reaches_the_engine(tiny_engine: Engine) -> None:
    request, _stream = parse_generate({**BASE, "frequency_penalty": 1.5})
    assert tiny_engine.sampling_params(request).frequency_penalty == 1.5
    validate(tiny_engine, {**BASE, "frequency_penalty": -2})


@pytest.mark.parametrize("path", [("messages", 1, "role"), ("messages", 1, "content"),
                                  ("messages", 1, "content", 0, "type"),
                                  ("messages", 1, "content", 0, "image"),
                                  ("messages", 1, "content", 1, "text")])
@pytest.mark.parametrize("value", [["user"], {"user": 1}, 7, None, b"user"])
def test_odd_types_in_messages_are_bad_requests(tiny_engine: Engine, path: tuple[Any, ...],
                                                value: Any) -> None:
    with pytest.raises((BadRequest, ImageInvalid)):  # b"user" is an image, just not valid
        validate(tiny_engine, with_value(path, value))


def test_the_base_request_is_valid(tiny_engine: Engine) -> None:
    validate(tiny_engine, copy.deepcopy(BASE))


@settings(max_examples=600, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(PATHS), value=values)
def test_any_value_in_any_field_is_a_typed_client_error(tiny_engine: Engine,
                                                        path: tuple[Any, ...],
                                                        value: Any) -> None:
    only_client_errors(tiny_engine, with_value(path, value))
