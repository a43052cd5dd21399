"""Tiny assets to experiment with, built here without a download: a tokenizer, a VLM or omni processor, a DiT
pipeline, a CLIP reward model.

    python -m runtime.tiny tokenizer out/tok              # byte-level BPE trained on the shipped corpus, ChatML
    python -m runtime.tiny processor qwen2_5_vl out/proc  # that tokenizer + the model's vision tokens, image processor
    python -m runtime.tiny pipeline flux out/flux         # a random diffusers pipeline (tiny transformer, VAE, ...)
    python -m runtime.tiny pipeline wan_a14b out/a14b     # Wan2.2 A14B's layout: two experts at boundary_ratio
    python -m runtime.tiny clip out/clip                  # a random CLIP checkpoint (rewards: [{clip: out/clip}])
    python -m runtime.tiny config qwen2_5_vl              # the tiny model.config of a model type, as YAML to paste

A random-init model trains with them (``data.tokenizer``, ``data.processor``, ``model.path``); they know nothing, so
what a run learns from them is only that it runs. Each command writes a new directory atomically (built beside it,
then renamed into place), with the list of the files it wrote (``.runtime-tiny.json``); an existing non-empty
directory is refused unless ``--overwrite``, and even then, before anything is built, when any file or folder in its
whole tree is not one that list names (a user's notes in a subfolder included). A bad argument is one line on stderr
and exit code 2. The builders are
the ones the tests and demos use (``runtime.data.text.tokenization.build_test_tokenizer``,
``runtime.data.vision.processor.build_test_processor``, ``runtime.data.audio.processor.build_omni_test_processor``,
``runtime.diffusion.tiny_pipelines.save_tiny_pipeline``, ``runtime.rl.rewards.models.save_tiny_clip``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

MANIFEST = ".runtime-tiny.json"  # the files an output holds, written by this command: what --overwrite may replace
A14B_BOUNDARY = 0.875  # Wan2.2-T2V-A14B's boundary_ratio: transformer denoises t >= 875, transformer_2 the rest
EXTRA_PIPELINES = ("wan_a14b",)  # tiny pipelines built here, beside the specs' cases
MIN_VOCAB, MAX_VOCAB = 300, 1 << 20  # 256 byte tokens + the special tokens + some merges; a "tiny" bound above
DEFAULT_VOCAB = 512

__all__ = [
    "TinyError",
    "main",
    "model_config",
    "processor_types",
    "write_clip",
    "write_pipeline",
    "write_processor",
    "write_tokenizer",
]


class TinyError(ValueError):
    """A request this command refuses; the message is one line."""


def processor_types() -> dict[str, str]:
    """Model type -> ``"vlm"`` or ``"omni"``: the types whose spec names a processor."""
    from runtime.models.registry import REGISTRY

    kinds = {}
    for name, entry in REGISTRY.items():
        if entry.family == "omni" and "processor_class" in entry.data:
            kinds[name] = "omni"
        elif entry.is_vlm and "processor" in entry.data:
            kinds[name] = "vlm"
    return dict(sorted(kinds.items()))


def pipeline_cases() -> list[str]:
    """The tiny DiT pipelines (a DiT's model type, or ``<model_type>_<variant>``)."""
    from runtime.diffusion.registry import tiny_cases

    return sorted([*tiny_cases(), *EXTRA_PIPELINES])


def save_wan_a14b(directory: Path, seed: int = 0) -> Path:
    """A tiny Wan2.2 A14B: a ``WanPipeline`` whose two random Wan experts (the ``wan`` spec's tiny config) switch at
    ``boundary_ratio`` (``transformer``: high noise, ``transformer_2``: low noise), as ``transformer_2`` expects."""
    import torch
    from diffusers import WanPipeline

    from runtime.diffusion.conditions.wan import WanConditionModel
    from runtime.diffusion.registry import lookup_dit, tiny_config

    config = tiny_config("wan", None)
    torch.manual_seed(seed)
    components = WanConditionModel.tiny_components(config, None)
    upstream = lookup_dit("wan").upstream_class()
    components["transformer"], components["transformer_2"] = upstream(**config), upstream(**config)
    WanPipeline(**components, boundary_ratio=A14B_BOUNDARY).save_pretrained(directory)
    return directory


def _tree(directory: Path) -> tuple[list[str], list[str]]:
    """(files, folders) under ``directory`` as relative POSIX paths; a link or special file counts as a file."""
    files, folders = [], []
    for root, dirs, names in os.walk(directory):
        here = Path(root).relative_to(directory)
        for name in list(dirs):
            if os.path.islink(os.path.join(root, name)):  # never followed: listed as what it is, a link
                dirs.remove(name)
                names.append(name)
            else:
                folders.append((here / name).as_posix())
        files += [(here / name).as_posix() for name in names]
    return sorted(files), sorted(folders)


def _foreign(directory: Path) -> list[str]:
    """What ``directory`` holds that no earlier output of this command wrote: every file, link or folder in its
    whole tree that its ``MANIFEST`` does not name (everything, when there is none)."""
    import json

    try:
        written = set(json.loads((directory / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        written = set()
    ours = {MANIFEST} | written if written else set()
    parents = {p.as_posix() for f in ours for p in Path(f).parents if p.as_posix() != "."}
    files, folders = _tree(directory)
    regular = {f for f in files if not os.path.islink(directory / f) and (directory / f).is_file()}
    return [f for f in files if f not in ours or f not in regular] + [d for d in folders if d not in parents]


def _refuse_foreign(directory: Path) -> None:
    foreign = _foreign(directory)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise TinyError(f"{directory} holds files this command does not write ({shown}); choose another directory")


def _check_target(directory: Path, overwrite: bool) -> None:
    if directory.parent == directory:
        raise TinyError(f"{directory} is the file system root")
    if directory.exists() or directory.is_symlink():
        if not directory.is_dir():
            raise TinyError(f"{directory} exists and is not a directory; choose a new directory")
        if any(directory.iterdir()):
            if not overwrite:
                raise TinyError(f"{directory} is not empty; pass --overwrite to replace it, or choose a new directory")
            _refuse_foreign(directory)  # before the build: a refusal costs no model build


def _write(directory: str | os.PathLike, build: Callable[[Path], Any], overwrite: bool) -> Path:
    """Build into a fresh sibling directory, then move it to ``directory`` (replacing an earlier output)."""
    out = Path(os.path.abspath(directory))
    _check_target(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as exc:
        raise TinyError(f"cannot write {out}: {exc.strerror or exc}") from None
    try:
        _build_and_move(out, tmp, build)
    except OSError as exc:
        raise TinyError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _build_and_move(out: Path, tmp: Path, build: Callable[[Path], Any]) -> None:
    import json

    build(tmp)
    files, _ = _tree(tmp)
    (tmp / MANIFEST).write_text(json.dumps({"written_by": "python -m runtime.tiny", "files": files}, indent=1))
    if out.exists():
        _refuse_foreign(out)  # again: a file added while the build ran
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, old / out.name)
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out)


def write_tokenizer(directory: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB, overwrite: bool = False) -> Path:
    """A byte-level BPE with ``vocab_size`` tokens (special tokens included) trained on the shipped corpus: pad, bos,
    eos (``<|endoftext|>``), ChatML's ``<|im_start|>``/``<|im_end|>`` and a ChatML chat template."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise TinyError(f"--vocab-size: {vocab_size} is outside [{MIN_VOCAB}, {MAX_VOCAB}]")
    from runtime.data.text.corpus import corpus_path
    from runtime.data.text.tokenization import build_test_tokenizer

    corpus = corpus_path().read_text(encoding="utf-8")
    return _write(directory, lambda tmp: build_test_tokenizer(tmp, corpus, vocab_size), overwrite)


def write_processor(
    model_type: str, directory: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB, overwrite: bool = False
) -> Path:
    """The tiny processor of ``model_type`` (a VLM or omni type): the tokenizer above with the model's special
    tokens, a PIL image processor with the tiny config's patch sizes (omni: also a Whisper feature extractor)."""
    kinds = processor_types()
    if model_type not in kinds:
        raise TinyError(f"model type {model_type!r} has no processor; known: {', '.join(kinds)}")
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise TinyError(f"--vocab-size: {vocab_size} is outside [{MIN_VOCAB}, {MAX_VOCAB}]")
    if kinds[model_type] == "omni":
        from runtime.data.audio.processor import build_omni_test_processor as build
    else:
        from runtime.data.vision.processor import build_test_processor as build
    return _write(directory, lambda tmp: build(tmp, model_type, vocab_size=vocab_size), overwrite)


def write_pipeline(case: str, directory: str | os.PathLike, seed: int = 0, overwrite: bool = False) -> Path:
    """The random diffusers pipeline of tiny case ``case`` (``pipeline_cases()``), saved with ``save_pretrained``."""
    cases = pipeline_cases()
    if case not in cases:
        raise TinyError(f"unknown tiny pipeline {case!r}; known: {', '.join(cases)}")
    if not 0 <= seed < 1 << 63:
        raise TinyError(f"--seed: {seed} is outside [0, 2**63)")
    if case == "wan_a14b":
        return _write(directory, lambda tmp: save_wan_a14b(tmp, seed), overwrite)
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    return _write(directory, lambda tmp: save_tiny_pipeline(case, tmp, seed), overwrite)


def write_clip(directory: str | os.PathLike, seed: int = 0, overwrite: bool = False) -> Path:
    """A random CLIP checkpoint (model, tokenizer, 32 px image processor) saved with transformers: a ``clip`` or
    ``pickscore`` reward of an RL run loads it through the same code as a real one."""
    if not 0 <= seed < 1 << 63:
        raise TinyError(f"--seed: {seed} is outside [0, 2**63)")
    from runtime.rl.rewards.models import save_tiny_clip

    return _write(directory, lambda tmp: save_tiny_clip(tmp, seed), overwrite)


def model_config(model_type: str, vocab_size: int = DEFAULT_VOCAB) -> dict[str, Any]:
    """The ``model:`` section of a random-init run of ``model_type`` at its spec's tiny size (``[model.tiny]``), its
    vocabulary (a VLM's text config's) sized for a tiny tokenizer or processor of ``vocab_size`` tokens."""
    from runtime.models.registry import REGISTRY
    from runtime.models.tiny_configs import tiny_config_dict

    entry = REGISTRY.get(model_type)
    if entry is None or entry.family == "dit":
        known = sorted(name for name, e in REGISTRY.items() if e.family != "dit")
        raise TinyError(f"model type {model_type!r} has no tiny run config; known: {', '.join(known)}")
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise TinyError(f"--vocab-size: {vocab_size} is outside [{MIN_VOCAB}, {MAX_VOCAB}]")
    config = tiny_config_dict(model_type)
    text = config.get("text_config", config)
    for table in (config, text):
        table.pop("use_cache", None)  # the trainer turns the cache off itself
    if entry.is_vlm:  # the media token ids come from the processor's tokenizer (runtime/train/data.py)
        for key in [k for k in config if k.endswith("_token_id")]:
            del config[key]
    text["vocab_size"] = vocab_size
    return {"type": model_type, "config": config}


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (``error: ...; see --help``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message}; see --help", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m runtime.tiny",
        description=__doc__.split("\n\n")[0],
        epilog="Run `python -m runtime.tiny <command> --help` for a command's arguments.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="command")
    tok = commands.add_parser("tokenizer", help="a tiny byte-level BPE tokenizer (data.tokenizer of a text model)")
    tok.add_argument("directory", type=Path, help="where to write it (new or empty, unless --overwrite)")
    tok.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help=f"tokens in all (default {DEFAULT_VOCAB})")
    proc = commands.add_parser("processor", help="a tiny VLM or omni processor (data.processor)")
    proc.add_argument("model_type", help="a VLM or omni model type: " + ", ".join(processor_types()))
    proc.add_argument("directory", type=Path, help="where to write it (new or empty, unless --overwrite)")
    proc.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help=f"tokens in all (default {DEFAULT_VOCAB})")
    pipe = commands.add_parser("pipeline", help="a tiny random DiT pipeline directory (model.path of a DiT run)")
    pipe.add_argument("case", help="a tiny case: " + ", ".join(pipeline_cases()))
    pipe.add_argument("directory", type=Path, help="where to write it (new or empty, unless --overwrite)")
    pipe.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    clip = commands.add_parser("clip", help="a tiny random CLIP checkpoint (a clip/pickscore reward of an RL run)")
    clip.add_argument("directory", type=Path, help="where to write it (new or empty, unless --overwrite)")
    clip.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    conf = commands.add_parser("config", help="the tiny model section of a model type's run config, as YAML")
    conf.add_argument("model_type", help="a text, VLM or omni model type")
    conf.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="the tokenizer's (default: as above)")
    for sub in (tok, proc, pipe, clip):
        sub.add_argument("--overwrite", action="store_true", help="replace an earlier output of this command")
    return parser


_NEXT = {
    "tokenizer": "set data.tokenizer: {path} (and model.config.vocab_size >= {vocab})",
    "processor": "set data.processor: {path} (and the text config's vocab_size >= {vocab})",
    "pipeline": "set model.path: {path}{expert}",
    "clip": "use it as a reward: rewards: [{{clip: {path}}}]",
}


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (0, or 2 for a refused request)."""
    args = _parser().parse_args(argv)
    if args.command == "config":
        try:
            section = model_config(args.model_type, args.vocab_size)
        except TinyError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        import yaml

        print(yaml.safe_dump({"model": section}, sort_keys=False), end="")
        return 0
    try:
        if args.command == "tokenizer":
            path = write_tokenizer(args.directory, args.vocab_size, args.overwrite)
        elif args.command == "processor":
            path = write_processor(args.model_type, args.directory, args.vocab_size, args.overwrite)
        elif args.command == "pipeline":
            path = write_pipeline(args.case, args.directory, args.seed, args.overwrite)
        else:
            path = write_clip(args.directory, args.seed, args.overwrite)
    except TinyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    vocab = getattr(args, "vocab_size", None)
    two = getattr(args, "case", "") == "wan_a14b"  # two experts: the job trains one
    expert = " and dit.condition.expert: transformer or transformer_2" if two else ""
    after = _NEXT[args.command].format(path=path, vocab=vocab, expert=expert)
    print(f"wrote a tiny {args.command} to {path}; {after}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
