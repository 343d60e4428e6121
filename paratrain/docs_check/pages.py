"""A page's runnable blocks: fenced code read into commands, with their annotations (the
package's docstring lists them) and the output the page shows."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT_S = 300.0
# Generated pages are left out: they are rendered from code, so an annotation added by hand would
# not last, and their blocks are records (the commands `make results` ran, an example file).
GENERATED = ("docs/results.md", "docs/configuration.md")
SHELLS = {"bash", "sh", "shell"}
RUNNABLE = SHELLS | {"console", "python"}
FENCE = re.compile(r"^\s*```\s*([\w+-]*)")
CLOSING = re.compile(r"^\s*```\s*$")
ANNOTATION = re.compile(r"^\s*<!--\s*docs-check:\s*(.*?)\s*-->\s*$")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")


@dataclass
class Command:
    text: str  # as bash reads it: continuations and here-documents kept
    shown: list[str] = field(default_factory=list)  # the output the page shows for it


@dataclass
class Block:
    page: Path
    line: int  # the opening fence's, 1-based
    lang: str
    body: str
    commands: list[Command] = field(default_factory=list)
    shown: list[str] = field(default_factory=list)  # an `output` block after it
    skip: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    save_as: str | None = None
    folder: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # saved by earlier blocks of the page

    @property
    def where(self) -> str:
        return f"{relative(self.page)}:{self.line}"


def relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def default_pages() -> list[Path]:
    """README.md, docs/*.md but the generated pages, examples/**/README.md."""
    docs = [page for page in sorted((ROOT / "docs").glob("*.md")) if relative(page) not in GENERATED]
    return [ROOT / "README.md", *docs, *sorted((ROOT / "examples").glob("**/README.md"))]


def shell_commands(body: str) -> list[Command]:
    """A bash block's commands: comment lines dropped, `\\` lines joined, here-documents kept."""
    commands, lines = [], body.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        text = [line]
        while text[-1].rstrip().endswith("\\") and i < len(lines):
            text.append(lines[i])
            i += 1
        heredoc = HEREDOC.search(text[-1])
        if heredoc:
            while i < len(lines):
                text.append(lines[i])
                i += 1
                if text[-1].strip() == heredoc.group(1):
                    break
        commands.append(Command("\n".join(text)))
    return commands


def console_commands(body: str) -> list[Command]:
    """A transcript's commands (`$ ` lines, with `\\` continuations) and the output shown after each."""
    commands: list[Command] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("$ "):
            text = [line[2:]]
            while text[-1].rstrip().endswith("\\") and i < len(lines):
                text.append(lines[i])
                i += 1
            commands.append(Command("\n".join(text)))
        elif commands and line.strip():
            commands[-1].shown.append(line)
    return commands


def annotate(block: Block, directive: str) -> None:
    word, _, rest = directive.partition(" ")
    if directive.startswith("skip:"):
        block.skip = directive[len("skip:"):].strip() or "no reason given"
    elif word == "timeout" and re.fullmatch(r"\d+(\.\d*)?", rest.strip()):
        block.timeout_s = float(rest)
    elif word == "file" and rest.strip():
        block.save_as = rest.strip()
    elif word == "in" and (ROOT / rest.strip()).is_dir():
        block.folder = rest.strip()
    elif word in ("output", "console") and not rest:
        block.lang = word
    else:
        raise ValueError(f"{block.where}: not a docs-check annotation: {directive!r}")


def read_page(page: Path) -> list[Block]:
    """The page's runnable blocks, each with its annotations and the files saved before it."""
    blocks, files, notes = [], {}, []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        note = ANNOTATION.match(lines[i])
        fence = FENCE.match(lines[i])
        i += 1
        if note:
            notes.append(note.group(1))
            continue
        if not fence:
            if lines[i - 1].strip():
                notes = []
            continue
        start, body = i, []
        while i < len(lines) and not CLOSING.match(lines[i]):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        block = Block(page, start, fence.group(1).lower(), "\n".join(body) + "\n", files=dict(files))
        for directive in notes:
            annotate(block, directive)
        notes = []
        if block.save_as:
            files[block.save_as] = block.body
        if block.lang == "output":
            if not blocks:
                raise ValueError(f"{block.where}: an output block with no command block before it")
            blocks[-1].shown = block.body.splitlines()
        elif block.lang in RUNNABLE:
            if block.lang != "python":
                block.commands = (console_commands if block.lang == "console" else shell_commands)(block.body)
            blocks.append(block)
    return blocks

