/* giftcomm._codec_native.Channel: the one-shot exchange of persistent plans over node-shared memory.
 *
 * A channel is laid over a node-shared window (giftcomm.transport.shared_window: every rank maps
 * every rank's part). Each rank's part holds two slots, used by alternate calls:
 *
 *   slot s at s * stride:  [uint64 sequence number][pad to 64][4 int64 header words][pad to 128]
 *                          [payload: one wire message, up to `capacity` bytes]
 *
 * Call number c (1, 2, ...; counted alike on every rank, since every rank makes every call) writes
 * slot c % 2: the header, then (optionally) the encoded message, then stores c as the slot's
 * sequence number with release order; it then waits, with a deadline, until every peer's slot
 * c % 2 shows c (acquire order) and reads the P headers (and messages). A slot is rewritten two
 * calls later, and by then every peer has finished reading it: a rank posts call c + 1 only after
 * finishing call c, and the writer waited for that post. One memory synchronisation per call, no
 * message copies, no MPI call.
 *
 * Channel(views, rank, capacity, crowded, table)
 *   views: list of P writable uint8 buffers (every rank's part, all the same size, >= 2 * stride);
 *   rank: this rank; capacity: payload bytes per slot; crowded: yield the core while spinning
 *   (more ranks than cores); table: int64 buffer of P * 4 words that receives every call's headers.
 *   The buffers must outlive the channel or its close().
 *
 * call(code, word, caller, seed, x, out, fmt, block, key, avg, timeout) -> status
 *   Posts header [code, word, caller, seed] and, when x (float32[n], C-contiguous) is given,
 *   encode(x) (key: None or the Philox key of stochastic rounding, counter offset 0) as the
 *   payload; waits for every peer and copies the P headers into table. When out (writable
 *   float32[n]) is given, every rank's code is 0 and all headers are equal, out receives the sum
 *   of the P messages decoded in rank order (divided by P with avg). Status 0: every rank's code
 *   is 0 and all headers are equal (and out, when given, holds the sum).
 *   Status 1: headers differ or carry an error (read table; nothing decoded).
 *   Status 2: the deadline (timeout seconds; 0: none) passed; table rows of the ranks that had not
 *   arrived have -1 in column 0; the channel is closed. Status 3: x or out is not acceptable
 *   (dtype, contiguity, size, writability) and nothing was done: the caller checks them itself.
 *   Status 4: the channel is closed (an earlier call timed out or was interrupted, or close()).
 *   KeyboardInterrupt (or another signal handler's exception) closes the channel and propagates.
 * parity() -> the slot the next call writes; payload(q, s) offset: see stride / HEADER_BYTES.
 * close(): later calls return status 4.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "gc_codec.h"
#include "gc_channel.h"

#if defined(__GNUC__) && defined(__unix__)
#include <sched.h>
#define GC_HAVE_CHANNEL 1

#define SEQ_STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define SEQ_LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)

enum { HEADER_OFF = 64, PAYLOAD_OFF = 128, WORDS = 4 };
#define SPIN_S 0.002        /* spin this long before sleeping (short waits keep their latency) */
#define YIELD_AFTER_S 5e-5  /* then yield while spinning: a peer this late may be waiting for our core */
#define MAX_SLEEP_S 0.0002  /* longest sleep between looks once spinning stopped */
#define SIGNAL_EVERY_S 0.01 /* look for signals (Ctrl-C) this often while sleeping */

typedef struct {
    PyObject_HEAD
    int rank, size, crowded, closed;
    size_t capacity, stride;
    uint64_t seq;
    uint8_t **bases;
    int64_t *table;
    PyObject *keep; /* (views, table): the buffers stay referenced while the channel lives */
} Channel;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t *seq_of(const Channel *c, int q, int s) { return (uint64_t *)(c->bases[q] + (size_t)s * c->stride); }
static int64_t *header_of(const Channel *c, int q, int s) { return (int64_t *)(c->bases[q] + (size_t)s * c->stride + HEADER_OFF); }
static uint8_t *payload_of(const Channel *c, int q, int s) { return c->bases[q] + (size_t)s * c->stride + PAYLOAD_OFF; }

static int all_arrived(const Channel *c, int s, uint64_t n)
{
    for (int q = 0; q < c->size; q++)
        if (q != c->rank && SEQ_LOAD(seq_of(c, q, s)) != n)
            return 0;
    return 1;
}

static void Channel_dealloc(Channel *c)
{
    PyMem_Free(c->bases);
    Py_XDECREF(c->keep);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *Channel_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *views, *table;
    int rank, crowded;
    Py_ssize_t capacity;
    (void)kwds;
    if (!PyArg_ParseTuple(args, "O!inpO:Channel", &PyList_Type, &views, &rank, &capacity, &crowded, &table))
        return NULL;
    Py_ssize_t p = PyList_GET_SIZE(views);
    if (p < 1 || rank < 0 || rank >= p || capacity < 0) {
        PyErr_Format(PyExc_ValueError, "Channel: rank %d of %zd ranks, capacity %zd", rank, p, capacity);
        return NULL;
    }
    size_t stride = PAYLOAD_OFF + (((size_t)capacity + 63) / 64) * 64;
    Channel *c = (Channel *)type->tp_alloc(type, 0);
    if (!c)
        return NULL;
    c->rank = rank;
    c->size = (int)p;
    c->crowded = crowded;
    c->capacity = (size_t)capacity;
    c->stride = stride;
    c->bases = PyMem_Calloc((size_t)p, sizeof(uint8_t *));
    c->keep = Py_BuildValue("(OO)", views, table);
    if (!c->bases || !c->keep) {
        Py_DECREF(c);
        return PyErr_NoMemory();
    }
    Py_buffer b;
    for (Py_ssize_t q = 0; q <= p; q++) {
        PyObject *obj = q < p ? PyList_GET_ITEM(views, q) : table;
        if (PyObject_GetBuffer(obj, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(c);
            return NULL;
        }
        size_t need = q < p ? 2 * stride : (size_t)p * WORDS * 8;
        int bad = (size_t)b.len < need || (uintptr_t)b.buf % 8; /* 8: the sequence words are atomic */
        if (q < p)
            c->bases[q] = (uint8_t *)b.buf;
        else
            c->table = (int64_t *)b.buf;
        PyBuffer_Release(&b); /* the memory stays alive through c->keep */
        if (bad) {
            Py_DECREF(c);
            PyErr_Format(PyExc_ValueError, "Channel: buffer %zd is too small or misaligned (needs %zu bytes)", q, need);
            return NULL;
        }
    }
    return (PyObject *)c;
}

/* Wait (GIL released by the caller's state *ts) until every peer posted call n in slot s.
 * Returns 0, 2 (deadline), or -1 with a Python exception set (a signal handler raised). */
static int wait_peers(Channel *c, int s, uint64_t n, double timeout, PyThreadState **ts)
{
    double start = now_s(), last_signal = start;
    while (!all_arrived(c, s, n)) {
        double t = now_s(), waited = t - start;
        if (waited < SPIN_S) {
            if (c->crowded || waited > YIELD_AFTER_S)
                sched_yield();
            continue;
        }
        if (timeout > 0 && waited > timeout)
            return 2;
        double nap = waited / 16 < MAX_SLEEP_S ? waited / 16 : MAX_SLEEP_S;
        struct timespec req = {0, (long)(nap * 1e9)};
        nanosleep(&req, NULL);
        if (t - last_signal > SIGNAL_EVERY_S) {
            last_signal = t;
            PyEval_RestoreThread(*ts);
            int r = PyErr_CheckSignals();
            *ts = PyEval_SaveThread();
            if (r < 0)
                return -1;
        }
    }
    return 0;
}

static int get_floats(PyObject *obj, Py_buffer *b, int writable)
{
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        return -1;
    }
    const char *f = b->format ? b->format : "B";
    if ((f[0] == '@' || f[0] == '=' || f[0] == '<') && f[1])
        f++;
    if (b->itemsize != 4 || strcmp(f, "f") != 0) {
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static PyObject *Channel_call(Channel *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11)
        return PyErr_Format(PyExc_TypeError, "Channel.call takes 11 arguments, got %zd", nargs);
    if (c->closed)
        return PyLong_FromLong(4);
    int64_t head[WORDS];
    for (int i = 0; i < WORDS; i++) {
        head[i] = PyLong_AsLongLong(args[i]);
        if (head[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    PyObject *xo = args[4], *oo = args[5], *key = args[8];
    int fmt = PyLong_AsLong(args[6]);
    long long block = PyLong_AsLongLong(args[7]);
    int avg = PyObject_IsTrue(args[9]);
    double timeout = PyFloat_AsDouble(args[10]);
    if (PyErr_Occurred())
        return NULL;
    gc_rng rng = {0, 0, 0};
    if (key != Py_None) {
        unsigned long long k = PyLong_AsUnsignedLongLong(key);
        if (PyErr_Occurred())
            return NULL;
        rng.k0 = (uint32_t)k;
        rng.k1 = (uint32_t)(k >> 32);
    }
    Py_buffer x = {0}, out = {0};
    int have_x = xo != Py_None, have_out = oo != Py_None;
    size_t n = 0;
    if (have_x) {
        if (get_floats(xo, &x, 0) < 0)
            return PyLong_FromLong(3);
        n = (size_t)x.len / 4;
        if (block < 1 || gc_message_nbytes(n, fmt, (size_t)block) > c->capacity || (key != Py_None && !gc_is_scaled(fmt))) {
            PyBuffer_Release(&x);
            return PyLong_FromLong(3);
        }
    }
    if (have_out) {
        if (!have_x || get_floats(oo, &out, 1) < 0) {
            if (have_x)
                PyBuffer_Release(&x);
            return PyLong_FromLong(3);
        }
        if ((size_t)out.len != 4 * n) {
            PyBuffer_Release(&out);
            PyBuffer_Release(&x);
            return PyLong_FromLong(3);
        }
    }
    const gc_kernels *k = gc_active_kernels();
    uint64_t seq = ++c->seq;
    int s = (int)(seq & 1), status = 0, p = c->size;
    PyThreadState *ts = PyEval_SaveThread();
    memcpy(header_of(c, c->rank, s), head, sizeof head);
    if (have_x)
        k->encode(fmt, (const float *)x.buf, n, payload_of(c, c->rank, s), (size_t)block, key != Py_None ? &rng : NULL);
    SEQ_STORE(seq_of(c, c->rank, s), seq);
    int w = wait_peers(c, s, seq, timeout, &ts);
    if (w == 0) {
        int same = 1;
        for (int q = 0; q < p; q++) {
            const int64_t *h = header_of(c, q, s);
            memcpy(c->table + (size_t)q * WORDS, h, sizeof head);
            same &= h[0] == 0 && memcmp(h, head, sizeof head) == 0;
        }
        if (same && have_out) {
            float *acc = (float *)out.buf;
            k->decode(fmt, payload_of(c, 0, s), n, acc, (size_t)block);
            for (int q = 1; q < p; q++)
                k->decode_accumulate(fmt, payload_of(c, q, s), n, acc, (size_t)block);
            if (avg)
                for (size_t i = 0; i < n; i++)
                    acc[i] = acc[i] / (float)p;
        } else if (!same) {
            status = 1;
        }
    } else if (w == 2) {
        for (int q = 0; q < p; q++)
            c->table[(size_t)q * WORDS] = q == c->rank || SEQ_LOAD(seq_of(c, q, s)) == seq ? 0 : -1;
        status = 2;
        c->closed = 1;
    } else {
        c->closed = 1;
    }
    PyEval_RestoreThread(ts);
    if (have_out)
        PyBuffer_Release(&out);
    if (have_x)
        PyBuffer_Release(&x);
    if (w < 0)
        return NULL;
    return PyLong_FromLong(status);
}

static PyObject *Channel_parity(Channel *c, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLong((long)((c->seq + 1) & 1));
}

static PyObject *Channel_close(Channel *c, PyObject *unused)
{
    (void)unused;
    c->closed = 1;
    Py_RETURN_NONE;
}

static PyMethodDef channel_methods[] = {
    {"call", (PyCFunction)(void (*)(void))Channel_call, METH_FASTCALL,
     "call(code, word, caller, seed, x, out, fmt_code, block, key, avg, timeout) -> status (see the module "
     "comment of native/gc_channel.c)."},
    {"parity", (PyCFunction)Channel_parity, METH_NOARGS, "The slot (0 or 1) the next call writes."},
    {"close", (PyCFunction)Channel_close, METH_NOARGS, "Refuse every later call (status 4)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef channel_members[] = {
    {"stride", T_PYSSIZET, offsetof(Channel, stride), READONLY, "Bytes from one slot to the next."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ChannelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "giftcomm._codec_native.Channel",
    .tp_basicsize = sizeof(Channel),
    .tp_dealloc = (destructor)Channel_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The one-shot exchange of persistent plans over node-shared memory (native/gc_channel.c).",
    .tp_methods = channel_methods,
    .tp_members = channel_members,
    .tp_new = Channel_new,
};

int gc_channel_register(PyObject *module)
{
    if (PyType_Ready(&ChannelType) < 0)
        return -1;
    Py_INCREF(&ChannelType);
    if (PyModule_AddObject(module, "Channel", (PyObject *)&ChannelType) < 0) {
        Py_DECREF(&ChannelType);
        return -1;
    }
    return PyModule_AddIntConstant(module, "CHANNEL_PAYLOAD_OFFSET", PAYLOAD_OFF);
}

#else /* no GCC atomics or POSIX clocks: no channel; giftcomm.persistent sends messages instead */

int gc_channel_register(PyObject *module)
{
    (void)module;
    return 0;
}

#endif
