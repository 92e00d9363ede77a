/* http_wire: what the gateway checks of a request's bytes that libevent 2.1's parser lets
 * through or refuses wrongly (see http_internal.h).
 *
 * Chunk-size lines. libevent reads a chunk's size with evutil_strtoll(line, &end, 16) and
 * refuses the line unless the number ends it or is followed by a space: a chunk extension
 * ("5;name=value", RFC 9112 7.1.1, which a recipient MUST ignore when it does not know it)
 * got a 413, and "0x5", "+5" or " 5" (which strtoll takes) were read as sizes. That call
 * (http.c evhttp_handle_chunked_read) is libevent's only one in base 16 and goes through
 * its PLT, like evhttp_send_error (http.c): the gateway defines evutil_strtoll, which for
 * base 16 parses the whole line by the RFC's grammar (1*HEXDIG, then extensions, which are
 * checked and ignored) and for any other base is libevent's own (strtoll). A line it
 * refuses returns -1, which libevent answers through evhttp_send_error with 413; that
 * override asks http_wire_chunk_refusal() what was wrong and answers 400 or 413 itself. */
#include <event2/util.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"

/* What the last chunk-size line refused was: HTTP_CHUNK_OK when none (loop thread only:
 * libevent calls evutil_strtoll and then, at once, evhttp_send_error). */
static http_chunk_refusal_t last_refusal;

static int is_tchar(unsigned char ch)
{
    return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
           (ch && strchr("!#$%&'*+-.^_`|~", ch));
}

static int hex_value(unsigned char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

static const unsigned char *skip_bws(const unsigned char *p)
{
    while (*p == ' ' || *p == '\t')
        p++;
    return p;
}

/* The size of the chunk-size line s (no CRLF), or -1 (*why says why):
 *   chunk-size [ chunk-ext ], chunk-size = 1*HEXDIG,
 *   chunk-ext  = *( BWS ";" BWS ext-name [ BWS "=" BWS ext-val ] ) BWS,
 *   ext-name   = token, ext-val = token / quoted-string (RFC 9112 7.1.1; trailing BWS
 *   tolerated, as libevent took "5 "). */
static int64_t chunk_size_line(const char *s, http_chunk_refusal_t *why)
{
    const unsigned char *p = (const unsigned char *)s;
    *why = HTTP_CHUNK_MALFORMED;
    if (strlen(s) > HTTP_CHUNK_LINE_MAX) {
        *why = HTTP_CHUNK_LONG;
        return -1;
    }
    int64_t v = 0;
    int n = 0;
    for (int d; (d = hex_value(*p)) >= 0; p++, n++) {
        if (v > (INT64_MAX >> 4))
            return -1; /* overflows: no such body */
        v = v * 16 + d;
    }
    if (n == 0)
        return -1;
    for (;;) {
        p = skip_bws(p);
        if (*p == 0)
            break;
        if (*p++ != ';')
            return -1;
        p = skip_bws(p);
        if (!is_tchar(*p))
            return -1;
        while (is_tchar(*p))
            p++;
        const unsigned char *q = skip_bws(p);
        if (*q != '=')
            continue;
        p = skip_bws(q + 1);
        if (*p == '"') { /* quoted-string: qdtext / "\" (HTAB / SP / VCHAR / obs-text) */
            for (p++; *p != '"'; p++) {
                if (*p == '\\')
                    p++;
                if (*p == 0 || (*p < 0x20 && *p != '\t') || *p == 0x7f)
                    return -1;
            }
            p++;
        } else {
            if (!is_tchar(*p))
                return -1;
            while (is_tchar(*p))
                p++;
        }
    }
    *why = HTTP_CHUNK_OK;
    return v;
}

ev_int64_t evutil_strtoll(const char *s, char **endptr, int base)
{
    if (base != 16)
        return (ev_int64_t)strtoll(s, endptr, base); /* libevent's own (evutil.c) */
    int64_t v = chunk_size_line(s, &last_refusal);
    if (endptr) /* libevent takes the number when it ends the line */
        *endptr = (char *)s + (v < 0 ? 0 : strlen(s));
    return v;
}

http_chunk_refusal_t http_wire_chunk_refusal(void)
{
    http_chunk_refusal_t r = last_refusal;
    last_refusal = HTTP_CHUNK_OK;
    return r;
}

// --- the request target

/* Whether ch may stand in a URI outside a percent-escape (RFC 3986 2.2, 2.3: unreserved,
 * sub-delims, ":", "@", and "/" and "?" between parts). */
static int is_uri_char(unsigned char ch)
{
    return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
           (ch && strchr("-._~!$&'()*+,;=:@/?", ch));
}

long http_wire_target_bad(const char *target)
{
    const unsigned char *t = (const unsigned char *)target;
    size_t i = 0, host_end = 0;
    /* absolute form: its authority may hold an IP literal in brackets ("[::1]:8000") */
    if (strncmp(target, "http://", 7) == 0 || strncmp(target, "https://", 8) == 0) {
        i = target[4] == ':' ? 7 : 8;
        host_end = i + strcspn(target + i, "/?");
    }
    for (; t[i]; i++) {
        if (t[i] == '%') {
            if (hex_value(t[i + 1]) < 0 || hex_value(t[i + 2]) < 0)
                return (long)i;
            i += 2;
        } else if (!is_uri_char(t[i]) && !(i < host_end && (t[i] == '[' || t[i] == ']'))) {
            return (long)i;
        }
    }
    return -1;
}

// --- a path's {id}

http_id_status_t http_wire_id_decode(const char *seg, size_t n, int allow_slash, char *out,
                                     size_t cap)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)seg[i];
        if (ch == '%') {
            int hi = i + 2 < n ? hex_value((unsigned char)seg[i + 1]) : -1;
            int lo = i + 2 < n ? hex_value((unsigned char)seg[i + 2]) : -1;
            if (hi < 0 || lo < 0)
                return HTTP_ID_BAD_ESCAPE;
            ch = (unsigned char)(hi * 16 + lo);
            i += 2;
        }
        if (ch == 0 || (ch == '/' && !allow_slash))
            return HTTP_ID_BAD_BYTE;
        if (o + 1 >= cap)
            return HTTP_ID_TOO_LONG;
        out[o++] = (char)ch;
    }
    out[o] = 0;
    return HTTP_ID_OK;
}
