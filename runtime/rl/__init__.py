"""RL fine-tuning jobs of diffusion models: ``torchrun --nproc-per-node N -m runtime.rl config.yaml``.

One loop (``loop.py``) shared by the algorithms: ``run_state.py`` builds, resumes and saves the run it advances,
``scoring.py`` rewards the global batch over every rank, ``update.py`` trains and updates the policy, ``replicas.py``
holds the collectives over data-parallel replicas they share. An algorithm is one module under ``algorithms/``
owning its config section, its rollout-window choice and its per-step objective (``flowgrpo`` today). The policy,
data, rewards and metrics live beside the loop: ``policy.py``, ``prompts.py``, ``rewards/``, ``metrics.py``;
``config.py`` and ``preflight.py`` refuse bad input before anything is built. See docs/flowgrpo.md.
"""
