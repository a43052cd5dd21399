"""Vision-language data: the Qwen-VL processor, chat samples with images and videos -> tokens, M-RoPE position ids
and pixels, whole-sample packing, and a small synthetic data set for demos and tests."""
