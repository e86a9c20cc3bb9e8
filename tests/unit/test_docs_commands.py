"""Every shell command in README.md and docs/*.md is checked against the code it names, without running it: fenced
```bash/```sh/```shell/```console blocks (in a console block only its ``$ `` lines) and ``$ `` lines outside fences.

- ``sdserve ...`` (also ``.venv/bin/sdserve``, ``python -m server.cli``) is parsed by the real parser that
  server/cli/main.py builds, with abbreviations off, so a renamed flag or subcommand in a doc fails here;
- ``make TARGET ... VAR=value``: the target is a rule of the Makefile and the variable is one it reads;
- ``curl``: its URL's path is a route of the app (the route table create_app builds, on a fake engine) with the
  method curl uses, its ``-d`` JSON parses and names only fields of the route's request schema (the OpenAPI
  document), and every curl option is one this checker knows (an unknown option fails: add it below);
- ``python -c CODE`` and ``python - <<EOF`` heredocs compile; ``python path/script.py --option``: the script is this
  repo's and defines the option; ``pytest``: its paths exist and its ``-m`` markers are declared in pyproject.toml;
- shell plumbing (grep, sleep, seq, ...) needs nothing;
- anything else (podman, kubectl, apt-get, ...) runs outside this repo's reach: its block carries
  ``<!-- not run: why -->`` on the line before the fence, and the test fails on an unmarked one (and on a marker that
  excuses nothing). Blocks marked ``<!-- runnable: ... -->`` run for real in tests/e2e/test_docs_examples.py; their
  commands are checked here too.

The prose's inline ``sdserve``/``make``/``pytest``/``python`` code spans are often fragments with placeholders: their
subcommands, options, targets, markers and paths must exist. docs/reference/ (generated from the code) is not read."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import pytest
from fastapi import FastAPI
from starlette.routing import Match

from server.app import create_app
from server.cli.main import parser as cli_parser
from server.settings import load_settings
from tests.unit.fakes import HashedEngine

ROOT = Path(__file__).resolve().parents[2]
SHELL = {"bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"^<!-- not run: (\S.*?) -->$")
RUNNABLE = "<!-- runnable:"
PLUMBING = {"grep", "cat", "sleep", "seq", "echo", "true", "false", "test", "head", "tail", "break", "continue",
            "cd", "mkdir", "ls", "export", "wc", "sort", "jq", "for", "if", "while", "until"}
"""Programs a doc may use without a marker: the shell's own plumbing around the checked commands."""
KEYWORDS = {"do", "done", "then", "else", "elif", "fi", "!", "{", "}"}
SEPARATORS = set(";&|()")
REDIRECTS = {"<", ">", ">>", ">&", "<&", "<<", "<<-", "&>", "<>", ">|"}
CURL_VALUE = {"-H", "--header", "-d", "--data", "--data-raw", "--data-binary", "--data-urlencode", "-F", "--form",
              "-X", "--request", "-o", "--output", "-D", "--dump-header", "-u", "--user", "-w", "--write-out",
              "-m", "--max-time", "--connect-timeout", "-A", "--user-agent", "--cacert", "--cert", "--key",
              "--retry", "-e", "--referer", "--json"}
CURL_FLAGS = {"-s", "--silent", "-S", "--show-error", "-f", "--fail", "--fail-with-body", "-L", "--location",
              "-i", "--include", "-v", "--verbose", "-N", "--no-buffer", "-k", "--insecure", "-I", "--head",
              "-G", "--get", "--compressed"}
DATA = {"-d", "--data", "--data-raw", "--data-binary", "--json"}


@dataclass(frozen=True)
class Command:
    """One simple command of a doc: its words (quotes removed), the heredoc it reads, where it is."""

    where: str
    words: tuple[str, ...]
    heredoc: str | None
    marker: str | None
    """The block's ``<!-- not run: why -->`` reason, or "runnable" for a block the e2e docs test runs."""


@dataclass(frozen=True)
class Block:
    where: str
    lines: tuple[str, ...]
    marker: str | None


def _marker(text: str, start: int) -> str | None:
    before = text[:start].rstrip("\n").rsplit("\n", 1)[-1].strip()
    if before.startswith(RUNNABLE):
        return "runnable"
    found = NOT_RUN.match(before)
    return found.group(1) if found else None


def blocks(text: str, name: str) -> Iterator[Block]:
    """The shell blocks of one page, each as its command lines, and every ``$ `` line outside a fence."""
    outside = text
    for match in FENCE.finditer(text):
        outside = outside.replace(match.group(0), "\n" * match.group(0).count("\n"), 1)
        language, body = match.group(1), match.group(2)
        line = text[:match.start()].count("\n") + 1
        if language not in SHELL:
            continue
        rows = body.split("\n")
        if language == "console":  # only the prompt lines are commands; the rest is their output
            rows = [r[2:] if r.startswith("$ ") else "" for r in rows]
        else:
            rows = [r[2:] if r.startswith("$ ") else r for r in rows]
        yield Block(f"{name}:{line}", tuple(rows), _marker(text, match.start()))
    for number, row in enumerate(outside.split("\n"), 1):
        if row.lstrip().startswith("$ "):
            start = sum(len(r) + 1 for r in outside.split("\n")[:number - 1])
            yield Block(f"{name}:{number}", (row.lstrip()[2:],), _marker(outside, start))


def _logical(lines: tuple[str, ...]) -> Iterator[tuple[str, str | None]]:
    """Backslash continuations joined; a heredoc's body (up to its end word) handed over with its line."""
    pending = iter(lines)
    for row in pending:
        while row.endswith("\\") or not _closed(row):
            following = next(pending, None)
            if following is None:
                break
            row = (row[:-1] + " " if row.endswith("\\") else row + "\n") + following
        heredoc = None
        opened = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", row)
        if opened:
            body = []
            for inner in pending:
                if inner.strip() == opened.group(1):
                    break
                body.append(inner)
            heredoc = "\n".join(body)
        yield row, heredoc


def _lex(row: str) -> list[str]:
    lexer = shlex.shlex(row, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def _closed(row: str) -> bool:
    """Whether the line's quotes close (a quoted JSON body may span lines)."""
    try:
        _lex(row)
    except ValueError:
        return False
    return True


def _segments(row: str) -> Iterator[list[str]]:
    """The simple commands of one line: split at ; & | ( ), redirections and their targets dropped, comments
    dropped, leading shell keywords and VAR=value assignments dropped."""
    row = re.sub(r"(?<![\w-])\d+(?=[<>])", "", row)  # 2>&1: the descriptor number is not an argument
    words: list[str] = []
    tokens = iter(_lex(row))
    for token in tokens:
        if token in REDIRECTS:
            next(tokens, None)
        elif set(token) <= SEPARATORS | {"<", ">"}:
            yield from _command(words)
            words = []
        else:
            words.append(token)
    yield from _command(words)


def _command(words: list[str]) -> Iterator[list[str]]:
    while words and (words[0] in KEYWORDS or re.fullmatch(r"[A-Za-z_]\w*=.*", words[0])):
        words = words[1:]
    if words and words != ["$"]:
        yield words


def commands(text: str, name: str) -> list[Command]:
    found = []
    for block in blocks(text, name):
        for row, heredoc in _logical(block.lines):
            for words in _segments(row):
                found.append(Command(block.where, tuple(words), heredoc, block.marker))
    return found


def all_commands() -> list[Command]:
    """Every command of README.md and docs/*.md (not docs/reference/, which is generated)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [c for page in pages
            for c in commands(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)))]


class DocError(Exception):
    """A command of a doc that no longer matches the code."""


def _strict(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser and every subparser with abbreviations off (``--plan`` must not pass for ``--plan-size``) and
    errors raised, not printed and exited."""

    def error(message: str) -> NoReturn:
        raise DocError(f"{p.prog}: {message}")

    p.allow_abbrev = False
    p.error = error  # type: ignore[method-assign]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _strict(sub)
    return p


@cache
def strict_parser() -> argparse.ArgumentParser:
    """server/cli/main.py's parser, strict (parsing never changes it, so one serves every command)."""
    return _strict(cli_parser())


def _synopses(words: tuple[str, ...]) -> list[list[str]]:
    """A usage line's optional ``[--flag value]`` groups: once left out, once with all of them."""
    if not any(w.startswith("[") or w.endswith("]") for w in words):
        return [list(words)]
    bare, full, depth = [], [], 0
    for word in words:
        depth += word.count("[")
        full.append(word.strip("[]"))
        if depth == 0:
            bare.append(word)
        depth -= word.count("]")
    return [bare, full]


def check_cli(args: list[str]) -> None:
    for words in _synopses(tuple(args)):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                namespace = strict_parser().parse_args(words)
        except SystemExit as exc:  # --help and --version print and exit 0: the words parsed
            if exc.code != 0:
                raise DocError(f"sdserve {' '.join(words)}: exit {exc.code}") from exc
            continue
        assert callable(getattr(namespace, "run", None)), f"sdserve {' '.join(words)}: no command to run"


@cache
def makefile() -> tuple[frozenset[str], frozenset[str]]:
    """The Makefile's rule names and the variables it assigns."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    rules = {name for line in re.findall(r"^([^\s#=:][^=:]*?):(?!=)", text, re.MULTILINE)
             for name in line.split()}
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:]?=", text, re.MULTILINE))
    return frozenset(rules), frozenset(variables)


def check_make(args: list[str]) -> None:
    rules, variables = makefile()
    targets = [a for a in args if "=" not in a and not a.startswith("-")]
    assert targets, "make with no target: name the target the doc means"
    for arg in args:
        if "=" in arg:
            assert arg.split("=", 1)[0] in variables, f"make {arg}: the Makefile reads no such variable"
        elif arg.startswith("-"):
            raise DocError(f"make {arg}: not an option a doc should need")
        else:
            assert arg in rules, f"make {arg}: no such target in the Makefile"


@cache
def app() -> FastAPI:
    """The real app on a fake engine (its lifespan is never entered: only its route table and OpenAPI are read)."""
    return create_app(HashedEngine(), load_settings("dev"))


def _curl(args: list[str]) -> tuple[str, str, list[str], list[str]]:
    """(method, URL, -d bodies, -F fields) of a curl command line."""
    method, url, bodies, forms = None, None, [], []
    words = iter(args)
    for word in words:
        if word in CURL_VALUE:
            value = next(words, "")
            if word in DATA:
                bodies.append(value)
            elif word in ("-F", "--form"):
                forms.append(value)
            elif word in ("-X", "--request"):
                method = value
        elif word.startswith("-") and word not in CURL_FLAGS:
            if not (word[1:].isalpha() and all(f"-{c}" in CURL_FLAGS for c in word[1:])):  # -sS, -sf
                raise DocError(f"curl {word}: an option this checker does not know (add it to CURL_*)")
        elif word.startswith(("http://", "https://")):
            url = word
        elif not word.startswith("-"):
            raise DocError(f"curl {word}: an argument that is neither an option's value nor a URL")
    if url is None:
        raise DocError("curl with no http(s) URL")
    head = "-I" in args or "--head" in args
    return method or ("POST" if bodies or forms else "HEAD" if head else "GET"), url, bodies, forms


def _fields(path: str, method: str) -> set[str] | None:
    """The top-level fields of the route's JSON request schema, or None where the document gives none."""
    document = app().openapi()
    for template, operations in document["paths"].items():
        if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path):
            body = operations.get(method.lower(), {}).get("requestBody", {})
            schema = body.get("content", {}).get("application/json", {}).get("schema", {})
            if "$ref" in schema:
                schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
            if "properties" in schema and schema.get("additionalProperties") is not True:
                return set(schema["properties"])
    return None


def check_curl(args: list[str]) -> None:
    method, url, bodies, forms = _curl(args)
    path = urlsplit(url).path
    scope = {"type": "http", "path": path, "method": method, "root_path": "", "headers": [], "query_string": b""}
    matches = {route.matches(scope)[0] for route in app().router.routes}
    assert Match.FULL in matches, (f"curl {method} {path}: the app has no such route"
                                   + (" for that method" if Match.PARTIAL in matches else ""))
    fields = _fields(path, method)
    for body in bodies:
        if body.startswith("@"):
            continue
        try:
            parsed: Any = json.loads(body)
        except json.JSONDecodeError as exc:
            raise DocError(f"curl -d for {path}: not JSON ({exc})") from exc
        if fields is not None and isinstance(parsed, dict):
            unknown = set(parsed) - fields
            assert not unknown, f"curl {path}: fields the request schema does not have: {sorted(unknown)}"
    for form in forms:
        assert re.fullmatch(r"[\w\[\]]+=.+", form, re.DOTALL), f"curl -F {form}: not name=value"


@cache
def markers() -> frozenset[str]:
    """The pytest markers pyproject.toml declares."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return frozenset(m.split(":")[0] for m in config["tool"]["pytest"]["ini_options"]["markers"])


def check_pytest(args: list[str]) -> None:
    """Its paths exist and its ``-m`` expression names declared markers."""
    words = iter(args)
    for word in words:
        if word == "-m":
            names = set(re.findall(r"\w+", next(words, ""))) - {"not", "and", "or"}
            assert names <= markers(), f"pytest -m: markers pyproject.toml does not declare: {names - markers()}"
        elif not word.startswith("-"):
            assert (ROOT / word.split("::")[0]).exists(), f"pytest {word}: no such test path"


def check_script(args: list[str]) -> None:
    """``python path/to/script.py --option``: the script exists and defines every option named."""
    script = ROOT / args[0]
    assert script.is_file(), f"python {args[0]}: no such script"
    source = script.read_text(encoding="utf-8")
    for word in args[1:]:
        if word.startswith("--"):
            assert f'"{word.split("=")[0]}"' in source, f"python {args[0]}: defines no option {word}"


def check_python(args: list[str], heredoc: str | None, where: str) -> bool:
    """True where the command is one this checker covers (the CLI module, pytest, a script of this repo, -c code,
    a heredoc: compiled)."""
    if args[:2] == ["-m", "server.cli"]:
        check_cli(args[2:])
    elif args[:2] == ["-m", "pytest"]:
        check_pytest(args[2:])
    elif args and args[0].endswith(".py") and (ROOT / args[0].split("/")[0]).is_dir():
        check_script(args)
    elif "-c" in args:
        compile(args[args.index("-c") + 1], where, "exec")
    elif args[:1] == ["-"] and heredoc is not None:
        compile(heredoc, where, "exec")
    else:
        return False
    return True


def check(command: Command) -> bool:
    """Check one command; True where it was checked, False for a program this test does not know."""
    program, args = command.words[0], list(command.words[1:])
    name = program.rsplit("/", 1)[-1]
    if name == "sdserve":
        check_cli(args)
    elif name == "make":
        check_make(args)
    elif name == "curl":
        check_curl(args)
    elif name == "pytest":
        check_pytest(args)
    elif re.fullmatch(r"python3?(\.\d+)?", name):
        return check_python(args, command.heredoc, command.where)
    else:
        return name in PLUMBING
    return True


INLINE = re.compile(r"`((?:\.venv/bin/)?(?:sdserve|python3?|pytest) [^`]+|make [a-z][^`]*)`")
PLACEHOLDER = re.compile(r"[A-Z_]+|<.*|.*>|.*\|.*|\.\.\.")


def inline(text: str, name: str) -> list[tuple[str, str]]:
    """(where, span) of every inline ``sdserve``, ``make``, ``pytest`` or ``python`` code span outside the
    fences."""
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(f"{name}:{prose[:m.start()].count(chr(10)) + 1}", m.group(1)) for m in INLINE.finditer(prose)]


def check_inline(span: str) -> None:
    """A prose mention may be a fragment (``sdserve engines export --first-block``) or carry placeholders, so it is
    not parsed whole: its subcommands must exist and every option it names must be one of that subcommand's."""
    words = [w.strip("[],.;:") for w in span.split()]
    program = words[0].rsplit("/", 1)[-1]
    if program == "make":
        check_make([w for w in words[1:] if w and not PLACEHOLDER.fullmatch(w)])
    if program != "sdserve":
        if program != "make":
            check(Command("inline", tuple(shlex.split(span)), None, "inline"))
        return
    current = strict_parser()
    for word in words[1:]:
        choices = next((a.choices for a in current._actions if isinstance(a, argparse._SubParsersAction)), None)
        if word.startswith("-"):
            flag = word.split("=", 1)[0]
            assert flag in current._option_string_actions, f"{current.prog}: no option {flag}"
        elif choices is not None and word in choices:
            current = choices[word]
        elif choices is not None and not PLACEHOLDER.fullmatch(word):
            raise DocError(f"{current.prog}: no subcommand {word!r} (choose from {', '.join(choices)})")


def check_all(found: list[Command]) -> None:
    for command in found:
        check(command)


COMMANDS = all_commands()


def test_the_docs_hold_the_commands_this_test_checks() -> None:
    """The collector finds the commands the docs are known to hold (a broken pattern would pass vacuously)."""
    names = [c.words[0].rsplit("/", 1)[-1] for c in COMMANDS]
    pages = {c.where.split(":")[0] for c in COMMANDS}
    assert names.count("sdserve") >= 15 and names.count("curl") >= 6 and names.count("make") >= 6, names
    assert {"README.md", "docs/lora.md", "docs/caching.md", "docs/deployment.md", "docs/memory.md"} <= pages, pages


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where}:{c.words[0]}" for c in COMMANDS])
def test_doc_command_matches_the_code(command: Command) -> None:
    """The command parses with the real CLI, names a real make target, or hits a real route; a command this test
    cannot check sits in a block marked runnable or ``<!-- not run: why -->``."""
    try:
        checked = check(command)
    except DocError as exc:
        pytest.fail(f"{command.where}: {' '.join(command.words)}\n{exc}")
    assert checked or command.marker, (f"{command.where}: `{' '.join(command.words)}` is neither checked here nor "
                                       "in a block marked <!-- not run: why --> (or runnable)")


INLINE_SPANS = [span for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
                for span in inline(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)))]


def test_every_inline_command_names_real_subcommands_and_options() -> None:
    """The prose's ``sdserve ...`` and ``make ...`` mentions: a renamed option or subcommand there fails too."""
    assert len(INLINE_SPANS) >= 100, len(INLINE_SPANS)
    stale = []
    for where, span in INLINE_SPANS:
        try:
            check_inline(span)
        except (DocError, AssertionError) as exc:
            stale.append(f"{where}: `{span}`: {exc}")
    assert not stale, "\n".join(stale)


def test_every_not_run_marker_excuses_a_command() -> None:
    """A ``not run`` marker on a block whose commands are all checked here would hide the next unchecked one."""
    by_block: dict[str, list[Command]] = {}
    for command in COMMANDS:
        if command.marker and command.marker != "runnable":
            by_block.setdefault(command.where, []).append(command)
    idle = [where for where, found in by_block.items() if all(check(c) for c in found)]
    assert not idle, f"not-run markers on blocks this test checks in full: {idle}"


@pytest.mark.parametrize(("text", "wrong"), [
    ("```bash\nsdserve serve --modle models/tiny\n```", "unrecognized arguments"),
    ("```bash\n.venv/bin/sdserve doctor --model m --plan-siz 64x64\n```", "unrecognized arguments"),
    ("```sh\nsdserve engine tiny --out m\n```", "invalid choice"),
    ("```console\n$ sdserve gate --cache [--treshold 0.3]\nout: ok\n```", "unrecognized arguments"),
    ("```bash\nmake runn\n```", "no such target"),
    ("```bash\nmake run PROT=8001\n```", "no such variable"),
    ("```bash\ncurl -s http://127.0.0.1:8000/v1/images/generate -d '{}'\n```", "no such route"),
    ("```bash\ncurl -s http://127.0.0.1:8000/ready -d '{}'\n```", "for that method"),
    ("```bash\ncurl -s http://127.0.0.1:8000/v1/images/generations \\\n  -d '{\"prompt\": \"x\",}'\n```", "not JSON"),
    ("```bash\ncurl -s http://127.0.0.1:8000/v1/images/generations -d '{\"promt\": \"x\"}'\n```", "promt"),
    ("```bash\ncurl --frobnicate http://127.0.0.1:8000/ready\n```", "does not know"),
    ("```bash\npython3 -c 'print(1'\n```", "never closed"),
])
def test_a_stale_command_fails(text: str, wrong: str) -> None:
    """Each kind of drift this test exists for is caught, with a message naming it."""
    found = commands(text, "doc.md")
    assert found
    with pytest.raises((DocError, AssertionError, SyntaxError), match=wrong):
        check_all(found)


@pytest.mark.parametrize(("text", "wrong"), [
    ("Export with `sdserve engines export --frst-block` first.", "no option --frst-block"),
    ("Then `sdserve enginez build --profile P` builds it.", "no subcommand 'enginez'"),
    ("`sdserve doctor [--json] [--profil P]`", "no option --profil"),
    ("Run `make refs-all` after.", "no such target"),
    ("`pytest -m client_default tests/e2e/test_client_replays.py`", "client_default"),
    ("`.venv/bin/python -m pytest tests/gpus`", "no such test path"),
    ("`python benchmarks/gpu/device_check.py --rehearsal`", "no option --rehearsal"),
    ("`python benchmarks/bench_watermarks.py`", "no such script"),
])
def test_a_stale_inline_command_fails(text: str, wrong: str) -> None:
    (found,) = inline(text, "doc.md")
    with pytest.raises((DocError, AssertionError), match=wrong):
        check_inline(found[1])


def test_inline_placeholders_and_fragments_pass() -> None:
    for span in ("sdserve engines export --from <a diffusers SD folder> --out models/sd15", "sdserve COMMAND --help",
                 "sdserve engines optimize --model M --out O [--target cpu|cuda|tensorrt] [--fp16]",
                 "sdserve serve --lora-dir", "make run PORT=8001"):
        check_inline(span)


def test_an_unknown_program_needs_its_marker() -> None:
    unmarked = commands("```sh\npodman run sdserve:0.1.0 && curl -s http://127.0.0.1:8000/ready\n```", "doc.md")
    marked = commands("<!-- not run: needs podman -->\n```sh\npodman run sdserve:0.1.0\n```", "doc.md")
    assert [c.words[0] for c in unmarked] == ["podman", "curl"] and not check(unmarked[0])
    assert unmarked[0].marker is None and marked[0].marker == "needs podman"
    prompt = commands("```text\n$ sdserve nope\n```\nSee:\n<!-- not run: needs helm -->\n  $ helm install sdserve\n",
                      "doc.md")
    assert [(c.where, c.words[0], c.marker) for c in prompt] == [("doc.md:6", "helm", "needs helm")]
    heredoc = commands("```sh\npython - <<'PY'\nimport json\nprint(json.dumps({}))\nPY\n```", "doc.md")
    assert len(heredoc) == 1 and heredoc[0].heredoc == "import json\nprint(json.dumps({}))" and check(heredoc[0])
