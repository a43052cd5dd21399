"""RL algorithms, one module each (``runtime.rl.config.ALGORITHMS`` names them): ``Settings`` (the frozen dataclass
of the config section named after the algorithm), ``RULES`` (its key rules), ``check(config)``, ``conventions``,
``window``, ``advantages`` and ``step_objective``."""
