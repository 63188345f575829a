"""The pretraining errors: a user's mistake, a checkpoint that cannot be used, a diverged run."""


class UsageError(ValueError):
    """A user's mistake: a bad setting or an unusable input file. The CLI reports it in one line (exit 2)."""


class NonFiniteLossError(RuntimeError):
    """Training diverged: a non-finite loss, gradient norm or weight. Nothing non-finite was saved."""


class CheckpointError(ValueError):
    """A training checkpoint that cannot be used; the message names the file."""
