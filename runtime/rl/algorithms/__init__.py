"""RL algorithms, one module each (``runtime.rl.config.ALGORITHMS`` names them): ``Settings`` (the frozen dataclass
of the config section named after the algorithm), ``RULES`` (its key rules), ``check(config)``, ``conventions``,
``window``, ``advantages`` and ``step_objective``.

Optional hooks the loop reads (``runtime/rl/loop.py``, ``update.py``): ``NEEDS_OLD_MEAN = True`` passes
``gaussian=(mean, old_mean, std_dev_t, sqrt_dt)`` to ``step_objective`` (GRPO-Guard); ``WINDOW_PER_ITERATION = True``
calls ``window(settings, num_steps, step)`` each iteration (MixGRPO); ``iteration_metrics(settings, num_steps, step)``
adds the algorithm's own metrics (MixGRPO's ``window_start``); ``train_positions(settings, window_size, seed, step,
first, count)`` returns the ``[count, K]`` window positions each sample trains on (DanceGRPO's subsampling);
``initial_noise(settings, seed, step, first, count, latent_shape)`` returns the rollout's starting noise or None
(DanceGRPO's shared noise per group); ``FORWARD_PROCESS = True`` trains on the rollout's clean samples
through ``forward_draws``, ``noised`` and ``objective`` instead of its steps (DiffusionNFT); ``OFFLINE = True``
replaces the whole iteration (no rollout, no reward) by ``iteration(run, step)`` -> ``(metrics, None)`` and reads
``data.pairs`` instead of ``data.prompts`` (Diffusion-DPO)."""
