/*
 * worker: the worker programs' entry (prefill_worker, decode_worker): the settings table,
 * logging, signals, then the compute state (worker/compute.h) and the runtime
 * (worker/runtime.h), which drives the roles until the worker has drained.
 */
#include "worker.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "runtime.h"

/* Read the CURVE key files (--curve-*) into rt: all three or none. Returns 0, or -1
 * (logged, naming the file and the problem). */
static int curve_settings(runtime_t *rt)
{
    const worker_settings *set = &rt->set;
    int n = (set->curve_secret_key && *set->curve_secret_key) +
            (set->curve_gateway_key && *set->curve_gateway_key) +
            (set->curve_authorized_keys && *set->curve_authorized_keys);
    if (n == 0)
        return 0;
    if (n != 3) {
        log_error("CURVE needs all of --curve-secret-key, --curve-gateway-key and "
                  "--curve-authorized-keys (or none of them)");
        return -1;
    }
    char err[512];
    curve_keypair gw;
    if (curve_key_load(set->curve_secret_key, 1, &rt->curve, err, sizeof(err)) < 0 ||
        curve_key_load(set->curve_gateway_key, 0, &gw, err, sizeof(err)) < 0 ||
        !(rt->curve_auth = curve_authlist_load(set->curve_authorized_keys, err, sizeof(err)))) {
        log_error("CURVE: %s", err);
        memset(&rt->curve, 0, sizeof(rt->curve));
        return -1;
    }
    snprintf(rt->curve_gateway_pub, sizeof(rt->curve_gateway_pub), "%s", gw.public_z85);
    rt->curve_on = 1;
    log_info("CURVE on: public key %s, gateway key %s, %zu keys admitted to the kv socket",
             rt->curve.public_z85, rt->curve_gateway_pub, curve_authlist_count(rt->curve_auth));
    return 0;
}

int worker_main(proto_role_t default_role, int argc, char **argv)
{
    runtime_t rt;
    memset(&rt, 0, sizeof(rt));
    rt.sigfd = -1;
    worker_settings *set = &rt.set;
    const config_entry_t table[] = {
        {"gateway", CONFIG_STRING, &set->gateway, "tcp://127.0.0.1:5557", 0, 0,
         "gateway ctl endpoint to connect to"},
        {"model", CONFIG_STRING, &set->model_path, "build/models/stories260K.gguf", 0, 0,
         "GGUF model file"},
        {"worker-id", CONFIG_STRING, &set->worker_id, NULL, 0, 0,
         "worker id, also its ctl routing id (unset: <role>-<hostname>-<pid>)"},
        {"role", CONFIG_STRING, &set->role_name, NULL, 0, 0,
         "prefill | decode | mixed (unset: the program's own role)"},
        {"kv-bind", CONFIG_STRING, &set->kv_bind, "tcp://127.0.0.1:5560", 0, 0,
         "decode/mixed: kv socket to bind (tcp://HOST:* picks a free port); a prefill worker "
         "binds it when it changes to decode (ROLE)"},
        {"kv-advertise", CONFIG_STRING, &set->kv_advertise, NULL, 0, 0,
         "decode/mixed: kv endpoint announced to the gateway (unset: the bound one)"},
        {"kv-blocks", CONFIG_INT, &set->kv_blocks, "0", 0, 1e9,
         "KV cache blocks (0 = max-seqs full contexts; with --emulate, the emulated "
         "accelerator's capacity for the emulated model: costmodel_kv_capacity_tokens / "
         "block-size, PRESET:token-scale=S scaling it)"},
        {"kv-watermark", CONFIG_DOUBLE, &set->kv_watermark, "0.01", 0, 0.5,
         "decode/mixed: fraction of the KV blocks a new sequence must leave free when it "
         "joins (vLLM's watermark), so that running sequences can grow before anything is "
         "preempted"},
        {"block-size", CONFIG_INT, &set->block_size, "16", 1, 4096, "tokens per KV block"},
        {"max-seqs", CONFIG_INT, &set->max_seqs, "64", 1, 65536,
         "sequences in the KV cache (running plus in transfer) and per batch"},
        {"max-batch-tokens", CONFIG_INT, &set->max_batch_tokens, "2048", 1, 1 << 24,
         "prompt tokens per prefill forward pass, over every prompt of the batch"},
        {"prefill-chunk-tokens", CONFIG_INT, &set->prefill_chunk_tokens, "512", 1, 1 << 24,
         "prompt tokens of one sequence per forward pass: a longer prompt is computed in "
         "chunks, one per loop iteration"},
        {"threads", CONFIG_INT, &set->threads, "0", 0, 1024,
         "compute threads, the loop thread included (0 = the CPUs this process may use)"},
        {"mtp", CONFIG_STRING, &set->mtp_setting, "auto", 0, 0,
         "MTP modules: auto (the model file's, else models/mtp/<name>-mtp.gguf beside the "
         "model, in the working directory or the build's repository) | none | a side file"},
        {"mtp-depth", CONFIG_INT, &set->mtp_depth_set, "-1", -1, 2,
         "MTP drafts per decode step at most, and the default of requests (-1 = 2 when "
         "modules are loaded; 0 = off); the worker lowers it when it does not pay"},
        {"mtp-adaptive", CONFIG_BOOL, &set->mtp_adaptive, "true", 0, 0,
         "lower a sequence's MTP depth when its acceptance and the batch size make "
         "verification not pay (docs/mtp.md); off: always --mtp-depth"},
        {"mtp-sampling", CONFIG_STRING, &set->mtp_sampling, "rejection", 0, 0,
         "MTP with temperature > 0: rejection (drafts sampled from the modules, speculative "
         "rejection sampling) | onehot (argmax drafts: seeded output identical at any depth)"},
        {"prefix-cache", CONFIG_BOOL, &set->prefix_cache, "true", 0, 0,
         "automatic prefix caching: a prompt whose leading full KV blocks an earlier prompt "
         "computed here shares them and computes only the rest, and a decode worker keeps "
         "the blocks it received or decoded so a transfer sends only those it lacks "
         "(docs/prefix-cache.md); false: every prompt is computed and sent whole"},
        {"heartbeat-ms", CONFIG_INT, &set->heartbeat_ms, "500", 10, 3600000,
         "heartbeat interval until the gateway sets one"},
        {"lease-ms", CONFIG_INT, &set->lease_ms, "5000", 10, 3600000,
         "KV transfer lease: silence after which a transfer is aborted"},
        {"emulate", CONFIG_STRING, &set->emulate, "", 0, 0,
         "emulated accelerator: a cost-model preset (a100-llama3-8b, h100-llama3-8b; "
         "PRESET:dilate=K runs it K times slower): each prefill/decode step is padded to "
         "its time and each KV transfer to its bytes; tokens come from the real model; MTP "
         "off (docs/scheduler.md); \"\" = real compute"},
        {"emulate-kv-pad", CONFIG_BOOL, &set->emulate_kv_pad, "true", 0, 0,
         "with --emulate: pad each KV transfer with zeros to the emulated model's bytes per "
         "token (true), or send the real model's KV only (false: on a small host the padding "
         "costs far more than the emulated link's time; tools/tidal-bench.sh turns it off)"},
        {"health-file", CONFIG_STRING, &set->health_file, "", 0, 0,
         "file rewritten at every heartbeat with the worker's state (time_ms, registered, "
         "state, ...) for container health checks (deploy/container/tidepool-health); "
         "removed at exit; \"\" = none"},
        {"curve-secret-key", CONFIG_STRING, &set->curve_secret_key, "", 0, 0,
         "CURVE: this worker's key pair file (tidepool-keygen; mode 0600): the ctl and kv "
         "sockets are encrypted and authenticated (docs/security.md); \"\" = plain. Needs "
         "--curve-gateway-key and --curve-authorized-keys"},
        {"curve-gateway-key", CONFIG_STRING, &set->curve_gateway_key, "", 0, 0,
         "CURVE: the gateway's public key file (its .pub)"},
        {"curve-authorized-keys", CONFIG_STRING, &set->curve_authorized_keys, "", 0, 0,
         "CURVE: the workers admitted to send KV to this one: a file of public keys or a "
         "directory of .pub files"},
        {"debug-step-delay-ms", CONFIG_INT, &set->debug_step_delay_ms, "0", 0, 10000,
         "testing only: sleep this long after every compute step"},
        {"log-level", CONFIG_STRING, &set->log_level, "info", 0, 0, "debug | info | warn | error"},
        {NULL, 0, NULL, NULL, 0, 0, NULL},
    };
    const char *program = default_role == PROTO_ROLE_DECODE ? "decode_worker" : "prefill_worker";
    int rc = config_load(table, program, argc, argv);
    if (rc != 0) {
        config_free(table);
        return rc == 1 ? 0 : 2;
    }
    rc = 2;
    rt.role = default_role;
    log_level_t level;
    if (set->role_name && *set->role_name && proto_role_parse(set->role_name, &rt.role) < 0) {
        fprintf(stderr, "%s: invalid --role '%s': want prefill, decode or mixed\n", program,
                set->role_name);
        goto out;
    }
    if (set->mtp_sampling && strcmp(set->mtp_sampling, "rejection") != 0 &&
        strcmp(set->mtp_sampling, "onehot") != 0) {
        fprintf(stderr, "%s: invalid --mtp-sampling '%s': want rejection or onehot\n", program,
                set->mtp_sampling);
        goto out;
    }
    if (log_level_parse(set->log_level, &level) < 0) {
        fprintf(stderr, "%s: invalid --log-level '%s'\n", program, set->log_level);
        goto out;
    }
    char log_role[32];
    snprintf(log_role, sizeof(log_role), "%s_worker", proto_role_str(rt.role));
    log_init(log_role, level);
    if (set->worker_id && *set->worker_id) {
        if (strlen(set->worker_id) >= PROTO_ID_LEN) {
            log_error("--worker-id is longer than %d bytes", PROTO_ID_LEN - 1);
            goto out;
        }
        snprintf(rt.wid, sizeof(rt.wid), "%s", set->worker_id);
    } else {
        char host[256] = "localhost";
        gethostname(host, sizeof(host) - 1);
        snprintf(rt.wid, sizeof(rt.wid), "%s-%.40s-%d", proto_role_str(rt.role), host,
                 (int)getpid());
    }
    rt.hb_ms = (int)set->heartbeat_ms;
    config_log(table);
    if (curve_settings(&rt) < 0)
        goto out; /* logged; rc 2: invalid settings */

    /* Signals go to the signalfd only: block them before any thread (zmq's) exists. */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    signal(SIGPIPE, SIG_IGN);
    if (sigprocmask(SIG_BLOCK, &mask, NULL) < 0 ||
        (rt.sigfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC)) < 0) {
        log_error("signalfd: %s", strerror(errno));
        rc = 1;
        goto out;
    }
    int crc = compute_setup(&rt.cp, set);
    if (crc < 0 || runtime_open(&rt) < 0) {
        rc = crc == -2 ? 2 : 1;
        runtime_close(&rt, 1);
        compute_teardown(&rt.cp);
        goto out;
    }
    log_info("worker %s (%s) up: gateway %s, pid %d", rt.wid, proto_role_str(rt.role), set->gateway,
             (int)getpid());
    rc = runtime_run(&rt);
    runtime_close(&rt, rc != 0);
    compute_teardown(&rt.cp); /* after the zmq context: queued frames point into the KV cache */
    log_info("exit %d", rc);
out:
    curve_authlist_destroy(&rt.curve_auth);
    memset(&rt.curve, 0, sizeof(rt.curve)); /* the secret key */
    if (rt.sigfd >= 0)
        close(rt.sigfd);
    config_free(table);
    return rc;
}
