"""The sidecar's side of the carousel's direct slots (sidecar/direct.py, protocol v1.4): the
epoch's phases, the words a launch fixes, the thinning rule's count and the sweep, on a plain
array of slot words. GpuIndex's use of it is tests/unit/test_index_gpu_carousel.py's; the
clients' side, tests/integration/test_carousel_direct.py's."""

from __future__ import annotations

import numpy as np
import pytest
from kalos_retrievers.sidecar.carousel import DONE, ERROR, IDLE, REQUEST, TAKEN
from kalos_retrievers.sidecar.direct import DirectSlots

from kalos_retrievers.protocol import W_ELIGIBLE, W_NS, W_SEQ, W_STATE

SLOTS, N = 11, 7


def rig() -> tuple[DirectSlots, np.ndarray, list[tuple[int, int]]]:
    words = np.zeros((SLOTS, 16), np.uint32)
    published: list[tuple[int, int]] = []
    return DirectSlots(words, N, lambda e, n: published.append((e, n))), words, published


def test_the_epoch_is_odd_from_a_launch_to_a_stops_beginning_and_each_phase_is_set_from_e() -> None:
    d, _, published = rig()
    assert [d.publish(p) for p in (1, 2, 3)] == [1, 2, 4]
    assert [d.publish(p) for p in (1, 2, 2, 3)] == [5, 6, 6, 8]  # a stop tried twice: still even
    assert [d.publish(p) for p in (1, 2, 3, 3)] == [9, 10, 12, 12]
    assert published == [(e, N) for e in (1, 2, 4, 5, 6, 6, 8, 9, 10, 12, 12)]
    assert d.epoch == 12


def test_a_launch_after_a_stop_that_never_ended_still_moves_to_the_next_odd_epoch() -> None:
    """The stop's end (E + 3) never published (it raised): the next launch still comes after
    every epoch a client may have seen, and odd."""
    d, _, _ = rig()
    d.publish(1)
    d.publish(2)
    assert d.publish(1) == 3
    d.publish(1)  # (a launch published twice: from an odd epoch, the next odd one)
    assert d.epoch == 5


def test_a_phase_outside_one_to_three_and_a_bad_slot_count_are_refused() -> None:
    d, _, _ = rig()
    with pytest.raises(ValueError, match="phase"):
        d.publish(4)
    for n in (0, SLOTS + 1):
        with pytest.raises(ValueError, match="direct slots"):
            DirectSlots(np.zeros((SLOTS, 16), np.uint32), n, None)


def test_a_launch_writes_the_namespace_and_its_rows_into_the_direct_slots_only() -> None:
    d, words, _ = rig()
    d.launch(-3, 157)  # (a namespace id as the kernel reads it: int32)
    assert words[:N, W_NS].view(np.int32).tolist() == [-3] * N and words[:N, W_ELIGIBLE].tolist() == [157] * N
    assert not words[N:].any()


def test_active_counts_every_slot_at_the_first_look_then_the_ones_that_moved() -> None:
    d, words, _ = rig()
    d.launch(0, 10)
    assert d.active() == N  # the first look after a launch
    assert d.active() == 0
    words[1, W_SEQ] += 1  # a request sent and answered since
    words[2, W_STATE] = REQUEST
    words[3, W_STATE] = TAKEN
    words[4, W_STATE] = DONE
    words[N + 1, W_SEQ] += 1  # (the lane's slot: not counted)
    assert d.active() == 3
    words[2, W_STATE] = words[3, W_STATE] = DONE
    assert d.active() == 0
    d.launch(0, 10)
    assert d.active() == N


def test_the_sweep_turns_requests_no_kernel_will_answer_back_to_idle() -> None:
    d, words, _ = rig()
    words[:, W_STATE] = [REQUEST, TAKEN, DONE, ERROR, IDLE, REQUEST, TAKEN, REQUEST, TAKEN, DONE, REQUEST]
    assert d.sweep() == 4
    assert words[:, W_STATE].tolist() == [IDLE, IDLE, DONE, ERROR, IDLE, IDLE, IDLE, REQUEST, TAKEN, DONE, REQUEST]
    assert d.sweep() == 0
