"""Make the documentation's pictures from a real run of the demo, and its printed output.

    python docs/screenshots.py            # about a minute on 2 CPU cores; needs tmux and chromium (pngquant if present)

It runs the README's demo, ``oomguard run --simulate-gpu 300MiB --html report.html examples/grpo_gsm8k.py``, in a
real terminal (a private tmux server, 120 columns) from a scratch directory, so that nothing lands in the checkout,
and writes:

- ``docs/images/live-view.png``: the terminal while the real run trains, the live panel at the bottom;
- ``docs/images/report.png`` and ``docs/images/report-ladder.png``: the run's HTML report in headless Chromium (the
  peak per attempt against the device and the breakdown; the attempts and the diff);
- the demo's output, oomguard's own lines as the terminal printed them, into the ``<!-- demo-output -->`` blocks of
  ``README.md`` and ``docs/getting-started.md``.

The terminal is turned into a picture by rich (it reads the terminal's colours and exports HTML), which Chromium then
screenshots; pngquant, where installed, makes the PNGs a few times smaller.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
DEMO = "oomguard run --simulate-gpu 300MiB --html report.html examples/grpo_gsm8k.py"
COLUMNS, ROWS = 120, 40
DEMO_BLOCK = re.compile(r"(<!-- demo-output -->\n```text\n)(.*?)(```\n)", re.S)


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"docs/screenshots.py needs {name} (apt-get install {name})")
    return path


class Terminal:
    """A command in a tmux pane of a private tmux server (only this script's server is ever stopped)."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.tmux = tool("tmux")
        self.socket = f"oomguard-docs-{os.getpid()}"
        subprocess.run([self.tmux, "-L", self.socket, "-f", "/dev/null", "new-session", "-d", "-s", "demo", "-x",
                        str(COLUMNS), "-y", str(ROWS), "-c", str(cwd), f"{command}; echo '[demo ended]'; sleep 3600"],
                       check=True, env=env)

    def screen(self, history: bool = False) -> str:
        """The pane as the terminal shows it, with its colours (ANSI escapes); ``history`` adds the scrollback."""
        args = [self.tmux, "-L", self.socket, "capture-pane", "-p", "-e", "-t", "demo"]
        if history:
            args += ["-J", "-S", "-"]  # -J: lines the terminal wrapped are joined back
        return subprocess.run(args, check=True, capture_output=True, text=True).stdout

    def close(self) -> None:
        subprocess.run([self.tmux, "-L", self.socket, "kill-server"], check=False)


def plain(ansi: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", ansi)


def live_panel_shown(screen: str) -> bool:
    """The live view of the real run (not a probe), once it shows a step and the peak against the device."""
    text = plain(screen)
    return bool(re.search(r"^oomguard\s+attempt \d+/\d+", text, re.M) and re.search(r"^step\s+[1-9]", text, re.M)
                and re.search(r"^peak\s+.*of 300\.00 MiB", text, re.M))


def terminal_page(ansi: str, title: str) -> str:
    """The terminal's text and colours as a page: rich reads the ANSI escapes and exports them as HTML."""
    import io

    from rich.console import Console
    from rich.terminal_theme import MONOKAI
    from rich.text import Text

    console = Console(record=True, width=COLUMNS, file=io.StringIO(), force_terminal=True, color_system="truecolor")
    console.print(Text.from_ansi(ansi.rstrip("\n")), soft_wrap=True)
    frame = ("<!DOCTYPE html><html><head><meta charset='utf-8'><style>body{{margin:0;background:{background}}}"
             ".bar{{background:#444;color:#ddd;font:13px sans-serif;padding:6px 12px}}"
             "pre{{margin:0;padding:10px 12px;color:{foreground};font:13px/1.3 'DejaVu Sans Mono',monospace}}"
             "</style></head><body><div class='bar'>" + html.escape(title) + "</div><pre>{code}</pre></body></html>")
    return console.export_html(theme=MONOKAI, inline_styles=True, code_format=frame)


def screenshot(page: Path, png: Path, width: int, height: int, profile: Path) -> None:
    """Headless Chromium, kept off the network (the same flags as tests/test_html.py)."""
    chrome = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                  None) or tool("chromium")
    subprocess.run([chrome, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={width},{height}",
                    f"--screenshot={png}", page.resolve().as_uri()], check=True, capture_output=True, timeout=120)
    if shutil.which("pngquant"):
        subprocess.run(["pngquant", "--force", "--skip-if-larger", "--strip", "--quality", "60-90", "--output",
                        str(png), str(png)], check=False)


def report_section(report: str, first: str | None) -> str:
    """The HTML report from its title down, or from its heading ``first`` down (the title kept)."""
    if first is None:
        return report
    script = ("<script>(function(){var h=[].find.call(document.querySelectorAll('h2'),function(e){return "
              f"e.textContent.indexOf({first!r})===0}});var b=document.body,n=b.firstElementChild.nextElementSibling;"
              "while(n&&n!==h){var x=n.nextElementSibling;b.removeChild(n);n=x;}})();</script>")
    return report.replace("</body>", script + "</body>")


def demo_lines(history: str) -> str:
    """oomguard's own lines of the demo (the training output left out), wrapped as a terminal of 118 columns."""
    out = []
    for line in plain(history).splitlines():
        if not line.startswith("oomguard") and not re.match(r"^[┃│┏┡└]", line):
            continue
        if line.startswith(("┏", "┡", "└")):
            continue  # the table's rules; its rows stay
        if line.startswith("oomguard report:"):
            out.append(line)
            break
        if "run it: " in line:  # a line to paste stays whole
            out.append(line)
            continue
        head = re.match(r"^(oomguard:? +(?:\d+\. +)?)", line)
        indent = " " * (len(head.group(1)) if head else 0)
        kept = re.sub(r"(\d) (bytes|[KMG]iB)\b", "\\1\u00a0\\2", line)  # a size stays on one line
        out += [w.replace("\u00a0", " ") for w in
                textwrap.wrap(kept, 118, subsequent_indent=indent, break_on_hyphens=False)] or [""]
    text = "\n".join(out) + "\n"
    return re.sub(r"\.oomguard/runs/[\w-]+/", ".oomguard/runs/<id>/", text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (its path is printed)")
    args = ap.parse_args()
    IMAGES.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="oomguard-docs-"))
    try:
        (scratch / "examples").symlink_to(ROOT / "examples")  # the command reads as the user types it
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "TERM": "xterm-256color", "COLUMNS": str(COLUMNS), "LINES": str(ROWS)}
        term = Terminal(DEMO, scratch, env)
        live = None
        try:
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                screen = term.screen()
                if live is None and live_panel_shown(screen):
                    live = screen
                if "[demo ended]" in plain(screen):
                    break
                time.sleep(0.25)
            else:
                raise SystemExit(f"the demo did not end within 15 minutes; its screen:\n{plain(term.screen())}")
            history = term.screen(history=True)
        finally:
            term.close()
        if live is None:
            raise SystemExit(f"the live view never showed the run's step and peak; the demo printed:\n{plain(history)}")
        profile = scratch / "chrome-profile"
        page = scratch / "live.html"
        page.write_text(terminal_page(live, f"$ {DEMO}"), encoding="utf-8")
        screenshot(page, IMAGES / "live-view.png", 1010, 20 + 17 * ROWS + 40, profile)
        report = (scratch / "report.html").read_text(encoding="utf-8")
        for name, first, height in (("report.png", None, 690), ("report-ladder.png", "Attempts", 470)):
            page = scratch / f"section-{name}.html"
            page.write_text(report_section(report, first), encoding="utf-8")
            screenshot(page, IMAGES / name, 1100, height, profile)
        output = demo_lines(history)
        for doc in (ROOT / "README.md", ROOT / "docs" / "getting-started.md"):
            text = doc.read_text(encoding="utf-8")
            new = DEMO_BLOCK.sub(lambda m: m.group(1) + output + m.group(3), text)
            if new != text:
                doc.write_text(new, encoding="utf-8")
                print(f"wrote the demo's output into {doc.relative_to(ROOT)}")
        for png in sorted(IMAGES.glob("*.png")):
            print(f"{png.relative_to(ROOT)}: {png.stat().st_size // 1024} KiB")
    finally:  # whatever the ending (a demo that never ends, a browser that fails), unless asked to keep it
        if args.keep:
            print(f"scratch directory: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
