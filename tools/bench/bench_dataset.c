/*
 * bench_dataset: JSONL prompts for tidepool-bench (bench_dataset.h), kept as parsed
 * jansson objects, one per line, in a growable array.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "bench_dataset.h"

struct bench_dataset {
    json_t **items; /* one object per line, owned */
    size_t n, cap;
};

void bench_dataset_destroy(bench_dataset_t **pds)
{
    if (!pds || !*pds)
        return;
    bench_dataset_t *ds = *pds;
    for (size_t i = 0; i < ds->n; i++)
        json_decref(ds->items[i]);
    free(ds->items);
    free(ds);
    *pds = NULL;
}

size_t bench_dataset_size(const bench_dataset_t *ds)
{
    return ds->n;
}

const json_t *bench_dataset_item(const bench_dataset_t *ds, size_t i)
{
    return ds->items[i];
}

bench_dataset_t *bench_dataset_load(const char *path, size_t max_items, int chat, char *err,
                                    size_t err_len)
{
    bench_dataset_t *ds = calloc(1, sizeof(*ds));
    if (!ds) {
        snprintf(err, err_len, "%s: out of memory", path);
        return NULL;
    }
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, err_len, "%s: cannot open: %s", path, strerror(errno));
        free(ds);
        return NULL;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    long lineno = 0;
    int rc = -1;
    while (ds->n < max_items && (len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        ssize_t k = 0;
        while (k < len && (line[k] == ' ' || line[k] == '\t' || line[k] == '\n' ||
                           line[k] == '\r'))
            k++;
        if (k == len)
            continue;
        json_error_t je;
        json_t *o = json_loadb(line, (size_t)len, 0, &je);
        if (!o || !json_is_object(o)) {
            snprintf(err, err_len, "%s:%ld: not a JSON object%s%s", path, lineno,
                     o ? "" : ": ", o ? "" : je.text);
            json_decref(o);
            goto out;
        }
        const json_t *p = json_object_get(o, "prompt"), *m = json_object_get(o, "messages");
        const json_t *mt = json_object_get(o, "max_tokens");
        const char *bad = NULL;
        if (!json_is_string(p) && !(json_is_array(m) && json_array_size(m) > 0))
            bad = "needs a string \"prompt\" or a non-empty array \"messages\"";
        else if (!json_is_string(p) && !chat)
            bad = "\"messages\" needs a chat endpoint (--endpoint /v1/chat/completions)";
        else if (mt && (!json_is_integer(mt) || json_integer_value(mt) < 1))
            bad = "\"max_tokens\" must be an integer >= 1";
        if (bad) {
            snprintf(err, err_len, "%s:%ld: %s", path, lineno, bad);
            json_decref(o);
            goto out;
        }
        if (ds->n == ds->cap) {
            size_t nc = ds->cap ? ds->cap * 2 : 64;
            json_t **ni = realloc(ds->items, nc * sizeof(*ni));
            if (!ni) {
                snprintf(err, err_len, "%s: out of memory", path);
                json_decref(o);
                goto out;
            }
            ds->items = ni;
            ds->cap = nc;
        }
        ds->items[ds->n++] = o;
    }
    if (ferror(f)) {
        snprintf(err, err_len, "%s: read error", path);
        goto out;
    }
    if (ds->n == 0) {
        snprintf(err, err_len, "%s: no prompts in the file", path);
        goto out;
    }
    rc = 0;
out:
    free(line);
    fclose(f);
    if (rc < 0)
        bench_dataset_destroy(&ds);
    return ds;
}
