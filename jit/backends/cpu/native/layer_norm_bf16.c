/* Layer norm over the last dim of fp32 rows, writing its fp32 result, that result
   rounded to bf16, or both, in the same pass (Note [Layer norm writing bf16 too] in
   jit/backends/cpu/norm_bf16.py says where the JIT uses it and what it saves).

     dynvm_layer_norm_bf16: per row of N, a multiple of 16 (rows `ldx` apart, elements
                            contiguous; results dense):
         mean, var = the row's mean and (biased) variance, rstd = 1 / sqrt(var + eps)
         y   = (x * rstd - mean * rstd) * w + b      (w, b: N floats each, or NULL)
         y16 = y rounded to bf16, nearest even, as torch's conversion rounds it
         (y or y16 NULL: that result is not written)

   The mean's and the variance's sums run in four independent accumulators: with one,
   each add waits on the last (a 48-add chain a pass at N = 768), and the kernel ran 32
   us over 128 x 768 warm on one thread against 22 with four (torch's 31).

   AVX-512F code behind target attributes only, so the library loads on any x86-64; the
   Python side calls it only where dynvm_layer_norm_bf16_supported() says AVX-512F is
   there. Rows are split over `threads` OpenMP threads (torch's team: -fopenmp links
   the libgomp soname torch ships), one thread where `threads` is 1. */

#include <Python.h>

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16_bits.h"

#define AVX512 __attribute__((target("avx512f")))

/* An empty module, so that importing every module of the package imports this one. */
static struct PyModuleDef layer_norm_module = {
    PyModuleDef_HEAD_INIT, "_layer_norm_bf16",
    "dynvm's layer norm writing bf16 too; its C function is called through ctypes "
    "(norm_bf16.py)",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__layer_norm_bf16(void) { return PyModule_Create(&layer_norm_module); }

int dynvm_layer_norm_bf16_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

/* The sum of a row's N floats (a multiple of 16), four accumulators apart. */
static inline AVX512 float row_sum(const float* x, long N) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  long k = 0;
  for (; k + 64 <= N; k += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(x + k));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(x + k + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(x + k + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(x + k + 48));
  }
  for (; k < N; k += 16) a0 = _mm512_add_ps(a0, _mm512_loadu_ps(x + k));
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* The sum of (x - mean)^2 over a row, four accumulators apart. */
static inline AVX512 float row_squares(const float* x, long N, __m512 mean) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  long k = 0;
  for (; k + 64 <= N; k += 64) {
    __m512 d0 = _mm512_sub_ps(_mm512_loadu_ps(x + k), mean);
    __m512 d1 = _mm512_sub_ps(_mm512_loadu_ps(x + k + 16), mean);
    __m512 d2 = _mm512_sub_ps(_mm512_loadu_ps(x + k + 32), mean);
    __m512 d3 = _mm512_sub_ps(_mm512_loadu_ps(x + k + 48), mean);
    a0 = _mm512_fmadd_ps(d0, d0, a0);
    a1 = _mm512_fmadd_ps(d1, d1, a1);
    a2 = _mm512_fmadd_ps(d2, d2, a2);
    a3 = _mm512_fmadd_ps(d3, d3, a3);
  }
  for (; k < N; k += 16) {
    __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + k), mean);
    a0 = _mm512_fmadd_ps(d, d, a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

static AVX512 void one_row(const float* x, long N, const float* w, const float* b,
                           float eps, float* y, uint16_t* y16) {
  float mean = row_sum(x, N) / (float)N;
  __m512 vmean = _mm512_set1_ps(mean);
  float var = row_squares(x, N, vmean) / (float)N;
  float rstd = 1.0f / sqrtf(var + eps);
  __m512 scale = _mm512_set1_ps(rstd), shift = _mm512_set1_ps(-mean * rstd);
  for (long k = 0; k < N; k += 16) {
    __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), scale, shift);
    if (w) v = _mm512_mul_ps(v, _mm512_loadu_ps(w + k));
    if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + k));
    if (y) _mm512_storeu_ps(y + k, v);
    if (y16) _mm256_storeu_si256((__m256i*)(y16 + k), bf16_bits(v));
  }
}

AVX512 void dynvm_layer_norm_bf16(const float* x, long ldx, long M, long N,
                                  const float* w, const float* b, float eps,
                                  float* y, uint16_t* y16, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (long m = 0; m < M; m++)
    one_row(x + m * ldx, N, w, b, eps, y ? y + m * N : NULL, y16 ? y16 + m * N : NULL);
}
