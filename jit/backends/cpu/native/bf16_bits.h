/* fp32 -> bf16 bits for the native kernels that write bf16 (layer_norm_bf16.c,
   attention.c): round to nearest even; NaN to 0xFFFF (ATen's vectorized conversion,
   cvtfp32_bf16, does the same). */
#ifndef DYNVM_BF16_BITS_H
#define DYNVM_BF16_BITS_H

#include <immintrin.h>

static inline __attribute__((target("avx512f"))) __m256i bf16_bits(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_srli_epi32(r, 16);
  __mmask16 ordered = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  r = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), r);
  return _mm512_cvtepi32_epi16(r);
}

#endif
