#!/usr/bin/env python3
"""Check the relative links of every Markdown file in the repository.

Every Markdown file git knows of (tracked, plus new files that .gitignore does not hide, so that
a page is checked before it is committed) is read; every relative link in it (inline links and
images, reference definitions, HTML href/src attributes) must name a file or folder that exists,
and a `#fragment` into a Markdown file must name one of its headings (GitHub's slugs: lower case,
punctuation dropped, spaces to hyphens, -1, -2, ... for repeats) or an explicit HTML anchor.
Links with a scheme (http, https, mailto, ...) are skipped, and so is everything inside code
spans and fenced code blocks.

Prints each broken link as FILE:LINE: TARGET (why) and exits 1 when any is broken.
Standard library only:  python3 scripts/check-doc-links.py [--root DIR]
"""

import argparse
import os
import re
import subprocess
import sys
import unicodedata
from urllib.parse import unquote

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ATTR = re.compile(r"<(?:a|img|source)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']*)[\"']", re.I)
HTML_ANCHOR = re.compile(r"<[a-z]+\b[^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']*)[\"']", re.I)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files(root):
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "*.md"],
        cwd=root, check=True, capture_output=True,
    ).stdout.decode()
    return sorted({p for p in out.split("\0") if p and os.path.isfile(os.path.join(root, p))})


def strip_code_spans(line):
    """Blank out `code spans` (of any backtick run length), keeping the columns."""
    out, i = [], 0
    while i < len(line):
        if line[i] == "`":
            j = i
            while j < len(line) and line[j] == "`":
                j += 1
            run = line[i:j]
            end = line.find(run, j)
            while end != -1 and end + len(run) < len(line) and line[end + len(run)] == "`":
                end = line.find(run, end + len(run) + 1)
            if end == -1:
                out.append(run)
                i = j
                continue
            out.append(" " * (end + len(run) - i))
            i = end + len(run)
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def heading_text_to_slug(text):
    """GitHub's heading anchor: the rendered text, lower case, punctuation dropped, ' ' -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"!?\[([^\]]*)\]\[[^\]]*\]", r"\1", text)  # reference links
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "")
    text = re.sub(r"(\*+)(\S(?:.*?\S)?)\1", r"\2", text)  # *emphasis*, **strong**
    text = re.sub(r"(?<![\w])(_+)(\S(?:.*?\S)?)\1(?![\w])", r"\2", text)  # _emphasis_
    text = text.strip().lower()
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in " -_" or cat[0] in "LMN":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def scan(path):
    """Yield ('heading', line, text) / ('anchor', line, id) / ('link', line, target)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    fence = None
    prev_text = None
    for n, raw in enumerate(lines, 1):
        m = FENCE.match(raw)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not raw.strip()[len(m.group(1)):].strip():
                fence = None
            prev_text = None
            continue
        if m:
            fence = m.group(1)
            prev_text = None
            continue
        if raw.startswith("    ") and prev_text is None and raw.strip():
            continue  # indented code block
        line = strip_code_spans(raw)
        h = ATX.match(line)
        if h:
            yield ("heading", n, h.group(2) or "")
            prev_text = None
        elif prev_text is not None and SETEXT.match(line) and not re.match(r"^ {0,3}-+\s*$", prev_text or "x"):
            yield ("heading", n - 1, prev_text)
            prev_text = None
            continue
        for a in HTML_ANCHOR.finditer(line):
            yield ("anchor", n, a.group(1))
        for lm in INLINE_LINK.finditer(line):
            yield ("link", n, lm.group(1))
        r = REF_DEF.match(line)
        if r:
            yield ("link", n, r.group(1))
        for a in HTML_ATTR.finditer(line):
            yield ("link", n, a.group(1))
        stripped = line.strip()
        is_para = stripped and not h and not stripped.startswith(("|", ">", "-", "*", "+")) \
            and not re.match(r"^\d+[.)]\s", stripped)
        prev_text = stripped if is_para else None


_anchor_cache = {}


def anchors_of(path):
    if path not in _anchor_cache:
        seen = {}
        anchors = set()
        for kind, _, text in scan(path):
            if kind == "heading":
                slug = heading_text_to_slug(text)
                count = seen.get(slug, 0)
                seen[slug] = count + 1
                anchors.add(slug if count == 0 else f"{slug}-{count}")
            elif kind == "anchor":
                anchors.add(text)
        _anchor_cache[path] = anchors
    return _anchor_cache[path]


def check(root):
    broken = []
    files = markdown_files(root)
    checked = 0
    for rel in files:
        path = os.path.join(root, rel)
        for kind, n, target in scan(path):
            if kind != "link":
                continue
            target = target.strip()
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1].strip()
            if not target or SCHEME.match(target) or target.startswith("//"):
                continue
            checked += 1
            file_part, _, fragment = target.partition("#")
            file_part = unquote(file_part.split("?", 1)[0])
            if file_part:
                if file_part.startswith("/"):
                    dest = os.path.normpath(os.path.join(root, file_part.lstrip("/")))
                else:
                    dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
                if not os.path.exists(dest):
                    broken.append(f"{rel}:{n}: {target} (no such file: {os.path.relpath(dest, root)})")
                    continue
                if not os.path.abspath(dest).startswith(os.path.abspath(root) + os.sep):
                    broken.append(f"{rel}:{n}: {target} (outside the repository)")
                    continue
            else:
                dest = path
            if fragment and dest.endswith(".md") and os.path.isfile(dest):
                frag = unquote(fragment)
                if frag not in anchors_of(dest) and frag.lower() not in anchors_of(dest):
                    broken.append(f"{rel}:{n}: {target} (no heading #{frag} in {os.path.relpath(dest, root)})")
    return files, checked, broken


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=None, help="repository root (default: this script's repository)")
    args = ap.parse_args()
    root = args.root or subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=os.path.dirname(os.path.abspath(__file__)),
        check=True, capture_output=True, text=True).stdout.strip()
    files, checked, broken = check(root)
    for b in broken:
        print(b)
    print(f"{len(files)} Markdown files, {checked} relative links, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    sys.exit(main())
