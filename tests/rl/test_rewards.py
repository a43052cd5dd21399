"""Rewards: by import path (a function, a class built with kwargs), weighted mixes, an HTTP reward against a loopback
server the test starts and stops (its JSON contract, timeouts and malformed answers as one clear error, no hang), and
the CLIP and PickScore rewards loading tiny random CLIP checkpoints saved to a temp dir with transformers (the loading
code is the real one), checked against the CLIP model's own forward."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from runtime.config.errors import ConfigError
from runtime.rl.rewards import RewardError, build_rewards

PROMPTS = ["a red kite", "a blue boat", "a green hill"]


def _images(seed: int = 0, video: bool = False) -> torch.Tensor:
    shape = (3, 3, 2, 32, 32) if video else (3, 3, 32, 32)
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _quantized_mean(x: torch.Tensor) -> torch.Tensor:
    """What a server sees of a sample: its 8-bit image, mapped back to [-1, 1], averaged."""
    q = ((x.clamp(-1, 1) + 1) * 127.5).round() / 127.5 - 1
    return q.flatten(1).mean(dim=1)


def test_callables_and_weighted_mix() -> None:
    mix = build_rewards(
        [
            {"callable": "tests.rl.rewards:brightness", "weight": 2.0, "name": "bright"},
            {"callable": "tests.rl.rewards.PromptLength", "kwargs": {"scale": 0.5}, "weight": -1},
        ]
    )
    x = _images()
    combined, each = mix(x, PROMPTS)
    bright = x.flatten(1).mean(dim=1)
    length = torch.tensor([0.5 * len(p) for p in PROMPTS])
    assert mix.names == ["bright", "callable1"]
    torch.testing.assert_close(each["bright"], bright)
    torch.testing.assert_close(each["callable1"], length)
    torch.testing.assert_close(combined, 2.0 * bright - length)


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("wrong_count", "returned 2 values for 3 samples"),
        ("not_finite", "non-finite values"),
        ("raises", "failed: RuntimeError: the reward model ran out of memory"),
    ],
)
def test_a_broken_reward_is_one_line_naming_it(target, words) -> None:
    mix = build_rewards([{"callable": f"tests.rl.rewards:{target}", "name": "mine"}])
    with pytest.raises(RewardError) as err:
        mix(_images(), PROMPTS)
    assert str(err.value).startswith("reward 'mine'") and words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"callable": "tests.rl.rewards:brightness", "kwargs": {"a": 1}}, "kwargs: tests.rl.rewards:brightness is a"),
        ({"callable": "tests.rl.rewards:PROMPTS_NONE"}, "has no 'PROMPTS_NONE'"),
        ({"http": "ftp://x"}, "not an http(s) URL"),
        ({"http": "http://127.0.0.1:1/x", "timeout": 0}, "rewards[0].timeout"),
        ({"clip": "/nonexistent/clip"}, "not a directory"),
        ({"callable": "tests.rl.rewards:brightness", "weight": "high"}, "rewards[0].weight"),
        ({"callable": "tests.rl.rewards:brightness", "scale": 2}, "rewards[0].scale: unknown key"),
    ],
)
def test_bad_reward_entries(spec, words) -> None:
    with pytest.raises(ConfigError) as err:
        build_rewards([spec])
    assert words in str(err.value), str(err.value)


# ---------------------------------------------------------------------------------------------------- HTTP


class _Handler(BaseHTTPRequestHandler):
    mode = "brightness"
    requests: list[dict] = []

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        mode = type(self).mode
        if mode == "slow":
            time.sleep(1.5)
        if mode == "malformed":
            answer = b"<html>oops</html>"
        elif mode == "count":
            answer = json.dumps({"rewards": [0.0]}).encode()
        elif mode == "status":
            self.send_response(503)
            self.end_headers()
            return
        else:
            answer = json.dumps({"rewards": [self._brightness(item) for item in body["images"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    @staticmethod
    def _brightness(item) -> float:
        frames = item if isinstance(item, list) else [item]
        values = [np.asarray(PIL.Image.open(io.BytesIO(base64.b64decode(f)))).astype(np.float64) for f in frames]
        return float(np.mean([v / 127.5 - 1 for v in values]))


class _QuietServer(ThreadingHTTPServer):
    """Closing joins the request threads (a "slow" answer still sleeping when the client gave up ends before the
    test does), and the broken pipe that answer then meets is expected: not printed into another test's output."""

    daemon_threads = False
    block_on_close = True

    def handle_error(self, request, client_address) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    """A loopback reward server on a free port; stopped (and its port closed) after the test."""
    handler = type("Handler", (_Handler,), {"mode": "brightness", "requests": []})
    httpd = _QuietServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/score", handler
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize("video", [False, True])
def test_http_reward_contract(server, video) -> None:
    url, handler = server
    mix = build_rewards([{"http": url, "name": "svc"}])
    x = _images(video=video)
    combined, _ = mix(x, PROMPTS)
    torch.testing.assert_close(combined, _quantized_mean(x).float(), rtol=0, atol=1e-6)
    (request,) = handler.requests
    assert request["version"] == 1 and request["prompts"] == PROMPTS and len(request["images"]) == 3
    assert isinstance(request["images"][0], list) == video


@pytest.mark.parametrize(
    ("mode", "words"),
    [
        ("slow", "did not answer within 0.3 s"),
        ("malformed", "answered malformed JSON"),
        ("count", "answered 1 rewards for 3 samples"),
        ("status", "answered HTTP 503"),
    ],
)
def test_http_reward_failures_are_one_clear_line(server, mode, words) -> None:
    url, handler = server
    handler.mode = mode
    mix = build_rewards([{"http": url, "name": "svc", "timeout": 0.3}])
    started = time.monotonic()
    with pytest.raises(RewardError) as err:
        mix(_images(), PROMPTS)
    assert time.monotonic() - started < 1.2  # the timeout, not the server's 1.5 s
    message = str(err.value)
    assert message.startswith(f"reward 'svc': HTTP reward at {url}") and words in message and "\n" not in message


def test_unreachable_server(tmp_path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mix = build_rewards([{"http": f"http://127.0.0.1:{port}/score", "timeout": 2}])
    with pytest.raises(RewardError, match="cannot be reached"):
        mix(_images(), PROMPTS)


def test_an_unreachable_reward_server_stops_the_run_before_the_model(tiny_pipelines, tmp_path, capsys) -> None:
    """A server nobody runs is found when the rewards are built (a TCP connection, nothing sent), before the policy
    is built and before iteration 1: one line naming rewards[0].http, exit 2, no metrics."""
    import socket

    import yaml

    from runtime.rl.__main__ import main
    from tests.rl.common import rl_config

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, rewards=[{"http": url, "name": "svc"}])
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert main([str(tmp_path / "rl.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'rl.yaml'}:"), err  # the line of the rewards entry
    assert f"rewards[0].http: {url} cannot be reached (127.0.0.1:{port}: " in err, err
    assert "start the reward server before the run" in err and err.count("\n") == 1, err
    assert not (tmp_path / "log" / "metrics.jsonl").exists()


def test_job_stops_on_a_reward_timeout_and_keeps_its_checkpoint(server, tiny_pipelines, tmp_path, capsys) -> None:
    """Step 2's request times out: the run stops there (exit 2, one line), after step 1's checkpoint and metrics;
    nothing of step 2 was trained or written, and the checkpoint resumes."""
    import yaml

    from runtime.checkpoint.verify import verify_checkpoint
    from runtime.rl.__main__ import main
    from tests.rl.common import rl_config

    url, handler = server
    ckpt = tmp_path / "ckpt"
    raw = rl_config(
        "flux",
        tiny_pipelines("flux"),
        tmp_path,
        rewards=[{"http": url, "name": "svc", "timeout": 0.3}],
        checkpoint={"dir": str(ckpt), "interval": 1},
    )
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(raw))
    original = _Handler.do_POST

    def second_is_slow(self) -> None:
        if len(type(self).requests) == 1:
            type(self).mode = "slow"
        original(self)

    handler.do_POST = second_is_slow
    capsys.readouterr()
    assert main([str(tmp_path / "rl.yaml")]) == 2
    err = capsys.readouterr().err
    assert "reward 'svc': HTTP reward" in err and "did not answer within 0.3 s" in err and err.count("\n") == 1, err
    assert [p.name for p in sorted(ckpt.iterdir())] == ["step_000001"]
    verify_checkpoint(ckpt / "step_000001")
    assert len((tmp_path / "log" / "metrics.jsonl").read_text().splitlines()) == 1


# ---------------------------------------------------------------------------------------------------- CLIP


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clip")
    from runtime.rl.rewards.models import save_tiny_clip

    return {"clip": save_tiny_clip(root / "clip", 0), "pick": save_tiny_clip(root / "pick", 1)}


def _expected(path: Path, x: torch.Tensor, pickscore: bool) -> torch.Tensor:
    """The checkpoint's own forward: logits_per_image = exp(logit_scale) * cosine, its diagonal per (image, text)."""
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    from runtime.rl.rewards.http import to_uint8

    model = CLIPModel.from_pretrained(path).eval()
    images = [PIL.Image.fromarray(to_uint8(s)) for s in x]
    pixels = CLIPImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")["pixel_values"]
    tokens = AutoTokenizer.from_pretrained(path)(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(pixel_values=pixels, **tokens).logits_per_image.diagonal()
    return logits if pickscore else logits / model.logit_scale.exp()


def test_clip_and_pickscore_rewards(clips) -> None:
    x = _images(3)
    mix = build_rewards(
        [
            {"clip": str(clips["clip"]), "name": "clip", "batch_size": 2},
            {"pickscore": str(clips["pick"]), "processor": str(clips["pick"]), "name": "pick", "weight": 0.5},
        ]
    )
    combined, each = mix(x, PROMPTS)
    torch.testing.assert_close(each["clip"], _expected(clips["clip"], x, False), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(each["pick"], _expected(clips["pick"], x, True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(combined, each["clip"] + 0.5 * each["pick"])
    assert each["clip"].abs().max() <= 1 and not torch.equal(each["clip"], each["pick"])


def test_clip_reward_of_a_video_averages_its_frames(clips) -> None:
    x = _images(4, video=True)
    mix = build_rewards([{"clip": str(clips["clip"]), "name": "clip"}])
    _, each = mix(x, PROMPTS)
    per_frame = torch.stack([_expected(clips["clip"], x[:, :, f], False) for f in range(x.shape[2])])
    torch.testing.assert_close(each["clip"], per_frame.mean(dim=0), rtol=1e-5, atol=1e-6)
