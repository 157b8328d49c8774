"""Rewrite a wheel without the files a GPU check never loads (other CUDA releases' libraries, unused locales), so that
it fits the device tool's 64 MiB: the files matching --drop are left out unless they also match --keep; RECORD is
rewritten to list exactly what remains.

    python bench/gpu/slim_wheel.py WHEEL --keep REGEX --drop REGEX
"""

from __future__ import annotations

import argparse
import re
import zipfile
from pathlib import Path


def slim(wheel: Path, keep: str, drop: str) -> tuple[int, int]:
    """Replace `wheel` in place; return its size before and after."""
    before = wheel.stat().st_size
    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as target:
        kept = [i for i in source.infolist() if not re.search(drop, i.filename) or re.search(keep, i.filename)]
        for info in kept:
            data = source.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                names = {i.filename for i in kept}
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if line.split(",", 1)[0] in names) + "\n").encode()
            target.writestr(info, data)
    slimmed.replace(wheel)
    return before, wheel.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--keep", required=True, help="Files matching this are kept even when --drop matches.")
    parser.add_argument("--drop", required=True, help="Files matching this are left out.")
    args = parser.parse_args()
    before, after = slim(args.wheel, args.keep, args.drop)
    print(f"{args.wheel.name}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
