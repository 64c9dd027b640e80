/* The step wire's native core: the per-item passes of proto/wire/step.py in C.
 *
 * Loaded through memory_broker.proto.wire.native.load; every function here has a Python
 * definition in step.py that gives the same result, and the tests run both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* unpack_u64s(buf, offset, count) -> tuple of ints: `count` little-endian u64s from `offset`. */
static PyObject *
unpack_u64s(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset, count;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &offset, &count))
        return NULL;
    if (offset < 0 || count < 0 || offset > view.len || count > (view.len - offset) / 8) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "u64 run past the end of the buffer");
        return NULL;
    }
    PyObject *out = PyTuple_New(count);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf + offset;
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned long long v;
        memcpy(&v, p + 8 * i, 8); /* x86-64 and aarch64 are little-endian */
        PyObject *n = PyLong_FromUnsignedLongLong(v);
        if (n == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&view);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, n);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"unpack_u64s", unpack_u64s, METH_VARARGS, "count little-endian u64s from offset, as a tuple"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_stepcore", "The step wire's native core.", -1, methods,
};

PyMODINIT_FUNC
PyInit__stepcore(void)
{
#if PY_BIG_ENDIAN
    PyErr_SetString(PyExc_ImportError, "the native step core assumes a little-endian machine");
    return NULL;
#endif
    return PyModule_Create(&module);
}
