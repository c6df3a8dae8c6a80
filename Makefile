# The two commands of the README: `make demo` (set up the runtime, run a federation) and `make test` (set up
# the runtime, the test extras and checkov, check style and types, then run the whole suite).
.PHONY: setup setup-test demo lint test
setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

demo: setup
	.venv/bin/fedmq simulate

# ruff (lint and format) over the whole tree, mypy over the bottom layers and the strategies ([tool.mypy] in pyproject.toml)
lint: setup-test
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	bash scripts/typecheck.sh

test: lint
	bash scripts/ensure-rabbitmq.sh || [ -z "$${CI:-}" ]
	.venv/bin/python -m pytest -n 2 --dist loadgroup
