"""Hooks the generated vision-language models call that are not about sequence parallelism (see runtime.sp.vision
for those): the FSDP dummy vision forward, the LM's attention kwargs kept away from the ViT, host-side ViT segment
lengths, and the data pipeline's M-RoPE position-id function."""
