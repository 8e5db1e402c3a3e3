"""Errors that reach the user as one clear line, never a traceback."""


class UserError(Exception):
    """A problem with the user's input or files (bad model, bad checkpoint, bad request)."""
