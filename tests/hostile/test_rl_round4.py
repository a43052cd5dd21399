"""Hostile rewards for ``python -m runtime.rl`` (round 4).

Rules checked here: ``rewards[].timeout`` of an HTTP reward bounds the whole request (a server dripping its answer
a byte at a time fails the iteration at the timeout, not minutes later); the answer is accepted only with status 200
(another status, a redirect among them, is one line naming it); a callable reward that raises ``SystemExit`` fails
the run (exit 2, one line naming the reward) instead of ending it with exit 0; a ``callable:`` target that is not
``package.module:function`` is one line naming the rewards entry. Every server here binds 127.0.0.1 and stops by
itself within seconds.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml

from runtime.config.errors import ConfigError
from runtime.rl.rewards import RewardError, build_rewards

PROMPTS = ["a red kite", "a blue boat", "a green hill"]
ANSWER = json.dumps({"rewards": [0.1, 0.2, 0.3]}).encode()


def _images() -> torch.Tensor:
    return torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1


def _one_line(err: pytest.ExceptionInfo, *needles: str) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# ------------------------------------------------------------------------------------------- rewards called here


def exits_zero(samples: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """A reward that ends the process "successfully" (sys.exit(0) in a user's scoring script)."""
    raise SystemExit(0)


def exits_three(samples: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    raise SystemExit(3)


class ExitsWhenBuilt:
    """A class reward whose constructor calls sys.exit."""

    def __init__(self) -> None:
        raise SystemExit("no GPU for the reward model")

    def __call__(self, samples: torch.Tensor, prompts: list[str]) -> list[float]:  # pragma: no cover
        return [0.0] * len(prompts)


# ---------------------------------------------------------------------------------------------------- servers


@contextmanager
def _dripping_server(answer: bytes, fast: int, seconds: float) -> Iterator[str]:
    """A loopback server that reads a request, sends ``answer[:fast]`` at once and then the rest one byte at a time,
    spread over ``seconds`` (each byte well within any per-read timeout). Stops by itself after ``seconds`` + 2."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.1)
    stop = threading.Event()
    delay = seconds / max(1, len(answer) - fast)
    end = time.monotonic() + seconds + 2

    def serve() -> None:
        while not stop.is_set() and time.monotonic() < end:
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(0.5)
                try:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(65536)
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = next(
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    )
                    while len(body) < length:
                        body += conn.recv(65536)
                    conn.sendall(answer[:fast])
                    for byte in answer[fast:]:
                        if stop.is_set() or time.monotonic() > end:
                            break
                        conn.sendall(bytes([byte]))
                        time.sleep(delay)
                except OSError:
                    continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/score"
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def _response(status: str = "200 OK", body: bytes = ANSWER) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


@pytest.mark.parametrize("fast", ["nothing", "headers"], ids=["dripped-headers", "dripped-body"])
def test_http_timeout_is_a_deadline_for_the_whole_request(fast: str) -> None:
    """Each byte comes 0.1 s after the last (a per-read timeout never fires) and the whole answer would take over
    10 s; the 1 s timeout still ends the request. The margin is generous (a loaded 2-core machine)."""
    answer = _response(body=ANSWER + b" " * 120)  # JSON may end in white space: a long, valid body
    split = 0 if fast == "nothing" else answer.index(b"\r\n\r\n") + 4
    with _dripping_server(answer, split, 0.1 * (len(answer) - split)) as url:
        mix = build_rewards([{"http": url, "name": "svc", "timeout": 1}])
        started = time.monotonic()
        with pytest.raises(RewardError) as err:
            mix(_images(), PROMPTS)
        took = time.monotonic() - started
    assert took < 1 + 4, took  # the timeout, not the server's 10+ s
    _one_line(err, f"reward 'svc': HTTP reward at {url}", "did not answer within 1 s")


class _Answer(BaseHTTPRequestHandler):
    status = 200
    location: str | None = None

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(type(self).status)
        if type(self).location is not None:
            self.send_header("Location", type(self).location)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    do_GET = do_POST  # urllib turns a redirected POST into a GET


@contextmanager
def _server(status: int, location: str | None = None) -> Iterator[str]:
    handler = type("Handler", (_Answer,), {"status": status, "location": location})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    if location == "self":
        handler.location = url
    try:
        yield url
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_http_status_other_than_200_is_refused() -> None:
    """The contract (docs/flowgrpo.md): status 200. A 201 with a well-formed body is still another status."""
    with _server(201) as url:
        with pytest.raises(RewardError) as err:
            build_rewards([{"http": url, "name": "svc"}])(_images(), PROMPTS)
    _one_line(err, "answered HTTP 201")


@pytest.mark.parametrize("status", [302, 307])
def test_http_redirect_loop_is_one_line(status: int) -> None:
    with _server(status, "self") as url:
        with pytest.raises(RewardError) as err:
            build_rewards([{"http": url, "name": "svc", "timeout": 5}])(_images(), PROMPTS)
    _one_line(err, f"reward 'svc': HTTP reward at {url}", f"answered HTTP {status}")


def test_http_200_still_accepted() -> None:
    with _server(200) as url:
        combined, _ = build_rewards([{"http": url, "name": "svc"}])(_images(), PROMPTS)
    assert combined.tolist() == pytest.approx([0.1, 0.2, 0.3])


# ------------------------------------------------------------------------------------------ callable rewards


@pytest.mark.parametrize("target", ["exits_zero", "exits_three"])
def test_a_reward_calling_sys_exit_is_a_failed_reward(target: str) -> None:
    mix = build_rewards([{"callable": f"tests.hostile.test_rl_round4:{target}", "name": "mine"}])
    with pytest.raises(RewardError) as err:
        mix(_images(), PROMPTS)
    _one_line(err, "reward 'mine'", "SystemExit")


def test_a_reward_class_calling_sys_exit_when_built_is_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        build_rewards([{"callable": "tests.hostile.test_rl_round4:ExitsWhenBuilt"}])
    _one_line(err, "rewards[0]", "SystemExit", "no GPU for the reward model")


def test_a_reward_module_failing_at_import_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "round4_exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "round4_raises_on_import.py").write_text("raise ValueError('bad\\nsetup')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("round4_exits_on_import", "round4_raises_on_import"):
        with pytest.raises(ConfigError) as err:
            build_rewards([{"callable": f"{module}:score"}])
        _one_line(err, "rewards[0].callable", module)


@pytest.mark.parametrize("target", ["./my.py:fn", ".mod:fn", "mod/sub:fn", "..:fn", "my.py:", "pkg.mod:fn()", " a:b"])
def test_a_path_like_callable_target_is_one_line(target: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_rewards([{"callable": target}])
    _one_line(err, "rewards[0].callable", "package.module:function")


@pytest.fixture(scope="module")
def flux_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    return save_tiny_pipeline("flux", tmp_path_factory.mktemp("round4") / "flux")


def test_sys_exit_in_a_reward_fails_the_run(flux_pipeline: Path, tmp_path: Path, capsys) -> None:
    """End to end: exit 2 and one line naming the reward; nothing logged as trained."""
    from runtime.rl.__main__ import main
    from tests.rl.common import rl_config

    raw = rl_config(
        "flux",
        flux_pipeline,
        tmp_path,
        rewards=[{"callable": "tests.hostile.test_rl_round4:exits_zero", "name": "mine"}],
    )
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    capsys.readouterr()
    code = main([str(path)])
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and "reward 'mine'" in err and "SystemExit" in err, err
    metrics = tmp_path / "log" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()
