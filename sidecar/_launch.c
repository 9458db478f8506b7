/* The launch of a float16 batch queued behind the search on the device, in C.
 *
 * With 32 client processes at 1M rows, each batch (~15 queries, one per client) is queued
 * behind the pass the device is running (GpuIndex._launch_behind): its descriptor written into
 * the registered descriptor page, then eight CUDA calls (three graph launches, three event
 * records, two stream waits). In Python that launch took ~73 us on the H200 host (S31-2: ~37
 * of Python before the CUDA calls, most of it per member: each member's slot spec and its
 * three addresses; ~23 in the calls), and when the cohort's last client comes back late the
 * device waits for all of it. These two do the same from what the dispatcher already holds
 * (the members' slot numbers) and from a plan made once per captured graph:
 *
 *   desc(page, off, k, high, ns, out_ld, slots, table, overflow_off, maxq)
 *       write the descriptor at byte ``off`` of ``page`` (struct Desc of kernels/recall.cu:
 *       n, k, n_rows, ns_id, mask 0, out_ld, seq 0, then the queries', rows' and scores'
 *       addresses, ``maxq`` of each) for one query per slot of ``slots`` (Python ints), each
 *       slot's three addresses read from ``table`` (a C-contiguous uint64 array of shape
 *       (n_slots, 3): query, rows, scores), and clear the lane's overflow flag (an i32 at
 *       ``overflow_off``);
 *   run(plan)
 *       make the plan's CUDA driver calls in order (cuGraphLaunch, cuEventRecord,
 *       cuStreamWaitEvent through the function pointers at its head) and return None, or at
 *       the first that fails (rc, index of that call), having made none after it.
 *
 * Everything is checked: the slots against the table, the descriptor against the page, the
 * plan's length and codes; a mismatch is a bug of the caller, raised. Built against the stable
 * ABI (Py_LIMITED_API, 3.11) and optional, like sidecar/_hotpath.c: without it (no compiler),
 * or with KALOS_QUEUE_C=0, GpuIndex makes the same writes and calls in Python.
 * tests/unit/test_launch_c.py checks desc() against the Python writer and run() against
 * recording callbacks; tests/gpu/test_gpu_index.py runs queued chains through both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { DESC_HEAD = 32 };  /* struct Desc's head: i32 n, k, n_rows, ns_id; u64 mask; i32 out_ld, seq */
enum { OP_GRAPH = 1, OP_RECORD = 2, OP_WAIT = 3 };
enum { PLAN_HEAD = 4 };  /* u64: cuGraphLaunch, cuEventRecord, cuStreamWaitEvent, number of ops */
#define PLAN_MAX_OPS 64
#define MAXQ_MAX 1024

typedef int (*graph_launch_fn)(void* exec, void* stream);
typedef int (*event_record_fn)(void* event, void* stream);
typedef int (*stream_wait_fn)(void* stream, void* event, unsigned int flags);

static inline void st32(char* p, int32_t v) { memcpy(p, &v, 4); }
static inline void st64(char* p, uint64_t v) { memcpy(p, &v, 8); }

static int as_i32(PyObject* o, const char* what, long long lo, long long hi, int32_t* out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s out of range: %lld", what, v);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

PyDoc_STRVAR(desc_doc,
"desc(page, off, k, high, ns, out_ld, slots, table, overflow_off, maxq) -> None\n\n"
"Write a queued batch's descriptor at byte ``off`` of ``page`` (writable): one query per slot\n"
"of ``slots`` (a list of slot numbers, 1 to ``maxq`` of them), each query's, rows' and scores'\n"
"addresses taken from ``table`` (uint64, C-contiguous, one row of 3 per slot of the segment);\n"
"then clear the i32 overflow flag at ``overflow_off`` of ``page``. Raises, having written\n"
"nothing, where a value does not fit.");

static PyObject* desc(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "desc takes 10 arguments");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(args[1]), ovf = PyLong_AsSsize_t(args[8]), maxq = PyLong_AsSsize_t(args[9]);
    if ((off == -1 || ovf == -1 || maxq == -1) && PyErr_Occurred()) return NULL;
    int32_t k, high, ns, out_ld;
    if (as_i32(args[2], "k", 1, INT32_MAX, &k) < 0 || as_i32(args[3], "high", 0, INT32_MAX, &high) < 0 ||
        as_i32(args[4], "ns", INT32_MIN, INT32_MAX, &ns) < 0 || as_i32(args[5], "out_ld", 1, INT32_MAX, &out_ld) < 0)
        return NULL;
    PyObject* slots = args[6];
    if (!PyList_Check(slots)) {
        PyErr_SetString(PyExc_TypeError, "slots: a list of ints");
        return NULL;
    }
    Py_ssize_t n = PyList_Size(slots);
    if (maxq < 1 || maxq > MAXQ_MAX || n < 1 || n > maxq) {
        PyErr_Format(PyExc_ValueError, "%zd slots for a descriptor of %zd queries", n, maxq);
        return NULL;
    }
    Py_buffer pb, tb;
    if (PyObject_GetBuffer(args[0], &pb, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[7], &tb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&pb);
        return NULL;
    }
    PyObject* result = NULL;
    Py_ssize_t size = DESC_HEAD + 3 * 8 * maxq;
    if (off < 0 || off % 8 || off > pb.len - size || ovf < 0 || ovf > pb.len - 4 ||
        (ovf + 4 > off && ovf < off + size)) {
        PyErr_SetString(PyExc_ValueError, "the descriptor or the overflow flag does not fit the page");
        goto done;
    }
    const char* f = tb.format ? tb.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (tb.ndim != 2 || tb.shape[1] != 3 || tb.itemsize != 8 || (strcmp(f, "Q") && strcmp(f, "L"))) {
        PyErr_SetString(PyExc_ValueError, "table: a C-contiguous (n_slots, 3) array of uint64 (query, rows, scores)");
        goto done;
    }
    Py_ssize_t n_slots = tb.len / 24;
    Py_ssize_t at[MAXQ_MAX];  /* every slot checked before anything is written */
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyList_GetItem(slots, j));
        if (s == -1 && PyErr_Occurred()) goto done;
        if (s < 0 || s >= n_slots) {
            PyErr_Format(PyExc_ValueError, "slot %zd outside the table's %zd", s, n_slots);
            goto done;
        }
        at[j] = 24 * s;
    }
    char* d = (char*)pb.buf + off;
    st32(d, (int32_t)n);
    st32(d + 4, k);
    st32(d + 8, high);
    st32(d + 12, ns);
    st64(d + 16, 0);  /* no filter mask */
    st32(d + 24, out_ld);
    st32(d + 28, 0);
    for (int a = 0; a < 3; a++) {
        char* to = d + DESC_HEAD + 8 * maxq * a;
        for (Py_ssize_t j = 0; j < n; j++) memcpy(to + 8 * j, (const char*)tb.buf + at[j] + 8 * a, 8);
    }
    st32((char*)pb.buf + ovf, 0);
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&tb);
    PyBuffer_Release(&pb);
    return result;
}

PyDoc_STRVAR(run_doc,
"run(plan) -> None | (rc, i)\n\n"
"Make the CUDA driver calls of ``plan`` (u64: the addresses of cuGraphLaunch, cuEventRecord\n"
"and cuStreamWaitEvent, the number of calls, then per call its code and two handles: 1 graph\n"
"exec, stream; 2 event, stream (record); 3 stream, event (wait)) in order. None when every call\n"
"returned 0; else the first failing call's result and index, no call made after it.");

static PyObject* run(PyObject* self, PyObject* plan) {
    (void)self;
    Py_buffer b;
    if (PyObject_GetBuffer(plan, &b, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t w[PLAN_HEAD + 3 * PLAN_MAX_OPS];
    Py_ssize_t words = b.len / 8;
    if (b.len % 8 || words < PLAN_HEAD || words > PLAN_HEAD + 3 * PLAN_MAX_OPS) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "plan: u64 words, a head of 4 and 3 per call");
        return NULL;
    }
    memcpy(w, b.buf, b.len);
    PyBuffer_Release(&b);
    uint64_t n = w[3];
    if ((Py_ssize_t)n != (words - PLAN_HEAD) / 3 || (words - PLAN_HEAD) % 3 || !w[0] || !w[1] || !w[2]) {
        PyErr_SetString(PyExc_ValueError, "plan: its call count, or a driver function, is wrong");
        return NULL;
    }
    for (uint64_t i = 0; i < n; i++) {
        uint64_t c = w[PLAN_HEAD + 3 * i];
        if (c < OP_GRAPH || c > OP_WAIT) {
            PyErr_Format(PyExc_ValueError, "plan: call %llu has code %llu", (unsigned long long)i, (unsigned long long)c);
            return NULL;
        }
    }
    graph_launch_fn graph = (graph_launch_fn)(uintptr_t)w[0];
    event_record_fn record = (event_record_fn)(uintptr_t)w[1];
    stream_wait_fn wait = (stream_wait_fn)(uintptr_t)w[2];
    for (uint64_t i = 0; i < n; i++) {
        const uint64_t* op = w + PLAN_HEAD + 3 * i;
        void* a = (void*)(uintptr_t)op[1];
        void* h = (void*)(uintptr_t)op[2];
        int rc = op[0] == OP_GRAPH ? graph(a, h) : op[0] == OP_RECORD ? record(a, h) : wait(a, h, 0);
        if (rc) return Py_BuildValue("(iK)", rc, (unsigned long long)i);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"desc", (PyCFunction)(void (*)(void))desc, METH_FASTCALL, desc_doc},
    {"run", run, METH_O, run_doc},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject* m) {
    PyObject* vals = Py_BuildValue("{sisisisisisi}", "DESC_HEAD", DESC_HEAD, "OP_GRAPH", OP_GRAPH,
                                   "OP_RECORD", OP_RECORD, "OP_WAIT", OP_WAIT, "PLAN_HEAD", PLAN_HEAD,
                                   "PLAN_MAX_OPS", PLAN_MAX_OPS);
    if (!vals) return -1;
    int rc = PyModule_AddObjectRef(m, "CONSTANTS", vals);
    Py_DECREF(vals);
    return rc;
}

static PyModuleDef_Slot mod_slots[] = {{Py_mod_exec, exec_module}, {0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_launch",
    "A queued batch's descriptor and CUDA calls in C (see GpuIndex._launch_behind).", 0, methods, mod_slots,
    NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__launch(void) { return PyModuleDef_Init(&module); }
