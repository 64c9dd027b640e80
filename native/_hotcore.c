/* The adapter wing's native core: a step's per-adapter passes over hot adapters in C.
 *
 * Loaded through memory_broker.proto.wire.native.load by broker/adapters/hot_path.py; each
 * function has a Python definition there that gives the same result, and the tests run both
 * (tests/test_adapter_hot_native.py compares them on random sequences). Nothing here changes
 * the store: these functions find objects and check them; the store's PinLedger pins them.
 *
 * Every function takes any Python object and refuses what it cannot read with a Python
 * exception (TypeError), or answers None ("not the common case: take the full path").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* The fields read per adapter: an entry's object, and that object's fields, through ordinary
 * attribute access by names interned once in the module's state. */
enum { A_OBJ, A_ID, A_FREED, A_STATE, A_PINS, NNAMES };
static const char *const NAMES[NNAMES] = {"obj", "object_id", "freed", "state", "pins"};
#include "module_state.h"

/* o.<field>, a new reference (NULL and an exception if it has none). */
static inline PyObject *
get(State *st, PyObject *o, int f)
{
    return PyObject_GetAttr(o, st->names[f]);
}

/* `own[aid].obj` (a new reference), or NULL: with no exception set when `aid` is not in
 * `own` or its entry has no object (not the common case), else an error. */
static PyObject *
entry_object(State *st, PyObject *own, PyObject *aid)
{
    PyObject *entry = PyDict_GetItemWithError(own, aid); /* borrowed */
    if (entry == NULL)
        return NULL;
    Py_INCREF(entry); /* held: a getattr may run code that changes `own` */
    PyObject *obj = get(st, entry, A_OBJ);
    Py_DECREF(entry);
    if (obj == Py_None) {
        Py_DECREF(obj);
        return NULL;
    }
    return obj;
}

/* 1 when `obj` is the store's object of its id (`shards[oid & (len - 1)]` holds it) and, with
 * `committed` not NULL, not freed and in state `committed` (what the store's `pinnable`
 * asks); 0 when not; -1 on an error. */
static int
is_live(State *st, PyObject *obj, PyObject *shards, PyObject *committed)
{
    PyObject *oid = get(st, obj, A_ID);
    if (oid == NULL)
        return -1;
    if (!PyLong_Check(oid)) {
        Py_DECREF(oid);
        PyErr_SetString(PyExc_TypeError, "an object id is not an int");
        return -1;
    }
    /* The list's size is read again here: code run by a getattr may have changed it. */
    Py_ssize_t nshards = PyList_GET_SIZE(shards);
    if (nshards <= 0) {
        Py_DECREF(oid);
        PyErr_SetString(PyExc_TypeError, "the store's object shards are empty");
        return -1;
    }
    size_t slot = (size_t)PyLong_AsUnsignedLongLongMask(oid) & (size_t)(nshards - 1);
    if (slot >= (size_t)nshards)
        slot = (size_t)nshards - 1;
    PyObject *shard = PyList_GET_ITEM(shards, slot);
    if (!PyDict_Check(shard)) {
        Py_DECREF(oid);
        PyErr_SetString(PyExc_TypeError, "the store's object shards are not dicts");
        return -1;
    }
    Py_INCREF(shard);
    PyObject *found = PyDict_GetItemWithError(shard, oid); /* borrowed; compared, never used */
    Py_DECREF(shard);
    Py_DECREF(oid);
    if (found != obj)
        return PyErr_Occurred() ? -1 : 0;
    if (committed == NULL)
        return 1;
    PyObject *v = get(st, obj, A_FREED);
    if (v == NULL)
        return -1;
    int freed = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (freed != 0)
        return freed < 0 ? -1 : 0;
    v = get(st, obj, A_STATE);
    if (v == NULL)
        return -1;
    int ok = PyObject_RichCompareBool(v, committed, Py_EQ);
    Py_DECREF(v);
    return ok;
}

/* `o` as a tuple (itself when it is one): a list's items could change under code that a hash,
 * a comparison or a getattr runs; a tuple's cannot. */
static PyObject *
as_tuple(PyObject *o, const char *what)
{
    if (PyTuple_CheckExact(o))
        return Py_NewRef(o);
    if (!PySequence_Check(o)) {
        PyErr_SetString(PyExc_TypeError, what);
        return NULL;
    }
    return PySequence_Tuple(o);
}

static int
check_shards(PyObject *shards)
{
    Py_ssize_t n = PyList_Check(shards) ? PyList_GET_SIZE(shards) : 0;
    if (n <= 0 || (n & (n - 1))) {
        PyErr_SetString(PyExc_TypeError, "shards must be a list of dicts, a power of two of them");
        return -1;
    }
    return 0;
}

/* pin_plan(own, ids, cap, shards, committed) -> (distinct ids, objects, live) | None
 *
 * The distinct ids of `ids` in order and each one's hot object (`own[id].obj`), when every
 * one is in `own` with an object and `cap` (0: none) admits them all; None otherwise.
 * `live`: whether every object is live, committed and not freed (what the store's pin
 * checks). Changes nothing. */
static PyObject *
pin_plan(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *own, *ids, *shards, *committed;
    Py_ssize_t cap;
    if (!PyArg_ParseTuple(args, "O!OnO!O", &PyDict_Type, &own, &ids, &cap, &PyList_Type, &shards, &committed))
        return NULL;
    if (check_shards(shards) < 0)
        return NULL;
    PyObject *seq = as_tuple(ids, "ids must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *seen = PySet_New(NULL);
    PyObject *distinct = PyList_New(0);
    PyObject *objs = PyList_New(0);
    PyObject *out = NULL;
    int live = 1;
    if (seen == NULL || distinct == NULL || objs == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *aid = items[i];
        int had = PySet_Contains(seen, aid);
        if (had < 0)
            goto done;
        if (had)
            continue;
        if (PySet_Add(seen, aid) < 0 || PyList_Append(distinct, aid) < 0)
            goto done;
        if (cap > 0 && PyList_GET_SIZE(distinct) > cap)
            goto none;
        PyObject *obj = entry_object(st, own, aid);
        if (obj == NULL) {
            if (PyErr_Occurred())
                goto done;
            goto none;
        }
        int r = live ? is_live(st, obj, shards, committed) : 0;
        if (r < 0 || PyList_Append(objs, obj) < 0) {
            Py_DECREF(obj);
            goto done;
        }
        Py_DECREF(obj);
        live = r;
    }
    out = PyTuple_Pack(3, distinct, objs, live ? Py_True : Py_False);
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(seen);
    Py_XDECREF(distinct);
    Py_XDECREF(objs);
    Py_DECREF(seq);
    return out;
}

/* release_plan(own, ids, sid, shards) -> (objects, counts | None) | None
 *
 * Each distinct id's hot object (first-listed order) with how many times it is listed
 * (counts None when each id is listed once), when every one is in `own` with an object the
 * store holds under its id, on which session `sid` holds at least that many pins
 * (`obj.pins[sid]`: what the store's unpin checks); None otherwise. Changes nothing. */
static PyObject *
release_plan(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *own, *ids, *sid, *shards;
    if (!PyArg_ParseTuple(args, "O!OOO!", &PyDict_Type, &own, &ids, &sid, &PyList_Type, &shards))
        return NULL;
    if (check_shards(shards) < 0)
        return NULL;
    PyObject *seq = as_tuple(ids, "ids must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    /* id -> its index in `order` */
    PyObject *index = PyDict_New();
    PyObject *order = PyList_New(0);
    Py_ssize_t *counts = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    PyObject *objs = NULL, *counted = NULL, *out = NULL;
    int repeated = 0;
    if (index == NULL || order == NULL || counts == NULL) {
        if (counts == NULL)
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *aid = items[i];
        PyObject *at = PyDict_GetItemWithError(index, aid); /* borrowed */
        if (at != NULL) {
            counts[PyLong_AsSsize_t(at)]++;
            repeated = 1;
            continue;
        }
        if (PyErr_Occurred())
            goto done;
        PyObject *k = PyLong_FromSsize_t(PyList_GET_SIZE(order));
        if (k == NULL)
            goto done;
        int r = PyDict_SetItem(index, aid, k);
        Py_DECREF(k);
        if (r < 0 || PyList_Append(order, aid) < 0)
            goto done;
        counts[PyList_GET_SIZE(order) - 1] = 1;
    }
    Py_ssize_t m = PyList_GET_SIZE(order);
    objs = PyList_New(m);
    if (objs == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *obj = entry_object(st, own, PyList_GET_ITEM(order, j));
        if (obj == NULL) {
            if (PyErr_Occurred())
                goto done;
            goto none;
        }
        PyList_SET_ITEM(objs, j, obj); /* steals */
        int live = is_live(st, obj, shards, NULL);
        if (live < 0)
            goto done;
        if (!live)
            goto none;
        PyObject *pins = get(st, obj, A_PINS);
        if (pins == NULL)
            goto done;
        if (!PyDict_Check(pins)) {
            Py_DECREF(pins);
            PyErr_SetString(PyExc_TypeError, "an object's pins are not a dict");
            goto done;
        }
        PyObject *held = PyDict_GetItemWithError(pins, sid); /* borrowed */
        Py_ssize_t have = 0;
        if (held != NULL) {
            Py_INCREF(held);
            have = PyLong_Check(held) ? PyLong_AsSsize_t(held) : -1;
            Py_DECREF(held);
        }
        Py_DECREF(pins);
        if (PyErr_Occurred())
            goto done;
        if (have < counts[j])
            goto none; /* the full path says why */
    }
    if (repeated) {
        counted = PyList_New(m);
        if (counted == NULL)
            goto done;
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *c = PyLong_FromSsize_t(counts[j]);
            if (c == NULL)
                goto done;
            PyList_SET_ITEM(counted, j, c);
        }
        out = PyTuple_Pack(2, objs, counted);
    } else {
        out = PyTuple_Pack(2, objs, Py_None);
    }
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(index);
    Py_XDECREF(order);
    Py_XDECREF(objs);
    Py_XDECREF(counted);
    PyMem_Free(counts);
    Py_DECREF(seq);
    return out;
}

/* counts[k] += n and order[k] = seq + i for each key k of `run` at index i: the uses of a
 * run from position `seq` on (n of them, the last from `seq`); 0, or -1 on an error. */
static int
count_run(PyObject *run, Py_ssize_t n, long long seq, PyObject *counts, PyObject *order)
{
    PyObject *times = PyLong_FromSsize_t(n);
    if (times == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(run); i++) {
        PyObject *k = PyTuple_GET_ITEM(run, i);
        PyObject *had = PyDict_GetItemWithError(counts, k); /* borrowed */
        PyObject *c;
        if (had != NULL) {
            Py_INCREF(had);
            c = PyNumber_Add(had, times);
            Py_DECREF(had);
        } else if (PyErr_Occurred())
            c = NULL;
        else
            c = Py_NewRef(times);
        PyObject *at = c == NULL ? NULL : PyLong_FromLongLong(seq + i);
        int r = at == NULL ? -1 : PyDict_SetItem(counts, k, c);
        if (r == 0)
            r = PyDict_SetItem(order, k, at);
        Py_XDECREF(c);
        Py_XDECREF(at);
        if (r < 0) {
            Py_DECREF(times);
            return -1;
        }
    }
    Py_DECREF(times);
    return 0;
}

/* One tier's record of one use of `run` (a tuple of keys) from position `seq`. `last` is
 * [the last run recorded or None, its uses since it was counted, the position of the last]:
 * the same run again (equal keys in the same order) counts there; another run first counts
 * the last one's uses into its keys (``count_run``), then its own key by key, and becomes the
 * last. 0, or -1 on an error. */
static int
record_one(PyObject *run, long long seq, PyObject *last, PyObject *counts, PyObject *order)
{
    if (!PyList_CheckExact(last) || PyList_GET_SIZE(last) != 3) {
        PyErr_SetString(PyExc_TypeError, "last must be a list [run or None, uses, position]");
        return -1;
    }
    PyObject *prev = Py_NewRef(PyList_GET_ITEM(last, 0));
    int same = prev == run ? 1 : prev == Py_None ? 0 : PyObject_RichCompareBool(prev, run, Py_EQ);
    PyObject *uses = NULL, *at = NULL;
    int r = -1;
    if (same < 0)
        goto done;
    Py_ssize_t n = PyLong_AsSsize_t(PyList_GET_ITEM(last, 1));
    long long was = PyLong_AsLongLong(PyList_GET_ITEM(last, 2));
    if (PyErr_Occurred())
        goto done;
    if (same) {
        uses = PyLong_FromSsize_t(n + 1);
    } else {
        if (n > 0 && (!PyTuple_Check(prev) || count_run(prev, n, was, counts, order) < 0)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "the last run is not a tuple");
            goto done;
        }
        if (count_run(run, 1, seq, counts, order) < 0)
            goto done;
        uses = PyLong_FromLong(0);
    }
    at = uses == NULL ? NULL : PyLong_FromLongLong(seq);
    if (at == NULL || PyList_GET_SIZE(last) != 3)
        goto done;
    if (!same)
        PyList_SetItem(last, 0, Py_NewRef(run));
    PyList_SetItem(last, 1, uses); /* steals */
    PyList_SetItem(last, 2, at);
    uses = at = NULL;
    r = 0;
done:
    Py_XDECREF(uses);
    Py_XDECREF(at);
    Py_DECREF(prev);
    return r;
}

/* record_run(run, seq, last, counts, order[, last2, counts2, order2]) -> seq + len(run)
 *
 * BatchedAccess's record of one use of each key of `run` (a tuple) in order from position
 * `seq` (``record_one``); with `last2`, `counts2` and `order2`, the same in those too (a
 * second tier hearing the same uses at the same positions). */
static PyObject *
record_run(PyObject *self, PyObject *args)
{
    PyObject *run, *last, *counts, *order, *last2 = NULL, *counts2 = NULL, *order2 = NULL;
    long long seq;
    if (!PyArg_ParseTuple(args, "O!LO!O!O!|O!O!O!", &PyTuple_Type, &run, &seq, &PyList_Type, &last, &PyDict_Type,
                          &counts, &PyDict_Type, &order, &PyList_Type, &last2, &PyDict_Type, &counts2, &PyDict_Type,
                          &order2))
        return NULL;
    if ((last2 == NULL) != (order2 == NULL)) {
        PyErr_SetString(PyExc_TypeError, "record_run: give last2, counts2 and order2, or none of them");
        return NULL;
    }
    if (record_one(run, seq, last, counts, order) < 0)
        return NULL;
    if (last2 != NULL && record_one(run, seq, last2, counts2, order2) < 0)
        return NULL;
    return PyLong_FromLongLong(seq + PyTuple_GET_SIZE(run));
}

/* join_rows(head, kept, objs) -> bytes | None
 *
 * `head` followed by `kept[obj.object_id]` for each of `objs` (each a bytes), in one copy;
 * None when any object's row is not kept (the caller makes it and asks again). */
static PyObject *
join_rows(PyObject *self, PyObject *args)
{
    State *st = state_of(self);
    PyObject *head, *kept, *list;
    if (!PyArg_ParseTuple(args, "SO!O!", &head, &PyDict_Type, &kept, &PyList_Type, &list))
        return NULL;
    PyObject *objs = PyList_AsTuple(list); /* a getattr below cannot change it */
    if (objs == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(objs);
    PyObject **rows = PyMem_Malloc((n ? n : 1) * sizeof(PyObject *));
    if (rows == NULL) {
        Py_DECREF(objs);
        return PyErr_NoMemory();
    }
    Py_ssize_t total = PyBytes_GET_SIZE(head), got = 0;
    PyObject *out = NULL;
    for (; got < n; got++) {
        PyObject *oid = get(st, PyTuple_GET_ITEM(objs, got), A_ID);
        if (oid == NULL)
            goto done;
        PyObject *row = PyDict_GetItemWithError(kept, oid); /* borrowed */
        Py_DECREF(oid);
        if (row == NULL) {
            if (!PyErr_Occurred())
                out = Py_NewRef(Py_None);
            goto done;
        }
        if (!PyBytes_Check(row)) {
            PyErr_SetString(PyExc_TypeError, "a kept row is not bytes");
            goto done;
        }
        Py_INCREF(row);
        rows[got] = row;
        total += PyBytes_GET_SIZE(row);
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out != NULL) {
        char *p = PyBytes_AS_STRING(out);
        memcpy(p, PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head));
        p += PyBytes_GET_SIZE(head);
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(p, PyBytes_AS_STRING(rows[i]), PyBytes_GET_SIZE(rows[i]));
            p += PyBytes_GET_SIZE(rows[i]);
        }
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        Py_DECREF(rows[i]);
    PyMem_Free(rows);
    Py_DECREF(objs);
    return out;
}

static PyMethodDef methods[] = {
    {"pin_plan", pin_plan, METH_VARARGS, "distinct ids and their live hot objects, or None"},
    {"release_plan", release_plan, METH_VARARGS, "hot objects and counts a session may release, or None"},
    {"record_run", record_run, METH_VARARGS, "one use of a run of keys, in order; returns the next seq"},
    {"join_rows", join_rows, METH_VARARGS, "head and each object's kept row in one bytes, or None"},
    {NULL, NULL, 0, NULL},
};

CORE_MODULE(_hotcore, "The adapter wing's native core (hot acquire and release).")
