"""A generation's turn of its session (``sessions.SessionStore``): begun on the slot
worker, its inputs the session's history joined with the prepared ids (or the request
alone, the session started afresh, when that history cannot be rebuilt), committed when
the generation ended normally (so the history is what the client saw) with its KV
blocks pinned for the next turn, and ended whatever happened."""

from __future__ import annotations

from collections.abc import Sequence

from qvld.engine.inputs.prompt_builder import prompt_keys
from qvld.engine.inputs.sessions import SessionStore, Turn, TurnInputs, continued, kept_ids
from qvld.engine.loop.blocks import BlockPool
from qvld.engine.model.tokenizer import TextTokenizer
from qvld.engine.preparer import PreparedRequest, Preparer
from qvld.engine.types import GenerateResult, SessionInfo


class SessionTurns:
    def __init__(self, sessions: SessionStore, blocks: BlockPool, preparer: Preparer,
                 tokenizer: TextTokenizer, eos_token_ids: Sequence[int]) -> None:
        self.sessions = sessions
        self.blocks = blocks
        self.preparer = preparer
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)

    def begin(self, prepared: PreparedRequest) -> Turn | None:
        """The request's turn of its session (None without one)."""
        sid = prepared.request.session
        if sid is None:
            return None
        return self.sessions.begin(prepared.uid, sid, prepared.session,
                                   prepared.session_version)

    def inputs(self, prepared: PreparedRequest, turn: Turn | None) -> TurnInputs:
        """What the generation feeds: the prepared ids, after the session's history when
        it continues one (``fresh_inputs`` when that history cannot be rebuilt)."""
        if turn is None:
            return TurnInputs(prepared.ids, prepared.images, prepared.image_starts)
        if turn.new and prepared.session is not None:  # prepared to continue a lost one
            return self.fresh_inputs(prepared)
        return continued(turn, prepared.ids, prepared.images, prepared.image_starts,
                         prepared.history_images, prepared.pinned, prepared.session_reset)

    def fresh_inputs(self, prepared: PreparedRequest) -> TurnInputs:
        """The request alone, its session started afresh (its history is lost)."""
        ids, images, starts = self.preparer.tokenize(prepared.request, prepared.uid)
        self.preparer.check_context(0, len(ids))
        return TurnInputs(ids, images, starts, reset=prepared.request.session is not None)

    def commit(self, prepared: PreparedRequest, turn: Turn, inputs: TurnInputs,
               result: GenerateResult) -> None:
        """The turn's answer kept in the session (not a cancelled one's), the session's
        blocks pinned, and what the result says of the session."""
        request = prepared.request
        assert request.session is not None
        if result.finish_reason == "cancelled":  # the client left or timed out
            turns = 0 if turn.new else turn.session.turns
        else:
            eos = () if request.ignore_eos else self.eos_token_ids
            ids = inputs.ids + kept_ids(self.tokenizer, result.token_ids, result.text,
                                        result.finish_reason, request.stop, eos)
            turns = self.sessions.commit(turn, ids, inputs.images, inputs.starts,
                                         reset=inputs.reset)
            self._pin_history(prepared.uid, request.session, ids, inputs)
        result.session = SessionInfo(id=request.session, turns=turns, reset=inputs.reset)

    def end(self, turn: Turn | None) -> None:
        if turn is not None:
            self.sessions.end(turn)

    def _pin_history(self, uid: int, sid: str, ids: list[int], inputs: TurnInputs) -> None:
        """The session's cached history blocks are pinned, so that its next turn finds
        them whatever else ran meanwhile; the store unpins them when the session leaves
        it (the engine's ``on_removed``)."""
        if not self.blocks.retain:
            return
        if self.sessions.has(uid, sid):  # not evicted again at once
            self.blocks.pin((uid, sid), prompt_keys(ids, inputs.images, inputs.starts),
                            self.preparer.cache_owner(uid))
