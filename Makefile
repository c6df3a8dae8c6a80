# The two commands of the README: `make demo` (set up, then run a federation) and `make test`.
.PHONY: setup demo test
setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/fedmq simulate

test: setup
	bash scripts/ensure-rabbitmq.sh || [ -z "$${CI:-}" ]
	.venv/bin/python -m pytest
