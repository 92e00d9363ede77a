/*
 * compute: a worker process's compute state, shared by the roles it runs: the model
 * (mmapped GGUF), the paged KV cache (its main layers, then one layer per MTP module), the
 * forward pass's context and threads, the sampler, the MTP modules with the
 * draft-and-verify state (specdec) and its cost measurement, and the emulated-accelerator
 * mode (--emulate).
 *
 * One per process, set up once at start-up: a role change keeps it (the KV cache and the
 * model stay; only the role states change). A mixed worker's two roles use the same KV
 * cache, so a local hand-off passes a sequence id.
 *
 * Emulated-accelerator mode (--emulate PRESET, docs/scheduler.md "Emulated workers"): the
 * worker runs the real (small) model, so tokens, streaming, KV transfers and every socket
 * are real, and then pads each prefill batch and each decode step with a sleep up to the
 * time the cost model (common/costmodel.h) gives for the emulated accelerator and model. A
 * step that already took longer is not padded. MTP is off in this mode (the cost model
 * emits one token per sequence per step). KV transfers are padded with zeros to the
 * emulated model's bytes (compute_kv_pad_bytes_per_token). Figures from an emulated worker
 * are emulated, never measurements: the worker says so at start (a WARN line), in REGISTER
 * and HEARTBEAT ("emu" = 1).
 */
#ifndef TP_COMPUTE_H
#define TP_COMPUTE_H

#include <stdint.h>

#include "costmodel.h"
#include "kvcache.h"
#include "model.h"
#include "mtp.h"
#include "sampler.h"
#include "settings.h"
#include "specdec.h"

typedef struct {
    model_t *model;
    const model_config *mc;
    model_ctx_t *mctx;
    kvcache_t *kv;
    sampler_t *sampler;
    int max_items;  /* sequences per forward pass (= --max-seqs) */
    int max_tokens; /* tokens per forward pass (the context's scratch) */
    int block_size; /* tokens per KV block */
    /* MTP (docs/mtp.md): module k's K/V is KV layer mc->n_layer + k - 1 */
    mtp_t *mtp;             /* NULL: no modules */
    int n_mtp;              /* modules loaded */
    int mtp_depth;          /* the worker's depth (cap and default per request) */
    int mtp_adaptive;       /* lower a sequence's depth when it does not pay */
    specdec_t *sd;          /* always (plain decoding is its depth-0 path) */
    specdec_costs sd_costs; /* step cost by depth and batch size */
    float sd_prior[2];      /* acceptance each sequence's controller starts from */
    /* --emulate */
    int emu_on;
    int emu_kv_pad; /* --emulate-kv-pad: KV transfers padded to the emulated bytes */
    costmodel emu;
} worker_compute;

/* Set up *cp from the settings: the emulation preset, the model, the MTP modules (per
 * --mtp; before the KV cache, which gets one layer per module), the KV cache, the forward
 * context, the sampler and the draft-and-verify state with its verify-cost measurement.
 * Logs what it set up. Returns 0; -1 on a start-up failure (a bad file, out of memory;
 * logged; compute_teardown frees what was made); -2 on an invalid setting (logged). */
int compute_setup(worker_compute *cp, const worker_settings *set);
/* Free everything of *cp (takes a partly set-up one). */
void compute_teardown(worker_compute *cp);

/* The MTP depth a request gets: the worker's, lowered by the request's (mtp_req = depth +
 * 1, 0 = not set); 0 without modules. */
int compute_req_depth(const worker_compute *cp, int mtp_req);

/* --emulate: after the prefill batch b[0..m) that started at t0_us (proto_now_us), sleep
 * until the cost model's prefill time for it has passed. No-op unless emulated. */
void compute_pad_prefill(const worker_compute *cp, const model_seq_batch *b, int m, int64_t t0_us);
/* --emulate: the same after the decode step over items[0..n). */
void compute_pad_decode(const worker_compute *cp, const specdec_item *items, int n, int64_t t0_us);
/* The KV bytes per token of the emulated model (costmodel_kv_bytes_per_token), to which
 * the KV sender pads every transfer (kvx_sender_params.pad_to_bytes_per_token); 0 when not
 * emulated or with --emulate-kv-pad false (no padding). */
uint64_t compute_kv_pad_bytes_per_token(const worker_compute *cp);

#endif
