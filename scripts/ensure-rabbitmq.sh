#!/usr/bin/env bash
# Make sure a RabbitMQ broker answers on 127.0.0.1:5672 (the test suite's shared broker).
# Starts it if it is installed but down; installs Debian's rabbitmq-server when missing and running as root.
set -uo pipefail
up() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }
up && exit 0
if ! command -v rabbitmq-server >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmq-server ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "ensure-rabbitmq: installing Debian's rabbitmq-server" >&2
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q rabbitmq-server) >&2 || exit 1
  else
    echo "ensure-rabbitmq: RabbitMQ is not installed; run: sudo apt-get install rabbitmq-server" >&2
    exit 1
  fi
fi
echo "ensure-rabbitmq: starting rabbitmq-server -detached" >&2
PATH=$PATH:/usr/sbin rabbitmq-server -detached >&2 || true
PATH=$PATH:/usr/sbin timeout 120 rabbitmqctl await_startup >&2 || true
for _ in $(seq 60); do up && exit 0; sleep 1; done
echo "ensure-rabbitmq: RabbitMQ did not come up on 127.0.0.1:5672" >&2
exit 1
