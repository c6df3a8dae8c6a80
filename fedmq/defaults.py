"""The defaults of local training (and the agents' heartbeat), defined once: a job's settings
(aggregator.config.JobConfig), the command line's flags (which read JobConfig's) and a task's TrainConfig
(fedmq.tasks.base) all take them from here.

They are the classic word-language-model regime of pytorch/examples (plain SGD at lr 20, gradient norm clipped
at 0.25, batches of 20, lr ÷ 4 whenever validation stops improving), which the FedAtt reference code also
starts from, chosen by a sweep of `fedmq simulate` with every other default (2 cores, 2026-11-26; three seeds
each; test perplexity mean ± sd, and the largest rise of validation perplexity after round 1):

| lr, annealing | builtin corpus, 8 rounds   | PTB, first 4,000 lines, 10 clients, 5 rounds |
|---------------|----------------------------|----------------------------------------------|
| 20, ÷ 4       | 66.9 ± 1.8, no rise         | 437.0 ± 69.6, +1.3 %                          |
| 20, off       | 66.9 ± 1.8, no rise         | 474.8 ± 33.2, +9.9 %                          |
| 10, ÷ 4       | 79.5 ± 0.6, no rise         | 386.6 ± 5.3, +19.0 %                          |
| 10, off       | 79.5 ± 0.6, no rise         | 413.4 ± 32.0, +19.0 %                         |

Annealing changes nothing while validation improves (the builtin corpus) and stops the rises lr 20 has on a
larger corpus; lr 10 falls more slowly on the default corpus and still rises once on PTB. The PTB runs:
`fedmq simulate --data ptb -k 10 -c 0.5 --rounds 5 --max-lines 4000 --max-eval-lines 400 --lr LR
--lr-anneal F --seed S`."""

EPOCHS = 1
BATCH_SIZE = 20
LR = 20.0
# FedSGD's lr: its round is one full-batch step, and lr 20 diverges there (builtin corpus, seed 0, validation
# perplexity by round: 580 -> 137,101 in round 2). At 1.5, the lr `fedmq experiment`'s cpu grids give it, it
# falls every round; at 5 it rises in round 3 (builtin corpus, 5 rounds: 1748.5, 835.7, 1640.8, 507.8, 414.9)
FEDSGD_LR = 1.5
OPTIMIZER = "sgd"  # sgd | adam
MOMENTUM = 0.0
LR_DECAY = 1.0  # the local lr × this after every local epoch
CLIP = 0.25  # gradient-norm clipping (0 = off)
LR_ANNEAL = 4.0  # the clients' lr ÷ this from the round after one that did not improve validation (1 = off)
# s between an agent's presence beats (JobConfig.heartbeat_s, the agents' and hosts' own default): a presence
# counts for three beats
HEARTBEAT_S = 5.0
REJOIN_S = 2.0  # s an agent (or a host's client) stays away after it went offline, before it joins again
# models a process's clients train on at once (a simulation's, a host's): 1, clients in turn, each step on all
# torch's threads; a GPU keeps 1 (CUDA holds state per training thread)
TRAINERS = 1


def lr_for(strategy: str) -> float:
    """The clients' default learning rate under ``strategy`` (a job that sets none): FedSGD's own, else LR."""
    return FEDSGD_LR if strategy == "fedsgd" else LR
