/* The sidecar's batch-1 recall, in C: taking the request and writing the answer.
 *
 * A CPU sidecar's recall of 100k x 384 rows streams 150 MB through the caches, and the
 * Python that takes the next request and writes the answer then runs cold: ~25-40 us each
 * on the H200 host, 70-90 us on the development VM (benchmarks/dispatcher_batch.py --cold),
 * most of what the sidecar added to an in-process numpy search (issue 2). The dispatcher's
 * short path for a lone recall (Dispatcher._lone) calls these two around the search:
 *
 *   take(slot, layout)     copy the request words once, check them as validate_request
 *                          does, check the deadline and that the query is finite, mark the
 *                          slot BUSY, and return the words (protocol.Request's fields);
 *   answer1(slot, ...)     write the search's rows and scores into the slot, check each
 *                          row the answer names, write the answer's blob (the documents as
 *                          encode_docs_blob lays them out, or for a client that reads them
 *                          from the arena their generations or whole entries, as
 *                          ArenaWriter.refs gives them), the response words, and then the
 *                          state word RESPONSE.
 *
 * A batch's members (several clients at once, a GPU sidecar's usual case) are searched
 * together and then answered by answer1 one by one (Dispatcher._answer_hot), from the rows the
 * search wrote into each slot: in Python that answer cost ~120-130 us per batch of ~16 on the
 * H200 host (S19-5).
 *
 * Each does only the common case, completely, and otherwise returns None / False having
 * written nothing it should not: the dispatcher's Python path (sidecar/dispatcher.py) then
 * goes on its own way, reading the slot afresh and answering any error with its message.
 * take() leaves to Python every op but RECALL, batches, namespaces and filters (args: unless
 * asked to hand them over, as the dispatcher does, whose Python decodes them), an expired
 * deadline, a query that is not finite and anything validate_request would refuse;
 * answer1() leaves answers with vectors, answers that would not fit the blob (Python sends
 * those in parts), rows out of range, and rows that hold no document.
 *
 * Nothing read from the slot is trusted: its words, and a batch member's rows, are copied
 * once and the copies checked and used (another process may rewrite the slot meanwhile: a
 * row checked and then read again could index the arena's table far outside it, as the
 * scenario in tests/reliability/test_hotpath_hostile.py did to a build that read them
 * twice), and every offset is checked against the buffers' lengths. Built against the stable
 * ABI (Py_LIMITED_API, 3.11) and optional, like the client's kalos_retrievers/_fastpath.c
 * (KALOS_HOTPATH=0 turns it off).
 * x86-64 store ordering: the answer's words are written before the state word (a release
 * store). The offsets and values below are protocol v1's; tests/unit/test_hotpath.py checks
 * them against protocol.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

enum {
    OFF_STATE = 0, OFF_SEQ = 8, OFF_OP = 16, OFF_FLAGS = 20, OFF_TOP_K = 24, OFF_N_ITEMS = 28,
    OFF_VEC_LEN = 32, OFF_ARGS_LEN = 40, OFF_DEADLINE = 48, OFF_RESP_SEQ = 56, OFF_STATUS = 64,
    OFF_N_RESULTS = 68, OFF_RESP_LEN = 72, OFF_RESP_FLAGS = 80, CTL_SIZE = 128,
};
enum { ST_BUSY = 3, ST_RESPONSE = 4 };
enum { OP_RECALL = 2 };
enum { FL_WITH_VECTORS = 1, FL_NO_DOCS = 2, FL_ARENA_DOCS = 4, FL_ARENA_ENTRIES = 8, KNOWN_FLAGS = 15 };
enum { RESP_ARENA_DOCS = 4, RESP_ARENA_ENTRIES = 8 };
#define ENTRY_SIZE 16
#define ENTRY_LEN_AT 8   /* an arena entry: u64 offset, u32 length, u32 gen */
#define ENTRY_GEN_AT 12

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* time.monotonic_ns()'s clock, the deadlines' */
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint32_t ld32(const char* p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t ld64(const char* p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void st32(char* p, uint32_t v) { memcpy(p, &v, 4); }
static inline void st64(char* p, uint64_t v) { memcpy(p, &v, 8); }

/* The slot's geometry: (dim, payload_off, rows_off, scores_off, blob_off, blob_size, max_k,
   max_results), offsets within the slot (protocol.Layout). */
typedef struct { long long dim, payload, rows, scores, blob, blob_size, max_k, max_results; } Layout;

static int read_layout(PyObject* t, Layout* l) {
    long long* f[] = {&l->dim, &l->payload, &l->rows, &l->scores, &l->blob, &l->blob_size, &l->max_k, &l->max_results};
    if (!PyTuple_Check(t) || PyTuple_Size(t) != 8) {
        PyErr_SetString(PyExc_TypeError, "layout: a tuple of 8 ints");
        return -1;
    }
    for (int i = 0; i < 8; i++) {
        *f[i] = PyLong_AsLongLong(PyTuple_GetItem(t, i));
        if (*f[i] == -1 && PyErr_Occurred()) return -1;
        if (*f[i] < 0 || *f[i] > ((long long)1 << 40)) {
            PyErr_SetString(PyExc_ValueError, "layout: a value out of range");
            return -1;
        }
    }
    return 0;
}

/* The layout's areas all inside a slot buffer of `len` bytes (a layout, unlike the slot's
   words, comes from the sidecar itself: a mismatch is a bug, raised). */
static int check_fits(const Layout* l, Py_ssize_t len) {
    if (l->payload < CTL_SIZE || l->payload + 4 * l->dim > len || l->rows < l->payload + 4 * l->dim ||
        l->rows + 4 * l->max_results > len ||
        l->scores + 4 * l->max_results > len || l->blob + l->blob_size > len) {
        PyErr_SetString(PyExc_ValueError, "the layout does not fit the slot buffer");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(take_doc,
"take(slot, layout[, with_args]) -> (seq, op, flags, top_k, n_items, vec_len, args_len, deadline_ns[, args]) | None\n\n"
"Take a batch-1 recall in the default namespace from ``slot`` (the slot's bytes, writable), a\n"
"slot the dispatcher found in state REQUEST or DOORBELL: its request words copied once and\n"
"checked (as protocol.validate_request does), its deadline not passed and its query finite,\n"
"the slot is marked BUSY and the copied words returned. None, with nothing written, for\n"
"anything else: the caller then takes the request its own way.\n"
"``with_args`` true: a recall with args (a namespace, a filter) is taken too, and the words\n"
"come with a ninth item, the args' bytes (copied once; b\"\" for none), for the caller to\n"
"decode (protocol.decode_recall_args) and answer any error of.\n"
"``layout``: (dim, payload_off, rows_off, scores_off, blob_off, blob_size, max_k, max_results).");

static PyObject* take(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "take takes 2 or 3 arguments");
        return NULL;
    }
    Layout lay;
    if (read_layout(args[1], &lay) < 0) return NULL;
    const int with_args = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (with_args < 0) return NULL;
    Py_buffer sb;
    if (PyObject_GetBuffer(args[0], &sb, PyBUF_WRITABLE) < 0) return NULL;
    PyObject* result = NULL;
    if (check_fits(&lay, sb.len) < 0) goto out;
    char* s = (char*)sb.buf;
    /* the request words copied once (after the state word the caller read: loads are not
       reordered with older loads on x86), then checked and used from the copy */
    char w[OFF_DEADLINE + 8 - OFF_SEQ];
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    memcpy(w, (const char*)s + OFF_SEQ, sizeof w);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);  /* the copy is not re-read from the slot */
    const uint64_t seq = ld64(w), vec_len = ld64(w + OFF_VEC_LEN - OFF_SEQ);
    const uint64_t args_len = ld64(w + OFF_ARGS_LEN - OFF_SEQ), deadline = ld64(w + OFF_DEADLINE - OFF_SEQ);
    const uint32_t op = ld32(w + OFF_OP - OFF_SEQ), flags = ld32(w + OFF_FLAGS - OFF_SEQ);
    const uint32_t top_k = ld32(w + OFF_TOP_K - OFF_SEQ), n_items = ld32(w + OFF_N_ITEMS - OFF_SEQ);
    /* the args at the query's 8-byte-aligned end, within the payload (validate_request's bound) */
    const uint64_t args_at = (vec_len + 7) & ~(uint64_t)7;
    if (op != OP_RECALL || n_items != 1 || (args_len && !with_args) || vec_len != (uint64_t)(4 * lay.dim) ||
        args_len > (uint64_t)(lay.rows - lay.payload) || args_at + args_len > (uint64_t)(lay.rows - lay.payload) ||
        top_k < 1 || top_k > (uint64_t)lay.max_k || top_k > (uint64_t)lay.max_results ||
        (flags & ~(uint32_t)KNOWN_FLAGS) || ((flags & FL_ARENA_ENTRIES) && !(flags & FL_ARENA_DOCS)) ||
        (deadline && now_ns() > deadline)) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    const char* q = s + lay.payload;
    for (long long i = 0; i < lay.dim; i++) {
        float x;
        memcpy(&x, q + 4 * i, 4);
        if (!isfinite(x)) {
            result = Py_NewRef(Py_None);
            goto out;
        }
    }
    if (with_args)  /* (y#: the args copied into a bytes object: read from the slot once) */
        result = Py_BuildValue("(KIIIIKKKy#)", (unsigned long long)seq, (unsigned int)op, (unsigned int)flags,
                               (unsigned int)top_k, (unsigned int)n_items, (unsigned long long)vec_len,
                               (unsigned long long)args_len, (unsigned long long)deadline,
                               s + lay.payload + args_at, (Py_ssize_t)args_len);
    else
        result = Py_BuildValue("(KIIIIKKK)", (unsigned long long)seq, (unsigned int)op, (unsigned int)flags,
                               (unsigned int)top_k, (unsigned int)n_items, (unsigned long long)vec_len,
                               (unsigned long long)args_len, (unsigned long long)deadline);
    if (result)  /* (the slot is ours only with its words in hand: a failed build writes nothing) */
        __atomic_store_n((uint32_t*)(s + OFF_STATE), (uint32_t)ST_BUSY, __ATOMIC_RELEASE);
out:
    PyBuffer_Release(&sb);
    return result;
}

/* A C-contiguous buffer of float32 or int32 values (format `want`, "f" or "i"), as numpy
   exports them; -1 with TypeError otherwise. */
static int get_values(PyObject* o, Py_buffer* b, const char* want) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char* fmt = b->format ? b->format : "B";
    if (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@') fmt++;
    if (b->itemsize != 4 || strcmp(fmt, want) != 0) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_TypeError, "answer1: expected a contiguous %s array of 4-byte values",
                     want[0] == 'f' ? "float32" : "int32");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(answer1_doc,
"answer1(slot, layout, seq, flags, rows, scores, high, docs, arena) -> bool\n\n"
"Write a batch-1 recall's results into ``slot``: the search's ``rows`` (int32) and ``scores``\n"
"(float32), kk = len(rows) of each, into the slot's rows and scores areas; then, if it can,\n"
"the whole answer the request's ``flags`` ask for, as the dispatcher's Python path writes it:\n"
"\n"
"* NO_DOCS: rows and scores only (an empty blob);\n"
"* ARENA_DOCS, with ``arena`` (table, rows_cap, version) and every row below rows_cap: the\n"
"  blob ArenaWriter.refs gives (each row's generation, or with ARENA_ENTRIES the u64 version\n"
"  and each row's 16-byte entry), every row's entry holding a document;\n"
"* otherwise the documents themselves, ``docs[row]`` (bytes) of each row, as\n"
"  protocol.encode_docs_blob lays them out;\n"
"\n"
"then the response words (``seq``, status OK, kk results, the response flags) and the state\n"
"word RESPONSE, and returns True. Every row a blob names is checked first: 0 <= row <\n"
"``high`` and a document there. False when it wrote the results only (vectors asked for, a\n"
"check that failed, a blob larger than the slot's): the caller answers from the slot's rows\n"
"its own way. ``docs``: the rows' documents, a list of bytes or None; ``table``: the arena's\n"
"row table, rows_cap x 16 bytes.\n"
"\n"
"``rows`` and ``scores`` may be the slot's own rows and scores areas (a batch's member, whose\n"
"results the device wrote there): they are then left as they are, not copied onto\n"
"themselves. Either way each row is read once, into answer1's own copy, and only that copy\n"
"is checked and named in the answer (the slot's owner may rewrite its rows meanwhile).");

static PyObject* answer1(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "answer1 takes 9 arguments");
        return NULL;
    }
    Layout lay;
    if (read_layout(args[1], &lay) < 0) return NULL;
    const unsigned long long seq = PyLong_AsUnsignedLongLong(args[2]);
    const long long flags = PyLong_AsLongLong(args[3]);
    const long long high = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    PyObject* docs = args[7];
    if (!PyList_Check(docs)) {
        PyErr_SetString(PyExc_TypeError, "answer1: docs must be a list");
        return NULL;
    }
    long long rows_cap = 0;
    unsigned long long version = 0;
    PyObject* table_obj = NULL;
    if (args[8] != Py_None) {
        if (!PyTuple_Check(args[8]) || PyTuple_Size(args[8]) != 3) {
            PyErr_SetString(PyExc_TypeError, "answer1: arena is None or (table, rows_cap, version)");
            return NULL;
        }
        table_obj = PyTuple_GetItem(args[8], 0);
        rows_cap = PyLong_AsLongLong(PyTuple_GetItem(args[8], 1));
        version = PyLong_AsUnsignedLongLong(PyTuple_GetItem(args[8], 2));
        if (PyErr_Occurred()) return NULL;
    }
    if (high < 0 || rows_cap < 0 || flags < 0) {
        PyErr_SetString(PyExc_ValueError, "answer1: flags, high and rows_cap must not be negative");
        return NULL;
    }
    Py_buffer sb, rb, cb, tb;
    if (PyObject_GetBuffer(args[0], &sb, PyBUF_WRITABLE) < 0) return NULL;
    if (get_values(args[4], &rb, "i") < 0) {
        PyBuffer_Release(&sb);
        return NULL;
    }
    if (get_values(args[5], &cb, "f") < 0) {
        PyBuffer_Release(&sb);
        PyBuffer_Release(&rb);
        return NULL;
    }
    int have_table = 0;
    PyObject* result = NULL;
    const long long kk = rb.len / 4;
    int32_t small[256];  /* the rows' copy: here for the usual k, else on the heap */
    int32_t* rows = small;
    if (check_fits(&lay, sb.len) < 0) goto out;
    if (cb.len != rb.len || kk > lay.max_results) {
        PyErr_SetString(PyExc_ValueError, "answer1: rows and scores differ in length or exceed the slot's results");
        goto out;
    }
    char* s = (char*)sb.buf;
    /* The rows copied once and from then on checked and used from the copy: a batch's rows
       (Dispatcher._answer_hot) are the slot's own rows area, where the device wrote them,
       and the slot's owner may rewrite them meanwhile (a row checked, then read again out of
       range, would index the table or the documents outside them). */
    if (kk > (long long)(sizeof small / sizeof small[0])) {
        rows = PyMem_Malloc((size_t)rb.len);
        if (rows == NULL) {
            PyErr_NoMemory();
            goto out;
        }
    }
    if (kk) memcpy(rows, rb.buf, (size_t)rb.len);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);  /* the copy is not re-read from the slot */
    /* the results into the slot's areas, unless they are there already (a batch's: the same
       memory, where a copy onto itself is formally undefined, and would write back values its
       owner may have changed since) */
    if (s + lay.rows != (char*)rb.buf) memcpy(s + lay.rows, rows, (size_t)rb.len);
    if (s + lay.scores != (char*)cb.buf) memmove(s + lay.scores, cb.buf, (size_t)cb.len);
    result = Py_NewRef(Py_False);  /* from here on: the results are written, the answer maybe not */
    if (flags & FL_WITH_VECTORS) goto out;
    char* b = s + lay.blob;
    long long need = 0;
    uint64_t rflags = 0;
    if (flags & FL_NO_DOCS) {
        /* rows and scores only: nothing names a row, nothing to check (as the Python path) */
    } else {
        for (long long i = 0; i < kk; i++)
            if (rows[i] < 0 || rows[i] >= high) goto out;
        int arena = table_obj != NULL && (flags & FL_ARENA_DOCS);
        for (long long i = 0; arena && i < kk; i++) arena = rows[i] < rows_cap;  /* else inline */
        if (arena) {
            if (PyObject_GetBuffer(table_obj, &tb, PyBUF_SIMPLE) < 0) {
                Py_CLEAR(result);
                goto out;
            }
            have_table = 1;
            if (rows_cap > tb.len / ENTRY_SIZE) {
                Py_CLEAR(result);
                PyErr_SetString(PyExc_ValueError, "answer1: the arena's table is shorter than rows_cap entries");
                goto out;
            }
            const char* table = (const char*)tb.buf;
            const int entries = (flags & FL_ARENA_ENTRIES) != 0;
            need = entries ? 8 + ENTRY_SIZE * kk : 4 * kk;
            if (need > lay.blob_size) goto out;
            for (long long i = 0; i < kk; i++)
                if (ld32(table + ENTRY_SIZE * (size_t)rows[i] + ENTRY_LEN_AT) == 0) goto out;
            if (entries) {
                st64(b, version);
                for (long long i = 0; i < kk; i++)
                    memcpy(b + 8 + ENTRY_SIZE * i, table + ENTRY_SIZE * (size_t)rows[i], ENTRY_SIZE);
            } else {
                for (long long i = 0; i < kk; i++)
                    memcpy(b + 4 * i, table + ENTRY_SIZE * (size_t)rows[i] + ENTRY_GEN_AT, 4);
            }
            rflags = RESP_ARENA_DOCS | (entries ? RESP_ARENA_ENTRIES : 0);
        } else {
            /* the documents inline: [u32 n][u32 offsets x (n + 1)][docs], encode_docs_blob's layout */
            const Py_ssize_t n_docs = PyList_Size(docs);
            need = 4 * (kk + 2);
            for (long long i = 0; i < kk; i++) {
                PyObject* d = rows[i] < n_docs ? PyList_GetItem(docs, rows[i]) : NULL;
                if (d == NULL || !PyBytes_Check(d)) goto out;  /* no document (None): Python refuses */
                need += PyBytes_Size(d);
            }
            if (need > lay.blob_size || need > 0xffffffffLL) goto out;  /* Python sends it in parts */
            st32(b, (uint32_t)kk);
            uint32_t at = 0;
            char* body = b + 4 * (kk + 2);
            for (long long i = 0; i < kk; i++) {
                PyObject* d = PyList_GetItem(docs, rows[i]);
                const Py_ssize_t len = PyBytes_Size(d);
                st32(b + 4 * (1 + i), at);
                memcpy(body + at, PyBytes_AsString(d), (size_t)len);
                at += (uint32_t)len;
            }
            st32(b + 4 * (1 + kk), at);
        }
    }
    st64(s + OFF_RESP_SEQ, seq);
    st32(s + OFF_STATUS, 0);
    st32(s + OFF_N_RESULTS, (uint32_t)kk);
    st64(s + OFF_RESP_LEN, (uint64_t)need);
    st64(s + OFF_RESP_FLAGS, rflags);
    __atomic_store_n((uint32_t*)(s + OFF_STATE), (uint32_t)ST_RESPONSE, __ATOMIC_RELEASE);
    Py_DECREF(result);
    result = Py_NewRef(Py_True);
out:
    if (rows != small) PyMem_Free(rows);
    if (have_table) PyBuffer_Release(&tb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&cb);
    return result;
}

static PyMethodDef methods[] = {
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL, take_doc},
    {"answer1", (PyCFunction)(void (*)(void))answer1, METH_FASTCALL, answer1_doc},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject* m) {
    PyObject* offs = Py_BuildValue("{sisisisisisisisisisisisisisi}", "state", OFF_STATE, "seq", OFF_SEQ,
                                   "op", OFF_OP, "flags", OFF_FLAGS, "top_k", OFF_TOP_K, "n_items", OFF_N_ITEMS,
                                   "vec_len", OFF_VEC_LEN, "args_len", OFF_ARGS_LEN, "deadline_ns", OFF_DEADLINE,
                                   "resp_seq", OFF_RESP_SEQ, "status", OFF_STATUS, "n_results", OFF_N_RESULTS,
                                   "resp_len", OFF_RESP_LEN, "resp_flags", OFF_RESP_FLAGS);
    if (!offs) return -1;
    int rc = PyModule_AddObjectRef(m, "CTL_OFFSETS", offs);
    Py_DECREF(offs);
    if (rc < 0) return -1;
    PyObject* vals = Py_BuildValue("{sisisisisisisisisisisisi}", "BUSY", ST_BUSY, "RESPONSE", ST_RESPONSE,
                                   "RECALL", OP_RECALL, "WITH_VECTORS", FL_WITH_VECTORS, "NO_DOCS", FL_NO_DOCS,
                                   "ARENA_DOCS", FL_ARENA_DOCS, "ARENA_ENTRIES", FL_ARENA_ENTRIES,
                                   "KNOWN_FLAGS", KNOWN_FLAGS, "RESP_ARENA_DOCS", RESP_ARENA_DOCS,
                                   "RESP_ARENA_ENTRIES", RESP_ARENA_ENTRIES, "ENTRY_SIZE", ENTRY_SIZE,
                                   "CTL_SIZE", CTL_SIZE);
    if (!vals) return -1;
    rc = PyModule_AddObjectRef(m, "CONSTANTS", vals);
    Py_DECREF(vals);
    if (rc < 0) return -1;
    /* take's with_args (session 46): a dispatcher finding an extension built before takes
       only recalls without args */
    return PyModule_AddIntConstant(m, "TAKE_ARGS", 1);
}

static PyModuleDef_Slot slots[] = {{Py_mod_exec, exec_module}, {0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hotpath",
    "The sidecar's batch-1 recall in C: take the request, write the arena answer.", 0, methods, slots,
    NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hotpath(void) { return PyModuleDef_Init(&module); }
