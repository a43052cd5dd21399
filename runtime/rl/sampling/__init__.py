"""Sampling of the RL job: the flow-matching step schedule and its SDE / CPS steps with their log-probs
(``scheduler.py``), and the windowed rollout that records them (``rollout.py``)."""
