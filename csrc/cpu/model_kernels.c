/* Elementwise CPU kernels of the model's training step, each one pass over its tensors where torch takes several
 * (module pretrain.model._kernels; pure C, no torch headers: the callers in pretrain/model check the tensors and
 * pass their addresses).
 *
 * 1. Dropout, its mask recomputed instead of stored.
 * scale_masked(src, dst, n, kind, key, first, threshold, scale, threads): dst[i] = src[i] * (kept(i) ? scale : 0)
 * for the n contiguous elements at the addresses src and dst (kind 0: float32, 1: bfloat16, rounded to nearest
 * even as torch rounds), where element i is kept iff the 16 bits
 *
 *     (int16_t)(splitmix64(key + (first + i / 4) * GAMMA) >> (16 * (i % 4)))
 *
 * are >= threshold. That is SplitMix64's output sequence (Steele, Lea & Flood 2014) read as counters: word w of
 * a mask is the hash of its index, so any word is computed without the ones before it, the forward and the
 * backward compute the same mask from (key, first), and nothing but those two numbers is kept between them. The
 * product with 0 keeps what torch's dropout gives a dropped element (x * 0: -0.0 for a negative x, NaN for a NaN
 * or an infinity), so a non-finite input is still seen downstream.
 *
 * pretrain/model/dropout.py computes exactly the same bits with torch ops where this module is not built
 * (``mask_words``) and checks the arguments: the addresses are those of contiguous CPU tensors of n elements of
 * the kind, which this module cannot check.
 *
 * 2. Rotary position embedding, forward (sign 1) and backward (sign -1, the inverse rotation of a gradient):
 * rope(src, in_kind, sizes, strides, cos, sin, table_strides, dst, out_kind, sign, threads), below.
 *
 * 3. Cross-entropy of (M, V) logits against labels, forward and backward, without the (M, V) log-softmax:
 * cross_entropy(...) and cross_entropy_grad(...), below.
 *
 * 4. GeGLU, gelu(u) g of z = [u, g] (erf's GELU), forward and backward in one pass each: geglu(...), below.
 *
 * 5. Attention probabilities: scale, key mask, softmax and dropout of the scores in one pass over each row, and
 * their backward in one: attention_probs(...) and attention_probs_grad(...), below.
 *
 * 6. A bias and erf's GELU, h = gelu(z + b), and the backward with the bias's gradient (column sums) in the same
 * pass: bias_gelu(...), below.
 *
 * 7. The attention groups' slot layout to and from head-major tensors, every group in one call: slot_heads(...),
 * below.
 *
 * The work is split over ``threads`` OpenMP threads (torch's intra-op count) and the GIL is released meanwhile.
 * Built with -fopenmp against libgomp.so.1 and imported after torch, whose CPU build loads its own libgomp.so.1:
 * the loader gives this module that same runtime, so these threads are torch's pool (a second pool would compete
 * with torch's threads, which spin a while after each of torch's ops: measured, two threads of a second pool were
 * no faster than one inside a training step).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Each row kernel is compiled for x86-64-v4 (AVX-512), v3 (AVX2) and the baseline, the loader picking the best
 * the CPU has (GCC's function multi-versioning, x86-64 only); elsewhere (aarch64, clang, or -DPRETRAIN_NO_CLONES)
 * once, for the compiler's target. The results are the same bits either way (-ffp-contract=off: no FMA is formed
 * where the source has none). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(PRETRAIN_NO_CLONES)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define GAMMA 0x9e3779b97f4a7c15ULL
#define BLOCK_WORDS 16
#define BLOCK (4 * BLOCK_WORDS)
#define MIN_PER_THREAD (1 << 16) /* elements: below this a thread's share is not worth waking it */
#define MAX_THREADS 256

static inline uint64_t splitmix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ULL;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static inline float bf16_to_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even; a NaN stays a (quiet) NaN */
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16, quiet = (u >> 16) | 0x40;
  return (uint16_t)(f != f ? quiet : rounded); /* both computed: the loop stays vectorised */
}

/* Loads and stores by kind: float32 as is, bfloat16 widened and rounded back. */
#define AS_IS(v) (v)
#define PUT(dst, v) ((dst) = (v))
#define PUT_BF16(dst, v) ((dst) = float_to_bf16(v))

/* The 4 * BLOCK_WORDS 16-bit draws of the block starting at word w, in element order. */
static inline void draws(int16_t *out, uint64_t key, uint64_t w) {
  uint64_t r[BLOCK_WORDS];
  for (int j = 0; j < BLOCK_WORDS; ++j) r[j] = splitmix64(key + (w + (uint64_t)j) * GAMMA);
  memcpy(out, r, sizeof r); /* little-endian: element 4j + l is bits 16l.. of word j */
}

static inline int16_t draw_at(uint64_t key, uint64_t word, int lane) {
  return (int16_t)(splitmix64(key + word * GAMMA) >> (16 * lane));
}

/* fn(ctx, lo, hi) over [0, n) in runs for up to ``threads`` OpenMP threads (torch's pool): as many threads as give
 * each at least MIN_PER_THREAD elements (per_item elements an item), each run a whole number of ``align`` items but
 * the last, the runs together covering [0, n). Every kernel splits its work here. */
typedef void (*RunFn)(const void *ctx, int64_t lo, int64_t hi);

static void parallel_runs(RunFn fn, const void *ctx, int64_t n, int64_t per_item, int64_t align, int threads) {
  const int64_t most = n * per_item / MIN_PER_THREAD;
  int64_t t = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
  if (t > most) t = most > 1 ? most : 1;
  if (t == 1) {
    fn(ctx, 0, n);
    return;
  }
  const int64_t per = ((n + t - 1) / t + align - 1) / align * align; /* t runs of whole aligns cover n */
#pragma omp parallel for num_threads((int)t) schedule(static, 1)
  for (int64_t k = 0; k < t; ++k) fn(ctx, per * k < n ? per * k : n, per * (k + 1) < n ? per * (k + 1) : n);
}

typedef struct {
  const void *src;
  void *dst;
  uint64_t key, first;
  int16_t threshold;
  float scale;
  int kind;
} Job;

/* Elements [lo, hi) of the mask (lo a multiple of BLOCK) from src (type T) into dst; the job's numbers in locals,
 * so that the stores (which could alias *j for the compiler) do not keep the loop from vectorising. */
#define DROP_RUN(T, LOAD, STORE)                                                                   \
  {                                                                                                \
    const T *restrict src = (const T *)j->src;                                                     \
    T *restrict dst = (T *)j->dst;                                                                 \
    const uint64_t key = j->key, first = j->first;                                                 \
    const int16_t threshold = j->threshold;                                                        \
    const float scale = j->scale;                                                                  \
    int16_t b[BLOCK];                                                                              \
    int64_t i = lo;                                                                                \
    for (; i + BLOCK <= hi; i += BLOCK) {                                                          \
      draws(b, key, first + (uint64_t)(i / 4));                                                    \
      for (int k = 0; k < BLOCK; ++k)                                                              \
        STORE(dst[i + k], LOAD(src[i + k]) * (b[k] >= threshold ? scale : 0.0f));                 \
    }                                                                                              \
    for (; i < hi; ++i) {                                                                          \
      const int16_t bits = draw_at(key, first + (uint64_t)(i / 4), (int)(i % 4));                  \
      STORE(dst[i], LOAD(src[i]) * (bits >= threshold ? scale : 0.0f));                            \
    }                                                                                              \
  }

CLONES
static void drop_run(const void *ctx, int64_t lo, int64_t hi) {
  const Job *j = (const Job *)ctx;
  if (j->kind == 0)
    DROP_RUN(float, AS_IS, PUT)
  else
    DROP_RUN(uint16_t, bf16_to_float, PUT_BF16)
}

static PyObject *scale_masked(PyObject *self, PyObject *args) {
  unsigned long long src, dst, key, first;
  long long n;
  int kind, threshold, threads;
  float scale;
  if (!PyArg_ParseTuple(args, "KKLiKKifi", &src, &dst, &n, &kind, &key, &first, &threshold, &scale, &threads))
    return NULL;
  if (n < 0 || (kind != 0 && kind != 1) || threshold < INT16_MIN || threshold > INT16_MAX || !src || !dst) {
    PyErr_SetString(PyExc_ValueError, "scale_masked: n >= 0, kind 0 (float32) or 1 (bfloat16), an int16 threshold "
                                      "and non-null addresses");
    return NULL;
  }
  const Job job = {(const void *)(uintptr_t)src, (void *)(uintptr_t)dst, key, first, (int16_t)threshold, scale, kind};
  Py_BEGIN_ALLOW_THREADS
  parallel_runs(drop_run, &job, n, 1, BLOCK, threads); /* runs of whole blocks: each starts on a word */
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

/* 2. RoPE: dst[s, a, b, t, :] = rotate(src[s, a, b, t, :]) for a (S, A, B, T, K) src of any strides but a
 * contiguous last dimension (q and k as head-major views of a fused projection: S = 2 stacks them) into a
 * contiguous dst, with tables cos/sin[s, a, b, t, :] (float32, broadcast: strides table_strides, 0 where a table
 * is shared, the last dimension contiguous; their two halves equal, as rotary.rope_tables makes them), in float32
 * arithmetic:
 *
 *     dst[k]     = fma(-sign src[k + H], sin[k], src[k] cos[k])      k < H = K / 2
 *     dst[k + H] = fma(sign src[k], sin[k], src[k + H] cos[k + H])
 *
 * (the cos product rounded, the sin product added exactly and the sum rounded: the arithmetic of rotary._rotate's
 * mul and addcmul_, whose vectorised CPU kernel fuses its multiply-add; otherwise no contraction into FMAs), then
 * rounded to dst's kind. */
typedef struct {
  const char *src;
  char *dst;
  const float *cos, *sin;
  int64_t size[5], stride[4], table_stride[4];
  int in_kind, out_kind;
  float sign;
} Rope;

/* One row: K elements from x (float32 or bfloat16) into y (float32 or bfloat16). */
#define ROPE_ROW(LOAD, STORE)                                                                      \
  for (int64_t k = 0; k < H; ++k) STORE(y[k], fmaf(-sign * LOAD(x[k + H]), sn[k], LOAD(x[k]) * c[k]));  \
  for (int64_t k = 0; k < H; ++k) STORE(y[k + H], fmaf(sign * LOAD(x[k]), sn[k], LOAD(x[k + H]) * c[k + H]));

/* Rows lo_row .. hi_row - 1 in the source's memory order: the four row dimensions taken from the largest stride to
 * the smallest (q and k as head-major views of (n, t, 3, H, K) memory: n, t, q/k, head), so each thread streams
 * through contiguous memory (head-major order would read 256 bytes and jump 3 KB, which ran at a quarter of the
 * memory's speed inside a training step); dst is written at each row's head-major place. */
CLONES
static void rope_rows(const void *ctx, int64_t lo_row, int64_t hi_row) {
  const Rope *r = (const Rope *)ctx;
  const int64_t K = r->size[4], H = K / 2;
  const float sign = r->sign;
  int order[4] = {0, 1, 2, 3};
  for (int i = 1; i < 4; ++i) /* stable insertion sort by stride, largest first */
    for (int j = i; j > 0 && r->stride[order[j]] > r->stride[order[j - 1]]; --j) {
      const int tmp = order[j];
      order[j] = order[j - 1], order[j - 1] = tmp;
    }
  int64_t idx[4], rest = lo_row;
  for (int i = 3; i >= 0; --i) idx[order[i]] = rest % r->size[order[i]], rest /= r->size[order[i]];
  for (int64_t row = lo_row; row < hi_row; ++row) {
    const int64_t at = idx[0] * r->stride[0] + idx[1] * r->stride[1] + idx[2] * r->stride[2] + idx[3] * r->stride[3];
    const int64_t at_table = idx[0] * r->table_stride[0] + idx[1] * r->table_stride[1]
                             + idx[2] * r->table_stride[2] + idx[3] * r->table_stride[3];
    const int64_t out = ((idx[0] * r->size[1] + idx[1]) * r->size[2] + idx[2]) * r->size[3] + idx[3];
    const float *restrict c = r->cos + at_table, *restrict sn = r->sin + at_table;
    if (r->in_kind == 0 && r->out_kind == 0) {
      const float *restrict x = (const float *)r->src + at;
      float *restrict y = (float *)r->dst + out * K;
      ROPE_ROW(AS_IS, PUT)
    } else if (r->in_kind == 0) {
      const float *restrict x = (const float *)r->src + at;
      uint16_t *restrict y = (uint16_t *)r->dst + out * K;
      ROPE_ROW(AS_IS, PUT_BF16)
    } else if (r->out_kind == 0) {
      const uint16_t *restrict x = (const uint16_t *)r->src + at;
      float *restrict y = (float *)r->dst + out * K;
      ROPE_ROW(bf16_to_float, PUT)
    } else {
      const uint16_t *restrict x = (const uint16_t *)r->src + at;
      uint16_t *restrict y = (uint16_t *)r->dst + out * K;
      ROPE_ROW(bf16_to_float, PUT_BF16)
    }
    for (int i = 3; i >= 0 && ++idx[order[i]] == r->size[order[i]]; --i) idx[order[i]] = 0;
  }
}

static PyObject *rope(PyObject *self, PyObject *args) {
  unsigned long long src, dst, cos, sin;
  Rope r;
  int threads;
  if (!PyArg_ParseTuple(args, "Ki(LLLLL)(LLLL)KK(LLLL)Kifi", &src, &r.in_kind, &r.size[0], &r.size[1], &r.size[2],
                        &r.size[3], &r.size[4], &r.stride[0], &r.stride[1], &r.stride[2], &r.stride[3], &cos, &sin,
                        &r.table_stride[0], &r.table_stride[1], &r.table_stride[2], &r.table_stride[3], &dst,
                        &r.out_kind, &r.sign, &threads))
    return NULL;
  int ok = src && dst && cos && sin && (r.in_kind == 0 || r.in_kind == 1) && (r.out_kind == 0 || r.out_kind == 1)
           && r.size[4] > 0 && r.size[4] % 2 == 0;
  for (int d = 0; d < 4; ++d) ok = ok && r.size[d] >= 0;
  if (!ok) {
    PyErr_SetString(PyExc_ValueError, "rope: non-null addresses, kinds 0 (float32) or 1 (bfloat16), sizes >= 0 and "
                                      "an even head size");
    return NULL;
  }
  r.src = (const char *)(uintptr_t)src, r.dst = (char *)(uintptr_t)dst;
  r.cos = (const float *)(uintptr_t)cos, r.sin = (const float *)(uintptr_t)sin;
  const int64_t rows = r.size[0] * r.size[1] * r.size[2] * r.size[3];
  if (rows == 0) Py_RETURN_NONE; /* nothing to rotate (and no size to divide by) */
  Py_BEGIN_ALLOW_THREADS
  parallel_runs(rope_rows, &r, rows, r.size[4], 1, threads);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

/* 3. Cross-entropy. e^x for x <= 0 (softmax's x - max and x - lse), Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2,
 * e^r by a degree-7 polynomial, times 2^n from the exponent bits; within 2 ulp of e^x, 0 below -87.3 (where e^x
 * is subnormal), NaN for NaN. Branch-free, so the loops that call it vectorise. */
static inline float exp_nonpositive(float x) {
  const float xc = x < -87.3f ? -87.3f : x; /* NaN compares false: stays NaN */
  const float n = rintf(xc * 1.44269504088896341f);
  float r = fmaf(n, -0.693359375f, xc);
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  const float e = fmaf(p, r * r, r) + 1.0f;
  const int32_t ni = n == n ? (int32_t)n : 0;
  const uint32_t bits = (uint32_t)(ni + 127) << 23;
  float two_n;
  memcpy(&two_n, &bits, 4);
  return x < -87.3f ? 0.0f : e * two_n;
}

#define LANES 16

typedef struct {
  const void *x;
  const int64_t *labels;
  int64_t rows, cols;
  int kind;
  float *lse, *loss;
  uint8_t *correct;
  void *grad;
  float coef;
} CrossEntropy;

/* Row i's max and sum of e^(x - max) over LANES partial lanes (the lanes vectorise; NaN-free max as maxps: a NaN
 * is not taken, but reaches the sum and so lse). */
#define ROW_LSE(LOAD)                                                                              \
  {                                                                                                \
    float m[LANES], acc[LANES];                                                                    \
    for (int j = 0; j < LANES; ++j) m[j] = -INFINITY, acc[j] = 0.0f;                               \
    int64_t v = 0;                                                                                 \
    for (; v + LANES <= V; v += LANES)                                                             \
      for (int j = 0; j < LANES; ++j) m[j] = LOAD(x[v + j]) > m[j] ? LOAD(x[v + j]) : m[j];        \
    float mx = -INFINITY;                                                                          \
    for (int j = 0; j < LANES; ++j) mx = m[j] > mx ? m[j] : mx;                                    \
    for (int64_t w = v; w < V; ++w) mx = LOAD(x[w]) > mx ? LOAD(x[w]) : mx;                        \
    const float shift = mx == -INFINITY ? 0.0f : mx;                                               \
    for (v = 0; v + LANES <= V; v += LANES)                                                        \
      for (int j = 0; j < LANES; ++j) acc[j] += exp_nonpositive(LOAD(x[v + j]) - shift);           \
    float sum = 0.0f;                                                                              \
    for (int j = 0; j < LANES; ++j) sum += acc[j];                                                 \
    for (int64_t w = v; w < V; ++w) sum += exp_nonpositive(LOAD(x[w]) - shift);                    \
    row_max = mx;                                                                                  \
    row_lse = shift + logf(sum);                                                                   \
    picked = label >= 0 && label < V ? LOAD(x[label]) : 0.0f;                                      \
  }

CLONES
static void ce_rows(const void *ctx, int64_t lo, int64_t hi) {
  const CrossEntropy *c = (const CrossEntropy *)ctx;
  const int64_t V = c->cols;
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t label = c->labels[i];
    float row_max, row_lse, picked;
    if (c->kind == 0) {
      const float *restrict x = (const float *)c->x + i * V;
      ROW_LSE(AS_IS)
    } else {
      const uint16_t *restrict x = (const uint16_t *)c->x + i * V;
      ROW_LSE(bf16_to_float)
    }
    const int valid = label >= 0 && label < V;
    c->lse[i] = row_lse;
    c->loss[i] = valid ? row_lse - picked : 0.0f;
    c->correct[i] = (uint8_t)(valid && picked >= row_max && row_lse == row_lse); /* a NaN row is never right */
  }
}

/* grad[i, v] = coef_i e^(x - lse_i), minus coef_i at the label, coef_i = coef for a labelled row, else 0. */
CLONES
static void ce_grad_rows(const void *ctx, int64_t lo, int64_t hi) {
  const CrossEntropy *c = (const CrossEntropy *)ctx;
  const int64_t V = c->cols;
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t label = c->labels[i];
    const int valid = label >= 0 && label < V;
    const float coef = valid ? c->coef : 0.0f, lse = c->lse[i];
    if (c->kind == 0) {
      const float *restrict x = (const float *)c->x + i * V;
      float *restrict g = (float *)c->grad + i * V;
      for (int64_t v = 0; v < V; ++v) g[v] = coef * exp_nonpositive(x[v] - lse);
      if (valid) g[label] = coef * exp_nonpositive(x[label] - lse) - coef;
    } else {
      const uint16_t *restrict x = (const uint16_t *)c->x + i * V;
      uint16_t *restrict g = (uint16_t *)c->grad + i * V;
      for (int64_t v = 0; v < V; ++v) g[v] = float_to_bf16(coef * exp_nonpositive(bf16_to_float(x[v]) - lse));
      if (valid) g[label] = float_to_bf16(coef * exp_nonpositive(bf16_to_float(x[label]) - lse) - coef);
    }
  }
}

static void ce_run(const CrossEntropy *c, int backward, int threads) {
  Py_BEGIN_ALLOW_THREADS
  parallel_runs(backward ? ce_grad_rows : ce_rows, c, c->rows, c->cols, 1, threads);
  Py_END_ALLOW_THREADS
}

static int ce_check(const CrossEntropy *c, unsigned long long x, unsigned long long labels) {
  if (!x || !labels || c->rows < 0 || c->cols < 1 || (c->kind != 0 && c->kind != 1)) {
    PyErr_SetString(PyExc_ValueError, "cross_entropy: non-null addresses, rows >= 0, cols >= 1 and kind 0 (float32) "
                                      "or 1 (bfloat16)");
    return 0;
  }
  return 1;
}

static PyObject *cross_entropy(PyObject *self, PyObject *args) {
  unsigned long long x, labels, lse, loss, correct;
  CrossEntropy c = {0};
  int threads;
  if (!PyArg_ParseTuple(args, "KLLiKKKKi", &x, &c.rows, &c.cols, &c.kind, &labels, &lse, &loss, &correct,
                        &threads))
    return NULL;
  if (!ce_check(&c, x, labels)) return NULL;
  if (!lse || !loss || !correct) {
    PyErr_SetString(PyExc_ValueError, "cross_entropy: non-null output addresses");
    return NULL;
  }
  c.x = (const void *)(uintptr_t)x, c.labels = (const int64_t *)(uintptr_t)labels;
  c.lse = (float *)(uintptr_t)lse, c.loss = (float *)(uintptr_t)loss, c.correct = (uint8_t *)(uintptr_t)correct;
  ce_run(&c, 0, threads);
  long long beyond = 0; /* labels past the vocabulary: the caller's error, as F.cross_entropy's */
  for (int64_t i = 0; i < c.rows; ++i) beyond += c.labels[i] >= c.cols;
  return PyLong_FromLongLong(beyond);
}

static PyObject *cross_entropy_grad(PyObject *self, PyObject *args) {
  unsigned long long x, labels, lse, grad;
  CrossEntropy c = {0};
  int threads;
  if (!PyArg_ParseTuple(args, "KLLiKKfKi", &x, &c.rows, &c.cols, &c.kind, &labels, &lse, &c.coef, &grad, &threads))
    return NULL;
  if (!ce_check(&c, x, labels)) return NULL;
  if (!lse || !grad) {
    PyErr_SetString(PyExc_ValueError, "cross_entropy_grad: non-null lse and grad addresses");
    return NULL;
  }
  c.x = (const void *)(uintptr_t)x, c.labels = (const int64_t *)(uintptr_t)labels;
  c.lse = (float *)(uintptr_t)lse, c.grad = (void *)(uintptr_t)grad;
  ce_run(&c, 1, threads);
  Py_RETURN_NONE;
}

/* 4. GeGLU: gelu(u) g, erf's GELU u Phi(u) by phi_exp (which 6. uses too). */
#define SQRT1_2 0.70710678118654752f
#define INV_SQRT_2PI 0.39894228040143268f

/* Phi(u) = erfc(-u / sqrt 2) / 2, the normal distribution, and e = e^(-u^2 / 2), its density times sqrt(2 pi):
 * one exponential serves both (a GELU's backward needs both). erfc(x) = e^(-x^2) t (c1 + t (c2 + ... c7)),
 * t = 1 / (1 + 0.449 x), for x = |u| / sqrt 2 >= 0: the form of Abramowitz & Stegun 7.1.26, the coefficients fitted
 * here (least squares on erfc's absolute error, reweighted towards the largest, over x in [0, 10]) to an absolute
 * error of 9.2e-10, far below float32's rounding, so the sum of many GELUs carries no bias of the formula's (A&S's
 * own coefficients, error 1.5e-7, moved a contrastive loss by 4e-5 relative against torch's GELU). */
static inline float phi_exp(float u, float *e) {
  const float x = fabsf(u) * SQRT1_2, t = 1.0f / fmaf(0.449f, x, 1.0f);
  float p = 0.09268330016257037f;
  p = fmaf(p, t, -0.49762345412531894f);
  p = fmaf(p, t, 0.870498385977045f);
  p = fmaf(p, t, -0.39026577069751894f);
  p = fmaf(p, t, 0.4679125191518885f);
  p = fmaf(p, t, 0.1980904087691085f);
  p = fmaf(p, t, 0.25870461168010156f);
  *e = exp_nonpositive(-0.5f * u * u);
  const float tail = 0.5f * (p * t) * *e; /* Phi(-|u|) */
  return u >= 0.0f ? 1.0f - tail : tail;
}

typedef struct {
  const void *z, *dh;
  void *out;
  int64_t rows, width; /* z: (rows, 2 width) = [u | g]; h, dh: (rows, width) */
  int kind, backward;  /* backward: dh given, out is z's gradient */
} Geglu;

#define GEGLU_FWD(LOAD, STORE)                                                                     \
  for (int64_t j = 0; j < F; ++j) {                                                                \
    const float u = LOAD(zu[j]), g = LOAD(zg[j]);                                                  \
    float e;                                                                                       \
    STORE(h[j], u * phi_exp(u, &e) * g);                                                           \
  }
#define GEGLU_BWD(LOAD, STORE)                                                                     \
  for (int64_t j = 0; j < F; ++j) {                                                                \
    const float u = LOAD(zu[j]), g = LOAD(zg[j]), d = LOAD(dh[j]);                                 \
    float e;                                                                                       \
    const float cdf = phi_exp(u, &e);                                                              \
    STORE(du[j], d * g * fmaf(u, INV_SQRT_2PI * e, cdf));                                          \
    STORE(dg[j], d * (u * cdf));                                                                   \
  }

/* Row i of z (type T) forward into h or backward into dz. */
#define GEGLU_ROW(T, LOAD, STORE)                                                                  \
  {                                                                                                \
    const T *restrict zu = (const T *)c->z + i * 2 * F, *restrict zg = zu + F;                     \
    if (!backward) {                                                                               \
      T *restrict h = (T *)c->out + i * F;                                                         \
      GEGLU_FWD(LOAD, STORE)                                                                       \
    } else {                                                                                       \
      const T *restrict dh = (const T *)c->dh + i * F;                                             \
      T *restrict du = (T *)c->out + i * 2 * F, *restrict dg = du + F;                             \
      GEGLU_BWD(LOAD, STORE)                                                                       \
    }                                                                                              \
  }

CLONES
static void geglu_rows(const void *ctx, int64_t lo, int64_t hi) {
  const Geglu *c = (const Geglu *)ctx;
  const int64_t F = c->width;
  const int backward = c->backward;
  for (int64_t i = lo; i < hi; ++i) {
    if (c->kind == 0)
      GEGLU_ROW(float, AS_IS, PUT)
    else
      GEGLU_ROW(uint16_t, bf16_to_float, PUT_BF16)
  }
}

/* geglu(z, dh, out, rows, width, kind, threads): dh 0: out = gelu(u) g, (rows, width); else out = the gradient of z
 * (rows, 2 width) for the output gradient dh. */
static PyObject *geglu(PyObject *self, PyObject *args) {
  unsigned long long z, dh, out;
  Geglu c;
  int threads;
  if (!PyArg_ParseTuple(args, "KKKLLii", &z, &dh, &out, &c.rows, &c.width, &c.kind, &threads)) return NULL;
  if (!z || !out || c.rows < 0 || c.width < 1 || (c.kind != 0 && c.kind != 1)) {
    PyErr_SetString(PyExc_ValueError, "geglu: non-null z and out, rows >= 0, width >= 1, kind 0 (float32) or 1 "
                                      "(bfloat16)");
    return NULL;
  }
  c.z = (const void *)(uintptr_t)z, c.dh = (const void *)(uintptr_t)dh, c.out = (void *)(uintptr_t)out;
  c.backward = dh != 0;
  Py_BEGIN_ALLOW_THREADS
  parallel_runs(geglu_rows, &c, c.rows, c.width, 1, threads);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

/* 5. Attention probabilities. Row r of the (rows, cols) float32 scores (rows = n * heads * t queries, cols keys):
 *
 *     x[j] = keep[j] ? scale * scores[j] : -FLT_MAX,   probs[j] = e^(x[j] - max x) / sum,
 *     dropped[j] = probs[j] * (kept(r * cols + j) ? dscale : 0)
 *
 * (keep: the row's uint8 key mask, 1 = may be attended to, or none; a row with no key gets weights over all, as
 * torch's masked_fill with the dtype's lowest value gives; kept: the dropout mask of scale_masked over the
 * contiguous probabilities). The backward, for dropped's gradient g:
 *
 *     dp[j] = g[j] * (kept ? dscale : 0),   grad[j] = keep[j] ? scale * probs[j] * (dp[j] - sum_k dp[k] probs[k]) : 0.
 *
 * The key mask is addressed per row: query row r = ((a * heads) + h) * t + i reads keep + a * keep_strides[0] +
 * h * keep_strides[1] + i * keep_strides[2] (strides in elements, 0 where the mask is broadcast), its keys
 * contiguous. Each row's dropout bits are drawn into a buffer (a row need not start on a word). */
typedef struct {
  const float *scores, *probs, *grad_in;
  float *probs_out, *dropped, *grad_out;
  const uint8_t *keep;
  int64_t rows, cols, heads, t, keep_strides[3];
  float scale, dscale;
  uint64_t key, first;
  int16_t threshold;
} Probs;

/* x[j] = e^(x[j] - max x) over a row of V, returning their sum (max and sum in LANES partial lanes, which
 * vectorise; a NaN is not taken by the max, but reaches the sum). */
static inline float exp_row(float *restrict x, int64_t V) {
  float m[LANES], acc[LANES];
  for (int j = 0; j < LANES; ++j) m[j] = -INFINITY, acc[j] = 0.0f;
  int64_t v = 0;
  for (; v + LANES <= V; v += LANES)
    for (int j = 0; j < LANES; ++j) m[j] = x[v + j] > m[j] ? x[v + j] : m[j];
  float mx = -INFINITY;
  for (int j = 0; j < LANES; ++j) mx = m[j] > mx ? m[j] : mx;
  for (int64_t w = v; w < V; ++w) mx = x[w] > mx ? x[w] : mx;
  for (v = 0; v + LANES <= V; v += LANES)
    for (int j = 0; j < LANES; ++j) acc[j] += (x[v + j] = exp_nonpositive(x[v + j] - mx));
  float sum = 0.0f;
  for (int j = 0; j < LANES; ++j) sum += acc[j];
  for (int64_t w = v; w < V; ++w) sum += (x[w] = exp_nonpositive(x[w] - mx));
  return sum;
}

/* Row r's dropout bits into b[0 .. cols). */
static inline void row_draws(int16_t *b, uint64_t *words, const Probs *c, int64_t r) {
  const int64_t start = r * c->cols, w0 = start / 4, lane = start % 4, nw = (lane + c->cols + 3) / 4;
  for (int64_t w = 0; w < nw; ++w) words[w] = splitmix64(c->key + (c->first + (uint64_t)(w0 + w)) * GAMMA);
  memcpy(b, (const int16_t *)words + lane, (size_t)c->cols * sizeof(int16_t));
}

/* A thread's buffers for rows of V: the dropout bits, the words they come from, and a float row. */
typedef struct {
  int16_t *bits;
  uint64_t *words;
  float *row;
} RowScratch;

static RowScratch row_scratch(int64_t V) {
  RowScratch sc = {malloc((size_t)V * sizeof(int16_t)), malloc((size_t)(V / 4 + 2) * sizeof(uint64_t)),
                   malloc((size_t)V * sizeof(float))};
  if (!sc.bits || !sc.words || !sc.row) abort(); /* a few KB: out of memory already */
  return sc;
}

static void free_scratch(RowScratch *sc) { free(sc->row), free(sc->words), free(sc->bits); }

static inline const uint8_t *row_keep(const Probs *c, int64_t r) {
  if (!c->keep) return NULL;
  const int64_t i = r % c->t, h = r / c->t % c->heads, a = r / (c->t * c->heads);
  return c->keep + a * c->keep_strides[0] + h * c->keep_strides[1] + i * c->keep_strides[2];
}

/* Rows [lo, hi): forward (grad_in null) the probabilities and the dropped ones, else the scores' gradient. */
CLONES
static void probs_rows(const void *ctx, int64_t lo, int64_t hi) {
  const Probs *c = (const Probs *)ctx;
  const int64_t V = c->cols;
  const float scale = c->scale, dscale = c->dscale;
  const int16_t threshold = c->threshold;
  RowScratch sc = row_scratch(V);
  int16_t *b = sc.bits;
  float *x = sc.row; /* forward: the row's exponentials; backward: the dropped probabilities' gradient */
  for (int64_t r = lo; r < hi; ++r) {
    const uint8_t *restrict keep = row_keep(c, r);
    row_draws(b, sc.words, c, r);
    if (!c->grad_in) {
      const float *restrict s = c->scores + r * V;
      float *restrict p = c->probs_out + r * V, *restrict d = c->dropped + r * V;
      if (keep)
        for (int64_t j = 0; j < V; ++j) x[j] = keep[j] ? scale * s[j] : -FLT_MAX;
      else
        for (int64_t j = 0; j < V; ++j) x[j] = scale * s[j];
      const float inv = 1.0f / exp_row(x, V);
      for (int64_t j = 0; j < V; ++j) {
        const float pj = x[j] * inv;
        p[j] = pj;
        d[j] = pj * (b[j] >= threshold ? dscale : 0.0f);
      }
      continue;
    }
    const float *restrict g = c->grad_in + r * V, *restrict p = c->probs + r * V;
    float *restrict out = c->grad_out + r * V;
    float lanes[LANES] = {0};
    int64_t v = 0;
    for (; v + LANES <= V; v += LANES)
      for (int j = 0; j < LANES; ++j) {
        x[v + j] = g[v + j] * (b[v + j] >= threshold ? dscale : 0.0f);
        lanes[j] += x[v + j] * p[v + j];
      }
    float dot = 0.0f;
    for (int j = 0; j < LANES; ++j) dot += lanes[j];
    for (; v < V; ++v) {
      x[v] = g[v] * (b[v] >= threshold ? dscale : 0.0f);
      dot += x[v] * p[v];
    }
    if (keep)
      for (int64_t j = 0; j < V; ++j) out[j] = keep[j] ? scale * (p[j] * (x[j] - dot)) : 0.0f;
    else
      for (int64_t j = 0; j < V; ++j) out[j] = scale * (p[j] * (x[j] - dot));
  }
  free_scratch(&sc);
}

/* Arguments shared by both directions: rows, cols, heads, t, keep, (keep strides), scale, key, first, threshold,
 * dscale; then the direction's addresses. */
static int probs_args(Probs *c, unsigned long long keep, int threshold) {
  if (c->rows < 0 || c->cols < 1 || c->heads < 1 || c->t < 1 || c->rows % (c->heads * c->t) != 0 ||
      threshold < INT16_MIN || threshold > INT16_MAX) {
    PyErr_SetString(PyExc_ValueError, "attention_probs: rows >= 0 a multiple of heads * t, cols, heads, t >= 1 and "
                                      "an int16 threshold");
    return 0;
  }
  c->keep = (const uint8_t *)(uintptr_t)keep, c->threshold = (int16_t)threshold;
  return 1;
}

/* attention_probs(scores, probs, dropped, rows, cols, heads, t, keep, (s0, s1, s2), scale, key, first, threshold,
 * dscale, threads) */
static PyObject *attention_probs(PyObject *self, PyObject *args) {
  unsigned long long scores, probs, dropped, keep;
  Probs c = {0};
  int threshold, threads;
  if (!PyArg_ParseTuple(args, "KKKLLLLK(LLL)fKKifi", &scores, &probs, &dropped, &c.rows, &c.cols, &c.heads, &c.t,
                        &keep, &c.keep_strides[0], &c.keep_strides[1], &c.keep_strides[2], &c.scale, &c.key,
                        &c.first, &threshold, &c.dscale, &threads))
    return NULL;
  if (!probs_args(&c, keep, threshold)) return NULL;
  if (!scores || !probs || !dropped) {
    PyErr_SetString(PyExc_ValueError, "attention_probs: non-null scores, probs and dropped addresses");
    return NULL;
  }
  c.scores = (const float *)(uintptr_t)scores, c.probs_out = (float *)(uintptr_t)probs;
  c.dropped = (float *)(uintptr_t)dropped;
  Py_BEGIN_ALLOW_THREADS
  parallel_runs(probs_rows, &c, c.rows, c.cols, 1, threads);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

/* attention_probs_grad(grad, probs, out, rows, cols, heads, t, keep, (s0, s1, s2), scale, key, first, threshold,
 * dscale, threads); out a separate tensor. */
static PyObject *attention_probs_grad(PyObject *self, PyObject *args) {
  unsigned long long grad, probs, out, keep;
  Probs c = {0};
  int threshold, threads;
  if (!PyArg_ParseTuple(args, "KKKLLLLK(LLL)fKKifi", &grad, &probs, &out, &c.rows, &c.cols, &c.heads, &c.t, &keep,
                        &c.keep_strides[0], &c.keep_strides[1], &c.keep_strides[2], &c.scale, &c.key, &c.first,
                        &threshold, &c.dscale, &threads))
    return NULL;
  if (!probs_args(&c, keep, threshold)) return NULL;
  if (!grad || !probs || !out) {
    PyErr_SetString(PyExc_ValueError, "attention_probs_grad: non-null grad, probs and out addresses");
    return NULL;
  }
  c.grad_in = (const float *)(uintptr_t)grad, c.probs = (const float *)(uintptr_t)probs;
  c.grad_out = (float *)(uintptr_t)out;
  Py_BEGIN_ALLOW_THREADS
  parallel_runs(probs_rows, &c, c.rows, c.cols, 1, threads);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

/* 6. bias_gelu(z, b, b_kind, dh, out, db, rows, width, kind, threads). Forward (dh 0): out = gelu(z + b) for the
 * (rows, width) z (kind 0 float32, 1 bfloat16) and the (width,) bias b (b_kind), the sum in float32. Backward:
 * out = dh * gelu'(z + b), z's gradient, and db[j] (float32) = the sum over rows of out[:, j] as stored: the bias's
 * gradient in the same pass, where autograd reads the gradient once more to sum it. The sums are taken over blocks
 * of BIAS_ROWS rows, each block's partial kept apart and the blocks added in order afterwards, so db does not
 * depend on the thread count. */
#define BIAS_ROWS 64

typedef struct {
  const void *z, *b, *dh;
  void *out;
  float *partials; /* (blocks, width) */
  int64_t rows, width;
  int kind, b_kind;
} BiasGelu;

#define BIAS_GELU_ROWS(T, LOAD, STORE)                                                             \
  {                                                                                                \
    const T *restrict z = (const T *)c->z;                                                         \
    T *restrict out = (T *)c->out;                                                                 \
    if (!c->dh) {                                                                                  \
      for (int64_t i = lo; i < hi; ++i)                                                            \
        for (int64_t j = 0; j < F; ++j) {                                                          \
          const float u = LOAD(z[i * F + j]) + bias[j];                                            \
          float e;                                                                                 \
          STORE(out[i * F + j], u * phi_exp(u, &e));                                               \
        }                                                                                          \
    } else {                                                                                       \
      const T *restrict dh = (const T *)c->dh;                                                     \
      for (int64_t blk = lo; blk < hi; blk += BIAS_ROWS) {                                         \
        float *restrict acc = c->partials + blk / BIAS_ROWS * F;                                   \
        for (int64_t j = 0; j < F; ++j) acc[j] = 0.0f;                                             \
        const int64_t end = blk + BIAS_ROWS < hi ? blk + BIAS_ROWS : hi;                           \
        for (int64_t i = blk; i < end; ++i)                                                        \
          for (int64_t j = 0; j < F; ++j) {                                                        \
            const float u = LOAD(z[i * F + j]) + bias[j];                                          \
            float e;                                                                               \
            const float cdf = phi_exp(u, &e);                                                      \
            STORE(out[i * F + j], LOAD(dh[i * F + j]) * fmaf(u, INV_SQRT_2PI * e, cdf));           \
            acc[j] += LOAD(out[i * F + j]);                                                        \
          }                                                                                        \
      }                                                                                            \
    }                                                                                              \
  }

CLONES
static void bias_gelu_rows(const void *ctx, int64_t lo, int64_t hi) {
  const BiasGelu *c = (const BiasGelu *)ctx;
  const int64_t F = c->width;
  float *bias = malloc((size_t)F * sizeof(float));
  if (!bias) abort();
  for (int64_t j = 0; j < F; ++j) /* the bias widened to float32 once a run */
    bias[j] = c->b_kind == 0 ? ((const float *)c->b)[j] : bf16_to_float(((const uint16_t *)c->b)[j]);
  if (c->kind == 0)
    BIAS_GELU_ROWS(float, AS_IS, PUT)
  else
    BIAS_GELU_ROWS(uint16_t, bf16_to_float, PUT_BF16)
  free(bias);
}

static PyObject *bias_gelu(PyObject *self, PyObject *args) {
  unsigned long long z, b, dh, out, db;
  BiasGelu c = {0};
  int threads;
  if (!PyArg_ParseTuple(args, "KKiKKKLLii", &z, &b, &c.b_kind, &dh, &out, &db, &c.rows, &c.width, &c.kind,
                        &threads))
    return NULL;
  if (!z || !b || !out || (dh && !db) || c.rows < 0 || c.width < 1 || (c.kind != 0 && c.kind != 1) ||
      (c.b_kind != 0 && c.b_kind != 1)) {
    PyErr_SetString(PyExc_ValueError, "bias_gelu: non-null z, b and out (and db with dh), rows >= 0, width >= 1, "
                                      "kinds 0 (float32) or 1 (bfloat16)");
    return NULL;
  }
  c.z = (const void *)(uintptr_t)z, c.b = (const void *)(uintptr_t)b, c.dh = (const void *)(uintptr_t)dh;
  c.out = (void *)(uintptr_t)out;
  const int64_t blocks = (c.rows + BIAS_ROWS - 1) / BIAS_ROWS;
  if (dh && !(c.partials = malloc((size_t)(blocks ? blocks : 1) * (size_t)c.width * sizeof(float))))
    return PyErr_NoMemory();
  Py_BEGIN_ALLOW_THREADS
  parallel_runs(bias_gelu_rows, &c, c.rows, c.width, BIAS_ROWS, threads); /* runs of whole blocks */
  if (dh) {
    float *restrict sum = (float *)(uintptr_t)db;
    for (int64_t j = 0; j < c.width; ++j) sum[j] = 0.0f;
    for (int64_t k = 0; k < blocks; ++k)
      for (int64_t j = 0; j < c.width; ++j) sum[j] += c.partials[k * c.width + j];
  }
  Py_END_ALLOW_THREADS
  free(c.partials);
  Py_RETURN_NONE;
}

/* 7. slot_heads(slots, row_stride, elem_bytes, shapes, parts, heads, size, ptrs, to_slots, threads). The attention
 * groups' slots: rows of ``row_stride`` elements (of elem_bytes each), group g's n_g * t_g rows end to end, the
 * first parts * heads * size columns of a row laid out (part, head, size). Group g's part c is the contiguous
 * head-major (n_g, heads, t_g, size) tensor at ptrs[g * parts + c]. to_slots 0 copies slots -> heads (the fused
 * q/k/v projection into q, k and v; the output's gradient), 1 heads -> slots (their gradients; the output). One
 * pass over the slots in their order, size elements a copy, where torch copies each group's each part apart
 * (strided views: 256-byte runs). shapes: ((n_0, t_0), ...). */
typedef struct {
  char *slots;
  char **ptrs;
  const int64_t *first, *t; /* per group: its first slot row, its length */
  int64_t groups, row_stride, elem, parts, heads, size;
  int to_slots;
} SlotHeads;

static void slot_heads_rows(const void *ctx, int64_t lo, int64_t hi) {
  const SlotHeads *c = (const SlotHeads *)ctx;
  const int64_t run = c->size * c->elem, H = c->heads;
  int64_t g = 0;
  while (g + 1 < c->groups && c->first[g + 1] <= lo) ++g;
  for (int64_t r = lo; r < hi; ++r) {
    while (g + 1 < c->groups && c->first[g + 1] <= r) ++g;
    const int64_t local = r - c->first[g], t = c->t[g], i = local / t, j = local % t;
    char *row = c->slots + r * c->row_stride * c->elem;
    for (int64_t part = 0; part < c->parts; ++part)
      for (int64_t h = 0; h < H; ++h) {
        char *slot = row + (part * H + h) * run;
        char *head = c->ptrs[g * c->parts + part] + ((i * H + h) * t + j) * run;
        if (c->to_slots)
          memcpy(slot, head, (size_t)run);
        else
          memcpy(head, slot, (size_t)run);
      }
  }
}

static PyObject *slot_heads(PyObject *self, PyObject *args) {
  unsigned long long slots;
  PyObject *shapes, *ptrs;
  SlotHeads c = {0};
  int threads;
  if (!PyArg_ParseTuple(args, "KLLO!LLLO!ii", &slots, &c.row_stride, &c.elem, &PyTuple_Type, &shapes, &c.parts,
                        &c.heads, &c.size, &PyTuple_Type, &ptrs, &c.to_slots, &threads))
    return NULL;
  c.groups = PyTuple_GET_SIZE(shapes);
  if (!slots || c.groups < 1 || c.parts < 1 || c.heads < 1 || c.size < 1 || (c.elem != 2 && c.elem != 4) ||
      c.row_stride < c.parts * c.heads * c.size || PyTuple_GET_SIZE(ptrs) != c.groups * c.parts) {
    PyErr_SetString(PyExc_ValueError, "slot_heads: a non-null slots address, groups, parts, heads, size >= 1, "
                                      "2- or 4-byte elements, rows holding parts * heads * size, an address per "
                                      "group and part");
    return NULL;
  }
  int64_t *sizes = malloc((size_t)(2 * c.groups) * sizeof(int64_t));
  char **addresses = malloc((size_t)(c.groups * c.parts) * sizeof(char *));
  if (!sizes || !addresses) {
    free(sizes), free(addresses);
    return PyErr_NoMemory();
  }
  int64_t rows = 0, ok = 1;
  for (int64_t g = 0; g < c.groups && ok; ++g) {
    long long n = 0, t = 0;
    PyObject *shape = PyTuple_GET_ITEM(shapes, g);
    ok = PyTuple_Check(shape) && PyArg_ParseTuple(shape, "LL", &n, &t) && n >= 0 && t >= 1;
    sizes[g] = rows, sizes[c.groups + g] = t;
    rows += n * t;
  }
  for (int64_t k = 0; k < c.groups * c.parts && ok; ++k) {
    addresses[k] = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ptrs, k));
    ok = !PyErr_Occurred() && addresses[k];
  }
  if (!ok) {
    free(sizes), free(addresses);
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_ValueError, "slot_heads: shapes of (n >= 0, t >= 1), non-null addresses");
    return NULL;
  }
  c.slots = (char *)(uintptr_t)slots, c.ptrs = addresses;
  c.first = sizes, c.t = sizes + c.groups;
  Py_BEGIN_ALLOW_THREADS
  parallel_runs(slot_heads_rows, &c, rows, c.parts * c.heads * c.size, 1, threads);
  Py_END_ALLOW_THREADS
  free(sizes), free(addresses);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scale_masked", scale_masked, METH_VARARGS,
     "scale_masked(src, dst, n, kind, key, first, threshold, scale, threads): dst = src * (kept ? scale : 0), the "
     "mask from SplitMix64 of (key, first + i // 4) (kind 0 float32, 1 bfloat16; addresses of contiguous tensors)"},
    {"rope", rope, METH_VARARGS,
     "rope(src, in_kind, (S, A, B, T, K), strides, cos, sin, table_strides, dst, out_kind, sign, threads): the "
     "rotary rotation of src's rows into the contiguous dst (float32 arithmetic)"},
    {"cross_entropy", cross_entropy, METH_VARARGS,
     "cross_entropy(x, rows, cols, kind, labels, lse, loss, correct, threads) -> the number of labels >= cols: per "
     "row of the (rows, cols) logits (kind 0 float32, 1 bfloat16) and int64 labels (outside [0, cols): ignored) "
     "its log-sum-exp, its loss lse - x[label] (0 if ignored) and whether x[label] is the row's max (float32, "
     "float32, uint8 outputs)"},
    {"cross_entropy_grad", cross_entropy_grad, METH_VARARGS,
     "cross_entropy_grad(x, rows, cols, kind, labels, lse, coef, grad, threads): grad = coef softmax(x) - coef at "
     "each label, 0 on ignored rows, in x's kind"},
    {"geglu", geglu, METH_VARARGS,
     "geglu(z, dh, out, rows, width, kind, threads): z = [u | g] (rows, 2 width); dh 0: out = gelu(u) g (erf's "
     "GELU); else out = d/dz of <dh, gelu(u) g>, (rows, 2 width); kind 0 float32, 1 bfloat16, all contiguous"},
    {"attention_probs", attention_probs, METH_VARARGS,
     "attention_probs(scores, probs, dropped, rows, cols, heads, t, keep, keep_strides, scale, key, first, "
     "threshold, dscale, threads): probs = softmax of the scaled, key-masked float32 scores per row, dropped = "
     "probs under scale_masked's mask"},
    {"attention_probs_grad", attention_probs_grad, METH_VARARGS,
     "attention_probs_grad(grad, probs, out, rows, cols, heads, t, keep, keep_strides, scale, key, first, "
     "threshold, dscale, threads): the scores' gradient for dropped's gradient grad, into out"},
    {"bias_gelu", bias_gelu, METH_VARARGS,
     "bias_gelu(z, b, b_kind, dh, out, db, rows, width, kind, threads): dh 0: out = gelu(z + b) (erf's GELU); else "
     "out = dh gelu'(z + b) and db (float32) its column sums, the same for any thread count"},
    {"slot_heads", slot_heads, METH_VARARGS,
     "slot_heads(slots, row_stride, elem_bytes, shapes, parts, heads, size, ptrs, to_slots, threads): the attention "
     "groups' (part, head, size) slot columns to (to_slots 0) or from (1) each group's head-major tensors"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "One-pass CPU kernels of the model (C).", -1,
                                     methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
