"""Transport and wire format: Broker interface, RabbitMQ and in-process backends, topology, codec."""
