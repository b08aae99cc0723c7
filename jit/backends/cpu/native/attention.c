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

     dynvm_attention_amx: the same for bf16 q, k, v and out with D a multiple of 32, its
     two products on AMX tiles (the probabilities rounded to bf16 for P V; the section
     at the end of this file).

   AVX-512F and AMX code behind target attributes only, so the library loads on any
   x86-64; the Python side calls it only where dynvm_attention_supported() (AVX-512F) or
   dynvm_attention_amx_supported() (AVX-512 BF16 and AMX, which also asks the kernel for
   the tiles' state) says so. */

#include <Python.h>

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

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

/* ---- bf16 operands on AMX tiles (Note [bf16 attention on AMX tiles] in
   jit/backends/cpu/attention_native.py). tdpbf16ps: a 16 x 16 fp32 tile += a 16 x 32
   bf16 tile times a 32 x 16 one whose rows hold pairs (the k-th and k+1-th of a column
   in one 32-bit slot). Tiles 0-3 accumulate, 4 holds A (16 rows x 32 bf16), 6 and 7 B
   by turns. Per (batch, head): K packed once as [D/2][Lp] pairs (key j's d and d+1 in
   one slot, keys along the row: a 16 x 16 transpose of 32-bit pairs), V as [Lp/2][D]
   pairs (keys 2t and 2t+1 of a column in one slot), both zero past L (Lp: L rounded up
   to 32). Per block of 16 queries: the scores 64 keys at a time, Q's rows read where
   they are (a block of fewer than 16 rows copied first), up to the last key a row of
   the block keeps, stored to P in fp32; scale, mask and softmax in AVX-512 (fp32, the
   sum from the fp32 exponentials), the unnormalized probabilities rounded to bf16 (as
   torch's flash kernel rounds them for its P V GEMM); P V over 32 keys a step into 4
   tiles of 16 columns, stored in fp32, scaled by 1 / sum, rounded to bf16 once. D a
   multiple of 32. */

#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#define AMX_INLINE static inline __attribute__((always_inline)) AMX
#define TILE_ROWS 16
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int dynvm_attention_amx_supported(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16")
      || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16"))
    return 0;
  /* the kernel's permission to use the tiles' state (granted once a process) */
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

struct tile_config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static AMX void configure_tiles(void) {
  struct tile_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = TILE_ROWS;
  /* GCC 12 drops the stores above as dead without this (ldtilecfg's read is unseen) */
  __asm__ volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}


/* keys_kept16 and pack_keys16 need AVX-512BW/VL only: both the AMX version and the
   AVX512-BF16 one (end of file) inline them. */
#define PACK_INLINE static inline __attribute__((always_inline)) \
    __attribute__((target("avx512f,avx512bw,avx512vl")))

/* keys_kept, 16 keys a step where the mask's keys are contiguous. */
PACK_INLINE long keys_kept16(long L, const void* mask, int kind, long row_at, long mj) {
  if (kind == MASK_NONE) return L;
  long j = L;
  if (mj == 1) {
    for (; j >= 16; j -= 16) {
      long at = row_at + j - 16;
      __mmask16 keep;
      if (kind == MASK_BOOL)
        keep = _mm_cmpneq_epi8_mask(_mm_loadu_si128((const __m128i*)((const uint8_t*)mask + at)),
                                    _mm_setzero_si128());
      else if (kind == MASK_BF16)
        keep = _mm256_cmpneq_epi16_mask(_mm256_loadu_si256((const __m256i*)((const uint16_t*)mask + at)),
                                        _mm256_set1_epi16((short)0xFF80));
      else
        keep = _mm512_cmp_ps_mask(_mm512_loadu_ps((const float*)mask + at),
                                  _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
      if (keep) return j - 16 + (32 - __builtin_clz((unsigned)keep));
    }
  }
  return keys_kept(j, mask, kind, row_at, mj);
}

/* Rows t0.. of K packed in pairs ([D/2][Lp] 32-bit slots) for keys j0..j0+15: a 16 x 16
   transpose of 32-bit pairs; `rows` of the 16 keys are real (the rest zero). */
PACK_INLINE void pack_keys16(const uint16_t* k, long k_row, long j0, int rows, long t0,
                            uint32_t* K32, long Lp) {
  __m512i r[16], a[16];
  for (int i = 0; i < 16; i++)
    r[i] = i < rows ? _mm512_loadu_si512((const void*)(k + (j0 + i) * k_row + 2 * t0))
                    : _mm512_setzero_si512();
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  /* r[4g + m]: in each 128-bit lane l, pair 4l + m of keys 4g..4g+3 */
  for (int m = 0; m < 4; m++) {
    __m512i x0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x88);       /* lanes 0, 2 */
    __m512i x1 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xDD);       /* lanes 1, 3 */
    __m512i y0 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x88);
    __m512i y1 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xDD);
    a[m] = _mm512_shuffle_i32x4(x0, y0, 0x88);        /* lane 0: pair m */
    a[8 + m] = _mm512_shuffle_i32x4(x0, y0, 0xDD);    /* lane 2: pair 8 + m */
    a[4 + m] = _mm512_shuffle_i32x4(x1, y1, 0x88);    /* lane 1: pair 4 + m */
    a[12 + m] = _mm512_shuffle_i32x4(x1, y1, 0xDD);   /* lane 3: pair 12 + m */
  }
  for (int t = 0; t < 16; t++) _mm512_storeu_si512((void*)(K32 + (t0 + t) * Lp + j0), a[t]);
}

static AMX void release_tiles(void) { _tile_release(); }

/* Scores of `n` tiles of 16 keys from j0 (accumulators 0..n-1), A rows of Q in tile 4,
   K in tiles 6 and 7 by turns. */
#define KEY_TILES(n, j0)                                                                  \
  do {                                                                                    \
    _tile_zero(0);                                                                        \
    if (n > 1) _tile_zero(1);                                                             \
    if (n > 2) _tile_zero(2);                                                             \
    if (n > 3) _tile_zero(3);                                                             \
    for (long t0 = 0; t0 < D / 2; t0 += 16) {                                             \
      const uint16_t* kt = Kp + 2 * (t0 * Lp + (j0));                                     \
      _tile_loadd(4, qa + 2 * t0, q_bytes);                                               \
      _tile_loadd(6, kt, Lp * 4);                                                         \
      _tile_dpbf16ps(0, 4, 6);                                                            \
      if (n > 1) { _tile_loadd(7, kt + 32, Lp * 4); _tile_dpbf16ps(1, 4, 7); }            \
      if (n > 2) { _tile_loadd(6, kt + 64, Lp * 4); _tile_dpbf16ps(2, 4, 6); }            \
      if (n > 3) { _tile_loadd(7, kt + 96, Lp * 4); _tile_dpbf16ps(3, 4, 7); }            \
    }                                                                                     \
    _tile_stored(0, P + (j0), Lp * 4);                                                    \
    if (n > 1) _tile_stored(1, P + (j0) + 16, Lp * 4);                                    \
    if (n > 2) _tile_stored(2, P + (j0) + 32, Lp * 4);                                    \
    if (n > 3) _tile_stored(3, P + (j0) + 48, Lp * 4);                                    \
  } while (0)

/* P V of `n` tiles of 16 columns from c0 over `blocks` of 32 keys. */
#define COLUMN_TILES(n, c0)                                                               \
  do {                                                                                    \
    _tile_zero(0);                                                                        \
    if (n > 1) _tile_zero(1);                                                             \
    if (n > 2) _tile_zero(2);                                                             \
    if (n > 3) _tile_zero(3);                                                             \
    for (long kb = 0; kb < blocks; kb++) {                                                \
      const uint16_t* vt = Vp + 2 * (16 * kb * D + (c0));                                 \
      _tile_loadd(4, Pb + 32 * kb, Lp * 2);                                               \
      _tile_loadd(6, vt, D * 4);                                                          \
      _tile_dpbf16ps(0, 4, 6);                                                            \
      if (n > 1) { _tile_loadd(7, vt + 32, D * 4); _tile_dpbf16ps(1, 4, 7); }             \
      if (n > 2) { _tile_loadd(6, vt + 64, D * 4); _tile_dpbf16ps(2, 4, 6); }             \
      if (n > 3) { _tile_loadd(7, vt + 96, D * 4); _tile_dpbf16ps(3, 4, 7); }             \
    }                                                                                     \
    _tile_stored(0, O + (c0), D * 4);                                                     \
    if (n > 1) _tile_stored(1, O + (c0) + 16, D * 4);                                     \
    if (n > 2) _tile_stored(2, O + (c0) + 32, D * 4);                                     \
    if (n > 3) _tile_stored(3, O + (c0) + 48, D * 4);                                     \
  } while (0)

static AMX void one_head_amx(const uint16_t* q, long q_at, long q_row, const uint16_t* k,
                             long k_at, long k_row, const uint16_t* v, long v_at, long v_row,
                             long S, long L, long D, const void* mask, int kind, long mask_at,
                             long mi, long mj, float scale, uint16_t* out, long o_at,
                             long o_row, char* scratch) {
  long Lp = (L + 31) & ~31L;
  uint16_t* Kp = (uint16_t*)scratch;             /* [D/2][Lp] pairs */
  uint16_t* Vp = Kp + D * Lp;                    /* [Lp/2][D] pairs */
  float* P = (float*)(Vp + D * Lp);              /* [16][Lp] */
  uint16_t* Pb = (uint16_t*)(P + TILE_ROWS * Lp);  /* [16][Lp] */
  float* O = (float*)(Pb + TILE_ROWS * Lp);      /* [16][D] */
  uint16_t* Qb = (uint16_t*)(O + TILE_ROWS * D);   /* [16][D], a block of fewer rows */
  float inv[TILE_ROWS];
  for (long j0 = 0; j0 < Lp; j0 += 16) {
    int rows = L - j0 >= 16 ? 16 : L - j0 > 0 ? (int)(L - j0) : 0;
    for (long t0 = 0; t0 < D / 2; t0 += 16)
      pack_keys16(k + k_at, k_row, j0, rows, t0, (uint32_t*)Kp, Lp);
  }
  for (long t = 0; t < Lp / 2; t++) {
    const uint16_t* even = v + v_at + 2 * t * v_row;
    const uint16_t* odd = even + v_row;
    for (long c = 0; c < D; c += 16) {
      __m512i lo = 2 * t < L ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(even + c)))
                             : _mm512_setzero_si512();
      __m512i hi = 2 * t + 1 < L ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(odd + c)))
                                 : _mm512_setzero_si512();
      _mm512_storeu_si512((void*)(Vp + 2 * (t * D + c)),
                          _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (long i0 = 0; i0 < S; i0 += TILE_ROWS) {
    int R = S - i0 < TILE_ROWS ? (int)(S - i0) : TILE_ROWS;
    const uint16_t* qa = q + q_at + i0 * q_row;
    long q_bytes = q_row * 2;
    if (R < TILE_ROWS) {   /* tiles read 16 rows: the block's rows, then zeros */
      for (int r = 0; r < TILE_ROWS; r++)
        for (long d = 0; d < D; d += 16)
          _mm256_storeu_si256((__m256i*)(Qb + r * D + d),
                              r < R ? _mm256_loadu_si256((const __m256i*)(qa + r * q_row + d))
                                    : _mm256_setzero_si256());
      qa = Qb, q_bytes = D * 2;
    }
    long kept = 0;
    for (int r = 0; r < R && kept < L; r++) {
      long mine = keys_kept16(L, mask, kind, mask_at + (i0 + r) * mi, mj);
      kept = mine > kept ? mine : kept;
    }
    long Lb = (kept + 15) & ~15L;
    for (long j0 = 0; j0 < Lb; j0 += 64) {
      long n = (Lb - j0) / 16;
      if (n >= 4) KEY_TILES(4, j0);
      else if (n == 3) KEY_TILES(3, j0);
      else if (n == 2) KEY_TILES(2, j0);
      else KEY_TILES(1, j0);
    }
    long blocks = (kept + 31) / 32;
    for (int r = 0; r < TILE_ROWS; r++) {
      float* row = P + r * Lp;
      uint16_t* rounded = Pb + r * Lp;
      long row_at = mask_at + (i0 + r) * mi;
      __m512 top = _mm512_set1_ps(-INFINITY);
      if (r < R)
        for (long j = 0; j < Lb; j += 16) {
          __m512 s = masked(_mm512_mul_ps(_mm512_loadu_ps(row + j), vscale), j, L, mask,
                            kind, row_at, mj);
          _mm512_storeu_ps(row + j, s);
          top = _mm512_max_ps(top, s);
        }
      float most = _mm512_reduce_max_ps(top);
      if (most == -INFINITY) {    /* past S, or masked everywhere: 0, as torch's SDPA */
        memset(rounded, 0, sizeof(uint16_t) * 32 * blocks);
        inv[r] = 0.0f;
        continue;
      }
      __m512 vmost = _mm512_set1_ps(most), total = _mm512_setzero_ps();
      for (long j = 0; j < Lb; j += 16) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmost));
        _mm256_storeu_si256((__m256i*)(rounded + j), (__m256i)_mm512_cvtneps_pbh(e));
        total = _mm512_add_ps(total, e);
      }
      if (Lb < 32 * blocks) memset(rounded + Lb, 0, sizeof(uint16_t) * (32 * blocks - Lb));
      inv[r] = 1.0f / _mm512_reduce_add_ps(total);
    }
    for (long c0 = 0; c0 < D; c0 += 64) {
      long n = (D - c0) / 16;
      if (n >= 4) COLUMN_TILES(4, c0);
      else if (n == 3) COLUMN_TILES(3, c0);
      else if (n == 2) COLUMN_TILES(2, c0);
      else COLUMN_TILES(1, c0);
    }
    for (int r = 0; r < R; r++) {
      __m512 s = _mm512_set1_ps(inv[r]);
      for (long d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i*)(out + o_at + (i0 + r) * o_row + d),
                            bf16_bits(_mm512_mul_ps(_mm512_loadu_ps(O + r * D + d), s)));
    }
  }
}

/* As dynvm_attention, for bf16 q, k, v and out on AMX tiles (the caller checks
   dynvm_attention_amx_supported(), which asks for the tiles' permission). */
int dynvm_attention_amx(const void* q, const long* qs, const void* k, const long* ks,
                        const void* v, const long* vs, long B, long H, long S, long L,
                        long D, const void* mask, int kind, const long* ms, float scale,
                        void* out, const long* os, int threads) {
  long Lp = (L + 31) & ~31L;
  size_t bytes = (size_t)(2 * D * Lp * 2 + TILE_ROWS * Lp * 6 + TILE_ROWS * D * 6);
  size_t per_thread = (bytes + 63) & ~(size_t)63;
  if (threads < 1) threads = 1;
  if (threads > B * H) threads = (int)(B * H);
  char* scratch = aligned_alloc(64, per_thread * (size_t)threads);
  if (scratch == NULL) return -1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    configure_tiles();
    char* mine = scratch + per_thread * (size_t)omp_get_thread_num();
#pragma omp for schedule(dynamic, 1) nowait
    for (long bh = 0; bh < B * H; bh++) {
      long b = bh / H, h = bh % H;
      one_head_amx((const uint16_t*)q, b * qs[0] + h * qs[1], qs[2], (const uint16_t*)k,
                   b * ks[0] + h * ks[1], ks[2], (const uint16_t*)v, b * vs[0] + h * vs[1],
                   vs[2], S, L, D, mask, kind, kind == MASK_NONE ? 0 : b * ms[0] + h * ms[1],
                   kind == MASK_NONE ? 0 : ms[2], kind == MASK_NONE ? 0 : ms[3], scale,
                   (uint16_t*)out, b * os[0] + h * os[1], os[2], mine);
    }
    release_tiles();
  }
  free(scratch);
  return 0;
}


/* ---- bf16 operands with AVX512-BF16 dot products, for CPUs without AMX (Note [bf16
   attention with AVX512-BF16 dot products] in jit/backends/cpu/attention_native.py).
   vdpbf16ps: 16 fp32 lanes += the products of 16 pairs of bf16 (each 32-bit slot a pair).
   Per (batch, head) K and V packed in pairs as the AMX version packs them (K [D/2][Lp]:
   key j's d and d+1 in one slot, keys along the row; V [Lp/2][D]: keys 2t and 2t+1 of a
   column in one slot; zero past L, Lp: L rounded up to 32). Per block of DOT_ROWS
   queries: the scores 32 keys at a time in 16 accumulators (a query's pair broadcast
   from where it lies, times 16 keys' pairs), up to the last key a row of the block
   keeps; scale, mask and softmax in fp32 as above, the unnormalized probabilities
   rounded to bf16 (as torch's flash kernel and the AMX version round them); P V over
   pairs of keys in blocks of 4 rows x 64 columns; scaled by 1 / sum, rounded to bf16
   once. D a multiple of 32. */

#define BF16DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define BF16DOT_INLINE static inline __attribute__((always_inline)) BF16DOT
#define DOT_ROWS 8

int dynvm_attention_bf16dot_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
      && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

/* The two bf16 at p (one 32-bit pair) in all 16 slots. */
BF16DOT_INLINE __m512bh pair_broadcast(const uint16_t* p) {
  uint32_t bits;
  memcpy(&bits, p, sizeof bits);
  return (__m512bh)_mm512_set1_epi32((int)bits);
}

/* The raw scores (q . k) of the block's rows for `n` (1 or 2) vectors of 16 keys from
   j0, stored to P's rows below `live`. */
BF16DOT_INLINE void scores_dot(const uint16_t* const* rows, const uint32_t* Kp, long Lp,
                               long D, long j0, const int n, float* P, int live) {
  __m512 a[DOT_ROWS], b[DOT_ROWS];
  for (int r = 0; r < DOT_ROWS; r++) a[r] = b[r] = _mm512_setzero_ps();
  for (long t = 0; t < D / 2; t++) {
    const uint32_t* kt = Kp + t * Lp + j0;
    __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void*)kt);
    __m512bh k1 = n > 1 ? (__m512bh)_mm512_loadu_si512((const void*)(kt + 16)) : k0;
    for (int r = 0; r < DOT_ROWS; r++) {
      __m512bh qv = pair_broadcast(rows[r] + 2 * t);
      a[r] = _mm512_dpbf16_ps(a[r], qv, k0);
      if (n > 1) b[r] = _mm512_dpbf16_ps(b[r], qv, k1);
    }
  }
  for (int r = 0; r < live; r++) {
    _mm512_storeu_ps(P + r * Lp + j0, a[r]);
    if (n > 1) _mm512_storeu_ps(P + r * Lp + j0 + 16, b[r]);
  }
}

/* P V for `live` (<= 4) rows of Pb over `pairs` pairs of keys, DV vectors of 16 columns
   from c0; out rows scaled by their softmax's 1 / sum and rounded to bf16. */
BF16DOT_INLINE void pv_dot(const uint16_t* Pb, long Lp, long pairs, const uint32_t* Vp,
                           long D, long c0, const int DV, const float* inv, uint16_t* out,
                           long o_at, long o_row, int live) {
  __m512 acc[PV_ROWS][4];
  const uint16_t* prow[PV_ROWS];
  for (int r = 0; r < PV_ROWS; r++) {
    prow[r] = Pb + (r < live ? r : live - 1) * Lp;   /* rows past the block: a repeat */
    for (int c = 0; c < DV; c++) acc[r][c] = _mm512_setzero_ps();
  }
  for (long t = 0; t < pairs; t++) {
    __m512bh vv[4];
    for (int c = 0; c < DV; c++)
      vv[c] = (__m512bh)_mm512_loadu_si512((const void*)(Vp + t * D + c0 + 16 * c));
    for (int r = 0; r < PV_ROWS; r++) {
      __m512bh p = pair_broadcast(prow[r] + 2 * t);
      for (int c = 0; c < DV; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, vv[c]);
    }
  }
  for (int r = 0; r < live; r++) {
    __m512 s = _mm512_set1_ps(inv[r]);
    for (int c = 0; c < DV; c++)
      _mm256_storeu_si256((__m256i*)(out + o_at + r * o_row + c0 + 16 * c),
                          bf16_bits(_mm512_mul_ps(acc[r][c], s)));
  }
}

static BF16DOT void one_head_dot(const uint16_t* q, long q_at, long q_row, const uint16_t* k,
                                 long k_at, long k_row, const uint16_t* v, long v_at,
                                 long v_row, long S, long L, long D, const void* mask,
                                 int kind, long mask_at, long mi, long mj, float scale,
                                 uint16_t* out, long o_at, long o_row, char* scratch) {
  long Lp = (L + 31) & ~31L;
  uint32_t* Kp = (uint32_t*)scratch;             /* [D/2][Lp] pairs */
  uint32_t* Vp = Kp + D / 2 * Lp;                /* [Lp/2][D] pairs */
  float* P = (float*)(Vp + Lp / 2 * D);          /* [DOT_ROWS][Lp] */
  uint16_t* Pb = (uint16_t*)(P + DOT_ROWS * Lp); /* [DOT_ROWS][Lp] */
  float inv[DOT_ROWS];
  for (long j0 = 0; j0 < Lp; j0 += 16) {
    int rows = L - j0 >= 16 ? 16 : L - j0 > 0 ? (int)(L - j0) : 0;
    for (long t0 = 0; t0 < D / 2; t0 += 16) pack_keys16(k + k_at, k_row, j0, rows, t0, Kp, Lp);
  }
  for (long t = 0; t < Lp / 2; t++) {
    const uint16_t* even = v + v_at + 2 * t * v_row;
    const uint16_t* odd = even + v_row;
    for (long c = 0; c < D; c += 16) {
      __m512i lo = 2 * t < L ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(even + c)))
                             : _mm512_setzero_si512();
      __m512i hi = 2 * t + 1 < L ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(odd + c)))
                                 : _mm512_setzero_si512();
      _mm512_storeu_si512((void*)(Vp + t * D + c), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (long i0 = 0; i0 < S; i0 += DOT_ROWS) {
    int R = S - i0 < DOT_ROWS ? (int)(S - i0) : DOT_ROWS;
    const uint16_t* rows[DOT_ROWS];   /* rows past S read the last one again, unstored */
    for (int r = 0; r < DOT_ROWS; r++) rows[r] = q + q_at + (i0 + (r < R ? r : R - 1)) * q_row;
    long kept = 0;
    for (int r = 0; r < R && kept < L; r++) {
      long mine = keys_kept16(L, mask, kind, mask_at + (i0 + r) * mi, mj);
      kept = mine > kept ? mine : kept;
    }
    long Lb = (kept + 15) & ~15L;
    long j0 = 0;
    for (; j0 + 32 <= Lb; j0 += 32) scores_dot(rows, Kp, Lp, D, j0, 2, P, R);
    if (j0 < Lb) scores_dot(rows, Kp, Lp, D, j0, 1, P, R);
    for (int r = 0; r < R; r++) {
      float* row = P + r * Lp;
      uint16_t* rounded = Pb + r * Lp;
      long row_at = mask_at + (i0 + r) * mi;
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (long j = 0; j < Lb; j += 16) {
        __m512 s = masked(_mm512_mul_ps(_mm512_loadu_ps(row + j), vscale), j, L, mask, kind,
                          row_at, mj);
        _mm512_storeu_ps(row + j, s);
        top = _mm512_max_ps(top, s);
      }
      float most = _mm512_reduce_max_ps(top);
      if (most == -INFINITY) {    /* masked everywhere: 0, as torch's SDPA gives */
        memset(rounded, 0, sizeof(uint16_t) * Lb);
        inv[r] = 0.0f;
        continue;
      }
      __m512 vmost = _mm512_set1_ps(most), total = _mm512_setzero_ps();
      for (long j = 0; j < Lb; j += 16) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmost));
        _mm256_storeu_si256((__m256i*)(rounded + j), (__m256i)_mm512_cvtneps_pbh(e));
        total = _mm512_add_ps(total, e);
      }
      inv[r] = 1.0f / _mm512_reduce_add_ps(total);
    }
    /* pairs up to the block's last kept key; Pb's odd tail is a masked key (0): kept <
       Lb, or kept == L and key L is past L */
    long pairs = (kept + 1) / 2;
    for (int r0 = 0; r0 < R; r0 += PV_ROWS) {
      int live = R - r0 < PV_ROWS ? R - r0 : PV_ROWS;
      long at = o_at + (i0 + r0) * o_row;
      for (long c0 = 0; c0 < D; c0 += 64) {
        long n = (D - c0) / 16;
        if (n >= 4) pv_dot(Pb + r0 * Lp, Lp, pairs, Vp, D, c0, 4, inv + r0, out, at, o_row, live);
        else if (n == 3) pv_dot(Pb + r0 * Lp, Lp, pairs, Vp, D, c0, 3, inv + r0, out, at, o_row, live);
        else if (n == 2) pv_dot(Pb + r0 * Lp, Lp, pairs, Vp, D, c0, 2, inv + r0, out, at, o_row, live);
        else pv_dot(Pb + r0 * Lp, Lp, pairs, Vp, D, c0, 1, inv + r0, out, at, o_row, live);
      }
    }
  }
}

/* As dynvm_attention_amx, with AVX512-BF16 dot products in place of the tiles (the caller
   checks dynvm_attention_bf16dot_supported()). */
int dynvm_attention_bf16dot(const void* q, const long* qs, const void* k, const long* ks,
                            const void* v, const long* vs, long B, long H, long S, long L,
                            long D, const void* mask, int kind, const long* ms, float scale,
                            void* out, const long* os, int threads) {
  long Lp = (L + 31) & ~31L;
  size_t bytes = (size_t)(2 * D * Lp * 2 + DOT_ROWS * Lp * 6);
  size_t per_thread = (bytes + 63) & ~(size_t)63;
  if (threads < 1) threads = 1;
  if (threads > B * H) threads = (int)(B * H);
  char* scratch = aligned_alloc(64, per_thread * (size_t)threads);
  if (scratch == NULL) return -1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
  for (long bh = 0; bh < B * H; bh++) {
    long b = bh / H, h = bh % H;
    char* mine = scratch + per_thread * (size_t)omp_get_thread_num();
    one_head_dot((const uint16_t*)q, b * qs[0] + h * qs[1], qs[2], (const uint16_t*)k,
                 b * ks[0] + h * ks[1], ks[2], (const uint16_t*)v, b * vs[0] + h * vs[1],
                 vs[2], S, L, D, mask, kind, kind == MASK_NONE ? 0 : b * ms[0] + h * ms[1],
                 kind == MASK_NONE ? 0 : ms[2], kind == MASK_NONE ? 0 : ms[3], scale,
                 (uint16_t*)out, b * os[0] + h * os[1], os[2], mine);
  }
  free(scratch);
  return 0;
}
