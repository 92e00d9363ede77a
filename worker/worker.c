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
         "KV cache blocks (0 = max-seqs full contexts)"},
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
        {"heartbeat-ms", CONFIG_INT, &set->heartbeat_ms, "500", 10, 3600000,
         "heartbeat interval until the gateway sets one"},
        {"lease-ms", CONFIG_INT, &set->lease_ms, "5000", 10, 3600000,
         "KV transfer lease: silence after which a transfer is aborted"},
        {"emulate", CONFIG_STRING, &set->emulate, "", 0, 0,
         "emulated accelerator: a cost-model preset (a100-llama3-8b, h100-llama3-8b; "
         "PRESET:dilate=K runs it K times slower): each prefill/decode step is padded to "
         "its time and each KV transfer to its bytes; tokens come from the real model; MTP "
         "off (docs/scheduler.md); \"\" = real compute"},
        {"health-file", CONFIG_STRING, &set->health_file, "", 0, 0,
         "file rewritten at every heartbeat with the worker's state (time_ms, registered, "
         "state, ...) for container health checks (deploy/container/tidepool-health); "
         "removed at exit; \"\" = none"},
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
    if (rt.sigfd >= 0)
        close(rt.sigfd);
    config_free(table);
    return rc;
}
