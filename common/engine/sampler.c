/*
 * sampler: see sampler.h.
 *
 * Random numbers: xorshift64* on the caller's 64-bit state (one draw per sampled token),
 * seeded by splitmix64. Candidate ordering is a total order (higher logit first, lower id
 * on ties) so results never depend on sort stability. Sorting is an in-place heap sort on
 * preallocated scratch (libc qsort may allocate): top-k keeps a bounded min-heap of the k
 * best, top-p without top-k first drops tokens whose probability is below
 * (1 - top_p) / (n - 1) (they can never be in the nucleus, as in run.c).
 */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>

typedef struct {
    float val; /* logit, then probability */
    int id;
} cand;

struct sampler {
    int vocab_size;
    cand *c;      /* (vocab_size,) */
    int *counts;  /* (vocab_size,) sampler_penalize: 0 between calls */
    uint8_t *seen; /* (vocab_size,) sampler_penalize: 0 between calls */
};

sampler_t *sampler_new(int vocab_size)
{
    if (vocab_size < 1)
        return NULL;
    sampler_t *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->vocab_size = vocab_size;
    s->c = calloc((size_t)vocab_size, sizeof(cand));
    s->counts = calloc((size_t)vocab_size, sizeof(int));
    s->seen = calloc((size_t)vocab_size, 1);
    if (!s->c || !s->counts || !s->seen) {
        sampler_destroy(&s);
        return NULL;
    }
    return s;
}

void sampler_destroy(sampler_t **sp)
{
    if (!sp || !*sp)
        return;
    free((*sp)->c);
    free((*sp)->counts);
    free((*sp)->seen);
    free(*sp);
    *sp = NULL;
}

uint64_t sampler_seed_state(uint64_t seed)
{
    uint64_t z = seed + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z ? z : 0x2545F4914F6CDD1DULL;
}

/* Uniform float in [0, 1) from xorshift64*. */
static float rand_f32(uint64_t *state)
{
    uint64_t x = *state;
    if (x == 0)
        x = 0x2545F4914F6CDD1DULL;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    uint64_t r = x * 0x2545F4914F6CDD1DULL;
    return (float)(r >> 40) / 16777216.0f;
}

/* a ranks before b: higher value, then lower id */
static int better(const cand *a, const cand *b)
{
    return a->val > b->val || (a->val == b->val && a->id < b->id);
}

/* Sift down in a heap whose root is the WORST element (min-heap by rank). */
static void sift_worst(cand *h, int n, int i)
{
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && better(&h[w], &h[l]))
            w = l;
        if (r < n && better(&h[w], &h[r]))
            w = r;
        if (w == i)
            return;
        cand tmp = h[i];
        h[i] = h[w];
        h[w] = tmp;
        i = w;
    }
}

/* Sort best-first in place: build a worst-rooted heap, then repeatedly move the worst to
 * the end. */
static void sort_best_first(cand *h, int n)
{
    for (int i = n / 2 - 1; i >= 0; i--)
        sift_worst(h, n, i);
    for (int end = n - 1; end > 0; end--) {
        cand tmp = h[0];
        h[0] = h[end];
        h[end] = tmp;
        sift_worst(h, end, 0);
    }
}

static int argmax(const float *x, int n)
{
    int best = 0;
    float bv = x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] > bv) {
            bv = x[i];
            best = i;
        }
    }
    return best;
}

/* The candidates a top-k and/or top-p draw chooses among: fills s->c best first with
 * probabilities (after temperature; logits may be overwritten) and returns their count;
 * *last is the index of the last candidate inside the nucleus and *cum the probability
 * mass of c[0..last]. Shared by sampler_sample and sampler_probs so that the distribution
 * speculative decoding verifies against is exactly the one sampling draws from. */
static int candidates(sampler_t *s, const sampler_params *p, float *logits, int top_k,
                      int use_top_p, int *last, float *cum)
{
    const int n = s->vocab_size;
    cand *c = s->c;
    int m;
    if (top_k) { /* the k best by logit, then sorted; softmax over them */
        for (int i = 0; i < top_k; i++)
            c[i] = (cand){logits[i], i};
        for (int i = top_k / 2 - 1; i >= 0; i--)
            sift_worst(c, top_k, i);
        for (int i = top_k; i < n; i++) {
            cand x = {logits[i], i};
            if (better(&x, &c[0])) {
                c[0] = x;
                sift_worst(c, top_k, 0);
            }
        }
        m = top_k;
        sort_best_first(c, m);
        float max_val = c[0].val, sum = 0.0f;
        for (int i = 0; i < m; i++) {
            c[i].val = expf(c[i].val - max_val);
            sum += c[i].val;
        }
        for (int i = 0; i < m; i++)
            c[i].val /= sum;
    } else { /* softmax over all, keep only plausible nucleus members, sort */
        int mi = argmax(logits, n);
        float max_val = logits[mi], sum = 0.0f;
        for (int i = 0; i < n; i++) {
            logits[i] = expf(logits[i] - max_val);
            sum += logits[i];
        }
        float cutoff = n > 1 ? (1.0f - p->top_p) / (float)(n - 1) : 0.0f;
        m = 0;
        for (int i = 0; i < n; i++) {
            float pr = logits[i] / sum;
            if (pr >= cutoff || i == mi)
                c[m++] = (cand){pr, i};
        }
        sort_best_first(c, m);
    }

    *last = m - 1;
    *cum = 0.0f;
    if (use_top_p) {
        for (int i = 0; i < m; i++) {
            *cum += c[i].val;
            if (*cum > p->top_p) {
                *last = i;
                break;
            }
        }
        if (*cum <= p->top_p) {
            *cum = 0.0f;
            for (int i = 0; i < m; i++)
                *cum += c[i].val;
        }
    } else {
        for (int i = 0; i < m; i++)
            *cum += c[i].val;
    }
    return m;
}

int sampler_sample(sampler_t *s, const sampler_params *p, uint64_t *rng, float *logits)
{
    const int n = s->vocab_size;
    if (!(p->temperature >= SAMPLER_GREEDY_EPS))
        return argmax(logits, n);
    for (int i = 0; i < n; i++)
        logits[i] /= p->temperature;
    float coin = rand_f32(rng);
    int top_k = p->top_k > 0 && p->top_k < n ? p->top_k : 0;
    int use_top_p = p->top_p < 1.0f; /* <= 0 keeps only the top token */

    if (!top_k && !use_top_p) { /* plain multinomial over the whole vocabulary */
        int mi = argmax(logits, n);
        float max_val = logits[mi], sum = 0.0f;
        for (int i = 0; i < n; i++) {
            logits[i] = expf(logits[i] - max_val);
            sum += logits[i];
        }
        float r = coin * sum, cdf = 0.0f;
        for (int i = 0; i < n; i++) {
            cdf += logits[i];
            if (r < cdf)
                return i;
        }
        return mi; /* rounding */
    }

    int last;
    float cum;
    candidates(s, p, logits, top_k, use_top_p, &last, &cum);
    const cand *c = s->c;
    float r = coin * cum, cdf = 0.0f;
    for (int i = 0; i <= last; i++) {
        cdf += c[i].val;
        if (r < cdf)
            return c[i].id;
    }
    return c[last].id;
}

void sampler_penalize(sampler_t *s, const sampler_penalties *pen, const int *hist, int n_hist,
                      int n_gen, float *logits)
{
    const int n = s->vocab_size;
    if (n_gen > n_hist)
        n_gen = n_hist;
    if (n_gen < 0)
        n_gen = 0;
    for (int i = 0; i < pen->n_bias; i++)
        if (pen->bias_ids[i] >= 0 && pen->bias_ids[i] < n)
            logits[pen->bias_ids[i]] += pen->bias[i];
    if (pen->ignore_eos && pen->eos_id >= 0 && pen->eos_id < n)
        logits[pen->eos_id] = -INFINITY;
    if (n_gen < pen->min_tokens) {
        if (pen->eos_id >= 0 && pen->eos_id < n)
            logits[pen->eos_id] = -INFINITY;
        for (int i = 0; i < pen->n_stop; i++)
            if (pen->stop_ids[i] >= 0 && pen->stop_ids[i] < n)
                logits[pen->stop_ids[i]] = -INFINITY;
    }
    int rep = pen->repetition > 0.0f && pen->repetition != 1.0f;
    if (!rep && pen->presence == 0.0f && pen->frequency == 0.0f)
        return;
    /* seen: 1 in the prompt, 2 generated (either one: repetition); counts: generated */
    const int p0 = n_hist - n_gen;
    for (int i = 0; i < n_hist; i++) {
        int t = hist[i];
        if (t < 0 || t >= n)
            continue;
        s->seen[t] |= i < p0 ? 1 : 2;
        s->counts[t] += i >= p0;
    }
    for (int i = 0; i < n_hist; i++) {
        int t = hist[i];
        if (t < 0 || t >= n || !s->seen[t])
            continue; /* each id once: its marks are cleared below */
        float l = logits[t];
        if (rep)
            l = l > 0.0f ? l / pen->repetition : l * pen->repetition;
        if (s->counts[t] > 0)
            l -= pen->frequency * (float)s->counts[t] + pen->presence;
        logits[t] = l;
        s->seen[t] = 0;
        s->counts[t] = 0;
    }
}

float sampler_uniform(uint64_t *rng)
{
    return rand_f32(rng);
}

void sampler_probs(sampler_t *s, const sampler_params *p, float *logits, float *probs)
{
    const int n = s->vocab_size;
    for (int i = 0; i < n; i++)
        probs[i] = 0.0f;
    if (!(p->temperature >= SAMPLER_GREEDY_EPS)) {
        probs[argmax(logits, n)] = 1.0f;
        return;
    }
    for (int i = 0; i < n; i++)
        logits[i] /= p->temperature;
    int top_k = p->top_k > 0 && p->top_k < n ? p->top_k : 0;
    int use_top_p = p->top_p < 1.0f; /* <= 0 keeps only the top token */

    if (!top_k && !use_top_p) { /* softmax over the whole vocabulary */
        int mi = argmax(logits, n);
        float max_val = logits[mi], sum = 0.0f;
        for (int i = 0; i < n; i++) {
            probs[i] = expf(logits[i] - max_val);
            sum += probs[i];
        }
        for (int i = 0; i < n; i++)
            probs[i] /= sum;
        return;
    }

    /* the candidates sampler_sample draws among, best first, as it computes them */
    int last;
    float cum;
    candidates(s, p, logits, top_k, use_top_p, &last, &cum);
    for (int i = 0; i <= last; i++)
        probs[s->c[i].id] = s->c[i].val / cum;
}

void sampler_logprobs(const float *logits, int vocab_size, int token, int n_top,
                      sampler_logprob *out)
{
    if (n_top < 0)
        n_top = 0;
    if (n_top > SAMPLER_MAX_TOP_LOGPROBS)
        n_top = SAMPLER_MAX_TOP_LOGPROBS;
    if (n_top > vocab_size)
        n_top = vocab_size;
    float mx = -INFINITY;
    for (int i = 0; i < vocab_size; i++)
        if (logits[i] > mx)
            mx = logits[i];
    double sum = 0;
    for (int i = 0; i < vocab_size; i++)
        sum += exp((double)logits[i] - (double)mx);
    double lse = (double)mx + log(sum);
    out->logprob = token >= 0 && token < vocab_size ? (float)((double)logits[token] - lse)
                                                    : -INFINITY;
    /* the n_top largest by insertion into a sorted list (n_top <= 20): strict > keeps the
     * lower id first among equal logits */
    int n = 0;
    for (int i = 0; i < vocab_size && n_top > 0; i++) {
        float v = logits[i];
        if (n == n_top && !(v > logits[out->top_ids[n - 1]]))
            continue;
        int j = n < n_top ? n++ : n - 1;
        while (j > 0 && v > logits[out->top_ids[j - 1]]) {
            out->top_ids[j] = out->top_ids[j - 1];
            j--;
        }
        out->top_ids[j] = i;
    }
    out->n_top = n;
    for (int j = 0; j < n; j++)
        out->top_logprobs[j] = (float)((double)logits[out->top_ids[j]] - lse);
}
