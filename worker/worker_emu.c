/*
 * worker_emu: emulated-accelerator mode (--emulate PRESET, docs/scheduler.md "Emulated
 * workers"). The worker runs the real (small) model, so tokens, streaming, KV transfers
 * and every socket are real, and then pads each prefill batch and each decode step with
 * a sleep up to the time the cost model (common/costmodel.h) gives for the emulated
 * accelerator and model: prefill by the batch's tokens and attention pairs, a decode step
 * by its batch size and total context. A step that already took longer than the model's
 * time is not padded. MTP drafting is off in this mode (the cost model emits one token
 * per sequence per step).
 *
 * Figures from an emulated worker are emulated, never measurements: the worker says so at
 * start (a WARN line), in REGISTER and HEARTBEAT ("emu" = 1), and the gateway shows it in
 * GET /workers ("emulated": true).
 *
 * KV transfers weigh what the emulated model's would: the sender sends the real small
 * model's KV (which the decode worker needs) plus zero padding, so that a transfer of n
 * tokens puts n x costmodel_kv_bytes_per_token() payload bytes on the wire (a100-llama3-8b:
 * 131072 per token), streamed with its layers (kvx_sender_params.pad_to_bytes_per_token,
 * docs/kvtransfer.md "Padding"), and the kv byte counters count them. The padding is
 * zero-copy from one read-only mapping of zeros. Not emulated: the link's speed (the bytes
 * take what the real network takes) and the KV cache's capacity (the real model's blocks).
 */
#include <errno.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "worker_internal.h"

int wemu_setup(worker_t *w)
{
    w->emu_on = 0;
    if (!w->emulate || !*w->emulate)
        return 0;
    if (costmodel_preset(w->emulate, &w->emu) < 0) {
        char names[256] = "";
        for (const char *const *n = costmodel_preset_names(); *n; n++) {
            strncat(names, names[0] ? ", " : "", sizeof(names) - strlen(names) - 1);
            strncat(names, *n, sizeof(names) - strlen(names) - 1);
        }
        log_error("--emulate '%s': unknown preset (presets: %s)", w->emulate, names);
        return -1;
    }
    w->emu_on = 1;
    log_warn("EMULATED accelerator '%s': prefill and decode times are the cost model's "
             "(sleeps), not measurements; tokens come from the real model; KV transfers are "
             "padded with zeros to the emulated model's %llu bytes per token (the KV cache "
             "holds the real model's)",
             w->emu.name, (unsigned long long)wemu_kv_bytes_per_token(w));
    return 0;
}

uint64_t wemu_kv_bytes_per_token(const worker_t *w)
{
    return w->emu_on ? (uint64_t)costmodel_kv_bytes_per_token(&w->emu) : 0;
}

/* Sleep until t0_us + ms (monotonic, proto_now_us). */
static void pad_until(int64_t t0_us, double ms)
{
    int64_t end = t0_us + (int64_t)(ms * 1000.0);
    for (;;) {
        int64_t left = end - proto_now_us();
        if (left <= 0)
            return;
        struct timespec ts = {.tv_sec = left / 1000000, .tv_nsec = (left % 1000000) * 1000};
        if (nanosleep(&ts, NULL) == 0)
            return;
        if (errno != EINTR)
            return;
    }
}

void wemu_pad_prefill(worker_t *w, int m, int64_t t0_us)
{
    if (!w->emu_on || m <= 0)
        return;
    double tokens = 0, pairs = 0;
    for (int i = 0; i < m; i++) {
        tokens += w->batch[i].n_tokens;
        pairs += costmodel_attn_pairs(w->batch[i].n_tokens, w->batch[i].pos);
    }
    pad_until(t0_us, costmodel_prefill_ms(&w->emu, tokens, pairs));
}

void wemu_pad_decode(worker_t *w, int n, int64_t t0_us)
{
    if (!w->emu_on || n <= 0)
        return;
    double ctx = 0;
    for (int i = 0; i < n; i++)
        ctx += w->sd_items[i].pos + 1;
    pad_until(t0_us, costmodel_decode_step_ms(&w->emu, n, ctx));
}
