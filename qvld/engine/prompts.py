"""Prompts: checked messages -> the prompt's token ids and its decoded images.

Everything before inference that depends on the model: the text is refused early when it
cannot fit the context, rendered with the chat template (or, after a session's history,
only what follows it), tokenised, and each image decoded, resized and patchified, with its
placeholder expanded to its token count. Images seen before (by the same cache owner)
skip decoding when their embedding is cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qvld.engine.cache import ImageCache
from qvld.engine.generate import never
from qvld.engine.image import PixelBudget, PreparedImage, image_digest, prepare
from qvld.engine.model_dir import ModelSpec
from qvld.engine.prompt import ChatTemplate, TextTokenizer, expand_image_pads
from qvld.engine.request import CheckedRequest
from qvld.errors import BadRequest, PromptTooLong


class PrepareStopped(Exception):
    """``should_stop`` fired between images (decoding a large one takes seconds): the
    caller knows whether that was a cancel or a deadline."""


class PromptBuilder:
    def __init__(self, spec: ModelSpec, tokenizer: TextTokenizer, template: ChatTemplate,
                 images: ImageCache, max_decode_pixels: int, max_context: int) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.template = template
        self.images = images
        self.max_decode_pixels = max_decode_pixels
        self.max_context = max_context

    def build(self, checked: CheckedRequest, owner: int | None,
              should_stop: Callable[[], bool] = never, history: list[int] | None = None
              ) -> tuple[list[int], list[PreparedImage], list[int]]:
        """The prompt's ids, images and image starts; with a session's ``history``, the
        ids that follow it: what the template renders after the last assistant turn
        (closing it if generation did not) for the new messages."""
        history = history or []
        self._check_text_length(checked.shown, self.max_context - len(history))
        if history:
            marker = "\x00qvld-history\x00"
            text = self.template.render([{"role": "assistant", "content": marker},
                                         *checked.shown], add_generation_prompt=True)
            if marker not in text:
                raise BadRequest("this model's chat template cannot continue a session")
            text = text.split(marker, 1)[1]
            closing = self.tokenizer.decode_special(history[-1:])
            if history[-1] in self.spec.generation.eos_token_ids and text.startswith(closing):
                text = text[len(closing):]  # generation already closed the turn
        else:
            text = self.template.render(checked.shown, add_generation_prompt=True)
        budget = PixelBudget.for_request(self.spec.vision, checked.image_tokens)
        prepared = self._prepare_images(checked.images, budget, owner, should_stop)
        ids, starts = expand_image_pads(self.tokenizer.encode(text), self.spec.image_token_id,
                                        [p.tokens for p in prepared])
        return ids, prepared, starts

    def _prepare_images(self, images: list[bytes], budget: PixelBudget, owner: int | None,
                        should_stop: Callable[[], bool]) -> list[PreparedImage]:
        limit = self.max_decode_pixels
        prepared: list[PreparedImage] = []
        for data in images:
            # Decoding a large image takes seconds: a request whose client left or whose
            # deadline passed stops between images.
            if should_stop():
                raise PrepareStopped(f"stopped after {len(prepared)} of {len(images)} images")
            key = (owner, image_digest(data, budget))
            known = self.images.grid(key) if key in self.images else None
            image = prepare(data, self.spec.vision, budget, limit, known_grid=known)
            self.images.remember_grid(key, (image.grid_h, image.grid_w))
            prepared.append(image)
        return prepared

    def _check_text_length(self, shown: list[dict[str, Any]], room: int) -> None:
        """Refuse text that cannot fit ``room`` tokens before templating and tokenising
        it whole: a 30 MB text part would otherwise cost gigabytes and seconds."""
        left = room - 1  # at least one token is generated
        for message in shown:
            content = message["content"]
            texts = [content] if isinstance(content, str) else [
                part["text"] for part in content if part["type"] == "text"]
            for text in texts:
                count = self.tokenizer.count_within(text, left)
                if count is None:
                    raise PromptTooLong(
                        f"the prompt's text is longer than the {room} tokens left in the "
                        f"context (engine.max_context_tokens {self.max_context})")
                left -= count
