"""The carousel's host side (sidecar/carousel.py), on the CPU: its copies of what
``carousel_topk`` in kernels/recall.cu defines, its launch against the kernel's parameter list,
its slots, and the clients' driver against a thread that answers as the kernel's conductor
does. What the kernel computes is for the GPU tests (tests/gpu/test_carousel.py)."""

from __future__ import annotations

import itertools
import re
import time
from typing import Any

import numpy as np
import pytest
from carousel_fakes import CarouselKernel, Conductor, FakeCupy, param_names, patch_kernels
from kalos_retrievers.sidecar import carousel, cuda_kernels
from kalos_retrievers.sidecar.carousel import DONE, ERROR, REQUEST, TAKEN, Carousel, Slots, drive
from kalos_retrievers.sidecar.index import NS_ANY
from kernel_fakes import SOURCE, dev

pytestmark = pytest.mark.timeout(60)


def _define(name: str) -> int:
    m = re.search(rf"^#define {name} \(?(-?\d+)u?\)?", SOURCE, re.M)
    assert m is not None, f"#define {name} not found in recall.cu"
    return int(m.group(1))


def test_the_host_constants_are_the_kernels() -> None:
    assert [_define(f"CAR_{n}") for n in ("IDLE", "REQUEST", "TAKEN", "DONE", "ERROR")] == [
        carousel.IDLE, REQUEST, TAKEN, DONE, ERROR]  # fmt: skip
    assert _define("CAR_KMAX") == carousel.KMAX
    assert _define("CAR_HEAD_BYTES") == carousel.HEAD
    assert _define("CAR_PINFO") == carousel.PINFO
    assert _define("KALOS_BLOCK") == cuda_kernels.BLOCK
    assert re.search(r"#define CAR_CAP \(2 \* CAR_STEP_ROWS \+ CAR_KMAX\)", SOURCE)
    assert re.search(r"#define CAR_STEP_ROWS \(KALOS_BLOCK / 32 \* 32\)", SOURCE)
    assert carousel._CAP == 2 * (cuda_kernels.BLOCK // 32 * 32) + carousel.KMAX
    # the instantiation the host launches is the one CI compiles, and it has POSITIONS positions
    assert re.search(rf"CAROUSEL\({carousel.NT}, 0\)", SOURCE) and 8 * carousel.NT == carousel.POSITIONS
    # the slot words the kernel reads and writes
    body = SOURCE[SOURCE.index("__device__ u64 car_merge(") :]  # (the merge, the answer's write, then the kernel)
    assert "hload(w + 1, mode)" in body and "w + 2" in body and "hstore(w + 4, nres" in body
    assert "hstore(w + 6," in body and 'st.release.sys.global.u32 [%0], %1;" ::"l"(w), "r"(CAR_DONE)' in body
    assert (carousel.W_K, carousel.W_NS, carousel.W_RESULTS, carousel.W_RESP_SEQ, carousel.W_NS_ABOARD) == (
        1,
        2,
        4,
        5,
        6,
    )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeCupy, list]:
    cp, log, _ = patch_kernels(monkeypatch)
    return cp, log


@pytest.mark.parametrize("metric", [0, 1, 2])
def test_the_launch_matches_the_kernels_parameters(fake: tuple[FakeCupy, list], metric: int) -> None:
    cp, log = fake
    dim, rows = 97, 1001
    data = dev(np.zeros((rows, 104), np.float16))
    sq = dev(np.zeros(rows, np.float32)) if metric == 2 else None
    slots = Slots(cp, 7, dim)
    car = Carousel(cp, data, dim, metric, slots, sqnorm=sq)
    car.start()
    with pytest.raises(RuntimeError, match="running already"):
        car.start()
    (_, args), = log  # fmt: skip
    got = dict(zip(param_names("carousel_topk"), args, strict=True))
    assert got["ld"] == 104 and got["lds"] == 160 and got["nrows"] == rows and got["dim"] == dim
    assert got["slot0"] == slots.addr and got["slot_bytes"] == slots.slot_bytes and got["n_slots"] == 7
    assert got["rows_off"] == slots.rows_off and got["scores_off"] == slots.scores_off
    assert got["hctl"] == car._haddr and car._haddr in cp.registered and slots.addr in cp.registered
    assert got["data"] is data and (got["sqnorm"] is sq if metric == 2 else got["sqnorm"] == 0) and got["ns"] == 0
    # every block resident (2 per SM on the H200 at 114 registers); the dynamic shared memory
    # holds the positions' queries, and the conductor's staging of a query for each warp
    assert car.grid == 264 and car.scanners == 263
    assert car.smem == carousel.POSITIONS * 160 * 2 >= cuda_kernels.BLOCK // 32 * 4 * dim
    assert len(car.lists) == car.scanners * carousel.POSITIONS * carousel._CAP
    assert len(car.res) == carousel.POSITIONS * car.scanners * carousel.KMAX
    assert len(car.pinfo) == carousel.POSITIONS * carousel.PINFO and len(car.dctl) == 2 + 2 * carousel.POSITIONS
    car.close()
    slots.close()
    assert cp.registered == {}


def test_a_launch_with_a_block_not_resident_fails(fake: tuple[FakeCupy, list], monkeypatch: pytest.MonkeyPatch) -> None:
    """One scanning block short (it waits for room behind blocks that never end): start()
    stops the kernel and says so; the control is the test above, where all of them start."""
    cp, _ = fake
    monkeypatch.setattr(CarouselKernel, "started", 262)
    slots = Slots(cp, 2, 8)
    car = Carousel(cp, dev(np.zeros((100, 8), np.float16)), 8, 1, slots)
    with pytest.raises(RuntimeError, match="only 262 of the carousel's 263 scanning blocks started"):
        car.start(timeout=0.05)
    assert car.hctl[0] == 1 and not car.running  # told to stop
    car.close()
    slots.close()
    # a capped grid (tests' long turns) and its floor
    car = Carousel(cp, dev(np.zeros((100, 8), np.float16)), 8, 1, Slots(cp, 2, 8), max_blocks=9)
    assert car.grid == 9 and car.scanners == 8
    with pytest.raises(ValueError, match="a grid of 1"):
        Carousel(cp, dev(np.zeros((100, 8), np.float16)), 8, 1, Slots(cp, 2, 8), max_blocks=1)


def test_the_launch_refuses_what_the_kernel_cannot_take(fake: tuple[FakeCupy, list]) -> None:
    cp, _ = fake
    slots = Slots(cp, 3, 16)
    with pytest.raises(ValueError, match="float16"):
        Carousel(cp, dev(np.zeros((5, 16), np.float32)), 16, 0, slots)
    with pytest.raises(ValueError, match="multiple of 8"):
        Carousel(cp, dev(np.zeros((5, 20), np.float16)), 16, 0, slots)
    with pytest.raises(ValueError, match="sqnorm"):
        Carousel(cp, dev(np.zeros((5, 16), np.float16)), 16, 2, slots)
    with pytest.raises(ValueError, match="16-d queries, not 8"):
        Carousel(cp, dev(np.zeros((5, 8), np.float16)), 8, 0, slots)
    with pytest.raises(ValueError, match="slots"):
        Slots(cp, carousel.MAX_SLOTS + 1, 16)
    slots.close()


def test_slots_are_laid_out_as_the_kernel_reads_them(fake: tuple[FakeCupy, list]) -> None:
    cp, _ = fake
    for dim in (1, 3, 97, 768):
        s = Slots(cp, 5, dim)
        assert s.slot_bytes % 128 == 0 and s.rows_off % 16 == 0 and s.scores_off == s.rows_off + 4 * carousel.KMAX
        assert s.rows_off >= carousel.HEAD + 4 * dim and s.scores_off + 4 * carousel.KMAX <= s.slot_bytes
        q = np.arange(dim, dtype=np.float32) + 0.5
        s.send(3, q, 7, ns=-2, seq=(1 << 32) + 9)
        raw = s.buf[3 * s.slot_bytes : 4 * s.slot_bytes]
        words = raw[:32].view(np.uint32)
        assert list(words[:4]) == [REQUEST, 7, np.uint32(0xFFFFFFFE), 9]
        np.testing.assert_array_equal(raw[carousel.HEAD : carousel.HEAD + 4 * dim].view(np.float32), q)
        assert (raw[s.rows_off : s.rows_off + 4 * carousel.KMAX].view(np.int32) == -7).all()  # poisoned
        assert np.isnan(raw[s.scores_off : s.scores_off + 4 * carousel.KMAX].view(np.float32)).all()
        with pytest.raises(RuntimeError, match="in flight"):
            s.send(3, q, 7)
        s.words[3, 0] = TAKEN
        with pytest.raises(RuntimeError, match="in flight"):
            s.send(3, q, 7)
        s.close()


@pytest.fixture
def rig(fake: tuple[FakeCupy, list]) -> Any:
    """``rig(n_slots, data)``: slots and a Conductor answering them from ``data``, stopped and
    released after the test."""
    made: list[tuple[Slots, Conductor]] = []

    def make(n_slots: int, data: np.ndarray) -> tuple[Slots, Conductor]:
        slots = Slots(fake[0], n_slots, data.shape[1])
        cond = Conductor(slots, data)
        cond.start()
        made.append((slots, cond))
        return slots, cond

    yield make
    for slots, cond in made:
        cond.stop.set()
        cond.join()
        slots.close()


def test_drive_sends_every_request_and_collects_every_answer(rig: Any) -> None:
    rng = np.random.default_rng(1)
    data = rng.standard_normal((53, 11)).astype(np.float32)
    qs = rng.standard_normal((41, 11)).astype(np.float32)
    slots, _ = rig(6, data)
    ks = [1 + j % 9 for j in range(40)] + [0]  # the last one refused
    answers = drive(slots, lambda j: (qs[j], ks[j], NS_ANY) if j < len(ks) else None, clients=4, return_ns=200_000)
    assert sorted(a.j for a in answers) == list(range(41))
    for a in answers:
        if a.j == 40:
            assert a.state == ERROR and a.n == 0
            continue
        want = np.argsort(-(data @ qs[a.j]), kind="stable")[: ks[a.j]]
        assert a.state == DONE and a.n == ks[a.j] and list(a.rows) == list(want), a.j
        assert a.seen_ns >= a.sent_ns and a.aboard_ns == 1000
    # four clients, each sending its next request 200 µs after it saw its last answer
    assert sorted({a.slot for a in answers}) == [0, 1, 2, 3]
    for slot in range(4):
        mine = sorted((a for a in answers if a.slot == slot), key=lambda a: a.sent_ns)
        assert all(b.sent_ns - a.seen_ns >= 200_000 for a, b in itertools.pairwise(mine))
    assert len(slots.words[slots.words[:, 0] == REQUEST]) == 0


def test_drive_fails_a_request_that_has_no_answer_in_time(rig: Any) -> None:
    """A kernel that stops answering fails the drive (and the negative control: the same drive
    with the conductor answering succeeds)."""
    data = np.eye(8, dtype=np.float32)
    slots, cond = rig(2, data)
    ok = drive(slots, lambda j: (data[j % 8], 1, NS_ANY) if j < 10 else None, timeout=2)
    assert len(ok) == 10 and all(int(a.rows[0]) == a.j % 8 for a in ok)
    cond.pause.set()
    with pytest.raises(TimeoutError, match=r"no answer within 0\.2 s"):
        drive(slots, lambda j: (data[0], 1, NS_ANY) if j < 3 else None, timeout=0.2)
    # an answer that echoes another request's seq is not taken for this one's
    slots.words[:, 0] = 0
    cond.wrong_seq = True
    cond.pause.clear()
    with pytest.raises(RuntimeError, match="an answer for request"):
        drive(slots, lambda j: (data[0], 1, NS_ANY) if j < 3 else None, timeout=2)


def test_drive_stops_sending_at_its_deadline_and_waits_for_what_is_aboard(rig: Any) -> None:
    data = np.eye(4, dtype=np.float32)
    slots, _ = rig(3, data)
    t0 = time.perf_counter()
    answers = drive(slots, lambda j: (data[j % 4], 2, NS_ANY), until=t0 + 0.2)
    assert answers and time.perf_counter() - t0 < 5
    assert sorted(a.j for a in answers) == list(range(len(answers)))  # none lost
    with pytest.raises(ValueError, match="clients"):
        drive(slots, lambda j: None, clients=4)
