"""Errors a user can fix. The CLI prints these as one line, with no traceback."""


class UserError(Exception):
    """Something in the input or the configuration that the user has to change."""


class ConfigError(UserError):
    """The configuration is invalid; raised before any work starts."""


class DataError(UserError):
    """The corpus cannot be turned into training data (missing, empty, undecodable...)."""


class ModelError(UserError):
    """A model file that cannot be used (missing, corrupted, without its tokenizer), or a model
    that does not survive export: the message names the file or the check that failed."""
