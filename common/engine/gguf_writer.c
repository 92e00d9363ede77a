/*
 * gguf_writer: the GGUF writer of gguf.h (gguf_writer_*). It keeps the metadata in a
 * growing byte buffer and the tensor table in an array, and writes header, padding and
 * data with stdio (GGUF v3, little-endian, tensors aligned to the file's alignment).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"

#define GGUF_MAGIC "GGUF"

typedef struct {
    char *name;
    gguf_tensor_type type;
    int n_dims;
    uint64_t ne[GGUF_MAX_DIMS];
    uint64_t n_bytes;
    const void *data;
} wtensor;

struct gguf_writer {
    uint8_t *kv; /* serialized key/value pairs */
    size_t kv_len, kv_cap;
    uint64_t n_kv;
    wtensor *tensors;
    int n_tensors, cap_tensors;
    uint32_t alignment;
    int oom; /* sticky allocation failure */
};

gguf_writer_t *gguf_writer_new(void)
{
    gguf_writer_t *w = calloc(1, sizeof(*w));
    if (w)
        w->alignment = GGUF_DEFAULT_ALIGNMENT;
    return w;
}

void gguf_writer_destroy(gguf_writer_t **wp)
{
    if (!wp || !*wp)
        return;
    gguf_writer_t *w = *wp;
    for (int i = 0; i < w->n_tensors; i++)
        free(w->tensors[i].name);
    free(w->tensors);
    free(w->kv);
    free(w);
    *wp = NULL;
}

static int wbuf(gguf_writer_t *w, const void *p, size_t n)
{
    if (w->oom)
        return -1;
    if (w->kv_len + n > w->kv_cap) {
        size_t cap = w->kv_cap ? w->kv_cap : 4096;
        while (cap < w->kv_len + n)
            cap *= 2;
        uint8_t *nb = realloc(w->kv, cap);
        if (!nb) {
            w->oom = 1;
            return -1;
        }
        w->kv = nb;
        w->kv_cap = cap;
    }
    memcpy(w->kv + w->kv_len, p, n);
    w->kv_len += n;
    return 0;
}

static int wstr(gguf_writer_t *w, const char *s, size_t n)
{
    uint64_t len = n;
    if (wbuf(w, &len, 8) != 0)
        return -1;
    return n ? wbuf(w, s, n) : 0;
}

static int wkey(gguf_writer_t *w, const char *key, uint32_t type)
{
    if (!key || !*key)
        return -1;
    if (wstr(w, key, strlen(key)) != 0 || wbuf(w, &type, 4) != 0)
        return -1;
    w->n_kv++;
    return 0;
}

int gguf_writer_add_u32(gguf_writer_t *w, const char *key, uint32_t v)
{
    if (strcmp(key, "general.alignment") == 0) {
        if (v == 0 || (v & (v - 1)) != 0)
            return -1;
        w->alignment = v;
    }
    if (wkey(w, key, GGUF_TYPE_UINT32) != 0)
        return -1;
    return wbuf(w, &v, 4);
}

int gguf_writer_add_i32(gguf_writer_t *w, const char *key, int32_t v)
{
    if (wkey(w, key, GGUF_TYPE_INT32) != 0)
        return -1;
    return wbuf(w, &v, 4);
}

int gguf_writer_add_f32(gguf_writer_t *w, const char *key, float v)
{
    if (wkey(w, key, GGUF_TYPE_FLOAT32) != 0)
        return -1;
    return wbuf(w, &v, 4);
}

int gguf_writer_add_bool(gguf_writer_t *w, const char *key, int v)
{
    uint8_t b = v ? 1 : 0;
    if (wkey(w, key, GGUF_TYPE_BOOL) != 0)
        return -1;
    return wbuf(w, &b, 1);
}

int gguf_writer_add_str(gguf_writer_t *w, const char *key, const char *s)
{
    if (!s || wkey(w, key, GGUF_TYPE_STRING) != 0)
        return -1;
    return wstr(w, s, strlen(s));
}

static int warr_head(gguf_writer_t *w, const char *key, uint32_t et, uint64_t n)
{
    if (wkey(w, key, GGUF_TYPE_ARRAY) != 0 || wbuf(w, &et, 4) != 0)
        return -1;
    return wbuf(w, &n, 8);
}

int gguf_writer_add_arr_str(gguf_writer_t *w, const char *key, const char *const *strs,
                            const size_t *lens, uint64_t n)
{
    if (warr_head(w, key, GGUF_TYPE_STRING, n) != 0)
        return -1;
    for (uint64_t i = 0; i < n; i++)
        if (wstr(w, strs[i], lens[i]) != 0)
            return -1;
    return 0;
}

int gguf_writer_add_arr_f32(gguf_writer_t *w, const char *key, const float *v, uint64_t n)
{
    if (warr_head(w, key, GGUF_TYPE_FLOAT32, n) != 0)
        return -1;
    return n ? wbuf(w, v, (size_t)n * 4) : 0;
}

int gguf_writer_add_arr_i32(gguf_writer_t *w, const char *key, const int32_t *v, uint64_t n)
{
    if (warr_head(w, key, GGUF_TYPE_INT32, n) != 0)
        return -1;
    return n ? wbuf(w, v, (size_t)n * 4) : 0;
}

int gguf_writer_add_tensor(gguf_writer_t *w, const char *name, gguf_tensor_type type, int n_dims,
                           const uint64_t *ne, const void *data)
{
    if (!name || !*name || strlen(name) > GGUF_MAX_NAME || n_dims < 1 || n_dims > GGUF_MAX_DIMS ||
        !data)
        return -1;
    if (type != GGUF_TENSOR_F32 && type != GGUF_TENSOR_F16 && type != GGUF_TENSOR_Q8_0)
        return -1;
    for (int i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return -1;
    uint64_t n = 1;
    for (int d = 0; d < n_dims; d++) {
        if (ne[d] == 0)
            return -1;
        n *= ne[d];
    }
    if (type == GGUF_TENSOR_Q8_0 && ne[0] % 32 != 0)
        return -1;
    if (w->n_tensors == w->cap_tensors) {
        int cap = w->cap_tensors ? w->cap_tensors * 2 : 64;
        wtensor *nt = realloc(w->tensors, (size_t)cap * sizeof(*nt));
        if (!nt)
            return -1;
        w->tensors = nt;
        w->cap_tensors = cap;
    }
    wtensor *t = &w->tensors[w->n_tensors];
    memset(t, 0, sizeof(*t));
    t->name = strdup(name);
    if (!t->name)
        return -1;
    t->type = type;
    t->n_dims = n_dims;
    for (int d = 0; d < GGUF_MAX_DIMS; d++)
        t->ne[d] = d < n_dims ? ne[d] : 1;
    t->n_bytes = gguf_tensor_nbytes(type, n);
    t->data = data;
    w->n_tensors++;
    return 0;
}

static int write_pad(FILE *f, uint64_t pos, uint32_t align)
{
    static const uint8_t zeros[64];
    uint64_t pad = (align - pos % align) % align;
    while (pad > 0) {
        size_t k = pad > sizeof(zeros) ? sizeof(zeros) : (size_t)pad;
        if (fwrite(zeros, 1, k, f) != k)
            return -1;
        pad -= k;
    }
    return 0;
}

/* The temporary file being written, for the signal handler (one write at a time per
 * process: the tools that install the handler write one file at a time). */
static char g_tmp_path[4096];
static volatile sig_atomic_t g_tmp_live;

static void on_fatal_signal(int sig)
{
    if (g_tmp_live)
        unlink(g_tmp_path); /* async-signal-safe */
    signal(sig, SIG_DFL);
    raise(sig);
}

int gguf_writer_cleanup_on_signals(void)
{
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
        struct sigaction sa, old;
        /* a signal the parent ignores (nohup: SIGHUP; a shell's background job: SIGINT)
         * stays ignored: it would not have killed the tool, so there is nothing to clean */
        if (sigaction(sigs[i], NULL, &old) != 0)
            return -1;
        if (old.sa_handler == SIG_IGN)
            continue;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_fatal_signal;
        sigemptyset(&sa.sa_mask);
        if (sigaction(sigs[i], &sa, NULL) != 0)
            return -1;
    }
    return 0;
}

static void tmp_forget(const char *tmp, int remove)
{
    g_tmp_live = 0;
    if (remove)
        unlink(tmp);
}

int gguf_writer_write(gguf_writer_t *w, const char *path, char *err, size_t errlen)
{
    char tmp[4096];
    FILE *f = NULL;
    if (w->oom) {
        snprintf(err, errlen, "%s: out of memory while building the file", path);
        return -1;
    }
    snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid());
    g_tmp_live = 0;
    memcpy(g_tmp_path, tmp, sizeof(g_tmp_path));
    g_tmp_live = 1; /* before the file exists: a signal now finds nothing to remove */
    f = fopen(tmp, "wb");
    if (!f) {
        g_tmp_live = 0;
        snprintf(err, errlen, "%s: cannot create %s: %s", path, tmp, strerror(errno));
        return -1;
    }
    uint32_t version = 3;
    uint64_t n_tensors = (uint64_t)w->n_tensors;
    uint64_t pos = 0;
    int ok = fwrite(GGUF_MAGIC, 1, 4, f) == 4 && fwrite(&version, 4, 1, f) == 1 &&
             fwrite(&n_tensors, 8, 1, f) == 1 && fwrite(&w->n_kv, 8, 1, f) == 1 &&
             (w->kv_len == 0 || fwrite(w->kv, 1, w->kv_len, f) == w->kv_len);
    pos = 24 + w->kv_len;
    uint64_t off = 0;
    for (int i = 0; ok && i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        uint64_t nlen = strlen(t->name);
        uint32_t nd = (uint32_t)t->n_dims, type = (uint32_t)t->type;
        ok = fwrite(&nlen, 8, 1, f) == 1 && fwrite(t->name, 1, nlen, f) == nlen &&
             fwrite(&nd, 4, 1, f) == 1 && fwrite(t->ne, 8, nd, f) == nd &&
             fwrite(&type, 4, 1, f) == 1 && fwrite(&off, 8, 1, f) == 1;
        pos += 8 + nlen + 4 + 8 * (uint64_t)nd + 4 + 8;
        off += t->n_bytes;
        off = (off + w->alignment - 1) / w->alignment * w->alignment;
    }
    if (ok && w->n_tensors > 0)
        ok = write_pad(f, pos, w->alignment) == 0;
    off = 0;
    for (int i = 0; ok && i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        ok = fwrite(t->data, 1, (size_t)t->n_bytes, f) == t->n_bytes;
        off += t->n_bytes;
        if (ok && i + 1 < w->n_tensors) {
            ok = write_pad(f, off, w->alignment) == 0;
            off = (off + w->alignment - 1) / w->alignment * w->alignment;
        }
    }
    if (ok)
        ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    if (fclose(f) != 0)
        ok = 0;
    if (!ok) {
        snprintf(err, errlen, "%s: write to %s failed: %s", path, tmp, strerror(errno));
        tmp_forget(tmp, 1);
        return -1;
    }
    if (rename(tmp, path) != 0) {
        snprintf(err, errlen, "%s: rename from %s failed: %s", path, tmp, strerror(errno));
        tmp_forget(tmp, 1);
        return -1;
    }
    tmp_forget(tmp, 0);
    return 0;
}
