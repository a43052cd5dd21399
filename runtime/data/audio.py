"""Audio files -> mono waveforms at the feature extractor's sampling rate.

Decoding uses ``soundfile`` (libsndfile, bundled in its wheels: wav, flac, ogg, ... with no system library) and
resampling ``soxr`` (the SoX resampler, high quality), both from the ``runtime`` extra. Multi-channel audio is
averaged to mono; integer PCM is scaled to [-1, 1] by soundfile. The Whisper feature extractor of Qwen3-Omni then
turns the waveform into log-mel frames (10 ms hop at 16 kHz).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["load_audio", "resample", "write_audio"]

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


def load_audio(path: str | Path, sampling_rate: int) -> np.ndarray:
    """The file's audio as a mono float32 waveform at ``sampling_rate`` Hz; ValueError naming the file if it cannot
    be decoded or holds no sample."""
    soundfile = _soundfile()
    try:
        wave, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (RuntimeError, OSError, soundfile.LibsndfileError) as exc:
        raise ValueError(f"cannot read audio {path}: {exc}") from None
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
