"""The prepare stage: everything before inference, on the daemon's prepare threads.

A request is checked against the engine's limits and the model's defaults, its session
looked up (never created before a turn commits) and its turns checked, its prompt built
(chat template, tokens, decoded images: ``prompt_builder.PromptBuilder``) after the
session's history, and its response format's compile started
(``constraints.GrammarCompiler``, on threads of its own while the images decode). What
comes out, a ``PreparedRequest``, is what a slot worker starts from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from qvld.config import Config
from qvld.engine.decoding.constraints import Constraint, GrammarCompiler
from qvld.engine.decoding.generation import never
from qvld.engine.decoding.sampling import SamplingParams
from qvld.engine.inputs.image import PixelBudget, PreparedImage
from qvld.engine.inputs.image_cache import ImageCache
from qvld.engine.inputs.prompt_builder import PromptBuilder
from qvld.engine.inputs.request import CheckedRequest, check, image_tokens, sampling
from qvld.engine.inputs.sessions import Session, SessionStore, dropped
from qvld.engine.inputs.vision import ImageEmbedding
from qvld.engine.model.model_dir import ModelSpec
from qvld.engine.types import GenerateRequest
from qvld.errors import BadRequest, PromptTooLong, SessionLost


@dataclass
class PreparedRequest:
    """A validated request, tokenised, its images decoded: ready for a slot."""

    request: GenerateRequest
    uid: int  # who asked: sessions are per uid, and so are the caches
    params: SamplingParams
    max_tokens: int
    ids: list[int]
    images: list[PreparedImage]
    image_starts: list[int]
    prepare_s: float
    # The session these ids continue (None: no session, or a new one), as prepared.
    session: Session | None = None
    session_version: int = 0
    history_tokens: int = 0
    # The session named was lost (expired, evicted, closed by an admin): a fresh start.
    session_reset: bool = False
    # The history's images as prepared (their raw bytes stay alive with this request),
    # and the embeddings of those whose bytes the session had already let go.
    history_images: list[PreparedImage] = field(default_factory=list)
    pinned: dict[bytes, ImageEmbedding] = field(default_factory=dict)
    # The response format's matcher, its compile started when the request arrived.
    constraint: Constraint | None = None


class Preparer:
    """Prepares requests for one engine: its config, model, prompt builder, sessions,
    image cache and grammar compiler; ``rows_room``, the most rows one generation can
    hold (the context, within the KV cache)."""

    def __init__(self, config: Config, spec: ModelSpec, prompts: PromptBuilder,
                 sessions: SessionStore, images: ImageCache, grammars: GrammarCompiler, *,
                 max_context: int, context_set_by: str, rows_room: int) -> None:
        self.config = config
        self.spec = spec
        self.prompts = prompts
        self.sessions = sessions
        self.images = images
        self.grammars = grammars
        self.max_context = max_context
        self.context_set_by = context_set_by  # for the message of a prompt too long
        self.rows_room = rows_room

    def cache_owner(self, uid: int) -> int | None:
        """Whose cached KV prefixes and image embeddings a request of ``uid`` may reuse:
        its own only, unless engine.share_caches (None: everyone's)."""
        return None if self.config.engine.share_caches else uid

    def check(self, request: GenerateRequest) -> CheckedRequest:
        """``request`` against this engine's limits and the model's defaults."""
        return check(request, self.config.engine, self.spec.generation)

    def sampling_params(self, request: GenerateRequest) -> SamplingParams:
        return sampling(request, self.spec.generation)

    def image_budget(self, request: GenerateRequest) -> PixelBudget:
        return PixelBudget.for_request(self.spec.vision, image_tokens(request,
                                                                      self.config.engine))

    def tokenize(self, request: GenerateRequest, uid: int = 0,
                 should_stop: Callable[[], bool] = never
                 ) -> tuple[list[int], list[PreparedImage], list[int]]:
        """Template, tokenise, decode and patchify images; no inference yet.

        Returns the ids, the images and the row where each image starts."""
        return self.prompts.build(self.check(request), self.cache_owner(uid), should_stop)

    def prepare(self, request: GenerateRequest, uid: int = 0,
                should_stop: Callable[[], bool] = never) -> PreparedRequest:
        """Everything before inference: validate, template, tokenise, decode images.

        Raises the typed error for bad input, or ``PrepareStopped`` when ``should_stop``
        fires between images. With a session, the ids are the continuation of its history
        (joined when the generation starts).
        """
        t0 = time.perf_counter()
        checked = self.check(request)
        if any(token >= self.spec.vocab_size for token, _ in request.logit_bias):
            raise BadRequest(f"logit_bias names a token id beyond the vocabulary "
                             f"({self.spec.vocab_size} ids)")
        constraint = None
        # A response format, or the grammar of a call a request's tool_choice demands:
        # it compiles while the images decode.
        fmt = request.response_format
        if fmt is None and request.tools is not None:
            fmt = request.tools.response_format()
        if fmt is not None:
            constraint = self.grammars.start(fmt, self.config.engine.grammar_compile_timeout_s,
                                             uid)
        session: Session | None = None
        lost = False
        if request.session is not None:  # looked up, never created before a turn commits
            session, lost = self.sessions.lookup(uid, request.session)
            check_turns(request, session, lost)
        # The version first: a turn committing meanwhile is then caught by ``begin``.
        version = session.version if session is not None else 0
        history = session.ids if session is not None else []
        ids, images, starts = self.prompts.build(checked, self.cache_owner(uid), should_stop,
                                                 history)
        self.check_context(len(history), len(ids))
        history_images = list(session.images) if session is not None else []
        owner = self.cache_owner(uid)
        pinned = {image.digest: embedding for image in history_images if dropped(image)
                  and (embedding := self.images.peek((owner, image.digest))) is not None}
        if constraint is not None and constraint.failed():
            constraint.wait()  # a grammar that failed already fails before the queue
        tokens = checked.max_tokens
        if request.max_tokens is None:  # to the end of the room it has (not refused)
            tokens = max(1, min(tokens, self.rows_room - len(history) - len(ids)))
        return PreparedRequest(request=request, uid=uid, params=checked.sampling,
                               max_tokens=tokens, ids=ids,
                               images=images, image_starts=starts,
                               prepare_s=time.perf_counter() - t0,
                               session=session, session_version=version,
                               history_tokens=len(history), session_reset=lost,
                               history_images=history_images, pinned=pinned,
                               constraint=constraint)

    def check_context(self, history: int, new: int) -> None:
        if history + new + 1 > self.max_context:
            raise PromptTooLong(f"the prompt has {history + new} tokens; the context "
                                f"holds {self.max_context} (set by {self.context_set_by}) "
                                "including at least one generated token"
                                + (" (start a new session)" if history else ""))


def check_turns(request: GenerateRequest, session: Session | None, lost: bool) -> None:
    """A client that said how many turns its session holds is refused, before anything
    runs, when the daemon's holds another count (it resends the history it has)."""
    expected = request.session_turns
    held = session.turns if session is not None else 0
    if expected is None or held == expected:
        return
    if session is None:
        why = ("it ended (expired, evicted or closed)" if lost
               else "the daemon does not hold it (restarted, or never had it)")
    else:
        why = f"it holds {held}"
    raise SessionLost(f"session {request.session!r} was expected to hold {expected} "
                      f"turns; {why}")
