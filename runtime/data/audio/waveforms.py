"""Audio files -> mono waveforms at the feature extractor's sampling rate.

Decoding uses ``soundfile`` (libsndfile, bundled in its wheels: wav, flac, ogg, ... with no system library) and
resampling ``soxr`` (the SoX resampler, high quality), both from the ``runtime`` extra. Multi-channel audio is
averaged to mono; integer PCM is scaled to [-1, 1] by soundfile. The Whisper feature extractor of Qwen3-Omni then
turns the waveform into log-mel frames (10 ms hop at 16 kHz).

Checked before decoding (``check_audio``, from the header): the file opens, is not truncated (a WAV whose data chunk
declares more bytes than the file holds, an Ogg stream whose last page is cut or lacks its end-of-stream mark; both
decode "fine" to a shorter clip), lasts at most ``MAX_AUDIO_SECONDS`` and holds at most ``MAX_AUDIO_SAMPLES``
samples (frames x channels: 2 GiB decoded as float32). After decoding, fewer frames than the header declares (a
FLAC cut at a frame boundary) is truncated too.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MAX_AUDIO_SAMPLES", "MAX_AUDIO_SECONDS", "check_audio", "load_audio", "resample", "write_audio"]

MAX_AUDIO_SECONDS = 3600
MAX_AUDIO_SAMPLES = 2**29
_MAX_CHUNKS = 4096  # RIFF chunks looked at before the data chunk

_MISSING = "audio data needs the soundfile and soxr packages (the runtime extra: pip install -e '.[runtime]')"


def _soundfile():
    try:
        import soundfile
    except ImportError:  # pragma: no cover - both are in the runtime extra
        raise RuntimeError(_MISSING) from None
    return soundfile


def resample(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``wave`` (frames,) float32 from ``rate`` to ``target`` Hz (soxr, high quality); unchanged when equal."""
    if rate == target:
        return wave
    try:
        import soxr
    except ImportError:  # pragma: no cover
        raise RuntimeError(_MISSING) from None
    return soxr.resample(wave, rate, target).astype(np.float32, copy=False)


def _wav_cut(path: Path) -> str | None:
    """Why a RIFF/WAVE file is truncated (its data chunk declares more bytes than follow), or None."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(12)
        if len(head) < 12 or head[:4] not in (b"RIFF", b"RIFX") or head[8:12] != b"WAVE":
            return None
        order, pos = ("<" if head[:4] == b"RIFF" else ">"), 12
        for _ in range(_MAX_CHUNKS):
            f.seek(pos)
            chunk = f.read(8)
            if len(chunk) < 8:
                return None
            declared = struct.unpack(f"{order}I", chunk[4:])[0]
            if chunk[:4] == b"data":
                present = size - pos - 8
                # 0 and 0xFFFFFFFF: written by streaming encoders that could not seek back to fill the size in
                if declared not in (0, 0xFFFFFFFF) and declared > present:
                    return f"its data chunk declares {declared} bytes, the file holds {present}"
                return None
            pos += 8 + declared + (declared & 1)
    return None


def _ogg_cut(path: Path) -> str | None:
    """Why an Ogg stream is truncated (its last page is cut, or is not marked end-of-stream), or None. Walks the
    page headers (27 bytes + segment table each); other files are left alone."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if f.read(4) != b"OggS":
            return None
        pos, last_flags = 0, 0
        while pos < size:
            f.seek(pos)
            header = f.read(27)
            if len(header) < 27 or header[:4] != b"OggS":
                return f"no Ogg page where one should start (byte {pos})"
            lacing = f.read(header[26])
            end = pos + 27 + len(lacing) + sum(lacing)
            if len(lacing) < header[26] or end > size:
                return f"its last page is cut (it would end at byte {end}, the file has {size})"
            pos, last_flags = end, header[5]
    return None if last_flags & 0x04 else "its last page is not marked end-of-stream"


def check_audio(path: str | Path) -> Any:
    """The file's ``soundfile.info``, after the checks of the module docstring; ValueError naming the file."""
    soundfile = _soundfile()
    path = Path(path)
    try:
        info = soundfile.info(str(path))
        cut = _wav_cut(path) or _ogg_cut(path)
    except (RuntimeError, OSError, soundfile.LibsndfileError) as exc:
        raise ValueError(f"cannot read audio {path}: {exc}") from None
    if cut:
        raise ValueError(f"audio {path}: truncated: {cut}")
    if info.duration > MAX_AUDIO_SECONDS:
        raise ValueError(
            f"audio {path}: {info.duration:.0f} s long, more than the limit of {MAX_AUDIO_SECONDS} s per clip; cut it"
        )
    if info.frames * info.channels > MAX_AUDIO_SAMPLES:
        raise ValueError(
            f"audio {path}: {info.frames * info.channels} samples (frames x channels), more than the limit of "
            f"{MAX_AUDIO_SAMPLES} per clip (2 GiB decoded as float32)"
        )
    return info


def load_audio(path: str | Path, sampling_rate: int) -> np.ndarray:
    """The file's audio as a mono float32 waveform at ``sampling_rate`` Hz; ValueError naming the file if it fails
    ``check_audio``, cannot be decoded, decodes to fewer frames than its header declares or holds no sample."""
    soundfile = _soundfile()
    info = check_audio(path)
    try:
        wave, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (RuntimeError, OSError, soundfile.LibsndfileError) as exc:
        raise ValueError(f"cannot read audio {path}: {exc}") from None
    if wave.shape[0] < info.frames:
        raise ValueError(f"audio {path}: truncated: its header declares {info.frames} frames, {wave.shape[0]} decode")
    if wave.shape[0] == 0:
        raise ValueError(f"audio {path} holds no sample")
    mono = wave.mean(axis=1) if wave.shape[1] > 1 else wave[:, 0]
    return resample(np.ascontiguousarray(mono, dtype=np.float32), int(rate), sampling_rate)


def write_audio(path: str | Path, wave: np.ndarray, sampling_rate: int) -> Path:
    """Write a mono float waveform; the format follows the suffix (.wav as 16-bit PCM, .flac)."""
    soundfile = _soundfile()
    path = Path(path)
    subtype = "PCM_16" if path.suffix.lower() in (".wav", ".flac") else None
    soundfile.write(str(path), np.asarray(wave, dtype=np.float32), sampling_rate, subtype=subtype)
    return path
