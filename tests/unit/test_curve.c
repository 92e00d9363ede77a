/* transport/curve: key-file and authorized-keys parsers, file modes, tidepool-keygen's
 * writer, a CURVE handshake through the ZAP handler (admitted and refused keys), and the
 * handshake monitor (transport/hsmon). */
#include <errno.h>
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
#include <zmq.h>

#include "curve.h"
#include "hsmon.h"

/* libzmq's documented test vectors (zmq_curve(7)) */
#define SRV_PUB "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
#define SRV_SEC "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6"
#define CLI_PUB "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"
#define CLI_SEC "D:)Q[IlAW!ahhC2ac:9*A}h:p?([4%wOTJ%JR%cs"

static int parse_key(const char *text, int need_secret, curve_keypair *kp, char *err)
{
    return curve_key_parse(text, strlen(text), "k", need_secret, kp, err, 256);
}

static void test_z85_valid(void **state)
{
    (void)state;
    assert_int_equal(curve_z85_valid(SRV_PUB), 1);
    assert_int_equal(curve_z85_valid(CLI_SEC), 1);
    assert_int_equal(curve_z85_valid(""), 0);
    assert_int_equal(curve_z85_valid("rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf"), 0); /* 39 */
    assert_int_equal(curve_z85_valid(SRV_PUB "A"), 0);                              /* 41 */
    assert_int_equal(curve_z85_valid("rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf\""), 0);
    assert_int_equal(curve_z85_valid("#####>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"), 0);
    assert_int_equal(curve_z85_valid(NULL), 0);
}

static void test_key_parse(void **state)
{
    (void)state;
    curve_keypair kp;
    char err[256];
    /* czmq's secret certificate */
    const char *full = "#   ZeroMQ CURVE **Secret** Certificate\n"
                       "\n"
                       "metadata\n"
                       "    name = \"gateway\"\n"
                       "curve\n"
                       "    public-key = \"" SRV_PUB "\"\n"
                       "    secret-key = \"" SRV_SEC "\"\n";
    assert_int_equal(parse_key(full, 1, &kp, err), 0);
    assert_string_equal(kp.public_z85, SRV_PUB);
    assert_string_equal(kp.secret_z85, SRV_SEC);
    /* a public certificate: fine unless a secret is needed; CRLF and no final newline */
    const char *pub = "metadata\r\ncurve\r\n    public-key = \"" CLI_PUB "\"";
    assert_int_equal(parse_key(pub, 0, &kp, err), 0);
    assert_string_equal(kp.public_z85, CLI_PUB);
    assert_string_equal(kp.secret_z85, "");
    assert_int_equal(parse_key(pub, 1, &kp, err), -1);
    assert_non_null(strstr(err, "holds no secret-key"));

    struct { const char *name, *text, *needle; } bad[] = {
        {"empty", "", "no public-key"},
        {"comments only", "# x\n\n", "no public-key"},
        {"mismatched pair",
         "curve\n    public-key = \"" CLI_PUB "\"\n    secret-key = \"" SRV_SEC "\"\n",
         "not the secret key's"},
        {"short key", "curve\n    public-key = \"rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf\"\n",
         "k:2: malformed key file: a key is not 40 Z85 characters"},
        {"bad alphabet",
         "curve\n    public-key = \"rq:rM>}U?@Lns47E1%kR.o@n%Fcmm L/@{H8]yf7\"\n",
         "k:2: malformed key file: the public key is not valid Z85"},
        {"overflowing group",
         "curve\n    public-key = \"#####>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7\"\n",
         "not valid Z85"},
        {"twice",
         "curve\n    public-key = \"" SRV_PUB "\"\n    public-key = \"" SRV_PUB "\"\n",
         "k:3: malformed key file: public-key given twice"},
        {"unknown name", "curve\n    private-key = \"" SRV_PUB "\"\n",
         "k:2: malformed key file: an unknown name in the curve section"},
        {"outside a section", "    public-key = \"" SRV_PUB "\"\n",
         "k:1: malformed key file: a line outside a section"},
        {"not indented", "curve\npublic-key = \"" SRV_PUB "\"\n", "must be indented"},
        {"unbalanced quote", "curve\n    public-key = \"" SRV_PUB "\n", "unbalanced quotes"},
        {"bare key", SRV_PUB "\n", "k:1: malformed key file: a bare key"},
        {"garbage", "curve\n  hello world\n", "k:2: malformed key file: neither"},
        {"NUL byte", "curve\n    public-key = \"" SRV_PUB "\"\n", "NUL"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        size_t len = strlen(bad[i].text);
        char buf[512];
        memcpy(buf, bad[i].text, len + 1);
        if (strcmp(bad[i].name, "NUL byte") == 0)
            buf[8] = 0; /* inside "    public-key" */
        err[0] = 0;
        int rc = curve_key_parse(buf, len, "k", 0, &kp, err, sizeof(err));
        if (rc != -1 || !strstr(err, bad[i].needle))
            fail_msg("case '%s': rc %d err '%s'", bad[i].name, rc, err);
        assert_string_equal(kp.public_z85, "");
    }
}

static char tmpdir[64];

static int setup_dir(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/test_curve.XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown_dir(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

static void write_text(const char *path, const char *text, mode_t mode)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    assert_int_equal(chmod(path, mode), 0);
}

/* tidepool-keygen's writer, the modes, O_EXCL, and the loader's mode check. */
static void test_key_files(void **state)
{
    (void)state;
    char base[128], key[160], pub[160], err[512];
    snprintf(base, sizeof(base), "%s/w0", tmpdir);
    snprintf(key, sizeof(key), "%s.key", base);
    snprintf(pub, sizeof(pub), "%s.pub", base);
    curve_keypair kp, got;
    assert_int_equal(curve_keypair_new(&kp, err, sizeof(err)), 0);
    assert_int_equal(curve_key_save(base, &kp, 0, err, sizeof(err)), 0);
    struct stat st;
    assert_int_equal(stat(key, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0600);
    assert_int_equal(stat(pub, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0644);
    assert_int_equal(curve_key_load(key, 1, &got, err, sizeof(err)), 0);
    assert_string_equal(got.public_z85, kp.public_z85);
    assert_string_equal(got.secret_z85, kp.secret_z85);
    assert_int_equal(curve_key_load(pub, 0, &got, err, sizeof(err)), 0);
    assert_string_equal(got.public_z85, kp.public_z85);
    assert_string_equal(got.secret_z85, "");
    /* never overwritten without force */
    curve_keypair kp2;
    assert_int_equal(curve_keypair_new(&kp2, err, sizeof(err)), 0);
    assert_int_equal(curve_key_save(base, &kp2, 0, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "File exists"));
    assert_int_equal(curve_key_load(key, 1, &got, err, sizeof(err)), 0);
    assert_string_equal(got.public_z85, kp.public_z85);
    assert_int_equal(curve_key_save(base, &kp2, 1, err, sizeof(err)), 0);
    assert_int_equal(curve_key_load(key, 1, &got, err, sizeof(err)), 0);
    assert_string_equal(got.public_z85, kp2.public_z85);
    /* a secret key readable by group or others is refused; a public one is fine */
    static const mode_t open_modes[] = {0644, 0640, 0604, 0660, 0400 | 0004};
    for (size_t i = 0; i < sizeof(open_modes) / sizeof(open_modes[0]); i++) {
        assert_int_equal(chmod(key, open_modes[i]), 0);
        assert_int_equal(curve_key_load(key, 1, &got, err, sizeof(err)), -1);
        assert_non_null(strstr(err, "lets group or others read it"));
        assert_int_equal(curve_key_load(key, 0, &got, err, sizeof(err)), -1);
    }
    assert_int_equal(chmod(key, 0400), 0);
    assert_int_equal(curve_key_load(key, 1, &got, err, sizeof(err)), 0);
    assert_int_equal(chmod(pub, 0666), 0);
    assert_int_equal(curve_key_load(pub, 0, &got, err, sizeof(err)), 0);
    /* missing file */
    char none[160];
    snprintf(none, sizeof(none), "%s/none.key", tmpdir);
    assert_int_equal(curve_key_load(none, 1, &got, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "cannot open"));
}

static void test_authlist(void **state)
{
    (void)state;
    char err[512];
    curve_authlist_t *l = NULL;
    const char *text = "# workers\n" SRV_PUB "\n\n"
                       "metadata\ncurve\n    public-key = \"" CLI_PUB "\"\n"
                       SRV_PUB "\n"; /* a duplicate counts once */
    assert_int_equal(curve_authlist_parse(&l, text, strlen(text), "a", err, sizeof(err)), 0);
    assert_int_equal(curve_authlist_count(l), 2);
    uint8_t bin[32];
    assert_non_null(zmq_z85_decode(bin, CLI_PUB));
    assert_int_equal(curve_authlist_contains(l, bin), 1);
    assert_non_null(zmq_z85_decode(bin, CLI_SEC));
    assert_int_equal(curve_authlist_contains(l, bin), 0);
    /* a bad file leaves the list as it was */
    struct { const char *text, *needle; } bad[] = {
        {"curve\n    secret-key = \"" SRV_SEC "\"\n", "a:2: holds a secret key"},
        {"rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf\n", "a:1: malformed authorized keys"},
        {"$####>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7\n", "a:1: malformed authorized keys: not"},
        {CLI_SEC "\nhello\n", "a:2: malformed"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        err[0] = 0;
        int rc = curve_authlist_parse(&l, bad[i].text, strlen(bad[i].text), "a", err,
                                      sizeof(err));
        if (rc != -1 || !strstr(err, bad[i].needle))
            fail_msg("case %zu: rc %d err '%s'", i, rc, err);
        assert_int_equal(curve_authlist_count(l), 2);
    }
    curve_authlist_destroy(&l);
    assert_null(l);
    curve_authlist_destroy(&l);

    /* a directory: *.pub files only (NAME.key and others are skipped) */
    char dir[128], path[192];
    snprintf(dir, sizeof(dir), "%s/auth", tmpdir);
    assert_int_equal(mkdir(dir, 0755), 0);
    l = curve_authlist_load(dir, err, sizeof(err));
    assert_null(l);
    assert_non_null(strstr(err, "no public key in it"));
    snprintf(path, sizeof(path), "%s/a.pub", dir);
    write_text(path, "metadata\ncurve\n    public-key = \"" SRV_PUB "\"\n", 0644);
    snprintf(path, sizeof(path), "%s/a.key", dir);
    write_text(path, "curve\n    public-key = \"" SRV_PUB "\"\n    secret-key = \"" SRV_SEC
                     "\"\n", 0600);
    snprintf(path, sizeof(path), "%s/notes.txt", dir);
    write_text(path, "not keys\n", 0644);
    snprintf(path, sizeof(path), "%s/b.pub", dir);
    write_text(path, CLI_PUB "\n", 0644);
    l = curve_authlist_load(dir, err, sizeof(err));
    if (!l)
        fail_msg("%s", err);
    assert_int_equal(curve_authlist_count(l), 2);
    curve_authlist_destroy(&l);
    /* one bad .pub file fails the whole directory, naming the file */
    snprintf(path, sizeof(path), "%s/c.pub", dir);
    write_text(path, "curve\n    secret-key = \"" SRV_SEC "\"\n", 0644);
    l = curve_authlist_load(dir, err, sizeof(err));
    assert_null(l);
    assert_non_null(strstr(err, "c.pub:2: holds a secret key"));
    /* a single file */
    snprintf(path, sizeof(path), "%s/b.pub", dir);
    l = curve_authlist_load(path, err, sizeof(err));
    assert_non_null(l);
    assert_int_equal(curve_authlist_count(l), 1);
    curve_authlist_destroy(&l);
    snprintf(path, sizeof(path), "%s/missing", dir);
    assert_null(curve_authlist_load(path, err, sizeof(err)));
    assert_non_null(strstr(err, "cannot read authorized keys"));
}

/* Connect a CURVE client with key pair cli to a server on ctx at ep; returns 1 when a
 * request and its reply went through within the timeout. */
static int try_client(void *ctx, const char *ep, const curve_keypair *cli, const char *srv_pub)
{
    void *c = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0, t = 300;
    zmq_setsockopt(c, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(c, ZMQ_RCVTIMEO, &t, sizeof(t));
    assert_int_equal(curve_setup_client(c, cli, srv_pub), 0);
    assert_int_equal(zmq_connect(c, ep), 0);
    zmq_send(c, "ping", 4, ZMQ_DONTWAIT);
    char buf[8];
    int n = zmq_recv(c, buf, sizeof(buf), 0);
    zmq_close(c);
    return n == 4;
}

static void *echo_thread(void *arg)
{
    void *s = arg;
    for (;;) {
        zmq_msg_t id, body;
        zmq_msg_init(&id);
        zmq_msg_init(&body);
        if (zmq_msg_recv(&id, s, 0) < 0 || zmq_msg_recv(&body, s, 0) < 0) {
            zmq_msg_close(&id);
            zmq_msg_close(&body);
            break;
        }
        int stop = zmq_msg_size(&body) == 4 && memcmp(zmq_msg_data(&body), "stop", 4) == 0;
        zmq_msg_send(&id, s, ZMQ_SNDMORE);
        zmq_msg_send(&body, s, 0);
        if (stop)
            break;
    }
    return NULL;
}

#include <pthread.h>

/* The ZAP handler admits listed keys only, counts refusals, and stops cleanly. */
static void test_zap_handshake(void **state)
{
    (void)state;
    char err[256];
    void *ctx = zmq_ctx_new();
    curve_keypair srv = {SRV_PUB, SRV_SEC}, cli = {CLI_PUB, CLI_SEC}, other;
    assert_int_equal(curve_keypair_new(&other, err, sizeof(err)), 0);
    curve_authlist_t *l = NULL;
    const char *text = CLI_PUB "\n";
    assert_int_equal(curve_authlist_parse(&l, text, strlen(text), "a", err, sizeof(err)), 0);
    curve_zap_t *z = curve_zap_start(ctx, &l, err, sizeof(err));
    assert_non_null(z);
    assert_null(l);
    /* a second handler in the same context cannot bind */
    curve_authlist_t *l2 = NULL;
    assert_int_equal(curve_authlist_parse(&l2, text, strlen(text), "a", err, sizeof(err)), 0);
    assert_null(curve_zap_start(ctx, &l2, err, sizeof(err)));
    assert_null(l2);
    assert_non_null(strstr(err, "cannot bind"));

    void *s = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    assert_int_equal(curve_setup_server(s, &srv, CURVE_ZAP_DOMAIN_KV), 0);
    assert_int_equal(zmq_bind(s, "tcp://127.0.0.1:*"), 0);
    char ep[128];
    size_t eplen = sizeof(ep);
    zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &eplen);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, echo_thread, s), 0);

    assert_int_equal(try_client(ctx, ep, &cli, SRV_PUB), 1);   /* listed */
    assert_int_equal(try_client(ctx, ep, &other, SRV_PUB), 0); /* not listed */
    assert_int_equal(try_client(ctx, ep, &cli, CLI_PUB), 0);   /* wrong server key */
    curve_zap_stats st;
    curve_zap_get_stats(z, &st);
    assert_true(st.n_allowed == 1);
    assert_true(st.n_refused >= 1); /* the refused client may retry its handshake */
    /* a plain client never reaches the application */
    void *plain = zmq_socket(ctx, ZMQ_DEALER);
    int t = 300;
    zmq_setsockopt(plain, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(plain, ZMQ_RCVTIMEO, &t, sizeof(t));
    zmq_connect(plain, ep);
    zmq_send(plain, "ping", 4, ZMQ_DONTWAIT);
    char buf[8];
    assert_int_equal(zmq_recv(plain, buf, sizeof(buf), 0), -1);
    zmq_close(plain);

    /* stop the echo thread through an admitted client */
    void *c = zmq_socket(ctx, ZMQ_DEALER);
    zmq_setsockopt(c, ZMQ_LINGER, &zero, sizeof(zero));
    curve_setup_client(c, &cli, SRV_PUB);
    zmq_connect(c, ep);
    zmq_send(c, "stop", 4, 0);
    pthread_join(th, NULL);
    zmq_close(c);
    zmq_close(s);
    curve_zap_stop(&z);
    assert_null(z);
    curve_zap_stop(&z);
    zmq_ctx_term(ctx);
}

/* The handshake monitor counts a plain client's failed handshake on a CURVE server, and a
 * socket reopened many times gets a new monitor each time (inproc names are not reused). */
static void test_hsmon(void **state)
{
    (void)state;
    char err[256];
    void *ctx = zmq_ctx_new();
    curve_keypair srv = {SRV_PUB, SRV_SEC};
    void *s = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    assert_int_equal(curve_setup_server(s, &srv, CURVE_ZAP_DOMAIN_CTL), 0);
    hsmon_t *m = hsmon_start(ctx, s, HSMON_SERVER, 1, "ctl", err, sizeof(err));
    assert_non_null(m);
    assert_int_equal(zmq_bind(s, "tcp://127.0.0.1:*"), 0);
    char ep[128];
    size_t eplen = sizeof(ep);
    zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &eplen);
    void *plain = zmq_socket(ctx, ZMQ_DEALER);
    zmq_setsockopt(plain, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_connect(plain, ep);
    hsmon_stats st = {0, 0};
    for (int i = 0; i < 300 && st.n_failed == 0; i++) {
        usleep(10000);
        hsmon_get_stats(m, &st);
    }
    assert_true(st.n_failed >= 1);
    /* the latest failure as its log line says it (tidepool-top shows it) */
    char why[320] = "x";
    int have = 0;
    for (int i = 0; i < 300 && !(have = hsmon_last_failure(m, why, sizeof(why))); i++)
        usleep(10000);
    assert_int_equal(have, 1);
    assert_non_null(strstr(why, "handshake from "));
    assert_non_null(strstr(why, "the client does not use CURVE"));
    /* the reopen pattern of a worker's ctl socket: monitor, close, again */
    void *c = NULL;
    hsmon_t *cm = NULL;
    for (int i = 0; i < 50; i++) {
        hsmon_stop(&cm);
        assert_null(cm);
        if (c)
            zmq_close(c);
        c = zmq_socket(ctx, ZMQ_DEALER);
        zmq_setsockopt(c, ZMQ_LINGER, &zero, sizeof(zero));
        cm = hsmon_start(ctx, c, HSMON_CLIENT, 0, "ctl", err, sizeof(err));
        assert_non_null(cm);
        if (i == 0) { /* none yet */
            assert_int_equal(hsmon_last_failure(cm, why, sizeof(why)), 0);
            assert_string_equal(why, "");
        }
        assert_int_equal(zmq_connect(c, ep), 0);
    }
    hsmon_stop(&cm);
    hsmon_stop(&cm); /* takes NULL */
    zmq_close(c);
    zmq_close(plain);
    hsmon_stop(&m);
    zmq_close(s);
    zmq_ctx_term(ctx);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_z85_valid),
        cmocka_unit_test(test_key_parse),
        cmocka_unit_test_setup_teardown(test_key_files, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_authlist, setup_dir, teardown_dir),
        cmocka_unit_test(test_zap_handshake),
        cmocka_unit_test(test_hsmon),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("curve", tests, NULL, NULL);
}
