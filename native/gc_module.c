/* giftcomm._codec_native: CPython bindings of the native CPU codec.
 *
 * Functions (all arguments are objects exporting the buffer protocol, C-contiguous; float32
 * buffers must have item format 'f', message buffers itemsize 1; sizes in bytes are checked
 * against giftcomm.formats.message_nbytes and raise ValueError on mismatch):
 *
 *   encode(x, out, fmt_code, block[, key, offset])  x: n float32 -> out: uint8[message_nbytes(n)]
 *   decode(msg, out, fmt_code, block)           msg: uint8[message_nbytes(n)] -> out: n float32
 *   decode_add_encode(msg_in, local, msg_out, sum_out, fmt_code, block[, key, offset])
 *                                               msg_out = encode(fp32(decode(msg_in) + local));
 *                                               sum_out: n float32 or None, receives the sum
 *   decode_accumulate(msg, acc, fmt_code, block)    acc (n float32) += decode(msg)
 *
 * fmt_code: giftcomm.formats.Format.variant_code: the format code (native/gc_formats.h, generated
 * from giftcomm/formats.py) plus, for the E8M0 formats, the scale rule << GC_SCALE_RULE_SHIFT;
 * block: 1..2^20 elements per scale (checked for every format, used by e4m3/e5m2; a fixed-block
 * format takes only its own). A code these kernels do not implement is a ValueError. An adaptive
 * row's code carries, in place of the scale rule, the slot of its spec (gc_adaptive.h), registered
 * with _adaptive_slot; decoding a message whose choice bits do not give the row's tier counts is
 * the reference's ValueError ("corrupt adaptive message: ...").
 *
 *   _adaptive_slot(budget_mbits, frame, share8_permille, top, mid, block) -> slot (1..63): register
 *                 an AdaptiveSpec (an equal one gets the same slot); ValueError for a spec these
 *                 kernels cannot run (a budget below the all-2-bit frames, an unknown tier element).
 *
 *   _formats() -> {name: facts} of the formats these kernels implement (facts: GC_<NAME>_FACTS as
 *                 compiled; giftcomm.codec compares them with giftcomm.formats_header.format_facts).
 * key: None (round to nearest even) or an int in [0, 2^64): stochastic rounding with Philox4x32-10
 * keyed by it, element i of the message using counter offset + i (offset: int in [0, 2^64), default
 * 0). Stochastic rounding of a pass-through format is a ValueError. The GIL is released
 * while the kernels run. Exact aliasing of an input and an output of the same call (msg_in is
 * msg_out, or sum_out is local) is allowed; partial overlap is not.
 *
 * Channel: the plan channel over node-shared memory (native/gc_channel.c).
 *
 * Private helpers for tests and benchmarks: _isa() -> the kernel variant in use ("generic",
 * "avx2", "avx512", "avx512vbmi"); _isas() -> the variants this CPU can run; _set_isa(name). The variant is
 * chosen at import: the best one the CPU supports, or GIFTCOMM_NATIVE_ISA if set (an unknown or
 * unsupported name warns and is ignored).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "gc_codec.h"
#include "gc_channel.h"

static const gc_kernels *g_kernels = &gc_kernels_generic;

gc_ada_spec gc_ada_specs[GC_ADA_SLOTS];
int gc_ada_nslots = 1; /* slot 0 stays unregistered */

static int isa_supported(const gc_kernels *k)
{
    if (k == &gc_kernels_generic)
        return 1;
#if defined(GC_HAVE_X86_VARIANTS)
    __builtin_cpu_init();
    if (k == &gc_kernels_avx2)
        return __builtin_cpu_supports("avx2");
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (k == &gc_kernels_avx512)
        return avx512;
    if (k == &gc_kernels_avx512vbmi)
        return avx512 && __builtin_cpu_supports("avx512vbmi");
#endif
    return 0;
}

static const gc_kernels *const g_all[] = {
#if defined(GC_HAVE_X86_VARIANTS)
    &gc_kernels_avx512vbmi, &gc_kernels_avx512, &gc_kernels_avx2,
#endif
    &gc_kernels_generic,
};
#define N_ISAS (sizeof(g_all) / sizeof(g_all[0]))

/* ---- argument handling ----
 * `fmt` arguments are variant codes (giftcomm.formats.Format.variant_code): the format code in the
 * low bits, the E8M0 formats' scale rule above them. A code of the table that these kernels do
 * not implement is rejected here (giftcomm.codec runs such formats on the reference). */

static const gc_format_row *format_of(int v)
{
    const gc_format_row *f = gc_format_row_of(GC_VARIANT_FORMAT(v));
    return f && gc_implemented(f->code) ? f : NULL;
}

static int rule_ok(const gc_format_row *f, int v)
{
    int rule = GC_VARIANT_RULE(v);
    if (f->scale == GC_SCALE_ADAPTIVE) /* the rule bits carry the registered spec's slot */
        return v >= 0 && gc_ada_spec_of(v) != NULL;
    return v >= 0 && (rule == GC_RULE_CEIL || (rule == GC_RULE_FLOOR && f->scale == GC_SCALE_E8M0));
}

static int ada_block_ok(size_t block)
{
    return block % GC_ADA_BLOCK_MULTIPLE == 0 && block <= GC_ADA_MAX_BLOCK;
}

static int check_fmt_block(int v, long long block)
{
    const gc_format_row *f = format_of(v);
    if (!f) {
        PyErr_Format(PyExc_ValueError, "format code %d is not implemented by the native kernels (see "
                     "giftcomm.codec.native_formats())", GC_VARIANT_FORMAT(v));
        return -1;
    }
    if (!rule_ok(f, v) && f->scale == GC_SCALE_ADAPTIVE) {
        PyErr_Format(PyExc_ValueError, "variant code %d: adaptive format %s takes the slot of a spec registered "
                     "with _adaptive_slot (giftcomm.codec.native_code), got slot %d", v, f->name, GC_VARIANT_RULE(v));
        return -1;
    }
    if (!rule_ok(f, v)) {
        PyErr_Format(PyExc_ValueError, "variant code %d: scale rule %d is not one format %s takes", v,
                     GC_VARIANT_RULE(v), f->name);
        return -1;
    }
    if (f->fixed_block && block != (long long)f->fixed_block) {
        PyErr_Format(PyExc_ValueError, "format %s has a fixed block of %d values, got %lld", f->name,
                     f->fixed_block, block);
        return -1;
    }
    if (block < 1 || block > (long long)GC_MAX_BLOCK) {
        PyErr_Format(PyExc_ValueError, "block must be between 1 and %u, got %lld", GC_MAX_BLOCK, block);
        return -1;
    }
    if (f->scale == GC_SCALE_ADAPTIVE && !ada_block_ok((size_t)block)) {
        PyErr_Format(PyExc_ValueError, "the native kernels take adaptive super-blocks of a multiple of %u values up "
                     "to %u, got %lld", GC_ADA_BLOCK_MULTIPLE, GC_ADA_MAX_BLOCK, block);
        return -1;
    }
    return 0;
}

/* ValueError (the reference's words) when a frame's choice bits do not give the row's tier counts */
static int check_ada_message(int v, const Py_buffer *msg, size_t n, size_t block)
{
    const gc_ada_spec *sp = GC_FMT_SCALE(GC_VARIANT_FORMAT(v)) == GC_SCALE_ADAPTIVE ? gc_ada_spec_of(v) : NULL;
    size_t bad, k8, k4;
    if (!sp || !gc_ada_find_corrupt(sp, (const uint8_t *)msg->buf, n, block, &bad))
        return 0;
    gc_ada_counts(sp, bad, block, &k8, &k4);
    PyErr_Format(PyExc_ValueError, "corrupt adaptive message: a frame's choice bits do not give (%zu, %zu, %zu) "
                 "super-blocks at 8/4/2 bits", k8, k4, bad - k8 - k4);
    return -1;
}

/* message_nbytes(n, fmt, block) of a valid variant */
static size_t msg_nbytes(size_t n, int v, size_t block)
{
    int fmt = GC_VARIANT_FORMAT(v);
    switch (GC_FMT_SCALE(fmt)) {
    case GC_SCALE_F32: return gc_scales_offset(n) + 4 * ((n + block - 1) / block);
    case GC_SCALE_NVFP4: return gc_group_offset(n) + 4 * ((n + GC_NVFP4_GROUP - 1) / GC_NVFP4_GROUP);
    case GC_SCALE_E8M0: return gc_payload_bytes(n, fmt) + (n + block - 1) / block;
    case GC_SCALE_ADAPTIVE: return gc_ada_message_bytes(gc_ada_spec_of(v), n, block);
    default: return n * (size_t)GC_FMT_ITEMSIZE(fmt);
    }
}

const gc_kernels *gc_active_kernels(void) { return g_kernels; }

size_t gc_message_nbytes(size_t n, int v, size_t block)
{
    const gc_format_row *f = format_of(v);
    if (!f || !rule_ok(f, v) || block < 1 || block > GC_MAX_BLOCK || (f->fixed_block && block != (size_t)f->fixed_block)
        || (f->scale == GC_SCALE_ADAPTIVE && !ada_block_ok(block)))
        return SIZE_MAX;
    return msg_nbytes(n, v, block);
}

int gc_is_scaled(int v) { return GC_FMT_SCALE(GC_VARIANT_FORMAT(v)) != GC_SCALE_NONE; }

/* key (None or int in [0, 2^64)) and offset -> *rng; returns 1 (stochastic), 0 (nearest), -1 error */
static int get_rng(PyObject *key, unsigned long long offset, int fmt, gc_rng *rng)
{
    if (key == NULL || key == Py_None)
        return 0;
    if (!gc_is_scaled(fmt)) {
        PyErr_Format(PyExc_ValueError, "stochastic rounding needs a block-scaled format (format code %d)", fmt);
        return -1;
    }
    unsigned long long k = PyLong_AsUnsignedLongLong(key);
    if (k == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "key must be None or an int in [0, 2**64)");
        return -1;
    }
    rng->k0 = (uint32_t)k;
    rng->k1 = (uint32_t)(k >> 32);
    rng->offset = (uint64_t)offset;
    return 1;
}

/* Get a C-contiguous buffer of float32 items; on success the caller releases it. */
static int get_f32(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if ((f[0] == '@' || f[0] == '=' || f[0] == '<') && f[1])
        f++;
    if (view->itemsize != 4 || strcmp(f, "f") != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous float32 buffer, got format '%s' itemsize %zd",
                     what, view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Get a C-contiguous buffer of bytes (itemsize 1); on success the caller releases it. */
static int get_u8(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->itemsize != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous uint8 buffer, got format '%s' itemsize %zd",
                     what, view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int check_msg(const Py_buffer *view, size_t n, int fmt, size_t block, const char *what)
{
    size_t want = msg_nbytes(n, fmt, block);
    if ((size_t)view->len != want) {
        PyErr_Format(PyExc_ValueError, "%s: a message of %zu values (format code %d, block %zu) has %zu bytes, got %zd",
                     what, n, fmt, block, want, view->len);
        return -1;
    }
    return 0;
}

/* ---- the four functions ---- */

static PyObject *py_encode(PyObject *self, PyObject *args)
{
    PyObject *xo, *oo, *key = NULL;
    int fmt;
    long long block;
    unsigned long long offset = 0;
    Py_buffer x, out;
    gc_rng rng;
    int sr;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOiL|OK:encode", &xo, &oo, &fmt, &block, &key, &offset)
        || check_fmt_block(fmt, block) < 0 || (sr = get_rng(key, offset, fmt, &rng)) < 0)
        return NULL;
    if (get_f32(xo, &x, 0, "x") < 0)
        return NULL;
    if (get_u8(oo, &out, 1, "out") < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    size_t n = (size_t)x.len / 4;
    PyObject *ret = NULL;
    if (check_msg(&out, n, fmt, (size_t)block, "out") == 0) {
        const gc_kernels *k = g_kernels;
        Py_BEGIN_ALLOW_THREADS
        k->encode(fmt, (const float *)x.buf, n, (uint8_t *)out.buf, (size_t)block, sr ? &rng : NULL);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&x);
    return ret;
}

static PyObject *py_decode(PyObject *self, PyObject *args)
{
    PyObject *mo, *oo;
    int fmt;
    long long block;
    Py_buffer msg, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOiL:decode", &mo, &oo, &fmt, &block) || check_fmt_block(fmt, block) < 0)
        return NULL;
    if (get_u8(mo, &msg, 0, "msg") < 0)
        return NULL;
    if (get_f32(oo, &out, 1, "out") < 0) {
        PyBuffer_Release(&msg);
        return NULL;
    }
    size_t n = (size_t)out.len / 4;
    PyObject *ret = NULL;
    if (check_msg(&msg, n, fmt, (size_t)block, "msg") == 0 && check_ada_message(fmt, &msg, n, (size_t)block) == 0) {
        const gc_kernels *k = g_kernels;
        Py_BEGIN_ALLOW_THREADS
        k->decode(fmt, (const uint8_t *)msg.buf, n, (float *)out.buf, (size_t)block);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&msg);
    return ret;
}

static PyObject *py_decode_add_encode(PyObject *self, PyObject *args)
{
    PyObject *mio, *lo, *moo, *so, *key = NULL;
    int fmt;
    long long block;
    unsigned long long offset = 0;
    Py_buffer min, loc, mout, sum;
    int have_sum = 0, sr;
    gc_rng rng;
    PyObject *ret = NULL;
    float *tmp = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOiL|OK:decode_add_encode", &mio, &lo, &moo, &so, &fmt, &block, &key, &offset)
        || check_fmt_block(fmt, block) < 0 || (sr = get_rng(key, offset, fmt, &rng)) < 0)
        return NULL;
    if (get_u8(mio, &min, 0, "msg_in") < 0)
        return NULL;
    if (get_f32(lo, &loc, 0, "local") < 0)
        goto rel_min;
    if (get_u8(moo, &mout, 1, "msg_out") < 0)
        goto rel_loc;
    if (so != Py_None) {
        if (get_f32(so, &sum, 1, "sum_out") < 0)
            goto rel_mout;
        have_sum = 1;
    }
    size_t n = (size_t)loc.len / 4;
    if (check_msg(&min, n, fmt, (size_t)block, "msg_in") < 0 || check_msg(&mout, n, fmt, (size_t)block, "msg_out") < 0
        || check_ada_message(fmt, &min, n, (size_t)block) < 0)
        goto done;
    if (have_sum && (size_t)sum.len != 4 * n) {
        PyErr_Format(PyExc_ValueError, "sum_out must hold %zu float32 values, got %zd bytes", n, sum.len);
        goto done;
    }
    if (GC_FMT_SCALE(GC_VARIANT_FORMAT(fmt)) == GC_SCALE_F32) { /* block-local scratch of the FP8 hop */
        size_t t = n < (size_t)block ? n : (size_t)block;
        tmp = (float *)PyMem_RawMalloc(4 * (t ? t : 1));
        if (!tmp) {
            PyErr_NoMemory();
            goto done;
        }
    }
    if (GC_FMT_SCALE(GC_VARIANT_FORMAT(fmt)) == GC_SCALE_ADAPTIVE && !have_sum) { /* the whole sum: a frame's tiers need all of it */
        tmp = (float *)PyMem_RawMalloc(4 * (n ? n : 1));
        if (!tmp) {
            PyErr_NoMemory();
            goto done;
        }
    }
    {
        const gc_kernels *k = g_kernels;
        float *sp = have_sum ? (float *)sum.buf : NULL;
        Py_BEGIN_ALLOW_THREADS
        k->decode_add_encode(fmt, (const uint8_t *)min.buf, (const float *)loc.buf, n, (uint8_t *)mout.buf, sp,
                             (size_t)block, tmp, sr ? &rng : NULL);
        Py_END_ALLOW_THREADS
    }
    ret = Py_NewRef(Py_None);
done:
    PyMem_RawFree(tmp);
    if (have_sum)
        PyBuffer_Release(&sum);
rel_mout:
    PyBuffer_Release(&mout);
rel_loc:
    PyBuffer_Release(&loc);
rel_min:
    PyBuffer_Release(&min);
    return ret;
}

static PyObject *py_decode_accumulate(PyObject *self, PyObject *args)
{
    PyObject *mo, *ao;
    int fmt;
    long long block;
    Py_buffer msg, acc;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOiL:decode_accumulate", &mo, &ao, &fmt, &block) || check_fmt_block(fmt, block) < 0)
        return NULL;
    if (get_u8(mo, &msg, 0, "msg") < 0)
        return NULL;
    if (get_f32(ao, &acc, 1, "acc") < 0) {
        PyBuffer_Release(&msg);
        return NULL;
    }
    size_t n = (size_t)acc.len / 4;
    PyObject *ret = NULL;
    if (check_msg(&msg, n, fmt, (size_t)block, "msg") == 0 && check_ada_message(fmt, &msg, n, (size_t)block) == 0) {
        const gc_kernels *k = g_kernels;
        Py_BEGIN_ALLOW_THREADS
        k->decode_accumulate(fmt, (const uint8_t *)msg.buf, n, (float *)acc.buf, (size_t)block);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&acc);
    PyBuffer_Release(&msg);
    return ret;
}

/* ---- the formats these kernels implement ---- */

static PyObject *py_formats(PyObject *self, PyObject *args)
{
    (void)self; (void)args;
    PyObject *d = PyDict_New();
    for (int code = 0; d && code < GC_FORMAT_CODE_LIMIT; code++) {
        const gc_format_row *f = format_of(code);
        if (!f)
            continue;
        PyObject *facts = PyUnicode_FromString(f->facts);
        if (!facts || PyDict_SetItemString(d, f->name, facts) < 0) {
            Py_XDECREF(facts);
            Py_CLEAR(d);
            break;
        }
        Py_DECREF(facts);
    }
    return d;
}

/* ---- the adaptive rows' specs ---- */

static int ada_tier_index(const char *name, const char *a, const char *b)
{
    return strcmp(name, a) == 0 ? 0 : strcmp(name, b) == 0 ? 1 : -1;
}

static PyObject *py_adaptive_slot(PyObject *self, PyObject *args)
{
    unsigned long long budget, frame, share8;
    long long block;
    const char *top, *mid;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKssL:_adaptive_slot", &budget, &frame, &share8, &top, &mid, &block))
        return NULL;
    gc_ada_spec sp = {(uint32_t)budget, (uint32_t)frame, (uint32_t)share8, ada_tier_index(top, "e4m3", "int8"),
                      ada_tier_index(mid, "e2m1", "int4")};
    if (sp.top_int8 < 0 || sp.mid_int4 < 0 || frame < 1 || frame > 65536 || share8 > 1000 || budget > 1000000
        || block < 1 || !ada_block_ok((size_t)block))
        return PyErr_Format(PyExc_ValueError, "not an adaptive spec these kernels run: budget %llu, frame %llu, "
                            "share8 %llu, top %s, mid %s, block %lld", budget, frame, share8, top, mid, block);
    for (size_t nsb = 1; nsb <= frame; nsb++) /* every frame size meets the budget at 2 bits */
        if (gc_ada_avail(&sp, nsb, (size_t)block) < 0)
            return PyErr_Format(PyExc_ValueError, "budget %llu mbit/value is below what a frame of %zu super-blocks of "
                                "%lld needs with every super-block at 2 bits", budget, nsb, block);
    for (int i = 1; i < gc_ada_nslots; i++) {
        const gc_ada_spec *q = &gc_ada_specs[i];
        if (q->budget_mbits == sp.budget_mbits && q->frame == sp.frame && q->share8_permille == sp.share8_permille
            && q->top_int8 == sp.top_int8 && q->mid_int4 == sp.mid_int4)
            return PyLong_FromLong(i);
    }
    if (gc_ada_nslots >= GC_ADA_SLOTS)
        return PyErr_Format(PyExc_ValueError, "all %d adaptive spec slots are taken", GC_ADA_SLOTS - 1);
    gc_ada_specs[gc_ada_nslots] = sp;
    return PyLong_FromLong(gc_ada_nslots++);
}

/* ---- kernel variant selection ---- */

static PyObject *py_isa(PyObject *self, PyObject *args)
{
    (void)self; (void)args;
    return PyUnicode_FromString(g_kernels->name);
}

static PyObject *py_isas(PyObject *self, PyObject *args)
{
    (void)self; (void)args;
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    for (size_t i = 0; i < N_ISAS; i++) {
        if (!isa_supported(g_all[i]))
            continue;
        PyObject *s = PyUnicode_FromString(g_all[i]->name);
        if (!s || PyList_Append(list, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(s);
    }
    return list;
}

static int set_isa(const char *name)
{
    for (size_t i = 0; i < N_ISAS; i++) {
        if (strcasecmp(g_all[i]->name, name) == 0) { /* GIFTCOMM_NATIVE_ISA=AVX2 as avx2 */
            if (!isa_supported(g_all[i]))
                return -2;
            g_kernels = g_all[i];
            return 0;
        }
    }
    return -1;
}

static PyObject *py_set_isa(PyObject *self, PyObject *args)
{
    const char *name;
    (void)self;
    if (!PyArg_ParseTuple(args, "s:_set_isa", &name))
        return NULL;
    int r = set_isa(name);
    if (r == -1)
        return PyErr_Format(PyExc_ValueError, "unknown kernel variant %R", PyTuple_GET_ITEM(args, 0));
    if (r == -2)
        return PyErr_Format(PyExc_ValueError, "this CPU cannot run the %s kernels", name);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS,
     "encode(x, out, fmt_code, block, key=None, offset=0): x float32[n] -> out uint8[message_nbytes(n)]; "
     "key: stochastic rounding (Philox4x32-10, counter offset + i)."},
    {"decode", py_decode, METH_VARARGS,
     "decode(msg, out, fmt_code, block): msg uint8[message_nbytes(n)] -> out float32[n]."},
    {"decode_add_encode", py_decode_add_encode, METH_VARARGS,
     "decode_add_encode(msg_in, local, msg_out, sum_out, fmt_code, block, key=None, offset=0): msg_out = encode(decode(msg_in) + local) "
     "with the sum in float32; sum_out (float32[n] or None) receives the sum. Fused per block."},
    {"decode_accumulate", py_decode_accumulate, METH_VARARGS,
     "decode_accumulate(msg, acc, fmt_code, block): acc (float32[n]) += decode(msg)."},
    {"_formats", py_formats, METH_NOARGS,
     "{name: facts} of the formats these kernels implement (facts as compiled from native/gc_formats.h)."},
    {"_adaptive_slot", py_adaptive_slot, METH_VARARGS,
     "_adaptive_slot(budget_mbits, frame, share8_permille, top, mid, block) -> slot: register an adaptive row's spec "
     "(giftcomm.adaptive.AdaptiveSpec); its variant code is the format code | slot << GC_SCALE_RULE_SHIFT."},
    {"_isa", py_isa, METH_NOARGS, "Name of the kernel variant in use."},
    {"_isas", py_isas, METH_NOARGS, "Kernel variants this CPU can run, best first."},
    {"_set_isa", py_set_isa, METH_VARARGS, "Select a kernel variant by name (tests, benchmarks)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "giftcomm._codec_native",
    "Native CPU kernels of the giftcomm FP8 codec (bit-identical to giftcomm.reference.codec).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__codec_native(void)
{
#if defined(GC_HAVE_X86_VARIANTS)
    gc_lut8_init();
#endif
    for (size_t i = 0; i < N_ISAS; i++) { /* best supported variant first */
        if (isa_supported(g_all[i])) {
            g_kernels = g_all[i];
            break;
        }
    }
    PyObject *mod = PyModule_Create(&moduledef);
    if (mod && gc_channel_register(mod) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    const char *env = getenv("GIFTCOMM_NATIVE_ISA");
    if (mod && env && *env) {
        int r = set_isa(env);
        if (r < 0 && PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "GIFTCOMM_NATIVE_ISA=%s ignored: %s; using %s", env,
                                      r == -1 ? "unknown kernel variant (generic, avx2, avx512, avx512vbmi)"
                                              : "not supported by this CPU",
                                      g_kernels->name) < 0) {
            Py_DECREF(mod);
            return NULL;
        }
    }
    return mod;
}
