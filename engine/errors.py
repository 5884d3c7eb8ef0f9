"""One base class for what a user did wrong: a config, data, checkpoint, results file, artifact or
run folder that is not what it should be. Command lines catch `UserError`, print one
`error: ...` line and exit 1; anything else is a programming error and keeps its traceback."""


class UserError(Exception):
    """Something the user can fix: the message names the file, key or path and what was expected."""

    def __str__(self):  # KeyError subclasses would otherwise print their message quoted
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()
