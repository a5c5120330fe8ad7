"""The user docs cannot drift from the command lines: every `pvsched` and
`pvschedd` command the docs give (in shell blocks, after a `$ ` or `# `
prompt in other blocks, and in inline code) names a subcommand that exists
and only flags that subcommand defines. The definitions are the manual
pages `pvsched man` renders from the programs' own clap definitions (the
same text as `--help`), so nothing here lists a flag by hand."""

import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
# Flags every program has.
ALWAYS = {"--help", "--version"}
# Subcommands with no page: `pvsched man` (hidden; for packagers).
HIDDEN = {"man": {"--out"}}
# Where a command starts within a line.
SEPARATORS = re.compile(r"&&|\|\||;|\||\$\(|`")
# Words that may come before the program in a command.
PREFIXES = {"sudo", "exec", "time", "nohup"}


def commands(path):
    """(line number, command text) of every pvsched/pvschedd command in
    the markdown file `path`."""
    out, fence, lang, pending = [], False, "", ""
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.rstrip()
        m = re.match(r"\s*```(\S*)", line)
        if m:
            fence, lang = not fence, m.group(1) if not fence else ""
            continue
        if fence:
            text = pending + line
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            prompt = re.match(r"\s*[$#] (.*)", text)
            if lang in ("sh", "shell", "bash", "console"):
                out.append((n, prompt.group(1) if prompt else text))
            elif prompt:
                out.append((n, prompt.group(1)))
            continue
        for span in re.findall(r"`([^`]+)`", line):
            out.append((n, span))
    found = []
    for n, text in out:
        for seg in SEPARATORS.split(text):
            try:
                words = shlex.split(seg, comments=True)
            except ValueError:
                words = seg.split()
            while words and (words[0] in PREFIXES or re.match(r"\w+=", words[0])):
                words = words[1:]
            if words and words[0] in ("pvsched", "pvschedd") and len(words) > 1:
                found.append((n, words))
    return found


def man_pages(tmp_path, pvsched):
    subprocess.run([str(pvsched), "man", "--out", str(tmp_path)], check=True)
    return {p.name: p.read_text().replace("\\-", "-") for p in tmp_path.iterdir()}


def page_of(pages, words):
    """The page of the (sub)command `words` names and how many words name
    it: pvschedd.8, else the longest pvsched-A-B.1 the words spell."""
    if words[0] == "pvschedd":
        return "pvschedd.8", 1
    best = ("pvsched.1", 1)
    name = "pvsched"
    for i, w in enumerate(words[1:], 2):
        if w.startswith("-"):
            break
        name += "-" + w
        if name + ".1" in pages:
            best = (name + ".1", i)
        else:
            break
    return best


def test_every_documented_flag_exists(tmp_path, release_bins):
    pages = man_pages(tmp_path, release_bins.pvsched)
    subcommands = {p[len("pvsched-"):-2] for p in pages if p.startswith("pvsched-")}
    bad, checked = [], 0
    for doc in DOCS:
        for n, words in commands(doc):
            page, used = page_of(pages, words)
            where = f"{doc.relative_to(REPO)}:{n}: {' '.join(words)}"
            if words[0] == "pvsched" and words[1] in HIDDEN:
                bad += [f"{where}: {w} is not an option of pvsched {words[1]}" for w in words[2:]
                        if w.startswith("--") and w.split("=", 1)[0] not in HIDDEN[words[1]]]
                continue
            if words[0] == "pvsched" and used == 1 and not words[1].startswith("-"):
                # Output quoted in the docs ("pvsched: ...", "pvsched
                # qemu-attach: ...") is not a command.
                if not words[1].endswith(":"):
                    bad.append(f"{where}: no subcommand {words[1]!r} (there are "
                               f"{', '.join(sorted(subcommands))})")
                continue
            for w in words[used:]:
                if not w.startswith("--"):
                    continue
                flag = w.split("=", 1)[0]
                checked += 1
                if flag not in ALWAYS and not re.search(re.escape(flag) + r"\b", pages[page]):
                    bad.append(f"{where}: {flag} is not an option of {page[:-2]}")
    assert not bad, "docs name commands or flags the programs do not have:\n" + "\n".join(bad)
    print(f"{checked} flags in the docs' pvsched and pvschedd commands, each defined")
