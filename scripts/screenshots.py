"""Screenshots and layout checks of the documentation site at 1280 px and 390 px (a phone).

Builds the site (``mkdocs build``, unless ``--site`` names a built one), serves it on
127.0.0.1, and with headless Chromium:

- takes a screenshot of each page in ``PAGES`` at each width in ``WIDTHS`` (into ``--out``),
  to look at (``--tall`` makes each one the height of a long page instead of a screen);
- loads each page in a frame of that width and measures, in the page itself, what a reader
  sees:

  * the navbar's height (one row: at most ``MAX_NAVBAR`` px);
  * whether the page is wider than the screen (nothing may push it sideways);
  * every table of the page's content: no cell narrower than its longest word (a word that
    does not fit is broken or sticks out; words inside ``nowrap`` code count as one), no row
    taller than the screen (a column squeezed to a word or two makes rows a screen tall), and
    no clipped column (every cell inside the screen and inside its table's box, so nothing
    hides behind a sideways scroll);
  * for a link to an anchor, whether the heading lands below the sticky navbar rather than
    under it (from the scroll margins the page sets, which is where the browser puts it).

Prints one JSON line per check and exits 1 if any fails. Used by tests/test_docs.py, which
fails when Chromium is missing on a machine where it can be installed (see ``find_chromium``)::

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
PAGES = ("", "getting_started/", "benchmarks/", "api/", "api/sharded_tensor/",
         "models/#clipping-gradients-stclip_grad_norm_")
TALL = 6000  # px: the window's height for --tall screenshots
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars")

# The probe page: every page in a frame of its width; each frame measured once loaded.
_PROBE_HEAD = r"""<!doctype html><html><body style="margin:0"><pre id="result">pending</pre><script>
const results = {}, expected = %d;
// Tables as a reader sees them: the first few problems, each naming the cell by its text.
function measureTables(doc, win) {
  const problems = [];
  const canvas = doc.createElement("canvas").getContext("2d");
  const name = (cell) => JSON.stringify(cell.textContent.trim().replace(/\s+/g, " ").slice(0, 40));
  const longestWord = (cell) => {
    let widest = 0, word = "";
    const walker = doc.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const style = win.getComputedStyle(node.parentElement);
      if (style.display === "none") continue;
      canvas.font = `${style.fontStyle} ${style.fontWeight} ${style.fontSize} ${style.fontFamily}`;
      const text = node.textContent.trim();
      const words = /^(nowrap|pre)$/.test(style.whiteSpace) ? [text] : text.split(/\s+/);
      for (const w of words) {
        const width = canvas.measureText(w).width;
        if (width > widest) { widest = width; word = w; }
      }
    }
    return [widest, word];
  };
  for (const table of doc.querySelectorAll('div[role="main"] table')) {
    if (table.closest(".highlight")) continue;  // code line numbers, not a table of content
    const box = table.getBoundingClientRect();
    for (const row of table.querySelectorAll("tr")) {
      const rowBox = row.getBoundingClientRect();
      if (rowBox.height > win.innerHeight) {
        problems.push(`a row ${Math.round(rowBox.height)} px tall, taller than the screen (${win.innerHeight} px): `
                      + name(row));
      }
      for (const cell of row.querySelectorAll(":scope > td, :scope > th")) {
        const r = cell.getBoundingClientRect();
        if (r.width === 0 || win.getComputedStyle(cell).display === "none") continue;
        if (r.right > win.innerWidth + 1 || r.left < -1 || r.right > box.right + 1) {
          problems.push(`clipped column: the cell ${name(cell)} spans `
                        + `${Math.round(r.left)}-${Math.round(r.right)} px, the table `
                        + `${Math.round(box.left)}-${Math.round(box.right)} px, the screen ${win.innerWidth} px`);
          continue;
        }
        const style = win.getComputedStyle(cell);
        if (style.display === "inline") continue;  // flows as text (a phone's header line): no box to be narrow
        const inner = cell.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
        const [widest, word] = longestWord(cell);
        if (widest > inner + 1) {
          problems.push(`the cell ${name(cell)} is ${Math.round(inner)} px wide, narrower than its word `
                        + `${JSON.stringify(word)} (${Math.round(widest)} px)`);
        }
      }
    }
  }
  return {count: problems.length, first: problems.slice(0, 5)};
}
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
  result.tables = measureTables(doc, win);
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


def check(site: Path, out: Path, chromium: str, *, tall: bool = False) -> list[dict[str, object]]:
    """Screenshot and measure every page at every width; one result per (page, width).

    The screenshots are a screen high (``HEIGHT``), or ``TALL`` px with ``tall``; the
    measures always use a screen of ``HEIGHT`` px.
    """
    out.mkdir(parents=True, exist_ok=True)
    server, base = serve(site)
    cases = [(page, width, re.sub(r"[^a-z0-9]+", "-", page.lower()).strip("-") or "index")
             for page in PAGES for width in WIDTHS]
    try:
        with tempfile.TemporaryDirectory() as profile:
            for page, width, name in cases:
                if "#" in page:
                    continue  # a headless screenshot is taken before the scroll to the anchor settles
                _chromium(chromium, f"--screenshot={out / f'{name}-{width}.png'}",
                          f"--window-size={width},{TALL if tall else HEIGHT}", base + page, profile=Path(profile))
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
        if measured["navbar"] == 0:
            problems.append("no navbar: not a page of the site (missing from the build?)")
        if measured["navbar"] > MAX_NAVBAR:
            problems.append(f"navbar is {measured['navbar']} px high (wraps); at most {MAX_NAVBAR}")
        if measured["overflow"] > 0:
            problems.append(f"page is {measured['overflow']} px wider than the screen")
        tables = measured.get("tables") or {"count": 0, "first": []}
        if tables["count"]:
            problems.append(f"{tables['count']} table problem(s), the first: {tables['first']}")
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
    parser.add_argument("--tall", action="store_true", help=f"screenshots {TALL} px high, to see whole pages")
    args = parser.parse_args(argv)
    if not args.chromium:
        print("screenshots: Chromium not found; install it (apt-get install chromium) or pass --chromium",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        site = args.site or build_site(Path(tmp) / "site")
        results = check(site, args.out, args.chromium, tall=args.tall)
    for result in results:
        print(json.dumps(result))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
