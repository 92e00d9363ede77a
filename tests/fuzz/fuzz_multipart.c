/*
 * fuzz_multipart: multipart/form-data bodies (gateway/multipart.c), as POST /v1/files gets
 * them. Input: the Content-Type header value up to the first '\n' (an empty first line, or
 * none: "multipart/form-data; boundary=X"), then the body (the whole input when it has no
 * '\n'); the
 * body is copied into a buffer of exactly its size, so that ASan sees any read past it.
 * Properties: at most MULTIPART_MAX_PARTS parts; each has a non-empty NUL-terminated name,
 * a NUL-terminated filename, and data inside the body; a refusal has a reason.
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "multipart.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nl = memchr(data, '\n', size);
    char ct[512] = "multipart/form-data; boundary=X";
    const uint8_t *b = data;
    size_t len = size;
    if (nl) {
        size_t n = (size_t)(nl - data);
        if (n >= sizeof(ct) || memchr(data, 0, n))
            return 0; /* a header value has no NUL, and libevent caps its size */
        if (n) {
            memcpy(ct, data, n);
            ct[n] = 0;
        }
        b = nl + 1;
        len = size - n - 1;
    }
    char *body = malloc(len ? len : 1);
    FUZZ_CHECK(body != NULL);
    if (len)
        memcpy(body, b, len);
    multipart_part parts[MULTIPART_MAX_PARTS];
    char err[256] = "";
    int n = multipart_parse(ct, body, len, parts, MULTIPART_MAX_PARTS, err, sizeof(err));
    if (n < 0) {
        FUZZ_CHECK(err[0] != 0 && memchr(err, 0, sizeof(err)) != NULL);
    } else {
        FUZZ_CHECK(n <= MULTIPART_MAX_PARTS);
        for (int i = 0; i < n; i++) {
            const multipart_part *p = &parts[i];
            FUZZ_CHECK(memchr(p->name, 0, sizeof(p->name)) != NULL && p->name[0]);
            FUZZ_CHECK(memchr(p->filename, 0, sizeof(p->filename)) != NULL);
            FUZZ_CHECK(p->data >= body && p->len <= len &&
                       (size_t)(p->data - body) <= len - p->len);
        }
    }
    free(body);
    return 0;
}
