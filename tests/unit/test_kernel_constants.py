"""The host's copies of what kernels/recall.cu defines: CI has no GPU, so a constant or a struct
layout changed on one side only would otherwise be found on the H200, as a wrong answer or a
hang. These tests read the CUDA source as text (no CuPy, no compiler) and compare it with the
Python constants that mirror it: sizes and limits, the protocol's words the resident kernel
reads and writes, and the byte layouts of ``BellCtl``, ``Desc`` and ``Params``.
"""

from __future__ import annotations

import re
import struct

import pytest
from kalos_retrievers.sidecar import cuda_kernels, index, index_gpu

from kalos_retrievers.protocol import (
    CTL_OFFSETS,
    DOORBELL_ARGS_MAX,
    DOORBELL_SCOPE_ARGS_MAX,
    Flag,
    Metric,
    Op,
    RespFlag,
    SlotState,
    encode_recall_args,
)

SOURCE = cuda_kernels.packaged_source()

_SIZES = {"int": 4, "unsigned int": 4, "float": 4, "u64": 8}


def defines() -> dict[str, int]:
    """Every ``#define NAME <integer>`` (the first definition of each name)."""
    out: dict[str, int] = {}
    for name, value in re.findall(r"^#define (\w+) \(?(-?\d+)\)?(?:\s|$)", SOURCE, re.M):
        out.setdefault(name, int(value))
    return out


def struct_fields(name: str) -> list[tuple[str, int, int]]:
    """(field, offset, size) of ``struct name`` as a C compiler lays it out (natural
    alignment), for the field types the kernels use: int, float, u64, pointers, and arrays
    of them sized by an integer or a ``#define``."""
    body = re.search(rf"^struct {name} {{\n(.*?)^}};", SOURCE, re.M | re.S)
    assert body is not None, f"struct {name} not found in kernels/recall.cu"
    consts = defines()
    fields, offset = [], 0
    for line in body.group(1).splitlines():
        decl = line.split("//")[0].strip()
        if not decl:
            continue
        m = re.fullmatch(r"((?:const )?(?:unsigned )?\w+\s*\**)\s*(.+);", decl)
        assert m is not None, f"cannot read {decl!r} in struct {name}"
        ctype = m.group(1).strip()
        size = 8 if ctype.endswith("*") else _SIZES[ctype]
        for declarator in m.group(2).split(","):
            field, count = declarator.strip(), 1
            arr = re.fullmatch(r"(\w+)\[(\w+)\]", field)
            if arr is not None:
                field, dim = arr.groups()
                count = int(dim) if dim.isdigit() else consts[dim]
            offset = -(-offset // size) * size  # natural alignment
            fields.append((field, offset, size * count))
            offset += size * count
    return fields


def packed_offsets(fmt: str) -> list[int]:
    """Offsets of each item of a little-endian ``struct`` format (no padding)."""
    out, at = [], 0
    for ch in fmt.lstrip("<"):
        out.append(at)
        at += struct.calcsize("<" + ch)
    return out


def test_sizes_and_limits_match() -> None:
    d = defines()
    assert d["KALOS_BLOCK"] == cuda_kernels.BLOCK
    assert d["KALOS_MAXQ"] == index_gpu.MAXQ
    assert d["MERGE_UNROLL"] == index_gpu.MERGE_UNROLL
    assert d["KALOS_CAND_MAX"] == index_gpu.CAND_MAX
    assert d["SELECT_GATHER"] == index_gpu.SELECT_GATHER
    assert d["BELL_WORDS"] == index_gpu._BELL_WORDS
    assert d["BELL_CAND_WORDS"] == index_gpu._BELL_CAND_WORDS
    # SYNC_WORDS: tickets, bounds and counts per query, then scan_topk's next row (sync_rows),
    # the next scan's direction (sync_dir), the batch-1 lists' tag and their area's size
    assert re.search(r"^#define SYNC_WORDS \(3 \* KALOS_MAXQ \+ 4\)$", SOURCE, re.M)
    assert 3 * d["KALOS_MAXQ"] + 4 == index_gpu.SYNC_WORDS
    assert "sync_rows(unsigned int* sync) { return reinterpret_cast<int*>(sync) + 3 * KALOS_MAXQ; }" in SOURCE
    assert "sync_dir(unsigned int* sync) { return reinterpret_cast<int*>(sync) + 3 * KALOS_MAXQ + 1; }" in SOURCE
    assert "sync_tag(unsigned int* sync) { return sync + 3 * KALOS_MAXQ + 2; }" in SOURCE
    assert "sync_ll_cap(unsigned int* sync) { return sync + 3 * KALOS_MAXQ + 3; }" in SOURCE
    assert (3 * d["KALOS_MAXQ"] + 2, 3 * d["KALOS_MAXQ"] + 3) == (index_gpu.SYNC_TAG, index_gpu.SYNC_LL_CAP)
    # the lists' area: per block a head and LL_K_MAX entries of 16 bytes, from a 16-byte boundary
    assert re.search(r"^#define LL_WORDS_PER_BLOCK \(4 \* LL_K_MAX \+ 4\)", SOURCE, re.M)
    assert 4 * d["LL_K_MAX"] + 4 == index_gpu.LL_WORDS_PER_BLOCK
    assert index_gpu.SYNC_WORDS * 4 % 16 == 0
    assert d["NS_ANY"] == index.NS_ANY
    assert d["NS_LIST"] == index_gpu.NS_LIST
    assert len({index.NS_ANY, index.NS_NONE, index_gpu.NS_LIST}) == 3  # (the host's three special ids differ)
    # the int8 resident kernel's candidates (RESCORE_FACTOR x k) fit its buffer for every k it takes
    assert d["KALOS_CAND_MAX"] >= index_gpu.RESCORE_FACTOR * index_gpu.DOORBELL_MAX_K


def test_protocol_values_the_kernel_uses_match() -> None:
    d = defines()
    assert (d["ST_REQUEST"], d["ST_BUSY"], d["ST_RESPONSE"], d["ST_DOORBELL"]) == (
        SlotState.REQUEST, SlotState.BUSY, SlotState.RESPONSE, SlotState.DOORBELL)  # fmt: skip
    assert d["OP_RECALL"] == Op.RECALL
    assert (d["FLAG_ARENA_DOCS"], d["FLAG_ARENA_ENTRIES"]) == (Flag.ARENA_DOCS, Flag.ARENA_ENTRIES)
    assert (d["RESP_ARENA_DOCS"], d["RESP_ARENA_ENTRIES"]) == (RespFlag.ARENA_DOCS, RespFlag.ARENA_ENTRIES)
    assert (d["METRIC_COSINE"], d["METRIC_IP"], d["METRIC_L2"]) == (Metric.COSINE, Metric.IP, Metric.L2)


@pytest.mark.parametrize(
    ("word", "field"),
    [("W_SEQ", "seq"), ("W_OP", "op"), ("W_FLAGS", "flags"), ("W_TOP_K", "top_k"),
     ("W_N_ITEMS", "n_items"), ("W_VEC_LEN", "vec_len"), ("W_ARGS_LEN", "args_len"),
     ("W_RESP_SEQ", "resp_seq"), ("W_STATUS", "status"), ("W_N_RESULTS", "n_results"),
     ("W_RESP_LEN", "resp_len"), ("W_RESP_FLAGS", "resp_flags")],
)  # fmt: skip
def test_the_slot_words_the_resident_kernel_reads_and_writes(word: str, field: str) -> None:
    assert 4 * defines()[word] == CTL_OFFSETS[field]


def test_the_kernel_reads_every_request_word_it_checks() -> None:
    """Block 0 copies W_REQUEST words (state .. args_len) before it decides."""
    assert 4 * defines()["W_REQUEST"] == CTL_OFFSETS["deadline_ns"]


def test_bellctl_layout_matches_the_host_line() -> None:
    fields = struct_fields("BellCtl")
    fmt = index_gpu._BELL_CTL.format
    items = fmt.lstrip("<")
    host = fields[: len(items)]
    # the host packs the leading fields in order, each at the C offset, with the C size
    assert [off for _, off, _ in host] == packed_offsets(fmt)
    assert [sz for _, _, sz in host] == [struct.calcsize("<" + ch) for ch in items]
    names = [n for n, _, _ in fields]
    at = {n: (off, sz) for n, off, sz in fields}
    assert names[len(items)] == "pad0" or names[len(items)] == "host_pad"  # then only padding
    assert at["served"][0] == index_gpu._BELL_SERVED  # the kernel's line starts at 128
    assert at["host_pad"][0] + at["host_pad"][1] == index_gpu._BELL_SERVED
    assert at["stamp"] == (index_gpu._BELL_SERVED + 8, index_gpu._BELL_STAMPS.size)
    assert index_gpu._BELL_SERVED + 8 + index_gpu._BELL_STAMPS.size <= 4096  # its registered page


def test_desc_and_params_layouts() -> None:
    desc = {n: off for n, off, _ in struct_fields("Desc")}
    head = ["n_queries", "k", "n_rows", "ns_id", "mask", "out_ld", "seq"]
    assert [desc[n] for n in head] == packed_offsets(index_gpu._DESC_HEAD.format)
    assert (desc["q"], desc["out_rows"], desc["out_scores"]) == (
        index_gpu._DESC_Q, index_gpu._DESC_ROWS, index_gpu._DESC_SCORES)  # fmt: skip
    last = struct_fields("Desc")[-1]
    assert last[1] + last[2] == index_gpu._DESC_SIZE
    params = struct_fields("Params")
    assert params[-1][1] + params[-1][2] <= index_gpu._PARAMS_SIZE  # the device buffer holds it


def test_the_reader_sees_a_changed_layout() -> None:
    """The negative control: the parser is not vacuous (a field inserted moves the ones after)."""
    global SOURCE
    saved = SOURCE
    try:
        SOURCE = saved.replace("    int rescore;", "    int extra;\n    int rescore;", 1)
        with pytest.raises(AssertionError):
            test_bellctl_layout_matches_the_host_line()
        words = defines()["BELL_WORDS"]
        SOURCE = saved.replace(f"#define BELL_WORDS {words}", f"#define BELL_WORDS {words - 2}", 1)
        assert saved != SOURCE
        with pytest.raises(AssertionError):
            test_sizes_and_limits_match()
    finally:
        SOURCE = saved


def test_rescore_factor_from_the_environment() -> None:
    """int8's candidates per result: the default without KALOS_RESCORE_FACTOR, the value given
    within [1, RESCORE_FACTOR_MAX], and a clear error for anything else."""
    from kalos_retrievers.sidecar import index_gpu as G

    assert G.rescore_factor({}) == G.RESCORE_FACTOR == 2
    assert G.rescore_factor({"KALOS_RESCORE_FACTOR": " "}) == G.RESCORE_FACTOR
    assert G.rescore_factor({"KALOS_RESCORE_FACTOR": "2"}) == 2
    assert G.rescore_factor({"KALOS_RESCORE_FACTOR": "16"}) == G.RESCORE_FACTOR_MAX
    for bad in ("0", "17", "-1", "2.5", "two"):
        with pytest.raises(ValueError, match="KALOS_RESCORE_FACTOR"):
            G.rescore_factor({"KALOS_RESCORE_FACTOR": bad})


def test_tpr_override_from_the_environment() -> None:
    from kalos_retrievers.sidecar import index_gpu as G

    assert G.tpr_override({}) == 0 and G.tpr_override({"KALOS_TPR": ""}) == 0
    assert [G.tpr_override({"KALOS_TPR": v}) for v in ("1", "8", " 32 ")] == [1, 8, 32]
    for bad in ("0", "3", "64", "abc", "4.0"):
        with pytest.raises(ValueError, match="KALOS_TPR"):
            G.tpr_override({"KALOS_TPR": bad})


def test_gpu_memory_limit_and_the_environment_s_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """KALOS_GPU_MEMORY_LIMIT is a whole number of bytes, named when it is not ("²" passes
    str.isdigit and not int()); environment_errors says every bad GpuIndex setting, one line
    each; a GpuIndex made directly refuses those and the ones recorded at import (which a
    benchmark building its own index ran with the default before), ahead of CuPy."""
    from kalos_retrievers.sidecar import index_gpu as G
    from kalos_retrievers.sidecar import knobs

    assert G.gpu_memory_limit({}) == 0 and G.gpu_memory_limit({"KALOS_GPU_MEMORY_LIMIT": " 4096 "}) == 4096
    for bad in ("1e9", "-1", "²", "12MB"):
        with pytest.raises(ValueError, match="KALOS_GPU_MEMORY_LIMIT"):
            G.gpu_memory_limit({"KALOS_GPU_MEMORY_LIMIT": bad})
    with pytest.raises(ValueError, match="KALOS_FILTER_LIST='²'"):
        G.filter_list_fraction("²")
    assert G.environment_errors({}) == []
    env = {"KALOS_TPR": "3", "KALOS_RESCORE_FACTOR": "0", "KALOS_GPU_MEMORY_LIMIT": "x"}
    errors = G.environment_errors(env)
    assert len(errors) == 3 and all(any(e.startswith(k) for e in errors) for k in env)
    monkeypatch.setattr(knobs, "ERRORS", ["KALOS_CAROUSEL='bogus': expected 0 (off), ..."])
    with pytest.raises(ValueError, match="KALOS_CAROUSEL='bogus'"):
        G.GpuIndex(8, 0, 0)


def test_resident_blocks_per_sm_from_the_environment() -> None:
    from kalos_retrievers.sidecar import index_gpu as G

    assert G.bell_blocks_per_sm({}) == G.BELL_PER_SM == 3
    assert G.bell_blocks_per_sm({"KALOS_BELL_PER_SM": " "}) == 3
    assert [G.bell_blocks_per_sm({"KALOS_BELL_PER_SM": v}) for v in ("1", " 3 ", "8")] == [1, 3, 8]
    for bad in ("0", "9", "-2", "2.0", "many"):
        with pytest.raises(ValueError, match="KALOS_BELL_PER_SM"):
            G.bell_blocks_per_sm({"KALOS_BELL_PER_SM": bad})


def test_resident_blocks_fit_on_an_sm_together() -> None:
    """The resident kernel's blocks per SM never exceed what CUDA's occupancy rules allow (a
    block that does not fit waits behind blocks that never end: the kernel hangs). Figures
    from the CUDA occupancy calculator's rules for each device."""
    from kalos_retrievers.sidecar import index_gpu as G

    h200 = G.SmLimits(regs=65536, smem=233472, threads=2048, smem_reserved=1024)
    t4 = G.SmLimits(regs=65536, smem=65536, threads=1024, smem_reserved=0)
    a100 = G.SmLimits(regs=65536, smem=167936, threads=2048, smem_reserved=1024)
    ga102 = G.SmLimits(regs=65536, smem=102400, threads=1536, smem_reserved=1024)
    f16 = (19456, 2768)  # the 768-d doorbell's dynamic and static shared memory, k <= 1024

    def fit(sm: G.SmLimits, regs: int, smem: tuple[int, int], cap: int = 3) -> int:
        return G.resident_blocks_per_sm(cap, regs, 256, *smem, sm)

    # the H200 as measured in session 13: float16 3, int8 and float32 2
    assert (fit(h200, 80, f16), fit(h200, 128, f16), fit(h200, 112, f16)) == (3, 2, 2)
    # registers are allocated per warp in units of 256: 81-88 per thread take as many as 88
    assert [fit(h200, r, f16) for r in (80, 81, 85, 88, 89)] == [3, 2, 2, 2, 2]
    assert [fit(h200, r, f16, cap=8) for r in (48, 49, 51, 56, 57, 64, 65)] == [5, 4, 4, 4, 4, 4, 3]
    assert fit(h200, 255, f16) == 1 and fit(h200, 256, f16) == 1
    # shared memory and threads per SM
    assert fit(t4, 80, f16) == 2  # 64 KiB: two blocks of ~22 KB
    assert fit(ga102, 80, (35840, 2768)) == 2  # a 4096-d float16 query: 3 would need 118 KB
    assert fit(a100, 80, (65536, 2768)) == 2  # a 64 KiB merge buffer: 3 would need 208 KB
    assert fit(t4, 32, (0, 0), cap=8) == 4  # 1,024 threads: 4 blocks of 256
    assert fit(h200, 80, (233472, 0)) == 0  # more shared memory than an SM has: none


def test_a_bad_gpu_setting_fails_the_start_as_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ValueError from opening the GPU index (a bad KALOS_RESCORE_FACTOR, ...) ends the start
    with the setting's message and the usage exit code, not a traceback."""
    from kalos_retrievers.sidecar import gpu, server

    def bad(*a: object) -> None:
        raise ValueError("KALOS_RESCORE_FACTOR='x': expected an integer from 1 to 16")

    monkeypatch.setattr(gpu, "open_gpu_index", bad)
    cfg = server.ServeConfig(name="kalos-unit-badenv", dim=8, device="cuda", dtype="int8")
    with pytest.raises(server.StartError, match="KALOS_RESCORE_FACTOR") as e:
        server.make_index(cfg)
    assert e.value.exit_code == server.EXIT_USAGE


def test_a_missing_cuda_library_is_an_unavailable_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy installed without the toolkit's libraries (a machine with only the driver): its
    failure to load NVRTC is GpuUnavailable, so ``--device auto`` falls back to the CPU and
    ``--device cuda`` exits 5 naming the fix (it was a traceback, exit 1); any other fault
    of the index still propagates."""
    import sys
    import types

    from kalos_retrievers.sidecar import gpu, server

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    fault: list[Exception] = []

    def gpu_index(*a: object) -> None:
        raise fault[0]

    monkeypatch.setattr(index_gpu, "GpuIndex", gpu_index)
    fault.append(RuntimeError("CuPy failed to load libnvrtc.so.12: OSError: libnvrtc.so.12: cannot open "
                              "shared object file: No such file or directory"))  # fmt: skip
    with pytest.raises(gpu.GpuUnavailable, match=r"libnvrtc.*cupy-cuda12x\[ctk\]"):
        gpu.open_gpu_index(8, 0, 0, "float16")
    auto = server.ServeConfig(name="kalos-unit-nolib", dim=8, device="auto")
    assert type(server.make_index(auto)).__name__ == "CpuIndex"
    with pytest.raises(server.StartError, match="NVRTC") as e:
        server.make_index(server.ServeConfig(name="kalos-unit-nolib", dim=8, device="cuda"))
    assert e.value.exit_code == server.EXIT_DEVICE
    fault[0] = RuntimeError("an index fault")  # (the control: not a missing library)
    with pytest.raises(RuntimeError, match="an index fault"):
        server.make_index(auto)


def test_int8_refuses_a_max_k_its_rescoring_cannot_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 storage re-scores at most CAND_MAX candidates: a --max-k above it is refused at
    start with a usage error (before any GPU is opened), one at it is accepted."""
    from kalos_retrievers.sidecar import gpu, server

    opened = []
    monkeypatch.setattr(gpu, "open_gpu_index", lambda *a: opened.append(a) or "index")
    cap = index_gpu.CAND_MAX
    over = server.ServeConfig(name="kalos-unit-maxk", dim=8, device="cuda", dtype="int8", max_k=cap + 1)
    with pytest.raises(server.StartError, match="--max-k") as e:
        server.make_index(over)
    assert e.value.exit_code == server.EXIT_USAGE and not opened
    at = server.ServeConfig(name="kalos-unit-maxk", dim=8, device="cuda", dtype="int8", max_k=cap)
    assert server.make_index(at) == "index" and len(opened) == 1
    f16 = server.ServeConfig(name="kalos-unit-maxk", dim=8, device="cuda", dtype="float16", max_k=cap + 1)
    assert server.make_index(f16) == "index"  # float16 answers any k the layout allows


def test_the_scope_table_matches_struct_bellspaces() -> None:
    """The host's table (index_gpu.bell_spaces_table) is laid out as ``struct BellSpaces``:
    ids, then the images' lengths, then the filter masks' or lists' addresses, then the images
    of DOORBELL_SCOPE_ARGS_MAX bytes each (v1.6; v1.5's rule, DOORBELL_ARGS_MAX, is shorter),
    then the lists' lengths (last since session 54: the rest where it was before lists)."""
    d = defines()
    assert d["BELL_SPACES_MAX"] == index_gpu.BELL_SPACES_MAX
    assert 4 * d["BELL_ARGS_WORDS"] == index_gpu.BELL_ARGS_MAX == DOORBELL_SCOPE_ARGS_MAX > DOORBELL_ARGS_MAX
    assert d["BELL_ARGS_WORDS"] == 32  # one word per lane of the warp that reads them
    assert d["BELL_IMAGE_WORDS"] == d["BELL_SPACES_MAX"] * d["BELL_ARGS_WORDS"]
    m = d["BELL_SPACES_MAX"]
    fields = struct_fields("BellSpaces")
    image = 16 * m
    assert [(n, off) for n, off, _ in fields] == [("id", 0), ("len", 4 * m), ("mask", 8 * m), ("image", image),
                                                   ("rows", image + 4 * d["BELL_IMAGE_WORDS"])]  # fmt: skip
    assert fields[-1][1] + fields[-1][2] == index_gpu._BELL_SPACES.size


def test_the_scope_table_holds_each_scopes_exact_args_and_mask() -> None:
    """Each entry is the args a client writes for that scope (a namespace, a filter or both),
    zero-padded, and its filter mask's address, or its list's with the id NS_LIST and the
    list's length: the kernel compares a request's args with it byte for byte. Empty args (the
    default namespace's), args past 128 bytes, a negative id and repeated args are left out,
    and at most BELL_SPACES_MAX are kept, in the order given."""
    n, w = index_gpu.BELL_SPACES_MAX, index_gpu.BELL_ARGS_MAX
    fits = encode_recall_args("é" * 61, None)  # 122 bytes of UTF-8: args of 128
    flt = encode_recall_args("mem", b'{"user_id":"u-17"}')
    few = encode_recall_args("mem", b'{"user_id":"u-3"}')
    spaces = [(encode_recall_args("notes", None), 7, 0, -1), (b"", 0, 0, -1),
              (encode_recall_args("x" * 123, None), 3, 0, -1), (encode_recall_args("neg", None), -1, 0, -1),
              (fits, 9, 0, -1), (flt, 4, 0xABC000, -1), (few, 4, 0xDEF000, 37),
              (encode_recall_args("notes", None), 8, 0, -1)]  # fmt: skip
    spaces += [(encode_recall_args(f"s{i}", None), 10 + i, 0, -1) for i in range(n)]
    table, keys = index_gpu.bell_spaces_table(spaces)
    rest = [encode_recall_args(f"s{i}", None) for i in range(n - 4)]
    assert keys == (encode_recall_args("notes", None), fits, flt, few, *rest)
    ids = struct.unpack_from(f"<{n}i", table, 0)
    lens = struct.unpack_from(f"<{n}i", table, 4 * n)
    masks = struct.unpack_from(f"<{n}Q", table, 8 * n)
    rows = struct.unpack_from(f"<{n}i", table, 16 * n + w * n)
    assert ids == (7, 9, 4, index_gpu.NS_LIST, *range(10, 10 + n - 4))
    assert rows == (0, 0, 0, 37, *[0] * (n - 4))
    assert masks == (0, 0, 0xABC000, 0xDEF000, *[0] * (n - 4))
    for e, args in enumerate(keys):
        assert lens[e] == len(args) <= w
        assert table[16 * n + w * e : 16 * n + w * (e + 1)] == args.ljust(w, b"\0")
    assert len(fits) == w
    assert index_gpu.bell_spaces_table([]) == (bytes(index_gpu._BELL_SPACES.size), ())
    names, filters = index_gpu.scope_names(keys[:3])
    assert names == ["notes", "é" * 61] and filters == [{"namespace": "mem", "filter": {"user_id": "u-17"}}]


@pytest.mark.parametrize("dtype", ["float16", "int8", "float32"])
def test_the_list_builds_are_compiled_unless_lists_are_off(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """An index compiles the scans of a list of rows and the resident kernel's build that serves
    lists (session 52) with the rest at start, for its device (the compile split's workers
    compile under it); ``KALOS_FILTER_LIST=0``, under which the host never asks for them,
    leaves them out (they more than double the compile). Every template the host names exists
    in kernels/recall.cu."""
    asked: list[list[str]] = []
    devices: list[object] = []

    def compile_kernels(exprs: list[str], device: object = None) -> None:
        asked.append(list(exprs))
        devices.append(device)

    monkeypatch.setattr(index_gpu.kernels, "compile_kernels", compile_kernels)
    idx = index_gpu.GpuIndex.__new__(index_gpu.GpuIndex)
    idx.__dict__.update(metric=0, ctype=index_gpu._CTYPE[dtype], tpr=4, dtype=dtype, ordinal=3)
    for fraction in (16, 0):
        monkeypatch.setattr(index_gpu, "FILTER_LIST", fraction)
        idx._compile()
    on, off = asked
    assert devices == [3, 3]
    t = index_gpu._CTYPE[dtype]
    lists = {f"scan_list<{t}, 4, {qb}, 0>" for qb in (1, 2, 4, 8)} | {f"doorbell_topk<{t}, 4, 0, true>"}
    assert lists <= set(on) and not lists & set(off)
    assert set(on) - set(off) == lists and f"doorbell_topk<{t}, 4, 0, false>" in off
    for name in {e.split("<")[0] for e in on}:
        assert re.search(rf"\b{name}\(", SOURCE), name
