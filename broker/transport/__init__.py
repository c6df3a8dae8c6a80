"""The transport: the Broker interface (base), its RabbitMQ (rabbitmq, pika) and in-process (memory) backends,
connect(url), the job's queues and names (queues, topology), reassembly of chunked messages, provisioning, TLS
and URLs. It carries what broker.wire encodes."""
