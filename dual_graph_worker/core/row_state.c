/* RowState: each request-pool row's acceptance state, and the loops over a batch's rows that
   read and update it (the same methods, loop for loop, as row_state.PyRowState: the tests hold
   the two to the same floats). Built with -ffp-contract=off: every operation rounds as
   Python's does. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    Py_ssize_t first_draws;
    double alpha, keep_sq, alpha_sq;
    double *est;          /* NaN until the row's first draws are in */
    double *noise;        /* the estimate's variance in draws' */
    double *draws;        /* n x first_draws */
    long long *admitted_at;
    Py_ssize_t *drawn;    /* first draws in so far */
    Py_ssize_t *rows;     /* scratch: the batch's rows, checked (take_rows) */
    Py_ssize_t rows_cap;
    int busy;             /* a method runs: Python code it calls may not re-enter */
} RowState;

/* `obj`'s rows (a list of ints, or a 1-d buffer of 4- or 8-byte ints: numpy's int32 / int64),
   each checked against the pool, into the object's scratch `rows`; their count, or -1 with an
   exception set. */
static Py_ssize_t take_rows(RowState *self, PyObject *obj) {
    Py_buffer view;
    int listed = PyList_Check(obj);
    if (!listed) {
        if (PyObject_GetBuffer(obj, &view, PyBUF_RECORDS_RO) < 0)
            return -1;
        const char *f = view.format ? view.format : "B";
        if (*f == '<' || *f == '=' || *f == '@')
            f++;
        if (view.ndim != 1 || f[0] == '\0' || f[1] != '\0'
                || !((view.itemsize == 8 && (*f == 'l' || *f == 'q'))
                     || (view.itemsize == 4 && (*f == 'i' || *f == 'l')))) {
            PyErr_Format(PyExc_TypeError, "rows must be a list or a 1-d int32/int64 array, "
                         "got format '%s' of %d dimensions", f, view.ndim);
            PyBuffer_Release(&view);
            return -1;
        }
    }
    Py_ssize_t len = listed ? PyList_GET_SIZE(obj) : view.shape[0];
    if (len > self->rows_cap) {
        Py_ssize_t *grown = PyMem_Realloc(self->rows, len * sizeof(Py_ssize_t));
        if (!grown) {
            if (!listed)
                PyBuffer_Release(&view);
            PyErr_NoMemory();
            return -1;
        }
        self->rows = grown;
        self->rows_cap = len;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        long long row;
        if (listed) {
            if (i >= PyList_GET_SIZE(obj)) {     /* an __index__ that shrank the list */
                len = i;
                break;
            }
            PyObject *item = PyList_GET_ITEM(obj, i);
            Py_INCREF(item);
            row = PyLong_AsLongLong(item);
            Py_DECREF(item);
            if (row == -1 && PyErr_Occurred())
                return -1;
        } else {
            const char *at = (const char *)view.buf + i * view.strides[0];
            if (view.itemsize == 8) {
                int64_t v;
                memcpy(&v, at, sizeof v);
                row = v;
            } else {
                int32_t v;
                memcpy(&v, at, sizeof v);
                row = v;
            }
        }
        if (row < 0 || row >= self->n) {
            PyErr_Format(PyExc_IndexError, "row %lld outside the pool's %zd rows", row, self->n);
            len = -1;
            break;
        }
        self->rows[i] = (Py_ssize_t)row;
    }
    if (!listed)
        PyBuffer_Release(&view);
    return len;
}

static int RowState_init(RowState *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"max_rows", "first_draws", "alpha", "keep_sq", "alpha_sq", NULL};
    Py_ssize_t n, k;
    double alpha, keep_sq, alpha_sq;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nnddd", names, &n, &k, &alpha, &keep_sq,
                                     &alpha_sq))
        return -1;
    if (self->est) {
        PyErr_SetString(PyExc_RuntimeError, "RowState is initialised once");
        return -1;
    }
    Py_ssize_t cells = n ? n : 1;
    if (n < 0 || k < 2 || k > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(double) / cells) {
        PyErr_SetString(PyExc_ValueError, "max_rows must be >= 0 and first_draws >= 2, "
                        "their product within memory");
        return -1;
    }
    self->first_draws = k;
    self->alpha = alpha;
    self->keep_sq = keep_sq;
    self->alpha_sq = alpha_sq;
    self->est = PyMem_Calloc(cells, sizeof(double));
    self->noise = PyMem_Calloc(cells, sizeof(double));
    self->draws = PyMem_Calloc(cells * k, sizeof(double));
    self->admitted_at = PyMem_Calloc(cells, sizeof(long long));
    self->drawn = PyMem_Calloc(cells, sizeof(Py_ssize_t));
    if (!self->est || !self->noise || !self->draws || !self->admitted_at || !self->drawn) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        self->est[i] = self->noise[i] = NAN;
        self->admitted_at[i] = -1;
    }
    self->n = n;          /* from here on rows index the arrays: 0 until they exist */
    return 0;
}

static void RowState_dealloc(RowState *self) {
    PyMem_Free(self->est);
    PyMem_Free(self->noise);
    PyMem_Free(self->draws);
    PyMem_Free(self->admitted_at);
    PyMem_Free(self->drawn);
    PyMem_Free(self->rows);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *admit_rows(RowState *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "admit(rows, step)");
        return NULL;
    }
    long long step = PyLong_AsLongLong(args[1]);
    if (step == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t len = take_rows(self, args[0]);
    if (len < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < len; i++) {
        Py_ssize_t row = self->rows[i];
        self->est[row] = self->noise[row] = NAN;
        self->admitted_at[row] = step;
        self->drawn[row] = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *newest_rows(RowState *self, PyObject *rows) {
    long long newest = -1;
    Py_ssize_t len = take_rows(self, rows);
    if (len < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < len; i++)
        if (self->admitted_at[self->rows[i]] > newest)
            newest = self->admitted_at[self->rows[i]];
    return PyLong_FromLongLong(newest);
}

static PyObject *pooled_rows(RowState *self, PyObject *rows) {
    double total = 0.0;
    Py_ssize_t known = 0;
    Py_ssize_t len = take_rows(self, rows);
    if (len < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < len; i++) {
        double e = self->est[self->rows[i]];
        if (e == e) {
            total += e;
            known++;
        }
    }
    return Py_BuildValue("(dn)", total, known);
}

static PyObject *weighted_rows(RowState *self, PyObject *const *args, Py_ssize_t nargs) {
    double v[6];
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "weighted(rows, every, fresh, centre, below, above, draw)");
        return NULL;
    }
    for (int j = 0; j < 6; j++) {
        v[j] = PyFloat_AsDouble(args[j + 1]);
        if (v[j] == -1.0 && PyErr_Occurred())
            return NULL;
    }
    double every = v[0], fresh = v[1], centre = v[2], below = v[3], above = v[4], draw = v[5];
    double total = 0.0;
    Py_ssize_t len = take_rows(self, args[0]);
    if (len < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < len; i++) {
        Py_ssize_t row = self->rows[i];
        double e = self->est[row];
        if (e != e) {
            total += fresh;
            continue;
        }
        double d = e < centre ? below : above;
        total += every + d * (e - every) / (d + draw * self->noise[row]);
    }
    return PyFloat_FromDouble(total);
}

/* A row's first draw: once first_draws are in, its first estimate (their mean) and their
   variance go to `firsts` and `within`, and its draws start over (a NaN accept length would
   unmeasure the row again). */
static int first_draw(RowState *self, Py_ssize_t row, double accept, PyObject *firsts,
                      PyObject *within) {
    Py_ssize_t k = self->first_draws;
    double *draws = self->draws + row * k;
    draws[self->drawn[row]++] = accept;
    if (self->drawn[row] < k)
        return 0;
    double total = 0.0, squares = 0.0;
    for (Py_ssize_t j = 0; j < k; j++) {
        total += draws[j];
        squares += draws[j] * draws[j];
    }
    double mean = total / (double)k;
    self->drawn[row] = 0;
    self->est[row] = mean;
    self->noise[row] = 1.0 / (double)k;
    PyObject *m = PyFloat_FromDouble(mean);
    PyObject *w = PyFloat_FromDouble((squares - (double)k * mean * mean) / (double)(k - 1));
    int failed = !m || !w || PyList_Append(firsts, m) < 0 || PyList_Append(within, w) < 0;
    Py_XDECREF(m);
    Py_XDECREF(w);
    return failed ? -1 : 0;
}

static PyObject *add_rows(RowState *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_Check(args[1]) || !PyList_Check(args[2])
            || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "add(rows, accepts: list, firsts: list, within: list)");
        return NULL;
    }
    PyObject *accepts = args[1];
    Py_ssize_t len = take_rows(self, args[0]);
    if (len < 0)
        return NULL;
    if (PyList_GET_SIZE(accepts) < len)               /* as zip: the shorter */
        len = PyList_GET_SIZE(accepts);
    int whole = 1;
    double alpha = self->alpha, keep_sq = self->keep_sq, alpha_sq = self->alpha_sq;
    for (Py_ssize_t i = 0; i < len && i < PyList_GET_SIZE(accepts); i++) {
        Py_ssize_t row = self->rows[i];
        PyObject *item = PyList_GET_ITEM(accepts, i);
        Py_INCREF(item);                             /* a __float__ may shrink the list */
        double a = PyFloat_AsDouble(item);
        Py_DECREF(item);
        if (a == -1.0 && PyErr_Occurred())
            return NULL;
        double e = self->est[row];
        if (e == e) {
            self->est[row] = e + alpha * (a - e);
            self->noise[row] = keep_sq * self->noise[row] + alpha_sq;
        } else {
            whole = 0;
            if (first_draw(self, row, a, args[2], args[3]) < 0)
                return NULL;
        }
    }
    return PyBool_FromLong(whole);
}

static PyObject *RowState_snapshot(RowState *self, PyObject *unused) {
    PyObject *est = PyList_New(self->n), *noise = PyList_New(self->n),
             *admitted = PyList_New(self->n), *draws = PyList_New(self->n);
    if (!est || !noise || !admitted || !draws)
        goto fail;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        PyObject *mine = PyList_New(self->drawn[i]);
        if (!mine)
            goto fail;
        for (Py_ssize_t j = 0; j < self->drawn[i]; j++)
            PyList_SET_ITEM(mine, j, PyFloat_FromDouble(self->draws[i * self->first_draws + j]));
        PyList_SET_ITEM(est, i, PyFloat_FromDouble(self->est[i]));
        PyList_SET_ITEM(noise, i, PyFloat_FromDouble(self->noise[i]));
        PyList_SET_ITEM(admitted, i, PyLong_FromLongLong(self->admitted_at[i]));
        PyList_SET_ITEM(draws, i, mine);
    }
    return Py_BuildValue("(NNNN)", est, noise, admitted, draws);
fail:
    Py_XDECREF(est);
    Py_XDECREF(noise);
    Py_XDECREF(admitted);
    Py_XDECREF(draws);
    return NULL;
}

/* Each method runs with `busy` set: Python code a conversion calls (an __index__, a __float__)
   may not call back into the object and overwrite its scratch. */
static int enter(RowState *self) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "RowState called from within one of its methods");
        return -1;
    }
    self->busy = 1;
    return 0;
}

#define FASTCALL(name)                                                                    \
    static PyObject *RowState_##name(RowState *self, PyObject *const *a, Py_ssize_t n) {  \
        if (enter(self) < 0)                                                              \
            return NULL;                                                                  \
        PyObject *out = name##_rows(self, a, n);                                          \
        self->busy = 0;                                                                   \
        return out;                                                                       \
    }
#define ONE_ARG(name)                                                                     \
    static PyObject *RowState_##name(RowState *self, PyObject *rows) {                    \
        if (enter(self) < 0)                                                              \
            return NULL;                                                                  \
        PyObject *out = name##_rows(self, rows);                                          \
        self->busy = 0;                                                                   \
        return out;                                                                       \
    }
FASTCALL(admit)
ONE_ARG(newest)
ONE_ARG(pooled)
FASTCALL(weighted)
FASTCALL(add)

static PyMethodDef RowState_methods[] = {
    {"admit", (PyCFunction)(void (*)(void))RowState_admit, METH_FASTCALL, NULL},
    {"newest", (PyCFunction)RowState_newest, METH_O, NULL},
    {"pooled", (PyCFunction)RowState_pooled, METH_O, NULL},
    {"weighted", (PyCFunction)(void (*)(void))RowState_weighted, METH_FASTCALL, NULL},
    {"add", (PyCFunction)(void (*)(void))RowState_add, METH_FASTCALL, NULL},
    {"snapshot", (PyCFunction)RowState_snapshot, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RowStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dgw_row_state.RowState",
    .tp_basicsize = sizeof(RowState),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RowState_init,
    .tp_dealloc = (destructor)RowState_dealloc,
    .tp_methods = RowState_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dgw_row_state", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_dgw_row_state(void) {
    if (PyType_Ready(&RowStateType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&RowStateType);
    if (PyModule_AddObject(m, "RowState", (PyObject *)&RowStateType) < 0) {
        Py_DECREF(&RowStateType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
