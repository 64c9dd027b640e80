/* What every native core shares: multi-phase init and a module state holding the attribute
 * names it reads and writes, interned once per module object (nothing process-global, so each
 * interpreter has its own).
 *
 * A core defines NNAMES and `static const char *const NAMES[NNAMES]` before including this,
 * and ends with CORE_MODULE(its name, its doc) after its `methods` table. */
#ifndef MEMORY_BROKER_MODULE_STATE_H
#define MEMORY_BROKER_MODULE_STATE_H

typedef struct {
    PyObject *names[NNAMES]; /* interned attribute names */
} State;

static inline State *
state_of(PyObject *module)
{
    return (State *)PyModule_GetState(module);
}

static int
exec_module(PyObject *module)
{
#if PY_BIG_ENDIAN
    PyErr_SetString(PyExc_ImportError, "the native cores assume a little-endian machine");
    return -1;
#endif
    State *st = state_of(module);
    for (int i = 0; i < NNAMES; i++)
        if ((st->names[i] = PyUnicode_InternFromString(NAMES[i])) == NULL)
            return -1;
    return 0;
}

static int
traverse(PyObject *module, visitproc visit, void *arg)
{
    State *st = state_of(module);
    for (int i = 0; i < NNAMES; i++)
        Py_VISIT(st->names[i]);
    return 0;
}

static int
clear(PyObject *module)
{
    State *st = state_of(module);
    for (int i = 0; i < NNAMES; i++)
        Py_CLEAR(st->names[i]);
    return 0;
}

static void
free_module(void *module)
{
    clear((PyObject *)module);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

#define CORE_MODULE(NAME, DOC)                                                                   \
    static struct PyModuleDef module = {                                                        \
        PyModuleDef_HEAD_INIT,                                                                  \
        .m_name = #NAME,                                                                        \
        .m_doc = DOC,                                                                           \
        .m_size = sizeof(State),                                                                \
        .m_methods = methods,                                                                   \
        .m_slots = slots,                                                                       \
        .m_traverse = traverse,                                                                 \
        .m_clear = clear,                                                                       \
        .m_free = free_module,                                                                  \
    };                                                                                          \
    PyMODINIT_FUNC PyInit_##NAME(void) { return PyModuleDef_Init(&module); }

#endif
