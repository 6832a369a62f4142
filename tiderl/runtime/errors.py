"""The coordinator's one error: the job cannot go on."""


class CoordinatorError(RuntimeError):
    """The job cannot go on (a trainer rank died or failed); the message says which. The job
    stops, resumable from its last checkpoint."""
