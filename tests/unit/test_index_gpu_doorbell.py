"""``GpuIndex.resume_doorbell``'s host side without a GPU: CuPy's arrays stood in for by host
memory (tests/kernel_fakes.py) and the kernel's launch checked against ``doorbell_topk``'s
parameters and recorded. What the kernel does with its settings is for
tests/gpu/test_gpu_doorbell.py and test_gpu_doorbell_spaces.py; here: that each start hands it
the rows, the default namespace and the namespaces it serves as the host line
(``struct BellCtl``) and the namespace table (``struct BellSpaces``) say, in the device memory
it reads them from. (A name clash in this code once failed every start that named a namespace,
on the GPU only: session 48.)"""

from __future__ import annotations

import mmap
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from kalos_retrievers.sidecar import index_gpu
from kalos_retrievers.sidecar.index import BellScope, CpuIndex
from kalos_retrievers.sidecar.index_gpu import GpuIndex, SmLimits, bell_spaces_table
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.store import NullStore
from kernel_fakes import DevArray, FakeKernel, NullStream

from kalos_retrievers.protocol import METRICS, Layout, encode_json, encode_recall_args

pytestmark = pytest.mark.timeout(60)


class _Dev(DevArray):
    """A device array whose ``set`` and ``fill`` write its host memory."""

    def set(self, arr: np.ndarray, stream: object = None) -> None:
        self.view(np.ndarray)[...] = np.asarray(arr).reshape(self.shape)

    def fill(self, value: int) -> None:
        self.view(np.ndarray).fill(value)


def _dev(a: np.ndarray) -> _Dev:
    return np.ascontiguousarray(a).view(_Dev)


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A GpuIndex made without CuPy, with what resume_doorbell reads: 24 rows of 16-d float16,
    a 3-slot segment, an empty arena, and the kernel's launch recorded in ``log``."""
    log: list[tuple[str, tuple]] = []
    kern = FakeKernel("doorbell_topk", log)
    kern.num_regs = 80
    kern.shared_size_bytes = 5888
    built: list[tuple] = []  # the template arguments of each doorbell_topk asked for
    monkeypatch.setattr(index_gpu.kernels, "get_kernel", lambda name, *t: built.append(t) or kern)
    idx = GpuIndex.__new__(GpuIndex)
    u8 = np.uint8
    bell_mm = mmap.mmap(-1, 4096)
    idx.__dict__.update(
        cp=SimpleNamespace(asarray=_dev, zeros=lambda n, dt: _dev(np.zeros(n, dt))),
        dim=16, ld=16, metric=0, name="cuda:0", ctype="__half", tpr=2,
        device=NullStream(), bstream=NullStream(),
        stream=NullStream(), doorbell_running=False, doorbell_k=64, doorbell_spaces=index_gpu.BELL_SPACES_MAX,
        doorbell_args=index_gpu.BELL_ARGS_MAX, _bell_masks={}, bell_mask_uploads=0, bell_mask_follows=0,
        _bell_lists={}, bell_list_uploads=0,
        bell_served_spaces=(), doorbell_launches=0, doorbell_mode=index_gpu.DOORBELL_MODE, seg_addr=1 << 40,
        _closed=False, _bell_layout=Layout(n_slots=3, dim=16), _arena_table=(1 << 41, 0, 0, 7), exact=None,
        _exact_reg=0, rescore_factor=1, _bell_mm=bell_mm, _bell_addr=np.frombuffer(bell_mm, u8).ctypes.data,
        bell_cfg=_dev(np.zeros(index_gpu._BELL_SERVED, u8)),
        bell_spaces=_dev(np.zeros(index_gpu._BELL_SPACES.size, u8)),
        bell_words=_dev(np.zeros(index_gpu._BELL_WORDS, np.uint32)), bell_cand=_dev(np.zeros(4, np.int32)),
        data=_dev(np.zeros((24, 16), np.float16)), ns=_dev(np.zeros(24, np.int32)),
        sqnorm=_dev(np.zeros(24, np.float32)),
        rowscale=None, params=_dev(np.zeros(4096, u8)), qbuf=_dev(np.zeros(16, np.float32)),
        qbuf_i8=_dev(np.zeros(16, np.int8)), scratch_k=_dev(np.zeros(64, np.float32)),
        scratch_v=_dev(np.zeros(64, np.int32)), sync=_dev(np.zeros(64, np.uint32)), bell_per_sm=3,
        sm_limits=SmLimits(65536, 233472, 2048, 1024), sms=132, max_grid=4096, on_doorbell=None,
        stop_carousel=lambda: None, _finish_all=lambda: None, _check=lambda fn: fn(),
    )  # fmt: skip
    idx.__dict__["built"] = built
    return idx, log


def host_line(idx: Any) -> tuple:
    """The settings the kernel was started with: its device copy of the host line."""
    return index_gpu._BELL_CTL.unpack_from(bytes(idx.bell_cfg.view(np.ndarray)))


def _ns(name: str, ns_id: int) -> BellScope:
    return BellScope(encode_recall_args(name, None), ns_id)


def test_a_start_names_the_namespaces_it_serves_in_the_kernels_table(index: Any) -> None:
    idx, log = index
    spaces = [_ns("notes", 5), _ns("ünï-名前", 9), _ns("x" * 123, 11)]  # the last one's args are too long
    idx.resume_doorbell(21, 3, spaces)
    assert idx.doorbell_running and idx.doorbell_launches == 1 and len(log) == 1
    line = host_line(idx)
    assert line[1:3] == (21, 3)  # n_rows, the default namespace's id
    assert line[-2:] == (2, idx.bell_spaces.data.ptr)  # n_spaces, where the table is
    table, keys = bell_spaces_table([(sc.args, sc.ns_id, 0, -1) for sc in spaces])
    assert keys == idx.bell_served_spaces == (spaces[0].args, spaces[1].args)
    assert bytes(idx.bell_spaces.view(np.ndarray)) == table  # copied to the device before the launch


def _masks(idx: Any) -> dict[bytes, tuple[int, np.ndarray]]:
    """Each served scope's mask address in the kernel's table, and the mask there."""
    n = index_gpu.BELL_SPACES_MAX
    addrs = index_gpu._BELL_SPACES.unpack(bytes(idx.bell_spaces.view(np.ndarray)))[2 * n : 3 * n]
    out = {}
    for key, addr in zip(idx.bell_served_spaces, addrs, strict=False):
        kept = idx._bell_masks.get(key)
        out[key] = (addr, None if kept is None else kept[2].view(np.ndarray))
    return out


def _entries(idx: Any) -> dict[bytes, tuple[int, int, int]]:
    """Each served scope's (id, list length, address) in the kernel's table."""
    n = index_gpu.BELL_SPACES_MAX
    f = index_gpu._BELL_SPACES.unpack(bytes(idx.bell_spaces.view(np.ndarray)))  # (the layout: test_kernel_constants)
    ids, addrs, rows = f[:n], f[2 * n : 3 * n], f[3 * n + 1 :]
    return {key: (ids[e], rows[e], addrs[e]) for e, key in enumerate(idx.bell_served_spaces)}


def test_a_selective_filter_is_served_through_a_list_of_its_rows(index: Any) -> None:
    """A filter that keeps at most 1/FILTER_LIST of the rows gets a device list of them (int32,
    ascending): its entry's id is NS_LIST, its length the list's, its address the list's. The
    list is kept while the filter's rows are the same read-only array, uploaded again for other
    rows, freed when the scope is no longer served; a filter whose rows grow past the fraction
    goes back to a mask, and one that keeps none gets a list of length 0. The control:
    ``KALOS_FILTER_LIST=0`` (FILTER_LIST 0) serves the same filter through a mask."""
    idx, _ = index
    rows = np.array([3, 11], np.int64)
    rows.flags.writeable = False  # (the service's kept answer)
    flt = BellScope(encode_recall_args("mem", b'{"user":"u1"}'), 6, rows)
    ns = _ns("notes", 5)
    idx.resume_doorbell(21, 3, [flt, ns])  # 2 of 21 rows: 2 x 16 > 21, a mask
    assert _entries(idx)[flt.args][:2] == (6, 0) and idx.bell_mask_uploads == 1 and idx._bell_lists == {}
    assert idx.built[-1] == ("__half", 2, 0, "false")  # (the kernel's build without lists)
    idx.doorbell_running = False
    idx.resume_doorbell(24, 3, [flt, ns])  # 2 x 16 > 24 still: a mask
    assert idx._bell_lists == {}
    idx.doorbell_running = False
    idx.resume_doorbell(32, 3, [flt, ns])  # 2 x 16 <= 32: the list
    ids, n_list, addr = _entries(idx)[flt.args]
    dev = idx._bell_lists[flt.args][1]
    assert (ids, n_list, addr) == (index_gpu.NS_LIST, 2, dev.data.ptr) and idx.bell_list_uploads == 1
    assert idx.built[-1] == ("__half", 2, 0, "true")  # the build that serves lists
    assert dev.dtype == np.int32 and dev.view(np.ndarray).tolist() == [3, 11]
    assert _entries(idx)[ns.args] == (5, 0, 0) and idx._bell_masks == {}  # (the mask freed)
    idx.doorbell_running = False
    idx.resume_doorbell(40, 3, [flt, ns])  # the same rows: the list kept
    assert idx.bell_list_uploads == 1 and _entries(idx)[flt.args][2] == addr
    fresh = np.array([1, 2, 30], np.int64)  # (a writable array: uploaded at every start)
    for want in (2, 3):
        idx.doorbell_running = False
        idx.resume_doorbell(48, 3, [flt._replace(rows=fresh)])
        assert idx.bell_list_uploads == want and _entries(idx)[flt.args][:2] == (index_gpu.NS_LIST, 3)
        assert idx._bell_lists[flt.args][1].view(np.ndarray).tolist() == [1, 2, 30]
    idx.doorbell_running = False
    idx.resume_doorbell(48, 3, [flt._replace(rows=np.zeros(0, np.int64))])  # keeps none: an empty list
    assert _entries(idx)[flt.args][:2] == (index_gpu.NS_LIST, 0)
    idx.doorbell_running = False
    idx.resume_doorbell(48, 3, [ns])
    assert idx._bell_lists == {} and idx.built[-1][-1] == "false"  # no longer served: freed
    idx.doorbell_running = False
    idx.resume_doorbell(48, 3, [flt._replace(rows=np.arange(4, dtype=np.int64))])  # 4 x 16 > 48: a mask
    assert _entries(idx)[flt.args][:2] == (6, 0) and idx._bell_lists == {}


def test_a_namespace_given_as_its_rows_is_served_through_their_list_where_selective(
        index: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A namespace without a filter given with its rows (BellScope.whole, Service.bell_spaces)
    gets a list of them like a selective filter's where they are at most 1/FILTER_LIST of
    the rows; otherwise, with lists off (KALOS_FILTER_LIST=0), in an index below
    KALOS_LIST_MIN_ROWS, with filters off
    (doorbell_args 0), or with no room for the list, it is served as the namespace alone:
    never a mask, never dropped. The control: the same rows as a filter's (not whole) get a
    mask where they are not selective."""
    idx, _ = index
    rows = np.array([3, 11], np.int64)
    rows.flags.writeable = False
    mem = BellScope(encode_recall_args("mem", None), 6, rows, 4, True)
    idx.resume_doorbell(32, 3, [mem])  # 2 x 16 <= 32: the list
    dev = idx._bell_lists[mem.args][1]
    assert _entries(idx)[mem.args] == (index_gpu.NS_LIST, 2, dev.data.ptr) and idx.built[-1][-1] == "true"
    assert dev.view(np.ndarray).tolist() == [3, 11] and idx.bell_mask_uploads == 0

    def alone(high: int) -> None:
        idx.doorbell_running = False
        idx.resume_doorbell(high, 3, [mem])
        assert _entries(idx)[mem.args] == (6, 0, 0) and idx.built[-1][-1] == "false"
        assert idx.bell_mask_uploads == 0 and idx._bell_lists == {} and idx._bell_masks == {}

    alone(31)  # 2 x 16 > 31: the namespace alone, no mask
    with monkeypatch.context() as m:
        m.setattr(index_gpu, "FILTER_LIST", 0)
        alone(1000)
    with monkeypatch.context() as m:  # an index below KALOS_LIST_MIN_ROWS: no list either
        m.setattr(index_gpu, "LIST_MIN_ROWS", 1001)
        alone(1000)
    with monkeypatch.context() as m:
        m.setitem(idx.__dict__, "doorbell_args", 0)
        alone(1000)

    def no_room(sc: BellScope) -> Any:
        raise MemoryError("out of device memory")

    with monkeypatch.context() as m:
        m.setitem(idx.__dict__, "_bell_list", no_room)
        alone(1000)
    idx.doorbell_running = False
    idx.resume_doorbell(31, 3, [mem._replace(whole=False)])  # the control: a filter's rows, a mask
    assert _entries(idx)[mem.args][:2] == (6, 0) and idx.bell_mask_uploads == 1


def test_the_negative_control_filter_list_0_serves_masks_only(index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    idx, _ = index
    monkeypatch.setattr(index_gpu, "FILTER_LIST", 0)
    flt = BellScope(encode_recall_args("mem", b'{"user":"u1"}'), 6, np.array([3], np.int64))
    idx.resume_doorbell(1000, 3, [flt])
    assert _entries(idx)[flt.args][:2] == (6, 0) and idx._bell_lists == {} and idx.bell_mask_uploads == 1


def test_a_filter_is_served_through_a_mask_of_the_rows_it_keeps(index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filter's scope gets a device mask (1 for each row it keeps, below the high-water mark)
    whose address is its table entry's; a namespace alone gets none. The mask is kept while the
    filter's rows are the same read-only array (grown with zeros when the high-water mark
    passes its end), and made again for other rows that say nothing of the changes since;
    one no longer served is freed. Without ``doorbell_args`` (KALOS_BELL_FILTERS=0,
    the control) a filter is left out and a namespace still served. (Masks only here:
    FILTER_LIST 0; lists are the test above.)"""
    idx, log = index
    monkeypatch.setattr(index_gpu, "FILTER_LIST", 0)
    rows = np.array([0, 4, 7, 20], np.int64)
    rows.flags.writeable = False  # (the service's kept answer)
    flt = BellScope(encode_recall_args("mem", b'{"user":"u1"}'), 6, rows)
    ns = _ns("notes", 5)
    idx.resume_doorbell(21, 3, [flt, ns])
    m = _masks(idx)
    addr, mask = m[flt.args]
    assert addr == idx._bell_masks[flt.args][2].data.ptr != 0 and m[ns.args][0] == 0
    assert mask.shape == (21,) and np.flatnonzero(mask).tolist() == [0, 4, 7, 20]
    assert idx.bell_mask_uploads == 1
    idx.doorbell_running = False
    idx.resume_doorbell(21, 3, [flt, ns])
    assert idx.bell_mask_uploads == 1 and _masks(idx)[flt.args][0] == addr  # the same rows: kept
    idx.doorbell_running = False
    idx.resume_doorbell(22, 3, [flt])  # the rows grew (a write elsewhere): a zero past the end
    grown = _masks(idx)[flt.args][1]
    assert idx.bell_mask_uploads == 1 and idx.bell_mask_follows == 1
    assert grown.shape == (22,) and np.flatnonzero(grown).tolist() == [0, 4, 7, 20]
    fresh = np.array([4], np.int64)  # (a writable array: the service keeps none, so no mask is kept for it)
    idx.doorbell_running = False
    idx.resume_doorbell(22, 3, [flt._replace(rows=fresh)])
    assert idx.bell_mask_uploads == 2 and np.flatnonzero(_masks(idx)[flt.args][1]).tolist() == [4]
    idx.doorbell_running = False
    idx.resume_doorbell(22, 3, [flt._replace(rows=fresh)])
    assert idx.bell_mask_uploads == 3
    idx.doorbell_running = False
    idx.resume_doorbell(22, 3, [ns])
    assert idx._bell_masks == {} and idx.bell_served_spaces == (ns.args,)  # no longer served: freed
    idx.doorbell_running = False
    idx.doorbell_args = 0
    idx.resume_doorbell(21, 3, [flt, ns])
    assert idx.bell_served_spaces == (ns.args,) and idx.bell_mask_uploads == 3 and len(log) == 7


def test_no_namespaces_leaves_the_table_unread(index: Any) -> None:
    """The controls: no namespaces asked, and an index that serves none (KALOS_BELL_SPACES=0),
    start the kernel with n_spaces 0 and no table."""
    idx, log = index
    idx.resume_doorbell(21, 3)
    assert host_line(idx)[-2:] == (0, 0) and idx.bell_served_spaces == ()
    idx.doorbell_running = False
    idx.doorbell_spaces = 0
    idx.resume_doorbell(21, 3, [_ns("notes", 5)])
    assert host_line(idx)[-2:] == (0, 0) and idx.bell_served_spaces == () and len(log) == 2
    assert not idx.bell_spaces.view(np.ndarray).any()


def test_a_running_kernel_is_not_started_again(index: Any) -> None:
    idx, log = index
    idx.resume_doorbell(21, 3, [_ns("notes", 5)])
    idx.resume_doorbell(21, 3, [_ns("other", 6)])
    assert len(log) == 1 and idx.bell_served_spaces == (_ns("notes", 5).args,)


def _follow_rig(index: Any, touched_since: Any = None) -> tuple[int, int]:
    """300 random upserts, deletes and compactions in two namespaces of a CPU service; after
    each, the fake GPU index started with the service's scopes (3 filters and a namespace) and
    its ``touched_since`` (or the one given), and each filter's device mask or list compared
    with the rows a fresh evaluation keeps, below the high-water mark. Returns (masks made
    whole, masks followed); raises AssertionError at the first wrong mask or list."""
    idx, _ = index
    dim, ns = 4, "mem"
    svc = Service(CpuIndex(dim, METRICS["ip"]), NullStore(), dim=dim, metric=METRICS["ip"])
    svc.index.doorbell_spaces = 8  # type: ignore[misc]  # (what the service notes: as many as the GPU's)
    rnd = random.Random(11)
    filters = [{"user": {"$eq": "u1"}}, {"user": {"$in": ["u2", "u3"]}}, {"user": {"$ne": "u1"}}]
    for flt in filters:
        svc.note_bell_space(ns, flt, encode_recall_args(ns, encode_json(flt)))
    svc.note_bell_space(ns)
    live: dict[str, set[str]] = {ns: set(), "other": set()}
    for step in range(300):
        where = ns if rnd.random() < 0.7 else "other"
        op = rnd.random()
        if op < 0.5:
            ids = list(dict.fromkeys(f"m{rnd.randrange(150)}" for _ in range(rnd.randrange(1, 7))))
            vecs = np.ones((len(ids), dim), np.float32)
            svc.upsert({"namespace": where, "ids": ids, "texts": ids,
                        "metadatas": [{"user": f"u{rnd.randrange(4)}"} for _ in ids]}, vecs)  # fmt: skip
            live[where] |= set(ids)
        elif op < 0.8 and live[where]:
            gone = rnd.sample(sorted(live[where]), min(len(live[where]), rnd.randrange(1, 5)))
            svc.delete({"namespace": where, "ids": gone})
            live[where] -= set(gone)
        else:
            svc.compact(max_moves=rnd.randrange(1, 40))
        idx.doorbell_running = False
        high = svc.rows.high
        idx.resume_doorbell(high, 0, svc.bell_spaces(), touched_since or svc.rows.touched_since)
        for flt in filters:
            key = encode_recall_args(ns, encode_json(flt))
            if key not in idx.bell_served_spaces:
                assert not live[ns], step  # (an empty namespace is not served)
                continue
            _, fresh, _, _ = svc.eligible(ns, flt)
            listed = idx._bell_lists.get(key)
            if listed is not None:  # (a selective filter's list of rows)
                ns_list, n_list, addr = _entries(idx)[key]
                got_rows = listed[1].view(np.ndarray)[:n_list].tolist()
                want_rows = [] if fresh is None else fresh.tolist()
                assert got_rows == want_rows and n_list == len(want_rows), f"list wrong at step {step} for {flt}"
                assert ns_list == index_gpu.NS_LIST and addr == listed[1].data.ptr, step
                continue
            want = np.zeros(high, np.uint8)
            if fresh is not None:
                want[fresh] = 1
            got = idx._bell_masks[key][2].view(np.ndarray)[:high]
            bad = np.flatnonzero(got != want)[:5]
            assert not len(bad), f"mask wrong at step {step} for {flt}: rows {bad}"
    return idx.bell_mask_uploads, idx.bell_mask_follows


def test_a_served_filters_mask_follows_the_rows_changes_touched(index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through random writes, deletes and compactions, each served filter's mask is what a
    whole new one would be at every start, while most starts write only the rows the changes
    touched (bell_mask_follows) instead of making it whole again (bell_mask_uploads). (Masks
    only: FILTER_LIST 0.)"""
    monkeypatch.setattr(index_gpu, "FILTER_LIST", 0)
    uploads, follows = _follow_rig(index)
    assert follows > 500 and uploads < follows // 10, (uploads, follows)


def test_the_negative_control_a_mask_blind_to_the_touched_rows_goes_wrong(
    index: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: told that no change touched any row, the masks kept are followed into
    wrong ones, and the comparison sees it."""
    monkeypatch.setattr(index_gpu, "FILTER_LIST", 0)
    with pytest.raises(AssertionError, match="mask wrong"):
        _follow_rig(index, touched_since=lambda seq: np.zeros(0, np.int64))


def test_served_filters_switch_between_lists_and_masks_and_stay_right(
    index: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With FILTER_LIST 4 the rig's filters (keeping about a quarter, a half and three quarters
    of the namespace's rows, beside another namespace) are served through lists at some starts
    and masks at others, as their share of the rows crosses a quarter: every list and every
    mask is right at every start."""
    monkeypatch.setattr(index_gpu, "FILTER_LIST", 4)
    uploads, follows = _follow_rig(index)
    idx, _ = index
    assert idx.bell_list_uploads > 30 and uploads + follows > 30, (idx.bell_list_uploads, uploads, follows)


def test_the_negative_control_a_list_kept_for_other_rows_goes_wrong(
    index: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: a list kept whatever the filter's rows are now is seen wrong."""
    monkeypatch.setattr(index_gpu, "FILTER_LIST", 4)
    real = GpuIndex._bell_list

    def stale(self: Any, sc: BellScope) -> Any:
        return self._bell_lists.get(sc.args) or real(self, sc)

    monkeypatch.setattr(GpuIndex, "_bell_list", stale)
    with pytest.raises(AssertionError, match="list wrong"):
        _follow_rig(index)
