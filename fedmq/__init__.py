"""fedmq's shared bottom layer: what the aggregator and the client agent both use and neither owns — the
errors, parameter checks, the tensor manifest, the tasks (models, data, local training) and the pulling rule.
Nothing here imports the broker, the aggregator, the agent or the CLI."""
