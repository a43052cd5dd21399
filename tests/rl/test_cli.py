"""``python -m runtime.rl`` as a user meets it: ``--help`` without torch, bad configs and inputs as one line naming
the file, line and key with exit code 2 (never a traceback), and the guards that stop a run (a reward that fails,
a policy that cannot or did not change, the log-prob gap alarm)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runtime.rl.__main__ import main
from tests.rl.common import rl_config

ROOT = Path(__file__).resolve().parents[2]


def test_help_answers_without_importing_torch() -> None:
    code = (
        "import sys; from runtime.rl.__main__ import main; rc = main(['--help']); "
        "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')], 'torch imported'; "
        "sys.exit(rc)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for key in ("algorithm: flowgrpo", "prompts_per_step", "true_cfg_scale", "advantage_std_ddof", "kl_form"):
        assert key in run.stdout, key
    from runtime.rl.config import ALGORITHMS

    headline = run.stdout.split("\n\n")[1].lower()  # after the usage lines: what the command does
    for name in ALGORITHMS:  # every algorithm the command offers is named up front (grpo_guard as GRPO-Guard)
        assert name.replace("_", "-") in headline, (name, headline)


def test_usage_errors(capsys) -> None:
    assert main([]) == 2 and "usage" in capsys.readouterr().err
    assert main(["a.yaml", "b.yaml"]) == 2


def _run(tmp_path: Path, raw: dict, capsys) -> tuple[int, str, str]:
    capsys.readouterr()  # what building the tiny pipeline printed
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    code = main([str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def _line_of(tmp_path: Path, key: str) -> int | None:
    lines = (tmp_path / "rl.yaml").read_text().splitlines()
    return next((i for i, line in enumerate(lines, 1) if line.strip().lstrip("- ").startswith(f"{key}:")), None)


BAD = [  # (section updates, the key named, words of the message)
    ({"algorithm": "flow_grpo"}, "algorithm", "unknown algorithm"),
    ({"flowgrpo": {"window_size": 9}}, "window_size", "flowgrpo.window_size"),
    ({"flowgrpo": {"windowsize": 2}}, "windowsize", "flowgrpo.windowsize: unknown key"),
    ({"flowgrpo": {"advantage_std_ddof": 2}}, "advantage_std_ddof", "verl-omni"),
    ({"flowgrpo": {"group_size": 1}}, "group_size", "at least 2"),
    ({"flowgrpo": {"kl_coef": 0.1}, "lora": {"rank": None}}, "reference", "frozen_copy"),
    ({"flowgrpo": {"sde_type": "ode"}}, "sde_type", "expected one of sde, cps"),
    ({"sampling": {"height": 30}}, "height", "multiple of 16"),
    ({"sampling": {"frames": 5}}, "frames", "generates images"),
    ({"sampling": {"true_cfg_scale": 0.5}}, "true_cfg_scale", "expected >= 1"),
    ({"rewards": []}, "rewards", "at least one reward"),
    ({"rewards": [{"callable": "tests.rl.nowhere:score"}]}, "callable", "rewards[0].callable: cannot import"),
    ({"rewards": [{"callable": "tests.rl.rewards:brightness", "http": "x"}]}, "callable", "exactly one reward kind"),
    ({"model": {"type": "qwen3"}}, "type", "not a generated DiT"),
    ({"model": {"type": "cogvideox"}}, "type", "'cogvideox' is a v-prediction diffusion model"),
    ({"data": {"prompts": "missing.txt"}}, "prompts", "no such file"),
    ({"data": {"prompts_per_step": 9}}, "prompts_per_step", "data.prompts_per_step: 6 prompt(s)"),
    ({"reference": "base"}, "reference", "expected one of lora_disabled, frozen_copy"),
    ({"stepz": 3}, "stepz", "stepz: unknown key"),
]


@pytest.mark.parametrize(("update", "key", "words"), BAD, ids=[b[1] + "-" + b[2][:12] for b in BAD])
def test_bad_config_is_one_line_naming_file_line_and_key(update, key, words, tiny_pipelines, tmp_path, capsys) -> None:
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path)
    for section, values in update.items():
        raw[section] = {**raw[section], **values} if isinstance(values, dict) and section in raw else values
    if key == "prompts" and "missing" in str(raw["data"]["prompts"]):
        raw["data"]["prompts"] = str(tmp_path / "missing.txt")
    code, _, err = _run(tmp_path, raw, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert words in err, err
    line = _line_of(tmp_path, key)  # None: a key the file leaves to its default (`reference`) is named alone
    assert (f"rl.yaml:{line}: " if line else f"rl.yaml: {key}") in err, err


def test_prompt_file_errors_name_the_line(tiny_pipelines, tmp_path, capsys) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a cat"}) + "\n" + json.dumps({"text": "a dog"}) + "\n")
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, data={"prompts": str(prompts)})
    code, _, err = _run(tmp_path, raw, capsys)
    assert code == 2 and f"{prompts}:2:" in err and '"prompt" string' in err, err


def test_a_failing_reward_stops_the_step_in_one_line(tiny_pipelines, tmp_path, capsys) -> None:
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, rewards=[{"callable": "tests.rl.rewards:wrong_count"}])
    code, _, err = _run(tmp_path, raw, capsys)
    assert code == 2 and "reward 'callable0' returned 3 values for 4 samples" in err and "Traceback" not in err, err


def test_a_loss_no_trained_parameter_reaches_stops(tiny_pipelines, tmp_path, capsys) -> None:
    """LoRA on the last block's text MLP of Qwen-Image: upstream never uses that output, so nothing trains."""
    lora = {"rank": 4, "target_modules": r"transformer_blocks\.1\.txt_mlp\.net\.2"}
    raw = rl_config("qwenimage", tiny_pipelines("qwenimage"), tmp_path, lora=lora)
    code, _, err = _run(tmp_path, raw, capsys)
    assert code == 2 and "depends on no trainable parameter" in err, err


def test_an_update_that_moves_nothing_stops(tiny_pipelines, tmp_path, capsys) -> None:
    """A learning rate too small to move any float32 weight: the policy did not change after the update."""
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, lora={"rank": None}, optim={"lr": 1e-30})
    code, _, err = _run(tmp_path, raw, capsys)
    assert code == 2 and "changed no trainable parameter" in err, err


def test_equal_rewards_are_nothing_to_learn_not_an_error(tiny_pipelines, tmp_path, capsys) -> None:
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, rewards=[{"callable": "tests.rl.rewards:constant"}])
    code, out, err = _run(tmp_path, raw, capsys)
    assert code == 0, err
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [m["advantage_abs_max"] for m in metrics] == [0.0, 0.0]
    lines = out.splitlines()  # the start-up summary comes first, then what is loading
    assert lines[0].startswith(f"run: flowgrpo on flux from {raw['model']['path']}, data "), lines
    assert "1 process(es) = dp_replicate 1 x dp_shard 1 x sp 1 on cpu | compute float32" in lines[0], lines
    assert lines[1].startswith("checking the inputs"), lines


@pytest.mark.parametrize("action", ["warn", "stop"])
def test_log_prob_gap_alarm(action, tiny_pipelines, tmp_path, capsys) -> None:
    """Qwen-Image rolled out one sample at a time (each prompt unpadded) and trained four at a time (padded, with a
    key mask): a real, tiny layout gap, above an alarm threshold set below it."""
    raw = rl_config(
        "qwenimage",
        tiny_pipelines("qwenimage"),
        tmp_path,
        sampling={"batch_size": 1},
        flowgrpo={"logprob_gap_alarm": 1e-12, "on_logprob_gap": action},
    )
    code, out, err = _run(tmp_path, raw, capsys)
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert 0 < metrics[0]["logprob_gap_max"] < 1e-5 and metrics[0]["logprob_gap_alarm"] == 1
    if action == "warn":
        assert code == 0 and out.count("ALARM step") == 2, out
    else:
        assert code == 2 and "log-prob gap" in err and "on_logprob_gap: stop" in err and len(metrics) == 1, err
