/* Masked attention over short sequences, one (batch, head) at a time in registers and
   L1/L2 (Note [Masked attention of our own] in jit/backends/cpu/attention_native.py says
   where the JIT uses it and what it measured).

     dynvm_attention: for each batch b, head h and query row i (S queries, L keys):
         s_j   = scale * (q_i . k_j) + mask(b, h, i, j)      (mask: none; bool, where
                                                             false is -inf; or additive)
         p_j   = exp(s_j - max s) / sum exp(s - max s)       (a row masked everywhere: 0)
         out_i = sum_j p_j v_j
     q, k, v and out of one dtype (fp32 or bf16; computed in fp32, out rounded to nearest
     even), each [B, H, rows, D] by element strides (b, h, row), D contiguous, D a
     multiple of 16; the mask by element strides (b, h, i, j), 0 where it broadcasts.

   Per (batch, head): K is packed transposed ([D][L], L rounded up to 16) once, then
   blocks of 8 query rows take their scores 32 keys at a time in 16 accumulators (a
   broadcast of q times a vector of K^T), up to the last key any of the 8 rows keeps
   (keys_kept), the row's softmax in place, and P V in blocks of 4 rows x D in
   accumulators. (batch, head) pairs are taken one at a time by
   `threads` OpenMP threads (torch's team: -fopenmp links the libgomp soname torch
   ships).

   AVX-512F code behind target attributes only, so the library loads on any x86-64; the
   Python side calls it only where dynvm_attention_supported() says AVX-512F is there. */

#include <Python.h>

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_bits.h"
#include "exp512.h"

#define AVX512 __attribute__((target("avx512f")))
#define INLINE static inline __attribute__((always_inline)) AVX512
#define ROWS 8     /* query rows of a score block */
#define PV_ROWS 4  /* rows of a P V block */

enum { MASK_NONE = 0, MASK_BOOL = 1, MASK_F32 = 2, MASK_BF16 = 3 };

/* An empty module, so that importing every module of the package imports this one. */
static struct PyModuleDef attention_module = {
    PyModuleDef_HEAD_INIT, "_attention",
    "dynvm's masked attention for short sequences; its C function is called through "
    "ctypes (attention_native.py)",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__attention(void) { return PyModule_Create(&attention_module); }

int dynvm_attention_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

static inline float scalar_at(const void* base, long at, int bf16) {
  if (!bf16) return ((const float*)base)[at];
  uint32_t bits = (uint32_t)((const uint16_t*)base)[at] << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

INLINE __m512 vector_at(const void* base, long at, int bf16) {
  if (!bf16) return _mm512_loadu_ps((const float*)base + at);
  __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + at));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* e^x for x <= 0 (a score less its row's max), by exp512.h; 0 below -87 (e^-87 ~
   1.6e-38) and at -inf. */
INLINE __m512 exp_nonpositive(__m512 x) {
  const __m512 floor = _mm512_set1_ps(-87.0f);
  __mmask16 live = _mm512_cmp_ps_mask(x, floor, _CMP_GT_OQ);
  return _mm512_maskz_mov_ps(live, exp512(_mm512_max_ps(x, floor)));
}

/* The scores of 16 keys from j0 for query row i: scaled, masked; -inf past L. */
INLINE __m512 masked(__m512 s, long j0, long L, const void* mask, int kind, long row_at,
                     long mj) {
  __mmask16 valid = j0 + 16 <= L ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - j0)) - 1);
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  if (kind == MASK_BOOL) {
    const uint8_t* m = (const uint8_t*)mask + row_at;
    __mmask16 keep = 0;
    if (mj == 1 && valid == 0xFFFF) {
      __m128i bytes = _mm_loadu_si128((const __m128i*)(m + j0));
      keep = _mm512_cmpneq_epi32_mask(_mm512_cvtepu8_epi32(bytes), _mm512_setzero_si512());
    } else {
      for (long j = j0; j < j0 + 16 && j < L; j++)
        if (m[j * mj]) keep |= (__mmask16)(1u << (j - j0));
    }
    valid &= keep;
  } else if (kind == MASK_F32 || kind == MASK_BF16) {
    int bf16 = kind == MASK_BF16;
    __m512 add;
    if (mj == 1 && valid == 0xFFFF) {
      add = vector_at(mask, row_at + j0, bf16);
    } else {
      float part[16] = {0};
      for (long j = j0; j < j0 + 16 && j < L; j++) part[j - j0] = scalar_at(mask, row_at + j * mj, bf16);
      add = _mm512_loadu_ps(part);
    }
    s = _mm512_add_ps(s, add);
  }
  return _mm512_mask_blend_ps(valid, minus_inf, s);
}

/* 1 + the last key that query row i keeps (0 where it keeps none): past it every
   score is -inf and every probability 0 (BERT's right padding), so a block of rows
   computes scores and P V only up to its rows' largest. */
static inline long keys_kept(long L, const void* mask, int kind, long row_at, long mj) {
  if (kind == MASK_NONE) return L;
  for (long j = L - 1; j >= 0; j--) {
    if (kind == MASK_BOOL) {
      if (((const uint8_t*)mask)[row_at + j * mj]) return j + 1;
    } else if (scalar_at(mask, row_at + j * mj, kind == MASK_BF16) != -INFINITY) {
      return j + 1;
    }
  }
  return 0;
}

/* P V for rows r0.. of the block (PV_ROWS of them, `live` stored), DV vectors of D from
   column c0: out rows scaled by their softmax's 1 / sum. */
INLINE void pv_block(const float* P, long Lp, long L, const void* vbase, long v_at,
                     long v_row, int v_bf16, long c0, const int DV, const float* inv,
                     void* out, long o_at, long o_row, int bf16, int live) {
  __m512 acc[PV_ROWS][8];
  for (int r = 0; r < PV_ROWS; r++)
    for (int c = 0; c < DV; c++) acc[r][c] = _mm512_setzero_ps();
  for (long j = 0; j < L; j++) {
    __m512 vv[8];
    for (int c = 0; c < DV; c++) vv[c] = vector_at(vbase, v_at + j * v_row + c0 + 16 * c, v_bf16);
    for (int r = 0; r < PV_ROWS; r++) {
      __m512 p = _mm512_set1_ps(P[r * Lp + j]);
      for (int c = 0; c < DV; c++) acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < live; r++) {
    __m512 scale = _mm512_set1_ps(inv[r]);
    for (int c = 0; c < DV; c++) {
      __m512 y = _mm512_mul_ps(acc[r][c], scale);
      long at = o_at + r * o_row + c0 + 16 * c;
      if (bf16)
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + at), bf16_bits(y));
      else
        _mm512_storeu_ps((float*)out + at, y);
    }
  }
}

static AVX512 void one_head(const void* q, long q_at, long q_row, const void* k, long k_at,
                            long k_row, const void* v, long v_at, long v_row, int bf16,
                            long S, long L, long D, const void* mask, int kind,
                            long mask_at, long mi, long mj, float scale, void* out,
                            long o_at, long o_row, float* scratch) {
  long Lp = (L + 15) & ~15L;
  float* Kt = scratch;               /* [D][Lp] */
  float* P = Kt + D * Lp;            /* [ROWS][Lp] */
  float* Q = P + ROWS * Lp;          /* [ROWS][D] */
  float* V = Q + ROWS * D;           /* [L][D], bf16 only */
  float inv[ROWS];
  for (long j = 0; j < L; j++)
    for (long d = 0; d < D; d++) Kt[d * Lp + j] = scalar_at(k, k_at + j * k_row + d, bf16);
  for (long j = L; j < Lp; j++)
    for (long d = 0; d < D; d++) Kt[d * Lp + j] = 0.0f;
  const void* vbase = v;
  long vb_at = v_at, vb_row = v_row;
  int vb_bf16 = bf16;
  if (bf16) {
    for (long j = 0; j < L; j++)
      for (long d = 0; d < D; d += 16)
        _mm512_storeu_ps(V + j * D + d, vector_at(v, v_at + j * v_row + d, 1));
    vbase = V, vb_at = 0, vb_row = D, vb_bf16 = 0;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (long i0 = 0; i0 < S; i0 += ROWS) {
    int R = S - i0 < ROWS ? (int)(S - i0) : ROWS;
    for (int r = 0; r < ROWS; r++)
      for (long d = 0; d < D; d++)
        Q[r * D + d] = r < R ? scalar_at(q, q_at + (i0 + r) * q_row + d, bf16) : 0.0f;
    long kept = 0;   /* keys any row of the block keeps; past them nothing is computed */
    for (int r = 0; r < R && kept < L; r++) {
      long mine = keys_kept(L, mask, kind, mask_at + (i0 + r) * mi, mj);
      kept = mine > kept ? mine : kept;
    }
    long Lb = (kept + 15) & ~15L;
    long j0 = 0;
    for (; j0 + 32 <= Lb; j0 += 32) {
      __m512 a[ROWS], b[ROWS];
      for (int r = 0; r < ROWS; r++) a[r] = b[r] = _mm512_setzero_ps();
      for (long d = 0; d < D; d++) {
        __m512 k0 = _mm512_loadu_ps(Kt + d * Lp + j0), k1 = _mm512_loadu_ps(Kt + d * Lp + j0 + 16);
        for (int r = 0; r < ROWS; r++) {
          __m512 qv = _mm512_set1_ps(Q[r * D + d]);
          a[r] = _mm512_fmadd_ps(qv, k0, a[r]);
          b[r] = _mm512_fmadd_ps(qv, k1, b[r]);
        }
      }
      for (int r = 0; r < R; r++) {
        long row_at = mask_at + (i0 + r) * mi;
        _mm512_storeu_ps(P + r * Lp + j0, masked(_mm512_mul_ps(a[r], vscale), j0, L, mask,
                                                 kind, row_at, mj));
        _mm512_storeu_ps(P + r * Lp + j0 + 16, masked(_mm512_mul_ps(b[r], vscale), j0 + 16,
                                                      L, mask, kind, row_at, mj));
      }
    }
    for (; j0 < Lb; j0 += 16) {
      __m512 a[ROWS];
      for (int r = 0; r < ROWS; r++) a[r] = _mm512_setzero_ps();
      for (long d = 0; d < D; d++) {
        __m512 k0 = _mm512_loadu_ps(Kt + d * Lp + j0);
        for (int r = 0; r < ROWS; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(Q[r * D + d]), k0, a[r]);
      }
      for (int r = 0; r < R; r++)
        _mm512_storeu_ps(P + r * Lp + j0, masked(_mm512_mul_ps(a[r], vscale), j0, L, mask,
                                                 kind, mask_at + (i0 + r) * mi, mj));
    }
    for (int r = 0; r < ROWS; r++) {
      float* row = P + r * Lp;
      if (r >= R) {               /* rows past S: zeros, never stored */
        memset(row, 0, sizeof(float) * Lp);
        inv[r] = 0.0f;
        continue;
      }
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (long j = 0; j < Lb; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + j));
      float most = _mm512_reduce_max_ps(top);
      if (most == -INFINITY) {    /* masked everywhere: 0, as torch's SDPA gives */
        memset(row, 0, sizeof(float) * Lp);
        inv[r] = 0.0f;
        continue;
      }
      __m512 vmost = _mm512_set1_ps(most), total = _mm512_setzero_ps();
      for (long j = 0; j < Lb; j += 16) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmost));
        _mm512_storeu_ps(row + j, e);
        total = _mm512_add_ps(total, e);
      }
      inv[r] = 1.0f / _mm512_reduce_add_ps(total);
    }
    for (int r0 = 0; r0 < R; r0 += PV_ROWS) {
      int live = R - r0 < PV_ROWS ? R - r0 : PV_ROWS;
      long at = o_at + (i0 + r0) * o_row;
      if (D == 64) {
        pv_block(P + r0 * Lp, Lp, kept, vbase, vb_at, vb_row, vb_bf16, 0, 4, inv + r0, out,
                 at, o_row, bf16, live);
      } else {
        for (long c0 = 0; c0 < D; c0 += 16)
          pv_block(P + r0 * Lp, Lp, kept, vbase, vb_at, vb_row, vb_bf16, c0, 1, inv + r0,
                   out, at, o_row, bf16, live);
      }
    }
  }
}

/* Strides are in elements: qs, ks, vs, os (batch, head, row); ms (batch, head, i, j).
   Returns 0, or -1 where scratch could not be allocated (nothing written then). The
   scratch is allocated before the parallel region and the pairs are taken one at a time
   (dynamic): the caller starts at once, and a worker woken late takes what is left. */
AVX512 int dynvm_attention(const void* q, const long* qs, const void* k, const long* ks,
                           const void* v, const long* vs, int bf16, long B, long H, long S,
                           long L, long D, const void* mask, int kind, const long* ms,
                           float scale, void* out, const long* os, int threads) {
  long Lp = (L + 15) & ~15L;
  size_t floats = (size_t)(D * Lp + ROWS * Lp + ROWS * D + (bf16 ? L * D : 0));
  size_t per_thread = ((floats * sizeof(float)) + 63) & ~(size_t)63;
  if (threads < 1) threads = 1;
  if (threads > B * H) threads = (int)(B * H);
  char* scratch = aligned_alloc(64, per_thread * (size_t)threads);
  if (scratch == NULL) return -1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
  for (long bh = 0; bh < B * H; bh++) {
    long b = bh / H, h = bh % H;
    float* mine = (float*)(scratch + per_thread * (size_t)omp_get_thread_num());
    one_head(q, b * qs[0] + h * qs[1], qs[2], k, b * ks[0] + h * ks[1], ks[2], v,
             b * vs[0] + h * vs[1], vs[2], bf16, S, L, D, mask, kind,
             kind == MASK_NONE ? 0 : b * ms[0] + h * ms[1], kind == MASK_NONE ? 0 : ms[2],
             kind == MASK_NONE ? 0 : ms[3], scale, out, b * os[0] + h * os[1], os[2], mine);
  }
  free(scratch);
  return 0;
}
