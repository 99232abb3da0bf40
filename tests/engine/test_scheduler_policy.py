"""The step scheduler as a policy: fake sequences, fake step outputs, a fake clock; no
threads, no model. What the step loop does around it (feed the planned rows, sample,
end a sequence) is ``step`` below, in a few lines."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest

from qvld.engine.decoding.generation import Prompt
from qvld.engine.loop.blocks import BlockPool
from qvld.engine.loop.scheduler import MIN_SHARED_ROWS, Plan, StepCost, StepScheduler
from qvld.engine.loop.sequence import Arrival, Sequence

BLOCK = 4
ALICE, BOB, CAROL = 1, 2, 3


@dataclass
class FakeText:
    ids: list[int] = field(default_factory=list)


@dataclass
class FakeDecoding:
    """What the scheduler reads of a sequence's decoding: whether it should stop."""

    answer: int  # tokens it generates before its stop rule fires
    stop: bool = False  # the client left, or its deadline passed
    text: FakeText = field(default_factory=FakeText)
    finish: str | None = None

    def should_stop(self) -> bool:
        return self.stop


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


_tokens = itertools.count(1000)


def make_seq(pool: BlockPool, uid: int, prompt: int, *, answer: int = 4,
             max_tokens: int = 64) -> Sequence:
    """A text prompt of ``prompt`` distinct tokens, its prefix looked up as the step
    loop's caller does before submitting."""
    ids = [next(_tokens) for _ in range(prompt)]
    p = Prompt(ids=ids, positions=np.zeros((3, prompt), np.int64), rope_delta=0,
               visual_mask=np.zeros(prompt, bool), visual_embeds=np.zeros((0, 1), np.float32),
               deepstack=np.zeros((1, 0, 1), np.float32), keys=[(t, None) for t in ids])
    lease = pool.hold_prefix(p.keys, uid)
    return Sequence(prompt=p, embeds=np.zeros((prompt, 1), np.float32), lease=lease,
                    owner=uid, decoding=FakeDecoding(answer), uid=uid,  # type: ignore[arg-type]
                    max_rows=prompt + max_tokens)


def step(scheduler: StepScheduler) -> tuple[Plan, list[Sequence]]:
    """One step as the loop runs it, with fake outputs: the planned rows fed, a token
    taken where the prompt is in; a sequence ends after its ``answer`` tokens."""
    plan = scheduler.schedule()
    ended = []
    for seq, n in plan.rows:
        scheduler.advance(seq, n)
        if seq.prefilling:
            continue
        decoding = seq.decoding
        assert isinstance(decoding, FakeDecoding)
        token = next(_tokens)
        decoding.text.ids.append(token)
        if len(decoding.text.ids) >= decoding.answer:
            decoding.finish = "stop"
            scheduler.finish(seq)
            ended.append(seq)
        else:
            seq.take([token])
    return plan, ended


def running(scheduler: StepScheduler) -> list[Sequence]:
    return scheduler.snapshot()[0]


def new(blocks: int = 64, *, max_sequences: int = 8, max_batch_tokens: int = 64,
        chunk: int = 16, clock: Clock | None = None) -> StepScheduler:
    return StepScheduler(BlockPool(blocks, BLOCK), max_sequences=max_sequences,
                         max_batch_tokens=max_batch_tokens, chunk=chunk,
                         clock=clock or Clock())


def test_admission_takes_the_user_holding_fewest_then_who_got_a_place_longest_ago() -> None:
    clock = Clock()
    s = new(max_sequences=1, clock=clock)
    a1, a2, a3 = (make_seq(s.pool, ALICE, 4, answer=2) for _ in range(3))
    b1 = make_seq(s.pool, BOB, 4, answer=2)
    for seq in (a1, a2, a3, b1):  # bob's arrives last
        s.add(seq)
    order = []
    while not s.idle:
        clock.now += 1
        plan, _ = step(s)
        order += plan.admitted
    # Alice first (she came first), then bob (fewer places had, longer ago), then alice.
    assert order == [a1, b1, a2, a3]
    assert [seq.admitted for seq in order] == sorted(seq.admitted for seq in order)
    assert a1.admitted == 101.0  # the scheduler's clock, not the wall's
    assert s.pool.stats()["held"] == 0


def test_nothing_overtakes_a_sequence_that_does_not_fit_yet() -> None:
    s = new(blocks=10, max_sequences=4)
    big_holder = make_seq(s.pool, ALICE, 20, answer=50)  # 6 blocks with its first token
    s.add(big_holder)
    step(s)
    large = make_seq(s.pool, BOB, 16, answer=1)  # 5 blocks: does not fit beside it
    small = make_seq(s.pool, BOB, 2, answer=1)  # would fit, but comes after
    s.add(large)
    s.add(small)
    plan, _ = step(s)
    assert plan.admitted == [] and s.counts() == (1, 2)
    big_holder.decoding.stop = True  # type: ignore[attr-defined]
    plan, _ = step(s)
    assert plan.stopped == [big_holder]
    assert plan.admitted == [large, small]


def test_a_waiting_user_preempts_the_one_holding_every_place() -> None:
    s = new(max_sequences=2)
    alices = [make_seq(s.pool, ALICE, 6, answer=100) for _ in range(2)]
    for seq in alices:
        s.add(seq)
    for _ in range(3):
        step(s)
    assert running(s) == alices
    held_before = s.pool.stats()["held"]
    bob = make_seq(s.pool, BOB, 6, answer=100)
    s.add(bob)
    plan, _ = step(s)
    # Her latest admitted gives way; bob runs beside her first.
    assert plan.preempted == [alices[1]] and plan.admitted == [bob]
    assert running(s) == [alices[0], bob]
    victim = alices[1]
    assert victim.preemptions == 1 and victim.fed == victim.cached == 0
    assert victim.token is None and len(victim.keys) == 6 + 3  # its tokens to recompute
    assert victim.lease.blocks == []  # nothing shared to keep: every block given back
    assert s.pool.stats()["held"] <= held_before + 1  # bob's, and alice's next block
    # Shares are level now: a user holding one place never takes another's.
    for _ in range(5):
        plan, _ = step(s)
        assert not plan.preempted and running(s) == [alices[0], bob]


def test_a_lone_user_keeps_every_place_and_equals_do_not_trade() -> None:
    s = new(max_sequences=2)
    a = [make_seq(s.pool, ALICE, 4, answer=100) for _ in range(3)]
    for seq in a:
        s.add(seq)
    plan, _ = step(s)
    assert plan.admitted == a[:2] and s.counts() == (2, 1)  # her own third waits
    b = [make_seq(s.pool, BOB, 4, answer=100) for _ in range(2)]
    for seq in b:
        s.add(seq)
    plan, _ = step(s)
    assert plan.preempted == [a[1]] and plan.admitted == [b[0]]
    for _ in range(4):
        plan, _ = step(s)
        assert not plan.preempted and not plan.admitted  # one each: nobody trades
    assert s.preemptions == 1


def test_blocks_are_taken_as_sequences_grow_not_for_max_tokens() -> None:
    """A pool for two worst-case requests (prompt + max_tokens 4000) runs eight at once
    when their answers are short."""
    worst = 8 + 4000
    s = new(blocks=2 * -(-worst // BLOCK), max_sequences=8)
    seqs = [make_seq(s.pool, uid, 8, answer=3, max_tokens=4000) for uid in range(8)]
    for seq in seqs:
        assert s.fits(seq)
        s.add(seq)
    plan, _ = step(s)
    assert plan.admitted == seqs  # all eight at once
    # Each holds its prompt and first token's blocks only.
    assert s.pool.stats()["held"] == 8 * 3
    ends = []
    while not s.idle:
        plan, ended = step(s)
        assert len(plan.rows) == 8 - len(ends)  # nobody waited for a place
        ends += ended
    assert sorted(id(x) for x in ends) == sorted(id(x) for x in seqs)
    assert s.peak_sequences == 8 and s.preemptions == 0
    assert s.pool.stats()["held"] == 0


def test_a_request_larger_than_the_whole_cache_is_refused_up_front() -> None:
    s = new(blocks=8)
    assert s.fits(make_seq(s.pool, ALICE, 8, max_tokens=24))  # 32 rows: 8 blocks
    assert not s.fits(make_seq(s.pool, ALICE, 8, max_tokens=25))


def test_a_sequence_that_outgrows_the_pool_preempts_the_latest_of_whoever_holds_most(
        ) -> None:
    """Bob's sequence needs a block and none is free: alice, holding two, gives up her
    latest, not bob his only one."""
    s = new(blocks=9, max_sequences=3)
    a1, a2, b = (make_seq(s.pool, uid, 7, answer=20, max_tokens=20)
                 for uid in (ALICE, ALICE, BOB))
    for seq in (a1, a2, b):
        s.add(seq)
    plan, _ = step(s)
    assert plan.admitted == [a1, b, a2]  # two blocks each: their prompts and next tokens
    preempted: list[Sequence] = []
    while not preempted:
        plan, _ = step(s)
        preempted += plan.preempted
    assert preempted == [a2] and a2.lease.blocks == []
    while not s.idle:
        step(s)
        for seq in running(s):  # every row fed has its block
            assert len(seq.lease.blocks) * BLOCK >= seq.fed
    for seq in (a1, a2, b):
        assert len(seq.decoding.text.ids) == 20  # type: ignore[attr-defined]
    assert b.preemptions == 0 and s.pool.stats()["held"] == 0  # alice gave way each time


def test_a_lone_sequence_that_outgrows_the_pool_gives_way_to_itself_and_resumes() -> None:
    """Two of alice's grow in a pool that holds one at full length: the later one gives
    way (its own user holds the most), recomputes its rows when the first ends, and its
    rows then continue exactly where they were."""
    s = new(blocks=6, max_sequences=2)
    first = make_seq(s.pool, ALICE, 3, answer=18, max_tokens=21)  # 6 blocks at most
    second = make_seq(s.pool, ALICE, 3, answer=18, max_tokens=21)
    s.add(first)
    s.add(second)
    generated: dict[int, list[int]] = {id(first): [], id(second): []}
    fed_tokens_at_preemption: list[int] = []
    while not s.idle:
        plan, _ = step(s)
        for seq in plan.preempted:
            fed_tokens_at_preemption.append(len(seq.keys))
        for seq in (first, second):
            generated[id(seq)] = list(seq.decoding.text.ids)  # type: ignore[attr-defined]
    assert second.preemptions >= 1 and first.preemptions == 0
    assert len(generated[id(first)]) == 18 and len(generated[id(second)]) == 18
    # Its keys are its prompt and every generated token but the last, each once.
    assert [t for t, _ in second.keys] == second.prompt.ids + generated[id(second)][:-1]


def test_rows_decoders_first_then_generated_rows_then_prompt_chunks_within_budget() -> None:
    s = new(max_batch_tokens=10, chunk=6)
    decoder = make_seq(s.pool, ALICE, 2, answer=100)
    s.add(decoder)
    step(s)  # its prompt in; it decodes now
    p1 = make_seq(s.pool, BOB, 12, answer=100)
    p2 = make_seq(s.pool, CAROL, 12, answer=100)
    s.add(p1)
    s.add(p2)
    plan, _ = step(s)
    assert [(seq, n) for seq, n in plan.rows] == [(decoder, 1), (p1, 6), (p2, 3)]
    plan, _ = step(s)
    assert plan.rows == [(decoder, 1), (p1, 6), (p2, 3)]
    plan, _ = step(s)
    assert plan.rows == [(decoder, 1), (p1, 1), (p2, 6)]  # p1 decodes; p2's last chunk
    assert p2.fed == 12


@pytest.mark.parametrize("state", ["waiting", "running", "prefilling", "preempted"])
def test_a_cancelled_sequence_leaves_in_every_state_with_its_blocks(state: str) -> None:
    s = new(blocks=32, max_sequences=1 if state == "waiting" else 2, chunk=4)
    other = make_seq(s.pool, BOB, 4, answer=100)
    seq = make_seq(s.pool, ALICE, 12, answer=100)
    if state == "waiting":  # behind bob's, who holds the one place
        s.add(other)
        step(s)
        s.add(seq)
    elif state == "preempted":  # alice held both places; bob took her latest
        s.add(make_seq(s.pool, ALICE, 4, answer=100))
        s.add(seq)
        for _ in range(4):
            step(s)
        s.add(other)
        plan, _ = step(s)
        assert plan.preempted == [seq]
    else:
        s.add(seq)
        step(s)  # admitted, one chunk of four fed
        if state == "running":
            for _ in range(3):
                step(s)
            assert not seq.prefilling and seq.token is not None
        else:
            assert seq.prefilling
    if state in ("waiting", "preempted"):
        assert s.counts()[1] == 1
        assert s.remove_waiting(seq)  # the loop's cancel: out at once
        assert not s.remove_waiting(seq)
    else:
        seq.decoding.stop = True  # type: ignore[attr-defined]
        plan, _ = step(s)
        assert plan.stopped == [seq] and all(x is not seq for x, _ in plan.rows)
    assert seq not in running(s) and seq not in s.snapshot()[1]
    assert seq.lease.blocks == []
    s.take_all()
    assert s.pool.stats()["held"] == 0


def test_step_cost_learns_a_decoding_step_and_a_row_from_the_steps_run() -> None:
    cost = StepCost()
    assert cost.rows_within(2.0) is None  # nothing seen yet: nothing bounded
    cost.observe(1, 0, 0.010)  # a decoding step: 10 ms
    assert cost.rows_within(2.0) is None  # no row's cost seen yet
    cost.observe(0, 8, 0.050)  # too few rows to tell a row's cost
    assert cost.rows_within(2.0) is None
    cost.observe(1, 200, 0.110)  # 100 ms beyond the decoding step: 0.5 ms a row
    assert cost.row_s == pytest.approx(0.0005)
    assert cost.rows_within(2.0) == 20  # 10 ms more: one more decoding step
    assert cost.rows_within(1.5) == MIN_SHARED_ROWS  # 10 rows: never below the floor



def test_a_step_that_waited_for_the_cpu_does_not_move_what_a_step_costs() -> None:
    """On a loaded machine a decoding step now and then takes ten times its cost (the
    scheduler test saw a bound past 511 rows beside a decoding token once): the costs
    are medians of the latest steps, so one such step changes neither."""
    cost = StepCost()
    for _ in range(8):
        cost.observe(1, 0, 0.010)
    cost.observe(1, 200, 0.110)
    assert cost.rows_within(2.0) == 20
    cost.observe(1, 0, 0.500)  # preempted: fifty times a decoding step
    cost.observe(1, 300, 0.160)  # a row step that ran as usual
    assert cost.decode_s == pytest.approx(0.010)
    assert cost.row_s == pytest.approx(0.0005)
    assert cost.rows_within(2.0) == 20
    # A lasting change is followed: once most of the latest steps cost 20 ms, so does one.
    for _ in range(StepCost.WINDOW // 2 + 1):
        cost.observe(1, 0, 0.020)
    assert cost.decode_s == pytest.approx(0.020)


def decoding_beside(s: StepScheduler, prompt: int) -> tuple[Sequence, Sequence]:
    """Alice decoding; then bob's prompt of ``prompt`` rows admitted beside her."""
    alice = make_seq(s.pool, ALICE, 2, answer=1000)
    s.add(alice)
    step(s)
    bob = make_seq(s.pool, BOB, prompt, answer=2)
    s.add(bob)
    return alice, bob


def test_another_users_prompt_rows_beside_a_decoding_user_take_one_share_of_the_step(
        ) -> None:
    """#46 item 8: one user's long prompts fed 512 rows into every step another user's
    token was in (11.5x slower answers); now they add what costs one decoding step."""
    s = new(blocks=512, max_batch_tokens=512, chunk=512)
    s.cost.decode_s, s.cost.row_s = 0.010, 0.0005  # 20 rows cost one decoding step
    alice, bob = decoding_beside(s, 300)
    fed = []
    while bob.prefilling:
        plan, _ = step(s)
        assert plan.rows[0] == (alice, 1)  # her token in every step
        fed.append(dict(plan.rows).get(bob, 0))
    assert fed == [20] * 15  # in, all of it, a share at a time
    # Alone he is not bounded: his next prompt goes in whole chunks.
    alice.decoding.stop = True  # type: ignore[attr-defined]
    step(s)
    carol_free = make_seq(s.pool, BOB, 300, answer=2)
    s.add(carol_free)
    plan, _ = step(s)
    assert dict(plan.rows)[carol_free] == 300


def test_the_prompt_share_is_one_users_whatever_the_number_of_users_decoding() -> None:
    s = new(blocks=512, max_batch_tokens=512, chunk=512)
    s.cost.decode_s, s.cost.row_s = 0.010, 0.0005
    _, bob = decoding_beside(s, 300)
    carol = make_seq(s.pool, CAROL, 2, answer=1000)
    s.add(carol)
    plan, _ = step(s)
    assert dict(plan.rows)[bob] == 20  # the share is all his: carol's turn is next
    plan, _ = step(s)
    assert dict(plan.rows)[carol] == 2 and dict(plan.rows)[bob] == 18  # shared
    plan, _ = step(s)  # two users decode: 1 + 1/2 decoding steps, 10 rows; the floor
    assert dict(plan.rows)[bob] == MIN_SHARED_ROWS


def test_a_lone_users_prompt_beside_its_own_answer_is_not_bounded() -> None:
    s = new(blocks=512, max_batch_tokens=512, chunk=512)
    s.cost.decode_s, s.cost.row_s = 0.010, 0.0005
    alice = make_seq(s.pool, ALICE, 2, answer=1000)
    s.add(alice)
    step(s)
    more = make_seq(s.pool, ALICE, 300, answer=2)
    s.add(more)
    plan, _ = step(s)
    assert plan.rows == [(alice, 1), (more, 300)]


def test_prompt_rows_go_first_to_the_user_who_got_them_least_recently() -> None:
    """Bob's long prompts no longer hold carol's short one back for several steps."""
    s = new(blocks=512, max_batch_tokens=8, chunk=8)
    bob1, bob2 = make_seq(s.pool, BOB, 40), make_seq(s.pool, BOB, 40)
    s.add(bob1)
    s.add(bob2)
    plan, _ = step(s)
    assert plan.rows == [(bob1, 8)]
    carol = make_seq(s.pool, CAROL, 4)
    s.add(carol)
    plan, _ = step(s)
    assert plan.rows == [(carol, 4), (bob1, 4)]  # carol's turn first, bob's after


def test_a_sequence_running_on_another_thread_is_stopped_once_it_is_back() -> None:
    """A prompt prefilled by another runtime, or a token chosen on the matcher lane
    (``outside``): its client leaving must not hand its blocks to someone else while
    that thread may still write them, nor end it while its decoding still chooses."""
    s = new()
    seq = make_seq(s.pool, ALICE, 4, answer=100)
    s.add(seq)
    step(s)
    seq.outside = True
    seq.decoding.stop = True  # type: ignore[attr-defined]
    plan, _ = step(s)
    assert plan.stopped == [] and seq in running(s) and seq.lease.blocks
    seq.outside = False  # back (the loop's ``joined`` or ``_chosen``)
    plan, _ = step(s)
    assert plan.stopped == [seq] and seq.lease.blocks == []


# -- encoding: the slots are the scheduler's to give -------------------------------------

def arrival(uid: int, stopped: list[bool] | None = None) -> Arrival:
    flag = stopped if stopped is not None else [False]
    return Arrival(uid=uid, should_stop=lambda: flag[0], encode=lambda: None,
                   drop=lambda: None)


def test_a_free_slot_goes_to_the_user_holding_the_fewest_generations() -> None:
    # Alice's burst of five pictures arrived first; bob's one after. Two slots: alice
    # takes both while nobody else has one, then bob's goes next, ahead of her three.
    scheduler = StepScheduler(BlockPool(64, BLOCK), max_sequences=8, max_batch_tokens=64,
                              chunk=16, encode_slots=2)
    alices = [arrival(ALICE) for _ in range(5)]
    for a in alices:
        scheduler.arrive(a)
    started, _ = scheduler.encodes()
    assert started == alices[:2]
    bob = arrival(BOB)
    scheduler.arrive(bob)
    assert scheduler.encodes() == ([], [])  # no slot is free
    scheduler.encoded(alices[0])
    assert scheduler.encodes()[0] == [bob]
    assert scheduler.arrivals() == (3, 2)
    scheduler.encoded(alices[1])
    scheduler.encoded(bob)
    assert scheduler.encodes()[0] == alices[2:4]  # only alice left: in arrival order


def test_running_and_waiting_sequences_count_toward_a_users_holding() -> None:
    # Carol already runs a generation; alice and bob hold none: theirs are encoded
    # first, though carol's arrived before them.
    pool = BlockPool(64, BLOCK)
    scheduler = StepScheduler(pool, max_sequences=8, max_batch_tokens=64, chunk=16,
                              encode_slots=1)
    scheduler.add(make_seq(pool, CAROL, 8))
    step(scheduler)
    order = [arrival(CAROL), arrival(ALICE), arrival(BOB)]
    for a in order:
        scheduler.arrive(a)
    started = []
    for _ in order:
        (one,), _ = scheduler.encodes()
        started.append(one.uid)
        scheduler.encoded(one)
    assert started == [ALICE, BOB, CAROL]


def test_an_arrival_that_stopped_is_dropped_not_encoded() -> None:
    scheduler = StepScheduler(BlockPool(64, BLOCK), max_sequences=8, max_batch_tokens=64,
                              chunk=16, encode_slots=1)
    gone = [False]
    left, stays = arrival(ALICE, gone), arrival(BOB)
    scheduler.arrive(left)
    scheduler.arrive(stays)
    gone[0] = True  # alice's client left while she waited for a slot
    started, stopped = scheduler.encodes()
    assert (started, stopped) == ([stays], [left])
    assert not scheduler.remove_arrival(stays)  # started: no longer waiting
    later = arrival(CAROL)
    scheduler.arrive(later)
    assert scheduler.remove_arrival(later) and scheduler.idle
