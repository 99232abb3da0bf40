"""Tool calling over HTTP as real clients do it: the ``openai`` package (non-streamed and
streamed) and LangChain's ``ChatOpenAI`` (``bind_tools``, structured output by function
calling), against the real daemon on the tiny model; the calls equal the socket's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.test_http import HttpDaemon

WEATHER_PARAMETERS = {"type": "object", "properties": {
    "city": {"type": "string", "description": "The city", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": WEATHER_PARAMETERS}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                               "maxLength": 10}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    d = HttpDaemon(tmp_path_factory.mktemp("http-tools")).start()
    try:
        yield d
    finally:
        d.stop()


def test_a_named_tool_choice_returns_a_valid_call(daemon: HttpDaemon) -> None:
    answer = daemon.openai().chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED,
        temperature=0, max_tokens=200)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert choice.message.content is None
    assert answer.usage.completion_tokens > 10


def test_the_stream_carries_the_same_call_as_deltas(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    whole = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED,
        temperature=0, max_tokens=200)
    chunks = list(client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED,
        temperature=0, max_tokens=200, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 for d in deltas)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_budget_too_small_for_a_call_is_a_400_and_a_tight_one_closes_it(
        daemon: HttpDaemon) -> None:
    """No call fits max_tokens 5: a 400 naming the shortest call; a budget a few tokens
    over it: the call the constraint closed, finish "length", streamed as deltas."""
    import openai

    client = daemon.openai()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(  # type: ignore[call-overload]
            model="tiny", messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=5)
    message = refused.value.body["message"]  # type: ignore[index]
    shortest = int(message.split("shortest answer is ")[1].split()[0])
    assert "leaves room for 5" in message and shortest > 5
    free = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice=NAMED, temperature=0,
        max_tokens=300)
    assert free.usage.completion_tokens > shortest + 3  # the model writes a longer city
    chunks = list(client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice=NAMED, temperature=0,
        max_tokens=shortest + 3, stream=True, stream_options={"include_usage": True}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= shortest + 3


def test_required_gives_tool_calls_with_ids(daemon: HttpDaemon) -> None:
    answer = daemon.openai().chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=300)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1 and choice.message.tool_calls[0].id
    assert choice.message.tool_calls[0].function.name in ("get_weather", "get_time")


def test_a_conversation_with_a_call_and_its_result_is_answered(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    messages: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    answer = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=messages, tools=[WEATHER, TIME], temperature=0,
        max_tokens=8)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    alone = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=8)
    # The call and its result are in the prompt (as the template shows them).
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_http_calls_equal_the_sockets(daemon: HttpDaemon) -> None:
    answer = daemon.openai().chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        temperature=0, max_tokens=300, parallel_tool_calls=False)
    with daemon.client() as client:
        result = client.generate({"messages": ASK, "tools": [WEATHER, TIME],
                                  "tool_choice": "required", "parallel_tool_calls": False,
                                  "temperature": 0, "max_tokens": 300})
    assert result["finish_reason"] == "tool_calls"
    assert [c["function"] for c in result["tool_calls"]] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in answer.choices[0].message.tool_calls]
    assert result["usage"]["completion_tokens"] == answer.usage.completion_tokens


def langchain_model(daemon: HttpDaemon) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key="unused",
                      model="tiny", temperature=0, max_tokens=200, max_retries=0)


def test_langchain_bind_tools_gets_tool_calls(daemon: HttpDaemon) -> None:
    from typing import Literal

    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    class WeatherQuery(BaseModel):
        city: str = Field(description="The city", max_length=12)
        unit: Literal["celsius", "fahrenheit"]

    # A random-weight model fills an unbounded string until the budget ends (a call cut
    # off is no call): bounded arguments, as a typed client declares them.
    @tool(args_schema=WeatherQuery)
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city."""
        return f"18 {unit} in {city}"

    bound = langchain_model(daemon).bind_tools([get_weather], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    assert set(call["args"]) == {"city", "unit"}
    # Its result goes back, and the model answers.
    from langchain_core.messages import HumanMessage, ToolMessage

    reply = bound.bind(tool_choice="none").invoke([
        HumanMessage("What is the weather in Paris?"), message,
        ToolMessage("18 celsius", tool_call_id=call["id"])])
    assert reply.tool_calls == [] and reply.content


def test_langchain_structured_output_by_function_calling(daemon: HttpDaemon) -> None:
    schema = {"title": "Weather", "description": "A city's weather.", "type": "object",
              "properties": {"city": {"type": "string", "maxLength": 12},
                             "celsius": {"type": "integer", "minimum": -50, "maximum": 60}},
              "required": ["city", "celsius"], "additionalProperties": False}
    structured = langchain_model(daemon).with_structured_output(schema,
                                                                method="function_calling")
    value = structured.invoke("Paris: 18 degrees.")
    jsonschema.validate(value, schema)
