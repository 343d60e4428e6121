/* The shared segment's one-shot collectives in native code (see ../algorithms/shared.py).

   A 16 KiB all-reduce through the segment is a copy, a step and an add: a few microseconds of
   memory traffic. Done as three Python-level calls (memmove, the step's poll loop, torch's add)
   the calls cost as much again. oneshot() does the whole piece in one call from a plan built
   once per tensor, and hands back to Python only what needs it: ringing a sleeping peer's
   doorbell, and a wait longer than the poll budget (Python then sleeps on the doorbell, checks
   that its peers still run, and times out). The all-to-alls' pieces (../algorithms/
   shared_all_to_all.py) are plans too, which reduce nothing: copies before the step and after
   it, reads of a peer's memory from the address it published in its slot, and checks that the
   peers wrote the sizes the copies after were planned for.

   A Python extension module (_arena_kernels), not a library for ctypes: a ctypes call cost
   0.45 us, a tenth of the whole call. Built on first use by native/__init__.py; where no C
   compiler is found, shared.py's Python path runs instead. Both give the same bits: the
   reduction folds rows in rank order, one IEEE add at a time (no -ffast-math), as torch's add
   does for two rows. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sched.h>
#include <sys/uio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

enum { DT_FLOAT32 = 0, DT_FLOAT64 = 1, DT_INT32 = 2, DT_INT64 = 3 };
enum { DONE = 0, WAIT = 1, WAIT_AND_RING = 2, CHANGED = 3 };
enum { MOST_ROWS = 64, WORDS_PER_LINE = 8 };

/* A copy of `bytes` from `source` to `into`. */
struct copy {
    char *into;
    const char *source;
    int64_t bytes;
};

/* A read of `bytes` of process `pid`'s memory into `into`, from the address it published in the
   word at `published`, plus `offset`. */
struct peer_read {
    char *into;
    const int64_t *published;
    int64_t offset;
    int64_t bytes;
    int64_t pid;
};

/* One call's addresses, worked out once (python: native/__init__.py, OneShotPlan). */
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
    /* copies[0, before) are made with the slot's copy, before the step; copies[before, before +
       after) after the reduction: the moves of an all-to-all, which reduce nothing. Arrays of
       their own (NULL where empty), so that an all-reduce's plan stays small to make. */
    int64_t before;
    int64_t after;
    const struct copy *copies;
    /* reads of the peers' memory, after the copies: an all-to-all's large parts */
    int64_t nreads;
    const struct peer_read *reads;
    /* what the copies after the step assume the peers wrote before it (`bytes` at `into` equal
       to those at `source`): an uneven all-to-all's headers, its peers' split sizes */
    int64_t nchecks;
    const struct copy *checks;
};

static void copy_all(const struct copy *copies, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (copies[i].bytes) memcpy(copies[i].into, copies[i].source, (size_t)copies[i].bytes);
}

/* Reads of a peer's memory (../transport/cross_memory.py), after the step and the copies:
   `bytes` from the address the peer published in the word at `published`, plus `offset`. -> 0,
   or the errno of the read that failed (the peer has gone, or may not be read). */
static int64_t read_all(const struct peer_read *reads, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        const struct peer_read *r = &reads[i];
        char *into = r->into;
        uintptr_t from = (uintptr_t)__atomic_load_n(r->published, __ATOMIC_RELAXED) + (uintptr_t)r->offset;
        int64_t left = r->bytes;
        while (left > 0) {  /* the kernel may read less than asked */
            struct iovec local = {into, (size_t)left}, remote = {(void *)from, (size_t)left};
            ssize_t done = process_vm_readv((pid_t)r->pid, &local, 1, &remote, 1, 0);
            if (done <= 0) return done < 0 ? errno : EIO;
            into += done, from += (uintptr_t)done, left -= done;
        }
    }
    return 0;
}

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

/* What a plan does once every rank has taken its step: the reduction, the copies after, the
   reads. -> DONE; CHANGED, having done none of it, where a peer wrote other than its checks
   expect; or minus the errno of a read that failed. */
static int finish(const struct oneshot_plan *p) {
    for (int64_t i = 0; i < p->nchecks; i++)
        if (memcmp(p->checks[i].into, p->checks[i].source, (size_t)p->checks[i].bytes)) return CHANGED;
    if (p->nrows >= 2) sum_rows(p->out, p->rows, p->nrows, p->count, p->dtype);
    copy_all(p->copies + p->before, p->after);
    int64_t error = read_all(p->reads, p->nreads);
    return error ? -(int)error : DONE;
}

/* True when every peer has taken `step`. */
static int all_arrived(const struct oneshot_plan *p, int64_t step) {
    for (int64_t i = 0; i < p->npeers; i++)
        if (__atomic_load_n(&p->words[p->peers[i]], __ATOMIC_ACQUIRE) < step) return 0;
    return 1;
}

/* Whether `done(what)` holds within poll_ns, looking again after each yield of the core; the
   GIL is let go meanwhile, so the process's other threads run. Both waits below use it. */
static int poll_for(int (*done)(const void *), const void *what, int64_t poll_ns) {
    if (poll_ns <= 0) return 0;
    int held = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t until = now_ns() + poll_ns;
    while (now_ns() < until) {
        sched_yield();
        if (done(what)) { held = 1; break; }
    }
    Py_END_ALLOW_THREADS
    return held;
}

struct step_wait { const struct oneshot_plan *plan; int64_t step; };

static int steps_taken(const void *what) {
    const struct step_wait *w = what;
    return all_arrived(w->plan, w->step);
}

/* One piece of a one-shot collective: copy in, take `step`, poll the peers for up to `poll_ns`
   (yielding the core between looks: spinning without yielding cost 30 us a call in the minutes
   when both ranks shared a core), then reduce and copy out. A plan that copies nothing and
   reduces nothing is a barrier. The poll lets go of the GIL: other threads of the process run meanwhile.
   DONE: all of it happened; CHANGED: the step is taken, but a peer wrote other than the plan
   expects (its checks), so nothing after the step happened; minus an errno: a read of a peer's
   memory failed. WAIT: the step is taken but a peer has not arrived; the caller waits
   (Arena.run_native) and then calls finish. WAIT_AND_RING: as WAIT, and a peer sleeps on its
   doorbell: the caller rings it first. */
static int oneshot(const struct oneshot_plan *p, int64_t step, int64_t poll_ns) {
    if (p->copy_bytes) memcpy(p->slot, p->input, (size_t)p->copy_bytes);
    copy_all(p->copies, p->before);
    __atomic_store_n(&p->words[p->mine], step, __ATOMIC_RELEASE);
    /* A sleeper raises its flag and then looks at our step; we wrote our step and now look at
       its flag. Without a full fence x86 may let our load pass our store, and both miss. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int64_t i = 0; i < p->npeers; i++)
        if (__atomic_load_n(&p->words[p->peers[i] + 1], __ATOMIC_RELAXED)) return WAIT_AND_RING;
    if (!all_arrived(p, step)) {
        struct step_wait wait = {p, step};
        if (!poll_for(steps_taken, &wait, poll_ns)) return WAIT;
    }
    return finish(p);
}

/* ---- the rings' short cut ---------------------------------------------------------------

   A blocking send or receive of a small message between two processes moves it straight
   between the tensor and the ring of ../transport/shm_ring.py (SharedMemoryP2P.send_now and
   recv_now decide when that is allowed, under the transport's lock). The layout is that file's:
   four counters, each on its own 64-byte line (head, tail, a sender waiting, a receiver
   sleeping), then the data; a message is a 64-byte header (tag, total, offset, length) and its
   payload rounded up to 64 bytes, which may wrap around the data's end. */

enum { LINE = 64, COUNTERS = 4 * LINE, HEAD = 0, TAIL = 8, SENDER_WAITING = 16, RECEIVER_SLEEPING = 24 };

static void ring_copy(char *data, int64_t capacity, int64_t position, char *outside, int64_t length, int into_ring) {
    position %= capacity;
    int64_t first = length < capacity - position ? length : capacity - position;
    if (into_ring) {
        memcpy(data + position, outside, (size_t)first);
        if (first < length) memcpy(data, outside + first, (size_t)(length - first));
    } else {
        memcpy(outside, data + position, (size_t)first);
        if (first < length) memcpy(outside + first, data, (size_t)(length - first));
    }
}

/* What ring_put and ring_take are given: the ring's mapping, its data's capacity, the counter
   the caller moves (head or tail), the message's tag, the tensor's address and its bytes. */
struct ring_call {
    char *ring;
    long long capacity, at, tag;
    char *tensor;
    long long nbytes;
};

static int ring_call_args(PyObject *const *args, Py_ssize_t nargs, const char *usage, struct ring_call *c) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, usage);
        return 0;
    }
    c->ring = PyLong_AsVoidPtr(args[0]), c->tensor = PyLong_AsVoidPtr(args[4]);
    c->capacity = PyLong_AsLongLong(args[1]), c->at = PyLong_AsLongLong(args[2]);
    c->tag = PyLong_AsLongLong(args[3]), c->nbytes = PyLong_AsLongLong(args[5]);
    return !PyErr_Occurred();
}

/* Publish `value` in counter `mine`, then look at the other end's flag: it raises its flag and
   then looks at our counter; we moved the counter and now look at its flag (see oneshot).
   -> value * 2 + 1 if the flag is up (the caller rings that end's doorbell). */
static PyObject *publish(int64_t *counters, int mine, long long value, int flag) {
    __atomic_store_n(&counters[mine], (int64_t)value, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return PyLong_FromLongLong(value * 2 + (__atomic_load_n(&counters[flag], __ATOMIC_RELAXED) != 0));
}

/* ring_put(ring, capacity, head, tag, source, nbytes) -> the new head * 2 + 1 if the receiver
   sleeps. The caller checked the room. */
static PyObject *py_ring_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    struct ring_call c;
    if (!ring_call_args(args, nargs, "ring_put(ring, capacity, head, tag, source, nbytes)", &c)) return NULL;
    int64_t *header = (int64_t *)(c.ring + COUNTERS + c.at % c.capacity);
    header[0] = c.tag, header[1] = c.nbytes, header[2] = 0, header[3] = c.nbytes;
    ring_copy(c.ring + COUNTERS, c.capacity, c.at % c.capacity + LINE, c.tensor, c.nbytes, 1);
    return publish((int64_t *)c.ring, HEAD, c.at + LINE + (c.nbytes + LINE - 1) / LINE * LINE, RECEIVER_SLEEPING);
}

struct head_wait { const int64_t *counters; long long tail; };

static int head_moved(const void *what) {
    const struct head_wait *w = what;
    return __atomic_load_n(&w->counters[HEAD], __ATOMIC_ACQUIRE) != w->tail;
}

/* ring_poll(ring, tail, poll_ns) -> True once the head is past `tail`, False if it is not
   within poll_ns (yielding the core between looks, the GIL let go). */
static PyObject *py_ring_poll(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "ring_poll(ring, tail, poll_ns)");
        return NULL;
    }
    int64_t *counters = PyLong_AsVoidPtr(args[0]);
    long long tail = PyLong_AsLongLong(args[1]), poll_ns = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    struct head_wait wait = {counters, tail};
    return PyBool_FromLong(head_moved(&wait) || poll_for(head_moved, &wait, poll_ns));
}

/* ring_take(ring, capacity, tail, tag, destination, nbytes) -> the new tail * 2 + 1 if a sender
   waits for room; -1 if no message is there, -2 if the next one is not this one whole (another
   tag or size, or a fragment): then nothing was read. */
static PyObject *py_ring_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    struct ring_call c;
    if (!ring_call_args(args, nargs, "ring_take(ring, capacity, tail, tag, destination, nbytes)", &c)) return NULL;
    int64_t *counters = (int64_t *)c.ring;
    if (__atomic_load_n(&counters[HEAD], __ATOMIC_ACQUIRE) == c.at) return PyLong_FromLong(-1);
    const int64_t *header = (const int64_t *)(c.ring + COUNTERS + c.at % c.capacity);
    if (header[0] != c.tag || header[1] != c.nbytes || header[2] != 0 || header[3] != c.nbytes)
        return PyLong_FromLong(-2);
    ring_copy(c.ring + COUNTERS, c.capacity, c.at % c.capacity + LINE, c.tensor, c.nbytes, 0);
    return publish(counters, TAIL, c.at + LINE + (c.nbytes + LINE - 1) / LINE * LINE, SENDER_WAITING);
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
    return PyLong_FromLong(finish((const struct oneshot_plan *)plan));
}

static PyMethodDef methods[] = {
    {"oneshot", (PyCFunction)(void (*)(void))py_oneshot, METH_FASTCALL,
     "oneshot(plan_address, step, poll_ns) -> DONE 0, WAIT 1, WAIT_AND_RING 2, CHANGED 3, or -errno of a failed read"},
    {"finish", py_finish, METH_O, "finish(plan_address) -> DONE 0, CHANGED 3 or -errno: the reduction, the copies and reads after, once every rank took the step"},
    {"ring_put", (PyCFunction)(void (*)(void))py_ring_put, METH_FASTCALL,
     "ring_put(ring, capacity, head, tag, source, nbytes) -> new head * 2 + receiver sleeping"},
    {"ring_poll", (PyCFunction)(void (*)(void))py_ring_poll, METH_FASTCALL,
     "ring_poll(ring, tail, poll_ns) -> whether the head moved past tail"},
    {"ring_take", (PyCFunction)(void (*)(void))py_ring_take, METH_FASTCALL,
     "ring_take(ring, capacity, tail, tag, destination, nbytes) -> new tail * 2 + sender waiting; -1 none; -2 not it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_arena_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__arena_kernels(void) { return PyModule_Create(&module); }
