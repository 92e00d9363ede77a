/*
 * The shift workload of tidepool-sim (tools/sim/sim_workload.h), used to test the tidal
 * policy on a mix that changes over a day: the code share of the working day (the curve
 * of tools/bench/gen-trace.py, docs/workloads.md) at exact hours, and the generator's
 * draws following it (night vs working hours), seeded and deterministic.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "sim_workload.h"

/* 0.15 at night, a ramp 7-9 h, 0.75 9-17 h, a ramp down 17-22 h; a 240 s day. */
static void test_code_share_curve(void **state)
{
    (void)state;
    double day = 240, hour = day / 24;
    struct {
        double h, share;
    } pts[] = {{0, 0.15}, {6.99, 0.15}, {8, 0.45}, {9, 0.75}, {12, 0.75}, {16.99, 0.75},
               {19.5, 0.45}, {22, 0.15}, {23.5, 0.15}, {24, 0.15}, {33, 0.75}};
    for (size_t i = 0; i < sizeof(pts) / sizeof(pts[0]); i++) {
        double s = sim_workload_code_share(pts[i].h * hour, day);
        if (fabs(s - pts[i].share) > 1e-9)
            fail_msg("%.2f h: share %.4f, want %.4f", pts[i].h, s, pts[i].share);
    }
}

/* The generator: online requests of the code shape (prompt 500..2500, output 5..30) with
 * the share of the hour, else conversation (200..1800, 100..300); offline ones of the
 * offline shape. Night (0-7 h) about 15 % code, working hours about 75 %. */
static void test_shift_generator(void **state)
{
    (void)state;
    sim_workload_kind kind;
    assert_int_equal(sim_workload_kind_parse("shift", &kind), 0);
    assert_int_equal(kind, SIM_WORKLOAD_SHIFT);
    sim_workload w;
    sim_workload_steady(&w, kind, 200, 2400, 0.1, 5);
    double hour = 2400 / 24.0;
    int night = 0, night_code = 0, day = 0, day_code = 0, n = 0;
    sim_workload_arrival a;
    double last = 0;
    while (sim_workload_next(&w, &a)) {
        assert_true(a.arrival_s >= last && a.arrival_s < 2400);
        last = a.arrival_s;
        n++;
        if (a.offline) {
            assert_true(a.prompt >= 256 && a.prompt <= 768 && a.out >= 128 && a.out <= 384);
            continue;
        }
        int code = a.out <= 30;
        if (code)
            assert_true(a.prompt >= 500 && a.prompt <= 2500);
        else
            assert_true(a.prompt >= 200 && a.prompt <= 1800 && a.out >= 100 && a.out <= 300);
        double h = a.arrival_s / hour;
        if (h < 7)
            night++, night_code += code;
        else if (h >= 9 && h < 17)
            day++, day_code += code;
    }
    assert_true(n > 400000);
    double sn = (double)night_code / night, sd = (double)day_code / day;
    print_message("night %.3f code (%d), working hours %.3f (%d)\n", sn, night, sd, day);
    assert_true(fabs(sn - 0.15) < 0.01);
    assert_true(fabs(sd - 0.75) < 0.01);
    /* seeded: the same seed gives the same first arrival */
    sim_workload w2, w3;
    sim_workload_steady(&w2, kind, 200, 2400, 0.1, 5);
    sim_workload_steady(&w3, kind, 200, 2400, 0.1, 5);
    sim_workload_arrival a2, a3;
    assert_int_equal(sim_workload_next(&w2, &a2), 1);
    assert_int_equal(sim_workload_next(&w3, &a3), 1);
    assert_true(a2.arrival_s == a3.arrival_s);
    assert_int_equal(a2.prompt, a3.prompt);
    assert_int_equal(a2.out, a3.out);
    assert_int_equal(a2.offline, a3.offline);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_code_share_curve),
        cmocka_unit_test(test_shift_generator),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("policy_workload", tests, NULL, NULL);
}
