"""Screenshots of an HTML report in a real headless browser, at 1400 and 800 px wide: how `oneiter compare --html`
looks to a person (tests check the page's DOM and CSS; this is for eyes).

    python tools/report_screenshots.py report.html --out shots/         # shots/report-1400.png, report-800.png
    python tools/report_screenshots.py --demo --out shots/              # records a small bf16 replay with a fault
                                                                        # first, then shoots its report

Needs Chromium (Debian: `apt-get install chromium`; or set CHROMIUM to its path). CI machines do not have it: no
test runs this. What to look for at 800 px: the banner's lines wrap, the plot scales down, the table scrolls
sideways in its own box and no entry name or number wraps; "divergent only" leaves the flagged rows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WIDTHS = (1400, 800)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


def chromium() -> str:
    found = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser") or \
        shutil.which("google-chrome")
    if not found:
        sys.exit("error: no Chromium found: apt-get install chromium, or set CHROMIUM")
    return found


def shoot(page: Path, out_dir: Path, widths=WIDTHS, height: int = 2000) -> list[Path]:
    """One PNG per width, each from a fresh browser profile (nothing of a previous run is reused)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shots = []
    for width in widths:
        png = out_dir / f"{page.stem}-{width}.png"
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                            f"--screenshot={png}", page.resolve().as_uri()], check=True, capture_output=True,
                           timeout=120)
        shots.append(png)
    return shots


def demo_report(folder: Path) -> Path:
    """A small ResNet-18 reference and a bf16 replay with a 5 % fault, compared into folder/report.html."""
    folder.mkdir(parents=True, exist_ok=True)
    oneiter = [sys.executable, "-m", "oneiter"]
    ref, tgt, page = folder / "ref.h5", folder / "tgt.h5", folder / "report.html"
    small = ["--model-arg", "image_size=32", "-b", "2", "-q", "--force"]
    subprocess.run([*oneiter, "record", "-m", "resnet18", *small, "-o", str(ref)], check=True)
    subprocess.run([*oneiter, "record", "--replay", str(ref), "--amp", "bf16", "--inject-fault", "layer3.1.conv2",
                    "-q", "--force", "-o", str(tgt)], check=True)
    subprocess.run([*oneiter, "compare", str(ref), str(tgt), "--html", str(page)], stdout=subprocess.DEVNULL)
    return page


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("page", nargs="?", type=Path, help="an HTML report (oneiter compare --html)")
    parser.add_argument("--demo", action="store_true", help="make a small faulted bf16 report first")
    parser.add_argument("--out", type=Path, default=Path("shots"))
    args = parser.parse_args()
    if args.demo == (args.page is not None):
        parser.error("give a report page, or --demo")
    page = demo_report(args.out) if args.demo else args.page
    for png in shoot(page, args.out):
        print(png)


if __name__ == "__main__":
    main()
