/*
 * fuzz_protocol: proto_decode (common/protocol.c) on arbitrary header bytes. Properties:
 * no crash, leak or undefined behaviour; a header that decodes re-encodes (proto_encode
 * and proto_encode_buf agree byte for byte), and the re-encoded header decodes to the same
 * message (every field, the token ids, the sampling controls, the log-probabilities and
 * the KV_BEGIN block hashes and the prefix summary included).
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "protocol.h"

static void same_msg(const proto_msg *a, const proto_msg *b)
{
    FUZZ_CHECK(a->n_tokens == b->n_tokens);
    FUZZ_CHECK(a->n_tokens == 0 ||
               memcmp(a->tokens, b->tokens, (size_t)a->n_tokens * sizeof(int)) == 0);
    FUZZ_CHECK(!a->samp == !b->samp);
    FUZZ_CHECK(!a->samp || memcmp(a->samp, b->samp, sizeof(*a->samp)) == 0);
    FUZZ_CHECK(!a->lps == !b->lps);
    FUZZ_CHECK(!a->lps ||
               memcmp(a->lps, b->lps, (size_t)a->n_tokens * sizeof(*a->lps)) == 0);
    FUZZ_CHECK(a->n_bhash == b->n_bhash);
    FUZZ_CHECK(a->n_bhash == 0 ||
               memcmp(a->bhash, b->bhash, (size_t)a->n_bhash * sizeof(uint64_t)) == 0);
    FUZZ_CHECK(!a->pfx == !b->pfx);
    FUZZ_CHECK(!a->pfx || memcmp(a->pfx, b->pfx, sizeof(*a->pfx)) == 0);
    proto_msg x = *a, y = *b;
    x.tokens = y.tokens = NULL;
    x.bhash = y.bhash = NULL;
    x.samp = y.samp = NULL;
    x.lps = y.lps = NULL;
    x.pfx = y.pfx = NULL;
    FUZZ_CHECK(memcmp(&x, &y, sizeof(x)) == 0); /* both zeroed whole by proto_decode */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    proto_msg m;
    char err[160];
    if (proto_decode(data, size, &m, err, sizeof(err)) < 0) {
        FUZZ_CHECK(m.tokens == NULL && m.samp == NULL && m.lps == NULL && m.bhash == NULL &&
                   m.type == 0);
        FUZZ_CHECK(memchr(err, 0, sizeof(err)) != NULL);
        return 0;
    }
    unsigned char *enc = NULL;
    size_t len = 0;
    FUZZ_CHECK(proto_encode(&m, &enc, &len) == 0);
    char stack[256];
    const void *out;
    size_t len2;
    void *heap;
    FUZZ_CHECK(proto_encode_buf(&m, stack, sizeof(stack), &out, &len2, &heap) == 0);
    FUZZ_CHECK(len2 == len && memcmp(out, enc, len) == 0);
    free(heap);
    proto_msg m2;
    FUZZ_CHECK(proto_decode(enc, len, &m2, err, sizeof(err)) == 0);
    same_msg(&m, &m2);
    free(enc);
    proto_msg_clear(&m);
    proto_msg_clear(&m2);
    return 0;
}
