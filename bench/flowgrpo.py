"""The RL figures of ``runtime.rl``, in one run:

1. the time split of a FlowGRPO iteration on the tiny Wan T2V pipeline: rollout (no grad, every denoising step),
   reward (decode + a tiny CLIP checkpoint + brightness), training (the window steps recomputed with grad, backward,
   AdamW), read from the job's own ``cpu_time_*`` metrics (user CPU seconds of the process,
   ``runtime.kernels.timing``: what other processes on a loaded machine run does not count), each phase's fastest
   iteration of the timed rounds;
2. the CPU time of one iteration of every algorithm (``runtime.rl.config.ALGORITHMS``, each with its defaults but
   the same group size and window) relative to FlowGRPO's on the same tiny Flux pipeline (Diffusion-DPO takes
   images, not video), prompts and rewards; DPO on random preference pairs;
3. activation memory per rank of the training side's recomputation (bytes saved for backward by one window step of
   one sample, true CFG on: the batch doubles) at sp=2 vs sp=1, worst rank over gloo ranks, on a Wan-shaped model
   (4 blocks, hidden 288, 8 heads) with 4096 video tokens per sample (target <= 0.6): exact and repeatable on CPU,
   unlike RSS.

4. async reward: the wall time of a FlowGRPO iteration with ``async_reward: true`` relative to the same run scoring
   synchronously, on tiny Flux (2 prompts x 4 samples, rollout chunks of 2) with a reward that takes real time: an
   HTTP scorer on 127.0.0.1 that sleeps ``--reward-seconds`` per sample (a judge model's latency without its CPU
   cost, so the figure is the overlap and not two computations sharing the cores); each run's fastest of the
   interleaved rounds, wall clock (what a user waits; the phases' user CPU time does not change).

1 and 2 come from one set of interleaved rounds: one iteration of every run per round (the order reversed every
round), each run's fastest round after a warm-up iteration (``runtime.kernels.timing.interleaved``; the cyclic
garbage collector paused while an iteration runs).

Run: `.venv/bin/python bench/flowgrpo.py [--repeats 14] [--dtype bf16] [--only async]` (``--only async``: figure 4
alone; ``--dtype``: the jobs'
``train.mixed_precision``; the jobs run where ``runtime.rl`` puts them: the GPU under NCCL, else the CPU).
"""

from __future__ import annotations

import http.server
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import Clock, bench_args, fastest, interleaved, saved_activation_bytes, setup, worst_rank

from runtime.rl.metrics import PHASES
from tests.rl.common import for_algorithm, rl_config, start

# Each algorithm with its module's defaults but the group size and window of the FlowGRPO run (DanceGRPO: every
# step stochastic, timestep_fraction 0.6 of them trained; DiffusionNFT: the ODE rollout, one forward-process draw).
ALGORITHMS = ("flowgrpo", "grpo_guard", "mixgrpo", "dancegrpo", "diffusionnft", "dpo")

# The Wan config of bench/dit.py (RoPE t/h/w = 12/12/12) with the tiny VAE's 4 latent channels; text_dim sizes the
# tiny text encoder.
WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=8,
    attention_head_dim=36,
    in_channels=4,
    out_channels=4,
    text_dim=64,
    freq_dim=64,
    ffn_dim=768,
    num_layers=4,
    rope_max_seq_len=256,
)
MEMORY_SAMPLING = {"height": 512, "width": 512, "frames": 13, "num_inference_steps": 1, "true_cfg_scale": 2.0}


def save_wan_pipeline(directory: Path, config: dict[str, Any]) -> Path:
    """A Wan pipeline directory with a random transformer of ``config`` and tiny encoders/VAE that fit it."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from runtime.diffusion.conditions.wan import WanConditionModel

    torch.manual_seed(0)
    components = WanConditionModel.tiny_components(config, None)
    WanPipeline(**components, transformer=WanTransformer3DModel(**config)).save_pretrained(directory)
    return directory


SPLIT = "flowgrpo on wan"  # the run whose phases make the time split


def _raw(model: str, pipeline: Path, work: Path, clip: Path, rounds: int, sampling: dict, dtype: str) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    return rl_config(
        model,
        pipeline,
        work,
        rewards=[{"callable": "tests.rl.rewards:brightness"}, {"clip": str(clip), "weight": 0.1}],
        sampling=sampling,
        flowgrpo={"group_size": 4, "window_size": 2},
        train={"steps": rounds + 1, "mixed_precision": dtype},
    )


def algorithm_runs(work: Path, rounds: int, dtype: str = "fp32") -> dict[str, Any]:
    """FlowGRPO on the tiny Wan T2V pipeline (the time split), and one run per algorithm on the tiny Flux pipeline
    (Diffusion-DPO takes images): the same prompts, rewards (CLIP + brightness), group size and window; DPO on 4
    random preference pairs per iteration (8 images, as the others' 2 prompts x 4 samples)."""
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline
    from runtime.rl.rewards.models import save_tiny_clip
    from tests.rl.test_dpo import write_pairs

    clip = save_tiny_clip(work / "clip")
    wan = {"height": 64, "width": 64, "frames": 9, "num_inference_steps": 8, "true_cfg_scale": 2.0}
    raw = _raw("wan", save_tiny_pipeline("wan", work / "wan"), work / "wan-run", clip, rounds, wan, dtype)
    runs = {SPLIT: start(raw)[0]}
    flux = save_tiny_pipeline("flux", work / "flux")
    for name in ALGORITHMS:
        sampling = {"height": 64, "width": 64, "num_inference_steps": 8}
        raw = _raw("flux", flux, work / name, clip, rounds, sampling, dtype)
        raw = for_algorithm(raw, name)
        if name == "dpo":
            del raw["rewards"]
            raw["data"] = {"pairs": str(write_pairs(work / "pairs", 8)), "prompts_per_step": 4}
        runs[name] = start(raw)[0]
    return runs


def iteration_rounds(runs: dict[str, Any], rounds: int, clock: Clock) -> tuple[dict[str, list[float]], list[dict]]:
    """Per run, the CPU seconds of each timed iteration (interleaved rounds after one warm-up iteration); the time
    split run's timed iterations' metrics."""
    from runtime.rl.loop import iteration

    metrics: dict[str, list[dict]] = {name: [] for name in runs}

    def job(name: str) -> Callable[[], None]:
        def one() -> None:
            metrics[name].append(iteration(runs[name], len(metrics[name]) + 1)[0])

        return one

    seconds = interleaved({name: job(name) for name in runs}, rounds, clock, warmup=1)
    return seconds, metrics[SPLIT][1:]


def _memory_worker(rank: int, world: int, raw: dict) -> int:
    """This rank's bytes saved for backward by the recomputation of one sample's first window step, on the inputs
    of a rollout through the job's own adapter and policy (FSDP2-wrapped, SP hooks live)."""
    import warnings

    from runtime.parallel.state import set_parallel_state
    from runtime.rl.loop import sample_generators
    from runtime.rl.sampling.rollout import rollout

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    torch.set_num_threads(1)
    try:
        run, _ = start(raw)
        adapter, module = run.policy.adapter, run.policy.module
        batch = adapter.encode([run.prompts[0].text], "blurry")
        steps = run.config.sampling.num_inference_steps
        res = rollout(
            adapter,
            module.eval(),
            batch,
            latent_shape=adapter.latent_shape,
            num_inference_steps=steps,
            window_size=1,
            generators=sample_generators(0, 1, 0, 1),
        )
        batch = {**batch, "schedule": res.schedule}

        def loss() -> torch.Tensor:
            log_prob, *_ = adapter.forward_and_sample_previous_step(
                module.train(),
                batch,
                res.latents[:, 0],
                res.step_indices[:, 0],
                prev_sample=res.latents[:, 1],
                noise_level=torch.full((1,), 0.7),
            )
            return log_prob.mean()

        return saved_activation_bytes(loss)
    finally:
        set_parallel_state(None)


def memory_ratio(work: Path) -> tuple[int, int]:
    pipeline = save_wan_pipeline(work / "wan-bench", WAN)
    raw = rl_config(
        "wan",
        pipeline,
        work,
        sampling=MEMORY_SAMPLING,
        flowgrpo={"group_size": 2, "window_size": 1},
        data={"prompts_per_step": 1},
    )
    one = worst_rank(_memory_worker, 1, raw)
    two = worst_rank(_memory_worker, 2, {**raw, "parallel": {"sp": 2}})
    return one, two


class _SlowScorer(http.server.BaseHTTPRequestHandler):
    """The HTTP reward contract (runtime/rl/rewards/http.py): sleeps ``seconds`` per image, answers a reward per
    image (its PNG's size: different samples score differently)."""

    seconds = 0.1

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.seconds * len(body["images"]))
        answer = json.dumps({"rewards": [len(image) / 1e4 for image in body["images"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


def async_reward_ratio(work: Path, rounds: int, seconds: float, dtype: str) -> dict[str, dict[str, float]]:
    """Per run (sync, async): the fastest iteration's wall seconds, and the fastest rollout and reward phases'."""
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline
    from runtime.rl.loop import iteration

    handler = type("Scorer", (_SlowScorer,), {"seconds": seconds})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        flux = save_tiny_pipeline("flux", work / "flux-async")
        runs, walls, waits = {}, {}, {}
        for name in ("sync", "async"):
            (work / f"async-{name}").mkdir(parents=True, exist_ok=True)
            raw = rl_config(
                "flux",
                flux,
                work / f"async-{name}",
                rewards=[{"http": f"http://127.0.0.1:{server.server_port}/score"}],
                sampling={"height": 64, "width": 64, "num_inference_steps": 8, "batch_size": 2},
                flowgrpo={"group_size": 4, "window_size": 2},
                train={"steps": rounds + 1, "mixed_precision": dtype},
            )
            runs[name], walls[name], waits[name] = start({**raw, "async_reward": name == "async"})[0], [], []
        for k in range(rounds + 1):  # the first round warms up
            for name in ("sync", "async") if k % 2 else ("async", "sync"):
                began = time.perf_counter()
                metrics = iteration(runs[name], k + 1)[0]
                if k:
                    walls[name].append(time.perf_counter() - began)
                    waits[name].append((metrics["wall_time_rollout"], metrics["wall_time_reward"]))
        return {
            name: {
                "iteration": min(walls[name]),
                "rollout": min(w[0] for w in waits[name]),
                "reward": min(w[1] for w in waits[name]),
            }
            for name in runs
        }
    finally:
        server.shutdown()
        server.server_close()


def main() -> None:
    parser = bench_args(__doc__, repeats=14)
    parser.add_argument("--only", choices=["async"], default=None, help="run figure 4 (async reward) alone")
    parser.add_argument("--reward-seconds", type=float, default=0.1, help="the HTTP scorer's latency per sample")
    args = parser.parse_args()
    bench = setup(args)
    with tempfile.TemporaryDirectory(prefix="bench-flowgrpo-") as scratch:
        work = Path(scratch)
        if args.only is None:
            _figures(work, bench, args)
        fig = async_reward_ratio(work, bench.repeats, args.reward_seconds, args.dtype)
        print("async reward, FlowGRPO on tiny Flux (64x64, 8 steps, 2 prompts x 4 samples, rollout chunks of 2), an")
        print(f"HTTP scorer on 127.0.0.1 taking {args.reward_seconds:g} s per sample; fastest iteration, wall clock:")
        for name, values in fig.items():
            phases = f"rollout phase {values['rollout']:7.3f} s   reward phase {values['reward']:7.3f} s"
            print(f"  {name:<6} iteration {values['iteration']:7.3f} s   {phases}")
        print(f"  sync / async iteration time: {fig['sync']['iteration'] / fig['async']['iteration']:.2f}x")


def _figures(work: Path, bench: Any, args: Any) -> None:
    """Figures 1-3 (module docstring)."""
    seconds, rows = iteration_rounds(algorithm_runs(work, bench.repeats, args.dtype), bench.repeats, bench.clock)
    split = {phase: fastest([r[f"cpu_time_{phase}"] for r in rows]) for phase in PHASES}
    total = sum(split.values())
    print("FlowGRPO iteration on tiny Wan T2V (64x64, 9 frames, 8 steps, 2 prompts x 4 samples, true CFG), one")
    print(f"process, {bench.label}, each phase's fastest iteration, its share of their sum:")
    for phase, value in split.items():
        print(f"  {phase:<8} {value:7.3f} s  {value / total:6.1%}")
    base = fastest(seconds["flowgrpo"])
    print(f"one iteration per algorithm on tiny Flux (64x64, 8 steps) relative to FlowGRPO's ({base:.3f} s):")
    for name in ALGORITHMS:
        print(f"  {name:<13} {fastest(seconds[name]):7.3f} s  {fastest(seconds[name]) / base:6.3f}x")
    one, two = memory_ratio(work)
    print("training-side recomputation, one window step of one sample, 4096 video tokens, Wan-shaped (4 blocks,")
    print("hidden 288), true CFG; bytes saved for backward per rank (worst rank):")
    mib = f"  sp=1 {one / 2**20:8.1f} MiB   sp=2 {two / 2**20:8.1f} MiB"
    print(f"{mib}   sp=2/sp=1 {two / one:.3f}  (target <= 0.6)")


if __name__ == "__main__":
    main()
