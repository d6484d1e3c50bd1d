"""The one error hierarchy of kvtier.

A miss is a value (``None`` / ``False``), never an exception. Exceptions are for
configuration mistakes and for faults a caller must know about.
"""


class KVTierError(Exception):
    """Base of every error kvtier raises on purpose.

    kvtier's errors are rooted here, not in Python's built-in errors (``ConfigError`` is not a
    ``ValueError``), so an ``except ValueError`` around a copy or a parse never swallows a
    configuration mistake, and ``except KVTierError`` catches exactly kvtier's own faults.
    ``InvalidKey`` alone is also a ``ValueError``: it is a caller passing a bad argument.
    """


class ConfigError(KVTierError):
    """A configuration value is wrong: unknown key, bad size, unknown name.

    The message is one line that names the problem and the valid choices.
    """


class OutOfSpace(ConfigError):
    """Storage a configuration asks for cannot be reserved at start (e.g. shared memory too small).

    Raised before any byte of it is used, so a full tmpfs refuses to start instead of killing the
    process with SIGBUS later. The message is one line: the size asked, the directory, its free space.
    """


class TierUnavailable(KVTierError):
    """A tier cannot be reached or used right now (server down, directory unwritable)."""


class CorruptEntry(KVTierError):
    """Stored bytes do not parse or do not match their checksum."""


class InvalidKey(KVTierError, ValueError):
    """A chunk key is not a ``KEY_BYTES``-byte digest (a caller's mistake, never a miss)."""


class LoaderError(KVTierError):
    """A model file or source is unusable (bad safetensors header, missing object, ...)."""
