/*
The quantised caches' decoding on a CPU (quant.py): a step's products over an entry's codes, each code
converted inside the loop that uses it, never a dequantised copy of the entry; and a new token's
quantising, one call an entry where PyTorch's takes a dozen small ops. Built and loaded by quant_c.py (the
system's C compiler, on first use); quant.py keeps PyTorch's ops for every case these do not take (a GPU,
fp64, torch.compile, no compiler), and the tests hold both to the same numbers.

    int4_key_scores    q . k over an int4 key entry (LRKV's shared key, MHA's keys, MLA's RoPE keys)
    int4_key_dot       x . k position by position (LRKV's residual key term, decode.key_scores)
    int4_weighted_sum  sum_t p_t x_t over an int4 entry held per token (values)
    int8_key_dot       int4_key_dot's over an int8 entry (LRKV's r_k)
    int8_store, int4_store   a token's rows quantised into their slots, bit for bit quant.py's arithmetic
    paged_gqa_decode   MHA's, GQA's and MQA's step over the paged pool's slots where they lie (paged.py),
                       plain (fp32, bf16) or int8
    int8_gather, int4_gather   Int8KVCache's and Int4KVCache's load of slots (the paged pool's rows),
                       dequantised in one pass

Layout (quant.laid_out): every entry read here lies position-last, rows of L bytes, a row's positions
contiguous, so that every loop runs along positions, V at a time in a vector (GCC's and Clang's vector
extensions: a 512-bit register where the processor has them, several narrower ones elsewhere), a row of
codes after another (SPAN positions of it at a time: rows lie pages apart). Byte i of an int4 head of
width D holds its channels i (low 4 bits) and D/2 + i (high 4 bits) (quant.int4_codes).

An int4 key entry (quant.KEYS) is per channel over groups of G slots: x_t = c_t s_g + m_g, g = t / G, and
the group being filled waits in full precision in a residual (its positions res_first..res_first + res_n
- 1, rows of H D numbers); every other int4 entry per token, x_t = c_t s_t + m_t; an int8 row x = c s.
Arithmetic in fp32; numbers of bf16 read as such (a bf16 is an fp32's top 16 bits).
*/
#include <float.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#define V 16  /* positions a vector holds */
#define SPAN 256  /* positions of a row a loop reads before it moves to the next row */
typedef float f32xV __attribute__((vector_size(4 * V)));
typedef uint32_t u32xV __attribute__((vector_size(4 * V)));
typedef int32_t i32xV __attribute__((vector_size(4 * V)));
typedef uint16_t u16xV __attribute__((vector_size(2 * V)));
typedef uint8_t u8xV __attribute__((vector_size(V)));
typedef int8_t i8xV __attribute__((vector_size(V)));

/* V fp32 (is_bf16 0) or bf16 (1) numbers from x, as fp32 */
static inline f32xV load(const void *x, int is_bf16) {
    f32xV f;
    if (is_bf16) {
        u16xV b;
        memcpy(&b, x, sizeof b);
        u32xV u = __builtin_convertvector(b, u32xV) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, x, sizeof f);
    }
    return f;
}

/* the V codes of the low and the high 4 bits of V bytes at c, as fp32 */
static inline void codes(const uint8_t *c, f32xV *lo, f32xV *hi) {
    u8xV b;
    memcpy(&b, c, sizeof b);
    /* through 32-bit integers: a compiler converts bytes to floats one at a time, 32-bit ones a vector */
    *lo = __builtin_convertvector(__builtin_convertvector(b & 15, i32xV), f32xV);
    *hi = __builtin_convertvector(__builtin_convertvector(b >> 4, i32xV), f32xV);
}

static inline float sum(f32xV v) {
    float s = 0;
    for (int l = 0; l < V; l++) s += v[l];
    return s;
}

/* number i of fp32 or bf16 numbers at x */
static inline float at(const void *x, int is_bf16, long i) {
    if (!is_bf16) return ((const float *)x)[i];
    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The residual's positions among t0..t0+n-1: out[k][r][p - t0] = sum_c a[k, r, c] res[p, k, c], a (K, M, D)
   at a + ((k M + r) D + c) lda + (p - t0) ldp numbers (fp32 or bf16), out rows n apart */
static void from_residual(long n, int K, int M, int D, const void *a, int a_bf16, long lda, long ldp,
                          long t0, float *out, const void *res, int res_bf16, long res_first, long res_n) {
    for (long p = res_first; p < res_first + res_n; p++) {
        if (p < t0 || p >= t0 + n) continue;
        for (int k = 0; k < K; k++)
            for (int r = 0; r < M; r++) {
                float y = 0;
                for (int c = 0; c < D; c++)
                    y += at(a, a_bf16, ((k * M + r) * D + c) * lda + (p - t0) * ldp)
                         * at(res, res_bf16, ((p - res_first) * K + k) * D + c);
                out[(k * M + r) * n + p - t0] = y;
            }
    }
}

/* A key entry's codes (H heads of D channels, position-last: head h's byte row i at codes + (h D/2 + i)
   ldc, positions t0..t0+n-1 its first n bytes) by x of the same shape (channel c of head h at
   x + (h D + c) ldx, its n positions; fp32 or bf16):
       out[h][t] = sum_c x[h, c, t] (code[h, c, t] s[g, h, c] + m[g, h, c]),  g = (t0 + t) / G
   or the residual's numbers where it holds position t0 + t. out (H, n) fp32; low, scale (groups, H, D)
   from group t0 / G on, fp32 or bf16 (ls_bf16). LRKV's residual key term (decode.key_scores). SPAN
   positions at a time, a row of codes after another, V positions at a time within a group. */
void int4_key_dot(long n, int H, int D, const void *x, int x_bf16, long ldx, const uint8_t *codes_,
                  long ldc, const void *low, const void *scale, int ls_bf16, long G, long t0, float *out,
                  const void *res, int res_bf16, long res_first, long res_n) {
    int half = D / 2, size = x_bf16 ? 2 : 4;
    for (long t = 0; t < n; t += SPAN)
        for (int h = 0; h < H; h++) {
            long end = n - t < SPAN ? n : t + SPAN;
            float *y = out + h * n;
            memset(y + t, 0, (end - t) * sizeof(float));
            for (int i = 0; i < half; i++) {
                const uint8_t *c = codes_ + (h * half + i) * ldc;
                const char *a = (const char *)x + (h * D + i) * ldx * size;
                const char *b = (const char *)x + (h * D + half + i) * ldx * size;
                for (long u = t; u < end;) {  /* a group's positions u..stop-1 */
                    long g = (t0 + u) / G - t0 / G, stop = u + G - (t0 + u) % G, j = u;
                    stop = stop < end ? stop : end;
                    long at_g = (g * H + h) * D + i;
                    float s_lo = at(scale, ls_bf16, at_g), m_lo = at(low, ls_bf16, at_g);
                    float s_hi = at(scale, ls_bf16, at_g + half), m_hi = at(low, ls_bf16, at_g + half);
                    for (; j + V <= stop; j += V) {
                        f32xV acc, lo, hi;
                        codes(c + j, &lo, &hi);
                        memcpy(&acc, y + j, sizeof acc);
                        acc += load(a + j * size, x_bf16) * (lo * s_lo + m_lo)
                               + load(b + j * size, x_bf16) * (hi * s_hi + m_hi);
                        memcpy(y + j, &acc, sizeof acc);
                    }
                    for (; j < stop; j++)
                        y[j] += at(a, x_bf16, j) * ((c[j] & 15) * s_lo + m_lo)
                                + at(b, x_bf16, j) * ((c[j] >> 4) * s_hi + m_hi);
                    u = stop;
                }
            }
        }
    from_residual(n, H, 1, D, x, x_bf16, ldx, 1, t0, out, res, res_bf16, res_first, res_n);
}

/* A key entry's scores (K heads of D channels, position-last as above, from position 0) by M query rows
   a head:
       out[k][r][t] = sum_c q[k, r, c] (code[k, c, t] s[g, k, c] + m[g, k, c]),  g = t / G
   or the residual's numbers where it holds position t. q (K, M, D) fp32; out (K, M, n) fp32; low, scale
   (groups, K, D), fp32 or bf16 (ls_bf16). The scale goes into the query, q s_g, and q . m_g is one number
   a row: a row of codes after another, each vector of them converted once for the M rows. qs: room for
   the groups' q s_g, ceil(n / G) M D numbers. */
void int4_key_scores(long n, int K, int M, int D, const float *q, const uint8_t *codes_, long ldc,
                     const void *low, const void *scale, int ls_bf16, long G, float *out,
                     const void *res, int res_bf16, long res_first, long res_n, float *qs) {
    int half = D / 2;
    long groups = (n + G - 1) / G;
    for (int k = 0; k < K; k++) {
        const float *qk = q + k * M * D;
        for (long g = 0; g < groups; g++)
            for (int r = 0; r < M; r++) {
                float qm = 0;  /* q . m_g, where every score of the group starts */
                for (int c = 0; c < D; c++) {
                    qs[(g * M + r) * D + c] = qk[r * D + c] * at(scale, ls_bf16, (g * K + k) * D + c);
                    qm += qk[r * D + c] * at(low, ls_bf16, (g * K + k) * D + c);
                }
                float *y = out + (k * M + r) * n;
                for (long t = g * G; t < (g + 1) * G && t < n; t++) y[t] = qm;
            }
        for (int i = 0; i < half; i++) {
            const uint8_t *c = codes_ + (k * half + i) * ldc;
            for (long g = 0; g < groups; g++) {
                long t = g * G, stop = (g + 1) * G < n ? (g + 1) * G : n;
                for (; t + V <= stop; t += V) {
                    f32xV lo, hi;
                    codes(c + t, &lo, &hi);
                    for (int r = 0; r < M; r++) {
                        float *y = out + (k * M + r) * n + t;
                        f32xV acc;
                        memcpy(&acc, y, sizeof acc);
                        acc += lo * qs[(g * M + r) * D + i] + hi * qs[(g * M + r) * D + half + i];
                        memcpy(y, &acc, sizeof acc);
                    }
                }
                for (; t < stop; t++)
                    for (int r = 0; r < M; r++)
                        out[(k * M + r) * n + t] += (c[t] & 15) * qs[(g * M + r) * D + i]
                                                    + (c[t] >> 4) * qs[(g * M + r) * D + half + i];
            }
        }
    }
    from_residual(n, K, M, D, q, 0, 1, 0, 0, out, res, res_bf16, res_first, res_n);
}

/* The sums over len positions of the weights w (rows n apart) times the low and the high codes of c, for
   R rows (1 or 4: each vector of codes converted once for them all), added to lo[j], hi[j] */
static inline __attribute__((always_inline)) void weighted_rows(long len, int R, const float *w, long n,
                                                                const uint8_t *c, float *lo, float *hi) {
    f32xV a[4] = {{0}}, b[4] = {{0}}, x, y;
    long t = 0;
    for (; t + V <= len; t += V) {
        codes(c + t, &x, &y);
        for (int j = 0; j < R; j++) {
            f32xV wt = load(w + j * n + t, 0);
            a[j] += wt * x;
            b[j] += wt * y;
        }
    }
    for (int j = 0; j < R; j++) {
        lo[j] += sum(a[j]);
        hi[j] += sum(b[j]);
        for (long u = t; u < len; u++) {
            lo[j] += w[j * n + u] * (c[u] & 15);
            hi[j] += w[j * n + u] * (c[u] >> 4);
        }
    }
}

/* A per-token entry's weighted sums over its first n positions (K heads of D channels, position-last as
   above) by M rows of weights p a head, x_t = c_t s_t + m_t:
       out[k][r][c] = sum_t p[k, r, t] s[t, k] code[k, c, t] + sum_t p[k, r, t] m[t, k]
   p (K, M, n) fp32 or bf16; low, scale fp32 or bf16 (ls_bf16), position t's head k at t ls_t + k ls_k;
   out (K, M, D) fp32. A head's weights p s made first (into w, room for M n numbers), then every row of
   its codes by them, along positions in V sums apart. */
void int4_weighted_sum(long n, int K, int M, int D, const void *p, int p_bf16, const uint8_t *codes_,
                       long ldc, const void *low, const void *scale, int ls_bf16, long ls_t, long ls_k,
                       float *out, float *w) {
    int half = D / 2, size = ls_bf16 ? 2 : 4, p_size = p_bf16 ? 2 : 4;
    for (int k = 0; k < K; k++) {
        const char *s = (const char *)scale + k * ls_k * size, *m = (const char *)low + k * ls_k * size;
        float *y = out + k * M * D;
        for (int r = 0; r < M; r++) {  /* the row's weights p s, and its p . m */
            const char *pr = (const char *)p + (k * M + r) * n * p_size;
            f32xV shifts = {0};
            long t = 0;
            for (; ls_t == 1 && t + V <= n; t += V) {  /* a scale and low a position, contiguous */
                f32xV pt = load(pr + t * p_size, p_bf16), wt = pt * load(s + t * size, ls_bf16);
                memcpy(w + r * n + t, &wt, sizeof wt);
                shifts += pt * load(m + t * size, ls_bf16);
            }
            float shift = sum(shifts);
            for (; t < n; t++) {
                float pt = at(pr, p_bf16, t);
                w[r * n + t] = pt * at(s, ls_bf16, t * ls_t);
                shift += pt * at(m, ls_bf16, t * ls_t);
            }
            for (int c = 0; c < D; c++) y[r * D + c] = shift;
        }
        for (int i = 0; i < half; i++) {
            const uint8_t *c = codes_ + (k * half + i) * ldc;
            for (int r = 0; r < M;) {
                float lo[4] = {0}, hi[4] = {0};
                int R = M - r >= 4 ? 4 : 1;
                if (R == 4)  /* R a constant in each, for the compiler's registers */
                    weighted_rows(n, 4, w + r * n, n, c, lo, hi);
                else
                    weighted_rows(n, 1, w + r * n, n, c, lo, hi);
                for (int j = 0; j < R; j++, r++) {
                    y[r * D + i] += lo[j];
                    y[r * D + half + i] += hi[j];
                }
            }
        }
    }
}

/* Int8KVCache's codes of the same kind of entry (int8, a byte row a channel: head h's channel c at
   codes + (h D + c) ldc, positions t0..t0+n-1 its first n bytes) with a scale a position and head:
       out[h][t] = s[t, h] sum_c x[h, c, t] code[h, c, t]
   x as int4_key_dot's; scale fp32 or bf16 (s_bf16), position t0 + t's head h at t s_t + h s_h from
   scale's first; out (H, n) fp32. */
void int8_key_dot(long n, int H, int D, const void *x, int x_bf16, long ldx, const uint8_t *codes_, long ldc,
                  const void *scale, int s_bf16, long s_t, long s_h, float *out) {
    int size = x_bf16 ? 2 : 4;
    for (long t = 0; t < n; t += SPAN)  /* SPAN positions of every row at a time */
        for (int h = 0; h < H; h++) {
            long len = n - t < SPAN ? n - t : SPAN, j;
            float *y = out + h * n + t;
            memset(y, 0, len * sizeof(float));
            for (int c = 0; c < D; c++) {
                const uint8_t *row = codes_ + (h * D + c) * ldc + t;
                const char *xr = (const char *)x + ((h * D + c) * ldx + t) * size;
                for (j = 0; j + V <= len; j += V) {
                    /* a signed byte as (its bits ^ 128) - 128 of the unsigned one: compilers widen
                       unsigned bytes a vector at a time, signed ones one at a time */
                    u8xV b;
                    f32xV acc;
                    memcpy(&b, row + j, sizeof b);
                    memcpy(&acc, y + j, sizeof acc);
                    acc += load(xr + j * size, x_bf16)
                           * __builtin_convertvector(__builtin_convertvector(b ^ 128, i32xV) - 128, f32xV);
                    memcpy(y + j, &acc, sizeof acc);
                }
                for (; j < len; j++) y[j] += at(xr, x_bf16, j) * (int8_t)row[j];
            }
            for (j = 0; j < len; j++) y[j] *= at(scale, s_bf16, (t + j) * s_t + h * s_h);
        }
}

/* round to the nearest bf16, ties to even (PyTorch's conversion), back as fp32 */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void put(void *to, int is_bf16, long i, float f) {  /* f, already of to's dtype, at to[i] */
    if (is_bf16) {
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        ((uint16_t *)to)[i] = (uint16_t)(u >> 16);
    } else {
        ((float *)to)[i] = f;
    }
}

/* Int8KVCache's store (quant.py, the same arithmetic in the same order): each row x of D numbers (B T R
   rows of x, fp32 or bf16, contiguous) as s = max|x| / 127 rounded to the cache's dtype (s_bf16) and the
   codes round(x / max(s, FLT_MIN)) in [-127, 127], ties to even; row (b, t, r) into slot slots[t], at
   codes + b cb + slot cl + r cr + c cc and scale + (b sb + slot sl + r sr) numbers. */
void int8_store(long B, long T, long R, int D, const void *x, int x_bf16, const int64_t *slots,
                int8_t *codes_, long cb, long cl, long cr, long cc, void *scale, int s_bf16, long sb, long sl,
                long sr) {
    for (long b = 0; b < B; b++)
        for (long t = 0; t < T; t++) {
            long slot = slots[t];
            for (long r = 0; r < R; r++) {
                long row = ((b * T + t) * R + r) * D;
                float top = 0, s;
                for (int c = 0; c < D; c++) top = fmaxf(top, fabsf(at(x, x_bf16, row + c)));
                s = top / 127;
                s = s_bf16 ? round_bf16(s) : s;
                long at_scale = b * sb + slot * sl + r * sr;
                put(scale, s_bf16, at_scale, s);
                float d = fmaxf(s, FLT_MIN);
                int8_t *q = codes_ + b * cb + slot * cl + r * cr;
                for (int c = 0; c < D; c++)
                    q[c * cc] = (int8_t)fminf(fmaxf(rintf(at(x, x_bf16, row + c) / d), -127), 127);
            }
        }
}

/* Int4KVCache's store of an entry held per token (quant.py, the same arithmetic in the same order): x
   (B T R rows of D numbers, fp32 or bf16, contiguous), each m consecutive rows one group: its low
   m = min x and s = (max x - min x) / 15, each rounded to the cache's dtype (ls_bf16), and the codes
   round((x - m) / max(s, FLT_MIN)) in [0, 15], ties to even, two a byte (channel i in the low 4 bits of
   byte i, D/2 + i in the high). Row (b, t, r) into slot slots[t]: its byte i at codes + b cb + slot cl
   + r cr + i ci; its group's low and scale at (b sb + slot sl + (r / m) sg) numbers. */
void int4_store(long B, long T, long R, int D, long m, const void *x, int x_bf16, const int64_t *slots,
                uint8_t *codes_, long cb, long cl, long cr, long ci, void *low, void *scale, int ls_bf16,
                long sb, long sl, long sg) {
    for (long b = 0; b < B; b++)
        for (long t = 0; t < T; t++) {
            long slot = slots[t];
            for (long r0 = 0; r0 < R; r0 += m) {
                long first = ((b * T + t) * R + r0) * D, n = m * D;
                float lo = at(x, x_bf16, first), hi = lo;
                for (long i = 1; i < n; i++) {
                    float v = at(x, x_bf16, first + i);
                    lo = fminf(lo, v);
                    hi = fmaxf(hi, v);
                }
                float s = (hi - lo) / 15;
                if (ls_bf16) {
                    lo = round_bf16(lo);
                    s = round_bf16(s);
                }
                long at_ls = b * sb + slot * sl + (r0 / m) * sg;
                put(low, ls_bf16, at_ls, lo);
                put(scale, ls_bf16, at_ls, s);
                float d = fmaxf(s, FLT_MIN);
                for (long r = r0; r < r0 + m; r++) {
                    uint8_t *q = codes_ + b * cb + slot * cl + r * cr;
                    long row = ((b * T + t) * R + r) * D;
                    for (int i = 0; i < D / 2; i++) {
                        float a = fminf(fmaxf(rintf((at(x, x_bf16, row + i) - lo) / d), 0), 15);
                        float c = fminf(fmaxf(rintf((at(x, x_bf16, row + D / 2 + i) - lo) / d), 0), 15);
                        q[i * ci] = (uint8_t)a | (uint8_t)((uint8_t)c << 4);
                    }
                }
            }
        }
}

/* V numbers of a slot's row at x, as fp32: fp32 (kind 0), bf16 (1) or int8 codes (2) */
static inline f32xV row_load(const void *x, int kind) {
    if (kind != 2) return load(x, kind);
#if defined(__AVX512F__) && V == 16  /* GCC 12 converts a vector of signed bytes one byte at a time */
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x)));
    f32xV out;
    memcpy(&out, &f, sizeof out);
    return out;
#else
    i8xV b;
    memcpy(&b, x, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, i32xV), f32xV);  /* as codes(): via 32 bits */
#endif
}

/* number i of a slot's row, as row_load's */
static inline float row_at(const void *x, int kind, long i) {
    return kind == 2 ? ((const int8_t *)x)[i] : at(x, kind, i);
}

/* the sum of v's numbers by halves (a loop's sum adds them one after another, a chain of V adds) */
static inline float halves_sum(f32xV v) {
    float h[V];
    memcpy(h, &v, sizeof h);
    for (int w = V / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) h[l] += h[l + w];  /* unrolled by the compiler: vector adds */
    return h[0];
}

/* q . x over a row of D numbers (x: row_load's kinds), q fp32; two sums, so that two chains run at once */
static inline float row_dot(const float *q, const void *x, int kind, int D) {
    int size = kind == 0 ? 4 : kind == 1 ? 2 : 1, i = 0;
    f32xV acc = {0}, acc2 = {0};
    for (; i + 2 * V <= D; i += 2 * V) {
        f32xV a, b;
        memcpy(&a, q + i, sizeof a);
        memcpy(&b, q + i + V, sizeof b);
        acc += a * row_load((const char *)x + i * size, kind);
        acc2 += b * row_load((const char *)x + (i + V) * size, kind);
    }
    for (; i + V <= D; i += V) {
        f32xV a;
        memcpy(&a, q + i, sizeof a);
        acc += a * row_load((const char *)x + i * size, kind);
    }
    float y = halves_sum(acc + acc2);
    for (; i < D; i++) y += q[i] * row_at(x, kind, i);
    return y;
}

/* y += w x over a row of D numbers (x: row_load's kinds), y fp32 */
static inline void row_axpy(float *y, float w, const void *x, int kind, int D) {
    int size = kind == 0 ? 4 : kind == 1 ? 2 : 1, i = 0;
    for (; i + V <= D; i += V) {
        f32xV a;
        memcpy(&a, y + i, sizeof a);
        a += w * row_load((const char *)x + i * size, kind);
        memcpy(y + i, &a, sizeof a);
    }
    for (; i < D; i++) y[i] += w * row_at(x, kind, i);
}

/* One new token a row over the paged pool's keys and values where they lie (paged.py; MHA's, GQA's and
   MQA's single-token step, decode.gqa_step), rows b0..b1-1 of B: row b reads its S positions' slots
   slots[b S + t] (-1: a position it does not see), each slot G heads of D numbers, its keys at
   k + (slot G + g) D and values likewise, fp32 (kind 0), bf16 (1) or int8 codes (2) with a scale a slot
   and head (k_scale[slot G + g], fp32 or bf16: scale_bf16), query head h = g H/G + j reading head g:

       out[b, h] = sum_t softmax_t(scale q[b, h] . k[t, g]) v[t, g]

   an int8 row being s c, q . (s c) = s (q . c) and the weights times s go onto the codes. q, out (B, H, D)
   fp32; room: S fp32 numbers a query head (the scores, then the weights). */
static inline __attribute__((always_inline)) void gqa_rows(
        long b0, long b1, long S, int H, int G, int D, const float *q, const int64_t *slots, const void *k,
        const void *v, const int kind, const void *k_scale, const void *v_scale, int scale_bf16, float scale,
        float *out, float *room) {
    int M = H / G, size = kind == 0 ? 4 : kind == 1 ? 2 : 1;
    for (long b = b0; b < b1; b++) {
        const int64_t *slot = slots + b * S;
        const float *q_b = q + b * H * D;
        float top[H], total[H];
        for (int h = 0; h < H; h++) top[h] = -INFINITY, total[h] = 0;
        /* the scores, a slot's keys read once, every head of it in turn (room: S numbers a query head) */
        for (long t = 0; t < S; t++) {
            if (slot[t] < 0) continue;
            for (int g = 0; g < G; g++) {
                long row = slot[t] * G + g;
                const char *key = (const char *)k + row * D * size;
                float s = kind == 2 ? scale * at(k_scale, scale_bf16, row) : scale;
                for (int j = 0; j < M; j++) {
                    int h = g * M + j;
                    float y = s * row_dot(q_b + h * D, key, kind, D);
                    room[h * S + t] = y;
                    top[h] = y > top[h] ? y : top[h];
                }
            }
        }
        for (int h = 0; h < H; h++)  /* the softmax's numerators */
            for (long t = 0; t < S; t++) {
                if (slot[t] < 0) continue;
                float e = expf(room[h * S + t] - top[h]);
                room[h * S + t] = e;
                total[h] += e;
            }
        float *y = out + b * H * D;
        memset(y, 0, H * D * sizeof(float));
        for (long t = 0; t < S; t++) {  /* the weighted sum, a slot's values read once */
            if (slot[t] < 0) continue;
            for (int g = 0; g < G; g++) {
                long row = slot[t] * G + g;
                const char *value = (const char *)v + row * D * size;
                float s = kind == 2 ? at(v_scale, scale_bf16, row) : 1;
                for (int j = 0; j < M; j++) {
                    int h = g * M + j;
                    row_axpy(y + h * D, s * room[h * S + t] / total[h], value, kind, D);
                }
            }
        }
    }
}

void paged_gqa_decode(long b0, long b1, long S, int H, int G, int D, const float *q, const int64_t *slots,
                      const void *k, const void *v, int kind, const void *k_scale, const void *v_scale,
                      int scale_bf16, float scale, float *out, float *room) {
    /* a loop of each kind's own, the kind known inside it */
    if (kind == 0)
        gqa_rows(b0, b1, S, H, G, D, q, slots, k, v, 0, k_scale, v_scale, scale_bf16, scale, out, room);
    else if (kind == 1)
        gqa_rows(b0, b1, S, H, G, D, q, slots, k, v, 1, k_scale, v_scale, scale_bf16, scale, out, room);
    else
        gqa_rows(b0, b1, S, H, G, D, q, slots, k, v, 2, k_scale, v_scale, scale_bf16, scale, out, room);
}

/* Int8KVCache's load of slots (quant.py, the same numbers): n slots' rows, slot slots[i]'s R rows of D
   codes at codes + (slots[i] R + r) D with a scale each at scale[slots[i] R + r] (fp32 or bf16:
   scale_bf16), into out's rows (i R + r) D as c s, fp32 or rounded once to bf16 (out_bf16): one pass where
   PyTorch's gathers and converts in several. */
void int8_gather(long n, long R, int D, const int8_t *codes, const void *scale, int scale_bf16,
                 const int64_t *slots, void *out, int out_bf16) {
    for (long i = 0; i < n; i++)
        for (long r = 0; r < R; r++) {
            long row = slots[i] * R + r, to = (i * R + r) * D;
            float s = at(scale, scale_bf16, row);
            const int8_t *c = codes + row * D;
            int d = 0;
            for (; d + V <= D; d += V) {
                f32xV x = s * row_load(c + d, 2);
                if (out_bf16) {
                    u32xV u;
                    memcpy(&u, &x, sizeof u);
                    u16xV b = __builtin_convertvector((u + 0x7FFF + ((u >> 16) & 1)) >> 16, u16xV);
                    memcpy((uint16_t *)out + to + d, &b, sizeof b);
                } else {
                    memcpy((float *)out + to + d, &x, sizeof x);
                }
            }
            for (; d < D; d++) put(out, out_bf16, to + d, out_bf16 ? round_bf16(s * c[d]) : s * c[d]);
        }
}

/* Int4KVCache's load of slots (quant.py, the same numbers, each c s then + m in fp32 as PyTorch's two
   ops, never fused): n slots' rows, slot slots[i]'s R rows of D/2 bytes at codes + (slots[i] R + r) D/2,
   into out's rows (i R + r) D as fp32 or rounded once to bf16 (out_bf16). The lows and scales (fp32 or
   bf16: ls_bf16) per channel over groups of G slots (per_channel 1, a key entry: number d of row r at
   ((slots[i] / G) R + r) D + d) or per token, one for R_ls rows at a time (slots[i] R / R_ls + r / R_ls). */
__attribute__((optimize("fp-contract=off")))
void int4_gather(long n, long R, int D, const uint8_t *codes, const void *low, const void *scale,
                 int ls_bf16, const int64_t *slots, long G, long R_ls, int per_channel, void *out,
                 int out_bf16) {
    int half = D / 2;
    for (long i = 0; i < n; i++)
        for (long r = 0; r < R; r++) {
            long row = slots[i] * R + r, to = (i * R + r) * D;
            const uint8_t *c = codes + row * half;
            long ls = per_channel ? ((slots[i] / G) * R + r) * D : slots[i] * (R / R_ls) + r / R_ls;
            for (int d = 0; d < D; d++) {
                int code = d < half ? c[d] & 15 : c[d - half] >> 4;
                float s = at(scale, ls_bf16, per_channel ? ls + d : ls);
                float m = at(low, ls_bf16, per_channel ? ls + d : ls);
                float p = code * s;
                float x = p + m;
                put(out, out_bf16, to + d, out_bf16 ? round_bf16(x) : x);
            }
        }
}
