/* The small operations of a decode step, each one C call instead of several ATen calls
   (Note [A decode step's small ops in C] in jit/backends/cpu/native_decode.py says
   where the JIT uses them and what they save).

     dynvm_rms_norm:      y = x * rsqrt(mean(x^2) + eps) * w, per row of N
     dynvm_silu_mul:      y = silu(x[:, :F]) * x[:, F:], per row of 2F
     dynvm_attention_row: one row's decode step of attention: rotary embedding of its
                          query and new key, the new key and value written into the KV
                          cache at the row's slot and position, then its query heads
                          over the slot's first `length` keys (grouped heads)

   Built into the same library as small_m_linear.c (setup.py), with AVX-512F code behind
   target attributes only, so the library loads on any x86-64; the Python side calls
   these only where dynvm_small_m_supported() says AVX-512F is there, and keeps torch's
   operations elsewhere. Each function works in float32 and reads rows of the given
   strides, their elements contiguous. */

#include <immintrin.h>
#include <math.h>

#include "exp512.h"

#define AVX512 __attribute__((target("avx512f")))

static inline __mmask16 tail_mask(long left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

AVX512 void dynvm_rms_norm(const float* x, long ldx, long M, long N, const float* w,
                           float eps, float* y, long ldy) {
  for (long m = 0; m < M; m++) {
    const float* row = x + m * ldx;
    __m512 acc = _mm512_setzero_ps();
    for (long k = 0; k < N; k += 16) {
      __m512 v = _mm512_maskz_loadu_ps(tail_mask(N - k), row + k);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)N + eps);
    __m512 s = _mm512_set1_ps(scale);
    float* out = y + m * ldy;
    for (long k = 0; k < N; k += 16) {
      __mmask16 mask = tail_mask(N - k);
      __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + k), s);
      if (w) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, w + k));
      _mm512_mask_storeu_ps(out + k, mask, v);
    }
  }
}

AVX512 void dynvm_silu_mul(const float* x, long ldx, long M, long F, float* y, long ldy) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (long m = 0; m < M; m++) {
    const float* gate = x + m * ldx;
    const float* up = gate + F;
    float* out = y + m * ldy;
    for (long k = 0; k < F; k += 16) {
      __mmask16 mask = tail_mask(F - k);
      __m512 g = _mm512_maskz_loadu_ps(mask, gate + k);
      __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(
          _mm512_setzero_ps(), g))));
      _mm512_mask_storeu_ps(out + k, mask, _mm512_mul_ps(silu,
                                                         _mm512_maskz_loadu_ps(mask, up + k)));
    }
  }
}

/* rotate_half's embedding of one head (D floats): x * cos + cat(-x2, x1) * sin, each
   product rounded before the sum (no fused multiply-add), as torch's ROTARY computes it:
   given the same cos and sin, the keys written into the cache are the interpreter's, bit
   for bit. */
static __attribute__((optimize("fp-contract=off"))) void rotary(const float* x, const float* cs, const float* sn, long D,
                          float* out) {
  long half = D / 2;
  for (long i = 0; i < half; i++) out[i] = x[i] * cs[i] + (-x[i + half]) * sn[i];
  for (long i = half; i < D; i++) out[i] = x[i] * cs[i] + x[i - half] * sn[i];
}

static inline AVX512 float dot(const float* a, const float* b, long D) {
  __m512 acc = _mm512_setzero_ps();
  for (long k = 0; k < D; k += 16) {
    __mmask16 mask = tail_mask(D - k);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + k),
                          _mm512_maskz_loadu_ps(mask, b + k), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

#define MAX_HEAD_DIM 256
#define MAX_KEYS 8192

/* One row, one new token (T = 1): q [H heads of D, head stride q_hs], the new key and
   value [Hkv heads, strides kn_hs, vn_hs], cos and sin [D]; the caches contiguous
   [S, Hkv, C, D]. Writes out [H, D]. Returns 0, or 1 (nothing written) when an operand
   is out of range: the caller then runs torch's operations, which raise as they do. */
AVX512 int dynvm_attention_row(const float* q, long q_hs, const float* kn, long kn_hs,
                               const float* vn, long vn_hs, const float* cs,
                               const float* sn, float* kc, float* vc, long S, long Hkv,
                               long C, long D, long H, const long* slot_at,
                               const long* position_at, const long* length_at, float scale,
                               float* out) {
  long slot = *slot_at, position = *position_at, length = *length_at;
  if (slot < 0 || slot >= S || position < 0 || position >= C || length < 1 || length > C
      || length > MAX_KEYS || D > MAX_HEAD_DIM || D % 2 || Hkv < 1 || H % Hkv)
    return 1;
  float* keys = kc + slot * Hkv * C * D;
  float* values = vc + slot * Hkv * C * D;
  for (long j = 0; j < Hkv; j++) {
    rotary(kn + j * kn_hs, cs, sn, D, keys + (j * C + position) * D);
    const float* v = vn + j * vn_hs;
    float* to = values + (j * C + position) * D;
    for (long i = 0; i < D; i++) to[i] = v[i];
  }
  long group = H / Hkv;
  float query[MAX_HEAD_DIM], scores[MAX_KEYS];
  for (long h = 0; h < H; h++) {
    rotary(q + h * q_hs, cs, sn, D, query);
    const float* k = keys + (h / group) * C * D;
    const float* v = values + (h / group) * C * D;
    float top = -INFINITY;
    for (long t = 0; t < length; t++) {
      scores[t] = dot(query, k + t * D, D) * scale;
      top = scores[t] > top ? scores[t] : top;
    }
    __m512 total = _mm512_setzero_ps();
    for (long t = 0; t < length; t += 16) {
      __mmask16 mask = tail_mask(length - t);
      __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + t),
                                      _mm512_set1_ps(top)));
      e = _mm512_maskz_mov_ps(mask, e);
      _mm512_mask_storeu_ps(scores + t, mask, e);
      total = _mm512_add_ps(total, e);
    }
    float inverse = 1.0f / _mm512_reduce_add_ps(total);
    __m512 acc[MAX_HEAD_DIM / 16];
    long blocks = (D + 15) / 16;
    for (long b = 0; b < blocks; b++) acc[b] = _mm512_setzero_ps();
    for (long t = 0; t < length; t++) {
      __m512 p = _mm512_set1_ps(scores[t]);
      for (long b = 0; b < blocks; b++)
        acc[b] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(tail_mask(D - 16 * b),
                                                           v + t * D + 16 * b), acc[b]);
    }
    __m512 norm = _mm512_set1_ps(inverse);
    for (long b = 0; b < blocks; b++)
      _mm512_mask_storeu_ps(out + h * D + 16 * b, tail_mask(D - 16 * b),
                            _mm512_mul_ps(acc[b], norm));
  }
  return 0;
}

/* ---- a GEMM of a few rows whose input is made by a small op first --------------------
   The RMS norm, or the SiLU-gated product, of x's rows written into a scratch buffer and
   that buffer multiplied by the weight on the small-M kernel (small_m_linear.c): one
   call from Python instead of two, the rows never leaving this call. */

void dynvm_small_m_linear_nk(const float* x, long ldx, long M, long K, const float* w,
                             long ldw, long N, const float* b, const float* add, long lda,
                             float* y, long ldy);
void dynvm_small_m_linear_kn(const float* x, long ldx, long M, long K, const float* w,
                             long ldw, long N, const float* b, const float* add, long lda,
                             float* y, long ldy);

#include <stdlib.h>

/* prologue 0: rms norm of K-wide rows (nw, eps); 1: silu(x[:, :K]) * x[:, K:] */
int dynvm_prologue_linear(int prologue, const float* x, long ldx, long M, long K,
                          const float* nw, float eps, int input_major, const float* w,
                          long ldw, long N, const float* b, const float* add, long lda,
                          float* y, long ldy) {
  float* rows = (float*)aligned_alloc(64, (size_t)((M * K * sizeof(float) + 63) / 64 * 64));
  if (!rows) return 1;
  if (prologue == 0)
    dynvm_rms_norm(x, ldx, M, K, nw, eps, rows, K);
  else
    dynvm_silu_mul(x, ldx, M, K, rows, K);
  if (input_major)
    dynvm_small_m_linear_kn(rows, K, M, K, w, ldw, N, b, add, lda, y, ldy);
  else
    dynvm_small_m_linear_nk(rows, K, M, K, w, ldw, N, b, add, lda, y, ldy);
  free(rows);
  return 0;
}

/* The RMS norm of the rows `pick` selects among N (the last token of each sequence,
   picked before the LM head): y[r] = rms_norm(x[pick[r]]). Returns 1 (nothing written)
   for an index outside -N..N-1, which the caller's operations then report. */
AVX512 int dynvm_rms_norm_rows(const float* x, long N, const long* pick, long R, long K,
                               const float* w, float eps, float* y) {
  for (long r = 0; r < R; r++)
    if (pick[r] < -N || pick[r] >= N) return 1;
  for (long r = 0; r < R; r++) {
    long row = pick[r] < 0 ? pick[r] + N : pick[r];
    dynvm_rms_norm(x + row * K, K, 1, K, w, eps, y + r * K, K);
  }
  return 0;
}

/* Rotary embedding's cos and sin tables for N positions: f = float(pos[n]) * inv[i] for
   the half = D / 2 frequencies, repeated over both halves of the D dims (cat(f, f)),
   times the model's attention scaling. glibc's cosf and sinf where torch's vectorized
   ones are used: both within 1 ulp, so a value may differ in its last bit. */
void dynvm_rotary_table(const long* pos, long N, const float* inv, long half,
                        float cos_scale, float sin_scale, float* cos_out, float* sin_out) {
  for (long n = 0; n < N; n++) {
    float p = (float)pos[n];
    float* c = cos_out + n * 2 * half;
    float* s = sin_out + n * 2 * half;
    for (long i = 0; i < half; i++) {
      float f = p * inv[i];
      c[i] = c[i + half] = cosf(f) * cos_scale;
      s[i] = s[i + half] = sinf(f) * sin_scale;
    }
  }
}

/* ---- one decoder layer of a one-token row ---------------------------------------------
   What the layer's five calls above compute, in one call: h2 = h + Wo attention(norm1(h)
   Wqkv), out = h2 + Wd silu_mul(norm2(h2) Wgu), with the attention step writing the
   cache as dynvm_attention_row does. The same functions in the same order, so the
   results are those of the five calls bit for bit; what goes is four returns to Python
   between them, each of which ran cold after its GEMV had streamed its weight through
   the caches. */
int dynvm_decoder_layer_row(const float* h, long K, const float* nw1, float eps1,
                            const float* wqkv, const float* bqkv, const float* cs,
                            const float* sn, float* kc, float* vc, long S, long Hkv,
                            long C, long D, long H, const long* slot, const long* position,
                            const long* length, float scale, const float* wo,
                            const float* bo, const float* nw2, float eps2,
                            const float* wgu, long F, const float* bgu, const float* wd,
                            const float* bd, float* h2, float* out) {
  long width = (H + 2 * Hkv) * D;
  float* qkv = (float*)aligned_alloc(64, (size_t)((width + H * D + 2 * F + K + 15) / 16 * 64));
  if (!qkv) return 1;
  float* attended = qkv + width;
  float* gated = attended + H * D;
  float* normed = gated + 2 * F;
  int failed = dynvm_prologue_linear(0, h, K, 1, K, nw1, eps1, 0, wqkv, K, width, bqkv,
                                     0, 0, qkv, width);
  if (!failed)
    failed = dynvm_attention_row(qkv, D, qkv + H * D, D, qkv + (H + Hkv) * D, D, cs, sn, kc,
                                 vc, S, Hkv, C, D, H, slot, position, length, scale,
                                 attended);
  if (!failed) {
    dynvm_small_m_linear_nk(attended, H * D, 1, H * D, wo, H * D, K, bo, h, K, h2, K);
    dynvm_rms_norm(h2, K, 1, K, nw2, eps2, normed, K);
    dynvm_small_m_linear_nk(normed, K, 1, K, wgu, K, 2 * F, bgu, 0, 0, gated, 2 * F);
    failed = dynvm_prologue_linear(1, gated, 2 * F, 1, F, 0, 0.0f, 0, wd, F, K, bd, h2, K,
                                   out, K);
  }
  free(qkv);
  return failed;
}
