/* Winograd F(2x2, 3x3) for a chain's NHWC fp32 stride-1 3x3 convolutions (padding 1;
   Note [Winograd F(2x2, 3x3) for the 3x3s] in jit/backends/cpu/winograd.py says when the
   chain runs it and what it measured): the input transform into V [16][tiles][Cin], the
   16 products as one batched oneDNN matmul [16, tiles, Cin] x [16, Cin, Cout] -> M
   [16][tiles][Cout] over the weight transformed once (U = G g G^T), and the output
   transform with the bias, the residual's sum and the ReLU in the store. Vectorized over
   16 channels of NHWC (Cin and Cout whole 16s).

   Tiles are 4x4 input windows at stride 2 (2x2 outputs each), numbered over all images
   (image, tile row, tile column); an odd height or width has a last tile half outside,
   read as zeros and not stored. A step runs tiles [first_tile, first_tile + tiles): the
   team's step all of them (the transforms split over torch's OpenMP team, the matmul a
   primitive built for the team), a piece of the chain in halves (chain_halves.c) its
   share on one thread (a matmul built for one thread, over its part of the scratch).

   Called by the chain's loops with the signature of dnnl_primitive_execute: `self` is a
   Winograd (below), `args` the step's execute arguments, whose source and destination
   memories give the data pointers (dense NHWC values of the arena). */

#include <immintrin.h>
#include <omp.h>
#include <stddef.h>

typedef int (*execute_fn)(void *primitive, void *stream, int nargs, const void *args);
typedef int (*get_handle_fn)(const void *memory, void **handle);

typedef struct {
  int arg;
  void *memory;
} exec_arg;

typedef struct {
  int images, height, width, in_channels, out_channels;
  int first_tile, tiles;     /* the tiles this step or piece computes */
  float *v, *m;              /* its scratch: [16][tiles][Cin], [16][tiles][Cout] */
  const float *bias;         /* Cout floats */
  int sum, relu;             /* post-ops: sum into y, then ReLU */
  void *matmul;              /* the batched matmul over v, U and m */
  int matmul_nargs;
  const void *matmul_args;
  execute_fn execute;        /* dnnl_primitive_execute */
  int arg_src, arg_dst;      /* DNNL_ARG_SRC / DNNL_ARG_DST */
  get_handle_fn get_handle;  /* dnnl_memory_get_data_handle */
} Winograd;

static inline int tiles_across(int n) { return (n + 1) / 2; }

/* V[k][t - first_tile][c] of tiles [t0, t1). */
__attribute__((target("avx512f"))) static void
input_tiles(const Winograd *w, const float *x, int t0, int t1) {
  int H = w->height, W = w->width, C = w->in_channels;
  int TH = tiles_across(H), TW = tiles_across(W);
  long T = w->tiles, sh = (long)W * C, sn = (long)H * W * C;
  __m512 zero = _mm512_setzero_ps();
  for (int t = t0; t < t1; t++) {
    int n = t / (TH * TW), rest = t % (TH * TW), ti = rest / TW, tj = rest % TW;
    int r0 = 2 * ti - 1, s0 = 2 * tj - 1;
    const float *image = x + n * sn;
    float *out = w->v + (long)(t - w->first_tile) * C;
    for (int c = 0; c < C; c += 16) {
      __m512 d[4][4];
      for (int i = 0; i < 4; i++) {
        int r = r0 + i;
        for (int j = 0; j < 4; j++) {
          int s = s0 + j;
          d[i][j] = (r >= 0 && r < H && s >= 0 && s < W)
                        ? _mm512_loadu_ps(image + r * sh + (long)s * C + c) : zero;
        }
      }
      __m512 u[4][4];   /* B^T d: rows */
      for (int j = 0; j < 4; j++) {
        u[0][j] = _mm512_sub_ps(d[0][j], d[2][j]);
        u[1][j] = _mm512_add_ps(d[1][j], d[2][j]);
        u[2][j] = _mm512_sub_ps(d[2][j], d[1][j]);
        u[3][j] = _mm512_sub_ps(d[1][j], d[3][j]);
      }
      for (int i = 0; i < 4; i++) {   /* (B^T d) B: columns */
        float *o = out + (long)(4 * i) * T * C + c;
        _mm512_storeu_ps(o, _mm512_sub_ps(u[i][0], u[i][2]));
        _mm512_storeu_ps(o + T * C, _mm512_add_ps(u[i][1], u[i][2]));
        _mm512_storeu_ps(o + 2 * T * C, _mm512_sub_ps(u[i][2], u[i][1]));
        _mm512_storeu_ps(o + 3 * T * C, _mm512_sub_ps(u[i][1], u[i][3]));
      }
    }
  }
}

/* y of tiles [t0, t1) from M: A^T m A + bias (+ y) then ReLU. */
__attribute__((target("avx512f"))) static void
output_tiles(const Winograd *w, float *y, int t0, int t1) {
  int H = w->height, W = w->width, C = w->out_channels;
  int TH = tiles_across(H), TW = tiles_across(W);
  long T = w->tiles, sh = (long)W * C, sn = (long)H * W * C;
  __m512 zero = _mm512_setzero_ps();
  for (int t = t0; t < t1; t++) {
    int n = t / (TH * TW), rest = t % (TH * TW), ti = rest / TW, tj = rest % TW;
    int rows = 2 * ti + 1 < H ? 2 : 1, cols = 2 * tj + 1 < W ? 2 : 1;
    float *base = y + n * sn + (2 * ti) * sh + (long)(2 * tj) * C;
    const float *in = w->m + (long)(t - w->first_tile) * C;
    for (int c = 0; c < C; c += 16) {
      __m512 m[4][4];
      for (int k = 0; k < 16; k++) m[k / 4][k % 4] = _mm512_loadu_ps(in + (long)k * T * C + c);
      __m512 u[2][4];   /* A^T m: rows */
      for (int j = 0; j < 4; j++) {
        u[0][j] = _mm512_add_ps(_mm512_add_ps(m[0][j], m[1][j]), m[2][j]);
        u[1][j] = _mm512_sub_ps(_mm512_sub_ps(m[1][j], m[2][j]), m[3][j]);
      }
      __m512 b = _mm512_loadu_ps(w->bias + c);
      for (int i = 0; i < rows; i++) {   /* (A^T m) A: columns */
        __m512 o[2];
        o[0] = _mm512_add_ps(_mm512_add_ps(u[i][0], u[i][1]), u[i][2]);
        o[1] = _mm512_sub_ps(_mm512_sub_ps(u[i][1], u[i][2]), u[i][3]);
        for (int j = 0; j < cols; j++) {
          float *p = base + i * sh + (long)j * C + c;
          __m512 v = _mm512_add_ps(o[j], b);
          if (w->sum) v = _mm512_add_ps(v, _mm512_loadu_ps(p));
          if (w->relu) v = _mm512_max_ps(v, zero);
          _mm512_storeu_ps(p, v);
        }
      }
    }
  }
}

/* 1 where this CPU runs the kernel (AVX-512F), else 0. */
int dynvm_winograd_supported(void) { return __builtin_cpu_supports("avx512f") ? 1 : 0; }

/* The step: dnnl_primitive_execute's signature. The transforms split over the calling
   thread's OpenMP count (one: inline), the matmul on `stream`. Returns 0, -1 where an
   argument's data pointer could not be read, or the matmul's status. */
int dynvm_winograd_execute(void *self, void *stream, int nargs, const void *args) {
  const Winograd *w = (const Winograd *)self;
  const exec_arg *a = (const exec_arg *)args;
  void *src = NULL, *dst = NULL;
  for (int i = 0; i < nargs; i++) {
    if (a[i].arg == w->arg_src && w->get_handle(a[i].memory, &src) != 0) return -1;
    if (a[i].arg == w->arg_dst && w->get_handle(a[i].memory, &dst) != 0) return -1;
  }
  if (src == NULL || dst == NULL) return -1;
  int t0 = w->first_tile, T = w->tiles;
  int threads = omp_get_max_threads();
  if (threads > T) threads = T;
  if (threads <= 1) {
    input_tiles(w, (const float *)src, t0, t0 + T);
  } else {
#pragma omp parallel num_threads(threads)
    {
      int k = omp_get_thread_num(), n = omp_get_num_threads();
      input_tiles(w, (const float *)src, t0 + (int)((long)T * k / n),
                  t0 + (int)((long)T * (k + 1) / n));
    }
  }
  int status = w->execute(w->matmul, stream, w->matmul_nargs, w->matmul_args);
  if (status != 0) return status;
  if (threads <= 1) {
    output_tiles(w, (float *)dst, t0, t0 + T);
  } else {
#pragma omp parallel num_threads(threads)
    {
      int k = omp_get_thread_num(), n = omp_get_num_threads();
      output_tiles(w, (float *)dst, t0 + (int)((long)T * k / n),
                   t0 + (int)((long)T * (k + 1) / n));
    }
  }
  return 0;
}
