/*
 * fuzz_http_wire: what the gateway checks of a request's bytes past libevent's parser
 * (gateway/http_wire.c). Input: a mode byte, then the bytes (cut at the first NUL, as
 * libevent keeps them):
 *   0  a chunk-size line, through the evutil_strtoll override (base 16) as libevent calls
 *      it: a size >= 0 ends the line (libevent takes it), -1 has a refusal reason; a size
 *      is the value of the line's leading hex digits; base 10 is strtoll's own
 *   1  a request target: -1, or the offset of a byte inside it that is not a URI's; a
 *      target taken holds no space, control or non-ASCII byte
 *   2  a path {id} (mode byte bit 4: "/" allowed), decoded into a small buffer: a decoded
 *      id holds no NUL (and no "/" unless allowed), is as long as the input less two bytes
 *      per escape, and re-encoding it gives the input back up to hex case
 */
#include <ctype.h>
#include <event2/util.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "http_internal.h"

static int hexv(int c)
{
    return isdigit(c) ? c - '0' : tolower(c) - 'a' + 10;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int mode = data[0];
    size_t n = strnlen((const char *)data + 1, size - 1);
    char *s = malloc(n + 1);
    FUZZ_CHECK(s != NULL);
    memcpy(s, data + 1, n);
    s[n] = 0;
    if (mode % 3 == 0) {
        char *end = NULL;
        ev_int64_t v = evutil_strtoll(s, &end, 16);
        http_chunk_refusal_t why = http_wire_chunk_refusal();
        FUZZ_CHECK(http_wire_chunk_refusal() == HTTP_CHUNK_OK); /* forgotten once asked */
        if (v >= 0) {
            FUZZ_CHECK(why == HTTP_CHUNK_OK && end == s + n && n <= HTTP_CHUNK_LINE_MAX);
            ev_int64_t want = 0;
            for (size_t i = 0; i < n && isxdigit((unsigned char)s[i]); i++)
                want = want * 16 + hexv((unsigned char)s[i]);
            FUZZ_CHECK(v == want);
        } else {
            FUZZ_CHECK(v == -1 && why != HTTP_CHUNK_OK && end == s);
            FUZZ_CHECK((why == HTTP_CHUNK_LONG) == (n > HTTP_CHUNK_LINE_MAX));
        }
        char *e10 = NULL, *e10b = NULL;
        FUZZ_CHECK(evutil_strtoll(s, &e10, 10) == strtoll(s, &e10b, 10) && e10 == e10b);
    } else if (mode % 3 == 1) {
        long bad = http_wire_target_bad(s);
        FUZZ_CHECK(bad >= -1 && bad < (long)n);
        for (size_t i = 0; bad < 0 && i < n; i++)
            FUZZ_CHECK((unsigned char)s[i] > 0x20 && (unsigned char)s[i] < 0x7f);
    } else {
        int slash = (mode & 16) != 0;
        char out[64];
        http_id_status_t st = http_wire_id_decode(s, n, slash, out, sizeof(out));
        if (st == HTTP_ID_OK) {
            size_t len = strlen(out), escapes = 0;
            for (size_t i = 0; i < n; i++)
                escapes += s[i] == '%';
            FUZZ_CHECK(len < sizeof(out) && len == n - 2 * escapes);
            FUZZ_CHECK(slash || !strchr(out, '/'));
            for (size_t i = 0, o = 0; i < n; i++, o++) { /* the input, escapes undone */
                int ch = (unsigned char)s[i];
                if (ch == '%') {
                    ch = hexv((unsigned char)s[i + 1]) * 16 + hexv((unsigned char)s[i + 2]);
                    i += 2;
                }
                FUZZ_CHECK((unsigned char)out[o] == ch);
            }
        }
    }
    free(s);
    return 0;
}
