/* STAND's tree, grown in C: the n-gram index of the committed context and the best-first
 * grower of edgemtp/drafters/ngram_index.py (NgramIndex.match, StoredDistributions.mixture,
 * ContextModel.next_tokens, grow, layout), computing the same tree bit for bit: the same
 * double-precision sums in the same order, the same stable orders and tie breaks.
 *
 * Compiled on first use by edgemtp/native/__init__.py (cc -O2 -shared); where that is not
 * possible the Python grower runs. A decode step of a small model on a GPU is ~0.5 ms, and the
 * Python grower took ~90 us of it (bench/results/gpu_host_h200.md).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define OCC 4          /* STAND_OCCURRENCES: the most recent matches whose distributions mix */
#define MAX_N 3        /* the longest n-gram the index can hold */
#define TOKEN_BITS 20  /* token ids below 2^20 (callers check) */

typedef struct {
    uint64_t key;      /* 0: empty */
    int64_t count;     /* occurrences seen */
    int64_t ends[OCC]; /* the last OCC end positions, oldest first */
} Slot;

typedef struct {
    int max_n;
    int64_t *tokens, ntok, cap_tok;
    Slot *slots;
    int64_t nslots, used;
    /* scratch for grow, reused */
    double *hs;        /* heap: score */
    int64_t *ho;       /* heap: order */
    int32_t *hp, *ht;  /* heap: parent node, token */
    int64_t hcap;
} Ctx;

static uint64_t pack(const int64_t *t, int n) {
    uint64_t k = (uint64_t)n;
    for (int i = 0; i < n; i++) k = (k << TOKEN_BITS) | (uint64_t)t[i];
    return k;
}

static uint64_t mix(uint64_t x) {  /* splitmix64's finaliser */
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27; x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static Slot *find(Ctx *c, uint64_t key) {
    uint64_t m = (uint64_t)c->nslots - 1, i = mix(key) & m;
    while (c->slots[i].key && c->slots[i].key != key) i = (i + 1) & m;
    return &c->slots[i];
}

static int grow_slots(Ctx *c) {
    int64_t n = c->nslots * 2;
    Slot *old = c->slots, *s = calloc((size_t)n, sizeof(Slot));
    if (!s) return -1;
    int64_t on = c->nslots;
    c->slots = s; c->nslots = n;
    for (int64_t i = 0; i < on; i++)
        if (old[i].key) *find(c, old[i].key) = old[i];
    free(old);
    return 0;
}

void *ctx_new(int max_n) {
    if (max_n < 1 || max_n > MAX_N) return NULL;
    Ctx *c = calloc(1, sizeof(Ctx));
    if (!c) return NULL;
    c->max_n = max_n;
    c->cap_tok = 1024; c->tokens = malloc(sizeof(int64_t) * 1024);
    c->nslots = 4096; c->slots = calloc(4096, sizeof(Slot));
    if (!c->tokens || !c->slots) { free(c->tokens); free(c->slots); free(c); return NULL; }
    return c;
}

void ctx_free(void *p) {
    Ctx *c = p;
    if (!c) return;
    free(c->tokens); free(c->slots);
    free(c->hs); free(c->ho); free(c->hp); free(c->ht);
    free(c);
}

/* NgramIndex.extend: every n-gram that just got a follower records where it ends; returns 0,
 * -1 (out of memory) or -2 (a token outside 0 .. 2^20 - 1: nothing more is appended) */
int ctx_extend(void *p, const int64_t *tok, int64_t n) {
    Ctx *c = p;
    for (int64_t j = 0; j < n; j++) {
        if (tok[j] < 0 || tok[j] >= (1LL << TOKEN_BITS)) return -2;
        if (c->ntok == c->cap_tok) {
            int64_t *t = realloc(c->tokens, sizeof(int64_t) * (size_t)(2 * c->cap_tok));
            if (!t) return -1;
            c->tokens = t; c->cap_tok *= 2;
        }
        int64_t pos = c->ntok - 1;  /* the position that just got a follower */
        c->tokens[c->ntok++] = tok[j];
        for (int g = 1; g <= c->max_n && g <= pos + 1; g++) {
            if (2 * (c->used + 1) > c->nslots && grow_slots(c)) return -1;
            uint64_t key = pack(c->tokens + pos - g + 1, g);
            Slot *s = find(c, key);
            if (!s->key) { s->key = key; c->used++; }
            if (s->count < OCC) s->ends[s->count] = pos;
            else { memmove(s->ends, s->ends + 1, sizeof(int64_t) * (OCC - 1)); s->ends[OCC - 1] = pos; }
            s->count++;
        }
    }
    return 0;
}

/* NgramIndex.match: the slot of the longest matched suffix n-gram, or NULL */
static Slot *match(Ctx *c, const int64_t *tail, int ntail, int *matched) {
    for (int n = ntail < c->max_n ? ntail : c->max_n; n > 0; n--) {
        Slot *s = find(c, pack(tail + ntail - n, n));
        if (s->key && s->count) { *matched = n; return s; }
    }
    return NULL;
}

/* StoredDistributions.mixture over a slot's last OCC ends, sorted by probability (stable):
 * into tok/pr, returns the count */
static int mixture(const Slot *s, const int64_t *ids, const float *probs, int64_t dsize, int k,
                   int32_t *tok, double *pr) {
    int npos = s->count < OCC ? (int)s->count : OCC, m = 0;
    double w = 1.0 / npos;
    for (int a = 0; a < npos; a++) {
        int64_t pos = s->ends[a];
        if (pos >= dsize) continue;  /* never written: all-zero probabilities */
        for (int j = 0; j < k; j++) {
            double q = (double)probs[pos * k + j];
            if (!(q > 0.0)) continue;
            int32_t t = (int32_t)ids[pos * k + j];
            int i = 0;
            while (i < m && tok[i] != t) i++;
            if (i == m) { tok[m] = t; pr[m] = 0.0; m++; }
            pr[i] = pr[i] + w * q;
        }
    }
    for (int i = 1; i < m; i++) {  /* insertion sort, descending, stable */
        int32_t t = tok[i]; double v = pr[i]; int j = i - 1;
        while (j >= 0 && pr[j] < v) { tok[j + 1] = tok[j]; pr[j + 1] = pr[j]; j--; }
        tok[j + 1] = t; pr[j + 1] = v;
    }
    return m;
}

/* heap of candidates: the best score first, then the earliest pushed (heapq on (-s, order)) */
static int before(const Ctx *c, int64_t a, int64_t b) {
    return c->hs[a] > c->hs[b] || (c->hs[a] == c->hs[b] && c->ho[a] < c->ho[b]);
}

static void swap(Ctx *c, int64_t a, int64_t b) {
    double s = c->hs[a]; c->hs[a] = c->hs[b]; c->hs[b] = s;
    int64_t o = c->ho[a]; c->ho[a] = c->ho[b]; c->ho[b] = o;
    int32_t x = c->hp[a]; c->hp[a] = c->hp[b]; c->hp[b] = x;
    x = c->ht[a]; c->ht[a] = c->ht[b]; c->ht[b] = x;
}

static int reserve(Ctx *c, int64_t n) {
    if (n <= c->hcap) return 0;
    int64_t cap = c->hcap ? c->hcap : 256;
    while (cap < n) cap *= 2;
    double *hs = realloc(c->hs, sizeof(double) * (size_t)cap);
    if (hs) c->hs = hs;
    int64_t *ho = realloc(c->ho, sizeof(int64_t) * (size_t)cap);
    if (ho) c->ho = ho;
    int32_t *hp = realloc(c->hp, sizeof(int32_t) * (size_t)cap);
    if (hp) c->hp = hp;
    int32_t *ht = realloc(c->ht, sizeof(int32_t) * (size_t)cap);
    if (ht) c->ht = ht;
    if (!hs || !ho || !hp || !ht) return -1;
    c->hcap = cap;
    return 0;
}

static void heap_push(Ctx *c, int64_t *size, double sc, int64_t order, int32_t v, int32_t t) {
    int64_t at = (*size)++;
    c->hs[at] = sc; c->ho[at] = order; c->hp[at] = v; c->ht[at] = t;
    while (at > 0 && before(c, at, (at - 1) / 2)) { swap(c, at, (at - 1) / 2); at = (at - 1) / 2; }
}

/* pop the best candidate and add it as node v = *nodes (its tail: (tail(parent) + (t,))[-n:]) */
static void heap_pop_add(Ctx *c, int64_t *size, int *nodes, int n, int64_t *tails, int *ntails,
                         int32_t *out_tok, int32_t *out_par, int32_t *out_depth,
                         double *out_score) {
    double sc = c->hs[0]; int32_t par = c->hp[0], t = c->ht[0];
    int64_t sz = --(*size);
    if (sz) {
        c->hs[0] = c->hs[sz]; c->ho[0] = c->ho[sz]; c->hp[0] = c->hp[sz]; c->ht[0] = c->ht[sz];
        for (int64_t at = 0;;) {
            int64_t l = 2 * at + 1, r = l + 1, best = at;
            if (l < sz && before(c, l, best)) best = l;
            if (r < sz && before(c, r, best)) best = r;
            if (best == at) break;
            swap(c, at, best); at = best;
        }
    }
    int v = (*nodes)++;
    out_tok[v] = t; out_par[v] = par; out_depth[v] = out_depth[par] + 1; out_score[v] = sc;
    int64_t buf[MAX_N + 1]; int nb = ntails[par];
    memcpy(buf, tails + (int64_t)par * MAX_N, sizeof(int64_t) * (size_t)nb);
    buf[nb++] = t;
    int keep = nb < n ? nb : n;
    memcpy(tails + (int64_t)v * MAX_N, buf + nb - keep, sizeof(int64_t) * (size_t)keep);
    ntails[v] = keep;
}

/* grow(GrownTree(root, tail, max_n), STAND's children, max_nodes, max_depth, min_score):
 * the nodes in the order grown, into out_tok/out_par/out_depth/out_score (max_nodes each);
 * returns the node count, or -1 (out of memory) or -2 (a new token id >= 2^20) */
int ctx_grow(void *p, const int64_t *newtok, int64_t nnew, const int64_t *ids,
             const float *probs, int64_t dsize, int k, int64_t root, const int64_t *tail,
             int ntail, int max_nodes, int max_depth, double min_score, int32_t *out_tok,
             int32_t *out_par, int32_t *out_depth, double *out_score) {
    Ctx *c = p;
    /* first the tokens committed since the last call (ctx_extend) */
    int e = nnew ? ctx_extend(p, newtok, nnew) : 0;
    if (e) return e == -2 ? -2 : -1;
    if (max_nodes < 1) max_nodes = 1;  /* (the root is always there, as in GrownTree) */
    int n = c->max_n;
    int64_t *tails = malloc(sizeof(int64_t) * (size_t)max_nodes * MAX_N);
    int *ntails = malloc(sizeof(int) * (size_t)max_nodes);
    int32_t *ctok = malloc(sizeof(int32_t) * (size_t)(OCC * k + 1));
    double *cpr = malloc(sizeof(double) * (size_t)(OCC * k + 1));
    int64_t size = 0, order = 0;
    int nodes = 1, rc = 0;
    if (!tails || !ntails || !ctok || !cpr) { rc = -1; goto done; }
    out_tok[0] = (int32_t)root; out_par[0] = -1; out_depth[0] = 0; out_score[0] = 1.0;
    ntails[0] = ntail < n ? ntail : n;
    memcpy(tails, tail + ntail - ntails[0], sizeof(int64_t) * (size_t)ntails[0]);
    for (int v = 0;; ) {
        /* expand(v) */
        if (out_depth[v] < max_depth) {
            int g;
            Slot *s = match(c, tails + (int64_t)v * MAX_N, ntails[v], &g);
            if (s) {
                int m = mixture(s, ids, probs, dsize, k, ctok, cpr);
                double base = out_score[v];
                if (reserve(c, size + m)) { rc = -1; goto done; }
                for (int i = 0; i < m; i++) {
                    double sc = base * cpr[i];
                    if (sc >= min_score) heap_push(c, &size, sc, order++, v, ctok[i]);
                }
            }
        }
        if (!size || nodes >= max_nodes) break;
        v = nodes;  /* the best candidate becomes node v */
        heap_pop_add(c, &size, &nodes, n, tails, ntails, out_tok, out_par, out_depth, out_score);
    }
    rc = nodes;
done:
    free(tails); free(ntails); free(ctok); free(cpr);
    return rc;
}

/* ngram_index.layout(tree, r, masked, k, vocab): the first r grown nodes plus k mask leaves
 * (ids vocab + j, a chain under their node) under each of the m nodes in masked, in a plan's
 * order: a stable sort on (depth, 0, -score) for a node and (depth of its node + 1 + j, 1,
 * node) for mask j (entries numbered as the Python appends them: the r nodes, then each masked
 * node's k masks). out_par: parents re-indexed; out_tok: ids; out_rows[i * k + j]: the row of
 * masked[i]'s mask j (NULL where m = 0). Returns r + m * k, or -1 (memory). */
int ctx_layout(int r, const int32_t *tok, const int32_t *par, const int32_t *depth,
               const double *score, const int32_t *masked, int m, int k, int64_t vocab,
               int32_t *out_par, int64_t *out_tok, int64_t *out_rows) {
    const int n = r + m * k;
    int32_t *order = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    int32_t *newidx = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    int32_t *d = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    if (!order || !newidx || !d) { free(order); free(newidx); free(d); return -1; }
    for (int e = 0; e < n; e++) {
        order[e] = e;
        d[e] = e < r ? depth[e] : depth[masked[(e - r) / k]] + 1 + (e - r) % k;
    }
    for (int i = 1; i < n; i++) {  /* insertion sort: stable, a tree is at most BC nodes */
        int32_t o = order[i]; int j = i - 1;
        for (; j >= 0; j--) {
            int32_t q = order[j];
            int after = d[q] > d[o];
            if (d[q] == d[o]) {
                int kq = q >= r, ko = o >= r;
                after = kq != ko ? kq > ko
                      : !ko ? -score[q] > -score[o]
                      : masked[(q - r) / k] > masked[(o - r) / k];
            }
            if (!after) break;
            order[j + 1] = q;
        }
        order[j + 1] = o;
    }
    for (int i = 0; i < n; i++) newidx[order[i]] = i;
    for (int i = 0; i < n; i++) {
        int32_t o = order[i];
        if (o < r) {
            out_par[i] = par[o] < 0 ? -1 : newidx[par[o]];
            out_tok[i] = tok[o];
        } else {
            int j = (o - r) % k;
            out_par[i] = j == 0 ? newidx[masked[(o - r) / k]] : newidx[o - 1];
            out_tok[i] = vocab + j;
        }
    }
    for (int e = r; e < n; e++) out_rows[e - r] = newidx[e];
    free(order); free(newidx); free(d);
    return n;
}

/* ---- the hybrid drafter's tree (edgemtp/drafters/hybrid.py: HybridDrafter.propose's grow,
 * _children, _mask_guesses, _jacobi_guesses) and LADE's n-gram pool it reads ---- */

typedef struct {
    int64_t key;       /* the n-gram's first token; -1: empty */
    int32_t n;         /* continuations held, oldest first */
    int64_t *conts;    /* size x levels */
} PSlot;

typedef struct {
    int size, levels;
    PSlot *slots;
    int64_t nslots, used;
} Pool;

static PSlot *pfind(Pool *p, int64_t key) {
    uint64_t m = (uint64_t)p->nslots - 1, i = mix((uint64_t)key) & m;
    while (p->slots[i].key != -1 && p->slots[i].key != key) i = (i + 1) & m;
    return &p->slots[i];
}

static PSlot *pget(const Pool *p, int64_t key) {
    PSlot *s = pfind((Pool *)p, key);
    return s->key == key ? s : NULL;
}

void *pool_new(int size, int levels) {
    Pool *p = calloc(1, sizeof(Pool));
    if (!p) return NULL;
    p->size = size; p->levels = levels; p->nslots = 256;
    p->slots = malloc(sizeof(PSlot) * 256);
    if (!p->slots) { free(p); return NULL; }
    for (int i = 0; i < 256; i++) { p->slots[i].key = -1; p->slots[i].n = 0; p->slots[i].conts = NULL; }
    return p;
}

void pool_free(void *q) {
    Pool *p = q;
    if (!p) return;
    for (int64_t i = 0; i < p->nslots; i++) free(p->slots[i].conts);
    free(p->slots); free(p);
}

static int pgrow(Pool *p) {
    int64_t on = p->nslots, n = 2 * on;
    PSlot *old = p->slots, *s = malloc(sizeof(PSlot) * (size_t)n);
    if (!s) return -1;
    for (int64_t i = 0; i < n; i++) { s[i].key = -1; s[i].n = 0; s[i].conts = NULL; }
    p->slots = s; p->nslots = n;
    for (int64_t i = 0; i < on; i++)
        if (old[i].key != -1) *pfind(p, old[i].key) = old[i];
    free(old);
    return 0;
}

/* NgramPool.add for each row [key, cont...] (rows of 1 + levels): a continuation seen again
 * moves to the back; the oldest leaves when the row is full */
int pool_add_many(void *q, const int64_t *rows, int64_t count) {
    Pool *p = q;
    int L = p->levels;
    if (p->size <= 0) return 0;
    for (int64_t r = 0; r < count; r++) {
        const int64_t *row = rows + r * (1 + L), *cont = row + 1;
        PSlot *s = pfind(p, row[0]);
        if (s->key == -1) {
            if (2 * (p->used + 1) > p->nslots) {
                if (pgrow(p)) return -1;
                s = pfind(p, row[0]);
            }
            s->conts = malloc(sizeof(int64_t) * (size_t)(p->size * (L > 0 ? L : 1)));
            if (!s->conts) return -1;
            s->key = row[0]; s->n = 0; p->used++;
        }
        int at = -1;
        for (int i = 0; i < s->n && at < 0; i++)
            if (!memcmp(s->conts + (int64_t)i * L, cont, sizeof(int64_t) * (size_t)L)) at = i;
        if (at < 0 && s->n >= p->size) at = 0;  /* full: the oldest leaves */
        if (at >= 0) {
            memmove(s->conts + (int64_t)at * L, s->conts + (int64_t)(at + 1) * L,
                    sizeof(int64_t) * (size_t)((s->n - at - 1) * L));
            s->n--;
        }
        memcpy(s->conts + (int64_t)s->n * L, cont, sizeof(int64_t) * (size_t)L);
        s->n++;
    }
    return 0;
}

/* a growable arena of (continuation, index) offers and a candidate dict in insertion order */
typedef struct { const int64_t *c; int i; } Offer;

typedef struct {
    int32_t *tok; double *sc; int n, cap;
} Cands;

static int cands_reserve(Cands *d, int n) {
    if (n <= d->cap) return 0;
    int cap = d->cap ? d->cap : 64;
    while (cap < n) cap *= 2;
    int32_t *t = realloc(d->tok, sizeof(int32_t) * (size_t)cap);
    if (t) d->tok = t;
    double *s = realloc(d->sc, sizeof(double) * (size_t)cap);
    if (s) d->sc = s;
    if (!t || !s) return -1;
    d->cap = cap;
    return 0;
}

static int cands_at(const Cands *d, int32_t t) {
    for (int i = 0; i < d->n; i++) if (d->tok[i] == t) return i;
    return -1;
}

/* the lowest index per token among n offers, in first-offer order (the hybrid's
 * _jacobi_of), into a scratch reused across nodes; returns the count, or -1 (memory) */
typedef struct { int32_t *tok; int *idx; int64_t cap; } Best;

static int64_t best_offers(Best *b, const Offer *o, int64_t n) {
    if (n > b->cap) {
        int32_t *t = realloc(b->tok, sizeof(int32_t) * (size_t)n);
        if (t) b->tok = t;
        int *i = realloc(b->idx, sizeof(int) * (size_t)n);
        if (i) b->idx = i;
        if (!t || !i) return -1;
        b->cap = n;
    }
    int64_t nb = 0;
    for (int64_t a = 0; a < n; a++) {
        int32_t t = (int32_t)o[a].c[o[a].i];
        int64_t k = 0;
        while (k < nb && b->tok[k] != t) k++;
        if (k == nb) { b->tok[nb] = t; b->idx[nb++] = o[a].i; }
        else if (o[a].i < b->idx[k]) b->idx[k] = o[a].i;
    }
    return nb;
}

static const double P_EDGES[7] = {0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9};

static int pbin(double p) {  /* bisect_right(P_EDGES, p) */
    int b = 0;
    while (b < 7 && P_EDGES[b] <= p) b++;
    return b;
}

/* ContextModel.next_tokens(tail): the guesses (best first) into tok/pr, returns their count;
 * *n: the matched n-gram length and *literal: the token after its newest occurrence (0 and -1
 * where nothing matched, or the match's distributions are all empty) */
static int lookup(Ctx *c, const int64_t *tail, int ntail, const int64_t *ids, const float *probs,
                  int64_t dsize, int k, int32_t *tok, double *pr, int *n, int64_t *literal) {
    int g = 0;
    *n = 0; *literal = -1;
    Slot *s = match(c, tail, ntail, &g);
    if (!s) return 0;
    int m = mixture(s, ids, probs, dsize, k, tok, pr);
    if (m) {
        int last = s->count < OCC ? (int)s->count - 1 : OCC - 1;
        *n = g; *literal = c->tokens[s->ends[last] + 1];
    }
    return m;
}

/* ip: nnew, dsize, K, root, ntail, max_nodes, max_depth, n_bins, first_literal, first_mask,
 *     first_jacobi, kmask (mask rows with candidates, 0: none), ck (candidates per mask row),
 *     prune, calibrate (0: raw probabilities, rates unused)
 * returns the node count, or -1 (memory) / -2 (a token id >= 2^20) */
int ctx_grow_hybrid(void *p, const int64_t *ip, double min_score, const int64_t *newtok,
                    const int64_t *ids, const float *probs, const int64_t *tail,
                    const double *rates, const double *prior, const int64_t *cand_ids,
                    const double *cand_p, void *poolp, int32_t *out_tok, int32_t *out_par,
                    int32_t *out_depth, double *out_score) {
    Ctx *c = p;
    const Pool *pool = poolp;
    int64_t nnew = ip[0], dsize = ip[1], root = ip[3];
    int K = (int)ip[2], ntail = (int)ip[4], max_nodes = (int)ip[5], max_depth = (int)ip[6];
    int n_bins = (int)ip[7], first_literal = (int)ip[8], first_mask = (int)ip[9];
    int first_jacobi = (int)ip[10], kmask = (int)ip[11], ck = (int)ip[12];
    int prune = (int)ip[13], calibrate = (int)ip[14];
    int e = nnew ? ctx_extend(p, newtok, nnew) : 0;
    if (e) return e == -2 ? -2 : -1;
    if (max_nodes < 1) max_nodes = 1;  /* (the root is always there, as in GrownTree) */
    int n = c->max_n, L = pool ? pool->levels : 0;
    int64_t *tails = malloc(sizeof(int64_t) * (size_t)max_nodes * MAX_N);
    int *ntails = malloc(sizeof(int) * (size_t)max_nodes);
    int *chain = malloc(sizeof(int) * (size_t)(max_nodes + 1));
    int64_t *off_at = malloc(sizeof(int64_t) * (size_t)(max_nodes + 1));
    int32_t *gtok = malloc(sizeof(int32_t) * (size_t)(OCC * K + 1));
    double *gpr = malloc(sizeof(double) * (size_t)(OCC * K + 1));
    Offer *offers = NULL;
    int64_t noff = 0, offcap = 0;
    Cands d = {0};
    Best best = {0};
    int64_t size = 0, order = 0;
    int nodes = 1, nchain = 1, rc = 0;
    if (!tails || !ntails || !chain || !off_at || !gtok || !gpr) { rc = -1; goto done; }
    chain[0] = 0;
    out_tok[0] = (int32_t)root; out_par[0] = -1; out_depth[0] = 0; out_score[0] = 1.0;
    ntails[0] = ntail < n ? ntail : n;
    memcpy(tails, tail + ntail - ntails[0], sizeof(int64_t) * (size_t)ntails[0]);
    for (int v = 0;; ) {
        off_at[v] = noff;  /* this node's offers start here (none if not expanded) */
        off_at[v + 1] = noff;
        if (out_depth[v] < max_depth) {
            int dep = out_depth[v], j = -1;
            if (v && dep == nchain && out_par[v] == chain[nchain - 1]) chain[nchain++] = v;
            if (dep < nchain && chain[dep] == v) j = dep;
            d.n = 0;
            /* lookups: the context's guesses after the node's tail */
            int ln; int64_t literal;
            int m = lookup(c, tails + (int64_t)v * MAX_N, ntails[v], ids, probs, dsize, K,
                           gtok, gpr, &ln, &literal);
            if (cands_reserve(&d, m + 1)) { rc = -1; goto done; }
            if (!calibrate) {
                for (int i = 0; i < m; i++) { d.tok[d.n] = gtok[i]; d.sc[d.n++] = gpr[i]; }
            } else if (m) {
                int base = (ln - 1) * n_bins;
                for (int i = 0; i < m; i++) { d.tok[d.n] = gtok[i]; d.sc[d.n++] = rates[base + pbin(gpr[i])]; }
                if (literal >= 0) {
                    int b = first_literal + 2 * (ln - 1) + (literal == gtok[0] ? 0 : 1);
                    int at = cands_at(&d, (int32_t)literal);
                    if (at < 0) { d.tok[d.n] = (int32_t)literal; d.sc[d.n++] = rates[b]; }
                    else if (rates[b] > d.sc[at]) d.sc[at] = rates[b];
                }
            }
            /* masks: mask j's candidates under the chain node of depth j */
            if (j >= 0 && j < kmask) {
                if (cands_reserve(&d, d.n + ck)) { rc = -1; goto done; }
                int rank = 0;
                for (int i = 0; i < ck; i++) {
                    int64_t t = cand_ids[(int64_t)j * ck + i];
                    if (prune && t == out_tok[v]) continue;
                    double q = calibrate ? rates[first_mask + rank] : cand_p[(int64_t)j * ck + i];
                    rank++;
                    int at = cands_at(&d, (int32_t)t);
                    if (at < 0) { at = d.n++; d.tok[at] = (int32_t)t; d.sc[at] = 0.0; }
                    d.sc[at] = 1.0 - (1.0 - d.sc[at]) * (1.0 - q);
                }
            }
            /* Jacobi offers: the parent's continuations this token matched, then the pool's */
            if (pool) {
                int64_t tok = out_tok[v], start = noff;
                if (v) {
                    int par = out_par[v];
                    for (int64_t a = off_at[par]; a < off_at[par + 1]; a++) {
                        Offer o = offers[a];
                        if (o.c[o.i] == tok && o.i + 1 < L) {
                            if (noff == offcap) {
                                offcap = offcap ? 2 * offcap : 256;
                                Offer *x = realloc(offers, sizeof(Offer) * (size_t)offcap);
                                if (!x) { rc = -1; goto done; }
                                offers = x;
                            }
                            offers[noff].c = o.c; offers[noff].i = o.i + 1; noff++;
                        }
                    }
                }
                const PSlot *ps = pget(pool, tok);
                if (ps) {
                    for (int i = 0; i < ps->n; i++) {
                        if (noff == offcap) {
                            offcap = offcap ? 2 * offcap : 256;
                            Offer *x = realloc(offers, sizeof(Offer) * (size_t)offcap);
                            if (!x) { rc = -1; goto done; }
                            offers = x;
                        }
                        offers[noff].c = ps->conts + (int64_t)i * L; offers[noff].i = 0; noff++;
                    }
                }
                off_at[v + 1] = noff;
                /* best (lowest) index per token, in first-offer order */
                int64_t nbest = best_offers(&best, offers + start, noff - start);
                if (nbest < 0 || cands_reserve(&d, d.n + (int)nbest)) { rc = -1; goto done; }
                for (int64_t k2 = 0; k2 < nbest; k2++) {
                    int b = first_jacobi + best.idx[k2];
                    double q = calibrate ? rates[b] : prior[b];
                    int at = cands_at(&d, best.tok[k2]);
                    if (at < 0) { at = d.n++; d.tok[at] = best.tok[k2]; d.sc[at] = 0.0; }
                    d.sc[at] = 1.0 - (1.0 - d.sc[at]) * (1.0 - q);
                }
            }
            /* siblings are exclusive events: their sum stays a probability */
            double total = 0.0;
            for (int i = 0; i < d.n; i++) total += d.sc[i];
            if (total > 0.99)
                for (int i = 0; i < d.n; i++) d.sc[i] = d.sc[i] * 0.99 / total;
            double base = out_score[v];
            if (reserve(c, size + d.n)) { rc = -1; goto done; }
            for (int i = 0; i < d.n; i++) {
                double sc = base * d.sc[i];
                if (sc >= min_score) heap_push(c, &size, sc, order++, v, d.tok[i]);
            }
        }
        if (!size || nodes >= max_nodes) break;
        v = nodes;
        heap_pop_add(c, &size, &nodes, n, tails, ntails, out_tok, out_par, out_depth, out_score);
    }
    rc = nodes;
done:
    free(tails); free(ntails); free(chain); free(off_at); free(gtok); free(gpr);
    free(offers); free(d.tok); free(d.sc); free(best.tok); free(best.idx);
    return rc;
}

/* hybrid.place_masks' split of the budget: the first r grown nodes and m nodes carrying k
 * masks each; returns r and writes the masked nodes (ascending) into masked, m into *nm.
 * The same arithmetic in the same order as the Python (sums left to right from 0). */
int ctx_place_masks(int n, const double *s, const int32_t *par, int bc, int k, double gain,
                    double min_score, int32_t *masked, int *nm) {
    double *below = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    double *end = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    int32_t *order = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    if (!below || !end || !order) { free(below); free(end); free(order); return -1; }
    double best = -HUGE_VAL, kept = 0.0;
    int choice_r = n < bc ? n : bc, choice_m = 0, worse = 0, last_r = -1;
    int mmax = k ? (bc - 1) / k + 1 : 1;
    *nm = 0;
    for (int m = 0; m < mmax; m++) {
        int r = n < bc - m * k ? n : bc - m * k;
        if (r != last_r) {
            for (int i = 0; i < r; i++) below[i] = 0.0;
            for (int c = 1; c < r; c++) below[par[c]] = below[par[c]] + s[c];
            for (int i = 0; i < r; i++) { double d = s[i] - below[i]; end[i] = 0.0 > d ? 0.0 : d; }
            for (int i = 0; i < r; i++) order[i] = i;
            for (int i = 1; i < r; i++) {  /* stable, by -end */
                int32_t o = order[i]; int j = i - 1;
                while (j >= 0 && -end[order[j]] > -end[o]) { order[j + 1] = order[j]; j--; }
                order[j + 1] = o;
            }
            kept = 0.0;
            for (int i = 1; i < r; i++) kept = kept + s[i];
            last_r = r;
        }
        int mt = m < r ? m : r;
        if (m && gain * end[order[mt - 1]] < k * min_score) break;
        double add = 0.0;
        for (int i = 0; i < mt; i++) add = add + end[order[i]];
        double value = kept + gain * add;
        if (value > best) {
            best = value; choice_r = r; choice_m = mt; worse = 0;
            for (int i = 0; i < mt; i++) masked[i] = order[i];
        } else if (++worse >= 4) break;
    }
    for (int i = 1; i < choice_m; i++) {  /* ascending */
        int32_t o = masked[i]; int j = i - 1;
        while (j >= 0 && masked[j] > o) { masked[j + 1] = masked[j]; j--; }
        masked[j + 1] = o;
    }
    *nm = choice_m;
    free(below); free(end); free(order);
    return choice_r;
}

/* HybridDrafter._learn for a tree grown by ctx_grow_hybrid (its nodes in grown order; the
 * index, pool and mask candidates as they were then): walks the accepted path (truth), and
 * for every candidate each node on it proposed adds 1 to seen[bucket] and, where it was the
 * true token, to hits[bucket] (calibrate only). ip as ctx_grow_hybrid's (nnew unused).
 * out[0]: 1 where the root's true token came from the masks alone; out[1]: the accepted
 * tokens only the window's n-grams proposed. Returns 0, or -1 (memory). */
int ctx_learn_hybrid(void *p, const int64_t *ip, const int64_t *truth, int ntruth,
                     const int32_t *tok, const int32_t *par, const int32_t *depth, int nodes,
                     const int64_t *ids, const float *probs, const int64_t *tail,
                     const int64_t *cand_ids, void *poolp, double *hits, double *seen,
                     int64_t *out) {
    Ctx *c = p;
    const Pool *pool = poolp;
    int64_t dsize = ip[1];
    int K = (int)ip[2], ntail = (int)ip[4], max_depth = (int)ip[6];
    int n_bins = (int)ip[7], first_literal = (int)ip[8], first_mask = (int)ip[9];
    int first_jacobi = (int)ip[10], kmask = (int)ip[11], ck = (int)ip[12];
    int prune = (int)ip[13], calibrate = (int)ip[14];
    int n = c->max_n, L = pool ? pool->levels : 0, rc = 0;
    int *chain = malloc(sizeof(int) * (size_t)(nodes + 1));
    int32_t *gtok = malloc(sizeof(int32_t) * (size_t)(OCC * K + 1));
    double *gpr = malloc(sizeof(double) * (size_t)(OCC * K + 1));
    Offer *offers = NULL, *next = NULL;
    int64_t ncap = 0;
    Best best = {0};
    int64_t noff = 0;
    out[0] = 0; out[1] = 0;
    if (!chain || !gtok || !gpr) { rc = -1; goto done; }
    int nchain = 1; chain[0] = 0;  /* the top-1 chain, as the grower built it */
    for (int v = 1; v < nodes; v++)
        if (depth[v] < max_depth && depth[v] == nchain && par[v] == chain[nchain - 1])
            chain[nchain++] = v;
    int64_t tl[MAX_N + 1]; int nt = ntail < n ? ntail : n;
    memcpy(tl, tail + ntail - nt, sizeof(int64_t) * (size_t)nt);
    int node = 0;
    for (int s = 0; s < ntruth; s++) {
        int64_t t = truth[s];
        int dep = depth[node];
        if (dep >= max_depth) break;
        /* the lookup */
        int ln; int64_t literal;
        int m = lookup(c, tl, nt, ids, probs, dsize, K, gtok, gpr, &ln, &literal);
        /* the Jacobi offers: the parent's matched, then the pool's */
        int64_t nn = 0;
        const PSlot *ps = pool ? pget(pool, tok[node]) : NULL;
        int64_t need = noff + (ps ? ps->n : 0) + 1;
        if (need > ncap) {  /* both offer lists grow together (they swap each node) */
            Offer *x = realloc(next, sizeof(Offer) * (size_t)need);
            if (x) next = x;
            Offer *y = realloc(offers, sizeof(Offer) * (size_t)need);
            if (y) offers = y;
            if (!x || !y) { rc = -1; goto done; }
            ncap = need;
        }
        if (pool) {
            for (int64_t a = 0; a < noff; a++)
                if (offers[a].c[offers[a].i] == tok[node] && offers[a].i + 1 < L) {
                    next[nn].c = offers[a].c; next[nn].i = offers[a].i + 1; nn++;
                }
            for (int i = 0; ps && i < ps->n; i++) { next[nn].c = ps->conts + (int64_t)i * L; next[nn].i = 0; nn++; }
        }
        int64_t nbest = best_offers(&best, next, nn);
        if (nbest < 0) { rc = -1; goto done; }
        const int32_t *bt = best.tok; const int *bi = best.idx;
        { Offer *sw = offers; offers = next; next = sw; noff = nn; }
        /* the masks under this node (chain node of depth j) */
        int j = dep < nchain && chain[dep] == node ? dep : -1;
        int has_masks = j >= 0 && j < kmask;
        int in_jac = 0, in_guess = 0, in_mask = 0;
        for (int64_t k2 = 0; k2 < nbest; k2++) {
            if (calibrate) { seen[first_jacobi + bi[k2]] += 1.0; if (bt[k2] == t) hits[first_jacobi + bi[k2]] += 1.0; }
            if (bt[k2] == t) in_jac = 1;
        }
        for (int i = 0; i < m; i++) {
            int b = (ln - 1) * n_bins + pbin(gpr[i]);
            if (calibrate) { seen[b] += 1.0; if (gtok[i] == t) hits[b] += 1.0; }
            if (gtok[i] == t) in_guess = 1;
        }
        if (literal >= 0 && calibrate) {
            int b = first_literal + 2 * (ln - 1) + (literal == gtok[0] ? 0 : 1);
            seen[b] += 1.0; if (literal == t) hits[b] += 1.0;
        }
        if (has_masks) {
            int rank = 0;
            for (int i = 0; i < ck; i++) {
                int64_t mt = cand_ids[(int64_t)j * ck + i];
                if (prune && mt == tok[node]) continue;
                if (calibrate) { seen[first_mask + rank] += 1.0; if (mt == t) hits[first_mask + rank] += 1.0; }
                if (mt == t) in_mask = 1;
                rank++;
            }
        }
        if (node == 0)
            out[0] = t != literal && !in_guess && !in_jac && in_mask;
        int child = -1;
        for (int v = 1; v < nodes && child < 0; v++)
            if (par[v] == node && tok[v] == t) child = v;
        if (child >= 0 && in_jac && t != literal && !in_guess && !in_mask) out[1]++;
        if (child < 0) break;
        node = child;
        /* the child's tail */
        if (nt < n) tl[nt++] = t;
        else { memmove(tl, tl + 1, sizeof(int64_t) * (size_t)(n - 1)); tl[n - 1] = t; }
    }
done:
    free(chain); free(gtok); free(gpr); free(offers); free(next); free(best.tok); free(best.idx);
    return rc;
}

/* ---- plans.Plan's compilation for a tree without mask tokens (k = 0: lookup and hybrid trees,
 * a new shape most steps), and lookahead.LookaheadPlan's (the tree followed by a window of
 * levels x width Jacobi cells whose cell (0, 0) is the root; levels = 0: no window) ---- */

/* depth[n]; mask[T * T] (bytes 0 / 1, row-major), T = n + levels * width - 1 (n without a
 * window): node i sees its ancestors and itself, window cell (l, c) the root, level 0's cells
 * of columns 1..c and column c's cells of levels 1..l; pos[T]: a node's depth, a cell's l + c.
 * The same as Plan._build_mask / LookaheadPlan._build_mask and their positions. Returns 0, or
 * i > 0 where node i's parent is not an earlier node or breaks the depth order (the caller
 * compiles in Python, which says which). */
int plan_tree(const int64_t *par, int n, int levels, int width, uint8_t *mask, int64_t *depth,
              int64_t *pos) {
    const size_t T = (size_t)(levels > 0 ? n + levels * width - 1 : n);
    memset(mask, 0, T * T);
    depth[0] = 0;
    mask[0] = 1;
    for (int i = 1; i < n; i++) {
        const int64_t p = par[i];
        if (p < 0 || p >= i) return i;
        depth[i] = depth[p] + 1;
        if (depth[i] < depth[i - 1]) return i;
        memcpy(mask + (size_t)i * T, mask + (size_t)p * T, (size_t)p + 1);  /* p's ancestors */
        mask[(size_t)i * T + (size_t)i] = 1;
    }
    for (int i = 0; i < n; i++) pos[i] = depth[i];
    for (int l = 0; l < levels; l++)
        for (int c = 0; c < width; c++) {
            if (!l && !c) continue;  /* the root's row is the tree's */
            const size_t row = (size_t)(n - 1 + l * width + c);
            uint8_t *m = mask + row * T;
            m[0] = 1;
            for (int j = 1; j <= c; j++) m[n - 1 + j] = 1;
            for (int u = 1; u <= l; u++) m[n - 1 + u * width + c] = 1;
            pos[row] = l + c;
        }
    return 0;
}
