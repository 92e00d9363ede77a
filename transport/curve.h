/*
 * curve: CURVE encryption and authentication of the inter-process ZeroMQ sockets (ctl and
 * kv), ZeroMQ's CurveZMQ (RFC 26) with a ZAP handler (RFC 27) that admits only listed
 * client public keys. docs/security.md describes the set-up.
 *
 * Keys are ZeroMQ's 32-byte Curve25519 keys in Z85 text (40 characters, RFC 32). A key
 * file is czmq's certificate format (ZPL), which tidepool-keygen writes:
 *
 *     #   tidepool CURVE key pair (tidepool-keygen) ...     comment lines ('#')
 *     metadata
 *     curve
 *         public-key = "<40 Z85 characters>"
 *         secret-key = "<40 Z85 characters>"            only in NAME.key, never in .pub
 *
 * Blank lines, '#' comments, the section lines `metadata` and `curve` and indented
 * `name = "value"` lines under `metadata` are accepted and ignored; anything else is a
 * malformed file. A file holding a secret key must not be readable by group or others
 * (mode 0600), and its public key must be the one the secret key derives.
 *
 * An authorized-keys list is a file or a directory. A file holds any number of public
 * keys, one per line, either bare (40 Z85 characters at the start of the line; no key
 * begins with '#') or as `public-key = "..."` lines of concatenated .pub files (comments
 * and section lines as above). A directory: every
 * regular file in it whose name ends in ".pub" (other files, such as NAME.key, are
 * skipped), each read as such a file. A list with a secret-key line, or with no key at
 * all, is refused.
 *
 * Servers (the gateway's ctl ROUTER, a decode worker's kv ROUTER) set ZMQ_CURVE_SERVER,
 * their secret key and a ZAP domain; the process runs one ZAP handler (curve_zap_start)
 * on inproc://zeromq.zap.01 of its zmq context, in its own thread, which answers 200 to a
 * CURVE client whose public key is listed and 400 to any other (logged with the key and
 * the peer address, at most CURVE_ZAP_LOG_BURST lines per CURVE_ZAP_LOG_WINDOW_S seconds).
 * Clients (a worker's ctl DEALER, the kv senders' DEALERs) set the server's public key and
 * their own key pair.
 *
 * Library code: returns errors as text; the ZAP handler logs through log.h. Thread-safety: key pairs and lists
 * are plain data; the ZAP handler owns its list after curve_zap_start.
 */
#ifndef TP_CURVE_H
#define TP_CURVE_H

#include <stddef.h>
#include <stdint.h>

#define CURVE_KEY_BYTES 32   /* a Curve25519 key, binary */
#define CURVE_Z85_LEN 40     /* its Z85 text, NUL excluded */
#define CURVE_ZAP_LOG_BURST 10      /* refusal log lines at most ... */
#define CURVE_ZAP_LOG_WINDOW_S 10   /* ... per this many seconds (the rest are counted) */
#define CURVE_ZAP_DOMAIN_CTL "tidepool-ctl"
#define CURVE_ZAP_DOMAIN_KV "tidepool-kv"
#define CURVE_ZAP_DOMAIN_STATS "tidepool-stats"

/* A key pair in Z85 text, NUL-terminated; secret_z85 is "" when only the public key is
 * known (a .pub file). */
typedef struct {
    char public_z85[CURVE_Z85_LEN + 1];
    char secret_z85[CURVE_Z85_LEN + 1];
} curve_keypair;

/* Whether s is exactly CURVE_Z85_LEN characters of the Z85 alphabet that decode to a key
 * (every 5-character group below 2^32). Returns 1 or 0. */
int curve_z85_valid(const char *s);

/* Generate a new key pair into *out (zmq_curve_keypair). Returns 0, or -1 when libzmq has
 * no CURVE support (message in err). */
int curve_keypair_new(curve_keypair *out, char *err, size_t errlen);

/* Read the key file at path into *out. need_secret = 1: the file must hold a secret key
 * (and then a public key matching it). A file holding a secret key whose mode gives any
 * access to group or others is refused, whatever need_secret says. Returns 0, or -1 with
 * the reason (naming the file, and the line when malformed) in err. */
int curve_key_load(const char *path, int need_secret, curve_keypair *out, char *err,
                   size_t errlen);

/* Parse key-file text (len bytes, need not be NUL-terminated) as curve_key_load does,
 * without the file-mode check; name is used in error messages. Same returns. */
int curve_key_parse(const char *text, size_t len, const char *name, int need_secret,
                    curve_keypair *out, char *err, size_t errlen);

/* Write kp as base.key (public and secret key, mode 0600) and base.pub (public key only,
 * mode 0644), in the format above. Without force an existing file is an error (O_EXCL);
 * with force both are replaced. Returns 0, or -1 with the reason in err (a .key written
 * before the .pub failed is removed). */
int curve_key_save(const char *base, const curve_keypair *kp, int force, char *err,
                   size_t errlen);

/* A set of authorized client public keys. */
typedef struct curve_authlist curve_authlist_t;

/* Load an authorized-keys file or directory (format above). Returns the list (the
 * caller's; free with curve_authlist_destroy), or NULL with the reason in err. */
curve_authlist_t *curve_authlist_load(const char *path, char *err, size_t errlen);

/* Parse authorized-keys text (one file's contents, len bytes) and add its keys to *list
 * (created when *list is NULL). name is used in error messages. A file without keys adds
 * none (curve_authlist_load refuses an empty list as a whole). Returns 0, or -1 with the
 * reason in err (*list keeps what it had). */
int curve_authlist_parse(curve_authlist_t **list, const char *text, size_t len, const char *name,
                         char *err, size_t errlen);

/* Number of distinct keys in the list (0 for NULL). */
size_t curve_authlist_count(const curve_authlist_t *list);

/* Whether the binary key (CURVE_KEY_BYTES bytes) is in the list. Returns 1 or 0. */
int curve_authlist_contains(const curve_authlist_t *list, const uint8_t *key);

/* Free the list and NULL *list. Takes NULL. */
void curve_authlist_destroy(curve_authlist_t **list);

/* Make sock (not bound yet) a CURVE server with kp's secret key and the ZAP domain given.
 * Returns 0, or -1 with errno. */
int curve_setup_server(void *sock, const curve_keypair *kp, const char *zap_domain);

/* Make sock (not connected yet) a CURVE client with key pair kp, accepting only the server
 * whose public key is server_public_z85. Returns 0, or -1 with errno (EINVAL for a key
 * that is not valid Z85). */
int curve_setup_client(void *sock, const curve_keypair *kp, const char *server_public_z85);

/* The ZAP handler of one zmq context. */
typedef struct curve_zap curve_zap_t;

/* Counters of a ZAP handler since it started. */
typedef struct {
    uint64_t n_allowed; /* CURVE handshakes admitted (200) */
    uint64_t n_refused; /* refused (400): unlisted key, or not CURVE */
    uint64_t n_unlogged; /* refusals not logged (rate limit) */
} curve_zap_stats;

/* Bind a ZAP handler at inproc://zeromq.zap.01 in zctx (borrowed) and start its thread;
 * it takes *list (consumed, *list set to NULL, also on failure). Call before binding the
 * CURVE server sockets of zctx. Returns the handler, or NULL with the reason in err
 * (EADDRINUSE: zctx has a handler already). */
curve_zap_t *curve_zap_start(void *zctx, curve_authlist_t **list, char *err, size_t errlen);

/* A copy of the handler's counters (thread-safe). */
void curve_zap_get_stats(const curve_zap_t *z, curve_zap_stats *out);

/* Stop the thread, close its sockets, free the list and the handler, NULL *z. Takes NULL.
 * Call before zmq_ctx_term of its context (whose termination waits for the handler's
 * socket). */
void curve_zap_stop(curve_zap_t **z);

#endif
