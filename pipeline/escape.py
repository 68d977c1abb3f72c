"""Where a competitor's string lands, and the one rule that makes it inert there.

Every string a submission, a result document or a pull request controls (a flag's code and message, a
login, an error message, a log tail, a workload or shape name) reaches a reader through one of four
destinations, each with one function here and no other escaping anywhere else:

- `md_inline`: GitHub markdown inline text, also a table cell (the PR comment, the check summary,
  leaderboard.md, the validation verdict). One line; nothing in it may become a link, an image, an
  @mention, an issue reference (#12, GH-12), math ($...$), HTML, emphasis, a heading or a table cell.
- `md_heading`: the text of a heading we open (the same rule: a heading's text is inline text).
- `md_code_block`: text shown verbatim (a log tail, a traceback): a fence longer than any backtick run
  inside, so nothing can close it.
- `terminal` / `terminal_lines`: a job log or a terminal. Control and invisible format characters are
  shown as escapes (\\x1b, \\r, \\u202e), never sent raw: a carriage return or an ANSI sequence could
  otherwise draw a forged `verdict: PASSED` over the real one; a line that would start with `::` (a
  GitHub Actions workflow command, which the runner reads from any step's output) is defused the same way.

Why these means: markdown's own backslash escapes stop markdown syntax (the parser removes them), but
GitHub links @mentions, issue references, URLs and emoji after parsing, in the text itself, so those get
a zero-width space (U+200B) after the character that starts them. A backslash does not stop GitHub's
math either (a documented limitation); GitHub's own advice is a `$` on its own inside `<span>`, so that
no two dollars share a text run. tests/test_escape.py parses what each rule writes for arbitrary strings
with a CommonMark/GFM parser (markdown-it-py) and checks all of this.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

ZWSP = "\u200b"
DOLLAR = "<span>$</span>"

# C0/C1 controls, format characters (bidi overrides, zero-width characters, the BOM, tag characters),
# surrogates, line and paragraph separators: invisible or acting on the text around them
_HIDDEN_CATEGORIES = frozenset(("Cc", "Cf", "Cs", "Zl", "Zp"))
# What can start markdown inside a line: a backslash, a code span, emphasis, a link or image (both need
# a `[`, so `(`, `)` and `!` stay as they are), a table cell, strikethrough, a heading's closing `#`s.
# `_` makes no emphasis between two letters or digits (snake_case stays readable); elsewhere it is escaped.
_MD_SPECIAL = re.compile(r"([\\`*\[\]|~#]|(?<![^\W_])_|_(?![^\W_]))")
# mentions and emails, issue references; a colon only where GitHub could make something of it: a URL's
# scheme (`://`, `mailto:`, `xmpp:`) or an emoji's `:name:` (GitHub has no emoji named by digits alone but
# :100: and :1234:), so a time (03:48:16) or a `file.py:name` reads and copies as itself
# (the name is matched as it stands escaped: `\_` is an `_` once markdown has read it)
_NAME = r"(?:\\?[a-z0-9_+-])+"
_AFTER = re.compile(rf"([@#]|:(?=//)|(?i:(?<=mailto)|(?<=xmpp)):|:(?=(?![0-9]+:){_NAME}:|(?:100|1234):))")
_LINE_START = re.compile(r"^([-+=](?=[\s=+-]|$)|\d{1,9}[.)](?=\s|$))")
_GH_REF = re.compile(r"(?i)(gh)(?=-)")  # GH-12 is an issue reference too
_WWW = re.compile(r"(?i)w(?=ww)")
_PLAIN_NUMBER = re.compile(r"[0-9][0-9,.]*( - [0-9][0-9,.]*)?(x|%)?")
_WORKFLOW_COMMAND = re.compile(r"^([ \t]*)(::|##\[)")


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    n = ord(c)
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _hidden(c: str) -> bool:
    return unicodedata.category(c) in _HIDDEN_CATEGORIES


def visible(text: Any, *, keep: str = "") -> str:
    """`text` with every control or invisible format character written as an escape (`\\x1b`, `\\u202e`),
    except those in `keep` (e.g. "\\n\\t" for text shown over several lines)."""
    s = str(text)
    if s.isprintable():
        return s  # the common case (no hidden character is printable), without a walk in Python
    return "".join(_escape_char(c) if c not in keep and _hidden(c) else c for c in s)


def _cut(s: str, limit: int | None) -> str:
    if limit is not None and len(s) > limit:
        return s[: max(0, limit - 3)] + "..."
    return s


# ---- GitHub markdown ----

# a colon that a colon right after the text would close into an emoji's `:name:`
_OPEN_AT_END = re.compile(rf":(?=(?:(?![0-9]+\Z){_NAME}|100|1234)\Z)")


def md_inline(text: Any, limit: int | None = 500, *, before_colon: bool = False) -> str:
    """Untrusted text as inert inline markdown on one line (a paragraph, a list item, a table cell), cut
    to `limit` characters before escaping. Whitespace runs (newlines too) become one space. `before_colon`:
    the caller writes a colon right after it (`### {x}: PASSED`), which could close an emoji."""
    s = re.sub(r"[ \t\r\n]+", " ", str(text)).strip()
    s = visible(s)
    if _PLAIN_NUMBER.fullmatch(s) and not _LINE_START.match(s):  # "1." alone would open a list
        return s
    s = _cut(s, limit)
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = _MD_SPECIAL.sub(r"\\\1", s)
    # at the start of a line it would open a list, a thematic break or a setext heading's underline
    s = _LINE_START.sub(lambda m: m.group(1)[:-1] + "\\" + m.group(1)[-1], s, count=1)
    s = _GH_REF.sub(r"\1" + ZWSP, s)
    s = _AFTER.sub(r"\1" + ZWSP, s)
    if before_colon:
        s = _OPEN_AT_END.sub(":" + ZWSP, s)
    s = _WWW.sub("w" + ZWSP, s)
    return s.replace("$", DOLLAR)


def md_heading(text: Any, limit: int | None = 200) -> str:
    """Untrusted text inside a heading we open (`### {md_heading(x)}: ...`): a heading's text is inline
    text, so the inline rule, shorter."""
    return md_inline(text, limit, before_colon=True)


def md_code_block(text: Any, lang: str = "text", limit: int | None = None) -> str:
    """Untrusted text verbatim, in a fence longer than any backtick run inside it (so no line of it can
    close the block), its last `limit` characters at most; control characters shown as escapes."""
    if not re.fullmatch(r"[a-z]{0,16}", lang):
        raise ValueError(f"a code block's language is ours, a short word: {lang!r}")
    s = str(text).replace("\r\n", "\n")
    if limit is not None and len(s) > limit:
        s = s[-limit:]
    s = visible(s.rstrip("\n"), keep="\n\t")
    longest = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{s}\n{fence}"


# ---- the terminal and the job log ----

def _defuse_command(line: str) -> str:
    m = _WORKFLOW_COMMAND.match(line)
    if not m:
        return line
    return m.group(1) + _escape_char(m.group(2)[0]) + line[m.end(1) + 1:]


def terminal(text: Any, limit: int | None = None) -> str:
    """Untrusted text on one line of a terminal or job log: every control character (newlines too) and
    invisible format character shown as an escape; no workflow command at its start."""
    return _defuse_command(visible(_cut(str(text), limit)))


def terminal_lines(text: Any) -> list[str]:
    """Untrusted text over several lines (a log tail): its lines, each as `terminal` makes one (a
    carriage return shown as \\r, never returning the cursor), tabs kept."""
    return [_defuse_command(visible(line, keep="\t")) for line in str(text).replace("\r\n", "\n").split("\n")]


def printable(text: str) -> str:
    """A name or a line quoted back to its author on one line (a PR's path, a diff's header): every
    character Python would not print written as repr writes it (`\\x1b`, `\\u202e`, `\\n`)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def easy_to_miss(text: str) -> str:
    """The characters of a name a reader would not see or would take for others, named; "" if none."""
    odd = dict.fromkeys(c for c in text if c.isspace() or not c.isprintable() or not c.isascii())
    if not odd:
        return ""
    names = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, 'an unnamed character')}" for c in odd)
    where = " at its end" if len(odd) == 1 and text.endswith(tuple(odd)) else ""
    return f" (it holds {names}{where}, easy to miss)"
