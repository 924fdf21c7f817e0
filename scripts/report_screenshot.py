"""Look at the HTML report the way a person does: render it in headless Chromium at a given width,
save a screenshot, and measure whether anything overflows horizontally.

    python scripts/report_screenshot.py out/summarize_legal --width 1400 --png report.png

Chromium comes from the system packages (Debian/Ubuntu: apt-get install chromium). Prints
`scroll width W at viewport V` and exits 1 when the page is wider than the window (a horizontal
scrollbar: something does not wrap).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_browser() -> str | None:
    return next((b for b in map(shutil.which, BROWSERS) if b), None)


def _run(browser: str, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--disable-dev-shm-usage"]
    return subprocess.run([browser, *flags, *args], capture_output=True, text=True, timeout=120)


def measure(page_html: str, width: int = 1400, png: str | None = None, height: int = 1600) -> dict:
    """{"scroll_width", "viewport"} of the page in Chromium at `width`; screenshot into png."""
    browser = find_browser()
    if browser is None:
        raise RuntimeError(f"no Chromium found (looked for {', '.join(BROWSERS)}); apt-get install chromium")
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "report.html"
        page.write_text(page_html)
        if png:
            _run(browser, f"--window-size={width},{height}", f"--screenshot={Path(png).resolve()}", page.as_uri())
        # A copy with a probe script (the report itself has none) that writes the layout width into the title.
        probe = Path(tmp) / "probe.html"
        probe.write_text(page_html.replace("</body>", "<script>document.title='W'+document.documentElement.scrollWidth"
                                                      "+'V'+window.innerWidth</script></body>"))
        dom = _run(browser, f"--window-size={width},{height}", "--dump-dom", probe.as_uri()).stdout
    m = re.search(r"<title>W(\d+)V(\d+)</title>", dom)
    if not m:
        raise RuntimeError("Chromium did not render the page (no probe title in --dump-dom output)")
    return {"scroll_width": int(m.group(1)), "viewport": int(m.group(2))}


def main() -> None:
    from batchspec.reports.output import build_report, to_html

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", help="a job's output path")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--png", default="report.png")
    args = ap.parse_args()
    m = measure(to_html(build_report(args.output)), args.width, args.png)
    print(f"scroll width {m['scroll_width']} at viewport {m['viewport']}; screenshot {args.png}")
    sys.exit(0 if m["scroll_width"] <= m["viewport"] else 1)


if __name__ == "__main__":
    main()
