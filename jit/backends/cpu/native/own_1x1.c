/* dynvm's own fp32 1x1 convolution for a chain's NHWC values at a few rows (Note [A 1x1
   convolution of our own at a few rows] in jit/backends/cpu/own_1x1.py says when the
   chain runs it and why).

   y[m, n] = act(sum_k x[m, k] w[k, n] + bias[n] (+ y[m, n] with `sum`)), x and y NHWC
   (M = N*H*W rows of K and N channels), the weight packed by own_1x1.py in panels of 64
   output channels: panel p is K x 64 contiguous at w + p * K * 64. A 7 x 64 register tile
   (28 accumulators, 4 weight vectors, one broadcast) over chunks of KC input channels: a
   chunk of a panel (KC x 64 floats, 64 KiB) is read once from L3 or memory and reused
   by every 7-row block from L1 / L2, while the next chunk is prefetched into L2. The two
   threads take halves of the panels (each reads half of the weight).

   The step is called by the chain's loop (onednn_chain.c) with the signature of
   dnnl_primitive_execute: `self` is an Own1x1 (below), `args` the step's oneDNN execute
   arguments, whose source and destination memories give the data pointers. */

#include <immintrin.h>
#include <omp.h>
#include <stddef.h>

#define NR 64
#define KC 256
#define MR 7

typedef struct {
  int arg;
  void *memory;
} exec_arg;

typedef int (*get_handle_fn)(const void *memory, void **handle);

typedef struct {
  int rows, in_channels, out_channels; /* M, K, N */
  const float *weight;                 /* panels */
  const float *bias;                   /* N floats */
  int sum, relu;                       /* post-ops: sum into y, then ReLU */
  int arg_src, arg_dst;                /* DNNL_ARG_SRC / DNNL_ARG_DST */
  get_handle_fn get_handle;            /* dnnl_memory_get_data_handle */
} Own1x1;

__attribute__((target("avx512f"), always_inline)) static inline void
tile(int mr, int K, const float *x, long ldx, const float *wp, float *y, long ldy,
     const float *bias, int sum, int relu, int first, int last, const char *pf) {
  __m512 c[MR][4];
#pragma GCC unroll 7
  for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
      if (r < mr)   /* the residual (sum) is the first chunk's starting value */
        c[r][j] = first && !sum ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy + 16 * j);
  for (int k = 0; k < K; k++) {
    const float *w = wp + (long)k * NR;
    if (pf) _mm_prefetch(pf + 64L * k, _MM_HINT_T1);
    __m512 b0 = _mm512_loadu_ps(w), b1 = _mm512_loadu_ps(w + 16);
    __m512 b2 = _mm512_loadu_ps(w + 32), b3 = _mm512_loadu_ps(w + 48);
#pragma GCC unroll 7
    for (int r = 0; r < MR; r++) {
      if (r < mr) {
        __m512 a = _mm512_set1_ps(x[r * ldx + k]);
        c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
        c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
        c[r][2] = _mm512_fmadd_ps(a, b2, c[r][2]);
        c[r][3] = _mm512_fmadd_ps(a, b3, c[r][3]);
      }
    }
  }
  __m512 zero = _mm512_setzero_ps();
#pragma GCC unroll 7
  for (int r = 0; r < MR; r++) {
    if (r >= mr) continue;
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      __m512 v = c[r][j];
      if (last) {
        v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));
        if (relu) v = _mm512_max_ps(v, zero);
      }
      _mm512_storeu_ps(y + r * ldy + 16 * j, v);
    }
  }
}

__attribute__((target("avx512f"))) static void
rows_tile(int mr, int K, const float *x, long ldx, const float *wp, float *y, long ldy,
          const float *bias, int sum, int relu, int first, int last, const char *pf) {
  switch (mr) {  /* a constant row count: the compiler keeps the tile in registers */
#define TILE(n) \
  case n: tile(n, K, x, ldx, wp, y, ldy, bias, sum, relu, first, last, pf); break;
    TILE(7) TILE(6) TILE(5) TILE(4) TILE(3) TILE(2) TILE(1)
#undef TILE
  }
}

__attribute__((target("avx512f"))) static void
panels(const Own1x1 *c, int p0, int p1, const float *x, float *y) {
  int M = c->rows, K = c->in_channels, N = c->out_channels;
  for (int p = p0; p < p1; p++) {
    const float *wp = c->weight + (long)p * K * NR;
    for (int k0 = 0; k0 < K; k0 += KC) {
      int kc = K - k0 < KC ? K - k0 : KC;
      int first = k0 == 0, last = k0 + kc >= K;
      /* the chunk after this one (this panel's next, or the next panel's first),
         prefetched into L2 a line per k by the first row blocks */
      const float *next = !last ? wp + (long)(k0 + kc) * NR
                                : (p + 1 < p1 ? c->weight + (long)(p + 1) * K * NR : NULL);
      int next_k = !last ? (K - k0 - kc < KC ? K - k0 - kc : KC) : (K < KC ? K : KC);
      long lines = next ? (long)next_k * NR / 16 : 0;
      for (int m = 0, b = 0; m < M; m += MR, b++) {
        const char *pf = NULL;
        if (next && (long)(b + 1) * kc <= lines) pf = (const char *)next + 64L * b * kc;
        rows_tile(M - m < MR ? M - m : MR, kc, x + (long)m * K + k0, K, wp + (long)k0 * NR,
                  y + (long)m * N + (long)p * NR, N, c->bias + (long)p * NR, c->sum,
                  c->relu, first, last, pf);
      }
    }
  }
}

/* 1 where this CPU runs the kernel (AVX-512F), else 0. */
int dynvm_own_1x1_supported(void) { return __builtin_cpu_supports("avx512f") ? 1 : 0; }

/* The chain's step: dnnl_primitive_execute's signature (`stream` unused). Returns 0, or
   -1 where an argument's data pointer could not be read. */
int dynvm_own_1x1_execute(void *self, void *stream, int nargs, const void *args) {
  const Own1x1 *c = (const Own1x1 *)self;
  const exec_arg *a = (const exec_arg *)args;
  void *src = NULL, *dst = NULL;
  (void)stream;
  for (int i = 0; i < nargs; i++) {
    if (a[i].arg == c->arg_src && c->get_handle(a[i].memory, &src) != 0) return -1;
    if (a[i].arg == c->arg_dst && c->get_handle(a[i].memory, &dst) != 0) return -1;
  }
  if (src == NULL || dst == NULL) return -1;
  int P = c->out_channels / NR;
  int threads = omp_get_max_threads();
  if (threads > P) threads = P;
  if (threads <= 1) {
    panels(c, 0, P, (const float *)src, (float *)dst);
    return 0;
  }
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), n = omp_get_num_threads();
    panels(c, P * t / n, P * (t + 1) / n, (const float *)src, (float *)dst);
  }
  return 0;
}
