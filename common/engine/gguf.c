/*
 * gguf: see gguf.h.
 *
 * The reader maps the file, then walks the header once with a bounds-checked cursor,
 * recording for every key/value pair the file offset of its value, and for every tensor
 * its info (validated). Getters re-read values from the mapping with memcpy (GGUF values
 * are unaligned). The writer is gguf_writer.c.
 */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_MAX_ARRAY_DEPTH 4

typedef struct {
    const char *key; /* into the mapping */
    size_t key_len;
    gguf_type type;
    size_t value_off; /* file offset of the value (after the u32 type) */
} gguf_kv;

struct gguf {
    char *path;
    const uint8_t *base;
    size_t size;
    uint32_t version;
    uint32_t alignment;
    int n_kv;
    gguf_kv *kvs;
    int n_tensors;
    gguf_tensor_info *tensors;
    char *names; /* NUL-terminated tensor names, back to back */
    int mapped;  /* base is our mmap of the file (gguf_open), not the caller's bytes */
};

/* ------------------------------------------------------------------------------------- */
/* fp16 */

float gguf_fp16_to_fp32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                e++;
                mant <<= 1;
            } while (!(mant & 0x400));
            mant &= 0x3ff;
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t gguf_fp32_to_fp16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t exp = (x >> 23) & 0xff;
    uint32_t mant = x & 0x7fffff;
    if (exp == 0xff) /* Inf / NaN (keep NaN quiet and non-zero) */
        return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 | (mant >> 13) : 0));
    int e = (int)exp - 127 + 15;
    if (e >= 31)
        return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {
        if (e < -10)
            return (uint16_t)sign;
        mant |= 0x800000;
        int shift = 14 - e;
        uint32_t half = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1)))
        half++; /* may carry into the exponent, up to Inf: correct */
    return (uint16_t)(sign | half);
}

/* ------------------------------------------------------------------------------------- */
/* types */

const char *gguf_tensor_type_name(gguf_tensor_type t)
{
    switch (t) {
    case GGUF_TENSOR_F32:
        return "F32";
    case GGUF_TENSOR_F16:
        return "F16";
    case GGUF_TENSOR_Q8_0:
        return "Q8_0";
    }
    return "unknown";
}

uint64_t gguf_tensor_nbytes(gguf_tensor_type t, uint64_t n)
{
    switch (t) {
    case GGUF_TENSOR_F32:
        return n * 4;
    case GGUF_TENSOR_F16:
        return n * 2;
    case GGUF_TENSOR_Q8_0:
        return n / 32 * 34;
    }
    return 0;
}

/* Size of one scalar value of a metadata type; 0 for STRING/ARRAY/unknown. */
static size_t scalar_size(uint32_t t)
{
    switch (t) {
    case GGUF_TYPE_UINT8:
    case GGUF_TYPE_INT8:
    case GGUF_TYPE_BOOL:
        return 1;
    case GGUF_TYPE_UINT16:
    case GGUF_TYPE_INT16:
        return 2;
    case GGUF_TYPE_UINT32:
    case GGUF_TYPE_INT32:
    case GGUF_TYPE_FLOAT32:
        return 4;
    case GGUF_TYPE_UINT64:
    case GGUF_TYPE_INT64:
    case GGUF_TYPE_FLOAT64:
        return 8;
    default:
        return 0;
    }
}

/* ------------------------------------------------------------------------------------- */
/* reader */

typedef struct {
    const uint8_t *base;
    size_t size;
    size_t pos;
    char *err;
    size_t errlen;
    const char *path;
} cursor;

__attribute__((format(printf, 2, 3))) static int cur_fail(cursor *c, const char *fmt, ...)
{
    if (c->err && c->errlen) {
        int n = snprintf(c->err, c->errlen, "%s: ", c->path);
        if (n >= 0 && (size_t)n < c->errlen) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(c->err + n, c->errlen - (size_t)n, fmt, ap);
            va_end(ap);
        }
    }
    return -1;
}

static int cur_read(cursor *c, void *out, size_t n, const char *what)
{
    if (n > c->size - c->pos)
        return cur_fail(c, "truncated file: %s at offset %zu needs %zu bytes, file has %zu", what,
                        c->pos, n, c->size);
    memcpy(out, c->base + c->pos, n);
    c->pos += n;
    return 0;
}

static int cur_skip(cursor *c, uint64_t n, const char *what)
{
    if (n > c->size - c->pos)
        return cur_fail(c, "truncated file: %s at offset %zu is %llu bytes, file has %zu", what,
                        c->pos, (unsigned long long)n, c->size);
    c->pos += (size_t)n;
    return 0;
}

/* Read a GGUF string; returns its pointer and length (into the mapping). */
static int cur_str(cursor *c, const char **s, uint64_t *len, const char *what)
{
    uint64_t n = 0;
    if (cur_read(c, &n, 8, what) != 0)
        return -1;
    if (n > c->size - c->pos)
        return cur_fail(c, "corrupt file: %s length %llu at offset %zu exceeds the file size", what,
                        (unsigned long long)n, c->pos - 8);
    *s = (const char *)c->base + c->pos;
    *len = n;
    c->pos += (size_t)n;
    return 0;
}

/* Skip a value of type t (validating lengths). */
static int cur_skip_value(cursor *c, uint32_t t, int depth)
{
    if (t == GGUF_TYPE_STRING) {
        const char *s = NULL;
        uint64_t n = 0;
        return cur_str(c, &s, &n, "string value");
    }
    if (t == GGUF_TYPE_ARRAY) {
        uint32_t et = 0;
        uint64_t n = 0;
        if (depth >= GGUF_MAX_ARRAY_DEPTH)
            return cur_fail(c, "corrupt file: arrays nested too deep at offset %zu", c->pos);
        if (cur_read(c, &et, 4, "array type") != 0 || cur_read(c, &n, 8, "array length") != 0)
            return -1;
        if (et >= GGUF_TYPE_COUNT_)
            return cur_fail(c, "corrupt file: unknown array element type %u", et);
        size_t es = scalar_size(et);
        if (es) {
            if (n > (c->size - c->pos) / es)
                return cur_fail(c,
                                "corrupt file: array of %llu elements at offset %zu exceeds the "
                                "file size",
                                (unsigned long long)n, c->pos);
            c->pos += (size_t)n * es;
            return 0;
        }
        /* strings or arrays: each takes at least 8 bytes */
        if (n > (c->size - c->pos) / 8)
            return cur_fail(c,
                            "corrupt file: array of %llu elements at offset %zu exceeds the file "
                            "size",
                            (unsigned long long)n, c->pos);
        for (uint64_t i = 0; i < n; i++)
            if (cur_skip_value(c, et, depth + 1) != 0)
                return -1;
        return 0;
    }
    size_t es = scalar_size(t);
    if (!es)
        return cur_fail(c, "corrupt file: unknown value type %u", t);
    return cur_skip(c, es, "value");
}

static int key_eq(const gguf_kv *kv, const char *key)
{
    size_t n = strlen(key);
    return kv->key_len == n && memcmp(kv->key, key, n) == 0;
}

static int parse(gguf_t *g, cursor *c)
{
    char magic[4];
    uint32_t version = 0;
    uint64_t n_tensors = 0, n_kv = 0;
    if (c->size < 4 + 4 + 8 + 8)
        return cur_fail(c, "not a GGUF file: %zu bytes is too short for the header", c->size);
    if (cur_read(c, magic, 4, "magic") != 0)
        return -1;
    if (memcmp(magic, GGUF_MAGIC, 4) != 0)
        return cur_fail(c, "not a GGUF file (bad magic %02x %02x %02x %02x)",
                        (unsigned char)magic[0], (unsigned char)magic[1], (unsigned char)magic[2],
                        (unsigned char)magic[3]);
    if (cur_read(c, &version, 4, "version") != 0)
        return -1;
    if (version != 2 && version != 3)
        return cur_fail(c, "unsupported GGUF version %u (need 2 or 3)", version);
    g->version = version;
    if (cur_read(c, &n_tensors, 8, "tensor count") != 0 || cur_read(c, &n_kv, 8, "kv count") != 0)
        return -1;
    if (n_tensors > GGUF_MAX_TENSORS)
        return cur_fail(c, "corrupt file: tensor count %llu exceeds the limit %u",
                        (unsigned long long)n_tensors, GGUF_MAX_TENSORS);
    if (n_kv > GGUF_MAX_KV)
        return cur_fail(c, "corrupt file: metadata count %llu exceeds the limit %u",
                        (unsigned long long)n_kv, GGUF_MAX_KV);
    /* every kv takes at least 8 + 4 bytes, every tensor info at least 8 + 4 + 4 + 8 */
    if (n_kv * 12 + n_tensors * 24 > c->size - c->pos)
        return cur_fail(c,
                        "truncated file: %llu metadata pairs and %llu tensors cannot fit in "
                        "%zu bytes",
                        (unsigned long long)n_kv, (unsigned long long)n_tensors, c->size);

    g->kvs = calloc(n_kv ? n_kv : 1, sizeof(gguf_kv));
    g->tensors = calloc(n_tensors ? n_tensors : 1, sizeof(gguf_tensor_info));
    /* names come from the file, so their total is bounded by its size (plus the NULs) */
    size_t names_cap = n_tensors * (GGUF_MAX_NAME + 1);
    if (names_cap > c->size + n_tensors)
        names_cap = c->size + n_tensors;
    g->names = malloc(names_cap + 1);
    if (!g->kvs || !g->tensors || !g->names)
        return cur_fail(c, "out of memory");

    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < n_kv; i++) {
        gguf_kv *kv = &g->kvs[i];
        uint64_t klen = 0;
        uint32_t t = 0;
        if (cur_str(c, &kv->key, &klen, "metadata key") != 0)
            return -1;
        kv->key_len = (size_t)klen;
        if (cur_read(c, &t, 4, "metadata value type") != 0)
            return -1;
        if (t >= GGUF_TYPE_COUNT_)
            return cur_fail(c, "corrupt file: metadata key %.*s has unknown type %u",
                            (int)(klen > 200 ? 200 : klen), kv->key, t);
        kv->type = (gguf_type)t;
        kv->value_off = c->pos;
        if (cur_skip_value(c, t, 0) != 0)
            return -1;
        g->n_kv++;
        if (key_eq(kv, "general.alignment")) {
            uint32_t a;
            if (t != GGUF_TYPE_UINT32)
                return cur_fail(c, "corrupt file: general.alignment is not a uint32");
            memcpy(&a, c->base + kv->value_off, 4);
            if (a == 0 || (a & (a - 1)) != 0 || a > (1u << 20))
                return cur_fail(c, "corrupt file: general.alignment %u is not a power of two", a);
            g->alignment = a;
        }
    }

    char *np = g->names;
    for (uint64_t i = 0; i < n_tensors; i++) {
        gguf_tensor_info *ti = &g->tensors[i];
        const char *name = NULL;
        uint64_t nlen = 0;
        uint32_t nd = 0, type = 0;
        if (cur_str(c, &name, &nlen, "tensor name") != 0)
            return -1;
        if (nlen == 0 || nlen > GGUF_MAX_NAME)
            return cur_fail(c, "corrupt file: tensor %llu has a name of %llu bytes",
                            (unsigned long long)i, (unsigned long long)nlen);
        memcpy(np, name, nlen);
        np[nlen] = '\0';
        if (strlen(np) != nlen)
            return cur_fail(c, "corrupt file: tensor %llu name contains a NUL byte",
                            (unsigned long long)i);
        ti->name = np;
        np += nlen + 1;
        if (cur_read(c, &nd, 4, "tensor n_dims") != 0)
            return -1;
        if (nd < 1 || nd > GGUF_MAX_DIMS)
            return cur_fail(c, "corrupt file: tensor %s has %u dimensions", ti->name, nd);
        ti->n_dims = (int)nd;
        uint64_t n_el = 1;
        for (int d = 0; d < GGUF_MAX_DIMS; d++)
            ti->ne[d] = 1;
        for (uint32_t d = 0; d < nd; d++) {
            if (cur_read(c, &ti->ne[d], 8, "tensor shape") != 0)
                return -1;
            if (ti->ne[d] == 0 || ti->ne[d] > (1ull << 40) || n_el > (1ull << 40) / ti->ne[d])
                return cur_fail(c, "corrupt file: tensor %s has a bad shape", ti->name);
            n_el *= ti->ne[d];
        }
        ti->n_elements = n_el;
        if (cur_read(c, &type, 4, "tensor type") != 0)
            return -1;
        if (type != GGUF_TENSOR_F32 && type != GGUF_TENSOR_F16 && type != GGUF_TENSOR_Q8_0)
            return cur_fail(c, "tensor %s has unsupported type %u", ti->name, type);
        ti->type = (gguf_tensor_type)type;
        if (type == GGUF_TENSOR_Q8_0 && ti->ne[0] % 32 != 0)
            return cur_fail(c, "corrupt file: Q8_0 tensor %s has ne[0] %llu not a multiple of 32",
                            ti->name, (unsigned long long)ti->ne[0]);
        ti->n_bytes = gguf_tensor_nbytes(ti->type, n_el);
        if (cur_read(c, &ti->offset, 8, "tensor offset") != 0)
            return -1;
        for (uint64_t j = 0; j < i; j++)
            if (strcmp(g->tensors[j].name, ti->name) == 0)
                return cur_fail(c, "corrupt file: duplicate tensor name %s", ti->name);
        g->n_tensors++;
    }

    /* data section */
    size_t data_start = (c->pos + g->alignment - 1) / g->alignment * g->alignment;
    if (n_tensors > 0 && data_start > c->size)
        return cur_fail(c, "truncated file: tensor data would start at %zu, file has %zu bytes",
                        data_start, c->size);
    for (int i = 0; i < g->n_tensors; i++) {
        gguf_tensor_info *ti = &g->tensors[i];
        if (ti->offset % g->alignment != 0)
            return cur_fail(c, "corrupt file: tensor %s offset %llu is not aligned to %u", ti->name,
                            (unsigned long long)ti->offset, g->alignment);
        uint64_t avail = c->size - data_start;
        if (ti->offset > avail || ti->n_bytes > avail - ti->offset)
            return cur_fail(c,
                            "truncated or corrupt file: tensor %s (%llu bytes at data offset "
                            "%llu) extends beyond the end of the file (%zu bytes)",
                            ti->name, (unsigned long long)ti->n_bytes,
                            (unsigned long long)ti->offset, c->size);
        ti->offset += data_start;
        ti->data = c->base + ti->offset;
    }
    return 0;
}

gguf_t *gguf_open(const char *path, char *err, size_t errlen)
{
    cursor c = {.err = err, .errlen = errlen, .path = path};
    gguf_t *g = calloc(1, sizeof(*g));
    int fd = -1;
    if (err && errlen)
        err[0] = '\0';
    if (!g) {
        cur_fail(&c, "out of memory");
        return NULL;
    }
    g->path = strdup(path);
    if (!g->path) {
        cur_fail(&c, "out of memory");
        goto fail;
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        cur_fail(&c, "cannot open: %s", strerror(errno));
        goto fail;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        cur_fail(&c, "not a regular file");
        goto fail;
    }
    if (st.st_size < 24) {
        cur_fail(&c, "not a GGUF file: %lld bytes is too short for the header",
                 (long long)st.st_size);
        goto fail;
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        cur_fail(&c, "mmap failed: %s", strerror(errno));
        goto fail;
    }
    close(fd);
    fd = -1;
    g->base = map;
    g->size = (size_t)st.st_size;
    g->mapped = 1;
    c.base = g->base;
    c.size = g->size;
    if (parse(g, &c) != 0)
        goto fail;
    return g;
fail:
    if (fd >= 0)
        close(fd);
    gguf_close(&g);
    return NULL;
}

gguf_t *gguf_open_mem(const void *data, size_t size, const char *name, char *err, size_t errlen)
{
    cursor c = {.err = err, .errlen = errlen, .path = name};
    if (err && errlen)
        err[0] = '\0';
    gguf_t *g = calloc(1, sizeof(*g));
    if (!g || !(g->path = strdup(name))) {
        cur_fail(&c, "out of memory");
        gguf_close(&g);
        return NULL;
    }
    if (!data || size < 24) {
        cur_fail(&c, "not a GGUF file: %zu bytes is too short for the header", size);
        gguf_close(&g);
        return NULL;
    }
    g->base = data;
    g->size = size;
    c.base = g->base;
    c.size = g->size;
    if (parse(g, &c) != 0) {
        gguf_close(&g);
        return NULL;
    }
    return g;
}

void gguf_close(gguf_t **gp)
{
    if (!gp || !*gp)
        return;
    gguf_t *g = *gp;
    if (g->base && g->mapped)
        munmap((void *)g->base, g->size);
    free(g->kvs);
    free(g->tensors);
    free(g->names);
    free(g->path);
    free(g);
    *gp = NULL;
}

const char *gguf_path(const gguf_t *g)
{
    return g->path;
}

uint32_t gguf_version(const gguf_t *g)
{
    return g->version;
}

uint32_t gguf_alignment(const gguf_t *g)
{
    return g->alignment;
}

size_t gguf_file_size(const gguf_t *g)
{
    return g->size;
}

int gguf_n_kv(const gguf_t *g)
{
    return g->n_kv;
}

const char *gguf_kv_key(const gguf_t *g, int i, size_t *len)
{
    if (i < 0 || i >= g->n_kv)
        return NULL;
    if (len)
        *len = g->kvs[i].key_len;
    return g->kvs[i].key;
}

gguf_type gguf_kv_type(const gguf_t *g, int i)
{
    return g->kvs[i].type;
}

int gguf_find_key(const gguf_t *g, const char *key)
{
    for (int i = 0; i < g->n_kv; i++)
        if (key_eq(&g->kvs[i], key))
            return i;
    return -1;
}

/* Read an integer scalar of type t at p as int64 (uint64 beyond INT64_MAX fails). */
static int read_int(uint32_t t, const uint8_t *p, int64_t *out)
{
    switch (t) {
    case GGUF_TYPE_UINT8: {
        uint8_t v = p[0];
        *out = v;
        return 0;
    }
    case GGUF_TYPE_INT8: {
        int8_t v;
        memcpy(&v, p, 1);
        *out = v;
        return 0;
    }
    case GGUF_TYPE_UINT16: {
        uint16_t v;
        memcpy(&v, p, 2);
        *out = v;
        return 0;
    }
    case GGUF_TYPE_INT16: {
        int16_t v;
        memcpy(&v, p, 2);
        *out = v;
        return 0;
    }
    case GGUF_TYPE_UINT32: {
        uint32_t v;
        memcpy(&v, p, 4);
        *out = v;
        return 0;
    }
    case GGUF_TYPE_INT32: {
        int32_t v;
        memcpy(&v, p, 4);
        *out = v;
        return 0;
    }
    case GGUF_TYPE_UINT64: {
        uint64_t v;
        memcpy(&v, p, 8);
        if (v > INT64_MAX)
            return -1;
        *out = (int64_t)v;
        return 0;
    }
    case GGUF_TYPE_INT64: {
        int64_t v;
        memcpy(&v, p, 8);
        *out = v;
        return 0;
    }
    default:
        return -1;
    }
}

static const gguf_kv *find_kv(const gguf_t *g, const char *key)
{
    int i = gguf_find_key(g, key);
    return i < 0 ? NULL : &g->kvs[i];
}

int gguf_get_u32(const gguf_t *g, const char *key, uint32_t *out)
{
    const gguf_kv *kv = find_kv(g, key);
    int64_t v;
    if (!kv || read_int(kv->type, g->base + kv->value_off, &v) != 0 || v < 0 || v > UINT32_MAX)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

int gguf_get_i32(const gguf_t *g, const char *key, int32_t *out)
{
    const gguf_kv *kv = find_kv(g, key);
    int64_t v;
    if (!kv || read_int(kv->type, g->base + kv->value_off, &v) != 0 || v < INT32_MIN ||
        v > INT32_MAX)
        return -1;
    *out = (int32_t)v;
    return 0;
}

int gguf_get_f32(const gguf_t *g, const char *key, float *out)
{
    const gguf_kv *kv = find_kv(g, key);
    if (!kv)
        return -1;
    if (kv->type == GGUF_TYPE_FLOAT32) {
        memcpy(out, g->base + kv->value_off, 4);
        return 0;
    }
    if (kv->type == GGUF_TYPE_FLOAT64) {
        double d;
        memcpy(&d, g->base + kv->value_off, 8);
        *out = (float)d;
        return 0;
    }
    return -1;
}

int gguf_get_str(const gguf_t *g, const char *key, const char **s, size_t *len)
{
    const gguf_kv *kv = find_kv(g, key);
    uint64_t n;
    if (!kv || kv->type != GGUF_TYPE_STRING)
        return -1;
    memcpy(&n, g->base + kv->value_off, 8);
    *s = (const char *)g->base + kv->value_off + 8;
    *len = (size_t)n;
    return 0;
}

int gguf_get_str_copy(const gguf_t *g, const char *key, char *buf, size_t cap)
{
    const char *s;
    size_t n;
    if (cap == 0 || gguf_get_str(g, key, &s, &n) != 0)
        return -1;
    if (n > cap - 1)
        n = cap - 1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    return 0;
}

/* Locate an array: its element type, count and the offset of the first element. */
static int arr_locate(const gguf_t *g, const char *key, uint32_t *et, uint64_t *n, size_t *off)
{
    const gguf_kv *kv = find_kv(g, key);
    if (!kv || kv->type != GGUF_TYPE_ARRAY)
        return -1;
    memcpy(et, g->base + kv->value_off, 4);
    memcpy(n, g->base + kv->value_off + 4, 8);
    *off = kv->value_off + 12;
    return 0;
}

int gguf_get_arr_info(const gguf_t *g, const char *key, gguf_type *elem_type, uint64_t *n)
{
    uint32_t et;
    uint64_t cnt;
    size_t off;
    if (arr_locate(g, key, &et, &cnt, &off) != 0)
        return -1;
    if (elem_type)
        *elem_type = (gguf_type)et;
    if (n)
        *n = cnt;
    return 0;
}

int gguf_get_arr_str(const gguf_t *g, const char *key, const char **ptrs, size_t *lens, uint64_t n)
{
    uint32_t et;
    uint64_t cnt;
    size_t off;
    if (arr_locate(g, key, &et, &cnt, &off) != 0 || et != GGUF_TYPE_STRING || cnt != n)
        return -1;
    for (uint64_t i = 0; i < n; i++) { /* lengths were validated at open */
        uint64_t len;
        memcpy(&len, g->base + off, 8);
        ptrs[i] = (const char *)g->base + off + 8;
        lens[i] = (size_t)len;
        off += 8 + (size_t)len;
    }
    return 0;
}

int gguf_get_arr_f32(const gguf_t *g, const char *key, float *out, uint64_t n)
{
    uint32_t et;
    uint64_t cnt;
    size_t off;
    if (arr_locate(g, key, &et, &cnt, &off) != 0 || et != GGUF_TYPE_FLOAT32 || cnt != n)
        return -1;
    memcpy(out, g->base + off, (size_t)n * 4);
    return 0;
}

int gguf_get_arr_i32(const gguf_t *g, const char *key, int32_t *out, uint64_t n)
{
    uint32_t et;
    uint64_t cnt;
    size_t off;
    if (arr_locate(g, key, &et, &cnt, &off) != 0 || cnt != n)
        return -1;
    size_t es = scalar_size(et);
    if (!es || et == GGUF_TYPE_FLOAT32 || et == GGUF_TYPE_FLOAT64 || et == GGUF_TYPE_BOOL)
        return -1;
    for (uint64_t i = 0; i < n; i++) {
        int64_t v;
        if (read_int(et, g->base + off + i * es, &v) != 0 || v < INT32_MIN || v > INT32_MAX)
            return -1;
        out[i] = (int32_t)v;
    }
    return 0;
}

int gguf_n_tensors(const gguf_t *g)
{
    return g->n_tensors;
}

const gguf_tensor_info *gguf_tensor(const gguf_t *g, int i)
{
    if (i < 0 || i >= g->n_tensors)
        return NULL;
    return &g->tensors[i];
}

const gguf_tensor_info *gguf_find_tensor(const gguf_t *g, const char *name)
{
    for (int i = 0; i < g->n_tensors; i++)
        if (strcmp(g->tensors[i].name, name) == 0)
            return &g->tensors[i];
    return NULL;
}
