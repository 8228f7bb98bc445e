/* The CPU's native kernels (built and called by cpu_native.py): paged decode attention that
 * reads each page where it lies, a small-batch linear (decode's GEMVs), and a decoder layer's
 * element-wise ops fused, one call each
 * where torch runs several operators (the CPU twins of layer_ops.py's Triton kernels).
 *
 * Paged decode attention: one decode token per request against per-head KV pages (the layout of paged_decode.py):
 *   q       [B, H, D]      float32, H = Hkv * G; query head h reads KV head h / G
 *   k, v    [N, S, D]      float32 pages of any layer / head
 *   tables  row (b, h) at  tables + b * table_stride_b + h * table_stride_h: int32 page ids
 *   lens    [B]            int32 tokens of each request (0: its rows get zeros)
 *   out     [B, H, D]      float32
 *
 * Each (request, KV head) row runs an online softmax over blocks of up to BLOCK tokens: the
 * G query heads' scores of a block (one pass over its K rows, each read once for all G), one
 * rescale of the accumulators, then one pass over its V rows. The gather path this replaces
 * copied every row's pages into a contiguous block first and read them again in two batched
 * matmuls: three passes over the cache where this takes one.
 *
 * Built by cpu_native.py with -O3 -march=native -ffast-math (the compile only, not the
 * link: see there) and no OpenMP runtime (torch brings its own; a second pool would fight
 * it for the cores): rows are split over
 * `threads` POSIX threads, the caller's thread taking the first share. No infinities arise
 * (scores are only formed for tokens that exist; the running max starts at -FLT_MAX), so
 * -ffast-math's finite-math assumption holds, and it lets expf vectorise through libmvec.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 128
#define MAX_G 16
#define MAX_D 256
#define AHEAD 16 /* tokens: prefetch the K and V rows this far ahead during the scores pass
                    (pages are scattered, so the hardware prefetcher loses the stream at every
                    page boundary; a block's V rows, 32 KB at D 64, are then in cache for the
                    second pass: 16 rows of 512 tokens, pages in DRAM, 1.36 -> 1.24 ms a layer) */

static inline const float *row_at(const float *base, const int32_t *tab, int64_t tok, int64_t S,
                                  int64_t D) {
    return base + ((int64_t)tab[tok / S] * S + tok % S) * D;
}

static inline void prefetch_row(const float *row, int64_t D) {
    for (int64_t i = 0; i < D; i += 16) __builtin_prefetch(row + i, 0, 3);
}

typedef struct {
    const float *q, *k, *v;
    const int32_t *tables, *lens;
    float *out;
    int64_t H, Hkv, D, S, stride_b, stride_h;
    float scale;
    int64_t rows;
    int64_t *next; /* shared by the threads of a call: the next row not yet taken */
} job_t;

/* One (request, KV head) row. Inlined with D and G constant where run_row dispatches the common
 * shapes, so that the compiler keeps q and the accumulators in registers and unrolls the dots:
 * SmolLM2's 16 rows of 512 tokens took 0.69 ms a layer with every page in cache through the
 * general form (the arithmetic), about half of the 1.48 ms with the pages in DRAM. */
static inline __attribute__((always_inline)) void run_row_shaped(const job_t *a, int64_t r, const int64_t D,
                                                                  const int64_t G) {
    const int64_t Hkv = a->Hkv, S = a->S;
    const int64_t b = r / Hkv, h = r % Hkv;
    const int64_t len = a->lens[b];
    const float *q = a->q + (b * a->H + h * G) * D;  /* [G, D] */
    float *out = a->out + (b * a->H + h * G) * D;    /* [G, D] */
    if (len <= 0) {
        memset(out, 0, sizeof(float) * G * D);
        return;
    }
    const int32_t *tab = a->tables + b * a->stride_b + h * a->stride_h;
    float m[MAX_G], l[MAX_G];
    float acc[MAX_G * MAX_D];
    float s[MAX_G * BLOCK];
    float qs[MAX_G * MAX_D];
    for (int64_t g = 0; g < G; g++) {
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t i = 0; i < G * D; i++) qs[i] = q[i] * a->scale;

    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;
        /* scores: s[g, t] = (q_g * scale) . k_t */
        for (int64_t t = 0; t < n; t++) {
            const int64_t tok = t0 + t;
            const float *kt = row_at(a->k, tab, tok, S, D);
            if (tok + AHEAD < len) {
                prefetch_row(row_at(a->k, tab, tok + AHEAD, S, D), D);
                prefetch_row(row_at(a->v, tab, tok + AHEAD, S, D), D);
            }
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qs + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qg[d] * kt[d];
                s[g * BLOCK + t] = dot;
            }
        }
        /* online softmax: new max, rescale, exponentiate */
        for (int64_t g = 0; g < G; g++) {
            float *sg = s + g * BLOCK;
            float mx = m[g];
            for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
            const float corr = expf(m[g] - mx);
            m[g] = mx;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                const float e = expf(sg[t] - mx);
                sg[t] = e;
                sum += e;
            }
            l[g] = l[g] * corr + sum;
            float *ag = acc + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ag[d] *= corr;
        }
        /* acc[g] += p[g, t] * v_t */
        for (int64_t t = 0; t < n; t++) {
            const int64_t tok = t0 + t;
            const float *vt = row_at(a->v, tab, tok, S, D);
            for (int64_t g = 0; g < G; g++) {
                const float p = s[g * BLOCK + t];
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ag[d] += p * vt[d];
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = 1.0f / l[g];
        for (int64_t d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv;
    }
}

/* Runs fn on each of `threads` (<= 64) shares laid out `size` bytes apart from `jobs`: the
 * first on the caller's thread, the others on POSIX threads (a share whose thread cannot be
 * had runs on the caller's after the first). */
static void run_shares(void *(*fn)(void *), void *jobs, size_t size, int64_t threads) {
    pthread_t tids[64];
    int started[64] = {0};
    char *base = (char *)jobs;
    for (int64_t i = 1; i < threads; i++)
        started[i] = pthread_create(&tids[i], NULL, fn, base + i * size) == 0;
    fn(base);
    for (int64_t i = 1; i < threads; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
        else
            fn(base + i * size);
    }
}

static void run_row(const job_t *a, int64_t r) {
    const int64_t D = a->D, G = a->H / a->Hkv;
#define SHAPED(d, g)                    \
    if (D == d && G == g) {             \
        run_row_shaped(a, r, d, g);     \
        return;                         \
    }
    SHAPED(64, 1) SHAPED(64, 2) SHAPED(64, 3) SHAPED(64, 4) SHAPED(64, 8)
    SHAPED(128, 1) SHAPED(128, 2) SHAPED(128, 4) SHAPED(128, 8)
    SHAPED(256, 1) SHAPED(256, 2) SHAPED(256, 4)
#undef SHAPED
    run_row_shaped(a, r, D, G);
}

/* With a shared counter each thread takes the next row until none is left, so a thread that
 * loses its core for a while (a served engine shares the cores with its server and clients)
 * holds up only the row it is on, not a fixed share of them. */
static void *run_rows(void *arg) {
    const job_t *a = (const job_t *)arg;
    for (int64_t r = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED); r < a->rows;
         r = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED))
        run_row(a, r);
    return NULL;
}

/* P: pages in each table row; no length may exceed P * S. threads: at most this many;
 * tokens_per_thread > 0: fewer, one per that many tokens read (all rows together).
 * Returns 0, -1 for shapes past the kernel's limits (the caller checks them first), -2 for a
 * length past the tables (nothing is read then). */
int spin_paged_decode_f32(const float *q, const float *k, const float *v, const int32_t *tables,
                          int64_t stride_b, int64_t stride_h, int64_t P, const int32_t *lens,
                          float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S,
                          float scale, int64_t threads, int64_t tokens_per_thread) {
    if (Hkv <= 0 || H % Hkv || H / Hkv > MAX_G || D > MAX_D || D <= 0 || S <= 0) return -1;
    int64_t tokens = 0;
    for (int64_t b = 0; b < B; b++) {
        if (lens[b] > P * S) return -2;
        tokens += lens[b] > 0 ? lens[b] : 0;
    }
    if (tokens_per_thread > 0 && threads > tokens * Hkv / tokens_per_thread)
        threads = tokens * Hkv / tokens_per_thread;
    const int64_t rows = B * Hkv;
    if (threads > rows) threads = rows;
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    job_t jobs[64];
    int64_t next = 0;
    for (int64_t i = 0; i < threads; i++) {
        job_t j = {q, k, v, tables, lens, out, H, Hkv, D, S, stride_b, stride_h, scale,
                   rows, &next};
        jobs[i] = j;
    }
    run_shares(run_rows, jobs, sizeof(job_t), threads);
    return 0;
}

/* ---- fused layer ops (float32; rows may be strided, the last dimension contiguous) ---------- */

/* out = w * rms_norm(x + res), res_out = x + res (res NULL: normalise x, res_out unwritten). */
void spin_add_rms_norm_f32(const float *x, int64_t sx, const float *res, int64_t sr, const float *w,
                           float *out, float *res_out, int64_t T, int64_t E, float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * sx;
        float *ot = out + t * E;
        const float *st = xt;
        if (res) {
            const float *rt = res + t * sr;
            float *so = res_out + t * E;
#pragma omp simd
            for (int64_t e = 0; e < E; e++) so[e] = xt[e] + rt[e];
            st = so;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t e = 0; e < E; e++) ss += st[e] * st[e];
        const float inv = 1.0f / sqrtf(ss / (float)E + eps);
#pragma omp simd
        for (int64_t e = 0; e < E; e++) ot[e] = w[e] * (st[e] * inv);
    }
}

/* RoPE of one [T, n, D] tensor (rows strided by st, heads by sh) into a contiguous one:
 * y = x * cos + roll(x, D/2) * sin, cos/sin [T, D] contiguous rows (sin's sign folded in).
 * cos NULL: a plain copy (v out of a fused q/k/v GEMM). */
static void rope_one(const float *x, int64_t st, int64_t sh, const float *cos_, const float *sin_,
                     float *y, int64_t T, int64_t n, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ ? cos_ + t * D : NULL, *s = sin_ ? sin_ + t * D : NULL;
        for (int64_t h = 0; h < n; h++) {
            const float *xh = x + t * st + h * sh;
            float *yh = y + (t * n + h) * D;
            if (!c) {
                memcpy(yh, xh, sizeof(float) * D);
                continue;
            }
#pragma omp simd
            for (int64_t d = 0; d < half; d++) yh[d] = xh[d] * c[d] + xh[d + half] * s[d];
#pragma omp simd
            for (int64_t d = half; d < D; d++) yh[d] = xh[d] * c[d] + xh[d - half] * s[d];
        }
    }
}

void spin_rope_qkv_f32(const float *q, int64_t sqt, int64_t sqh, const float *k, int64_t skt, int64_t skh,
                       const float *v, int64_t svt, int64_t svh, const float *cos_, const float *sin_,
                       float *q_out, float *k_out, float *v_out, int64_t T, int64_t H, int64_t Hkv,
                       int64_t D) {
    rope_one(q, sqt, sqh, cos_, sin_, q_out, T, H, D);
    rope_one(k, skt, skh, cos_, sin_, k_out, T, Hkv, D);
    if (v) rope_one(v, svt, svh, NULL, NULL, v_out, T, Hkv, D);
}

/* out = silu(gate) * up: [T, F] rows strided by sg / su, out contiguous. */
void spin_silu_mul_f32(const float *gate, int64_t sg, const float *up, int64_t su, float *out, int64_t T,
                       int64_t F) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate + t * sg, *u = up + t * su;
        float *o = out + t * F;
#pragma omp simd
        for (int64_t f = 0; f < F; f++) /* clamped: no infinity under -ffast-math */
            o[f] = g[f] / (1.0f + expf(fminf(-g[f], 80.0f))) * u[f];
    }
}

/* ---- small-batch linear: out[t] = W x[t] (+ bias), a decode step's GEMMs ------------------- */

/* Rows of x per call (a decode step at batch 1-4) and output features per pass: four weight
 * rows at a time keep four independent FMA chains per x row, where one chain waits on the
 * FMA's latency (eight rows a pass read no faster on the AVX2 EPYC: 8.1 GB/s either way). */
#define GEMV_MAX_T 4
#define GEMV_ROWS 4

typedef struct {
    const float *x, *w, *bias;
    float *out;
    int64_t T, K, N, sx, n0, n1;
} gemv_job_t;

static void *gemv_run(void *arg) {
    const gemv_job_t *a = (const gemv_job_t *)arg;
    const int64_t K = a->K;
    int64_t n = a->n0;
    for (; n + GEMV_ROWS <= a->n1; n += GEMV_ROWS) {
        const float *w0 = a->w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        for (int64_t t = 0; t < a->T; t++) {
            const float *x = a->x + t * a->sx;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t k = 0; k < K; k++) {
                s0 += x[k] * w0[k];
                s1 += x[k] * w1[k];
                s2 += x[k] * w2[k];
                s3 += x[k] * w3[k];
            }
            float *o = a->out + t * a->N + n;
            o[0] = s0 + (a->bias ? a->bias[n] : 0.f);
            o[1] = s1 + (a->bias ? a->bias[n + 1] : 0.f);
            o[2] = s2 + (a->bias ? a->bias[n + 2] : 0.f);
            o[3] = s3 + (a->bias ? a->bias[n + 3] : 0.f);
        }
    }
    for (; n < a->n1; n++) {
        const float *w0 = a->w + n * K;
        for (int64_t t = 0; t < a->T; t++) {
            const float *x = a->x + t * a->sx;
            float s0 = 0.f;
#pragma omp simd reduction(+ : s0)
            for (int64_t k = 0; k < K; k++) s0 += x[k] * w0[k];
            a->out[t * a->N + n] = s0 + (a->bias ? a->bias[n] : 0.f);
        }
    }
    return NULL;
}

/* x [T, K] rows strided by sx (last dimension contiguous), w [N, K] contiguous, bias [N] or
 * NULL, out [T, N] contiguous; T <= GEMV_MAX_T. The N outputs are split over `threads`
 * POSIX threads, the caller's taking the first share. Returns 0, -1 for T past the limit. */
int spin_linear_rows_f32(const float *x, int64_t sx, const float *w, const float *bias, float *out,
                         int64_t T, int64_t K, int64_t N, int64_t threads) {
    if (T < 1 || T > GEMV_MAX_T || K < 1 || N < 1) return -1;
    if (threads > N / 256) threads = N / 256; /* a share under 256 rows is not worth a thread */
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    gemv_job_t jobs[64];
    for (int64_t i = 0; i < threads; i++) {
        /* shares on multiples of GEMV_ROWS, so that only the last one has a tail */
        int64_t n0 = N * i / threads / GEMV_ROWS * GEMV_ROWS, n1 = N * (i + 1) / threads / GEMV_ROWS * GEMV_ROWS;
        if (i == threads - 1) n1 = N;
        gemv_job_t j = {x, w, bias, out, T, K, N, sx, n0, n1};
        jobs[i] = j;
    }
    run_shares(gemv_run, jobs, sizeof(gemv_job_t), threads);
    return 0;
}
