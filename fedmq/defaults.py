"""The defaults of local training, defined once: a job's settings (aggregator.config.JobConfig), the command
line's flags (which read JobConfig's) and a task's TrainConfig (fedmq.tasks.base) all take them from here.

They are the classic word-language-model regime of pytorch/examples (plain SGD at lr 20, gradient norm clipped
at 0.25, batches of 20), which the FedAtt reference code also starts from."""

EPOCHS = 1
BATCH_SIZE = 20
LR = 20.0
OPTIMIZER = "sgd"  # sgd | adam
MOMENTUM = 0.0
LR_DECAY = 1.0  # the local lr × this after every local epoch
CLIP = 0.25  # gradient-norm clipping (0 = off)
