"""The planner's one error type: every bad input names the field, the value and the fix."""
from __future__ import annotations


class PlanError(ValueError):
    """A rejected input.

    ``str(err)`` reads ``--FIELD: value X <problem>; fix: <fix>``, the line ``shardwise plan``
    prints after ``error: `` before returning exit code 2.
    """

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        self.field = field
        """The option or attribute at fault, e.g. ``gpu`` (printed as ``--gpu``)."""
        self.value = value
        """The value that was rejected, as given."""
        self.problem = problem
        """What is wrong with it, in a few words."""
        self.fix = fix
        """What to do instead."""
        flag = field if field.startswith("--") else "--" + field.replace("_", "-")
        super().__init__(f"{flag}: value {value!s} {problem}; fix: {fix}")
