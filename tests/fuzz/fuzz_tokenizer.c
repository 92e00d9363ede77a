/*
 * fuzz_tokenizer: encode and decode (common/engine/tokenizer.c) of arbitrary text and ids
 * with the real default model's tokenizer (fuzz_model_path: build/models/stories260K.gguf).
 *
 * Input: byte 0 = mode (bit 0: also read the input as token ids, 2 bytes LE each, and
 * decode them); the rest is the text. Properties: every id is in the vocabulary; a cap one
 * short of the count fails and reports the count needed; the ids equal the reference
 * merge loop's (tokenizer_encode_ref) exactly; decoding the ids of a text encoded
 * after BOS gives the text back byte for byte (byte fallback covers every byte); arbitrary
 * ids, in range or not, decode without reading outside the vocabulary.
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "tokenizer.h"

static tokenizer_t *g_tok;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!g_tok) {
        char err[512];
        g_tok = tokenizer_load(fuzz_model_path(), err, sizeof(err));
        FUZZ_CHECK(g_tok != NULL);
    }
    if (size < 1)
        return 0;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int cap = (int)len + 2;
    int *ids = malloc((size_t)cap * sizeof(int));
    FUZZ_CHECK(ids != NULL);
    int needed = -1;
    int n = tokenizer_encode(g_tok, text, len, 1, ids, cap, &needed);
    FUZZ_CHECK(n >= 1 && n == needed && ids[0] == tokenizer_bos(g_tok));
    int V = tokenizer_vocab_size(g_tok);
    for (int i = 0; i < n; i++)
        FUZZ_CHECK(ids[i] >= 0 && ids[i] < V);
    int needed2 = -1;
    FUZZ_CHECK(tokenizer_encode(g_tok, text, len, 1, ids, n - 1, &needed2) == -1);
    FUZZ_CHECK(needed2 == n);
    n = tokenizer_encode(g_tok, text, len, 1, ids, cap, NULL);
    int *ref = malloc((size_t)cap * sizeof(int));
    FUZZ_CHECK(ref != NULL);
    FUZZ_CHECK(tokenizer_encode_ref(g_tok, text, len, 1, ref, cap, NULL) == n);
    FUZZ_CHECK(memcmp(ids, ref, (size_t)n * sizeof(int)) == 0);
    free(ref);
    char *back = malloc(len + 1);
    FUZZ_CHECK(back != NULL);
    size_t blen = 0;
    for (int i = 1; i < n; i++) {
        size_t pl;
        const char *p = tokenizer_piece(g_tok, ids[i - 1], ids[i], &pl);
        FUZZ_CHECK(blen + pl <= len);
        memcpy(back + blen, p, pl);
        blen += pl;
    }
    FUZZ_CHECK(blen == len && memcmp(back, text, len) == 0);
    free(back);
    free(ids);
    if (data[0] & 1) {
        int prev = -1;
        volatile unsigned char sink = 0;
        for (size_t i = 1; i + 1 < size; i += 2) {
            int id = (int)(data[i] | data[i + 1] << 8) - 16;
            size_t pl;
            const char *p = tokenizer_piece(g_tok, prev, id, &pl);
            if (pl)
                sink ^= (unsigned char)(p[0] ^ p[pl - 1]);
            prev = id;
        }
        (void)sink;
    }
    return 0;
}
