/* seqpen: see seqpen.h. */
#include "seqpen.h"

#include <stdlib.h>
#include <string.h>

struct seqpen {
    proto_sampling ps;
    sampler_penalties pen; /* views into ps */
    int *ids;              /* (cap,) prompt then generated */
    int n_ids, n_gen, cap;
};

seqpen_t *seqpen_new(const proto_sampling *ps, const int *ids, int n_ids, int n_gen, int cap,
                     int eos_id)
{
    if (!ps || n_ids < 0 || n_gen < 0 || n_gen > n_ids || cap < n_ids || cap < 1)
        return NULL;
    seqpen_t *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    p->ids = malloc((size_t)cap * sizeof(int));
    if (!p->ids) {
        free(p);
        return NULL;
    }
    if (n_ids)
        memcpy(p->ids, ids, (size_t)n_ids * sizeof(int));
    p->n_ids = n_ids;
    p->n_gen = n_gen;
    p->cap = cap;
    p->ps = *ps;
    p->pen = (sampler_penalties){.presence = p->ps.presence,
                                 .frequency = p->ps.frequency,
                                 .repetition = p->ps.repetition,
                                 .min_tokens = p->ps.min_tokens,
                                 .ignore_eos = p->ps.ignore_eos,
                                 .eos_id = eos_id,
                                 .bias_ids = p->ps.bias_ids,
                                 .bias = p->ps.bias,
                                 .n_bias = p->ps.n_bias,
                                 .stop_ids = p->ps.stop_ids,
                                 .n_stop = p->ps.n_stop};
    return p;
}

void seqpen_destroy(seqpen_t **pp)
{
    if (!pp || !*pp)
        return;
    free((*pp)->ids);
    free(*pp);
    *pp = NULL;
}

int seqpen_push(seqpen_t *p, int token)
{
    if (p->n_ids >= p->cap)
        return -1;
    p->ids[p->n_ids++] = token;
    p->n_gen++;
    return 0;
}

void seqpen_apply(const seqpen_t *p, sampler_t *s, float *logits)
{
    sampler_penalize(s, &p->pen, p->ids, p->n_ids, p->n_gen, logits);
}

int seqpen_is_stop(const seqpen_t *p, int token)
{
    for (int i = 0; i < p->ps.n_stop; i++)
        if (p->ps.stop_ids[i] == token)
            return 1;
    return 0;
}

void seqpen_export(const seqpen_t *p, int drop, proto_sampling *out, const int **ids,
                   int *n_ids)
{
    drop = drop && p->n_gen > 0 ? 1 : 0;
    *out = p->ps;
    out->n_gen = p->n_gen - drop;
    *ids = p->ids;
    *n_ids = p->n_ids - drop;
}
