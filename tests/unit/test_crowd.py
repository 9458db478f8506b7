"""The crowd's lane (sidecar/crowd.py) against a thread that answers the carousel's slots as
its kernel does (tests/carousel_fakes.py): every request boarded is harvested once, with its
own answer, through the backlog when the slots are full; a wrong echo and a kernel that
stops answering are failures, not waits."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from carousel_fakes import Conductor, FakeCupy
from carousel_fakes import top_ip as _top
from kalos_retrievers.sidecar.carousel import REQUEST, TAKEN, Slots
from kalos_retrievers.sidecar.crowd import CrowdLane
from kalos_retrievers.sidecar.index import NS_ANY

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def rig() -> Iterator[Any]:
    """``rig(n_slots, data, ns=None)``: a lane over fresh slots and a Conductor answering them."""
    made: list[tuple[Slots, Conductor]] = []

    def make(n_slots: int, data: np.ndarray, ns: np.ndarray | None = None) -> tuple[CrowdLane, Conductor]:
        slots = Slots(FakeCupy(), n_slots, data.shape[1])
        cond = Conductor(slots, data, ns)
        cond.start()
        made.append((slots, cond))
        return CrowdLane(slots), cond

    yield make
    for slots, cond in made:
        cond.stop.set()
        cond.join()
        slots.close()


def test_more_requests_than_slots_wait_their_turn_and_each_is_answered_once(rig: Any) -> None:
    rng = np.random.default_rng()
    data = rng.standard_normal((97, 13)).astype(np.float32)
    lane, cond = rig(5, data)
    qs = rng.standard_normal((23, 13)).astype(np.float32)
    ks = [1 + j % 9 for j in range(23)]
    for j in range(23):
        lane.board(("token", j), qs[j], ks[j], NS_ANY)
    assert lane.in_flight == 23 and lane.boarded == 5  # the rest wait in the backlog
    got = lane.drain()
    assert lane.in_flight == 0 and lane.boarded == 23 and cond.answered == 23
    assert sorted(x.token[1] for x in got) == list(range(23))  # each once
    for x in got:
        j = x.token[1]
        want = _top(data, qs[j], ks[j])
        assert x.ok and x.n == ks[j] and x.rows.tolist() == want, j
        assert np.allclose(x.scores, data[want] @ qs[j], rtol=1e-5)
        assert x.lane_ns > 0 and x.aboard_ns == 1000  # (the stand-in kernel's word: 1000 ns aboard)
    assert lane.harvest() == []  # nothing twice


def test_a_namespace_picks_its_rows_and_fewer_rows_than_k_come_padded(rig: Any) -> None:
    rng = np.random.default_rng()
    data = rng.standard_normal((41, 7)).astype(np.float32)
    ns = np.full(41, 3, np.int32)
    ns[rng.choice(41, 5, replace=False)] = 1
    lane, _ = rig(2, data, ns)
    q = rng.standard_normal(7).astype(np.float32)
    lane.board("a", q, 9, 1)
    lane.board("b", q, 4, 3)
    got = {x.token: x for x in lane.drain()}
    assert got["a"].n == 5 and got["a"].rows[:5].tolist() == _top(data, q, 9, ns == 1)
    assert got["a"].rows[5:].tolist() == [-1] * 4 and np.isneginf(got["a"].scores[5:]).all()
    assert got["b"].rows.tolist() == _top(data, q, 4, ns == 3)


def test_a_refused_request_comes_back_not_ok(rig: Any) -> None:
    data = np.eye(8, dtype=np.float32)
    lane, _ = rig(2, data)  # (no namespace array: a request naming one is refused)
    lane.board("named", data[2], 3, 0)
    lane.board("any", data[2], 3, NS_ANY)
    got = {x.token: x for x in lane.drain()}
    assert not got["named"].ok and got["named"].n == 0 and got["named"].aboard_ns == 0  # (never aboard)
    assert got["any"].ok and got["any"].rows[0] == 2


def test_an_answer_echoing_another_request_comes_back_not_ok_and_the_rest_come_too(rig: Any) -> None:
    """The kernel and the lane disagreeing about a slot: that answer is not to be trusted (not
    ok, with why), and it takes no other answer down with it."""
    data = np.eye(6, dtype=np.float32)
    lane, cond = rig(3, data)
    lane.board("good", data[1], 2, NS_ANY)
    assert [x.ok for x in lane.drain()] == [True]
    cond.wrong_seq = True
    lane.board("x", data[1], 2, NS_ANY)
    lane.board("y", data[2], 2, NS_ANY)
    got = {x.token: x for x in lane.drain()}
    assert sorted(got) == ["x", "y"] and not got["x"].ok and "answered request" in got["x"].why
    assert lane.in_flight == 0


def test_a_drain_fails_when_the_kernel_stops_answering_and_asks_whether_it_lives(rig: Any) -> None:
    """The negative control of the drain tests above: with the conductor paused nothing comes,
    and the drain ends with an error, having asked ``alive`` while it waited."""
    data = np.eye(6, dtype=np.float32)
    lane, cond = rig(3, data)
    cond.pause.set()
    asked: list[int] = []
    lane.alive = lambda: asked.append(1)
    lane.board("x", data[1], 2, NS_ANY)
    assert lane.busy()
    with pytest.raises(TimeoutError, match="none of its 1"):
        lane.drain(timeout=0.2)
    assert asked
    lane.alive = lambda: (_ for _ in ()).throw(OSError("the kernel faulted"))
    with pytest.raises(OSError, match="faulted"):
        lane.drain(timeout=5)
    lane.alive = lambda: None
    cond.pause.clear()
    assert [x.token for x in lane.drain()] == ["x"] and not lane.busy()


def test_busy_is_a_request_the_kernel_holds(rig: Any) -> None:
    data = np.eye(6, dtype=np.float32)
    lane, cond = rig(2, data)
    assert not lane.busy()
    cond.pause.set()
    lane.board("x", data[1], 2, NS_ANY)
    assert lane.busy()  # REQUEST
    (c,) = np.flatnonzero(lane.slots.words[:, 0])
    lane.slots.words[c, 0] = TAKEN
    assert lane.busy()
    lane.slots.words[c, 0] = REQUEST
    cond.pause.clear()
    lane.drain()
    assert not lane.busy()


def test_quiesce_runs_the_backlog_through_and_keeps_the_answers_for_harvest(rig: Any) -> None:
    """The index's side of a stop: with more requests than slots, quiesce returns only when the
    kernel holds nothing and nothing waits, and the next harvest returns every answer once."""
    rng = np.random.default_rng()
    data = rng.standard_normal((31, 5)).astype(np.float32)
    lane, cond = rig(3, data)
    qs = rng.standard_normal((8, 5)).astype(np.float32)
    for j in range(8):
        lane.board(j, qs[j], 4, NS_ANY)
    lane.quiesce()
    assert not lane.busy() and cond.answered == 8 and lane.in_flight == 8  # answered, not harvested
    got = lane.harvest()
    assert sorted(x.token for x in got) == list(range(8)) and lane.in_flight == 0
    assert all(x.rows.tolist() == _top(data, qs[x.token], 4) for x in got)


def test_abandon_hands_back_every_token_not_harvested(rig: Any) -> None:
    data = np.eye(6, dtype=np.float32)
    lane, cond = rig(2, data)
    lane.board("done", data[1], 1, NS_ANY)
    lane.quiesce()  # "done" answered, kept
    cond.pause.set()
    for t in ("aboard1", "aboard2", "waiting"):
        lane.board(t, data[2], 1, NS_ANY)
    assert sorted(lane.abandon()) == ["aboard1", "aboard2", "done", "waiting"]
    assert lane.in_flight == 0 and lane.harvest() == []


def test_a_lane_is_stalled_when_the_kernel_holds_requests_and_answers_none(rig: Any) -> None:
    data = np.eye(6, dtype=np.float32)
    lane, cond = rig(2, data)
    assert not lane.stalled(0.0)  # (nothing aboard)
    cond.pause.set()
    lane.board("x", data[1], 1, NS_ANY)
    assert not lane.stalled(0.05)
    time.sleep(0.1)
    assert lane.stalled(0.05) and not lane.stalled(5.0)
    cond.pause.clear()
    lane.drain()
    assert not lane.stalled(0.0)


def test_abandon_never_frees_a_slot_the_kernel_still_holds(rig: Any) -> None:
    data = np.eye(6, dtype=np.float32)
    lane, cond = rig(3, data)
    cond.pause.set()
    lane.board("a", data[1], 1, NS_ANY)
    lane.abandon()
    for t in ("b", "c", "d"):  # two slots left: one waits in the backlog, none sent to the held slot
        lane.board(t, data[2], 1, NS_ANY)
    assert lane.boarded == 3 and lane.in_flight == 3
    cond.pause.clear()
    assert sorted(x.token for x in lane.drain()) == ["b", "c", "d"]
