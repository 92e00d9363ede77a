/*
 * worker: the entry of the worker programs (prefill_worker, decode_worker). One process
 * runs the model in one of three roles:
 *   prefill: batches prompts, runs them through the model, streams each layer's KV to the
 *            decode worker named by the gateway (kvtransfer), samples the first token
 *            (prefill_worker/prefill.c);
 *   decode:  receives KV hand-offs and runs continuous batching with MTP2 draft-and-verify,
 *            and migrates running sequences when it changes role (decode_worker/decode.c);
 *   mixed:   both in one process; a PREFILL with an empty decode endpoint is decoded
 *            locally without a transfer.
 * The runtime (worker/runtime.h) drives the roles; the two programs differ only in their
 * default role, and either can be moved to the other role live (ROLE).
 *
 * One thread owns every socket, the model and the KV cache: a zmq_poll loop over the ctl
 * DEALER (to the gateway), the kv ROUTER (decode/mixed), the kv DEALERs (one per decode
 * endpoint) and a signalfd. See docs/protocol.md for the messages and docs/kvtransfer.md
 * for the hand-off.
 */
#ifndef TP_WORKER_H
#define TP_WORKER_H

#include "protocol.h"

/* Run a worker until it has drained after SIGTERM/SIGINT (returns 0), a second signal
 * (returns 1) or a start-up failure (returns 1 after logging the reason; 2 for invalid
 * settings). default_role is used unless --role overrides it. Settings come from argv,
 * TIDEPOOL_* environment variables and an optional config file (--help lists them);
 * `--help` prints the table and returns 0. Call once per process, from main(). */
int worker_main(proto_role_t default_role, int argc, char **argv);

#endif
