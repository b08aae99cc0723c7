/* An fp32 GEMM of a few to some tens of rows over a weight packed once into K-major
   column panels (Note [A panel GEMM of our own] in jit/backends/cpu/panel_linear.py says
   why, what it measured, and at which rows the JIT chooses it).

     y[m, n] = act(sum_k x[m, k] * W(n, k) + b[n]) (+ add[m, n])

   The packed weight: panel p holds W's columns n = width p .. width (p + 1) - 1 as
   [K][width], contiguous (the last panel's columns past N are zeros), and the panels
   follow each other: the weight is one sequential stream, each thread's share of panels
   a contiguous piece of it. width is 16 (one vector a k) or 32 (two).

   Rows that fit one register block (up to 16 at width 16: 16 accumulators; up to 12 at
   width 32: 24) go over each panel's whole K at once: for each k the block loads the
   panel's vectors and broadcasts each row's x[m, k] into one FMA per vector, reading the
   panel from memory once, with a software prefetch PREFETCH_BYTES ahead in the stream
   (the hardware prefetcher stops at each 4 KiB page).

   More rows go 32 columns at a time (two 16-column panels side by side, or one 32-column
   panel) in blocks of up to CHUNK_ROWS (11) rows (22 accumulators: 2 weight loads and 11
   broadcasts a 22 FMAs, where a 16-row block at 16 columns needs 17 loads a 16), over K
   in chunks of CHUNK_K: each chunk of the panels is read from memory once and by the
   later row blocks from cache, the sums kept in y between chunks; x is first packed k-major a row block (one sequential stream of broadcasts),
   and each block prefetches its share of the stream's next chunk, spread over its k.
   The panels are split across the OpenMP team torch itself uses, one parallel region a
   call.

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
/* K a chunk past one register block, and where its next chunk is prefetched to: over
   BERT-base's 24 GEMMs (H33M, 2026-12-06 10:03 UTC, load 2.5) 192-256 ran 18.7 ms at M =
   64 against 19.4 at 128 and 20.6 at 64 (equal at 24-48 rows), and into L2 (T1) 0-7%
   faster than into L1 (T0) at 24-64 rows. A chunk of two panels is 32 KiB at 256. */
#ifndef CHUNK_K
#define CHUNK_K 256
#endif
#ifndef CHUNK_HINT
#define CHUNK_HINT _MM_HINT_T1
#endif

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

/* The epilogue of a block's accumulators: bias, activation, residual add, store. */
#define EPILOGUE(V, R)                                                                     \
  do {                                                                                     \
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
  } while (0)

/* One panel's columns n0 .. n0 + 16 V - 1 (lanes masked by `masks` past N) for rows
   r0 .. r0 + R - 1 that fit one register block: the whole K in registers, the panel read
   once from memory, then the epilogue. */
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
    EPILOGUE(V, R);                                                                        \
  }

/* Rows r0 .. r0 + R - 1 over one K chunk of V column vectors, vector v's k-th 16 floats
   at chunk + v * vstride + k * kstride; x's rows packed k-major (xp: R floats a k). The
   sums start from y's partial sums unless `first` and get the epilogue if `last`, else
   go back to y. Every `step`-th k, from k = 0, prefetches row k + `offset` of the
   stream's next chunk (at `ahead`, `ahead_rows` rows): the chunk's row blocks share it. */
#define CHUNK_BLOCK(V, R)                                                                  \
  static inline AVX512 void chunk_block_##V##_##R(                                         \
      const float* xp, long kn, const float* chunk, long kstride, long vstride, long r0,   \
      long n0, const __mmask16* masks, const float* b, int act, const float* add,          \
      long lda, float* y, long ldy, int first, int last, const float* ahead,               \
      long ahead_rows, long step, long offset) {                                           \
    __m512 acc[R][V];                                                                      \
    for (int r = 0; r < R; r++)                                                            \
      for (int v = 0; v < V; v++)                                                          \
        acc[r][v] = first ? _mm512_setzero_ps()                                            \
                          : _mm512_maskz_loadu_ps(masks[v], y + (r0 + r) * ldy + n0 + 16 * v); \
    long countdown = 1;                                                                    \
    for (long k = 0; k < kn; k++) {                                                        \
      if (--countdown == 0) {                                                              \
        countdown = step;                                                                  \
        if (k + offset < ahead_rows)                                                       \
          for (int v = 0; v < V; v++)                                                      \
            _mm_prefetch((const char*)(ahead + v * vstride + (k + offset) * kstride),      \
                         CHUNK_HINT);                                                      \
      }                                                                                    \
      __m512 wv[V];                                                                        \
      for (int v = 0; v < V; v++) wv[v] = _mm512_load_ps(chunk + v * vstride + k * kstride); \
      for (int r = 0; r < R; r++) {                                                        \
        __m512 xb = _mm512_set1_ps(xp[k * R + r]);                                         \
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_fmadd_ps(wv[v], xb, acc[r][v]);     \
      }                                                                                    \
    }                                                                                      \
    if (last) {                                                                            \
      EPILOGUE(V, R);                                                                      \
    } else {                                                                               \
      for (int r = 0; r < R; r++)                                                          \
        for (int v = 0; v < V; v++)                                                        \
          _mm512_mask_storeu_ps(y + (r0 + r) * ldy + n0 + 16 * v, masks[v], acc[r][v]);    \
    }                                                                                      \
  }

typedef void (*panel_block_fn)(const float*, long, long, const float*, long, long,
                               const __mmask16*, const float*, int, const float*, long,
                               float*, long, const char*);
typedef void (*chunk_block_fn)(const float*, long, const float*, long, long, long, long,
                               const __mmask16*, const float*, int, const float*, long,
                               float*, long, int, int, const float*, long, long, long);

#define UP_TO_12(KIND, V)                                                                  \
  KIND(V, 1) KIND(V, 2) KIND(V, 3) KIND(V, 4) KIND(V, 5) KIND(V, 6) KIND(V, 7) KIND(V, 8)  \
  KIND(V, 9) KIND(V, 10) KIND(V, 11) KIND(V, 12)
#define NAMES_UP_TO_12(P, V)                                                               \
  P##V##_1, P##V##_2, P##V##_3, P##V##_4, P##V##_5, P##V##_6, P##V##_7, P##V##_8,          \
  P##V##_9, P##V##_10, P##V##_11, P##V##_12

/* 16-column panels: up to 16 rows a block (16 accumulators; 21-22 spilled: M = 64 in
   3 blocks ran 2.3x slower than in 4); 32 columns (24 accumulators, two weight vectors a
   k: fewer loads per FMA): up to 12 */
#define MAX_ROWS_1 16
#define MAX_ROWS_2 12
/* past one register block, blocks of up to 11 rows: over BERT-base's 24 GEMMs (H33M,
   10:16 UTC, load 1.7-2.2) 12-row blocks ran 24 rows in 11.11 ms and 48 in 15.26, 11
   10.16 and 13.60 (3 blocks of 8, 5 of 9-10), 32 and 64 rows equal (11.30, 17.17 against
   11.28, 16.89); 10 lost at 32 rows (12.38: 4 blocks of 8) */
#define CHUNK_ROWS 11
UP_TO_12(PANEL_BLOCK, 1) PANEL_BLOCK(1, 13) PANEL_BLOCK(1, 14) PANEL_BLOCK(1, 15)
PANEL_BLOCK(1, 16) UP_TO_12(PANEL_BLOCK, 2)
UP_TO_12(CHUNK_BLOCK, 1) UP_TO_12(CHUNK_BLOCK, 2)

static const panel_block_fn PANEL_BLOCKS_1[MAX_ROWS_1 + 1] = {
    0, NAMES_UP_TO_12(panel_block_, 1), panel_block_1_13, panel_block_1_14,
    panel_block_1_15, panel_block_1_16};
static const panel_block_fn PANEL_BLOCKS_2[MAX_ROWS_2 + 1] = {
    0, NAMES_UP_TO_12(panel_block_, 2)};
static const chunk_block_fn CHUNK_BLOCKS_1[MAX_ROWS_2 + 1] = {
    0, NAMES_UP_TO_12(chunk_block_, 1)};
static const chunk_block_fn CHUNK_BLOCKS_2[MAX_ROWS_2 + 1] = {
    0, NAMES_UP_TO_12(chunk_block_, 2)};

static inline __mmask16 lanes_mask(long lanes) {
  return lanes >= 16 ? (__mmask16)0xFFFF
       : lanes <= 0  ? (__mmask16)0
                     : (__mmask16)((1u << lanes) - 1u);
}

/* The row blocks past one register block: as few of up to CHUNK_ROWS rows as cover M,
   their sizes within one of each other; block i starts at row_start(M, blocks, i). */
static inline long row_start(long M, long blocks, long i) {
  return M / blocks * i + (i < M % blocks ? i : M % blocks);
}

/* x's rows packed a row block at a time, k-major (R floats a k), so that a block's
   broadcasts read one sequential stream: in place its rows are K floats apart, and at
   K = 3072 (12 KiB) all of a block's rows fall in one L1 set. */
static inline void pack_rows(const float* x, long ldx, long M, long K, long blocks,
                             float* xp) {
  #pragma omp for schedule(static)
  for (long block = 0; block < blocks; block++) {
    long r0 = row_start(M, blocks, block), rows = row_start(M, blocks, block + 1) - r0;
    float* out = xp + r0 * K;
    for (long k = 0; k < K; k++)
      for (long r = 0; r < rows; r++) out[k * rows + r] = x[(r0 + r) * ldx + k];
  }
}

/* Floats of the scratch dynvm_panel_linear needs for M rows: x's packed rows past one
   register block, none within it. */
long dynvm_panel_scratch_floats(long M, long K, long width) {
  return M > (width == 16 ? MAX_ROWS_1 : MAX_ROWS_2) ? M * K : 0;
}

/* Columns n0 .. n0 + 16 V - 1 over K in chunks, for all M rows (x packed in xp).
   `group` is where the V vectors' data starts, one k row of vector v at group + v *
   vstride + k * kstride; `next` the stream's next group (null past this thread's). */
static inline AVX512 void chunked_columns(const float* xp, long M, long K,
                                          const float* group, long kstride, long vstride,
                                          const float* next, long n0, long N,
                                          const float* b, int act, const float* add,
                                          long lda, float* y, long ldy,
                                          const chunk_block_fn* table) {
  long blocks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS;
  __mmask16 masks[2] = {lanes_mask(N - n0), lanes_mask(N - n0 - 16)};
  for (long k0 = 0; k0 < K; k0 += CHUNK_K) {
    long kn = K - k0 < CHUNK_K ? K - k0 : CHUNK_K;
    const float* chunk = group + k0 * kstride;
    /* the next chunk of these columns, or the next group's first */
    const float* ahead = k0 + kn < K ? chunk + kn * kstride : next;
    long ahead_k = k0 + kn < K ? K - k0 - kn : K;   /* k rows left where it points */
    long ahead_rows = !ahead ? 0 : ahead_k < CHUNK_K ? ahead_k : CHUNK_K;
    for (long block = 0; block < blocks; block++) {
      long r0 = row_start(M, blocks, block), rows = row_start(M, blocks, block + 1) - r0;
      table[rows](xp + r0 * K + k0 * rows, kn, chunk, kstride, vstride, r0, n0, masks, b,
                  act, add, lda, y, ldy, k0 == 0, k0 + kn == K, ahead, ahead_rows, blocks,
                  block);
    }
  }
}

/* y = act(x W^T + b) (+ add) with W packed as above in panels of `width` (16 or 32)
   columns: ceil(N / width) panels of K x width floats, 64-byte aligned. x, add and y are
   row-strided, rows contiguous; `scratch` holds dynvm_panel_scratch_floats(M, K, width)
   floats (the caller's: torch's allocator reuses it, and a failed allocation raises
   there). */
AVX512 void dynvm_panel_linear(const float* x, long ldx, long M, long K,
                               const float* packed, long width, long N, const float* b,
                               int act, const float* add, long lda, float* y, long ldy,
                               float* scratch) {
  long panels = (N + width - 1) / width, vectors = width / 16;
  long one_block = vectors == 1 ? MAX_ROWS_1 : MAX_ROWS_2;
  const panel_block_fn* table = vectors == 1 ? PANEL_BLOCKS_1 : PANEL_BLOCKS_2;
  long blocks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS;
  float* xp = M > one_block ? scratch : 0;
  /* past one block the panels go 32 columns at a time: a 16-column panel and the next */
  long groups = M > one_block ? (N + 31) / 32 : panels;
  #pragma omp parallel
  {
    if (xp) pack_rows(x, ldx, M, K, blocks, xp);   /* the team's barrier follows */
    long threads = omp_get_num_threads(), thread = omp_get_thread_num();
    long first = groups * thread / threads, last = groups * (thread + 1) / threads;
    if (!xp) {
      const char* end = (const char*)(packed + last * K * width);
      for (long p = first; p < last; p++) {
        const float* panel = packed + p * K * width;
        long n0 = p * width;
        __mmask16 masks[2] = {lanes_mask(N - n0), lanes_mask(N - n0 - 16)};
        table[M](x, ldx, K, panel, 0, n0, masks, b, act, add, lda, y, ldy, end);
      }
    } else {
      for (long g = first; g < last; g++) {
        long n0 = g * 32;
        const float* group = packed + n0 * K;         /* 32 columns are K x 32 floats */
        const float* next = g + 1 < last ? group + 32 * K : 0;
        /* at width 16 an odd last panel stands alone */
        int pair = vectors == 2 || n0 + 16 < panels * 16;
        chunked_columns(xp, M, K, group, width, vectors == 2 ? 16 : 16 * K, next, n0, N, b,
                        act, add, lda, y, ldy, pair ? CHUNK_BLOCKS_2 : CHUNK_BLOCKS_1);
      }
    }
  }
}
