/* The detector's host running statistics in C: the sliding-window median (RunningMedian), the
 * robust spread built on it (Spread), the bias-corrected EMA (EMA) and the sliding minimum
 * (SlidingMin). spikeguard.measure.stats and .spread wrap them (state_dict, pickling, argument
 * checks) and fall back to their pure-Python twins where this module was not built.
 *
 * Why C: the detector updates six medians (three over 5,000 updates), two spreads, two EMAs and
 * two sliding minima a step. In Python a sorted list's two pointer moves per update (O(window))
 * and the call overhead of these small objects were most of an update's cost.
 *
 * The median: two heaps over a ring of slots, a max-heap of the lower half and a min-heap of the
 * upper half, with each slot's place in its heap recorded so that the oldest value is replaced
 * where it sits: an update is O(log window) comparisons of doubles. The median is an element of
 * the window (odd count) or the mean of the two middle elements (even count), (lower + upper) /
 * 2.0. Every number here is the same IEEE double operation, in the same order, as in the Python
 * twins (built with -ffp-contract=off: no fused multiply-add), so the two agree bit for bit and
 * with the device twins (tests feed them the same streams). Only finite values enter a median or
 * an EMA: a NaN or an infinity raises ValueError before anything changes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <structmember.h>

typedef struct {
    Py_ssize_t window; /* capacity */
    Py_ssize_t n;      /* values held, <= window */
    Py_ssize_t head;   /* the slot of the oldest value once full */
    Py_ssize_t nlo, nhi;
    double *val;       /* by slot */
    Py_ssize_t *where; /* by slot: k >= 0 is hi[k], k < 0 is lo[-k - 1] */
    Py_ssize_t *lo;    /* max-heap of slots: the lower half (one more than hi when n is odd) */
    Py_ssize_t *hi;    /* min-heap of slots: the upper half */
    double value;      /* the median; NaN while empty */
} Median;

typedef struct {
    PyObject_HEAD
    Median m;
} MedianObject;

/* ---- the two heaps: each move records the slot's new place ---- */

static inline void put_lo(Median *m, Py_ssize_t k, Py_ssize_t s) { m->lo[k] = s; m->where[s] = -k - 1; }
static inline void put_hi(Median *m, Py_ssize_t k, Py_ssize_t s) { m->hi[k] = s; m->where[s] = k; }

static Py_ssize_t up_lo(Median *m, Py_ssize_t k) {
    Py_ssize_t s = m->lo[k];
    double x = m->val[s];
    while (k > 0) {
        Py_ssize_t p = (k - 1) >> 1;
        if (!(x > m->val[m->lo[p]])) break;
        put_lo(m, k, m->lo[p]);
        k = p;
    }
    put_lo(m, k, s);
    return k;
}

static void down_lo(Median *m, Py_ssize_t k) {
    Py_ssize_t s = m->lo[k], n = m->nlo;
    double x = m->val[s];
    for (;;) {
        Py_ssize_t c = 2 * k + 1;
        if (c >= n) break;
        if (c + 1 < n && m->val[m->lo[c + 1]] > m->val[m->lo[c]]) c++;
        if (!(m->val[m->lo[c]] > x)) break;
        put_lo(m, k, m->lo[c]);
        k = c;
    }
    put_lo(m, k, s);
}

static Py_ssize_t up_hi(Median *m, Py_ssize_t k) {
    Py_ssize_t s = m->hi[k];
    double x = m->val[s];
    while (k > 0) {
        Py_ssize_t p = (k - 1) >> 1;
        if (!(x < m->val[m->hi[p]])) break;
        put_hi(m, k, m->hi[p]);
        k = p;
    }
    put_hi(m, k, s);
    return k;
}

static void down_hi(Median *m, Py_ssize_t k) {
    Py_ssize_t s = m->hi[k], n = m->nhi;
    double x = m->val[s];
    for (;;) {
        Py_ssize_t c = 2 * k + 1;
        if (c >= n) break;
        if (c + 1 < n && m->val[m->hi[c + 1]] < m->val[m->hi[c]]) c++;
        if (!(m->val[m->hi[c]] < x)) break;
        put_hi(m, k, m->hi[c]);
        k = c;
    }
    put_hi(m, k, s);
}

static void push_lo(Median *m, Py_ssize_t s) { put_lo(m, m->nlo, s); m->nlo++; up_lo(m, m->nlo - 1); }
static void push_hi(Median *m, Py_ssize_t s) { put_hi(m, m->nhi, s); m->nhi++; up_hi(m, m->nhi - 1); }

static Py_ssize_t pop_lo(Median *m) {
    Py_ssize_t top = m->lo[0];
    m->nlo--;
    if (m->nlo > 0) { put_lo(m, 0, m->lo[m->nlo]); down_lo(m, 0); }
    return top;
}

static Py_ssize_t pop_hi(Median *m) {
    Py_ssize_t top = m->hi[0];
    m->nhi--;
    if (m->nhi > 0) { put_hi(m, 0, m->hi[m->nhi]); down_hi(m, 0); }
    return top;
}

/* after one value changed: if the lower half's largest now exceeds the upper half's smallest,
 * the two trade places (only the changed value can be out of order, and it is at a root) */
static void trade(Median *m) {
    if (m->nhi == 0) return;
    Py_ssize_t a = m->lo[0], b = m->hi[0];
    if (!(m->val[a] > m->val[b])) return;
    put_lo(m, 0, b);
    put_hi(m, 0, a);
    down_lo(m, 0);
    down_hi(m, 0);
}

static void add(Median *m, double x) {
    if (m->n < m->window) { /* filling: a new slot, then the halves rebalanced */
        Py_ssize_t s = m->n++;
        m->val[s] = x;
        if (m->nlo == 0 || x <= m->val[m->lo[0]]) push_lo(m, s); else push_hi(m, s);
        if (m->nlo > m->nhi + 1) push_hi(m, pop_lo(m));
        else if (m->nhi > m->nlo) push_lo(m, pop_hi(m));
    } else { /* full: the oldest slot takes the new value where it sits */
        Py_ssize_t s = m->head;
        m->head = (s + 1 == m->window) ? 0 : s + 1;
        m->val[s] = x;
        Py_ssize_t k = m->where[s];
        if (k < 0) {
            k = -k - 1;
            if (up_lo(m, k) == k) down_lo(m, k);
        } else {
            if (up_hi(m, k) == k) down_hi(m, k);
        }
        trade(m);
    }
    m->value = (m->n & 1) ? m->val[m->lo[0]] : (m->val[m->lo[0]] + m->val[m->hi[0]]) / 2.0;
}

static void median_free(Median *m) {
    PyMem_Free(m->val); PyMem_Free(m->where); PyMem_Free(m->lo); PyMem_Free(m->hi);
    m->val = NULL; m->where = m->lo = m->hi = NULL;
}

/* (re)start empty with room for `window` values; -1 with an exception set on failure */
static int median_init(Median *m, Py_ssize_t window) {
    if (window < 1) {
        PyErr_Format(PyExc_ValueError, "window=%zd must be an integer >= 1", window);
        return -1;
    }
    median_free(m);
    m->val = PyMem_Malloc(window * sizeof(double));
    m->where = PyMem_Malloc(window * sizeof(Py_ssize_t));
    m->lo = PyMem_Malloc((window / 2 + 1) * sizeof(Py_ssize_t));
    m->hi = PyMem_Malloc((window / 2 + 1) * sizeof(Py_ssize_t));
    if (!m->val || !m->where || !m->lo || !m->hi) {
        median_free(m);
        PyErr_NoMemory();
        return -1;
    }
    m->window = window;
    m->n = m->head = m->nlo = m->nhi = 0;
    m->value = Py_NAN;
    return 0;
}

static PyObject *median_values(Median *m) {
    PyObject *out = PyList_New(m->n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < m->n; i++) {
        Py_ssize_t s = m->head + i;
        if (s >= m->window) s -= m->window;
        PyObject *v = PyFloat_FromDouble(m->val[s]);
        if (v == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* a Python number as a double; -1 with an exception set when it is not one */
static int as_double(PyObject *arg, double *x) {
    if (PyFloat_CheckExact(arg)) { *x = PyFloat_AS_DOUBLE(arg); return 0; }
    *x = PyFloat_AsDouble(arg);
    return (*x == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* a finite double, or -1 with "<who>.update(<x>): only finite values belong in the history" */
static int finite_or_raise(double x, const char *who) {
    if (isfinite(x)) return 0;
    PyObject *v = PyFloat_FromDouble(x);
    if (v != NULL) {
        PyErr_Format(PyExc_ValueError, "%s.update(%R): only finite values belong in the history",
                     who, v);
        Py_DECREF(v);
    }
    return -1;
}

static int ready(void *p) {
    if (p != NULL) return 0;
    PyErr_SetString(PyExc_RuntimeError, "the statistic was not initialised (call __init__)");
    return -1;
}

/* ---- RunningMedian ---- */

static int MedianObject_init(MedianObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"window", NULL};
    Py_ssize_t window = 5000;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n", kwlist, &window)) return -1;
    return median_init(&self->m, window);
}

static void MedianObject_dealloc(MedianObject *self) {
    median_free(&self->m);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *MedianObject_update(MedianObject *self, PyObject *arg) {
    double x;
    if (as_double(arg, &x) < 0 || finite_or_raise(x, "RunningMedian") < 0
        || ready(self->m.val) < 0) return NULL;
    add(&self->m, x);
    Py_RETURN_NONE;
}

static PyObject *MedianObject_values(MedianObject *self, PyObject *Py_UNUSED(ignored)) {
    return median_values(&self->m);
}

static Py_ssize_t MedianObject_len(MedianObject *self) { return self->m.n; }

static PyMethodDef MedianObject_methods[] = {
    {"update", (PyCFunction)MedianObject_update, METH_O,
     "Add a finite value; the oldest leaves once the window is full."},
    {"values", (PyCFunction)MedianObject_values, METH_NOARGS, "The window's values, oldest first."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef MedianObject_members[] = {
    {"value", T_DOUBLE, offsetof(MedianObject, m.value), READONLY,
     "The median of the window; NaN while empty."},
    {"window", T_PYSSIZET, offsetof(MedianObject, m.window), READONLY,
     "How many values the window holds."},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods MedianObject_seq = {.sq_length = (lenfunc)MedianObject_len};

static PyTypeObject MedianType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spikeguard.measure._cstats.SlidingMedian",
    .tp_doc = "Median of the last `window` finite values (two heaps over a ring of slots).",
    .tp_basicsize = sizeof(MedianObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)MedianObject_init,
    .tp_dealloc = (destructor)MedianObject_dealloc,
    .tp_methods = MedianObject_methods,
    .tp_members = MedianObject_members,
    .tp_as_sequence = &MedianObject_seq,
};

/* ---- Spread: scale x the running median of |v - the previous kept v| ---- */

typedef struct {
    PyObject_HEAD
    Median m;
    double scale;
    double last;  /* the previous kept value; NaN before the first */
    double value; /* scale x the median; NaN while empty */
    int log;      /* of log(v): v not positive (or not finite) is left out */
} SpreadObject;

static int SpreadObject_init(SpreadObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"window", "scale", "log", NULL};
    Py_ssize_t window;
    double scale;
    int log_ = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nd|p", kwlist, &window, &scale, &log_))
        return -1;
    if (median_init(&self->m, window) < 0) return -1;
    self->scale = scale;
    self->log = log_;
    self->last = self->value = Py_NAN;
    return 0;
}

static void SpreadObject_dealloc(SpreadObject *self) {
    median_free(&self->m);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *SpreadObject_add(SpreadObject *self, PyObject *arg) {
    double v;
    if (as_double(arg, &v) < 0 || ready(self->m.val) < 0) return NULL;
    if (self->log) {
        if (!(v > 0.0 && isfinite(v))) Py_RETURN_NONE;
        v = log(v);
    }
    if (!isfinite(v)) Py_RETURN_NONE; /* left out: changes nothing */
    if (self->last == self->last) {
        add(&self->m, fabs(v - self->last));
        self->value = self->scale * self->m.value;
    }
    self->last = v;
    Py_RETURN_NONE;
}

static PyObject *SpreadObject_values(SpreadObject *self, PyObject *Py_UNUSED(ignored)) {
    return median_values(&self->m);
}

/* _restore(deviations, last): the state a state_dict describes (deviations oldest first) */
static PyObject *SpreadObject_restore(SpreadObject *self, PyObject *args) {
    PyObject *devs;
    double last;
    if (!PyArg_ParseTuple(args, "Od", &devs, &last)) return NULL;
    PyObject *seq = PySequence_Fast(devs, "deviations must be a sequence of numbers");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (median_init(&self->m, self->m.window) < 0) { Py_DECREF(seq); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        double x;
        if (as_double(PySequence_Fast_GET_ITEM(seq, i), &x) < 0
            || finite_or_raise(x, "Spread") < 0) { Py_DECREF(seq); return NULL; }
        add(&self->m, x);
    }
    Py_DECREF(seq);
    self->last = last;
    self->value = self->scale * self->m.value;
    Py_RETURN_NONE;
}

static Py_ssize_t SpreadObject_len(SpreadObject *self) { return self->m.n; }

static PyMethodDef SpreadObject_methods[] = {
    {"add", (PyCFunction)SpreadObject_add, METH_O,
     "Add one kept step's value (a non-finite value is left out and changes nothing)."},
    {"values", (PyCFunction)SpreadObject_values, METH_NOARGS,
     "The window's deviations, oldest first."},
    {"_restore", (PyCFunction)SpreadObject_restore, METH_VARARGS,
     "Load the deviations (oldest first) and the last value."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef SpreadObject_members[] = {
    {"value", T_DOUBLE, offsetof(SpreadObject, value), READONLY,
     "scale x the median of the deviations; NaN while empty."},
    {"last", T_DOUBLE, offsetof(SpreadObject, last), READONLY,
     "The previous kept value (NaN before the first)."},
    {"window", T_PYSSIZET, offsetof(SpreadObject, m.window), READONLY, "The deviations' window."},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods SpreadObject_seq = {.sq_length = (lenfunc)SpreadObject_len};

static PyTypeObject SpreadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spikeguard.measure._cstats.SlidingSpread",
    .tp_doc = "scale x the running median of |v - the previous kept v| (of log v with log=True).",
    .tp_basicsize = sizeof(SpreadObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)SpreadObject_init,
    .tp_dealloc = (destructor)SpreadObject_dealloc,
    .tp_methods = SpreadObject_methods,
    .tp_members = SpreadObject_members,
    .tp_as_sequence = &SpreadObject_seq,
};

/* ---- EMA: bias-corrected, m_t = (1 - alpha) m_{t-1} + alpha x_t, value m_t / (1 - (1-alpha)^t) */

typedef struct {
    PyObject_HEAD
    double alpha, m, decay, value;
    long long count;
} EMAObject;

static int EMAObject_init(EMAObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"alpha", NULL};
    double alpha = 1e-3;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|d", kwlist, &alpha)) return -1;
    if (!(alpha > 0.0 && alpha <= 1.0)) {
        PyObject *a = PyFloat_FromDouble(alpha);
        if (a != NULL) {
            PyErr_Format(PyExc_ValueError, "alpha=%R must be in (0, 1]; the detector uses 1/1000",
                         a);
            Py_DECREF(a);
        }
        return -1;
    }
    self->alpha = alpha;
    self->m = 0.0;
    self->decay = 1.0;
    self->count = 0;
    self->value = Py_NAN;
    return 0;
}

static PyObject *EMAObject_update(EMAObject *self, PyObject *arg) {
    double x;
    if (as_double(arg, &x) < 0 || finite_or_raise(x, "EMA") < 0) return NULL;
    double a = self->alpha;
    double m = self->m = (1.0 - a) * self->m + a * x;
    double decay = self->decay = self->decay * (1.0 - a);
    self->count++;
    self->value = m / (1.0 - decay);
    Py_RETURN_NONE;
}

/* _restore(alpha, m, count, decay) */
static PyObject *EMAObject_restore(EMAObject *self, PyObject *args) {
    double alpha, m, decay;
    long long count;
    if (!PyArg_ParseTuple(args, "ddLd", &alpha, &m, &count, &decay)) return NULL;
    self->alpha = alpha;
    self->m = m;
    self->count = count;
    self->decay = decay;
    self->value = count == 0 ? Py_NAN : m / (1.0 - decay);
    Py_RETURN_NONE;
}

static PyMethodDef EMAObject_methods[] = {
    {"update", (PyCFunction)EMAObject_update, METH_O, "Add a finite value."},
    {"_restore", (PyCFunction)EMAObject_restore, METH_VARARGS, "Load (alpha, m, count, decay)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef EMAObject_members[] = {
    {"value", T_DOUBLE, offsetof(EMAObject, value), READONLY,
     "The bias-corrected average; NaN before the first update."},
    {"alpha", T_DOUBLE, offsetof(EMAObject, alpha), READONLY, "The weight of a new value."},
    {"count", T_LONGLONG, offsetof(EMAObject, count), READONLY, "Values averaged."},
    {"_m", T_DOUBLE, offsetof(EMAObject, m), READONLY, "The uncorrected average."},
    {"_decay", T_DOUBLE, offsetof(EMAObject, decay), READONLY, "(1 - alpha) ** count."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject EMAType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spikeguard.measure._cstats.BiasCorrectedEMA",
    .tp_doc = "Exponential moving average with bias correction.",
    .tp_basicsize = sizeof(EMAObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)EMAObject_init,
    .tp_methods = EMAObject_methods,
    .tp_members = EMAObject_members,
};

/* ---- SlidingMin: a monotonic deque of (push index, value, step), values strictly rising ---- */

typedef struct { long long i; double v; long long step; } Entry;

typedef struct {
    PyObject_HEAD
    Py_ssize_t window;
    Entry *q;          /* a ring of `cap` entries */
    Py_ssize_t cap, head, n;
} MinObject;

static int MinObject_init(MinObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"window", NULL};
    Py_ssize_t window;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &window)) return -1;
    PyMem_Free(self->q);
    self->cap = 16;
    self->q = PyMem_Malloc(self->cap * sizeof(Entry));
    if (self->q == NULL) { PyErr_NoMemory(); return -1; }
    self->window = window;
    self->head = self->n = 0;
    return 0;
}

static void MinObject_dealloc(MinObject *self) {
    PyMem_Free(self->q);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline Entry *at(MinObject *self, Py_ssize_t k) {
    Py_ssize_t s = self->head + k;
    return &self->q[s >= self->cap ? s - self->cap : s];
}

static int append(MinObject *self, long long i, double v, long long step) {
    if (self->n == self->cap) { /* grow: unroll the ring into a buffer twice the size */
        Entry *q = PyMem_Malloc(2 * self->cap * sizeof(Entry));
        if (q == NULL) { PyErr_NoMemory(); return -1; }
        for (Py_ssize_t k = 0; k < self->n; k++) q[k] = *at(self, k);
        PyMem_Free(self->q);
        self->q = q;
        self->cap *= 2;
        self->head = 0;
    }
    Entry *e = at(self, self->n++);
    e->i = i; e->v = v; e->step = step;
    return 0;
}

/* min_before(i) -> (minimum value, its step) over pushes i - window .. i - 1; (NaN, None) if none */
static PyObject *MinObject_min_before(MinObject *self, PyObject *arg) {
    long long i = PyLong_AsLongLong(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (ready(self->q) < 0) return NULL;
    long long lo = i - (long long)self->window;
    while (self->n > 0 && self->q[self->head].i < lo) {
        self->head = (self->head + 1 == self->cap) ? 0 : self->head + 1;
        self->n--;
    }
    if (self->n == 0) return Py_BuildValue("(dO)", Py_NAN, Py_None);
    Entry *e = &self->q[self->head];
    return Py_BuildValue("(dL)", e->v, e->step);
}

static PyObject *MinObject_push(MinObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "push(i, value, step) takes 3 arguments");
        return NULL;
    }
    long long i = PyLong_AsLongLong(args[0]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    double v;
    if (as_double(args[1], &v) < 0) return NULL;
    long long step = PyLong_AsLongLong(args[2]);
    if (step == -1 && PyErr_Occurred()) return NULL;
    if (ready(self->q) < 0) return NULL;
    while (self->n > 0 && at(self, self->n - 1)->v >= v) self->n--;
    if (append(self, i, v, step) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *MinObject_entries(MinObject *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(self->n);
    if (out == NULL) return NULL;
    for (Py_ssize_t k = 0; k < self->n; k++) {
        Entry *e = at(self, k);
        PyObject *t = Py_BuildValue("[LdL]", e->i, e->v, e->step);
        if (t == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, k, t);
    }
    return out;
}

/* _restore(entries): the deque oldest first, as (i, value, step) tuples (the Python wrapper's
 * load_state_dict makes them from the state dict's lists) */
static PyObject *MinObject_restore(MinObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "entries must be a sequence of (i, value, step)");
    if (seq == NULL) return NULL;
    self->head = self->n = 0;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq); k++) {
        long long i, step;
        double v;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "LdL", &i, &v, &step)
            || append(self, i, v, step) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyMethodDef MinObject_methods[] = {
    {"min_before", (PyCFunction)MinObject_min_before, METH_O,
     "(minimum value, its step) over the window before push i; (NaN, None) if empty."},
    {"push", (PyCFunction)(void (*)(void))MinObject_push, METH_FASTCALL, "push(i, value, step)"},
    {"entries", (PyCFunction)MinObject_entries, METH_NOARGS,
     "The deque's [i, value, step] entries, oldest first."},
    {"_restore", (PyCFunction)MinObject_restore, METH_O, "Load entries as entries() lists them."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef MinObject_members[] = {
    {"window", T_PYSSIZET, offsetof(MinObject, window), READONLY, "Pushes the minimum spans."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject MinType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spikeguard.measure._cstats.SlidingMinimum",
    .tp_doc = "Minimum of the values pushed in the last `window` pushes (a monotonic deque).",
    .tp_basicsize = sizeof(MinObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)MinObject_init,
    .tp_dealloc = (destructor)MinObject_dealloc,
    .tp_methods = MinObject_methods,
    .tp_members = MinObject_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cstats",
    "The detector's host running statistics in C (see spikeguard.measure.stats).", -1, NULL,
};

PyMODINIT_FUNC PyInit__cstats(void) {
    PyTypeObject *types[] = {&MedianType, &SpreadType, &EMAType, &MinType};
    const char *names[] = {"SlidingMedian", "SlidingSpread", "BiasCorrectedEMA", "SlidingMinimum"};
    for (int k = 0; k < 4; k++)
        if (PyType_Ready(types[k]) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    for (int k = 0; k < 4; k++) {
        Py_INCREF(types[k]);
        if (PyModule_AddObject(m, names[k], (PyObject *)types[k]) < 0) {
            Py_DECREF(types[k]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
