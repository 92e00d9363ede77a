/* multipart: see multipart.h. A hand-written scanner: every read is bounded by the body's
 * length (memmem / memchr with explicit sizes), header values are parsed with explicit end
 * pointers, and copies into the fixed fields are length-checked. */
#include "multipart.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

#define MAX_HEADER_BYTES 8192 /* one part header line */

/* Case-insensitive: does s (n bytes) start with prefix? */
static int ci_starts(const char *s, size_t n, const char *prefix)
{
    size_t k = strlen(prefix);
    return n >= k && strncasecmp(s, prefix, k) == 0;
}

/* A parameter value at *pp (token or quoted-string) into out (cap bytes). Advances *pp.
 * 0, or -1 (unterminated, too long). */
static int param_value(const char **pp, const char *end, char *out, size_t cap)
{
    const char *p = *pp;
    size_t n = 0;
    if (p < end && *p == '"') {
        p++;
        while (p < end && *p != '"') {
            if (*p == '\\' && p + 1 < end)
                p++;
            if (n + 1 >= cap)
                return -1;
            out[n++] = *p++;
        }
        if (p >= end)
            return -1;
        p++; /* closing quote */
    } else {
        while (p < end && *p != ';' && *p != ' ' && *p != '\t') {
            if (n + 1 >= cap)
                return -1;
            out[n++] = *p++;
        }
    }
    out[n] = 0;
    *pp = p;
    return 0;
}

/* Walk "; key=value" parameters of a header value [p, end); for each call fn. 0 or -1. */
static int each_param(const char *p, const char *end,
                      int (*fn)(const char *key, size_t klen, const char **pp, const char *end,
                                void *ud),
                      void *ud)
{
    for (;;) {
        while (p < end && (*p == ' ' || *p == '\t'))
            p++;
        if (p >= end)
            return 0;
        if (*p != ';')
            return -1;
        p++;
        while (p < end && (*p == ' ' || *p == '\t'))
            p++;
        const char *k = p;
        while (p < end && *p != '=' && *p != ';')
            p++;
        if (p >= end || *p != '=')
            return -1;
        size_t klen = (size_t)(p - k);
        while (klen > 0 && (k[klen - 1] == ' ' || k[klen - 1] == '\t'))
            klen--;
        p++;
        while (p < end && (*p == ' ' || *p == '\t'))
            p++;
        if (fn(k, klen, &p, end, ud) < 0)
            return -1;
    }
}

typedef struct {
    char boundary[72];
    int found;
} ct_params;

static int on_ct_param(const char *key, size_t klen, const char **pp, const char *end, void *ud)
{
    ct_params *c = ud;
    char tmp[256];
    if (param_value(pp, end, tmp, sizeof(tmp)) < 0)
        return -1;
    if (klen == 8 && strncasecmp(key, "boundary", 8) == 0) {
        size_t n = strlen(tmp);
        if (n < 1 || n > 70)
            return -1;
        memcpy(c->boundary, tmp, n + 1);
        c->found = 1;
    }
    return 0;
}

static int on_cd_param(const char *key, size_t klen, const char **pp, const char *end, void *ud)
{
    multipart_part *part = ud;
    if (klen == 4 && strncasecmp(key, "name", 4) == 0)
        return param_value(pp, end, part->name, sizeof(part->name));
    if (klen == 8 && strncasecmp(key, "filename", 8) == 0)
        return param_value(pp, end, part->filename, sizeof(part->filename));
    char skip[1024];
    return param_value(pp, end, skip, sizeof(skip));
}

int multipart_parse(const char *content_type, const char *body, size_t len, multipart_part *parts,
                    int max_parts, char *err, size_t errlen)
{
#define FAIL(...)                                                                                  \
    do {                                                                                           \
        snprintf(err, errlen, __VA_ARGS__);                                                        \
        return -1;                                                                                 \
    } while (0)
    if (!content_type)
        FAIL("no Content-Type");
    const char *ct = content_type, *ct_end = ct + strlen(ct);
    while (ct < ct_end && (*ct == ' ' || *ct == '\t'))
        ct++;
    if (!ci_starts(ct, (size_t)(ct_end - ct), "multipart/form-data"))
        FAIL("not multipart/form-data");
    ct_params cp = {.found = 0};
    if (each_param(ct + 19, ct_end, on_ct_param, &cp) < 0 || !cp.found)
        FAIL("no valid boundary parameter in the Content-Type");
    char delim[80];
    int dl = snprintf(delim, sizeof(delim), "\r\n--%s", cp.boundary); /* CRLF + "--" + b */
    const char *dash = delim + 2;                                     /* "--" + boundary */
    size_t dashl = (size_t)dl - 2;
    size_t pos;
    if (len >= dashl && memcmp(body, dash, dashl) == 0) {
        pos = dashl;
    } else {
        const char *q = len ? memmem(body, len, delim, (size_t)dl) : NULL;
        if (!q)
            FAIL("no opening boundary");
        pos = (size_t)(q - body) + (size_t)dl;
    }
    int n = 0;
    for (;;) {
        if (pos + 2 <= len && body[pos] == '-' && body[pos + 1] == '-')
            return n; /* close delimiter (an epilogue may follow) */
        while (pos < len && (body[pos] == ' ' || body[pos] == '\t'))
            pos++;
        if (pos + 2 > len || body[pos] != '\r' || body[pos + 1] != '\n')
            FAIL("malformed boundary line");
        pos += 2;
        if (n == max_parts)
            FAIL("more than %d parts", max_parts);
        multipart_part *part = &parts[n];
        memset(part, 0, sizeof(*part));
        int has_cd = 0;
        /* headers: lines until an empty one */
        for (;;) {
            const char *line = body + pos;
            const char *eol = pos < len ? memmem(line, len - pos, "\r\n", 2) : NULL;
            if (!eol)
                FAIL("unterminated part headers");
            size_t ll = (size_t)(eol - line);
            pos += ll + 2;
            if (ll == 0)
                break;
            if (ll > MAX_HEADER_BYTES)
                FAIL("part header longer than %d bytes", MAX_HEADER_BYTES);
            const char *colon = memchr(line, ':', ll);
            if (!colon)
                FAIL("malformed part header");
            size_t nl = (size_t)(colon - line);
            if (nl == 19 && strncasecmp(line, "Content-Disposition", 19) == 0) {
                const char *v = colon + 1, *vend = eol;
                while (v < vend && (*v == ' ' || *v == '\t'))
                    v++;
                if (!ci_starts(v, (size_t)(vend - v), "form-data"))
                    FAIL("a part's Content-Disposition is not form-data");
                if (each_param(v + 9, vend, on_cd_param, part) < 0)
                    FAIL("malformed Content-Disposition parameters");
                has_cd = 1;
            }
        }
        if (!has_cd || !part->name[0])
            FAIL("a part has no Content-Disposition name");
        const char *q = pos <= len ? memmem(body + pos, len - pos, delim, (size_t)dl) : NULL;
        if (!q)
            FAIL("missing closing boundary");
        part->data = body + pos;
        part->len = (size_t)(q - (body + pos));
        n++;
        pos = (size_t)(q - body) + (size_t)dl;
    }
#undef FAIL
}
