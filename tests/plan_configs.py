"""The tiny qwen3 a `runtime.plan` test plans (one definition for the plan suites)."""

TINY_QWEN3 = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}
