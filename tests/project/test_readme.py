"""The README is a quickstart, and what it and the docs show works: its first screen holds the
two commands a new machine needs (`.ci/run` and scripts/bench_startup.py read them), every
relative link in README.md, CONTRIBUTING.md and docs/*.md leads to a file, every `jaxserve ...`
command in their code blocks parses with the CLI's own parser, and the README's Python
compiles."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}  # ```text and others are not commands


def code_blocks(text: str, languages=None) -> list[str]:
    return [body for lang, body in FENCE.findall(text)
            if languages is None or lang in languages]


def test_first_screen_holds_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines: a quickstart, not reference"
    first = lines[:25]
    installs = [line for line in first if line.startswith("pip install -e . && jaxserve generate")]
    tests = [line for line in first if "python -m pytest" in line]
    assert installs, "the README's first screen lacks `pip install -e . && jaxserve generate ...`"
    assert tests, "the README's first screen lacks the `python -m pytest` command"
    assert first.index(installs[0]) < first.index(tests[0])
    # the user install is jaxserve alone; the test extras come with the test command
    assert "[" not in installs[0].split("&&")[0]
    # both inside the first ```bash block, which .ci/run and bench_startup.py read
    first_block = code_blocks(README.read_text(), {"bash"})[0].splitlines()
    assert first_block[:2] == [installs[0], tests[0]]


def test_readme_names_the_accelerator_installs():
    text = README.read_text()
    for command in ('pip install -e .', 'pip install -e ".[tpu]"', 'pip install -e ".[cuda]"',
                    'pip install -e ".[torch]"', '"jax[rocm7-local]"'):
        assert command in text, command


def prose(page: pathlib.Path) -> str:
    text = page.read_text()
    for body in code_blocks(text):  # links are in prose, not in code
        text = text.replace(body, "")
    return text


def links_with_anchors(page: pathlib.Path) -> list[tuple[str, str]]:
    """(path, anchor) of each relative link; path "" for an anchor in the same page."""
    found = []
    for target in LINK.findall(prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # http(s):, mailto:
        path, _, anchor = target.partition("#")
        found.append((path, anchor))
    return found


def relative_links(page: pathlib.Path) -> list[str]:
    return [path for path, _ in links_with_anchors(page) if path]


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", prose(page), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file(page):
    links = relative_links(page)
    missing = [link for link in links if not (page.parent / link).exists()]
    assert missing == [], f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_anchor_names_a_heading(page):
    wrong = []
    for path, anchor in links_with_anchors(page):
        target = page.parent / path if path else page
        if anchor and target.suffix == ".md" and target.exists() and \
                anchor not in anchors(target):
            wrong.append(f"{path}#{anchor}")
    assert wrong == [], f"{page.relative_to(ROOT)} links to headings that do not exist: {wrong}"


def test_the_link_check_sees_links():
    links = relative_links(README)
    assert "docs/usage.md" in links and "CONTRIBUTING.md" in links
    for page in ("usage", "serving", "structured-outputs", "parallelism", "quantization", "grpc",
                 "performance", "kernels", "deployment", "architecture"):
        assert f"docs/{page}.md" in links, page
    assert "examples/quickstart.ipynb" in links


def shown_commands(text: str) -> list[str]:
    """The `jaxserve ...` command lines of a page's shell code blocks: `$ ` prompts stripped,
    backslash continuations joined, comments, pipes and a trailing `&` dropped; a command
    quoted inside another (`ssh ... --command "jaxserve serve ..."`) counts too."""
    commands = []
    for body in code_blocks(text, SHELL_BLOCKS):
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            if "jaxserve" not in line.split():
                if not re.search(r"[\"']jaxserve ", line):
                    continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue  # not shell (program output)
            for word in words:  # a command quoted inside another
                if word.startswith("jaxserve "):
                    commands.append(word)
            segment: list[str] = []
            for word in [*words, ";"]:  # `pip install -e . && jaxserve generate ...`
                if word in ("&&", "||", ";", "|", "&", ">", "2>", ">>"):
                    if segment[:1] == ["jaxserve"]:
                        commands.append(shlex.join(segment))
                    segment = [] if word in ("&&", "||", ";") else ["(rest dropped)"]
                else:
                    segment.append(word)
    return commands


ALL_COMMANDS = sorted({(page.relative_to(ROOT).as_posix(), command)
                       for page in PAGES for command in shown_commands(page.read_text())})


def test_commands_are_found():
    pages = {page for page, _ in ALL_COMMANDS}
    assert {"README.md", "docs/usage.md", "docs/serving.md", "docs/parallelism.md"} <= pages
    shown = [command for _, command in ALL_COMMANDS]
    assert any(c.startswith("jaxserve generate") for c in shown)
    assert any(c.startswith("jaxserve serve") for c in shown)
    assert any(c.startswith("jaxserve plan") for c in shown)
    assert any(c.startswith("jaxserve convert") for c in shown)
    # the pod-slice command quoted inside `gcloud ... --command "..."`
    assert any("--multi-host" in c for c in shown)


@pytest.mark.parametrize("page,command", ALL_COMMANDS,
                         ids=[f"{page}: {command}" for page, command in ALL_COMMANDS])
def test_shown_command_parses(page, command):
    from jaxserve.cli import build_parser

    argv = shlex.split(command)[1:]
    if argv in ([], ["--help"], ["-h"]):
        return  # `jaxserve --help`
    argv = [a for a in argv if a not in ("--help", "-h")]  # `jaxserve serve --help`: its flags
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            args, extra = build_parser().parse_known_args(argv)
        except SystemExit as exit_:
            pytest.fail(f"{page}: `{command}` does not parse (exit {exit_.code}): "
                        f"{(stderr.getvalue().strip().splitlines() or [''])[-1]}")
    if args.command == "generate" and not any(e.startswith("-") for e in extra):
        extra = []  # prompts after the flags (jaxserve.cli's main takes them as prompts)
    assert extra == [], f"{page}: `{command}`: unrecognized arguments {extra}"


def test_readme_python_compiles():
    blocks = code_blocks(README.read_text(), {"python"})
    assert blocks, "the README shows no Python"
    for i, code in enumerate(blocks):
        compile(code, f"README.md python block {i}", "exec")
    offline = blocks[0]
    assert "from jaxserve import LLM, SamplingParams" in offline and "llm.generate(" in offline
    assert len([line for line in offline.splitlines() if line.strip()]) <= 5
    assert "base_url=\"http://localhost:8000/v1\"" in "".join(blocks)
