"""Prompts: checked messages -> token ids and decoded images -> what the language model
takes (embeddings, visual mask, mRoPE positions, deepstack features).

``build`` is everything before inference that depends on the model: the text is refused
early when it cannot fit the context, rendered with the chat template (or, after a
session's history, only what follows it), tokenised, and each image decoded, resized and
patchified, its placeholder expanded to its token count; an image seen before (by the
same cache owner) skips decoding. ``assemble`` runs on a slot: it encodes the images not
already in the KV cache (or takes their cached embeddings) and lays the prompt out.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from qvld.engine.decoding.generation import Prompt, mrope_positions, never
from qvld.engine.inputs.image import PixelBudget, PreparedImage, image_digest, prepare
from qvld.engine.inputs.image_cache import ImageCache
from qvld.engine.inputs.request import CheckedRequest
from qvld.engine.inputs.sessions import dropped
from qvld.engine.inputs.video import PreparedVideo, VideoStopped, prepare_frames, prepare_video
from qvld.engine.inputs.vision import ImageEmbedding, encode_image
from qvld.engine.model.interface import Slot
from qvld.engine.model.model_dir import ModelSpec
from qvld.engine.model.tokenizer import ChatTemplate, TextTokenizer, expand_visual_pads
from qvld.errors import BadRequest, PromptTooLong

# Qwen's vision tokens, as its chat template writes them.
VISION_START, VIDEO_PAD, VISION_END = "<|vision_start|>", "<|video_pad|>", "<|vision_end|>"


class PrepareStopped(Exception):
    """``should_stop`` fired between images (decoding a large one takes seconds): the
    caller knows whether that was a cancel or a deadline."""


class HistoryLost(Exception):
    """A session's history cannot be rebuilt exactly: an image it needs has neither its
    raw bytes (dropped past engine.session_image_mb) nor a cached embedding, and the KV
    cache no longer holds it. The turn then starts the session afresh."""


def prompt_keys(ids: list[int], images: list[PreparedImage], starts: list[int]
                ) -> list[tuple[int, bytes | None]]:
    """(token id, image digest) per row: equal keys mean equal KV rows."""
    keys: list[tuple[int, bytes | None]] = [(t, None) for t in ids]
    for image, start in zip(images, starts, strict=True):
        for row in range(start, start + image.tokens):
            keys[row] = (ids[row], image.digest)
    return keys


class PromptBuilder:
    def __init__(self, spec: ModelSpec, tokenizer: TextTokenizer, template: ChatTemplate,
                 images: ImageCache, max_decode_pixels: int, max_context: int,
                 one_encoder_at_a_time: bool = False,
                 context_set_by: str = "engine.max_context_tokens",
                 video_max_tokens: int = 2048, video_pruning: float = 0.0,
                 *, max_clip_decode_pixels: int) -> None:
        self.spec = spec
        self.max_clip_decode_pixels = max_clip_decode_pixels  # engine.max_clip_decode_pixels
        self.video_max_tokens = video_max_tokens  # model.video_max_tokens
        self.video_pruning = video_pruning  # model.video_pruning
        self.context_set_by = context_set_by  # what sets max_context, for messages
        # With continuous batching the vision encoder runs beside the language model's
        # steps; each inference already takes every core, so encoders running at once
        # only share them: one at a time, the first request's image is done first (its
        # first token comes sooner) and the steps compete with one encoder, not several.
        self._encoding: AbstractContextManager[Any] = (
            threading.Lock() if one_encoder_at_a_time else nullcontext())
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
        self._check_text_length(checked, self.max_context - len(history))
        if checked.prompt is not None:  # raw: as it is, no template (and no session)
            text = checked.prompt
        elif history:
            # A session's tools are its first turn's: they are shown before the history.
            marker = "\x00qvld-history\x00"
            text = self.template.render([{"role": "assistant", "content": marker},
                                         *checked.shown], add_generation_prompt=True,
                                        variables=checked.template_kwargs)
            if marker not in text:
                raise BadRequest("this model's chat template cannot continue a session")
            text = text.split(marker, 1)[1]
            closing = self.tokenizer.decode_special(history[-1:])
            if history[-1] in self.spec.generation.eos_token_ids and text.startswith(closing):
                text = text[len(closing):]  # generation already closed the turn
        else:
            text = self.template.render(checked.shown, add_generation_prompt=True,
                                        tools=checked.tools, variables=checked.template_kwargs)
        budget = PixelBudget.for_request(self.spec.vision, checked.image_tokens)
        prepared = self._prepare_images(checked.images, budget, owner, should_stop)
        videos = self._prepare_videos(checked.videos, should_stop)
        text = self._place_videos(text, videos)
        groups = [group for video in videos for group in video.groups]
        image_id, video_id = self.spec.image_token_id, self.spec.video_token_id
        ids, found = expand_visual_pads(self.tokenizer.encode(text), {
            image_id: [p.tokens for p in prepared], video_id: [g.tokens for g in groups]})
        items = [prepared[n] if token == image_id else groups[n] for token, n, _ in found]
        return ids, items, [start for _, _, start in found]

    def _prepare_videos(self, videos: list[bytes | list[bytes]],
                        should_stop: Callable[[], bool]) -> list[PreparedVideo]:
        out = []
        limits = (self.spec.vision, self.spec.video, self.video_max_tokens,
                  self.max_decode_pixels, should_stop)
        for video in videos:
            try:
                out.append(prepare_video(video, *limits, pruning=self.video_pruning,
                                         max_clip_pixels=self.max_clip_decode_pixels)
                           if isinstance(video, bytes) else
                           prepare_frames(video, *limits, pruning=self.video_pruning))
            except VideoStopped as exc:
                raise PrepareStopped(str(exc)) from None
        return out

    @staticmethod
    def _place_videos(text: str, videos: list[PreparedVideo]) -> str:
        """Each video's one placeholder -> its frame groups with their timestamps, in
        order (as Qwen3VLProcessor does before tokenising)."""
        one = VISION_START + VIDEO_PAD + VISION_END
        placed = "\x00qvld-video-pad\x00"  # not a place for the next video
        for video in videos:
            if one not in text:
                raise BadRequest("this model's chat template has no place for a video")
            text = text.replace(one, video.placeholder(VISION_START, placed, VISION_END), 1)
        return text.replace(placed, VIDEO_PAD)

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

    def _check_text_length(self, checked: CheckedRequest, room: int) -> None:
        """Refuse text that cannot fit ``room`` tokens before templating and tokenising
        it whole: a 30 MB text part would otherwise cost gigabytes and seconds."""
        left = room - 1  # at least one token is generated
        texts = [] if checked.prompt is None else [checked.prompt]
        texts += [text for message in checked.shown for text in (
            [message["content"]] if isinstance(message["content"], str) else
            [part["text"] for part in message["content"] if part["type"] == "text"])]
        # A call's name and arguments (JSON text or an object the template writes out).
        texts += [json.dumps(call["function"], ensure_ascii=False)
                  for message in checked.shown for call in message.get("tool_calls", ())]
        if checked.tools:
            texts.append(json.dumps(checked.tools, ensure_ascii=False))
        # A token stands for at least one byte: text of no more bytes than the room fits
        # (the usual case), with no counting. Characters first, so that a huge text is
        # not copied to bytes.
        if sum(map(len, texts)) <= left and sum(len(t.encode()) for t in texts) <= left:
            return
        for text in texts:
            count = self.tokenizer.count_within(text, left)
            if count is None:
                raise PromptTooLong(
                    f"the prompt's text is longer than the {room} tokens left in the "
                    f"context of {self.max_context} tokens (set by {self.context_set_by})")
            left -= count

    # -- on a slot: the embeddings the language model takes ---------------------------

    def embed_image(self, slot: Slot, image: PreparedImage, owner: int | None = None,
                    pinned: dict[bytes, ImageEmbedding] | None = None
                    ) -> tuple[ImageEmbedding, bool]:
        """The image's embedding, and whether it came from the cache (``owner``'s
        entries, or one ``pinned`` since the request was prepared)."""
        key = (owner, image.digest)
        held = (pinned or {}).get(image.digest)
        if held is None and self.images.peek(key) is None:
            # Not cached: encode it, one encoder at a time with continuous batching. The
            # lookup is repeated inside: a request for the same image that got the lock
            # first has encoded it meanwhile (four clients asking about one photo at
            # once encode it once).
            with self._encoding:
                return self._cached_or_encoded(slot, image, key, held)
        return self._cached_or_encoded(slot, image, key, held)

    def _cached_or_encoded(self, slot: Slot, image: PreparedImage, key: tuple[int | None, bytes],
                           held: ImageEmbedding | None) -> tuple[ImageEmbedding, bool]:
        cached = self.images.get(key, held)
        if cached is not None:
            return cached, True
        if image.patches is None:  # evicted since it was prepared: decode again
            if dropped(image):
                raise HistoryLost(image.digest.hex())
            image = prepare(image.data, self.spec.vision, image.budget,
                            self.max_decode_pixels)
        embedding = encode_image(slot, image, self.spec.vision)
        self.images.put(key, embedding)
        return embedding, False

    def assemble(self, slot: Slot, ids: list[int], images: list[PreparedImage],
                 starts: list[int], should_stop: Callable[[], bool] = never,
                 cached: int = 0, owner: int | None = None,
                 pinned: dict[bytes, ImageEmbedding] | None = None) -> Prompt | None:
        """Lay out embeddings, masks and positions; encode the images on ``slot``.

        Images entirely inside the first ``cached`` rows (already in the KV cache) are
        not encoded. None when ``should_stop`` fired between images. Raises HistoryLost
        when a session image is needed whose bytes and embedding are both gone.
        """
        hidden, k = self.spec.hidden_size, self.spec.vision.deepstack_layers
        visual_mask = np.zeros(len(ids), dtype=bool)
        embeds, deepstack = [], []
        hits = misses = 0
        for image, start in zip(images, starts, strict=True):
            visual_mask[start:start + image.tokens] = True
            if start + image.tokens <= cached:
                embeds.append(np.zeros((image.tokens, hidden), np.float32))
                deepstack.append(np.zeros((k, image.tokens, hidden), np.float32))
                continue
            if should_stop():
                return None
            embedding, hit = self.embed_image(slot, image, owner, pinned)
            if hit:
                hits += 1
            else:
                misses += 1
            embeds.append(embedding.embeds)
            deepstack.append(embedding.deepstack)
        positions, delta = mrope_positions(
            len(ids), [(start, *image.merged_grid, image.keep)
                       for image, start in zip(images, starts, strict=True)])
        return Prompt(
            ids=ids,
            positions=positions,
            rope_delta=delta,
            visual_mask=visual_mask,
            visual_embeds=np.concatenate(embeds) if embeds
            else np.zeros((0, hidden), np.float32),
            deepstack=np.concatenate(deepstack, axis=1) if deepstack
            else np.zeros((k, 0, hidden), np.float32),
            keys=prompt_keys(ids, images, starts),
            image_cache_hits=hits,
            image_cache_misses=misses,
        )
