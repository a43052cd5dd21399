"""Omni (audio) data: audio files -> waveforms, the generated omni processor, chat samples with audio, images and
videos -> model inputs, whole-sample packing, and a small synthetic data set for demos and tests."""
