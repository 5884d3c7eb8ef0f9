"""One base class for what a user did wrong: a config, data, checkpoint, results file, artifact or
run folder that is not what it should be. Command lines catch `UserError`, print one
`error: ...` line and exit 1; anything else is a programming error and keeps its traceback."""


class UserError(Exception):
    """Something the user can fix: the message names the file, key or path and what was expected."""

    def __str__(self):  # KeyError subclasses would otherwise print their message quoted
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class DataError(UserError, ValueError):
    """Data that cannot be used as it is; the message names the file (and record) and what was expected."""


class MissingData(DataError, FileNotFoundError):
    """A data folder or file that is not there; the message says where to put it."""


class BadSample(DataError):
    """One sample that cannot be read (corrupt image, unreadable audio, malformed row)."""

    def __init__(self, where, reason=None):  # one argument: how DataLoader re-raises a worker's error
        super().__init__(where if reason is None else f"{where}: {reason}")
        self.where, self.reason = where, reason


class ArtifactError(UserError, ValueError):
    """A checkpoint or artifact that cannot be used as asked: the message names the file."""


class ArtifactNotFound(ArtifactError, FileNotFoundError):
    """A checkpoint or artifact file (or its description) that is not there."""


class UnsafeArtifact(ArtifactError):
    """An artifact refused because opening or running it could run code from it or reach other files."""


class Preempted(Exception):
    """A stop request (SIGTERM / SIGINT) honoured: train.py exits with `exit_code`. `agreed`: every
    process stopped at the same step (a clean teardown with a barrier); otherwise (start-up, an
    evaluation) each process ends by itself."""
    exit_code = 75  # EX_TEMPFAIL: distinct from failures (1) and from being killed (128 + signal)

    def __init__(self, message, agreed=True):
        super().__init__(message)
        self.agreed = agreed
