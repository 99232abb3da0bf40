"""The API dialects beside chat completions, against the real daemon with each one's
real client: the Anthropic Messages API (``POST /v1/messages``) with ``anthropic`` and
LangChain's ``ChatAnthropic`` (images, streaming, a tool_use / tool_result round trip,
keys as ``x-api-key``, errors in the API's shape); and the defaults every dialect shares
(an answer without a limit runs to the end of the context)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.test_http import RECEIPT, HttpDaemon

GREEDY = {"temperature": 0}  # an extension here: the API has dropped sampling fields
ADD = {"name": "add", "description": "Add two numbers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "number"},
                                                         "b": {"type": "number"}},
                        "required": ["a", "b"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    # A context of 1 024 tokens: an answer without a limit ends there, soon.
    d = HttpDaemon(tmp_path_factory.mktemp("dialects"),
                   args=["--set", "engine.max_context_tokens=1024"]).start()
    try:
        yield d
    finally:
        d.stop()


def client(daemon: HttpDaemon, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{daemon.port}", api_key=key,
                               max_retries=0, timeout=60)


def picture_question(question: str = "What is the total?") -> list[dict[str, Any]]:
    data = base64.b64encode(Path(RECEIPT).read_bytes()).decode()
    return [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": data}},
        {"type": "text", "text": question}]}]


def test_a_picture_and_a_question_streamed_and_not(daemon: HttpDaemon) -> None:
    messages = client(daemon).messages
    whole = messages.create(model="tiny", max_tokens=12, extra_body=GREEDY,
                            system="Answer briefly.", messages=picture_question())
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.stop_reason in ("max_tokens", "end_turn")
    assert whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 100  # the image
    with messages.stream(model="tiny", max_tokens=12, extra_body=GREEDY,
                         system="Answer briefly.", messages=picture_question()) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text  # greedy: same
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The same picture again: its prompt rows come from the cache.
    again = messages.create(model="tiny", max_tokens=2, extra_body=GREEDY,
                            system="Answer briefly.", messages=picture_question())
    assert again.usage.cache_read_input_tokens > 100
    # count_tokens: the prompt's tokens, nothing generated (input_tokens excludes the
    # cache reads, as the API counts them).
    counted = messages.count_tokens(model="tiny", system="Answer briefly.",
                                    messages=picture_question())
    usage = again.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_a_tool_use_and_tool_result_round_trip(daemon: HttpDaemon) -> None:
    messages = client(daemon).messages
    ask = [{"role": "user", "content": "What is 2 plus 3?"}]
    first = messages.create(model="tiny", max_tokens=400, extra_body=GREEDY, tools=[ADD],
                            tool_choice={"type": "any"}, messages=ask)
    assert first.stop_reason == "tool_use", first
    use = next(block for block in first.content if block.type == "tool_use")
    assert use.name == "add" and set(use.input) == {"a", "b"}
    assert use.id.startswith("toolu_")
    answer = messages.create(
        model="tiny", max_tokens=8, extra_body=GREEDY, tools=[ADD],
        messages=[*ask, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result",
                                                "tool_use_id": use.id, "content": "5"}]}])
    assert answer.content[0].type == "text" and answer.stop_reason in ("max_tokens",
                                                                       "end_turn")
    # Streamed, the call arrives as a tool_use block whose input is the model's JSON.
    with messages.stream(model="tiny", max_tokens=400, extra_body=GREEDY, tools=[ADD],
                         tool_choice={"type": "tool", "name": "add"},
                         messages=ask) as stream:
        final = stream.get_final_message()
    streamed = next(block for block in final.content if block.type == "tool_use")
    assert streamed.input == use.input and final.stop_reason == "tool_use"


def test_stop_sequences_and_the_stop_reason(daemon: HttpDaemon) -> None:
    messages = client(daemon).messages
    free = messages.create(model="tiny", max_tokens=40, extra_body=GREEDY,
                           messages=[{"role": "user", "content": "Count: 1, 2, 3"}])
    text = free.content[0].text
    cut = text[len(text) // 2:len(text) // 2 + 2]  # something the greedy answer says
    stopped = messages.create(model="tiny", max_tokens=40, extra_body=GREEDY,
                              stop_sequences=[cut],
                              messages=[{"role": "user", "content": "Count: 1, 2, 3"}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == cut
    assert cut not in stopped.content[0].text
    assert stopped.content[0].text == text[:text.index(cut)]


def test_errors_in_the_apis_shape(daemon: HttpDaemon) -> None:
    with pytest.raises(anthropic.BadRequestError) as unknown:
        client(daemon).messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": "Hi"}], extra_body={"temprature": 0})
    assert unknown.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "temperature" in unknown.value.body["error"]["message"]  # type: ignore[index]
    status, _, body = daemon.request("POST", "/v1/messages", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}).encode())
    assert status == 400 and body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens is required"}}
    status, _, body = daemon.request("POST", "/v1/messages", json.dumps(
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "bm90IGFuIGltYWdl"}}]}]}).encode())
    assert status == 400 and body["type"] == "error", body
    status, _, body = daemon.request("POST", "/v1/messages", json.dumps(
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "x", "name": "add", "input": {}}]}]}).encode())
    assert status == 400 and "a user message holds" in body["error"]["message"]
    assert "op=generate" in daemon.log() and "api" in daemon.log()


def test_langchain_chat_anthropic(daemon: HttpDaemon) -> None:
    from langchain_anthropic import ChatAnthropic

    chat = ChatAnthropic(model="tiny", base_url=f"http://127.0.0.1:{daemon.port}",
                         api_key="unused", max_tokens=6, temperature=0,  # type: ignore[arg-type]
                         max_retries=0)
    reply = chat.invoke("Hello")
    assert isinstance(reply.content, str) and reply.content
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] <= 6
    assert "".join(str(c.content) for c in chat.stream("Hello")) == reply.content


def test_a_key_is_taken_as_x_api_key(tmp_path: Path) -> None:
    from qvld.http.keys import hash_key
    from tests.conftest import free_port

    key, other = "qvld-test-key-dora-0123456789", "qvld-test-key-erin-0123456789"
    keys = tmp_path / "keys"
    keys.write_text(f"dora:{hash_key(key)}\nerin:{hash_key(other)}\n")
    keys.chmod(0o600)
    port = free_port()  # and http.ollama_listen: the same API on Ollama's port
    d = HttpDaemon(tmp_path, args=["--set", f"http.api_keys_file={keys}",
                                   "--set", f"http.ollama_listen=127.0.0.1:{port}"]).start()
    try:
        import ollama

        on_its_port = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60,
                                    headers={"Authorization": f"Bearer {key}"})
        assert len(on_its_port.list().models) == 1
        chatted = on_its_port.chat(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                   options={"num_predict": 2}, stream=False)
        assert chatted.done and chatted.eval_count <= 2
        assert "also on 127.0.0.1:" in d.log()
        answer = client(d, key).messages.create(  # the SDK sends it as x-api-key
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert answer.usage.output_tokens <= 2
        with pytest.raises(anthropic.AuthenticationError) as refused:
            client(d, "not-a-key").messages.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        # A stored response is its user's own: another key can neither read nor
        # continue it (nor tell it from one that does not exist).
        mine = d.openai(key).responses.create(model="tiny", input="Hi", max_output_tokens=2)
        assert d.openai(key).responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            d.openai(other).responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            d.openai(other).responses.delete(mine.id)
        with pytest.raises(openai.BadRequestError, match="not found"):
            d.openai(other).responses.create(model="tiny", input="Hi",
                                             previous_response_id=mine.id)
    finally:
        d.stop()


def test_an_answer_without_a_limit_runs_to_the_end_of_the_context(daemon: HttpDaemon
                                                                 ) -> None:
    """#47: a request naming no max_tokens got 128 tokens, and none more than 512
    (cut descriptions, LengthFinishReasonError in clients). By default it now runs until
    the model stops or the context ends, as vLLM and OpenAI do."""
    answer = daemon.openai().chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=[{"role": "user", "content": "Tell me a long story."}],
        temperature=0, extra_body={"ignore_eos": True})
    usage = answer.usage
    assert usage.completion_tokens > 512 and answer.choices[0].finish_reason == "length"
    assert usage.prompt_tokens + usage.completion_tokens == 1024  # the whole context
    # Anthropic's max_tokens is required and means what it says.
    capped = client(daemon).messages.create(model="tiny", max_tokens=40, extra_body={
        **GREEDY, "ignore_eos": True}, messages=[{"role": "user", "content": "Go on."}])
    assert capped.usage.output_tokens == 40 and capped.stop_reason == "max_tokens"


# -- the Ollama API --------------------------------------------------------------------

def ollama_client(daemon: HttpDaemon) -> Any:
    import ollama

    return ollama.Client(host=f"http://127.0.0.1:{daemon.port}", timeout=60)


def test_ollama_chat_with_a_picture_streamed_and_not(daemon: HttpDaemon) -> None:
    client = ollama_client(daemon)
    ask = [{"role": "user", "content": "What is the total?", "images": [str(RECEIPT)]}]
    options = {"temperature": 0, "num_predict": 12, "num_ctx": 4096}  # num_ctx: ignored
    whole = client.chat(model="tiny", messages=ask, options=options, stream=False,
                        keep_alive="5m")
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count <= 12 and whole.prompt_eval_count > 100  # the image's rows
    assert whole.total_duration > whole.eval_duration > 0
    chunks = list(client.chat(model="tiny", messages=ask, options=options, stream=True))
    assert len(chunks) > 2 and chunks[-1].done and not any(c.done for c in chunks[:-1])
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].eval_count == whole.eval_count
    # As in Ollama, a request that does not say streams, one JSON object a line.
    status, headers, body = daemon.request("POST", "/api/chat", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
         "options": {"num_predict": 3, "temperature": 0}}).encode())
    lines = [json.loads(line) for line in body.splitlines()]
    assert status == 200 and headers["Content-Type"].startswith("application/x-ndjson")
    assert lines[-1]["done"] and lines[-1]["eval_count"] <= 3 and len(lines) >= 2


def test_ollama_list_show_ps_version(daemon: HttpDaemon) -> None:
    client = ollama_client(daemon)
    listed = client.list().models
    assert len(listed) == 1 and listed[0].model and listed[0].size > 1000
    shown = client.show(listed[0].model)
    assert "vision" in (shown.capabilities or []) and shown.template
    assert shown.modelinfo["qwen3vl.context_length"] == 1024  # type: ignore[index]
    running = client.ps().models
    assert running[0].model == listed[0].model and running[0].context_length == 1024
    status, _, body = daemon.request("GET", "/api/version")
    assert status == 200 and body["version"]


def test_ollama_generate_with_a_schema_format(daemon: HttpDaemon) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"total": {"type": "number"},
                                               "shop": {"type": "string", "maxLength": 8}},
              "required": ["total", "shop"], "additionalProperties": False}
    answer = ollama_client(daemon).generate(
        model="tiny", prompt="What does the receipt say?", images=[str(RECEIPT)],
        format=schema, options={"num_predict": 200, "temperature": 0}, stream=False)
    assert answer.done
    jsonschema.validate(json.loads(answer.response), schema)
    assert daemon.request("POST", "/api/generate", json.dumps(
        {"model": "tiny", "prompt": "Hi", "raw": True}).encode())[0] == 400


def test_ollama_errors_and_misspellings(daemon: HttpDaemon) -> None:
    import ollama

    with pytest.raises(ollama.ResponseError) as typo:
        ollama_client(daemon).chat(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                   options={"temprature": 0}, stream=False)
    assert typo.value.status_code == 400 and "temperature" in typo.value.error
    # What Ollama ignores is ignored; what it refuses is refused, in its shape.
    status, _, body = daemon.request("POST", "/api/chat", json.dumps(
        {"model": "tiny", "stream": False, "options": {"num_predict": 2},
         "messages": [{"role": "user", "content": "Hi"}], "some_new_field": 1}).encode())
    assert status == 200 and body["done"], body
    status, _, body = daemon.request("POST", "/api/chat", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi",
                                        "images": ["bm90IGFuIGltYWdl"]}]}).encode())
    assert status == 400 and set(body) == {"error"} and "PNG" in body["error"]


def test_langchain_chat_ollama(daemon: HttpDaemon) -> None:
    from langchain_ollama import ChatOllama

    chat = ChatOllama(model="tiny", base_url=f"http://127.0.0.1:{daemon.port}",
                      num_predict=6, temperature=0)
    reply = chat.invoke("Hello")
    assert isinstance(reply.content, str) and reply.content
    assert "".join(str(c.content) for c in chat.stream("Hello")) == reply.content


# -- the Responses API -----------------------------------------------------------------

def data_url() -> str:
    return "data:image/png;base64," + base64.b64encode(Path(RECEIPT).read_bytes()).decode()


def test_responses_a_picture_and_a_question_streamed_and_not(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    ask = [{"role": "user", "content": [{"type": "input_image", "image_url": data_url()},
                                        {"type": "input_text", "text": "What is the total?"}]}]
    whole = client.responses.create(model="tiny", input=ask, max_output_tokens=12,
                                    temperature=0, instructions="Answer briefly.")
    assert whole.object == "response" and whole.output_text
    assert whole.status in ("completed", "incomplete")
    assert whole.usage is not None and whole.usage.input_tokens > 100
    assert whole.usage.output_tokens <= 12
    events = list(client.responses.create(model="tiny", input=ask, max_output_tokens=12,
                                          temperature=0, instructions="Answer briefly.",
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text and events[-1].response.output_text == deltas
    # The SDK's stream helper wants response.completed (an answer cut at
    # max_output_tokens ends in response.incomplete, as OpenAI's does): a format keeps
    # this one short.
    short = {"type": "json_schema", "name": "yes", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}}
    with client.responses.stream(model="tiny", input="Hi", max_output_tokens=40,
                                 temperature=0, text={"format": short}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text) in (
        {"ok": True}, {"ok": False})


def test_responses_a_follow_up_continues_the_stored_conversation(daemon: HttpDaemon
                                                                 ) -> None:
    client = daemon.openai()
    first = client.responses.create(model="tiny", max_output_tokens=8, temperature=0,
                                    input=[{"role": "user", "content": [
                                        {"type": "input_image", "image_url": data_url()},
                                        {"type": "input_text", "text": "What is this?"}]}])
    follow = client.responses.create(model="tiny", max_output_tokens=4, temperature=0,
                                     previous_response_id=first.id, input="And the total?")
    assert follow.previous_response_id == first.id
    # The picture and the first answer are in the prompt again, from the KV cache.
    assert follow.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    assert follow.usage.input_tokens_details.cached_tokens > 100  # type: ignore[union-attr]
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="tiny", previous_response_id=first.id, input="Hi")
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_a_function_tool_round_trip_and_a_schema(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    tool = {"type": "function", "name": "add", "description": "Add two numbers",
            "parameters": ADD["input_schema"], "strict": True}
    ask: list[Any] = [{"role": "user", "content": "What is 2 plus 3?"}]
    called = client.responses.create(model="tiny", input=ask, tools=[tool],
                                     tool_choice="required", max_output_tokens=400,
                                     temperature=0)
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name == "add" and set(json.loads(call.arguments)) == {"a", "b"}
    answer = client.responses.create(
        model="tiny", tools=[tool], max_output_tokens=6, temperature=0,
        input=[*ask, {"type": "function_call", "call_id": call.call_id, "name": "add",
                      "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert answer.output[0].type == "message" and answer.output_text
    # Streamed: the arguments arrive as function_call_arguments events.
    events = list(client.responses.create(model="tiny", input=ask, tools=[tool],
                                          tool_choice={"type": "function", "name": "add"},
                                          max_output_tokens=400, temperature=0,
                                          stream=True))
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments
    schema = {"type": "object", "properties": {"total": {"type": "number"}},
              "required": ["total"], "additionalProperties": False}
    shaped = client.responses.create(model="tiny", input="The total?", temperature=0,
                                     max_output_tokens=200, text={"format": {
                                         "type": "json_schema", "name": "receipt",
                                         "schema": schema, "strict": True}})
    assert set(json.loads(shaped.output_text)) == {"total"}


def test_langchain_chat_openai_on_the_responses_api(daemon: HttpDaemon) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model="tiny", base_url=f"http://127.0.0.1:{daemon.port}/v1",
                      api_key="unused", max_tokens=6, temperature=0,  # type: ignore[arg-type]
                      use_responses_api=True, max_retries=0)
    reply = chat.invoke("Hello")
    assert reply.text and reply.usage_metadata is not None
    assert reply.usage_metadata["output_tokens"] <= 6


# -- text completions ------------------------------------------------------------------

def test_text_completions_take_a_raw_prompt(daemon: HttpDaemon) -> None:
    """#47: LlamaIndex's OpenAILike posts to /v1/completions by default; it was a 404.
    A raw prompt, no chat template; max_tokens 16 by default, as OpenAI's API has it."""
    client = daemon.openai()
    whole = client.completions.create(model="tiny", prompt="Once upon a time",
                                      temperature=0, max_tokens=8,
                                      extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.choices[0].text
    assert whole.usage.completion_tokens == 8  # type: ignore[union-attr]
    assert whole.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=1)
    # No template: the prompt is the text alone, fewer tokens than as a chat message.
    assert whole.usage.prompt_tokens < chat.usage.prompt_tokens  # type: ignore[union-attr]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon a time", temperature=0, max_tokens=8, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == whole.choices[0].text
    default = client.completions.create(model="tiny", prompt="Once upon a time",
                                        extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny", prompt="Hi", echo=True)
    with pytest.raises(openai.BadRequestError, match="placeholders"):
        client.completions.create(model="tiny", prompt="<|vision_start|><|image_pad|>")


