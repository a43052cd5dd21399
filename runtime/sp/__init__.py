"""Model-facing SP hooks that generated modeling files call.

Each hook is the identity when SP is off, so a generated model with parallelism off runs the upstream
code path exactly (bitwise-equal logits and gradients).
"""
