# The two commands of the README: `make demo` (set up the runtime, run a federation) and `make test` (set up
# the runtime, the test extras and checkov, check style, then run the whole suite beside the type check).
.PHONY: setup setup-test demo style lint test images
setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

demo: setup
	.venv/bin/fedmq simulate

# ruff (lint and format) over the whole tree, mypy over the bottom layers and the strategies ([tool.mypy] in pyproject.toml)
style: setup-test
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

lint: style
	bash scripts/typecheck.sh

# ruff first (it takes a second); mypy (about 15 s) runs beside the suite, and a finding fails `make test` once
# the suite is done, with mypy's report. Three pytest workers on two cores: much of the suite waits (on process
# starts, RabbitMQ nodes, round deadlines), and a third worker fills those waits (tests/conftest.py)
test: style
	bash scripts/ensure-rabbitmq.sh || [ -z "$${CI:-}" ]
	mkdir -p build
	bash scripts/typecheck.sh > build/typecheck.log 2>&1 & types=$$!; \
	.venv/bin/python -m pytest -n 3 --dist loadgroup; tests=$$?; \
	if ! wait $$types; then cat build/typecheck.log; exit 1; fi; \
	tail -n 1 build/typecheck.log; exit $$tests

# The CPU and CUDA images (docker/), tagged $(IMAGE):<version>-cpu / -cuda. ENGINE=podman builds them with
# podman; IMAGE_FLAGS passes more build flags, e.g. --build-arg BASE_IMAGE=... and a package mirror
# (docs/deploy.md "Building the images").
ENGINE ?= docker
IMAGE ?= fedmq
IMAGE_FLAGS ?=
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
images:
	$(ENGINE) build $(IMAGE_FLAGS) -f docker/Dockerfile.cpu -t $(IMAGE):$(VERSION)-cpu .
	$(ENGINE) build $(IMAGE_FLAGS) -f docker/Dockerfile.cuda -t $(IMAGE):$(VERSION)-cuda .
