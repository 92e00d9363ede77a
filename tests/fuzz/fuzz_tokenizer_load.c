/*
 * fuzz_tokenizer_load: loading a tokenizer (common/engine/tokenizer.c) from arbitrary GGUF
 * bytes (gguf_open_mem + tokenizer_load_gguf). A vocabulary that loads encodes a few texts
 * (ASCII, multi-byte, bytes no piece spells, a NUL) and decodes every id. Properties: no
 * crash, leak or undefined behaviour; encoded ids are in the vocabulary and BOS comes
 * first.
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *copy = fuzz_aligned_copy(data, size);
    char err[512];
    gguf_t *g = gguf_open_mem(copy, size, "tok.gguf", err, sizeof(err));
    tokenizer_t *t = g ? tokenizer_load_gguf(g, err, sizeof(err)) : NULL;
    gguf_close(&g);
    free(copy); /* the tokenizer keeps its own copy of what it needs */
    if (!t) {
        FUZZ_CHECK(strncmp(err, "tok.gguf: ", 10) == 0);
        return 0;
    }
    int V = tokenizer_vocab_size(t);
    FUZZ_CHECK(V >= 3);
    FUZZ_CHECK(tokenizer_bos(t) >= 0 && tokenizer_bos(t) < V);
    FUZZ_CHECK(tokenizer_eos(t) >= 0 && tokenizer_eos(t) < V);
    static const char *texts[] = {"Once upon a time", " ab  ba\tab\n", "\xc3\xa9t\xc3\xa9 \xe2\x96\x81",
                                  "\xff\xfe\x80 x", "a\0b"};
    static const size_t lens[] = {16, 11, 9, 6, 3};
    int ids[64];
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        int n = tokenizer_encode(t, texts[i], lens[i], 1, ids, 64, NULL);
        FUZZ_CHECK(n >= 1 && n <= (int)lens[i] + 2 && ids[0] == tokenizer_bos(t));
        for (int k = 0; k < n; k++) {
            FUZZ_CHECK(ids[k] >= 0 && ids[k] < V);
            size_t pl;
            const char *p = tokenizer_piece(t, k ? ids[k - 1] : -1, ids[k], &pl);
            FUZZ_CHECK(p != NULL);
        }
    }
    volatile unsigned char sink = 0;
    for (int id = -1; id <= V && id < 4096; id++) {
        size_t pl;
        const char *p = tokenizer_piece(t, tokenizer_bos(t), id, &pl);
        if (pl)
            sink ^= (unsigned char)(p[0] ^ p[pl - 1]);
    }
    (void)sink;
    tokenizer_destroy(&t);
    return 0;
}
