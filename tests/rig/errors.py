"""The one error type of the rig: its message is a single line saying what is wrong and what to do."""


class RigError(Exception):
    """The rig cannot be brought up, used or torn down; `str(error)` is one line."""
