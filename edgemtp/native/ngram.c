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

int64_t ctx_len(void *p) { return ((Ctx *)p)->ntok; }

/* NgramIndex.match: the slot of the longest matched suffix n-gram, or NULL */
static Slot *match(Ctx *c, const int64_t *tail, int ntail) {
    for (int n = ntail < c->max_n ? ntail : c->max_n; n > 0; n--) {
        Slot *s = find(c, pack(tail + ntail - n, n));
        if (s->key && s->count) return s;
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
    if (max_nodes < 1) return 0;
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
            Slot *s = match(c, tails + (int64_t)v * MAX_N, ntails[v]);
            if (s) {
                int m = mixture(s, ids, probs, dsize, k, ctok, cpr);
                double base = out_score[v];
                if (reserve(c, size + m)) { rc = -1; goto done; }
                for (int i = 0; i < m; i++) {
                    double sc = base * cpr[i];
                    if (!(sc >= min_score)) continue;
                    int64_t at = size++;
                    c->hs[at] = sc; c->ho[at] = order++; c->hp[at] = v; c->ht[at] = ctok[i];
                    while (at > 0 && before(c, at, (at - 1) / 2)) { swap(c, at, (at - 1) / 2); at = (at - 1) / 2; }
                }
            }
        }
        if (!size || nodes >= max_nodes) break;
        /* pop the best candidate: it becomes node v */
        double sc = c->hs[0]; int32_t par = c->hp[0], t = c->ht[0];
        size--;
        if (size) {
            c->hs[0] = c->hs[size]; c->ho[0] = c->ho[size]; c->hp[0] = c->hp[size]; c->ht[0] = c->ht[size];
            for (int64_t at = 0;;) {
                int64_t l = 2 * at + 1, r = l + 1, best = at;
                if (l < size && before(c, l, best)) best = l;
                if (r < size && before(c, r, best)) best = r;
                if (best == at) break;
                swap(c, at, best); at = best;
            }
        }
        v = nodes++;
        out_tok[v] = t; out_par[v] = par; out_depth[v] = out_depth[par] + 1; out_score[v] = sc;
        /* its tail: (tail(parent) + (t,))[-n:] */
        int64_t buf[MAX_N + 1]; int nb = ntails[par];
        memcpy(buf, tails + (int64_t)par * MAX_N, sizeof(int64_t) * (size_t)nb);
        buf[nb++] = t;
        int keep = nb < n ? nb : n;
        memcpy(tails + (int64_t)v * MAX_N, buf + nb - keep, sizeof(int64_t) * (size_t)keep);
        ntails[v] = keep;
    }
    rc = nodes;
done:
    free(tails); free(ntails); free(ctok); free(cpr);
    return rc;
}

/* layout(tree, r) without masks: the first r grown nodes in depth order, best first within a
 * depth (a stable sort on (depth, -score)); parents re-indexed. Returns r, or -1 (memory). */
int ctx_layout(int r, const int32_t *tok, const int32_t *par, const int32_t *depth,
               const double *score, int32_t *out_par, int64_t *out_tok) {
    int32_t *order = malloc(sizeof(int32_t) * (size_t)(r > 0 ? r : 1));
    int32_t *newidx = malloc(sizeof(int32_t) * (size_t)(r > 0 ? r : 1));
    if (!order || !newidx) { free(order); free(newidx); return -1; }
    for (int i = 0; i < r; i++) order[i] = i;
    for (int i = 1; i < r; i++) {
        int32_t o = order[i]; int j = i - 1;
        while (j >= 0 && (depth[order[j]] > depth[o]
                          || (depth[order[j]] == depth[o] && -score[order[j]] > -score[o]))) {
            order[j + 1] = order[j]; j--;
        }
        order[j + 1] = o;
    }
    for (int i = 0; i < r; i++) newidx[order[i]] = i;
    for (int i = 0; i < r; i++) {
        int32_t o = order[i];
        out_par[i] = par[o] < 0 ? -1 : newidx[par[o]];
        out_tok[i] = tok[o];
    }
    free(order); free(newidx);
    return r;
}
