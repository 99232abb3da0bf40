"""Structured output faster than free text, and always closed, on the real tiny model.

Fast-forward: the tokens a response format forces are fed in one step beside the chosen
one; with ``engine.grammar_fast_forward`` off the same tokens are fed one step each. The
two must give the same ids (the forced run is tokenised canonically either way) in
fewer steps. Always closes: an answer the budget would cut is ended by the constraint
as soon as the rest no longer fits, and still validates.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import numpy as np
import pytest

from qvld.engine import Engine, GenerateRequest
from qvld.engine.decoding.constraints import Constraint, GrammarCompiler
from qvld.engine.decoding.finisher import Finisher
from qvld.engine.decoding.response_format import parse_response_format
from qvld.engine.inputs.tools import parse_tools
from qvld.errors import BadRequest
from tests.conftest import TINY, parity_config, wait_for
from tests.engine.test_constraints import DATE, EOS, SYSTEM, WIRE, check_answer

# Six required properties with long names and bounded values: most of the answer is
# forced (keys, quotes, braces, commas, the enums' tails).
EXTRACT = {"type": "object", "properties": {
    "product_display_name": {"type": "string", "maxLength": 8},
    "unit_price_in_whole_euros": {"type": "integer", "minimum": 0, "maximum": 999},
    "currency_iso_code": {"enum": ["EUR", "USD", "GBP"]},
    "currently_in_stock": {"type": "boolean"},
    "customer_rating_out_of_five": {"type": "integer", "minimum": 1, "maximum": 5},
    "shipping_category_label": {"enum": ["standard", "express", "freight"]}},
    "required": ["product_display_name", "unit_price_in_whole_euros", "currency_iso_code",
                 "currently_in_stock", "customer_rating_out_of_five",
                 "shipping_category_label"],
    "additionalProperties": False}
# An unbounded string first: a random-weight model never ends it by itself.
OPEN = {"type": "object", "properties": {
    "note": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "score": {"type": "integer"}},
    "required": ["note", "tags"]}
FORMATS = {**WIRE, "extract": {"type": "json_schema", "schema": EXTRACT},
           "open": {"type": "json_schema", "schema": OPEN}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def request(kind: str, n: int = 0, *, temperature: float = 0.0, max_tokens: int = 400,
            choices: int = 1, **kw: Any) -> GenerateRequest:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Question {n}: the product on the receipt?"}]
    if kind == "tool":
        return GenerateRequest(messages=messages, max_tokens=max_tokens,
                               temperature=temperature, seed=n,
                               tools=parse_tools([WEATHER], "required"), n=choices, **kw)
    return GenerateRequest(messages=messages, max_tokens=max_tokens, temperature=temperature,
                           seed=n, response_format=parse_response_format(FORMATS[kind]),
                           n=choices, **kw)


def validate(kind: str, text: str) -> None:
    if kind in ("extract", "open"):
        jsonschema.validate(json.loads(text), FORMATS[kind]["schema"])
    elif kind != "tool":
        check_answer(kind, text)


@pytest.fixture(scope="module")
def fast() -> Iterator[Engine]:
    yield Engine(parity_config(TINY, prefill_chunk=64))


@pytest.fixture(scope="module")
def stepwise() -> Iterator[Engine]:
    yield Engine(parity_config(TINY, prefill_chunk=64, grammar_fast_forward=False))


def steps(engine: Engine, req: GenerateRequest, **kw: Any) -> tuple[Any, int]:
    """The result and how many batched steps it took (the engine runs nothing else)."""
    assert engine.batch is not None
    before = engine.batch.steps
    result = engine.generate(req, **kw)
    return result, engine.batch.steps - before


def test_forced_tokens_are_most_of_a_long_keyed_answer_and_cost_no_steps(
        fast: Engine) -> None:
    result, taken = steps(fast, request("extract"))
    jsonschema.validate(json.loads(result.text), EXTRACT)
    assert result.finish_reason == "stop" and not result.closed
    usage = result.usage
    assert usage.forced_tokens >= 0.4 * usage.completion_tokens, usage
    # About one step per sampled token (after the prompt's): forced runs ride along.
    sampled = usage.completion_tokens - usage.forced_tokens
    assert len(result.mask_s) == sampled
    prompt_steps = -(-(usage.prompt_tokens - usage.cached_tokens) // 64)
    assert taken - prompt_steps <= sampled + 1 < usage.completion_tokens / 4


@pytest.mark.parametrize("kind", ["extract", "receipt", "object", "date", "expression",
                                  "pairs", "open", "tool"])
def test_fast_forward_changes_the_steps_not_the_answer(fast: Engine, stepwise: Engine,
                                                       kind: str) -> None:
    for n, temperature in ((1, 0.0), (2, 0.9)):
        one, one_steps = steps(fast, request(kind, n, temperature=temperature))
        other, other_steps = steps(stepwise, request(kind, n, temperature=temperature))
        assert one.token_ids == other.token_ids, (one.text, other.text)
        assert one.text == other.text and one.finish_reason == other.finish_reason
        assert one.usage.forced_tokens == other.usage.forced_tokens
        if kind == "tool":
            assert one.tool_calls is not None and other.tool_calls is not None
            assert [(c.name, c.arguments) for c in one.tool_calls] == [
                (c.name, c.arguments) for c in other.tool_calls]
        else:
            validate(kind, one.text)
        # Step by step, every completion token is a step of its own, but a close.
        assert other_steps >= other.usage.completion_tokens or other.closed
        if one.usage.forced_tokens > 1:
            assert one_steps < other_steps


@pytest.mark.parametrize("backend", ["openvino", "onnxruntime"])
def test_the_alone_path_fast_forwards_to_the_same_answer(stepwise: Engine,
                                                         backend: str) -> None:
    """A generation on a slot of its own (no continuous batching; the ONNX Runtime
    backend) feeds a forced run as one multi-row step."""
    alone = Engine(parity_config(TINY, backend, continuous_batching=False))
    for kind in ("extract", "open", "tool"):
        one = alone.generate(request(kind, 3))
        other = stepwise.generate(request(kind, 3))
        assert one.token_ids == other.token_ids
        assert one.usage.forced_tokens == other.usage.forced_tokens > 0


def test_an_unbounded_string_cut_by_max_tokens_still_validates(fast: Engine) -> None:
    free = fast.generate(request("open", 4, max_tokens=300))
    assert free.usage.completion_tokens > 30  # it would not end by itself within 30
    streamed: list[str] = []
    for max_tokens in (30, 24):
        result = fast.generate(request("open", 4, max_tokens=max_tokens),
                               on_token=lambda text, ids, **_: streamed.append(text))
        document = json.loads(result.text)
        jsonschema.validate(document, OPEN)
        assert result.closed and result.finish_reason == "length"
        assert result.usage.completion_tokens <= max_tokens
        assert "".join(streamed) == result.text
        streamed.clear()


@pytest.mark.slow  # ~7 s of sampled answers (the default tier stays under 5 minutes)
def test_sampled_answers_close_and_validate_at_every_budget(fast: Engine) -> None:
    shortest = None
    for max_tokens in range(21, 60, 6):
        for n in range(3):
            result = fast.generate(request("open", n, temperature=1.2, max_tokens=max_tokens))
            jsonschema.validate(json.loads(result.text), OPEN)
            assert result.usage.completion_tokens <= max_tokens
            shortest = result.usage.completion_tokens if shortest is None else min(
                shortest, result.usage.completion_tokens)
    assert shortest is not None and shortest < 30


def test_regexes_and_grammars_close_too(fast: Engine) -> None:
    expression = fast.generate(request("expression", 6, temperature=1.0, max_tokens=400))
    for max_tokens in (3, 5, 9):
        result = fast.generate(request("expression", 6, temperature=1.0,
                                       max_tokens=max_tokens))
        check_answer("expression", result.text)
        assert result.usage.completion_tokens <= max_tokens
        if expression.usage.completion_tokens > max_tokens:
            assert result.finish_reason == "length"


def test_a_budget_below_the_shortest_answer_is_a_bad_request(fast: Engine) -> None:
    with pytest.raises(BadRequest, match=r"shortest answer is \d+ tokens; this request "
                                         r"leaves room for 10"):
        fast.generate(request("extract", max_tokens=10))
    with pytest.raises(BadRequest, match="leaves room for 9"):
        fast.generate(request("date", max_tokens=9))  # a date is 10 characters
    assert re.fullmatch(DATE, fast.generate(request("date", max_tokens=10)).text)


def test_forced_tokens_report_certainty_in_logprobs(fast: Engine) -> None:
    result = fast.generate(request("extract", 7, logprobs=2))
    assert result.logprobs is not None
    assert len(result.logprobs) == len(result.token_ids)
    certain = [e for e in result.logprobs if e["logprob"] == 0.0 and len(e["top"]) == 1]
    assert len(certain) >= result.usage.forced_tokens
    for entry, token in zip(result.logprobs, result.token_ids, strict=True):
        assert entry["token_id"] == token
        assert all(np.isfinite(alt["logprob"]) for alt in entry["top"])


def test_choices_and_sessions_fast_forward_too(fast: Engine) -> None:
    prepared = fast.prepare(request("extract", 8, temperature=1.0, choices=3))
    results = [g.future.result(60) for g in fast.submit_choices(prepared, [None] * 3)]
    for result in results:
        jsonschema.validate(json.loads(result.text), EXTRACT)
        assert result.usage.forced_tokens >= 0.4 * result.usage.completion_tokens
    assert len({r.text for r in results}) > 1
    turns = [fast.generate(request("extract", 9, session="ff")) for _ in range(2)]
    for turn in turns:
        jsonschema.validate(json.loads(turn.text), EXTRACT)
        assert turn.usage.forced_tokens > 0
    assert turns[1].usage.cached_tokens > turns[0].usage.prompt_tokens // 2


def test_the_finisher_ends_each_kind_of_grammar_from_its_start() -> None:
    compiler = GrammarCompiler(TINY / "tokenizer.json", 768, EOS)
    try:
        for kind in ("extract", "receipt", "object", "date", "expression", "pairs", "open"):
            fmt = parse_response_format(FORMATS[kind])
            assert fmt is not None
            constraint = compiler.start(fmt, 30)
            constraint.wait()
            assert constraint.shortest is not None, kind
            text = compiler.finisher.tokenizer.decode_str(constraint.shortest)
            validate(kind, text)
    finally:
        compiler.close()
    assert isinstance(compiler.finisher, Finisher)


LOOPING = "ab|ba*c"  # from "b" the finisher's greedy order writes "a" for ever


def test_a_grammar_the_finisher_cannot_end_from_some_states_still_matches(
        fast: Engine) -> None:
    fmt = {"type": "regex", "pattern": LOOPING}
    for n in range(6):
        result = fast.generate(GenerateRequest(
            messages=[{"role": "user", "content": f"Letters {n}?"}], max_tokens=20,
            temperature=1.5, seed=n, response_format=parse_response_format(fmt)))
        assert re.fullmatch(LOOPING, result.text), result.text
        assert result.usage.completion_tokens <= 20


def test_a_requests_finishing_searches_are_bounded_in_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import qvld.engine.decoding.constraints as constraints

    monkeypatch.setattr(constraints, "FINISH_WORK_PER_REQUEST", 500)
    compiler = GrammarCompiler(TINY / "tokenizer.json", 768, EOS)
    try:
        fmt = parse_response_format({"type": "regex", "pattern": LOOPING})
        assert fmt is not None
        constraint = compiler.start(fmt, 30)
        constraint.wait()
        assert constraint.shortest is not None  # from the start: "ab"
        assert constraint.finish(100) is not None and constraint.can_finish
        (b,) = compiler.finisher.tokenizer.tokenize_str("b")
        assert not constraint.advance(b)
        searches = 0
        while constraint.can_finish:  # each search runs to its limit, or out of work
            assert constraint.finish(100_000) is None
            searches += 1
        assert searches == 1 and constraint.finish_work.left <= 0
        assert constraint.finish(100) is None  # no more searches for this request
    finally:
        compiler.close()


@pytest.mark.slow  # 7 s: the default tier stays under 5 minutes
def test_a_slow_machine_gets_the_same_answers(fast: Engine,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing early depends on the grammar and the tokens, never on the clock: with
    every clock reading a second after the last (a machine a thousand times slower),
    the answers that close early, and the others, are the same ids."""
    import qvld.engine.decoding.constraints as constraints
    import qvld.engine.decoding.generation as generate

    expected = {kind: fast.generate(request(kind, 5, max_tokens=200)).token_ids
                for kind in ("extract", "open", "object", "receipt")}
    fake = FakeClock()
    for module in (constraints, generate):
        monkeypatch.setattr(module, "time", fake)
    for kind, ids in expected.items():
        result = fast.generate(request(kind, 5, max_tokens=200))
        assert result.token_ids == ids, kind
    assert fake.readings > 100


class FakeClock:
    """``time`` as a module, but every ``perf_counter`` reading a second after the last."""

    def __init__(self) -> None:
        import time

        self.readings = 0
        self._time = time

    def perf_counter(self) -> float:
        self.readings += 1
        return float(self.readings)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._time, name)


@pytest.mark.slow  # long: the default tier stays under 5 minutes
def test_a_preempted_generation_with_forced_rows_resumes_to_the_same_answer() -> None:
    from tests.conftest import StepGate, wait_for

    engine = Engine(parity_config(TINY, infer_requests=2, max_sequences=2, prefill_chunk=16,
                                  max_new_tokens=3000))
    alone = Engine(parity_config(TINY, max_sequences=1, max_new_tokens=3000))
    assert engine.batch is not None
    many = {"type": "json_schema", "schema": {"type": "array", "items": EXTRACT,
                                              "minItems": 12, "maxItems": 12}}

    def long(n: int) -> GenerateRequest:
        return GenerateRequest(messages=[{"role": "user", "content": f"Products {n}?"}],
                               max_tokens=2500, temperature=0.0,
                               response_format=parse_response_format(many))

    with StepGate(engine) as gate:
        alices = gate.start_together([
            lambda: engine.submit(engine.prepare(long(0), 1001)),
            lambda: engine.submit(engine.prepare(long(1), 1001))])
        # Bob arrives between two steps, however slow his prepare.
        bobs = engine.submit(engine.prepare(request("extract", 1), 1002))
        wait_for(lambda: engine.batch is not None and engine.batch.queued() == (2, 1),
                 30, "bob's to wait for a place")
    bob = bobs.future.result(60)
    jsonschema.validate(json.loads(bob.text), EXTRACT)
    assert engine.batch.preemptions >= 1
    assert any(g.seq is not None and g.seq.preemptions for g in alices)
    for n, gen in enumerate(alices):
        result = gen.future.result(120)
        assert len(json.loads(result.text)) == 12
        assert result.token_ids == alone.generate(long(n)).token_ids
    assert engine.blocks is not None and engine.blocks.stats()["held"] == 0


@pytest.mark.parametrize("batching", [True, False])
def test_an_answer_closes_when_its_compile_ends_after_the_prompt(
        batching: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile still running when the prompt is fed (a loaded machine) is waited for
    before the answer's first token: the answer still has its way to close. Nothing
    blocks meanwhile, whichever executor steps (paged, or slots): the prompt is fed
    beside the compile, and the sequence keeps its logits until the compile ends."""
    slow, needed = threading.Event(), threading.Event()
    compile_, wait = GrammarCompiler._compile, Constraint.wait

    def late(self: GrammarCompiler, fmt: Any) -> Any:
        assert slow.wait(30)
        return compile_(self, fmt)

    def waited(self: Constraint) -> None:
        needed.set()  # the generation needs the compile now: it may end
        wait(self)

    monkeypatch.setattr(GrammarCompiler, "_compile", late)
    monkeypatch.setattr(Constraint, "wait", waited)
    engine = Engine(parity_config(TINY, continuous_batching=batching))
    prepared = engine.prepare(request("open", 6, max_tokens=40))
    assert prepared.constraint is not None and not prepared.constraint.future.done()
    gen = engine.submit(prepared)
    wait_for(lambda: gen.seq is not None and gen.seq.logits is not None, 30,
             "the prompt fed, its first token waiting for the compile")
    assert not needed.is_set() and not prepared.constraint.future.done()
    slow.set()
    result = gen.future.result(60)
    jsonschema.validate(json.loads(result.text), OPEN)
    assert result.finish_reason == "length" and result.closed
