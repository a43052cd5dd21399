"""DiT training data: (caption, image or video) samples from local files, bucketed by size and frame count."""
