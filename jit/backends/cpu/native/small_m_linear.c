/* The CPU backend's GEMM of a few rows over a dense fp32 weight (Note [A small-M GEMM of
   our own] in jit/backends/cpu/native_linear.py says when the JIT calls it and why).

     y[m, n] = sum_k x[m, k] * W(n, k)  (+ b[n])  (+ add[m, n])

   W is the weight as the program holds it, never a packed copy: either torch's Linear
   layout ("nk": w[n * ldw + k]) or input-major ("kn": w[k * ldw + n], the layout the LM
   head is stored in, Note [LM head stored input-major]). x, add and y are row-strided
   (ld*), their rows contiguous.

   At M <= 16 the product reads each weight byte once and uses it M times, so it is
   bound by how fast the weight streams: both kernels read W exactly once from memory,
   keep a block of outputs in registers, and split the output columns across the
   OpenMP team that torch itself uses (libgomp is loaded once per process: the library
   names the same soname torch ships), so the team's threads each stream their share.

   Only AVX-512F code paths: the functions carry target attributes and the library is
   built without -mavx512f, so loading it on any x86-64 is safe; dynvm_small_m_supported
   says whether the kernels may be called. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <omp.h>

#define AVX512 __attribute__((target("avx512f")))

/* An importable (empty) module, so that the package's modules all import; the kernels
   are plain C functions that native_linear.py calls through ctypes, which releases the
   GIL for each call. */
static struct PyModuleDef small_m_module = {
    PyModuleDef_HEAD_INIT, "_small_m_linear",
    "dynvm's small-M GEMM; its C functions are called through ctypes (native_linear.py)",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__small_m_linear(void) { return PyModule_Create(&small_m_module); }

int dynvm_small_m_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") ? 1 : 0;
}

/* ---- nk: W is [N, K]; a block is NB weight rows x MB rows of x ------------------------
   Each output is a dot product over K: NB * MB vector accumulators summed across lanes
   at the end. The NB weight rows are read from memory once and from L1 for the other
   row blocks of x. */

#define NK_BLOCK(NB, MB)                                                                   \
  static inline AVX512 void nk_block_##NB##_##MB(                                          \
      const float* x, long ldx, long K, const float* w, long ldw, const float* b,          \
      const float* add, long lda, float* y, long ldy, long n0, long m0,                    \
      const float* ahead) {                                                                \
    __m512 acc[NB][MB];                                                                    \
    for (int i = 0; i < NB; i++)                                                           \
      for (int j = 0; j < MB; j++) acc[i][j] = _mm512_setzero_ps();                        \
    long k = 0;                                                                            \
    for (; k + 16 <= K; k += 16) {                                                         \
      __m512 xv[MB];                                                                       \
      if (ahead)                                                                           \
        for (int i = 0; i < NB; i++) _mm_prefetch((const char*)(ahead + i * ldw + k),      \
                                                  _MM_HINT_T0);                            \
      for (int j = 0; j < MB; j++) xv[j] = _mm512_loadu_ps(x + (m0 + j) * ldx + k);        \
      for (int i = 0; i < NB; i++) {                                                       \
        __m512 wv = _mm512_loadu_ps(w + (n0 + i) * ldw + k);                               \
        for (int j = 0; j < MB; j++) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);    \
      }                                                                                    \
    }                                                                                      \
    if (k < K) {                                                                           \
      __mmask16 tail = (__mmask16)((1u << (K - k)) - 1u);                                  \
      __m512 xv[MB];                                                                       \
      for (int j = 0; j < MB; j++)                                                         \
        xv[j] = _mm512_maskz_loadu_ps(tail, x + (m0 + j) * ldx + k);                       \
      for (int i = 0; i < NB; i++) {                                                       \
        __m512 wv = _mm512_maskz_loadu_ps(tail, w + (n0 + i) * ldw + k);                   \
        for (int j = 0; j < MB; j++) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);    \
      }                                                                                    \
    }                                                                                      \
    for (int i = 0; i < NB; i++)                                                           \
      for (int j = 0; j < MB; j++) {                                                       \
        long n = n0 + i, m = m0 + j;                                                       \
        float v = _mm512_reduce_add_ps(acc[i][j]);                                         \
        if (b) v += b[n];                                                                  \
        if (add) v += add[m * lda + n];                                                    \
        y[m * ldy + n] = v;                                                                \
      }                                                                                    \
  }

NK_BLOCK(4, 1) NK_BLOCK(4, 2) NK_BLOCK(4, 3) NK_BLOCK(4, 4)
NK_BLOCK(1, 1) NK_BLOCK(1, 2) NK_BLOCK(1, 3) NK_BLOCK(1, 4)

/* A column block's rows of x, four at a time; the first row block also prefetches the
   weight rows of `ahead` (the thread's next column block, or NULL), so they stream from
   memory while the later row blocks compute from L1. */
#define NK_ROWS(NB)                                                                        \
  static inline AVX512 void nk_rows_##NB(                                                  \
      const float* x, long ldx, long M, long K, const float* w, long ldw, const float* b,  \
      const float* add, long lda, float* y, long ldy, long n0, const float* ahead) {       \
    long m0 = 0;                                                                           \
    for (; m0 + 4 <= M; m0 += 4, ahead = 0)                                                \
      nk_block_##NB##_4(x, ldx, K, w, ldw, b, add, lda, y, ldy, n0, m0, ahead);            \
    switch (M - m0) {                                                                      \
      case 3: nk_block_##NB##_3(x, ldx, K, w, ldw, b, add, lda, y, ldy, n0, m0, ahead);    \
              break;                                                                       \
      case 2: nk_block_##NB##_2(x, ldx, K, w, ldw, b, add, lda, y, ldy, n0, m0, ahead);    \
              break;                                                                       \
      case 1: nk_block_##NB##_1(x, ldx, K, w, ldw, b, add, lda, y, ldy, n0, m0, ahead);    \
              break;                                                                       \
      default: break;                                                                      \
    }                                                                                      \
  }

NK_ROWS(4) NK_ROWS(1)

AVX512 void dynvm_small_m_linear_nk(const float* x, long ldx, long M, long K,
                                    const float* w, long ldw, long N, const float* b,
                                    const float* add, long lda, float* y, long ldy) {
  long blocks = N / 4;
  #pragma omp parallel
  {
    #pragma omp for schedule(static) nowait
    for (long block = 0; block < blocks; block++)
      nk_rows_4(x, ldx, M, K, w, ldw, b, add, lda, y, ldy, block * 4,
                block + 1 < blocks ? w + (block + 1) * 4 * ldw : 0);
    #pragma omp for schedule(static)
    for (long n = blocks * 4; n < N; n++)
      nk_rows_1(x, ldx, M, K, w, ldw, b, add, lda, y, ldy, n, 0);
  }
}

/* ---- kn: W is [K, N]; outer products over blocks of k rows --------------------------
   Consecutive k rows of W are a whole row (N floats) apart, so walking k down a narrow
   column strip touches a new page every row. Instead each thread owns a contiguous range
   of 64-column strips and, for each block of KN_K_BLOCK rows of k, walks across all its
   strips: every weight row is then read as KN_K_BLOCK sequential streams. The outputs
   live in y between blocks (M x the thread's columns: 1 MiB at M = 16 over half of a
   32000-column head, in L2), each block's 64-column piece in registers while its k rows
   run: MB rows of x broadcast against 4 vectors of a weight row, no lane sums. The first
   row block also prefetches the same k rows' piece KN_PREFETCH_STRIPS strips on: the
   hardware prefetcher restarts at every 4 KiB page, and 16 interleaved streams cross one
   every 16 strips (over the bench Llama's 768 x 32000 head at M=4, one thread, 2026-12-05:
   9.5 ms without, 7.1 with two strips ahead, 7.6 with four; blocks of 32 or 64 k rows
   were slower). The lanes past N of the last strip are masked off (masked loads read
   nothing there, masked stores write nothing). */

#ifndef KN_PREFETCH_STRIPS
#define KN_PREFETCH_STRIPS 2
#endif
#ifndef KN_K_BLOCK
#define KN_K_BLOCK 16
#endif

#define KN_BLOCK(MB)                                                                       \
  static inline AVX512 void kn_block_##MB(                                                 \
      const float* x, long ldx, long k0, long k1, const float* w, long ldw, float* y,      \
      long ldy, long n0, long m0, const __mmask16* masks, long ahead) {                    \
    __m512 acc[MB][4];                                                                     \
    for (int j = 0; j < MB; j++)                                                           \
      for (int v = 0; v < 4; v++)                                                          \
        acc[j][v] = _mm512_maskz_loadu_ps(masks[v], y + (m0 + j) * ldy + n0 + 16 * v);     \
    for (long k = k0; k < k1; k++) {                                                       \
      const float* row = w + k * ldw + n0;                                                 \
      if (ahead) {                                                                         \
        const char* next = (const char*)(row + ahead);                                     \
        _mm_prefetch(next, _MM_HINT_T0);                                                   \
        _mm_prefetch(next + 64, _MM_HINT_T0);                                              \
        _mm_prefetch(next + 128, _MM_HINT_T0);                                             \
        _mm_prefetch(next + 192, _MM_HINT_T0);                                             \
      }                                                                                    \
      __m512 wv[4];                                                                        \
      for (int v = 0; v < 4; v++) wv[v] = _mm512_maskz_loadu_ps(masks[v], row + 16 * v);   \
      for (int j = 0; j < MB; j++) {                                                       \
        __m512 xb = _mm512_set1_ps(x[(m0 + j) * ldx + k]);                                 \
        for (int v = 0; v < 4; v++) acc[j][v] = _mm512_fmadd_ps(wv[v], xb, acc[j][v]);     \
      }                                                                                    \
    }                                                                                      \
    for (int j = 0; j < MB; j++)                                                           \
      for (int v = 0; v < 4; v++)                                                          \
        _mm512_mask_storeu_ps(y + (m0 + j) * ldy + n0 + 16 * v, masks[v], acc[j][v]);      \
  }

KN_BLOCK(1) KN_BLOCK(2) KN_BLOCK(3) KN_BLOCK(4)

static inline AVX512 void kn_masks(long width, __mmask16* masks) {
  for (int v = 0; v < 4; v++) {
    long lanes = width - 16 * v;
    masks[v] = lanes >= 16 ? (__mmask16)0xFFFF
             : lanes <= 0  ? (__mmask16)0
                           : (__mmask16)((1u << lanes) - 1u);
  }
}

AVX512 void dynvm_small_m_linear_kn(const float* x, long ldx, long M, long K,
                                    const float* w, long ldw, long N, const float* b,
                                    const float* add, long lda, float* y, long ldy) {
  long strips = (N + 63) / 64;
  #pragma omp parallel
  {
    long threads = omp_get_num_threads(), thread = omp_get_thread_num();
    long first = strips * thread / threads, last = strips * (thread + 1) / threads;
    long n_lo = first * 64, n_hi = last * 64 < N ? last * 64 : N;
    /* y starts as the bias (+ the add): the blocks of k accumulate onto it */
    for (long m = 0; m < M; m++)
      for (long n = n_lo; n < n_hi; n++)
        y[m * ldy + n] = (b ? b[n] : 0.0f) + (add ? add[m * lda + n] : 0.0f);
    for (long k0 = 0; k0 < K; k0 += KN_K_BLOCK) {
      long k1 = k0 + KN_K_BLOCK < K ? k0 + KN_K_BLOCK : K;
      for (long strip = first; strip < last; strip++) {
        long n0 = strip * 64;
        __mmask16 masks[4];
        kn_masks(N - n0, masks);
        /* the first row block prefetches this k block's piece of a strip further on */
        long ahead = strip + KN_PREFETCH_STRIPS < last ? KN_PREFETCH_STRIPS * 64 : 0;
        long m0 = 0;
        for (; m0 + 4 <= M; m0 += 4, ahead = 0)
          kn_block_4(x, ldx, k0, k1, w, ldw, y, ldy, n0, m0, masks, ahead);
        switch (M - m0) {
          case 3: kn_block_3(x, ldx, k0, k1, w, ldw, y, ldy, n0, m0, masks, ahead); break;
          case 2: kn_block_2(x, ldx, k0, k1, w, ldw, y, ldy, n0, m0, masks, ahead); break;
          case 1: kn_block_1(x, ldx, k0, k1, w, ldw, y, ldy, n0, m0, masks, ahead); break;
          default: break;
        }
      }
    }
  }
}
