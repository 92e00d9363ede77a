# tidepool build. Everything goes under $(BUILD) (default build/; sanitized builds under
# build/san-<list>/). Targets: all, test, bench, clean, model.
#   make SANITIZER=address,undefined test
#   make BUILD=build-x            (a private build dir, e.g. for parallel work)

SANITIZER ?=
ifeq ($(SANITIZER),)
BUILD ?= build
else
BUILD ?= build/san-$(subst $(comma),-,$(SANITIZER))
endif
comma := ,

CC      ?= cc
PKGS    := libzmq msgpack libevent jansson libxxhash inih sqlite3
OPT     ?= -O2
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -g $(OPT) -Wall -Wextra -Werror -Wshadow \
               -Wno-unused-parameter -fno-strict-aliasing -pthread -I. -Icommon -Icommon/engine \
               -Ikvtransfer $(shell pkg-config --cflags $(PKGS))
LDLIBS_BASE := $(shell pkg-config --libs $(PKGS)) -lm -pthread
ifneq ($(SANITIZER),)
CFLAGS_BASE += -fsanitize=$(SANITIZER) -fno-omit-frame-pointer -fno-sanitize-recover=all
LDFLAGS_BASE += -fsanitize=$(SANITIZER)
endif
ALL_CFLAGS  := $(CFLAGS_BASE) $(CFLAGS)
ALL_LDFLAGS := $(LDFLAGS_BASE) $(LDFLAGS)

LIB_SRC  := $(wildcard common/*.c common/engine/*.c kvtransfer/*.c)
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
LIB      := $(BUILD)/libtidepool.a

PROGS    := gateway prefill_worker decode_worker
# each program folder: main.c plus its own modules (archived so tests can link them)
define prog_rules
$(1)_SRC := $$(filter-out $(1)/main.c,$$(wildcard $(1)/*.c))
$(1)_OBJ := $$($(1)_SRC:%.c=$(BUILD)/obj/%.o)
$(BUILD)/lib$(1).a: $$($(1)_OBJ)
	@mkdir -p $$(@D)
	rm -f $$@ && ar rcs $$@ $$^
$(BUILD)/bin/$(1): $(BUILD)/obj/$(1)/main.o $(BUILD)/lib$(1).a $(LIB)
	@mkdir -p $$(@D)
	$$(CC) $$(ALL_LDFLAGS) -o $$@ $$^ $$(LDLIBS_BASE)
endef
$(foreach p,$(PROGS),$(eval $(call prog_rules,$(p))))
PROG_LIBS := $(foreach p,$(PROGS),$(BUILD)/lib$(p).a)

TOOL_SRC := $(wildcard tools/tidepool-*.c)
TOOLS    := $(TOOL_SRC:tools/%.c=$(BUILD)/bin/%)

TEST_SRC := $(wildcard tests/unit/test_*.c)
TESTS    := $(TEST_SRC:tests/unit/%.c=$(BUILD)/tests/%)
BENCH_SRC := $(wildcard tests/bench/bench_*.c)
BENCHES  := $(BENCH_SRC:tests/bench/%.c=$(BUILD)/tests/%)

BINS := $(PROGS:%=$(BUILD)/bin/%) $(TOOLS)

.PHONY: all test unit integration bench clean model
# keep object files of pattern-rule chains (tools, tests)
.SECONDARY:
all: $(BINS) $(TESTS) model

# Rebuild everything when the flags change.
$(BUILD)/.flags: FORCE
	@mkdir -p $(@D)
	@echo '$(CC) $(ALL_CFLAGS) $(ALL_LDFLAGS)' | cmp -s - $@ || echo '$(CC) $(ALL_CFLAGS) $(ALL_LDFLAGS)' > $@
FORCE:

$(BUILD)/obj/%.o: %.c $(BUILD)/.flags
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -MMD -MP -c -o $@ $<

$(LIB): $(LIB_OBJ)
	@mkdir -p $(@D)
	rm -f $@ && ar rcs $@ $^

# Tools link the program archives too (tidepool-sim runs the gateway's own policy code).
$(BUILD)/bin/tidepool-%: $(BUILD)/obj/tools/tidepool-%.o $(PROG_LIBS) $(LIB)
	@mkdir -p $(@D)
	$(CC) $(ALL_LDFLAGS) -o $@ $^ $(LDLIBS_BASE) $(if $(filter %-top,$@),-lncursesw)

$(BUILD)/tests/test_%: $(BUILD)/obj/tests/unit/test_%.o $(PROG_LIBS) $(LIB)
	@mkdir -p $(@D)
	$(CC) $(ALL_LDFLAGS) -o $@ $< $(PROG_LIBS) $(LIB) $(LDLIBS_BASE) -lcmocka

$(BUILD)/tests/bench_%: $(BUILD)/obj/tests/bench/bench_%.o $(PROG_LIBS) $(LIB)
	@mkdir -p $(@D)
	$(CC) $(ALL_LDFLAGS) -o $@ $< $(PROG_LIBS) $(LIB) $(LDLIBS_BASE)

# The default model, converted from llama2.c format at set-up (never committed).
MODEL_DIR ?= ../shared/models/stories260K
MODEL_GGUF := build/models/stories260K.gguf
model: $(MODEL_GGUF)
$(MODEL_GGUF): $(BUILD)/bin/tidepool-convert
	@mkdir -p $(@D)
	$(BUILD)/bin/tidepool-convert --checkpoint $(MODEL_DIR)/stories260K.bin \
	    --tokenizer $(MODEL_DIR)/tok512.bin --name stories260K --out $@

test: all
	BUILD=$(BUILD) tests/run_tests.sh

bench: all $(BENCHES)
	BUILD=$(BUILD) tests/run_bench.sh

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
