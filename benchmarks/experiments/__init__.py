"""Named reproductions of the seed papers' experiments: ``fedmq experiment NAME --scale S --out DIR``.

Papers: FedAtt (Ji et al. 2019), FedMed (Wu et al. 2020), dynamic pulling (Passban et al. 2022).
Every experiment is a grid of federations run one after the other with :class:`fedmq.simulation.Simulation`
over the in-process broker (``memory://``, the same engine/agent/codec code path as RabbitMQ). Each federation
writes a normal run folder ``OUT/NAME/<run>/`` (aggregator.runlog: config, metrics, summary); the experiment
writes ``OUT/NAME/results.json`` + ``results.md`` (one row per run), ``OUT/NAME/report/`` (``fedmq report`` of
all its runs) and ``OUT/NAME/NAME.SCALE.json``, the small results file that is kept in git under
benchmarks/results/ (benchmarks/results_file.py: the final numbers of each run and seed, the command and the
commit). Reruns into the same folder replace that experiment's run folders.

The modules: ``spec`` (RunSpec, the settings every grid shares), ``grids`` and ``nmt_grid`` (the grids, data:
which federations make each experiment at each scale), ``runner`` (one federation into its run folder),
``nmt_domains`` (the translation experiment's phases), ``results`` (rows, mean ± sd, orderings, the tables
and the results file) and ``run`` (``run_experiment``, what ``fedmq experiment`` calls). The task code the
translation experiment reads (per-domain BLEU and cross-entropy, pre-training pairs) is in
fedmq.tasks.nmt_domains.

The caller hands in the Simulation class and the report function (``run_experiment(simulation=, report=)``):
the CLI (``fedmq experiment``), scripts/reproduce.py and the tests. This package sits below cli, which imports
it for ``fedmq bench`` and ``fedmq experiment``; importing them back would make the two packages a cycle
(tests/unit/test_layering.py), and both live in cli for good reasons (``fedmq simulate``, ``fedmq report``).

Scales (same code path, only numbers differ):

* ``paper``: the papers' settings (100 IID clients, 50 rounds, GRU-300 / LSTM 2x400, full vocabulary, full
  validation and test splits; Transformer-base for translation). Meant for a GPU machine.
* ``cpu``: what finishes on 2 shared CPU cores: Penn Treebank (the 6,645 words of its first 4,000 training
  lines), 20 clients (so C = 0.1 selects 2), those 4,000 lines (~85k words, ~4.2k a client), 12 rounds of
  E = 1 epoch, every method on the same GRU-small tied, validation/test on the first 1,000 lines (~21k words
  each) -- absolute perplexities are far from the papers' (a fraction of an epoch of PTB),
  only the ordering of methods is read.
* ``smoke``: CI; a reduced grid, one or two rounds, tiny slices, tiny models.

Local training follows FedAtt's Algorithm 2 ("z ← βz + ∇L(θ); θ ← θ − ηz": SGD with momentum) and its
reference code (shaoxiongji/fed-att: momentum 0.5, E = 5, B = 10, no gradient clipping) at the paper scale,
with lr 0.5 where the reference has 0.01: the papers give no learning rate, and ``sweep --scale paper``
(FedAvg, PTB, C = 0.1, 25 rounds on a GPU) found 0.01 far from trained, 0.5 best, 1.0 flat from round 16 and
2.0 divergent in its first rounds (docs/results/paper-scale.md). At the cpu scale, where a client takes ~12
steps a round, momentum comes from the validation sweep ``fedmq experiment sweep --scale cpu`` and lr (0.5)
with FedMed's "decayed learning rate" (x 0.9 a round) from a second sweep on the C = 0.1 cells whose
validation curves spiked at lr 1.0 (docs/results/method.md). Every method shares this one client regime, so
that only the aggregation differs. The score is the test perplexity of the best-on-validation global model
(as both LM papers report).
"""

from fedmq.benchmarks.experiments.grids import NAMES
from fedmq.benchmarks.experiments.run import check_args, check_corpora, parse_seeds, run_experiment
from fedmq.benchmarks.experiments.spec import SCALES, ExperimentError, RunSpec

__all__ = [
    "NAMES",
    "SCALES",
    "ExperimentError",
    "RunSpec",
    "check_args",
    "check_corpora",
    "parse_seeds",
    "run_experiment",
]
