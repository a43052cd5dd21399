"""A reward served over HTTP (a reward model on other GPUs or machines, an OCR service...): one POST per iteration
and rank with the whole batch, JSON both ways, standard library only.

Contract (version 1). The request body::

    {"version": 1,
     "prompts": ["a cat", ...],                      # one per sample
     "images": ["<base64 PNG>", ...]}                # one per sample: an 8-bit RGB PNG of the decoded image;
                                                     # for videos a list of PNG frames per sample instead

The answer must be status 200 with the body ``{"rewards": [0.7, ...]}``: one finite number per sample, in order.
Anything else fails the iteration with one line naming the reward (``RewardError``): no complete answer within
``timeout`` seconds (default 60; a deadline for the whole request: connect, send, headers and body), a refused
connection, another status (2xx other than 200 and redirects included: a redirect is not followed), a body that is
not JSON, a missing ``rewards`` list, the wrong count, a value that is not a finite number. Nothing is trained on a
failed iteration.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import socket
import urllib.error
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch

from runtime.config.errors import ConfigError
from runtime.rl.rewards.transport import DeadlineExceeded, RedirectRefused, post, reachable

__all__ = ["DEFAULT_TIMEOUT", "HttpReward", "encode_png", "to_uint8"]

DEFAULT_TIMEOUT = 60.0
MAX_ANSWER_BYTES = 64 << 20  # an answer of rewards is small; more is not one
PROBE_SECONDS = 10.0  # the start-up connection probe's bound (a reward's own timeout when shorter)


class _Failed(Exception):
    pass


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """``(3, H, W)`` pixels in [-1, 1] as the ``(H, W, 3)`` 8-bit image a pipeline's ``output_type="pil"`` gives."""
    x = ((pixels.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return np.ascontiguousarray(x.permute(1, 2, 0).numpy())


def encode_png(pixels: torch.Tensor) -> str:
    buffer = io.BytesIO()
    PIL.Image.fromarray(to_uint8(pixels)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _payload(samples: torch.Tensor, prompts: Sequence[str]) -> bytes:
    if samples.ndim == 5:  # (B, 3, F, H, W) videos: a list of frames per sample
        images: list[Any] = [[encode_png(f) for f in sample.unbind(1)] for sample in samples]
    else:
        images = [encode_png(sample) for sample in samples]
    return json.dumps({"version": 1, "prompts": list(prompts), "images": images}).encode("utf-8")


@dataclass(frozen=True)
class HttpReward:
    url: str
    timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def from_spec(cls, url: str, spec: dict[str, Any], key: str) -> HttpReward:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{key}.http: {url!r} is not an http(s) URL")
        try:
            parts = urllib.parse.urlsplit(url)
            host, _ = parts.hostname, parts.port  # a port that is not a number raises here
        except ValueError as exc:
            raise ConfigError(f"{key}.http: {url!r}: {exc}; expected http://HOST:PORT/PATH") from None
        if not host:
            raise ConfigError(f"{key}.http: {url!r} names no host; expected http://HOST:PORT/PATH")
        timeout = spec.get("timeout", DEFAULT_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 3600:
            raise ConfigError(f"{key}.timeout: expected seconds in (0, 3600], found {timeout!r}")
        return cls(url, float(timeout))

    def probe(self) -> str | None:
        """Why the server cannot be reached (at most 10 s, within the reward's timeout); None when it can."""
        return reachable(self.url, min(self.timeout, PROBE_SECONDS))

    def _answer(self, body: bytes) -> bytes:
        headers = {"Content-Type": "application/json"}
        late = f"did not answer within {self.timeout:g} s (rewards[].timeout: the whole request's deadline)"
        try:
            answer = post(self.url, body, headers, self.timeout, MAX_ANSWER_BYTES)
        except DeadlineExceeded:
            raise _Failed(late) from None
        except RedirectRefused as exc:
            to = f" to {exc.location}" if exc.location else ""
            raise _Failed(
                f"answered HTTP {exc.status} {exc.reason} (a redirect{to}: not followed; set rewards[].http to the "
                f"URL that answers with status 200)"
            ) from None
        except urllib.error.HTTPError as exc:
            raise _Failed(f"answered HTTP {exc.code} {exc.reason}") from None
        except TimeoutError:
            raise _Failed(late) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, TimeoutError | socket.timeout):
                raise _Failed(late) from None
            raise _Failed(f"cannot be reached: {reason}") from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise _Failed(f"connection failed: {type(exc).__name__}: {exc}") from None
        if answer.status != 200:
            raise _Failed(f"answered HTTP {answer.status} {answer.reason}; the contract is status 200")
        if len(answer.body) > MAX_ANSWER_BYTES:
            raise _Failed(f"answered more than {MAX_ANSWER_BYTES} bytes")
        return answer.body

    def __call__(self, samples: torch.Tensor, prompts: Sequence[str]) -> list[float]:
        from runtime.rl.rewards import RewardError

        try:
            data = self._answer(_payload(samples, prompts))
            try:
                answer = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                raise _Failed(f"answered malformed JSON: {data[:80]!r}") from None
            values = answer.get("rewards") if isinstance(answer, dict) else None
            if not isinstance(values, list):
                raise _Failed(f'answered no "rewards" list: {str(answer)[:80]}')
            if len(values) != len(prompts):
                raise _Failed(f"answered {len(values)} rewards for {len(prompts)} samples")
            bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, int | float)), None)
            if bad is not None or not all(math.isfinite(v) for v in values):
                raise _Failed(f"answered a reward that is not a finite number: {bad if bad is not None else values}")
        except _Failed as exc:
            message = " ".join(str(exc).split())[:400]  # a server's words are one line here
            raise RewardError(f"HTTP reward at {self.url} {message}") from None
        return [float(v) for v in values]
