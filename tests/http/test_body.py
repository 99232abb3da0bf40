"""Request bodies before they are decoded (qvld.http.body): the shape walk's bound
against what the decoder really builds, the slices it walks in, and the text checks."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qvld.errors import BadRequest
from qvld.http import body
from qvld.http.body import check_json_shape, decode_json


def values(value: Any) -> int:
    """Values the decoder builds, keys included."""
    if isinstance(value, dict):
        return 1 + sum(1 + values(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(values(v) for v in value)
    return 1


def empty_containers(value: Any) -> int:
    if isinstance(value, dict):
        return (not value) + sum(empty_containers(v) for v in value.values())
    if isinstance(value, list):
        return (not value) + sum(empty_containers(v) for v in value)
    return 0


# Strings full of what the walk must not take for structure: quotes, backslashes,
# brackets, commas, colons, and characters JSON escapes.
TRICKY = st.text(alphabet=st.sampled_from('"\\[]{},: ax\u00e9\n\t\u2028/'), max_size=12)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TRICKY,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(TRICKY, children, max_size=5),
    max_leaves=40)


@settings(max_examples=400, deadline=None)
@given(JSON, st.sampled_from([(",", ":"), (", ", ": ")]), st.booleans())
def test_the_walk_bounds_what_the_decoder_builds(value: Any, separators: tuple[str, str],
                                                 ascii_only: bool) -> None:
    text = json.dumps(value, separators=separators, ensure_ascii=ascii_only).encode()
    bound = check_json_shape(text)
    exact = values(value)
    # Never under what is built; over it by at most one per empty container.
    assert exact <= bound <= exact + empty_containers(value)


@settings(max_examples=60, deadline=None)
@given(JSON, st.integers(1, 9))
def test_slices_do_not_change_the_count(value: Any, slice_bytes: int) -> None:
    """Strings, escapes and backslash runs cut at any slice boundary."""
    text = json.dumps(value).encode()
    whole = check_json_shape(text)
    original = body._SLICE
    body._SLICE = slice_bytes
    try:
        assert check_json_shape(text) == whole
    finally:
        body._SLICE = original


def test_bombs_and_deep_nesting_are_refused_from_the_bytes() -> None:
    with pytest.raises(BadRequest, match="more than 65536 JSON values"):
        check_json_shape(b"[" + b"[]," * 100_000 + b"[]]")
    with pytest.raises(BadRequest, match="more than 10 JSON values"):
        check_json_shape(b'{"a": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}', max_values=10)
    with pytest.raises(BadRequest, match="deeper than 128 levels"):
        check_json_shape(b"[" * 129 + b"]" * 129)
    check_json_shape(b"[" * 128 + b"]" * 128)
    # Structure inside a string is text: a 200 000-comma prompt is one value.
    assert check_json_shape(json.dumps({"t": "[{,:" * 200_000}).encode()) == 3


def test_decode_refuses_what_nothing_downstream_can_encode() -> None:
    assert decode_json(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}  # a pair
    for bad, why in [(b'{"a": "\\ud800"}', "lone surrogate \\ud800"),
                     (b'{"\\udfff": 1}', "lone surrogate \\udfff"),
                     (b'["x", ["\\ude00y"]]', "lone surrogate \\ude00"),
                     (b'{"a": "\xed\xa0\x80"}', "not valid UTF-8"),
                     (b"\xff\xfe{}", "not valid UTF-8"),
                     (b'{"a": }', "not valid JSON")]:
        with pytest.raises(BadRequest, match=why.replace("\\", "\\\\")):
            decode_json(bad)
