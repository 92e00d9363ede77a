# tidepool build. Everything goes under $(BUILD) (default build/; sanitized builds under
# build/san-<list>/). Targets: all, test, bench, clean, model, fuzz, fuzz-build, fuzz-seeds.
#   make SANITIZER=address,undefined test
#   make BUILD=build-x            (a private build dir, e.g. for parallel work)

SANITIZER ?=
ifeq ($(SANITIZER),)
BUILD ?= build
else
BUILD ?= build/san-$(subst $(comma),-,$(SANITIZER))
endif
comma := ,
space := $(empty) $(empty)
# plain `make` builds everything (the first rule below is an archive's, not all)
.DEFAULT_GOAL := all

CC      ?= cc
PKGS    := libzmq msgpack libevent jansson libxxhash inih sqlite3
OPT     ?= -O2
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -g $(OPT) -Wall -Wextra -Werror -Wshadow \
               -Wno-unused-parameter -fno-strict-aliasing -pthread \
               $(shell pkg-config --cflags $(PKGS))
LDLIBS_BASE := $(shell pkg-config --libs $(PKGS)) -lm -pthread
# libsodium: the gateway's API keys (gateway/auth.c hashes and compares them); linked by
# what links the gateway's archive (the gateway, the tools, the tests), not by the workers.
CFLAGS_BASE += $(shell pkg-config --cflags libsodium)
SODIUM_LIBS := $(shell pkg-config --libs libsodium)
ifneq ($(SANITIZER),)
CFLAGS_BASE += -fsanitize=$(SANITIZER) -fno-omit-frame-pointer -fno-sanitize-recover=all
LDFLAGS_BASE += -fsanitize=$(SANITIZER)
endif
# The libFuzzer build (make fuzz-build sets it, with CC=clang): coverage instrumentation
ifeq ($(FUZZING),1)
CFLAGS_BASE += -fsanitize=fuzzer-no-link
endif
ALL_CFLAGS  := $(CFLAGS_BASE) $(CFLAGS)
ALL_LDFLAGS := $(LDFLAGS_BASE) $(LDFLAGS)

# --- Layering (docs/architecture.md). Each folder compiles with the include paths of the
# folders it may use, and nothing else; tools/check-layers.py (run by make test) reads the
# same table and fails on any include that crosses it (relative paths, system headers that
# belong to another layer). A folder's own directory is always searchable.
#   folder          may include
LAYER_common         := common
LAYER_engine         := common common/engine
LAYER_transport      := common transport
LAYER_kvtransfer     := $(LAYER_engine) transport kvtransfer
LAYER_worker         := $(LAYER_kvtransfer) worker
LAYER_prefill_worker := $(LAYER_worker) prefill_worker
LAYER_decode_worker  := $(LAYER_worker) decode_worker
LAYER_gateway        := $(LAYER_engine) transport gateway
LAYER_trace          := common tools/trace
LAYER_bench          := common tools/trace tools/bench
LAYER_sim            := $(LAYER_engine) gateway tools/trace tools/sim
LAYER_tools          := $(LAYER_worker) tools tools/trace tools/bench tools/sim prefill_worker \
                        decode_worker gateway
LAYER_tests          := $(LAYER_worker) prefill_worker decode_worker gateway tools tools/trace \
                        tools/bench tools/sim
# folder -> layer (the longest matching folder wins: common/engine is the engine layer)
LAYERS := common:common common/engine:engine transport:transport kvtransfer:kvtransfer \
          worker:worker prefill_worker:prefill_worker decode_worker:decode_worker \
          gateway:gateway tools/trace:trace tools/bench:bench tools/sim:sim tools:tools \
          tests:tests
# "layer=dir,dir ..." for the checker
LAYER_SPEC := $(foreach l,common engine transport kvtransfer worker prefill_worker decode_worker \
                gateway trace bench sim tools tests,$(l)=$(subst $(space),$(comma),$(strip $(LAYER_$(l)))))
inc = $(addprefix -I,$(LAYER_$(1)))
$(BUILD)/obj/common/%.o:         INC = $(call inc,common)
$(BUILD)/obj/common/engine/%.o:  INC = $(call inc,engine)
$(BUILD)/obj/transport/%.o:      INC = $(call inc,transport)
$(BUILD)/obj/kvtransfer/%.o:     INC = $(call inc,kvtransfer)
$(BUILD)/obj/worker/%.o:         INC = $(call inc,worker)
$(BUILD)/obj/prefill_worker/%.o: INC = $(call inc,prefill_worker)
$(BUILD)/obj/decode_worker/%.o:  INC = $(call inc,decode_worker)
$(BUILD)/obj/gateway/%.o:        INC = $(call inc,gateway)
$(BUILD)/obj/tools/trace/%.o:    INC = $(call inc,trace)
$(BUILD)/obj/tools/bench/%.o:    INC = $(call inc,bench)
$(BUILD)/obj/tools/sim/%.o:      INC = $(call inc,sim)
$(BUILD)/obj/tools/%.o:          INC = $(call inc,tools)
$(BUILD)/obj/tests/%.o:          INC = $(call inc,tests)

# --- Archives, one per folder (main.c files excluded: they are the programs)
# name:sources
arch_src = $(filter-out %/main.c,$(wildcard $(1)/*.c))
A_common         := $(wildcard common/*.c common/engine/*.c)
A_transport      := $(call arch_src,transport)
A_kvtransfer     := $(call arch_src,kvtransfer)
A_worker         := $(call arch_src,worker)
A_prefill_worker := $(call arch_src,prefill_worker)
A_decode_worker  := $(call arch_src,decode_worker)
A_gateway        := $(call arch_src,gateway)
A_trace          := $(call arch_src,tools/trace)
A_bench          := $(call arch_src,tools/bench)
A_sim            := $(call arch_src,tools/sim)
ARCHIVES := common transport kvtransfer worker prefill_worker decode_worker gateway trace bench \
            sim
lib = $(BUILD)/lib$(1).a
define archive_rule
$(call lib,$(1)): $$(A_$(1):%.c=$(BUILD)/obj/%.o)
	@mkdir -p $$(@D)
	rm -f $$@ && ar rcs $$@ $$^
endef
$(foreach a,$(ARCHIVES),$(eval $(call archive_rule,$(a))))

# What each program links (in dependency order; the worker runtime and its two roles
# refer to each other, so they are one link group).
WORKER_LIBS  := -Wl,--start-group $(call lib,prefill_worker) $(call lib,decode_worker) \
                $(call lib,worker) -Wl,--end-group $(call lib,kvtransfer)
WORKER_DEPS  := $(foreach a,prefill_worker decode_worker worker kvtransfer transport common,$(call lib,$(a)))
GATEWAY_DEPS := $(foreach a,gateway transport common,$(call lib,$(a)))
ALL_DEPS     := $(foreach a,$(ARCHIVES),$(call lib,$(a)))
ALL_LIBS     := -Wl,--start-group $(ALL_DEPS) -Wl,--end-group

PROGS := gateway prefill_worker decode_worker
$(BUILD)/bin/gateway: $(BUILD)/obj/gateway/main.o $(GATEWAY_DEPS)
	@mkdir -p $(@D)
	$(CC) $(ALL_LDFLAGS) -o $@ $^ $(LDLIBS_BASE) $(SODIUM_LIBS)
$(BUILD)/bin/prefill_worker $(BUILD)/bin/decode_worker: $(BUILD)/bin/%: $(BUILD)/obj/%/main.o $(WORKER_DEPS)
	@mkdir -p $(@D)
	$(CC) $(ALL_LDFLAGS) -o $@ $< $(WORKER_LIBS) $(call lib,transport) $(call lib,common) $(LDLIBS_BASE)

TOOL_SRC := $(wildcard tools/tidepool-*.c)
TOOLS    := $(TOOL_SRC:tools/%.c=$(BUILD)/bin/%)

TEST_SRC := $(wildcard tests/unit/test_*.c)
TESTS    := $(TEST_SRC:tests/unit/%.c=$(BUILD)/tests/%)
BENCH_SRC := $(wildcard tests/bench/bench_*.c)
BENCHES  := $(BENCH_SRC:tests/bench/%.c=$(BUILD)/tests/%)

# Fuzzing harnesses (tests/fuzz/fuzz_<name>.c; docs/testing.md): each is linked twice, as a
# replay of its corpus and saved crashes with the normal compiler ($(BUILD)/tests/
# test_fuzz_<name>, run by make test) and, by make fuzz-build, as a libFuzzer binary
# ($(BUILD)/fuzz/bin/fuzz_<name>, clang).
FUZZ_SRC    := $(filter-out tests/fuzz/fuzz_common.c,$(wildcard tests/fuzz/fuzz_*.c))
FUZZ_NAMES  := $(FUZZ_SRC:tests/fuzz/fuzz_%.c=%)
FUZZ_REPLAY := $(FUZZ_NAMES:%=$(BUILD)/tests/test_fuzz_%)
FUZZ_COMMON := $(BUILD)/obj/tests/fuzz/fuzz_common.o
FUZZ_BUILD  := $(BUILD)/fuzz
FUZZ_SECONDS ?= 60

BINS := $(PROGS:%=$(BUILD)/bin/%) $(TOOLS)

.PHONY: all test unit integration bench clean model check-layers print-layers deploy-test netns-test \
        fuzz fuzz-build fuzz-harnesses fuzz-seeds
# keep object files of pattern-rule chains (tools, tests)
.SECONDARY:
all: $(BINS) $(TESTS) $(FUZZ_REPLAY) model

# Rebuild everything when the flags (or the layering table, which sets include paths) change.
$(BUILD)/.flags: FORCE
	@mkdir -p $(@D)
	@echo '$(CC) $(ALL_CFLAGS) $(ALL_LDFLAGS) $(LAYER_SPEC)' | cmp -s - $@ || \
	    echo '$(CC) $(ALL_CFLAGS) $(ALL_LDFLAGS) $(LAYER_SPEC)' > $@
FORCE:

$(BUILD)/obj/%.o: %.c $(BUILD)/.flags
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) $(INC) -MMD -MP -c -o $@ $<

# Tools and tests may use every archive (tidepool-sim runs the gateway's own policy code).
$(BUILD)/bin/tidepool-%: $(BUILD)/obj/tools/tidepool-%.o $(ALL_DEPS)
	@mkdir -p $(@D)
	$(CC) $(ALL_LDFLAGS) -o $@ $< $(ALL_LIBS) $(LDLIBS_BASE) $(SODIUM_LIBS) $(if $(filter %-top,$@),-lncursesw)

$(BUILD)/tests/test_%: $(BUILD)/obj/tests/unit/test_%.o $(ALL_DEPS)
	@mkdir -p $(@D)
	$(CC) $(ALL_LDFLAGS) -o $@ $< $(ALL_LIBS) $(LDLIBS_BASE) $(SODIUM_LIBS) -lcmocka

$(BUILD)/tests/bench_%: $(BUILD)/obj/tests/bench/bench_%.o $(ALL_DEPS)
	@mkdir -p $(@D)
	$(CC) $(ALL_LDFLAGS) -o $@ $< $(ALL_LIBS) $(LDLIBS_BASE) $(SODIUM_LIBS)

# --- Fuzzing (tests/fuzz/, docs/testing.md "Fuzzing")
$(BUILD)/tests/test_fuzz_%: $(BUILD)/obj/tests/fuzz/fuzz_%.o $(BUILD)/obj/tests/fuzz/replay_main.o \
                            $(FUZZ_COMMON) $(ALL_DEPS)
	@mkdir -p $(@D)
	$(CC) $(ALL_LDFLAGS) -o $@ $(filter %.o,$^) $(ALL_LIBS) $(LDLIBS_BASE)
$(BUILD)/tests/fuzz_make_seeds: $(BUILD)/obj/tests/fuzz/make_seeds.o $(FUZZ_COMMON) $(ALL_DEPS)
	@mkdir -p $(@D)
	$(CC) $(ALL_LDFLAGS) -o $@ $(filter %.o,$^) $(ALL_LIBS) $(LDLIBS_BASE)
$(BUILD)/bin/fuzz_%: $(BUILD)/obj/tests/fuzz/fuzz_%.o $(FUZZ_COMMON) $(ALL_DEPS)
	@mkdir -p $(@D)
	$(CC) $(ALL_LDFLAGS) -fsanitize=fuzzer -o $@ $(filter %.o,$^) $(ALL_LIBS) $(LDLIBS_BASE)
# (inside the fuzz build only)
fuzz-harnesses: $(FUZZ_NAMES:%=$(BUILD)/bin/fuzz_%)
# The libFuzzer binaries: clang, ASan + UBSan, coverage, in $(BUILD)/fuzz/.
fuzz-build:
	$(MAKE) BUILD=$(FUZZ_BUILD) CC=clang SANITIZER=address,undefined FUZZING=1 fuzz-harnesses
# Run each harness for FUZZ_SECONDS (FUZZ=name... picks some); fails on any crash, leak or
# sanitizer report. New inputs go to $(BUILD)/fuzz/corpus/, crash inputs to
# $(BUILD)/fuzz/artifacts/ (tests/fuzz/run.sh).
fuzz: fuzz-build model
	FUZZ_BIN=$(FUZZ_BUILD)/bin FUZZ_WORK=$(FUZZ_BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) \
	    tests/fuzz/run.sh $(FUZZ)
# Write the seed corpora again from the project's encoders (tests/fuzz/make_seeds.c).
fuzz-seeds: $(BUILD)/tests/fuzz_make_seeds
	$(BUILD)/tests/fuzz_make_seeds tests/fuzz/corpus

# The include-layering check alone (make test runs it too).
CHECK_LAYERS_ARGS = $(LAYERS:%=--folder %) $(LAYER_SPEC:%=--layer %)
check-layers:
	/usr/bin/python3 tools/check-layers.py $(CHECK_LAYERS_ARGS)
# The checker's arguments (tests/integration/test_layers.py runs it on planted trees).
print-layers:
	@echo $(CHECK_LAYERS_ARGS)
# The include flags of one layer (print-inc-common, print-inc-gateway, ...).
print-inc-%:
	@echo $(call inc,$*)

# The default model, converted from llama2.c format at set-up (never committed). Written
# beside and renamed into place: every build (plain, sanitized) converts it again with its
# own converter (same bytes), and .ci/run builds the sanitized tree while the plain tests
# have the file mapped.
MODEL_DIR ?= ../shared/models/stories260K
MODEL_GGUF := build/models/stories260K.gguf
model: $(MODEL_GGUF)
$(MODEL_GGUF): $(BUILD)/bin/tidepool-convert
	@mkdir -p $(@D)
	$(BUILD)/bin/tidepool-convert --checkpoint $(MODEL_DIR)/stories260K.bin \
	    --tokenizer $(MODEL_DIR)/tok512.bin --name stories260K --out $@.tmp$(notdir $(BUILD))
	mv -f $@.tmp$(notdir $(BUILD)) $@

test: all $(BENCHES)
	BUILD=$(BUILD) tests/run_tests.sh

# Container image, compose and Kubernetes manifests (podman as root; tools/install-deps.sh
# --deploy installs what they need): tests/deploy/run.sh. Not part of `make test`.
deploy-test: all
	tests/deploy/run.sh

# A multi-host cluster in network namespaces (root; faults: a link down, a host killed, the
# gateway partitioned): tests/netns/. Not part of `make test`.
netns-test: all
	BUILD=$(BUILD) tests/run_tests.sh --suite netns

bench: all $(BENCHES)
	BUILD=$(BUILD) tests/run_bench.sh

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
