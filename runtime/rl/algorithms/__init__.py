"""RL algorithms, one module each (``runtime.rl.config.ALGORITHMS`` names them), each exposing ``ALGORITHM``: an
instance of its ``base.Algorithm`` subclass, the contract the loop calls and nothing else (``base.py`` lists the
hooks: config, what it samples, which steps it trains, its loss, its metrics, its checkpoint state). The module also
holds the section's ``Settings`` (frozen dataclass), ``RULES`` and the plain functions the class delegates to (the
tests check those against float64 re-derivations of the papers' and peers' formulas). ``objectives.py`` holds the
GRPO formulas the step-trained algorithms share (group advantages, the clipped loss, the KL to the reference)."""
