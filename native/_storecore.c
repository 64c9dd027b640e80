/* The store's native core: the per-key passes of a step (broker/store) in C.
 *
 * Loaded through memory_broker.broker.store.records.store_core (memory_broker.proto.wire.native);
 * each function here is one loop of the store's Python code over a batch (ObjectStore.lookup,
 * ObjectTable.held_once, PinLedger.pin_all / unpin_once, PriorityLRU.add_all / remove_all) and
 * does what that loop does, in the same order, to the same Python objects: the shard dicts,
 * the objects' pins dicts and the session's pins dict. Nothing is kept here: an object's fields
 * are read and written through ordinary attribute access, by names interned once in the
 * module's state. A function that meets what its Python loop
 * would refuse or treat specially returns None (the caller then runs the Python path, which
 * says what is wrong) or raises what the Python loop would raise (KeyError, TypeError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { F_ID, F_PINS, F_COUNT, F_NPAGES, F_SEG, F_CT, F_FREED, F_STATE, F_KEY, NNAMES };
static const char *const NAMES[NNAMES] = {
    "object_id", "pins", "pin_count", "num_pages", "queue_seg", "content_type", "freed", "state", "key",
};
#include "module_state.h"

/* ------------------------------------------------------------------ fields */

/* obj.<field>, a new reference (NULL and an exception if unset). */
static inline PyObject *
get(State *st, PyObject *o, int f)
{
    return PyObject_GetAttr(o, st->names[f]);
}

/* obj.<field> = v (v borrowed); -1 and an exception on failure. */
static inline int
set(State *st, PyObject *o, int f, PyObject *v)
{
    return PyObject_SetAttr(o, st->names[f], v);
}

/* obj.<field> as a C integer; -1 with an exception set on failure (check PyErr_Occurred). */
static inline Py_ssize_t
get_int(State *st, PyObject *o, int f)
{
    PyObject *v = get(st, o, f);
    if (v == NULL)
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return n;
}

static inline int
set_int(State *st, PyObject *o, int f, Py_ssize_t n)
{
    PyObject *v = PyLong_FromSsize_t(n);
    if (v == NULL)
        return -1;
    int r = set(st, o, f, v);
    Py_DECREF(v);
    return r;
}

/* obj.pins, which must be a dict (a new reference). */
static inline PyObject *
get_pins(State *st, PyObject *o)
{
    PyObject *pins = get(st, o, F_PINS);
    if (pins != NULL && !PyDict_Check(pins)) {
        Py_DECREF(pins);
        PyErr_SetString(PyExc_TypeError, "an object's pins must be a dict");
        return NULL;
    }
    return pins;
}

/* d[key] as a C integer, `missing` if absent; -1 with an exception on failure. */
static inline int
dict_int(PyObject *d, PyObject *key, Py_ssize_t missing, Py_ssize_t *out)
{
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL) {
        if (PyErr_Occurred())
            return -1;
        *out = missing;
        return 0;
    }
    Py_ssize_t n = PyLong_AsSsize_t(v);
    if (n == -1 && PyErr_Occurred())
        return -1;
    *out = n;
    return 0;
}

static inline int
dict_set_int(PyObject *d, PyObject *key, Py_ssize_t n)
{
    PyObject *v = PyLong_FromSsize_t(n);
    if (v == NULL)
        return -1;
    int r = PyDict_SetItem(d, key, v);
    Py_DECREF(v);
    return r;
}

static int
check_list(PyObject *o, const char *what)
{
    if (!PyList_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list", what);
        return -1;
    }
    return 0;
}

static int
check_dict(PyObject *o, const char *what)
{
    if (!PyDict_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dict", what);
        return -1;
    }
    return 0;
}

/* The shard list of a ShardedMap: a list of dicts whose length is a power of two. */
static int
check_shards(PyObject *shards)
{
    if (check_list(shards, "shards") < 0)
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(shards);
    if (n < 1 || (n & (n - 1))) {
        PyErr_SetString(PyExc_ValueError, "shards must be a power-of-two number of dicts");
        return -1;
    }
    return 0;
}

static inline PyObject *
shard_at(PyObject *shards, Py_hash_t h)
{
    Py_ssize_t n = PyList_GET_SIZE(shards); /* re-read: a dict's __eq__ may run code */
    if (n < 1 || (n & (n - 1))) {
        PyErr_SetString(PyExc_ValueError, "shards must be a power-of-two number of dicts");
        return NULL;
    }
    PyObject *d = PyList_GET_ITEM(shards, (Py_ssize_t)((size_t)h & (size_t)(n - 1)));
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "each shard must be a dict");
        return NULL;
    }
    return d;
}

/* ------------------------------------------------------------------ lookup */

/* find_keys(shards, keys, most, pool) -> list | None
 *
 * ObjectStore.lookup's loop: the objects of the longest prefix of ``keys`` in the key index
 * (a ShardedMap's shards; ``(pool, key)`` when pool is not 0). None if any key is not bytes of
 * 1..most bytes: the caller's checks then say which.
 */
static PyObject *
find_keys_impl(PyObject *shards, PyObject *keys, Py_ssize_t most, PyObject *pool)
{
    if (check_shards(shards) < 0)
        return NULL;
    int pooled = PyObject_IsTrue(pool);
    if (pooled < 0)
        return NULL;
    if (!PyList_Check(keys) && !PyTuple_Check(keys))
        Py_RETURN_NONE; /* an iterator would be used up: the Python path reads it */
    PyObject *seq = PySequence_Tuple(keys); /* a snapshot: code a lookup runs cannot change it */
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = items[i];
        if (!PyBytes_CheckExact(k) || PyBytes_GET_SIZE(k) < 1 || PyBytes_GET_SIZE(k) > most) {
            Py_DECREF(seq);
            Py_RETURN_NONE;
        }
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = items[i], *key = k;
        if (pooled) {
            key = PyTuple_Pack(2, pool, k);
            if (key == NULL)
                goto fail;
        }
        Py_hash_t h = PyObject_Hash(key);
        PyObject *d = h == -1 ? NULL : shard_at(shards, h);
        PyObject *obj = d == NULL ? NULL : PyDict_GetItemWithError(d, key);
        Py_XINCREF(obj);
        if (pooled)
            Py_DECREF(key);
        if (obj == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        int r = PyList_Append(out, obj);
        Py_DECREF(obj);
        if (r < 0)
            goto fail;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *
find_keys(PyObject *self, PyObject *args)
{
    PyObject *shards, *keys, *pool;
    Py_ssize_t most;
    if (!PyArg_ParseTuple(args, "OOnO", &shards, &keys, &most, &pool))
        return NULL;
    return find_keys_impl(shards, keys, most, pool);
}

/* ------------------------------------------------------------------ pins */

/* pin_all(objs, sid, spins) -> (fresh, fresh_pages, contention)
 *
 * PinLedger.pin_all's loop: one more pin of session ``sid`` on each of ``objs`` in order
 * (``obj.pin_count``, ``obj.pins[sid]``, ``spins[obj.object_id]``); ``fresh``: the objects
 * that had no pin at all, and their pages; ``contention``: pins added beside another
 * session's where ``sid`` held none.
 */
static PyObject *
pin_all_impl(State *st, PyObject *objs, PyObject *sid, PyObject *spins)
{
    if (check_list(objs, "objs") < 0 || check_dict(spins, "spins") < 0)
        return NULL;
    PyObject *one = PyLong_FromLong(1);
    PyObject *fresh = PyList_New(0);
    Py_ssize_t pages = 0, contention = 0;
    if (one == NULL || fresh == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objs); i++) {
        PyObject *obj = PyList_GET_ITEM(objs, i);
        Py_INCREF(obj);
        PyObject *pins = NULL, *oid = NULL;
        Py_ssize_t n = get_int(st, obj, F_COUNT), c;
        if ((n == -1 && PyErr_Occurred()) || set_int(st, obj, F_COUNT, n + 1) < 0)
            goto next_fail;
        if ((pins = get_pins(st, obj)) == NULL || (oid = get(st, obj, F_ID)) == NULL)
            goto next_fail;
        if (!n) { /* no pins at all: none of this session's either (spins mirrors obj.pins) */
            Py_ssize_t np;
            if (PyList_Append(fresh, obj) < 0 || PyDict_SetItem(pins, sid, one) < 0 ||
                PyDict_SetItem(spins, oid, one) < 0)
                goto next_fail;
            np = get_int(st, obj, F_NPAGES);
            if (np == -1 && PyErr_Occurred())
                goto next_fail;
            pages += np;
        }
        else {
            PyObject *cur = PyDict_GetItemWithError(pins, sid);
            if (cur == NULL) {
                if (PyErr_Occurred())
                    goto next_fail;
                contention++; /* beside another session's pins */
                c = 0;
            }
            else if ((c = PyLong_AsSsize_t(cur)) == -1 && PyErr_Occurred())
                goto next_fail;
            if (dict_set_int(pins, sid, c + 1) < 0 || dict_int(spins, oid, 0, &c) < 0 ||
                dict_set_int(spins, oid, c + 1) < 0)
                goto next_fail;
        }
        Py_DECREF(pins);
        Py_DECREF(oid);
        Py_DECREF(obj);
        continue;
    next_fail:
        Py_XDECREF(pins);
        Py_XDECREF(oid);
        Py_DECREF(obj);
        goto fail;
    }
    Py_DECREF(one);
    return Py_BuildValue("Nnn", fresh, pages, contention);
fail:
    Py_XDECREF(one);
    Py_XDECREF(fresh);
    return NULL;
}

static PyObject *
pin_all(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *objs, *sid, *spins;
    if (!PyArg_ParseTuple(args, "OOO", &objs, &sid, &spins))
        return NULL;
    return pin_all_impl(st, objs, sid, spins);
}

/* A small open-addressing set of int64 ids: true if one repeats. */
static int
has_repeat(const long long *ids, Py_ssize_t n, int *repeat)
{
    size_t cap = 16;
    while (cap < (size_t)n * 2)
        cap <<= 1;
    Py_ssize_t stack[128];
    Py_ssize_t *slots = cap <= 128 ? stack : PyMem_Malloc(cap * sizeof(Py_ssize_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(slots, 0, cap * sizeof(Py_ssize_t)); /* slot = index + 1; 0 = empty */
    *repeat = 0;
    for (Py_ssize_t i = 0; i < n && !*repeat; i++) {
        size_t j = ((uint64_t)ids[i] * 0x9E3779B97F4A7C15ull) >> 32;
        for (;; j++) {
            j &= cap - 1;
            if (!slots[j]) {
                slots[j] = i + 1;
                break;
            }
            if (ids[slots[j] - 1] == ids[i]) {
                *repeat = 1;
                break;
            }
        }
    }
    if (slots != stack)
        PyMem_Free(slots);
    return 0;
}

/* held_once(shards, ids, sid) -> list | None
 *
 * ObjectTable.held_once: the objects of ``ids`` (an object table's shards) when each id is an
 * int named once whose object holds a pin of ``sid``; None otherwise (the caller then checks
 * id by id and says what is wrong).
 */
static PyObject *
held_once_impl(State *st, PyObject *shards, PyObject *ids, PyObject *sid)
{
    if (check_shards(shards) < 0)
        return NULL;
    if (!PyList_Check(ids) && !PyTuple_Check(ids))
        Py_RETURN_NONE; /* an iterator would be used up: the Python path reads it */
    PyObject *seq = PySequence_Tuple(ids); /* a snapshot: code a lookup runs cannot change it */
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = NULL;
    long long *vals = PyMem_Malloc((n ? n : 1) * sizeof(long long));
    if (vals == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow;
        if (!PyLong_CheckExact(items[i]))
            goto none;
        vals[i] = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow)
            goto none; /* no such id in the table */
        if (vals[i] == -1 && PyErr_Occurred())
            goto done;
    }
    int repeat;
    if (has_repeat(vals, n, &repeat) < 0)
        goto done;
    if (repeat)
        goto none;
    if ((out = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = shard_at(shards, (Py_hash_t)vals[i]);
        PyObject *obj = d == NULL ? NULL : PyDict_GetItemWithError(d, items[i]);
        if (obj == NULL) {
            if (PyErr_Occurred())
                goto fail;
            goto none;
        }
        Py_INCREF(obj);
        PyList_SET_ITEM(out, i, obj); /* owned by out from here, even on the way out */
        PyObject *pins = get_pins(st, obj);
        if (pins == NULL)
            goto fail;
        int held = PyDict_Contains(pins, sid);
        Py_DECREF(pins);
        if (held < 0)
            goto fail;
        if (!held)
            goto none;
    }
    goto done;
none:
    Py_XDECREF(out);
    out = Py_NewRef(Py_None);
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(vals);
    Py_DECREF(seq);
    return out;
}

static PyObject *
held_once(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *shards, *ids, *sid;
    if (!PyArg_ParseTuple(args, "OOO", &shards, &ids, &sid))
        return NULL;
    return held_once_impl(st, shards, ids, sid);
}

/* unpin_once(objs, sid, spins) -> (zero, zero_pages, any_freed)
 *
 * PinLedger.unpin_once's loop: one pin of ``sid`` less on each of ``objs`` (distinct objects on
 * each of which ``sid`` holds a pin: the caller checked); ``zero``: those left with no pin,
 * their pages, and whether any of them is freed (its pages then go back).
 */
static PyObject *
unpin_once_impl(State *st, PyObject *objs, PyObject *sid, PyObject *spins)
{
    if (check_list(objs, "objs") < 0 || check_dict(spins, "spins") < 0)
        return NULL;
    PyObject *zero = PyList_New(0);
    Py_ssize_t pages = 0;
    int freed = 0;
    if (zero == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objs); i++) {
        PyObject *obj = PyList_GET_ITEM(objs, i);
        Py_INCREF(obj);
        PyObject *oid = NULL, *pins = get_pins(st, obj);
        Py_ssize_t left, n;
        if (pins == NULL || (oid = get(st, obj, F_ID)) == NULL)
            goto next_fail;
        PyObject *cur = PyDict_GetItemWithError(pins, sid);
        if (cur == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, sid);
            goto next_fail;
        }
        left = PyLong_AsSsize_t(cur) - 1;
        if (left == -2 && PyErr_Occurred())
            goto next_fail;
        if (left) {
            if (dict_set_int(pins, sid, left) < 0 || dict_set_int(spins, oid, left) < 0)
                goto next_fail;
        }
        else if (PyDict_DelItem(pins, sid) < 0 || PyDict_DelItem(spins, oid) < 0)
            goto next_fail;
        n = get_int(st, obj, F_COUNT);
        if ((n == -1 && PyErr_Occurred()) || set_int(st, obj, F_COUNT, n - 1) < 0)
            goto next_fail;
        if (n == 1) {
            Py_ssize_t np = get_int(st, obj, F_NPAGES);
            PyObject *f;
            int t;
            if ((np == -1 && PyErr_Occurred()) || PyList_Append(zero, obj) < 0 || (f = get(st, obj, F_FREED)) == NULL)
                goto next_fail;
            t = PyObject_IsTrue(f);
            Py_DECREF(f);
            if (t < 0)
                goto next_fail;
            pages += np;
            freed |= t;
        }
        Py_DECREF(pins);
        Py_DECREF(oid);
        Py_DECREF(obj);
        continue;
    next_fail:
        Py_XDECREF(pins);
        Py_XDECREF(oid);
        Py_DECREF(obj);
        Py_DECREF(zero);
        return NULL;
    }
    return Py_BuildValue("NnO", zero, pages, freed ? Py_True : Py_False);
}

static PyObject *
unpin_once(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *objs, *sid, *spins;
    if (!PyArg_ParseTuple(args, "OOO", &objs, &sid, &spins))
        return NULL;
    return unpin_once_impl(st, objs, sid, spins);
}

/* pinnable_all(shards, ids, committed) -> list | None
 *
 * ObjectStore.pin's checks in the usual case: the objects of ``ids`` (ints, in an object
 * table's shards) when each is live (not freed) and in state ``committed``; None otherwise (the
 * caller then checks id by id and says what is wrong). One store pool only: the caller checks.
 */
static PyObject *
pinnable_all(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *shards, *ids, *committed;
    if (!PyArg_ParseTuple(args, "OOO", &shards, &ids, &committed))
        return NULL;
    if (check_shards(shards) < 0)
        return NULL;
    if (!PyList_Check(ids) && !PyTuple_Check(ids))
        Py_RETURN_NONE; /* an iterator would be used up: the Python path reads it */
    PyObject *seq = PySequence_Tuple(ids); /* a snapshot: code a lookup runs cannot change it */
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow;
        if (!PyLong_CheckExact(items[i]))
            goto none;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow)
            goto none;
        if (v == -1 && PyErr_Occurred())
            goto fail;
        PyObject *d = shard_at(shards, (Py_hash_t)v);
        PyObject *obj = d == NULL ? NULL : PyDict_GetItemWithError(d, items[i]);
        if (obj == NULL) {
            if (PyErr_Occurred())
                goto fail;
            goto none;
        }
        Py_INCREF(obj);
        PyList_SET_ITEM(out, i, obj);
        PyObject *state = get(st, obj, F_STATE), *freed;
        if (state == NULL)
            goto fail;
        Py_DECREF(state); /* compared by identity only */
        if (state != committed)
            goto none;
        if ((freed = get(st, obj, F_FREED)) == NULL)
            goto fail;
        int t = PyObject_IsTrue(freed);
        Py_DECREF(freed);
        if (t < 0)
            goto fail;
        if (t)
            goto none;
    }
    Py_DECREF(seq);
    return out;
none:
    Py_DECREF(out);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* ------------------------------------------------------------------ eviction queues */

/* remove_all(objs, segments) -> (pages, emptied)
 *
 * PriorityLRU.remove_all's loop: each of ``objs`` in a queue segment (``obj.queue_seg``, a
 * number in ``segments``) leaves it; ``pages``: theirs; ``emptied``: (number, obj) of each
 * segment left empty, for the caller to forget (as the loop's ``q.drop``).
 */
static PyObject *
remove_all_impl(State *st, PyObject *objs, PyObject *segments)
{
    if (check_list(objs, "objs") < 0 || check_dict(segments, "segments") < 0)
        return NULL;
    PyObject *emptied = PyList_New(0);
    Py_ssize_t pages = 0;
    if (emptied == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objs); i++) {
        PyObject *obj = PyList_GET_ITEM(objs, i);
        Py_INCREF(obj);
        PyObject *oid = NULL, *seg = NULL, *num = get(st, obj, F_SEG);
        Py_ssize_t np;
        if (num == NULL)
            goto next_fail;
        if (num == Py_None)
            goto next;
        seg = PyDict_GetItemWithError(segments, num);
        if (seg == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, num);
            goto next_fail;
        }
        Py_INCREF(seg);
        if (!PyDict_Check(seg)) {
            PyErr_SetString(PyExc_TypeError, "a queue segment must be a dict");
            goto next_fail;
        }
        if ((oid = get(st, obj, F_ID)) == NULL || PyDict_DelItem(seg, oid) < 0 || set(st, obj, F_SEG, Py_None) < 0)
            goto next_fail;
        np = get_int(st, obj, F_NPAGES);
        if (np == -1 && PyErr_Occurred())
            goto next_fail;
        pages += np;
        if (PyDict_GET_SIZE(seg) == 0) {
            PyObject *t = PyTuple_Pack(2, num, obj);
            int r = t == NULL ? -1 : PyList_Append(emptied, t);
            Py_XDECREF(t);
            if (r < 0)
                goto next_fail;
        }
    next:
        Py_XDECREF(seg);
        Py_XDECREF(oid);
        Py_DECREF(num);
        Py_DECREF(obj);
        continue;
    next_fail:
        Py_XDECREF(seg);
        Py_XDECREF(oid);
        Py_XDECREF(num);
        Py_DECREF(obj);
        Py_DECREF(emptied);
        return NULL;
    }
    return Py_BuildValue("nN", pages, emptied);
}

static PyObject *
remove_all(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *objs, *segments;
    if (!PyArg_ParseTuple(args, "OO", &objs, &segments))
        return NULL;
    return remove_all_impl(st, objs, segments);
}

/* fill(objs, start, ct, seg, num, room) -> (stop, pages)
 *
 * PriorityLRU.add_all's loop over one run: from ``objs[start]`` on, each object of content
 * type ``ct`` (by identity) that is in no queue (``queue_seg`` None) goes at the end of
 * segment ``seg`` (number ``num``), at most ``room`` of them; ``stop``: the index of the
 * first object not placed; ``pages``: the placed objects'.
 */
static PyObject *
fill(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *objs, *ct, *seg, *num;
    Py_ssize_t start, room, pages = 0;
    if (!PyArg_ParseTuple(args, "OnOOOn", &objs, &start, &ct, &seg, &num, &room))
        return NULL;
    if (check_list(objs, "objs") < 0 || check_dict(seg, "seg") < 0)
        return NULL;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must not be negative");
        return NULL;
    }
    Py_ssize_t i = start;
    for (; i < PyList_GET_SIZE(objs) && room > 0; i++, room--) {
        PyObject *obj = PyList_GET_ITEM(objs, i);
        Py_INCREF(obj);
        PyObject *oid = NULL, *v = get(st, obj, F_SEG);
        Py_ssize_t np;
        int stop = v == NULL ? -1 : v != Py_None;
        Py_XDECREF(v);
        if (!stop) {
            v = get(st, obj, F_CT);
            stop = v == NULL ? -1 : v != ct;
            Py_XDECREF(v);
        }
        if (stop) {
            Py_DECREF(obj);
            if (stop < 0)
                return NULL;
            break;
        }
        if ((oid = get(st, obj, F_ID)) == NULL || PyDict_SetItem(seg, oid, obj) < 0 || set(st, obj, F_SEG, num) < 0)
            goto next_fail;
        np = get_int(st, obj, F_NPAGES);
        if (np == -1 && PyErr_Occurred())
            goto next_fail;
        pages += np;
        Py_DECREF(oid);
        Py_DECREF(obj);
        continue;
    next_fail:
        Py_XDECREF(oid);
        Py_DECREF(obj);
        return NULL;
    }
    return Py_BuildValue("nn", i, pages);
}

/* touch_run(objs, start, ct, segments, last, num, room) -> (stop, emptied)
 *
 * PriorityLRU.touch of each object of a run: from ``objs[start]`` on, each object of content
 * type ``ct`` (by identity) that is in a queue segment (its ``queue_seg`` number in
 * ``segments``, holding it) moves to the end of segment ``last`` (number ``num``), which has
 * ``room`` free places; an object in no segment is left as it is. ``stop``: the index of the
 * first object of another type, or that needs a place when none is left; ``emptied``: the
 * numbers of segments other than ``last`` left empty, for the caller to forget.
 */
static PyObject *
touch_run(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *objs, *ct, *segments, *last, *num;
    Py_ssize_t start, room;
    if (!PyArg_ParseTuple(args, "OnOOOOn", &objs, &start, &ct, &segments, &last, &num, &room))
        return NULL;
    if (check_list(objs, "objs") < 0 || check_dict(segments, "segments") < 0 || check_dict(last, "last") < 0)
        return NULL;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must not be negative");
        return NULL;
    }
    PyObject *emptied = PyList_New(0);
    if (emptied == NULL)
        return NULL;
    Py_ssize_t i = start;
    for (; i < PyList_GET_SIZE(objs); i++) {
        PyObject *obj = PyList_GET_ITEM(objs, i);
        Py_INCREF(obj);
        PyObject *oid = NULL, *seg = NULL, *v = get(st, obj, F_CT), *at = NULL;
        int stop = v == NULL ? -1 : v != ct;
        Py_XDECREF(v);
        if (stop)
            goto out;
        if ((v = get(st, obj, F_SEG)) == NULL)
            goto fail;
        if (v != Py_None) {
            seg = PyDict_GetItemWithError(segments, v);
            Py_XINCREF(seg);
        }
        if (seg == NULL) {
            Py_DECREF(v);
            if (PyErr_Occurred())
                goto fail;
            Py_DECREF(obj);
            continue; /* in no queue: touch leaves it */
        }
        if (!PyDict_Check(seg) || (oid = get(st, obj, F_ID)) == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "a queue segment must be a dict");
            Py_DECREF(v);
            goto fail;
        }
        at = PyDict_GetItemWithError(seg, oid);
        if (at != obj) {
            Py_DECREF(v);
            if (PyErr_Occurred())
                goto fail;
            Py_DECREF(seg);
            Py_DECREF(oid);
            Py_DECREF(obj);
            continue; /* its number names a segment that does not hold it: not in a queue */
        }
        if (room + (seg == last) <= 0) { /* no place left: the caller starts a segment */
            Py_DECREF(v);
            stop = 1;
            goto out;
        }
        if (PyDict_DelItem(seg, oid) < 0) {
            Py_DECREF(v);
            goto fail;
        }
        room += seg == last;
        if (PyDict_GET_SIZE(seg) == 0 && seg != last && PyList_Append(emptied, v) < 0) {
            Py_DECREF(v);
            goto fail;
        }
        Py_DECREF(v);
        if (PyDict_SetItem(last, oid, obj) < 0 || set(st, obj, F_SEG, num) < 0)
            goto fail;
        room--;
        Py_DECREF(seg);
        Py_DECREF(oid);
        Py_DECREF(obj);
        continue;
    out:
        Py_XDECREF(seg);
        Py_XDECREF(oid);
        Py_DECREF(obj);
        if (stop < 0) {
            Py_DECREF(emptied);
            return NULL;
        }
        break;
    fail:
        Py_XDECREF(seg);
        Py_XDECREF(oid);
        Py_DECREF(obj);
        Py_DECREF(emptied);
        return NULL;
    }
    return Py_BuildValue("nN", i, emptied);
}

/* ------------------------------------------------------------------ fused passes */

/* pin_all, then remove_all of the objects that had no pin: a new tuple of 5 with its first
 * item left NULL for the caller, then (fresh, fresh_pages, contention, queued_pages, emptied),
 * ``fresh`` a count. */
static PyObject *
pin_remove_impl(State *st, PyObject *objs, PyObject *sid, PyObject *spins, PyObject *segments, Py_ssize_t first)
{
    PyObject *pinned = pin_all_impl(st, objs, sid, spins), *removed = NULL, *out = NULL;
    if (pinned == NULL)
        return NULL;
    PyObject *fresh = PyTuple_GET_ITEM(pinned, 0);
    if (PyList_GET_SIZE(fresh) == 0)
        removed = Py_BuildValue("(n[])", (Py_ssize_t)0);
    else
        removed = remove_all_impl(st, fresh, segments);
    if (removed == NULL || (out = PyTuple_New(first + 5)) == NULL)
        goto done;
    PyObject *items[5] = {PyLong_FromSsize_t(PyList_GET_SIZE(fresh)), PyTuple_GET_ITEM(pinned, 1),
                          PyTuple_GET_ITEM(pinned, 2), PyTuple_GET_ITEM(removed, 0), PyTuple_GET_ITEM(removed, 1)};
    if (items[0] == NULL) {
        Py_CLEAR(out);
        goto done;
    }
    PyTuple_SET_ITEM(out, first, items[0]);
    for (int k = 1; k < 5; k++)
        PyTuple_SET_ITEM(out, first + k, Py_NewRef(items[k]));
done:
    Py_XDECREF(removed);
    Py_DECREF(pinned);
    return out;
}

/* pin_remove(objs, sid, spins, segments) -> (fresh, fresh_pages, contention, queued_pages, emptied)
 *
 * PinLedger.pin_all with a PriorityLRU on this core in one call: pin_all, then remove_all of
 * the objects that had no pin (they leave their eviction queues). ``fresh``: how many had no
 * pin, and ``fresh_pages`` theirs; ``queued_pages`` and ``emptied``: remove_all's.
 */
static PyObject *
pin_remove(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *objs, *sid, *spins, *segments;
    if (!PyArg_ParseTuple(args, "OOOO", &objs, &sid, &spins, &segments))
        return NULL;
    return pin_remove_impl(st, objs, sid, spins, segments, 0);
}

/* lookup_pin(key_shards, keys, most, pool, sid, spins, segments, room)
 *     -> None | (found, None) | (found, fresh, fresh_pages, contention, queued_pages, emptied)
 *
 * ObjectStore.lookup with pin in one call: find_keys, then (when ``room`` < 0, no limit, or
 * the prefix found is at most ``room`` objects) pin_remove of what it found. None: a key the
 * caller's checks then name (find_keys's None); (found, None): more than ``room`` found,
 * nothing pinned (the caller's limit check then says so); otherwise found and pin_remove's.
 */
static PyObject *
lookup_pin(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *shards, *keys, *pool, *sid, *spins, *segments;
    Py_ssize_t most, room;
    if (!PyArg_ParseTuple(args, "OOnOOOOn", &shards, &keys, &most, &pool, &sid, &spins, &segments, &room))
        return NULL;
    PyObject *found = find_keys_impl(shards, keys, most, pool);
    if (found == NULL || found == Py_None)
        return found;
    if (room >= 0 && PyList_GET_SIZE(found) > room)
        return Py_BuildValue("(NO)", found, Py_None);
    PyObject *out = pin_remove_impl(st, found, sid, spins, segments, 1);
    if (out == NULL) {
        Py_DECREF(found);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, found);
    return out;
}

/* unpin_held(obj_shards, ids, sid, spins) -> None | (objs, zero, zero_pages, any_freed)
 *
 * ObjectStore.unpin in the usual case in one call: held_once, then unpin_once on what it
 * found. None: held_once's None (nothing changed; the caller checks id by id).
 */
static PyObject *
unpin_held(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *shards, *ids, *sid, *spins;
    if (!PyArg_ParseTuple(args, "OOOO", &shards, &ids, &sid, &spins))
        return NULL;
    PyObject *objs = held_once_impl(st, shards, ids, sid);
    if (objs == NULL || objs == Py_None)
        return objs;
    PyObject *r = unpin_once_impl(st, objs, sid, spins), *out = NULL;
    if (r != NULL && (out = PyTuple_New(4)) != NULL) {
        PyTuple_SET_ITEM(out, 0, Py_NewRef(objs));
        for (int k = 0; k < 3; k++)
            PyTuple_SET_ITEM(out, k + 1, Py_NewRef(PyTuple_GET_ITEM(r, k)));
    }
    Py_XDECREF(r);
    Py_DECREF(objs);
    return out;
}

/* reply_size(objs) -> (pages, key_bytes) | None
 *
 * The sums ReplyRoom.take (broker/store/object_table.py) estimates a reply of ``objs`` from:
 * their num_pages, and the lengths of their keys (None counts 0). None where ``objs`` is not a
 * list or a key is neither bytes nor None: the caller's Python sums then say what is wrong.
 */
static PyObject *
reply_size(PyObject *self, PyObject *objs)
{
    State *st = state_of(self);
    if (!PyList_CheckExact(objs))
        Py_RETURN_NONE;
    Py_ssize_t pages = 0, keys = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objs); i++) {
        PyObject *o = PyList_GET_ITEM(objs, i);
        Py_ssize_t n = get_int(st, o, F_NPAGES);
        if (n == -1 && PyErr_Occurred())
            return NULL;
        PyObject *k = get(st, o, F_KEY);
        if (k == NULL)
            return NULL;
        int ok = k == Py_None || PyBytes_CheckExact(k);
        if (ok && k != Py_None)
            keys += PyBytes_GET_SIZE(k);
        Py_DECREF(k);
        if (!ok)
            Py_RETURN_NONE;
        pages += n;
    }
    return Py_BuildValue("(nn)", pages, keys);
}

/* ------------------------------------------------------------------ the module */

static PyMethodDef methods[] = {
    {"find_keys", find_keys, METH_VARARGS, "the objects of the longest prefix of keys in the key index"},
    {"pin_all", pin_all, METH_VARARGS, "one more pin of a session on each object"},
    {"held_once", held_once, METH_VARARGS, "the objects of ids when each is named once and pinned by the session"},
    {"unpin_once", unpin_once, METH_VARARGS, "one pin of a session less on each object"},
    {"pinnable_all", pinnable_all, METH_VARARGS, "the objects of ids when each is live and committed"},
    {"remove_all", remove_all, METH_VARARGS, "objects leave their eviction queue segments"},
    {"fill", fill, METH_VARARGS, "objects of one content type join the end of a queue segment"},
    {"touch_run", touch_run, METH_VARARGS, "objects of one content type move to the end of their queue"},
    {"pin_remove", pin_remove, METH_VARARGS, "pin_all and remove_all in one call"},
    {"lookup_pin", lookup_pin, METH_VARARGS, "find_keys, pin_all and remove_all in one call"},
    {"unpin_held", unpin_held, METH_VARARGS, "held_once and unpin_once in one call"},
    {"reply_size", reply_size, METH_O, "the pages and key bytes of objects, for a reply's estimate"},
    {NULL, NULL, 0, NULL},
};

CORE_MODULE(_storecore, "The store's native core: a step's per-key passes.")
