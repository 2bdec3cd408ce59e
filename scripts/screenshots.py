"""Screenshots and layout checks of the documentation site at 1280 px and 390 px (a phone).

Builds the site (``mkdocs build``, unless ``--site`` names a built one), serves it on
127.0.0.1, and with headless Chromium:

- takes a screenshot of each page in ``PAGES`` at each width in ``WIDTHS`` (into ``--out``),
  to look at;
- loads each page in a frame of that width and measures, in the page itself: the navbar's
  height (one row: at most ``MAX_NAVBAR`` px), whether the page is wider than the screen
  (nothing may push it sideways: wide tables and code scroll in their own box), and, for a
  link to an anchor, whether the heading lands below the sticky navbar rather than under it
  (from the scroll margins the page sets, which is where the browser puts it).

Prints one JSON line per check and exits 1 if any fails. Used by tests/test_docs.py when
Chromium is installed::

    python scripts/screenshots.py --out /tmp/shots          # build, shoot, check
    python scripts/screenshots.py --site site --out shots   # an already built site
"""

from __future__ import annotations

import argparse
import functools
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIDTHS = (1280, 390)
HEIGHT = 900
MAX_NAVBAR = 80  # px: one row of the bootstrap navbar is 56
# Pages with the widest content: long code lines, wide tables, API signatures; and anchors.
PAGES = ("", "benchmarks/", "api/", "api/sharded_tensor/", "models/#clipping-gradients-stclip_grad_norm_")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars")

# The probe page: every page in a frame of its width; each frame measured once loaded.
_PROBE_HEAD = """<!doctype html><html><body style="margin:0"><pre id="result">pending</pre><script>
const results = {}, expected = %d;
function measure(frame) {
  const doc = frame.contentDocument, win = frame.contentWindow;
  const nav = doc.querySelector(".navbar");
  const navHeight = nav ? nav.getBoundingClientRect().height : 0;
  const result = {navbar: Math.round(navHeight), overflow: doc.documentElement.scrollWidth - win.innerWidth};
  const hash = decodeURIComponent(win.location.hash.slice(1));
  if (hash) {
    // Following a link scrolls the target to scroll-padding-top (of the page) plus
    // scroll-margin-top (of the target) below the top of the window: that must clear the navbar.
    const target = doc.getElementById(hash);
    const px = (value) => (parseFloat(value) || 0);
    result.anchor = target ? Math.round(px(win.getComputedStyle(target).scrollMarginTop)
        + px(win.getComputedStyle(doc.documentElement).scrollPaddingTop) - navHeight) : null;
  }
  results[frame.dataset.key] = result;
  if (Object.keys(results).length === expected) {
    document.getElementById("result").textContent = JSON.stringify(results);
  }
}
</script>
"""
_PROBE_FRAME = ('<iframe data-key="{key}" style="border:0;display:block" width="{width}" height="{height}" '
                'src="{src}" onload="setTimeout(() => measure(this), 300)"></iframe>')

def find_chromium() -> str | None:
    """The Chromium executable on PATH (Debian's ``chromium``), or ``None``."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def build_site(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(dest)],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    return dest


def serve(site: Path) -> tuple[ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def _chromium(chromium: str, *args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


def check(site: Path, out: Path, chromium: str) -> list[dict[str, object]]:
    """Screenshot and measure every page at every width; one result per (page, width)."""
    out.mkdir(parents=True, exist_ok=True)
    server, base = serve(site)
    cases = [(page, width, re.sub(r"[^a-z0-9]+", "-", page.lower()).strip("-") or "index")
             for page in PAGES for width in WIDTHS]
    try:
        with tempfile.TemporaryDirectory() as profile:
            for page, width, name in cases:
                if "#" in page:
                    continue  # a headless screenshot is taken before the scroll to the anchor settles
                _chromium(chromium, f"--screenshot={out / f'{name}-{width}.png'}", f"--window-size={width},{HEIGHT}",
                          base + page, profile=Path(profile))
            probe = site / "_probe.html"
            probe.write_text(_PROBE_HEAD % len(cases) + "".join(
                _PROBE_FRAME.format(key=f"{name}-{width}", width=width, height=HEIGHT, src=html.escape("/" + page))
                for page, width, name in cases) + "</body></html>")
            try:
                dom = _chromium(chromium, "--dump-dom", "--virtual-time-budget=15000",
                                f"--window-size={max(WIDTHS) + 40},{HEIGHT}", base + probe.name,
                                profile=Path(profile)).stdout
            finally:
                probe.unlink()
    finally:
        server.shutdown()
    found = re.search(r'<pre id="result">(.*?)</pre>', dom, re.DOTALL)
    measured = json.loads(html.unescape(found[1])) if found and found[1] != "pending" else {}
    return [_judge(page, width, out / f"{name}-{width}.png", measured.get(f"{name}-{width}"))
            for page, width, name in cases]


def _judge(page: str, width: int, shot: Path, measured: dict[str, int] | None) -> dict[str, object]:
    problems = []
    if "#" not in page and (not shot.exists() or shot.stat().st_size < 2000):
        problems.append("no screenshot (or a blank one)")
    if measured is None:
        problems.append("the page could not be measured (did it load?)")
    else:
        if measured["navbar"] > MAX_NAVBAR:
            problems.append(f"navbar is {measured['navbar']} px high (wraps); at most {MAX_NAVBAR}")
        if measured["overflow"] > 0:
            problems.append(f"page is {measured['overflow']} px wider than the screen")
        if "#" in page and (measured.get("anchor") is None or measured["anchor"] < 0):
            problems.append(f"anchor heading sits {measured.get('anchor')} px from the navbar's bottom (hidden)")
    return {"page": "/" + page, "width": width, "screenshot": str(shot) if "#" not in page else None,
            "measured": measured,
            "ok": not problems, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, help="a built site (default: build one into a temporary folder)")
    parser.add_argument("--out", type=Path, default=ROOT / "screenshots", help="where the PNG files go")
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM") or find_chromium())
    args = parser.parse_args(argv)
    if not args.chromium:
        print("screenshots: Chromium not found; install it (apt-get install chromium) or pass --chromium",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        site = args.site or build_site(Path(tmp) / "site")
        results = check(site, args.out, args.chromium)
    for result in results:
        print(json.dumps(result))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
