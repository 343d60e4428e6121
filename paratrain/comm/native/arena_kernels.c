/* The shared segment's one-shot collectives in native code (see ../algorithms/shared.py).

   A 16 KiB all-reduce through the segment is a copy, a step and an add: a few microseconds of
   memory traffic. Done as three Python-level calls (memmove, the step's poll loop, torch's add)
   the calls cost as much again. oneshot() does the whole piece in one call from a plan built
   once per tensor, and hands back to Python only what needs it: ringing a sleeping peer's
   doorbell, and a wait longer than the poll budget (Python then sleeps on the doorbell, checks
   that its peers still run, and times out).

   A Python extension module (_arena_kernels), not a library for ctypes: a ctypes call cost
   0.45 us, a tenth of the whole call. Built on first use by native/__init__.py; where no C
   compiler is found, shared.py's Python path runs instead. Both give the same bits: the
   reduction folds rows in rank order, one IEEE add at a time (no -ffast-math), as torch's add
   does for two rows. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

enum { DT_FLOAT32 = 0, DT_FLOAT64 = 1, DT_INT32 = 2, DT_INT64 = 3 };
enum { DONE = 0, WAIT = 1, WAIT_AND_RING = 2 };
enum { MOST_ROWS = 64, WORDS_PER_LINE = 8 };

/* One call's addresses, worked out once (python: native/kernels.py, OneShotPlan). */
struct oneshot_plan {
    char *slot;                 /* this rank's slot in the half this call uses */
    const char *input;          /* what is copied into it */
    int64_t copy_bytes;
    int64_t *words;             /* the segment's step lines */
    int64_t mine;               /* index of this rank's step word */
    int64_t peers[MOST_ROWS];   /* index of each peer's step word */
    int64_t npeers;
    char *out;                  /* out <- rows[0] op rows[1] op ... (count elements) */
    const char *rows[MOST_ROWS];
    int64_t nrows;
    int64_t count;
    int64_t dtype;
};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

#define FOLD(type)                                                              \
    static void fold_##type(type *out, const char *const *rows, int64_t nrows,   \
                            int64_t count) {                                     \
        const type *a = (const type *)rows[0], *b = (const type *)rows[1];       \
        for (int64_t i = 0; i < count; i++) out[i] = a[i] + b[i];                \
        for (int64_t r = 2; r < nrows; r++) {                                    \
            const type *c = (const type *)rows[r];                               \
            for (int64_t i = 0; i < count; i++) out[i] += c[i];                  \
        }                                                                        \
    }

/* Vector code for the machine it runs on, chosen when the library loads (gcc's clones). */
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
CLONES FOLD(float)
CLONES FOLD(double)
CLONES FOLD(int32_t)
CLONES FOLD(int64_t)

/* out <- the sum of `nrows` (>= 2) rows of `count` elements, folded in row order. */
static void sum_rows(char *out, const char *const *rows, int64_t nrows, int64_t count, int64_t dtype) {
    switch (dtype) {
    case DT_FLOAT32: fold_float((float *)out, rows, nrows, count); break;
    case DT_FLOAT64: fold_double((double *)out, rows, nrows, count); break;
    case DT_INT32: fold_int32_t((int32_t *)out, rows, nrows, count); break;
    case DT_INT64: fold_int64_t((int64_t *)out, rows, nrows, count); break;
    }
}

/* The reduction of a plan whose step every rank has taken. */
static void finish(const struct oneshot_plan *p) {
    if (p->nrows >= 2) sum_rows(p->out, p->rows, p->nrows, p->count, p->dtype);
}

/* True when every peer has taken `step`. */
static int all_arrived(const struct oneshot_plan *p, int64_t step) {
    for (int64_t i = 0; i < p->npeers; i++)
        if (__atomic_load_n(&p->words[p->peers[i]], __ATOMIC_ACQUIRE) < step) return 0;
    return 1;
}

/* One piece of a one-shot collective: copy in, take `step`, poll the peers for up to `poll_ns`
   (yielding the core between looks: spinning without yielding cost 30 us a call in the minutes
   when both ranks shared a core), then reduce. A plan that copies nothing and reduces nothing is
   a barrier. The poll lets go of the GIL: other threads of the process run meanwhile.
   DONE: all of it happened. WAIT: the step is taken but a peer has not arrived; the caller waits
   (Arena.run_native) and then calls finish. WAIT_AND_RING: as WAIT, and a peer sleeps on its
   doorbell: the caller rings it first. */
static int oneshot(const struct oneshot_plan *p, int64_t step, int64_t poll_ns) {
    if (p->copy_bytes) memcpy(p->slot, p->input, (size_t)p->copy_bytes);
    __atomic_store_n(&p->words[p->mine], step, __ATOMIC_RELEASE);
    /* A sleeper raises its flag and then looks at our step; we wrote our step and now look at
       its flag. Without a full fence x86 may let our load pass our store, and both miss. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int64_t i = 0; i < p->npeers; i++)
        if (__atomic_load_n(&p->words[p->peers[i] + 1], __ATOMIC_RELAXED)) return WAIT_AND_RING;
    if (!all_arrived(p, step)) {
        if (poll_ns <= 0) return WAIT;
        int arrived = 0;
        Py_BEGIN_ALLOW_THREADS
        int64_t until = now_ns() + poll_ns;
        while (now_ns() < until) {
            sched_yield();
            if (all_arrived(p, step)) { arrived = 1; break; }
        }
        Py_END_ALLOW_THREADS
        if (!arrived) return WAIT;
    }
    finish(p);
    return DONE;
}

/* ---- the module ------------------------------------------------------------------------ */

static PyObject *py_oneshot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "oneshot(plan_address, step, poll_ns)");
        return NULL;
    }
    void *plan = PyLong_AsVoidPtr(args[0]);
    long long step = PyLong_AsLongLong(args[1]), poll_ns = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLong(oneshot((const struct oneshot_plan *)plan, step, poll_ns));
}

static PyObject *py_finish(PyObject *self, PyObject *arg) {
    void *plan = PyLong_AsVoidPtr(arg);
    if (PyErr_Occurred()) return NULL;
    finish((const struct oneshot_plan *)plan);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"oneshot", (PyCFunction)(void (*)(void))py_oneshot, METH_FASTCALL,
     "oneshot(plan_address, step, poll_ns) -> DONE 0, WAIT 1 or WAIT_AND_RING 2"},
    {"finish", py_finish, METH_O, "finish(plan_address): the reduction, once every rank took the step"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_arena_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__arena_kernels(void) { return PyModule_Create(&module); }
