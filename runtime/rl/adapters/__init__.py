"""Model adapters of the RL job: how rollout and training drive one architecture (``registry.py``: the base
classes and the registry keyed by architecture; ``sd3.py``, ``dit.py`` (every generated flow-matching DiT),
``nondiffusers.py`` (models that are not diffusers pipelines) and ``bagel/`` (a BAGEL-style MoT))."""
