/* cluster_route: cache-aware routing (docs/prefix-cache.md "Cache-aware routing"): the
 * gateway's belief of what each prefill-capable worker's prefix cache holds, and the
 * tokens of a prompt it expects a worker to find cached.
 *
 * A belief is a set of block hashes (common/prefixhash.h) per worker: those of the last
 * HEARTBEAT "pfx" summary (each summary replaces the last: a block the worker no longer
 * reports is no longer believed), plus those of the prompts routed to the worker lately
 * (they are cached once computed; without them a burst of requests sharing a prefix would
 * be spread by load before the next heartbeat tells where the prefix is), which are
 * believed for CLUSTER_ROUTE_TTL_HB heartbeat intervals or while the summaries report
 * them. The set is an open-addressing table sized at its first use (no allocation per
 * request); when it fills, the entries no longer believed are dropped, and if that is not
 * enough (prompts routed faster than they expire) the routed ones too. A wrong belief (a
 * worker restarted, a block evicted since) only costs a miss: the worker confirms every
 * hash on the token ids. A worker that registers again (new process, or a new role)
 * starts with no belief, and so does one that reports no summary (its cache is off).
 *
 * A prompt's expected hit on worker w: the chain of its full blocks, hashed with w's seed
 * for the lookahead (MTP depth) the prompt will run at there, and counted from the first
 * block while w's belief holds them; capped as the worker caps what it shares (the last
 * token, and with MTP the one before, are always computed). */
#include <stdlib.h>
#include <string.h>

#include "cluster_internal.h"
#include "log.h"
#include "prefixhash.h"

#define ROUTE_CAP 16384 /* belief entries: 4 x (PROTO_PFX_MAX_HASHES + routed ones) */
_Static_assert((ROUTE_CAP & (ROUTE_CAP - 1)) == 0, "a power of two");

typedef struct {
    uint64_t hash;
    uint32_t seen;     /* the summary that last reported it (route_belief.gen); 0 = none */
    uint8_t used;
    int64_t until_us;  /* routed: believed until then (0 = not routed) */
} route_entry;

struct route_belief {
    uint32_t gen; /* summaries received */
    int n_used;
    int has_seed[PROTO_PFX_MAX_LOOKAHEAD + 1];
    uint64_t seed[PROTO_PFX_MAX_LOOKAHEAD + 1]; /* per lookahead, from the last summary */
    int n_reported;                             /* hashes in the last summary */
    route_entry e[ROUTE_CAP];
};

static int live(const route_belief *b, const route_entry *x, int64_t now)
{
    return x->used && ((b->gen && x->seen == b->gen) || x->until_us > now);
}

static uint32_t slot_of(uint64_t h)
{
    h ^= h >> 33; /* the low bits of a hash forced to few bits in tests are all alike */
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return (uint32_t)(h & (ROUTE_CAP - 1));
}

static route_entry *find(route_belief *b, uint64_t h)
{
    for (uint32_t i = slot_of(h), n = 0; n < ROUTE_CAP; i = (i + 1) & (ROUTE_CAP - 1), n++) {
        if (!b->e[i].used)
            return NULL;
        if (b->e[i].hash == h)
            return &b->e[i];
    }
    return NULL;
}

/* Keep only the entries still believed (rehashed into a clean table); with routed 0, only
 * those the last summary reported. */
static void compact(route_belief *b, int64_t now, int routed)
{
    static route_entry keep[ROUTE_CAP]; /* the loop thread's: one gateway loop */
    int n = 0;
    for (int i = 0; i < ROUTE_CAP; i++)
        if (routed ? live(b, &b->e[i], now) : b->e[i].used && b->gen && b->e[i].seen == b->gen)
            keep[n++] = b->e[i];
    memset(b->e, 0, sizeof(b->e));
    b->n_used = 0;
    for (int k = 0; k < n; k++) {
        uint32_t i = slot_of(keep[k].hash);
        while (b->e[i].used)
            i = (i + 1) & (ROUTE_CAP - 1);
        b->e[i] = keep[k];
        b->n_used++;
    }
}

/* The entry of h, made if new (NULL when the table is full of believed entries). */
static route_entry *upsert(route_belief *b, uint64_t h, int64_t now)
{
    route_entry *x = find(b, h);
    if (x)
        return x;
    if (b->n_used >= ROUTE_CAP / 4 * 3) {
        compact(b, now, 1);
        if (b->n_used >= ROUTE_CAP / 2) /* routed faster than believed: forget those */
            compact(b, now, 0);
        if (b->n_used >= ROUTE_CAP / 4 * 3)
            return NULL;
    }
    uint32_t i = slot_of(h);
    while (b->e[i].used)
        i = (i + 1) & (ROUTE_CAP - 1);
    b->e[i] = (route_entry){.hash = h, .used = 1};
    b->n_used++;
    return &b->e[i];
}

void cluster_route_forget(worker_t *w)
{
    free(w->belief);
    w->belief = NULL;
}

void cluster_route_summary(worker_t *w, const proto_prefix_summary *px)
{
    if (!px) { /* no summary: its cache is off (or it is no prefill worker) */
        cluster_route_forget(w);
        return;
    }
    if (!w->belief && !(w->belief = calloc(1, sizeof(*w->belief)))) {
        log_warn("out of memory for the prefix belief of worker %s", w->id);
        return;
    }
    route_belief *b = w->belief;
    int64_t now = proto_now_us();
    if (++b->gen == 0)
        b->gen = 1;
    memset(b->has_seed, 0, sizeof(b->has_seed));
    for (int g = 0, off = 0; g < px->n_groups; off += px->group[g++].n) {
        int la = px->group[g].lookahead;
        b->has_seed[la] = 1;
        b->seed[la] = px->group[g].seed;
        for (int k = 0; k < px->group[g].n; k++) {
            route_entry *x = upsert(b, px->hashes[off + k], now);
            if (x)
                x->seen = b->gen;
        }
    }
    b->n_reported = px->n_hashes;
}

int cluster_route_n_believed(const worker_t *w)
{
    if (!w->belief)
        return 0;
    int64_t now = proto_now_us();
    int n = 0;
    for (int i = 0; i < ROUTE_CAP; i++)
        n += live(w->belief, &w->belief->e[i], now);
    return n;
}

/* The MTP depth r's prompt runs at on w (prefill_worker: compute_req_depth, depth 0 with
 * sampling controls), which is the lookahead of its blocks' keys. */
static int req_lookahead(const req_t *r, const worker_t *w)
{
    if (r->samp)
        return 0;
    int d = w->mtp_depth > 0 ? w->mtp_depth - 1 : 0;
    if (r->mtp_depth > 0 && r->mtp_depth - 1 < d)
        d = r->mtp_depth - 1;
    return d;
}

/* r's chain of full blocks as w would key them, into c's scratch; returns the count
 * (0 when w's seed for it is unknown or r's prompt is never shared). */
static int chain_of(cluster_t *c, const worker_t *w, const req_t *r)
{
    const route_belief *b = w->belief;
    int la = req_lookahead(r, w);
    if (!b || r->echo || w->block_size <= 0 || la > PROTO_PFX_MAX_LOOKAHEAD || !b->has_seed[la])
        return 0;
    int n = r->n_prompt + r->n_gen;
    int max_blocks = n / w->block_size + 1;
    if (max_blocks > c->route_cap) {
        uint64_t *v = realloc(c->route_chain, (size_t)max_blocks * sizeof(*v));
        if (!v)
            return 0;
        c->route_chain = v;
        c->route_cap = max_blocks;
    }
    int max_cached = n - 1 - (la > 0);
    return prefixhash_chain(b->seed[la], w->block_size, la, r->tokens, n, max_cached,
                            c->route_chain, c->route_cap);
}

int cluster_route_expected_hit(cluster_t *c, const worker_t *w, const req_t *r)
{
    int n = chain_of(c, w, r);
    if (n == 0)
        return 0;
    int64_t now = proto_now_us();
    int k = 0;
    for (; k < n; k++) {
        const route_entry *x = find(w->belief, c->route_chain[k]);
        if (!x || !live(w->belief, x, now))
            break;
    }
    return k * w->block_size;
}

void cluster_route_routed(cluster_t *c, worker_t *w, const req_t *r)
{
    int n = chain_of(c, w, r);
    int64_t now = proto_now_us();
    int64_t until = now + (int64_t)CLUSTER_ROUTE_TTL_HB * c->p.heartbeat_ms * 1000;
    for (int k = 0; k < n; k++) {
        route_entry *x = upsert(w->belief, c->route_chain[k], now);
        if (x && x->until_us < until)
            x->until_us = until;
    }
}
