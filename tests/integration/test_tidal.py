"""Live role changes: a prefill worker moves to decode by finishing its batch, a decode
worker moves to prefill by migrating its running sequences to other decode workers over
kvtransfer, under load, and no stream loses, repeats or alters a token (docs/scheduler.md
"Live role changes").

Real workers and the real model; --debug-step-delay-ms keeps the streams running while
the changes happen. The texts must equal the greedy references of test_e2e."""

import os
import signal
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402
from test_e2e import REF, wait_kv_free, worker_figures  # noqa: E402
from test_stats import Subscriber, metric, parse_metrics  # noqa: E402
from test_chunked import CHUNK, LONG, MAX_TOKENS, greedy  # noqa: E402


def set_role(c, wid, role):
    return c.request("POST", "/workers/%s/role" % wid, {"role": role})


def wait_roles(c, want, timeout=15):
    """Wait until /workers shows every worker of want {id: role} ready in that role."""
    deadline = time.time() + timeout
    figs = None
    while time.time() < deadline:
        figs = worker_figures(c)
        if all(figs.get(k, {}).get("role") == v and figs[k]["state"] == "ready"
               for k, v in want.items()):
            return figs
        time.sleep(0.05)
    raise AssertionError("roles not reached: want %r, have %r" % (want, figs))


class RoleChange(unittest.TestCase):
    def run_streams(self, c, n, results):
        prompts = (list(REF) * n)[:n]

        def run(i):
            results[i] = (prompts[i], c.stream_text(prompts[i], max_tokens=48))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        return threads

    def check_streams(self, threads, results):
        for t in threads:
            t.join(60)
        for i, r in enumerate(results):
            self.assertIsNotNone(r, "stream %d did not finish" % i)
            prompt, (status, text, events, done) = r
            self.assertEqual(status, 200, events)
            self.assertTrue(done, "stream %d must end with [DONE]" % i)
            self.assertEqual(text, REF[prompt], "stream %d" % i)
            self.assertEqual(events[-1]["choices"][0]["finish_reason"], "length")

    def test_role_changes_under_load(self):
        with Cluster(roles=("prefill", "decode", "decode"),
                     worker_args=["--debug-step-delay-ms", "40"]) as c:
            wait_roles(c, {"prefill-0": "prefill", "decode-1": "decode", "decode-2": "decode"})
            sub = Subscriber(c.stats)
            self.addCleanup(sub.close)
            # the endpoint's errors first (OpenAI-style bodies)
            status, body = set_role(c, "prefill-0", "decode")
            self.assertEqual(status, 409, body)  # the last prefill worker
            self.assertEqual(body["error"]["code"], "role_change_refused")
            status, body = set_role(c, "nobody", "decode")
            self.assertEqual(status, 404, body)
            status, body = c.request("POST", "/workers/decode-1/role", {"role": "mixed"})
            self.assertEqual(status, 400, body)
            for raw in (b'{"role": "decode", "role": "prefill"}', b"prefill", b'{"role": '):
                status, body = c.request("POST", "/workers/decode-1/role", raw=raw)
                self.assertEqual((status, body["error"]["code"]), (400, "invalid_json"), raw)
            status, body = set_role(c, "decode-1", "decode")
            self.assertEqual(status, 409, body)  # already decode
            status, body = c.request("GET", "/workers/decode-1/role")
            self.assertEqual(status, 405, body)

            # 12 greedy streams; both directions change while they run
            results = [None] * 12
            threads = self.run_streams(c, 12, results)
            time.sleep(0.3)
            status, body = set_role(c, "decode-1", "prefill")
            self.assertEqual(status, 202, body)
            self.assertEqual(body["status"], "changing")
            status, body = set_role(c, "decode-2", "prefill")
            self.assertEqual(status, 409, body)  # would leave no decode worker
            self.assertIn("last decode", body["error"]["message"])
            status, body = set_role(c, "prefill-0", "decode")
            self.assertEqual(status, 202, body)  # decode-1 is becoming prefill
            status, body = set_role(c, "prefill-0", "decode")
            self.assertEqual(status, 409, body)  # already changing
            self.check_streams(threads, results)
            figs = wait_roles(c, {"prefill-0": "decode", "decode-1": "prefill",
                                  "decode-2": "decode"})
            self.assertTrue(figs["prefill-0"]["kv_endpoint"].startswith("tcp://"))
            self.assertEqual(figs["decode-1"]["kv_endpoint"], "")
            # decode-1 had running sequences when ordered: it migrated them to decode-2 (the
            # only other decode worker ready then) instead of decoding them to the end
            deadline = time.time() + 5
            while time.time() < deadline and "migrated_out" not in figs["decode-1"]:
                time.sleep(0.1)
                figs = worker_figures(c)
            d1, d2 = figs["decode-1"], figs["decode-2"]
            self.assertGreaterEqual(d1.get("migrated_out", 0), 1, d1)
            self.assertEqual(d1["migrations_failed"], 0, d1)
            self.assertEqual(d2.get("migrated_in"), d1["migrated_out"], d2)
            self.assertLess(d1["last_role_change_ms"], 40 * 48, d1)  # far below a drain

            # the new roles serve, and change back while streams run
            results = [None] * 12
            threads = self.run_streams(c, 12, results)
            time.sleep(0.3)
            status, body = set_role(c, "prefill-0", "prefill")
            self.assertEqual(status, 202, body)
            status, body = set_role(c, "decode-1", "decode")
            self.assertEqual(status, 202, body)
            self.check_streams(threads, results)
            figs = wait_roles(c, {"prefill-0": "prefill", "decode-1": "decode"})
            # the workers report the change's latency in their heartbeats
            deadline = time.time() + 5
            while time.time() < deadline and figs["prefill-0"].get("role_changes") != 2:
                time.sleep(0.1)
                figs = worker_figures(c)
            self.assertEqual(figs["prefill-0"].get("role_changes"), 2, figs)
            self.assertGreater(figs["prefill-0"]["last_role_change_ms"], 0)
            # one last check that the cluster is whole
            status, body = c.complete("Once upon a time", max_tokens=48)
            self.assertEqual(status, 200, body)
            self.assertEqual(body["choices"][0]["text"], REF["Once upon a time"])
            log = c.log("gateway")
            done = [ln for ln in log.splitlines() if "role change" in ln and "done in" in ln]
            self.assertEqual(len(done), 4, log[-3000:])
            # and the stats socket carries role_change events: ordered, then done in N ms
            sub.wait_event(lambda e: e.get("event") == "role_change" and e["worker"] == "decode-1"
                           and e["reason"] == "ordered by the operator")
            ev = sub.wait_event(lambda e: e.get("event") == "role_change"
                                and e["worker"] == "decode-1"
                                and e["reason"].startswith("done in "))
            self.assertGreater(float(ev["reason"].split()[2]), 0, ev)

    def test_decode_worker_migrates_long_streams(self):
        """A decode worker ordered to prefill while it runs long streams (160 tokens at 25 ms a
        step: 4 s each) moves them, with their MTP state, to the other decode worker and
        switches within a second; every stream goes on there and ends with exactly the text of
        an undisturbed run: greedy ones, and seeded sampled ones too (at a fixed MTP depth the
        draft schedule, hence the random stream, does not depend on where a step runs)."""
        with Cluster(roles=("prefill", "decode", "decode"),
                     worker_args=["--debug-step-delay-ms", "25", "--mtp-adaptive", "false"]) as c:
            wait_roles(c, {"prefill-0": "prefill", "decode-1": "decode", "decode-2": "decode"})
            prompts = list(REF)[:4]

            def params(i):
                # and with sampling controls: their counts move with the sequence (KV_BEGIN
                # "samp" and "tokens"; such a sequence decodes at depth 0)
                pen = {2: {"frequency_penalty": 0.8, "repetition_penalty": 1.2},
                       3: {"presence_penalty": 0.6, "logit_bias": {"432": -4}}}.get(i % 4, {})
                return dict({"temperature": 0.9, "seed": 100 + i} if i % 2 else {}, **pen)

            want = {i: c.complete(prompts[i % len(prompts)], max_tokens=160, **params(i))[1]
                    ["choices"][0]["text"] for i in range(8)}
            results = [None] * 8

            def run(i):
                results[i] = (i, c.stream_text(prompts[i % len(prompts)], max_tokens=160, **params(i)))

            threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            busy = None
            deadline = time.time() + 5
            while time.time() < deadline:
                figs = worker_figures(c)
                busy = next((k for k in ("decode-1", "decode-2") if figs[k]["running"] >= 2), None)
                if busy:
                    break
                time.sleep(0.05)
            self.assertIsNotNone(busy, "no decode worker got streams")
            other = "decode-2" if busy == "decode-1" else "decode-1"
            t0 = time.time()
            status, body = set_role(c, busy, "prefill")
            self.assertEqual(status, 202, body)
            figs = wait_roles(c, {busy: "prefill"}, timeout=5)
            switched_s = time.time() - t0
            self.assertTrue(any(t.is_alive() for t in threads), "the streams ended first")
            self.assertLess(switched_s, 1.5)
            for t in threads:
                t.join(60)
            for i, r in enumerate(results):
                self.assertIsNotNone(r, "stream %d did not finish" % i)
                k, (status, text, events, done) = r
                self.assertEqual((status, done), (200, True), events[-3:])
                self.assertEqual(text, want[k], "stream %d %r" % (i, params(i)))
            deadline = time.time() + 3
            while time.time() < deadline and figs[busy].get("migrated_out") is None:
                time.sleep(0.1)
                figs = worker_figures(c)
            self.assertGreaterEqual(figs[busy]["migrated_out"], 2, figs[busy])
            self.assertEqual(figs[busy]["migrations_failed"], 0, figs[busy])
            self.assertEqual(figs[other]["migrated_in"], figs[busy]["migrated_out"])
            self.assertIn("migrated to", c.log(busy))
            self.assertIn("with the MTP state", c.log(busy))
            # /metrics: the moves per worker and the role change (promtool runs in test_stats)
            conn = c.conn()
            conn.request("GET", "/metrics")
            samples = parse_metrics(conn.getresponse().read().decode())[0]
            conn.close()
            self.assertEqual(metric(samples, "tidepool_worker_migrations_total", worker=busy,
                                    direction="out", result="ok"), figs[busy]["migrated_out"])
            self.assertEqual(metric(samples, "tidepool_worker_migrations_total", worker=other,
                                    direction="in", result="ok"), figs[busy]["migrated_out"])
            self.assertEqual(metric(samples, "tidepool_role_changes_total"), 1)
            self.assertGreater(metric(samples, "tidepool_role_change_last_seconds"), 0)
            self.assertEqual(metric(samples, "tidepool_workers", role="decode",
                                    state="changing"), 0)

    def test_decode_to_prefill_switches_without_waiting(self):
        """A decode worker ordered to prefill while it decodes streams and while prompts bound
        for it still queue at the prefill worker (one prompt per batch, 40 ms a step) does not
        wait for any of them: the queued prompts send their KV to the new decode worker
        directly (MIGRATE to the prefill worker), the running sequences move, and the worker
        switches while those moves are still on their way, detaching its decode role once
        they are over. Every stream ends with exactly the undisturbed greedy text, no move
        fails and every KV block is free again afterwards."""
        with Cluster(roles=("prefill", "decode", "decode"),
                     worker_args=["--debug-step-delay-ms", "40", "--mtp-adaptive", "false",
                                  "--max-batch-tokens", "8"]) as c:
            wait_roles(c, {"prefill-0": "prefill", "decode-1": "decode", "decode-2": "decode"})
            base = {k: w["kv_blocks_total"] for k, w in worker_figures(c).items()}
            results = [None] * 24
            threads = self.run_streams(c, 24, results)
            busy = None
            deadline = time.time() + 5
            while time.time() < deadline and busy is None:
                figs = worker_figures(c)
                busy = next((k for k in ("decode-1", "decode-2") if figs[k]["running"] >= 1),
                            None)
                time.sleep(0.02)
            self.assertIsNotNone(busy, "no decode worker got streams")
            status, body = set_role(c, busy, "prefill")
            self.assertEqual(status, 202, body)
            figs = wait_roles(c, {busy: "prefill"}, timeout=5)
            self.assertTrue(any(t.is_alive() for t in threads), "the streams ended first")
            self.check_streams(threads, results)
            log = c.log(busy)
            self.assertIn("moved on in the background", log)
            # the prompts still queued for it went to the other decode worker directly
            self.assertIn("decode worker changed before the prefill started", c.log("prefill-0"))
            deadline = time.time() + 5
            while time.time() < deadline and "decode role detached" not in c.log(busy):
                time.sleep(0.1)
            self.assertIn("decode role detached", c.log(busy))
            figs = wait_kv_free(c, base)
            self.assertEqual(figs[busy].get("migrations_failed"), 0, figs[busy])
            self.assertGreaterEqual(figs[busy]["migrated_out"], 1, figs[busy])
            # it serves as a prefill worker now
            self.assertEqual(greedy(c, next(iter(REF)), 48)[0], REF[next(iter(REF))])

    def test_no_room_elsewhere_reruns_instead_of_waiting(self):
        """Both decode workers full (--max-seqs 2, 4 streams): the one ordered to prefill has
        nowhere to move its sequences, so the gateway re-runs them from their tokens so far
        (as for a preemption) instead of letting the change wait until they finish; every
        stream still ends with exactly the undisturbed greedy text, and KV is all free after."""
        with Cluster(roles=("prefill", "decode", "decode"),
                     worker_args=["--debug-step-delay-ms", "40", "--max-seqs", "2"]) as c:
            wait_roles(c, {"prefill-0": "prefill", "decode-1": "decode", "decode-2": "decode"})
            base = {k: w["kv_blocks_total"] for k, w in worker_figures(c).items()}
            results = [None] * 4
            threads = self.run_streams(c, 4, results)
            deadline = time.time() + 5
            figs = {}
            while time.time() < deadline:
                figs = worker_figures(c)
                if figs["decode-1"]["running"] == 2 and figs["decode-2"]["running"] == 2:
                    break
                time.sleep(0.02)
            self.assertEqual((figs["decode-1"]["running"], figs["decode-2"]["running"]), (2, 2))
            status, body = set_role(c, "decode-1", "prefill")
            self.assertEqual(status, 202, body)
            wait_roles(c, {"decode-1": "prefill"}, timeout=5)
            self.assertTrue(any(t.is_alive() for t in threads), "the streams ended first")
            self.check_streams(threads, results)
            gw = c.log("gateway")
            self.assertIn("(0 sequences migrating, 2 re-run: no room elsewhere)", gw)
            self.assertIn("no other decode worker has room for it now", gw)
            wait_kv_free(c, base)

    def test_failed_migration_loses_nothing(self):
        """The target of the moves is frozen (SIGSTOP) when a decode worker is ordered to
        prefill: the moves time out (lease 1 s), the target is declared dead, and every
        request is re-run from its tokens so far once a decode worker is back (SIGCONT): each
        stream still ends with exactly the undisturbed greedy text."""
        with Cluster(roles=("prefill", "decode", "decode"),
                     worker_args=["--debug-step-delay-ms", "25", "--lease-ms", "1000"]) as c:
            wait_roles(c, {"prefill-0": "prefill", "decode-1": "decode", "decode-2": "decode"})
            prompts = list(REF)[:3]
            want = {p: c.complete(p, max_tokens=120)[1]["choices"][0]["text"] for p in prompts}
            results = [None] * 6

            def run(i):
                p = prompts[i % len(prompts)]
                results[i] = (p, c.stream_text(p, max_tokens=120))

            threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            busy = None
            deadline = time.time() + 5
            while time.time() < deadline and busy is None:
                figs = worker_figures(c)
                busy = next((k for k in ("decode-1", "decode-2") if figs[k]["running"] >= 2), None)
                time.sleep(0.05)
            self.assertIsNotNone(busy, "no decode worker got streams")
            other = "decode-2" if busy == "decode-1" else "decode-1"
            c.procs[other].send_signal(signal.SIGSTOP)
            try:
                status, body = set_role(c, busy, "prefill")
                self.assertEqual(status, 202, body)
                time.sleep(2.5)
            finally:
                c.procs[other].send_signal(signal.SIGCONT)
            for t in threads:
                t.join(60)
            for i, r in enumerate(results):
                self.assertIsNotNone(r, "stream %d did not finish" % i)
                p, (status, text, events, done) = r
                self.assertEqual((status, done), (200, True), events[-3:])
                self.assertEqual(text, want[p], "stream %d" % i)
            self.assertIn("migrating to", c.log(busy))
            self.assertIn("retrying", c.log("gateway"))

    def test_prefill_worker_finishes_its_prompt_then_switches(self):
        """A prefill worker ordered to decode mid-prompt (chunks of 7 tokens) computes the
        rest of the prompt and hands its KV over before it switches."""
        with Cluster(roles=("prefill", "prefill", "decode"),
                     worker_args=CHUNK + ["--debug-step-delay-ms", "100", "--log-level",
                                          "debug"]) as c:
            # (13 chunks 100 ms apart: a window of over a second for the order to come
            # mid-prompt even on a loaded host under the sanitizers; 40 ms was missed once)
            wait_roles(c, {"prefill-0": "prefill", "prefill-1": "prefill", "decode-2": "decode"})
            want, n_prompt = greedy(c)  # the same text as unchunked (test_chunked)
            result = {}
            t = threading.Thread(target=lambda: result.update(
                r=c.stream_text(LONG, max_tokens=MAX_TOKENS)))
            t.start()
            busy = None
            deadline = time.time() + 5
            while busy is None and time.time() < deadline:
                busy = next((k for k, w in worker_figures(c).items()
                             if w["role"] == "prefill" and w["assigned"] > 0), None)
            self.assertIsNotNone(busy, "the long prompt was never assigned")
            status, body = set_role(c, busy, "decode")
            self.assertEqual(status, 202, body)
            t.join(30)
            status, text, events, done = result["r"]
            self.assertEqual((status, done, text), (200, True, want))
            wait_roles(c, {busy: "decode"})
            log = c.log(busy).splitlines()
            last_chunk = max(i for i, ln in enumerate(log)
                             if "prefill chunk [" in ln and ", %d) of" % n_prompt in ln)
            switched = next(i for i, ln in enumerate(log) if "role changed prefill -> decode" in ln)
            ordered = next(i for i, ln in enumerate(log) if "role change prefill -> decode" in ln)
            self.assertLess(ordered, last_chunk, "the order came mid-prompt")
            self.assertLess(last_chunk, switched)
            # and it decodes now: a request lands on it or on decode-2, both serve
            self.assertEqual(greedy(c, next(iter(REF)), 48)[0], REF[next(iter(REF))])

    def test_tidal_policy_moves_a_worker(self):
        """--tidal: a decode shortage (1 decode worker of 2 sequences, 12 streams) makes the
        policy move a prefill worker to decode, by draining; the streams stay exact."""
        with Cluster(roles=("prefill", "prefill", "decode"),
                     gateway_args=["--tidal", "--tidal-min-role-s", "0", "--smooth-s", "0.3"],
                     worker_args=["--debug-step-delay-ms", "20", "--max-seqs", "2"]) as c:
            wait_roles(c, {"prefill-0": "prefill", "prefill-1": "prefill", "decode-2": "decode"})
            results = [None] * 12
            threads = self.run_streams(c, 12, results)
            self.check_streams(threads, results)
            figs = worker_figures(c)
            roles = sorted(w["role"] for w in figs.values())
            self.assertEqual(roles, ["decode", "decode", "prefill"], figs)
            self.assertIn("ordered by the tidal policy", c.log("gateway"))


class Failover(unittest.TestCase):
    def test_role_change_outlives_a_crash(self):
        """A worker moved to decode crashes and comes back in the role it was launched with
        (as the launcher, compose and Kubernetes restart it): the gateway orders it back to
        decode. Before: the crash undid the change and, with the other decode worker moved
        to prefill, left no decode worker at all (a fresh-user trial)."""
        with Cluster(roles=("prefill", "prefill", "decode")) as c:
            wait_roles(c, {"prefill-0": "prefill", "prefill-1": "prefill",
                           "decode-2": "decode"})
            self.assertEqual(set_role(c, "prefill-1", "decode")[0], 202)
            wait_roles(c, {"prefill-1": "decode"})
            self.assertEqual(set_role(c, "decode-2", "prefill")[0], 202)
            wait_roles(c, {"decode-2": "prefill"})
            c.kill("prefill-1")
            c.start_worker("prefill-1", "prefill")  # its launch role again
            deadline = time.time() + 30
            while "restoring the role it was ordered to, decode" not in c.log("gateway"):
                self.assertLess(time.time(), deadline, c.log("gateway")[-3000:])
                time.sleep(0.05)
            wait_roles(c, {"prefill-0": "prefill", "prefill-1": "decode",
                           "decode-2": "prefill"}, timeout=30)
            c.wait_healthy()
            prompt = next(iter(REF))
            status, text, _, done = c.stream_text(prompt, max_tokens=48)
            self.assertEqual((status, done, text), (200, True, REF[prompt]))

    def test_killed_decode_worker_seeded_stream_continues_exactly(self):
        """A decode worker SIGKILLed mid-stream: the gateway re-runs its requests elsewhere
        from their tokens so far and from the sampler state the workers reported with them
        (TOKENS "rng"), so a seeded sampled stream (plain decoding) ends with exactly the
        text of an undisturbed run, like a greedy one; penalised ones too (their counts come
        from the prompt plus the tokens so far, which the re-run carries)."""
        with Cluster(roles=("prefill", "decode", "decode"),
                     worker_args=["--debug-step-delay-ms", "25"]) as c:
            wait_roles(c, {"prefill-0": "prefill", "decode-1": "decode", "decode-2": "decode"})
            prompt = next(iter(REF))
            kinds = [{"temperature": 0.9, "seed": 7, "mtp_depth": 0},
                     {"temperature": 0.8, "seed": 11, "top_p": 0.9, "mtp_depth": 0}, {},
                     # sampling controls: the re-run counts the tokens generated before
                     {"frequency_penalty": 0.8, "presence_penalty": 0.4,
                      "repetition_penalty": 1.2, "logit_bias": {"432": -3}},
                     {"temperature": 0.9, "seed": 5, "frequency_penalty": 0.5,
                      "min_tokens": 110, "stop_token_ids": [2, 13]}]
            want = [c.complete(prompt, max_tokens=120, **k)[1]["choices"][0]["text"]
                    for k in kinds]
            results = [None] * len(kinds)

            def run(i):
                results[i] = c.stream_text(prompt, max_tokens=120, **kinds[i])

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(kinds))]
            for t in threads:
                t.start()
            victim = None
            deadline = time.time() + 5
            while victim is None and time.time() < deadline:
                figs = worker_figures(c)
                victim = next((k for k in ("decode-1", "decode-2") if figs[k]["running"] >= 1),
                              None)
                time.sleep(0.05)
            self.assertIsNotNone(victim)
            time.sleep(0.5)  # a few dozen tokens in
            c.kill(victim)
            for t in threads:
                t.join(60)
            for i, r in enumerate(results):
                self.assertIsNotNone(r, "stream %d did not finish" % i)
                status, text, events, done = r
                self.assertEqual((status, done), (200, True), events[-3:])
                self.assertEqual(text, want[i], "stream %d %r" % (i, kinds[i]))
            self.assertIn("retrying", c.log("gateway"))


class Emulated(unittest.TestCase):
    def test_emulated_workers_serve_with_model_timings(self):
        """4 emulated workers (a100-llama3-8b): real tokens, the cost model's step times."""
        with Cluster(roles=("prefill", "prefill", "decode", "decode"),
                     worker_args=["--emulate", "a100-llama3-8b"]) as c:
            wait_roles(c, {"prefill-0": "prefill", "prefill-1": "prefill",
                           "decode-2": "decode", "decode-3": "decode"})
            figs = worker_figures(c)
            self.assertTrue(all(w.get("emulated") for w in figs.values()), figs)
            for name in figs:
                self.assertIn("EMULATED accelerator 'a100-llama3-8b'", c.log(name))
            t0 = time.time()
            status, body = c.complete("Once upon a time", max_tokens=48)
            elapsed = time.time() - t0
            self.assertEqual(status, 200, body)
            self.assertEqual(body["choices"][0]["text"], REF["Once upon a time"])
            # 47 decode steps of an 8B bf16 model on an A100 read 16 GB of weights each: at
            # least 7.8 ms per step at full memory bandwidth (the cost model adds MBU and
            # overhead); the small real model alone takes well under 1 ms per step
            self.assertGreater(elapsed, 47 * 0.0078, elapsed)
            self.assertLess(elapsed, 5.0, elapsed)
            # concurrent streams batch: 8 at once take far less than 8 times one
            results = [None] * 8
            threads = RoleChange.run_streams(self, c, 8, results)
            t0 = time.time()
            RoleChange.check_streams(self, threads, results)
            self.assertLess(time.time() - t0, 4 * elapsed)


if __name__ == "__main__":
    unittest.main()
