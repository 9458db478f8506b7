"""The sidecar's side of a selective filter's list of rows (session 52) without a GPU:
``GpuIndex.launch_slots`` hands the search a list of the filter's rows (int32, the namespace id
NS_LIST, the list's length as the row count) where the filter keeps at most 1/FILTER_LIST of the
rows, a mask otherwise; a kept answer's device array is reused only as what it was made as;
``_run`` never takes a list to the GEMM paths; ``_graph`` captures ``scan_list`` for a list,
its launch checked against the kernel's parameter list in kernels/recall.cu (tests/kernel_fakes.py).
What the kernels compute with a list is for tests/gpu/test_gpu_index.py."""

from __future__ import annotations

import mmap
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from kalos_retrievers.sidecar import index_gpu
from kalos_retrievers.sidecar.index import SlotSpec
from kalos_retrievers.sidecar.index_gpu import NS_LIST, GpuIndex
from kernel_fakes import DevArray, FakeKernel, NullStream
from kernel_fakes import dev as _dev

pytestmark = pytest.mark.timeout(60)

HIGH = 1000  # rows below the high-water mark


def _spec(n: int = 1) -> SlotSpec:
    q = np.zeros((n, 8), np.float32)
    rows, scores = np.zeros((n, 10), np.int32), np.zeros((n, 10), np.float32)
    return SlotSpec(q, rows, scores, q.ctypes.data, rows.ctypes.data, scores.ctypes.data)


@pytest.fixture
def index() -> Any:
    """A GpuIndex without CuPy whose ``_run`` records what the search was given: (k, high, ns,
    the device array at mask_addr, dense)."""
    idx = GpuIndex.__new__(GpuIndex)
    arrays: dict[int, DevArray] = {}

    def asarray(a: np.ndarray) -> DevArray:
        d = _dev(np.array(a))
        arrays[d.data.ptr] = d
        return d

    runs: list[tuple[int, int, int, Any, bool]] = []

    def run(qs: list, rows: list, scores: list, k: int, high: int, ns: int, mask_addr: int, out_ld: int,
            dense: bool = False, defer: bool = False) -> None:  # fmt: skip
        runs.append((k, high, ns, arrays.get(mask_addr), dense))

    idx.__dict__.update(
        cp=SimpleNamespace(asarray=asarray), device=NullStream(), stream=NullStream(), seg_addr=1 << 40, exact=None,
        _mask_kept=None, _masks_kept=OrderedDict(), filter_lists=0, lists_declined=0, fault_inject=None,
        _pass_end_ev=None, dim=8, dtype="float16",
        _finish_all=lambda: None, _run=run,
    )  # fmt: skip
    return idx, runs


def _search(idx: Any, cands: np.ndarray | None, ns: int = 3) -> None:
    idx.launch_slots([_spec()], 10, HIGH, ns, cands, False)


def test_a_selective_filter_is_searched_through_a_list_of_its_rows(index: Any) -> None:
    idx, runs = index
    cands = np.array([2, 17, 400, 999], np.int64)  # 4 of 1,000 rows: 4 x 16 <= 1,000
    _search(idx, cands)
    k, high, ns, arr, dense = runs[-1]
    assert (k, high, ns, dense) == (10, 4, NS_LIST, False) and idx.filter_lists == 1
    assert arr.dtype == np.int32 and arr.tolist() == [2, 17, 400, 999]


def test_a_filter_keeping_more_is_searched_through_a_mask(index: Any) -> None:
    idx, runs = index
    cands = np.arange(0, HIGH, 7, dtype=np.int64)  # 143 rows: 143 x 16 > 1,000
    _search(idx, cands)
    k, high, ns, arr, _ = runs[-1]
    assert (k, high, ns) == (10, HIGH, 3) and idx.filter_lists == 0
    assert arr.dtype == np.uint8 and len(arr) == HIGH and np.flatnonzero(arr).tolist() == cands.tolist()


def test_the_control_filter_list_0_searches_every_filter_through_a_mask(index: Any, monkeypatch: Any) -> None:
    idx, runs = index
    monkeypatch.setattr(index_gpu, "FILTER_LIST", 0)
    _search(idx, np.array([5], np.int64))
    assert runs[-1][1:3] == (HIGH, 3) and runs[-1][3].dtype == np.uint8 and idx.filter_lists == 0


def test_below_the_floor_of_rows_a_selective_filter_is_searched_through_a_mask(index: Any, monkeypatch: Any) -> None:
    """KALOS_LIST_MIN_ROWS (LIST_MIN_ROWS): in an index with fewer rows below its high-water
    mark a list saves no walk worth having (S54-5/6), so even a selective filter gets a mask;
    at the floor, a list again. (The tests' conftest sets the floor 0: their indexes are small.)
    The namespace's wish follows the same rule (``wants_rows``)."""
    idx, runs = index
    cands = np.array([2, 17, 400, 999], np.int64)
    monkeypatch.setattr(index_gpu, "LIST_MIN_ROWS", HIGH + 1)
    _search(idx, cands)
    assert runs[-1][1:3] == (HIGH, 3) and runs[-1][3].dtype == np.uint8 and idx.filter_lists == 0
    assert not idx.wants_rows(len(cands), HIGH)
    monkeypatch.setattr(index_gpu, "LIST_MIN_ROWS", HIGH)
    _search(idx, cands)
    assert runs[-1][1:3] == (4, NS_LIST) and runs[-1][3].dtype == np.int32 and idx.filter_lists == 1
    assert idx.wants_rows(len(cands), HIGH)


def test_the_floor_of_rows_by_default_and_as_set() -> None:
    """2^18 rows unless KALOS_LIST_MIN_ROWS says otherwise (0: any size); anything but a whole
    number >= 0 is refused, naming the variable."""
    assert index_gpu.list_min_rows(None) == index_gpu.list_min_rows("") == index_gpu.LIST_MIN_ROWS_DEFAULT == 1 << 18
    assert index_gpu.list_min_rows("0") == 0 and index_gpu.list_min_rows(" 100000 ") == 100_000
    for bad in ("-1", "1e6", "many"):
        with pytest.raises(ValueError, match="KALOS_LIST_MIN_ROWS"):
            index_gpu.list_min_rows(bad)
        with pytest.raises(ValueError, match="KALOS_FILTER_LIST"):
            index_gpu.filter_list_fraction(bad)
    assert not index_gpu.use_list(1_000, 200_000, 16, index_gpu.LIST_MIN_ROWS_DEFAULT)
    assert index_gpu.use_list(1_000, 300_000, 16, index_gpu.LIST_MIN_ROWS_DEFAULT)


def test_a_batch_the_masks_pass_answers_for_less_takes_the_mask(index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """KALOS_LIST_LAUNCH_ROWS (LIST_LAUNCH_ROWS, session 59): a batch of 2 or more queries
    that use_list would scan through a list takes the mask where list_pays says its fused
    launches cost more than the GEMM / mma pass (counted as ``lists_declined``); a single
    query keeps the list. The controls: the rule off (0), which the tests' conftest sets by
    default, and int8 and KALOS_GEMM=0, whose mask batches walk every row in fused launches."""
    idx, runs = index
    cands = np.array([2, 17, 400, 999], np.int64)
    monkeypatch.setattr(index_gpu, "LIST_LAUNCH_ROWS", index_gpu.LIST_LAUNCH_ROWS_DEFAULT)
    idx.launch_slots([_spec(1)], 10, HIGH, 3, cands, False)
    assert runs[-1][1:3] == (4, NS_LIST) and idx.filter_lists == 1 and idx.lists_declined == 0
    idx.launch_slots([_spec(2), _spec(1)], 10, HIGH, 3, cands, False)  # 3 queries in two slots
    assert runs[-1][1:3] == (HIGH, 3) and runs[-1][3].dtype == np.uint8
    assert np.flatnonzero(runs[-1][3]).tolist() == cands.tolist()
    assert idx.filter_lists == 1 and idx.lists_declined == 1
    for launch_rows, listed in ((HIGH - 4, True), (HIGH - 3, False)):  # one launch of 996 + 4 rows, or 997 + 4
        monkeypatch.setattr(index_gpu, "LIST_LAUNCH_ROWS", launch_rows)
        idx.launch_slots([_spec(3)], 10, HIGH, 3, cands, False)
        assert runs[-1][1:3] == ((4, NS_LIST) if listed else (HIGH, 3)), launch_rows
    assert idx.filter_lists == 2 and idx.lists_declined == 2
    for control in ("rule off", "int8", "no gemm"):
        with monkeypatch.context() as m:
            if control == "rule off":
                m.setattr(index_gpu, "LIST_LAUNCH_ROWS", 0)
            elif control == "int8":
                m.setattr(idx, "dtype", "int8")
            else:
                m.setattr(index_gpu, "USE_GEMM", False)
            idx.launch_slots([_spec(3)], 10, HIGH, 3, cands, False)
        assert runs[-1][1:3] == (4, NS_LIST) and idx.lists_declined == 2, control
    assert idx.filter_lists == 5


def test_one_answer_kept_as_a_list_and_as_a_mask(index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept answer (read-only) searched by single queries (its list) and by batches the rule
    sends to the mask keeps both uploads: alternating makes no new one after the first two.
    A list longer than CAND_CAP keeps every batch (the mask's batch could overflow: tau_sample)."""
    idx, runs = index
    monkeypatch.setattr(index_gpu, "LIST_LAUNCH_ROWS", index_gpu.LIST_LAUNCH_ROWS_DEFAULT)
    cands = np.array([3, 30, 300], np.int64)
    cands.flags.writeable = False
    for _ in range(3):
        idx.launch_slots([_spec(1)], 10, HIGH, 3, cands, False)
        idx.launch_slots([_spec(5)], 10, HIGH, 3, cands, False)
    assert [r[3].dtype for r in runs] == [np.int32, np.uint8] * 3
    assert len({id(r[3]) for r in runs}) == 2 and idx.lists_declined == 3
    high = 16 * (index_gpu.CAND_CAP + 1)
    for kept, listed in ((index_gpu.CAND_CAP, False), (index_gpu.CAND_CAP + 1, True)):
        idx.launch_slots([_spec(64)], 10, high, 3, np.arange(kept, dtype=np.int64), False)
        assert runs[-1][2] == (NS_LIST if listed else 3), kept


def test_where_a_listed_batch_pays() -> None:
    """list_pays: ceil(n / FUSED_MAX_Q) launches of (LIST_LAUNCH_ROWS + the list's rows)
    against ceil(n / MAXQ) passes over ``high``, at S58's size (1,005,000 rows, a 5,000-row
    filter: the list won at 48 queries and lost at 64) and past one pass of the mask."""
    f, mq = index_gpu.FUSED_MAX_Q, index_gpu.MAXQ
    assert (f, mq) == (8, 64)  # the arithmetic below
    assert [index_gpu.list_pays(n, 5_000, 1_005_000, 150_000) for n in (2, 8, 48, 49, 56, 64)] == [
        True, True, True, False, False, False]  # 7 launches of 155,000 rows > 1,005,000
    assert index_gpu.list_pays(48, 5_000, 930_000, 150_000) and not index_gpu.list_pays(48, 5_001, 930_000, 150_000)
    # 65 queries: 9 launches against 2 passes; 1 query: always the list
    assert index_gpu.list_pays(65, 5_000, 9 * 155_000 // 2, 150_000)
    assert not index_gpu.list_pays(65, 5_000, 9 * 155_000 // 2 - 1, 150_000)
    assert index_gpu.list_pays(1, 5_000, 10, 150_000) and index_gpu.list_pays(64, 5_000, 10, 0)
    assert index_gpu.list_launch_rows(None) == index_gpu.list_launch_rows(" ") == 140_000
    # the default at the sizes it was fitted to (H100, S58 and S60): 1,005,000 rows and 5,000-row
    # lists, the list to 48 queries; 300,011 rows and 2,500- or 10,000-row lists, to 16
    d = index_gpu.LIST_LAUNCH_ROWS_DEFAULT
    assert [index_gpu.list_pays(n, 5_000, 1_005_000, d) for n in (48, 56)] == [True, False]
    assert [index_gpu.list_pays(n, kept, 300_011, d) for kept in (2_500, 10_000) for n in (16, 24)] == [
        True, False, True, False]
    assert index_gpu.list_launch_rows("0") == 0 and index_gpu.list_launch_rows("90000") == 90_000
    for bad in ("-1", "1e5", "lots"):
        with pytest.raises(ValueError, match="KALOS_LIST_LAUNCH_ROWS"):
            index_gpu.list_launch_rows(bad)


def test_no_filter_gets_neither(index: Any) -> None:
    idx, runs = index
    _search(idx, None)
    assert runs[-1][1:4] == (HIGH, 3, None) and idx.filter_lists == 0


def test_a_kept_answers_list_is_uploaded_once_and_reused_only_as_a_list(index: Any, monkeypatch: Any) -> None:
    """A read-only candidates array (the service's kept answer) keeps its device list: the
    same array again reuses it. Were lists switched off meanwhile, the kept int32 list must not
    be read as a uint8 mask (nor a mask as a list): a new array is made as what is needed now."""
    idx, runs = index
    cands = np.array([3, 30, 300], np.int64)
    cands.flags.writeable = False
    _search(idx, cands)
    first = runs[-1][3]
    _search(idx, cands)
    assert runs[-1][3] is first and idx.filter_lists == 2  # the same list
    monkeypatch.setattr(index_gpu, "FILTER_LIST", 0)
    _search(idx, cands)
    mask = runs[-1][3]
    assert mask is not first and mask.dtype == np.uint8 and np.flatnonzero(mask).tolist() == [3, 30, 300]
    monkeypatch.setattr(index_gpu, "FILTER_LIST", 16)
    _search(idx, cands)
    assert runs[-1][3] is not mask and runs[-1][3].dtype == np.int32 and runs[-1][2] == NS_LIST


def test_answers_searched_in_turn_keep_their_own_uploads(index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read-only answers of several scopes searched in turn (a list, a mask, another list) are
    uploaded once each and found again (MASKS_KEPT of them, the least recently used dropped
    first); ``high`` grown makes a scope's upload again. The control: with one kept, every
    turn uploads again."""
    idx, runs = index
    answers = [np.array([2, 9], np.int64), np.arange(0, HIGH, 5, dtype=np.int64), np.array([7], np.int64)]
    for a in answers:
        a.flags.writeable = False
    for keep, want in ((8, 3), (1, 9)):
        monkeypatch.setattr(index_gpu, "MASKS_KEPT", keep)
        idx._masks_kept.clear()
        runs.clear()
        for _ in range(3):
            for a in answers:
                _search(idx, a)
                assert idx._mask_kept[0] is a and idx._mask_kept[2] is runs[-1][3]
        assert len({id(r[3]) for r in runs}) == want, keep
        assert [r[3].dtype for r in runs[:3]] == [np.int32, np.uint8, np.int32]
    monkeypatch.setattr(index_gpu, "MASKS_KEPT", 8)
    before = runs[-1][3]
    idx.launch_slots([_spec()], 10, HIGH + 1, 3, answers[2], False)  # the rows grew: made again
    assert runs[-1][3] is not before and runs[-1][3].tolist() == [7]


def test_a_writable_answer_is_not_kept(index: Any) -> None:
    idx, runs = index
    cands = np.array([3, 30, 300], np.int64)
    _search(idx, cands)
    _search(idx, cands)
    assert runs[0][3] is not runs[1][3] and idx._mask_kept is None


class _Graph:
    def __init__(self, log: list, key: tuple) -> None:
        self.log, self.key = log, key

    def launch(self, stream: object) -> None:
        self.log.append(("launch", self.key))


def test_a_list_never_takes_the_gemm_path_and_asks_for_list_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_run`` of 11 queries: with a list, fused graphs of the list's scan (8 queries, then 3),
    never the GEMM / mma path; the control: the same batch through a mask takes that path."""
    idx = GpuIndex.__new__(GpuIndex)
    log: list = []
    mm = mmap.mmap(-1, 4096)

    def graph(k: int, qb: int, grid: int, slot: tuple = (0, 0, 0), listed: bool = False) -> _Graph:
        log.append(("graph", qb, listed))
        return _Graph(log, (qb, listed))

    idx.__dict__.update(
        dim=8, ld=8, tpr=1, max_grid=528, smem_optin=227 * 1024, dtype="float16", stream=NullStream(),
        _desc_mm=mm, _desc_u64=np.frombuffer(mm, np.uint64), _graph=graph, _check=lambda fn: fn(),
        _graph_done=lambda: None, _pending=[], _mma_end=None, trace=None,
        _batch_topk=lambda n, k, high: log.append(("gemm", n)) or (lambda: None),
    )  # fmt: skip
    qs = [1 << 30] * 11
    idx._run(qs, qs, qs, 10, 4, NS_LIST, 1 << 31, 10)
    assert log == [("graph", 8, True), ("launch", (8, True)), ("graph", 4, True), ("launch", (4, True))]
    log.clear()
    idx._run(qs, qs, qs, 10, HIGH, 3, 1 << 31, 10)
    assert log == [("gemm", 11)] if index_gpu.USE_GEMM else all(e[0] != "gemm" for e in log)


def test_a_lists_graph_captures_scan_list_with_its_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_graph(..., listed=True)`` captures prep_queries and scan_list (not scan_topk), each
    launch checked against the kernel's parameter list; cached apart from the mask's graph."""
    launched: list[tuple[str, tuple]] = []
    asked: list[str] = []

    def get_kernel(name: str, *t: object) -> FakeKernel:
        asked.append(name)
        return FakeKernel(name, launched)

    monkeypatch.setattr(index_gpu.kernels, "get_kernel", get_kernel)
    idx = GpuIndex.__new__(GpuIndex)
    ptr = _dev(np.zeros(8, np.float32))
    idx.__dict__.update(
        graphs={}, ld=8, dim=8, metric=0, ctype="__half", tpr=1, rowscale=None, stream=NullStream(),
        device=NullStream(), desc_addr=1 << 20, params=ptr, qbuf=ptr, qbuf_h=ptr, qbuf_i8=ptr, data=ptr, ns=ptr,
        sqnorm=ptr, scratch_k=ptr, scratch_v=ptr, sync=ptr,
    )  # fmt: skip
    g_list = idx._graph(10, 1, 2, (1, 2, 3), True)
    g_mask = idx._graph(10, 1, 2, (1, 2, 3))
    assert asked == ["prep_queries", "scan_list", "prep_queries", "scan_topk"]
    assert [name for name, _ in launched] == ["prep_queries", "scan_list", "prep_queries", "scan_topk"]
    assert g_list is not g_mask and idx._graph(10, 1, 2, (1, 2, 3), True) is g_list and len(idx.graphs) == 2


def test_lists_of_many_lengths_share_a_few_grids(monkeypatch: pytest.MonkeyPatch) -> None:
    """A search through a list (batch 1, and a batch of 3) takes a grid of a power of two blocks (or the most the
    device and the merge allow), so lists of every length from 1 to 80,000 rows capture graphs
    for a dozen grids at most, each with at least the blocks the list needs; the control: the
    same row counts without a list take a grid per 2 x 64 rows, hundreds of them."""
    idx = GpuIndex.__new__(GpuIndex)
    grids: dict[bool, list[int]] = {True: [], False: []}
    mm = mmap.mmap(-1, 4096)

    def graph(k: int, qb: int, grid: int, slot: tuple = (0, 0, 0), listed: bool = False) -> _Graph:
        grids[listed].append(grid)
        return _Graph([], ())

    idx.__dict__.update(
        dim=8, ld=8, tpr=4, max_grid=528, smem_optin=227 * 1024, dtype="float16", stream=NullStream(),
        _desc_mm=mm, _desc_u64=np.frombuffer(mm, np.uint64), _graph=graph, _check=lambda fn: fn(),
        _graph_done=lambda: None, _pending=[], _mma_end=None, trace=None,
    )  # fmt: skip
    monkeypatch.setattr(index_gpu, "USE_GEMM", False)  # (the control's batch: fused graphs too)
    lengths = range(1, 80_001, 7)
    for nq in (1, 3):  # batch 1 (the slot's graph) and a batch (fused graphs)
        grids[True].clear()
        grids[False].clear()
        qs = [1 << 30] * nq
        for n in lengths:
            idx._run(qs, qs, qs, 10, n, NS_LIST, 1 << 31, 10)
            idx._run(qs, qs, qs, 10, n, 3, 0, 10)
        listed = grids[True]
        assert len(set(listed)) <= 12 and all(g & (g - 1) == 0 or g == 528 for g in listed), nq
        assert all(g >= min(528, -(-n // 128)) for g, n in zip(listed, lengths, strict=True))  # (64 groups, 2 rounds)
        assert len(set(grids[False])) > 400
