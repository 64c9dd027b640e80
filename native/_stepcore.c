/* The step wire's native core: the per-item passes of proto/wire/step.py in C.
 *
 * Loaded through memory_broker.proto.wire.native.load; every function here has a Python
 * definition in step.py that gives the same result, and the tests run both.
 *
 * Each codec function takes what step.py's Python path takes and either returns the same
 * result or returns None: "not taken here". step.py then runs its Python path, which either
 * gives the result or raises the error that names the fault, so an error (its type and its
 * message) is always the Python one. Everything read from a buffer is bounds-checked before
 * it is read; nothing here trusts a length it did not check against the buffer's end.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>


/* The wire's numbers, as proto/wire/step.py defines them (tests/test_step_codec_native.py
 * reads every #define here and checks it against step.py's value). */
#define MAX_OPS 64
#define OP_RELEASE 1
#define OP_UNPIN 2
#define OP_PIN 3
#define OP_COMMIT 4
#define OP_ABORT 5
#define OP_ACQUIRE 6
#define OP_LOOKUP 7
#define ACQUIRE_PREPARE 1
#define OK_KIND 0x80
#define STEP_KIND 2
#define HEADER_SIZE 5          /* <IB>: body length, kind */
#define REPLY_HEAD_SIZE 6      /* <IH>: arena slabs, result count */
#define OBJ_HEAD_SIZE 31       /* <QqBBBIII>: an object record's head */
#define OBJ_NPAGES_AT 27       /* its page count */
#define OBJ_OWNED 1            /* its flags */
#define OBJ_DEDUP 2
#define ACQ_RESULT_HEAD_SIZE 20 /* <BBQdH>: an acquire result's head */
#define ACQ_ADAPTER_SIZE 21    /* <QQBI>: an acquired adapter's record */
#define ACQ_NPAGES_AT 17       /* its page count */

/* ------------------------------------------------------------------ little-endian reads */

static inline uint16_t rd16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t rd32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* ------------------------------------------------------------------ a growing output buffer */

typedef struct {
    char *p;
    Py_ssize_t len, cap;
} Out;

static int out_reserve(Out *o, Py_ssize_t more) {
    if (more < 0 || o->len > PY_SSIZE_T_MAX - more) {
        PyErr_NoMemory();
        return -1;
    }
    if (o->len + more <= o->cap) return 0;
    Py_ssize_t cap = o->cap ? o->cap : 256;
    while (cap < o->len + more) {
        if (cap > PY_SSIZE_T_MAX / 2) { cap = o->len + more; break; }
        cap *= 2;
    }
    char *p = PyMem_Realloc(o->p, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->p = p;
    o->cap = cap;
    return 0;
}

static int out_put(Out *o, const void *src, Py_ssize_t n) {
    if (out_reserve(o, n) < 0) return -1;
    memcpy(o->p + o->len, src, (size_t)n);
    o->len += n;
    return 0;
}

static inline int out_u8(Out *o, unsigned v) { unsigned char b = (unsigned char)v; return out_put(o, &b, 1); }
static inline int out_u16(Out *o, unsigned v) { unsigned char b[2] = {(unsigned char)v, (unsigned char)(v >> 8)}; return out_put(o, b, 2); }
static inline int out_u32(Out *o, uint32_t v) { return out_put(o, &v, 4); }
static inline int out_u64(Out *o, uint64_t v) { return out_put(o, &v, 8); }

static void out_free(Out *o) { PyMem_Free(o->p); o->p = NULL; o->len = o->cap = 0; }

/* ------------------------------------------------------------------ the module's state */

/* One per module object (multi-phase init): nothing process-global. The attribute names read
 * and written on the objects the Python side passes in, interned once. */
enum { N_OBJECT_ID, NNAMES };
static const char *const NAMES[NNAMES] = {"object_id"};
#include "module_state.h"

/* ------------------------------------------------------------------ decode_step (broker) */

/* `count` length-prefixed strings from *pos (not past `end`): a tuple of bytes (text=0) or
 * of str decoded as strict UTF-8 (text=1). NULL with no exception set: malformed. */
static PyObject *
read_strs16(const unsigned char *b, Py_ssize_t *pos, Py_ssize_t end, Py_ssize_t count, int text)
{
    PyObject *t = PyTuple_New(count);
    if (t == NULL) return NULL;
    Py_ssize_t p = *pos;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (end - p < 2) goto malformed;
        Py_ssize_t n = rd16(b + p);
        p += 2;
        if (end - p < n) goto malformed;
        PyObject *s;
        if (text) {
            s = PyUnicode_DecodeUTF8((const char *)b + p, n, NULL);
            if (s == NULL) {
                if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                    PyErr_Clear();
                    goto malformed;
                }
                Py_DECREF(t);
                return NULL;
            }
        } else {
            s = PyBytes_FromStringAndSize((const char *)b + p, n);
            if (s == NULL) { Py_DECREF(t); return NULL; }
        }
        PyTuple_SET_ITEM(t, i, s);
        p += n;
    }
    *pos = p;
    return t;
malformed:
    Py_DECREF(t);
    return NULL;
}

/* Op(kind, items, flags, max_adapters, lease_ms), by calling `op_type`; steals `items`. */
static PyObject *
make_op(PyObject *op_type, long kind, PyObject *items, long flags, long cap, unsigned long lease)
{
    PyObject *args[5] = {PyLong_FromLong(kind), items, PyLong_FromLong(flags), PyLong_FromLong(cap),
                         PyLong_FromUnsignedLong(lease)};
    PyObject *op = NULL;
    if (args[0] && args[2] && args[3] && args[4])
        op = PyObject_Vectorcall(op_type, args, 5, NULL);
    for (int i = 0; i < 5; i++) Py_XDECREF(args[i]);
    return op;
}

/* decode_step(body, Op) -> list of Op, or None where the body is not well formed (the
 * caller's checked reader then says why). */
static PyObject *
decode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "decode_step(body, Op)");
        return NULL;
    }
    PyObject *op_type = args[1];
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *b = (const unsigned char *)view.buf;
    Py_ssize_t end = view.len, pos = 0;
    PyObject *ops = NULL;
    if (end < 2) goto malformed;
    Py_ssize_t n = rd16(b);
    pos = 2;
    if (n > MAX_OPS) goto malformed;
    ops = PyList_New(n);
    if (ops == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (end - pos < 1) goto malformed;
        int k = b[pos++];
        PyObject *items = NULL;
        long flags = 0, cap = 0;
        unsigned long lease = 0;
        if (k == OP_LOOKUP) {
            if (end - pos < 3) goto malformed;
            flags = b[pos];
            Py_ssize_t count = rd16(b + pos + 1);
            pos += 3;
            if (flags > 1) goto malformed;
            items = read_strs16(b, &pos, end, count, 0);
        } else if (k == OP_ACQUIRE) {
            if (end - pos < 9) goto malformed;
            flags = b[pos];
            cap = rd16(b + pos + 1);
            lease = rd32(b + pos + 3);
            Py_ssize_t count = rd16(b + pos + 7);
            pos += 9;
            if (flags & ~ACQUIRE_PREPARE) goto malformed;
            items = read_strs16(b, &pos, end, count, 1);
        } else if (k == OP_RELEASE) {
            if (end - pos < 2) goto malformed;
            Py_ssize_t count = rd16(b + pos);
            pos += 2;
            items = read_strs16(b, &pos, end, count, 1);
        } else if (k == OP_UNPIN || k == OP_PIN || k == OP_COMMIT || k == OP_ABORT) {
            if (end - pos < 2) goto malformed;
            Py_ssize_t count = rd16(b + pos);
            pos += 2;
            if ((end - pos) / 8 < count) goto malformed;
            items = PyTuple_New(count);
            if (items == NULL) goto fail;
            for (Py_ssize_t j = 0; j < count; j++) {
                PyObject *v = PyLong_FromUnsignedLongLong(rd64(b + pos + 8 * j));
                if (v == NULL) { Py_DECREF(items); goto fail; }
                PyTuple_SET_ITEM(items, j, v);
            }
            pos += 8 * count;
        } else {
            goto malformed;
        }
        if (items == NULL) {
            if (PyErr_Occurred()) goto fail;
            goto malformed;
        }
        PyObject *op = make_op(op_type, k, items, flags, cap, lease);
        if (op == NULL) goto fail;
        PyList_SET_ITEM(ops, i, op);
    }
    if (pos != end) goto malformed;
    PyBuffer_Release(&view);
    return ops;
malformed:
    Py_XDECREF(ops);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(ops);
    PyBuffer_Release(&view);
    return NULL;
}

/* ------------------------------------------------------------------ encode_ok_reply (broker) */

/* encode_ok_reply(arena_slabs, results) -> bytes, or None: an OK STEP reply frame (header,
 * reply head, then the already-encoded result records joined), as step.encode_step_reply
 * writes it for a list of bytes. None for anything else (not a list of bytes, counts or
 * sizes out of range): the Python path then writes or refuses it. */
static PyObject *
encode_ok_reply(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "encode_ok_reply(arena_slabs, results)");
        return NULL;
    }
    PyObject *results = args[1];
    if (!PyLong_Check(args[0]) || !PyList_CheckExact(results)) Py_RETURN_NONE;
    unsigned long slabs = PyLong_AsUnsignedLong(args[0]);
    if (slabs == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(results);
    if (slabs > 0xFFFFFFFFUL || n > 0xFFFF) Py_RETURN_NONE;
    Py_ssize_t size = REPLY_HEAD_SIZE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(results, i);
        if (!PyBytes_CheckExact(r)) Py_RETURN_NONE;
        size += PyBytes_GET_SIZE(r);
        if (size > 0xFFFFFFFFL) Py_RETURN_NONE;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, HEADER_SIZE + size);
    if (out == NULL) return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    uint32_t v = (uint32_t)size;
    memcpy(p, &v, 4);
    p[4] = OK_KIND;
    v = (uint32_t)slabs;
    memcpy(p + 5, &v, 4);
    p[9] = (unsigned char)n;
    p[10] = (unsigned char)(n >> 8);
    p += HEADER_SIZE + REPLY_HEAD_SIZE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(results, i);
        Py_ssize_t k = PyBytes_GET_SIZE(r);
        memcpy(p, PyBytes_AS_STRING(r), (size_t)k);
        p += k;
    }
    return out;
}

/* ------------------------------------------------------------------ encode_allocations (broker) */

/* A Python int as a C unsigned value of at most `max`; -1 (exception cleared) if it is not
 * one: the caller then leaves the record to the Python path, which raises what it raises. */
static int as_uint(PyObject *v, unsigned long long max, unsigned long long *out) {
    if (!PyLong_Check(v)) return -1;
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    if (x > max) return -1;
    *out = x;
    return 0;
}

/* encode_allocations(kind, sid, objs, wire_parts, attrs) -> bytes, or None: the store's
 * objects (with wire_head/wire_tail), as step.encode_allocations writes them. `attrs` is the
 * tuple of interned names (wire_head, wire_tail, owner, pins, pin_count). */
static PyObject *
encode_allocations(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyTuple_Check(args[4]) || PyTuple_GET_SIZE(args[4]) != 5) {
        PyErr_SetString(PyExc_TypeError, "encode_allocations(kind, sid, objs, wire_parts, attrs)");
        return NULL;
    }
    unsigned long long kind;
    if (as_uint(args[0], 255, &kind) < 0) Py_RETURN_NONE;
    PyObject *sid = args[1], *wire_parts = args[3], *attrs = args[4];
    PyObject *a_head = PyTuple_GET_ITEM(attrs, 0), *a_tail = PyTuple_GET_ITEM(attrs, 1);
    PyObject *a_owner = PyTuple_GET_ITEM(attrs, 2), *a_pins = PyTuple_GET_ITEM(attrs, 3);
    PyObject *a_count = PyTuple_GET_ITEM(attrs, 4);
    PyObject *seq = PySequence_Fast(args[2], "objs must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > 0xFFFF) { Py_DECREF(seq); Py_RETURN_NONE; }
    PyObject **objs = PySequence_Fast_ITEMS(seq);
    Out o = {0};
    if (out_u8(&o, (unsigned)kind) < 0 || out_u16(&o, (unsigned)n) < 0) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ob = objs[i];
        PyObject *head = PyObject_GetAttr(ob, a_head), *tail = NULL;
        if (head == NULL) goto fail;
        if (head == Py_None) {
            Py_DECREF(head);
            PyObject *pair = PyObject_CallOneArg(wire_parts, ob);
            if (pair == NULL) goto fail;
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) { Py_DECREF(pair); goto not_taken; }
            head = PyTuple_GET_ITEM(pair, 0);
            tail = PyTuple_GET_ITEM(pair, 1);
            Py_INCREF(head);
            Py_INCREF(tail);
            Py_DECREF(pair);
        } else {
            tail = PyObject_GetAttr(ob, a_tail);
            if (tail == NULL) { Py_DECREF(head); goto fail; }
        }
        if (!PyBytes_Check(head) || !PyBytes_Check(tail)) { Py_DECREF(head); Py_DECREF(tail); goto not_taken; }
        int r = out_put(&o, PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head));
        Py_DECREF(head);
        if (r < 0) { Py_DECREF(tail); goto fail; }
        /* The changing fields: owned flag, this session's pins, all pins (<BII). */
        PyObject *owner = PyObject_GetAttr(ob, a_owner);
        if (owner == NULL) { Py_DECREF(tail); goto fail; }
        int owned = PyObject_RichCompareBool(owner, sid, Py_EQ);
        Py_DECREF(owner);
        if (owned < 0) { Py_DECREF(tail); goto fail; }
        PyObject *pins = PyObject_GetAttr(ob, a_pins);
        if (pins == NULL) { Py_DECREF(tail); goto fail; }
        unsigned long long sp = 0, tp = 0;
        if (!PyDict_CheckExact(pins)) { Py_DECREF(pins); Py_DECREF(tail); goto not_taken; }
        PyObject *mine = PyDict_GetItemWithError(pins, sid);
        if (mine == NULL && PyErr_Occurred()) { Py_DECREF(pins); Py_DECREF(tail); goto fail; }
        int bad = mine != NULL && as_uint(mine, 0xFFFFFFFFu, &sp) < 0;
        Py_DECREF(pins);
        PyObject *count = PyObject_GetAttr(ob, a_count);
        if (count == NULL) { Py_DECREF(tail); goto fail; }
        bad |= as_uint(count, 0xFFFFFFFFu, &tp) < 0;
        Py_DECREF(count);
        if (bad) { Py_DECREF(tail); goto not_taken; }
        if (out_u8(&o, owned ? 1 : 0) < 0 || out_u32(&o, (uint32_t)sp) < 0 || out_u32(&o, (uint32_t)tp) < 0 ||
            out_put(&o, PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail)) < 0) {
            Py_DECREF(tail);
            goto fail;
        }
        Py_DECREF(tail);
    }
    Py_DECREF(seq);
    PyObject *res = PyBytes_FromStringAndSize(o.p, o.len);
    out_free(&o);
    return res;
not_taken:
    Py_DECREF(seq);
    out_free(&o);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    out_free(&o);
    return NULL;
}

/* ------------------------------------------------------------------ encode_step (client) */

/* Adapter ids, each length-prefixed UTF-8. 0, or 1: not taken (not a str, not encodable,
 * too long), or -1: error. */
static int put_texts(Out *o, PyObject *seq) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **it = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_Check(it[i])) return 1;
        Py_ssize_t len;
        const char *s = PyUnicode_AsUTF8AndSize(it[i], &len);
        if (s == NULL) {
            if (PyErr_ExceptionMatches(PyExc_UnicodeError)) { PyErr_Clear(); return 1; }
            return -1;
        }
        if (len > 0xFFFF) return 1;
        if (out_u16(o, (unsigned)len) < 0 || out_put(o, s, len) < 0) return -1;
    }
    return 0;
}

/* Field j of an op (attrs: (kind, items, flags, max_adapters, lease_ms)): an Op's attribute,
 * or a tuple op's item j (a tuple in Op's field order; 0 for the fields it leaves off).
 * A new reference, or NULL with an error set. */
static PyObject *op_get(PyObject *op, PyObject *attrs, int j) {
    if (PyTuple_CheckExact(op)) {
        if (j < PyTuple_GET_SIZE(op)) {
            PyObject *v = PyTuple_GET_ITEM(op, j);
            Py_INCREF(v);
            return v;
        }
        return PyLong_FromLong(0);
    }
    return PyObject_GetAttr(op, PyTuple_GET_ITEM(attrs, j));
}

/* One op's bytes after its kind. 0 taken, 1 not taken, -1 error. */
static int put_op(Out *o, PyObject *op, PyObject *attrs, long *kind_out) {
    /* attrs: (kind, items, flags, max_adapters, lease_ms) */
    if (PyTuple_CheckExact(op) && (PyTuple_GET_SIZE(op) < 2 || PyTuple_GET_SIZE(op) > 5)) return 1;
    PyObject *kv = op_get(op, attrs, 0);
    if (kv == NULL) return -1;
    unsigned long long k;
    int bad = as_uint(kv, 255, &k) < 0;
    Py_DECREF(kv);
    if (bad || k < OP_RELEASE || k > OP_LOOKUP) return 1;
    *kind_out = (long)k;
    PyObject *items = op_get(op, attrs, 1);
    if (items == NULL) return -1;
    if (!PyTuple_Check(items) && !PyList_Check(items)) { Py_DECREF(items); return 1; }
    PyObject *seq = PySequence_Fast(items, "items");
    Py_DECREF(items);
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **it = PySequence_Fast_ITEMS(seq);
    int r = 1;
    if (n > 0xFFFF) goto done;
    if (out_u8(o, (unsigned)k) < 0) { r = -1; goto done; }
    if (k == OP_RELEASE) {
        if (out_u16(o, (unsigned)n) < 0) { r = -1; goto done; }
        r = put_texts(o, seq);
    } else if (k == OP_ACQUIRE) {
        unsigned long long fl, cap, lease;
        PyObject *v[3];
        for (int j = 0; j < 3; j++) {
            v[j] = op_get(op, attrs, 2 + j);
            if (v[j] == NULL) { for (int q = 0; q < j; q++) Py_DECREF(v[q]); r = -1; goto done; }
        }
        int bad3 = as_uint(v[0], 255, &fl) < 0 || as_uint(v[1], 0xFFFF, &cap) < 0 || as_uint(v[2], 0xFFFFFFFFu, &lease) < 0 ||
                   (fl & ~(unsigned long long)ACQUIRE_PREPARE); /* a shaped acquire: the Python encoder's */
        for (int j = 0; j < 3; j++) Py_DECREF(v[j]);
        if (bad3) { r = 1; goto done; }
        if (out_u8(o, (unsigned)fl) < 0 || out_u16(o, (unsigned)cap) < 0 || out_u32(o, (uint32_t)lease) < 0 ||
            out_u16(o, (unsigned)n) < 0) { r = -1; goto done; }
        r = put_texts(o, seq);
    } else if (k == OP_LOOKUP) {
        PyObject *fv = op_get(op, attrs, 2);
        if (fv == NULL) { r = -1; goto done; }
        unsigned long long fl;
        int badf = as_uint(fv, 255, &fl) < 0;
        Py_DECREF(fv);
        if (badf) { r = 1; goto done; }
        if (out_u8(o, (unsigned)fl) < 0 || out_u16(o, (unsigned)n) < 0) { r = -1; goto done; }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!PyBytes_CheckExact(it[i]) || PyBytes_GET_SIZE(it[i]) > 0xFFFF) { r = 1; goto done; }
            Py_ssize_t len = PyBytes_GET_SIZE(it[i]);
            if (out_u16(o, (unsigned)len) < 0 || out_put(o, PyBytes_AS_STRING(it[i]), len) < 0) { r = -1; goto done; }
        }
        r = 0;
    } else { /* unpin, pin, commit, abort: u64 ids */
        if (out_u16(o, (unsigned)n) < 0 || out_reserve(o, 8 * n) < 0) { r = -1; goto done; }
        for (Py_ssize_t i = 0; i < n; i++) {
            unsigned long long id;
            if (as_uint(it[i], ~0ULL, &id) < 0) { r = 1; goto done; }
            out_u64(o, id);
        }
        r = 0;
    }
done:
    Py_DECREF(seq);
    return r;
}

/* encode_step(ops, attrs) -> the STEP frame (header and body), or None: not taken (the
 * Python encoder then encodes it or raises what it raises). */
static PyObject *
encode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != 5) {
        PyErr_SetString(PyExc_TypeError, "encode_step(ops, attrs)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "ops must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_OPS) { Py_DECREF(seq); Py_RETURN_NONE; }
    PyObject **ops = PySequence_Fast_ITEMS(seq);
    Out o = {0};
    /* The header is written last: body length, kind. */
    if (out_reserve(&o, HEADER_SIZE + 2) < 0) goto fail;
    o.len = HEADER_SIZE;
    out_u16(&o, (unsigned)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        long k = 0;
        int r = put_op(&o, ops[i], args[1], &k);
        if (r < 0) goto fail;
        if (r > 0) {
            Py_DECREF(seq);
            out_free(&o);
            Py_RETURN_NONE;
        }
    }
    Py_DECREF(seq);
    if (o.len - HEADER_SIZE > 0xFFFFFFFFLL) { out_free(&o); Py_RETURN_NONE; }
    uint32_t body = (uint32_t)(o.len - HEADER_SIZE);
    memcpy(o.p, &body, 4);
    o.p[4] = STEP_KIND;
    PyObject *res = PyBytes_FromStringAndSize(o.p, o.len);
    out_free(&o);
    return res;
fail:
    Py_DECREF(seq);
    out_free(&o);
    return NULL;
}

/* ------------------------------------------------------------------ a step batch's counts (client) */

/* Whether `o` is a list or tuple: then *items are its items (borrowed: `*n` of them; an
 * empty list's may be NULL); else the caller's Python pass takes it. */
static int
seq_items(PyObject *o, PyObject ***items, Py_ssize_t *n)
{
    if (!PyList_CheckExact(o) && !PyTuple_CheckExact(o)) return 0;
    *n = PySequence_Fast_GET_SIZE(o);
    *items = PySequence_Fast_ITEMS(o);
    return 1;
}

/* 1 where each of the n items is a key of `counts` and none repeats, 0 where not (or an
 * item cannot be hashed: the Python pass says so), -1 on error. Changes nothing. */
static int
drops_held(PyObject *counts, PyObject **it, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = PyDict_Contains(counts, it[i]);
        if (r < 0) {
            PyErr_Clear();
            return 0;
        }
        if (!r) return 0;
    }
    if (n < 2) return 1;
    if (n <= 8) { /* a step's few drops: compared pairwise (every item hashed above) */
        for (Py_ssize_t i = 1; i < n; i++)
            for (Py_ssize_t j = 0; j < i; j++) {
                int r = PyObject_RichCompareBool(it[i], it[j], Py_EQ);
                if (r < 0) return -1;
                if (r) return 0;
            }
        return 1;
    }
    PyObject *seen = PySet_New(NULL);
    if (seen == NULL) return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (PySet_Add(seen, it[i]) < 0) {
            Py_DECREF(seen);
            return -1;
        }
    int all = PySet_GET_SIZE(seen) == n;
    Py_DECREF(seen);
    return all;
}

/* One count off `x` in `counts` (held: checked); 1 where that was its last (removed), 0
 * where not, -1 on error. */
static int
count_out(PyObject *counts, PyObject *x)
{
    PyObject *c = PyDict_GetItemWithError(counts, x);
    if (c == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, x);
        return -1;
    }
    long n = PyLong_AsLong(c);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (n > 1) {
        PyObject *v = PyLong_FromLong(n - 1);
        if (v == NULL) return -1;
        int r = PyDict_SetItem(counts, x, v);
        Py_DECREF(v);
        return r < 0 ? -1 : 0;
    }
    return PyDict_DelItem(counts, x) < 0 ? -1 : 1;
}

/* The distinct items of it[0:n] in order that are not keys of `held`: a new list, or NULL. */
static PyObject *
new_items(PyObject **it, Py_ssize_t n, PyObject *held)
{
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = PyDict_Contains(held, it[i]);
        if (r < 0) goto fail;
        if (r) continue;
        r = PySequence_Contains(out, it[i]);
        if (r < 0) goto fail;
        if (!r && PyList_Append(out, it[i]) < 0) goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* batch_take(acount, kcount, adapters, own, objects, add, drop, add_keys, drop_keys) ->
 * (rel, unpin, new_ids, new_keys, own_leases): batch.py's StepBatch._take_drops of a change,
 * its dicts changed as that changes them; or None, having changed nothing, where a drop is
 * not held or repeats, or an argument is not a list or tuple (the Python pass then checks,
 * raises or counts it). */
static PyObject *
batch_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    State *st = state_of(self);
    if (nargs != 9 || !PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[1]) || !PyDict_CheckExact(args[2]) ||
        !PyDict_CheckExact(args[3]) || !PyDict_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "batch_take(acount, kcount, adapters, own, objects, add, drop, add_keys, drop_keys)");
        return NULL;
    }
    PyObject *acount = args[0], *kcount = args[1], *adapters = args[2], *own = args[3], *objects = args[4];
    Py_ssize_t n_add, n_drop, n_addk, n_dropk;
    PyObject **add, **drop, **add_keys, **drop_keys;
    if (!seq_items(args[5], &add, &n_add) || !seq_items(args[6], &drop, &n_drop) ||
        !seq_items(args[7], &add_keys, &n_addk) || !seq_items(args[8], &drop_keys, &n_dropk))
        Py_RETURN_NONE;
    int ok = drops_held(acount, drop, n_drop);
    if (ok > 0) ok = drops_held(kcount, drop_keys, n_dropk);
    if (ok < 0) return NULL;
    if (!ok) Py_RETURN_NONE;
    PyObject *rel = PyList_New(0), *unpin = PyList_New(0), *leases = PyList_New(0);
    PyObject *new_ids = NULL, *new_keys = NULL;
    if (rel == NULL || unpin == NULL || leases == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n_drop; i++) {
        PyObject *a = drop[i];
        int last = count_out(acount, a);
        if (last < 0) goto fail;
        if (!last) continue;
        if (PyDict_DelItem(adapters, a) < 0) goto fail;
        PyObject *lease = PyDict_GetItemWithError(own, a);
        if (lease != NULL) {
            if (PyList_Append(leases, lease) < 0 || PyDict_DelItem(own, a) < 0) goto fail;
        } else if (PyErr_Occurred() || PyList_Append(rel, a) < 0) {
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < n_dropk; i++) {
        PyObject *k = drop_keys[i];
        int last = count_out(kcount, k);
        if (last < 0) goto fail;
        if (!last) continue;
        PyObject *o = PyDict_GetItemWithError(objects, k);
        if (o == NULL) {
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        PyObject *oid = PyObject_GetAttr(o, st->names[N_OBJECT_ID]);
        if (oid == NULL) goto fail;
        int bad = PyList_Append(unpin, oid) < 0 || PyDict_DelItem(objects, k) < 0;
        Py_DECREF(oid);
        if (bad) goto fail;
    }
    new_ids = new_items(add, n_add, acount);
    if (new_ids == NULL) goto fail;
    new_keys = new_items(add_keys, n_addk, objects);
    if (new_keys == NULL) goto fail;
    return Py_BuildValue("(NNNNN)", rel, unpin, new_ids, new_keys, leases);
fail:
    Py_XDECREF(rel);
    Py_XDECREF(unpin);
    Py_XDECREF(leases);
    Py_XDECREF(new_ids);
    Py_XDECREF(new_keys);
    return NULL;
}

/* One count more on `x` in `counts`; 0, or -1 on error. */
static int
count_in(PyObject *counts, PyObject *x)
{
    PyObject *c = PyDict_GetItemWithError(counts, x), *v;
    if (c == NULL) {
        if (PyErr_Occurred()) return -1;
        v = PyLong_FromLong(1);
    } else {
        long n = PyLong_AsLong(c);
        if (n == -1 && PyErr_Occurred()) return -1;
        v = PyLong_FromLong(n + 1);
    }
    if (v == NULL) return -1;
    int r = PyDict_SetItem(counts, x, v);
    Py_DECREF(v);
    return r;
}

/* batch_account(acount, kcount, objects, adapters, add, add_keys, new_keys, found) ->
 * (the adapters of add, the objects of add_keys' present prefix): batch.py's
 * StepBatch._account of a change's result, its dicts changed as that changes them; None,
 * having changed nothing, where an argument is not a list or tuple. */
static PyObject *
batch_account(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8 || !PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[1]) || !PyDict_CheckExact(args[2]) ||
        !PyDict_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "batch_account(acount, kcount, objects, adapters, add, add_keys, new_keys, found)");
        return NULL;
    }
    PyObject *acount = args[0], *kcount = args[1], *objects = args[2], *adapters = args[3];
    Py_ssize_t n_add, n_addk, n_new, n_found;
    PyObject **add, **add_keys, **new_keys, **found;
    if (!seq_items(args[4], &add, &n_add) || !seq_items(args[5], &add_keys, &n_addk) ||
        !seq_items(args[6], &new_keys, &n_new) || !seq_items(args[7], &found, &n_found))
        Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < n_add; i++)
        if (count_in(acount, add[i]) < 0) return NULL;
    for (Py_ssize_t i = 0; i < n_new && i < n_found; i++)
        if (PyDict_SetItem(objects, new_keys[i], found[i]) < 0) return NULL;
    PyObject *got = PyList_New(0), *las = NULL;
    if (got == NULL) return NULL;
    int prefix = 1;
    for (Py_ssize_t i = 0; i < n_addk; i++) {
        if (count_in(kcount, add_keys[i]) < 0) goto fail;
        if (!prefix) continue;
        PyObject *o = PyDict_GetItemWithError(objects, add_keys[i]);
        if (o == NULL) {
            if (PyErr_Occurred()) goto fail;
            prefix = 0; /* the end of the present prefix */
            PyList_SetSlice(got, 0, PyList_GET_SIZE(got), NULL);
        } else if (o == Py_None) {
            prefix = 0;
            PyList_SetSlice(got, 0, PyList_GET_SIZE(got), NULL);
        } else if (PyList_Append(got, o) < 0) {
            goto fail;
        }
    }
    las = PyList_New(n_add);
    if (las == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n_add; i++) {
        PyObject *la = PyDict_GetItemWithError(adapters, add[i]);
        if (la == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, add[i]);
            goto fail;
        }
        Py_INCREF(la);
        PyList_SET_ITEM(las, i, la);
    }
    return Py_BuildValue("(NN)", las, got);
fail:
    Py_XDECREF(got);
    Py_XDECREF(las);
    return NULL;
}

/* ------------------------------------------------------------------ object_record (client) */

/* object_record(cls, arena_slabs, raw) -> cls(...) of one object record's bytes, as step.py's
 * _object_record(raw, arena_slabs) makes it (<QqBBBIII>, the pages <I>, then <H> and the key:
 * the key is what follows the two length bytes). ValueError where raw is too short for its
 * head and pages (the decoders call it only on records they measured). */
static PyObject *
object_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "object_record(cls, arena_slabs, raw: bytes)");
        return NULL;
    }
    PyObject *cls = args[0], *slabs = args[1];
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(args[2]);
    Py_ssize_t size = PyBytes_GET_SIZE(args[2]);
    if (size < OBJ_HEAD_SIZE) goto short_raw;
    Py_ssize_t npages = rd32(b + OBJ_NPAGES_AT);
    if ((size - OBJ_HEAD_SIZE) / 4 < npages) goto short_raw;
    Py_ssize_t at = OBJ_HEAD_SIZE + 4 * npages;
    if (size - at < 2) goto short_raw;
    PyObject *v[11] = {NULL};
    int64_t wp;
    memcpy(&wp, b + 8, 8);
    v[0] = PyLong_FromUnsignedLongLong(rd64(b));
    v[1] = PyLong_FromLongLong(wp);
    v[2] = PyLong_FromLong(b[16]);
    v[3] = PyLong_FromLong(b[17]);
    v[4] = PyBool_FromLong(b[18] & OBJ_OWNED);
    v[5] = PyBool_FromLong(b[18] & OBJ_DEDUP);
    v[6] = PyLong_FromUnsignedLong(rd32(b + 19));
    v[7] = PyLong_FromUnsignedLong(rd32(b + 23));
    v[8] = PyList_New(npages);
    v[9] = PyBytes_FromStringAndSize((const char *)b + at + 2, size - at - 2);
    v[10] = Py_NewRef(slabs);
    PyObject *rec = NULL;
    for (int i = 0; i < 11; i++)
        if (v[i] == NULL) goto done;
    for (Py_ssize_t i = 0; i < npages; i++) {
        PyObject *pg = PyLong_FromUnsignedLong(rd32(b + OBJ_HEAD_SIZE + 4 * i));
        if (pg == NULL) goto done;
        PyList_SET_ITEM(v[8], i, pg);
    }
    rec = PyObject_Vectorcall(cls, v, 11, NULL);
done:
    for (int i = 0; i < 11; i++) Py_XDECREF(v[i]);
    return rec;
short_raw:
    PyErr_Format(PyExc_ValueError, "an object record of %zd bytes is shorter than its head, pages and key length",
                 size);
    return NULL;
}

/* cls(*v) of `n` values (new references each, released): a new reference, or NULL. */
static PyObject *
call_with(PyObject *cls, PyObject **v, int n)
{
    PyObject *o = NULL;
    int ok = 1;
    for (int i = 0; i < n; i++)
        ok &= v[i] != NULL;
    if (ok)
        o = PyObject_Vectorcall(cls, v, n, NULL);
    for (int i = 0; i < n; i++) Py_XDECREF(v[i]);
    return o;
}

/* ------------------------------------------------------------------ decode_ok (client) */

/* The record of `raw` from `memo`, or make(raw) kept there (memo cleared past `limit`).
 * A new reference, or NULL on error. */
static PyObject *
memo_record(PyObject *memo, PyObject *raw, PyObject *make, Py_ssize_t limit)
{
    PyObject *rec = PyDict_GetItemWithError(memo, raw);
    if (rec != NULL) {
        Py_INCREF(rec);
        return rec;
    }
    if (PyErr_Occurred()) return NULL;
    if (PyDict_GET_SIZE(memo) >= limit) PyDict_Clear(memo);
    rec = PyObject_CallOneArg(make, raw);
    if (rec == NULL) return NULL;
    if (PyDict_SetItem(memo, raw, rec) < 0) {
        Py_DECREF(rec);
        return NULL;
    }
    return rec;
}

/* The record of the `size` bytes at `p`, the `ri`-th of its kind in a reply: the record at
 * the same place in the last reply where its bytes are the same (`last`: a list of (bytes,
 * record), this decoder's; a memcmp where a memo lookup hashes, and nothing allocated), else
 * memo_record's, kept at that place in `last` (NULL: no `last`). A new reference, or NULL. */
static PyObject *
record_at(PyObject *memo, const unsigned char *p, Py_ssize_t size, PyObject *make, Py_ssize_t limit,
          PyObject *last, Py_ssize_t ri)
{
    if (last != NULL && ri < PyList_GET_SIZE(last)) {
        PyObject *e = PyList_GET_ITEM(last, ri);
        PyObject *was = PyTuple_GET_ITEM(e, 0);
        if (PyBytes_GET_SIZE(was) == size && memcmp(PyBytes_AS_STRING(was), p, (size_t)size) == 0) {
            PyObject *rec = PyTuple_GET_ITEM(e, 1);
            Py_INCREF(rec);
            return rec;
        }
    }
    PyObject *raw = PyBytes_FromStringAndSize((const char *)p, size);
    if (raw == NULL) return NULL;
    PyObject *rec = memo_record(memo, raw, make, limit);
    if (rec != NULL && last != NULL && ri <= PyList_GET_SIZE(last) && ri < limit) {
        PyObject *e = PyTuple_Pack(2, raw, rec);
        int bad = e == NULL;
        if (!bad && ri < PyList_GET_SIZE(last)) {
            PyList_SetItem(last, ri, e); /* steals e; drops the entry it replaces */
        } else if (!bad) {
            bad = PyList_Append(last, e) < 0;
            Py_DECREF(e);
        }
        if (bad) Py_CLEAR(rec);
    }
    Py_DECREF(raw);
    return rec;
}

/* The results of an OK reply's body `b[0:end]` (its op count at 4; records from the memos,
 * as decode_ok says): a new list; or NULL, with *malformed set where the body is not well
 * formed (no error set: the reference decoder says why), else with an error set. */
static PyObject *
decode_results(const unsigned char *b, Py_ssize_t end, PyObject *const *args, Py_ssize_t limit, PyObject *last_objects,
               PyObject *last_adapters, int *malformed)
{
    PyObject *objects = args[0], *make_object = args[1], *adapters = args[2], *make_adapter = args[3];
    PyObject *outcome = args[4];
    Py_ssize_t pos = REPLY_HEAD_SIZE, n_objects = 0, n_adapters = 0;
    PyObject *results = NULL;
    *malformed = 0;
    if (end < REPLY_HEAD_SIZE) goto malformed;
    Py_ssize_t n = rd16(b + 4);
    results = PyList_New(n);
    if (results == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (end - pos < 1) goto malformed;
        int k = b[pos];
        PyObject *item = NULL;
        if (k == OP_PIN || k == OP_LOOKUP) {
            if (end - pos < 3) goto malformed;
            Py_ssize_t count = rd16(b + pos + 1);
            pos += 3;
            item = PyList_New(count);
            if (item == NULL) goto fail;
            for (Py_ssize_t j = 0; j < count; j++) {
                /* <QqBBBIII>: 31 bytes, page count at 27; then the pages, then <H> key. */
                if (end - pos < OBJ_HEAD_SIZE) { Py_DECREF(item); goto malformed; }
                Py_ssize_t npages = rd32(b + pos + OBJ_NPAGES_AT);
                if ((end - pos - OBJ_HEAD_SIZE) / 4 < npages) { Py_DECREF(item); goto malformed; }
                Py_ssize_t at = OBJ_HEAD_SIZE + 4 * npages;
                if (end - pos - at < 2) { Py_DECREF(item); goto malformed; }
                Py_ssize_t klen = rd16(b + pos + at);
                if (end - pos - at - 2 < klen) { Py_DECREF(item); goto malformed; }
                Py_ssize_t size = at + 2 + klen;
                PyObject *rec = record_at(objects, b + pos, size, make_object, limit, last_objects, n_objects++);
                if (rec == NULL) { Py_DECREF(item); goto fail; }
                PyList_SET_ITEM(item, j, rec);
                pos += size;
            }
        } else if (k == OP_ACQUIRE) {
            /* <BBQdH>: 20 bytes; then records <QQBI> (21 bytes, page count at 17) and pages. */
            if (end - pos < ACQ_RESULT_HEAD_SIZE) goto malformed;
            int hot = b[pos + 1];
            if (hot > 1) goto malformed; /* layouts follow (a load's): the Python decoder reads them */
            uint64_t txn = rd64(b + pos + 2);
            double deadline;
            memcpy(&deadline, b + pos + 10, 8);
            Py_ssize_t count = rd16(b + pos + 18);
            pos += ACQ_RESULT_HEAD_SIZE;
            PyObject *recs = PyTuple_New(count);
            if (recs == NULL) goto fail;
            for (Py_ssize_t j = 0; j < count; j++) {
                if (end - pos < ACQ_ADAPTER_SIZE) { Py_DECREF(recs); goto malformed; }
                Py_ssize_t npages = rd32(b + pos + ACQ_NPAGES_AT);
                if ((end - pos - ACQ_ADAPTER_SIZE) / 4 < npages) { Py_DECREF(recs); goto malformed; }
                Py_ssize_t size = ACQ_ADAPTER_SIZE + 4 * npages;
                PyObject *rec = record_at(adapters, b + pos, size, make_adapter, limit, last_adapters, n_adapters++);
                if (rec == NULL) { Py_DECREF(recs); goto fail; }
                PyTuple_SET_ITEM(recs, j, rec);
                pos += size;
            }
            PyObject *a[4];
            a[0] = PyBool_FromLong(hot);
            a[1] = PyLong_FromUnsignedLongLong(txn);
            a[2] = PyFloat_FromDouble(deadline);
            a[3] = recs;
            if (a[1] && a[2]) item = PyObject_Vectorcall(outcome, a, 4, NULL);
            for (int q = 0; q < 4; q++) Py_XDECREF(a[q]);
            if (item == NULL) goto fail;
        } else if (k >= OP_RELEASE && k <= OP_LOOKUP) {
            pos += 1;
            item = Py_None;
            Py_INCREF(item);
        } else {
            goto malformed;
        }
        PyList_SET_ITEM(results, i, item);
    }
    if (pos != end) goto malformed;
    return results;
malformed:
    *malformed = 1;
fail:
    Py_XDECREF(results);
    return NULL;
}

/* decode_ok(body, objects, make_object, adapters, make_adapter, outcome, limit) ->
 * (slabs, results) of an OK reply, or None where it is not well formed (the reference
 * decoder then says why). Object and adapter records come from the memos (dicts: a
 * record's bytes -> the record), made by make_object/make_adapter on a miss; an acquire
 * result is outcome(hot, txn_id, deadline, records). */
static PyObject *
decode_ok(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7 || !PyDict_Check(args[1]) || !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "decode_ok(body, objects, make_object, adapters, make_adapter, outcome, limit)");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[6]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *b = (const unsigned char *)view.buf;
    int malformed;
    PyObject *results = decode_results(b, view.len, args + 1, limit, NULL, NULL, &malformed), *res = NULL;
    if (results != NULL) {
        PyObject *s = PyLong_FromUnsignedLong(rd32(b));
        if (s != NULL) res = PyTuple_Pack(2, s, results);
        Py_XDECREF(s);
        Py_DECREF(results);
    } else if (malformed) {
        res = Py_None;
        Py_INCREF(res);
    }
    PyBuffer_Release(&view);
    return res;
}

/* reply(slabs, results), by calling the class `cls` (error and failed_index its defaults).
 * Steals both. */
static PyObject *
make_reply(PyObject *cls, PyObject *slabs, PyObject *results)
{
    PyObject *a[2] = {slabs, results};
    return call_with(cls, a, 2);
}

/* decode_frame(objects, make_object, adapters, make_adapter, outcome, limit, reply, slabs,
 * buf, got, last_objects, last_adapters) -> reply(slabs, results) of the whole OK reply frame
 * in buf[0:got] (its header included), records as decode_ok makes them (found first at their
 * place in the last reply: record_at; the two lists are the decoder's, of (bytes, record),
 * emptied by it when the records it makes change); or None where buf[0:got] is not one whole OK
 * frame, not well formed, or holds records of an arena of other than `slabs` slabs (the
 * caller then reads and decodes it the reference way, which also says what is wrong). */
static PyObject *
decode_frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12 || !PyDict_Check(args[0]) || !PyDict_Check(args[2]) || !PyList_CheckExact(args[10]) ||
        !PyList_CheckExact(args[11])) {
        PyErr_SetString(PyExc_TypeError, "decode_frame(objects, make_object, adapters, make_adapter, outcome, limit, "
                                         "reply, slabs, buf, got, last_objects, last_adapters)");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[5]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    long long want = PyLong_AsLongLong(args[7]);
    if (want == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t got = PyLong_AsSsize_t(args[9]);
    if (got == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[8], &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *b = (const unsigned char *)view.buf;
    PyObject *res = NULL;
    if (got < HEADER_SIZE + REPLY_HEAD_SIZE || got > view.len || (Py_ssize_t)rd32(b) != got - HEADER_SIZE ||
        b[4] != OK_KIND)
        goto none;
    uint32_t slabs = rd32(b + HEADER_SIZE);
    if ((long long)slabs != want && rd16(b + 9) != 0) goto none;
    int malformed;
    PyObject *results = decode_results(b + HEADER_SIZE, got - HEADER_SIZE, args, limit, args[10], args[11], &malformed);
    if (results == NULL) {
        if (malformed) goto none;
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *s = PyLong_FromUnsignedLong(slabs);
    if (s != NULL) {
        res = make_reply(args[6], s, results);
    } else {
        Py_DECREF(results);
    }
    PyBuffer_Release(&view);
    return res;
none:
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_step", (PyCFunction)(void (*)(void))decode_step, METH_FASTCALL,
     "decode_step(body, Op): a STEP body's ops, or None where it is not well formed"},
    {"encode_ok_reply", (PyCFunction)(void (*)(void))encode_ok_reply, METH_FASTCALL,
     "encode_ok_reply(arena_slabs, results): an OK STEP reply frame from a list of bytes, or None"},
    {"encode_allocations", (PyCFunction)(void (*)(void))encode_allocations, METH_FASTCALL,
     "encode_allocations(kind, sid, objs, wire_parts, attrs): the object records, or None"},
    {"encode_step", (PyCFunction)(void (*)(void))encode_step, METH_FASTCALL,
     "encode_step(ops, attrs): a STEP frame, or None where the Python encoder must say why"},
    {"decode_ok", (PyCFunction)(void (*)(void))decode_ok, METH_FASTCALL,
     "decode_ok(body, objects, make_object, adapters, make_adapter, outcome, limit): (slabs, results) or None"},
    {"batch_take", (PyCFunction)(void (*)(void))batch_take, METH_FASTCALL,
     "batch_take(acount, kcount, adapters, own, objects, add, drop, add_keys, drop_keys): "
     "(rel, unpin, new_ids, new_keys, own_leases), or None"},
    {"batch_account", (PyCFunction)(void (*)(void))batch_account, METH_FASTCALL,
     "batch_account(acount, kcount, objects, adapters, add, add_keys, new_keys, found): (adapters, objects), or None"},
    {"object_record", (PyCFunction)(void (*)(void))object_record, METH_FASTCALL,
     "object_record(cls, arena_slabs, raw): the ObjectRecord of one object record's bytes"},
    {"decode_frame", (PyCFunction)(void (*)(void))decode_frame, METH_FASTCALL,
     "decode_frame(objects, make_object, adapters, make_adapter, outcome, limit, reply, slabs, buf, got, "
     "last_objects, last_adapters): "
     "reply(slabs, results) of a whole OK frame, or None"},
    {NULL, NULL, 0, NULL},
};

CORE_MODULE(_stepcore, "The step wire's native core.")
