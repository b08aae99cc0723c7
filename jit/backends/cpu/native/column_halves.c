/* A GEMM as two column halves on one-thread oneDNN primitives, the second half run by
   a helper thread of dynvm's own (Note [Column halves with a helper thread] in
   jit/backends/cpu/column_halves.py says why and what it measured).

   One helper per process. A kernel call that runs halves enters (`_enter`: it owns the
   helper until `_leave`; a second caller, in another thread, is refused and runs the
   OpenMP team), which wakes the helper from its futex; the helper then spins, at
   SCHED_IDLE priority (any other runnable thread on its core preempts it), until the
   call leaves or max_spin_ns pass without a half to run, and sleeps again. For each GEMM
   the caller posts half B, runs half A, then takes B itself unless the helper claimed it
   first; a claimed B that is late_ns late puts the caller to sleep on a futex (a helper
   preempted mid-half then gets the caller's core). The helper raises itself to normal
   priority before it claims and computes there (claimed at SCHED_IDLE and preempted, a
   busy host could starve it for as long as it stays busy). Each half writes a dense [M, h] buffer of its own (oneDNN 3.2's brgemm
   matmul refuses a strided result: gemm:jit then, several times slower) and the thread
   that ran it copies it into its columns of the result, adding or multiplying the fp32
   binary operand's columns there (the primitive's binary post-op, done after it, in the
   same fp32 order).

   oneDNN's and OpenMP's functions come in as pointers, so nothing is linked; the
   functions are called through ctypes, holding the GIL as the primitives' calls do. */

#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* An importable (empty) module, so that the package's modules all import. */
static struct PyModuleDef halves_module = {
    PyModuleDef_HEAD_INIT, "_column_halves",
    "dynvm's column halves with a helper thread (column_halves.py)",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__column_halves(void) { return PyModule_Create(&halves_module); }

typedef int (*execute_fn)(void *primitive, void *stream, int nargs, const void *args);
typedef int (*set_handle_fn)(void *memory, void *handle);
typedef void (*set_threads_fn)(int);
typedef int (*get_threads_fn)(void);

/* One GEMM's halves, laid out by column_halves.py (ctypes.Structure _Halves). */
struct halves {
  void *primitive[2];
  int64_t nargs[2];
  const void *args[2];
  void *src_memory[2];     /* memory objects of x, set per call */
  char *buffer[2];         /* each half's dense [rows, cols] result */
  int64_t cols[2];         /* the halves' widths */
  int64_t first_col[2];    /* where each half's columns start in the result */
  int64_t rows;
  int64_t width;           /* the result's row length (N) */
  int64_t element_size;    /* of the result */
  int64_t binary;          /* 0 none, 1 add, 2 multiply (fp32 result and operand) */
};

enum { IDLE, POSTED, CLAIMED, DONE, TAKEN };

static execute_fn execute;
static set_handle_fn set_handle;
static set_threads_fn set_threads;
static get_threads_fn get_threads;
static void *helper_stream;
static atomic_llong late_ns, max_spin_ns;
static atomic_int claiming = 1;     /* 0: the helper never claims (tests) */
static atomic_int started;
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

static atomic_int inside;           /* 1 while a call owns the helper */
static atomic_int generation;       /* bumped by every _enter: the helper's futex word */
static atomic_int state;            /* the posted half's: IDLE .. TAKEN */
static atomic_int caller_waiting;
static struct halves *posted;       /* set before state becomes POSTED */
static char *posted_out;
static const char *posted_other;
static atomic_int posted_status;
static atomic_llong by_helper, by_caller;
static atomic_int call_helper, call_caller;   /* this call's B halves, by whom */

static long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void futex_wait(atomic_int *word, int expected) {
  syscall(SYS_futex, (int *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake(atomic_int *word) {
  syscall(SYS_futex, (int *)word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static void set_idle(int idle) {
  struct sched_param param = {0};
  pthread_setschedparam(pthread_self(), idle ? SCHED_IDLE : SCHED_OTHER, &param);
}

/* Half `i`'s buffer into its columns of `out`, with the binary operand's columns. */
static void place(const struct halves *h, int i, char *out, const char *other) {
  int64_t cols = h->cols[i], size = h->element_size;
  for (int64_t r = 0; r < h->rows; r++) {
    char *to = out + (r * h->width + h->first_col[i]) * size;
    const char *from = h->buffer[i] + r * cols * size;
    if (h->binary == 0) {
      memcpy(to, from, (size_t)(cols * size));
      continue;
    }
    float *y = (float *)to;
    const float *a = (const float *)from;
    const float *b = (const float *)(other + (r * h->width + h->first_col[i]) * size);
    if (h->binary == 1)
      for (int64_t c = 0; c < cols; c++) y[c] = a[c] + b[c];
    else
      for (int64_t c = 0; c < cols; c++) y[c] = a[c] * b[c];
  }
}

static int run_half(const struct halves *h, int i, void *stream, char *out,
                    const char *other) {
  int status = execute(h->primitive[i], stream, (int)h->nargs[i], h->args[i]);
  if (status == 0) place(h, i, out, other);
  return status;
}

static void *helper(void *unused) {
  (void)unused;
  set_threads(1);     /* this thread's OpenMP count: its primitives run inline */
  set_idle(1);
  for (;;) {
    int seen = atomic_load(&generation);
    if (!atomic_load(&inside)) {
      futex_wait(&generation, seen);
      continue;
    }
    long long since = now_ns();
    int spins = 0;
    while (atomic_load_explicit(&inside, memory_order_acquire)) {
      int expected = POSTED;
      if (atomic_load_explicit(&state, memory_order_acquire) == POSTED &&
          atomic_load_explicit(&claiming, memory_order_relaxed)) {
        /* normal priority before claiming: a helper preempted after its claim must
           not wait at SCHED_IDLE (starved on a busy host) while the caller waits */
        set_idle(0);
        if (!atomic_compare_exchange_strong(&state, &expected, CLAIMED)) {
          set_idle(1);
          continue;
        }
        atomic_store(&posted_status, run_half(posted, 1, helper_stream, posted_out,
                                              posted_other));
        set_idle(1);
        atomic_fetch_add(&by_helper, 1);
        atomic_fetch_add(&call_helper, 1);
        atomic_store(&state, DONE);   /* seq_cst: before caller_waiting's load */
        if (atomic_load(&caller_waiting)) futex_wake(&state);
        since = now_ns();
        continue;
      }
      __builtin_ia32_pause();
      if (++spins % 64 == 0 && now_ns() - since > atomic_load(&max_spin_ns)) {
        /* no half for a while: parked until the next call's _enter */
        if (atomic_load(&generation) == seen) futex_wait(&generation, seen);
        break;
      }
    }
  }
  return NULL;
}

/* Start the helper once. Returns 0, or an error from pthread_create. */
int dynvm_halves_start(void *execute_fn_, void *set_handle_fn_, void *set_threads_fn_,
                       void *get_threads_fn_, void *stream, long long late,
                       long long max_spin) {
  int status = 0;
  pthread_mutex_lock(&start_lock);
  atomic_store(&late_ns, late);
  atomic_store(&max_spin_ns, max_spin);
  if (!atomic_load(&started)) {
    execute = (execute_fn)execute_fn_;
    set_handle = (set_handle_fn)set_handle_fn_;
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

/* A call takes the helper: 1, or 0 where another call has it (run the team then). */
int dynvm_halves_enter(void) {
  int expected = 0;
  if (!atomic_compare_exchange_strong(&inside, &expected, 1)) return 0;
  atomic_store(&call_helper, 0);
  atomic_store(&call_caller, 0);
  atomic_fetch_add(&generation, 1);
  futex_wake(&generation);
  return 1;
}

/* The call ends. Returns its B halves: by the helper << 16 | by the caller (each at
   most 65535). */
int dynvm_halves_leave(void) {
  int helper_ = atomic_load(&call_helper), caller = atomic_load(&call_caller);
  atomic_store_explicit(&inside, 0, memory_order_release);
  return (helper_ > 0xFFFF ? 0xFFFF : helper_) << 16 | (caller > 0xFFFF ? 0xFFFF : caller);
}

/* One GEMM: both halves of `h` over x into `out` (the binary operand `other`, or NULL).
   Only the thread that entered calls it. Returns oneDNN's status (0: success). */
int dynvm_halves_run(void *stream, struct halves *h, void *x, char *out,
                     const char *other) {
  int status = set_handle(h->src_memory[0], x) | set_handle(h->src_memory[1], x);
  if (status != 0) return status;
  int threads = get_threads();
  set_threads(1);
  posted = h;
  posted_out = out;
  posted_other = other;
  atomic_store_explicit(&state, POSTED, memory_order_release);
  status = run_half(h, 0, stream, out, other);
  int expected = POSTED;
  if (atomic_compare_exchange_strong(&state, &expected, TAKEN)) {
    status |= run_half(h, 1, stream, out, other);
    atomic_fetch_add(&by_caller, 1);
    atomic_fetch_add(&call_caller, 1);
  } else {
    long long since = now_ns();
    int spins = 0;
    while (atomic_load_explicit(&state, memory_order_acquire) != DONE) {
      __builtin_ia32_pause();
      if (++spins % 64 == 0 && now_ns() - since > atomic_load(&late_ns)) {
        /* the helper is late (preempted?): sleep, so this core is free for it */
        atomic_store(&caller_waiting, 1);
        while (atomic_load(&state) == CLAIMED) futex_wait(&state, CLAIMED);
        atomic_store(&caller_waiting, 0);
      }
    }
    status |= atomic_load(&posted_status);
  }
  atomic_store(&state, IDLE);
  set_threads(threads);
  return status;
}

/* B halves run by the helper and by the caller since the start: out[0], out[1]. */
void dynvm_halves_counts(long long *out) {
  out[0] = atomic_load(&by_helper);
  out[1] = atomic_load(&by_caller);
}

/* 0: the helper never claims a half (the caller runs both); 1: it does. */
void dynvm_halves_set_claiming(int on) { atomic_store(&claiming, on); }
