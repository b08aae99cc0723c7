/* A batch-1 chain of oneDNN primitives as one parallel section a call: each step cut
   into pieces (halves of its output rows) on one-thread primitives, claimed by the
   caller and a helper thread of dynvm's own, with a barrier of our own between steps
   (Note [A chain in halves, one wake a call] in jit/backends/cpu/chain_halves.py says
   why and what it measured).

   One helper per process, asleep on a futex between calls. A call (`_run`) posts its
   plan and wakes the helper once; both threads then walk the steps in order: in each
   step they claim its pieces one at a time (one fetch-and-add), run what they claimed
   inline (the primitives were built for one thread, and each thread's OpenMP count is
   1 while it runs them), and wait until every piece of the step has run before the
   next step (its pieces read rows the other thread wrote). A waiting thread spins for
   at most late_ns, then sleeps on the step's futex, so a partner preempted mid-piece
   gets the core instead of a spinning neighbour. The helper joins a call only while
   the call is open: a helper that wakes after the caller ran every piece itself finds
   it closed and sleeps again, so a late or starved helper never delays the caller by
   more than the one piece it is inside. The caller returns only after the helper,
   if it joined, has left the plan (the plan's counters are reused by the next call).

   oneDNN's and OpenMP's functions come in as pointers, so nothing is linked; called
   through ctypes.PyDLL, holding the GIL as the chain's call does, let go and taken
   back between two steps once yield_after_ns have passed (onednn_chain.c's rule). */

#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "helper_sync.h"

static struct PyModuleDef halves_module = {
    PyModuleDef_HEAD_INIT, "_chain_halves",
    "dynvm's batch-1 chains in halves with a helper thread (chain_halves.py)",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__chain_halves(void) { return PyModule_Create(&halves_module); }

typedef int (*execute_fn)(void *primitive, void *stream, int nargs, const void *args);
typedef int (*set_handle_fn)(void *memory, void *handle);
typedef int (*wait_fn)(void *stream);
typedef void (*set_threads_fn)(int);
typedef int (*get_threads_fn)(void);

/* A chain's pieces, laid out by chain_halves.py (ctypes.Structure _Plan). Step s's
   pieces are first_piece[s] .. first_piece[s + 1] - 1. */
struct plan {
  int64_t steps;
  const int64_t *first_piece;
  void *const *primitive;
  const int64_t *nargs;
  const void *const *args;
  int64_t binds;                 /* memory objects whose handle is set per call */
  void *const *bind_memory;
  const int64_t *bind_source;    /* which of the call's pointers */
  const int64_t *bind_offset;    /* plus these bytes */
  atomic_int *claimed;           /* per step: pieces claimed this call */
  atomic_int *done;              /* per step: pieces run this call */
  atomic_int *waiting;           /* per step: a thread sleeps on done[s] */
  const struct place *const *place;  /* per piece: NULL, or where its buffer goes */
  char *const *pointers;         /* this call's (set by _run) */
  /* per piece: NULL (oneDNN's dnnl_primitive_execute) or a step of dynvm's own with
     its signature (winograd.c, Note [Winograd F(2x2, 3x3) for the 3x3s] in
     jit/backends/cpu/winograd.py) */
  void *const *executes;
};

/* An output-channel piece (fp32): the primitive wrote a dense [pixels, cols] buffer;
   its thread places it into columns [first_col, first_col + cols) of the step's NHWC
   result (rows of `width`), adding the residual already there (`sum`) and applying
   ReLU after it (`relu`), as the team's primitive's post-ops do, in the same order. */
struct place {
  const float *buffer;
  int64_t pixels, cols, width, first_col;
  int64_t sum, relu;
  int64_t source;                /* -1: `fixed`; else the call's pointer `source` */
  int64_t offset;                /* bytes past that pointer */
  char *fixed;
};

static void place_piece(const struct place *q, char *const *pointers) {
  char *base = q->source < 0 ? q->fixed : pointers[q->source] + q->offset;
  float *out = (float *)base;
  for (int64_t r = 0; r < q->pixels; r++) {
    float *y = out + r * q->width + q->first_col;
    const float *a = q->buffer + r * q->cols;
    if (!q->sum) {
      memcpy(y, a, (size_t)q->cols * sizeof(float));
    } else if (q->relu) {
      for (int64_t c = 0; c < q->cols; c++) {
        float v = a[c] + y[c];
        y[c] = v > 0.0f ? v : 0.0f;
      }
    } else {
      for (int64_t c = 0; c < q->cols; c++) y[c] = a[c] + y[c];
    }
  }
}

static execute_fn execute;
static set_handle_fn set_handle;
static wait_fn stream_wait;
static set_threads_fn set_threads;
static get_threads_fn get_threads;
static void *helper_stream;
static atomic_llong late_ns;
static atomic_int started;
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

/* (generation << 2) | phase: 0 closed, 1 open (the helper may join), 2 the helper
   inside, 3 the helper left. The helper sleeps on it between calls; the caller on it
   while the helper leaves. */
#define OPEN 1
#define JOINED 2
#define LEFT 3
static atomic_int state;
static atomic_int busy;              /* a call owns the helper */
static struct plan *posted;
static atomic_int posted_status;
static atomic_int caller_waits_exit;
static atomic_llong helper_walked;   /* pieces the helper ran in the call it joined */
/* Since the start: pieces by the helper, by the caller; calls the helper joined, calls
   it missed; futex sleeps at a step's wait; ns the caller waited at steps. */
static atomic_llong by_helper, by_caller, joined, missed, sleeps, wait_ns;

static _Thread_local long long walked;
/* The CPU each thread last ran a piece or waited on (0 the caller, 1 the helper): a
   thread whose partner sits on its own CPU does not spin for it (the partner cannot
   run while it spins: the scheduler woke the helper on the caller's CPU, or the other
   CPU is another process's). */
static atomic_int cpu_of[2];   /* pieces this thread ran in its last walk */

static void futex_wake_all(atomic_int *word) { futex_wake(word, INT_MAX); }

/* Walk the plan's steps: claim and run pieces, wait for each step's end. `caller`:
   counts, waits timed, and the GIL let go between steps. */
static int walk(struct plan *p, void *stream, int caller, long long yield_after_ns) {
  int status = 0;
  long long last = yield_after_ns > 0 ? now_ns() : 0;
  long long mine = 0;
  int me = caller ? 0 : 1;
  for (int64_t s = 0; s < p->steps; s++) {
    if (caller && yield_after_ns > 0 && s > 0 && now_ns() - last >= yield_after_ns) {
      PyThreadState *saved = PyEval_SaveThread();
      PyEval_RestoreThread(saved);
      last = now_ns();
    }
    int first = (int)p->first_piece[s];
    int pieces = (int)p->first_piece[s + 1] - first;
    int i;
    while ((i = atomic_fetch_add(&p->claimed[s], 1)) < pieces) {
      atomic_store_explicit(&cpu_of[me], sched_getcpu(), memory_order_relaxed);
      execute_fn by = p->executes[first + i] != NULL ? (execute_fn)p->executes[first + i]
                                                      : execute;
      int run = by(p->primitive[first + i], stream, (int)p->nargs[first + i],
                   p->args[first + i]);
      status |= run;
      if (run == 0 && p->place[first + i] != NULL)
        place_piece(p->place[first + i], p->pointers);
      mine++;
      atomic_fetch_add(&p->done[s], 1);            /* seq_cst: before waiting's load */
      if (atomic_load(&p->waiting[s])) futex_wake_all(&p->done[s]);
    }
    int done = atomic_load(&p->done[s]);
    if (done < pieces) {
      long long since = now_ns();
      int spins = 0;
      int cpu = sched_getcpu();
      atomic_store_explicit(&cpu_of[me], cpu, memory_order_relaxed);
      while ((done = atomic_load(&p->done[s])) < pieces) {
        __builtin_ia32_pause();
        if (++spins % 64 == 0 &&
            (now_ns() - since > atomic_load(&late_ns) ||
             atomic_load_explicit(&cpu_of[1 - me], memory_order_relaxed) == cpu)) {
          /* the partner's piece is late (preempted?): sleep, the core is its */
          atomic_store(&p->waiting[s], 1);
          if (atomic_load(&p->done[s]) == done) futex_wait(&p->done[s], done);
          atomic_fetch_add(&sleeps, 1);
        }
      }
      if (caller) atomic_fetch_add(&wait_ns, now_ns() - since);
    }
  }
  atomic_fetch_add(caller ? &by_caller : &by_helper, mine);
  walked = mine;
  return status;
}

static void *helper(void *unused) {
  (void)unused;
  set_threads(1);     /* this thread's OpenMP count: its primitives run inline */
  int last_generation = -1;
  for (;;) {
    int seen = atomic_load(&state);
    if ((seen & 3) != OPEN || (seen >> 2) == last_generation) {
      futex_wait(&state, seen);
      continue;
    }
    if (!atomic_compare_exchange_strong(&state, &seen, (seen & ~3) | JOINED)) continue;
    last_generation = seen >> 2;
    atomic_fetch_or(&posted_status, walk(posted, helper_stream, 0, 0));
    atomic_store(&helper_walked, walked);
    atomic_store(&state, (seen & ~3) | LEFT);
    if (atomic_load(&caller_waits_exit)) futex_wake_all(&state);
  }
  return NULL;
}

/* Start the helper once. Returns 0, or an error from pthread_create. */
int dynvm_chain_halves_start(void *execute_fn_, void *set_handle_fn_, void *wait_fn_,
                             void *set_threads_fn_, void *get_threads_fn_, void *stream,
                             long long late) {
  int status = 0;
  pthread_mutex_lock(&start_lock);
  atomic_store(&late_ns, late);
  if (!atomic_load(&started)) {
    execute = (execute_fn)execute_fn_;
    set_handle = (set_handle_fn)set_handle_fn_;
    stream_wait = (wait_fn)wait_fn_;
    set_threads = (set_threads_fn)set_threads_fn_;
    get_threads = (get_threads_fn)get_threads_fn_;
    helper_stream = stream;
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    status = pthread_create(&thread, &attr, helper, NULL);
    pthread_attr_destroy(&attr);
    if (status == 0) atomic_store(&started, 1);
  }
  pthread_mutex_unlock(&start_lock);
  return status;
}

/* One call of the plan: bind the per-call pointers (pointers[bind_source[i]] +
   bind_offset[i] on bind_memory[i]), then walk the steps with the helper (`helped`
   0: the caller alone); *pieces gets the pieces the helper ran << 16 | the caller's.
   Returns -2 where another thread's call owns the helper, -3 where the calling
   thread's OpenMP count is under 2 (run the team's chain then), else oneDNN's first
   failing status or 0. */
int dynvm_chain_halves_run(struct plan *p, void *stream, char *const *pointers,
                           int helped, long long yield_after_ns, int *pieces) {
  if (get_threads() < 2) return -3;
  int expected = 0;
  if (!atomic_compare_exchange_strong(&busy, &expected, 1)) return -2;
  long long by_it = 0;
  int status = 0;
  p->pointers = pointers;
  for (int64_t i = 0; i < p->binds; i++)
    status |= set_handle(p->bind_memory[i], pointers[p->bind_source[i]] + p->bind_offset[i]);
  if (status != 0) {
    atomic_store(&busy, 0);
    return status;
  }
  for (int64_t s = 0; s < p->steps; s++) {
    atomic_store(&p->claimed[s], 0);
    atomic_store(&p->done[s], 0);
    atomic_store(&p->waiting[s], 0);
  }
  int threads = get_threads();
  set_threads(1);
  int generation = ((atomic_load(&state) >> 2) + 1) & 0x1FFFFFFF;
  if (helped) {
    posted = p;
    atomic_store(&posted_status, 0);
    atomic_store(&state, generation << 2 | OPEN);
    futex_wake_all(&state);
  }
  status |= walk(p, stream, 1, yield_after_ns);
  if (helped) {
    int open = generation << 2 | OPEN;
    if (atomic_compare_exchange_strong(&state, &open, generation << 2)) {
      atomic_fetch_add(&missed, 1);        /* it never joined: closed now */
    } else {
      atomic_fetch_add(&joined, 1);
      int spins = 0;
      long long since = now_ns();
      int seen;
      while (((seen = atomic_load(&state)) & 3) != LEFT) {
        __builtin_ia32_pause();
        if (++spins % 64 == 0 && now_ns() - since > atomic_load(&late_ns)) {
          atomic_store(&caller_waits_exit, 1);
          if (atomic_load(&state) == seen) futex_wait(&state, seen);
          atomic_store(&caller_waits_exit, 0);
        }
      }
      status |= atomic_load(&posted_status);
      by_it = atomic_load(&helper_walked);
    }
  }
  long long own = walked;
  *pieces = (int)((by_it > 0xFFFF ? 0xFFFF : by_it) << 16 | (own > 0xFFFF ? 0xFFFF : own));
  status |= stream_wait(stream);
  set_threads(threads);
  atomic_store(&busy, 0);
  return status;
}

/* Since the start: pieces by the helper, by the caller, calls it joined, calls it
   missed, futex sleeps at steps, ns the caller waited at steps: out[0..5]. */
void dynvm_chain_halves_stats(long long *out) {
  out[0] = atomic_load(&by_helper);
  out[1] = atomic_load(&by_caller);
  out[2] = atomic_load(&joined);
  out[3] = atomic_load(&missed);
  out[4] = atomic_load(&sleeps);
  out[5] = atomic_load(&wait_ns);
}
