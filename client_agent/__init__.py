"""Client agent: the agent loop, tasks (models, data, training, evaluation) and availability models."""
