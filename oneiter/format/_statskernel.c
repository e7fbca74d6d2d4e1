/* The statistics level's CPU kernel: every statistic and the rowcol32 checksum of a tensor in one pass; and, for
 * judging a replay's reruns, the sums of a pair of tensors in one pass (`pair`, at the end of this file).
 *
 * Where this sits: `format/stats.py` `tensor_stats` calls `reduce` for contiguous CPU float32, float64 and
 * bfloat16 tensors when this extension was built (it is optional: without a C compiler, torch's chunked
 * reductions do the same work, ~2x slower). Each 4 KB row of the tensor's bytes is read once, while it is in
 * cache: its int32 words go into the checksum's column and row sums, its numbers into min, max, sum, sum of
 * squares and sum of |x|, accumulated in float64 in independent lanes (vectorized without reassociating any
 * lane's additions). The GIL is released while it runs.
 *
 * rowcol32 (docs/format.md): the bytes, zero-padded to whole rows of ROW int32 little-endian words; column sums
 * c_j and row sums r_i wrap in int32; the checksum is (sum c_j*(2j+1), sum r_i*(2i+1)), wrapping in int64.
 * Non-finite values: the first pass sees them through a non-finite total; a second pass then counts NaN and Inf
 * and reduces the finite values only, as the other paths do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ROW 1024 /* int32 words per checksum row (stats.ROW) */
#define ROW_BYTES (4 * ROW)
#define LANES 4 /* float64 accumulators: one AVX2 vector; the scalar loops use lane 0 */

enum { F32 = 0, F64 = 1, BF16 = 2 };

typedef struct {
    double sum[LANES], sumsq[LANES], abs_sum[LANES], low[LANES], high[LANES];
} Acc;

typedef struct {
    uint32_t cols[ROW];
    uint64_t rows;
    uint64_t index;
} Check;

static inline float bf16_value(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline double value_at(const unsigned char *p, size_t i, int kind) {
    if (kind == F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    if (kind == F64) {
        double d;
        memcpy(&d, p + 8 * i, 8);
        return d;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return bf16_value(h);
}

static void check_row(Check *restrict c, const uint32_t *restrict w) {
    uint32_t r = 0;
    uint32_t *restrict cols = c->cols;
    for (int j = 0; j < ROW; j++) {
        cols[j] += w[j];
        r += w[j];
    }
    c->rows += (uint64_t)(int64_t)(int32_t)r * (2 * c->index + 1);
    c->index++;
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_SIMD 1

/* AVX2: 8 floats at a time; min/max in the data's precision (minps keeps the running value when the new one is
   NaN), sums in float64 (two vectors of 4 per 8 floats), sum of squares by FMA. */
typedef struct {
    __m256d sum, sumsq, abs_sum;
} Sums;

__attribute__((target("avx2,fma"))) static inline void add_pd(Sums *s, __m256d d, __m256d sign) {
    s->sum = _mm256_add_pd(s->sum, d);
    s->sumsq = _mm256_fmadd_pd(d, d, s->sumsq);
    s->abs_sum = _mm256_add_pd(s->abs_sum, _mm256_andnot_pd(sign, d));
}

__attribute__((target("avx2,fma"))) static inline void add_ps(Sums *s, __m256 v, __m256d sign) {
    add_pd(s, _mm256_cvtps_pd(_mm256_castps256_ps128(v)), sign);
    add_pd(s, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), sign);
}

__attribute__((target("avx2,fma"))) static void store(Acc *a, Sums *s, int count, __m256d low, __m256d high) {
    double t[4];
    Sums *end = s + count;
    for (; s < end; s++) {
        _mm256_storeu_pd(t, s->sum);
        for (int k = 0; k < 4; k++) a->sum[k] += t[k];
        _mm256_storeu_pd(t, s->sumsq);
        for (int k = 0; k < 4; k++) a->sumsq[k] += t[k];
        _mm256_storeu_pd(t, s->abs_sum);
        for (int k = 0; k < 4; k++) a->abs_sum[k] += t[k];
    }
    _mm256_storeu_pd(t, low);
    for (int k = 0; k < 4; k++) a->low[k] = t[k] < a->low[k] ? t[k] : a->low[k];
    _mm256_storeu_pd(t, high);
    for (int k = 0; k < 4; k++) a->high[k] = t[k] > a->high[k] ? t[k] : a->high[k];
}

#define SUMS_INIT {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()}

/* float32 or bfloat16 (widened to float32 bits): n a multiple of 16 */
__attribute__((target("avx2,fma"))) static void ps_values(Acc *a, const unsigned char *p, size_t n, int bf16) {
    const __m256d sign = _mm256_set1_pd(-0.0);
    Sums s[2] = {SUMS_INIT, SUMS_INIT};
    __m256 low = _mm256_set1_ps(INFINITY), high = _mm256_set1_ps(-INFINITY);
    for (size_t i = 0; i < n; i += 16) {
        __m256 v[2];
        if (bf16) {
            for (int h = 0; h < 2; h++) {
                __m128i bits = _mm_loadu_si128((const __m128i *)(p + 2 * (i + 8 * h)));
                v[h] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
            }
        } else {
            v[0] = _mm256_loadu_ps((const float *)(p + 4 * i));
            v[1] = _mm256_loadu_ps((const float *)(p + 4 * (i + 8)));
        }
        for (int h = 0; h < 2; h++) {
            low = _mm256_min_ps(v[h], low);
            high = _mm256_max_ps(v[h], high);
            add_ps(&s[h], v[h], sign);
        }
    }
    /* min/max of 8 floats as 2x4 doubles: exact */
    __m256d low_d = _mm256_min_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(low)),
                                  _mm256_cvtps_pd(_mm256_extractf128_ps(low, 1)));
    __m256d high_d = _mm256_max_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(high)),
                                   _mm256_cvtps_pd(_mm256_extractf128_ps(high, 1)));
    store(a, s, 2, low_d, high_d);
}

/* float64: n a multiple of 8 */
__attribute__((target("avx2,fma"))) static void pd_values(Acc *a, const unsigned char *p, size_t n) {
    const __m256d sign = _mm256_set1_pd(-0.0);
    Sums s[2] = {SUMS_INIT, SUMS_INIT};
    __m256d low = _mm256_set1_pd(INFINITY), high = _mm256_set1_pd(-INFINITY);
    for (size_t i = 0; i < n; i += 8) {
        for (int h = 0; h < 2; h++) {
            __m256d v = _mm256_loadu_pd((const double *)(p + 8 * (i + 4 * h)));
            low = _mm256_min_pd(v, low);
            high = _mm256_max_pd(v, high);
            add_pd(&s[h], v, sign);
        }
    }
    store(a, s, 2, low, high);
}

__attribute__((target("avx2"))) static void check_row_avx2(Check *restrict c, const uint32_t *restrict w) {
    __m256i r = _mm256_setzero_si256();
    for (int j = 0; j < ROW; j += 8) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(w + j));
        __m256i *col = (__m256i *)(c->cols + j);
        _mm256_storeu_si256(col, _mm256_add_epi32(_mm256_loadu_si256(col), x));
        r = _mm256_add_epi32(r, x);
    }
    uint32_t t[8], total = 0;
    _mm256_storeu_si256((__m256i *)t, r);
    for (int k = 0; k < 8; k++) total += t[k];
    c->rows += (uint64_t)(int64_t)(int32_t)total * (2 * c->index + 1);
    c->index++;
}
#else
#define HAVE_SIMD 0
#endif

static int simd(void) {
#if HAVE_SIMD
    static int found = -1;
    if (found < 0)
        found = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return found;
#else
    return 0;
#endif
}

static void acc_init(Acc *a) {
    for (int k = 0; k < LANES; k++) {
        a->sum[k] = a->sumsq[k] = a->abs_sum[k] = 0;
        a->low[k] = INFINITY;
        a->high[k] = -INFINITY;
    }
}

/* one value into lane 0 (the scalar loops) */
static inline void add_value(Acc *a, double v) {
    a->sum[0] += v;
    a->sumsq[0] += v * v;
    a->abs_sum[0] += fabs(v);
    a->low[0] = v < a->low[0] ? v : a->low[0];
    a->high[0] = v > a->high[0] ? v : a->high[0];
}

/* the lanes folded into out[5]: low, high, sum, sum of squares, sum of |x| */
static void acc_total(const Acc *a, double out[5]) {
    out[0] = INFINITY, out[1] = -INFINITY, out[2] = out[3] = out[4] = 0;
    for (int k = 0; k < LANES; k++) {
        out[0] = a->low[k] < out[0] ? a->low[k] : out[0];
        out[1] = a->high[k] > out[1] ? a->high[k] : out[1];
        out[2] += a->sum[k], out[3] += a->sumsq[k], out[4] += a->abs_sum[k];
    }
}

/* the elements of one row that do not fill a whole vector group, one at a time */
static void tail_values(Acc *a, const unsigned char *p, size_t from, size_t n, int kind) {
    for (size_t i = from; i < n; i++)
        add_value(a, value_at(p, i, kind));
}

static void row_values(Acc *a, const unsigned char *p, size_t n, int kind, int vectorized) {
    size_t whole = 0;
#if HAVE_SIMD
    if (vectorized) {
        whole = n / 16 * 16;
        if (kind == F64)
            pd_values(a, p, whole);
        else
            ps_values(a, p, whole, kind == BF16);
    }
#endif
    tail_values(a, p, whole, n, kind);
}

static void add_row(Check *c, const uint32_t *w, int vectorized) {
#if HAVE_SIMD
    if (vectorized) {
        check_row_avx2(c, w);
        return;
    }
#endif
    check_row(c, w);
}

/* pass 2, only when the data holds NaN or Inf: counts, and the statistics of the finite values */
static void finite_pass(const unsigned char *p, size_t numel, int kind, double out[5], int64_t counts[3]) {
    Acc acc;
    int64_t nan = 0, inf = 0;
    acc_init(&acc);
    for (size_t i = 0; i < numel; i++) {
        double v = value_at(p, i, kind);
        if (isnan(v))
            nan++;
        else if (isinf(v))
            inf++;
        else
            add_value(&acc, v);
    }
    acc_total(&acc, out);
    counts[0] = nan, counts[1] = inf, counts[2] = (int64_t)numel - nan - inf;
}

/* reduce(address, numel, kind[, vectorized]) -> (low, high, sum, sumsq, abs_sum, nan, inf, finite, check0, check1);
   vectorized=False takes the portable scalar path (the tests compare both) */
static PyObject *reduce(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t numel;
    int kind, vectorized = 1;
    if (!PyArg_ParseTuple(args, "Kni|p", &address, &numel, &kind, &vectorized))
        return NULL;
    vectorized = vectorized && simd();
    if (numel <= 0 || kind < F32 || kind > BF16) {
        PyErr_SetString(PyExc_ValueError, "reduce: expected numel > 0 and kind 0 (float32), 1 (float64), 2 (bfloat16)");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)(uintptr_t)address;
    size_t size = kind == F64 ? 8 : kind == F32 ? 4 : 2;
    size_t nbytes = (size_t)numel * size, per_row = ROW_BYTES / size;
    Check check;
    Acc acc;
    double out[5];
    int64_t counts[3] = {0, 0, (int64_t)numel};
    uint64_t check0 = 0;

    Py_BEGIN_ALLOW_THREADS
    memset(&check, 0, sizeof check);
    acc_init(&acc);
    uint32_t words[ROW];
    size_t offset = 0;
    for (; offset + ROW_BYTES <= nbytes; offset += ROW_BYTES) {
        const unsigned char *row = p + offset;
        if ((uintptr_t)row % 4 == 0) {
            add_row(&check, (const uint32_t *)row, vectorized);
        } else {
            memcpy(words, row, ROW_BYTES);
            add_row(&check, words, vectorized);
        }
        row_values(&acc, row, per_row, kind, vectorized);
    }
    if (offset < nbytes) { /* the last, partial row: zero-padded for the checksum */
        memset(words, 0, ROW_BYTES);
        memcpy(words, p + offset, nbytes - offset);
        add_row(&check, words, vectorized);
        row_values(&acc, p + offset, (nbytes - offset) / size, kind, vectorized);
    }
    acc_total(&acc, out);
    if (!isfinite(out[2]) || !isfinite(out[4]))
        finite_pass(p, (size_t)numel, kind, out, counts);
    for (int j = 0; j < ROW; j++)
        check0 += (uint64_t)(int64_t)(int32_t)check.cols[j] * (uint64_t)(2 * j + 1);
    Py_END_ALLOW_THREADS

    return Py_BuildValue("dddddLLLLL", out[0], out[1], out[2], out[3], out[4], (long long)counts[0],
                         (long long)counts[1], (long long)counts[2], (long long)(int64_t)check0,
                         (long long)(int64_t)check.rows);
}

/* -- pair sums: judging one tensor against another (record/local/rerun.py `tensor_stats`) ---------------------------
 * For two float32 or two float64 arrays a (the reference) and b: sum a^2, sum b^2, sum (a-b)^2, sum a*b and
 * max |a-b|, each accumulated in float64 (a - b is exact in float64 for float32 inputs). One pass reads each
 * array once; torch's path makes a - b and reads the arrays five times. NaN/Inf show as a non-finite total:
 * the caller then takes its careful path. */
typedef struct {
    double aa, bb, dd, ab, maxd;
} PairSums;

static void pair_scalar(PairSums *s, const unsigned char *pa, const unsigned char *pb, size_t from, size_t n,
                        int kind) {
    for (size_t i = from; i < n; i++) {
        double a = value_at(pa, i, kind), b = value_at(pb, i, kind), d = a - b;
        s->aa += a * a, s->bb += b * b, s->dd += d * d, s->ab += a * b;
        double m = fabs(d);
        s->maxd = m > s->maxd || isnan(m) ? m : s->maxd;
    }
}

#if HAVE_SIMD
__attribute__((target("avx2"))) static inline double hsum(__m256d v) {
    double t[4];
    _mm256_storeu_pd(t, v);
    return (t[0] + t[1]) + (t[2] + t[3]);
}

/* 8 elements per step: float32 as 2x4 doubles, float64 as 2 loads; n a multiple of 8 */
__attribute__((target("avx2,fma"))) static void pair_avx2(PairSums *s, const unsigned char *pa,
                                                           const unsigned char *pb, size_t n, int kind) {
    const __m256d sign = _mm256_set1_pd(-0.0);
    __m256d aa = _mm256_setzero_pd(), bb = aa, dd = aa, ab = aa, maxd = aa;
    __m256d aa2 = aa, bb2 = aa, dd2 = aa, ab2 = aa;
    for (size_t i = 0; i < n; i += 8) {
        __m256d a0, a1, b0, b1;
        if (kind == F32) {
            __m256 va = _mm256_loadu_ps((const float *)(pa + 4 * i)), vb = _mm256_loadu_ps((const float *)(pb + 4 * i));
            a0 = _mm256_cvtps_pd(_mm256_castps256_ps128(va)), a1 = _mm256_cvtps_pd(_mm256_extractf128_ps(va, 1));
            b0 = _mm256_cvtps_pd(_mm256_castps256_ps128(vb)), b1 = _mm256_cvtps_pd(_mm256_extractf128_ps(vb, 1));
        } else {
            a0 = _mm256_loadu_pd((const double *)(pa + 8 * i)), a1 = _mm256_loadu_pd((const double *)(pa + 8 * i + 32));
            b0 = _mm256_loadu_pd((const double *)(pb + 8 * i)), b1 = _mm256_loadu_pd((const double *)(pb + 8 * i + 32));
        }
        __m256d d0 = _mm256_sub_pd(a0, b0), d1 = _mm256_sub_pd(a1, b1);
        aa = _mm256_fmadd_pd(a0, a0, aa), aa2 = _mm256_fmadd_pd(a1, a1, aa2);
        bb = _mm256_fmadd_pd(b0, b0, bb), bb2 = _mm256_fmadd_pd(b1, b1, bb2);
        dd = _mm256_fmadd_pd(d0, d0, dd), dd2 = _mm256_fmadd_pd(d1, d1, dd2);
        ab = _mm256_fmadd_pd(a0, b0, ab), ab2 = _mm256_fmadd_pd(a1, b1, ab2);
        /* NaN in d reaches dd (the caller's careful path), so max may ignore it */
        maxd = _mm256_max_pd(_mm256_andnot_pd(sign, d0), maxd);
        maxd = _mm256_max_pd(_mm256_andnot_pd(sign, d1), maxd);
    }
    s->aa += hsum(aa) + hsum(aa2), s->bb += hsum(bb) + hsum(bb2), s->dd += hsum(dd) + hsum(dd2);
    s->ab += hsum(ab) + hsum(ab2);
    double t[4];
    _mm256_storeu_pd(t, maxd);
    for (int k = 0; k < 4; k++)
        s->maxd = t[k] > s->maxd ? t[k] : s->maxd;
}
#endif

/* pair(address_a, address_b, numel, kind[, vectorized]) -> (sum a^2, sum b^2, sum (a-b)^2, sum a*b, max |a-b|) */
static PyObject *pair(PyObject *self, PyObject *args) {
    unsigned long long address_a, address_b;
    Py_ssize_t numel;
    int kind, vectorized = 1;
    if (!PyArg_ParseTuple(args, "KKni|p", &address_a, &address_b, &numel, &kind, &vectorized))
        return NULL;
    vectorized = vectorized && simd();
    if (numel < 0 || (kind != F32 && kind != F64)) {
        PyErr_SetString(PyExc_ValueError, "pair: expected numel >= 0 and kind 0 (float32) or 1 (float64)");
        return NULL;
    }
    const unsigned char *pa = (const unsigned char *)(uintptr_t)address_a;
    const unsigned char *pb = (const unsigned char *)(uintptr_t)address_b;
    PairSums s = {0, 0, 0, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    size_t whole = 0;
#if HAVE_SIMD
    if (vectorized) {
        whole = (size_t)numel / 8 * 8;
        pair_avx2(&s, pa, pb, whole, kind);
    }
#endif
    pair_scalar(&s, pa, pb, whole, (size_t)numel, kind);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("ddddd", s.aa, s.bb, s.dd, s.ab, s.maxd);
}

static PyObject *simd_available(PyObject *self, PyObject *unused) { return PyBool_FromLong(simd()); }

static PyMethodDef methods[] = {
    {"simd", simd_available, METH_NOARGS, "simd() -> whether the vectorized (AVX2+FMA) path runs on this CPU"},
    {"reduce", reduce, METH_VARARGS,
     "reduce(address, numel, kind[, vectorized]) -> (low, high, sum, sumsq, abs_sum, nan, inf, finite, check0, "
     "check1)"},
    {"pair", pair, METH_VARARGS,
     "pair(address_a, address_b, numel, kind[, vectorized]) -> (sum a^2, sum b^2, sum (a-b)^2, sum a*b, max |a-b|)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_statskernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__statskernel(void) { return PyModule_Create(&module); }
