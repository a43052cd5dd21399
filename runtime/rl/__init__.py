"""RL fine-tuning jobs of diffusion models: ``torchrun --nproc-per-node N -m runtime.rl config.yaml``.

One loop (``loop.py``) shared by the algorithms; an algorithm is one module under ``algorithms/`` owning its config
section, its rollout-window choice and its per-step objective (``flowgrpo`` today). The policy, data, rewards and
metrics live beside the loop: ``policy.py``, ``prompts.py``, ``rewards/``, ``metrics.py``; ``config.py`` and
``preflight.py`` refuse bad input before anything is built. See docs/flowgrpo.md.
"""
