"""Diffusion RL, one folder: ``torchrun --nproc-per-node N -m runtime.rl config.yaml``.

One loop (``loop.py``) shared by the algorithms: ``run_state.py`` builds, resumes and saves the run it advances,
``scoring.py`` rewards the global batch over every rank, ``update.py`` trains the rollout's steps or clean samples
and updates the policy, ``offline.py`` trains preference pairs, ``replicas.py`` holds the collectives over
data-parallel replicas they share. An algorithm is one module under ``algorithms/`` implementing the contract of
``algorithms/base.py`` (what it samples, which steps it trains, its loss, its metrics, its checkpoint state); the
loop calls nothing else of it. Below the loop: the model adapters keyed by architecture (``adapters/``), the step
schedule, SDE steps, rollout and forward-process draws (``sampling/``), the vLLM-Omni engine mapping (``engines/``),
rewards (``rewards/``); beside it the policy, data and metrics (``policy.py``, ``prompts.py``, ``pairs.py``,
``metrics.py``) and the switch between two experts of one pipeline (``experts.py``: Wan2.2 A14B); ``config.py`` and
``preflight.py`` refuse bad input before anything is built. See docs/flowgrpo.md.
"""
