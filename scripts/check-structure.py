#!/usr/bin/env python3
"""Check the shape of the Rust code: import cycles between files, and the longest functions.

(a) Import cycles. For every crate of the workspace (each crate root: src/lib.rs, src/main.rs,
    src/bin/*.rs, the [[bin]] paths of its Cargo.toml, tests/*.rs, examples/*.rs, build.rs) the
    module tree is built from its `mod name;` declarations (`foo/mod.rs` is module foo, `#[path]`
    is honoured). Then every path of a file that names an item of its own crate is resolved to
    the file that defines it:
      - `use` declarations (`use crate::a::B;`, `use super::{x, y::Z};`, `use self::c::D;`, and
        paths relative to the module, `use child::E;`);
      - qualified paths in the code itself (`crate::run::now_ms()`, `super::Thing`, and
        `module::item` through a module the file imported or declared).
    Comments and string literals are ignored; paths to other crates are not followed. A name a module only imports (`pub use` or `use`)
    is followed to where it comes from, so a re-export is not mistaken for a definition.
    A file A *imports* a file B when A names an item defined in B. A parent declaring
    `mod child` is not an import, and neither is a module naming the items of the submodules it
    declares (a module and the files it is made of are one unit; `--strict` counts those too).
    A cycle is a set of files that import each other, directly or transitively (a strongly
    connected component of the import graph); the script prints each, its elementary cycles,
    and the lines that make each import. Uses inside `#[cfg(test)]` modules count, and an import
    made only there is marked "(test)" (`--ignore-test-uses` leaves those out).

(b) The longest functions: every `fn` item with a body, its length from the `fn` line to its
    closing brace (a brace-matching parser over the source with comments and strings blanked),
    the 15 longest (`--top N`) outside tests (`--include-tests` to count `tests/`, `#[cfg(test)]`
    modules and `#[test]` functions as well).

Exit status: 1 when an import cycle is found, unless `--report` is given; 0 otherwise.
Standard library only:  python3 scripts/check-structure.py [--report] [--strict] [--top N]
"""

import argparse
import os
import re
import subprocess
import sys
from collections import defaultdict

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
KEYWORD_ROOTS = {"crate", "super", "self"}


# ---------------------------------------------------------------- lexing


def blank_comments_and_strings(src):
    """The source with comments, string and char literals replaced by spaces (newlines kept),
    so that offsets and line numbers stay those of the file."""
    out = list(src)
    n = len(src)
    i = 0

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        if c == "/" and i + 1 < n and src[i + 1] == "/":
            j = src.find("\n", i)
            j = n if j == -1 else j
            blank(i, j)
            i = j
        elif c == "/" and i + 1 < n and src[i + 1] == "*":
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif c in "rb" and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'(?:br|rb|r|b|c|cr)(#*)"', src[i:i + 300])
            if m and "r" in m.group(0):
                hashes = m.group(1)
                end = src.find('"' + hashes, i + len(m.group(0)))
                end = n if end == -1 else end + 1 + len(hashes)
                blank(i, end)
                i = end
            elif m:  # b"..."
                j = i + len(m.group(0))
                while j < n and src[j] != '"':
                    j += 2 if src[j] == "\\" else 1
                blank(i, j + 1)
                i = j + 1
            elif src.startswith("b'", i):
                j = i + 2
                while j < n and src[j] != "'":
                    j += 2 if src[j] == "\\" else 1
                blank(i, j + 1)
                i = j + 1
            else:
                i += 1
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
        elif c == "'":
            if i + 1 < n and src[i + 1] == "\\":
                j = i + 2
                while j < n and src[j] != "'":
                    j += 2 if src[j] == "\\" else 1
                blank(i, j + 1)
                i = j + 1
            elif i + 2 < n and src[i + 2] == "'":
                blank(i, i + 3)
                i += 3
            else:
                i += 1  # a lifetime or a label
        else:
            i += 1
    return "".join(out)


def line_of(text, offset, _cache={}):
    """1-based line number of offset in text."""
    import bisect
    starts = _cache.get(id(text))
    if starts is None or starts[0] is not text:
        starts = (text, [0] + [m.end() for m in re.finditer("\n", text)])
        _cache[id(text)] = starts
    return bisect.bisect_right(starts[1], offset)


def matching_brace(text, open_at):
    """Offset of the `}` closing the `{` at open_at (text already blanked)."""
    depth = 0
    for k in range(open_at, len(text)):
        ch = text[k]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(text) - 1


def attributes_before(text, offset):
    """The attribute text (`#[...]` lines) directly before offset."""
    k = offset
    attrs = []
    while True:
        head = text[:k].rstrip()
        m = re.search(r"#!?\[[^\[\]]*(?:\[[^\[\]]*\][^\[\]]*)*\]\s*$", head)
        if not m:
            m2 = re.search(r"\b(?:pub(?:\s*\([^)]*\))?|unsafe|async|const|extern\s*(?:\"[^\"]*\")?)\s*$", head)
            if m2:
                k = m2.start()
                continue
            break
        attrs.append(m.group(0))
        k = m.start()
    return " ".join(attrs)


# ---------------------------------------------------------------- one file


class RustFile:
    def __init__(self, path, rel):
        self.path = path
        self.rel = rel
        with open(path, encoding="utf-8") as f:
            self.src = f.read()
        self.text = blank_comments_and_strings(self.src)
        # inline modules: (start, end, name, is_test)
        self.inline_mods = []
        # file modules declared here: (offset, name, inline_path, path_attr, is_test)
        self.mod_decls = []
        for m in re.finditer(r"(?<![\w:])mod\s+(" + IDENT + r")\s*([;{])", self.text):
            attrs = attributes_before(self.text, m.start())
            is_test = bool(re.search(r"cfg\s*\(\s*test\s*\)", attrs))
            if m.group(2) == "{":
                open_at = m.end() - 1
                self.inline_mods.append((open_at, matching_brace(self.text, open_at), m.group(1), is_test))
            else:
                pa = re.search(r'path\s*=\s*"([^"]*)"', self.src[max(0, m.start() - 300):m.start()])
                self.mod_decls.append((m.start(), m.group(1), None, pa.group(1) if pa else None, is_test))
        self.mod_decls = [(o, name, self.inline_path_at(o), pa, t or self.in_test(o))
                          for (o, name, _, pa, t) in self.mod_decls]

    def inline_path_at(self, offset):
        return tuple(name for (s, e, name, _) in sorted(self.inline_mods) if s < offset < e)

    def in_test(self, offset):
        return any(t and s < offset < e for (s, e, _, t) in self.inline_mods)

    def use_trees(self):
        """(offset, [segments...], bound name) for every path a `use` declaration brings in
        ('*' for globs, None for `as _`)."""
        if not hasattr(self, "_uses"):
            self._uses = list(self._use_trees())
        return self._uses

    def _use_trees(self):
        for m in re.finditer(r"(?<![\w:])use\s+(?!<)([^;]+);", self.text):
            body = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", m.group(1).strip())
            body = re.sub(r"\s+", " ", body)
            body = re.sub(r"^::", "", body)
            for path, bound in expand_use_tree(body):
                yield m.start(), path, bound

    def qualified_paths(self):
        """(offset, [segments]) of paths written in the code (not in `use` declarations)."""
        use_spans = [(m.start(), m.end()) for m in re.finditer(r"(?<![\w:])use\s+(?!<)[^;]+;", self.text)]
        for m in re.finditer(r"(?<![\w:$])(" + IDENT + r"(?:\s*::\s*" + IDENT + r")+)", self.text):
            if any(s <= m.start() < e for s, e in use_spans):
                continue
            segs = [s.strip() for s in m.group(1).split("::")]
            yield m.start(), segs


def expand_use_tree(body, prefix=()):
    """`a::{b, c::{self, d as e}, f::*}` -> [(['a','b'], 'b'), (['a','c'], 'c'),
    (['a','c','d'], 'e'), (['a','f'], '*')]: each path and the name it binds."""
    out = []
    depth, start, parts = 0, 0, []
    for k, ch in enumerate(body):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[start:k])
            start = k + 1
    parts.append(body[start:])
    for part in parts:
        part = part.strip()
        if not part:
            continue
        brace = part.find("{")
        if brace != -1:
            head = part[:brace].strip().rstrip(":")
            inner = part[brace + 1:part.rfind("}")]
            out += expand_use_tree(inner, prefix + tuple(s for s in head.split("::") if s))
            continue
        alias = None
        m = re.match(r"^(.*?)\s+as\s+(" + IDENT + r")$", part)
        if m:
            part, alias = m.group(1), m.group(2)
        segs = [s.strip() for s in part.split("::") if s.strip()]
        if not segs:
            continue
        if segs[-1] == "*":
            out.append((list(prefix) + segs[:-1], "*"))
            continue
        if segs[-1] == "self":
            segs = segs[:-1]
        path = list(prefix) + segs
        if not path:
            continue
        bound = alias or path[-1]
        out.append((path, None if bound == "_" else bound))
    return out


# ---------------------------------------------------------------- one crate


class Crate:
    def __init__(self, name, root_file, repo):
        self.name = name
        self.repo = repo
        self.root_rel = os.path.relpath(root_file, repo)
        self.modules = {}  # module path (tuple) -> RustFile
        self.files = {}  # rel -> RustFile
        self.file_module = {}  # rel -> module path of the file
        self.test_modules = set()
        self._load(root_file, (), is_root=True, is_test=False)

    def _load(self, path, modpath, is_root, is_test):
        rel = os.path.relpath(path, self.repo)
        if rel in self.files:
            return
        rf = RustFile(path, rel)
        self.files[rel] = rf
        self.file_module[rel] = modpath
        self.modules[modpath] = rf
        if is_test:
            self.test_modules.add(modpath)
        for (s, e, name, t) in rf.inline_mods:
            inner = modpath + rf.inline_path_at(s) + (name,)
            self.modules.setdefault(inner, rf)
            if t or is_test:
                self.test_modules.add(inner)
        base = os.path.basename(path)
        here = os.path.dirname(path)
        if not (is_root or base == "mod.rs"):
            here = os.path.join(here, os.path.splitext(base)[0])
        for (offset, name, inline_path, path_attr, t) in rf.mod_decls:
            d = os.path.join(here, *inline_path)
            if path_attr:
                cands = [os.path.join(os.path.dirname(path) if not inline_path else d, path_attr)]
            else:
                cands = [os.path.join(d, name + ".rs"), os.path.join(d, name, "mod.rs")]
            for c in cands:
                if os.path.isfile(c):
                    self._load(c, modpath + inline_path + (name,), False, is_test or t)
                    break

    # -- resolution

    def imports_of(self, modpath):
        """name -> segments for the `use` declarations written directly in modpath."""
        cache = self.__dict__.setdefault("_imports", {})
        if modpath not in cache:
            cache[modpath] = self._imports_of(modpath)
        return cache[modpath]

    def _imports_of(self, modpath):
        rf = self.modules.get(modpath)
        if rf is None:
            return {}
        base = self.file_module[rf.rel]
        out = {}
        for offset, segs, bound in rf.use_trees():
            if base + rf.inline_path_at(offset) != modpath:
                continue
            if bound and bound != "*":
                out.setdefault(bound, segs)
        return out

    def absolute(self, segs, modpath):
        """Segments of a path written in module modpath -> an absolute module path in this
        crate plus the remaining segments, or None when the path leaves the crate."""
        if not segs:
            return None
        head = segs[0]
        if head == "crate":
            cur, rest = (), segs[1:]
        elif head in ("super", "self"):
            cur, rest = modpath, list(segs)
            while rest and rest[0] in ("super", "self"):
                if rest[0] == "super":
                    if not cur:
                        return None
                    cur = cur[:-1]
                rest = rest[1:]
        elif modpath + (head,) in self.modules:
            cur, rest = modpath, list(segs)
        else:
            # a name the module imported (`use crate::zoo;` then `zoo::resolve`)
            imported = self.imports_of(modpath).get(head)
            if imported is None or imported[0] not in KEYWORD_ROOTS and modpath + (imported[0],) not in self.modules:
                return None
            resolved = self.absolute(imported, modpath)
            if resolved is None:
                return None
            cur, rest0 = resolved
            rest = rest0 + list(segs[1:])
        return cur, list(rest)

    def defining_module(self, segs, modpath, seen=None):
        """The module (path) that defines the item a path names, following imports."""
        r = self.absolute(segs, modpath)
        if r is None:
            return None
        cur, rest = r
        while rest and cur + (rest[0],) in self.modules:
            cur = cur + (rest[0],)
            rest = rest[1:]
        if rest:
            seen = seen or set()
            key = (cur, rest[0])
            if key not in seen:
                seen.add(key)
                imported = self.imports_of(cur).get(rest[0])
                if imported is not None:
                    deeper = self.defining_module(imported + rest[1:], cur, seen)
                    if deeper is not None:
                        return deeper
        return cur

    def edges(self, strict):
        """(from_rel, to_rel, line, text, is_test) for every import between two files."""
        out = []
        for rel, rf in self.files.items():
            base = self.file_module[rel]
            refs = [(o, segs, "use") for o, segs, _ in rf.use_trees()]
            refs += [(o, segs, "path") for o, segs in rf.qualified_paths()]
            for offset, segs, kind in refs:
                if not segs:
                    continue
                modpath = base + rf.inline_path_at(offset)
                if kind == "path" and segs[0] not in KEYWORD_ROOTS and modpath + (segs[0],) not in self.modules:
                    imported = self.imports_of(modpath).get(segs[0])
                    if imported is None or not self._is_module_path(imported, modpath):
                        continue
                target = self.defining_module(segs, modpath)
                if target is None:
                    continue
                trf = self.modules.get(target)
                if trf is None or trf.rel == rel:
                    continue
                tmod = self.file_module[trf.rel]
                if not strict and tmod[:len(base)] == base and len(tmod) > len(base):
                    continue  # a module naming the items of its own submodules
                is_test = modpath in self.test_modules or any(
                    modpath[:k] in self.test_modules for k in range(len(modpath) + 1))
                line = line_of(rf.text, offset)
                snippet = "::".join(segs)
                out.append((rel, trf.rel, line, snippet, is_test))
        return out

    def _is_module_path(self, segs, modpath):
        r = self.absolute(segs, modpath)
        if r is None:
            return False
        cur, rest = r
        while rest and cur + (rest[0],) in self.modules:
            cur, rest = cur + (rest[0],), rest[1:]
        return not rest


# ---------------------------------------------------------------- workspace


def crate_roots(repo):
    """(crate name, root file) for every crate target of the workspace."""
    roots = []
    manifests = []
    with open(os.path.join(repo, "Cargo.toml"), encoding="utf-8") as f:
        workspace = f.read()
    members = re.search(r"^\s*members\s*=\s*\[(.*?)\]", workspace, re.S | re.M)
    if members:  # the workspace's members (globs are expanded by their directory)
        import glob
        for pattern in re.findall(r'"([^"]+)"', members.group(1)):
            for d in sorted(glob.glob(os.path.join(repo, pattern))):
                if os.path.isfile(os.path.join(d, "Cargo.toml")):
                    manifests.append(d)
    if "[package]" in workspace:
        manifests.append(repo)
    if not manifests:
        for dirpath, dirnames, filenames in os.walk(repo):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")
                           and not (dirpath == repo and d in ("target", "shared"))]
            if "Cargo.toml" in filenames:
                manifests.append(dirpath)
    for d in sorted(manifests):
        with open(os.path.join(d, "Cargo.toml"), encoding="utf-8") as f:
            toml = f.read()
        if "[package]" not in toml:
            continue
        name = re.search(r'^\s*name\s*=\s*"([^"]+)"', toml, re.M).group(1)
        cands = [("lib", "src/lib.rs"), ("main", "src/main.rs"), ("build", "build.rs")]
        for m in re.finditer(r'\[\[(?:bin|example|test|bench)\]\][^\[]*?path\s*=\s*"([^"]+)"', toml, re.S):
            cands.append(("bin", m.group(1)))
        for sub in ("src/bin", "tests", "examples", "benches"):
            p = os.path.join(d, sub)
            if os.path.isdir(p):
                for fn in sorted(os.listdir(p)):
                    if fn.endswith(".rs"):
                        cands.append((sub, os.path.join(sub, fn)))
                    elif os.path.isfile(os.path.join(p, fn, "main.rs")):
                        cands.append((sub, os.path.join(sub, fn, "main.rs")))
        seen = set()
        for kind, relpath in cands:
            path = os.path.normpath(os.path.join(d, relpath))
            if os.path.isfile(path) and path not in seen:
                seen.add(path)
                roots.append((f"{name} ({relpath})", path))
    return roots


def tarjan(nodes, graph):
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def elementary_cycles(comp, graph, limit=50):
    """Simple cycles inside one component (each once, starting at its smallest file)."""
    comp = sorted(comp)
    members = set(comp)
    cycles = []
    for start in comp:
        allowed = {v for v in members if v >= start}
        path = [start]

        def dfs(v):
            for w in sorted(graph.get(v, ())):
                if w not in allowed:
                    continue
                if w == start:
                    cycles.append(list(path))
                    if len(cycles) >= limit:
                        return True
                elif w not in path:
                    path.append(w)
                    if dfs(w):
                        return True
                    path.pop()
            return False

        if dfs(start):
            break
    return cycles


def longest_functions(files, test_files, include_tests):
    """(lines, rel, line, name) of every fn item with a body."""
    out = []
    for rel, rf in files.items():
        if not include_tests and (rel in test_files or "/tests/" in "/" + rel.replace(os.sep, "/")):
            continue
        text = rf.text
        for m in re.finditer(r"(?<![\w])fn\s+(" + IDENT + r")", text):
            if not include_tests and rf.in_test(m.start()):
                continue
            if not include_tests and re.search(r"#\[(?:\w+::)*test\b", attributes_before(text, m.start())):
                continue
            depth_paren = 0
            k = m.end()
            body_at = None
            while k < len(text):
                ch = text[k]
                if ch in "([":
                    depth_paren += 1
                elif ch in ")]":
                    depth_paren -= 1
                elif ch == ";" and depth_paren == 0:
                    break
                elif ch == "{" and depth_paren == 0:
                    body_at = k
                    break
                k += 1
            if body_at is None:
                continue
            end = matching_brace(text, body_at)
            first, last = line_of(text, m.start()), line_of(text, end)
            out.append((last - first + 1, rel, first, m.group(1)))
    out.sort(key=lambda t: (-t[0], t[1], t[2]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", action="store_true", help="print everything, exit 0 even with cycles")
    ap.add_argument("--strict", action="store_true",
                    help="also count a module naming the items of its own submodules as an import")
    ap.add_argument("--top", type=int, default=15, help="how many of the longest functions to list")
    ap.add_argument("--include-tests", action="store_true", help="count test code among the longest functions")
    ap.add_argument("--ignore-test-uses", action="store_true",
                    help="leave out imports made only inside #[cfg(test)] modules")
    ap.add_argument("--edges", action="store_true", help="print every import edge of the workspace")
    ap.add_argument("--root", default=None, help="repository root (default: this script's repository)")
    args = ap.parse_args()
    repo = args.root or subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=os.path.dirname(os.path.abspath(__file__)),
        check=True, capture_output=True, text=True).stdout.strip()

    crates = [Crate(name, root, repo) for name, root in crate_roots(repo)]
    graph = defaultdict(set)
    evidence = defaultdict(list)
    all_files = {}
    test_files = set()
    for c in crates:
        for rel, rf in c.files.items():
            all_files.setdefault(rel, rf)
            if c.file_module[rel] in c.test_modules:
                test_files.add(rel)
        for a, b, line, snippet, is_test in c.edges(args.strict):
            if is_test and args.ignore_test_uses:
                continue
            graph[a].add(b)
            evidence[(a, b)].append((line, snippet, is_test))

    if args.edges:
        for (a, b), ev in sorted(evidence.items()):
            print(f"{a} -> {b}: " + ", ".join(f"{l} {s}" for l, s, _ in sorted(set(ev))[:3]))

    comps = [c for c in tarjan(set(graph) | {b for s in graph.values() for b in s}, graph) if len(c) > 1]
    print(f"Import cycles between files ({len(all_files)} files in {len(crates)} crate targets): {len(comps)}")
    for i, comp in enumerate(comps, 1):
        print(f"\n{i}. {len(comp)} files: " + ", ".join(comp))
        cycles = elementary_cycles(comp, graph)
        for cyc in cycles:
            print("   cycle: " + " -> ".join(cyc + [cyc[0]]))
        print("   imports:")
        for a in comp:
            for b in sorted(graph[a]):
                if b in comp:
                    ev = sorted(set(evidence[(a, b)]))
                    test_only = all(t for _, _, t in ev)
                    where = ", ".join(f"{a}:{l} {s}" for l, s, _ in ev[:4])
                    more = f" (+{len(ev) - 4} more)" if len(ev) > 4 else ""
                    print(f"     {a} -> {b}{' (test)' if test_only else ''}: {where}{more}")

    funcs = longest_functions(all_files, test_files, args.include_tests)
    print(f"\nThe {args.top} longest functions{' (tests included)' if args.include_tests else ' (outside tests)'}:")
    for lines, rel, line, name in funcs[:args.top]:
        print(f"  {lines:5d} lines  {rel}:{line}  {name}")

    if comps and not args.report:
        return 1
    return 0


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    sys.exit(main())
