/* A GEMM as column pieces on one-thread oneDNN primitives, shared between the caller
   and a helper thread of dynvm's own (Note [Column halves with a helper thread] in
   jit/backends/cpu/column_halves.py says why and what it measured).

   One helper per process. A kernel call that runs halves enters (`_enter`: it owns the
   helper until `_leave`; a second caller, in another thread, is refused and runs the
   OpenMP team), which wakes the helper from its futex; the helper then spins, at
   SCHED_IDLE priority (any other runnable thread on its core preempts it), until the
   call leaves or max_spin_ns pass without a piece to run, and sleeps again. For each
   GEMM the caller posts it (one word: its serial, its pieces, the next piece) and both
   threads claim pieces one at a time by compare-and-swap until none is left; the caller
   then waits for a piece the helper is inside, on a futex once late_ns pass (a helper
   preempted mid-piece then gets the caller's core). A late helper so costs at most one
   piece: with two halves it cost the whole of B after A. The helper raises itself to
   normal priority before it claims and computes there (claimed at SCHED_IDLE and
   preempted, a busy host could starve it for as long as it stays busy). Each piece
   writes a dense [M, w] buffer of its own (oneDNN 3.2's brgemm matmul refuses a strided
   result: gemm:jit then, several times slower) and the thread that ran it copies it
   into its columns of the result, adding or multiplying the fp32 binary operand's
   columns there (the primitive's binary post-op, done after it, in the same fp32
   order).

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

#include "helper_sync.h"

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

/* One GEMM's column pieces, laid out by column_halves.py (ctypes.Structure _Halves). */
#define MAX_PIECES 8
struct halves {
  void *primitive[MAX_PIECES];
  int64_t nargs[MAX_PIECES];
  const void *args[MAX_PIECES];
  void *src_memory[MAX_PIECES];  /* memory objects of x, set per call */
  char *buffer[MAX_PIECES];      /* each piece's dense [rows, cols] result */
  int64_t cols[MAX_PIECES];      /* the pieces' widths */
  int64_t first_col[MAX_PIECES]; /* where each piece's columns start in the result */
  int64_t pieces;
  int64_t rows;
  int64_t width;           /* the result's row length (N) */
  int64_t element_size;    /* of the result */
  int64_t binary;          /* 0 none, 1 add, 2 multiply (fp32 result and operand) */
};


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
/* The posted GEMM and its next piece: serial << 16 | pieces << 8 | next. A piece is
   claimed by one compare-and-swap of next to next + 1, by either thread; serial (the
   caller's count of GEMMs) makes a stale word fail the swap. */
static atomic_llong work;
static atomic_int finished;         /* the posted GEMM's pieces run to the end */
static atomic_int caller_waiting;
static struct halves *posted;       /* set before work names the GEMM */
static char *posted_out;
static const char *posted_other;
static atomic_int posted_status;
static long long serial;            /* the caller's alone */
static atomic_int call_helper, call_caller;   /* this call's pieces, by whom */
static atomic_llong by_helper, by_caller;   /* pieces, by whom, since the start */
/* What the helper met, for dynvm_halves_stats (a clock read a GEMM, ~25 ns of ~100 us):
   the caller's wait, after its last piece, for the helper's, its futex sleeps, the time
   from a post to the helper's first claim in it, the time from _enter to the helper seeing the call, the
   calls it saw, and its parks after max_spin_ns without a half. */
static atomic_llong wait_ns, sleeps, claim_ns, wake_ns, wakes, parks;
static atomic_llong posted_at, entered_at;
static atomic_int call_helper, call_caller;   /* this call's B halves, by whom */


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

/* A piece of the GEMM named by `w` (re-read on failure): its index, or -1 where every
   piece is claimed. `*claimed` gets the word that was swapped. */
static int claim(long long *claimed) {
  long long w = atomic_load(&work);
  for (;;) {
    int next = (int)(w & 0xFF), pieces = (int)((w >> 8) & 0xFF);
    if (next >= pieces) return -1;
    if (atomic_compare_exchange_weak(&work, &w, w + 1)) {
      *claimed = w;
      return next;
    }
  }
}

static void *helper(void *unused) {
  (void)unused;
  set_threads(1);     /* this thread's OpenMP count: its primitives run inline */
  set_idle(1);
  int last_seen = -1;
  long long last_serial = -1;
  for (;;) {
    int seen = atomic_load(&generation);
    if (!atomic_load(&inside)) {
      futex_wait(&generation, seen);
      continue;
    }
    long long since = now_ns();
    int spins = 0;
    int now_seen = atomic_load(&generation);
    if (now_seen != last_seen) {
      /* a call this helper has not yet seen: how long it took to notice it */
      atomic_fetch_add(&wake_ns, since - atomic_load(&entered_at));
      atomic_fetch_add(&wakes, 1);
      last_seen = now_seen;
    }
    while (atomic_load_explicit(&inside, memory_order_acquire)) {
      long long w = atomic_load_explicit(&work, memory_order_acquire);
      if ((w & 0xFF) < ((w >> 8) & 0xFF) &&
          atomic_load_explicit(&claiming, memory_order_relaxed)) {
        /* normal priority before claiming: a helper preempted inside a piece must not
           wait at SCHED_IDLE (starved on a busy host) while the caller waits */
        set_idle(0);
        long long claimed;
        int i;
        while ((i = claim(&claimed)) >= 0) {
          /* the swap succeeded on a GEMM with a piece unclaimed, so the caller is still
             inside it (it waits for every piece): posted is that GEMM's */
          if ((claimed >> 16) != last_serial) {
            atomic_fetch_add(&claim_ns, now_ns() - atomic_load(&posted_at));
            last_serial = claimed >> 16;
          }
          atomic_fetch_or(&posted_status, run_half(posted, i, helper_stream, posted_out,
                                                   posted_other));
          atomic_fetch_add(&by_helper, 1);
          atomic_fetch_add(&call_helper, 1);
          atomic_fetch_add(&finished, 1);   /* seq_cst: before caller_waiting's load */
          if (atomic_load(&caller_waiting)) futex_wake(&finished, 1);
        }
        set_idle(1);
        since = now_ns();
        continue;
      }
      __builtin_ia32_pause();
      if (++spins % 64 == 0 && now_ns() - since > atomic_load(&max_spin_ns)) {
        /* no piece for a while: parked until the next call's _enter */
        atomic_fetch_add(&parks, 1);
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
  atomic_store(&entered_at, now_ns());
  atomic_fetch_add(&generation, 1);
  futex_wake(&generation, 1);
  return 1;
}

/* The call ends. Returns its pieces: by the helper << 16 | by the caller (each at most
   65535). */
int dynvm_halves_leave(void) {
  int helper_ = atomic_load(&call_helper), caller = atomic_load(&call_caller);
  atomic_store_explicit(&inside, 0, memory_order_release);
  return (helper_ > 0xFFFF ? 0xFFFF : helper_) << 16 | (caller > 0xFFFF ? 0xFFFF : caller);
}

/* One GEMM: its pieces of `h` over x into `out` (the binary operand `other`, or NULL),
   claimed one at a time by the caller and the helper; the caller returns once every
   piece has run (it waits at most for the one piece the helper is inside). Only the
   thread that entered calls it. Returns oneDNN's status (0: success). */
int dynvm_halves_run(void *stream, struct halves *h, void *x, char *out,
                     const char *other) {
  int status = 0;
  int pieces = (int)h->pieces;
  if (pieces < 1 || pieces > MAX_PIECES) return -1;
  for (int i = 0; i < pieces; i++) status |= set_handle(h->src_memory[i], x);
  if (status != 0) return status;
  int threads = get_threads();
  set_threads(1);
  posted = h;
  posted_out = out;
  posted_other = other;
  atomic_store(&posted_status, 0);
  atomic_store(&finished, 0);
  atomic_store(&posted_at, now_ns());
  serial = (serial + 1) & 0xFFFFFFFFFFLL;
  atomic_store_explicit(&work, serial << 16 | (long long)pieces << 8, memory_order_release);
  long long claimed;
  int i, mine = 0;
  while ((i = claim(&claimed)) >= 0) {
    status |= run_half(h, i, stream, out, other);
    mine++;
    atomic_fetch_add(&finished, 1);
  }
  atomic_fetch_add(&by_caller, mine);
  atomic_fetch_add(&call_caller, mine);
  if (atomic_load(&finished) < pieces) {
    long long since = now_ns();
    int spins = 0, slept = 0, done;
    while ((done = atomic_load(&finished)) < pieces) {
      __builtin_ia32_pause();
      if (++spins % 64 == 0 && now_ns() - since > atomic_load(&late_ns)) {
        /* the helper's piece is late (preempted?): sleep, so this core is free for it */
        atomic_store(&caller_waiting, 1);
        if (atomic_load(&finished) == done) futex_wait(&finished, done);
        atomic_store(&caller_waiting, 0);
        slept = 1;
      }
    }
    atomic_fetch_add(&wait_ns, now_ns() - since);
    atomic_fetch_add(&sleeps, slept);
  }
  status |= atomic_load(&posted_status);
  set_threads(threads);
  return status;
}

/* Pieces run by the helper and by the caller since the start: out[0], out[1]. */
void dynvm_halves_counts(long long *out) {
  out[0] = atomic_load(&by_helper);
  out[1] = atomic_load(&by_caller);
}

/* Since the start: pieces by the helper, by the caller, the caller's wait for the
   helper's last piece (ns), its futex sleeps in them, post-to-first-claim time (ns)
   summed over the GEMMs the helper took part in,
   enter-to-seen time (ns) summed over the calls the helper saw, those calls, and its
   parks: out[0..7]. */
void dynvm_halves_stats(long long *out) {
  out[0] = atomic_load(&by_helper);
  out[1] = atomic_load(&by_caller);
  out[2] = atomic_load(&wait_ns);
  out[3] = atomic_load(&sleeps);
  out[4] = atomic_load(&claim_ns);
  out[5] = atomic_load(&wake_ns);
  out[6] = atomic_load(&wakes);
  out[7] = atomic_load(&parks);
}

/* 0: the helper never claims a piece (the caller runs them all); 1: it does. */
void dynvm_halves_set_claiming(int on) { atomic_store(&claiming, on); }
