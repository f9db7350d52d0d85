# The two entry points of the README: `make run` and `make test`.
CARGO ?= cargo
# Tests start real etcd clusters and replica processes; on a 2-core machine two at a time
# keeps lease timing honest.
TEST_THREADS ?= 2

.PHONY: deps build run test lint

deps:
	@./scripts/install-deps

build: deps
	$(CARGO) build --bin baton

run: build
	./target/debug/baton dev

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

test: lint
	$(CARGO) test -- --test-threads=$(TEST_THREADS)
