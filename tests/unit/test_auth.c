/* Tests of gateway/auth: key checks (Bearer parsing, ids, admin), the key file (format,
 * permissions, errors that name the line but never the key) and the token buckets. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cmocka.h>

#include "auth.h"

#define SRC "--api-key" /* the source of the keys added directly */

static const auth_key_params user = {0, 0, 0};
static const auth_key_params admin = {1, 0, 0};

/* A temporary file with text and mode; its path in path (cap bytes). */
static void write_file(char *path, const char *text, mode_t mode)
{
    strcpy(path, "/tmp/tidepool-test-keys-XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    assert_int_equal(fchmod(fd, mode), 0);
    close(fd);
}

/* The Bearer scheme, case-insensitive, with surrounding whitespace; anything else is a
 * missing key, a wrong key is invalid. */
static void test_check_header(void **state)
{
    (void)state;
    auth_t *a = auth_new();
    char err[256];
    assert_non_null(a);
    assert_int_equal(auth_n_keys(a), 0);
    assert_int_equal(auth_add_key(a, "sk-user-0123456789", &user, SRC, err, sizeof(err)), 0);
    assert_int_equal(auth_add_key(a, "sk-admin-0123456789", &admin, SRC, err, sizeof(err)), 0);
    assert_int_equal(auth_n_keys(a), 2);
    assert_int_equal(auth_n_admin(a), 1);
    auth_key *k;
    assert_int_equal(auth_check(a, "Bearer sk-user-0123456789", &k), AUTH_OK);
    assert_ptr_equal(k, auth_key_at(a, 0));
    assert_int_equal(auth_key_get_params(k).admin, 0);
    assert_int_equal(auth_check(a, "  bearer \tsk-admin-0123456789  ", &k), AUTH_OK);
    assert_ptr_equal(k, auth_key_at(a, 1));
    assert_int_equal(auth_key_get_params(k).admin, 1);
    assert_int_equal(auth_check(a, "BEARER sk-user-0123456789", &k), AUTH_OK);
    assert_int_equal(auth_check(a, "Bearer sk-user-012345678", &k), AUTH_INVALID);
    assert_null(k);
    assert_int_equal(auth_check(a, "Bearer sk-user-0123456789x", &k), AUTH_INVALID);
    assert_int_equal(auth_check(a, "Bearer sk-user 0123456789", &k), AUTH_INVALID);
    assert_int_equal(auth_check(a, NULL, &k), AUTH_MISSING);
    assert_int_equal(auth_check(a, "", &k), AUTH_MISSING);
    assert_int_equal(auth_check(a, "Bearer", &k), AUTH_MISSING);
    assert_int_equal(auth_check(a, "Bearer   ", &k), AUTH_MISSING);
    assert_int_equal(auth_check(a, "Basic c2stdXNlcg==", &k), AUTH_MISSING);
    assert_int_equal(auth_check(a, "Bearersk-user-0123456789", &k), AUTH_MISSING);
    assert_null(k);
    auth_destroy(&a);
    assert_null(a);
    auth_destroy(&a);
}

/* A key's id is the first 12 hex digits of its BLAKE2b-256 digest (the value below is
 * python3 -c "import hashlib; print(hashlib.blake2b(b'sk-user-0123456789',
 * digest_size=32).hexdigest()[:12])"); keys given twice or malformed are refused, and no
 * message quotes a key. */
static void test_ids_and_bad_keys(void **state)
{
    (void)state;
    auth_t *a = auth_new();
    char err[256];
    assert_int_equal(auth_add_key(a, "sk-user-0123456789", &user, SRC, err, sizeof(err)), 0);
    const char *id = auth_key_id(auth_key_at(a, 0));
    assert_int_equal(strlen(id), AUTH_ID_HEX);
    assert_string_equal(id, "26283a535f0f");
    assert_int_equal(auth_add_key(a, "sk-user-0123456789", &admin, SRC, err, sizeof(err)), -1);
    assert_string_equal(err, "the API key with id 26283a535f0f is given twice: in --api-key and "
                             "in --api-key");
    assert_int_equal(auth_add_key(a, "", &user, SRC, err, sizeof(err)), -1);
    assert_int_equal(auth_add_key(a, "sk bad", &user, SRC, err, sizeof(err)), -1);
    assert_null(strstr(err, "sk"));
    assert_int_equal(auth_add_key(a, "sk-\xc3\xa9t\xc3\xa9", &user, SRC, err, sizeof(err)), -1);
    char long_key[AUTH_MAX_KEY_BYTES + 2];
    memset(long_key, 'k', sizeof(long_key) - 1);
    long_key[sizeof(long_key) - 1] = 0;
    assert_int_equal(auth_add_key(a, long_key, &user, SRC, err, sizeof(err)), -1);
    long_key[AUTH_MAX_KEY_BYTES] = 0;
    assert_int_equal(auth_add_key(a, long_key, &user, SRC, err, sizeof(err)), 0);
    auth_key_params bad = {0, -1, 0};
    assert_int_equal(auth_add_key(a, "sk-other-key-000000", &bad, SRC, err, sizeof(err)), -1);
    assert_int_equal(auth_n_keys(a), 2);
    auth_destroy(&a);
}

/* The file format: comments, blank lines, attributes. */
static void test_file_format(void **state)
{
    (void)state;
    char path[64], err[512];
    write_file(path,
               "# tidepool keys\n"
               "\n"
               "sk-alice-0000000000000\n"
               "  sk-bob-00000000000000   admin   # the operator\n"
               "sk-carol-000000000000 requests-per-s=2.5\ttokens-per-s=1000\r\n"
               "   # indented comment\n"
               "sk-dave-0000000000000 tokens-per-s=7 admin",
               0600);
    auth_t *a = auth_new();
    assert_int_equal(auth_load_file(a, path, err, sizeof(err)), 0);
    assert_int_equal(auth_n_keys(a), 4);
    assert_int_equal(auth_n_admin(a), 2);
    auth_key *k;
    assert_int_equal(auth_check(a, "Bearer sk-alice-0000000000000", &k), AUTH_OK);
    auth_key_params p = auth_key_get_params(k);
    assert_int_equal(p.admin, 0);
    assert_true(p.requests_per_s == 0 && p.tokens_per_s == 0);
    assert_int_equal(auth_check(a, "Bearer sk-bob-00000000000000", &k), AUTH_OK);
    assert_int_equal(auth_key_get_params(k).admin, 1);
    assert_int_equal(auth_check(a, "Bearer sk-carol-000000000000", &k), AUTH_OK);
    p = auth_key_get_params(k);
    assert_int_equal(p.admin, 0);
    assert_true(p.requests_per_s == 2.5 && p.tokens_per_s == 1000);
    assert_int_equal(auth_check(a, "Bearer sk-dave-0000000000000", &k), AUTH_OK);
    p = auth_key_get_params(k);
    assert_true(p.admin == 1 && p.tokens_per_s == 7);
    assert_int_equal(auth_check(a, "Bearer #", &k), AUTH_INVALID);
    auth_destroy(&a);
    unlink(path);
}

/* Refused files: the message names the file and the line, never a key. */
static void test_file_errors(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        mode_t mode;
        const char *want; /* after "<path>: " */
    } cases[] = {
        {"sk-secret-1111111111\n", 0644,
         "the API key file is accessible by group or others (mode 0644): make it readable by "
         "its owner only (chmod 600)"},
        {"sk-secret-1111111111\n", 0640,
         "the API key file is accessible by group or others (mode 0640): make it readable by "
         "its owner only (chmod 600)"},
        {"sk-secret-1111111111\n", 0602,
         "the API key file is accessible by group or others (mode 0602): make it readable by "
         "its owner only (chmod 600)"},
        {"# nothing\n\n", 0600, "the API key file holds no key"},
        {"sk-secret-1111111111\nsk-secret-2222222222 sk-secret-3333333333\n", 0600,
         "line 2: word 2 is not an attribute (want admin, requests-per-s=N or tokens-per-s=N "
         "after the key)"},
        {"\n\nsk-secret-1111111111 requests-per-s=0\n", 0600,
         "line 3: word 2: a rate must be a number in (0, 1e9]"},
        {"sk-secret-1111111111 tokens-per-s=fast\n", 0600,
         "line 1: word 2: a rate must be a number in (0, 1e9]"},
        {"sk-secret-1111111111\nsk-secret-1111111111 admin\n", 0600,
         "line 2: the API key with id "},
        {"sk-secret-1111111111 admin admin\n", 0600, "line 1: word 3 repeats the attribute admin"},
        {"sk-secret-1111111111 requests-per-s=1 admin requests-per-s=2\n", 0600,
         "line 1: word 4 repeats the attribute requests-per-s"},
        {"\nsk-secret-1111111111 tokens-per-s=5 tokens-per-s=5\n", 0600,
         "line 2: word 3 repeats the attribute tokens-per-s"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char path[64], err[512], want[600];
        write_file(path, cases[i].text, cases[i].mode);
        auth_t *a = auth_new();
        assert_int_equal(auth_load_file(a, path, err, sizeof(err)), -1);
        snprintf(want, sizeof(want), "%s: %s", path, cases[i].want);
        if (strncmp(err, want, strlen(want)) != 0)
            fail_msg("case %zu: got '%s', want '%s'", i, err, want);
        assert_null(strstr(err, "sk-secret"));
        auth_destroy(&a);
        unlink(path);
    }
    char err[512];
    auth_t *a = auth_new();
    assert_int_equal(auth_load_file(a, "/nonexistent/keys", err, sizeof(err)), -1);
    assert_string_equal(err, "/nonexistent/keys: cannot open the API key file: No such file or "
                             "directory");
    assert_int_equal(auth_load_file(a, "/tmp", err, sizeof(err)), -1);
    assert_string_equal(err, "/tmp: the API key file is not a regular file");
    auth_destroy(&a);
}

/* A key given twice names both places, whichever they are: the environment and a file
 * line, two file lines (the trial: TIDEPOOL_API_KEY=$(head -n 1 keys) and --api-key-file
 * keys said only "line 1"). */
static void test_duplicate_names_both_sources(void **state)
{
    (void)state;
    char path[64], err[1024], want[1024];
    write_file(path, "# keys\nsk-secret-1111111111 admin\nsk-secret-2222222222\n", 0600);
    auth_t *a = auth_new();
    assert_int_equal(auth_add_key(a, "sk-secret-1111111111", &user, "TIDEPOOL_API_KEY", err,
                                  sizeof(err)),
                     0);
    assert_int_equal(auth_load_file(a, path, err, sizeof(err)), -1);
    snprintf(want, sizeof(want),
             "%s: line 2: the API key with id %s is given twice: in TIDEPOOL_API_KEY and in %s "
             "line 2",
             path, auth_key_id(auth_key_at(a, 0)), path);
    assert_string_equal(err, want);
    assert_int_equal(auth_n_keys(a), 1);
    auth_destroy(&a);
    unlink(path);

    write_file(path, "sk-secret-3333333333\n\nsk-secret-3333333333\n", 0600);
    a = auth_new();
    assert_int_equal(auth_load_file(a, path, err, sizeof(err)), -1);
    snprintf(want, sizeof(want),
             "%s: line 3: the API key with id %s is given twice: in %s line 1 and in %s line 3",
             path, auth_key_id(auth_key_at(a, 0)), path, path);
    assert_string_equal(err, want);
    assert_null(strstr(err, "sk-secret"));
    auth_destroy(&a);
    unlink(path);
}

/* The requests bucket: 2 per second holds 2; then a request waits for the refill, and
 * Retry-After is whole seconds, at least 1. */
static void test_request_bucket(void **state)
{
    (void)state;
    auth_t *a = auth_new();
    char err[256];
    auth_key_params p = {0, 2, 0};
    assert_int_equal(auth_add_key(a, "sk-limited-000000000", &p, SRC, err, sizeof(err)), 0);
    assert_int_equal(auth_add_key(a, "sk-free-000000000000", &user, SRC, err, sizeof(err)), 0);
    auth_key *k, *free_key;
    assert_int_equal(auth_check(a, "Bearer sk-limited-000000000", &k), AUTH_OK);
    assert_int_equal(auth_check(a, "Bearer sk-free-000000000000", &free_key), AUTH_OK);
    int ra = -1;
    int64_t t = 1000000000;
    assert_int_equal(auth_take_request(k, t, &ra), 0);
    assert_int_equal(ra, 0);
    assert_int_equal(auth_take_request(k, t, &ra), 0);
    assert_int_equal(auth_take_request(k, t, &ra), -1);
    assert_int_equal(ra, 1);
    assert_int_equal(auth_take_request(k, t + 400000, &ra), -1); /* 0.8 of a request */
    assert_int_equal(ra, 1);
    assert_int_equal(auth_take_request(k, t + 500000, &ra), 0); /* 1.0 */
    assert_int_equal(auth_take_request(k, t + 500000, &ra), -1);
    assert_int_equal(auth_take_request(k, t + 100000000, &ra), 0); /* full again: 2 */
    assert_int_equal(auth_take_request(k, t + 100000000, &ra), 0);
    assert_int_equal(auth_take_request(k, t + 100000000, &ra), -1);
    for (int i = 0; i < 1000; i++)
        assert_int_equal(auth_take_request(free_key, t, &ra), 0);
    /* a slow rate: one request per 10 s holds one; Retry-After counts the seconds */
    auth_key_params slow = {0, 0.1, 0};
    assert_int_equal(auth_add_key(a, "sk-slow-000000000000", &slow, SRC, err, sizeof(err)), 0);
    assert_int_equal(auth_check(a, "Bearer sk-slow-000000000000", &k), AUTH_OK);
    assert_int_equal(auth_take_request(k, t, &ra), 0);
    assert_int_equal(auth_take_request(k, t + 2500000, &ra), -1);
    assert_int_equal(ra, 8); /* 0.75 of a request missing at 0.1/s: 7.5 s, rounded up */
    auth_destroy(&a);
}

/* The tokens bucket: a request costing more than the bucket holds passes on a full bucket
 * and leaves a debt; tokens given back refill it, never beyond its size. */
static void test_token_bucket(void **state)
{
    (void)state;
    auth_t *a = auth_new();
    char err[256];
    auth_key_params p = {0, 0, 100};
    assert_int_equal(auth_add_key(a, "sk-tokens-0000000000", &p, SRC, err, sizeof(err)), 0);
    auth_key *k;
    assert_int_equal(auth_check(a, "Bearer sk-tokens-0000000000", &k), AUTH_OK);
    int ra;
    int64_t t = 5000000;
    assert_int_equal(auth_take_tokens(k, t, 60, &ra), 0);  /* 40 left */
    assert_int_equal(auth_take_tokens(k, t, 50, &ra), -1); /* 10 missing at 100/s */
    assert_int_equal(ra, 1);
    auth_return_tokens(k, t, 30); /* 70 */
    assert_int_equal(auth_take_tokens(k, t, 50, &ra), 0); /* 20 */
    auth_return_tokens(k, t, 1000);                       /* capped at 100 */
    assert_int_equal(auth_take_tokens(k, t, 300, &ra), 0); /* full: passes, -200 */
    assert_int_equal(auth_take_tokens(k, t, 1, &ra), -1);
    assert_int_equal(ra, 3); /* 201 tokens at 100/s */
    assert_int_equal(auth_take_tokens(k, t + 2000000, 1, &ra), -1); /* -200 + 200 = 0 */
    assert_int_equal(ra, 1);
    assert_int_equal(auth_take_tokens(k, t + 2010000, 1, &ra), 0);
    assert_int_equal(auth_take_request(k, t, &ra), 0); /* no request limit */
    auth_destroy(&a);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check_header),    cmocka_unit_test(test_ids_and_bad_keys),
        cmocka_unit_test(test_file_format),     cmocka_unit_test(test_file_errors),
        cmocka_unit_test(test_request_bucket),  cmocka_unit_test(test_token_bucket),
        cmocka_unit_test(test_duplicate_names_both_sources),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("auth", tests, NULL, NULL);
}
