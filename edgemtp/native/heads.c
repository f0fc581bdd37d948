/* Learned heads (models/heads.py: Medusa and residual) run on the host in C.

   The heads graphs (heads/<kind>.onnx) stay the package's portable artifact; this computes
   the same function for one hidden state at a time, where onnxruntime spends most of a run on
   per-node overhead: a 4-head residual graph on stories260K is ~30 kernels, ~30 us, against a
   ~230 us forward of the base model. Float sums run in a fixed order with 8 partial sums
   (the compiler turns them into SIMD lanes), so results differ from onnxruntime's in the last
   bits: the drafts may differ in a near-tie, never the committed tokens (verification decides).
   Built with -march=native where the compiler takes it (the build is per machine).
   runtimes/heads.py checks each loaded file against its onnxruntime session before using it.

   Layout: every matrix is row-major with the reduction axis contiguous (dot products):
     medusa   w1 [H*d, d], b1 [H*d], scale [d]          z = unit(h) w1^T + b1
                                                        s_j = h + scale * silu(z_j)
     residual wh [w, d], wd [d, w], bd [d] or NULL       y = silu(u + unit(h) wh^T)
              table [C, w] (the chain's first-layer     h = h + y wd^T (+ bd)
              rows), u0 [w] the root's row              u = table[argmax_c h . chain_c]
   lm [M, d]: the LM-head rows the heads score, passed as panels of 8 rows ([ceil(M / 8), d,
   8], zero rows past M; see panel_scores); chain = its first C rows.
   Output: per head the top-k of the log-softmax over M rows, ids (row indices, first maximal
   index first on ties, as onnxruntime's TopK) and log-probs. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "v8.h"


/* o[r] = a . b[r] for 4 rows of b (stride n): four independent sums, so the loop is bound by
   throughput, not by the latency of one chain of adds */
static inline void dots4(const float *a, const float *b, int n, float *o) {
    v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    const float *b0 = b, *b1 = b + n, *b2 = b + 2 * (int64_t)n, *b3 = b + 3 * (int64_t)n;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 x = load8(a + i);
        s0 += x * load8(b0 + i);
        s1 += x * load8(b1 + i);
        s2 += x * load8(b2 + i);
        s3 += x * load8(b3 + i);
    }
    float t0 = sum8(s0), t1 = sum8(s1), t2 = sum8(s2), t3 = sum8(s3);
    for (; i < n; i++) {
        t0 += a[i] * b0[i];
        t1 += a[i] * b1[i];
        t2 += a[i] * b2[i];
        t3 += a[i] * b3[i];
    }
    o[0] = t0;
    o[1] = t1;
    o[2] = t2;
    o[3] = t3;
}

static inline float dot(const float *a, const float *b, int n) {
    v8 acc = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
    float s = sum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* o[r] = a . b[r] for rows r < m of b (stride n) */
static inline void matvec(const float *a, const float *b, int m, int n, float *o) {
    int r = 0;
    for (; r + 4 <= m; r += 4) dots4(a, b + (int64_t)r * n, n, o + r);
    for (; r < m; r++) o[r] = dot(a, b + (int64_t)r * n, n);
}

static inline void unit(const float *x, float *out, int d) {
    /* x / sqrt(mean(x^2) + 1e-6), as onnxruntime's RMS normalisation with unit gains */
    float ss = dot(x, x, d);
    float inv = 1.0f / sqrtf(ss / (float)d + 1e-6f);
    for (int i = 0; i < d; i++) out[i] = x[i] * inv;
}

static inline float silu(float z) { return z / (1.0f + fexp(-z)); }

/* y = silu(u + y), 8 lanes at a time */
static inline void silu_add(float *y, const float *u, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 z = load8(y + i) + load8(u + i);
        z = z / (1.0f + vexp(-z));
        memcpy(y + i, &z, 32);
    }
    for (; i < n; i++) y[i] = silu(u[i] + y[i]);
}

/* the largest of s[0..n), n >= 1 */
static inline float max_of(const float *s, int n) {
    float mx = s[0];
    int c = 0;
    if (n >= 8) {
        v8 vm = load8(s);
        for (c = 8; c + 8 <= n; c += 8) vm = max8(vm, load8(s + c));
        for (int l = 0; l < 8; l++) mx = vm[l] > mx ? vm[l] : mx;
    }
    for (; c < n; c++) mx = s[c] > mx ? s[c] : mx;
    return mx;
}

/* the first index of the largest of s[0..n) (as argmax) */
static inline int first_max(const float *s, int n) {
    float mx = max_of(s, n);
    for (int c = 0; c < n; c++)
        if (s[c] == mx) return c;
    return 0;
}

/* a before b in the top-k order: the larger value, the lower index on ties */
static inline int ahead(float va, int64_t ia, float vb, int64_t ib) {
    return va > vb || (va == vb && ia < ib);
}

/* restore the heap below slot i: lp/ids hold a heap whose root is the last of the k kept */
static inline void sift(float *lp, int64_t *ids, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && ahead(lp[w], ids[w], lp[l], ids[l])) w = l;
        if (r < n && ahead(lp[w], ids[w], lp[r], ids[r])) w = r;
        if (w == i) return;
        float tv = lp[i];
        int64_t ti = ids[i];
        lp[i] = lp[w];
        ids[i] = ids[w];
        lp[w] = tv;
        ids[w] = ti;
        i = w;
    }
}

/* top-k of s[0..m) into ids/lp as log-softmax values, best first, ties by lower index (as
   onnxruntime's TopK): a heap of the k best so far, then sorted */
static inline void topk_logsoftmax(const float *s, int m, int k, int64_t *ids, float *lp) {
    float mx = max_of(s, m);
    int c;
    v8 acc = {0};
    for (c = 0; c + 8 <= m; c += 8) acc += vexp(load8(s + c) - mx);
    float sum = sum8(acc);
    for (; c < m; c++) sum += fexp(s[c] - mx);
    float lse = mx + logf(sum);
    /* only values >= t can be among the k largest, where t is the k-th largest maximum of
       the blocks of 8: those k blocks hold k values >= t. The heap then sees a few more
       than k values instead of m (its updates, not the scan, were the cost at k = 30) */
    int nb = m / 8, n = 0;
    float t = -INFINITY;
    if (nb >= 2 * k && k <= 64) {
        float heap[64] = {-INFINITY};  /* a min-heap of the k largest block maxima so far */
        for (int b = 0; b < nb; b++) {
            v8 q = load8(s + 8 * b);
            float bm = q[0];
            for (int l = 1; l < 8; l++) bm = q[l] > bm ? q[l] : bm;
            if (b < k) {
                int i = b;
                heap[i] = bm;
                while (i > 0 && heap[(i - 1) / 2] > heap[i]) {
                    float x = heap[i];
                    heap[i] = heap[(i - 1) / 2];
                    heap[(i - 1) / 2] = x;
                    i = (i - 1) / 2;
                }
            } else if (bm > heap[0]) {
                int i = 0;
                heap[0] = bm;
                for (;;) {
                    int l = 2 * i + 1, r = l + 1, w = i;
                    if (l < k && heap[l] < heap[w]) w = l;
                    if (r < k && heap[r] < heap[w]) w = r;
                    if (w == i) break;
                    float x = heap[i];
                    heap[i] = heap[w];
                    heap[w] = x;
                    i = w;
                }
            }
        }
        t = heap[0];
    }
    for (c = 0; c < m; c++) {
        float v = s[c];
        if (!(v >= t)) continue;
        if (n < k) {
            lp[n] = v;
            ids[n] = c;
            if (++n == k)
                for (int i = k / 2 - 1; i >= 0; i--) sift(lp, ids, k, i);
        } else if (v > lp[0]) {  /* (an equal value has a higher index: it stays out) */
            lp[0] = v;
            ids[0] = c;
            sift(lp, ids, k, 0);
        }
    }
    for (; n < k; n++) {  /* (fewer than k comparable values: NaN scores) */
        lp[n] = -INFINITY;
        ids[n] = 0;
    }
    for (int i = 1; i < k; i++) {  /* best first */
        float v = lp[i];
        int64_t x = ids[i];
        int j = i;
        for (; j > 0 && ahead(v, x, lp[j - 1], ids[j - 1]); j--) {
            lp[j] = lp[j - 1];
            ids[j] = ids[j - 1];
        }
        lp[j] = v;
        ids[j] = x;
    }
    for (int i = 0; i < k; i++) lp[i] -= lse;
}

/* o[r] = a . row r for r < 8 * panels, the rows held as panels of 8 ([panels, n, 8]: row
   8p + l, element i at P[(p n + i) 8 + l]); 4 panels at a time, so 4 independent sums and no
   horizontal adds */
static inline void panel_scores(const float *a, const float *pm, int panels, int n, float *o) {
    int p = 0;
    for (; p + 4 <= panels; p += 4) {
        const float *q = pm + (int64_t)p * n * 8;
        v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (int i = 0; i < n; i++) {
            v8 x = (v8){0} + a[i];
            s0 += x * load8(q + (int64_t)i * 8);
            s1 += x * load8(q + ((int64_t)n + i) * 8);
            s2 += x * load8(q + (2 * (int64_t)n + i) * 8);
            s3 += x * load8(q + (3 * (int64_t)n + i) * 8);
        }
        memcpy(o + (int64_t)p * 8, &s0, 32);
        memcpy(o + (int64_t)p * 8 + 8, &s1, 32);
        memcpy(o + (int64_t)p * 8 + 16, &s2, 32);
        memcpy(o + (int64_t)p * 8 + 24, &s3, 32);
    }
    for (; p < panels; p++) {
        const float *q = pm + (int64_t)p * n * 8;
        v8 s0 = {0};
        for (int i = 0; i < n; i++) s0 += ((v8){0} + a[i]) * load8(q + (int64_t)i * 8);
        memcpy(o + (int64_t)p * 8, &s0, 32);
    }
}

#define PANELS(m) (((m) + 7) / 8)

/* panel_scores for `heads` vectors a [heads, n] at once, out [heads, ostride]: each panel is
   read once for 4 vectors (the rows of a large LM head come from memory once a run) */
static inline void panel_scores_multi(const float *a, int heads, const float *pm, int panels,
                                      int n, float *o, int64_t ostride) {
    int j = 0;
    for (; j + 4 <= heads; j += 4) {
        const float *a0 = a + (int64_t)j * n, *a1 = a0 + n, *a2 = a1 + n, *a3 = a2 + n;
        for (int p = 0; p < panels; p++) {
            const float *q = pm + (int64_t)p * n * 8;
            v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            for (int i = 0; i < n; i++) {
                v8 r = load8(q + (int64_t)i * 8);
                s0 += r * a0[i];
                s1 += r * a1[i];
                s2 += r * a2[i];
                s3 += r * a3[i];
            }
            memcpy(o + j * ostride + (int64_t)p * 8, &s0, 32);
            memcpy(o + (j + 1) * ostride + (int64_t)p * 8, &s1, 32);
            memcpy(o + (j + 2) * ostride + (int64_t)p * 8, &s2, 32);
            memcpy(o + (j + 3) * ostride + (int64_t)p * 8, &s3, 32);
        }
    }
    for (; j < heads; j++) panel_scores(a + (int64_t)j * n, pm, panels, n, o + j * ostride);
}

/* lm: the M LM-head rows as panels (panel_scores). work: at least
   heads * (8 PANELS(m) + d) + 8 PANELS(m) + 2 d + w floats */
int heads_medusa(int d, int heads, int m, int k, const float *h, const float *w1,
                 const float *b1, const float *scale, const float *lm, float *work,
                 int64_t *ids, float *lp) {
    if (d < 1 || heads < 1 || k < 1 || k > m) return -1;
    int64_t mp = 8 * (int64_t)PANELS(m);
    float *uh = work, *st = work + d, *sc = st + (int64_t)heads * d;
    unit(h, uh, d);
    matvec(uh, w1, heads * d, d, st);
    silu_add(st, b1, heads * d);  /* silu(z + b1), 8 lanes at a time */
    for (int j = 0; j < heads; j++) {
        float *sj = st + (int64_t)j * d;
        for (int i = 0; i < d; i++) sj[i] = h[i] + scale[i] * sj[i];
    }
    panel_scores_multi(st, heads, lm, PANELS(m), d, sc, mp);
    for (int j = 0; j < heads; j++)
        topk_logsoftmax(sc + j * mp, m, k, ids + (int64_t)j * k, lp + (int64_t)j * k);
    return 0;
}

/* chain: the first c rows of lm (c == m: the chain's scores are the heads' logits); lm as
   panels. work: at least heads * (8 PANELS(m) + d) + 8 PANELS(m) + 2 d + w floats */
int heads_residual(int d, int w, int heads, int c, int m, int k, const float *h0,
                   const float *u0, const float *wh, const float *wd, const float *bd,
                   const float *table, const float *lm, float *work, int64_t *ids, float *lp) {
    if (d < 1 || w < 1 || heads < 1 || c < 1 || c > m || k < 1 || k > m) return -1;
    int reuse = c == m;
    int64_t mp = 8 * (int64_t)PANELS(m);
    float *uh = work, *y = uh + d, *st = y + w, *sc = st + (int64_t)heads * d;
    float *chain = reuse ? sc : sc + (int64_t)heads * mp;
    const float *u = u0, *h = h0;
    for (int j = 0; j < heads; j++) {
        float *hn = st + (int64_t)j * d;
        unit(h, uh, d);
        matvec(uh, wh, w, d, y);
        silu_add(y, u, w);
        matvec(y, wd, d, w, hn);
        for (int i = 0; i < d; i++) hn[i] = h[i] + (hn[i] + (bd ? bd[i] : 0.0f));
        h = hn;
        if (j + 1 < heads || reuse) {
            float *s = reuse ? sc + (int64_t)j * mp : chain;
            panel_scores(h, lm, PANELS(c), d, s);
            u = table + (int64_t)first_max(s, c) * w;
        }
    }
    if (!reuse)
        panel_scores_multi(st, heads, lm, PANELS(m), d, sc, mp);
    for (int j = 0; j < heads; j++)
        topk_logsoftmax(sc + j * mp, m, k, ids + (int64_t)j * k, lp + (int64_t)j * k);
    return 0;
}

/* the root's first-layer row for a vocabulary subset: u0 = b_up + unit(e) we^T, we [w, d] */
void heads_root_row(int d, int w, const float *e, const float *we, const float *bu,
                    float *work, float *u0) {
    unit(e, work, d);
    matvec(work, we, w, d, u0);
    for (int i = 0; i < w; i++) u0[i] += bu[i];
}

/* one call with every argument in a struct (runtimes/heads.py fills it once per runner):
   ctypes converts 2 arguments a run instead of 16 */
typedef struct {
    int32_t kind, d, w, heads, c, m, k, by_id;  /* kind 0 medusa, 1 residual */
    const float *h, *emb, *w1, *b1, *scale, *wh, *wd, *bd, *table, *we, *bu, *lm;
    float *work, *u0;
    int64_t *ids;
    float *lp;
} HeadsCall;

int heads_run(const HeadsCall *a, int64_t root) {
    if (a->kind == 0)
        return heads_medusa(a->d, a->heads, a->m, a->k, a->h, a->w1, a->b1, a->scale, a->lm,
                            a->work, a->ids, a->lp);
    const float *u0 = a->u0;
    if (a->by_id) {
        if (root < 0 || root >= a->c) return -1;
        u0 = a->table + root * a->w;
    } else {
        heads_root_row(a->d, a->w, a->emb, a->we, a->bu, a->work, a->u0);
    }
    return heads_residual(a->d, a->w, a->heads, a->c, a->m, a->k, a->h, u0, a->wh, a->wd,
                          a->bd, a->table, a->lm, a->work, a->ids, a->lp);
}
