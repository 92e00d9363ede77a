/*
 * multipart: a parser of multipart/form-data bodies (RFC 7578, the framing of RFC 2046),
 * for POST /v1/files. Pure: no allocation, no I/O; the parts point into the body.
 *
 * Accepted: a boundary parameter (token or quoted-string, 1..70 bytes) among others in the
 * Content-Type, a preamble before the first delimiter and an epilogue after the last,
 * transport padding (spaces, tabs) after a delimiter, CRLF line ends, Content-Disposition
 * form-data with name and filename (quoted with backslash escapes, or tokens); other part
 * headers are ignored. Refused with a reason: anything else, including a part without a
 * name, a header line over 8 KiB, a missing closing delimiter and more than max_parts parts.
 * Never reads past body + len.
 */
#ifndef TP_GW_MULTIPART_H
#define TP_GW_MULTIPART_H

#include <stddef.h>

#define MULTIPART_MAX_PARTS 16 /* what POST /v1/files accepts */

typedef struct {
    char name[64];      /* form field name */
    char filename[256]; /* "" when the part is not a file */
    const char *data;   /* borrowed from the body */
    size_t len;         /* bytes of data */
} multipart_part;

/* Parse body (len bytes) whose Content-Type header is content_type (NULL: refused) into at
 * most max_parts parts. Returns the number of parts, or -1 with a reason in err. */
int multipart_parse(const char *content_type, const char *body, size_t len, multipart_part *parts,
                    int max_parts, char *err, size_t errlen);

#endif
