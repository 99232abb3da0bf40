"""Chat template and tokenizer: messages -> token ids, token ids -> text.

The template is rendered as transformers renders it (sandboxed jinja2, trim_blocks and
lstrip_blocks, ``raise_exception``, ``tojson``, the special tokens as variables) so that
the prompt ids equal ``apply_chat_template``'s.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from qvld.errors import BadRequest, ModelInvalid


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (assistant masks unused)."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's own API

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# Names the template's code calls (jinja2's own globals and ours): a request's
# variables may not shadow them (``namespace`` as a string made the template crash).
TEMPLATE_GLOBALS = frozenset({*jinja2.defaults.DEFAULT_NAMESPACE, "raise_exception",
                              "strftime_now"})


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelInvalid(f"the chat template does not parse: {exc}") from exc
        self._special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[dict[str, Any]] | None = None,
               variables: dict[str, Any] | None = None) -> str:
        """The prompt text, as ``apply_chat_template(messages, tools=tools,
        **variables)`` renders it; ``variables`` (a request's ``chat_template_kwargs``,
        e.g. ``add_vision_id``) cannot replace what is passed here."""
        try:
            return self._template.render({
                **(variables or {}),
                "messages": list(messages),
                "tools": list(tools) if tools else None,
                "documents": None,
                "add_generation_prompt": add_generation_prompt,
                **self._special_tokens,
            })
        except jinja2.TemplateError as exc:
            raise BadRequest(f"the chat template refused the messages: {exc}") from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError,
                ArithmeticError) as exc:
            # What a request's variables or messages made the template's own code do
            # (a string where it adds numbers, say): the request's fault, said so.
            raise BadRequest(f"the chat template could not render this request: "
                             f"{type(exc).__name__}: {exc}") from exc


class TextTokenizer:
    """tokenizer.json through the `tokenizers` library; no transformers at run time."""

    def __init__(self, path: Path) -> None:
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception
            raise ModelInvalid(f"{path} cannot be loaded: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added (special) tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        # The batch form releases the GIL while it works (plain ``encode`` holds it:
        # a long text would stall the event loop) and skips the offsets nobody reads.
        return list(self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids)

    def count_within(self, text: str, limit: int) -> int | None:
        """The tokens of ``text`` alone, or None when they are more than ``limit``; the
        cost is bounded by the chunk size and the limit, whatever the length of ``text``
        (tokenising a whole text costs ≈200 bytes of memory per byte of text).

        A long text is counted in chunks cut where the tokenizer's own pre-tokenizer
        splits (found in a small window around each cut), so that the chunks tokenise as
        the whole does; ``CUT_SLACK`` tokens per cut absorb what a cut could still change
        (e.g. normalisation across it), so a text is never called too long when it is
        not. Counting stops as soon as the limit is passed.
        """
        # A token stands for at least one byte (no need to count a short text in chunks);
        # characters are checked first, so that a huge text is not copied to bytes.
        if len(text) <= limit and len(text.encode()) <= limit:
            return None if limit < 0 else len(self.encode(text))
        total = cuts = start = 0
        while start < len(text):
            end = self._cut(text, start + self.CHUNK_CHARS)
            total += len(self.encode(text[start:end]))
            cuts += end < len(text)
            if total - cuts * self.CUT_SLACK > limit:
                return None
            start = end
        return max(total - cuts * self.CUT_SLACK, 0)

    CHUNK_CHARS = 32_768
    CUT_SLACK = 8
    _WINDOW = 256

    def _cut(self, text: str, at: int) -> int:
        """A position near ``at`` where the pre-tokenizer starts a new piece."""
        if at >= len(text):
            return len(text)
        pre = self._tok.pre_tokenizer
        lo = max(0, at - self._WINDOW)
        if pre is None:
            return at
        pieces = pre.pre_tokenize_str(text[lo:at + self._WINDOW])
        # Piece starts at least half a window in (the window's own start may split
        # differently from the whole text), the one nearest ``at``.
        starts = [lo + s for _, (s, _e) in pieces if s >= self._WINDOW // 2]
        return min(starts, key=lambda p: abs(p - at), default=at) or at

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def decode_special(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens spelled out (e.g. '<|im_end|>')."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def token_id(self, token: str) -> int | None:
        result = self._tok.token_to_id(token)
        return None if result is None else int(result)


def expand_image_pads(ids: Sequence[int], image_token_id: int,
                      image_tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """Replace the i-th image placeholder with ``image_tokens[i]`` copies of it.

    Returns the ids and where each image's rows start: an image is its span, never just
    its token id (generated text could contain that id too).
    """
    out: list[int] = []
    starts: list[int] = []
    for token in ids:
        if token != image_token_id:
            out.append(token)
            continue
        if len(starts) >= len(image_tokens):
            raise BadRequest("the prompt has more image placeholders than images")
        starts.append(len(out))
        out.extend([image_token_id] * image_tokens[len(starts) - 1])
    if len(starts) != len(image_tokens):
        raise BadRequest(f"{len(image_tokens)} images but {len(starts)} image placeholders "
                         "in the prompt")
    return out, starts


def expand_visual_pads(ids: Sequence[int], spans: dict[int, Sequence[int]]
                       ) -> tuple[list[int], list[tuple[int, int, int]]]:
    """``expand_image_pads`` for several kinds (image pads, video pads): ``spans`` maps
    each pad id to its spans' token counts in order. Returns the ids and, in prompt
    order, (pad id, index among that pad's spans, start row)."""
    out: list[int] = []
    found: list[tuple[int, int, int]] = []
    used = dict.fromkeys(spans, 0)
    for token in ids:
        counts = spans.get(token)
        if counts is None:
            out.append(token)
            continue
        n = used[token]
        if n >= len(counts):
            raise BadRequest("the prompt has more image or video placeholders than "
                             "images and videos")
        used[token] = n + 1
        found.append((token, n, len(out)))
        out.extend([token] * counts[n])
    if any(used[t] != len(c) for t, c in spans.items()):
        raise BadRequest("the prompt's image and video placeholders do not match its "
                         "images and videos")
    return out, found


class IncrementalText:
    """Text of a growing id list, released only up to complete UTF-8 characters.

    Each new id decodes a short window, not the whole list: the text of ids[start:] minus
    that of ids[start:settled] is what the new ids add (both begin at the same id, so a
    decoder's special treatment of a sequence start cancels out). The window moves on
    whenever its text ends in a complete character, so the work per token does not grow
    with the length of the answer.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self.settled_length = 0  # len(text) that no later id can change
        self._start = 0  # first id of the window
        self._settled = 0  # ids whose text is final
        self._window_settled = ""  # text of ids[_start:_settled]

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        window = self._tokenizer.decode(self.ids[self._start:])
        self.text = self.text[:self.settled_length] + window[len(self._window_settled):]
        if not window.endswith("\ufffd"):
            self.settled_length = len(self.text)
            self._start, self._settled = self._settled, len(self.ids)
            self._window_settled = self._tokenizer.decode(self.ids[self._start:])

    def stable_text(self) -> str:
        """The text so far without a trailing incomplete character (U+FFFD)."""
        return self.text.rstrip("\ufffd")
