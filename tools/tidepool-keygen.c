/*
 * tidepool-keygen: a CURVE key pair for the ctl and kv sockets (docs/security.md).
 *
 *   tidepool-keygen [--force] DIR/NAME     writes DIR/NAME.key (0600) and DIR/NAME.pub (0644)
 *   tidepool-keygen --check FILE           reads a key file or an authorized-keys list
 *
 * NAME.key holds the public and the secret key, NAME.pub the public key only, both in
 * czmq's certificate format (transport/curve.h). Existing files are never overwritten
 * without --force. Exit status: 0, 1 on failure (message on stderr), 2 on bad usage.
 */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "curve.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: tidepool-keygen [--force] DIR/NAME\n"
               "       tidepool-keygen --check FILE|DIR\n"
               "  Write a CURVE key pair: DIR/NAME.key (public + secret key, mode 0600) and\n"
               "  DIR/NAME.pub (public key, 0644), in ZeroMQ/czmq certificate format (Z85).\n"
               "  --force   replace existing files\n"
               "  --check   read a key file (.key or .pub) or an authorized-keys file or\n"
               "            directory, print its public key(s) count, exit 1 if malformed\n");
}

int main(int argc, char **argv)
{
    int force = 0, check = 0;
    const char *target = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--force") == 0) {
            force = 1;
        } else if (strcmp(argv[i], "--check") == 0) {
            check = 1;
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            return 0;
        } else if (argv[i][0] == '-' || target) {
            usage(stderr);
            return 2;
        } else {
            target = argv[i];
        }
    }
    if (!target || (check && force)) {
        usage(stderr);
        return 2;
    }
    char err[512];
    if (check) {
        curve_keypair kp;
        if (curve_key_load(target, 0, &kp, err, sizeof(err)) == 0) {
            printf("%s: %s key file, public key %s\n", target,
                   kp.secret_z85[0] ? "secret" : "public", kp.public_z85);
            return 0;
        }
        char err2[512];
        curve_authlist_t *l = curve_authlist_load(target, err2, sizeof(err2));
        if (!l) {
            /* one message where the other reading is beside the point: a directory is a
             * list, a .key/.pub file or one holding a secret key is a key file, a file that
             * cannot be read fails both ways alike */
            struct stat st;
            size_t n = strlen(target);
            int is_dir = stat(target, &st) == 0 && S_ISDIR(st.st_mode);
            int key_file = n > 4 && (strcmp(target + n - 4, ".key") == 0 ||
                                     strcmp(target + n - 4, ".pub") == 0);
            if (is_dir)
                fprintf(stderr, "tidepool-keygen: %s\n", err2);
            else if (key_file || strstr(err2, "holds a secret key") || access(target, R_OK) < 0)
                fprintf(stderr, "tidepool-keygen: %s\n", err);
            else
                fprintf(stderr, "tidepool-keygen: %s\n  (as an authorized-keys list: %s)\n",
                        err, err2);
            return 1;
        }
        printf("%s: authorized keys, %zu public key(s)\n", target, curve_authlist_count(l));
        curve_authlist_destroy(&l);
        return 0;
    }
    curve_keypair kp;
    if (curve_keypair_new(&kp, err, sizeof(err)) < 0 ||
        curve_key_save(target, &kp, force, err, sizeof(err)) < 0) {
        fprintf(stderr, "tidepool-keygen: %s\n", err);
        return 1;
    }
    memset(kp.secret_z85, 0, sizeof(kp.secret_z85));
    printf("%s.key %s.pub public-key %s\n", target, target, kp.public_z85);
    return 0;
}
