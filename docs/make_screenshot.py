"""Regenerate ``docs/dashboard.png``: the gradwatch dashboard of the demo's runs at gradwatch's defaults, in a real
TensorBoard, in headless Chromium.

    python docs/make_screenshot.py [--out docs/dashboard.png] [--steps 600] [--every N]

Trains the demo's healthy model and its wrong custom backward (``gradwatch demo``'s default runs) for 600 steps with
``GradWatch()`` at its defaults (``--every`` sets a cadence instead) into a temporary directory: a check of each kind
at step 1, then every 500 steps as far as the 1% budget allows, so most charts hold one point per run, as a user's
first run does. It serves the directory with ``tensorboard``, opens the Custom Scalars tab in ``chromium --headless``
(Debian's ``apt-get install chromium``) without smoothing (TensorBoard's default 0.6 would blend each check with the
ones before it), waits until every gradwatch chart lists its tags, and saves the page (tall enough for every section):
a healthy run (relative error near 1e-7, verdict 0) beside a run with a wrong backward (relative error near 1e-2,
verdict 2). With Pillow installed the PNG is reduced to a 256-colour palette to keep the repository small.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the server and browser drivers the end-to-end tests use

from tensorboard_browser import HeadlessChromium, TensorBoardServer, find_chromium  # noqa: E402

from gradwatch.cli.demo import RUNS, train  # noqa: E402
from gradwatch.tensorboard.dashboard import REL_ERROR_TAGS, SECTIONS, layout_tags  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=None, help="a cadence of checks (default: GradWatch's)")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--height", type=int, default=2950)
    args = parser.parse_args(argv)
    binary = find_chromium()
    if binary is None:
        print("needs chromium (apt-get install chromium)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as logdir:
        for name in ("none", "rmsnorm"):
            train(RUNS[name], Path(logdir), args.steps, args.every, progress_bar=False)
        with TensorBoardServer(Path(logdir)) as server:
            server.wait_for("/data/plugin/custom_scalars/layout", lambda layout: bool(layout.get("category")))
            with HeadlessChromium(binary, width=args.width, height=args.height) as browser:
                browser.open(f"{server.url}/#custom_scalars&_smoothingWeight=0")
                drawn = [REL_ERROR_TAGS[0], *(tag for tag in layout_tags() if tag not in REL_ERROR_TAGS)]
                browser.wait_for_text(
                    [title for _, charts in SECTIONS for title, _, _ in charts]
                    + [f"{tag} ({RUNS[name].run_name}/version_0)" for name in ("none", "rmsnorm") for tag in drawn],
                    timeout=300,  # TensorBoard loads each chart's data in turn: slow on a busy machine
                )
                time.sleep(2)  # let the charts finish drawing
                browser.screenshot(args.out)
    try:
        from PIL import Image
    except ImportError:
        print("Pillow not installed: the PNG is kept as Chromium wrote it")
    else:
        with Image.open(args.out) as image:
            image.convert("RGB").quantize(colors=256).save(args.out, optimize=True)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
