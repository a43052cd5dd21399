"""`make demo` (`python -m runtime.demo`): regenerate every spec into a scratch copy and compare with generated/, SP=2
parity, the text, VLM, omni and DiT trainers, FlowGRPO. Takes no arguments; a few minutes on a 2-core machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def regen_matches_checked_in() -> bool:
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        for name in ("pyproject.toml", "specs", "templates"):
            src = ROOT / name
            (shutil.copytree if src.is_dir() else shutil.copy)(src, scratch / name)
        subprocess.run(
            [sys.executable, "-m", "patchgen.cli", "regen", "--all", "--root", str(scratch)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        fresh = sorted(p.relative_to(scratch) for p in (scratch / "generated").rglob("*") if p.is_file())
        same = [p for p in fresh if (ROOT / p).is_file() and (ROOT / p).read_bytes() == (scratch / p).read_bytes()]
        print(f"regenerated {len(fresh)} files into a scratch dir: {len(same)} identical to the checked-in copies")
        return len(same) == len(fresh)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["--help"], ["-h"]):
        print(f"usage: python -m runtime.demo\n\n{__doc__}")
        sys.exit(0)
    if argv:
        print(f"error: {argv[0]}: python -m runtime.demo takes no arguments (--help: what it runs)", file=sys.stderr)
        sys.exit(2)
    print("== 1. regenerate from specs + templates + pinned upstream ==")
    ok = regen_matches_checked_in()
    print("== 2. tiny qwen3: Ulysses SP=2 (2 gloo processes) vs single process ==")
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "runtime.demos.sp_parity"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print(run.stdout, end="")
    if run.returncode != 0 or "PASS" not in run.stdout:
        print(run.stderr[-4000:], file=sys.stderr)
        ok = False
    print("== 3. text trainer: tiny qwen3, sp=2, 30 steps, resume from step 15, export ==", flush=True)
    from runtime.demos.train_text import main as train_demo

    ok = train_demo() and ok
    print("== 4. VLM trainer: tiny qwen3_vl, sp=2 (ViT + LM), generated images, export ==", flush=True)
    from runtime.demos.train_vlm import main as vlm_demo

    ok = vlm_demo() and ok
    print(
        "== 5. omni trainer: tiny qwen3_omni_moe thinker, sp=2 (audio encoder + ViT + LM), generated audio ==",
        flush=True,
    )
    from runtime.demos.train_omni import main as omni_demo

    ok = omni_demo() and ok
    print(
        "== 6. DiT trainer: tiny Wan2.1 T2V, sp=2, generated clips, resume, WanPipeline video; tiny Flux.1 LoRA; "
        "tiny HunyuanVideo LoRA, sp=2 ==",
        flush=True,
    )
    from runtime.demos.train_dit import main as dit_demo

    ok = dit_demo() and ok
    print(
        "== 7. FlowGRPO: torchrun -m runtime.rl on tiny Flux.1 at sp=2, CLIP (tiny checkpoint) + brightness rewards, "
        "resume, LoRA export loaded by FluxPipeline ==",
        flush=True,
    )
    from runtime.demos.flowgrpo import main as flowgrpo_demo

    ok = flowgrpo_demo() and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
