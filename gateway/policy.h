/*
 * policy: the tidal scheduling rule, a pure function from observed load figures to actions.
 *
 * Each call (one "tick", typically once per heartbeat interval) reads the workers' and the
 * cluster's figures and returns at most a few role changes {worker, new role} and the
 * offline admission (how many offline requests may run now, how many to preempt). The
 * rule (docs/scheduler.md has the full text and every default):
 *
 *   1. Pressures, 1.0 = "at the SLO's edge", from EWMA-smoothed signals (smooth_ms):
 *        prefill = max(queued prompt tokens / (n_prefill * prefill_tokens_per_s)
 *                        / (queue_budget * TTFT SLO),
 *                      online prompt-token arrival rate / (n_prefill * prefill_tokens_per_s),
 *                      max(TTFT p90, oldest gateway wait) / TTFT SLO)
 *        decode  = max(online decoding sequences / (n_decode * decode_seqs_per_worker),
 *                      KV use / kv_high * online share, TPOT p90 / TPOT SLO)
 *   1d. Decode's own sequences: with decode room reserved at dispatch, online decoding
 *      counts the requests whose prompt is still at a prefill worker (P of them) and those
 *      waiting for room (G). Where decode is the *gainer* of a move (2, 2d) its sequence
 *      load is its own instead: D = the sequences past their prefill, plus the part
 *      P * (1 - r) of the prompts' slots, r = prefill's load pressure (rates and queue,
 *      at most 1), plus the share (D + P(1 - r)) / (D + P) of the G waiting. More decode
 *      room lets more prompts into prefill, which computes them sooner only as far as
 *      it has spare capacity: a prompt burst on a busy prefill side fills the slots from
 *      dispatch on, and more decode workers would only lengthen its queue. Where decode
 *      is the donor, and in the estimate and offline admission, every held slot counts (a
 *      prompt burst must not let prefill take the decode room it holds).
 *   2. Move workers from role B to role A when pressure(A) >= act_pressure and
 *      pressure(A) > band * pressure(B after losing one worker); the candidates have been
 *      in their role min_role_ms; role B keeps min_per_role workers; the moves stay within
 *      the rate cap (changes in the last window_ms). How many: the estimate (2c) when it
 *      points the same way, else one at a time while the rule holds (re-projecting both
 *      pressures). Because the rule projects the donor's pressure after the move, the
 *      same load cannot ask for the reverse move (band >= 1): no flapping under steady
 *      load.
 *   2c. Estimate: the workers each role needs at pressure 1 from the load terms alone
 *      (prefill: prompt tokens/s over prefill_tokens_per_s, no backlog; decode: online
 *      sequences over decode_seqs_per_worker, requests/s times the output tokens of
 *      the requests that ended over decode_tokens_per_s, KV use; the token term also
 *      counts when decode is the donor in 2, never to make decode gain), and the split that
 *      brings the busier role to target_pressure, or to the pressure both would share
 *      when that is higher (the other role keeps the rest: slack for when the tide
 *      turns). Once the first warmup_ms of traffic is seen, the split moves to the
 *      estimate at once (start_from_estimate; only if a role's load pressure exceeds band
 *      times the other's), then only when the rule of 2 fires. Before warmup_ms the rule
 *      of 2 needs pressure 1 (not act_pressure): start-up transients move little.
 *   2d. Capacity (docs/scheduler.md "Capacity moves"): when the rule fires, the moves that
 *      bring the gainer's load pressure (rates only, one standard error 1/sqrt(n arrivals)
 *      below the measured rate) to 1 are not held back by the rate cap, as far as the
 *      donor keeps ceil(its load) workers, and decode beyond capacity by its sequences
 *      gains without the band while prefill stays within it (capacity_moves, with
 *      donor_guard); no move leaves the donor's
 *      load pressure above max(1, the gainer's after the move) (donor_guard); a capacity
 *      move reversing a change made before warmup_ms skips the guard of 2b (startup_fix).
 *      At the shared pressure the estimate (2c) rounds to the whole split with the lower
 *      of the two pressures. The rates start as the running mean since the traffic began
 *      (the call before the first that saw an online arrival), and warmup_ms counts from
 *      there too.
 *   2e. Start-up settle: before warmup_ms, a role that gained workers gains no more for
 *      smooth_ms (the signals' time constant) unless a capacity move (2d) asks for them
 *      (startup_settle): a start-up move is made once, not again a call or two later on a
 *      slightly longer view (each time migrating sequences the last move had moved).
 *   2b. Reversal guard: a move against the last change's direction also needs min_role_ms
 *      since that change and the rule asking for it call after call for a hold that is 0
 *      after a calm spell and doubles (from reverse_hold_ms) with every reversal made
 *      while the load keeps swinging: a tide that turns is answered at once, load that
 *      swings faster than min_role_ms stops moving the split after a few rounds.
 *   3. Offline: may run floor(max(0, offline_target - max(pressures)) * decode capacity)
 *      requests; online pressure >= preempt_pressure preempts the excess; an offline request
 *      waiting offline_max_wait_ms guarantees offline_aging_per_worker per decode worker
 *      while online pressure is below preempt_pressure (aging: never starved forever when
 *      online load is low).
 *
 * State kept between calls (smoothed signals, recent change times, the reversal guard)
 * lives in policy_state, owned by the caller: no globals, no clock, no I/O, no allocation.
 * Same inputs and state give the same outputs, so the gateway and tidepool-sim run the same
 * code. Thread-safe as long as a policy_state is used by one thread at a time.
 */
#ifndef TP_GW_POLICY_H
#define TP_GW_POLICY_H

#include <stddef.h>
#include <stdint.h>

#define POLICY_MAX_ACTIONS 4096    /* role changes returned by one call */
#define POLICY_MAX_HISTORY 1024    /* calls with changes remembered for the rate cap */
#define POLICY_MAX_REVERSE_LEVEL 8 /* reversal hold doubles at most this many times */

/* Same values as proto_role_t / proto_state_t (checked in policy.c). */
typedef enum {
    POLICY_ROLE_PREFILL = 1,
    POLICY_ROLE_DECODE = 2,
    POLICY_ROLE_MIXED = 3,
} policy_role_t;

typedef enum {
    POLICY_WORKER_READY = 1,
    POLICY_WORKER_DRAINING = 2, /* leaving (SIGTERM) or changing role */
    POLICY_WORKER_DOWN = 3,     /* not counted at all */
} policy_worker_state_t;

/* One worker's figures, as last reported. */
typedef struct {
    int index;                    /* caller's worker index, echoed in actions */
    int role;                     /* policy_role_t */
    int state;                    /* policy_worker_state_t */
    int changing;                 /* 1 while a role change is in progress */
    int target_role;              /* when changing: the role it is moving to */
    int64_t role_age_ms;          /* time since its current role began */
    int running;                  /* sequences running (decode) or prompts in flight (prefill) */
    int queued;                   /* prompts queued at the worker */
    int64_t queued_prompt_tokens; /* tokens of those prompts */
    int kv_blocks_used, kv_blocks_total;
    int decode_batch;   /* sequences in the last decode step */
    double ttft_p90_ms; /* recent, this worker's requests; <= 0 = unknown */
    double tpot_p90_ms; /* recent (or last step time); <= 0 = unknown */
} policy_worker;

/* Cluster-wide figures from the gateway. Online = interactive; offline = flex / batch. */
typedef struct {
    int64_t queued_prompt_tokens;  /* online prompts waiting for a prefill worker */
    int64_t oldest_wait_ms;        /* how long the oldest of them has waited */
    int online_queued;             /* online requests waiting for a prefill worker */
    int online_running;            /* online requests admitted (prefill .. finish) */
    int online_decoding;           /* online sequences decoding or waiting for decode room */
    int online_prefilling;         /* of online_decoding: requests holding decode room (reserved
                                    * at dispatch) whose prompt is still queued at or computed
                                    * by a prefill worker; 0 = none or not reported */
    int online_wait_room;          /* of online_decoding: requests waiting for decode room
                                    * before their prefill (at the gateway); 0 = none or not
                                    * reported */
    int64_t prompt_tokens_arrived; /* counter: online prompt tokens ever admitted */
    int64_t online_arrived;        /* counter: online requests ever admitted */
    int64_t online_done;           /* counter: online requests that ended ... */
    int64_t output_tokens_done;    /* ... and their output tokens (usage.completion_tokens);
                                    * these three 0 = not reported */
    int offline_queued, offline_running;
    int64_t offline_oldest_wait_ms;
    double ttft_p90_ms; /* recent online p90 over the cluster; <= 0 = unknown */
    double tpot_p90_ms; /* recent online p90 over the cluster; <= 0 = unknown */
} policy_cluster;

typedef struct {
    int64_t now_ms;               /* monotonic time of this call (ms) */
    const policy_worker *workers; /* (n_workers,), borrowed */
    int n_workers;
    policy_cluster cluster;
} policy_input;

/* Every knob; defaults in policy_default_params() and docs/scheduler.md. */
typedef struct {
    /* targets */
    double ttft_slo_ms; /* time to first token target */
    double tpot_slo_ms; /* time per output token target */
    /* capacity estimates (from costmodel or measurement) */
    double prefill_tokens_per_s;   /* prompt tokens one prefill worker computes per second */
    double decode_seqs_per_worker; /* sequences one decode worker runs within the TPOT SLO */
    double decode_tokens_per_s;    /* output tokens/s one decode worker emits within the TPOT
                                    * SLO (decode_seqs_per_worker / step time); 0 = unknown:
                                    * the decode load is the sequence count alone */
    double queue_budget;           /* share of the TTFT SLO a prompt may spend queued */
    double kv_high;                /* KV use fraction counted as "full" */
    /* smoothing and hysteresis */
    int64_t smooth_ms;       /* EWMA time constant of every signal */
    double act_pressure;     /* the pressured role must reach this to gain a worker */
    double band;             /* ... and exceed the donor's projected pressure by this */
    int64_t min_role_ms;     /* a worker stays at least this long in a role, and the
                              * split does not reverse direction sooner than this */
    int64_t reverse_hold_ms; /* ... nor, after a recent reversal, before the rule asked
                              * for it this long (doubling per recent reversal) */
    int max_changes;         /* role changes allowed per window (0 = none) ... */
    double max_change_frac;  /* ... or this share of the workers, if larger */
    int64_t window_ms;       /* the rate cap's sliding window */
    int min_per_role;        /* workers that always stay prefill-capable and decode-capable */
    double target_pressure;  /* the estimate brings a busy role to this pressure (or to
                              * the pressure both roles would share, if higher) */
    int64_t warmup_ms;       /* the first window of traffic: before it no estimate, and only
                              * pressure >= 1 moves a worker */
    int start_from_estimate; /* 1: after warmup_ms, move to the estimated split
                              * even below act_pressure (once); 0: only when the rule fires */
    int capacity_moves;      /* 1: moves that bring the gaining role's load pressure to 1
                              * (the donor's staying within capacity) exceed the rate cap */
    int startup_fix;         /* 1: a capacity move may reverse a change made before
                              * warmup_ms at once (no reversal guard) */
    int donor_guard;         /* 1: no move leaves the donor's load pressure above 1 (or the
                              * gainer's, if higher) */
    int startup_settle;      /* 1: before warmup_ms, a role that gained workers gains no
                              * more for smooth_ms but by a capacity move (2e) */
    /* offline admission */
    double offline_target;        /* offline fills capacity up to this online pressure */
    double preempt_pressure;      /* online pressure that preempts offline work */
    int64_t offline_max_wait_ms;  /* aging: an offline request waiting this long ... */
    int offline_aging_per_worker; /* ... guarantees this many offline slots per decode worker */
} policy_params;

/* The smoothed load signals (one EWMA each). */
typedef struct {
    double queued_tokens;    /* online prompt tokens waiting for prefill */
    double oldest_wait_ms;   /* oldest of them */
    double prompt_rate;      /* online prompt tokens arriving per second */
    double arrival_rate;     /* online requests arriving per second */
    double out_per_req;      /* output tokens per ended online request (0 = none yet) */
    double ttft_ms, tpot_ms; /* p90s, 0 when unknown */
    double decoding;         /* online sequences decoding or waiting for decode room */
    double prefilling;       /* of them, holding decode room before their prefill ended */
    double wait_room;        /* of them, waiting for decode room (1d) */
    double kv_frac;          /* KV use fraction of decode-capable workers, online share */
} policy_signals;

/* Between calls; initialize with policy_state_init, then only the policy writes it. */
typedef struct {
    int initialized;
    int64_t n_calls; /* successful policy_decide calls */
    int64_t last_ms;
    int64_t first_ms;           /* the first call's time */
    int traffic_seen;           /* online work has arrived since the first call ... */
    int64_t traffic_ms;         /* ... after the call at this time (its start) */
    int64_t last_prompt_tokens; /* cluster counters at the previous call */
    int64_t last_output_tokens, last_arrived, last_done;
    int64_t first_arrived;      /* online_arrived at the first call */
    int rates_seeded;           /* the rates hold a first sample */
    int est_started;            /* the start-up estimate was applied (or not needed) */
    policy_signals sig;         /* EWMA, time constant smooth_ms */
    int last_dir;               /* role gained by the last change (0 = none yet) */
    int64_t last_change_ms;
    int reverse_holding;      /* the rule asks for the opposite direction ... */
    int64_t reverse_since_ms; /* ... since then, call after call */
    int reverse_level;        /* recent reversals (decays by one per calm spell) */
    int64_t last_ask_end_ms;  /* when the last run of reversal asks ended */
    /* recent calls that changed roles (ring: time, changes), for the rate cap */
    int64_t change_ms[POLICY_MAX_HISTORY];
    int change_n[POLICY_MAX_HISTORY];
    int n_hist, hist_head;
    int recent; /* changes in the ring */
    int64_t n_changes; /* role changes decided since init */
} policy_state;

typedef struct {
    int worker; /* policy_worker.index */
    int role;   /* policy_role_t to move to */
} policy_action;

typedef struct {
    policy_action actions[POLICY_MAX_ACTIONS];
    int n_actions;
    int offline_max_running; /* offline requests that may be running now */
    int offline_preempt;     /* offline requests to preempt now (0 = none) */
    /* diagnostics (after this call's actions are projected) */
    double prefill_pressure, decode_pressure;
    int n_prefill, n_decode; /* prefill-capable / decode-capable workers after the actions */
    double est_prefill_workers, est_decode_workers; /* load in workers at pressure 1 (2c) */
    int est_prefill; /* the estimated split's prefill capacity (workers), -1 = none yet */
} policy_output;

/* Defaults for every knob (see docs/scheduler.md). */
policy_params policy_default_params(void);

/* 0 when every knob is in range, else -1 with a message naming the knob in err. */
int policy_params_check(const policy_params *p, char *err, size_t err_len);

/* Zero the state. The first policy_decide call seeds the smoothed signals and makes no
 * role change (one sample is not a trend); offline admission is decided from it. */
void policy_state_init(policy_state *st);

/* One decision. Reads p and in (borrowed), updates *st, writes *out. Role changes name
 * workers that are READY, not changing, and at least min_role_ms in their role; the caller
 * starts them (and reports changing = 1 with target_role until done). Time going
 * backwards is treated as no time passing. Returns 0, or -1 (out zeroed, state unchanged)
 * when p fails policy_params_check or in is malformed (n_workers < 0, workers NULL with
 * n_workers > 0, an unknown role or state). */
int policy_decide(const policy_params *p, policy_state *st, const policy_input *in,
                  policy_output *out);

#endif
