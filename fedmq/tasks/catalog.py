"""What the tasks accept, by name, without importing torch: `fedmq simulate` checks its flags against this
before it loads torch, and the registry uses the same lists (tests/unit/test_cli.py keeps the model names in
step with lm_models.PRESETS and nmt_model.CONFIGS)."""

TASKS = ("lm", "nmt")
MODELS = {
    "lm": ("gru-tiny", "gru-small", "gru-medium", "gru-large", "lstm"),
    "nmt": ("tiny", "mini", "small", "base"),
}
# CLI flags shared by both tasks that only mean something for one of them (the registry ignores them for the
# other; the CLI refuses them when a user gives them for the other task)
LM_ONLY = ("tied", "bptt", "max_eval_lines", "min_count", "emb", "hidden", "layers")
# lm: training words seen fewer times are <unk> (lm_data.Vocabulary), so <unk> is a training target and a test
# word never seen in training is scored by what the rare words taught the model (measured: docs/cli.md)
MIN_COUNT = 2
NMT_ONLY = (
    "domains",
    "label_smoothing",
    "max_len",
    "eval_max_sentences",
    "beam",
    "eval_batch",
    "cache_dir",
    "eval_fraction",
)
