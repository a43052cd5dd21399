"""The experiment trackers of ``log.report_to`` behind one small interface, each through its own library:

* ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` writing ``<log.dir>/tb``; the run config as a text
  summary; a PNG as an image, a video as its frames side by side (``add_images``: ``add_video`` needs moviepy).
* ``wandb``: ``wandb.init(project=log.project, name=run_name, dir=log.dir, config=<run config>)``; it honours
  ``WANDB_MODE`` (``offline`` writes ``<log.dir>/wandb/offline-run-*``, ``wandb sync`` uploads it later) and
  ``WANDB_API_KEY``; images as ``wandb.Image``, MP4 as ``wandb.Video``.
* ``mlflow``: ``MlflowClient`` on ``MLFLOW_TRACKING_URI``, or a file store at ``<log.dir>/mlruns`` when it is unset;
  experiment ``log.project``, the run config flattened into params, files as run artifacts; metric names with
  ``.`` for ``/`` (``reward.clip``: the file store cannot hold both ``reward`` and ``reward/clip``).

MLflow 3 keeps its file store in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE=true``; the
database stores (``sqlite:///...``) need the full ``mlflow`` package, which ``mlflow-skinny`` (our extra) is not.
So for a ``file:`` store (the default) the backend opts in to the file store (``MLFLOW_ALLOW_FILE_STORE``, when the
environment does not already say), and any other URI (a server, a database) is used as given. A server
(``http(s)://``) is first reached with one plain TCP connect of at most ``PROBE_SECONDS`` (through the proxy the
environment names for it, if any): MLflow's client retries a refused connection for about 270 s
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` 7 with ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR`` 2) before it says anything, and
those retries are left as they are for the calls of a running run, where a server that hiccups should be waited for.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Tracker", "Trackers", "open_tracker"]

VIDEO_SUFFIXES = (".mp4",)


class Tracker(Protocol):
    """One experiment tracker of a run (rank 0 only)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_file(self, tag: str, path: Path, step: int) -> None:
        """A PNG image or an MP4 video written under the run directory (a plot, a validation sample)."""

    def close(self, failed: bool = False) -> None:
        """End the run (``failed``: marked as such where the tracker has a run status)."""


def _image_array(path: Path) -> Any:
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def _video_frames(path: Path) -> Any:
    """The frames of a video file, ``[frames, height, width, 3]`` uint8, decoded with PyAV."""
    import av
    import numpy as np

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def _as_markdown_code(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


class TensorBoardTracker:
    def __init__(self, log_dir: Path, run_config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir / "tb"))
        text = json.dumps(dict(run_config), indent=2, default=str)
        self.writer.add_text("run_config", _as_markdown_code(text), 0)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_file(self, tag: str, path: Path, step: int) -> None:
        if path.suffix in VIDEO_SUFFIXES:
            self.writer.add_images(tag, _video_frames(path), step, dataformats="NHWC")
        else:
            self.writer.add_image(tag, _image_array(path), step, dataformats="HWC")

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, log_dir: Path, project: str, run_name: str, run_config: Mapping[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        # WANDB_MODE read at each run's start (wandb's process-wide settings keep the first run's otherwise)
        mode = os.environ.get("WANDB_MODE") or None
        self.run = wandb.init(project=project, name=run_name, dir=str(log_dir), config=dict(run_config), mode=mode)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_file(self, tag: str, path: Path, step: int) -> None:
        media = self.wandb.Video(str(path)) if path.suffix in VIDEO_SUFFIXES else self.wandb.Image(str(path))
        self.run.log({tag: media}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested run config as MLflow params: dotted keys, values as text."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = str(value)
    return out


def mlflow_key(key: str) -> str:
    """MLflow's name of a metric: ``/`` becomes ``.`` (the file store keeps ``reward`` as a file, so it cannot also
    hold ``reward/clip`` under it)."""
    return key.replace("/", ".")


def mlflow_uri(log_dir: Path) -> str:
    """``MLFLOW_TRACKING_URI`` when set, else the file store ``<log.dir>/mlruns``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (log_dir / "mlruns").resolve().as_uri()


PROBE_SECONDS = 5.0  # a tracking server that does not accept a TCP connection in this long is not there


def probe_server(uri: str, timeout: float = PROBE_SECONDS) -> None:
    """Connect once to the host of an ``http(s)://`` tracking URI (or to the proxy the environment names for it);
    a ``ConnectionError`` naming the URI if that fails, in at most ``timeout`` seconds. Other URIs: nothing to do."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    target = parts
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        target = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    try:
        address = (target.hostname or "", target.port or (443 if target.scheme == "https" else 80))
        with socket.create_connection(address, timeout=timeout):
            pass
    except (OSError, ValueError) as exc:  # refused, unreachable, unknown host, timed out; a port that is no number
        via = f" through the proxy {proxy}" if target is not parts else ""
        raise ConnectionError(
            f"cannot connect to the MLflow tracking server {uri} (MLFLOW_TRACKING_URI){via} within {timeout:g} s: "
            f"{getattr(exc, 'strerror', None) or exc}"
        ) from None


class MlflowTracker:
    def __init__(self, log_dir: Path, project: str, run_name: str, run_config: Mapping[str, Any]) -> None:
        self.log_dir = log_dir.resolve()
        uri = mlflow_uri(log_dir)
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # see the module docstring
        probe_server(uri)  # seconds, not MLflow's 270 s of retries, when no server is there
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self.Metric = Metric
        self.client = MlflowClient(uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in flat_params(run_config).items()]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [self.Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_file(self, tag: str, path: Path, step: int) -> None:
        """The file as an artifact, under its directory relative to the run directory (``samples/step_4``)."""
        folder = path.resolve().parent
        inside = folder.is_relative_to(self.log_dir) and folder != self.log_dir
        where = folder.relative_to(self.log_dir).as_posix() if inside else None
        self.client.log_artifact(self.run_id, str(path), artifact_path=where)

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def open_tracker(name: str, log_dir: Path, project: str, run_name: str, run_config: Mapping[str, Any]) -> Tracker:
    if name == "tensorboard":
        return TensorBoardTracker(log_dir, run_config)
    if name == "wandb":
        return WandbTracker(log_dir, project, run_name, run_config)
    if name == "mlflow":
        return MlflowTracker(log_dir, project, run_name, run_config)
    raise ValueError(f"unknown tracker {name!r}")


class Trackers:
    """The trackers of a run; every call goes to each of them."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        numbers = {k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, int | float)}
        if numbers:
            for tracker in self.trackers:
                tracker.log_metrics(numbers, step)

    def log_file(self, tag: str, path: Path, step: int) -> None:
        for tracker in self.trackers:
            tracker.log_file(tag, path, step)

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed)
        self.trackers = []
