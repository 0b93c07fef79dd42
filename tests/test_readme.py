"""README.md against the product it describes: every flag and every choice of
``paratrain train --help``, every command ``paratrain --help`` lists, every
``paratrain train ...`` line it shows, and its own limits (length, one date, no
tracker words). In-process and fast: the parser is built, never run."""
import argparse
import pathlib
import re
import shlex

from paratrain import cli
from paratrain.train.options import build_parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))

# Options whose value is free text: the forms their help documents, each of which
# the README must name too (the test checks that the help still lists them).
DOCUMENTED_FORMS = {
    "--compression": ("none", "fp16", "bf16", "topk", "powersgd", "onebit"),
    "--algorithm": ("direct", "ring", "tree", "naive"),
}
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
TRACKER_WORDS = re.compile(r"\b(issue|session)\s+#?\d+", re.IGNORECASE)


def code_texts(text):
    """The text of every fenced block and every `code span`, where flags and choices are written."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    outside = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return fenced + re.findall(r"`([^`\n]+)`", outside)


def tokens(text):
    """Words of the README's code, split where a list of choices is (`a|b|c`, `a, b`, `a / b`)."""
    words = set()
    for code in code_texts(text):
        words.update(w for w in re.split(r"[\s|,/=\[\]()'\"\\]+", code) if w)
    return words


def mentioned(word, words):
    """``word`` as a token, or as the head of a parametrised form (``topk`` in ``topk:<ratio>``)."""
    return word in words or any(w.startswith(word + ":") for w in words)


def public_actions():
    return [a for a in build_parser()._actions
            if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]


def long_flag(action):
    return max(action.option_strings, key=len) if action.option_strings else None


def test_every_train_flag_is_in_the_readme():
    missing = [flag for a in public_actions() for flag in a.option_strings
               if flag.startswith("--") and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", README)]
    assert missing == [], f"README.md does not mention these `paratrain train` flags: {missing}"


def test_every_train_choice_is_in_the_readme():
    words = tokens(README)
    missing = []
    for a in public_actions():
        if a.choices is None:
            continue
        missing += [f"{long_flag(a)} {c}" for c in a.choices if not mentioned(str(c), words)]
    assert missing == [], f"README.md does not mention these `paratrain train` choices: {missing}"


def test_every_documented_free_text_form_is_in_the_readme():
    words = tokens(README)
    actions = {long_flag(a): a for a in public_actions()}
    missing = []
    for a in actions.values():
        if a.choices is not None or not a.help:
            continue
        forms = set(re.findall(r"\b([a-z][\w-]*):<\w+>", a.help))   # topk:<ratio>, powersgd:<rank>
        for form in DOCUMENTED_FORMS.get(long_flag(a), ()):
            assert re.search(rf"\b{form}\b", a.help), f"{long_flag(a)}'s help no longer names {form}"
            forms.add(form)
        missing += [f"{long_flag(a)} {f}" for f in sorted(forms) if not mentioned(f, words)]
    for flag in DOCUMENTED_FORMS:
        assert flag in actions, f"{flag} is gone from `paratrain train`; update DOCUMENTED_FORMS"
    assert missing == [], f"README.md does not mention these documented forms: {missing}"


def test_every_command_of_paratrain_help_is_in_the_readme():
    listed = cli.USAGE.split("commands:", 1)[1]
    commands = re.findall(r"^  ([a-z][\w-]*)\s{2,}", listed, flags=re.MULTILINE)
    assert commands, "cli.USAGE lists no commands"
    names = [f"paratrain {c}" for c in commands]
    names += [f"paratrain bench {b}" for b in dict.fromkeys(re.findall(r"paratrain bench ([a-z][\w-]*)", cli.USAGE))]
    missing = [n for n in names if not re.search(rf"{re.escape(n)}(?![\w-])", README)]
    assert missing == [], f"README.md does not mention: {missing}"


def train_lines(text, spans=True):
    """The ``paratrain train ...`` command lines shown in ``text``, without comments,
    leaving out those with placeholders (``<id>``, ``X|Y``, ``...``)."""
    found = []
    for code in code_texts(text):
        lines = code.splitlines() if "\n" in code else ([code] if spans else [])
        for line in lines:
            line = line.split("#", 1)[0].strip()
            if line.startswith("paratrain train") and not re.search(r"[<|]|\.\.\.", line):
                found.append(line)
    return found


def test_the_train_commands_shown_parse_and_pass_the_front_ends_checks():
    from paratrain.train import job
    shown = train_lines(README) + [l for doc in DOCS for l in train_lines(doc.read_text(), spans=False)]
    assert len(shown) >= 10
    resolve = getattr(getattr(job, "layout", None), "resolve", None) or getattr(job, "resolve_layout", None)
    problems = []
    for line in dict.fromkeys(shown):
        argv = shlex.split(line)[2:]
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            problems.append(f"{line}: argparse refuses it")
            continue
        if args.resume or args.model.startswith("hf-") or resolve is None:
            continue   # a checkpoint to find, transformers to import: parsing is the check
        problem = resolve(args, argv) or job.check(args)
        if problem:
            problems.append(f"{line}: {problem}")
    assert problems == []


def test_the_readme_is_short_dated_once_and_free_of_tracker_words():
    lines = README.count("\n") + 1
    assert lines <= 650, f"README.md has {lines} lines; keep it under 650 (details go to docs/)"
    dates = DATE.findall(README)
    assert len(set(dates)) <= 1 and len(dates) <= 1, f"README.md holds more than one date: {dates}"
    for path in [ROOT / "README.md"] + DOCS:
        words = TRACKER_WORDS.findall(path.read_text())
        assert not words, f"{path.relative_to(ROOT)} names tracker issues or sessions: {words}"


def test_the_test_command_block_is_intact():
    block = README.split("<!-- test-command -->", 1)[1].split("```", 2)[1].strip()
    assert block == ("python3 -m venv .venv && .venv/bin/pip install -q -e '.[test,mpi]' && "
                     ".venv/bin/python -m pytest -q -n 2")
