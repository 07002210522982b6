"""What tests/package/test_docs.py checks, as functions of text, so that each check can be
shown to fail on a made-up broken input.

- `broken_references(text, where)`: the paths, modules, `pipeschedule` subcommands and
  options, and link targets (with their `#anchor`) that a Markdown page names and that do
  not exist.
- `note_problems(files)`: the Notes (a name in brackets after `Note:`) referenced with no
  definition, or with a definition in another file than the one they name, and the Notes
  defined twice.
- `guide_commands(text)`: README's fenced shell commands, each as run in CI or marked GPU.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Files the pages name as the user's own (written by the commands they show, or given by
# the user: a corpus, a tokenizer, a launch script): they are not in the repository.
USER_FILES = {"config.yaml", "text.yaml", "s.json", "t.json", "t.png", "zb.json", "bad.json", "plan.png",
              "run_train.py", "my-corpus/", "my-tokenizer/", "wheels/", "torch_schedule.csv",
              "ScheduleZBVZeroBubble-pp4-m8-defer1.csv"}
# A path names the repository where it starts with one of these (bare paths in prose too).
TOP = ("pipeschedule/", "integration/", "benchmarks/", "tests/", "docs/", "examples/", ".ci/")
SUFFIXES = (".py", ".md", ".json", ".csv", ".yaml", ".png", ".txt", ".toml")
MODULE = re.compile(r"(?<![\w./-])((?:pipeschedule|integration\.nanotron|benchmarks)(?:\.[A-Za-z_]\w*)+)")
CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
BARE = re.compile(r"(?<![\w/.`-])((?:" + "|".join(map(re.escape, TOP)) + r")[\w./*-]*)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)


def _exists(path: str, base: Path) -> bool:
    return (ROOT / path).exists() or (base / path).exists()


def _path_like(span: str) -> bool:
    """A code span that names a file or folder of the repository: one word that is a
    folder path (`a/b/`) or ends with one of our file suffixes; not a user's file."""
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", span) or span in USER_FILES:
        return False
    if span.startswith(".") and "/" not in span:  # a suffix (`.jsonl`), not a file
        return False
    return span.endswith("/") and "/" in span[:-1] or span.endswith(SUFFIXES)


def _defined_names(path: Path) -> set[str]:
    """The names a module binds at its top level (defs, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def module_exists(dotted: str) -> bool:
    """`a.b.c` names a module or package file of the tree, or a name its longest module
    prefix defines at its top level (a function, class or constant: `pipeschedule.lower`)."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.exists():
            rest = parts[k:]
            return not rest or len(rest) <= 2 and rest[0] in _defined_names(source)
    return False


def cli_parser() -> argparse.ArgumentParser:
    from pipeschedule.cli.main import build_parser

    return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _headings(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped,
    spaces as hyphens)."""
    text = FENCE.sub("", path.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def _command_words(text: str) -> list[list[str]]:
    """The words of every `pipeschedule ...` command a page shows: fenced lines and code
    spans that start with it (a `$ ` prompt allowed), up to a comment or a shell operator."""
    lines = [line for _, body in FENCE.findall(text) for line in body.splitlines()]
    lines += CODE.findall(text)
    out = []
    for line in lines:
        line = line.strip().removeprefix("$ ")
        if line.startswith("pipeschedule "):
            line = re.split(r"\s+#|\s*(?:&&|\||>)\s*", line)[0]
            out.append(line.split()[1:])
    return out


def broken_references(text: str, where: Path, parser: argparse.ArgumentParser | None = None) -> list[str]:
    """What a Markdown page at `where` names that does not exist, one line each."""
    base, problems = where.parent, []
    for span in CODE.findall(text):
        if _path_like(span) and not _exists(span, base):
            problems.append(f"path `{span}`")
    for match in BARE.finditer(text):
        path = match.group(1).rstrip(".,;:")
        named = path.endswith("/") or path.endswith(SUFFIXES)  # not a prefix or a format tag ("pipeschedule/1")
        if named and "*" not in path and not _exists(path, base):
            problems.append(f"path {path}")
    for target in LINK.findall(text):
        if re.match(r"\w+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (base / path) if path else where
        if not file.exists():
            problems.append(f"link target {target}")
        elif anchor and file.suffix == ".md" and anchor not in _headings(file):
            problems.append(f"link anchor {target}")
    for match in MODULE.finditer(text):
        if "." + match.group(1).rsplit(".", 1)[1] in SUFFIXES:  # a file name (`benchmarks.md`), not a module
            continue
        if not module_exists(match.group(1).rstrip(".")):
            problems.append(f"module {match.group(1)}")
    commands = _subparsers(parser or cli_parser())
    for words in _command_words(text):
        if not words or words[0].startswith("-") or words[0].isupper():  # an option, or a placeholder (COMMAND)
            continue
        words[0] = words[0].rstrip(":")  # an error line quoted from the command ("pipeschedule verify: ...")
        if words[0] not in commands:
            problems.append(f"subcommand pipeschedule {words[0]}")
            continue
        options = commands[words[0]]._option_string_actions
        problems += [f"option pipeschedule {words[0]} {w}" for w in words[1:]
                     if w.startswith("--") and w.split("=")[0] not in options]
    return problems


def file_map(block: str) -> list[str]:
    """The paths a file map lists: each line `NAME[, NAME..]  description`, NAME a file or a
    folder (`dir/`), indented two spaces under its folder; lines that go on with a
    description are skipped."""
    folders: list[str] = []
    listed = []
    for line in block.splitlines():
        names = [n.strip() for n in re.split(r"\s{2,}", line.strip())[0].split(",")]
        if not line.strip() or not all(re.fullmatch(r"[\w.-]+(?:/[\w.-]+)*(?:\.py|/)", n) for n in names):
            continue
        level = (len(line) - len(line.lstrip())) // 2
        del folders[level:]
        listed += ["".join(folders) + name for name in names]
        if len(names) == 1 and names[0].endswith("/"):
            folders.append(names[0])
    return listed


def unmapped(listed: list[str], roots=("pipeschedule", "integration")) -> list[str]:
    """The modules under `roots` that a file map does not list: each must be, unless a
    listed folder stands for its files as a whole (no file of it is listed). A package's
    `__init__.py` need not be."""
    whole = {f for f in listed if f.endswith("/") and not any(g != f and g.startswith(f) for g in listed)}
    out = []
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name in listed or any(name.startswith(f) for f in whole):
                continue
            if path.name != "__init__.py":
                out.append(name)
    return out


# [Note: Note definitions] A Note is defined in a .py file where its bracket (`Note:` and
# its name in square brackets) begins a line of a comment or docstring (after indentation
# and `#` or the opening quotes) and its text goes on after a space (not `:`, `.`, `,` or
# `)`, which make it a reference), and where it opens a paragraph (after a blank line, a
# bare `#` or the docstring's quotes) or its text begins with a capital letter. Anywhere
# else, and anywhere in Markdown, the bracket is a reference; its name may break across
# lines there. A reference followed by "in FILE" must name the file that defines it.
NOTE = re.compile(r"\[Note: ([^\][{}()\\^]+)\]")  # a name has no brackets, braces, parentheses
DEFINITION = re.compile(r'^\s*(?:#\s*|r?""")?\[Note: ([^\]\n]+)\](?= \S|$)')
NOTE_IN = re.compile(r"\s+in\s+`?([\w./-]+\.py)`?")


def _name(raw: str) -> str:
    """A referenced name as one line: string literals joined, comment marks dropped."""
    return re.sub(r"\s+(?:#\s*)?", " ", re.sub(r'"\s+"', "", raw)).strip()


def note_definitions(path: str, text: str) -> list[tuple[str, int]]:
    """(name, line) of every Note `text` (a .py file's) defines."""
    lines, found = text.splitlines(), []
    for i, line in enumerate(lines):
        match = DEFINITION.match(line)
        if not match:
            continue
        prev = lines[i - 1].strip() if i else ""
        rest = line[match.end():].strip()
        opens = line.lstrip().startswith(('"""', 'r"""')) or prev in ("", "#", '"""', 'r"""')
        if opens or rest[:1].isupper():
            found.append((match.group(1), i + 1))
    return found


def note_problems(files: dict[str, str]) -> list[str]:
    """For `files` (path -> text): each Note referenced but never defined, defined more
    than once, or referenced as "in FILE" where FILE does not define it."""
    defined: dict[str, list[str]] = defaultdict(list)
    for path, text in files.items():
        if path.endswith(".py"):
            for name, line in note_definitions(path, text):
                defined[name].append(f"{path}:{line}")
    problems = [f"[Note: {name}] defined {len(at)} times: {', '.join(at)}" for name, at in defined.items()
                if len(at) > 1]
    for path, text in files.items():
        for match in NOTE.finditer(text):
            name = _name(match.group(1))
            line = text.count("\n", 0, match.start()) + 1
            if name not in defined:
                problems.append(f"{path}:{line}: [Note: {name}] is defined nowhere")
                continue
            named = NOTE_IN.match(text, match.end())
            home, said = defined[name][0].split(":")[0], named.group(1).lstrip("./") if named else None
            if named and home != said and not home.endswith("/" + said):
                problems.append(f"{path}:{line}: [Note: {name}] in {named.group(1)}, but it is defined in {home}")
    return sorted(set(problems))


# [Note: GPU blocks] README's fenced ```bash blocks are its shell commands. A block whose
# first line is a comment starting with `# GPU` is for GPU machines and is not run in CI;
# every other block runs in CI, command by command (`\` continuations joined), in one
# temporary folder as a session: each command sees the files the ones before it wrote.
GPU_MARK = "# GPU"
SHELL_FENCES = {"bash", "sh", "shell", "console", "zsh"}


@dataclass(frozen=True)
class Command:
    line: str  # the command as README shows it (continuations joined)
    gpu: bool  # in a block marked `# GPU`
    shown: str | None  # the output README shows right after its block, for the block's last command


def guide_commands(text: str) -> list[Command]:
    """README's shell commands in order; comment lines dropped."""
    blocks = list(FENCE.finditer(text))
    commands = []
    for at, block in enumerate(blocks):
        fence, body = block.groups()
        if fence not in SHELL_FENCES:
            continue
        gpu = body.lstrip().startswith(GPU_MARK)
        lines = [line for line in body.replace("\\\n", " ").splitlines() if line.strip() and
                 not line.lstrip().startswith("#")]
        nxt = blocks[at + 1] if at + 1 < len(blocks) else None
        shown = nxt.group(2) if nxt and nxt.group(1) == "" and nxt.start() == block.end() + 1 else None
        for i, line in enumerate(lines):
            commands.append(Command(re.sub(r"\s+", " ", line).strip(), gpu, shown if i == len(lines) - 1 else None))
    return commands


INSTALL = re.compile(r"^(?:python -m )?pip install [^&]*(?:&&\s*|$)")


def without_install(line: str) -> str:
    """The command with its leading `pip install ...` (and `&&`) taken off: CI has installed
    the extras before the suite runs (`.ci/run`), so what is left is what the user runs next."""
    return INSTALL.sub("", line).strip()


# -- schedule tables: their figures are the simulator's --------------------------------------

TABLE_PP, TABLE_M = 4, 16  # the tables' setting: pp=4, 16 microbatches, default costs
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def markdown_table(text: str, header: str) -> list[dict[str, str]]:
    """The rows of the Markdown table whose header line starts with `header`, each as
    {column: cell} (cells stripped)."""
    lines = text.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith(header))
    columns = [c.strip() for c in lines[start].strip().strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(columns, (c.strip() for c in line.strip().strip("|").split("|")))))
    return rows


def schedule_of(cell: str):
    """(family, keyword arguments) of the first `engine` or `NAME --flag V` a cell names, or
    None where it names no family of ours (e.g. `auto`)."""
    from pipeschedule.compiler.families import FAMILIES

    code = CODE.search(cell)
    if code is None:
        return None
    words = code.group(1).split()
    name, _, params = words[0].partition(":")
    kwargs = dict(p.split("=") for p in params.split(",") if p)
    kwargs.update(zip((w.lstrip("-") for w in words[1::2]), words[2::2]))
    family = next((f.name for f in FAMILIES.values() if name in (f.name, f.engine)), None)
    if family is None:
        return None
    return family, {k: int(v) for k, v in kwargs.items() if k in ("virtual", "cap")}


def simulated_figures(family: str, kwargs: dict) -> dict:
    """What a schedule table says of a schedule at TABLE_PP, TABLE_M under the default costs:
    step time, bubble, in flight per rank, activations per rank (microbatches through a
    rank's whole share: a (stage, mb) stash weighs 1/virtual) and throughput against 1F1B."""
    from fractions import Fraction

    from pipeschedule import compile_schedule
    from pipeschedule.simulate import CostModel, simulate

    schedule = compile_schedule(family, pp=TABLE_PP, microbatches=TABLE_M, **kwargs)
    result = simulate(schedule)
    unit = CostModel.default(schedule)
    stash = CostModel(unit.forward, unit.backward, unit.weight,
                      {"stash": (Fraction(1, schedule.virtual),) * schedule.num_stages})
    base = simulate(compile_schedule("1f1b", pp=TABLE_PP, microbatches=TABLE_M)).step_time
    return {"step": result.step_time, "bubble": result.bubble_fraction, "inflight": list(result.peak_inflight),
            "activations": [float(b) for b in simulate(schedule, stash).peak_bytes],
            "throughput": base / result.step_time}


def table_mismatches(rows: list[dict[str, str]], columns: dict[str, str]) -> list[str]:
    """Cells of `rows` whose figure is not the simulator's. `columns` maps a column to what
    it shows: "step", "bubble", "throughput" (rounded as written), "inflight" (a list),
    "activations" (rank 0's, then the fullest rank's in parentheses where given)."""
    out = []
    for row in rows:
        found = schedule_of(next(iter(row.values())))
        if found is None:
            continue
        figures = simulated_figures(*found)
        for column, what in columns.items():
            cell = row[column]
            numbers = [float(x) for x in NUMBER.findall(cell)]
            if what == "inflight":
                ok = numbers == figures["inflight"]
            elif what == "activations":
                acts = figures["activations"]
                ok = numbers[:1] == [acts[0]] and (len(numbers) < 2 or numbers[1] == max(acts))
            else:
                digits = len(cell.partition(".")[2])
                ok = bool(numbers) and round(figures[what], digits) == numbers[0]
            if not ok:
                out.append(f"{found[0]} {found[1]}: {column} {cell!r}, the simulator gives {figures[what]}")
    return out
