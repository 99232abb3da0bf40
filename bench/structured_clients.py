"""Structured output as its users meet it: LangChain's ``with_structured_output`` and the
``openai`` package against the real daemon (tiny model, HTTP), a budget too small for
any answer, and a second user's free-text question beside three users' structured
floods.

    python bench/structured_clients.py

Prints what each client got (an answer, or the exception it raised) and bob's seconds.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.test_http import HttpDaemon  # noqa: E402


class Product(BaseModel):
    name: str = Field(max_length=12)
    price_in_euros: int = Field(ge=0, le=999)
    in_stock: bool


def main() -> int:
    from langchain_openai import ChatOpenAI

    daemon = HttpDaemon(Path(tempfile.mkdtemp())).start()
    try:
        client = daemon.openai()
        base = str(client.base_url)
        schema = {"type": "json_schema", "json_schema": {
            "name": "Product", "schema": Product.model_json_schema()}}
        for max_tokens in (128, 40, 3):
            chat = ChatOpenAI(base_url=base, api_key="x", model="tiny", temperature=0,
                              max_tokens=max_tokens)
            try:
                got: object = chat.with_structured_output(
                    Product, method="json_schema").invoke("The product?")
            except Exception as exc:  # what the client raises is the finding
                got = f"{type(exc).__name__}: {str(exc)[:120]}"
            print(f"LangChain json_schema, max_tokens {max_tokens}: {got}")
            if max_tokens > 3:
                answer = client.chat.completions.create(  # type: ignore[call-overload]
                    model="tiny", max_tokens=max_tokens, temperature=0,
                    messages=[{"role": "user", "content": "The product?"}],
                    response_format=schema)
                choice = answer.choices[0]
                print(f"  openai create(): finish {choice.finish_reason}, "
                      f"{Product.model_validate_json(choice.message.content)}")
        stop = threading.Event()

        def flood() -> None:
            while not stop.is_set():
                client.chat.completions.create(  # type: ignore[call-overload]
                    model="tiny", max_tokens=300, response_format=schema,
                    messages=[{"role": "user", "content": "List the products."}])

        def bobs_questions() -> list[float]:
            """Seconds for each of three 16-token free-text questions."""
            seconds = []
            for i in range(3):
                t0 = time.perf_counter()
                client.chat.completions.create(model="tiny", max_tokens=16, messages=[
                    {"role": "user", "content": f"Hi {i}"}])
                seconds.append(time.perf_counter() - t0)
            return seconds

        alone = bobs_questions()
        threads = [threading.Thread(target=flood) for _ in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(1)  # the floods under way (a bench, not a test)
        beside = bobs_questions()
        stop.set()
        for thread in threads:
            thread.join()
        print(f"bob's 16 tokens: alone {statistics.median(alone):.3f} s, beside three "
              f"structured floods {', '.join(f'{s:.3f}' for s in beside)} s")
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
