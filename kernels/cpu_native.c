/* The CPU's native kernels (built and called by cpu_native.py): paged decode attention that
 * reads each page where it lies, a small-batch linear (decode's GEMVs), and a decoder layer's
 * element-wise ops fused, one call each
 * where torch runs several operators (the CPU twins of layer_ops.py's Triton kernels).
 *
 * Paged decode attention: one decode token per request against per-head KV pages (the layout of paged_decode.py):
 *   q       [B, H, D]      float32, H = Hkv * G; query head h reads KV head h / G
 *   k, v    [N, S, D]      float32 or float16 pages of any layer / head (spin_paged_decode_f32,
 *                          spin_paged_decode_f16kv); float16 pages are widened as they are read
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
 * link: see there) and no OpenMP runtime (torch brings its own, whose spinning team would
 * fight a second one for the cores): rows are split over `threads` POSIX threads of the
 * pool below (run_shares), whose workers sleep between calls, the caller's thread taking
 * the first share. No infinities arise
 * (scores are only formed for tokens that exist; the running max starts at -FLT_MAX), so
 * -ffast-math's finite-math assumption holds, and it lets expf vectorise through libmvec.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 128
#define MAX_G 16
#define MAX_D 256
#define AHEAD 16 /* tokens: prefetch the K and V rows this far ahead during the scores pass
                    (pages are scattered, so the hardware prefetcher loses the stream at every
                    page boundary; a block's V rows, 32 KB at D 64, are then in cache for the
                    second pass: 16 rows of 512 tokens, pages in DRAM, 1.36 -> 1.24 ms a layer) */

/* float16 K/V pages (cache.kv_cache_dtype): half the bytes a decode step reads, each element
 * widened to float32 as it is loaded (F16C's vcvtph2ps, one instruction a vector), the scores,
 * the softmax and the sums in float32. Compilers without _Float16 build the float32 kernel only
 * (spin_kv_f16_supported says which). */
#if defined(__FLT16_MANT_DIG__)
typedef _Float16 kv_half;
#define HAVE_KV_F16 1
#else
typedef uint16_t kv_half; /* never read: spin_paged_decode_f16kv refuses every call */
#define HAVE_KV_F16 0
#endif

/* A token's K or V row in the pages: es is the element size (4 or 2 bytes). */
static inline const char *row_at(const char *base, const int32_t *tab, int64_t tok, int64_t S,
                                 int64_t D, int64_t es) {
    return base + ((int64_t)tab[tok / S] * S + tok % S) * D * es;
}

/* Into L2 (prefetcht2), not L1: the rows 16 tokens ahead are 64 cache lines of K and V in
 * flight, more than L1's miss buffers hold, and a prefetch into L1 waited for one. A 16-row
 * step of SmolLM2 at 580 tokens, its 30 layers on one thread, pages scattered over 2 GiB in
 * huge pages: 47 -> 32 ms on float32 pages, 34 -> 23 on float16. */
static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(row + i, 0, 1);
}

/* A float16 row widened into dst (L1-resident), 16 or 8 elements an instruction: compilers
 * without AVX512-FP16 convert _Float16 one element at a time (gcc 12: the kernel took 3x the
 * float32 one's time), so the widening is written with F16C / AVX-512 intrinsics. */
static inline __attribute__((always_inline)) void widen_row(const char *src, float *dst, int64_t D) {
    const kv_half *h = (const kv_half *)src;
    int64_t d = 0;
#if HAVE_KV_F16 && defined(__AVX512F__)
    for (; d + 16 <= D; d += 16)
        _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + d))));
#elif HAVE_KV_F16 && defined(__F16C__)
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
#endif
#if HAVE_KV_F16
    for (; d < D; d++) dst[d] = (float)h[d];
#else
    (void)h;
    (void)d;
    (void)dst;
#endif
}

/* A K or V row as float32: the pages' own row, or (F16) the row widened into buf. */
static inline __attribute__((always_inline)) const float *row_f32(const char *row, float *buf, int64_t D,
                                                                  const int F16) {
    if (!F16) return (const float *)row;
    widen_row(row, buf, D);
    return buf;
}

typedef struct job {
    const float *q;
    const char *k, *v; /* float32 or float16 pages */
    const int32_t *tables, *lens;
    float *out;
    int64_t H, Hkv, D, S, stride_b, stride_h;
    float scale;
    int64_t rows;
    int64_t *next; /* shared by the threads of a call: the next row not yet taken */
    void (*row)(const struct job *, int64_t); /* run_row_f32 or run_row_f16 */
} job_t;

/* One (request, KV head) row. Inlined with D and G constant where run_row_f32/_f16 dispatch the common
 * shapes, so that the compiler keeps q and the accumulators in registers and unrolls the dots:
 * SmolLM2's 16 rows of 512 tokens took 0.69 ms a layer with every page in cache through the
 * general form (the arithmetic), about half of the 1.48 ms with the pages in DRAM. */
static inline __attribute__((always_inline)) void run_row_shaped(const job_t *a, int64_t r, const int64_t D,
                                                                  const int64_t G, const int F16) {
    const int64_t Hkv = a->Hkv, S = a->S, es = F16 ? 2 : 4;
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
    float wide[MAX_D]; /* F16: the K or V row being read, widened */
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
            const float *kt = row_f32(row_at(a->k, tab, tok, S, D, es), wide, D, F16);
            if (tok + AHEAD < len) {
                prefetch_row(row_at(a->k, tab, tok + AHEAD, S, D, es), D * es);
                prefetch_row(row_at(a->v, tab, tok + AHEAD, S, D, es), D * es);
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
            const float *vt = row_f32(row_at(a->v, tab, tok, S, D, es), wide, D, F16);
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

/* ---- shares on a persistent pool ----------------------------------------------------------
 *
 * run_shares runs fn once on each of `threads` (<= 64) shares laid out `size` bytes apart from
 * `jobs`. The caller's thread takes the first share and then every share no worker has taken,
 * and returns once all have run. Workers are POSIX threads started on first need and kept,
 * asleep on a condition variable between calls.
 *
 * The shares' work comes from shared counters (a row, a tile), so a call ends when its work
 * is done, whoever did it: the caller never waits for a worker that has not started. Served,
 * the cores are shared with the server and the load client, and a worker that cannot be
 * scheduled at once left the caller waiting at its join when each call started its own
 * threads: a 16-row decode step of SmolLM2 took 115 ms served (90 quiet), 19 ms of it the
 * engine's thread asleep, 30 joins a step. A late worker now finds its share taken and goes
 * back to sleep.
 *
 * A share is claimed by a compare-and-swap on `pool_next`, which holds the call's generation
 * above its next share index: a worker still holding an earlier call's generation can claim
 * nothing of a later one. A call's fields are written before its generation is published and
 * not again until every share of it has run. A forked child has no workers: its caller runs
 * every share itself (pthread_atfork re-initialises the lock). */
#define POOL_MAX 64
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t pool_call_mu = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static int64_t pool_workers = 0, pool_gen = 0;
static void *(*pool_fn)(void *);
static char *pool_jobs;
static size_t pool_size;
static int64_t pool_n;
static uint64_t pool_next;  /* generation << 32 | next share index */
static int64_t pool_done;   /* shares of the current call that have run */
static int pool_atfork = 0;

static int pool_claim(uint64_t gen, int64_t *share) {
    uint64_t v = __atomic_load_n(&pool_next, __ATOMIC_ACQUIRE);
    while ((v >> 32) == gen && (int64_t)(v & 0xffffffffu) < __atomic_load_n(&pool_n, __ATOMIC_ACQUIRE)) {
        if (__atomic_compare_exchange_n(&pool_next, &v, v + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *share = (int64_t)(v & 0xffffffffu);
            return 1;
        }
    }
    return 0;
}

static void pool_run(uint64_t gen) {
    int64_t i;
    while (pool_claim(gen, &i)) {
        pool_fn(pool_jobs + i * pool_size);
        __atomic_fetch_add(&pool_done, 1, __ATOMIC_RELEASE);
    }
}

static void *pool_worker(void *arg) {
    (void)arg;
    int64_t seen = 0;
    pthread_mutex_lock(&pool_mu);
    for (;;) {
        while (pool_gen == seen) pthread_cond_wait(&pool_cv, &pool_mu);
        seen = pool_gen;
        pthread_mutex_unlock(&pool_mu);
        pool_run((uint64_t)seen & 0xffffffffu);
        pthread_mutex_lock(&pool_mu);
    }
    return NULL;
}

static void pool_after_fork(void) {
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_cv, NULL);
    pthread_mutex_init(&pool_call_mu, NULL);
    pool_workers = 0;
}

static void run_shares(void *(*fn)(void *), void *jobs, size_t size, int64_t threads) {
    if (threads <= 1) {
        fn(jobs);
        return;
    }
    pthread_mutex_lock(&pool_call_mu);
    pthread_mutex_lock(&pool_mu);
    if (!pool_atfork) pool_atfork = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    while (pool_workers < threads - 1 && pool_workers < POOL_MAX - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, pool_worker, NULL) != 0) break; /* the caller runs the rest */
        pthread_detach(t);
        pool_workers++;
    }
    const uint64_t gen = (uint64_t)(++pool_gen) & 0xffffffffu;
    pool_fn = fn;
    pool_jobs = (char *)jobs;
    pool_size = size;
    __atomic_store_n(&pool_n, threads, __ATOMIC_RELEASE);
    __atomic_store_n(&pool_done, 1, __ATOMIC_RELEASE); /* share 0: the caller's, below */
    __atomic_store_n(&pool_next, gen << 32 | 1u, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
    fn(jobs);
    pool_run(gen); /* the shares no worker has taken yet: nothing left to do in them, mostly */
    for (int spins = 0; __atomic_load_n(&pool_done, __ATOMIC_ACQUIRE) < threads; spins++) {
        if (spins < 2000)
            __builtin_ia32_pause();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&pool_call_mu);
}

/* The common shapes with D, G and the pages' element type constant (see run_row_shaped). */
#define SHAPES(F16)                                                                            \
    SHAPED(64, 1, F16) SHAPED(64, 2, F16) SHAPED(64, 3, F16) SHAPED(64, 4, F16) SHAPED(64, 8, F16) \
    SHAPED(128, 1, F16) SHAPED(128, 2, F16) SHAPED(128, 4, F16) SHAPED(128, 8, F16)             \
    SHAPED(256, 1, F16) SHAPED(256, 2, F16) SHAPED(256, 4, F16)
#define SHAPED(d, g, F16)                \
    if (D == d && G == g) {              \
        run_row_shaped(a, r, d, g, F16); \
        return;                          \
    }

static void run_row_f32(const job_t *a, int64_t r) {
    const int64_t D = a->D, G = a->H / a->Hkv;
    SHAPES(0)
    run_row_shaped(a, r, D, G, 0);
}

static void run_row_f16(const job_t *a, int64_t r) {
    const int64_t D = a->D, G = a->H / a->Hkv;
    SHAPES(1)
    run_row_shaped(a, r, D, G, 1);
}
#undef SHAPED
#undef SHAPES

/* With a shared counter each thread takes the next row until none is left, so a thread that
 * loses its core for a while (a served engine shares the cores with its server and clients)
 * holds up only the row it is on, not a fixed share of them. */
static void *run_rows(void *arg) {
    const job_t *a = (const job_t *)arg;
    for (int64_t r = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED); r < a->rows;
         r = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED))
        a->row(a, r);
    return NULL;
}

static int paged_decode(const float *q, const char *k, const char *v, const int32_t *tables,
                        int64_t stride_b, int64_t stride_h, int64_t P, const int32_t *lens, float *out,
                        int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S, float scale,
                        int64_t threads, int64_t tokens_per_thread, void (*row)(const job_t *, int64_t)) {
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
                   rows, &next, row};
        jobs[i] = j;
    }
    run_shares(run_rows, jobs, sizeof(job_t), threads);
    return 0;
}

/* P: pages in each table row; no length may exceed P * S. threads: at most this many;
 * tokens_per_thread > 0: fewer, one per that many tokens read (all rows together).
 * Returns 0, -1 for shapes past the kernel's limits (the caller checks them first), -2 for a
 * length past the tables (nothing is read then). */
int spin_paged_decode_f32(const float *q, const float *k, const float *v, const int32_t *tables,
                          int64_t stride_b, int64_t stride_h, int64_t P, const int32_t *lens,
                          float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S,
                          float scale, int64_t threads, int64_t tokens_per_thread) {
    return paged_decode(q, (const char *)k, (const char *)v, tables, stride_b, stride_h, P, lens, out, B, H,
                        Hkv, D, S, scale, threads, tokens_per_thread, run_row_f32);
}

/* The same over float16 pages (q and out float32); -3 where the compiler has no _Float16. */
int spin_paged_decode_f16kv(const float *q, const void *k, const void *v, const int32_t *tables,
                            int64_t stride_b, int64_t stride_h, int64_t P, const int32_t *lens,
                            float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S,
                            float scale, int64_t threads, int64_t tokens_per_thread) {
    if (!HAVE_KV_F16) return -3;
    return paged_decode(q, (const char *)k, (const char *)v, tables, stride_b, stride_h, P, lens, out, B, H,
                        Hkv, D, S, scale, threads, tokens_per_thread, run_row_f16);
}

int spin_kv_f16_supported(void) { return HAVE_KV_F16; }

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

/* Rows of x per call (a decode step at batch 1-4). Each weight row is one dot product per x
 * row, read from memory once (the x rows' later products find it in L1). One weight row at a
 * time, not several side by side: on the 2-vCPU AVX-512 EPYC (Zen 4) a [49152, 576] weight at
 * one x row read 22.6 GB/s one row at a time against 13.9 four rows at a time and 16.5 eight
 * (x86-64-v3; 19.1, 13.3 and 16.5 with AVX-512), where one thread's plain sum of 512 MB reads
 * 19 GB/s: the interleaved rows' loop vectorised into more loads and shuffles per FMA than the
 * memory system hides. */
#define GEMV_MAX_T 4

typedef struct {
    const float *x, *w, *bias;
    float *out;
    int64_t T, K, N, sx, n0, n1;
} gemv_job_t;

static void *gemv_run(void *arg) {
    const gemv_job_t *a = (const gemv_job_t *)arg;
    const int64_t K = a->K;
    for (int64_t n = a->n0; n < a->n1; n++) {
        const float *w0 = a->w + n * K;
        const float b = a->bias ? a->bias[n] : 0.f;
        for (int64_t t = 0; t < a->T; t++) {
            const float *x = a->x + t * a->sx;
            float s0 = 0.f;
#pragma omp simd reduction(+ : s0)
            for (int64_t k = 0; k < K; k++) s0 += x[k] * w0[k];
            a->out[t * a->N + n] = s0 + b;
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
        int64_t n0 = N * i / threads, n1 = N * (i + 1) / threads;
        gemv_job_t j = {x, w, bias, out, T, K, N, sx, n0, n1};
        jobs[i] = j;
    }
    run_shares(gemv_run, jobs, sizeof(gemv_job_t), threads);
    return 0;
}

/* ---- causal prefill attention: a chunk of queries against its context --------------------- */

/* q [n, H, D] at positions qpos0 .. qpos0 + n - 1 (tokens strided by sq_t, heads by sq_h);
 * k, v [T keys, Hkv heads, D] at positions kpos0 .. kpos0 + T - 1 (strides sk_t/sk_h,
 * sv_t/sv_h); out [n, H, D] contiguous. Query head h reads KV head h / G. The query at
 * position p sees the keys at positions p - window + 1 .. p (window 0: every earlier one).
 *
 * A flash attention over tiles: a work item is one KV head's G query heads over PROWS / G
 * query tokens (their rows share every K and V row read), swept over blocks of PK keys with
 * an online softmax. Per block, the scores are a register-blocked GEMM of the item's queries
 * (pre-scaled, copied once) against the block's keys (transposed once per call into [D][PK]
 * tiles), and the output a second one of the probabilities against the V rows where
 * they lie: each loaded key or value vector feeds PMR rows' FMAs from registers, where the
 * row-at-a-time dot products of the decode kernel above load two operands per FMA. Items
 * are taken from a shared counter, the longest (the last query tokens) first, so that a
 * thread which loses its core holds up one item, not a fixed share of them. */
#if defined(__AVX512F__)
#define PVL 16 /* floats in a vector */
#define PMR 6  /* rows per register block: 6 rows x 4 vectors of accumulators + 4 loads of 32 */
#define PNV 4  /* vectors per register block (64 keys or 64 dimensions) */
#else
#define PVL 8
#define PMR 6 /* AVX2: 16 registers: 6 x 2 accumulators + 2 loads + a broadcast (the 4 rows
                 * it had: SmolLM2's 2048-token layer on one thread 89 ms against 63) */
#define PNV 2
#endif
#define PK 64          /* keys per block: a multiple of PNV * PVL on either ISA */
#define PROWS 96       /* target rows (G x tokens) per item */
#define PMAX_ROWS 128  /* rows per item at most */
#define NEG_BIG (-1e30f) /* a masked score: finite (-ffast-math), exp(NEG_BIG - m) = 0 */

typedef float pvec __attribute__((vector_size(PVL * 4), aligned(4)));
typedef int32_t pivec __attribute__((vector_size(PVL * 4), aligned(4)));

/* Lane-wise max (C has no ?: on vectors; a compare's lanes are all ones or zeros). */
static inline __attribute__((always_inline)) pvec pf_max(pvec a, pvec b) {
    const pivec gt = a > b;
    return (pvec)(((pivec)a & gt) | ((pivec)b & ~gt));
}

/* The largest and the sum of a vector's lanes, halving the vector log2(PVL) times. */
static inline __attribute__((always_inline)) float pf_hmax(pvec x) {
#if PVL == 16
    x = pf_max(x, __builtin_shuffle(x, (pivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    x = pf_max(x, __builtin_shuffle(x, (pivec){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
#else
    x = pf_max(x, __builtin_shuffle(x, (pivec){4, 5, 6, 7, 0, 1, 2, 3}));
#endif
    return fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
}

static inline __attribute__((always_inline)) float pf_hsum(pvec x) {
#if PVL == 16
    x += __builtin_shuffle(x, (pivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (pivec){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
#else
    x += __builtin_shuffle(x, (pivec){4, 5, 6, 7, 0, 1, 2, 3});
#endif
    return (x[0] + x[1]) + (x[2] + x[3]);
}

/* exp(x) for x <= 0 (a score less the running max), in vector registers: x = n ln2 + r with
 * |r| <= ln2 / 2 (ln2 in two parts), exp(r) by Cephes' expf polynomial (about 1 ulp),
 * 2^n put in the exponent bits; 0 below -87 (a masked score among them). Measured level with
 * libmvec's expf (60.1 against 60.4 ms a SmolLM2 layer on one thread); it keeps the softmax
 * pass in vector registers beside pf_hmax and pf_hsum, which gave the 5% (57.5 ms). */
static inline __attribute__((always_inline)) pvec pf_exp(pvec x) {
    const pivec keep = x >= -87.0f;
    x = pf_max(x, (pvec){0} - 87.0f);
    const pivec n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, pivec); /* round: x <= 0 */
    const pvec fn = __builtin_convertvector(n, pvec);
    const pvec r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    pvec p = (pvec){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const pivec scale = (n + 127) << 23;
    pvec y;
    memcpy(&y, &scale, sizeof y);
    return (pvec)((pivec)(p * y) & keep);
}

typedef struct {
    const float *q, *kt, *v; /* kt [Hkv][T / PK blocks][D][PK]: the keys transposed, zeros past T */
    float *out;
    int64_t sq_t, sq_h, ldk, sv_t, sv_h;
    int64_t n, H, Hkv, D, T, qpos0, kpos0, window, tokens;
    float scale;
    int64_t items;
    int64_t *next, *done; /* shared: the next item not yet taken; items finished */
} pf_job_t;

/* s[r][c0 .. c0 + PNV*PVL) = qs[r] . kt[:, c] for MR rows from r0; kt [D][PK], qs [rows][D]. */
static inline __attribute__((always_inline)) void pf_scores(const float *qs, const float *kt, float *s, int64_t r0,
                                                            int64_t c0, int64_t D, const int MR) {
    pvec acc[PMR][PNV];
    for (int m = 0; m < MR; m++)
        for (int u = 0; u < PNV; u++) acc[m][u] = (pvec){0};
    for (int64_t d = 0; d < D; d++) {
        pvec kv[PNV];
        for (int u = 0; u < PNV; u++) kv[u] = *(const pvec *)(kt + d * PK + c0 + u * PVL);
        for (int m = 0; m < MR; m++) {
            const float qd = qs[(r0 + m) * D + d];
            for (int u = 0; u < PNV; u++) acc[m][u] += qd * kv[u];
        }
    }
    for (int m = 0; m < MR; m++)
        for (int u = 0; u < PNV; u++) *(pvec *)(s + (r0 + m) * PK + c0 + u * PVL) = acc[m][u];
}

/* o[r][d0 .. d0 + PNV*PVL) = o[r][..] * corr[r] + sum_j p[r][j] v_j[..] for MR rows from r0. */
static inline __attribute__((always_inline)) void pf_values(const float *p, const float *vrow, int64_t sv,
                                                            int64_t nk, float *o, const float *corr, int64_t r0,
                                                            int64_t d0, int64_t D, const int MR) {
    pvec acc[PMR][PNV];
    for (int m = 0; m < MR; m++)
        for (int u = 0; u < PNV; u++) acc[m][u] = *(const pvec *)(o + (r0 + m) * D + d0 + u * PVL) * corr[r0 + m];
    for (int64_t j = 0; j < nk; j++) {
        pvec vv[PNV];
        const float *vj = vrow + j * sv + d0;
        for (int u = 0; u < PNV; u++) vv[u] = *(const pvec *)(vj + u * PVL);
        for (int m = 0; m < MR; m++) {
            const float pj = p[(r0 + m) * PK + j];
            for (int u = 0; u < PNV; u++) acc[m][u] += pj * vv[u];
        }
    }
    for (int m = 0; m < MR; m++)
        for (int u = 0; u < PNV; u++) *(pvec *)(o + (r0 + m) * D + d0 + u * PVL) = acc[m][u];
}

static void pf_item(const pf_job_t *a, int64_t item, float *qs, float *o, float *s, float *m, float *l,
                    float *corr) {
    const int64_t G = a->H / a->Hkv, D = a->D, tokens = a->tokens;
    const int64_t blocks = (a->n + tokens - 1) / tokens;
    const int64_t qb = blocks - 1 - item / a->Hkv, hk = item % a->Hkv; /* the longest first */
    const int64_t i0 = qb * tokens, i1 = i0 + tokens < a->n ? i0 + tokens : a->n;
    const int64_t rows = (i1 - i0) * G;
    /* rows r = (i - i0) * G + g: query token i, head hk * G + g */
    for (int64_t i = i0; i < i1; i++)
        for (int64_t g = 0; g < G; g++) {
            const float *src = a->q + i * a->sq_t + (hk * G + g) * a->sq_h;
            float *dst = qs + ((i - i0) * G + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = src[d] * a->scale;
        }
    memset(o, 0, sizeof(float) * rows * D);
    for (int64_t r = 0; r < rows; r++) {
        m[r] = NEG_BIG;
        l[r] = 0.0f;
    }
    /* keys this item's queries see: positions lo .. hi */
    const int64_t plast = a->qpos0 + i1 - 1, pfirst = a->qpos0 + i0;
    int64_t lo = a->window > 0 ? pfirst - a->window + 1 : a->kpos0;
    if (lo < a->kpos0) lo = a->kpos0;
    int64_t j_lo = (lo - a->kpos0) / PK * PK, j_hi = plast - a->kpos0 + 1; /* key indices [j_lo, j_hi), j_lo
                                                                          on a tile */
    if (j_hi > a->T) j_hi = a->T;
    const float *kth = a->kt + hk * D * a->ldk, *vh = a->v + hk * a->sv_h; /* ldk: keys rounded up to PK */
    const int64_t full = D / (PNV * PVL) * (PNV * PVL);
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += PK) {
        const int64_t nk = j_hi - j0 < PK ? j_hi - j0 : PK;
        const float *kt = kth + j0 * D; /* the block's [D][PK] tile (j0 a multiple of PK) */
        int64_t r = 0;
        for (; r + PMR <= rows; r += PMR)
            for (int64_t c0 = 0; c0 < PK; c0 += PNV * PVL) pf_scores(qs, kt, s, r, c0, D, PMR);
        for (; r < rows; r++)
            for (int64_t c0 = 0; c0 < PK; c0 += PNV * PVL) pf_scores(qs, kt, s, r, c0, D, 1);
        /* mask (the causal edge, the window's far edge, the block's end), online softmax */
        const int64_t kp0 = a->kpos0 + j0; /* position of the block's first key */
        for (int64_t rr = 0; rr < rows; rr++) {
            const int64_t qp = a->qpos0 + i0 + rr / G;
            float *sr = s + rr * PK;
            int64_t hi = qp - kp0 + 1; /* keys [.., hi) of the block are not in the future */
            if (hi > nk) hi = nk;
            int64_t lo_c = a->window > 0 ? qp - a->window + 1 - kp0 : 0;
            if (lo_c < 0) lo_c = 0;
            for (int64_t c = 0; c < lo_c && c < PK; c++) sr[c] = NEG_BIG;
            for (int64_t c = hi > 0 ? hi : 0; c < PK; c++) sr[c] = NEG_BIG;
            float mx = m[rr];
            pvec vm = (pvec){0} + mx;
            for (int64_t c = 0; c < PK; c += PVL) {
                const pvec x = *(const pvec *)(sr + c);
                vm = pf_max(x, vm);
            }
            mx = pf_hmax(vm);
            if (mx == NEG_BIG) { /* nothing visible yet: p = 0, the state is unchanged */
                memset(sr, 0, sizeof(float) * PK);
                corr[rr] = 1.0f;
                continue;
            }
            pvec vs = (pvec){0};
            for (int64_t c = 0; c < PK; c += PVL) {
                const pvec e = pf_exp(*(const pvec *)(sr + c) - mx);
                *(pvec *)(sr + c) = e;
                vs += e;
            }
            const float sum = pf_hsum(vs);
            corr[rr] = m[rr] == NEG_BIG ? 0.0f : expf(m[rr] - mx); /* nothing held yet: no slow underflow */
            l[rr] = l[rr] * corr[rr] + sum;
            m[rr] = mx;
        }
        const float *vb = vh + j0 * a->sv_t;
        r = 0;
        for (; r + PMR <= rows; r += PMR)
            for (int64_t d0 = 0; d0 < full; d0 += PNV * PVL) pf_values(s, vb, a->sv_t, nk, o, corr, r, d0, D, PMR);
        for (; r < rows; r++)
            for (int64_t d0 = 0; d0 < full; d0 += PNV * PVL) pf_values(s, vb, a->sv_t, nk, o, corr, r, d0, D, 1);
        for (int64_t rr = 0; rr < rows && full < D; rr++)
            for (int64_t d = full; d < D; d++) {
                float acc = o[rr * D + d] * corr[rr];
                for (int64_t j = 0; j < nk; j++) acc += s[rr * PK + j] * vb[j * a->sv_t + d];
                o[rr * D + d] = acc;
            }
    }
    for (int64_t i = i0; i < i1; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t rr = (i - i0) * G + g;
            const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
            float *dst = a->out + (i * a->H + hk * G + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = o[rr * D + d] * inv;
        }
}

static void *pf_run(void *arg) {
    const pf_job_t *a = (const pf_job_t *)arg;
    const int64_t rows = a->tokens * (a->H / a->Hkv), D = a->D;
    /* one scratch per thread: queries, outputs, scores, softmax state */
    float *buf = (float *)malloc(sizeof(float) * (2 * rows * D + rows * PK + 3 * rows));
    if (!buf) return NULL;
    float *qs = buf, *o = qs + rows * D, *s = o + rows * D;
    float *m = s + rows * PK, *l = m + rows, *corr = l + rows;
    for (int64_t it = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED); it < a->items;
         it = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED))
    {
        pf_item(a, it, qs, o, s, m, l, corr);
        __atomic_fetch_add(a->done, 1, __ATOMIC_RELAXED);
    }
    free(buf);
    return NULL;
}

/* Returns 0; -1 for shapes past the limits (checked by the caller first); -3 when no thread
 * could have its scratch (out is then incomplete). */
int spin_prefill_attention_f32(const float *q, int64_t sq_t, int64_t sq_h, const float *k, int64_t sk_t,
                               int64_t sk_h, const float *v, int64_t sv_t, int64_t sv_h, float *out, int64_t n,
                               int64_t H, int64_t Hkv, int64_t D, int64_t T, int64_t qpos0, int64_t kpos0,
                               int64_t window, float scale, int64_t threads) {
    if (Hkv <= 0 || H % Hkv || H / Hkv > PMAX_ROWS || D <= 0 || D > MAX_D || n <= 0 || T <= 0) return -1;
    const int64_t G = H / Hkv;
    int64_t tokens = PROWS / G;
    if (tokens < 1) tokens = 1;
    if (tokens > n) tokens = n;
    const int64_t items = (n + tokens - 1) / tokens * Hkv;
    if (threads > items) threads = items;
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    /* The keys transposed once, a [D][PK] tile per block of PK keys, for every item to read:
     * each item transposing its own blocks cost 10% of the kernel (the earlier keys are every
     * item's), and one [D][T] matrix puts a block's D rows a multiple of 4 KB apart, all in
     * the same L1 sets. */
    const int64_t ldk = (T + PK - 1) / PK * PK;
    float *kt = (float *)malloc(sizeof(float) * Hkv * D * ldk);
    if (!kt) return -3;
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t j0 = 0; j0 < ldk; j0 += PK)
            for (int64_t jj = 0; jj < PK; jj += 16) /* 16 keys at a time: whole cache lines written */
                for (int64_t d = 0; d < D; d++) {
                    float *dst = kt + h * D * ldk + j0 * D + d * PK + jj;
                    for (int64_t j = 0; j < 16; j++)
                        dst[j] = j0 + jj + j < T ? k[(j0 + jj + j) * sk_t + h * sk_h + d] : 0.0f;
                }
    pf_job_t jobs[64];
    int64_t next = 0, done = 0;
    for (int64_t i = 0; i < threads; i++) {
        pf_job_t j = {q, kt, v, out, sq_t, sq_h, ldk, sv_t, sv_h, n, H, Hkv, D, T, qpos0, kpos0, window, tokens,
                      scale, items, &next, &done};
        jobs[i] = j;
    }
    run_shares(pf_run, jobs, sizeof(pf_job_t), threads);
    free(kt);
    return done == items ? 0 : -3;
}
