/*
 * fuzz_gguf: the GGUF reader (common/engine/gguf.c) on arbitrary file bytes, through
 * gguf_open_mem on a page-aligned copy (as gguf_open's mmap would place them).
 * Properties: no crash, leak or undefined behaviour; an open file's every metadata value
 * can be read with every getter, and every tensor lies inside the bytes (its first and last
 * bytes are read), is aligned as the file says, and has n_bytes matching its shape and type.
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "gguf.h"

static volatile uint8_t g_sink;

static void read_kv(const gguf_t *g, int i)
{
    size_t klen;
    const char *k = gguf_kv_key(g, i, &klen);
    FUZZ_CHECK(k != NULL);
    char key[256];
    if (klen >= sizeof(key) || memchr(k, 0, klen))
        return; /* the getters take NUL-terminated keys */
    memcpy(key, k, klen);
    key[klen] = 0;
    uint32_t u;
    int32_t s;
    float f;
    const char *str;
    size_t slen;
    char buf[64];
    (void)gguf_get_u32(g, key, &u);
    (void)gguf_get_i32(g, key, &s);
    (void)gguf_get_f32(g, key, &f);
    if (gguf_get_str(g, key, &str, &slen) == 0 && slen)
        g_sink ^= (uint8_t)(str[0] ^ str[slen - 1]);
    if (gguf_get_str_copy(g, key, buf, sizeof(buf)) == 0)
        FUZZ_CHECK(memchr(buf, 0, sizeof(buf)) != NULL);
    gguf_type et;
    uint64_t n;
    if (gguf_get_arr_info(g, key, &et, &n) != 0 || n > 4096)
        return;
    const char **ptrs = malloc((n ? n : 1) * sizeof(*ptrs));
    size_t *lens = malloc((n ? n : 1) * sizeof(*lens));
    float *fv = malloc((n ? n : 1) * sizeof(float));
    int32_t *iv = malloc((n ? n : 1) * sizeof(int32_t));
    FUZZ_CHECK(ptrs && lens && fv && iv);
    if (gguf_get_arr_str(g, key, ptrs, lens, n) == 0)
        for (uint64_t j = 0; j < n; j++)
            if (lens[j])
                g_sink ^= (uint8_t)(ptrs[j][0] ^ ptrs[j][lens[j] - 1]);
    (void)gguf_get_arr_f32(g, key, fv, n);
    (void)gguf_get_arr_i32(g, key, iv, n);
    FUZZ_CHECK(gguf_get_arr_str(g, key, ptrs, lens, n + 1) != 0); /* wrong n is refused */
    free(ptrs);
    free(lens);
    free(fv);
    free(iv);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *copy = fuzz_aligned_copy(data, size);
    char err[512];
    gguf_t *g = gguf_open_mem(copy, size, "fuzz.gguf", err, sizeof(err));
    if (!g) {
        FUZZ_CHECK(strncmp(err, "fuzz.gguf: ", 11) == 0);
        free(copy);
        return 0;
    }
    FUZZ_CHECK(gguf_file_size(g) == size);
    for (int i = 0; i < gguf_n_kv(g); i++)
        read_kv(g, i);
    uint32_t align = gguf_alignment(g);
    if (align > 4096)
        align = 4096; /* the copy is page-aligned, no more */
    for (int i = 0; i < gguf_n_tensors(g); i++) {
        const gguf_tensor_info *t = gguf_tensor(g, i);
        FUZZ_CHECK(t->n_dims >= 1 && t->n_dims <= GGUF_MAX_DIMS);
        FUZZ_CHECK(t->n_bytes == gguf_tensor_nbytes(t->type, t->n_elements));
        FUZZ_CHECK(t->offset <= size && t->n_bytes <= size - t->offset);
        FUZZ_CHECK((const uint8_t *)t->data == copy + t->offset);
        FUZZ_CHECK((uintptr_t)t->data % align == 0);
        if (t->n_bytes)
            g_sink ^= (uint8_t)(((const uint8_t *)t->data)[0] ^
                                ((const uint8_t *)t->data)[t->n_bytes - 1]);
        FUZZ_CHECK(gguf_find_tensor(g, t->name) == t);
    }
    gguf_close(&g);
    free(copy);
    return 0;
}
