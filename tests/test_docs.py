"""The documentation as a reader meets it: the site builds, the generated pages match the code, and every command a
page shows is one oomguard accepts (the cheap ones are run).

A renamed option, a new knob or remedy, a changed exit code or version range fails here, not in front of a reader.
The whole file takes a few seconds: `mkdocs build` and the commands run in this process or one subprocess.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from oomguard.cli import RUN_EXIT_CODES, main

from helpers import ROOT

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
MAIN_JOB = ("python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 && pip install -q -e \".[all]\" && "
            "oomguard run --simulate-gpu 300MiB examples/grpo_gsm8k.py")
# placeholders the pages use for a user's own files, and the repository's files a test runs them with
STAND_INS = {"./Llama-3.2-1B-Instruct": "tests/fixtures/models/llama-3.2-1b", "./model": "tests/fixtures/models/llama-3.2-1b",
             "config.json": "tests/fixtures/models/llama-3.2-1b/config.json"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", "{", "}"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "2>"}


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code_blocks(path: Path, langs: tuple[str, ...]) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S) if m.group(1) in langs]


def shell_commands(block: str) -> list[list[str]]:
    """Every simple command of a shell block as words: continuation lines joined, comments, operators and
    redirections left out, a `bash -c '...'` read inside, leading VAR=value assignments dropped."""
    out: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words, skip = [], False
        for tok in [*lex, ";"]:
            if skip:
                skip = False
                continue
            if tok in REDIRECTS:
                skip = True
                continue
            if tok not in SEPARATORS:
                words.append(tok)
                continue
            while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
                words.pop(0)
            if words:
                out.append(words)
                out += [c for w in words if "oomguard " in w and w != words[0] for c in shell_commands(w)]
            words = []
    return out


def doc_commands() -> list[tuple[Path, list[str]]]:
    """Every `oomguard ...` command in the shell blocks of the README and the pages."""
    return [(page, words[1:]) for page in PAGES for block in code_blocks(page, ("bash", "sh", "shell"))
            for words in shell_commands(block) if words[0] == "oomguard"]


def parse(args: list[str]) -> click.Context | None:
    """Parse as `oomguard` would, with click's own parser and types; None for an eager option (--help, --version)."""
    top = click.Context(main, info_name="oomguard")
    try:
        if not args or args[0].startswith("-"):
            main.make_context("oomguard", list(args))
            return None
        cmd = main.get_command(top, args[0])
        if cmd is None:
            raise click.UsageError(f"no command {args[0]!r}")
        ctx = cmd.make_context(args[0], list(args[1:]), parent=top)
        # `run` passes what it does not know on to COMMAND: a misspelt option would become the command to run
        first = next(iter(w for w in ctx.params.get("command", ()) if w != "--"), "")
        if args[0] == "run" and first.startswith("-") and first != "-m" and "--" not in args[:args.index(first)]:
            raise click.NoSuchOption(first, ctx=ctx)
        return ctx
    except click.exceptions.Exit:
        return None


# -- the site -------------------------------------------------------------------------------------------------------
def test_the_site_builds_strict(tmp_path):
    """Broken links, missing anchors and pages left out of the nav fail the build."""
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs MkDocs (pip install -e '.[test]')")
        pytest.skip("MkDocs is not installed (pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()
    assert (tmp_path / "site" / "images" / "live-view.png").exists()


def test_the_generated_parts_match_the_code():
    import doctest

    generator = _generator()
    assert doctest.testmod(generator).failed == 0
    # in a fresh interpreter: what the code says, whatever an earlier test in this worker did to the modules it loaded
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, f"{out.stdout}{out.stderr}; run `python docs/generate.py` and commit the pages"


# -- the README -----------------------------------------------------------------------------------------------------
def test_the_readme_is_short_and_holds_both_commands_a_picture_and_links():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert f"```bash\n{MAIN_JOB}\n```" in text
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in text  # the test command is exactly what CI runs
    assert f"```bash\n{ci}\n```" in (DOCS / "contributing" / "testing.md").read_text(encoding="utf-8")  # as shown
    pictures = re.findall(r"!\[[^\]]+\]\((docs/images/[\w-]+\.png)\)", text)
    assert pictures and all((ROOT / p).is_file() for p in pictures)
    for face in ("oomguard run", "@oomguard.guard", "oomguard analyze", "oomguard plan"):
        assert re.search(rf"^\| `{re.escape(face)}[^|]*\|.*\]\(docs/", text, re.M), face
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([\w-]+))?\)", text)
    assert len(links) > 20
    for target, anchor in links:
        assert (ROOT / target).is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.*)$", (ROOT / target).read_text(encoding="utf-8"), re.M)
            assert anchor in {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}, anchor


def test_the_pictures_are_shown_and_small():
    pngs = sorted((DOCS / "images").glob("*.png"))
    assert {p.name for p in pngs} >= {"live-view.png", "report.png", "report-ladder.png"}
    assert sum(p.stat().st_size for p in pngs) < 400 * 1024
    shown = " ".join(p.read_text(encoding="utf-8") for p in PAGES)
    assert all(p.name in shown for p in pngs)


# -- the reference --------------------------------------------------------------------------------------------------
def test_every_option_and_exit_code_is_in_the_reference():
    cli_page = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    top = click.Context(main, info_name="oomguard")
    for name in main.list_commands(top):
        cmd = main.get_command(top, name)
        assert f"## oomguard {name}" in cli_page
        for p in cmd.params:
            for opt in (*p.opts, *p.secondary_opts):
                if isinstance(p, click.Option):
                    assert re.search(rf"<code[^>]*>[^<]*(?<![\w-]){re.escape(opt)}\b", cli_page), f"oomguard {name} {opt}"
    codes_page = (DOCS / "reference" / "exit-codes.md").read_text(encoding="utf-8")
    from oomguard.run import supervisor

    codes = {c for code, _ in RUN_EXIT_CODES for c in code.split("/") if c.isdigit()}
    assert codes == {str(supervisor.EXIT_EXHAUSTED), str(supervisor.EXIT_LEAKED), str(supervisor.EXIT_BUG),
                     str(supervisor.EXIT_NOT_FOUND), str(supervisor.EXIT_NOT_EXECUTABLE), "2", "130", "143"}
    shown = set(re.findall(r"\*\*(\d+)(?:/(\d+))?\*\*", codes_page))
    assert codes <= {c for pair in shown for c in pair if c}


def test_every_environment_variable_and_guard_parameter_is_documented():
    env_page = (DOCS / "reference" / "environment.md").read_text(encoding="utf-8")
    read = {m for f in (ROOT / "oomguard").rglob("*.py") for m in re.findall(r"OOMGUARD_[A-Z_]+", f.read_text())}
    assert read and {v for v in read if f"`{v}" not in env_page} == set()
    import oomguard

    api = (DOCS / "reference" / "python-api.md").read_text(encoding="utf-8")
    assert [p for p in inspect.signature(oomguard.guard).parameters if f"| `{p}` |" not in api] == []


# -- commands and snippets in the pages -----------------------------------------------------------------------------
def test_every_oomguard_command_in_the_pages_parses():
    """Each command is parsed by the real click commands: an unknown or renamed option, a missing value or one of the
    wrong type fails."""
    commands = doc_commands()
    assert len(commands) >= 40 and {a[0] for _, a in commands} >= {"run", "plan", "analyze", "knobs", "ladders"}
    for page, args in commands:
        try:
            ctx = parse(args)
        except click.ClickException as e:
            pytest.fail(f"{page.relative_to(ROOT)}: `oomguard {shlex.join(args)}`: {e.format_message()}")
        if ctx is not None and args[0] == "run":
            assert ctx.params["command"], f"{page.relative_to(ROOT)}: `oomguard {shlex.join(args)}` runs nothing"


def test_the_cheap_commands_in_the_pages_run(tmp_path, monkeypatch):
    """plan, analyze, knobs and ladders as the pages show them, on the repository's example logs and model configs
    (a user's own files stand in as STAND_INS), from a scratch directory so that what they write stays there."""
    for name in ("examples", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    ran = set()
    for page, args in doc_commands():
        if args[0] not in ("plan", "analyze", "knobs", "ladders") or "--help" in args:
            continue
        args = [STAND_INS.get(a, a) for a in args]
        inputs = [a for i, a in enumerate(args) if ("/" in a or re.search(r"\.(log|json|pickle|toml|gz)$", a))
                  and (i == 0 or args[i - 1] not in ("--html",))]
        if not all(Path(a).exists() for a in inputs):
            continue  # a user's own file, named for the reader
        result = CliRunner().invoke(main, args)
        allowed = {0, 3, 4} if args[0] == "plan" else {0}  # plan: sure, predicted not to fit, probe first
        said = f"{page.relative_to(ROOT)}: `oomguard {shlex.join(args)}` exited {result.exit_code}: {result.output}"
        assert result.exit_code in allowed, said
        assert result.exception is None or isinstance(result.exception, SystemExit), said
        assert "Traceback" not in result.output
        ran.add(args[0])
    assert ran == {"plan", "analyze", "knobs", "ladders"}


def test_the_ladders_in_the_pages_load(tmp_path):
    from oomguard.decide.ladder import load_ladder

    blocks = [b for page in PAGES for b in code_blocks(page, ("toml",)) if "[[rung]]" in b]
    assert blocks
    for i, block in enumerate(blocks):
        path = tmp_path / f"ladder-{i}.toml"
        path.write_text(block)
        assert load_ladder(str(path)).rungs


def test_the_runnable_python_snippets_run():
    snippets = [m.group(1) for page in PAGES for m in re.finditer(r"<!-- runnable -->\n```python\n(.*?)^```",
                                                                   page.read_text(encoding="utf-8"), re.M | re.S)]
    assert snippets
    for code in snippets:
        exec(compile(code, "<docs snippet>", "exec"), {})


def test_the_command_reader_sees_what_a_shell_would():
    block = ("OOMGUARD_SIMULATE_GPU=2GiB oomguard run train.py  # a comment\n"
             "oomguard plan --model m --gpu 24GiB && python train.py\n"
             "srun -N 2 bash -c 'oomguard run --group $PWD/g -- \\\n  torchrun --nnodes 2 train.py'\n"
             "oomguard run --json-log -- python t.py 2> log.jsonl\n")
    assert [w for w in shell_commands(block) if w[0] == "oomguard"] == [
        ["oomguard", "run", "train.py"], ["oomguard", "plan", "--model", "m", "--gpu", "24GiB"],
        ["oomguard", "run", "--group", "$PWD/g", "--", "torchrun", "--nnodes", "2", "train.py"],
        ["oomguard", "run", "--json-log", "--", "python", "t.py", "2"]]
    with pytest.raises(click.NoSuchOption):
        parse(["run", "--max-attempt", "3", "train.py"])
    with pytest.raises(click.BadParameter):
        parse(["run", "--max-attempts", "many", "train.py"])


@pytest.mark.e2e
@pytest.mark.slow
def test_the_demo_prints_what_the_readme_shows(tmp_path):
    """The README's main job, run as a user runs it: oomguard's lines are the README's demo output (times apart), and
    the alternative's "run it" line names the script as the user typed it. When the climb changes on purpose,
    `python docs/screenshots.py` writes the new output (and pictures)."""
    spec = importlib.util.spec_from_file_location("docs_screenshots", DOCS / "screenshots.py")
    assert spec and spec.loader
    shots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shots)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    out = subprocess.run([sys.executable, "-m", "oomguard", *MAIN_JOB.split(" && ")[-1].split()[1:]], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0, out.stderr[-3000:]

    def same(text: str) -> str:
        text = re.sub(r"in \d+\.\ds", "in <t>s", text)
        return "\n".join(line for line in text.splitlines()
                         if not re.match(r"^oomguard \w+ \d+/\d+: (step \d+|starting)", line))  # no terminal: progress

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = shots.DEMO_BLOCK.search(readme)
    assert shown and same(shots.demo_lines(out.stderr)) == same(shown.group(2))
    assert "run it: oomguard run --config .oomguard/runs/<id>/alternative-1.lock.json --simulate-gpu 300MiB -- " \
           "examples/grpo_gsm8k.py" in shown.group(2)
