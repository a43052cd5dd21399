"""Config errors as one-line messages that start with the dotted key they concern, collected so that a config with
several errors reports all of them at once (exit code 2)."""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["ConfigError", "ConfigErrors", "LayoutRefused", "message_key"]

_KEY_PREFIX = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\[\d+\])*:")  # `data.buckets[2]:` is data.buckets


class ConfigError(ValueError):
    """A user error in the run configuration or parallel layout (exit code 2): one message, or every message of a
    config with several errors (``messages``, one line each; ``str`` joins them with newlines)."""

    def __init__(self, *messages: str) -> None:
        super().__init__("\n".join(messages))
        self.messages = list(messages)


class LayoutRefused(ConfigError):
    """A layout the model's code would compute wrongly, found while it runs: an attention module that passed no
    checked site, an argument ring attention does not compute, experts the fused kernels would misread, a key mask
    a ring cannot honour. Reported like a config error (one line, exit 2), never trained through."""


def message_key(message: str) -> str | None:
    """The dotted key a one-line error starts with (``data.buckets[2]: ...`` -> ``data.buckets``)."""
    match = _KEY_PREFIX.match(message)
    return match.group(1) if match else None


class ConfigErrors:
    """The errors of one config, collected so that all are reported at once. A key whose value was refused is
    replaced by its default while the other checks go on; what a later check says about a refused key (or a key
    inside it) is dropped, as a consequence of the first error rather than another one."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.refused: list[str] = []

    def _covered(self, key: str) -> bool:
        return any(key == bad or key.startswith((bad + ".", bad + "[")) for bad in self.refused)

    def add(self, *messages: str) -> None:
        for message in messages:
            key = message_key(message)
            if key is not None and self._covered(key):
                continue
            self.messages.append(message)
            if key is not None:
                self.refused.append(key)

    def run(self, check: Callable[[], None]) -> None:
        """Run one check, keeping what it raises. A check that fails otherwise on the defaults put in place of
        refused values is skipped when errors were found already (those errors are the ones to report)."""
        try:
            check()
        except ConfigError as exc:
            self.add(*exc.messages)
        except Exception:
            if not self.messages:
                raise

    def raise_if_any(self) -> None:
        if self.messages:
            raise ConfigError(*self.messages)
