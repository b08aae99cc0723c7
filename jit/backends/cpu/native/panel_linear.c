/* An fp32 GEMM of 16-32 rows over a weight packed once into K-major column panels (Note
   [A panel GEMM of our own] in jit/backends/cpu/panel_linear.py says why, what it
   measured, and that the JIT does not choose it yet).

     y[m, n] = act(sum_k x[m, k] * W(n, k) + b[n]) (+ add[m, n])

   The packed weight: panel p holds W's columns n = width p .. width (p + 1) - 1 as
   [K][width], contiguous (the last panel's columns past N are zeros), and the panels
   follow each other: the weight is one sequential stream, each thread's share of panels
   a contiguous piece of it. width is 16 (one vector a k) or 32 (two).

   Per panel, the rows of x go in blocks (up to 16 rows at width 16: 16 accumulators; up
   to 12 at width 32: 24), and for each k the block loads the panel's vectors and
   broadcasts each row's x[m, k] into one FMA per vector. The first block reads the panel
   from memory, with a software prefetch PREFETCH_BYTES ahead in the stream (the hardware
   prefetcher stops at each 4 KiB page); the later blocks find it in L2 (a 16-column panel
   is 48 KiB at K = 768, 192 KiB at K = 3072). The panels are split across the OpenMP
   team torch itself uses, one parallel region a call.

   Only AVX-512F code paths: the functions carry target attributes, so the library loads
   on any x86-64; dynvm_panel_supported says whether the kernels may be called. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <omp.h>

#define AVX512 __attribute__((target("avx512f")))
/* 8 KiB ahead: at M = 16 over BERT-base's 16 GEMMs 1 / 4 / 8 / 16 KiB ran 15.97 / 8.57 /
   8.07 / 8.77 ms (2026-12-06, H32M, docs/bench_log.md) */
#define PREFETCH_BYTES 8192

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_GELU_ERF = 2 };

static struct PyModuleDef panel_module = {
    PyModuleDef_HEAD_INIT, "_panel_linear",
    "dynvm's panel GEMM; its C functions are called through ctypes (panel_linear.py)",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__panel_linear(void) { return PyModule_Create(&panel_module); }

int dynvm_panel_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") ? 1 : 0;
}

/* e^v for v in fp32's range: v = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to
   r^6 (relative error below 2e-7 there), scaled by 2^n (vscalefps). */
static inline AVX512 __m512 exp_ps(__m512 v) {
  v = _mm512_max_ps(_mm512_min_ps(v, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

/* GELU (erf form): 0.5 v (1 + erf(v / sqrt 2)), erf by Abramowitz & Stegun 7.1.26
   (absolute error below 1.5e-7), odd in its argument. */
static inline AVX512 __m512 gelu_erf_ps(__m512 v) {
  __m512 z = _mm512_mul_ps(v, _mm512_set1_ps(0.707106781f));
  __m512 a = _mm512_abs_ps(z);
  __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f),
                           _mm512_fmadd_ps(a, _mm512_set1_ps(0.3275911f),
                                           _mm512_set1_ps(1.0f)));
  __m512 p = _mm512_set1_ps(1.061405429f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
  p = _mm512_mul_ps(p, t);
  __m512 e = exp_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), a));
  __m512 erf_abs = _mm512_fnmadd_ps(p, e, _mm512_set1_ps(1.0f));
  __mmask16 negative = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
  __m512 erf = _mm512_mask_sub_ps(erf_abs, negative, _mm512_setzero_ps(), erf_abs);
  return _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(0.5f)),
                       _mm512_add_ps(erf, _mm512_set1_ps(1.0f)));
}

/* One panel's columns n0 .. n0 + 16 V - 1 (lanes masked by `masks` past N) for rows
   r0 .. r0 + R - 1: the whole K in registers, then bias, activation, add, store. */
#define PANEL_BLOCK(V, R)                                                                  \
  static inline AVX512 void panel_block_##V##_##R(                                         \
      const float* x, long ldx, long K, const float* panel, long r0, long n0,              \
      const __mmask16* masks, const float* b, int act, const float* add, long lda,         \
      float* y, long ldy, const char* prefetch_end) {                                      \
    __m512 acc[R][V];                                                                      \
    for (int r = 0; r < R; r++)                                                            \
      for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();                         \
    const float* xr = x + r0 * ldx;                                                        \
    for (long k = 0; k < K; k++) {                                                         \
      const float* w = panel + k * 16 * V;                                                 \
      const char* ahead = (const char*)w + PREFETCH_BYTES;                                 \
      if (ahead < prefetch_end)                                                            \
        for (int v = 0; v < V; v++) _mm_prefetch(ahead + 64 * v, _MM_HINT_T0);             \
      __m512 wv[V];                                                                        \
      for (int v = 0; v < V; v++) wv[v] = _mm512_load_ps(w + 16 * v);                      \
      for (int r = 0; r < R; r++) {                                                        \
        __m512 xb = _mm512_set1_ps(xr[r * ldx + k]);                                       \
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_fmadd_ps(wv[v], xb, acc[r][v]);     \
      }                                                                                    \
    }                                                                                      \
    __m512 bv[V];                                                                          \
    for (int v = 0; v < V; v++)                                                            \
      bv[v] = b ? _mm512_maskz_loadu_ps(masks[v], b + n0 + 16 * v) : _mm512_setzero_ps();  \
    for (int r = 0; r < R; r++) {                                                          \
      long m = r0 + r;                                                                     \
      for (int v = 0; v < V; v++) {                                                        \
        __m512 o = _mm512_add_ps(acc[r][v], bv[v]);                                        \
        if (act == ACT_RELU) o = _mm512_max_ps(o, _mm512_setzero_ps());                    \
        else if (act == ACT_GELU_ERF) o = gelu_erf_ps(o);                                  \
        if (add)                                                                           \
          o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(masks[v], add + m * lda + n0 + 16 * v)); \
        _mm512_mask_storeu_ps(y + m * ldy + n0 + 16 * v, masks[v], o);                     \
      }                                                                                    \
    }                                                                                      \
  }

typedef void (*panel_block_fn)(const float*, long, long, const float*, long, long,
                               const __mmask16*, const float*, int, const float*, long,
                               float*, long, const char*);

/* 16-column panels: up to 16 rows a block (16 accumulators; 21-22 spilled: M = 64 in
   3 blocks ran 2.3x slower than in 4); 32-column panels: up to 12
   (24 accumulators, two weight vectors a k: fewer loads per FMA) */
#define MAX_ROWS_1 16
#define MAX_ROWS_2 12
PANEL_BLOCK(1, 1) PANEL_BLOCK(1, 2) PANEL_BLOCK(1, 3) PANEL_BLOCK(1, 4) PANEL_BLOCK(1, 5)
PANEL_BLOCK(1, 6) PANEL_BLOCK(1, 7) PANEL_BLOCK(1, 8) PANEL_BLOCK(1, 9) PANEL_BLOCK(1, 10)
PANEL_BLOCK(1, 11) PANEL_BLOCK(1, 12) PANEL_BLOCK(1, 13) PANEL_BLOCK(1, 14)
PANEL_BLOCK(1, 15) PANEL_BLOCK(1, 16)
PANEL_BLOCK(2, 1) PANEL_BLOCK(2, 2) PANEL_BLOCK(2, 3) PANEL_BLOCK(2, 4) PANEL_BLOCK(2, 5)
PANEL_BLOCK(2, 6) PANEL_BLOCK(2, 7) PANEL_BLOCK(2, 8) PANEL_BLOCK(2, 9) PANEL_BLOCK(2, 10)
PANEL_BLOCK(2, 11) PANEL_BLOCK(2, 12)

static const panel_block_fn BLOCKS_1[MAX_ROWS_1 + 1] = {
    0, panel_block_1_1, panel_block_1_2, panel_block_1_3, panel_block_1_4,
    panel_block_1_5, panel_block_1_6, panel_block_1_7, panel_block_1_8, panel_block_1_9,
    panel_block_1_10, panel_block_1_11, panel_block_1_12, panel_block_1_13,
    panel_block_1_14, panel_block_1_15, panel_block_1_16};
static const panel_block_fn BLOCKS_2[MAX_ROWS_2 + 1] = {
    0, panel_block_2_1, panel_block_2_2, panel_block_2_3, panel_block_2_4,
    panel_block_2_5, panel_block_2_6, panel_block_2_7, panel_block_2_8, panel_block_2_9,
    panel_block_2_10, panel_block_2_11, panel_block_2_12};

static inline __mmask16 lanes_mask(long lanes) {
  return lanes >= 16 ? (__mmask16)0xFFFF
       : lanes <= 0  ? (__mmask16)0
                     : (__mmask16)((1u << lanes) - 1u);
}

/* y = act(x W^T + b) (+ add) with W packed as above in panels of `width` (16 or 32)
   columns: ceil(N / width) panels of K x width floats, 64-byte aligned. x, add and y are
   row-strided, rows contiguous. */
AVX512 void dynvm_panel_linear(const float* x, long ldx, long M, long K,
                               const float* packed, long width, long N, const float* b,
                               int act, const float* add, long lda, float* y, long ldy) {
  long panels = (N + width - 1) / width, vectors = width / 16;
  long max_rows = vectors == 1 ? MAX_ROWS_1 : MAX_ROWS_2;
  const panel_block_fn* table = vectors == 1 ? BLOCKS_1 : BLOCKS_2;
  /* rows in as few blocks as fit, their sizes within one of each other */
  long blocks = (M + max_rows - 1) / max_rows;
  #pragma omp parallel
  {
    long threads = omp_get_num_threads(), thread = omp_get_thread_num();
    long first = panels * thread / threads, last = panels * (thread + 1) / threads;
    const char* end = (const char*)(packed + last * K * width);
    for (long p = first; p < last; p++) {
      const float* panel = packed + p * K * width;
      long n0 = p * width;
      __mmask16 masks[2] = {lanes_mask(N - n0), lanes_mask(N - n0 - 16)};
      long r0 = 0;
      for (long block = 0; block < blocks; block++) {
        long rows = (M - r0) / (blocks - block);
        /* only the first block prefetches: the later ones find the panel in L2 */
        table[rows](x, ldx, K, panel, r0, n0, masks, b, act, add, lda, y, ldy,
                    block == 0 ? end : (const char*)0);
        r0 += rows;
      }
    }
  }
}
