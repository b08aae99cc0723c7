#include <immintrin.h>
#include <stdint.h>

/* bench.small_m_stream's "native-fp32" path: a plain AVX-512 small-M linear, to tell
   what a kernel of dynvm's own would gain over the GEMMs torch exposes (Note [Small-M
   weight streaming] in bench/small_m_stream.py). Measurement only: nothing in dynvm
   calls it.

   y[M,N] = x[M,K] . w[N,K]^T (+ b[N]), fp32, w in torch's Linear layout. The output
   columns are split across OpenMP's threads (torch's own runtime: the library is linked
   to the libgomp already loaded), so both cores stream their half of w once; rows of x
   go in blocks of MB beside 4 rows of w, so 4 x MB accumulators stay in registers and
   the 4 w rows are read from memory once and from L1 for the other row blocks. */
#define BLOCK(NB, MB) \
static inline void block_##NB##_##MB(const float* x, long K, const float* w, const float* b, \
                              float* y, long N, long n0, long m0) { \
  __m512 acc[NB][MB]; \
  for (int i = 0; i < NB; i++) for (int j = 0; j < MB; j++) acc[i][j] = _mm512_setzero_ps(); \
  long k = 0; \
  for (; k + 16 <= K; k += 16) { \
    __m512 xv[MB]; \
    for (int j = 0; j < MB; j++) xv[j] = _mm512_loadu_ps(x + (m0 + j) * K + k); \
    for (int i = 0; i < NB; i++) { \
      __m512 wv = _mm512_loadu_ps(w + (n0 + i) * K + k); \
      for (int j = 0; j < MB; j++) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]); \
    } \
  } \
  if (k < K) { \
    __mmask16 mask = (__mmask16)((1u << (K - k)) - 1); \
    __m512 xv[MB]; \
    for (int j = 0; j < MB; j++) xv[j] = _mm512_maskz_loadu_ps(mask, x + (m0 + j) * K + k); \
    for (int i = 0; i < NB; i++) { \
      __m512 wv = _mm512_maskz_loadu_ps(mask, w + (n0 + i) * K + k); \
      for (int j = 0; j < MB; j++) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]); \
    } \
  } \
  for (int i = 0; i < NB; i++) for (int j = 0; j < MB; j++) \
    y[(m0 + j) * N + n0 + i] = _mm512_reduce_add_ps(acc[i][j]) + (b ? b[n0 + i] : 0.0f); \
}
BLOCK(4, 1) BLOCK(4, 2) BLOCK(4, 3) BLOCK(4, 4)

static void tail_row(const float* x, long M, long K, const float* w, const float* b,
                     float* y, long N, long n) {
  for (long m = 0; m < M; m++) {
    float s = b ? b[n] : 0.0f;
    for (long k = 0; k < K; k++) s += x[m * K + k] * w[n * K + k];
    y[m * N + n] = s;
  }
}

void smk_linear_f32(const float* x, long M, long K, const float* w, const float* b,
                    float* y, long N) {
  long blocks = N / 4;
  #pragma omp parallel for schedule(static)
  for (long bi = 0; bi < blocks; bi++) {
    long n0 = bi * 4, m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) block_4_4(x, K, w, b, y, N, n0, m0);
    switch (M - m0) {
      case 3: block_4_3(x, K, w, b, y, N, n0, m0); break;
      case 2: block_4_2(x, K, w, b, y, N, n0, m0); break;
      case 1: block_4_1(x, K, w, b, y, N, n0, m0); break;
    }
  }
  for (long n = blocks * 4; n < N; n++) tail_row(x, M, K, w, b, y, N, n);
}
