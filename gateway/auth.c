/* auth: see auth.h. Keys are a growable array of digests with their parameters and two
 * token buckets each; a lookup compares the presented key's digest with all of them. */
#include "auth.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define DIGEST_BYTES crypto_generichash_BYTES /* 32 */
#define MAX_RATE 1e9

typedef struct {
    double rate;   /* per second; 0 = no limit */
    double cap;    /* what the bucket holds at most: max(rate, 1) */
    double level;  /* what it holds (negative: debt) */
    int64_t t_us;  /* when level was last brought up to date (0 = never: full) */
} bucket;

struct auth_key {
    unsigned char digest[DIGEST_BYTES];
    char id[AUTH_ID_HEX + 1];
    size_t n_bytes; /* the key's length */
    char *source;   /* where it was given (auth_add_key's source), for messages */
    auth_key_params p;
    bucket requests, tokens;
};

struct auth {
    auth_key **keys; /* pointers: a key handed out stays where it is as keys are added */
    int n, cap, n_admin;
};

auth_t *auth_new(void)
{
    if (sodium_init() < 0)
        return NULL;
    return calloc(1, sizeof(auth_t));
}

void auth_destroy(auth_t **pa)
{
    if (!pa || !*pa)
        return;
    auth_t *a = *pa;
    for (int i = 0; i < a->n; i++) {
        free(a->keys[i]->source);
        sodium_memzero(a->keys[i], sizeof(*a->keys[i]));
        free(a->keys[i]);
    }
    free(a->keys);
    free(a);
    *pa = NULL;
}

static void digest_of(const char *s, size_t n, unsigned char out[DIGEST_BYTES])
{
    crypto_generichash(out, DIGEST_BYTES, (const unsigned char *)s, n, NULL, 0);
}

static void bucket_init(bucket *b, double rate)
{
    b->rate = rate;
    b->cap = rate > 1 ? rate : 1;
    b->level = b->cap;
    b->t_us = 0;
}

int auth_add_key(auth_t *a, const char *key, const auth_key_params *p, const char *source,
                 char *err, size_t errlen)
{
    size_t n = strlen(key);
    if (n == 0 || n > AUTH_MAX_KEY_BYTES) {
        snprintf(err, errlen, "an API key must be 1 to %d bytes long (one is %zu)",
                 AUTH_MAX_KEY_BYTES, n);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        if (key[i] < 0x21 || key[i] > 0x7e) {
            snprintf(err, errlen,
                     "an API key may hold only visible ASCII characters (one has a space, a "
                     "control or a non-ASCII byte at offset %zu)",
                     i);
            return -1;
        }
    }
    if (!(p->requests_per_s == 0 || (p->requests_per_s > 0 && p->requests_per_s <= MAX_RATE)) ||
        !(p->tokens_per_s == 0 || (p->tokens_per_s > 0 && p->tokens_per_s <= MAX_RATE))) {
        snprintf(err, errlen, "a rate limit must be a number in (0, 1e9]");
        return -1;
    }
    auth_key *k = calloc(1, sizeof(*k));
    if (!k) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    digest_of(key, n, k->digest);
    for (int i = 0; i < AUTH_ID_HEX / 2; i++)
        snprintf(k->id + 2 * i, 3, "%02x", k->digest[i]);
    for (int i = 0; i < a->n; i++) {
        int same = sodium_memcmp(a->keys[i]->digest, k->digest, DIGEST_BYTES) == 0;
        if (same || strcmp(a->keys[i]->id, k->id) == 0) {
            snprintf(err, errlen,
                     same ? "the API key with id %s is given twice: in %s and in %s"
                          : "two API keys have the id %s (in %s and in %s): replace one of them",
                     k->id, a->keys[i]->source, source);
            free(k);
            return -1;
        }
    }
    if (!(k->source = strdup(source))) {
        free(k);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (a->n == a->cap) {
        int cap = a->cap ? 2 * a->cap : 8;
        auth_key **v = realloc(a->keys, (size_t)cap * sizeof(*v));
        if (!v) {
            free(k->source);
            free(k);
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        a->keys = v;
        a->cap = cap;
    }
    k->n_bytes = n;
    k->p = *p;
    k->p.admin = p->admin ? 1 : 0;
    bucket_init(&k->requests, p->requests_per_s);
    bucket_init(&k->tokens, p->tokens_per_s);
    a->keys[a->n++] = k;
    a->n_admin += k->p.admin;
    return 0;
}

/* "name=N" with N a number in (0, 1e9]: 1 and *out; 0 when word is not name=...; -1 bad. */
static int rate_attr(const char *word, const char *name, double *out)
{
    size_t n = strlen(name);
    if (strncmp(word, name, n) != 0 || word[n] != '=')
        return 0;
    char *end;
    errno = 0;
    double v = strtod(word + n + 1, &end);
    if (errno || end == word + n + 1 || *end || !isfinite(v) || v <= 0 || v > MAX_RATE)
        return -1;
    *out = v;
    return 1;
}

/* One line of a key file (NUL-terminated, no newline), number lineno. 0 (a key added or a
 * blank or comment line), or -1 with err set. */
static int file_line(auth_t *a, const char *path, int lineno, char *line, char *err,
                     size_t errlen)
{
    char *save = NULL, *key = NULL;
    auth_key_params p = {0};
    int nword = 0, seen_admin = 0, seen_requests = 0, seen_tokens = 0;
    for (char *w = strtok_r(line, " \t\r\f\v", &save); w; w = strtok_r(NULL, " \t\r\f\v", &save)) {
        if (w[0] == '#')
            break; /* a comment to the end of the line */
        nword++;
        if (!key) {
            key = w;
            continue;
        }
        int r = 0, *seen = NULL;
        const char *attr = NULL;
        if (strcmp(w, "admin") == 0) {
            p.admin = 1;
            seen = &seen_admin, attr = "admin";
        } else if ((r = rate_attr(w, "requests-per-s", &p.requests_per_s)) != 0) {
            seen = &seen_requests, attr = "requests-per-s";
        } else if ((r = rate_attr(w, "tokens-per-s", &p.tokens_per_s)) != 0) {
            seen = &seen_tokens, attr = "tokens-per-s";
        }
        if (r < 0) {
            snprintf(err, errlen, "%s: line %d: word %d: a rate must be a number in (0, 1e9]",
                     path, lineno, nword);
            return -1;
        }
        if (seen && (*seen)++) { /* which one would win is a guess: refuse */
            snprintf(err, errlen, "%s: line %d: word %d repeats the attribute %s", path, lineno,
                     nword, attr);
            return -1;
        }
        if (!seen) { /* not echoed: it could be a second key pasted on the line */
            snprintf(err, errlen,
                     "%s: line %d: word %d is not an attribute (want admin, requests-per-s=N "
                     "or tokens-per-s=N after the key)",
                     path, lineno, nword);
            return -1;
        }
    }
    if (!key)
        return 0;
    char why[512], source[300];
    snprintf(source, sizeof(source), "%s line %d", path, lineno);
    if (auth_add_key(a, key, &p, source, why, sizeof(why)) < 0) {
        snprintf(err, errlen, "%s: line %d: %s", path, lineno, why);
        return -1;
    }
    return 0;
}

int auth_load_file(auth_t *a, const char *path, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "%s: cannot open the API key file: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s: the API key file is not a regular file", path);
        close(fd);
        return -1;
    }
    if (st.st_mode & 077) {
        snprintf(err, errlen,
                 "%s: the API key file is accessible by group or others (mode %04o): make it "
                 "readable by its owner only (chmod 600)",
                 path, (unsigned)(st.st_mode & 07777));
        close(fd);
        return -1;
    }
    FILE *f = fdopen(fd, "r");
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int lineno = 0, rc = 0, before = a->n;
    while ((len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        if (memchr(line, 0, (size_t)len)) {
            snprintf(err, errlen, "%s: line %d: a NUL byte", path, lineno);
            rc = -1;
            break;
        }
        if (len > 0 && line[len - 1] == '\n')
            line[--len] = 0;
        if (file_line(a, path, lineno, line, err, errlen) < 0) {
            rc = -1;
            break;
        }
    }
    if (rc == 0 && ferror(f)) {
        snprintf(err, errlen, "%s: cannot read the API key file: %s", path, strerror(errno));
        rc = -1;
    }
    if (rc == 0 && a->n == before) {
        snprintf(err, errlen, "%s: the API key file holds no key", path);
        rc = -1;
    }
    if (line) {
        sodium_memzero(line, cap);
        free(line);
    }
    fclose(f);
    return rc;
}

int auth_n_keys(const auth_t *a)
{
    return a ? a->n : 0;
}

int auth_n_admin(const auth_t *a)
{
    return a ? a->n_admin : 0;
}

const auth_key *auth_key_at(const auth_t *a, int i)
{
    return i >= 0 && i < a->n ? a->keys[i] : NULL;
}

auth_status_t auth_check(auth_t *a, const char *h, auth_key **key)
{
    *key = NULL;
    if (!h)
        return AUTH_MISSING;
    h += strspn(h, " \t");
    if (strncasecmp(h, "Bearer", 6) != 0 || (h[6] != ' ' && h[6] != '\t'))
        return AUTH_MISSING;
    h += 6;
    h += strspn(h, " \t");
    size_t n = strlen(h);
    while (n > 0 && (h[n - 1] == ' ' || h[n - 1] == '\t'))
        n--;
    if (n == 0)
        return AUTH_MISSING;
    unsigned char d[DIGEST_BYTES];
    digest_of(h, n, d);
    auth_key *found = NULL;
    for (int i = 0; i < a->n; i++) /* all of them, whichever matches */
        if (sodium_memcmp(d, a->keys[i]->digest, DIGEST_BYTES) == 0)
            found = a->keys[i];
    sodium_memzero(d, sizeof(d));
    *key = found;
    return found ? AUTH_OK : AUTH_INVALID;
}

const char *auth_key_id(const auth_key *k)
{
    return k->id;
}

size_t auth_key_bytes(const auth_key *k)
{
    return k->n_bytes;
}

auth_key_params auth_key_get_params(const auth_key *k)
{
    return k->p;
}

// --- rate limits

static void refill(bucket *b, int64_t now_us)
{
    if (b->t_us && now_us > b->t_us) {
        b->level += b->rate * (double)(now_us - b->t_us) / 1e6;
        if (b->level > b->cap)
            b->level = b->cap;
    }
    if (!b->t_us || now_us > b->t_us)
        b->t_us = now_us;
}

static int take(bucket *b, int64_t now_us, double n, int *retry_after_s)
{
    *retry_after_s = 0;
    if (b->rate <= 0)
        return 0;
    refill(b, now_us);
    double need = n < b->cap ? n : b->cap; /* more than it holds: a full bucket */
    if (b->level >= need) {
        b->level -= n;
        return 0;
    }
    double s = ceil((need - b->level) / b->rate);
    *retry_after_s = s < 1 ? 1 : s > 86400 ? 86400 : (int)s;
    return -1;
}

int auth_take_request(auth_key *k, int64_t now_us, int *retry_after_s)
{
    return take(&k->requests, now_us, 1, retry_after_s);
}

int auth_take_tokens(auth_key *k, int64_t now_us, double n, int *retry_after_s)
{
    return take(&k->tokens, now_us, n > 0 ? n : 0, retry_after_s);
}

void auth_return_tokens(auth_key *k, int64_t now_us, double n)
{
    bucket *b = &k->tokens;
    if (b->rate <= 0 || !(n > 0))
        return;
    refill(b, now_us);
    b->level += n;
    if (b->level > b->cap)
        b->level = b->cap;
}
