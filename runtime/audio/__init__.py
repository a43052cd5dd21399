"""Hooks of generated omni models with a chunked Whisper-style audio encoder (qwen3_omni_moe's thinker): Ulysses SP
inside the audio encoder (``runtime.audio.sp``), the FSDP dummy audio forward (``runtime.audio.dummy_forward``) and
the per-sample M-RoPE position ids of samples with audio (``runtime.audio.positions``). See docs/omni.md."""
