/*
 * auth: the gateway's API keys: who may call it (Authorization: Bearer), who is an admin,
 * and each key's optional rate limits.
 *
 * Keys come from --api-key, --admin-api-key and --api-key-file (auth_load_file: one key per
 * line with optional attributes `admin`, `requests-per-s=N`, `tokens-per-s=N`; the file
 * must be readable by its owner only). Only a digest of each key is kept (BLAKE2b-256,
 * libsodium's crypto_generichash): a presented key is hashed and compared with every
 * configured digest by sodium_memcmp (constant time), so neither the comparison's time nor
 * the process's memory gives a key away. A key is named everywhere (logs, the Batch API's
 * owner column) by its id, the first AUTH_ID_HEX hex digits of its digest, never by itself.
 *
 * Rate limits are token buckets, refilled continuously at their rate from a monotonic
 * clock the caller passes (microseconds), holding at most one second's worth (at least 1):
 * a request may take what the bucket holds, or, when it costs more than the bucket can
 * hold, a full bucket (which then goes into debt). Pure logic, no I/O besides reading the
 * key file; loop thread only.
 */
#ifndef TP_GW_AUTH_H
#define TP_GW_AUTH_H

#include <stddef.h>
#include <stdint.h>

#define AUTH_ID_HEX 12           /* hex digits of a key id */
#define AUTH_MAX_KEY_BYTES 256   /* longest key accepted */
#define AUTH_MIN_GOOD_KEY_BYTES 16 /* shorter keys are accepted with a warning */

typedef struct auth auth_t;
typedef struct auth_key auth_key;

/* What a key may do. */
typedef struct {
    int admin;             /* 1: also /metrics, /workers, role changes, every Batch object */
    double requests_per_s; /* HTTP requests per second; 0 = no limit */
    double tokens_per_s;   /* completion tokens per second (prompt + max_tokens at
                            * admission, settled with the tokens generated at the end);
                            * 0 = no limit */
} auth_key_params;

typedef enum {
    AUTH_OK = 0,      /* a configured key */
    AUTH_MISSING = 1, /* no Authorization header, not the Bearer scheme, or an empty key */
    AUTH_INVALID = 2, /* a Bearer key that is not configured */
} auth_status_t;

/* An empty key set (auth_n_keys 0: the gateway is open). NULL when libsodium cannot be
 * initialised or out of memory. */
auth_t *auth_new(void);

/* Free a and its keys. Takes NULL; NULLs *a. */
void auth_destroy(auth_t **a);

/* Add key (NUL-terminated; 1..AUTH_MAX_KEY_BYTES visible ASCII characters, no spaces) with
 * p (bounds: rates 0 or in (0, 1e9]); source names where it was given ("--api-key",
 * "TIDEPOOL_API_KEY (value 2)", "FILE line 3"; copied). 0, or -1 with a message in err that
 * names the key by its id only (bad characters or length, a key given twice or two keys
 * with one id: both sources named, out of memory). The key itself is not kept, only its
 * digest. */
int auth_add_key(auth_t *a, const char *key, const auth_key_params *p, const char *source,
                 char *err, size_t errlen);

/* Add the keys of the file at path. Format: one key per line, then optional attributes
 * separated by whitespace: `admin`, `requests-per-s=N`, `tokens-per-s=N` (N a positive
 * number); blank lines and lines whose first non-blank character is '#' are ignored, as is
 * everything from a word starting with '#'. 0, or -1 with a message in err naming the file
 * and, for a bad line, its number (never its key): unreadable, not a regular file,
 * readable or writable by group or others (mode & 077), a malformed line (an attribute
 * given twice on it included), a bad or repeated key, no key at all. */
int auth_load_file(auth_t *a, const char *path, char *err, size_t errlen);

/* Keys configured (0: no authentication) and how many of them are admin keys. */
int auth_n_keys(const auth_t *a);
int auth_n_admin(const auth_t *a);

/* The i-th key in the order added (0 <= i < auth_n_keys), borrowed. */
const auth_key *auth_key_at(const auth_t *a, int i);

/* Check an Authorization header value (NULL: none): AUTH_OK with *key the matching key
 * (borrowed from a, lives as long as a), else AUTH_MISSING / AUTH_INVALID and *key NULL.
 * The scheme is case-insensitive; surrounding whitespace is ignored. Every configured
 * digest is compared, in constant time each. */
auth_status_t auth_check(auth_t *a, const char *authorization, auth_key **key);

/* The key's id: AUTH_ID_HEX lowercase hex digits (borrowed, NUL-terminated). */
const char *auth_key_id(const auth_key *k);

/* The key's length in bytes (to warn about short keys at start-up). */
size_t auth_key_bytes(const auth_key *k);

/* The key's parameters (admin, rates). */
auth_key_params auth_key_get_params(const auth_key *k);

/* Take one request from k's requests/s bucket at now_us (monotonic microseconds). 0, or -1
 * when the key is over its limit, with *retry_after_s the whole seconds (>= 1) until a
 * request would pass. Always 0 for a key without a request limit. */
int auth_take_request(auth_key *k, int64_t now_us, int *retry_after_s);

/* Take n tokens (>= 0) from k's tokens/s bucket at now_us, as auth_take_request. */
int auth_take_tokens(auth_key *k, int64_t now_us, double n, int *retry_after_s);

/* Give back n tokens (>= 0) taken but not used (a request that generated fewer than its
 * max_tokens); the bucket never holds more than it can. */
void auth_return_tokens(auth_key *k, int64_t now_us, double n);

#endif
