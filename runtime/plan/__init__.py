"""Memory plans for real model sizes, computed rather than measured on hardware we do not have.

``python -m runtime.plan cfg.yaml --gpus 64 --gpu-mem 80`` builds the model of ``cfg.yaml`` (real published sizes, see
``configs/``) out of fake tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes, no memory), runs one
forward of the configured workload on them while counting the bytes autograd saves for backward per block, and
prints the per-rank bytes of parameters, gradients, optimizer state, gathered (unsharded) parameters and activations
under the configured FSDP/HSDP/SP/EP/activation-checkpointing layout, then the first layout that fits in the order
of least recomputation and communication (not of memory) and its runners-up with their memory (``choice``).

Modules: ``config`` (the plan file, no torch), ``footprint`` (the fake-tensor measurement), ``dit_inputs`` (a DiT's
forward inputs, and which of its modules read tensor values to the host), ``host_reads`` (runs those modules on real
tensors inside the fake step), ``layout`` (per-rank bytes and the layout search, pure arithmetic), ``choice`` (the
proposal and runners-up as the report says them), ``__main__`` (the command, with dotted overrides; ``--help`` imports
no torch).
"""
