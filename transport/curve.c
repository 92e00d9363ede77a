/* curve: see curve.h. Key files are parsed line by line into a small state machine (no
 * allocation but the authorized list, a sorted array searched by bsearch). The ZAP handler
 * is a REP socket on inproc://zeromq.zap.01 polled by its own thread together with an
 * inproc PAIR that carries the stop order; sockets are created and bound by the starting
 * thread, then used only by the handler's thread (pthread_create is the memory barrier
 * ZeroMQ asks for when a socket changes threads). */
#include "curve.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "log.h"

#define KEYFILE_MAX_BYTES (1 << 20) /* a key file or a list file larger than this is refused */
#define ZAP_ENDPOINT "inproc://zeromq.zap.01"

// --- Z85

static const char z85_chars[] =
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";

static int z85_digit(char c)
{
    const char *p = c ? strchr(z85_chars, c) : NULL;
    return p ? (int)(p - z85_chars) : -1;
}

int curve_z85_valid(const char *s)
{
    if (!s || strlen(s) != CURVE_Z85_LEN)
        return 0;
    for (int g = 0; g < CURVE_Z85_LEN; g += 5) {
        uint64_t v = 0;
        for (int i = 0; i < 5; i++) {
            int d = z85_digit(s[g + i]);
            if (d < 0)
                return 0;
            v = v * 85 + (uint64_t)d;
        }
        if (v > 0xffffffffull)
            return 0;
    }
    return 1;
}

static int z85_to_bin(const char *z85, uint8_t *bin)
{
    return curve_z85_valid(z85) && zmq_z85_decode(bin, z85) != NULL ? 0 : -1;
}

// --- key pairs

int curve_keypair_new(curve_keypair *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    if (!zmq_has("curve") || zmq_curve_keypair(out->public_z85, out->secret_z85) != 0) {
        snprintf(err, errlen, "this libzmq has no CURVE support: %s", zmq_strerror(zmq_errno()));
        return -1;
    }
    return 0;
}

static int read_file(const char *path, char **text, size_t *len, char *err, size_t errlen)
{
    *text = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size > KEYFILE_MAX_BYTES) {
        snprintf(err, errlen, "%s: not a regular file of at most %d bytes", path,
                 KEYFILE_MAX_BYTES);
        close(fd);
        return -1;
    }
    char *buf = malloc((size_t)st.st_size + 1);
    size_t got = 0;
    while (buf && got < (size_t)st.st_size) {
        ssize_t n = read(fd, buf + got, (size_t)st.st_size - got);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    if (!buf || got != (size_t)st.st_size) {
        snprintf(err, errlen, "cannot read %s", path);
        free(buf);
        return -1;
    }
    buf[got] = 0;
    *text = buf;
    *len = got;
    return 0;
}

/* What one line of a key file is. */
typedef enum { LN_SKIP, LN_PUBLIC, LN_SECRET, LN_BARE, LN_BAD } line_kind_t;

/* Classify line [p, p + n) (no newline); for a key line, copy the key into key (41 bytes)
 * unchecked but at most CURVE_Z85_LEN + 1 characters (longer: LN_BAD). section tracks the
 * section lines: 0 none, 1 metadata, 2 curve. */
static line_kind_t classify(const char *p, size_t n, int *section, char *key, const char **why)
{
    while (n > 0 && (p[n - 1] == ' ' || p[n - 1] == '\t' || p[n - 1] == '\r'))
        n--;
    int indented = n > 0 && (p[0] == ' ' || p[0] == '\t');
    while (n > 0 && (*p == ' ' || *p == '\t')) {
        p++;
        n--;
    }
    /* '#' is a Z85 digit too, but 84 x 85^4 > 2^32: no key begins with it */
    if (n == 0 || *p == '#')
        return LN_SKIP;
    if (!indented && n == 8 && memcmp(p, "metadata", 8) == 0) {
        *section = 1;
        return LN_SKIP;
    }
    if (!indented && n == 5 && memcmp(p, "curve", 5) == 0) {
        *section = 2;
        return LN_SKIP;
    }
    if (n == CURVE_Z85_LEN && !indented) { /* 40 Z85 characters, but no key */
        size_t i = 0;
        while (i < n && z85_digit(p[i]) >= 0)
            i++;
        if (i == n) {
            memcpy(key, p, n);
            key[n] = 0;
            return LN_BARE; /* refused by the callers' check */
        }
    }
    const char *eq = memchr(p, '=', n);
    if (!eq) {
        *why = "neither a comment, a section, a 'name = \"value\"' line nor a key";
        return LN_BAD;
    }
    size_t nl = (size_t)(eq - p);
    while (nl > 0 && (p[nl - 1] == ' ' || p[nl - 1] == '\t'))
        nl--;
    const char *v = eq + 1;
    size_t vl = n - (size_t)(v - p);
    while (vl > 0 && (*v == ' ' || *v == '\t')) {
        v++;
        vl--;
    }
    if (vl >= 2 && v[0] == '"' && v[vl - 1] == '"') {
        v++;
        vl -= 2;
    } else if (memchr(v, '"', vl)) {
        *why = "unbalanced quotes";
        return LN_BAD;
    }
    if (!indented) {
        *why = "a 'name = value' line outside a section (must be indented)";
        return LN_BAD;
    }
    int is_pub = nl == 10 && memcmp(p, "public-key", 10) == 0;
    int is_sec = nl == 10 && memcmp(p, "secret-key", 10) == 0;
    if (*section == 2 && (is_pub || is_sec)) {
        if (vl != CURVE_Z85_LEN) {
            *why = "a key is not 40 Z85 characters";
            return LN_BAD;
        }
        memcpy(key, v, vl);
        key[vl] = 0;
        return is_pub ? LN_PUBLIC : LN_SECRET;
    }
    if (*section == 1)
        return LN_SKIP; /* metadata: any name = value */
    *why = *section == 2 ? "an unknown name in the curve section" : "a line outside a section";
    return LN_BAD;
}

int curve_key_parse(const char *text, size_t len, const char *name, int need_secret,
                    curve_keypair *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    int section = 0, lineno = 0;
    const char *p = text, *end = text + len;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
        lineno++;
        char key[CURVE_Z85_LEN + 1];
        const char *why = "";
        if (memchr(p, 0, n)) {
            snprintf(err, errlen, "%s:%d: malformed key file: a NUL byte", name, lineno);
            goto fail;
        }
        line_kind_t k = classify(p, n, &section, key, &why);
        p += n + (nl ? 1 : 0);
        if (k == LN_SKIP)
            continue;
        if (k == LN_BARE) {
            why = "a bare key (a key file names its keys: public-key = \"...\")";
            k = LN_BAD;
        }
        if (k == LN_BAD) {
            snprintf(err, errlen, "%s:%d: malformed key file: %s", name, lineno, why);
            goto fail;
        }
        char *dst = k == LN_PUBLIC ? out->public_z85 : out->secret_z85;
        if (dst[0]) {
            snprintf(err, errlen, "%s:%d: malformed key file: %s given twice", name, lineno,
                     k == LN_PUBLIC ? "public-key" : "secret-key");
            goto fail;
        }
        if (!curve_z85_valid(key)) {
            snprintf(err, errlen, "%s:%d: malformed key file: the %s is not valid Z85", name,
                     lineno, k == LN_PUBLIC ? "public key" : "secret key");
            goto fail;
        }
        memcpy(dst, key, sizeof(key));
    }
    if (!out->public_z85[0]) {
        snprintf(err, errlen, "%s: malformed key file: no public-key", name);
        goto fail;
    }
    if (need_secret && !out->secret_z85[0]) {
        snprintf(err, errlen, "%s: holds no secret-key (a .pub file? give the .key file)", name);
        goto fail;
    }
    if (out->secret_z85[0]) {
        char derived[CURVE_Z85_LEN + 1];
        if (zmq_curve_public(derived, out->secret_z85) != 0) {
            snprintf(err, errlen, "%s: cannot derive the public key: %s", name,
                     zmq_strerror(zmq_errno()));
            goto fail;
        }
        if (strcmp(derived, out->public_z85) != 0) {
            snprintf(err, errlen, "%s: malformed key file: the public-key is not the secret "
                     "key's", name);
            goto fail;
        }
    }
    return 0;
fail:
    memset(out, 0, sizeof(*out));
    return -1;
}

int curve_key_load(const char *path, int need_secret, curve_keypair *out, char *err,
                   size_t errlen)
{
    memset(out, 0, sizeof(*out));
    char *text;
    size_t len;
    if (read_file(path, &text, &len, err, errlen) < 0)
        return -1;
    int rc = curve_key_parse(text, len, path, need_secret, out, err, errlen);
    struct stat st;
    if (rc == 0 && out->secret_z85[0] && stat(path, &st) == 0 && (st.st_mode & 077)) {
        snprintf(err, errlen, "%s holds a secret key but its mode %04o lets group or others "
                 "read it: chmod 600 %s", path, (unsigned)(st.st_mode & 07777), path);
        memset(out, 0, sizeof(*out));
        rc = -1;
    }
    memset(text, 0, len); /* the secret key */
    free(text);
    return rc;
}

static int write_keyfile(const char *path, int mode, int force, const char *text, char *err,
                         size_t errlen)
{
    int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (force ? O_TRUNC : O_EXCL);
    int fd = open(path, flags, mode);
    if (fd < 0) {
        snprintf(err, errlen, "cannot create %s: %s%s", path, strerror(errno),
                 errno == EEXIST ? " (--force replaces it)" : "");
        return -1;
    }
    size_t n = strlen(text);
    int ok = fchmod(fd, (mode_t)mode) == 0 && write(fd, text, n) == (ssize_t)n;
    if (close(fd) < 0)
        ok = 0;
    if (!ok) {
        snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
        unlink(path);
        return -1;
    }
    return 0;
}

int curve_key_save(const char *base, const curve_keypair *kp, int force, char *err,
                   size_t errlen)
{
    if (!curve_z85_valid(kp->public_z85) || !curve_z85_valid(kp->secret_z85)) {
        snprintf(err, errlen, "invalid key pair");
        return -1;
    }
    char key_path[4096], pub_path[4096], stamp[32];
    if ((size_t)snprintf(key_path, sizeof(key_path), "%s.key", base) >= sizeof(key_path) ||
        (size_t)snprintf(pub_path, sizeof(pub_path), "%s.pub", base) >= sizeof(pub_path)) {
        snprintf(err, errlen, "path too long: %s", base);
        return -1;
    }
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%SZ", &tm);
    char text[1024];
    snprintf(text, sizeof(text),
             "#   **** Generated on %s by tidepool-keygen ****\n"
             "#   ZeroMQ CURVE **Secret** Certificate\n"
             "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n"
             "\n"
             "metadata\n"
             "curve\n"
             "    public-key = \"%s\"\n"
             "    secret-key = \"%s\"\n",
             stamp, kp->public_z85, kp->secret_z85);
    if (write_keyfile(key_path, 0600, force, text, err, errlen) < 0) {
        memset(text, 0, sizeof(text));
        return -1;
    }
    memset(text, 0, sizeof(text));
    snprintf(text, sizeof(text),
             "#   **** Generated on %s by tidepool-keygen ****\n"
             "#   ZeroMQ CURVE Public Certificate\n"
             "#   Exchange securely, or use a secure mechanism to verify the contents\n"
             "#   of this file after exchange. Store public certificates in your home\n"
             "#   directory, in the .curve subdirectory.\n"
             "\n"
             "metadata\n"
             "curve\n"
             "    public-key = \"%s\"\n",
             stamp, kp->public_z85);
    if (write_keyfile(pub_path, 0644, force, text, err, errlen) < 0) {
        unlink(key_path);
        return -1;
    }
    return 0;
}

// --- authorized keys

struct curve_authlist {
    uint8_t (*keys)[CURVE_KEY_BYTES]; /* sorted, distinct */
    size_t n, cap;
};

static int key_cmp(const void *a, const void *b)
{
    return memcmp(a, b, CURVE_KEY_BYTES);
}

static int authlist_add(curve_authlist_t *l, const uint8_t *key)
{
    if (curve_authlist_contains(l, key))
        return 0;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 16;
        void *p = realloc(l->keys, cap * CURVE_KEY_BYTES);
        if (!p)
            return -1;
        l->keys = p;
        l->cap = cap;
    }
    memcpy(l->keys[l->n++], key, CURVE_KEY_BYTES);
    qsort(l->keys, l->n, CURVE_KEY_BYTES, key_cmp);
    return 0;
}

int curve_authlist_parse(curve_authlist_t **list, const char *text, size_t len, const char *name,
                         char *err, size_t errlen)
{
    /* parse into a scratch list first: *list changes only when the whole file is good */
    curve_authlist_t add = {0};
    int section = 0, lineno = 0, rc = -1;
    const char *p = text, *end = text + len;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
        lineno++;
        char key[CURVE_Z85_LEN + 1];
        const char *why = "";
        if (memchr(p, 0, n)) {
            snprintf(err, errlen, "%s:%d: malformed authorized keys: a NUL byte", name, lineno);
            goto done;
        }
        line_kind_t k = classify(p, n, &section, key, &why);
        p += n + (nl ? 1 : 0);
        if (k == LN_SKIP)
            continue;
        if (k == LN_SECRET) {
            snprintf(err, errlen, "%s:%d: holds a secret key: authorized keys are public keys "
                     "(.pub files)", name, lineno);
            goto done;
        }
        if (k == LN_BAD) {
            snprintf(err, errlen, "%s:%d: malformed authorized keys: %s", name, lineno, why);
            goto done;
        }
        uint8_t bin[CURVE_KEY_BYTES];
        if (z85_to_bin(key, bin) < 0) {
            snprintf(err, errlen, "%s:%d: malformed authorized keys: not a Z85 key", name,
                     lineno);
            goto done;
        }
        if (authlist_add(&add, bin) < 0) {
            snprintf(err, errlen, "out of memory");
            goto done;
        }
    }
    if (!*list) {
        *list = calloc(1, sizeof(**list));
        if (!*list) {
            snprintf(err, errlen, "out of memory");
            goto done;
        }
    }
    for (size_t i = 0; i < add.n; i++) {
        if (authlist_add(*list, add.keys[i]) < 0) {
            snprintf(err, errlen, "out of memory");
            goto done;
        }
    }
    rc = 0;
done:
    free(add.keys);
    return rc;
}

static int authlist_add_file(curve_authlist_t **list, const char *path, char *err,
                             size_t errlen)
{
    char *text;
    size_t len;
    if (read_file(path, &text, &len, err, errlen) < 0)
        return -1;
    int rc = curve_authlist_parse(list, text, len, path, err, errlen);
    free(text);
    return rc;
}

static int name_cmp(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

curve_authlist_t *curve_authlist_load(const char *path, char *err, size_t errlen)
{
    curve_authlist_t *list = NULL;
    struct stat st;
    if (stat(path, &st) < 0) {
        snprintf(err, errlen, "cannot read authorized keys %s: %s", path, strerror(errno));
        return NULL;
    }
    if (!S_ISDIR(st.st_mode)) {
        if (authlist_add_file(&list, path, err, errlen) < 0)
            goto fail;
    } else {
        DIR *d = opendir(path);
        if (!d) {
            snprintf(err, errlen, "cannot read authorized keys %s: %s", path, strerror(errno));
            return NULL;
        }
        char **names = NULL;
        size_t n = 0, cap = 0;
        int bad = 0;
        for (struct dirent *e; (e = readdir(d)) != NULL;) {
            size_t l = strlen(e->d_name);
            if (l < 5 || strcmp(e->d_name + l - 4, ".pub") != 0 || e->d_name[0] == '.')
                continue;
            if (n == cap) {
                cap = cap ? 2 * cap : 16;
                char **q = realloc(names, cap * sizeof(*names));
                if (!q) {
                    bad = 1;
                    break;
                }
                names = q;
            }
            if (!(names[n] = strdup(e->d_name))) {
                bad = 1;
                break;
            }
            n++;
        }
        closedir(d);
        if (!bad && n > 1)
            qsort(names, n, sizeof(*names), name_cmp); /* errors name the same file each run */
        for (size_t i = 0; i < n && !bad; i++) {
            char fp[4096];
            snprintf(fp, sizeof(fp), "%s/%s", path, names[i]);
            struct stat fs;
            if (stat(fp, &fs) == 0 && !S_ISREG(fs.st_mode))
                continue;
            if (authlist_add_file(&list, fp, err, errlen) < 0)
                bad = 2;
        }
        for (size_t i = 0; i < n; i++)
            free(names[i]);
        free(names);
        if (bad == 1)
            snprintf(err, errlen, "out of memory");
        if (bad)
            goto fail;
    }
    if (curve_authlist_count(list) == 0) {
        snprintf(err, errlen, "authorized keys %s: no public key in it%s", path,
                 S_ISDIR(st.st_mode) ? " (no readable *.pub file)" : "");
        goto fail;
    }
    return list;
fail:
    curve_authlist_destroy(&list);
    return NULL;
}

size_t curve_authlist_count(const curve_authlist_t *list)
{
    return list ? list->n : 0;
}

int curve_authlist_contains(const curve_authlist_t *list, const uint8_t *key)
{
    return list && list->n && bsearch(key, list->keys, list->n, CURVE_KEY_BYTES, key_cmp);
}

void curve_authlist_destroy(curve_authlist_t **list)
{
    if (!list || !*list)
        return;
    free((*list)->keys);
    free(*list);
    *list = NULL;
}

// --- sockets

int curve_setup_server(void *sock, const curve_keypair *kp, const char *zap_domain)
{
    int one = 1;
    if (!curve_z85_valid(kp->secret_z85)) {
        errno = EINVAL;
        return -1;
    }
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof(one)) < 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, kp->secret_z85, CURVE_Z85_LEN) < 0 ||
        zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, zap_domain, strlen(zap_domain)) < 0)
        return -1;
    return 0;
}

int curve_setup_client(void *sock, const curve_keypair *kp, const char *server_public_z85)
{
    if (!curve_z85_valid(server_public_z85) || !curve_z85_valid(kp->public_z85) ||
        !curve_z85_valid(kp->secret_z85)) {
        errno = EINVAL;
        return -1;
    }
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server_public_z85, CURVE_Z85_LEN) < 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, kp->public_z85, CURVE_Z85_LEN) < 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, kp->secret_z85, CURVE_Z85_LEN) < 0)
        return -1;
    return 0;
}

// --- the ZAP handler (RFC 27)

struct curve_zap {
    void *rep;      /* bound at ZAP_ENDPOINT; the thread's */
    void *ctl_in;   /* PAIR, the thread's end of the stop channel */
    void *ctl_out;  /* PAIR, the owner's end */
    pthread_t thread;
    int started;
    curve_authlist_t *list;
    atomic_uint_fast64_t n_allowed, n_refused, n_unlogged;
    /* refusal log rate limit (the thread's) */
    int64_t window_start_us;
    int window_lines;
    uint64_t window_dropped;
};

#define ZAP_MAX_FRAMES 8 /* version, id, domain, address, routing id, mechanism, credential(s) */

typedef struct {
    zmq_msg_t f[ZAP_MAX_FRAMES];
    int n;
    int truncated; /* more frames than ZAP_MAX_FRAMES (drained) */
} zap_req;

static int frame_is(zmq_msg_t *m, const char *s)
{
    size_t n = strlen(s);
    return zmq_msg_size(m) == n && memcmp(zmq_msg_data(m), s, n) == 0;
}

static void zap_reply(void *rep, zmq_msg_t *request_id, const char *code, const char *text,
                      const char *user)
{
    zmq_send_const(rep, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(rep, request_id ? zmq_msg_data(request_id) : "",
             request_id ? zmq_msg_size(request_id) : 0, ZMQ_SNDMORE);
    zmq_send(rep, code, strlen(code), ZMQ_SNDMORE);
    zmq_send(rep, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(rep, user, strlen(user), ZMQ_SNDMORE);
    zmq_send(rep, "", 0, 0); /* metadata: none */
}

/* Log one refusal, at most CURVE_ZAP_LOG_BURST per window; the others are counted and
 * their number logged when the next window opens. */
static void zap_log_refusal(curve_zap_t *z, const char *key_z85, const char *addr,
                            const char *domain, const char *why)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
    if (now - z->window_start_us >= (int64_t)CURVE_ZAP_LOG_WINDOW_S * 1000000) {
        if (z->window_dropped)
            log_warn("curve: %llu more refusals in the last %d s not logged",
                     (unsigned long long)z->window_dropped, CURVE_ZAP_LOG_WINDOW_S);
        z->window_start_us = now;
        z->window_lines = 0;
        z->window_dropped = 0;
    }
    if (z->window_lines >= CURVE_ZAP_LOG_BURST) {
        z->window_dropped++;
        atomic_fetch_add(&z->n_unlogged, 1);
        return;
    }
    z->window_lines++;
    log_warn("curve: refused a connection to %s from %s: %s%s%s", domain, addr, why,
             key_z85[0] ? ", client key " : "", key_z85);
}

/* Copy frame m as a printable string into buf (cap bytes): bytes outside 0x20..0x7e
 * become '?'. */
static void frame_str(zmq_msg_t *m, char *buf, size_t cap)
{
    size_t n = zmq_msg_size(m) < cap - 1 ? zmq_msg_size(m) : cap - 1;
    const unsigned char *d = zmq_msg_data(m);
    for (size_t i = 0; i < n; i++)
        buf[i] = d[i] >= 0x20 && d[i] < 0x7f ? (char)d[i] : '?';
    buf[n] = 0;
}

static void zap_handle(curve_zap_t *z, zap_req *q)
{
    /* RFC 27: version, request id, domain, address, identity, mechanism, credentials... */
    if (q->n < 6 || q->truncated || !frame_is(&q->f[0], "1.0")) {
        zap_reply(z->rep, q->n >= 2 ? &q->f[1] : NULL, "500", "malformed ZAP request", "");
        return;
    }
    char domain[64], addr[64], key_z85[CURVE_Z85_LEN + 1] = "";
    frame_str(&q->f[2], domain, sizeof(domain));
    frame_str(&q->f[3], addr, sizeof(addr));
    if (!frame_is(&q->f[5], "CURVE")) {
        char mech[32];
        frame_str(&q->f[5], mech, sizeof(mech));
        atomic_fetch_add(&z->n_refused, 1);
        zap_log_refusal(z, "", addr, domain, mech);
        zap_reply(z->rep, &q->f[1], "400", "CURVE only", "");
        return;
    }
    if (q->n != 7 || zmq_msg_size(&q->f[6]) != CURVE_KEY_BYTES) {
        zap_reply(z->rep, &q->f[1], "500", "malformed CURVE credentials", "");
        return;
    }
    const uint8_t *key = zmq_msg_data(&q->f[6]);
    zmq_z85_encode(key_z85, key, CURVE_KEY_BYTES);
    if (curve_authlist_contains(z->list, key)) {
        atomic_fetch_add(&z->n_allowed, 1);
        log_debug("curve: admitted %s to %s (key %s)", addr, domain, key_z85);
        zap_reply(z->rep, &q->f[1], "200", "OK", key_z85);
        return;
    }
    atomic_fetch_add(&z->n_refused, 1);
    zap_log_refusal(z, key_z85, addr, domain, "key not authorized");
    zap_reply(z->rep, &q->f[1], "400", "key not authorized", "");
}

static void *zap_thread(void *arg)
{
    curve_zap_t *z = arg;
    for (;;) {
        zmq_pollitem_t items[2] = {{z->rep, 0, ZMQ_POLLIN, 0}, {z->ctl_in, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, -1) < 0) {
            if (zmq_errno() == EINTR)
                continue;
            break; /* ETERM: the context is going */
        }
        if (items[1].revents & ZMQ_POLLIN)
            break;
        if (!(items[0].revents & ZMQ_POLLIN))
            continue;
        zap_req q = {.n = 0};
        int more = 1, failed = 0;
        while (more) {
            zmq_msg_t tmp, *m = q.n < ZAP_MAX_FRAMES ? &q.f[q.n] : &tmp;
            zmq_msg_init(m);
            if (zmq_msg_recv(m, z->rep, 0) < 0) {
                zmq_msg_close(m);
                failed = 1;
                break;
            }
            more = zmq_msg_more(m);
            if (m == &tmp) {
                q.truncated = 1;
                zmq_msg_close(m);
            } else {
                q.n++;
            }
        }
        if (!failed)
            zap_handle(z, &q);
        for (int i = 0; i < q.n; i++)
            zmq_msg_close(&q.f[i]);
        if (failed && zmq_errno() == ETERM)
            break;
    }
    int zero = 0;
    zmq_setsockopt(z->rep, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_close(z->rep);
    zmq_close(z->ctl_in);
    z->rep = z->ctl_in = NULL;
    return NULL;
}

curve_zap_t *curve_zap_start(void *zctx, curve_authlist_t **list, char *err, size_t errlen)
{
    curve_zap_t *z = calloc(1, sizeof(*z));
    if (!z) {
        snprintf(err, errlen, "out of memory");
        curve_authlist_destroy(list);
        return NULL;
    }
    z->list = *list;
    *list = NULL;
    char ctl_ep[64];
    snprintf(ctl_ep, sizeof(ctl_ep), "inproc://tidepool-zap-stop-%p", (void *)z);
    z->rep = zmq_socket(zctx, ZMQ_REP);
    z->ctl_in = zmq_socket(zctx, ZMQ_PAIR);
    z->ctl_out = zmq_socket(zctx, ZMQ_PAIR);
    int zero = 0;
    if (!z->rep || !z->ctl_in || !z->ctl_out) {
        snprintf(err, errlen, "ZAP handler: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    zmq_setsockopt(z->ctl_out, ZMQ_LINGER, &zero, sizeof(zero));
    if (zmq_bind(z->rep, ZAP_ENDPOINT) < 0) {
        snprintf(err, errlen, "ZAP handler: cannot bind %s: %s", ZAP_ENDPOINT,
                 zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (zmq_bind(z->ctl_in, ctl_ep) < 0 || zmq_connect(z->ctl_out, ctl_ep) < 0) {
        snprintf(err, errlen, "ZAP handler: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (pthread_create(&z->thread, NULL, zap_thread, z) != 0) {
        snprintf(err, errlen, "ZAP handler: cannot start its thread");
        goto fail;
    }
    z->started = 1;
    return z;
fail:
    curve_zap_stop(&z);
    return NULL;
}

void curve_zap_get_stats(const curve_zap_t *z, curve_zap_stats *out)
{
    out->n_allowed = atomic_load(&((curve_zap_t *)z)->n_allowed);
    out->n_refused = atomic_load(&((curve_zap_t *)z)->n_refused);
    out->n_unlogged = atomic_load(&((curve_zap_t *)z)->n_unlogged);
}

void curve_zap_stop(curve_zap_t **zp)
{
    if (!zp || !*zp)
        return;
    curve_zap_t *z = *zp;
    if (z->started) {
        zmq_send(z->ctl_out, "", 0, 0);
        pthread_join(z->thread, NULL);
    } else {
        int zero = 0;
        if (z->rep) {
            zmq_setsockopt(z->rep, ZMQ_LINGER, &zero, sizeof(zero));
            zmq_close(z->rep);
        }
        if (z->ctl_in)
            zmq_close(z->ctl_in);
    }
    if (z->ctl_out)
        zmq_close(z->ctl_out);
    curve_authlist_destroy(&z->list);
    free(z);
    *zp = NULL;
}
