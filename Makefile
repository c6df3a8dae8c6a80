# The two commands of the README: `make demo` (set up the runtime, run a federation) and `make test` (set up
# the runtime, the test extras and checkov, then run the whole suite).
.PHONY: setup setup-test demo test
setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

demo: setup
	.venv/bin/fedmq simulate

test: setup-test
	bash scripts/ensure-rabbitmq.sh || [ -z "$${CI:-}" ]
	.venv/bin/python -m pytest -n 2 --dist loadgroup
