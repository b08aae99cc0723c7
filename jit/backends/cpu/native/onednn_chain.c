/* A chain of oneDNN primitives in one call (Note [A chain of primitives in one call] in
   jit/backends/cpu/onednn_chain.py says when the JIT calls it and why).

   The primitives, their execute-argument arrays and the memory objects those arrays
   name are built once, in Python, through oneDNN's C API; a call sets the data handles
   of the memory objects that change per call (the chain's input and its results), then
   executes each primitive in order on one stream and waits for it. oneDNN's functions
   come in as pointers (looked up in the libdnnl that dynvm loaded), so this library
   links nothing of oneDNN and loads where libdnnl is absent.

   It is called through ctypes.PyDLL, holding the GIL as each primitive call did before
   (Note [oneDNN primitives built once]); between two primitives, once yield_after_ns
   have passed since it last did, it lets the GIL go and takes it back, where the
   interpreter's loop would have switched threads between two calls: a thread that
   waited longer than the switch interval runs then, and a chain of 100 ms never holds
   the GIL for all of it. (Letting it go between every two primitives cost 1.5% of a
   bf16 ResNet-50 chain at batch 1: 13.36 against 13.20 ms, A/A 0.995.)

   Each step names the function that executes it: dnnl_primitive_execute for oneDNN's
   primitives, or a step of dynvm's own with the same signature (own_1x1.c, Note [A 1x1
   convolution of our own at a few rows] in jit/backends/cpu/own_1x1.py). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <time.h>

/* An importable (empty) module, so that the package's modules all import; the function
   below is a plain C function that onednn_chain.py calls through ctypes. */
static struct PyModuleDef chain_module = {
    PyModuleDef_HEAD_INIT, "_onednn_chain",
    "dynvm's chain of oneDNN primitives in one call (onednn_chain.py)",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__onednn_chain(void) { return PyModule_Create(&chain_module); }

typedef int (*execute_fn)(void *primitive, void *stream, int nargs, const void *args);
typedef int (*set_handle_fn)(void *memory, void *handle);
typedef int (*wait_fn)(void *stream);

static long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Set handles[i] on memories[i] (i < nhandles), then execute primitives[s] with its
   nargs[s] arguments args[s] by executes[s], or by `execute` where executes is NULL
   (s < nsteps), then wait. Returns the first status other than success (0), with
   *failed the index of the step (nhandles + s for a step, i for a handle, nhandles +
   nsteps for the wait); 0 when all succeeded. With yield_after_ns > 0 the GIL (the
   caller holds it) is let go and taken back between two steps once that many
   nanoseconds have passed since the last time. */
static int chain_run(void *const *executes, void *execute, void *set_handle, void *wait,
                     void *stream, int nhandles, void *const *memories,
                     void *const *handles, int nsteps, void *const *primitives,
                     const int *nargs, void *const *args, long long yield_after_ns,
                     int *failed) {
  set_handle_fn set = (set_handle_fn)set_handle;
  long long last = yield_after_ns > 0 ? now_ns() : 0;
  int status;
  for (int i = 0; i < nhandles; i++) {
    status = set(memories[i], handles[i]);
    if (status != 0) {
      *failed = i;
      return status;
    }
  }
  for (int s = 0; s < nsteps; s++) {
    if (yield_after_ns > 0 && s > 0 && now_ns() - last >= yield_after_ns) {
      PyThreadState *state = PyEval_SaveThread();
      PyEval_RestoreThread(state);
      last = now_ns();
    }
    execute_fn run = (execute_fn)(executes != NULL ? executes[s] : execute);
    status = run(primitives[s], stream, nargs[s], args[s]);
    if (status != 0) {
      *failed = nhandles + s;
      return status;
    }
  }
  status = ((wait_fn)wait)(stream);
  if (status != 0) *failed = nhandles + nsteps;
  return status;
}

/* Every step by dnnl_primitive_execute (`execute`). */
int dynvm_onednn_chain_run(void *execute, void *set_handle, void *wait, void *stream,
                           int nhandles, void *const *memories, void *const *handles,
                           int nsteps, void *const *primitives, const int *nargs,
                           void *const *args, long long yield_after_ns, int *failed) {
  return chain_run(NULL, execute, set_handle, wait, stream, nhandles, memories, handles,
                   nsteps, primitives, nargs, args, yield_after_ns, failed);
}

/* Each step by its own function, executes[s]: oneDNN's or dynvm's own (own_1x1.c). */
int dynvm_onednn_chain_run_steps(void *const *executes, void *set_handle, void *wait,
                                 void *stream, int nhandles, void *const *memories,
                                 void *const *handles, int nsteps,
                                 void *const *primitives, const int *nargs,
                                 void *const *args, long long yield_after_ns, int *failed) {
  return chain_run(executes, NULL, set_handle, wait, stream, nhandles, memories, handles,
                   nsteps, primitives, nargs, args, yield_after_ns, failed);
}
