"""The client side of a federation: agents that join a job, train when selected and upload their updates.

- agent.py: the one-client agent (``fedmq agent run``), one process per client, and its round
- host.py: one agent process serving many clients of a job over one broker connection
- joining.py: joining a job and leaving it, alike for an agent and a host
- trainers.py: the pool of models local training runs on, shared by the agents of a process
- state.py: what an agent keeps between the rounds it is selected for, in memory or on disk
- availability.py: seeded availability models and fault plans for intermittent clients

The tasks (models, data, training, evaluation) live in fedmq.tasks, below both sides of a federation.
"""
