"""``python -m bench.gpu_check.pin_wheels STAGE DEST EXPECTED``: move the wheels ``make gpu-wheels`` downloaded into
``STAGE`` to ``DEST`` (``.whl/``), pinned by hash, in place of what was there.

The lent GPU machine installs what the checkout carries; without pins it would install any ``*.whl`` it finds there
(a stale wheel of an earlier pin list, a damaged or swapped file). So: exactly ``EXPECTED`` wheels (one per pin),
each a readable zip; the old wheels and the old pin file of ``DEST`` removed (nothing else there is touched); and
``DEST/requirements.txt``, one ``name==version --hash=sha256:...`` line per wheel, written last and atomically, for

    python3 -m pip install --require-hashes --no-index --find-links .whl --no-deps -r .whl/requirements.txt ...

which refuses a wheel whose bytes are not the ones downloaded here. A failed check leaves ``DEST`` as it was.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

PINS = "requirements.txt"


def pin_line(wheel: Path) -> str:
    """``name==version --hash=sha256:<digest>`` of a wheel file (name and version from its file name: the wheel
    spec escapes every ``-`` inside them, so the first two ``-``-separated fields are they)."""
    name, version = wheel.name.split("-")[:2]
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return f"{name}=={version} --hash=sha256:{digest}"


def wheel_problems(wheels: list[Path], expected: int) -> list[str]:
    """Why the downloaded ``wheels`` cannot be carried: not one per pin, or a file that is no readable zip."""
    problems = []
    if len(wheels) != expected:
        problems.append(f"{len(wheels)} wheels downloaded, expected {expected} (one per pin)")
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as exc:
            bad = str(exc)
        if bad is not None:
            problems.append(f"{wheel.name}: not a readable wheel ({bad})")
    return problems


def replace_wheels(stage: Path, dest: Path, expected: int) -> list[str]:
    """Check the wheels of ``stage``, then make them (and their pin file) ``dest``'s only wheels; the problems
    found instead, with ``dest`` untouched."""
    wheels = sorted(stage.glob("*.whl"))
    problems = wheel_problems(wheels, expected)
    if problems:
        return problems
    lines = [pin_line(wheel) for wheel in wheels]
    dest.mkdir(parents=True, exist_ok=True)
    (dest / PINS).unlink(missing_ok=True)  # first: a half-replaced folder has no pins, and installs nothing
    for stale in dest.glob("*.whl"):
        stale.unlink()
    for wheel in wheels:
        shutil.move(wheel, dest / wheel.name)
    with tempfile.NamedTemporaryFile("w", dir=dest, prefix=f".{PINS}.", delete=False) as out:
        out.write("\n".join(lines) + "\n")
    os.replace(out.name, dest / PINS)
    return []


def main(argv: list[str]) -> int:
    stage, dest, expected = Path(argv[0]), Path(argv[1]), int(argv[2])
    problems = replace_wheels(stage, dest, expected)
    for problem in problems:
        print(f"error: make gpu-wheels: {problem}; {dest} left as it was", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
