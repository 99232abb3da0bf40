"""The engine facade: build from config, ``prepare`` a request, ``submit`` it, await its
``Generation.future`` (or ``generate``: both, blocking).

Who owns what, in the order a request meets them:

- ``prepare`` (``preparer.Preparer``, on the daemon's prepare stage threads):
  validation, chat template, tokens, decoded images (``prompts.PromptBuilder``,
  ``image``); a response format's compile started (``constraints.GrammarCompiler``,
  its own fair threads).
- ``submit``: bounds the waiting generations (``server.queue_max`` beyond the free
  places, each user's share kept for it) and hands each to the step loop as an
  ``Arrival``: the scheduler, the one queue, starts its encode on a slot worker (one
  thread per ``engine.infer_requests`` slot) when a slot is free and its user's turn
  has come.
- On the slot worker (``_start``): a session turn begun (``session_turns``; its
  history joined, or started afresh when it cannot be rebuilt), then
  ``runners.LoopRunner``: the prompt's cached prefix held, its images encoded and rows
  embedded, and the ``sequence.Sequence`` handed to the step loop.
- The step loop (``loop.step_loop.StepLoop``, one thread) asks the step scheduler
  (``scheduler.StepScheduler``: waiting, running, KV blocks, rows per step, fairness and
  preemption) who runs, feeds the rows, samples (``decoding.generation.Decoding``) and
  calls the sequence's ``on_done``. Every runtime runs there: OpenVINO's paged model
  steps every sequence in one inference; a runtime without paged attention steps them
  one by one on slots (``model.slot_paged.SlotPaged``) over the same KV blocks.
- ``_finish``: the result (``results``), the session turn committed (and its blocks
  pinned), the future settled.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import numpy as np

from qvld.config import Config
from qvld.engine import results
from qvld.engine.decoding.constraints import GrammarCompiler
from qvld.engine.decoding.generation import Decoding, never
from qvld.engine.decoding.sampling import Sampler, SamplingParams, StopStrings
from qvld.engine.inputs.image import PixelBudget, PreparedImage
from qvld.engine.inputs.image_cache import ImageCache
from qvld.engine.inputs.prompt_builder import HistoryLost, PromptBuilder
from qvld.engine.inputs.request import CheckedRequest
from qvld.engine.inputs.sessions import (
    SessionStore,
    Turn,
    TurnInputs,
)
from qvld.engine.inputs.tools import HeldText
from qvld.engine.inputs.vision import encode_image
from qvld.engine.loop.blocks import BlockPool
from qvld.engine.loop.sequence import Arrival
from qvld.engine.loop.step_loop import StepLoop
from qvld.engine.model.backend import SlotPool, load_models, release_file_pages
from qvld.engine.model.interface import RowsSlot
from qvld.engine.model.model_dir import (
    VIDEO_CONFIG,
    ModelSpec,
    load_model_spec,
    onnx_outdated,
    resolve_backend,
)
from qvld.engine.model.tokenizer import ChatTemplate, TextTokenizer
from qvld.engine.preparer import PreparedRequest, Preparer
from qvld.engine.runners import Generation, LoopRunner, Ran, RunJob
from qvld.engine.session_turns import SessionTurns
from qvld.engine.types import (
    GenerateRequest,
    GenerateResult,
    ServedModel,
    TokenCallback,
)
from qvld.errors import Busy, ModelInvalid
from qvld.fairqueue import within_share

log = logging.getLogger("qvld.engine")


def warmup_image(size: int = 448) -> bytes:
    """A smooth gradient as PNG: about the default image budget, cheap to decode."""
    import io

    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    pixels = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], -1)
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


class Engine:
    def __init__(self, config: Config, *,
                 on_step: Callable[[int, int], None] | None = None,
                 on_prefill: Callable[[str, int], None] | None = None) -> None:
        """Load and compile ``config.model``. ``on_step(sequences, prefill_rows)`` is
        called after every step of the step loop, ``on_prefill(runtime, rows)`` whenever
        a runtime computed prompt rows (both on the step thread; not during ``warmup``)."""
        path = config.model.path
        if path is None:
            raise ModelInvalid("model.path is not set")
        backend, why = resolve_backend(config.model)
        if backend != config.model.backend:  # auto: the runtime it chose, from here on
            log.info("model.backend auto: %s (%s)", backend, why)
            config = config.model_copy(
                update={"model": config.model.model_copy(update={"backend": backend})})
        self.config = config
        t0 = time.perf_counter()
        self.spec: ModelSpec = load_model_spec(path, config.model.backend)
        self.tokenizer = TextTokenizer(path / "tokenizer.json")
        self.template = ChatTemplate(self.spec.chat_template, self.spec.special_tokens)
        if not (path / VIDEO_CONFIG).is_file():
            log.warning("%s has no %s: clips are sampled with transformers' defaults (fps "
                        "%g, %d-%d frames, %d-%d pixels in all), not the model's own; "
                        "copy the checkpoint's file beside the graphs", config.model.path,
                        VIDEO_CONFIG, self.spec.video.fps, self.spec.video.min_frames,
                        self.spec.video.max_frames, self.spec.video.min_pixels,
                        self.spec.video.max_pixels)
        self.models = load_models(self.spec, config.model, config.engine)
        outdated = onnx_outdated(path)
        if outdated:  # auto passed them over (onnxruntime named would have refused)
            log.warning("%s; until then OpenVINO runs everything", outdated)
        for deprecation in config.deprecations():
            log.warning("%s", deprecation)
        self.max_context = min(config.engine.max_context_tokens,
                               self.spec.max_position_embeddings)
        # What sets the context, for the message of a prompt that does not fit.
        self.context_set_by = (
            "engine.max_context_tokens"
            if config.engine.max_context_tokens <= self.spec.max_position_embeddings else
            "the model's max_position_embeddings; engine.max_context_tokens is "
            f"{config.engine.max_context_tokens}")
        # Every generation runs in the step loop over the paged KV cache; the slots only
        # encode images and embed prompts.
        self.blocks: BlockPool = self._block_pool(config)
        paged = self.models.new_paged(self.blocks.num_blocks, config.engine.infer_requests)
        prompt = self.models.prompt
        # A slot of the prompt runtime's own for prefills (its slots load and read out
        # rows); its rows can go only into an f16 or f32 paged cache.
        prompt_slot = (cast(RowsSlot, prompt.new_slot())
                       if prompt is not None and paged.rows_accessible else None)
        self.batch = StepLoop(paged, self.blocks,
                              max_sequences=config.engine.max_sequences,
                              max_batch_tokens=config.engine.max_batch_tokens,
                              chunk=config.engine.prefill_chunk,
                              on_step=on_step, on_prefill=on_prefill,
                              runtime=self.models.runtime, prompt_slot=prompt_slot,
                              prompt_runtime=prompt.runtime if prompt else "",
                              encoders=config.engine.infer_requests)
        if prompt is not None and not paged.rows_accessible:
            log.warning("model.kv_cache_precision %s: prompts are prefilled by "
                        "OpenVINO (ONNX Runtime's rows go only into an f16 or f32 "
                        "cache); images are still encoded by ONNX Runtime",
                        config.model.kv_cache_precision)
        self.pool = SlotPool(self.models, config.engine.infer_requests)
        self.queue_max = config.server.queue_max
        self._lock = threading.Lock()
        self._generations: set[Generation] = set()
        self.images = ImageCache(config.engine.image_cache_mb << 20)
        self.sessions = SessionStore(config.engine.sessions_max, config.engine.session_ttl_s,
                                     per_user=config.engine.sessions_per_user,
                                     image_budget_bytes=config.engine.session_image_mb << 20,
                                     on_removed=lambda uid, sid: self.blocks.unpin((uid, sid)))
        self.prompts = PromptBuilder(self.spec, self.tokenizer, self.template, self.images,
                                     config.engine.max_decode_pixels, self.max_context,
                                     one_encoder_at_a_time=True,
                                     context_set_by=self.context_set_by,
                                     video_max_tokens=config.model.video_max_tokens,
                                     video_pruning=config.model.video_pruning,
                                     max_clip_decode_pixels=(
                                         config.engine.max_clip_decode_pixels))
        # Structured output: compiled on threads of its own, beside images and prefill.
        self.grammars = GrammarCompiler(path / "tokenizer.json",
                                        self.spec.vocab_size,
                                        self.spec.generation.eos_token_ids,
                                        cache_size=config.engine.grammar_cache_size)
        self.preparer = Preparer(
            config, self.spec, self.prompts, self.sessions, self.images, self.grammars,
            max_context=self.max_context, context_set_by=self.context_set_by,
            # The most rows one generation can hold: the context, within the KV cache.
            rows_room=min(self.max_context, self.blocks.num_blocks * self.blocks.block_size))
        self.turns = SessionTurns(self.sessions, self.blocks, self.preparer, self.tokenizer,
                                  self.spec.generation.eos_token_ids)
        self.runner = LoopRunner(self.pool, self.prompts, self.batch, self.max_context)
        self.load_s = time.perf_counter() - t0
        self.served = ServedModel(
            name=self.spec.name, path=self.spec.path, chat_template=self.spec.chat_template,
            eos_token_ids=tuple(self.spec.generation.eos_token_ids),
            runtime=self.models.runtime, runtime_version=self.models.runtime_version,
            runtime_properties=dict(self.models.runtime_properties),
            prompt_runtime=self.prompt_runtime,
            continuous_batching=self.batch.model.batches_decoding,
            load_s=self.load_s)

    def _block_pool(self, config: Config) -> BlockPool:
        """Blocks for the KV budget (engine.kv_cache_mb; what the scheduler admits by),
        plus one per running generation for its partly filled last block, and never more
        than every running generation (engine.max_sequences) at full context twice over
        (the rest a prefix cache). With kv_cache_mb 0: every running generation at full
        context, and no prefix cache."""
        engine = config.engine
        size = self.models.kv_block_size
        per_block = self.models.kv_bytes_per_token * size
        full = engine.max_sequences * (-(-self.max_context // size) + 1)
        if not engine.kv_cache_mb:
            return BlockPool(full, size, retain=False)
        budget = engine.kv_admission_bytes or 0
        return BlockPool(min(budget // per_block + engine.max_sequences, 2 * full), size)

    def reconfigure(self, config: Config) -> None:
        """A reload that kept this engine (same model and engine keys): the bounds that
        live outside ``engine``."""
        self.config = config
        self.preparer.config = config
        self.queue_max = config.server.queue_max

    # -- requests (the prepare stage: ``preparer``) ---------------------------------

    def cache_owner(self, uid: int) -> int | None:
        return self.preparer.cache_owner(uid)

    def check(self, request: GenerateRequest) -> CheckedRequest:
        return self.preparer.check(request)

    def sampling_params(self, request: GenerateRequest) -> SamplingParams:
        return self.preparer.sampling_params(request)

    def image_budget(self, request: GenerateRequest) -> PixelBudget:
        return self.preparer.image_budget(request)

    def tokenize(self, request: GenerateRequest, uid: int = 0,
                 should_stop: Callable[[], bool] = never
                 ) -> tuple[list[int], list[PreparedImage], list[int]]:
        return self.preparer.tokenize(request, uid, should_stop)

    def prepare(self, request: GenerateRequest, uid: int = 0,
                should_stop: Callable[[], bool] = never) -> PreparedRequest:
        return self.preparer.prepare(request, uid, should_stop)

    # -- what the daemon reports -------------------------------------------------------

    @property
    def runtime(self) -> tuple[str, str]:
        """The runtime's name and version (``model.backend``'s)."""
        return self.models.runtime, self.models.runtime_version

    @property
    def prompt_runtime(self) -> str:
        """The runtime that prefills prompts: the prompt backend's where its rows can go
        into the paged cache (model.prompt_backend), else the decoding one's."""
        prompt = self.models.prompt
        if prompt is not None and self.batch.prefills is not None:
            return str(prompt.runtime)
        return self.models.runtime

    # -- sessions, for the fronts ------------------------------------------------------

    def session_count(self) -> int:
        return len(self.sessions)

    def list_sessions(self, uid: int | None) -> list[dict[str, Any]]:
        """``uid``'s sessions (None: everyone's)."""
        return self.sessions.list(uid)

    def close_session(self, uid: int, sid: str, by_owner: bool = True) -> bool:
        return self.sessions.close(uid, sid, by_owner=by_owner)

    def close_user_sessions(self, uid: int) -> int:
        """Every session of ``uid`` (a revoked key's); how many there were."""
        return self.sessions.close_user(uid)

    def inherit_sessions(self, old: Engine) -> None:
        """A reload: ``old``'s sessions are known here, so that their follow-ups say they
        were reset rather than that they never existed."""
        self.sessions.inherit(old.sessions)

    @property
    def preemptions(self) -> int:
        return self.batch.preemptions

    def stats(self) -> dict[str, Any]:
        """The model, the runtime and the caches, for status (nothing outside the engine
        reaches into its pool or caches)."""
        out: dict[str, Any] = {
            "name": self.spec.name,
            "path": str(self.spec.path),
            "load_s": round(self.load_s, 3),
            "runtime": {"name": self.models.runtime, "version": self.models.runtime_version,
                        **self.models.runtime_properties},
            "infer_requests": len(self.pool.slots),
            "max_context_tokens": self.max_context,
            "image_cache": self.images.stats(),
            "sessions": self.sessions.stats(),
            "grammars": self.grammars.stats(),
            "batch": self.batch_stats(),
        }
        # Rows held by running generations or kept as prefixes.
        blocks = self.blocks.stats()
        out["kv_cached_tokens"] = (blocks["held"] + blocks["cached"]) * blocks["block_size"]
        out["kv_budget_tokens"] = blocks["blocks"] * blocks["block_size"]
        return out

    def batch_stats(self) -> dict[str, Any]:
        """The step loop's counters, the KV blocks, every running generation (uid, rows
        fed, tokens so far), and whether a step runs its sequences in one inference
        (continuous batching) or one by one on slots (and why)."""
        decoding, prefilling = self.batch.counts()
        batched = self.batch.model.batches_decoding
        batching: dict[str, Any] = {"continuous_batching": batched}
        if not batched:
            batching["reason"] = "engine.continuous_batching is off"
        return {**batching,
                "max_batch_tokens": self.batch.max_batch_tokens,
                "steps": self.batch.steps, "peak_sequences": self.batch.peak_sequences,
                "decoding": decoding, "prefilling": prefilling,
                "prompt_runtime": self.prompt_runtime,
                "kv_blocks": self.blocks.stats(),
                "kv_usage_ratio": round(self.blocks.usage_ratio(), 4),
                "sequences": self.batch.sequences()}

    def infer_stuck(self, bound_s: float) -> bool:
        """Whether an inference call has been running for longer than ``bound_s``."""
        now = time.monotonic()
        started = [slot.busy_since for slot in self.pool.slots]
        # A prompt prefilled by another runtime runs on the slot's prompt slot.
        started += [slot.prompt_slot.busy_since for slot in self.pool.slots
                    if slot.prompt_slot is not None]
        started.append(self.batch.busy_since)
        if self.batch.prefills is not None:
            started.append(self.batch.prefills.busy_since)
        return any(t is not None and now - t > bound_s for t in started)

    def kv_bytes(self, tokens: int) -> int:
        """KV-cache memory ``tokens`` positions take at the runtime's KV precision."""
        return tokens * self.models.kv_bytes_per_token

    # -- generations --------------------------------------------------------------

    def submit(self, prepared: PreparedRequest, on_token: TokenCallback | None = None,
               should_stop: Callable[[], bool] = never) -> Generation:
        """Start a prepared request; its ``future`` gets the result (or the typed error).

        Busy when ``server.queue_max`` generations wait already and this user holds its
        share of them (``fairqueue.within_share``). ``should_stop`` is
        polled between images, prefill chunks and decode steps; True ends the
        generation as cancelled (so does ``cancel``)."""
        return self.submit_choices(prepared, [on_token], should_stop)[0]

    def submit_choices(self, prepared: PreparedRequest,
                       on_tokens: list[TokenCallback | None],
                       should_stop: Callable[[], bool] = never) -> list[Generation]:
        """``len(on_tokens)`` answers to one prompt (``n``), a Generation each, with its
        own sampler seed (the request's plus its index) and its own grammar matcher.

        With continuous batching and a prefix cache, the first runs alone until its
        prompt is in the KV cache; the others start then and take its prompt's blocks
        (one prefill: each computes only the rows of its last, partly filled block).
        Otherwise all start at once. Busy when the queue cannot take them all."""
        gens = [Generation(uid=prepared.uid, stop_when=should_stop) for _ in on_tokens]
        # Counted from the generations not yet settled (a settled one is gone before its
        # caller hears of it), not from the step loop's last published view: a client
        # that sends its next request as soon as its last one answered is not busy.
        with self._lock:
            users = collections.Counter(gen.uid for gen in self._generations)
        held = users.pop(prepared.uid, 0)
        if not within_share(total=held + sum(users.values()), held=held, others=len(users),
                            asked=len(gens),
                            capacity=self.batch.max_sequences + self.queue_max):
            raise Busy(f"the queue is full ({self.queue_max} waiting) and this user holds "
                       f"its share ({held} generations); retry shortly")
        rest = [(gen, self._choice(prepared, i), on_token)
                for i, (gen, on_token) in enumerate(zip(gens, on_tokens, strict=True)) if i]
        started = threading.Event()

        def start_rest() -> None:
            with self._lock:
                if started.is_set():
                    return
                started.set()
            for gen, choice, on_token in rest:
                if gen.cancelled.is_set():
                    self._settle(gen, results.cancelled(choice, gen))
                    continue
                try:
                    self._enqueue(gen, choice, on_token)
                except Exception as exc:  # shutting down
                    self._settle(gen, None, exc)

        shared = rest and self.blocks.retain
        if shared:
            gens[0].on_prefilled = start_rest
            gens[0].future.add_done_callback(lambda _: start_rest())
        self._enqueue(gens[0], prepared, on_tokens[0])
        if not shared:
            start_rest()
        return gens

    def _choice(self, prepared: PreparedRequest, index: int) -> PreparedRequest:
        """Choice ``index`` of ``n``: the same prompt, its own seed and matcher."""
        params = prepared.params
        seed = None if params.seed is None else (params.seed + index) % 2 ** 63
        constraint = None
        if prepared.constraint is not None:  # compiled already: a copy of the cached one
            constraint = self.grammars.start(prepared.constraint.format,
                                             self.config.engine.grammar_compile_timeout_s,
                                             prepared.uid)
        return replace(prepared, params=replace(params, seed=seed), constraint=constraint)

    def _enqueue(self, gen: Generation, prepared: PreparedRequest,
                 on_token: TokenCallback | None) -> None:
        gen.arrival = Arrival(uid=prepared.uid, should_stop=gen.should_stop,
                              encode=lambda: self._start(gen, prepared, on_token),
                              drop=lambda: self._settle(gen, results.cancelled(prepared, gen)))
        with self._lock:
            self._generations.add(gen)
        try:
            self.batch.arrive(gen.arrival)
        except BaseException:
            with self._lock:
                self._generations.discard(gen)
            raise

    def cancel(self, gen: Generation) -> None:
        """End ``gen``: waiting for a slot or a place, at the loop's next turn; running,
        at its next step (an encode under way stops between images)."""
        gen.cancelled.set()
        if gen.seq is not None:
            self.batch.cancel(gen.seq)
        elif gen.arrival is not None:
            self.batch.cancel_arrival(gen.arrival)

    def generations(self) -> list[Generation]:
        with self._lock:
            return list(self._generations)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) generations: running ones have a place in the step loop;
        the others wait (for a slot worker to encode their images, or for a place)."""
        running = self.batch.queued()[0]
        with self._lock:
            total = len(self._generations)
        # The loop's view may still hold a sequence whose generation just settled.
        running = min(running, total)
        return running, total - running

    def close(self) -> None:
        """Start nothing more: generations waiting for a slot end cancelled."""
        self.batch.close()

    def run(self, prepared: PreparedRequest, on_token: TokenCallback | None = None,
            should_stop: Callable[[], bool] = never) -> GenerateResult:
        """``submit`` and wait for the result on this thread."""
        return self.submit(prepared, on_token, should_stop).future.result()

    def generate(self, request: GenerateRequest, on_token: TokenCallback | None = None,
                 uid: int = 0, should_stop: Callable[[], bool] = never) -> GenerateResult:
        """``prepare`` then ``run``: one blocking generation, asked by ``uid``."""
        return self.run(self.prepare(request, uid), on_token, should_stop)

    def _settle(self, gen: Generation, result: GenerateResult | None,
                error: BaseException | None = None) -> None:
        with self._lock:
            self._generations.discard(gen)
        if gen.future.done():
            return
        if error is not None:
            gen.future.set_exception(error)
        else:
            assert result is not None
            gen.future.set_result(result)

    def _start(self, gen: Generation, prepared: PreparedRequest,
               on_token: TokenCallback | None) -> None:
        """On a slot worker: a session turn begun, then the runner (images encoded, the
        sequence handed to the step loop); its history started afresh when it cannot be
        rebuilt. Reports through ``gen``."""
        gen.t_start = time.perf_counter()
        gen.slot_wait_s = time.monotonic() - gen.enqueued
        request = prepared.request
        turn: Turn | None = None
        # An answer that may be tool calls streams its text up to the first call.
        held = None
        if on_token is not None and request.tools is not None and request.tools.parses:
            on_token = held = HeldText(on_token)

        def job(inputs: TurnInputs) -> RunJob:
            def done(ran: Ran | None, error: BaseException | None) -> None:
                if error is not None:
                    self._fail(gen, turn, error)
                else:
                    self._finish(gen, prepared, turn, inputs, ran, held)

            return RunJob(gen=gen, owner=self.cache_owner(prepared.uid), inputs=inputs,
                          decoding=self._decoding(prepared, inputs, on_token, gen),
                          max_tokens=prepared.max_tokens, done=done)

        try:
            turn = self.turns.begin(prepared)
            try:
                self.runner.start(job(self.turns.inputs(prepared, turn)))
            except HistoryLost:  # its history could not be rebuilt: a fresh start
                self.runner.start(job(self.turns.fresh_inputs(prepared)))
        except BaseException as exc:
            self._fail(gen, turn, exc)

    def _fail(self, gen: Generation, turn: Turn | None, error: BaseException) -> None:
        self.turns.end(turn)
        self._settle(gen, None, error)

    def _decoding(self, prepared: PreparedRequest, inputs: TurnInputs,
                  on_token: TokenCallback | None, gen: Generation) -> Decoding:
        request = prepared.request
        return Decoding(
            self.tokenizer, Sampler(prepared.params, inputs.ids, self.spec.vocab_size),
            prompt_len=len(inputs.ids), max_tokens=prepared.max_tokens,
            max_context=self.max_context,
            eos_ids=() if request.ignore_eos else self.spec.generation.eos_token_ids,
            stops=StopStrings(request.stop), on_token=on_token,
            should_stop=gen.should_stop, constraint=prepared.constraint,
            logprobs=request.logprobs, fast_forward=self.config.engine.grammar_fast_forward)

    def _finish(self, gen: Generation, prepared: PreparedRequest, turn: Turn | None,
                inputs: TurnInputs, ran: Ran | None, held: HeldText | None = None) -> None:
        """The result, and the session turn committed when the generation ended normally
        (so the history is what the client saw); an answer that is calls of the request's
        tools split into its content and its calls."""
        try:
            result = (results.cancelled(prepared, gen) if ran is None
                      else results.finished(prepared, gen, ran))
            request = prepared.request
            if turn is not None and request.session is not None:
                self.turns.commit(prepared, turn, inputs, result)
            if request.tools is not None:
                results.split_tool_calls(result, request.tools, held)
        except BaseException as exc:
            self._fail(gen, turn, exc)
            return
        self.turns.end(turn)
        self._settle(gen, result)

    def warmup(self) -> None:
        """One short generation about an image, so that every submodel has run the shapes
        requests hit (vision, merger, a prompt-sized prefill, one-token decode): the first
        inference after compile is much slower (+0.8 s of image encoding measured on the
        full-size model after a text-only warm-up).

        Each submodel repacks its weights on its first inference; the mapped file pages
        it read are dropped after the vision models and again after the language model,
        so that they never sit beside all the repacked copies (lower peak and steady RSS).
        """
        request = GenerateRequest(messages=[{"role": "user", "content": [
            {"type": "image", "image": warmup_image()}, {"type": "text", "text": "Hello"}]}],
            max_tokens=2, temperature=0.0)
        uid = os.getuid()  # the daemon's own caches
        prepared = self.prepare(request, uid)
        # A warm-up is not served work: not observed.
        observers = self.batch.on_step, self.batch.on_prefill
        self.batch.on_step = self.batch.on_prefill = None
        with self.pool.acquire() as slot:
            for image in prepared.images:
                encode_image(slot, image, self.spec.vision)
        release_file_pages(self.models.weight_files)
        try:
            self.run(prepared)
        finally:
            self.batch.on_step, self.batch.on_prefill = observers
        release_file_pages(self.models.weight_files)
        for image in prepared.images:  # nobody will ask about it again
            self.images.discard((self.cache_owner(uid), image.digest))
        self.grammars.load()  # built beside loading; ready before the daemon says so
