"""``ConfigError``: the one error a bad configuration raises, wherever it is checked (the config
module, its cross-field rules, a subsystem's own checks). ``megascale.config`` re-exports it."""


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or breaks a rule.

    The message names the field (``section.key``), the value, and what would be accepted.
    """
