/*
 * traceline: one parser of trace lines for the simulator and the load client
 * (traceline.h). A CSV line is cut at its commas in place; a JSONL line goes through
 * jansson. The reader keeps one getline buffer.
 */
#include "traceline.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/types.h>

struct traceline_reader {
    FILE *f;
    char *path;
    char *buf;
    size_t cap;
    size_t lineno;     /* lines read */
    size_t data_lines; /* lines that were neither blank nor comments */
};

int traceline_class(const char *s, int *offline)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1]))
        n--;
    static const char *const on[] = {"online", "0", "default", "auto", "interactive"};
    static const char *const off[] = {"offline", "1", "flex", "batch"};
    *offline = 0;
    if (n == 0)
        return 0;
    for (size_t i = 0; i < sizeof(on) / sizeof(on[0]); i++)
        if (strlen(on[i]) == n && strncasecmp(s, on[i], n) == 0)
            return 0;
    for (size_t i = 0; i < sizeof(off) / sizeof(off[0]); i++)
        if (strlen(off[i]) == n && strncasecmp(s, off[i], n) == 0) {
            *offline = 1;
            return 0;
        }
    return -1;
}

/* A number filling the whole field (blanks around it allowed). */
static int parse_double(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    while (isspace((unsigned char)*end))
        end++;
    if (errno || end == s || *end)
        return -1;
    *out = v;
    return 0;
}

/* The checks every request passes, whatever its format. */
static int check_req(double t, double pt, double ot, traceline_req *q, const char **why)
{
    if (!isfinite(t) || t < 0) {
        *why = "arrival_s must be a finite number >= 0";
        return -1;
    }
    if (!(pt >= 1 && pt <= 1e9) || pt != floor(pt) || !(ot >= 1 && ot <= 1e9) || ot != floor(ot)) {
        *why = "prompt_tokens and output_tokens must be whole numbers in [1, 1e9]";
        return -1;
    }
    q->arrival_s = t;
    q->prompt_tokens = (long long)pt;
    q->output_tokens = (long long)ot;
    return 0;
}

static int parse_csv(char *line, traceline_req *q, const char **why)
{
    char *f[5];
    int n = 0;
    for (char *p = line; n < 5;) {
        f[n++] = p;
        char *c = strchr(p, ',');
        if (!c)
            break;
        *c = 0;
        p = c + 1;
    }
    if (n < 3 || n > 4) {
        *why = "want arrival_s,prompt_tokens,output_tokens[,class]";
        return -1;
    }
    double t, pt, ot;
    if (parse_double(f[0], &t) < 0) {
        *why = "arrival_s is not a number";
        return 1; /* a header, if it is the first request line: the caller decides */
    }
    if (parse_double(f[1], &pt) < 0 || parse_double(f[2], &ot) < 0) {
        *why = "prompt_tokens / output_tokens are not numbers";
        return -1;
    }
    if (check_req(t, pt, ot, q, why) < 0)
        return -1;
    if (traceline_class(n == 4 ? f[3] : "", &q->offline) < 0) {
        *why = "class must be online or offline";
        return -1;
    }
    return 0;
}

static int parse_json(const char *line, traceline_req *q, const char **why)
{
    json_error_t jerr;
    json_t *o = json_loads(line, 0, &jerr);
    int rc = -1;
    if (!json_is_object(o)) {
        *why = "not a JSON object";
        goto out;
    }
    const json_t *t = json_object_get(o, "arrival_s");
    const json_t *pt = json_object_get(o, "prompt_tokens");
    const json_t *ot = json_object_get(o, "output_tokens");
    if (!json_is_number(t) || !json_is_number(pt) || !json_is_number(ot)) {
        *why = "want numbers arrival_s, prompt_tokens, output_tokens";
        goto out;
    }
    if (check_req(json_number_value(t), json_number_value(pt), json_number_value(ot), q, why) < 0)
        goto out;
    q->offline = 0;
    const json_t *off = json_object_get(o, "offline");
    const json_t *cls = json_object_get(o, "class");
    const json_t *tier = json_object_get(o, "service_tier");
    if (off) {
        if (!json_is_boolean(off) && !json_is_integer(off)) {
            *why = "offline must be a boolean";
            goto out;
        }
        q->offline = json_is_true(off) || (json_is_integer(off) && json_integer_value(off));
    } else if (cls || tier) {
        const json_t *s = cls ? cls : tier;
        if (!json_is_string(s) || traceline_class(json_string_value(s), &q->offline) < 0) {
            *why = "class / service_tier must be online, offline or flex";
            goto out;
        }
    }
    rc = 0;
out:
    json_decref(o);
    return rc;
}

int traceline_parse(char *line, traceline_req *q, const char **why)
{
    while (isspace((unsigned char)*line))
        line++;
    return *line == '{' ? parse_json(line, q, why) : parse_csv(line, q, why);
}

traceline_reader_t *traceline_open(const char *path, char *err, size_t err_len)
{
    traceline_reader_t *r = calloc(1, sizeof(*r));
    if (!r || !(r->path = strdup(path))) {
        free(r);
        snprintf(err, err_len, "%s: out of memory", path);
        return NULL;
    }
    if (!(r->f = fopen(path, "r"))) {
        snprintf(err, err_len, "%s: %s", path, strerror(errno));
        traceline_close(&r);
        return NULL;
    }
    return r;
}

int traceline_next(traceline_reader_t *r, traceline_req *q, char *err, size_t err_len)
{
    ssize_t len;
    while ((len = getline(&r->buf, &r->cap, r->f)) >= 0) {
        r->lineno++;
        while (len > 0 && (r->buf[len - 1] == '\n' || r->buf[len - 1] == '\r'))
            r->buf[--len] = 0;
        char *s = r->buf;
        while (isspace((unsigned char)*s))
            s++;
        if (!*s || *s == '#')
            continue;
        traceline_req one = {0};
        const char *why = "?";
        int rc = traceline_parse(s, &one, &why);
        if (rc == 1 && r->data_lines == 0) {
            r->data_lines++;
            continue; /* a CSV header */
        }
        r->data_lines++;
        if (rc != 0) {
            snprintf(err, err_len, "%s:%zu: %s", r->path, r->lineno, why);
            return -1;
        }
        one.line = r->lineno;
        *q = one;
        return 1;
    }
    if (ferror(r->f)) {
        snprintf(err, err_len, "%s: read error", r->path);
        return -1;
    }
    return 0;
}

void traceline_close(traceline_reader_t **r)
{
    if (!r || !*r)
        return;
    if ((*r)->f)
        fclose((*r)->f);
    free((*r)->buf);
    free((*r)->path);
    free(*r);
    *r = NULL;
}
