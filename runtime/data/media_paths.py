"""Where the media files a data file names may live.

A data line is input the trainer does not control (a scraped or shared data set), and every path in it is opened and
read, so it must not reach files the user did not mean to train on. The rule, for every family's data (chat data
with images, videos and audio; DiT captions with images, videos and frame folders):

- media paths are relative to the data file's directory and must stay inside it: an absolute path, a ``..`` that
  leads out, or a symlink whose target is outside (resolved before the check) is an error naming the line;
- ``data.media_dir: <dir>`` names another directory instead: paths are relative to it, absolute paths are accepted,
  and everything must stay inside it (``media_dir: /`` accepts any path: the explicit opt-in).

Nothing outside is opened: the check runs before the file is looked at.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.data.errors import LineError

__all__ = ["MediaRoot"]


@dataclass(frozen=True)
class MediaRoot:
    """The directory a data file's media must stay inside."""

    directory: Path  # as given: relative paths are joined to it (messages show these paths)
    real: Path  # the directory with every symlink resolved: what a media file's resolved path must lie inside
    explicit: bool = False  # named by data.media_dir: absolute paths inside it are accepted

    @classmethod
    def at(cls, directory: str | Path, explicit: bool = False) -> MediaRoot:
        directory = Path(directory)
        return cls(directory, directory.resolve(), explicit)

    @classmethod
    def of(cls, data_path: str | Path, media_dir: str | Path | None = None) -> MediaRoot:
        """The media root of the data file ``data_path``: its directory, or ``media_dir`` when given."""
        return cls.at(Path(data_path).parent) if media_dir is None else cls.at(media_dir, explicit=True)

    def _where(self) -> str:
        return f"data.media_dir {self.directory}" if self.explicit else f"the data file's directory {self.directory}"

    def resolve(self, value: str, key: str) -> Path:
        """``value`` (a path from a data line, under ``key``) joined to the root; ``LineError`` when it is absolute
        without ``data.media_dir`` or leads outside the root."""
        path = Path(value)
        if path.is_absolute() and not self.explicit:
            raise LineError(
                f"{key}: absolute path {value!r}: media paths are relative to {self._where()}; make it relative, "
                f"or set data.media_dir to a directory holding the media"
            )
        joined = self.directory / path
        self.check_inside(joined, key, value)
        return joined

    def check_inside(self, path: Path, key: str, shown: str | None = None) -> None:
        """``LineError`` unless ``path`` (symlinks resolved) lies inside the root."""
        try:
            real = path.resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
            raise LineError(f"{key}: {shown or str(path)!r}: cannot resolve it: {exc}") from None
        if not real.is_relative_to(self.real):
            raise LineError(
                f"{key}: {shown or str(path)!r} leads outside {self._where()} (to {real}); media must stay inside "
                f"it, or set data.media_dir to a directory that holds them"
            )
